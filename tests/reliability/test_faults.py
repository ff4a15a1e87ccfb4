"""I/O errors and permission errors from a fault-injecting FUSE filesystem.

The store runs on faultfs (tests/reliability/faultfs.py, a passthrough over
libfuse via mfusepy, in its own process), which fails chosen operations on chosen
paths with EIO, ENOSPC, EACCES, EROFS, ESTALE or EINVAL. For every fault: it
surfaces as an FsStoreError with the right code, errno, operation and path (or,
where fsstore documents that a step is best-effort, the operation succeeds and logs
its warning code); the fault really fired (faultfs logs each one); and afterwards,
with the fault gone, the store is consistent: every batch that was committed loads
whole and once, a failed append left no batch, no temp file and no lock, the
summaries agree, and the next append works.

Root ignores file modes, so EACCES comes from faultfs here; a subprocess that drops
privileges shows the real thing on a local disk.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fsstore import FsStoreError
from fsstore._store import SyncStore

from ._check import assert_summaries_consistent, assert_transcript, batch, lock_files, temp_files
from ._mounts import FaultFs

PROJECT = "-faults"
KEY = {"project_key": PROJECT, "session_id": "s"}
SUB = {**KEY, "subpath": "subagents/a"}
NEW = {"project_key": PROJECT, "session_id": "fresh"}

# faultfs paths are relative to the mount; ``{r}`` is the case's store root there
T = "{r}/projects/-faults/sessions/s/main"
PART_TMP = r"/\.tmp-(?![^/]*-(?:state|segment|dir|deleted)$)[^/]*$"
PART = r"/[0-9]{20}\.jsonl$"


def rule(op: str, path: str, err: str) -> dict[str, Any]:
    return {"op": op, "path": path, "errno": err}


@dataclass
class Case:
    action: str  # append | append_new | load | list_sessions | list_subkeys | list_session_summaries | delete | compact
    rules: list[dict[str, Any]]
    code: str | None  # expected error code; None: the action succeeds
    path: str | None = None  # expected err.path ({T} and {root} are expanded)
    committed: bool = False  # a failing append's batch, a failing delete: in effect afterwards?
    logged: set[str] = field(default_factory=set)  # warning codes the store must log
    fsync: bool = False
    compact_every: int = 64
    xfail: str | None = None  # a known fsstore bug this case exposes


def append_faults() -> dict[str, Case]:
    # the lock marker <root>/.locks/<hash>.lock, and the holder's record linked to it
    lock = r"{r}/\.locks/[^/]*\.lock$"
    record = r"{r}/\.locks/owner-[^/]*$"
    t = "{T}"
    return {
        # the part's temp file
        "write ENOSPC on the part temp file": Case("append", [rule("write", T + PART_TMP, "ENOSPC")], "ENOSPC", t),
        "write EIO on the part temp file": Case("append", [rule("write", T + PART_TMP, "EIO")], "EIO", t),
        "create EACCES of the part temp file": Case("append", [rule("create", T + PART_TMP, "EACCES")], "EACCES", t),
        "create EROFS of the part temp file": Case("append", [rule("create", T + PART_TMP, "EROFS")], "EROFS", t),
        "fsync EIO of the part temp file": Case("append", [rule("fsync", T + PART_TMP, "EIO")], "EIO", t, fsync=True),
        # the lock
        # (the record is written once per store object, before these cases arm their faults)
        "utimens EIO of the lock holder's record": Case("append", [rule("utimens", record, "EIO")], "EIO", None),
        "utimens EACCES of the lock holder's record": Case(
            "append", [rule("utimens", record, "EACCES")], "EACCES", None),
        "link EIO of the record to the lock file": Case("append", [rule("link", lock, "EIO")], "EIO", None),
        "link ENOSPC of the record to the lock file": Case("append", [rule("link", lock, "ENOSPC")], "ENOSPC", None),
        # the check after the link (a listing): failing, it takes the link back
        "readdir EIO at the commit's check": Case("append", [rule("readdir", f"{T}$", "EIO")], "EIO", t),
        # the commit move (link() on libfuse2, rename(RENAME_NOREPLACE) on libfuse3)
        "link/rename EIO to the part name": Case(
            "append", [rule("link", T + PART, "EIO"), rule("rename", T + PART, "EIO")], "EIO", t),
        "link/rename ESTALE to the part name": Case(
            "append", [rule("link", T + PART, "ESTALE"), rule("rename", T + PART, "ESTALE")], "ESTALE", t),
        "lookup ESTALE of the transcript directory": Case(
            "append", [rule("getattr", f"{T}$", "ESTALE")], "ESTALE", t),
        "mkdir EROFS of a new session": Case(
            "append_new", [rule("mkdir", "{r}/projects/-faults/sessions/fresh", "EROFS")], "EROFS", None),
        "mkdir EACCES of a new session": Case(
            "append_new", [rule("mkdir", "{r}/projects/-faults/sessions/fresh", "EACCES")], "EACCES", None),
        # best-effort steps after the commit: the append succeeds and says so in the log
        "create ENOSPC of the summary sidecar's temp file (compaction)": Case(
            "append", [rule("create", f"{T}/\\.tmp-[^/]*-state$", "ENOSPC")], None, logged={"SUMMARY_BEHIND"},
            compact_every=3),
        "rename EIO onto state.json (compaction)": Case(
            "append", [rule("rename", f"{T}/state.json$", "EIO")], None, logged={"SUMMARY_BEHIND"},
            compact_every=3),
        "write ENOSPC of a compaction segment": Case(
            "append", [rule("write", f"{T}/\\.tmp-[^/]*-segment$", "ENOSPC")], None,
            logged={"COMPACT_FAILED"}, compact_every=3),
        "fsyncdir EINVAL (a mount without directory fsync)": Case(
            "append", [rule("fsyncdir", "", "EINVAL")], None, logged={"DIR_FSYNC_UNSUPPORTED"}, fsync=True),
        # after the commit point the batch is visible: the append succeeds, the failed
        # directory fsync is logged (at ERROR, with the errno's code)
        "fsyncdir EIO after the commit move": Case(
            "append", [rule("fsyncdir", f"{T}$", "EIO")], None, logged={"EIO"}, fsync=True),
    }


def read_faults() -> dict[str, Case]:
    t = "{T}"
    sessions = "{root}/projects/-faults/sessions"
    return {
        "opendir EIO of the transcript directory": Case("load", [rule("opendir", f"{T}$", "EIO")], "EIO", t),
        "readdir ESTALE of the transcript directory": Case("load", [rule("readdir", f"{T}$", "ESTALE")], "ESTALE", t),
        "read EIO of a part": Case("load", [rule("read", T + PART, "EIO")], "EIO", t),
        "open EACCES of a part": Case("load", [rule("open", T + PART, "EACCES")], "EACCES", t),
        # found by this case: a persistent ESTALE used to come out as EAGAIN (fixed in cf83e95)
        "lookup ESTALE on load": Case("load", [rule("getattr", f"{T}$", "ESTALE")], "ESTALE", t),
        "opendir EIO of the sessions directory": Case(
            "list_sessions", [rule("opendir", "{r}/projects/-faults/sessions$", "EIO")], "EIO", sessions),
        "readdir EACCES of the subkeys directory": Case(
            "list_subkeys", [rule("readdir", "{r}/projects/-faults/sessions/s/subkeys$", "EACCES")], "EACCES",
            "{root}/projects/-faults/sessions/s/subkeys"),
        "open EIO of a part while listing summaries": Case(
            "list_session_summaries", [rule("open", T + PART, "EIO")], "EIO", None),
    }


def other_faults() -> dict[str, Case]:
    return {
        # Marked, a delete is committed (a mark is never taken back): loads see None, and
        # the next one under the lock finishes it.
        "rename EIO of the session into .trash": Case(
            "delete", [rule("rename", "{r}/projects/-faults/sessions/s$", "EIO")], "EIO",
            "{root}/projects/-faults/sessions/s", committed=True),
        "mkdir EROFS of .trash": Case("delete", [rule("mkdir", "{r}/\\.trash$", "EROFS")], "EROFS", None),
        "unlink EIO while emptying .trash": Case(
            "delete", [rule("unlink", "{r}/\\.trash/", "EIO")], None, logged={"TRASH_LEFT"}),
        # Compaction fsyncs the directory before its unlinks whatever fsync says (power
        # loss: test_power_loss.py); a mount without directory fsync is no store's warning
        # then (fsync=False asked for none), and the compaction goes on (stop 34).
        "fsyncdir EINVAL in compact() of a store without fsync": Case(
            "compact", [rule("fsyncdir", "", "EINVAL")], None),
        "write ENOSPC of the segment in compact()": Case(
            "compact", [rule("write", f"{T}/\\.tmp-[^/]*-segment$", "ENOSPC")], "ENOSPC", None),
        "read-only mount (EROFS on every change)": Case(
            "append",
            [rule(op, "{r}/", "EROFS") for op in ("create", "mkdir", "write", "rename", "link", "unlink", "rmdir")],
            "EROFS", None),
    }


CASES = {**append_faults(), **read_faults(), **other_faults()}


class Scene:
    def __init__(self, ffs: FaultFs, name: str, case: Case) -> None:
        self.ffs = ffs
        self.case = case
        self.rel = "/" + name.replace(" ", "-").replace("/", "-").replace("(", "").replace(")", "")
        self.root = ffs.mountpoint + self.rel
        self.opts = {"fsync": case.fsync, "compact_every": case.compact_every}
        self.store = SyncStore(self.root, create=True, **self.opts)
        self.expected: dict[str, list[tuple[Any, int]]] = {"main": [], "sub": [], "new": []}
        self.keys = {"main": KEY, "sub": SUB, "new": NEW}
        self.n = 0

    def expand(self, text: str) -> str:
        """A rule's path pattern, inside the mount."""
        return text.replace("{r}", self.rel)

    def where(self, text: str) -> str:
        """An expected err.path, absolute."""
        t = self.root + "/projects/-faults/sessions/s/main"
        return text.replace("{T}", t).replace("{root}", self.root)

    def append(self, which: str) -> None:
        self.n += 1
        self.store.append(self.keys[which], batch(which, self.n, 2))
        self.expected[which].append((which, self.n))

    def check(self) -> None:
        self.store._compactions.done()  # a compaction the last append left to its thread
        store = SyncStore(self.root, create=True, **self.opts)
        for which, key in self.keys.items():
            loaded = store.load(key)
            if self.expected[which]:
                v = assert_transcript(loaded, self.expected[which], 2 * len(self.expected[which]))
                assert v.batches == self.expected[which]
            else:
                assert loaded is None, (which, loaded)
        assert temp_files(self.root) == []
        assert lock_files(self.root) == []
        assert_summaries_consistent(store, PROJECT)


