"""A stateful hypothesis test: fsstore against the SDK's InMemorySessionStore as the model."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Coroutine
from typing import Any, TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from fsstore._store import SyncStore

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Drive one of InMemorySessionStore's coroutines; they never await anything."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    raise AssertionError("InMemorySessionStore awaited something")


projects = st.sampled_from(["-home-a", "-Home-A", "proj"])
sessions = st.sampled_from(["s1", "S1", "s2"])
subpaths = st.sampled_from([None, "subagents/agent-1", "subagents/agent-2", "x"])
uuids = st.one_of(st.none(), st.sampled_from(["a", "b", "c", "d"]))


@st.composite
def batches(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for _ in range(draw(st.integers(0, 3))):
        e: dict[str, Any] = {"type": draw(st.sampled_from(["user", "assistant", "x"])),
                             "n": draw(st.integers())}
        u = draw(uuids)
        if u is not None:
            e["uuid"] = u
        if draw(st.booleans()):
            e["customTitle"] = draw(st.sampled_from(["t1", "t2"]))
        out.append(e)
    return out


def _dedupe(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if entries is None:
        return None
    seen: set[str] = set()
    out = []
    for e in entries:
        u = e.get("uuid")
        if isinstance(u, str):
            if u in seen:
                continue
            seen.add(u)
        out.append(e)
    return out


class StoreMatchesModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        from claude_agent_sdk import InMemorySessionStore

        self.dir = tempfile.mkdtemp(prefix="fsstore-stateful-")
        self.store = SyncStore(self.dir, create=True)
        self.model = InMemorySessionStore()
        self.keys: set[tuple[str, str, str | None]] = set()

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _key(p: str, s: str, sp: str | None) -> dict[str, Any]:
        k: dict[str, Any] = {"project_key": p, "session_id": s}
        if sp is not None:
            k["subpath"] = sp
        return k

    @rule(p=projects, s=sessions, sp=subpaths, batch=batches())
    def append(self, p: str, s: str, sp: str | None, batch: list[dict[str, Any]]) -> None:
        key = self._key(p, s, sp)
        self.store.append(key, batch)
        run(self.model.append(key, batch))
        if batch:
            self.keys.add((p, s, sp))

    @rule(p=projects, s=sessions, sp=subpaths)
    def delete(self, p: str, s: str, sp: str | None) -> None:
        key = self._key(p, s, sp)
        self.store.delete(key)
        run(self.model.delete(key))

    @rule(p=projects, s=sessions, sp=subpaths)
    def load(self, p: str, s: str, sp: str | None) -> None:
        key = self._key(p, s, sp)
        # The model keeps duplicates; the store de-duplicates by uuid (the SDK's guidance).
        expected = _dedupe(run(self.model.load(key)))
        assert self.store.load(key) == (expected or None)

    @invariant()
    def every_written_key_loads_like_the_model(self) -> None:
        for p, s, sp in self.keys:
            self.load(p, s, sp)

    @invariant()
    def listings_agree(self) -> None:
        for p in ("-home-a", "-Home-A", "proj"):
            got = sorted(e["session_id"] for e in self.store.list_sessions(p))
            want = sorted(e["session_id"] for e in run(self.model.list_sessions(p))
                          if run(self.model.load({"project_key": p, "session_id": e["session_id"]})))
            assert got == want
            summaries = {e["session_id"]: e["data"] for e in self.store.list_session_summaries(p)}
            model = {e["session_id"]: e["data"] for e in run(self.model.list_session_summaries(p))}
            assert summaries == {k: v for k, v in model.items() if k in summaries}
            assert set(summaries) == set(got)
            for s in ("s1", "S1", "s2"):
                key = {"project_key": p, "session_id": s}
                want_sub = sorted(x for x in run(self.model.list_subkeys(key))
                                  if run(self.model.load({**key, "subpath": x})))
                assert sorted(self.store.list_subkeys(key)) == want_sub


StoreMatchesModel.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
test_store_matches_in_memory_model = StoreMatchesModel.TestCase
