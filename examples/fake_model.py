"""A tiny, deterministic stand-in for the Anthropic Messages API, on loopback.

It lets the real Claude Code CLI (bundled in the ``claude-agent-sdk`` wheel) run
offline. Point the CLI at it with::

    ANTHROPIC_BASE_URL=http://127.0.0.1:<port>   ANTHROPIC_API_KEY=<any string>
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1   DISABLE_TELEMETRY=1

What it proves to a test: the reply depends on the conversation the CLI sends,
so a resumed session can be told apart from a fresh one. The rules, applied to
the last user message (the first that matches wins):

* it carries a ``tool_result`` -> ``The subagent reported: <result text>``
* ``Remember the number N``    -> ``OK, I will remember N.``
* ``What number ...``          -> ``You asked me to remember N.`` if an *earlier*
  user turn of the request said "Remember the number N", else
  ``Nobody asked me to remember a number.``
* ``Delegate: <task>`` (and the request offers the ``Agent``/``Task`` tool) ->
  a ``tool_use`` block that starts a subagent with ``<task>`` as its prompt
* anything else                -> ``Echo: <text>``

Every request is recorded (path, headers, parsed body, reply) in
:attr:`FakeModel.requests`; the ``x-api-key`` header tells which "host" sent it
when each host uses its own key. The CLI streams (``"stream": true``), so the
reply is sent as the server-sent events the CLI expects: ``message_start``,
``content_block_start``, ``content_block_delta``, ``content_block_stop``,
``message_delta``, ``message_stop``. Non-streaming requests get the plain JSON
message; ``/v1/messages/count_tokens`` gets a token count.

Run it standalone with ``python examples/fake_model.py [--port N]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REMEMBER = re.compile(r"remember the number (\d+)", re.IGNORECASE)
RECALL = re.compile(r"\bwhat number\b", re.IGNORECASE)
DELEGATE = re.compile(r"\bdelegate:\s*(.+)", re.IGNORECASE | re.DOTALL)
SUBAGENT_TOOLS = ("Agent", "Task")


@dataclass
class Recorded:
    """One request the CLI sent, and what the stand-in answered."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    reply: list[dict[str, Any]] = field(default_factory=list)

    @property
    def api_key(self) -> str:
        return self.headers.get("x-api-key", "")

    @property
    def text(self) -> str:
        """The whole request body as JSON text (for "did X reach the model" checks)."""
        return json.dumps(self.body, ensure_ascii=False)

    @property
    def reply_text(self) -> str:
        return "".join(b.get("text", "") for b in self.reply if b.get("type") == "text")


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content or [] if isinstance(b, dict)]


def _user_text(message: dict[str, Any]) -> str:
    """What the user typed in one message (system reminders left out)."""
    texts = [
        b.get("text", "")
        for b in _blocks(message)
        if b.get("type") == "text"
        and not b.get("text", "").lstrip().startswith("<system-reminder>")
    ]
    return "\n".join(t for t in texts if t)


def _tool_result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    return " ".join(b.get("text", "") for b in content or [] if isinstance(b, dict))


def decide(body: dict[str, Any], tool_ids: Iterator[int]) -> list[dict[str, Any]]:
    """The reply's content blocks for a request body (see the module docstring)."""
    users = [m for m in body.get("messages", []) if m.get("role") == "user"]
    if not users:
        return [{"type": "text", "text": "Echo: (nothing)"}]
    last = users[-1]
    results = [b for b in _blocks(last) if b.get("type") == "tool_result"]
    if results:
        return [
            {"type": "text", "text": f"The subagent reported: {_tool_result_text(results[-1])}"}
        ]
    text = _user_text(last)
    if m := REMEMBER.search(text):
        return [{"type": "text", "text": f"OK, I will remember {m.group(1)}."}]
    if RECALL.search(text):
        for earlier in reversed(users[:-1]):
            if m := REMEMBER.search(_user_text(earlier)):
                return [{"type": "text", "text": f"You asked me to remember {m.group(1)}."}]
        return [{"type": "text", "text": "Nobody asked me to remember a number."}]
    tools = {t.get("name") for t in body.get("tools", []) if isinstance(t, dict)}
    tool = next((name for name in SUBAGENT_TOOLS if name in tools), None)
    if (m := DELEGATE.search(text)) and tool is not None:
        task = m.group(1).strip()
        return [
            {"type": "text", "text": "Starting a subagent."},
            {
                "type": "tool_use",
                "id": f"toolu_fake{next(tool_ids):08d}",
                "name": tool,
                "input": {
                    "description": "Delegated task",
                    "prompt": task,
                    "subagent_type": "general-purpose",
                    "run_in_background": False,
                },
            },
        ]
    return [{"type": "text", "text": f"Echo: {text}"}]


