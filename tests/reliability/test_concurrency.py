"""Several writer processes and a reader process on one store.

N writer processes append M batches each to the same transcript while others write
to another session and to subpaths of the shared one, and a reader process loads
in a loop. Afterwards every entry is there exactly once, every batch contiguous,
each writer's batches in its own order, every summary agrees with its transcript,
and every snapshot the reader saw is a prefix of the final transcript (the reader
checks that each snapshot extends the previous one; the parent checks the last
against the final transcript).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from fsstore._store import SyncStore

from . import _children
from ._check import assert_summaries_consistent, assert_transcript, ids

PROJECT = "-concurrency"
SHARED = {"project_key": PROJECT, "session_id": "shared"}
SUB_A = {**SHARED, "subpath": "subagents/agent-a"}
SUB_B = {**SHARED, "subpath": "subagents/agent-b"}
OTHER = {"project_key": PROJECT, "session_id": "other"}


def run_workload(
    procs: Any,
    root: str,
    *,
    shared_writers: int,
    batches: int,
    opts: dict[str, Any],
    seed: int,
    figures: Any,
    readers: int = 1,
) -> dict[str, Any]:
    """Start everyone at once, wait, and check everything; returns the numbers."""
    plan: list[tuple[str, dict[str, str]]] = [(f"w{i}", SHARED) for i in range(shared_writers)]
    plan += [("sub-a", SUB_A), ("sub-b", SUB_B), ("other", OTHER)]
    start, stop = procs.Event(), procs.Event()
    workers = []
    for n, (wid, key) in enumerate(plan):
        parent, child = procs.Pipe(duplex=False)
        p = procs.Process(
            target=_children.writer, args=(root, key, wid, batches, seed * 1000 + n, opts, start, child)
        )
        p.start()
        child.close()
        workers.append((p, parent, wid, key))
    rdrs = []
    for _ in range(readers):
        parent, child = procs.Pipe(duplex=False)
        p = procs.Process(target=_children.reader, args=(root, [SHARED, SUB_A], opts, start, stop, child))
        p.start()
        child.close()
        rdrs.append((p, parent))
    start.set()
    try:
        results = []
        for p, conn, wid, _key in workers:
            assert conn.poll(240), f"writer {wid} did not finish"
            results.append((wid, conn.recv()))
            p.join(30)
        stop.set()
        reads = []
        for p, conn in rdrs:
            assert conn.poll(60), "reader did not finish"
            reads.append(conn.recv())
            p.join(30)
    finally:
        stop.set()
        for p, *_ in workers + rdrs:  # type: ignore[misc]
            if p.is_alive():
                p.kill()
                p.join(10)
    errors = [(wid, r[1]) for wid, r in results if r[0] != "ok"]
    assert not errors, errors
    for r in reads:
        assert r[0] == "ok", r[1]
    figures.add("appends", len(plan) * batches)
    figures.add("writer processes", len(plan))
    figures.add("reader processes", len(rdrs))

    store = SyncStore(root, create=True, **opts)
    written = {wid: r[2] for wid, r in results}
    final = {}
    for key, writers in ((SHARED, [w for w, k in plan if k is SHARED]), (SUB_A, ["sub-a"]), (SUB_B, ["sub-b"]), (OTHER, ["other"])):
        loaded = store.load(key)
        assert_transcript(loaded, [(w, b) for w in writers for b in range(batches)], sum(written[w] for w in writers))
        final[id(key)] = ids(loaded or [])
    entries = sum(len(v) for v in final.values())
    loads = 0
    for _ok, nloads, problems, last in reads:
        assert problems == [], problems
        loads += nloads
        for k, key in enumerate([SHARED, SUB_A]):
            assert final[id(key)][: len(last[k])] == last[k], "a snapshot is not a prefix of the final transcript"
    figures.add("reader loads checked", loads)
    assert loads >= 2 * len(rdrs), "the reader hardly ran"
    assert sorted(store.list_subkeys(SHARED)) == sorted([SUB_A["subpath"], SUB_B["subpath"]])
    assert {s["session_id"] for s in store.list_sessions(PROJECT)} == {"shared", "other"}
    assert assert_summaries_consistent(store, PROJECT) == 2
    return {"entries": entries, "loads": loads}


def test_concurrent_writers_lose_nothing_and_reader_sees_only_prefixes(
    procs: Any, tmp_path: Path, figures: Any
) -> None:
    # compact_every=16: compactions run while the reader reads
    run_workload(
        procs, str(tmp_path / "store"), shared_writers=5, batches=40,
        opts={"compact_every": 16}, seed=1, figures=figures,
    )


def test_concurrent_writers_with_fsync_and_no_compaction(procs: Any, tmp_path: Path, figures: Any) -> None:
    run_workload(
        procs, str(tmp_path / "store"), shared_writers=3, batches=15,
        opts={"compact_every": 0, "fsync": True}, seed=2, figures=figures,
    )


@pytest.mark.soak
@pytest.mark.parametrize("seed", range(3))
def test_soak_many_writers_many_batches(procs: Any, tmp_path: Path, figures: Any, seed: int) -> None:
    rng = random.Random(seed)
    run_workload(
        procs, str(tmp_path / "store"), shared_writers=8, batches=int(os.environ.get("FSSTORE_SOAK_BATCHES", "300")),
        opts={"compact_every": rng.choice([0, 4, 64]), "fsync": rng.random() < 0.3},
        seed=seed, figures=figures, readers=2,
    )


def test_reader_never_sees_a_later_batch_without_an_earlier_one_in_a_big_directory(
    procs: Any, tmp_path: Path, figures: Any
) -> None:
    """A listing that takes several getdents calls is not atomic (4000 leftover temp files
    make the directory that big): a batch committed during it can be missed while a later
    one is seen. load() must notice the hole and list again (found by this test; fixed in
    97fda66)."""
    root = str(tmp_path / "store")
    store = SyncStore(root, create=True)
    store.append(SHARED, [{"w": "seed", "b": 0, "i": 0, "n": 1}])
    tdir = Path(root, "projects", PROJECT, "sessions", "shared", "main")
    for i in range(4000):  # what killed writers leave behind until `fsstore gc` runs
        (tdir / f".tmp-99999-{i:012x}-1").touch()
    start, stop = procs.Event(), procs.Event()
    rp, rc = procs.Pipe(duplex=False)
    reader = procs.Process(target=_children.reader, args=(root, [SHARED], {}, start, stop, rc, True))
    reader.start()
    rc.close()
    writers = []
    for w in range(3):
        parent, child = procs.Pipe(duplex=False)
        p = procs.Process(
            target=_children.writer, args=(root, SHARED, f"w{w}", 200, w, {}, start, child, stop)
        )
        p.start()
        child.close()
        writers.append((p, parent))
    start.set()
    try:
        for p, conn in writers:
            assert conn.poll(240)
            status, done, *_entries = conn.recv()
            assert status == "ok", done
            p.join(30)
            figures.add("appends", done)
            figures.add("writer processes")
        stop.set()
        assert rp.poll(60)
        result = rp.recv()
    finally:
        stop.set()
        for p in [reader, *(w for w, _ in writers)]:
            if p.is_alive():
                p.kill()
            p.join(10)
    assert result[0] == "ok", result[1]
    assert result[2] == [], result[2][:2]
    assert result[1] >= 20, f"the reader hardly ran ({result[1]} loads)"
    figures.add("reader loads checked", result[1])


def test_append_racing_a_delete_of_a_long_session_id_keeps_it_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete lands between an append's directory walk and its lock. The append must
    start over in a fresh, complete directory (found by this test: filelock used to
    recreate the directory by path, without the .key of a hashed name, so the session
    was never listed again; fixed in ac24c9e)."""
    root = tmp_path / "store"
    key = {"project_key": PROJECT, "session_id": "L" * 300}
    store = SyncStore(root, create=True)
    store.append(key, [{"n": 0}])
    real_open = os.open
    fired = []

    def open_then_delete(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        if not fired and os.path.basename(os.fsdecode(path)).startswith(".tmp-"):
            fired.append(path)  # another process deletes the session right now
            SyncStore(root, create=True).delete(key)
        return fd

    monkeypatch.setattr(os, "open", open_then_delete)
    store.append(key, [{"n": 1}])
    monkeypatch.undo()
    assert fired
    assert store.load(key) == [{"n": 1}]  # the delete came first, then this append
    assert [s["session_id"] for s in store.list_sessions(PROJECT)] == [key["session_id"]]
