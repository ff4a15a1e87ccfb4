"""A child process killed at a point of a store operation, and the checks of every
promise after it (see test_crashes.py; also run on FUSE by test_real_mount.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsstore._store import SyncStore

from . import _children
from ._check import assert_summaries_consistent, assert_transcript, batch, temp_files

STALE = 2.0
MARGIN = 2.0  # seconds on top of stale_lock_seconds a new writer may need
PROJECT = "-crash-project"
MAIN = {"project_key": PROJECT, "session_id": "s-main"}
SUB = {**MAIN, "subpath": "subagents/agent-1"}


def kj(key: dict[str, str]) -> str:
    return json.dumps(key, sort_keys=True)


@dataclass
class Model:
    """What must be in the store: each transcript's batches, in commit order."""

    root: str
    opts: dict[str, Any]
    batches: dict[str, list[tuple[Any, int]]] = field(default_factory=dict)
    sizes: dict[tuple[Any, int], int] = field(default_factory=dict)
    rounds: int = 0

    def store(self, **over: Any) -> SyncStore:
        return SyncStore(self.root, create=True, **{**self.opts, **over})

    def append(self, key: dict[str, str], w: Any, b: int, n: int) -> None:
        self.store().append(key, batch(w, b, n))
        self.batches.setdefault(kj(key), []).append((w, b))
        self.sizes[(w, b)] = n

    def check(self) -> None:
        store = self.store()
        for k, expected in self.batches.items():
            key = json.loads(k)
            loaded = store.load(key)
            if not expected:
                assert loaded is None, f"{key} should be gone"
                continue
            v = assert_transcript(loaded, expected, sum(self.sizes[b] for b in expected))
            assert v.batches == expected, f"{key}: commit order changed"
        # listings report exactly what loads
        sessions = {s["session_id"] for s in store.list_sessions(PROJECT)}
        want = {json.loads(k)["session_id"] for k, b in self.batches.items() if b and "subpath" not in json.loads(k)}
        assert sessions == want
        for k, b in self.batches.items():
            key = json.loads(k)
            if "subpath" in key:
                subs = store.list_subkeys({"project_key": key["project_key"], "session_id": key["session_id"]})
                assert (key["subpath"] in subs) == bool(b)
        assert_summaries_consistent(store, PROJECT)

    def forget(self, key: dict[str, str]) -> None:
        """delete(key): a main key takes its whole session (subpaths too), a subpath itself."""
        if key.get("subpath"):
            self.batches[kj(key)] = []
            return
        for k in self.batches:
            other = json.loads(k)
            if other["project_key"] == key["project_key"] and other["session_id"] == key["session_id"]:
                self.batches[k] = []


def run_child(procs: Any, root: str, spec: dict[str, Any]) -> tuple[str, Any]:
    """Start the crash child; kill -9 it when it reports its point. Returns (kind, msg)."""
    parent, child = procs.Pipe(duplex=False)
    p = procs.Process(target=_children.crash_child, args=(root, spec, child))
    p.start()
    child.close()
    try:
        assert parent.poll(60), "crash child neither stopped nor finished in 60 s"
        msg = parent.recv()
    finally:
        if p.is_alive():
            p.kill()  # SIGKILL
        p.join(30)
        parent.close()
    assert p.exitcode is not None, "crash child not reaped"
    if msg[0] == "reached":
        assert p.exitcode == -9, p.exitcode
    assert msg[0] in ("reached", "completed"), msg
    return msg[0], msg


def _kind(name: str) -> str:
    """What a file name is, in the on-disk format's terms."""
    if _children.PART.match(name):
        return "part"
    if _children.SEGMENT.match(name):
        return "segment"
    if name.startswith(".tmp-"):
        for tag in ("state", "segment", "dir", "deleted"):
            if name.endswith(f"-{tag}"):
                return f"temp-{tag}"
        return "temp"
    if name.endswith(".lock") or name == "lock" or ".stale-" in name or ".break." in name:
        return "lock"
    if name in ("state.json", ".state.spare", ".key", ".trash", ".locks", "summary"):
        return name
    return "dir"


