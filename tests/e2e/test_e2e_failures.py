"""A full store does not break the agent, and the SDK tells the operator why.

The store root sits on a size-limited tmpfs that is filled to the last block.
Through the real SDK and CLI:

* the agent session still completes (the CLI's local transcript is the durable
  copy);
* the SDK reports the dropped mirror batch as a ``MirrorErrorMessage`` whose
  text names the errno (``ENOSPC``) and the operation (``append``), which is
  what operators alert on; the failed appends leave nothing behind in the store;
* once space is freed the next session mirrors normally, and the gap can be
  repaired with ``import_session_to_store`` from the host's local transcript,
  after which another host resumes the once-failed session.

Needs root (to mount the tmpfs); skipped with the reason otherwise.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsstore import FsSessionStore

pytestmark = pytest.mark.anyio


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a size-limited tmpfs (mount -t tmpfs -o size=...)")
    mnt = tmp_path / "small-tmpfs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(mnt)],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem under it has no block left."""
    chunk = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        for size in (4096, 1):  # the last partial blocks
            while True:
                try:
                    f.write(b"\0" * size)
                except OSError:
                    break


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


async def test_full_store_reports_enospc_and_recovers(
    hosts: Any, small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from claude_agent_sdk import import_session_to_store

    hosts.root = small_tmpfs / "store"
    store = FsSessionStore(hosts.root, create=True)
    filler = small_tmpfs / "filler"
    fill(filler)

    a = await hosts.run_here("a", "Remember the number 7.")

    # The agent session itself completed...
    assert (a["subtype"], a["is_error"], a["result"]) == (
        "success",
        False,
        "OK, I will remember 7.",
    )
    sid = a["session_id"]
    assert "Remember the number 7." in hosts.local_transcript("a", sid).read_text()
    # ...and the SDK said, in words an alert can match, what failed and why.
    assert a["mirror_errors"], "the full store went unreported"
    for reported in a["mirror_errors"]:
        assert reported["key"] == hosts.key(sid)
        assert reported["error"].startswith(f"fsstore ENOSPC during append at {hosts.root}/"), (
            reported
        )
        assert "No space left on device" in reported["error"]
    # Failed appends leave no part, no temp file: the store simply lacks the session.
    assert store.sync.load(hosts.key(sid)) is None
    assert files_under(hosts.root) == []

    filler.unlink()

    a2 = await hosts.run_here("a", "Remember the number 8.")
    assert a2["mirror_errors"] == []
    mirrored = store.sync.load(hosts.key(a2["session_id"]))
    assert mirrored is not None and "Remember the number 8." in str(mirrored)

    # Repair the gap from host A's local copy; then host B resumes the session.
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(hosts.config_dir("a")))
    await import_session_to_store(sid, store, directory=str(hosts.cwd))
    b = hosts.run("b", "What number did I ask you to remember?", resume=sid)
    assert b["result"] == "You asked me to remember 7."
