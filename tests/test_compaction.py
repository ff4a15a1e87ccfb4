"""Compaction: segments change how a transcript is stored, never what load() returns."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fsstore import FsStoreError, _compact, _layout
from fsstore._store import SyncStore

from .conftest import KEY, entry
from .test_store import parts_of, tdir


def files_of(root: Path) -> list[tuple[int, int]]:
    return sorted(r for p in tdir(root, KEY).iterdir() if (r := _layout.parse_item(p.name)))


def test_automatic_compaction_keeps_load_identical_and_files_few(root: Path) -> None:
    store = SyncStore(root, compact_every=8)
    expected = []
    for i in range(300):
        batch = [entry(i), {"type": "no-uuid", "i": i}]
        if i % 50 == 7:
            batch.append(entry(i - 1))  # a retried entry: dropped by load, before and after
        store.append(KEY, batch)
        expected.extend(batch if i % 50 != 7 else batch[:2])
    assert store.load(KEY) == expected
    files = files_of(root)
    segments = [f for f in files if f[0] != f[1]]
    assert len(files) - len(segments) < 8
    assert len(segments) <= math.log2(300 / 8) + 2
    # The files tile 1..300 exactly: no gaps, no overlaps.
    assert [f[0] for f in files] == [1] + [f[1] + 1 for f in files[:-1]] and files[-1][1] == 300


def test_compact_on_demand_merges_everything_into_one_segment(root: Path) -> None:
    store = SyncStore(root, compact_every=0)
    for i in range(20):
        store.append(KEY, [entry(i)])
    before = store.load(KEY)
    assert store.compact(KEY) == 20
    assert files_of(root) == [(1, 20)]
    assert store.load(KEY) == before
    assert store.compact(KEY) == 0  # nothing left to merge
    store.append(KEY, [entry(20)])
    assert store.load(KEY) == [*before, entry(20)]  # type: ignore[misc]
    assert store.compact({**KEY, "session_id": "never"}) == 0


def test_choose_behaves_like_a_binary_counter() -> None:
    items: list[tuple[int, int, str]] = []
    for seq in range(1, 1025):
        items.append((seq, seq, "p"))
        if len(items) >= 2 and items[-2][0] == items[-2][1]:  # two parts in a row: compact
            start = _compact.choose(items, everything=False)
            items = [*items[:start], (items[start][0], items[-1][1], "s")]
        assert len(items) <= math.log2(seq) + 2
    assert items == [(1, 1024, "s")]


def test_leftovers_of_a_compaction_killed_before_unlinking_are_skipped(root: Path) -> None:
    store = SyncStore(root, compact_every=0)
    for i in range(6):
        store.append(KEY, [entry(i)])
    d = tdir(root, KEY)
    # What a compaction leaves when killed between its segment move and the unlinks:
    blob = b"".join((d / _layout.part_name(s)).read_bytes() for s in range(1, 5))
    (d / _layout.segment_name(1, 4)).write_bytes(blob)
    assert store.load(KEY) == [entry(i) for i in range(6)]
    store.compact(KEY)
    assert files_of(root) == [(1, 6)]
    assert store.load(KEY) == [entry(i) for i in range(6)]


def test_compaction_never_copies_a_damaged_part(root: Path) -> None:
    store = SyncStore(root, compact_every=0)
    for i in range(4):
        store.append(KEY, [entry(i)])
    bad = tdir(root, KEY) / _layout.part_name(3)
    bad.write_bytes(b'{"type":"x"}\n{broken\n')
    with pytest.raises(FsStoreError) as info:
        store.compact(KEY)
    assert info.value.code == "CORRUPT" and info.value.path == str(bad)
    assert parts_of(root, KEY) == [_layout.part_name(s) for s in range(1, 5)]


def test_summary_heals_across_a_compaction(root: Path) -> None:
    from claude_agent_sdk import fold_session_summary

    store = SyncStore(root, compact_every=0)
    batches = [[entry(i, message={"role": "user", "content": f"prompt {i}"}),
                {"type": "t", "customTitle": f"title {i}"}] for i in range(5)]
    store.append(KEY, batches[0])
    state_file = tdir(root, KEY) / _layout.STATE
    old = state_file.read_bytes()
    for b in batches[1:]:
        store.append(KEY, b)
    store.compact(KEY)
    state = json.loads(state_file.read_text())
    state.update(json.loads(old), compacted=state["compacted"], seq=state["seq"])
    del state["check"]  # edited by hand: written as format 1, which has no check
    state["format"] = 1
    state_file.write_text(json.dumps(state))  # summary folded only through part 1
    [summary] = store.list_session_summaries(KEY["project_key"])
    want = None
    for b in batches:
        want = fold_session_summary(want, KEY, b)  # type: ignore[arg-type]
    assert want is not None and summary["data"] == want["data"]


def test_a_holder_past_half_its_lease_publishes_nothing(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SyncStore(root, stale_lock_seconds=0.2)
    store.append(KEY, [entry(1)])
    real = SyncStore._current_state

    def slow_read(self: SyncStore, *args: Any) -> Any:
        time.sleep(0.15)  # a stall (hung NFS server) between taking the lock and committing
        return real(self, *args)

    monkeypatch.setattr(SyncStore, "_current_state", slow_read)
    with pytest.raises(FsStoreError) as info:
        store.append(KEY, [entry(2)])
    assert info.value.code == "LOCK_EXPIRED" and info.value.operation == "append"
    monkeypatch.undo()
    assert store.load(KEY) == [entry(1)]
    assert not [p for p in tdir(root, KEY).iterdir() if p.name.startswith(".tmp-")]


# -- readers racing compaction, with real processes ----------------------------------


def _writer(root: str, n: int, start: Any) -> None:
    store = SyncStore(root, compact_every=3)
    start.wait()
    for i in range(n):
        store.append(KEY, [entry(2 * i), entry(2 * i + 1)])


def _compactor(root: str, start: Any, stop: Any) -> None:
    store = SyncStore(root, compact_every=0)
    start.wait()
    while not stop.is_set():
        store.compact(KEY)


def _reader(root: str, start: Any, stop: Any, out: Any) -> None:
    store = SyncStore(root)
    snapshots = []
    start.wait()
    while not stop.is_set():
        got = store.load(KEY)
        snapshots.append([e["uuid"] for e in got] if got else [])
    out.put(snapshots)


@pytest.fixture(params=["root", "tmpfs"])
def race_root(request: pytest.FixtureRequest, root: Path) -> Iterator[Path]:
    """The usual root, and one on tmpfs: its unlink sets a file's ctime before it
    drops the link, so a reader can catch a leftover mid-unlink looking like a late
    commit (see test_a_leftover_caught_mid_unlink_is_a_race_not_corruption)."""
    if request.param == "root":
        yield root
        return
    if not os.path.isdir("/dev/shm") or os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize < 1 << 26:
        pytest.skip("no tmpfs at /dev/shm with 64 MiB free")
    base = Path(tempfile.mkdtemp(prefix="fsstore-race-", dir="/dev/shm"))
    try:
        yield base / "store"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_readers_racing_compaction_see_every_entry_exactly_once(race_root: Path) -> None:
    root = race_root
    ctx = mp.get_context("spawn")
    SyncStore(root).append(KEY, [entry(-1)])
    # Everyone starts together: a reader still starting up when the writer is done
    # would see nothing of the race.
    start, stop, out = ctx.Barrier(4), ctx.Event(), ctx.Queue()
    writer = ctx.Process(target=_writer, args=(str(root), 150, start))
    others = [ctx.Process(target=_compactor, args=(str(root), start, stop)),
              ctx.Process(target=_reader, args=(str(root), start, stop, out)),
              ctx.Process(target=_reader, args=(str(root), start, stop, out))]
    for p in (writer, *others):
        p.start()
    writer.join(120)
    stop.set()
    snapshots = out.get(timeout=60) + out.get(timeout=60)
    for p in others:
        p.join(60)
    assert [p.exitcode for p in (writer, *others)] == [0, 0, 0, 0]
    final = [e["uuid"] for e in SyncStore(root).load(KEY) or []]
    assert final == ["u--1"] + [f"u-{i}" for i in range(300)]
    assert len(snapshots) > 20
    assert any(1 < len(snap) < len(final) for snap in snapshots), "no load overlapped the writer"
    for snap in snapshots:
        assert snap == final[: len(snap)]  # a prefix: nothing missing, nothing twice


def test_compaction_keeps_the_session_mtime_and_file_ages(root: Path) -> None:
    store = SyncStore(root, compact_every=0)
    for i in range(3):
        store.append(KEY, [entry(i)])
    old = time.time() - 10 * 86400
    for p in tdir(root, KEY).iterdir():
        os.utime(p, (old, old))
    [before] = store.list_sessions(KEY["project_key"])
    store.compact(KEY)
    [after] = store.list_sessions(KEY["project_key"])
    assert after["mtime"] == before["mtime"]  # an old session stays old
    [segment] = [p for p in tdir(root, KEY).iterdir() if _layout.parse_item(p.name)]
    assert abs(segment.stat().st_mtime - old) < 1


def test_compaction_refuses_to_hide_a_sequence_gap(root: Path) -> None:
    store = SyncStore(root, compact_every=0)
    for i in range(3):
        store.append(KEY, [entry(i)])
    (tdir(root, KEY) / _layout.part_name(2)).unlink()  # lost by hand
    with pytest.raises(FsStoreError) as info:
        store.compact(KEY)
    assert info.value.code == "CORRUPT" and "gap" in info.value.message
    assert parts_of(root, KEY) == [_layout.part_name(1), _layout.part_name(3)]
    auto = SyncStore(root, compact_every=2)
    auto.append(KEY, [entry(3)])  # the automatic compaction fails, the append does not
    assert auto.load(KEY) == [entry(0), entry(2), entry(3)]


def test_a_holder_stalled_after_its_commit_does_not_write_an_old_sequence(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write that could send later commits into a segment's range is skipped."""
    from fsstore import _store

    a = SyncStore(root, stale_lock_seconds=0.4, compact_every=0)
    real = _store.SyncStore._after_commit
    stalled: list[int] = []

    def stall(self: Any, *args: Any) -> Any:
        if not stalled:
            stalled.append(1)
            # Meanwhile another writer reclaims the lock by age and moves on.
            b = SyncStore(root, stale_lock_seconds=0.4, compact_every=2)
            for i in range(10, 16):
                b.append(KEY, [entry(i)])
            time.sleep(0.25)  # past half of stale_lock_seconds
        return real(self, *args)

    a.append(KEY, [entry(0)])
    monkeypatch.setattr(_store.SyncStore, "_after_commit", stall)
    a.append(KEY, [entry(1)])  # commits (visible), then must not write its old state
    monkeypatch.undo()
    state = json.loads((tdir(root, KEY) / _layout.STATE).read_text())
    assert state["seq"] >= 8  # b's view survived
    b = SyncStore(root, compact_every=2)
    for i in range(20, 26):
        b.append(KEY, [entry(i)])
    got = [e["uuid"] for e in b.load(KEY) or []]
    assert sorted(got) == sorted(f"u-{i}" for i in [0, 1, *range(10, 16), *range(20, 26)])


