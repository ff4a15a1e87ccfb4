"""Real network mounts, each mounted twice (two client caches = two hosts).

* :func:`gluster_pair`: ``glusterd`` (started here unless one runs already), a
  one-brick volume with default options on loopback, mounted twice with
  ``mount -t glusterfs 127.0.0.1:/VOL``.
* :func:`sshfs_pair`: a private ``sshd`` on a loopback port with a throwaway key
  (``internal-sftp``), one exported directory mounted twice with sshfs, with its
  its caches on (shortened to 4 s) or with every cache off.
* :func:`on_host`: the command line that runs a child process "on host 1" or "on
  host 2": its own UTS namespace with its own host name, so fsstore (and filelock)
  see another host, and a dead lock holder there is reclaimed by age only.

Everything is torn down on the way out of the context managers, whatever happened
inside; :data:`CLEANUPS` is the last resort the conftest runs at session end.
Probes return ``None`` where a kind of mount works here, else the reason to skip.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.reliability._mounts import _fuse_missing, _run, unmount, unshare_uts_unavailable
from tests.reliability._overlap import faketime_env

REPO = Path(__file__).resolve().parents[2]
CLEANUPS: list[Callable[[], None]] = []

#: the host names the two "hosts" run under (one UTS namespace each)
HOSTS = ("fsstore-host-1", "fsstore-host-2")


@dataclasses.dataclass(frozen=True)
class Pair:
    """One storage mounted twice: ``m1`` stands for host 1, ``m2`` for host 2."""

    kind: str  # "gluster", "sshfs", "sshfs-nocache"
    m1: Path
    m2: Path
    #: how long a mount may show another client's change late (its cache timeouts)
    cache_window: float
    volume: str | None = None
    #: sshfs: the exported directory, and how to mount it once more (port, key, options)
    export: Path | None = None
    sshfs_args: tuple[int, Path, str] | None = None

    def mount(self, host: int) -> Path:
        return self.m1 if host == 1 else self.m2

    def fresh(self, name: str) -> tuple[Path, Path]:
        """A new directory on the storage, as both hosts see it."""
        sub = f"{name}-{time.monotonic_ns()}"
        (self.m1 / sub).mkdir()
        deadline = time.monotonic() + self.cache_window + 5
        while not (self.m2 / sub).is_dir():  # a negative entry cached on m2 expires
            assert time.monotonic() < deadline, f"{sub} not visible on m2"
            time.sleep(0.2)
        return self.m1 / sub, self.m2 / sub


def on_host(host: int, *argv: str) -> list[str]:
    """``argv`` run with host name ``HOSTS[host - 1]`` in a UTS namespace of its own."""
    return ["unshare", "--uts", "sh", "-c", f'hostname {HOSTS[host - 1]} && exec "$@"', "sh", *argv]


def child(host: int, module: str, *args: str) -> list[str]:
    """``python -m module args`` on ``host`` (the repository on PYTHONPATH)."""
    return on_host(host, sys.executable, "-m", module, *args)


def child_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


def _common_missing() -> str | None:
    if reason := _fuse_missing():
        return reason
    return unshare_uts_unavailable()


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM a daemon we started, SIGKILL it if it does not go within 20 s."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _unmount_all(*paths: Path) -> None:
    for p in paths:
        unmount(str(p))
        if os.path.ismount(p):
            _run("umount", "-l", str(p))


# -- GlusterFS -------------------------------------------------------------------


@functools.cache
def gluster_unavailable() -> str | None:
    if reason := _common_missing():
        return reason
    for tool in ("glusterd", "gluster", "mount.glusterfs"):
        if not shutil.which(tool) and not os.path.exists(f"/usr/sbin/{tool}") and not os.path.exists(f"/sbin/{tool}"):
            return f"needs {tool} (apt-get install glusterfs-server glusterfs-client; .ci/run installs them)"
    return None


def _brick_host() -> str:
    """A name for 127.0.0.1 that gluster accepts as a brick host (not localhost)."""
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        addr = ""
    if addr != "127.0.0.1":
        with open("/etc/hosts", "a", encoding="utf-8") as fh:  # root: checked by the probe
            fh.write(f"\n127.0.0.1 {name}  # added by fsstore tests/network\n")
    return name


def _gluster(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return _run("gluster", "--mode=script", *args, timeout=timeout)


def _glusterd_running() -> bool:
    return _gluster("pool", "list", timeout=15).returncode == 0


@contextlib.contextmanager
def gluster_pair(base: Path, env: dict[str, str] | None = None) -> Iterator[Pair]:
    """A one-brick volume (default options) mounted at ``base/m1`` and ``base/m2``;
    ``env``: added to the clients' environment (benchmarks/network.py's round trip)."""
    started: subprocess.Popen[bytes] | None = None
    vol = f"fsstore{os.getpid()}"
    brick = Path(tempfile.mkdtemp(prefix="fsstore-brick-", dir="/var/tmp"))
    m1, m2 = base / "m1", base / "m2"
    m1.mkdir(parents=True, exist_ok=True)
    m2.mkdir(parents=True, exist_ok=True)
    created = False

    def teardown() -> None:
        nonlocal started, created
        _unmount_all(m1, m2)
        if created:
            _gluster("volume", "stop", vol, "force")
            _gluster("volume", "delete", vol)
            created = False
        if started is not None:
            _stop(started)
            started = None
        shutil.rmtree(brick, ignore_errors=True)

    CLEANUPS.append(teardown)
    try:
        host = _brick_host()
        if not _glusterd_running():
            log = open(base / "glusterd.log", "wb")  # noqa: SIM115 - the child keeps it
            started = subprocess.Popen(["glusterd", "--no-daemon"], stdout=log, stderr=subprocess.STDOUT)
            log.close()
            deadline = time.monotonic() + 30
            while not _glusterd_running():
                if started.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"glusterd did not start: {(base / 'glusterd.log').read_text()[-2000:]}")
                time.sleep(0.3)
        _remove_orphan_volumes()
        r = _gluster("volume", "create", vol, f"{host}:{brick}", "force")
        if r.returncode != 0:
            raise RuntimeError(f"gluster volume create: {r.stdout}{r.stderr}")
        created = True
        r = _gluster("volume", "start", vol)
        if r.returncode != 0:
            raise RuntimeError(f"gluster volume start: {r.stdout}{r.stderr}")
        for m in (m1, m2):
            _mount_gluster(vol, m, env)
        # default volume options: the client caches metadata for 1 s (md-cache)
        yield Pair("gluster", m1, m2, cache_window=2.0, volume=vol)
    finally:
        teardown()
        with contextlib.suppress(ValueError):
            CLEANUPS.remove(teardown)


def _remove_orphan_volumes() -> None:
    """Volumes an earlier run (fsstore<pid>, that pid gone) could not remove: killed
    before its teardown."""
    r = _gluster("volume", "list")
    for name in r.stdout.split():
        pid = name[len("fsstore"):]
        if name.startswith("fsstore") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _gluster("volume", "stop", name, "force")
            _gluster("volume", "delete", name)


def profile_start(vol: str) -> None:
    _gluster("volume", "profile", vol, "start")
    _gluster("volume", "profile", vol, "info", "clear")


def profile_stop(vol: str) -> None:
    _gluster("volume", "profile", vol, "stop")


def profile_ops(vol: str) -> dict[str, int]:
    """File operations the brick served since the last call, by kind (``info incremental``)."""
    r = _gluster("volume", "profile", vol, "info", "incremental")
    ops: dict[str, int] = {}
    in_interval = False
    for line in r.stdout.splitlines():
        if line.startswith("Interval") and "Stats" in line:
            in_interval = True
            continue
        if line.startswith("Cumulative Stats"):
            in_interval = False
        if not in_interval:
            continue
        cols = line.split()
        # %-latency  Avg  Min  Max  No.ofcalls  Fop
        if len(cols) >= 6 and cols[-2].isdigit() and cols[-1].isupper() and cols[-1] not in ("FOP",):
            ops[cols[-1]] = ops.get(cols[-1], 0) + int(cols[-2])
    return ops


# -- sshfs -----------------------------------------------------------------------

#: sshfs 3.7 with its caches on, as by default (names, listings and attributes kept
#: past another host's change) but for 4 s instead of the default 20 s, which keeps the
#: suite short: what a client shows late, and what fsstore does about it, is the same.
SSHFS_CACHED = "dcache_timeout=4,entry_timeout=4,attr_timeout=4"
SSHFS_CACHE_WINDOW = 5.0
#: sshfs 3.7 with every cache off (its own caches and the kernel's)
SSHFS_NOCACHE = "cache=no,dir_cache=no,attr_timeout=0,entry_timeout=0,negative_timeout=0"


@functools.cache
def sshfs_unavailable() -> str | None:
    if reason := _common_missing():
        return reason
    for tool in ("sshfs", "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"needs {tool} (apt-get install sshfs openssh-server; .ci/run installs them)"
    if not os.path.exists("/usr/sbin/sshd"):
        return "needs /usr/sbin/sshd (apt-get install openssh-server)"
    return None


@contextlib.contextmanager
def sshd(base: Path) -> Iterator[tuple[int, Path]]:
    """A private sshd on a free loopback port (internal-sftp only); yields (port, client key)."""
    base.mkdir(parents=True, exist_ok=True)
    for name in ("hostkey", "clientkey"):
        r = _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(base / name))
        assert r.returncode == 0, r.stderr
    shutil.copy(base / "clientkey.pub", base / "authorized_keys")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (base / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {base}/hostkey\n"
        f"AuthorizedKeysFile {base}/authorized_keys\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\n"
        f"PidFile {base}/sshd.pid\nSubsystem sftp internal-sftp\nMaxStartups 100\nMaxSessions 100\n"
    )
    os.makedirs("/run/sshd", exist_ok=True)  # privilege separation directory
    proc = subprocess.Popen(
        ["/usr/sbin/sshd", "-D", "-f", str(base / "sshd_config"), "-E", str(base / "sshd.log")]
    )

    def stop() -> None:
        _stop(proc)

    CLEANUPS.append(stop)
    try:
        deadline = time.monotonic() + 15
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                log = base / "sshd.log"
                raise RuntimeError(f"sshd did not start: {log.read_text() if log.exists() else ''}")
            time.sleep(0.1)
        yield port, base / "clientkey"
    finally:
        stop()
        with contextlib.suppress(ValueError):
            CLEANUPS.remove(stop)


def sshfs_mount(port: int, key: Path, export: Path, mnt: Path, options: str = "") -> None:
    mnt.mkdir(parents=True, exist_ok=True)
    opts = (
        f"IdentityFile={key},StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,"
        f"port={port},LogLevel=ERROR"
    )
    if options:
        opts += "," + options
    r = _run("sshfs", f"root@127.0.0.1:{export}", str(mnt), "-o", opts, timeout=30)
    if r.returncode != 0 or not os.path.ismount(mnt):
        raise RuntimeError(f"sshfs: {r.stdout}{r.stderr}")


class ThirdMount:
    """The sshfs export of a pair mounted once more, by an sshfs process of our own
    (foreground), so that the test can kill it: a host whose client died."""

    def __init__(self, pair: Pair, mnt: Path, options: str | None = None) -> None:
        assert pair.export is not None and pair.sshfs_args is not None
        port, key, pair_options = pair.sshfs_args
        options = pair_options if options is None else options
        mnt.mkdir(parents=True, exist_ok=True)
        opts = (f"IdentityFile={key},StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,"
                f"port={port},LogLevel=ERROR" + ("," + options if options else ""))
        self.mnt = mnt
        self.proc = subprocess.Popen(["sshfs", "-f", f"root@127.0.0.1:{pair.export}", str(mnt), "-o", opts],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not os.path.ismount(mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("sshfs (third mount) did not mount")
            time.sleep(0.05)

    def crash(self) -> None:
        """kill -9 the client: nothing it hid is ever removed (then detach the mount)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        # a dead FUSE mount answers ENOTCONN, so os.path.ismount says False: detach it anyway
        for cmd in (("fusermount3", "-u", "-z"), ("umount", "-l")):
            if str(self.mnt) not in Path("/proc/mounts").read_text():
                break
            _run(*cmd, str(self.mnt))

    def close(self) -> None:
        self.crash()