def committed(events: list[Any]) -> bool:
    """Did the trace reach a commit point: a temp file linked (or moved) to a part
    name, or a new transcript's directory, part 1 inside, renamed into place?"""
    wrote_part = False
    for c, n, o in events:
        if o != "ok":
            continue
        if c in ("renameat2", "link") and _children.PART.match(n[1]) and n[0].startswith(".tmp-"):
            return True
        if c == "open" and _children.PART.match(n[0]):
            wrote_part = True
        if c == "rename" and wrote_part and n[0].endswith("-dir"):
            return True
    return False


def deleted(events: list[Any]) -> bool:
    """A delete is committed once it marked the transcript (``.deleted``)."""
    return any(c == "open" and o == "ok" and n[0] == ".deleted" for c, n, o in events)


def recover(model: Model, key: dict[str, str], figures: Any) -> float:
    """A new writer's append; returns how long it took (lock reclaim included)."""
    model.rounds += 1
    t0 = time.monotonic()
    model.append(key, "recovery", model.rounds, 2)
    elapsed = time.monotonic() - t0
    figures.add("appends")
    assert elapsed < STALE + MARGIN, f"new writer needed {elapsed:.2f}s for the lock (stale {STALE}s)"
    return elapsed


def crash_round(
    procs: Any, model: Model, figures: Any, *, op: str, key: dict[str, str], spec: dict[str, Any], label: str
) -> tuple[str, int]:
    """One kill -9 round and its checks; returns ('reached' or 'completed', syscalls made)."""
    model.rounds += 1
    n = spec.pop("n", 3)
    victim = ("crash", model.rounds)
    model.sizes[victim] = n
    full = {
        "op": op,
        "key": key,
        "batch": batch(victim[0], victim[1], n),
        "opts": {**model.opts, **spec.pop("opts", {})},
        **spec,
    }
    kind, msg = run_child(procs, model.root, full)
    events, count = (msg[4], msg[5]) if kind == "reached" else (msg[1], msg[2])
    if kind == "reached":
        if "point" not in full:  # a random syscall: name it by what the call does
            label = f"{op}: {msg[1]} {msg[2]} {' -> '.join(_kind(n) for n in msg[3])}"
        figures.crash_point(label)
    if op.startswith("append"):
        figures.add("appends")
        if kind == "completed" or committed(events):
            model.batches.setdefault(kj(key), []).append(victim)
        else:
            model.batches.setdefault(kj(key), [])
    elif op == "delete" and (kind == "completed" or deleted(events)):
        model.forget(key)
    model.check()
    # the killed process's temp files are garbage for `fsstore gc`, never entries
    figures.add("temp files left by killed writers", len(temp_files(model.root)))
    elapsed = recover(model, key, figures)
    figures.maximum("slowest new writer after kill -9 (ms)", int(elapsed * 1000))
    model.check()
    return kind, count


def fresh_model(root: Path, **opts: Any) -> Model:
    model = Model(str(root), {"stale_lock_seconds": STALE, "lock_timeout_seconds": STALE + MARGIN + 1, **opts})
    model.append(MAIN, "warmup", 0, 2)
    model.append(SUB, "warmup", 1, 2)
    return model


#: points where the killed process holds the transcript lock: the next writer must reclaim it
LOCK_HELD = {
    "holding_lock_marker_written", "holding_lock_before_move", "between_move_and_dir_fsync",
    "during_dir_fsync_after_move", "during_summary_update", "state_temp_written",
    "after_state_before_lock_release", "compaction_segment_temp_written",
    "compaction_after_segment_move", "compaction_midway_unlinking_parts",
}


def named_point(procs: Any, root: Path, figures: Any, point: str, **extra: Any) -> None:
    op, fsync, _cond = _children.POINTS[point]
    opts: dict[str, Any] = {"fsync": fsync, **extra}
    if op == "append_compacting":
        opts["compact_every"] = 4
    model = fresh_model(root, **opts)
    key = MAIN
    if op == "append_compacting":
        model.append(MAIN, "warmup", 2, 1)  # parts 1, 2 (+ this) ... the child's is the 4th
        model.append(MAIN, "warmup", 3, 1)
        op = "append"
    elif op == "append_new_hashed":
        key = {"project_key": PROJECT, "session_id": "h" * 300}
    elif op == "append_new":
        key = {"project_key": PROJECT, "session_id": "s-new"}
    kind, _count = crash_round(
        procs, model, figures, op="append" if op.startswith("append") else op,
        key=key, spec={"point": point}, label=point,
    )
    assert kind == "reached", f"{point}: the child finished without reaching the point"