def _open_below(path: str) -> list[str]:
    """What this process has open at or below ``path``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target == path or target.startswith(path + "/"):
                found.append(target)
    return found


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else [], id=n)
    for n, c in CASES.items()
])
def test_fault_surfaces_with_code_errno_operation_path_and_store_stays_consistent(
    name: str, fault_mount: FaultFs, figures: Any, caplog: pytest.LogCaptureFixture
) -> None:
    case = CASES[name]
    scene = Scene(fault_mount, name, case)
    for which in ("main", "main", "sub"):
        scene.append(which)
    fault_mount.take_injected()
    fault_mount.set(*[{**r, "path": scene.expand(r["path"])} for r in case.rules])
    err: FsStoreError | None = None
    victim = None
    try:
        with caplog.at_level(logging.WARNING, logger="fsstore"):
            try:
                if case.action in ("append", "append_new"):
                    which = "new" if case.action == "append_new" else "main"
                    scene.n += 1
                    victim = (which, (which, scene.n))
                    for _ in range(3 if case.logged & {"DIR_FSYNC_UNSUPPORTED", "COMPACT_FAILED"} else 1):
                        scene.store.append(scene.keys[which], batch(which, scene.n, 2))
                        scene.expected[which].append((which, scene.n))
                        scene.n += 1
                    scene.store._compactions.done()  # one an append left to its thread
                    victim = None
                elif case.action == "load":
                    scene.store.load(KEY)
                elif case.action == "list_sessions":
                    scene.store.list_sessions(PROJECT)
                elif case.action == "list_subkeys":
                    scene.store.list_subkeys(KEY)
                elif case.action == "list_session_summaries":
                    scene.store.list_session_summaries(PROJECT)
                elif case.action == "delete":
                    scene.store.delete(KEY)
                    scene.expected["main"] = []
                    scene.expected["sub"] = []
                elif case.action == "compact":
                    scene.store.compact(KEY)
            except FsStoreError as exc:
                err = exc
    finally:
        fault_mount.clear()
    # Nothing of the store is left open by the failed operation (stop 19: a delete whose
    # ticket removal failed left its other transcript directories open, which kept the
    # mount busy until the test process ended).
    assert _open_below(scene.root) == [], name
    fired = fault_mount.take_injected()
    assert fired, f"{name}: the fault never fired"
    figures.fault(name, len(fired))
    figures.add("appends", 3 + (case.action.startswith("append")))
    logged = {str(getattr(r, "code", "")) for r in caplog.records}
    if case.code is None:
        assert err is None, f"{name}: expected success, got {err}"
    else:
        assert err is not None, f"{name}: expected {case.code}, the operation succeeded"
        assert err.code == case.code, err
        assert err.errno == getattr(errno, case.code), err
        operation = "append" if case.action.startswith("append") else case.action
        assert err.operation == operation, err
        assert err.path is not None and err.path.startswith(scene.root + "/"), err
        if case.path is not None:
            assert err.path == scene.where(case.path), err
        assert case.code in str(err) and operation in str(err)
        assert case.code in logged  # logged once at the public boundary
        if victim is not None and case.committed:
            scene.expected[victim[0]].append(victim[1])
        if case.action == "delete" and case.committed:
            scene.expected["main"], scene.expected["sub"] = [], []
    assert case.logged <= logged, (case.logged, logged)
    if "DIR_FSYNC_UNSUPPORTED" in case.logged:
        assert sum(1 for r in caplog.records if getattr(r, "code", "") == "DIR_FSYNC_UNSUPPORTED") == 1
    if not case.fsync:
        assert "DIR_FSYNC_UNSUPPORTED" not in logged, logged  # only stores that asked for fsync
    scene.check()
    # and the store keeps working
    scene.append("main")
    scene.append("sub")
    scene.check()


def test_eacces_from_a_process_without_privileges(tmp_path: Path, figures: Any) -> None:
    """A real EACCES: a child that drops root to nobody, on a root-owned 0700 store."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop privileges")
    root = tmp_path / "store"
    SyncStore(root, create=True).append(KEY, batch("w", 0, 1))
    os.chmod(tmp_path, 0o755)
    code = f"""
import os, sys, json, tempfile
from fsstore import FsStoreError
from fsstore._store import SyncStore
# everything imported lazily is imported now, while the interpreter's files are readable
warm = SyncStore(tempfile.mkdtemp(), create=True)
k = {{"project_key": "p", "session_id": "s"}}
warm.append(k, [{{"a": 1}}]); warm.load(k); warm.list_sessions("p"); warm.delete(k)
os.setgid(65534); os.setuid(65534)
out = []
for op in ("append", "load", "list_sessions", "delete"):
    try:
        s = SyncStore({str(root)!r}, create=True)
        key = {KEY!r}
        if op == "append": s.append(key, [{{"a": 1}}])
        elif op == "load": s.load(key)
        elif op == "list_sessions": s.list_sessions(key["project_key"])
        else: s.delete(key)
        out.append([op, None, None, None, None])
    except FsStoreError as e:
        out.append([op, e.code, e.errno, e.operation, e.path])
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    import json

    results = json.loads(r.stdout)
    for op, code_, errno_, operation, path in results:
        assert code_ == "EACCES", (op, code_)
        assert errno_ == errno.EACCES and operation == op
        assert path == str(root), (op, path)  # the directory it could not open
        figures.fault("EACCES (unprivileged process)")
    assert SyncStore(root, create=True).load(KEY) == batch("w", 0, 1)  # untouched
