"""Nothing is read or written outside root; lock files are not followed; modes hold.

An attacker who can write inside root replaces a directory of the store with a
symlink to a decoy tree outside root (same layout, decoy entries, a decoy state
file with a recognisable mtime). Before an operation, and *between two of its
steps* (staged by wrapping ``os`` calls in this process: the store itself has no
hooks), and at random moments from a thread that keeps exchanging the directory
and the symlink. Every operation must then either fail (``UNSAFE_PATH`` or another
FsStoreError) or work on the real store: it never returns decoy data, and the
decoy tree is byte-for-byte and timestamp-for-timestamp unchanged (a lock file
created and removed outside root still changes its directory's mtime).

Lock files: a ``lock`` that is a symlink (to a victim file, or to a path that does
not exist) is never opened through, truncated or created at its target (the
attack class of filelock's CVE-2025-68146).

Modes: with umask 0, every directory the store creates is 0700 and every file
0600, the lock file included.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fsstore import FsStoreError
from fsstore._store import SyncStore

from ._check import lock_files, snapshot, walk

# Found by these tests and fixed in ac24c9e: the lock file used to live in the transcript
# directory and was handed to filelock by path, which followed a swapped directory out of
# root and mkdir -p'd missing ones (0755, no .key); list_sessions used to stat
# main/state.json through a symlinked main/; root's missing parents were 0755.
# Found by these tests: the lock used to be handed to filelock as the path string
# <root>/.locks/<hash>.lock after an lstat() of .locks, so a .locks swapped for a symlink
# in between was followed; fixed when the lock became a link made relative to .locks
# opened with O_NOFOLLOW (issue 16).

PROJECT = "proj"
KEY = {"project_key": PROJECT, "session_id": "sess"}
SUB = {**KEY, "subpath": "agents/a"}
DECOY_MTIME = 1_000_000_000  # 2001-09-09: no real file has it
REAL = {"type": "user", "real": True, "message": {"role": "user", "content": "real"}}
DECOY = {"type": "user", "decoy": True, "message": {"role": "user", "content": "decoy"}}

# store-relative directories an attacker can swap, and what they are
SWAPPABLE = {
    "project dir": "projects/proj",
    "sessions dir": "projects/proj/sessions",
    "session dir": "projects/proj/sessions/sess",
    "main transcript dir": "projects/proj/sessions/sess/main",
    "subkeys dir": "projects/proj/sessions/sess/subkeys",
    "subpath transcript dir": "projects/proj/sessions/sess/subkeys/agents%2Fa",
    "trash dir": ".trash",
    "locks dir": ".locks",
}


def build(tmp_path: Path) -> tuple[Path, Path, SyncStore]:
    """A real store with main + subpath transcripts, and a decoy copy of it outside root."""
    root = tmp_path / "store"
    store = SyncStore(root, create=True, stale_lock_seconds=1.0, lock_timeout_seconds=2.0)
    for key in (KEY, SUB):
        store.append(key, [REAL])
        store.append(key, [REAL])
    store.delete({**KEY, "session_id": "gone"})  # creates .trash
    decoy = tmp_path / "outside"
    for rel in ("projects/proj/sessions/sess/main", "projects/proj/sessions/sess/subkeys/agents%2Fa"):
        d = decoy / rel
        d.mkdir(parents=True)
        (d / "00000000000000000001.jsonl").write_text(json.dumps(DECOY) + "\n")
        (d / "00000000000000000002.jsonl").write_text(json.dumps(DECOY) + "\n")
        (d / "state.json").write_text(
            json.dumps({"format": 1, "seq": 2, "folded": 2, "compacted": 0,
                        "summary": {"session_id": "sess", "mtime": 0, "data": {"decoy": True}}})
        )
    (decoy / ".trash").mkdir()
    (decoy / ".locks").mkdir()
    assert (root / ".locks").is_dir(), "the store keeps its locks elsewhere now: update SWAPPABLE"
    for p, _st in walk(decoy):
        os.utime(p, (DECOY_MTIME, DECOY_MTIME), follow_symlinks=False)
    return root, decoy, store


def swap_in(root: Path, decoy: Path, rel: str) -> None:
    """Move ``root/rel`` aside (inside root) and put a symlink to the decoy in its place."""
    real = root / rel
    real.rename(real.with_name(real.name + ".aside"))
    real.symlink_to(decoy / rel.replace("projects/", "projects/", 1), target_is_directory=True)


OPS: dict[str, Callable[[SyncStore], Any]] = {
    "append": lambda s: s.append(KEY, [REAL]),
    "append subpath": lambda s: s.append(SUB, [REAL]),
    "load": lambda s: s.load(KEY),
    "load subpath": lambda s: s.load(SUB),
    "list_sessions": lambda s: s.list_sessions(PROJECT),
    "list_session_summaries": lambda s: s.list_session_summaries(PROJECT),
    "list_subkeys": lambda s: s.list_subkeys(KEY),
    "delete": lambda s: s.delete(KEY),
    "delete subpath": lambda s: s.delete(SUB),
    "compact": lambda s: s.compact(KEY),
    "locked": lambda s: _locked(s),
}


def _locked(store: SyncStore) -> None:
    with store.locked(KEY):
        pass


def leaks(result: Any) -> bool:
    """Does a result carry anything from the decoy tree?"""
    text = json.dumps(result, default=str)
    return '"decoy"' in text or str(DECOY_MTIME * 1000) in text


def run_op(name: str, store: SyncStore) -> tuple[Any, FsStoreError | None]:
    try:
        return OPS[name](store), None
    except FsStoreError as exc:
        return None, exc


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("where", list(SWAPPABLE))
def test_symlinked_directory_inside_root_is_never_followed(tmp_path: Path, where: str, op: str) -> None:
    root, decoy, store = build(tmp_path)
    before = snapshot(decoy)
    swap_in(root, decoy, SWAPPABLE[where])
    result, err = run_op(op, store)
    assert snapshot(decoy) == before, f"{op} wrote outside root through the {where}"
    assert not leaks(result), f"{op} returned data from outside root through the {where}: {result}"
    if err is not None:
        assert err.code in ("UNSAFE_PATH", "LOCK_TIMEOUT"), err
        assert err.path is None or err.path.startswith(str(root)), err


def test_list_sessions_does_not_stat_through_a_symlinked_transcript_dir(tmp_path: Path) -> None:
    """The session directory is real, its main/ is a symlink out of root: the session
    has no transcript inside root, so it is not listed (and no outside mtime leaks)."""
    root, decoy, store = build(tmp_path)
    swap_in(root, decoy, SWAPPABLE["main transcript dir"])
    try:
        sessions = store.list_sessions(PROJECT)
    except FsStoreError as exc:
        assert exc.code == "UNSAFE_PATH"
        return
    assert [s for s in sessions if s["session_id"] == "sess"] == [], sessions


# -- swaps between two steps of an operation ----------------------------------------------


@contextlib.contextmanager
def swap_when(
    monkeypatch: pytest.MonkeyPatch,
    trigger: Callable[[str, tuple[Any, ...]], str | None],
    action: Callable[[], None],
) -> Iterator[list[str]]:
    """Run ``action`` once, just before or just after (as ``trigger`` answers) the first
    ``os`` call it picks. Only this process's ``os`` functions are wrapped."""
    fired: list[str] = []

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            when = None if fired else trigger(name, args)
            if when == "before":
                fired.append(name)
                action()
            try:
                return real(*args, **kwargs)
            finally:
                if when == "after":
                    fired.append(name)
                    action()

        return wrapped

    for name in ("open", "listdir", "scandir", "stat", "lstat", "rename", "mkdir"):
        monkeypatch.setattr(os, name, wrap(name, getattr(os, name)))
    try:
        yield fired
    finally:
        monkeypatch.undo()


