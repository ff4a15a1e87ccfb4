"""Entries with a known shape, and the checks every reliability test runs on a store.

An entry names its writer ``w``, its batch ``b``, its index ``i`` in the batch and
the batch size ``n``, so a transcript can be checked without keeping the batches:
every batch contiguous and complete, every batch exactly once, each writer's
batches in its own order. Entries carry no ``uuid`` on purpose: the store
de-duplicates by ``uuid`` on load, which would hide a batch committed twice.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TEMP = re.compile(r"^\.tmp-")
PART = re.compile(r"^[0-9]{20}\.jsonl$")
SEGMENT = re.compile(r"^[0-9]{20}-[0-9]{20}\.jsonl$")

BatchId = tuple[Any, int]  # (writer, batch number)

#: Totals over the run (the conftest prints them): entries that were acknowledged and
#: then checked, and entries that were acknowledged but not found (must stay 0).
TOTALS = {"entries verified (cumulative over checks)": 0, "entries lost": 0}


def batch(w: Any, b: int, n: int, *, pad: int = 0) -> list[dict[str, Any]]:
    """Batch ``b`` of writer ``w``: ``n`` user entries that also drive the summary fold."""
    out = []
    for i in range(n):
        e: dict[str, Any] = {
            "type": "user",
            "w": w,
            "b": b,
            "i": i,
            "n": n,
            "timestamp": "2025-01-01T00:00:00.000Z",
            "message": {"role": "user", "content": f"prompt {w}/{b}/{i}"},
            "lastPrompt": f"{w}/{b}/{i}",  # last-wins: the summary must follow the last batch
        }
        if pad:
            e["pad"] = "x" * pad
        out.append(e)
    return out


def ids(entries: Iterable[Mapping[str, Any]]) -> list[tuple[Any, int, int]]:
    return [(e["w"], e["b"], e["i"]) for e in entries]


@dataclass
class Verdict:
    """What a transcript holds, and everything wrong with it (empty ``problems``: fine)."""

    batches: list[BatchId] = field(default_factory=list)
    entries: int = 0
    problems: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        return not self.problems


def verify(entries: Sequence[Mapping[str, Any]] | None) -> Verdict:
    """Every batch whole and contiguous, none twice, each writer's batches in order."""
    v = Verdict()
    if entries is None:
        return v
    v.entries = len(entries)
    seen: set[BatchId] = set()
    last_b: dict[Any, int] = {}
    i = 0
    while i < len(entries):
        e = entries[i]
        bid = (e["w"], e["b"])
        n = e["n"]
        run = entries[i : i + n]
        if [(x["w"], x["b"], x["i"]) for x in run] != [(bid[0], bid[1], j) for j in range(n)]:
            v.problems.append(f"batch {bid} is not whole and contiguous at entry {i}")
            # resynchronise on the next entry to keep reporting
            i += 1
            continue
        if bid in seen:
            v.problems.append(f"batch {bid} appears twice")
        seen.add(bid)
        if bid[0] in last_b and bid[1] <= last_b[bid[0]]:
            v.problems.append(f"writer {bid[0]!r}: batch {bid[1]} after batch {last_b[bid[0]]}")
        last_b[bid[0]] = bid[1]
        v.batches.append(bid)
        i += n
    return v


def assert_transcript(
    entries: Sequence[Mapping[str, Any]] | None,
    expected: Iterable[BatchId],
    expected_entries: int | None = None,
) -> Verdict:
    """``verify`` and compare with the batches that must be there (order-free).

    ``expected_entries``: how many entries those batches hold; the shortfall, if any,
    is added to ``TOTALS["entries lost"]`` before the assertions fail.
    """
    v = verify(entries)
    if expected_entries is not None:
        TOTALS["entries verified (cumulative over checks)"] += expected_entries
        TOTALS["entries lost"] += max(0, expected_entries - v.entries)
    assert v.ok(), v.problems[:10]
    want = set(expected)
    got = set(v.batches)
    assert got == want, {"lost": sorted(want - got)[:20], "extra": sorted(got - want)[:20]}
    if expected_entries is not None:
        assert v.entries == expected_entries, f"{v.entries} entries, {expected_entries} acknowledged"
    return v


def fold(key: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    from claude_agent_sdk import fold_session_summary

    return fold_session_summary(None, dict(key), list(entries))["data"]  # type: ignore[arg-type]


def assert_summaries_consistent(store: Any, project_key: str) -> int:
    """Every summary the store reports agrees with a fold of the transcript it loads.

    A session may be left out (the SDK then folds it from load()); a summary that is
    there must not disagree. Returns how many summaries were checked.
    """
    summaries = store.list_session_summaries(project_key)
    listed = {s["session_id"]: s["mtime"] for s in store.list_sessions(project_key)}
    for s in summaries:
        key = {"project_key": project_key, "session_id": s["session_id"]}
        loaded = store.load(key)
        assert loaded is not None, f"summary for {s['session_id']!r} without a transcript"
        assert s["session_id"] in listed, f"summary for {s['session_id']!r} not in list_sessions"
        assert s["data"] == fold(key, loaded), f"summary of {s['session_id']!r} disagrees"
    return len(summaries)


def walk(root: str | os.PathLike[str]) -> list[tuple[str, os.stat_result]]:
    """Every path under ``root`` (root included) with its lstat, never following links;
    one removed between the listing and its lstat is left out (a store object of this
    process that goes removes its lock record: soak, seed 1019)."""
    out = []
    root = os.fspath(root)
    if not os.path.lexists(root):
        return out
    out.append((root, os.lstat(root)))
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            with contextlib.suppress(FileNotFoundError):
                out.append((p, os.lstat(p)))
    return out


def is_lock_file(name: str) -> bool:
    """A transcript lock marker, wherever the layout keeps it (``lock``, ``<hash>.lock``)."""
    return (name == "lock" or name.endswith(".lock")) and ".break." not in name


def lock_files(root: str | os.PathLike[str]) -> list[str]:
    return [p for p, st in walk(root) if is_lock_file(os.path.basename(p)) and not stat.S_ISDIR(st.st_mode)]


def temp_files(root: str | os.PathLike[str], *, outside_trash: bool = True) -> list[str]:
    return [
        p
        for p, st in walk(root)
        if TEMP.match(os.path.basename(p))
        and stat.S_ISREG(st.st_mode)
        and not (outside_trash and "/.trash/" in p)
    ]


def snapshot(root: str | os.PathLike[str]) -> dict[str, tuple[int, int, int, bytes | None]]:
    """Content and metadata of a tree, to prove nothing in it changed."""
    out: dict[str, tuple[int, int, int, bytes | None]] = {}
    for p, st in walk(root):
        data = None
        if stat.S_ISREG(st.st_mode):
            with open(p, "rb") as fh:
                data = fh.read()
        elif stat.S_ISLNK(st.st_mode):
            data = os.readlink(p).encode()
        out[p] = (st.st_mode, st.st_mtime_ns, st.st_ctime_ns, data)
    return out
