"""What the reliability tests run in child processes (never in the test process).

* :func:`writer` appends batches; :func:`reader` loads in a loop and checks every
  snapshot as it goes; both report over a pipe.
* :func:`crash_child` runs one store operation with a *tracer* on the system calls
  that change the filesystem (``os.open`` for writing, ``write``, ``fsync``,
  ``rename``, ``link``, ``unlink``, ``mkdir``, ``rmdir`` and fsstore's
  ``renameat2``) and stops at a chosen point: it reports the calls made so far to
  the parent and sleeps until the parent kills it with SIGKILL. Points are named
  by what the calls do to the documented on-disk format (docs/format.md), e.g.
  "after the move of the temp file to a part name", so fsstore needs no test hooks
  and a refactoring inside fsstore does not move them. ``during_summary_update``
  stops inside the SDK's ``fold_session_summary``.
* :func:`hold_lock` takes a transcript lock and keeps it (alive) until killed; run
  as ``python -m tests.reliability._children hold-lock ...`` it can be started
  under ``unshare --uts`` with another hostname.

The module is preloaded in the forkserver, with fsstore and the Claude SDK.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import re
import stat
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import claude_agent_sdk  # preloaded in the forkserver: the store folds summaries with it

from fsstore import FsStoreError
from fsstore._store import SyncStore

from ._check import PART, SEGMENT, batch, is_lock_file, verify

# -- workers ---------------------------------------------------------------------------


def writer(
    root: str,
    key: dict[str, str],
    wid: Any,
    nbatches: int,
    seed: int,
    opts: dict[str, Any],
    start: Any,
    conn: Any,
    stop: Any = None,
) -> None:
    try:
        store = SyncStore(root, create=True, **opts)
        rng = random.Random(seed)
        start.wait(60)
        done = entries = 0
        for b in range(nbatches):
            if stop is not None and stop.is_set():
                break
            n = rng.randint(1, 5)
            store.append(key, batch(wid, b, n))
            done += 1
            entries += n
        conn.send(("ok", done, entries))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        conn.send(("error", traceback.format_exc()))


def reader(
    root: str,
    keys: list[dict[str, str]],
    opts: dict[str, Any],
    start: Any,
    stop: Any,
    conn: Any,
    halt_on_problem: bool = False,
) -> None:
    """Load each key in turn until ``stop``; every snapshot must extend the previous one.

    Since "extends" is transitive, the last snapshot being a prefix of the final
    transcript (checked by the parent) makes every snapshot a prefix of it.
    """
    try:
        store = SyncStore(root, create=True, **opts)
        prev: dict[int, list[tuple[Any, int, int]]] = {}
        loads = 0
        problems: list[str] = []
        start.wait(60)
        while not stop.is_set() and len(problems) < 5:
            for k, key in enumerate(keys):
                entries = store.load(key) or []
                loads += 1
                v = verify(entries)
                snap = [(e["w"], e["b"], e["i"]) for e in entries]
                if not v.ok():
                    problems.append(f"load {loads} of {key}: {v.problems[:3]}")
                old = prev.get(k, [])
                if snap[: len(old)] != old:
                    where = next(i for i, (a, b) in enumerate(zip(snap, old)) if a != b) if len(snap) >= len(old) else len(snap)
                    problems.append(
                        f"load {loads} of {key}: not an extension of the previous snapshot "
                        f"(first difference at entry {where}: saw {snap[where:where + 2]}, "
                        f"had {old[where:where + 2]})"
                    )
                prev[k] = snap
                if problems and halt_on_problem:
                    stop.set()
        conn.send(("ok", loads, problems, {k: prev.get(k, []) for k in range(len(keys))}))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        conn.send(("error", traceback.format_exc()))


# -- the tracer ------------------------------------------------------------------------

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


class Tracer:
    """Counts the filesystem-changing calls of this process and stops at a chosen one."""

    def __init__(self, conn: Any, stop_at: Callable[[Tracer, str, str, tuple[str, ...], bool], bool]) -> None:
        self.conn = conn
        self.stop_at = stop_at
        self.events: list[tuple[str, tuple[str, ...], str]] = []  # (call, names, outcome)
        self.fdnames: dict[int, str] = {}
        self.dirfds: set[int] = set()
        self.count = 0
        self.armed = False
        self.pause: float | None = None  # stop this long and go on, instead of waiting to be killed

    def step(self, phase: str, call: str, names: tuple[str, ...], ok: bool = True) -> None:
        if not self.armed:
            return
        if phase == "before":
            self.count += 1
        else:
            self.events.append((call, names, "ok" if ok else "error"))
        if self.stop_at(self, phase, call, names, ok):
            self.armed = False
            if self.pause is not None:
                self.conn.send(("paused", phase, call, names, self.events, self.count))
                time.sleep(self.pause)
                return
            self.conn.send(("reached", phase, call, names, self.events, self.count))
            while True:  # the parent kills us here
                time.sleep(3600)

    # helpers for stop conditions
    def done(self, call: str, pattern: re.Pattern[str] | str, index: int = -1) -> bool:
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        return any(c == call and o == "ok" and rx.search(n[index]) for c, n, o in self.events)

    def count_done(self, call: str, pattern: str, index: int = -1) -> int:
        rx = re.compile(pattern)
        return sum(1 for c, n, o in self.events if c == call and o == "ok" and rx.search(n[index]))


def _base(p: Any) -> str:
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    return os.path.basename(str(p)) if p is not None else "?"


def install(tracer: Tracer) -> None:
    """Wrap the os functions fsstore (and filelock) use to change the filesystem."""
    import fsstore._fsio as fsio

    real_open, real_write, real_fsync = os.open, os.write, os.fsync
    real_rename, real_replace, real_link = os.rename, os.replace, os.link
    real_unlink, real_mkdir, real_rmdir, real_close = os.unlink, os.mkdir, os.rmdir, os.close

    def t_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        name = _base(path)
        counted = bool(flags & _WRITE_FLAGS)
        if counted:
            tracer.step("before", "open", (name,))
        try:
            fd = real_open(path, flags, mode, dir_fd=dir_fd)
        except OSError:
            if counted:
                tracer.step("after", "open", (name,), False)
            raise
        tracer.fdnames[fd] = name
        if flags & os.O_DIRECTORY:
            tracer.dirfds.add(fd)
        if counted:
            tracer.step("after", "open", (name,))
        return fd

    def t_close(fd: int) -> None:
        tracer.fdnames.pop(fd, None)
        tracer.dirfds.discard(fd)
        real_close(fd)

    def by_fd(real: Callable[..., int]) -> Callable[..., int]:
        """write() and pwrite() (the in-place state file), traced as "write"."""
        def wrapped(fd: int, *args: Any) -> int:
            name = tracer.fdnames.get(fd)
            if name is None:  # a pipe or another file we did not open: not traced
                return real(fd, *args)
            tracer.step("before", "write", (name,))
            try:
                n = real(fd, *args)
            except OSError:
                tracer.step("after", "write", (name,), False)
                raise
            tracer.step("after", "write", (name,))
            return n

        return wrapped

    def t_fsync(fd: int) -> None:
        call = "fsync_dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync"
        name = tracer.fdnames.get(fd, "?")
        tracer.step("before", call, (name,))
        try:
            real_fsync(fd)
        except OSError:
            tracer.step("after", call, (name,), False)
            raise
        tracer.step("after", call, (name,))

    def two(call: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            names = (_base(src), _base(dst))
            tracer.step("before", call, names)
            try:
                out = real(src, dst, *args, **kwargs)
            except OSError:
                tracer.step("after", call, names, False)
                raise
            tracer.step("after", call, names)
            return out

        return wrapped

    def one(call: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(path: Any, *args: Any, **kwargs: Any) -> Any:
            names = (_base(path),)
            tracer.step("before", call, names)
            try:
                out = real(path, *args, **kwargs)
            except OSError:
                tracer.step("after", call, names, False)
                raise
            tracer.step("after", call, names)
            return out

        return wrapped

    os.open = t_open  # type: ignore[assignment]
    os.close = t_close
    os.write = by_fd(real_write)
    os.pwrite = by_fd(os.pwrite)
    os.fsync = t_fsync
    os.rename = two("rename", real_rename)
    os.replace = two("rename", real_replace)
    os.link = two("link", real_link)
    os.unlink = one("unlink", real_unlink)
    os.remove = os.unlink
    os.mkdir = one("mkdir", real_mkdir)
    os.rmdir = one("rmdir", real_rmdir)

    real_r2 = getattr(fsio, "_renameat2", None)
    if real_r2 is not None:

        def t_renameat2(dfd: int, src: bytes, dfd2: int, dst: bytes, flags: int) -> int:
            names = (_base(src), _base(dst))
            tracer.step("before", "renameat2", names)
            rc = real_r2(dfd, src, dfd2, dst, flags)
            # no Python call between the C call and the caller's ctypes.get_errno()
            if rc == 0:
                tracer.step("after", "renameat2", names)
            else:
                err = ctypes.get_errno()
                tracer.step("after", "renameat2", names, False)
                ctypes.set_errno(err)
            return rc

        fsio._renameat2 = t_renameat2


# -- named crash points ----------------------------------------------------------------

_MOVE = ("renameat2", "link")
# A batch's temp file: ".tmp-..." without the tags of the other temp files.
_TMP_BATCH = re.compile(r"^\.tmp-(?!.*-(?:state|segment|dir|deleted|probe)$)")


def _moved_to(call: str, names: tuple[str, ...], rx: re.Pattern[str]) -> bool:
    return call in _MOVE and len(names) == 2 and bool(rx.match(names[1]))


#: name -> (operation, fsync, stop condition). Each stops the child at that point.
POINTS: dict[str, tuple[str, bool, Callable[[Tracer, str, str, tuple[str, ...], bool], bool]]] = {
    # before the lock: the batch is in a temp file, nothing else
    "temp_file_created_empty": ("append", False,
        lambda t, ph, c, n, ok: ph == "after" and c == "open" and bool(_TMP_BATCH.match(n[0]))),
    "temp_file_written_before_lock": ("append", True,
        lambda t, ph, c, n, ok: ph == "after" and c == "fsync" and bool(_TMP_BATCH.match(n[0]))),
    # taking the lock: the holder's record written, not yet linked to the lock name
    "lock_record_written": ("append", False,
        lambda t, ph, c, n, ok: ph == "after" and c == "write" and n[0].startswith("owner-")),
    # holding the lock: the record linked to the lock name (the marker appears whole)
    "holding_lock_marker_written": ("append", False,
        lambda t, ph, c, n, ok: ph == "after" and ok and c == "link" and is_lock_file(n[1])),
    "holding_lock_before_move": ("append", False,
        lambda t, ph, c, n, ok: ph == "before" and _moved_to(c, n, PART)),
    "between_move_and_dir_fsync": ("append", True,
        lambda t, ph, c, n, ok: ph == "after" and ok and _moved_to(c, n, PART)),
    "during_dir_fsync_after_move": ("append", True,
        lambda t, ph, c, n, ok: ph == "before" and c == "fsync_dir" and any(_moved_to(x, y, PART) for x, y, _o in t.events)),
    # the check: linked, the listing not yet made or the temp name not yet unlinked
    "after_commit_before_temp_unlink": ("append", False,
        lambda t, ph, c, n, ok: ph == "before" and c == "unlink" and bool(_TMP_BATCH.match(n[0]))
        and any(_moved_to(x, y, PART) for x, y, _o in t.events)),
    # compaction (automatic, inside an append that reaches compact_every)
    "compaction_segment_temp_written": ("append_compacting", False,
        lambda t, ph, c, n, ok: ph == "after" and c == "write" and n[0].endswith("-segment")),
    "compaction_after_segment_move": ("append_compacting", False,
        lambda t, ph, c, n, ok: ph == "after" and ok and _moved_to(c, n, SEGMENT)),
    "during_summary_update": ("append_compacting", False, lambda t, ph, c, n, ok: ph == "fold"),
    "compaction_summary_written": ("append_compacting", False,
        lambda t, ph, c, n, ok: ph == "after" and ok and c == "rename" and n[1] == "state.json"),
    "compaction_midway_unlinking_parts": ("append_compacting", False,
        lambda t, ph, c, n, ok: ph == "after" and c == "unlink" and PART.match(n[0]) is not None
        and any(_moved_to(x, y, SEGMENT) for x, y, _o in t.events)
        and t.count_done("unlink", PART.pattern, 0) >= 2),
    # delete
    "delete_marked": ("delete", False,
        lambda t, ph, c, n, ok: ph == "after" and ok and c == "open" and n[0] == ".deleted"),
    "delete_before_rename_to_trash": ("delete", False,
        lambda t, ph, c, n, ok: ph == "before" and c == "rename" and n[1].endswith("-deleted")),
    "delete_after_rename_to_trash": ("delete", False,
        lambda t, ph, c, n, ok: ph == "after" and ok and c == "rename" and n[1].endswith("-deleted")),
    "delete_midway_removing_trash": ("delete", False,
        lambda t, ph, c, n, ok: ph == "after" and c == "unlink" and t.done("rename", "-deleted$")
        and sum(1 for x, _y, o in t.events if x == "unlink") >= 2),
    # a new session whose id needs a hashed directory name (.key written, not yet renamed)
    "hashed_dir_before_rename": ("append_new_hashed", False,
        lambda t, ph, c, n, ok: ph == "before" and c == "rename" and n[0].endswith("-dir")),
    "new_session_first_mkdir": ("append_new", False,
        lambda t, ph, c, n, ok: ph == "after" and c == "mkdir" and ok),
    # a new transcript: its directory made under a temp name with part 1 inside
    "new_transcript_before_rename": ("append_new", False,
        lambda t, ph, c, n, ok: ph == "before" and c == "rename" and n[0].endswith("-dir")
        and t.done("open", PART.pattern)),
}


def by_index(k: int, phase: str) -> Callable[[Tracer, str, str, tuple[str, ...], bool], bool]:
    """Stop before or after the k-th filesystem-changing call (random campaigns)."""
    return lambda t, ph, c, n, ok: ph == phase and t.count == k and ph in ("before", "after")


def crash_child(root: str, spec: dict[str, Any], conn: Any) -> None:
    """Run ``spec['op']`` on ``spec['key']`` and stop at ``spec['point']`` (or at syscall k)."""
    try:
        if "point" in spec:
            stop_at = POINTS[spec["point"]][2]
        else:
            stop_at = by_index(spec["k"], spec["phase"])
        tracer = Tracer(conn, stop_at)
        tracer.pause = spec.get("pause")
        install(tracer)
        _hook_fold(tracer)
        store = SyncStore(root, create=True, **spec["opts"])
        key = spec["key"]
        tracer.armed = True
        op = spec["op"]
        if op.startswith("append"):
            store.append(key, spec["batch"])
            store._compactions.done()  # an automatic compaction is the append's work too
        elif op == "delete":
            store.delete(key)
        elif op == "compact":
            store.compact(key)
        else:  # pragma: no cover
            raise ValueError(op)
        tracer.armed = False
        conn.send(("completed", tracer.events, tracer.count))
    except FsStoreError as exc:
        conn.send(("fsstore_error", exc.code, exc.operation, traceback.format_exc()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        conn.send(("error", traceback.format_exc()))


def _hook_fold(tracer: Tracer) -> None:
    import fsstore._summaries as summaries

    real = claude_agent_sdk.fold_session_summary

    def fold(prev: Any, key: Any, entries: Any) -> Any:
        tracer.step("fold", "fold", ("summary",))
        return real(prev, key, entries)

    claude_agent_sdk.fold_session_summary = fold
    cache_clear = getattr(summaries.fold_function, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


# -- locks -----------------------------------------------------------------------------


def hold_lock(root: str, key: dict[str, str], opts: dict[str, Any], conn: Any) -> None:
    """Take the transcript lock and keep it, alive, until killed."""
    try:
        with SyncStore(root, create=True, **opts).locked(key):
            conn.send(("locked", os.getpid()))
            while True:
                time.sleep(3600)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        conn.send(("error", traceback.format_exc()))


def _dead_holder(root: str, key: dict[str, str], opts: dict[str, Any]) -> None:
    """A holder forked here takes the lock and is SIGKILLed; how long until a new writer
    gets it? (Run inside ``unshare --pid`` to play a container.)"""
    import signal

    from ._check import lock_files

    SyncStore(root, create=True, **opts).append(key, batch("first", 0, 1))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder
        with SyncStore(root, create=True, **opts).locked(key):
            os.write(w, b"x")
            time.sleep(3600)
    os.read(r, 1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    marker = open(lock_files(root)[0]).read().split("\n")  # noqa: SIM115
    t0 = time.monotonic()
    error = None
    try:
        SyncStore(root, create=True, **{**opts, "lock_timeout_seconds": 5}).append(key, batch("second", 1, 1))
    except FsStoreError as exc:
        error = exc.code
    print(json.dumps({"marker_host": marker[1], "elapsed": time.monotonic() - t0, "error": error}))


def _main(argv: list[str]) -> None:
    cmd, root, key, opts = argv[0], argv[1], json.loads(argv[2]), json.loads(argv[3])
    if cmd == "dead-holder":
        _dead_holder(root, key, opts)
        return
    if cmd != "hold-lock":  # pragma: no cover
        raise SystemExit(f"unknown command {cmd}")
    with SyncStore(root, create=True, **opts).locked(key):
        print(f"locked {os.getpid()} {os.uname().nodename}", flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    _main(sys.argv[1:])