def base(p: Any) -> str:
    return os.path.basename(os.fsdecode(p)) if isinstance(p, (str, bytes, os.PathLike)) else ""


def is_temp_open(n: str, a: tuple[Any, ...]) -> str | None:
    return "after" if n == "open" and base(a[0]).startswith(".tmp-") else None


STAGED: dict[str, tuple[str, str, Callable[[str, tuple[Any, ...]], str | None]]] = {
    # op, the directory swapped, when
    "append: project dir swapped after the temp file, before the lock": ("append", "project dir", is_temp_open),
    "append: main dir swapped after the temp file, before the lock": ("append", "main transcript dir", is_temp_open),
    "append subpath: subkeys dir swapped after the temp file": ("append subpath", "subkeys dir", is_temp_open),
    "locked: session dir swapped after the directory walk, before the lock": (
        "locked", "session dir", lambda n, a: "after" if n == "lstat" and base(a[0]) == ".locks" else None),
    "load: project dir swapped after listing, before reading": (
        "load", "project dir", lambda n, a: "after" if n == "listdir" else None),
    "list_sessions: main dir swapped after listing the sessions": (
        "list_sessions", "main transcript dir", lambda n, a: "after" if n == "scandir" else None),
    "list_session_summaries: main dir swapped after listing the sessions": (
        "list_session_summaries", "main transcript dir", lambda n, a: "after" if n == "scandir" else None),
    "delete: trash swapped just before the rename into it": (
        "delete", "trash dir", lambda n, a: "before" if n == "rename" else None),
    "delete: sessions dir swapped just before the rename": (
        "delete", "sessions dir", lambda n, a: "before" if n == "rename" else None),
    "append: .locks swapped after the store checked it, before the lock": (
        "append", "locks dir", lambda n, a: "after" if n == "lstat" and base(a[0]) == ".locks" else None),
    "locked: .locks swapped after the store checked it, before the lock": (
        "locked", "locks dir", lambda n, a: "after" if n == "lstat" and base(a[0]) == ".locks" else None),
}


