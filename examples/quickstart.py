"""fsstore quick start: a session started in one process and resumed in another.

What it shows: two "hosts" (two separate processes, each with its own
``CLAUDE_CONFIG_DIR``, so neither sees the other's local transcript) share only
an fsstore directory. Host A tells the model "Remember the number 42."; host B
resumes that session by id through ``FsSessionStore`` and asks for the number.
B can only answer because the SDK loaded A's turns from the store. At the end
the script shows what is on disk: a short tree and the transcript's entry count.

Offline by default: the real Claude Code CLI (bundled in ``claude-agent-sdk``)
talks to a small stand-in Messages API on loopback (``examples/fake_model.py``).
With ``--real`` and ``ANTHROPIC_API_KEY`` set it talks to the Anthropic API.

    pip install -e '.[claude]'
    python examples/quickstart.py                  # offline, stand-in model
    python examples/quickstart.py --real           # real API (ANTHROPIC_API_KEY)
    python examples/quickstart.py --root /mnt/nfs/agent-sessions

Everything (store, both hosts' config dirs, the project dir) goes under a fresh
temp directory unless ``--workdir`` / ``--root`` say otherwise; it is kept so
you can look around.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # fake_model
try:
    import fsstore  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent))

try:
    import anyio
    from claude_agent_sdk import (
        AssistantMessage,
        ClaudeAgentOptions,
        MirrorErrorMessage,
        ResultMessage,
        TextBlock,
        query,
    )

    from fsstore import FsSessionStore
except ImportError as exc:  # pragma: no cover - depends on the machine
    sys.exit(f"{exc}\nInstall first:  pip install -e '.[claude]'   (from the repository root)")

PROMPT_A = "Remember the number 42. Reply in one short sentence."
PROMPT_B = "What number did I ask you to remember? Reply in one short sentence."


# -- one host: a single query() with the store ----------------------------------------


async def run_host(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one SDK session; return its session id, reply and any mirror errors."""
    options = ClaudeAgentOptions(
        cwd=spec["cwd"],
        session_store=FsSessionStore(spec["root"], create=True),
        resume=spec.get("resume"),
        env={**spec["env"], "CLAUDE_CONFIG_DIR": spec["config_dir"]},
        model=spec.get("model"),
        tools=[],  # a demo conversation: no tools, nothing runs on your machine
        max_turns=1,
    )
    out: dict[str, Any] = {"session_id": None, "reply": "", "mirror_errors": []}
    async for message in query(prompt=spec["prompt"], options=options):
        if isinstance(message, AssistantMessage):
            out["reply"] += "".join(b.text for b in message.content if isinstance(b, TextBlock))
        elif isinstance(message, MirrorErrorMessage):
            out["mirror_errors"].append(message.error)
        elif isinstance(message, ResultMessage):
            out["session_id"] = message.session_id
            if message.is_error:
                out["error"] = message.result or message.subtype
    return out


