"""The SDK's store helpers work on fsstore, on sessions the real CLI wrote.

A real session is mirrored into the store, then every store-backed helper of
``claude_agent_sdk`` runs against :class:`fsstore.FsSessionStore`:

* ``list_sessions_from_store`` takes the summaries fast path (zero ``load()``
  calls) and agrees with what the SDK derives from the host's local transcript;
* ``get_session_info_from_store`` / ``get_session_messages_from_store`` read it;
* ``rename_session_via_store`` / ``tag_session_via_store`` show up in the listing;
* ``fork_session_via_store`` makes a session another host can resume;
* ``delete_session_via_store`` removes it from every view and from disk;
* ``import_session_to_store`` copies a host's local transcripts (subagent and
  its metadata included) into a store, and another host resumes from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from claude_agent_sdk import (
    delete_session_via_store,
    fork_session_via_store,
    get_session_info_from_store,
    get_session_messages_from_store,
    import_session_to_store,
    list_sessions,
    list_sessions_from_store,
    rename_session_via_store,
    tag_session_via_store,
)

from fsstore import FsSessionStore

pytestmark = pytest.mark.anyio

RECALL = "What number did I ask you to remember?"
COMPARED = ("summary", "first_prompt", "custom_title", "tag", "cwd", "created_at")


class CountingStore(FsSessionStore):
    """Counts the calls that tell the fast path from the slow one."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.loads = 0
        self.summary_calls = 0

    async def load(self, key: Any) -> list[dict[str, Any]] | None:
        self.loads += 1
        return await super().load(key)

    async def list_session_summaries(self, project_key: str) -> list[dict[str, Any]]:
        self.summary_calls += 1
        return await super().list_session_summaries(project_key)


def texts(messages: list[Any]) -> list[tuple[str, str]]:
    out = []
    for m in messages:
        content = m.message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for b in blocks:
            if b.get("type") == "text" and not b["text"].lstrip().startswith("<system-reminder>"):
                out.append((m.type, b["text"]))
    return out


async def test_store_helpers_on_a_real_session(hosts: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    a = await hosts.run_here("a", "Remember the number 42.")
    sid = a["session_id"]
    d = str(hosts.cwd)
    store = CountingStore(hosts.root)

    # Listing: one summaries call, no per-session load.
    [info] = await list_sessions_from_store(store, directory=d)
    assert (store.summary_calls, store.loads) == (1, 0)
    assert info.session_id == sid
    assert info.first_prompt == "Remember the number 42."
    # ... and the same metadata the SDK reads from host A's own local transcript.
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(hosts.config_dir("a")))
    [disk] = list_sessions(directory=d)
    assert {f: getattr(info, f) for f in COMPARED} == {f: getattr(disk, f) for f in COMPARED}
    assert abs(info.last_modified - disk.last_modified) < 60_000

    one = await get_session_info_from_store(store, sid, directory=d)
    assert one is not None and one.session_id == sid
    assert one.first_prompt == "Remember the number 42."

    messages = await get_session_messages_from_store(store, sid, directory=d)
    assert texts(messages) == [
        ("user", "Remember the number 42."),
        ("assistant", "OK, I will remember 42."),
    ]

    await rename_session_via_store(store, sid, "Investigation #1", directory=d)
    await tag_session_via_store(store, sid, "e2e", directory=d)
    loads_before = store.loads
    [info] = await list_sessions_from_store(store, directory=d)
    assert store.loads == loads_before  # still the fast path: the sidecar kept up
    assert (info.summary, info.custom_title, info.tag) == (
        "Investigation #1",
        "Investigation #1",
        "e2e",
    )

    fork = await fork_session_via_store(store, sid, directory=d, title="Fork of 42")
    assert fork.session_id != sid
    listed = {i.session_id: i for i in await list_sessions_from_store(store, directory=d)}
    assert set(listed) == {sid, fork.session_id}
    assert listed[fork.session_id].custom_title == "Fork of 42"
    forked = await get_session_messages_from_store(store, fork.session_id, directory=d)
    assert texts(forked) == texts(messages)
    assert {m.uuid for m in forked}.isdisjoint({m.uuid for m in messages})

    # The fork is a real session: another host resumes it and the model sees A's turns.
    b = hosts.run("b", RECALL, resume=fork.session_id)
    assert b["session_id"] == fork.session_id
    assert b["result"] == "You asked me to remember 42."

    await delete_session_via_store(store, sid, directory=d)
    assert store.sync.load(hosts.key(sid)) is None
    assert await get_session_info_from_store(store, sid, directory=d) is None
    assert [i.session_id for i in await list_sessions_from_store(store, directory=d)] == [
        fork.session_id
    ]
    assert not list(Path(hosts.root).glob(f"projects/*/sessions/{sid}"))
    assert store.sync.load(hosts.key(fork.session_id)) is not None


async def test_import_session_to_store_from_a_hosts_local_transcripts(
    hosts: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A session (with a subagent) that host A mirrored into some other store:
    # the store we import into has never seen it.
    a = await hosts.run_here(
        "a", "Delegate: Say hello from the subagent.", root=str(tmp_path / "old-store")
    )
    sid = a["session_id"]
    old = FsSessionStore(tmp_path / "old-store", create=True)
    new = FsSessionStore(hosts.root, create=True)
    assert new.sync.load(hosts.key(sid)) is None

    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(hosts.config_dir("a")))  # whose local disk
    await import_session_to_store(sid, new, directory=str(hosts.cwd))

    def uuids(entries: list[dict[str, Any]] | None) -> list[str]:
        assert entries is not None
        return [e["uuid"] for e in entries if e.get("uuid")]

    assert uuids(new.sync.load(hosts.key(sid))) == uuids(old.sync.load(hosts.key(sid)))
    [subpath] = old.sync.list_subkeys(hosts.key(sid))
    assert new.sync.list_subkeys(hosts.key(sid)) == [subpath]
    imported_sub = new.sync.load(hosts.key(sid, subpath))
    assert uuids(imported_sub) == uuids(old.sync.load(hosts.key(sid, subpath)))
    assert imported_sub is not None
    assert [e["agentType"] for e in imported_sub if e["type"] == "agent_metadata"] == [
        "general-purpose"
    ]
    # Importing twice does not duplicate history (uuid-keyed dedupe on load).
    await import_session_to_store(sid, new, directory=str(hosts.cwd))
    assert uuids(new.sync.load(hosts.key(sid))) == uuids(old.sync.load(hosts.key(sid)))

    # Another host resumes from the store it was imported into.
    monkeypatch.delenv("CLAUDE_CONFIG_DIR")
    b = hosts.run("b", "Echo this.", resume=sid)
    assert b["session_id"] == sid
    assert b["result"] == "Echo: Echo this."
    [request] = hosts.requests("b")
    assert "Delegate: Say hello from the subagent." in request.text
    assert "The subagent reported:" in request.text