def _mount_gluster(vol: str, mnt: Path, env: dict[str, str] | None = None) -> None:
    """Mount the volume at ``mnt``, trying for ~10 s (a brick takes a moment to listen;
    a loaded machine's mount can fail once). With ``env``, by mount.glusterfs itself:
    mount(8) drops ``LD_*`` variables."""
    for _attempt in range(20):
        if env is None:
            r = _run("mount", "-t", "glusterfs", f"127.0.0.1:/{vol}", str(mnt), timeout=60)
        else:
            r = subprocess.run(["mount.glusterfs", f"127.0.0.1:/{vol}", str(mnt)], capture_output=True,
                               text=True, timeout=60, check=False, env={**os.environ, **env})
        if r.returncode == 0 and os.path.ismount(mnt):
            return
        time.sleep(0.5)
    raise RuntimeError(f"mount -t glusterfs: {r.stdout}{r.stderr}")


@contextlib.contextmanager
def third_mount(pair: Pair, mnt: Path, options: str | None = None) -> Iterator[ThirdMount | Path]:
    """The sshfs export (or the GlusterFS volume) of ``pair`` mounted once more (a third
    host); gone on exit. For GlusterFS, the mount point. ``options``: sshfs's, instead
    of the pair's."""
    if pair.volume is not None:
        mnt.mkdir(parents=True, exist_ok=True)

        def unmount() -> None:
            _unmount_all(mnt)

        CLEANUPS.append(unmount)
        try:
            _mount_gluster(pair.volume, mnt)
            yield mnt
        finally:
            unmount()
            with contextlib.suppress(ValueError):
                CLEANUPS.remove(unmount)
        return
    m = ThirdMount(pair, mnt, options)
    CLEANUPS.append(m.close)
    try:
        yield m
    finally:
        m.close()
        with contextlib.suppress(ValueError):
            CLEANUPS.remove(m.close)


