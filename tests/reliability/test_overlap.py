"""Format 2's promise with lock holders that overlap, in real processes.

The lock is for order and cheap contention; nothing may depend on it being
exclusive. Here it is not: a writer stalled inside one system call (``strace -e
inject=SYSCALL:delay_enter``) outlives its lease, a pruner stalls inside its move;
and a writer's clock is off (libfaketime: until stop 29 one running ahead judged
every held lock stale; it now times its waiting by its own clock, like the others).
In every run: every acknowledged batch exactly once and whole, every reader
snapshot a prefix of the final order, no CORRUPT, no failed append's batch present.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fsstore._store import SyncStore

from . import _overlap
from ._overlap import KEY, start_compactor, start_reader, start_writer, verify, wait_all

pytestmark = pytest.mark.timeout(240)

needs_faketime = pytest.mark.skipif(_overlap.faketime_unavailable() is not None,
                                    reason=str(_overlap.faketime_unavailable()))
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")

# Every lock is judged stale after 1 s: overlaps come often.
FAST = {"stale_lock_seconds": 1.0, "lock_timeout_seconds": 10.0, "compact_every": 8, "summaries": False}


def _campaign(tmp_path: Path, figures: Any, odd: dict[str, dict[str, Any]], *, n: int, normal: int = 3,
              seconds: float = 6.0, compactor: bool = True) -> dict[str, int]:
    root, work = tmp_path / "store", tmp_path / "work"
    work.mkdir()
    SyncStore(root, create=True).append(KEY, [{"uuid": f"seed-{j}", "b": "seed"} for j in range(_overlap.PER_BATCH)])
    procs = [start_writer(root, work, f"w{k}", n, FAST) for k in range(normal)]
    for name, how in odd.items():
        procs.append(start_writer(root, work, name, n, FAST, **how))
    readers = [start_reader(root, work, f"r{k}", seconds) for k in range(2)]
    others = [start_compactor(root, work, seconds, FAST)] if compactor else []
    wait_all(procs + readers + others, timeout=180)
    got = verify(root, work)
    figures.add("appends", got["acked"])
    figures.add("writer processes", len(procs))
    figures.add("reader loads checked", got["snapshots"])
    return got


@needs_faketime
@pytest.mark.parametrize("offset", ["+10m", "-10m"])
def test_a_skewed_process_has_its_wall_clock_off_and_its_sleeps_and_waits_on_time(offset: str) -> None:
    """The skewed writers below are a host whose wall clock is wrong: ``time.time()`` is
    off by the offset, while sleeps, timed thread waits and lock timeouts take the time
    they say (review 99: with libfaketime faking the monotonic clock too, as the suite
    did before stop 38, a timed wait of one thread on another never timed out, so the
    skewed writers never took the store's in-process timeout paths)."""
    code = ("import json, os, threading, time\n"
            "skew = time.time() - os.stat('/proc/self').st_mtime\n"
            "t0 = time.monotonic(); time.sleep(0.2); threading.Event().wait(0.2)\n"
            "held = threading.Lock(); held.acquire(); held.acquire(timeout=0.2)\n"
            "print(json.dumps([skew, time.monotonic() - t0]))")
    out = subprocess.run([sys.executable, "-c", code], env=_overlap.faketime_env(offset), capture_output=True,
                         text=True, timeout=30, check=True)
    skew, waited = json.loads(out.stdout)
    assert abs(skew - (600 if offset == "+10m" else -600)) < 60 and 0.5 < waited < 5, out.stdout


@needs_faketime
@pytest.mark.parametrize("offset", ["+35s", "+10m", "-10m"])
@pytest.mark.parametrize("run", [0, pytest.param(1, marks=pytest.mark.soak), pytest.param(2, marks=pytest.mark.soak)])
def test_a_writer_with_a_skewed_clock_loses_nothing(
    tmp_path: Path, figures: Any, offset: str, run: int
) -> None:
    """One writer's clock is off (ahead: every marker looks old to it; behind: every
    marker looks new), three normal writers, a compactor, two readers. (Format 1
    failed this about one run in two at +10m: CORRUPT for every reader; until stop 29
    the writer ahead broke every held lock, its readers' too.)"""
    got = _campaign(tmp_path, figures, {"skewed": {"env": _overlap.faketime_env(offset)}}, n=100)
    assert got["acked"] + got["failed"] == 4 * 100


# The stall sweep: every system call a writer, a compactor or a pruner makes while it
# holds the lock, with where the sweep stalls it (strace's when=first+step), and
# whether the main suite runs it (the rest are soak runs).
WRITER_SWEEP = {
    "linkat": ("5+7", True), "getdents64": ("5+15", True), "newfstatat": ("5+25", False),
    "renameat2": ("1+2", False), "openat": ("5+7", False), "unlinkat": ("5+7", False),
    "close": ("9+7", False), "read": ("5+7", False), "write": ("5+7", False),
    "utimensat": ("1+2", False), "renameat": ("1+1", False), "mkdirat": ("1", False),
    "fsync": ("1+1", False),  # (a compaction's segment, whatever fsync says: stop 34)
}
COMPACTOR_SWEEP = {
    "renameat2": ("2+3", True), "unlinkat": ("3+5", False), "getdents64": ("3+5", False),
    "openat": ("3+5", False), "read": ("3+5", False), "write": ("2+3", False),
    "utimensat": ("2+3", False), "renameat": ("1+2", False), "linkat": ("2+3", False),
    "fsync": ("1+1", True),  # its segment's, under the lock, before the move (stop 34)
}
PRUNE_SWEEP = {"unlinkat": True, "linkat": False, "openat": False, "getdents64": False,
               "newfstatat": False, "renameat": False}
# Calls that reach no storage (process and descriptor bookkeeping, a directory rewind).
NO_STORAGE = {"getpid", "gettid", "fcntl", "lseek", "futex", "clock_gettime", "mmap", "munmap",
              "brk", "mprotect", "madvise", "rt_sigprocmask", "rt_sigaction", "getrandom", "geteuid"}


def _sweep_params(table: dict[str, Any]) -> list[Any]:
    main = {call: v[1] if isinstance(v, tuple) else v for call, v in table.items()}
    return [pytest.param(call, id=call, marks=() if on else pytest.mark.soak) for call, on in main.items()]


CALLS_UNDER_LOCK = """
import sys
sys.path.insert(0, {repo!r})
from fsstore._store import SyncStore
s = SyncStore({root!r}, create=True, compact_every=4, summaries=False)
s.append({key!r}, [{{"uuid": "first"}}])
for i in range(12):
    s.append({key!r}, [{{"uuid": "u%d" % i}}])
s.compact({key!r})
"""


@needs_strace
def test_the_stall_sweep_covers_every_call_made_under_the_lock(tmp_path: Path) -> None:
    """Enumerates, with strace, the system calls of appends (with automatic
    compaction) and of a compaction between taking the lock (the link of the holder's
    record to the lock name) and releasing it (its unlink): each is in the sweep."""
    code = CALLS_UNDER_LOCK.format(repo=_overlap.REPO, root=str(tmp_path / "store"), key=KEY)
    trace = tmp_path / "trace"
    subprocess.run(["strace", "-f", "-qq", "-o", str(trace), sys.executable, "-c", code], check=True, timeout=120)
    seen: set[str] = set()
    inside: set[str] = set()  # threads holding the lock (an automatic compaction has one of its own)
    for line in trace.read_text().splitlines():
        thread, call = line.split(None, 1)
        if call.startswith("<..."):
            continue  # a call resumed: counted where it began
        name = call.split("(", 1)[0]
        if name == "linkat" and '.lock"' in line and "owner-" in line:
            inside.add(thread)
        elif name in ("unlink", "unlinkat") and '.lock"' in line:
            inside.discard(thread)
        elif thread in inside:
            seen.add(name)
    assert "getdents64" in seen and "renameat2" in seen, seen  # the trace is what we think
    missing = seen - NO_STORAGE - set(WRITER_SWEEP)
    assert not missing, f"calls made under the lock that the stall sweep does not stall: {missing}"
    assert set(COMPACTOR_SWEEP) <= set(WRITER_SWEEP) | {"linkat"}


@needs_strace
@pytest.mark.parametrize("call", _sweep_params(WRITER_SWEEP))
def test_a_writer_stalled_inside_a_system_call_past_its_lease_loses_nothing(
    tmp_path: Path, figures: Any, call: str
) -> None:
    """The stall sweep, writers: one writer's calls of one kind each take 1.5 s (as
    ``when`` picks them), past the 1 s lock lifetime: the others reclaim its lock and
    go on, also while it is between its link and its check (linkat, getdents64)."""
    stall = (call, 1_500_000, WRITER_SWEEP[call][0])
    _campaign(tmp_path, figures, {"stalled": {"stall": stall}}, n=20, seconds=6.0)
    figures.fault(f"writer's {call} stalled 1.5 s past the lock's lease")


@needs_strace
@pytest.mark.parametrize("call", _sweep_params(COMPACTOR_SWEEP))
def test_a_compactor_stalled_inside_a_system_call_past_its_lease_loses_nothing(
    tmp_path: Path, figures: Any, call: str
) -> None:
    """The stall sweep, compaction (the code of ``fsstore compact``): the compactor's
    calls of one kind each take 1.5 s while four writers append and two readers load."""
    root, work = tmp_path / "store", tmp_path / "work"
    work.mkdir()
    SyncStore(root, create=True).append(KEY, [{"uuid": f"seed-{j}", "b": "seed"} for j in range(_overlap.PER_BATCH)])
    procs = [start_writer(root, work, f"w{k}", 25, FAST, pause=0.02) for k in range(4)]
    readers = [start_reader(root, work, f"r{k}", 6.0) for k in range(2)]
    compactor = start_compactor(root, work, 6.0, FAST, stall=(call, 1_500_000, COMPACTOR_SWEEP[call][0]))
    wait_all([*procs, *readers, compactor], timeout=180)
    got = verify(root, work)
    assert got["acked"] + got["failed"] == 4 * 25
    figures.add("appends", got["acked"])
    figures.fault(f"compactor's {call} stalled 1.5 s past the lock's lease")


@needs_strace
@pytest.mark.parametrize("call", _sweep_params(PRUNE_SWEEP))
def test_prune_stalled_inside_a_system_call_never_deletes_an_acknowledged_batch(
    tmp_path: Path, figures: Any, call: str
) -> None:
    """The stall sweep, ``fsstore prune``: every call of one kind it makes takes 0.8 s
    (past its 0.5 s lease) while a writer appends to the old session it is pruning.
    Whatever prune decides, every batch whose append returned is there afterwards."""
    root = tmp_path / "store"
    _overlap.old_session(root)
    writer = SyncStore(root, create=True, stale_lock_seconds=1.0, lock_timeout_seconds=30)
    acked: list[str] = []

    def during() -> None:
        for i in range(6):
            time.sleep(0.3)
            writer.append(KEY, [{"uuid": f"new-{i}", "b": f"new-{i}"}])
            acked.append(f"new-{i}")

    out = _overlap.run_stalled_prune(root, call, 800_000, during)
    got = [e["b"] for e in SyncStore(root, create=True).load(KEY) or []]
    assert [b for b in got if b != "old"] == acked, out
    figures.add("appends", len(acked))
    figures.fault(f"prune's {call} stalled 0.8 s past its lease")


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.soak), pytest.param(2, marks=pytest.mark.soak)])
def test_writers_and_a_compactor_stopped_at_random_instants_lose_nothing(
    tmp_path: Path, figures: Any, seed: int
) -> None:
    """SIGSTOP campaign: one of two writers or the compactor (a paused VM, a process
    stopped by a debugger) is stopped for 1.5 s, past the 1 s lock lifetime, at random
    instants, while two more writers append and two readers load."""
    root, work = tmp_path / "store", tmp_path / "work"
    work.mkdir()
    SyncStore(root, create=True).append(KEY, [{"uuid": f"seed-{j}", "b": "seed"} for j in range(_overlap.PER_BATCH)])
    victims = [start_writer(root, work, f"v{k}", 40, FAST, pause=0.01) for k in range(2)]
    victims.append(start_compactor(root, work, 8.0, FAST))
    others = [start_writer(root, work, f"w{k}", 40, FAST, pause=0.05) for k in range(2)]
    readers = [start_reader(root, work, f"r{k}", 8.0) for k in range(2)]
    stopped = _overlap.stop_at_random(victims, stop_for=1.5, gap=(0.05, 0.6), seed=seed)
    wait_all([*victims, *others, *readers], timeout=180)
    stops = stopped()
    got = verify(root, work)
    assert stops >= 3 and got["acked"] + got["failed"] == 4 * 40, (stops, got)
    figures.add("appends", got["acked"])
    figures.fault("writer or compactor SIGSTOPped 1.5 s past the lock's lease")


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.soak)])
def test_prune_stopped_at_random_instants_never_deletes_an_acknowledged_batch(
    tmp_path: Path, figures: Any, seed: int
) -> None:
    """SIGSTOP campaign, ``fsstore prune``: stopped for 1.5 s (past its lease) at a
    random instant of its run, while a writer appends to the old session it prunes;
    four rounds. Every batch whose append returned is there afterwards."""
    import random

    rng = random.Random(seed)
    for round_ in range(4):
        root = tmp_path / f"store-{round_}"
        _overlap.old_session(root)
        figures.add("appends", _overlap.prune_stopped_once(root, root, rng))
    figures.fault("prune SIGSTOPped 1.5 s at a random instant")


