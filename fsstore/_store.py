"""The synchronous store: the one implementation of every operation.

:class:`fsstore.FsSessionStore` runs these methods in worker threads; scripts, the
CLI and operators call them directly through ``store.sync``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import _compact, _delete, _fsio, _keys, _layout, _summaries
from ._errors import FsStoreError, log, translating
from ._fsio import Fs
from ._keys import TranscriptKey
from ._layout import Component
from ._lock import Held, Locks
from ._transcript import (
    READ_ATTEMPTS,
    UNLOCKED_READS,
    Deleted,
    Item,
    State,
    Vanished,
    check_session_marker,
    commit,
    dedupe,
    encode_batch,
    parse,
    plan,
    read_snapshot,
    read_state,
    scan,
    scan_items,
    warn_gap,
)

# A reader that keeps losing races with compactions and deletes gives up after this
# many reads, and after the second number reads under the transcript lock (see
# _hold_for_reading): the readers' limits, in _transcript.
_LOAD_ATTEMPTS, _OPTIMISTIC_LOADS = READ_ATTEMPTS, UNLOCKED_READS
# An append whose transcript directory is deleted under it starts over this often.
_APPEND_ATTEMPTS = 50
_STALE_VIEW_PAUSE = 1.1  # s: a GlusterFS client's cached lookups (1 s) lapse unused


# Transcripts an appending process remembers (validated key, paths, next number).
_APPENDING = 64


@dataclasses.dataclass(eq=False)
class _Appending:
    """One transcript as a process that appends to it remembers it between appends:
    the key validated and its paths worked out once, and where the next part goes."""

    key: TranscriptKey
    comps: list[Component]
    path: str  # <root>/<rel>, for messages
    lock_path: str  # <root>/.locks/<lock name>
    sdk_key: dict[str, str]  # the key as the SDK's summary fold takes it
    session_marker: str | None  # see _layout.session_marker
    # One above the highest number this process saw at its last commit, and the name
    # of the file that held it: while that file is still there, no compaction merged
    # it and no delete took the directory (a directory made anew can even reuse the
    # inode), so the number is still the next one or a link to it finds EEXIST.
    next_seq: int = 0
    last_name: str | None = None


def _last_of(items: list[Item]) -> tuple[int, str | None]:
    """One above the highest number of a listing, and the name of a file holding it."""
    last = max(items, key=lambda it: it[1], default=None)
    return (1, None) if last is None else (last[1] + 1, last[2])


def _check_made(fd: int, names: list[str], t: _Appending) -> None:
    """:class:`Deleted` if the subagent transcript just published at ``fd/names...``
    belongs to a session marked deleted (a session delete that marked it before the
    new directory appeared moves it away with the session: nothing of it is kept, and
    what was made is removed)."""
    if t.session_marker is None:
        return
    try:
        check_session_marker(fd, "/".join([*names, t.session_marker]))
    except Deleted:
        with contextlib.suppress(OSError):
            _fsio.remove_tree(fd, names[0])
        raise


def _tick_mtime(dfd: int, before_ns: int) -> None:
    """Make the directory's mtime (the session's mtime) at least 1 ms later than
    before the commit. The SDK compares a summary's mtime with list_sessions' in
    whole milliseconds, and file systems stamp with a coarse clock (ext4: a few
    ms): without this, a commit within the same tick would leave a summary made
    before it looking fresh. Only ever moves forward, from the storage's own times."""
    st = os.fstat(dfd)
    if st.st_mtime_ns // 1_000_000 <= before_ns // 1_000_000:
        os.utime(".", ns=(st.st_atime_ns, (before_ns // 1_000_000 + 1) * 1_000_000), dir_fd=dfd)


class SyncStore:
    """Blocking twin of :class:`fsstore.FsSessionStore` (same methods, same errors)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = False,
        stale_lock_seconds: float = 30.0,
        lock_timeout_seconds: float = 20.0,
        dir_mode: int = 0o700,
        file_mode: int = 0o600,
        summaries: bool | None = None,
        compact_every: int = 64,
        create: bool = False,
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
        self._locks = Locks(
            self._fs, stale_lock_seconds=stale_lock_seconds, lock_timeout_seconds=lock_timeout_seconds)
        self._fold = _summaries.fold_function() if summaries is not False else None
        self._forget_appending()
        _fsio.in_forked_child(self, "_forget_appending")
        if summaries is True and self._fold is None:
            raise ValueError("summaries=True needs claude-agent-sdk (pip install 'fsstore-sessions[claude]')")

    def _forget_appending(self) -> None:
        """Remember no transcript (also in a forked child, where a thread that held
        the guard does not exist)."""
        # The transcripts this process appended to lately (see _Appending).
        self._appending: collections.OrderedDict[tuple[str, str, str | None], _Appending] = (
            collections.OrderedDict()
        )
        self._appending_guard = threading.Lock()

    # -- plumbing ------------------------------------------------------------------

    @contextlib.contextmanager
    def _open_root(self, *, create: bool, path_only: bool = False) -> Iterator[int | None]:
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
            if not self._create:
                raise self._not_a_store("does not exist") from None
            # Only the root itself, never its parents: a missing parent is a missing
            # mount more often than not.
            made = False
            try:
                os.mkdir(self.root, self._fs.dir_mode)
                made = True
            except FileExistsError:
                pass  # another writer made it first
            except FileNotFoundError:
                raise FsStoreError(
                    "ENOENT", f"the parent of {self.root} does not exist; fsstore makes the root "
                    "only, never its parents (is the share mounted?)", operation="append",
                    path=os.path.dirname(self.root), errno=errno.ENOENT) from None
            fd = os.open(self.root, flags)
            if made:
                try:
                    self._fs.fix_mode(fd)
                except BaseException:
                    os.close(fd)
                    raise
        try:
            if create:
                self._require_store(fd)
            yield fd
        finally:
            os.close(fd)

    def _require_store(self, rfd: int) -> None:
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
            raise self._not_a_store("has no .fsstore marker")
        self.init_marker(rfd)

    def init_marker(self, rfd: int) -> None:
        """Write ``.fsstore`` (format, when, which host) unless it exists."""
        doc = {"format": 2, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "host": socket.gethostname()}
        try:
            self._fs.write_new(rfd, _layout.MARKER, (json.dumps(doc) + "\n").encode())
        except FileExistsError:
            pass

    def _not_a_store(self, why: str) -> FsStoreError:
        return FsStoreError(
            "NOT_A_STORE",
            f"{self.root} {why}: not an fsstore store (is the share mounted? create a store "
            "with `fsstore init ROOT` or FsSessionStore(root, create=True))",
            operation="append", path=self.root)

    def _open(
        self, rfd: int, comps: list[Component], operation: str, *, create: bool = False,
        path_only: bool = False,
    ) -> int | None:
        return self._fs.open_dir(
            rfd, comps, create=create, base_path=self.root, operation=operation, path_only=path_only
        )

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
            with self._open_root(create=True) as rfd:
                assert rfd is not None
                self._fs.make_dir(rfd, _layout.LOCKS, None)
            st = os.lstat(locks)
        if not stat.S_ISDIR(st.st_mode):
            raise _fsio.unsafe(locks, operation)
        return locks

    # -- append --------------------------------------------------------------------

    def _appending_to(self, key: Mapping[str, Any], operation: str) -> _Appending:
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
        t = _Appending(key=tk, comps=comps, path=self._path(comps),
                       lock_path=f"{self._locks_path}/{_layout.lock_name(comps)}", sdk_key=tk.as_dict(),
                       session_marker=_layout.session_marker(tk))
        with self._appending_guard:
            t = self._appending.setdefault((tk.project_key, tk.session_id, tk.subpath), t)
            while len(self._appending) > _APPENDING:
                self._appending.popitem(last=False)  # an append in flight keeps its own
        return t

    def append(self, key: Mapping[str, Any], entries: list[Any]) -> None:
        """Commit ``entries`` as one batch (see :mod:`fsstore._transcript` for the protocol).

        When it returns, the batch is in every later ``load()`` on every host whose
        client sees the file, exactly once and whole. An empty list writes nothing.
        Raises :class:`~fsstore.FsStoreError`: ``INVALID_KEY``/``INVALID_ENTRY``
        before anything touches disk; otherwise nothing of the batch is committed.
        """
        op = "append"
        t = self._appending_to(key, op)
        if isinstance(entries, list) and not entries:
            return
        payload = encode_batch(entries, op)
        with translating(op, t.path):
            for attempt in range(_APPEND_ATTEMPTS):
                try:
                    self._append_once(t, payload)
                    return
                except Deleted as exc:
                    # A delete is committed once marked: finish it (its deleter may
                    # have died) and start over in a new directory. Nothing of ours
                    # is visible. Not under our lock: finishing takes the lock of
                    # what it moves (the session's: its main transcript's).
                    _delete.finish(self, t.comps, t.path, session=exc.session)
                    # Where this client still reaches the deleted directory by its path.
                    with contextlib.suppress(Deleted, FileNotFoundError):
                        if self._recreate(t, payload):
                            t.next_seq, t.last_name = 2, _layout.part_name(1)
                            return
                except FileNotFoundError:
                    pass  # moved away by a delete before our commit: start over
                except OSError as exc:
                    if exc.errno != errno.ESTALE or attempt == _APPEND_ATTEMPTS - 1:
                        raise
                    # NFS: a directory another host replaced (deleted and made anew)
                    # since this client looked it up; looked up again next time.
                t.last_name = None
                time.sleep(min(0.001 * attempt, 0.05))
            raise FsStoreError(
                "ENOENT",
                "transcript directory kept disappearing (concurrent deletes)",
                operation=op,
                path=t.path,
                errno=errno.ENOENT,
            )

    def _append_once(self, t: _Appending, payload: bytes) -> None:
        op = "append"
        with self._open_root(create=False, path_only=True) as rfd:
            dfd = self._open(rfd, t.comps, op, path_only=True) if rfd is not None else None
        if dfd is None:
            with self._open_root(create=True, path_only=True) as rfd:
                assert rfd is not None
                if self._first_commit(rfd, t, payload):
                    t.next_seq, t.last_name = 2, _layout.part_name(1)
                    return
            raise FileNotFoundError(errno.ENOENT, "created and deleted meanwhile", t.path)
        try:
            # The directory as it was: the temp file's creation can move its mtime back
            # (a coarse clock behind the last commit's tick: see _tick_mtime).
            before = os.fstat(dfd)
            tmp = _fsio.temp_name()
            try:
                self._fs.write_temp(dfd, tmp, payload)
            except FileNotFoundError:
                tmp = ""
                if self._recreate(t, payload):
                    t.next_seq, t.last_name = 2, _layout.part_name(1)
                    return
                raise
            try:
                self._locks_dir(op)
                with self._locks.hold(t.lock_path, op) as held:
                    now = os.fstat(dfd)  # after any commit that came before ours
                    seq = self._next_seq(t, dfd)
                    held.check(op)
                    seq, items = commit(self._fs, dfd, tmp, seq, payload, t.session_marker)
                    t.next_seq, t.last_name = _last_of(items)
                    tmp = self._drop_temp(dfd, tmp, t.path)
                    self._after_commit(t, dfd, held, items, max(before.st_mtime_ns, now.st_mtime_ns))
            finally:
                if tmp:
                    _fsio.unlink_quiet(dfd, tmp)
        finally:
            os.close(dfd)

    @staticmethod
    def _drop_temp(dfd: int, tmp: str, path: str) -> str:
        """Unlink a committed batch's temp name (a second link to its part). After the
        commit point: a failure is logged (the name is garbage for ``fsstore gc``),
        since raising would make the SDK retry a committed batch. Returns ``""``."""
        try:
            _fsio.unlink_quiet(dfd, tmp)
        except OSError as exc:
            log.warning("temp link left after commit: %s", exc, extra={
                "code": "TEMP_LEFT", "operation": "append", "path": f"{path}/{tmp}"})
        return ""

    def _first_commit(self, rfd: int, t: _Appending, payload: bytes) -> bool:
        """Commit the first batch of a new transcript: its directory appears with part
        1 already in it (one rename), so no reader or listing ever sees a transcript
        without a part. False if another writer's directory appeared first."""
        parent = self._open(rfd, t.comps[:-1], "append", create=True, path_only=True)
        assert parent is not None
        name, original = t.comps[-1]
        try:
            self._locks_dir("append")
            with self._locks.hold(t.lock_path, "append") as held:
                held.check("append")
                made = self._fs.new_dir(parent, name, original, lambda tfd: self._fs.write_new(
                    tfd, _layout.part_name(1), payload))
                if made:
                    _check_made(parent, [name], t)
                return made
        finally:
            os.close(parent)

    def _recreate(self, t: _Appending, payload: bytes) -> bool:
        """Commit the batch as part 1 of the transcript made anew where its directory is
        gone on the server while its path still opens here: another host deleted the
        session and this client answers from a cache (sshfs keeps names 20 s; mkdir
        there says EEXIST; a GlusterFS client keeps reaching the moved directory while
        it uses it, see _fsio.listed_dir). The missing part of the path is made under a temp name,
        part 1 inside, and renamed over the stale name (a rename reaches the server).
        False if nothing is missing there (the caller starts over)."""
        with self._open_root(create=True, path_only=True) as rfd:
            assert rfd is not None
            fd = os.dup(rfd)
            try:
                for i, (name, original) in enumerate(t.comps):
                    nfd = os.open(name, _fsio.PATH_FLAGS, dir_fd=fd)
                    if _fsio.gone_on_server(self._fs, rfd, fd, name, nfd):
                        os.close(nfd)
                        break  # comps[i] is gone on the server: make comps[i:] anew
                    os.close(fd)
                    fd = nfd
                else:
                    return False
                self._locks_dir("append")
                with self._locks.hold(t.lock_path, "append") as held:
                    held.check("append")
                    made = self._fs.new_dir(fd, name, original, self._filler(t.comps[i + 1:], payload))
                if made:
                    _check_made(fd, [n for n, _ in t.comps[i:]], t)
                elif self._fs.listed_ino_ok:
                    # Another directory is there on the server, and this client reaches the
                    # old one: its view lapses once unused (GlusterFS: about 1 s). Not
                    # touching it meanwhile is what lets it lapse.
                    time.sleep(_STALE_VIEW_PAUSE)
                return made
            finally:
                os.close(fd)

    def _filler(self, comps: list[Component], payload: bytes) -> Callable[[int], object]:
        """What :meth:`_fsio.Fs.new_dir` writes into a new directory: the directories
        ``comps`` below it (each with its ``.key`` where hashed), part 1 in the last."""
        def fill(dir_fd: int) -> None:
            if not comps:
                self._fs.write_new(dir_fd, _layout.part_name(1), payload)
                return
            (name, original), below = comps[0], self._filler(comps[1:], payload)
            os.mkdir(name, self._fs.dir_mode, dir_fd=dir_fd)
            sub = os.open(name, _fsio.DIR_FLAGS, dir_fd=dir_fd)
            try:
                self._fs.fix_mode(sub)
                if original is not None:
                    self._fs.write_new(sub, _fsio.KEY_FILE, original.encode("utf-8"))
                below(sub)
            finally:
                os.close(sub)
        return fill

    def _next_seq(self, t: _Appending, dfd: int) -> int:
        """Where this process's next part goes (step 4 of the commit)."""
        if t.last_name is not None:
            try:
                os.stat(t.last_name, dir_fd=dfd, follow_symlinks=False)
                return t.next_seq
            except FileNotFoundError:
                pass
        t.next_seq, t.last_name = _last_of(scan_items(dfd))
        return t.next_seq

    def _after_commit(
        self, t: _Appending, dfd: int, held: Held, items: list[Item], before_ns: int
    ) -> None:
        """After the commit point. Nothing here fails the append.

        The batch is committed; raising now would make the SDK retry it, and a
        retried batch is stored twice (entries without a uuid are not de-duplicated).
        So failures are logged: a failed directory fsync is the operator's to see, a
        failed compaction only costs load speed.
        """
        try:
            _tick_mtime(dfd, before_ns)
            self._fs.sync_dir(dfd)
        except OSError as exc:
            code = errno.errorcode.get(exc.errno or 0, "EIO")
            log.error(
                "batch committed and visible, but the directory fsync failed (%s): it may not "
                "survive a power loss", exc,
                extra={"code": code, "operation": "append", "path": t.path, "errno": exc.errno},
            )
        if not self._compact_every:
            return
        compacted = max((last for first, last, _ in items if first != last), default=0)
        if sum(1 for first, last, _ in items if first == last and first > compacted) < self._compact_every:
            return
        try:
            _compact.compact(self._fs, dfd, t.path, held, everything=False, operation="compact",
                             summary=self._summary_of(t.key))
        except (OSError, FsStoreError, Vanished) as exc:
            log.warning("automatic compaction failed: %s", exc,
                        extra={"code": "COMPACT_FAILED", "operation": "compact", "path": t.path})

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
        names = [n for n, _ in comps]
        with translating(op, path):
            stale: OSError | None = None
            deleting = False  # a .deleted marker was seen: look again under the lock
            for attempt in range(_LOAD_ATTEMPTS):
                with contextlib.ExitStack() as guard, self._open_root(create=False, path_only=True) as rfd:
                    if rfd is None:
                        return None
                    locked = (deleting or attempt >= _OPTIMISTIC_LOADS) and self._hold_for_reading(guard, comps)
                    try:
                        dfd = self._open(rfd, comps, op, path_only=True)
                    except OSError as exc:
                        if exc.errno == errno.ESTALE:  # NFS: replaced by another host
                            stale = exc
                            continue
                        raise
                    if dfd is None:
                        return None
                    try:
                        batches, gap = read_snapshot(dfd, path, op, _layout.session_marker(tk))
                        if not _fsio.same_dir(dfd, rfd, names):
                            continue  # deleted (moved away) while we read: look again
                    except Deleted as exc:
                        if not (locked or deleting):
                            deleting = True
                            continue
                        marked = exc
                        break  # out of the lock, to finish the delete
                    except Vanished as exc:
                        if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ESTALE:
                            stale = exc.__cause__
                        # Listed files gone again: our client may list from a cache.
                        if attempt and not _fsio.refresh_listing(dfd):
                            return None  # the directory is gone on the server: deleted
                        continue
                    except OSError as exc:
                        if exc.errno not in (errno.ENOENT, errno.ESTALE):
                            raise
                        stale = exc if exc.errno == errno.ESTALE else stale
                        if attempt and not _fsio.refresh_listing(dfd):
                            return None
                        continue  # the directory went away under us (another host's delete)
                    except FsStoreError:
                        if _fsio.same_dir(dfd, rfd, names):
                            raise
                        continue  # a half-removed directory (a delete) is not damage
                    finally:
                        os.close(dfd)
                if gap is not None:
                    warn_gap(gap, path, op)
                return dedupe(batches) if batches else None
            else:
                if stale is not None:
                    raise stale  # a mount that keeps answering ESTALE: say so, not "busy"
                raise FsStoreError(
                    "EAGAIN",
                    f"transcript changed under the reader {_LOAD_ATTEMPTS} times in a row",
                    operation=op,
                    path=path,
                    errno=errno.EAGAIN,
                )
            # A delete is committed once marked. Seen under the transcript's lock, its
            # deleter may have died: finish it (deleters hold the lock of what they move).
            if locked:
                _delete.finish(self, comps, path, session=marked.session)
            return None

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

    def _transcript_mtimes(
        self, parent_fd: int, children: list[tuple[str, str]], below: str, where: str, op: str
    ) -> Iterator[tuple[str, int]]:
        """``(key part, mtime in epoch ms)`` of each child's transcript directory
        ``parent/name+below``.

        A commit links a file into that directory, so its mtime is the time of the
        last commit (or compaction) by the storage's own clock; the summary uses
        the same stat. One symlink-proof probe per transcript: this runs over every
        session of a project each time the SDK lists them (names are ASCII: names
        :func:`decode_entry` accepted).
        """
        for name, part in children:
            try:
                st = self._fs.stat_beneath(parent_fd, name + below)
            except OSError as exc:
                err = exc.errno or errno.EIO
                if err not in (errno.ELOOP, errno.EXDEV, errno.ENOENT, errno.ENOTDIR):
                    # One transcript this process may not read must not hide the others.
                    log.warning("left out of the listing: %s", os.strerror(err), extra={
                        "code": errno.errorcode.get(err, "EIO"), "operation": op,
                        "path": f"{where}/{name}", "errno": err})
                # A symlink inside the transcript path is not ours to report; a session
                # without a main transcript (only subagents, or removed) has no mtime.
                continue
            if stat.S_ISDIR(st.st_mode):
                yield part, st.st_mtime_ns // 1_000_000

    @contextlib.contextmanager
    def _children(self, comps: list[Component], op: str) -> Iterator[tuple[int, list[tuple[str, str]]]]:
        """The directory under ``comps`` (fd) and ``(name, decoded key part)`` of each
        directory in it; no children if it does not exist."""
        with self._open_root(create=False) as rfd:
            pfd = self._open(rfd, comps, op) if rfd is not None else None
            if pfd is None:
                yield -1, []
                return
            try:
                children: list[tuple[str, str]] = []
                # decode_entry's common case inline: this loop runs once per session
                # each time the SDK lists a project.
                own, is_dir, add = _keys.is_own_name, _fsio.is_dir_entry, children.append
                with os.scandir(pfd) as it:
                    for entry in it:
                        name = entry.name
                        if own(name):
                            if is_dir(entry):
                                add((name, name))
                        elif (part := _layout.decode_entry(pfd, entry)) is not None:
                            add((name, part))
                yield pfd, children
            finally:
                os.close(pfd)

    def list_sessions(self, project_key: str) -> list[dict[str, Any]]:
        op = "list_sessions"
        _keys.check_part(project_key, "project_key", op)
        comps = _layout.project_dirs(project_key)
        with translating(op, self._path(comps)), self._children(comps, op) as (pfd, children):
            return [{"session_id": session_id, "mtime": mtime}
                    for session_id, mtime in self._transcript_mtimes(
                        pfd, children, f"/{_layout.MAIN}", self._path(comps), op)]

    def list_subkeys(self, key: Mapping[str, Any]) -> list[str]:
        op = "list_subkeys"
        tk = _keys.parse_key(key, op, allow_subpath=False)
        comps = [*_layout.session_dirs(tk.project_key, tk.session_id), (_layout.SUBKEYS, None)]
        with translating(op, self._path(comps)), self._children(comps, op) as (pfd, children):
            valid = []
            for name, subpath in children:
                try:
                    _keys.parse_key({**tk.as_dict(), "subpath": subpath}, op)
                except FsStoreError:
                    continue  # a name no valid key encodes to: not ours to report
                valid.append((name, subpath))
            return [subpath for subpath, _mtime
                    in self._transcript_mtimes(pfd, valid, "", self._path(comps), op)]

    def list_session_summaries(self, project_key: str) -> list[dict[str, Any]]:
        op = "list_session_summaries"
        _keys.check_part(project_key, "project_key", op)
        comps = _layout.project_dirs(project_key)
        out: list[dict[str, Any]] = []
        with translating(op, self._path(comps)), self._children(comps, op) as (pfd, children):
            for name, session_id in children:
                mfd = self._fs.open_dir(
                    pfd, [(name, None), (_layout.MAIN, None)],
                    create=False, base_path=self._path(comps), operation=op,
                )
                if mfd is None:
                    continue
                try:
                    path = f"{self._path(comps)}/{name}/{_layout.MAIN}"
                    key = {"project_key": project_key, "session_id": session_id}
                    summary, mtime_ns = self._fresh_summary(mfd, path, key)
                finally:
                    os.close(mfd)
                if summary is not None:
                    out.append({**summary, "session_id": session_id, "mtime": mtime_ns // 1_000_000})
        return out

    def _fresh_summary(
        self, mfd: int, path: str, key: dict[str, str]
    ) -> tuple[dict[str, Any] | None, int]:
        """The summary of every part committed before its mtime (the stat comes first),
        from the sidecar a compaction left plus the parts after it; None if it cannot
        be had now (the SDK then rebuilds it through load(), which reports problems)."""
        mtime_ns = os.fstat(mfd).st_mtime_ns
        state = read_state(mfd) or State()
        try:
            items, deleted = scan(mfd)
            chain, gap = plan(items)
            if deleted or gap is not None or not chain:
                return None, 0
            if state.summary is not None and state.folded == chain[-1][1]:
                return state.summary, mtime_ns
            if self._fold is None:
                return None, 0
            summary, _folded = _compact.fold_chain(
                (self._fold, key), state, chain,
                lambda name: parse(_fsio.read_file(mfd, name), f"{path}/{name}", "summary"))
        except (FsStoreError, FileNotFoundError) as exc:
            log.warning("summary left out: %s", exc, extra={"code": "SUMMARY_BEHIND",
                        "operation": "list_session_summaries", "path": path})
            return None, 0
        return summary, mtime_ns

    # -- delete --------------------------------------------------------------------

    def delete(self, key: Mapping[str, Any]) -> None:
        """Delete a session (its main and subagent transcripts) or, with ``subpath``,
        one subagent transcript. Missing is not an error.

        Each transcript directory is marked (``.deleted``) before the session is moved
        into ``.trash`` in one rename and removed there: a reader on any host sees the
        whole transcript or None, and an append that was not yet committed starts
        over in a new directory (:mod:`fsstore._delete`).
        """
        self.delete_unless(key, None)

    def delete_unless(self, key: Mapping[str, Any], keep: Callable[[], bool] | None) -> None:
        """:meth:`delete`; where ``keep`` is given, it is asked after the transcripts are
        marked and before they are moved: True takes the marks back and keeps them
        (``fsstore prune``'s last look, which no commit can slip past)."""
        op = "delete"
        tk = _keys.parse_key(key, op)
        if tk.subpath is None:
            comps = _layout.session_dirs(tk.project_key, tk.session_id)
        else:
            comps = _layout.transcript_dirs(tk)
        path = self._path(comps)
        with translating(op, path):
            try:
                _delete.remove(self, comps, path, _layout.MAIN if tk.subpath is None else "", op, keep)
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
        op = "compact"
        tk = _keys.parse_key(key, op)
        comps = _layout.transcript_dirs(tk)
        path = self._path(comps)
        with translating(op, path), self._open_root(create=False) as rfd:
            if rfd is None:
                return 0
            dfd = self._open(rfd, comps, op)
            if dfd is None:
                return 0
            try:
                with self._locks.hold(self._lock_path(_layout.lock_name(comps), op), op) as held:
                    for _attempt in range(_LOAD_ATTEMPTS):
                        try:
                            return _compact.compact(self._fs, dfd, path, held, everything=True,
                                                    operation=op, summary=self._summary_of(tk))
                        except Vanished:
                            continue  # a file merged by an overlapping compaction: look again
            finally:
                os.close(dfd)
            raise FsStoreError("EAGAIN", f"files kept vanishing under {_LOAD_ATTEMPTS} compactions "
                               "(overlapping lock holders compacting)", operation=op, path=path,
                               errno=errno.EAGAIN)

    @contextlib.contextmanager
    def locked(self, key: Mapping[str, Any]) -> Iterator[None]:
        """Hold the transcript's commit lock (the transcript need not exist).

        Inside, this store's append, compact and load of that transcript, in the
        same thread or task, run under it rather than wait for it (nested
        ``locked`` too); other threads, tasks, processes and stores wait.
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
        with self._open_root(create=True) as rfd:
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
