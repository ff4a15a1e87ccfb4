"""Type checkers accept FsSessionStore wherever the SDKs want a SessionStore."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("mypy", reason="mypy not installed")

SNIPPET = """
from claude_agent_sdk import ClaudeAgentOptions
from qoder_agent_sdk import QoderAgentOptions
from fsstore import FsSessionStore, FsStoreError

store = FsSessionStore("/tmp/fsstore-typing", create=True)
ClaudeAgentOptions(session_store=store)
QoderAgentOptions(session_store=store)

def code(err: FsStoreError) -> str:
    return err.code
"""


def test_fsstore_satisfies_both_sdk_protocols_under_mypy_strict(tmp_path: Path) -> None:
    snippet = tmp_path / "use_store.py"
    snippet.write_text(SNIPPET)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(snippet), str(REPO / "fsstore")],
        check=False, capture_output=True, text=True, cwd=REPO,
    )
    assert out.returncode == 0, out.stdout + out.stderr