@needs_strace
def test_prune_stalled_inside_its_move_never_deletes_a_batch_acknowledged_meanwhile(
    tmp_path: Path, figures: Any
) -> None:
    """prune marks the session, looks at it a last time, then stalls 3 s inside the
    rename into .trash (the one window its lease check cannot cover). A writer takes
    the lock meanwhile, finds the mark, finishes the delete and commits its batch in
    a session made anew. When prune's rename goes through, it moves that new session:
    it finds no mark of its own there and moves it back. The batch stays."""
    root = tmp_path / "store"
    _overlap.old_session(root)
    prune = subprocess.Popen(
        ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=renameat",
         "-e", "inject=renameat:delay_enter=3000000", sys.executable, "-m", "fsstore", "prune",
         str(root), "--older-than", "30d", "--stale-lock-seconds", "1s"],
        cwd=_overlap.REPO, env={**os.environ, "PYTHONPATH": _overlap.REPO},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.5)  # prune holds the lock, marked the session, and is inside its rename
    writer = SyncStore(root, create=True, stale_lock_seconds=1.0)
    writer.append(KEY, [{"uuid": "new", "b": "new"}])  # acknowledged
    out, _ = prune.communicate(timeout=60)
    old, new = {"uuid": "old", "b": "old"}, {"uuid": "new", "b": "new"}
    # Deleted with the batch kept in a session made anew; or, where the machine was
    # slow enough that the append came before prune's last look, the session kept.
    assert writer.load(KEY) in ([new], [old, new]), out
    assert SyncStore(root, create=True).load(KEY) == writer.load(KEY)
    figures.fault("prune stalled 3 s inside its move")