@contextlib.contextmanager
def sshfs_pair(base: Path, port: int, key: Path, *, cached: bool) -> Iterator[Pair]:
    export = base / "export"
    export.mkdir(parents=True, exist_ok=True)
    m1, m2 = base / "m1", base / "m2"

    def teardown() -> None:
        _unmount_all(m1, m2)

    CLEANUPS.append(teardown)
    try:
        opts = SSHFS_CACHED if cached else SSHFS_NOCACHE
        for m in (m1, m2):
            sshfs_mount(port, key, export, m, opts)
        yield Pair("sshfs" if cached else "sshfs-nocache", m1, m2, cache_window=SSHFS_CACHE_WINDOW if cached else 1.0,
                   export=export, sshfs_args=(port, key, opts))
    finally:
        teardown()
        with contextlib.suppress(ValueError):
            CLEANUPS.remove(teardown)


def cleanup_all() -> None:
    for fn in reversed(list(CLEANUPS)):
        with contextlib.suppress(Exception):
            fn()
    CLEANUPS.clear()


# -- processes on hosts ----------------------------------------------------------


@dataclasses.dataclass
class Role:
    """One child process: ``role`` of tests/network/_host.py run on ``host`` with ``spec``."""

    host: int
    role: str
    spec: dict[str, object]
    skew: str | None = None  # its wall clock this far off (libfaketime: "-10m")


