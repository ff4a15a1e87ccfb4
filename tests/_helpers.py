"""Helpers shared by the test modules: where the documented on-disk format puts a
transcript, its parts and its lock (docs/format.md), and the ``fsstore`` command line
run as a user runs it."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fsstore import _create, _delete, _layout, _read, _trash
from fsstore._keys import parse_key
from fsstore._store import SyncStore

from .conftest import KEY, entry

P = KEY["project_key"]  # "-home-user-repo": starts with "-"
S = KEY["session_id"]
SUB = {**KEY, "subpath": "subagents/agent-1"}
DAY = 86400.0


def first_line(proc: subprocess.Popen[str]) -> str:
    """The next line ``proc`` writes to its stdout pipe, read a byte at a time. A buffered
    ``proc.stdout.readline()`` may read ahead past it, and ``proc.communicate()`` (which
    reads the descriptor when more than one pipe is open) then never sees what followed:
    a child that finished fast seemed to have printed nothing (CI, stop 43)."""
    assert proc.stdout is not None
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(proc.stdout.fileno(), 1)
        if not byte:
            break
        line += byte
    return line.decode()


class Overtaken:
    """A lock hold whose lease another process has taken over (a stall past it): what
    its holder checks passes, and nothing keeps others out."""

    path = "-"
    since = 0.0
    budget = math.inf

    def check(self, operation: str) -> None:
        pass


def overtake_locks(monkeypatch: pytest.MonkeyPatch, store: SyncStore) -> None:
    """``store``'s lock holds keep nobody out, as if each were overtaken."""
    monkeypatch.setattr(store._locks, "hold", lambda *a, **k: contextlib.nullcontext(Overtaken()))


def with_a_part_that_keeps_vanishing(root: Path, monkeypatch: pytest.MonkeyPatch) -> SyncStore:
    """A store holding three parts of ``KEY`` (no compaction), the second of which every
    read finds gone: a client that keeps listing a removed name."""
    store = SyncStore(root, create=True, compact_every=0)
    for i in range(3):
        store.append(KEY, [entry(i)])
    real = _read.read_file

    def vanishing(dir_fd: int, name: str) -> bytes:
        if name == _layout.part_name(2):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", name)
        return real(dir_fd, name)

    monkeypatch.setattr(_read, "read_file", vanishing)
    return store


def tdir(root: Path, key: dict[str, Any]) -> Path:
    """A transcript's directory."""
    return root / _layout.rel(_layout.transcript_dirs(parse_key(key, "test")))


def lock_file(root: Path, key: dict[str, Any]) -> Path:
    """Where the store keeps a transcript's commit lock (``<root>/.locks/<hash>.lock``)."""
    locks = root / _layout.LOCKS
    locks.mkdir(parents=True, exist_ok=True)
    return locks / _layout.lock_name(_layout.transcript_dirs(parse_key(key, "test")))


def parts_of(root: Path, key: dict[str, Any]) -> list[str]:
    """The names of a transcript's parts and segments, sorted."""
    return sorted(p.name for p in tdir(root, key).iterdir() if _layout.parse_item(p.name))


