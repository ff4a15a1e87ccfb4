"""The stand-in model's answers depend on the conversation it is sent.

The end-to-end tests conclude "the earlier turns reached the model" from the
stand-in's reply, so that inference is checked here on plain request bodies
(no CLI, milliseconds): the recall answer needs an *earlier* user turn, a
tool_use block is produced only when the request offers the subagent tool, and
the SSE stream carries the event sequence the CLI expects.
"""

from __future__ import annotations

import itertools
import json
import urllib.request
from types import ModuleType
from typing import Any


def body(*user_texts: str, tools: tuple[str, ...] = ()) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for i, text in enumerate(user_texts):
        if i:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": "ok"}]})
        messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
    return {"messages": messages, "tools": [{"name": t} for t in tools], "stream": True}


def reply(fm: ModuleType, b: dict[str, Any]) -> list[dict[str, Any]]:
    return list(fm.decide(b, itertools.count(1)))


def test_recall_needs_an_earlier_turn(fake_model_module: ModuleType) -> None:
    fm = fake_model_module
    recall = "What number did I ask you to remember?"
    assert reply(fm, body(recall)) == [
        {"type": "text", "text": "Nobody asked me to remember a number."}
    ]
    assert reply(fm, body("Remember the number 42.", recall)) == [
        {"type": "text", "text": "You asked me to remember 42."}
    ]
    # The number in the *question* does not count: only earlier turns do.
    assert reply(fm, body(f"{recall} Remember the number 5.")) == [
        {"type": "text", "text": "OK, I will remember 5."}
    ]
    reminder = "<system-reminder>Remember the number 9.</system-reminder>"
    assert reply(fm, body(reminder, recall))[0]["text"] == "Nobody asked me to remember a number."


def test_delegate_uses_the_subagent_tool_only_when_offered(fake_model_module: ModuleType) -> None:
    fm = fake_model_module
    assert reply(fm, body("Delegate: count to 3.")) == [
        {"type": "text", "text": "Echo: Delegate: count to 3."}
    ]
    blocks = reply(fm, body("Delegate: count to 3.", tools=("Bash", "Agent")))
    [use] = [b for b in blocks if b["type"] == "tool_use"]
    assert use["name"] == "Agent"
    assert use["input"]["prompt"] == "count to 3."
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "done"}],
    }
    b = body("Delegate: count to 3.", tools=("Agent",))
    b["messages"] += [{"role": "assistant", "content": blocks}, result]
    assert reply(fm, b) == [{"type": "text", "text": "The subagent reported: done"}]


def test_streams_the_events_the_cli_expects(fake_model_module: ModuleType) -> None:
    with fake_model_module.FakeModel() as model:
        request = urllib.request.Request(
            f"{model.url}/v1/messages?beta=true",
            data=json.dumps(body("Delegate: x", tools=("Agent",))).encode(),
            headers={"x-api-key": "key-t", "content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Type"] == "text/event-stream"
            raw = response.read().decode()
    events = [line.split(": ", 1)[1] for line in raw.splitlines() if line.startswith("event: ")]
    block = ["content_block_start", "content_block_delta", "content_block_stop"]
    assert events == ["message_start", *block, *block, "message_delta", "message_stop"]
    data = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    assert data[-2]["delta"]["stop_reason"] == "tool_use"
    [recorded] = model.messages_requests(api_key="key-t")
    assert recorded.reply_text == "Starting a subagent."
