"""The synchronous store: the one implementation of every operation.

:class:`fsstore.FsSessionStore` runs these methods in worker threads; scripts, the
CLI and operators call them directly through ``store.sync``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import errno
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import (
    _autocompact,
    _commit,
    _compact,
    _delete,
    _fsio,
    _keys,
    _layout,
    _listing,
    _read,
    _summaries,
    _transcript,
    _views,
)
from ._errors import FsStoreError, log, translating
from ._fsio import Fs
from ._keys import TranscriptKey
from ._layout import Component
from ._lock import Held, Locks
from ._transcript import (
    READ_ATTEMPTS,
    UNLOCKED_READS,
    Deleted,
    Vanished,
    dedupe,
    read_snapshot,
    warn_gap,
)

# A reader that keeps losing races with compactions and deletes gives up after this
# many reads, and after the second number reads under the transcript lock (see
# _hold_for_reading): the readers' limits, in _transcript.
_LOAD_ATTEMPTS, _OPTIMISTIC_LOADS = READ_ATTEMPTS, UNLOCKED_READS
# How long one listing of summaries waits, in all, for the clock to pass the mtimes of
# sessions changed just before (settled_mtime; a second where mtimes are whole seconds).
_SETTLE_SECONDS = 1.5


class _Again(enum.Enum):
    AGAIN = "again"  # a load attempt lost a race (see :meth:`SyncStore._load_once`)


_AGAIN = _Again.AGAIN


@dataclasses.dataclass
class _Retries:
    """What a load's lost attempts learned."""

    stale: OSError | None = None  # the last ESTALE (a mount that keeps answering it)
    stale_opens: int = 0  # attempts whose open of the path answered ESTALE
    deleting: bool = False  # a .deleted mark was seen: look again under the lock
    restored: int = 0  # times moved back from .trash (see _delete.restore)
    last: str = ""  # why the last attempt was lost (said where the load gives up)


# Transcripts an appending process remembers (validated key, paths, next number; about
# 1.4 KB each). An append to one it forgot, not yet compacted, looks at its whole path on
# the server (see _commit._unvouched): a third of a local append's time.
_APPENDING = 1024


