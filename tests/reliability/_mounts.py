"""Mounts for the reliability tests: a size-limited tmpfs, bindfs, faultfs, and an
ext4 file system on a loop device whose power can be cut (:func:`ext4_loop`).

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


# EXT4_IOC_SHUTDOWN (_IOR('X', 125, __u32)) with EXT4_GOING_FLAGS_NOLOGFLUSH: the file
# system stops at once, its journal not flushed and no dirty page written: what the
# disk holds is what a power loss at that instant would leave (xfstests' "godown").
_EXT4_IOC_SHUTDOWN = 0x8004587D
_NOLOGFLUSH = 2


@functools.cache
def ext4_loop_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount a loop device"
    for tool in ("mkfs.ext4", "mount", "umount"):
        if not shutil.which(tool):
            return f"needs {tool}"
    with tempfile.TemporaryDirectory(prefix="fsstore-probe-") as d:
        try:
            with ext4_loop(d) as mnt:
                cut_power(mnt)
        except (AssertionError, OSError) as exc:
            return f"cannot mount ext4 on a loop device and cut its power here: {exc}"
    return None


@contextlib.contextmanager
def ext4_loop(base: str | os.PathLike[str], *, size_mb: int = 64) -> Iterator[str]:
    """A fresh ext4 on a loop device (image ``base/ext4.img``) mounted at ``base/mnt``,
    with a 1 s journal commit interval (so a test waits 2 s, not 6, for the journal to
    carry what it did); unmounted on the way out. :func:`cut_power` and :func:`remount`."""
    img, mnt = os.path.join(base, "ext4.img"), os.path.join(base, "mnt")
    os.makedirs(mnt, exist_ok=True)
    with open(img, "wb") as f:
        f.truncate(size_mb << 20)
    r = _run("mkfs.ext4", "-q", "-F", img)
    assert r.returncode == 0, r.stderr
    remount(mnt, img)
    try:
        yield mnt
    finally:
        unmount(mnt)
        with contextlib.suppress(OSError):
            os.unlink(img)


def remount(mnt: str, img: str | None = None) -> None:
    """(Re)mount the loop image at ``mnt``: after :func:`cut_power`, the journal's replay
    gives what a reboot would find."""
    img = img or os.path.join(os.path.dirname(mnt), "ext4.img")
    unmount(mnt)
    r = _run("mount", "-o", "loop,commit=1", img, mnt)
    assert r.returncode == 0, r.stderr
    MOUNTED.append(mnt)


def cut_power(mnt: str) -> None:
    """Stop the file system at ``mnt`` as a power loss would, at this instant."""
    import fcntl
    import struct

    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _NOLOGFLUSH))
    finally:
        os.close(fd)


def sync_fs(path: str) -> None:
    """Write back everything of the file system at ``path`` (``syncfs``, not ``sync``:
    never waits on another test's FUSE mount)."""
    r = _run("sync", "-f", path, timeout=60)
    assert r.returncode == 0, r.stderr


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
