"""Several writer processes and a reader process on one store: the workload the
concurrency tests run on local disk and the real-mount tests on FUSE (see
test_concurrency.py for what it checks)."""

from __future__ import annotations

from typing import Any

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
