"""Mounts for the reliability tests: a size-limited tmpfs, bindfs, and faultfs.

Every mount is a context manager that unmounts on the way out, whatever happened
inside; :data:`MOUNTED` is a last-resort list the conftest unmounts at session end.
Capability probes return ``None`` when a mount kind works here, else the reason to
skip (root, /dev/fuse, the binaries; ``.ci/run`` installs fuse3, bindfs, libfuse).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MOUNTED: list[str] = []


def _run(*cmd: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def unmount(path: str) -> None:
    """Unmount ``path`` (FUSE or not); lazily if it is busy."""
    if not os.path.ismount(path):
        if path in MOUNTED:
            MOUNTED.remove(path)
        return
    for cmd in (("fusermount3", "-u", path), ("fusermount", "-u", path), ("umount", path)):
        if shutil.which(cmd[0]) and _run(*cmd).returncode == 0 and not os.path.ismount(path):
            break
    else:
        _run("umount", "-l", path)
    if path in MOUNTED and not os.path.ismount(path):
        MOUNTED.remove(path)


@functools.cache
def tmpfs_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount a size-limited tmpfs"
    if not shutil.which("mount"):
        return "needs mount(8)"
    d = tempfile.mkdtemp(prefix="fsstore-probe-")
    try:
        r = _run("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d)
        if r.returncode != 0:
            return f"cannot mount tmpfs here: {r.stderr.strip()}"
        unmount(d)
        return None
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(d)


@contextlib.contextmanager
def tmpfs(path: str | os.PathLike[str], options: str) -> Iterator[str]:
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    r = _run("mount", "-t", "tmpfs", "-o", options, "tmpfs", path)
    assert r.returncode == 0, r.stderr
    MOUNTED.append(path)
    try:
        yield path
    finally:
        unmount(path)


def _fuse_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root for FUSE mounts"
    if not os.path.exists("/dev/fuse"):
        return "needs /dev/fuse"
    return None


@functools.cache
def bindfs_unavailable() -> str | None:
    if reason := _fuse_missing():
        return reason
    if not shutil.which("bindfs"):
        return "needs bindfs (apt-get install bindfs fuse3; .ci/run installs it)"
    src = tempfile.mkdtemp(prefix="fsstore-probe-src-")
    mnt = tempfile.mkdtemp(prefix="fsstore-probe-mnt-")
    try:
        r = _run("bindfs", src, mnt)
        if r.returncode != 0:
            return f"bindfs cannot mount here: {r.stderr.strip()}"
        unmount(mnt)
        return None
    finally:
        for d in (mnt, src):
            with contextlib.suppress(OSError):
                os.rmdir(d)


@contextlib.contextmanager
def bindfs(src: str | os.PathLike[str], mnt: str | os.PathLike[str]) -> Iterator[str]:
    src, mnt = os.fspath(src), os.fspath(mnt)
    os.makedirs(src, exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    r = _run("bindfs", src, mnt)
    assert r.returncode == 0, r.stderr
    MOUNTED.append(mnt)
    try:
        yield mnt
    finally:
        unmount(mnt)


@functools.cache
def faultfs_unavailable() -> str | None:
    if reason := _fuse_missing():
        return reason
    try:
        r = _run(sys.executable, "-c", "import mfusepy")
    except OSError as exc:  # pragma: no cover
        return f"cannot run python: {exc}"
    if r.returncode != 0:
        return "needs mfusepy and libfuse (pip install mfusepy; apt-get install libfuse2 or libfuse3-3)"
    return None


class FaultFs:
    """A running faultfs mount and its control file (see faultfs.py for the rules)."""

    def __init__(self, backing: str, mountpoint: str, control: str, log: str, proc: subprocess.Popen[bytes]) -> None:
        self.backing = backing
        self.mountpoint = mountpoint
        self.control = control
        self.log = log
        self.proc = proc
        self.total_injected = 0

    def set(self, *rules: dict[str, Any]) -> None:
        doc = {"rules": list(rules)}
        tmp = f"{self.control}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
        os.replace(tmp, self.control)  # a new inode: faultfs notices at its next call

    def clear(self) -> None:
        self.set()

    def injected(self) -> list[str]:
        try:
            with open(self.log, encoding="utf-8") as fh:
                return fh.read().splitlines()
        except FileNotFoundError:
            return []

    def take_injected(self) -> list[str]:
        """The faults injected since the last call (and count them)."""
        lines = self.injected()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log)
        self.total_injected += len(lines)
        return lines


@contextlib.contextmanager
def faultfs(base: str | os.PathLike[str], *, threads: bool = False) -> Iterator[FaultFs]:
    base = os.fspath(base)
    backing, mnt = f"{base}/backing", f"{base}/mnt"
    control, log = f"{base}/control.json", f"{base}/faults.log"
    os.makedirs(backing, exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    with open(control, "w", encoding="utf-8") as fh:
        json.dump({"rules": []}, fh)
    errlog = open(f"{base}/faultfs.stderr", "wb")  # noqa: SIM115 - closed below
    cmd = [sys.executable, str(HERE / "faultfs.py"), backing, mnt, control, log]
    if threads:
        cmd.append("--threads")
    proc = subprocess.Popen(cmd, stdout=errlog, stderr=subprocess.STDOUT)
    MOUNTED.append(mnt)
    try:
        deadline = time.monotonic() + 15
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                errlog.flush()
                raise RuntimeError(
                    f"faultfs did not mount (exit {proc.poll()}): "
                    + Path(f"{base}/faultfs.stderr").read_text(errors="replace")[-2000:]
                )
            time.sleep(0.02)
        yield FaultFs(backing, mnt, control, log, proc)
    finally:
        unmount(mnt)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        errlog.close()


@functools.cache
def unshare_uts_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for unshare --uts"
    if not shutil.which("unshare"):
        return "needs unshare (util-linux)"
    r = _run("unshare", "--uts", "sh", "-c", "hostname fsstore-probe-host && hostname")
    if r.returncode != 0 or r.stdout.strip() != "fsstore-probe-host":
        return f"unshare --uts does not work here: {r.stderr.strip()}"
    return None