def fsstore(*args: object, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the CLI exactly as a user would (``python -m fsstore``)."""
    return subprocess.run(
        [sys.executable, "-m", "fsstore", *map(str, args)],
        check=False, capture_output=True, text=True, timeout=timeout,
    )


def fsstore_json(*args: object, rc: int = 0) -> Any:
    proc = fsstore(*args, "--json")
    assert proc.returncode == rc, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def age_tree(path: Path, seconds: float) -> None:
    for p in [path, *path.rglob("*")]:
        age(p, seconds)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in root.rglob("*")}


def write_jsonl(path: Path, entries: list[dict[str, Any]], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in entries) + tail)


def fast_writer(root: str, stop: Any) -> None:
    """Append to KEY, compacting every 4 appends, until ``stop`` is set (a process)."""
    store = SyncStore(root, create=True, compact_every=4, summaries=False)
    i = 0
    while not stop.is_set():
        store.append(KEY, [entry(100_000 + i)])
        i += 1


def no_lock_taken_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail at once where a thread would wait for a transcript lock it holds already
    (the in-process lock is not reentrant: only a hold taken through ``locked`` on the
    same store is used again; anything else would wait for itself until LOCK_TIMEOUT)."""
    import contextlib

    from fsstore import _lock

    real = _lock.Locks.hold

    def hold(self: Any, lock_path: str, operation: str) -> Any:
        cm = real(self, lock_path, operation)
        assert isinstance(cm, contextlib.nullcontext) or not self.held_here(lock_path), (
            f"{operation} waits for its own lock")
        return cm

    monkeypatch.setattr(_lock.Locks, "hold", hold)


# -- another user (root ignores file modes) ---------------------------------------

NOBODY = 65534


def as_nobody(*args: object) -> tuple[int, str]:
    """Run the CLI as uid 65534; its exit code and its stdout and stderr together.

    In a forked child that drops root, not in a new interpreter: the interpreter is
    installed under /root, which that uid cannot reach.
    """
    import filelock._identity  # noqa: F401 - lazily imported by the lock code; import it as root

    import fsstore.cli

    fsstore.cli.build_parser()  # what building the parser imports, while root can read it

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        rc = 99
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            sys.stdout = sys.stderr = open(w, "w", closefd=False)  # noqa: SIM115
            rc = fsstore.cli.main([str(a) for a in args])
            sys.stdout.flush()
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
        os._exit(rc)
    os.close(w)
    with open(r) as fh:
        out = fh.read()
    _pid, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out


def chown_tree(path: Path, uid: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, uid, uid, follow_symlinks=False)


def orphan_of(root: Path, batches: list[list[dict[str, Any]]], *, key: dict[str, Any] = KEY,
              made_since: list[dict[str, Any]] | None = None, marked: bool = False,
              compact_every: int = 64) -> str:
    """A session of ``batches`` (in transcript ``key``) moved into .trash as a delete
    moves one by mistake (an unmarked ``-deleted`` directory of its tag: docs/format.md,
    "Deletes"), and a session made at its name since holding ``made_since`` (default
    ``[entry(2)]``) in its main transcript: what a merger that died before its first
    append leaves. Returns its name in .trash. ``marked``: moved by its own delete,
    which died before emptying it. ``compact_every``: of the store that writes them (a
    merge appends one batch per file)."""
    store = SyncStore(root, create=True, compact_every=compact_every)
    for batch in batches:
        store.append(key, batch)
    comps = _layout.transcript_dirs(parse_key(key, "test"))
    if marked:
        (root / _layout.rel(comps) / _layout.DELETED).touch()
    aside = root.parent / f"{root.name}-aside"  # not in .trash yet: the append would move it back
    (root / _layout.rel(comps[:4])).rename(aside)
    main = {"project_key": key["project_key"], "session_id": key["session_id"]}
    store.append(main, [entry(2)] if made_since is None else made_since)
    (root / _layout.TRASH).mkdir(exist_ok=True)
    name = f".tmp-4242-0123456789ab-0-{_trash.tags(comps)[0]}{_delete.ASIDE_TAG}"
    aside.rename(root / _layout.TRASH / name)
    return name


def moved_by_a_dead_deleter(root: Path, key: dict[str, Any] = KEY, *, record: bool = True) -> Path:
    """Move the session of ``key`` (with a ``subpath``: that subagent transcript) into
    .trash as a delete whose lock was overtaken moves one made anew (unmarked), with the
    record of its name it leaves beside it (unless not ``record``: gc removed it), and
    die there, before moving it back (docs/format.md, "Deletes"). Returns where it is in
    .trash."""
    comps = _layout.transcript_dirs(parse_key(key, "test"))
    moved = comps if key.get("subpath") is not None else comps[:4]
    tags = "-".join(_trash.tags(moved))
    aside = f".tmp-4242-0123456789ab-0-{tags}{_delete.FROM}{moved[-1][0]}{_delete.ASIDE_TAG}"
    if record:
        (root / _layout.rel(moved[:-1]) / _delete.moving_record(aside)).write_text(moved[-1][0])
    (root / _layout.TRASH).mkdir(exist_ok=True)
    (root / _layout.rel(moved)).rename(root / _layout.TRASH / aside)
    return root / _layout.TRASH / aside


def made_anew_blind(monkeypatch: pytest.MonkeyPatch, store: SyncStore, key: dict[str, Any],
                    entries: list[dict[str, Any]]) -> None:
    """``store.append(key, entries)`` as a writer that makes the transcript (or its
    session) anew and never sees what a delete moved from that name into .trash by
    mistake: its look there before making it missed it (a client's cached listing), and
    it died before its look after (docs/format.md, "Deletes"). What is moved stays for
    its deleter's merge, or gc's."""
    with monkeypatch.context() as m:
        m.setattr(_delete, "restore", lambda *args: False)
        m.setattr(_create, "_merge_what_was_moved", lambda *args: None)
        store.append(key, entries)


def stall(pid: int, calls: str, delay_us: int, *, path: str | os.PathLike[str], when: str | None = None
          ) -> subprocess.Popen[bytes]:
    """strace attached to process ``pid``: its ``calls`` (comma-separated) on ``path``
    (strace's ``-P``), those ``when`` picks (all if None), each take ``delay_us`` longer.
    Returns once it is attached; the caller kills it."""
    inject = f"inject={calls}:delay_enter={delay_us}" + (f":when={when}" if when else "")
    tracer = subprocess.Popen(["strace", "-f", "-qq", "-o", "/dev/null", "-P", str(path),
                               "-e", f"trace={calls}", "-e", inject, "-p", str(pid)])
    deadline = time.monotonic() + 10
    while "TracerPid:\t0" in Path(f"/proc/{pid}/status").read_text():
        assert time.monotonic() < deadline, "strace did not attach"
        time.sleep(0.02)
    return tracer


# s: how long a nested run of the suite (the whole-suite soaks) may take
NESTED_SUITE_SECONDS = 1500


def nested_suite(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m pytest -q ARGS`` in a child process, bounded by
    :data:`NESTED_SUITE_SECONDS`. On the bound it is interrupted (SIGINT), so that its
    session's end unmounts what its fixtures mounted (a kill left GlusterFS and sshfs
    mounts behind), and killed only if that does not end it within a minute."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=NESTED_SUITE_SECONDS)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        err += f"\n(interrupted after {NESTED_SUITE_SECONDS} s)"
        return subprocess.CompletedProcess(cmd, 1, out, err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
