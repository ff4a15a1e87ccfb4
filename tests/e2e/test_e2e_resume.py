"""A session crosses hosts only through the store: resume, continue, and subagents.

Through the real SDK and bundled CLI, with ``session_store=FsSessionStore(root, create=True)``:

* the quick start: host A is told "Remember the number 42."; host B (another
  process, another ``CLAUDE_CONFIG_DIR``) resumes by session id, and the request
  B's CLI sends to the model carries A's turns, so the model answers 42; without
  the store B cannot resume at all;
* ``continue_conversation=True`` on a host with no local sessions resumes the
  project's most recently written session in the store;
* a subagent's transcript is mirrored under its own subpath and materialized
  for the CLI when another host resumes the session (``list_subkeys``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fsstore import FsSessionStore

pytestmark = pytest.mark.anyio

RECALL = "What number did I ask you to remember?"


def conversation(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, text) of each text block the CLI sent, system reminders left out."""
    out = []
    for message in body["messages"]:
        content = message["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for block in blocks:
            text = block.get("text", "") if block.get("type") == "text" else ""
            if text and not text.lstrip().startswith("<system-reminder>"):
                out.append((message["role"], text))
    return out


async def test_quick_start_resume_on_another_host(hosts: Any) -> None:
    store = FsSessionStore(hosts.root, create=True)

    a = await hosts.run_here("a", "Remember the number 42.")
    assert a["result"] == "OK, I will remember 42."
    assert a["mirror_errors"] == []
    sid = a["session_id"]
    mirrored = store.sync.load(hosts.key(sid))
    assert mirrored is not None
    assert "Remember the number 42." in json.dumps(mirrored)
    assert not hosts.config_dir("b").exists()  # B starts with no local copy of anything

    b = hosts.run("b", RECALL, resume=sid)

    assert b["session_id"] == sid
    assert b["result"] == "You asked me to remember 42."
    [request] = hosts.requests("b")
    turns = conversation(request.body)
    assert ("user", "Remember the number 42.") in turns
    assert ("assistant", "OK, I will remember 42.") in turns
    assert turns[-1] == ("user", RECALL)
    assert turns.index(("user", "Remember the number 42.")) < turns.index(
        ("assistant", "OK, I will remember 42.")
    )
    # B's own turn went back into the store, after A's entries.
    after = store.sync.load(hosts.key(sid))
    assert after is not None and after[: len(mirrored)] == mirrored
    assert "You asked me to remember 42." in json.dumps(after[len(mirrored) :])
    # B's process read the session from the store, not from A's disk.
    assert ["load", hosts.key(sid), len(mirrored)] in b["store_calls"]


async def test_without_the_store_the_other_host_cannot_resume(hosts: Any, tmp_path: Path) -> None:
    a = await hosts.run_here("a", "Remember the number 42.")
    empty = tmp_path / "empty-store"

    c = hosts.run("c", RECALL, resume=a["session_id"], root=str(empty), expect_error=True)

    assert c["error"] is not None
    assert f"No conversation found with session ID: {a['session_id']}" in c["error"]
    assert hosts.requests("c") == []  # nothing reached the model


async def test_continue_conversation_picks_the_most_recent_session_in_the_store(
    hosts: Any,
) -> None:
    from claude_agent_sdk import tag_session_via_store

    store = FsSessionStore(hosts.root, create=True)
    first = await hosts.run_here("a", "Remember the number 1.")
    second = await hosts.run_here("a", "Remember the number 2.")
    assert first["session_id"] != second["session_id"]

    # B has never run anything: --continue can only come from the store.
    b = hosts.run("b", RECALL, continue_conversation=True)
    assert b["session_id"] == second["session_id"]
    assert b["result"] == "You asked me to remember 2."
    assert any(call[0] == "list_sessions" for call in b["store_calls"])

    # Writing to the older session makes it the most recent one.
    await tag_session_via_store(store, first["session_id"], "bumped", directory=str(hosts.cwd))
    c = hosts.run("c", RECALL, continue_conversation=True)
    assert c["session_id"] == first["session_id"]
    assert c["result"] == "You asked me to remember 1."


async def test_subagent_transcript_is_mirrored_and_materialized_on_resume(
    hosts: Any, tmp_path: Path
) -> None:
    from claude_agent_sdk import get_subagent_messages_from_store, list_subagents_from_store

    store = FsSessionStore(hosts.root, create=True)
    a = await hosts.run_here("a", "Delegate: Say hello from the subagent.")
    sid = a["session_id"]
    assert a["mirror_errors"] == []
    assert a["result"].startswith("The subagent reported:")
    assert "Echo: Say hello from the subagent." in a["result"]  # the subagent's own turn
    assert len(hosts.requests("a")) == 3  # parent asks, subagent answers, parent wraps up

    # Mirrored under the session, on its own subpath, the same entries as A's local file.
    [subpath] = store.sync.list_subkeys(hosts.key(sid))
    assert subpath.startswith("subagents/agent-")
    sub_entries = store.sync.load(hosts.key(sid, subpath))
    assert sub_entries is not None
    local = hosts.config_dir("a") / "projects" / hosts.project_key / sid / f"{subpath}.jsonl"
    # (The CLI keeps uuid-less bookkeeping lines, e.g. api-request-*, out of the mirror.)
    local_uuids = [json.loads(line).get("uuid") for line in local.read_text().splitlines()]
    local_uuids = [u for u in local_uuids if u]
    assert [e["uuid"] for e in sub_entries if e.get("uuid")] == local_uuids
    assert "Say hello from the subagent." in json.dumps(sub_entries)
    # The main transcript is a separate key: no subagent line leaked into it.
    main = store.sync.load(hosts.key(sid))
    assert main is not None
    assert not {e.get("uuid") for e in main} & set(local_uuids)
    agent_id = subpath.rsplit("agent-", 1)[1]
    assert await list_subagents_from_store(store, sid, directory=str(hosts.cwd)) == [agent_id]
    messages = await get_subagent_messages_from_store(
        store, sid, agent_id, directory=str(hosts.cwd)
    )
    assert [m.type for m in messages] == ["user", "assistant"]

    # Host B resumes: the SDK lists the subkeys and writes the subagent transcript
    # into the config dir it builds for B's CLI.
    materialized_under = tmp_path / "b-tmp"
    materialized_under.mkdir()
    b = hosts.run("b", "Echo this.", resume=sid, tmpdir=str(materialized_under))
    assert b["result"] == "Echo: Echo this."
    assert ["list_subkeys", hosts.key(sid), [subpath]] in b["store_calls"]
    assert ["load", hosts.key(sid, subpath), len(sub_entries)] in b["store_calls"]
    suffix = f"projects/{hosts.project_key}/{sid}/{subpath}.jsonl"
    seen = [p for p in b["materialized"] if p.endswith(suffix)]
    assert len(seen) == 1, b["materialized"]
    assert any(p.endswith(f"{subpath}.meta.json") for p in b["materialized"]), b["materialized"]
    # Resuming did not disturb the subagent's transcript in the store.
    assert store.sync.load(hosts.key(sid, subpath)) == sub_entries
