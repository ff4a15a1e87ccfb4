"""The README's first command works: examples/quickstart.py, offline, end to end.

Runs the example exactly as a newcomer would (a fresh process, the stand-in
model, a new work directory) and checks what it promises: host B recalls host
A's number, the request B's CLI sent carried A's turn, and the closing summary
shows the store's tree and the transcript's entry count. ``--real`` without an
API key refuses clearly instead of hanging or calling the network.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from claude_agent_sdk import project_key_for_directory

from fsstore import FsSessionStore

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}


def test_quickstart_runs_offline(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--workdir", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    m = re.search(r"session ([0-9a-f-]{36})", out)
    assert m, out
    sid = m.group(1)
    assert "< OK, I will remember 42." in out
    assert f"resume={sid}" in out
    assert "< You asked me to remember 42." in out
    assert "carried host A's turn" in out
    # The closing summary: a tree of the store and the entry count, which is the truth.
    assert f"{tmp_path / 'store'}/" in out
    assert ".fsstore" in out
    [line] = [ln for ln in out.splitlines() if ln.startswith(f"main transcript of {sid}: ")]
    count = int(line.split(": ")[1].split()[0])
    store = FsSessionStore(tmp_path / "store", create=True)
    project_key = project_key_for_directory(str(tmp_path.resolve() / "project"))
    assert [s["session_id"] for s in store.sync.list_sessions(project_key)] == [sid]
    loaded = store.sync.load({"project_key": project_key, "session_id": sid})
    assert loaded is not None and count == len(loaded)
    # Nothing in the tree is left unexplained, and it ends with what to run next.
    tree, explained = out.split("What is on disk:")[1].split(f"main transcript of {sid}")
    for name in (".fsstore", "state.json", ".locks"):
        assert name not in tree or name in explained, name
    assert out.rstrip().splitlines()[-1].strip() == f"fsstore ls {tmp_path / 'store'}"


def test_real_mode_needs_an_api_key(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--real", "--workdir", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert done.returncode != 0
    assert "ANTHROPIC_API_KEY" in done.stderr
    assert not (tmp_path / "store").exists()
