"""One "host" of the end-to-end tests: a single SDK ``query()`` with ``FsSessionStore``.

A host is what the tests start twice (or more) to prove a session crosses
machines only through the store: each host is its own process with its own
``CLAUDE_CONFIG_DIR`` (its private local transcript copy), and all of them share
only the store root and the stand-in model's URL.

Run in-process with :func:`run_session` (async), or as a separate process::

    python tests/e2e/_host.py '<spec as JSON>'

which prints the :func:`run_session` result as one JSON object on stdout.
The spec keys: ``root``, ``cwd``, ``config_dir``, ``env`` (the model's env),
``prompt``; optional ``resume``, ``continue_conversation``, ``tmpdir`` (where
the SDK materializes a resumed session; listed at the first message so a test
can see what was materialized), ``timeout`` (seconds).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

# Importable when run as a script from anywhere (fsstore may be installed editable or not).
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import anyio
from claude_agent_sdk import (
    AssistantMessage,
    ClaudeAgentOptions,
    MirrorErrorMessage,
    ResultMessage,
    SystemMessage,
    TextBlock,
    query,
)

from fsstore import FsSessionStore


class RecordingStore(FsSessionStore):
    """``FsSessionStore`` that also notes which protocol calls the SDK made."""

    def __init__(self, root: str, *, create: bool = False) -> None:
        super().__init__(root, create=create)
        self.calls: list[list[Any]] = []

    async def append(self, key: Any, entries: list[dict[str, Any]]) -> None:
        self.calls.append(["append", dict(key), len(entries)])
        await super().append(key, entries)

    async def load(self, key: Any) -> list[dict[str, Any]] | None:
        out = await super().load(key)
        self.calls.append(["load", dict(key), None if out is None else len(out)])
        return out

    async def list_sessions(self, project_key: str) -> list[dict[str, Any]]:
        out = await super().list_sessions(project_key)
        self.calls.append(["list_sessions", project_key, len(out)])
        return out

    async def list_subkeys(self, key: Any) -> list[str]:
        out = await super().list_subkeys(key)
        self.calls.append(["list_subkeys", dict(key), out])
        return out


def _listing(top: str) -> list[str]:
    found = []
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            found.append(os.path.relpath(os.path.join(dirpath, name), top))
    return sorted(found)


def _note(out: dict[str, Any], message: object, spec: dict[str, Any]) -> None:
    if out["materialized"] is None and spec.get("tmpdir"):
        out["materialized"] = _listing(spec["tmpdir"])
    if isinstance(message, MirrorErrorMessage):
        out["mirror_errors"].append({"error": message.error, "key": message.key})
    elif isinstance(message, SystemMessage) and message.subtype == "init":
        out["session_id"] = message.data.get("session_id")
    elif isinstance(message, AssistantMessage):
        out["assistant_texts"].extend(b.text for b in message.content if isinstance(b, TextBlock))
    elif isinstance(message, ResultMessage):
        out.update(
            session_id=message.session_id,
            result=message.result,
            is_error=message.is_error,
            subtype=message.subtype,
        )


async def run_session(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one query() through the real bundled CLI; summarize what came back."""
    if spec.get("tmpdir"):
        tempfile.tempdir = spec["tmpdir"]  # the SDK materializes resumes under here
    os.makedirs(spec["config_dir"], exist_ok=True)
    os.makedirs(spec["cwd"], exist_ok=True)
    store = RecordingStore(spec["root"], create=True)
    options = ClaudeAgentOptions(
        cwd=spec["cwd"],
        session_store=store,
        resume=spec.get("resume"),
        continue_conversation=bool(spec.get("continue_conversation")),
        env={**spec["env"], "CLAUDE_CONFIG_DIR": spec["config_dir"]},
        max_turns=spec.get("max_turns", 4),
    )
    out: dict[str, Any] = {
        "session_id": None,
        "result": None,
        "is_error": None,
        "subtype": None,
        "assistant_texts": [],
        "mirror_errors": [],
        "materialized": None,
        "error": None,
    }
    started = time.monotonic()
    try:
        with anyio.fail_after(spec.get("timeout", 120)):
            async for message in query(prompt=spec["prompt"], options=options):
                _note(out, message, spec)
    except Exception as exc:  # noqa: BLE001 - reported: a test may expect a failed session
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["elapsed_s"] = round(time.monotonic() - started, 3)
    out["store_calls"] = store.calls
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = anyio.run(run_session, spec)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
