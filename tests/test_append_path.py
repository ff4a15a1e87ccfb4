"""The append path, seen from the kernel: one listing of a small directory, a flat cost."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import anyio
import pytest

from fsstore import FsSessionStore, _layout

from ._helpers import tdir
from .conftest import KEY, entry

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")

_SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r})
from fsstore._store import SyncStore
s = SyncStore({root!r}, create=True, compact_every={compact_every})
for i in range(1, {n} + 1):
    if i in {marks!r}:
        try: os.stat(f"/MARK-begin-{{i}}")
        except OSError: pass
    s.append({key!r}, [{{"type": "x", "uuid": f"{{i}}-{{j}}", "t": "y" * 300}} for j in range(5)])
    if i in {marks!r}:
        try: os.stat(f"/MARK-end-{{i}}")
        except OSError: pass
    s._compactions.done()  # outside the marks: when the thread merges is not the next append's
"""


def traced_appends(root: Path, n: int, marks: tuple[int, ...], compact_every: int) -> dict[int, Counter[str]]:
    """The system calls of appends number ``marks``, by name; ``futex`` left out (the
    GIL changing hands with a compaction's thread, not work of the append)."""
    return {i: Counter(m.group(1) for ln in lines
                       if (m := re.match(r"(?:\d+\s+)?(\w+)\(", ln)) and m.group(1) != "futex")
            for i, lines in traced_lines(root, n, marks, compact_every).items()}


def traced_lines(root: Path, n: int, marks: tuple[int, ...], compact_every: int) -> dict[int, list[str]]:
    """The strace lines of appends number ``marks`` out of ``n``."""
    script = _SCRIPT.format(repo=str(Path(__file__).parent.parent), root=str(root), n=n,
                            marks=marks, key=KEY, compact_every=compact_every)
    out = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/stdout", sys.executable, "-c",
                          textwrap.dedent(script)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    traced: dict[int, list[str]] = {}
    for i in marks:
        s = next(k for k, ln in enumerate(lines) if f"/MARK-begin-{i}\"" in ln)
        e = next(k for k, ln in enumerate(lines) if f"/MARK-end-{i}\"" in ln)
        thread = lines[s].split()[0]  # the appending thread's (a compaction's thread is another)
        traced[i] = [ln for ln in lines[s + 1:e] if ln.split()[0] == thread]
    return traced


def test_an_append_lists_its_directory_twice_and_its_syscalls_do_not_grow(root: Path) -> None:
    """The check lists the transcript directory twice per append; compaction keeps it
    small, so append 300 (after 37 compactions, one every 8 appends, which left
    segments 1-256, 257-288 and 289-296) makes exactly the calls append 10 makes."""
    calls = traced_appends(root, 300, (10, 300), compact_every=8)
    assert calls[10]["getdents64"] == calls[300]["getdents64"] == 4  # two listings, each then its end
    for i in (10, 300):  # the record's touch, and the mtime's tick where the clock had not moved
        assert calls[i].pop("utimensat") in (1, 2), calls[i]  # (a flake while it was counted: load)
    assert calls[300] == calls[10]  # same calls, same counts: no O(parts) work


def test_automatic_compaction_comes_once_per_compact_every_appends_after_the_append(root: Path) -> None:
    """64 is the compaction cadence: appends 64 and 128 find it due and leave it to a
    thread of the process, so each lists its directory as append 10 does (the
    compaction's listings are the thread's); the parts are merged all the same."""
    calls = traced_appends(root, 131, (10, 128, 131), compact_every=64)
    assert calls[128]["getdents64"] == calls[10]["getdents64"] == 4
    assert calls[131] == calls[10]
    items = sorted(r for p in tdir(root, KEY).iterdir() if (r := _layout.parse_item(p.name)))
    segments = [it for it in items if it[0] != it[1]]
    # Merged all the same, by the thread (after 64, then 1-64 and 65-128 into one), then
    # parts 129 to 131.
    assert segments == [(1, 128)] and len(items) == 4, items


@pytest.mark.anyio
async def test_cancelled_append_commits_whole_or_not_at_all(root: Path) -> None:
    store = FsSessionStore(root, create=True)
    for i in range(30):
        with anyio.move_on_after(0.0005 * (i % 5)):
            await store.append(KEY, [entry(2 * i), entry(2 * i + 1)])
    loaded = await store.load(KEY) or []
    uuids = [e["uuid"] for e in loaded]
    # Each batch is there with both entries, or absent; never half.
    for a, b in zip(uuids[::2], uuids[1::2]):
        assert int(b[2:]) == int(a[2:]) + 1
    assert len(uuids) % 2 == 0
    assert not [p for p in root.rglob(".tmp-*")]


def test_a_steady_append_links_its_part_and_rewrites_no_shared_file(root: Path) -> None:
    """Format 2: a commit is one link of the batch's temp file to its part name; no
    file another host reads is replaced (no rename at all), no state file touched."""
    lines = traced_lines(root, 12, (10,), compact_every=0)[10]
    assert len([ln for ln in lines if re.search(r"\blinkat\(.*\.tmp-.*0000000010\.jsonl", ln)]) == 1
    assert not [ln for ln in lines if re.search(r"\brenameat2?\(", ln)]
    assert not [ln for ln in lines if "state" in ln]