def run_roles(roles: list[Role], base: Path, *, timeout: float, stop_after: list[int] | None = None) -> list[dict[str, object]]:
    """Start every role, release them together, and collect their JSON reports.

    ``stop_after``: indexes of the roles whose end stops the others (writers: the
    readers run until the writers are done). Every child is killed on the way out.
    """
    import json

    start, stop = base / f"start-{time.monotonic_ns()}", base / f"stop-{time.monotonic_ns()}"
    procs = []
    try:
        for r in roles:
            spec = {"start": str(start), "stop": str(stop), **r.spec}
            procs.append(subprocess.Popen(
                child(r.host, "tests.network._host", r.role, json.dumps(spec)),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=child_env() if r.skew is None else {**faketime_env(r.skew), "PYTHONPATH": child_env()["PYTHONPATH"]},
            ))
        start.touch()
        deadline = time.monotonic() + timeout
        outs: list[dict[str, object] | None] = [None] * len(procs)
        first = stop_after if stop_after is not None else list(range(len(procs)))
        for order in (first, [i for i in range(len(procs)) if i not in first]):
            for i in order:
                left = max(1.0, deadline - time.monotonic())
                out, err = procs[i].communicate(timeout=left)
                lines = out.strip().splitlines()
                if not lines:
                    raise AssertionError(f"{roles[i].role} on host {roles[i].host} said nothing: {err[-3000:]}")
                outs[i] = json.loads(lines[-1])
                assert "error" not in outs[i], outs[i]["error"]  # type: ignore[operator]
            stop.touch()
        return [o for o in outs if o is not None]
    finally:
        stop.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        for f in (start, stop):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