def _sse(blocks: list[dict[str, Any]], message: dict[str, Any], stop: str) -> bytes:
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": {**message, "content": []}}),
    ]
    for i, block in enumerate(blocks):
        start: dict[str, Any]
        delta: dict[str, Any]
        if block["type"] == "text":
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [
            (
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": start},
            ),
            ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": i}),
        ]
    events += [
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 8},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events).encode()


class FakeModel:
    """The stand-in Messages API, served from a daemon thread.

    Use as a context manager (``with FakeModel() as model: model.url``) or call
    :meth:`start` / :meth:`stop`. ``port=0`` picks a free port.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else host
        return f"http://{name}:{port}"

    def env(self, api_key: str = "fake-key") -> dict[str, str]:
        """The environment that points a Claude Code CLI at this server."""
        return {
            "ANTHROPIC_BASE_URL": self.url,
            "ANTHROPIC_API_KEY": api_key,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
        }

    def start(self) -> FakeModel:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeModel:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def messages_requests(self, api_key: str | None = None, since: int = 0) -> list[Recorded]:
        """The ``/v1/messages`` requests (optionally one host's, from index ``since`` on)."""
        with self._lock:
            found = [r for r in self.requests[since:] if r.path.split("?")[0] == "/v1/messages"]
        return [r for r in found if api_key is None or r.api_key == api_key]

    def _record(self, rec: Recorded) -> None:
        with self._lock:
            self.requests.append(rec)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        model = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, ctype: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                model._record(
                    Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, {})
                )
                self._send(
                    404,
                    "application/json",
                    b'{"type":"error","error":{"type":"not_found_error","message":"stand-in"}}',
                )

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    body = {}
                rec = Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                path = self.path.split("?")[0]
                if path.endswith("/count_tokens"):
                    model._record(rec)
                    self._send(200, "application/json", b'{"input_tokens": 42}')
                    return
                if path != "/v1/messages":
                    model._record(rec)
                    self._send(
                        404,
                        "application/json",
                        b'{"type":"error","error":{"type":"not_found_error","message":"stand-in"}}',
                    )
                    return
                rec.reply = decide(body, model._ids)
                model._record(rec)
                stop = "tool_use" if any(b["type"] == "tool_use" for b in rec.reply) else "end_turn"
                message = {
                    "id": f"msg_fake{next(model._ids):08d}",
                    "type": "message",
                    "role": "assistant",
                    "model": body.get("model", "fake-model"),
                    "content": rec.reply,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": 10, "output_tokens": 1},
                }
                if body.get("stream"):
                    self._send(200, "text/event-stream", _sse(rec.reply, message, stop))
                else:
                    done = {
                        **message,
                        "stop_reason": stop,
                        "usage": {"input_tokens": 10, "output_tokens": 8},
                    }
                    self._send(200, "application/json", json.dumps(done).encode())

        return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    model = FakeModel(port=args.port)
    print(f"stand-in model at {model.url}  (Ctrl+C to stop)", flush=True)
    for key, value in model.env().items():
        print(f"export {key}={value}")
    try:
        model._server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
