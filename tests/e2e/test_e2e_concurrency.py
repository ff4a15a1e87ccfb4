"""Several SDK sessions in several processes write one store root at the same time.

Through the real SDK and CLI, all in the same project of one store:

* three host processes each run a session at once; every session is mirrored
  whole, listed (fast path, first prompts right), and resumable afterwards by
  yet other processes, each recalling its own number;
* while those resumes run, one more process resumes one of the sessions too: two
  writers append to the same transcript concurrently and neither turn is lost
  or duplicated.
"""

from __future__ import annotations

from typing import Any

import pytest
from claude_agent_sdk import list_sessions_from_store

from fsstore import FsSessionStore

pytestmark = pytest.mark.anyio

N = 3
RECALL = "What number did I ask you to remember?"


async def test_concurrent_sessions_from_several_processes(hosts: Any) -> None:
    store = FsSessionStore(hosts.root, create=True)
    numbers = [100 + i for i in range(N)]

    started = [hosts.start(f"w{i}", f"Remember the number {n}.") for i, n in enumerate(numbers)]
    first = [hosts.wait(p, f"w{i}") for i, p in enumerate(started)]

    sids = [r["session_id"] for r in first]
    assert len(set(sids)) == N
    for r, n in zip(first, numbers):
        assert r["result"] == f"OK, I will remember {n}."
        assert r["mirror_errors"] == []
    assert sorted(s["session_id"] for s in store.sync.list_sessions(hosts.project_key)) == sorted(
        sids
    )
    infos = {
        i.session_id: i for i in await list_sessions_from_store(store, directory=str(hosts.cwd))
    }
    assert {sid: infos[sid].first_prompt for sid in sids} == {
        sid: f"Remember the number {n}." for sid, n in zip(sids, numbers)
    }
    before = {sid: store.sync.load(hosts.key(sid)) for sid in sids}

    # Everything resumable elsewhere; session 0 gets two concurrent writers.
    second = [hosts.start(f"r{i}", RECALL, resume=sid) for i, sid in enumerate(sids)]
    extra = hosts.start("x", "Echo from the second writer.", resume=sids[0])
    resumed = [hosts.wait(p, f"r{i}") for i, p in enumerate(second)]
    other = hosts.wait(extra, "x")

    for r, sid, n in zip(resumed, sids, numbers):
        assert r["session_id"] == sid
        assert r["result"] == f"You asked me to remember {n}."
        assert r["mirror_errors"] == []
    assert other["result"] == "Echo: Echo from the second writer."
    assert other["mirror_errors"] == []

    for i, sid in enumerate(sids):
        entries = store.sync.load(hosts.key(sid))
        assert entries is not None
        prior = before[sid]
        assert prior is not None and entries[: len(prior)] == prior  # history intact, in order
        uuids = [e["uuid"] for e in entries if e.get("uuid")]
        assert len(uuids) == len(set(uuids))
        text = str(entries[len(prior) :])
        assert f"You asked me to remember {numbers[i]}." in text
        if i == 0:
            assert "Echo: Echo from the second writer." in text
        else:
            assert "second writer" not in text