def _staged_params() -> list[Any]:
    out = []
    for stage in STAGED:
        out.append(pytest.param(stage, id=stage))
    return out


@pytest.mark.parametrize("stage", _staged_params())
def test_directory_swapped_between_two_steps_is_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    op, where, trigger = STAGED[stage]
    root, decoy, store = build(tmp_path)
    before = snapshot(decoy)
    with swap_when(monkeypatch, trigger, lambda: swap_in(root, decoy, SWAPPABLE[where])) as fired:
        result, err = run_op(op, store)
    assert fired, f"{stage}: the staging call never happened (did fsstore change how it works?)"
    assert snapshot(decoy) == before, f"{stage}: wrote outside root"
    assert not leaks(result), f"{stage}: returned data from outside root: {result}"
    if err is not None:
        assert err.code in ("UNSAFE_PATH", "LOCK_TIMEOUT"), err


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_RENAME_EXCHANGE = 2


def exchange(a: str, b: str) -> None:
    if _libc.renameat2(-100, a.encode(), -100, b.encode(), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), a)


@pytest.mark.parametrize("where", [
    "project dir", "session dir", "main transcript dir",
    "locks dir",
])
def test_directory_flipping_to_a_symlink_at_random_moments_is_never_followed(
    tmp_path: Path, figures: Any, where: str
) -> None:
    """A thread keeps atomically exchanging a directory with a symlink to the decoy
    while the store appends, loads, lists and locks."""
    root, decoy, store = build(tmp_path)
    before = snapshot(decoy)
    real = root / SWAPPABLE[where]
    link = real.with_name(real.name + ".link")
    link.symlink_to(decoy / SWAPPABLE[where], target_is_directory=True)
    stop = threading.Event()
    flips = [0]

    def flipper() -> None:
        while not stop.is_set():
            exchange(str(real), str(link))
            flips[0] += 1
            time.sleep(0.0003)

    t = threading.Thread(target=flipper, daemon=True)
    t.start()
    outcomes: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 2.0
        i = 0
        while time.monotonic() < deadline:
            name = list(OPS)[i % len(OPS)]
            if name.startswith("delete"):
                name = "load"
            result, err = run_op(name, store)
            assert not leaks(result), f"{name} returned data from outside root: {result}"
            outcomes[err.code if err else "ok"] = outcomes.get(err.code if err else "ok", 0) + 1
            i += 1
    finally:
        stop.set()
        t.join(5)
    if not real.is_dir() or real.is_symlink():
        exchange(str(real), str(link))
    assert flips[0] > 100 and outcomes.get("ok", 0) > 0, (flips, outcomes)
    figures.add("symlink flips survived", flips[0])
    after = snapshot(decoy)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert not changed, f"written outside root: {changed[:5]} (outcomes {outcomes})"


# -- lock files ----------------------------------------------------------------------------


def lock_path(store: SyncStore, root: Path) -> Path:
    """Where KEY's lock marker lives (found by holding it, whatever the layout)."""
    with store.locked(KEY):
        found = lock_files(root)
    assert len(found) == 1, found
    return Path(found[0])