class SyncStore:
    """Blocking twin of :class:`fsstore.FsSessionStore` (same methods, same errors)."""

    def __init__(
        self, root: str | os.PathLike[str], *, fsync: bool = False, stale_lock_seconds: float = 30.0,
        lock_timeout_seconds: float = 20.0, dir_mode: int = 0o700, file_mode: int = 0o600,
        summaries: bool | None = None, compact_every: int = 64, create: bool = False,
    ) -> None:
        if compact_every < 0:
            raise ValueError("compact_every must be >= 0 (0 turns automatic compaction off)")
        if not stale_lock_seconds > 0:
            raise ValueError("stale_lock_seconds must be > 0")
        if not lock_timeout_seconds >= 0:
            raise ValueError("lock_timeout_seconds must be >= 0")
        for name, mode in (("dir_mode", dir_mode), ("file_mode", file_mode)):
            if not 0 <= mode <= 0o7777:
                raise ValueError(f"{name} must be a permission mode like 0o700, not {mode!r}")
        self.root = os.path.abspath(os.fspath(root))
        self._create = create
        self._locks_path = f"{self.root}/{_layout.LOCKS}"
        self._compact_every = compact_every
        self._fs = Fs(fsync=fsync, dir_mode=dir_mode, file_mode=file_mode)
        _read.forget_mounts()  # mounts may have come and gone since the last store was made
        _views.forget_mounts()
        self._locks = Locks(
            self._fs, stale_lock_seconds=stale_lock_seconds, lock_timeout_seconds=lock_timeout_seconds)
        self._summaries = summaries
        if summaries is True and self._fold is None:
            raise ValueError("summaries=True needs claude-agent-sdk (pip install 'fsstore-sessions[claude]')")
        self._start_over()
        _fsio.in_forked_child(self, "_start_over")

    @property
    def _fold(self) -> _summaries.Fold | None:
        """The Claude SDK's fold, imported when first needed (a compaction, a listing of
        summaries): a process that never needs one does not load the SDK."""
        return _summaries.fold_function() if self._summaries is not False else None

    def _start_over(self) -> None:
        """Remember no transcript and queue no compaction (also in a forked child,
        where a thread that held a guard, or compacted, does not exist)."""
        # The transcripts this process appended to lately (see _commit.Appending).
        self._appending: collections.OrderedDict[tuple[str, str, str | None], _commit.Appending] = (
            collections.OrderedDict()
        )
        self._appending_guard = threading.Lock()
        self._compactions = _autocompact.Compactions()

    # -- plumbing ------------------------------------------------------------------

    @contextlib.contextmanager
    def _open_root(
        self, *, create: bool, path_only: bool = False, operation: str = "append"
    ) -> Iterator[int | None]:
        """The root, open; None if it does not exist. ``create``: for a write that makes
        directories, which only a store may take (see :meth:`_require_store`).
        ``path_only``: an ``O_PATH`` handle (``*at`` calls only; no open on a server)."""
        # The root path itself may be a symlink (the operator's choice); nothing
        # below it is followed.
        flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.root, flags | (getattr(os, "O_PATH", 0) if path_only else 0))
        except FileNotFoundError:
            if not create:
                yield None
                return
            if os.path.islink(self.root):  # mkdir would say EEXIST: say what is missing
                why = f"is a symlink to {os.readlink(self.root)}, which does not exist"
                if not self._create:
                    raise self._not_a_store(why, operation) from None
                raise FsStoreError("ENOENT", f"{self.root} {why} (is the share mounted?)",
                                   operation=operation, path=self.root, errno=errno.ENOENT) from None
            if not self._create:
                raise self._not_a_store("does not exist", operation) from None
            # Only the root itself, never its parents: a missing parent is a missing
            # mount more often than not.
            made = False
            try:
                os.mkdir(self.root, self._fs.dir_mode)
                made = True
            except FileNotFoundError:
                raise FsStoreError(
                    "ENOENT", f"the parent of {self.root} does not exist; fsstore makes the root "
                    "only, never its parents (is the share mounted?)", operation=operation,
                    path=os.path.dirname(self.root), errno=errno.ENOENT) from None
            except OSError as exc:
                if not _fsio.lost_race(exc, None, self.root):
                    raise  # else another writer (maybe on another host) made it first
            fd = os.open(self.root, flags)
            if made:
                try:
                    self._fs.fix_mode(fd)
                except BaseException:
                    os.close(fd)
                    raise
        try:
            if create:
                self._require_store(fd, operation)
            yield fd
        finally:
            os.close(fd)

    def _require_store(self, rfd: int, operation: str) -> None:
        """Refuse (NOT_A_STORE) to make directories in a root that is not a store: no
        ``.fsstore`` marker, and none of the directories of a store made before the
        marker existed. An unmounted share's mount point is such a directory; writing
        into it would split the store in two. With ``create``, write the marker."""
        for name in (_layout.MARKER, _layout.PROJECTS, _layout.LOCKS):
            try:
                os.stat(name, dir_fd=rfd, follow_symlinks=False)
                return
            except FileNotFoundError:
                continue
        if not self._create:
            raise self._not_a_store("has no .fsstore marker", operation)
        self.init_marker(rfd)

    def init_marker(self, rfd: int) -> None:
        """Write ``.fsstore`` (format, when, which host) unless it exists."""
        doc = {"format": 2, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "host": socket.gethostname()}
        try:
            self._fs.write_new(rfd, _layout.MARKER, (json.dumps(doc) + "\n").encode())
        except OSError as exc:
            if not _fsio.lost_race(exc, rfd, _layout.MARKER):
                raise

    def _not_a_store(self, why: str, operation: str) -> FsStoreError:
        return FsStoreError(
            "NOT_A_STORE",
            f"{self.root} {why}: not an fsstore store (is the share mounted? create a store "
            "with `fsstore init ROOT` or FsSessionStore(root, create=True))",
            operation=operation, path=self.root)

    def _open(
        self, rfd: int, comps: list[Component], operation: str, *, create: bool = False,
        path_only: bool = False,
    ) -> int | None:
        return self._fs.open_dir(
            rfd, comps, create=create, base_path=self.root, operation=operation, path_only=path_only
        )

    def _exists(self, rfd: int, comps: list[Component]) -> bool:
        fd = self._open(rfd, comps, "load", path_only=True)
        if fd is not None:
            os.close(fd)
        return fd is not None

    def _path(self, comps: list[Component]) -> str:
        return f"{self.root}/{_layout.rel(comps)}"

    def _lock_path(self, lock_name: str, operation: str) -> str:
        """Path of a transcript's lock file, ``<root>/.locks`` checked (:meth:`_locks_dir`)."""
        return f"{self._locks_dir(operation)}/{lock_name}"

    def _locks_dir(self, operation: str) -> str:
        """``<root>/.locks``, checked to be a real directory (created if missing).

        filelock opens the lock by path, so this runs before every acquire: a ``.locks``
        swapped for a symlink would otherwise take lock files outside root. It also
        creates the directory with ``dir_mode`` (filelock would use 0777 & ~umask).
        """
        locks = self._locks_path
        try:
            st = os.lstat(locks)
        except FileNotFoundError:
            with self._open_root(create=True, operation=operation) as rfd:
                assert rfd is not None
                self._fs.make_dir(rfd, _layout.LOCKS, None)
            st = os.lstat(locks)
        if not stat.S_ISDIR(st.st_mode):
            raise _fsio.unsafe(locks, operation)
        return locks

    # -- append --------------------------------------------------------------------

    def _appending_to(self, key: Mapping[str, Any], operation: str) -> _commit.Appending:
        """The transcript ``key`` names, validated once per process and then remembered."""
        ident: Any = None
        if type(key) is dict:
            subpath = key.get("subpath")
            ident = (key.get("project_key"), key.get("session_id"), subpath if subpath != "" else None)
            with self._appending_guard:
                try:
                    known = self._appending.get(ident)
                except TypeError:  # an unhashable value: parse_key says what is wrong
                    known = None
                if known is not None:
                    self._appending.move_to_end(ident)
                    return known
        tk = _keys.parse_key(key, operation)
        comps = _layout.transcript_dirs(tk)
        t = _commit.Appending(key=tk, comps=comps, path=self._path(comps),
                       lock_path=f"{self._locks_path}/{_layout.lock_name(comps)}",
                       session_marker=_layout.session_marker(tk))
        with self._appending_guard:
            t = self._appending.setdefault((tk.project_key, tk.session_id, tk.subpath), t)
            while len(self._appending) > _APPENDING:
                self._appending.popitem(last=False)  # an append in flight keeps its own
        return t

    def append(self, key: Mapping[str, Any], entries: list[Any]) -> None:
        """Commit ``entries`` as one batch (see :mod:`fsstore._commit` for the protocol).

        When it returns, the batch is in every later ``load()`` on every host whose
        client sees the file, exactly once and whole. An empty list writes nothing.
        Raises :class:`~fsstore.FsStoreError`: ``INVALID_KEY``/``INVALID_ENTRY``
        before anything touches disk; otherwise nothing of the batch is committed,
        except where the message says it may be (see :meth:`FsSessionStore.append`).
        """
        self._append(key, entries)

    def _append(
        self, key: Mapping[str, Any], entries: list[Any], *, into: Callable[[int], bool] | None = None,
        payload: bytes | None = None,
    ) -> None:
        """``payload``: the bytes ``entries`` were written as once (a merge's: see _merge)."""
        op = "append"
        t = self._appending_to(key, op)
        if isinstance(entries, list) and not entries:
            return
        payload = _transcript.encode_batch(entries, op) if payload is None else payload
        with translating(op, t.path):
            _commit.append(self, t, payload, into=into)

    def _summary_of(self, tk: TranscriptKey) -> _compact.Summary | None:
        """What compaction needs to keep the summary sidecar: main transcripts only."""
        if tk.subpath is not None or self._fold is None:
            return None
        return self._fold, {"project_key": tk.project_key, "session_id": tk.session_id}

    # -- load ----------------------------------------------------------------------

    def load(self, key: Mapping[str, Any]) -> list[Any] | None:
        """The transcript's entries in commit order, or None if it has none.

        Every batch whose ``append`` returned before this call is in it, each once
        and whole; entries with a string ``uuid`` seen before are dropped. A load
        racing a delete returns the whole transcript or None. Raises
        :class:`~fsstore.FsStoreError` (``CORRUPT`` names the file and line of
        damaged bytes; ``EAGAIN`` after losing too many races with compactions).
        """
        op = "load"
        tk = _keys.parse_key(key, op)
        comps = _layout.transcript_dirs(tk)
        path = self._path(comps)
        seen = _Retries()
        with translating(op, path):
            for attempt in range(_LOAD_ATTEMPTS):
                try:
                    snapshot = self._load_once(tk, comps, path, attempt, seen)
                except Deleted as marked:
                    # A delete is committed once marked. Seen under the transcript's lock,
                    # its deleter may have died: finish it (out of the lock: deleters hold
                    # the lock of what they move).
                    _delete.finish(self, comps, path, session=marked.session)
                    return None
                if snapshot is _AGAIN:
                    continue
                if snapshot is None:
                    return None
                batches, gap = snapshot
                if gap is not None:
                    warn_gap(gap, path, op)
                return dedupe(batches) if batches else None
            if seen.stale is not None:
                raise seen.stale  # a mount that keeps answering ESTALE: say so, not "busy"
            raise FsStoreError(
                "EAGAIN",
                f"transcript changed under the reader {_LOAD_ATTEMPTS} times in a row "
                f"(the last time: {seen.last})",
                operation=op,
                path=path,
                errno=errno.EAGAIN,
            )

    def _load_once(
        self, tk: TranscriptKey, comps: list[Component], path: str, attempt: int, seen: _Retries
    ) -> tuple[list[tuple[int, list[dict[str, Any]]]], int | None] | None | _Again:
        """One attempt of :meth:`load`: its snapshot (batches, first missing number),
        None (no transcript), or ``_AGAIN`` (a race: what it learned is in ``seen``).
        Raises :class:`Deleted` for a delete to finish (seen under the lock)."""
        op, names = "load", [n for n, _ in comps]
        with contextlib.ExitStack() as guard, self._open_root(create=False, path_only=True) as rfd:
            if rfd is None:
                return None
            locked = (seen.deleting or attempt >= _OPTIMISTIC_LOADS) and self._hold_for_reading(guard, comps)
            try:
                dfd = self._open(rfd, comps, op, path_only=True)
            except OSError as exc:
                if exc.errno != errno.ESTALE:
                    raise
                # Replaced or deleted by another host: a GlusterFS client can answer so
                # for every open of the path until its 1 s caches lapse (review 104, a
                # load of a session just deleted twice: 50 tries in 0.1 s). A pause.
                seen.stale, seen.stale_opens = exc, seen.stale_opens + 1
                time.sleep(min(0.02 * seen.stale_opens, 0.1))
                return _AGAIN
            if dfd is None:
                if seen.restored < 2 and _delete.restore(self, rfd, comps):
                    seen.restored += 1
                    seen.last = "a delete's mistaken move into .trash was put back"
                    return _AGAIN  # a stalled delete had it in .trash by mistake
                return None
            try:
                snapshot = read_snapshot(dfd, path, op, _layout.session_marker(tk))
                # Deleted (moved away) while we read: look again.
                if _fsio.same_dir(dfd, rfd, names):
                    return snapshot
                seen.last = "the directory at its name was replaced"
                return _AGAIN
            except Deleted:
                if locked:
                    raise
                if seen.deleting:
                    return None  # marked, and we may not take the lock to finish it
                seen.deleting, seen.last = True, "a delete's mark"  # look again under the lock
                return _AGAIN
            except (Vanished, OSError) as exc:
                cause = exc.__cause__ if isinstance(exc, Vanished) else exc
                seen.last = str(exc)
                if isinstance(exc, OSError) and exc.errno not in (errno.ENOENT, errno.ESTALE):
                    raise
                if isinstance(cause, OSError) and cause.errno == errno.ESTALE:
                    seen.stale = cause
                # Listed files, or the directory, gone under us (a compaction, another
                # host's delete): our client may list from a cache. Ask the server.
                if attempt and not _views.refresh_listing(dfd):
                    return None  # the directory is gone on the server: deleted
                return _AGAIN
            except FsStoreError:
                if _fsio.same_dir(dfd, rfd, names):
                    raise
                seen.last = "the directory at its name was replaced"
                return _AGAIN  # a half-removed directory (a delete) is not damage
            finally:
                os.close(dfd)

    def _hold_for_reading(self, guard: contextlib.ExitStack, comps: list[Component]) -> bool:
        """Take the transcript's lock into ``guard`` for a reader that keeps losing races.

        A load lists, then reads every file; a writer compacting faster than that
        (many writers, a small ``compact_every``) can make each listing stale before it
        is read, forever. Under the lock the read is one consistent snapshot; writers
        wait one read. A reader that may not take the lock (a read-only mount or user)
        or does not get it in time goes on without it. Returns whether it holds it
        (also when the caller holds it already: inside :meth:`locked`).
        """
        try:
            path = self._lock_path(_layout.lock_name(comps), "load")
            if self._locks.held_here(path):
                return True
            guard.enter_context(self._locks.hold(path, "load"))
        except (OSError, FsStoreError) as exc:
            log.debug("load goes on without the transcript lock: %s", exc)
            return False
        return True

    # -- listing -------------------------------------------------------------------

    def list_sessions(self, project_key: str) -> list[dict[str, Any]]:
        """``[{"session_id", "mtime"}]`` (epoch ms, the storage's time of the last commit)
        of the project's sessions with a main transcript; nothing for a missing project.
        A session this process may not read is left out and logged, not raised."""
        op = "list_sessions"
        _keys.check_part(project_key, "project_key", op)
        comps = _layout.project_dirs(project_key)
        with translating(op, self._path(comps)), _listing.children(self, comps, op) as (pfd, children, moved_back):
            return [{"session_id": session_id, "mtime": mtime}
                    for session_id, mtime in _listing.transcript_mtimes(
                        pfd, children, _layout.MAIN, self._path(comps), op, moved_back)]

    def list_subkeys(self, key: Mapping[str, Any]) -> list[str]:
        """The ``subpath`` of every subagent transcript of the session ``key``."""
        op = "list_subkeys"
        tk = _keys.parse_key(key, op, allow_subpath=False)
        comps = [*_layout.session_dirs(tk.project_key, tk.session_id), (_layout.SUBKEYS, None)]
        with translating(op, self._path(comps)), _listing.children(self, comps, op) as (pfd, children, moved_back):
            valid = []
            for name, subpath in children:
                try:
                    _keys.parse_key({**tk.as_dict(), "subpath": subpath}, op)
                except FsStoreError:
                    continue  # a name no valid key encodes to: not ours to report
                valid.append((name, subpath))
            return [subpath for subpath, _mtime
                    in _listing.transcript_mtimes(pfd, valid, None, self._path(comps), op, moved_back)]

    def list_session_summaries(self, project_key: str) -> list[dict[str, Any]]:
        """The Claude SDK's summaries of the project's sessions, each current as of its
        ``mtime``; a session whose summary cannot be had now is left out."""
        return _listing.summaries(self, project_key)

    # -- delete --------------------------------------------------------------------

    def delete(self, key: Mapping[str, Any]) -> None:
        """Delete a session (its main and subagent transcripts) or, with ``subpath``,
        one subagent transcript; missing is not an error. Marked ``.deleted``, then moved
        into ``.trash`` in one rename (:mod:`fsstore._delete`): readers see all or None.
        Committed once marked: a failure after that is raised, loads see None, and the
        next append, locked load or delete finishes it."""
        self.delete_unless(key, None)

    def delete_unless(self, key: Mapping[str, Any], keep: Callable[[], bool] | None) -> bool:
        """:meth:`delete`; where ``keep`` is given (``fsstore prune``'s last look), the
        transcripts are marked as a prune's, ``keep`` is asked, and the delete is
        committed unless it says True or an append came in since the marks (which wins):
        False if kept, its marks taken back (:func:`fsstore._delete._prune`)."""
        op = "delete"
        tk = _keys.parse_key(key, op)
        if tk.subpath is None:
            comps = _layout.session_dirs(tk.project_key, tk.session_id)
        else:
            comps = _layout.transcript_dirs(tk)
        path = self._path(comps)
        with translating(op, path):
            try:
                tries = 3
                while True:
                    try:
                        return _delete.remove(self, comps, path,
                                              _layout.MAIN if tk.subpath is None else "", op, keep)
                    except OSError as exc:
                        # ESTALE for good: a directory opened on the way was removed by
                        # another host meanwhile (its session deleted there; review 104):
                        # from the root again. Not a prune's: its look was of what went.
                        tries -= 1
                        if exc.errno != errno.ESTALE or keep is not None or not tries:
                            raise
            finally:
                self._forget(tk)

    def _forget(self, tk: TranscriptKey) -> None:
        """Drop what appends remember of a deleted session (or subagent transcript).

        Not needed for correctness (a new directory is another inode), only to
        forget at once.
        """
        with self._appending_guard:
            for ident in [i for i in self._appending if i[:2] == (tk.project_key, tk.session_id)
                          and (tk.subpath is None or i[2] == tk.subpath)]:
                del self._appending[ident]

    # -- maintenance ---------------------------------------------------------------

    def compact(self, key: Mapping[str, Any]) -> int:
        """Merge all of a transcript's files into one segment; return how many were merged."""
        tk = _keys.parse_key(key, "compact")
        with translating("compact", self._path(_layout.transcript_dirs(tk))):
            return self._compact(tk, everything=True)

    def _compact(self, tk: TranscriptKey, *, everything: bool, wait: float | None = None) -> int:
        """:meth:`compact` (``everything``) or the automatic one (the parts since the
        last segment, binary-counter style); raises OSError or FsStoreError, unlogged."""
        op = "compact"
        comps = _layout.transcript_dirs(tk)
        path = self._path(comps)
        with self._open_root(create=False) as rfd:
            if rfd is None:
                return 0
            try:
                dfd = self._open(rfd, comps, op)
            except OSError as exc:
                # Replaced on another host since this client looked it up (a delete,
                # a prune; review, stop 36: COMPACT_FAILED beside them on GlusterFS):
                # nothing to compact there; the next compaction looks it up again.
                if exc.errno != errno.ESTALE:
                    raise
                return 0
            if dfd is None:
                return 0
            lock = self._lock_path(_layout.lock_name(comps), op)
            try:
                summary = self._summary_of(tk)  # the SDK's first import, if now: not under the lock
                return _compact.compact(self._fs, dfd, path, lambda: self._locks.hold(lock, op, wait),
                                        everything=everything, operation=op, summary=summary)
            finally:
                os.close(dfd)

    @contextlib.contextmanager
    def locked(self, key: Mapping[str, Any]) -> Iterator[None]:
        """Hold the transcript's commit lock (the transcript need not exist).

        Inside, this store's append, compact and load of that transcript, in the
        same thread or task, run under it rather than wait for it (nested
        ``locked`` too); other threads, tasks, processes and stores wait.

        In the main thread, Ctrl-C (SIGINT) is held off while the lock is held, as
        it is inside every append: its ``KeyboardInterrupt`` comes at the next
        append or compact inside the block, before it commits, or as the block ends
        and the lock is given back (see ``fsstore/_interrupts.py``); the SIGINT
        handler in place as the block began is the one in place after it.
        """
        hold, held = self._take_lock(key)
        # The caller's own errors pass through untranslated.
        try:
            with self._locks.marked_held(held):
                yield
        finally:
            hold.__exit__(None, None, None)

    def _take_lock(self, key: Mapping[str, Any]) -> tuple[contextlib.AbstractContextManager[Held], Held]:
        """The entered hold of a transcript's lock, for :meth:`locked` (and the async
        store's, which takes it in a worker thread); the caller exits it."""
        op = "lock"
        tk = _keys.parse_key(key, op)
        comps = _layout.transcript_dirs(tk)
        with translating(op, self._path(comps)):
            hold = self._locks.hold(self._lock_path(_layout.lock_name(comps), op), op)
            return hold, hold.__enter__()

    # -- for maintenance: what ``fsstore``'s commands use of the store --------------

    @property
    def fs(self) -> Fs:
        """The file operations with this store's modes and fsync setting, for the
        maintenance code that opens and writes in the store's directories."""
        return self._fs

    def open_root(self) -> contextlib.AbstractContextManager[int | None]:
        """The root directory, open for the ``with`` (None if it does not exist;
        NotADirectoryError if it is not a directory). The root path itself may be a
        symlink; nothing below it is followed."""
        return self._open_root(create=False)

    def init(self) -> None:
        """Make the store: the root (never its parents; ``create=True`` where it does
        not exist yet) and its ``.fsstore`` marker, unless they are there."""
        with translating("init", self.root), self._open_root(create=True, operation="init") as rfd:
            assert rfd is not None
            self.init_marker(rfd)

    @contextlib.contextmanager
    def reading_lock(self, key: Mapping[str, Any]) -> Iterator[bool]:
        """Hold the transcript's lock for a reader that keeps losing races with
        compactions, as ``load`` does after a few tries (:meth:`_hold_for_reading`):
        where this process may not take it, or does not get it in time, the reader
        goes on without it. Yields whether it is held (also when this thread holds it
        already, inside :meth:`locked`)."""
        comps = _layout.transcript_dirs(_keys.parse_key(key, "load"))
        with contextlib.ExitStack() as guard:
            yield self._hold_for_reading(guard, comps)
