"""Real processes whose lock holds overlap: writers with skewed clocks or stalled
system calls, readers recording every snapshot, and the checks of format 2's promise.

Each writer appends batches ``<name>-<i>`` of ``PER_BATCH`` entries (uuids
``<name>-<i>-<j>``) and writes the name of each batch whose ``append`` returned to
its log file, so the check knows exactly what was acknowledged. Each reader writes
one line per load: the batch names of that snapshot, in order.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = str(Path(__file__).resolve().parents[2])
KEY = {"project_key": "-overlap", "session_id": "s"}
PER_BATCH = 3
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"

# A stalled child says "ready" once imported and waits for strace to attach (see
# start_stalled): its interpreter's start-up makes hundreds of the calls swept.
WAIT = """
if {stalled!r}:
    print("ready", flush=True)
    sys.stdin.readline()
"""

WRITER = """
import json, sys, time
sys.path.insert(0, {repo!r})
from fsstore._store import SyncStore
from fsstore import FsStoreError
{wait}
s = SyncStore({root!r}, create=True, **{opts!r})
key = {key!r}
with open({log!r}, "a") as log:
    for i in range({n}):
        name = "{name}-%d" % i
        try:
            s.append(key, [{{"uuid": "%s-%d" % (name, j), "b": name}} for j in range({per})])
        except FsStoreError as exc:
            print("failed", name, exc.code, file=sys.stderr, flush=True)
            continue
        log.write(name + "\\n")
        log.flush()
        time.sleep({pause})
"""

READER = """
import json, sys, time
sys.path.insert(0, {repo!r})
from fsstore._store import SyncStore
s = SyncStore({root!r}, create=True)
key = {key!r}
deadline = time.monotonic() + {seconds}
with open({log!r}, "a") as log:
    while time.monotonic() < deadline:
        got = s.load(key) or []
        names = []
        for e in got:
            if not names or names[-1] != e["b"]:
                names.append(e["b"])
        log.write(json.dumps(names) + "\\n")
        log.flush()
"""

COMPACTOR = """
import sys, time
sys.path.insert(0, {repo!r})
from fsstore._store import SyncStore
from fsstore import FsStoreError
{wait}
s = SyncStore({root!r}, create=True, **{opts!r})
deadline = time.monotonic() + {seconds}
while time.monotonic() < deadline:
    try:
        s.compact({key!r})
    except FsStoreError as exc:
        print("compact failed", exc.code, file=sys.stderr, flush=True)
    time.sleep(0.05)
"""


def faketime_unavailable() -> str | None:
    """Why a process with a skewed clock cannot be started here (None: it can)."""
    if not os.path.exists(FAKETIME_LIB):
        return "needs libfaketime (apt-get install faketime)"
    if _wallclock_shim() is None:
        return "needs a C compiler for the wall-clock shim (apt-get install gcc libc6-dev)"
    return None


def faketime_env(offset: str) -> dict[str, str]:
    """The environment of a process whose wall clock is ``offset`` off, its monotonic
    clock right (libfaketime, with tests/reliability/wallclock_shim.c preloaded before
    it; file times stay the storage's, as on NFS)."""
    shim = _wallclock_shim()
    assert shim is not None, faketime_unavailable()
    return {**os.environ, "LD_PRELOAD": f"{shim} {FAKETIME_LIB}", "FAKETIME": offset,
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_DONT_RESET": "1", "FAKETIME_NO_CACHE": "1"}


@functools.lru_cache(maxsize=1)
def _wallclock_shim() -> str | None:
    """tests/reliability/wallclock_shim.c built (once per run); None without a compiler."""
    src = Path(__file__).with_name("wallclock_shim.c")
    out = Path(tempfile.mkdtemp(prefix="fsstore-shim-")) / "wallclock_shim.so"
    try:
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(out), str(src), "-ldl"],
                       check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return str(out)


# (system call, delay in microseconds, strace's when=first+step or None for every call)
Stall = tuple[str, int, "str | None"]


def start_writer(root: Path, work: Path, name: str, n: int, opts: dict[str, Any], *,
                 stall: Stall | None = None, env: dict[str, str] | None = None,
                 pause: float = 0.0) -> subprocess.Popen[str]:
    code = WRITER.format(repo=REPO, root=str(root), opts=opts, key=KEY, log=str(work / f"{name}.acked"),
                         n=n, name=name, per=PER_BATCH, pause=pause, wait=WAIT.format(stalled=bool(stall)))
    return _start(code, work / f"{name}.err", stall, env)


def _start(code: str, err_path: Path, stall: Stall | None, env: dict[str, str] | None = None
           ) -> subprocess.Popen[str]:
    with open(err_path, "w") as err:  # the child keeps its own copy
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=err, text=True,
                                stdin=subprocess.PIPE if stall else None,
                                stdout=subprocess.PIPE if stall else None)
    if stall:
        _attach(proc, *stall)
    return proc


