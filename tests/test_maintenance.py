"""`fsstore check` and `prune` next to live writers, run in process (the command line
itself: test_cli.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from fsstore import _compact, _layout
from fsstore._store import SyncStore

from ._helpers import fast_writer, no_lock_taken_twice, tdir
from .conftest import KEY, entry


def test_check_reports_the_leftovers_of_an_interrupted_compaction(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsstore import _check

    store = SyncStore(root, create=True, compact_every=0)
    for i in range(4):
        store.append(KEY, [entry(i)])
    monkeypatch.setattr(_compact, "_covered", lambda *a: [])  # killed before step 6
    store.compact(KEY)
    monkeypatch.undo()
    problems = _check.check(str(root)).problems
    assert sorted(p.kind for p in problems) == ["leftover"] * 4
    assert store.load(KEY) == [entry(i) for i in range(4)]


def test_check_next_to_a_writer_compacting_faster_than_it_reads_finds_nothing(root: Path) -> None:
    """`fsstore check` lists and reads every file of a transcript; a writer compacting
    every few appends can change each listing before check has read it. Check looks
    under the transcript lock once it has lost a few times (it used to give up after
    20 and report a merged file as unreadable)."""
    from fsstore import _check

    seed = SyncStore(root, create=True, compact_every=0, summaries=False)
    for i in range(1000):
        seed.append(KEY, [entry(i)])
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    writer = ctx.Process(target=fast_writer, args=(str(root), stop))
    writer.start()
    try:
        runs, bad = 0, []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            runs += 1
            bad += [p for p in _check.check(str(root)).problems if p.severity != "info"]
    finally:
        stop.set()
        writer.join(30)
    assert writer.exitcode == 0
    assert bad == [], f"{len(bad)} problems in {runs} checks: {bad[:3]}"
    assert runs > 5


def test_prune_of_an_old_damaged_session_does_not_wait_for_its_own_locks(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prune looks at a session again under its locks; a gap there (a settled
    listing) must not make it ask for those locks again."""
    from fsstore import _cleanup

    store = SyncStore(root, create=True, compact_every=0)
    for i in range(4):
        store.append(KEY, [entry(i)])
    (tdir(root, KEY) / _layout.part_name(2)).unlink()
    old = time.time() - 40 * 86400
    for p in tdir(root, KEY).iterdir():
        os.utime(p, (old, old))
    no_lock_taken_twice(monkeypatch)
    actions, looked = _cleanup.prune(str(root), older_than=30 * 86400)
    assert looked == 1 and len(actions) == 1, actions