def host_process(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`run_host` in a new Python process: another "host"."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, __file__, "--host", json.dumps(spec)],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"host {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = time.monotonic() - started
    if result.get("error"):
        sys.exit(f"host {name}: the session ended with an error: {result['error']}")
    return result


# -- showing what is on disk ------------------------------------------------------------


def tree(top: Path, max_files: int = 6) -> list[str]:
    """A short ``tree``-like listing; long file lists are cut to ``max_files``."""
    lines = [f"{top}/"]

    def walk(d: Path, prefix: str) -> None:
        children = sorted(d.iterdir(), key=lambda p: (p.is_file(), p.name))
        dirs = [c for c in children if c.is_dir()]
        files = [c for c in children if not c.is_dir()]
        shown: list[Path | str] = [*dirs, *files[:max_files]]
        if len(files) > max_files:
            shown.append(f"... {len(files) - max_files} more files")
        for i, child in enumerate(shown):
            last = i == len(shown) - 1
            branch = "`-- " if last else "|-- "
            if isinstance(child, str):
                lines.append(f"{prefix}{branch}{child}")
            elif child.is_dir():
                lines.append(f"{prefix}{branch}{child.name}/")
                walk(child, prefix + ("    " if last else "|   "))
            else:
                lines.append(f"{prefix}{branch}{child.name}  ({child.stat().st_size} bytes)")

    walk(top, "")
    return lines


def describe(root: Path, cwd: Path, session_id: str) -> list[str]:
    from claude_agent_sdk import project_key_for_directory

    store = FsSessionStore(root, create=True)
    key = {"project_key": project_key_for_directory(str(cwd)), "session_id": session_id}
    entries = store.sync.load(key) or []
    kinds: dict[str, int] = {}
    for e in entries:
        kinds[e.get("type", "?")] = kinds.get(e.get("type", "?"), 0) + 1
    top = ", ".join(f"{n} {t}" for t, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    main_dir = next(root.glob(f"projects/*/sessions/{session_id}/main"))
    parts = len(list(main_dir.glob("*.jsonl")))
    return [
        f"main transcript of {session_id}: {len(entries)} entries ({top})",
        f"  in {parts} .jsonl parts, one per append() the SDK's mirror made (host A's first, then B's);",
        "  .fsstore marks the directory as a store (fsstore init, or create=True); state.json,",
        "  once compaction has run, is a rebuildable hint (the listing summary); .locks/ holds",
        "  a transcript's lock file only while someone commits.",
    ]


# -- the demo -----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Start a session in one process and resume it in another through fsstore."
    )
    parser.add_argument(
        "--real",
        action="store_true",
        help="use the Anthropic API (needs ANTHROPIC_API_KEY) instead of the stand-in model",
    )
    parser.add_argument(
        "--workdir", type=Path, help="where to put everything (default: a new temp dir)"
    )
    parser.add_argument(
        "--root", type=Path, help="the store directory (default: WORKDIR/store); try a shared mount"
    )
    parser.add_argument("--model", help="model for --real (default: the CLI's default)")
    parser.add_argument("--host", help=argparse.SUPPRESS)  # internal: run one host
    args = parser.parse_args()

    if args.host:
        print(json.dumps(anyio.run(run_host, json.loads(args.host))))
        return

    if args.real and not os.environ.get("ANTHROPIC_API_KEY"):
        sys.exit(
            "--real needs ANTHROPIC_API_KEY in the environment (or drop --real to run offline)."
        )

    work = (args.workdir or Path(tempfile.mkdtemp(prefix="fsstore-demo-"))).resolve()
    root = (args.root or work / "store").resolve()
    cwd = work / "project"
    for d in (work, cwd):
        d.mkdir(parents=True, exist_ok=True)

    model = None
    if args.real:
        env: dict[str, str] = {}  # the CLI inherits ANTHROPIC_API_KEY from this process
        print(
            f"Using the Anthropic API at {os.environ.get('ANTHROPIC_BASE_URL', 'its default URL')}."
        )
    else:
        from fake_model import FakeModel

        model = FakeModel().start()
        env = model.env()
        print(f"Offline: the real Claude Code CLI talks to a stand-in model at {model.url}")
        print("(pass --real to use the Anthropic API with your ANTHROPIC_API_KEY)")
    print(f"store root: {root}\n")

    def spec(host: str, prompt: str, **extra: Any) -> dict[str, Any]:
        return {
            "root": str(root),
            "cwd": str(cwd),
            "env": env,
            "model": args.model,
            "config_dir": str(work / f"host-{host}" / "claude-config"),
            "prompt": prompt,
            **extra,
        }

    try:
        a = host_process("A", spec("a", PROMPT_A))
        print(f"host A (process 1)  > {PROMPT_A}")
        print(f"                    < {a['reply']}")
        print(f"                      session {a['session_id']}  [{a['seconds']:.1f}s]")
        for err in a["mirror_errors"]:
            print(f"mirror error reported by the SDK: {err}")
        if a["mirror_errors"]:
            sys.exit("host A's session was not fully mirrored to the store; see the errors above.")
        b = host_process("B", spec("b", PROMPT_B, resume=a["session_id"]))
        print(f"host B (process 2)  resume={a['session_id']}")
        print(f"                    > {PROMPT_B}")
        print(f"                    < {b['reply']}  [{b['seconds']:.1f}s]")
        if model is not None:
            sent = [r for r in model.messages_requests() if PROMPT_B in r.text]
            carried = bool(sent) and all("Remember the number 42." in r.text for r in sent)
            print(
                f"\nThe request host B's CLI sent to the model {'carried' if carried else 'LACKED'} "
                "host A's turn: B had it only from the store."
            )
    finally:
        if model is not None:
            model.stop()

    for err in b["mirror_errors"]:
        print(f"mirror error reported by the SDK: {err}")

    print("\nWhat is on disk:")
    print("\n".join(tree(root)))
    print("\n".join(describe(root, cwd, a["session_id"])))
    if "42" not in b["reply"]:
        sys.exit("host B did not recall the number: the session did not come across.")
    print("\nNext, list the store's sessions (`fsstore check` verifies every file):")
    print(f"  fsstore ls {shlex.quote(str(root))}")


if __name__ == "__main__":
    main()