def start_reader(root: Path, work: Path, name: str, seconds: float) -> subprocess.Popen[str]:
    code = READER.format(repo=REPO, root=str(root), key=KEY, log=str(work / f"{name}.snaps"),
                         seconds=seconds)
    with open(work / f"{name}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-c", code], stderr=err, text=True)


def start_compactor(root: Path, work: Path, seconds: float, opts: dict[str, Any], *,
                    stall: Stall | None = None) -> subprocess.Popen[str]:
    code = COMPACTOR.format(repo=REPO, root=str(root), opts=opts, key=KEY, seconds=seconds,
                            wait=WAIT.format(stalled=bool(stall)))
    return _start(code, work / "compactor.err", stall)


_TRACERS: list[subprocess.Popen[bytes]] = []


def _attach(proc: subprocess.Popen[str], call: str, delay_us: int, when: str | None) -> None:
    """Once ``proc`` says it is ready, attach strace so that its calls ``call`` (those
    ``when`` picks; all if None) each take ``delay_us`` longer, then let it go on."""
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    inject = f"inject={call}:delay_enter={delay_us}" + (f":when={when}" if when else "")
    _TRACERS.append(subprocess.Popen(["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={call}",
                                      "-e", inject, "-p", str(proc.pid)]))
    deadline = time.monotonic() + 10
    while _tracer_pid(proc.pid) == 0:
        assert time.monotonic() < deadline, "strace did not attach"
        time.sleep(0.02)
    proc.stdin.write("go\n")
    proc.stdin.flush()


PRUNER = """
import sys
sys.path.insert(0, {repo!r})
from fsstore.cli import main
{wait}
sys.exit(main(["prune", {root!r}, "--older-than", "30d", "--stale-lock-seconds", "1s"]))
"""


def run_stalled_prune(root: Path, call: str, delay_us: int, during: Any) -> str:
    """``fsstore prune ROOT`` (sessions older than 30 days) with every ``call`` it makes
    once running delayed by ``delay_us`` (strace attached after its imports), while
    ``during()`` runs; returns prune's output."""
    # LANGUAGE=C: argparse asks gettext for each of its ~36 messages, and gettext looks
    # for 4 translation files each time (~144 stats, 2 minutes with newfstatat delayed).
    prune = subprocess.Popen([sys.executable, "-c", PRUNER.format(repo=REPO, root=str(root), wait=WAIT.format(stalled=True))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "LANGUAGE": "C"})
    try:
        _attach(prune, call, delay_us, None)
        during()
        out, _ = prune.communicate(timeout=120)
        return out
    finally:
        if prune.poll() is None:
            prune.kill()
            prune.wait(10)