def _segment_and_a_later_part(root: Path, later: dict[str, Any]) -> tuple[SyncStore, Path]:
    """Parts 1-4 merged into a segment, then a part 2 holding ``later`` written after it."""
    store = SyncStore(root, compact_every=0)
    for i in range(4):
        store.append(KEY, [entry(i)])
    store.compact(KEY)  # segment 1-4
    time.sleep(0.01)
    part = tdir(root, KEY) / _layout.part_name(2)
    part.write_text(json.dumps(later) + "\n")  # newer ctime, one link
    os.chmod(part, 0o600)
    return store, part


def test_a_part_committed_after_the_segment_covering_it_is_reported_not_dropped(root: Path) -> None:
    store, late = _segment_and_a_later_part(root, entry(99))  # what an overlapping holder would leave
    with pytest.raises(FsStoreError) as info:
        store.load(KEY)
    assert info.value.code == "CORRUPT" and "committed after segment" in info.value.message
    with pytest.raises(FsStoreError):
        store.compact(KEY)  # and compaction does not unlink it as a leftover
    assert late.exists()


def test_a_leftover_caught_mid_unlink_is_a_race_not_corruption(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On tmpfs an unlink sets the file's ctime before it drops the link, so a reader's
    stat racing a compaction's unlink of a leftover sees a part newer than the segment
    covering it, still linked: what a late commit looks like. Staged here with real
    files: the leftover is newer than the segment, and the compaction's unlink
    finishes right after the reader's first stat of it. The reader lists again."""
    store, leftover = _segment_and_a_later_part(root, entry(1))
    real_stat = os.stat
    seen: list[str] = []

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_stat(path, *args, **kwargs)
        if path == leftover.name and not seen:
            seen.append(path)
            leftover.unlink()  # the compaction's unlink completes
        return result

    monkeypatch.setattr(os, "stat", stat)
    assert store.load(KEY) == [entry(i) for i in range(4)]
    assert seen, "the reader never looked at the leftover (did load change how it works?)"


def _spy_lock(monkeypatch: pytest.MonkeyPatch, *, can_lock: bool) -> list[bool]:
    """Record each time load asks for the lock; with ``can_lock=False`` it never gets
    it (a read-only mount or user)."""
    taken: list[bool] = []
    real = SyncStore._hold_for_reading

    def hold(self: SyncStore, guard: Any, comps: Any) -> bool:
        got = real(self, guard, comps) if can_lock else False
        taken.append(got)
        return got

    monkeypatch.setattr(SyncStore, "_hold_for_reading", hold)
    return taken


def _racing_listings(
    monkeypatch: pytest.MonkeyPatch, torn: Callable[[int, list[Any]], list[Any]], times: int,
    other: SyncStore | None, taken: list[bool],
) -> list[int]:
    """Listings as a reader racing writers sees them: the first ``times`` unlocked
    listings are ``torn(n, real listing)``, and before each another store appends a
    batch (the directory moves on). A listing made under the lock is the real one."""
    from fsstore import _transcript

    real_scan = _transcript.scan_items
    calls: list[int] = []

    def scan(dir_fd: int) -> list[tuple[int, int, str]]:
        if any(taken) or len(calls) >= times:
            return real_scan(dir_fd)
        calls.append(1)
        if other is not None:
            other.append(KEY, [entry(100 + len(calls))])
        return torn(len(calls), real_scan(dir_fd))

    monkeypatch.setattr(_transcript, "scan_items", scan)
    return calls


def _without(*names: str) -> Callable[[int, list[Any]], list[Any]]:
    return lambda _n, items: [it for it in items if it[2] not in names]


@pytest.mark.parametrize("can_lock", [True, False], ids=["reader can lock", "reader cannot lock"])
def test_a_listing_torn_by_racing_compactions_is_listed_again_until_whole(
    root: Path, monkeypatch: pytest.MonkeyPatch, can_lock: bool
) -> None:
    """A listing that takes several getdents calls can miss a segment made behind its
    cursor and the parts it replaced: a gap that is a race, not damage. However many
    times in a row that happens (each time elsewhere, the directory changing between
    listings), load never returns a transcript with a hole. A reader that can takes
    the lock after the first such listing."""
    store = SyncStore(root, compact_every=0)
    for i in range(12):
        store.append(KEY, [entry(i)])
    taken = _spy_lock(monkeypatch, can_lock=can_lock)
    calls = _racing_listings(
        monkeypatch, lambda n, items: [it for it in items if it[2] != _layout.part_name(2 + n)],
        6, SyncStore(root, compact_every=0), taken)
    got = store.load(KEY)
    assert got == [entry(i) for i in range(12)] + [entry(100 + k) for k in range(1, len(calls) + 1)]
    assert (calls, taken) == (([1], [True]) if can_lock else ([1] * 6, [False] * (len(taken))))


def _merge_tail_by_hand(d: Path) -> None:
    """What a compaction of parts 7 and 8 does to the directory: their bytes into
    segment 7-8 (moved into place), then the parts unlinked."""
    parts = [d / _layout.part_name(7), d / _layout.part_name(8)]
    tmp = d / ".tmp-by-hand-segment"
    tmp.write_bytes(b"".join(p.read_bytes() for p in parts))
    os.chmod(tmp, 0o600)
    tmp.rename(d / _layout.segment_name(7, 8))
    for p in parts:
        p.unlink()


@pytest.mark.parametrize("can_lock", [True, False], ids=["reader can lock", "reader cannot lock"])
def test_a_listing_torn_at_the_tail_is_listed_again(
    root: Path, monkeypatch: pytest.MonkeyPatch, can_lock: bool
) -> None:
    """Torn at the tail (segment 7-8 made behind the cursor, parts 7 and 8 gone ahead
    of it) a listing has no gap, only ends early: state.json, read before listing,
    records a later committed sequence, and no part after the listing exists by
    name. Listed again; a listing that only missed parts still there (a stale
    directory cache) is completed by name instead, silently."""
    store = SyncStore(root, compact_every=0)
    for i in range(6):
        store.append(KEY, [entry(i)])
    store.compact(KEY)
    store.append(KEY, [entry(6)])
    store.append(KEY, [entry(7)])
    d = tdir(root, KEY)
    taken = _spy_lock(monkeypatch, can_lock=can_lock)

    def torn(n: int, items: list[Any]) -> list[Any]:
        if n == 1:
            _merge_tail_by_hand(d)  # the racing compaction, while this listing ran
            return [it for it in items if it[2] not in (_layout.part_name(7), _layout.part_name(8))]
        return items

    calls = _racing_listings(monkeypatch, torn, 2, None, taken)
    assert store.load(KEY) == [entry(i) for i in range(8)]
    assert calls == ([1] if can_lock else [1, 1]) and taken == [can_lock]


def test_a_listing_that_misses_parts_still_there_reads_them_by_name(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stale directory cache (NFS) can list a transcript without its newest parts
    while state.json, opened afresh, records them: they are read by name, with no
    warning and no lock."""
    store = SyncStore(root, compact_every=0)
    for i in range(5):
        store.append(KEY, [entry(i)])
    taken = _spy_lock(monkeypatch, can_lock=True)
    calls = _racing_listings(monkeypatch, _without(_layout.part_name(4), _layout.part_name(5)), 1, None, taken)
    assert store.load(KEY) == [entry(i) for i in range(5)]
    assert (calls, taken) == ([1], [])
    assert not [r for r in caplog.records if getattr(r, "code", None) == "GAP"]


@pytest.mark.parametrize("can_lock", [True, False], ids=["reader can lock", "reader cannot lock"])
def test_a_real_gap_is_loaded_with_a_warning_while_appends_go_on(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, can_lock: bool
) -> None:
    """A part lost by hand is damage: load returns the rest with a GAP warning, at
    the second listing, also for a reader that cannot lock while another writer
    keeps appending (every listing differs at the tail: the damage does not)."""
    store = SyncStore(root, compact_every=0)
    for i in range(6):
        store.append(KEY, [entry(i)])
    (tdir(root, KEY) / _layout.part_name(2)).unlink()
    taken = _spy_lock(monkeypatch, can_lock=can_lock)
    calls = _racing_listings(monkeypatch, lambda _n, items: items, 10, SyncStore(root, compact_every=0), taken)
    got = store.load(KEY)
    assert got == [entry(i) for i in range(6) if i != 1] + [entry(100 + k) for k in range(1, len(calls) + 1)]
    assert len(calls) == (1 if can_lock else 2)
    assert [r for r in caplog.records if getattr(r, "code", None) == "GAP"]


def _fast_writer(root: str, stop: Any) -> None:
    store = SyncStore(root, compact_every=4, summaries=False)
    i = 0
    while not stop.is_set():
        store.append(KEY, [entry(100_000 + i)])
        i += 1


def test_a_reader_outpaced_by_compaction_reads_under_the_lock(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers compacting every few appends can make every listing stale before it is
    read; a reader that keeps losing reads under the lock instead of giving up."""
    from fsstore import _store

    seed = SyncStore(root, compact_every=0, summaries=False)
    for i in range(2000):
        seed.append(KEY, [entry(i)])
    monkeypatch.setattr(_store, "_LOAD_ATTEMPTS", 10)  # fewer chances, so losing is likely
    monkeypatch.setattr(_store, "_OPTIMISTIC_LOADS", 3)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    writers = [ctx.Process(target=_fast_writer, args=(str(root), stop)) for _ in range(3)]
    for w in writers:
        w.start()
    try:
        loads = 0
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            got = seed.load(KEY)
            assert got is not None and got[:2000] == [entry(i) for i in range(2000)]
            assert len({e["uuid"] for e in got}) == len(got)
            loads += 1
    finally:
        stop.set()
        for w in writers:
            w.join(30)
    assert loads >= 5


_DIES_BEFORE_STATE = r'''
import os, sys
import fsstore._store as s
s.write_state = lambda *a, **k: os._exit(9)  # killed right after its commit point
s.SyncStore(sys.argv[1], compact_every=0, summaries=False).append(
    {"project_key": "-home-user-repo", "session_id": sys.argv[2]}, [{"uuid": sys.argv[3]}])
'''


def test_two_compactions_never_make_a_remembered_state_look_current(root: Path) -> None:
    """Compaction keeps state.json's mtime, and on a local file system the state file
    alternates between two inodes: after two compactions state.json can be the inode
    this process wrote, with its mtime and size, while holding a newer state (found
    by review: the commit then landed inside the segment). The write id tells."""
    import subprocess
    import sys

    a = SyncStore(root, compact_every=0, summaries=False)
    for i in range(3):
        a.append(KEY, [entry(i)])
    a.compact(KEY)
    r = subprocess.run([sys.executable, "-c", _DIES_BEFORE_STATE, str(root), KEY["session_id"], "c1"],
                       check=False)
    assert r.returncode == 9  # part 4 committed, state.json behind
    a.compact(KEY)
    a.append(KEY, [entry(9)])
    got = SyncStore(root).load(KEY)
    assert got is not None and [e["uuid"] for e in got] == ["u-0", "u-1", "u-2", "c1", "u-9"]


@pytest.mark.parametrize("link", ["dropped", "not yet dropped"])
def test_check_does_not_report_a_leftover_caught_mid_unlink_as_late(
    root: Path, monkeypatch: pytest.MonkeyPatch, link: str
) -> None:
    """`fsstore check` stats every file it lists; one stat can land inside a
    compaction's unlink of a leftover: the ctime already bumped, the link count
    dropped (ext4) or not yet (tmpfs). Staged with real files: the unlink completes
    around the walker's first stat of each leftover. Not a late part: check lists
    again and finds the leftover gone."""
    from fsstore import _maintenance

    store = SyncStore(root, compact_every=0)
    for i in range(4):
        store.append(KEY, [entry(i)])
    monkeypatch.setattr(_compact, "_remove", lambda fd, names: None)  # interrupted before step 6
    store.compact(KEY)
    monkeypatch.undo()
    quiet = _maintenance.check(str(root)).problems
    assert sorted(p.kind for p in quiet) == ["leftover"] * 4
    real_stat = _maintenance.Walker._stat
    unlinked: list[str] = []

    def racing_stat(self: Any, entry: os.DirEntry[str], comps: Any) -> os.stat_result | None:
        if entry.name not in (_layout.part_name(n) for n in range(1, 5)) or entry.name in unlinked:
            return real_stat(self, entry, comps)
        unlinked.append(entry.name)
        path = tdir(root, KEY) / entry.name
        if link == "dropped":
            fd = os.open(path, os.O_RDONLY)
            try:
                os.unlink(path)
                return os.fstat(fd)  # nlink 0, the unlink's ctime
            finally:
                os.close(fd)
        os.utime(path)  # the unlink's ctime update ...
        st = os.stat(path)  # ... seen with the link still there
        os.unlink(path)
        return st

    monkeypatch.setattr(_maintenance.Walker, "_stat", racing_stat)
    problems = _maintenance.check(str(root)).problems
    assert unlinked, "check never stat'ed the leftovers (did it change how it works?)"
    assert [p for p in problems if p.kind == "late-part"] == [], problems
    assert store.load(KEY) == [entry(i) for i in range(4)]


def test_check_next_to_a_writer_compacting_faster_than_it_reads_finds_nothing(root: Path) -> None:
    """`fsstore check` lists and reads every file of a transcript; a writer compacting
    every few appends can change each listing before check has read it. Check looks
    under the transcript lock once it has lost a few times (it used to give up after
    20 and report a merged file as unreadable)."""
    from fsstore import _maintenance

    seed = SyncStore(root, compact_every=0, summaries=False)
    for i in range(1000):
        seed.append(KEY, [entry(i)])
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    writer = ctx.Process(target=_fast_writer, args=(str(root), stop))
    writer.start()
    try:
        runs, bad = 0, []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            runs += 1
            bad += [p for p in _maintenance.check(str(root)).problems if p.severity != "info"]
    finally:
        stop.set()
        writer.join(30)
    assert writer.exitcode == 0
    assert bad == [], f"{len(bad)} problems in {runs} checks: {bad[:3]}"
    assert runs > 5


def _no_lock_taken_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail at once where a thread asks for a transcript lock it holds already (the
    in-process lock is not reentrant: that would wait for itself until LOCK_TIMEOUT)."""
    from fsstore import _lock

    real = _lock.Locks.hold

    def hold(self: Any, lock_path: str, operation: str) -> Any:
        assert not self.held_here(lock_path), f"{operation} waits for its own lock"
        return real(self, lock_path, operation)

    monkeypatch.setattr(_lock.Locks, "hold", hold)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_damaged_transcript_loaded_under_its_own_lock_does_not_wait_for_it(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, api: str
) -> None:
    """Inside ``locked(key)`` a listing is settled already: a load that finds a gap
    there takes it as damage at once instead of asking for the lock it holds (the
    async API loads in a worker thread while the caller's thread holds the lock)."""
    import anyio

    from fsstore import FsSessionStore

    store = SyncStore(root, compact_every=0)
    for i in range(4):
        store.append(KEY, [entry(i)])
    (tdir(root, KEY) / _layout.part_name(2)).unlink()
    _no_lock_taken_twice(monkeypatch)
    if api == "sync":
        with store.locked(KEY):
            got = store.load(KEY)
    else:
        astore = FsSessionStore(root=root)

        async def main() -> Any:
            async with astore.locked(KEY):
                return await astore.load(KEY)

        got = anyio.run(main)
    assert got == [entry(0), entry(2), entry(3)]
    assert [r for r in caplog.records if getattr(r, "code", None) == "GAP"]


def test_prune_of_an_old_damaged_session_does_not_wait_for_its_own_locks(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prune looks at a session again under its locks; a gap there (a settled
    listing) must not make it ask for those locks again."""
    from fsstore import _maintenance

    store = SyncStore(root, compact_every=0)
    for i in range(4):
        store.append(KEY, [entry(i)])
    (tdir(root, KEY) / _layout.part_name(2)).unlink()
    old = time.time() - 40 * 86400
    for p in tdir(root, KEY).iterdir():
        os.utime(p, (old, old))
    _no_lock_taken_twice(monkeypatch)
    actions, looked = _maintenance.prune(str(root), older_than=30 * 86400)
    assert looked == 1 and len(actions) == 1, actions


@pytest.mark.parametrize("left", ["a short listing", "a late-looking leftover"])
def test_a_transcript_deleted_while_loaded_is_gone_not_damaged(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, left: str
) -> None:
    """A delete renames the session away, then removes its files, without the lock:
    a reader still in the old directory, even one listing under the lock, can see it
    half removed. That is a delete, not damage: no GAP warning, no CORRUPT; the
    session is gone."""
    from fsstore import _transcript

    store = SyncStore(root, compact_every=0)
    for i in range(4):
        store.append(KEY, [entry(i)])
    if left == "a late-looking leftover":
        store.compact(KEY)  # segment 1-4
    d = tdir(root, KEY)
    real_scan = _transcript.scan_items
    calls: list[int] = []

    def scan(dir_fd: int) -> list[tuple[int, int, str]]:
        calls.append(1)
        if len(calls) == 1:  # torn by a race: the reader lists again, under the lock
            return [it for it in real_scan(dir_fd)
                    if it[2] not in (_layout.part_name(2), _layout.segment_name(1, 4))]
        if len(calls) == 2:  # the session is renamed into .trash; removing its files begins
            os.makedirs(root / ".trash", exist_ok=True)
            os.rename(d.parent, root / ".trash" / "x")
            gone = root / ".trash" / "x" / "main"
            if left == "a short listing":
                (gone / _layout.part_name(4)).unlink()
            else:  # a part 2 newer than the segment, as a stat inside an unlink sees it
                time.sleep(0.01)
                (gone / _layout.part_name(2)).write_text(json.dumps(entry(1)) + "\n")
        return real_scan(dir_fd)

    taken = _spy_lock(monkeypatch, can_lock=True)
    monkeypatch.setattr(_transcript, "scan_items", scan)
    assert store.load(KEY) is None
    assert len(calls) == 2 and taken[:1] == [True]
    assert not [r for r in caplog.records if getattr(r, "code", None) == "GAP"]