@needs_strace
def test_prune_stalled_past_older_than_after_its_first_look_keeps_a_batch_acknowledged_meanwhile(
    tmp_path: Path, figures: Any
) -> None:
    """prune --older-than 1s looks at the session (one batch, 2 s old), then stalls 3 s
    in the link that takes its lock. A batch appended meanwhile is acknowledged; by the
    time prune looks again (marked, under the lock) that batch is more than 1 s old too.
    It must keep the session: a file was committed since its first look.

    Found by review (12 of 12 runs): the second look judged the newest file by its age
    only, so any stall longer than --older-than deleted the batch."""
    root = tmp_path / "store"
    writer = SyncStore(root, create=True)
    writer.append(KEY, [{"uuid": "old", "b": "old"}])
    time.sleep(2.0)
    records = set(os.listdir(root / ".locks"))
    prune = subprocess.Popen(
        ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=linkat",
         "-e", "inject=linkat:delay_enter=3000000:when=1", sys.executable, "-m", "fsstore", "prune",
         str(root), "--older-than", "1s"],
        cwd=_overlap.REPO, env={**os.environ, "PYTHONPATH": _overlap.REPO},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # prune has looked once it writes its lock record, just before the stalled link
        deadline = time.monotonic() + 30
        while not set(os.listdir(root / ".locks")) - records:
            assert prune.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        writer.append(KEY, [{"uuid": "new", "b": "new"}])  # acknowledged
        out, _ = prune.communicate(timeout=60)
    finally:
        prune.kill()
        prune.wait()
    assert SyncStore(root, create=True).load(KEY) == [{"uuid": "old", "b": "old"}, {"uuid": "new", "b": "new"}], out
    assert "written to meanwhile" in out, out
    figures.fault("prune stalled 3 s taking its lock, past --older-than")