def stop_at_random(procs: list[subprocess.Popen[str]], *, stop_for: float, gap: tuple[float, float],
                   seed: int) -> Callable[[], int]:
    """In a thread: SIGSTOP one of ``procs`` (at random) for ``stop_for`` seconds, at
    random instants ``gap`` apart, until they have all exited. Returns a function
    that waits for the thread and gives the number of stops."""
    rng = random.Random(seed)
    stops = [0]

    def run() -> None:
        while True:
            time.sleep(rng.uniform(*gap))
            alive = [p for p in procs if p.poll() is None]
            if not alive:
                return
            victim = rng.choice(alive)
            try:
                os.kill(victim.pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            stops[0] += 1
            time.sleep(stop_for)
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def done() -> int:
        thread.join(stop_for + gap[1] + 5)
        return stops[0]

    return done


def old_session(root: Path) -> None:
    """A store at ``root`` whose one session (KEY, batch "old") is 40 days old."""
    from fsstore._store import SyncStore

    SyncStore(root, create=True).append(KEY, [{"uuid": "old", "b": "old"}])
    ancient = time.time() - 40 * 86400
    for p in [*root.rglob("*")]:
        if "projects" in p.parts:
            os.utime(p, (ancient, ancient), follow_symlinks=False)


def prune_stopped_once(prune_root: Path, writer_root: Path, rng: random.Random, *, settle: float = 0.0) -> int:
    """``fsstore prune --older-than 30d`` on ``prune_root`` (made by :func:`old_session`),
    SIGSTOPped at a random instant of its run for about 1.5 s (past its lease) while a
    writer appends through ``writer_root`` (the same store, maybe another mount).
    Asserts every batch whose append returned is there afterwards (``settle`` seconds
    later: a client cache's window); returns how many."""
    from fsstore import FsStoreError
    from fsstore._store import SyncStore

    writer = SyncStore(writer_root, create=True, stale_lock_seconds=1.0, lock_timeout_seconds=30)
    prune = subprocess.Popen(
        [sys.executable, "-m", "fsstore", "prune", str(prune_root), "--older-than", "30d",
         "--stale-lock-seconds", "1s"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    acked = []

    def append(b: str) -> None:
        # The writer's own lease is 0.5 s: on a loaded machine (a GlusterFS round trip
        # slowed by the CPU) its hold can outlast it, and it gives up with LOCK_EXPIRED,
        # which publishes nothing and is retryable. It tries again, as an application
        # would; what is checked is the batches whose append returned.
        for attempt in range(5):
            try:
                writer.append(KEY, [{"uuid": b, "b": b}])
                break
            except FsStoreError as exc:
                if exc.code != "LOCK_EXPIRED" or attempt == 4:
                    raise
        acked.append(b)

    try:
        time.sleep(rng.uniform(0.15, 0.45))  # somewhere in its walk, mark, last look or move
        os.kill(prune.pid, signal.SIGSTOP)
        for i in range(3):
            append(f"new-{i}")
            time.sleep(0.5)
        os.kill(prune.pid, signal.SIGCONT)
        out, _ = prune.communicate(timeout=60)
    finally:
        if prune.poll() is None:
            prune.kill()
        prune.wait(10)
    append("after")
    time.sleep(settle)  # a client cache's window (sshfs), before every client sees it all
    for root in {prune_root, writer_root}:
        got = [e["b"] for e in SyncStore(root, create=True).load(KEY) or []]
        assert [b for b in got if b != "old"] == acked, (str(root), out)
    return len(acked)


def _tracer_pid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0


def wait_all(procs: list[subprocess.Popen[str]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{p.args[:3]} did not finish in {timeout} s") from None
    finally:
        for p in [*procs, *_TRACERS]:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        _TRACERS.clear()


def verify(root: Path, work: Path) -> dict[str, int]:
    """Every acknowledged batch exactly once and whole in the final load; every reader
    snapshot a prefix of it; no error output but failed appends. Returns figures."""
    from fsstore._store import SyncStore

    got = SyncStore(root, create=True).load(KEY) or []
    order: list[str] = []
    count: dict[str, int] = {}
    for e in got:
        count[e["b"]] = count.get(e["b"], 0) + 1
        if not order or order[-1] != e["b"]:
            order.append(e["b"])
    acked = [ln for f in sorted(work.glob("*.acked")) for ln in f.read_text().split()]
    lost = [b for b in acked if b not in count]
    torn = [b for b, c in count.items() if c != PER_BATCH]
    assert not lost, f"{len(lost)} acknowledged batches lost: {lost[:10]}"
    assert not torn, f"batches not whole or twice: {torn[:10]}"
    assert len(order) == len(set(order)), "a batch appears in two places"
    snapshots = 0
    for f in sorted(work.glob("*.snaps")):
        for line in f.read_text().splitlines():
            snap = json.loads(line)
            snapshots += 1
            assert snap == order[: len(snap)], f"{f.name}: a snapshot is not a prefix of the final order"
    failed = 0
    for f in sorted(work.glob("*.err")):
        for line in f.read_text().splitlines():
            if line.startswith("failed "):
                failed += 1
                name, code = line.split()[1:3]
                assert name not in count, f"{name} failed with {code} but is in the transcript"
                continue
            assert line.startswith("compact failed "), f"{f.name}: {line}"  # a traceback, a CORRUPT
    return {"acked": len(acked), "snapshots": snapshots, "failed": failed, "batches": len(order)}