@pytest.mark.parametrize("target", ["victim file", "missing path", "victim directory"])
def test_lock_file_symlink_is_never_followed(tmp_path: Path, target: str) -> None:
    root, _decoy, store = build(tmp_path)
    lock = lock_path(store, root)
    victim = tmp_path / "victim"
    if target == "victim file":
        victim.write_text("precious\n")
    elif target == "victim directory":
        victim.mkdir()
    lock.symlink_to(victim)
    before = snapshot(tmp_path / "victim") if victim.exists() else {}
    try:
        store.append(KEY, [REAL])
    except FsStoreError as exc:
        assert exc.code in ("LOCK_TIMEOUT", "UNSAFE_PATH"), exc
    if target == "missing path":
        assert not os.path.lexists(victim), "the lock was created at the symlink's target"
    else:
        assert snapshot(victim) == before, "the lock symlink's target was written"
    assert [e for e in store.load(KEY) or [] if "decoy" in e] == []


def test_lock_file_replaced_by_a_symlink_while_held_is_not_followed_on_release(tmp_path: Path) -> None:
    root, _decoy, store = build(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.utime(victim, (DECOY_MTIME, DECOY_MTIME))
    before = snapshot(victim)
    lock = lock_path(store, root)
    with store.locked(KEY):
        assert lock.is_file() and not lock.is_symlink()
        lock.unlink()
        lock.symlink_to(victim)
    assert snapshot(victim) == before
    store2 = SyncStore(root, create=True, stale_lock_seconds=1.0, lock_timeout_seconds=2.0)
    try:
        store2.append(KEY, [REAL])
    except FsStoreError as exc:
        assert exc.code == "LOCK_TIMEOUT", exc
    assert snapshot(victim) == before


# -- modes -----------------------------------------------------------------------------------

_MODES_SCRIPT = r"""
import json, os, sys
os.umask(int(sys.argv[2], 8))
from fsstore._store import SyncStore
root = sys.argv[1]
s = SyncStore(root, create=True, compact_every=3, fsync=True)
k = {"project_key": "p", "session_id": "s"}
for i in range(4):
    s.append(k, [{"i": i}])                                      # parts, state, a segment
s.append({**k, "subpath": "agents/a"}, [{"i": 0}])                # subkeys
s.append({"project_key": "P" * 300, "session_id": "S" * 300}, [{"i": 0}])  # hashed dirs, .key
s.append({"project_key": "p", "session_id": "gone"}, [{"i": 0}])
s.delete({"project_key": "p", "session_id": "gone"})             # .trash
modes = {}
with s.locked(k):                                                 # the lock file, while held
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            modes[os.path.relpath(p, root)] = os.lstat(p).st_mode
modes["."] = os.lstat(root).st_mode
print(json.dumps(modes))
"""


@pytest.mark.parametrize("umask", ["000", "022", "077"])
def test_everything_the_store_creates_is_0700_or_0600(tmp_path: Path, umask: str) -> None:
    root = tmp_path / "store"
    out = subprocess.run([sys.executable, "-c", _MODES_SCRIPT, str(root), umask],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    modes = json.loads(out.stdout)
    assert any(p.endswith("lock") for p in modes), "the lock file was not seen while held"
    wrong = {p: oct(m & 0o7777) for p, m in modes.items()
             if (m & 0o7777) != (0o700 if stat.S_ISDIR(m) else 0o600)}
    assert not wrong, wrong


def test_missing_parents_of_root_are_never_created_and_the_root_is_0700(tmp_path: Path) -> None:
    """A missing parent is a missing mount more often than not (issue 15): create=True
    makes the root itself, 0700 whatever the umask, and nothing above it."""
    script = ("import os,sys; os.umask(0o022); from fsstore._store import SyncStore; "
              "SyncStore(sys.argv[1], create=True).append({'project_key':'p','session_id':'s'}, [{}])")
    deep = tmp_path / "a" / "b" / "store"
    out = subprocess.run([sys.executable, "-c", script, str(deep)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0 and "ENOENT" in out.stderr, out.stderr
    assert not (tmp_path / "a").exists()
    root = tmp_path / "store"
    out = subprocess.run([sys.executable, "-c", script, str(root)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert root.stat().st_mode & 0o777 == 0o700


def test_append_racing_a_delete_keeps_every_directory_0700(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    store = SyncStore(root, create=True)
    store.append(KEY, [REAL])
    old = os.umask(0o022)
    try:
        with swap_when(monkeypatch, is_temp_open, lambda: SyncStore(root, create=True).delete(KEY)) as fired:
            store.append(KEY, [REAL])
    finally:
        os.umask(old)
    assert fired
    assert store.load(KEY) == [REAL]
    wrong = {p: oct(st.st_mode & 0o777) for p, st in walk(root)
             if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o777 != 0o700}
    assert not wrong, wrong
