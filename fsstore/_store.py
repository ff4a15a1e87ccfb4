"""The synchronous store: the one implementation of every operation.

:class:`fsstore.FsSessionStore` runs these methods in worker threads; scripts, the
CLI and operators call them directly through ``store.sync``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
import stat
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from . import _compact, _fsio, _keys, _layout, _summaries
from ._errors import FsStoreError, log, translating
from ._fsio import Fs
from ._keys import TranscriptKey
from ._layout import Component
from ._lock import Held, Locks
from ._transcript import (
    State,
    StateFile,
    Unsettled,
    Vanished,
    commit,
    dedupe,
    encode_batch,
    log_state_failure,
    parse,
    parse_state,
    probe_latest,
    read_batches,
    read_raw_state,
    read_state,
    read_state_stat,
    rebuild_state,
    scan_items,
    warn_damage,
    write_state,
)

# A reader that keeps losing races with compactions and deletes gives up after this.
_LOAD_ATTEMPTS = 50
# ... and after this many, reads under the transcript lock (see _hold_for_reading).
_OPTIMISTIC_LOADS = 8
# An append whose transcript directory is deleted under it starts over this often.
_APPEND_ATTEMPTS = 50


# Transcripts an appending process remembers (validated key, paths, state, the two
# state files held open: at most 2 x 32 descriptors per store).
_APPENDING = 32


@dataclasses.dataclass(eq=False)
class _Appending:
    """One transcript as a process that appends to it remembers it between appends.

    The key is validated and its paths worked out once. ``state`` is the state this
    process last wrote and ``head`` how that write's state.json begins (its write
    id): while state.json still begins so, nobody else has written since. On a
    local file system the two state files are then also still as this process left
    them, and stay open between appends: ``current`` (state.json, the file it
    swapped in) and ``spare`` (.state.spare, the one it swapped out). A steady
    append then opens neither by name. Both are only used under the transcript's
    lock, and closed whenever ``head`` is dropped or the object goes (an append in
    flight keeps its object alive).
    """

    key: TranscriptKey
    comps: list[Component]
    path: str  # <root>/<rel>, for messages
    lock_path: str  # <root>/.locks/<lock name>
    sdk_key: dict[str, str]  # the key as the SDK's summary fold takes it
    abs_dir: bytes | None = None  # <realpath of root>/<rel>, once root was resolved
    state: State | None = None
    head: bytes | None = None
    current: StateFile | None = None
    spare: StateFile | None = None

    def forget_files(self) -> None:
        """Close the state files held open (someone else wrote, or a write failed)."""
        for kept in (self.current, self.spare):
            if kept is not None:
                os.close(kept.fd)
        self.current = self.spare = None

    def __del__(self) -> None:
        self.forget_files()


def decode_entry(parent_fd: int, entry: os.DirEntry[str]) -> str | None:
    """The key part a directory entry stands for; None for anything not ours.

    Hashed names are decoded from their ``.key`` file, which must encode back to
    the name; store-internal names (starting with ``.``) and non-directories are
    not keys.
    """
    name = entry.name
    if name.startswith(".") or not _fsio.is_dir_entry(entry):
        return None
    if not _keys.is_hashed(name):
        return _keys.decode(name)
    try:
        fd = os.open(name, _fsio.DIR_FLAGS, dir_fd=parent_fd)
        try:
            original = _fsio.read_file(fd, _fsio.KEY_FILE).decode("utf-8")
        finally:
            os.close(fd)
    except (FileNotFoundError, NotADirectoryError, _fsio.NotAFile, UnicodeDecodeError):
        return None  # vanished meanwhile, or not a directory/.key fsstore made
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None  # a symlink: never ours
        raise
    return original if _keys.matches(name, original) else None


def _known_seq(dfd: int) -> int:
    """The sequence state.json records as committed (read before listing); 0 if none
    can be trusted. A hint for load: a listing must reach it."""
    try:
        state = read_state(dfd)[0]
    except OSError:
        return 0
    return state.seq if state is not None else 0


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
        self._locks_path = f"{self.root}/{_layout.LOCKS}"
        self._compact_every = compact_every
        self._fs = Fs(fsync=fsync, dir_mode=dir_mode, file_mode=file_mode)
        self._locks = Locks(
            stale_lock_seconds=stale_lock_seconds,
            lock_timeout_seconds=lock_timeout_seconds,
            mode=file_mode,
        )
        self._fold = _summaries.fold_function() if summaries is not False else None
        # The root with its own symlinks resolved (the operator's choice, resolved once):
        # lets an append open its transcript directory in a single openat2 call.
        self._real_root: str | None = None
        self._forget_appending()
        _fsio.in_forked_child(self, "_forget_appending")
        if summaries is True and self._fold is None:
            raise ValueError("summaries=True needs claude-agent-sdk (pip install 'fsstore-sessions[claude]')")

    def _forget_appending(self) -> None:
        """Remember no transcript (also in a forked child: its state files are the
        parent's descriptors, and a thread that held the guard does not exist there)."""
        # The transcripts this process appended to lately (see _Appending).
        self._appending: collections.OrderedDict[tuple[str, str, str | None], _Appending] = (
            collections.OrderedDict()
        )
        self._appending_guard = threading.Lock()

    # -- plumbing ------------------------------------------------------------------

    @contextlib.contextmanager
    def _open_root(self, *, create: bool) -> Iterator[int | None]:
        # The root path itself may be a symlink (the operator's choice); nothing
        # below it is followed.
        flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.root, flags)
        except FileNotFoundError:
            if not create:
                yield None
                return
            self._fs.make_dirs(self.root)
            fd = os.open(self.root, flags)
        try:
            yield fd
        finally:
            os.close(fd)

    def _open(
        self, rfd: int, comps: list[Component], operation: str, *, create: bool = False
    ) -> int | None:
        return self._fs.open_dir(
            rfd, comps, create=create, base_path=self.root, operation=operation
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

    def _open_transcript(self, t: _Appending, operation: str) -> int:
        """Open (creating if needed) a transcript directory for writing."""
        if t.abs_dir is None and self._real_root is not None:
            t.abs_dir = os.fsencode(f"{self._real_root}/{_layout.rel(t.comps)}")
        if t.abs_dir is not None:
            fd = self._fs.open_abs_dir(t.abs_dir)
            if fd is not None:
                return fd
        with self._open_root(create=True) as rfd:
            assert rfd is not None
            dfd = self._open(rfd, t.comps, operation, create=True)
            assert dfd is not None
            self._resolve_root()
            return dfd

    def _resolve_root(self) -> None:
        """Resolve the (existing) root's own symlinks, and tell from its file-system
        type whether state.json may be rewritten in place (``Fs.exchange_ok``): done
        once per store, by whatever writes state.json first, an append or a
        compaction. Once: what the store learns later (a mount refusing
        RENAME_EXCHANGE) must stick, also where every append walks (no openat2)."""
        if self._real_root is None:
            self._real_root = os.path.realpath(self.root)
            self._fs.exchange_ok = _fsio.is_local_fs(self._real_root)

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
                       lock_path=f"{self._locks_path}/{_layout.lock_name(comps)}", sdk_key=tk.as_dict())
        with self._appending_guard:
            t = self._appending.setdefault((tk.project_key, tk.session_id, tk.subpath), t)
            while len(self._appending) > _APPENDING:
                self._appending.popitem(last=False)  # an append in flight keeps its own
        return t

    def append(self, key: Mapping[str, Any], entries: list[Any]) -> None:
        op = "append"
        t = self._appending_to(key, op)
        if isinstance(entries, list) and not entries:
            return
        payload = encode_batch(entries, op)
        with translating(op, t.path):
            for _attempt in range(_APPEND_ATTEMPTS):
                try:
                    self._append_once(t, entries, payload)
                    return
                except FileNotFoundError:
                    # The transcript directory was moved away (a concurrent delete)
                    # before our commit: nothing of ours is visible; start over.
                    continue
            raise FsStoreError(
                "ENOENT",
                "transcript directory kept disappearing (concurrent deletes)",
                operation=op,
                path=t.path,
                errno=errno.ENOENT,
            )

    def _append_once(self, t: _Appending, entries: list[dict[str, Any]], payload: bytes) -> None:
        op = "append"
        dfd = self._open_transcript(t, op)
        try:
            tmp = _fsio.temp_name()
            self._fs.write_temp(dfd, tmp, payload)
            committed = False
            try:
                self._locks_dir(op)
                with self._locks.hold(t.lock_path, op) as held:
                    state, state_mtime, opened = self._current_state(t, dfd)
                    try:
                        held.check(op)
                        seq = commit(self._fs, dfd, tmp, state.seq)
                        committed = True
                        spare, opened = opened, None  # _finish_commit owns it from here
                        self._finish_commit(t, dfd, held, state, state_mtime, seq, entries, spare)
                    finally:
                        if opened is not None:
                            os.close(opened.fd)
            finally:
                if not committed:
                    _fsio.unlink_quiet(dfd, tmp)
        finally:
            os.close(dfd)

    def _current_state(self, t: _Appending, dfd: int) -> tuple[State, int, StateFile | None]:
        """The transcript's state (under its lock), state.json's mtime (0 if none), and
        state.json held open for writing where it may become the next spare (else None).

        If state.json still begins with the head of this process's last write, nobody
        wrote since and the state remembered is current: no parse. Elsewhere than on
        a local file system it is opened, not stat'ed by name, so that NFS
        revalidates it (close-to-open consistency).
        """
        kept = self._kept_state(t, dfd)
        if kept is not None:
            return kept
        read_only = _fsio.READ_FLAGS | os.O_NONBLOCK
        try:
            try:
                fd = os.open(_layout.STATE, _fsio.RW_FLAGS if self._fs.exchange_ok else read_only, dir_fd=dfd)
            except PermissionError:
                if not self._fs.exchange_ok:
                    raise
                fd = os.open(_layout.STATE, read_only, dir_fd=dfd)  # another user's: read it only
        except FileNotFoundError:
            return rebuild_state(dfd), 0, None
        try:
            st = os.fstat(fd)
            raw = read_raw_state(fd, st)
            if t.head is None or not raw.startswith(t.head):
                state = parse_state(raw)
            else:
                assert t.state is not None
                state = t.state.copy()
            if self._fs.exchange_ok and stat.S_ISREG(st.st_mode) and st.st_nlink == 1 \
                    and st.st_uid == os.geteuid():
                keep, fd = StateFile.of(fd, st), -1
            else:
                keep = None
        finally:
            if fd >= 0:
                os.close(fd)
        return (state if state is not None else rebuild_state(dfd)), st.st_mtime_ns, keep

    def _kept_state(self, t: _Appending, dfd: int) -> tuple[State, int, StateFile] | None:
        """:meth:`_current_state` from the two state files held open since this
        process's last append (local file systems), if nobody else wrote since:

        - the file it swapped in still has one link (no rename replaced it, no hard
          link shares it) and still begins with its write id (another writer's
          rewrite in place begins with theirs): an fstat and a pread, no lookup;
        - ``.state.spare`` is still the file it swapped out (same inode, which no
          other file can have while it is held open; one link). Every other
          writer's swap moves one of the two; and anything planted at that name is
          caught here, before a swap could make it state.json.

        Else both are closed and None returned: state.json is then read by name.
        """
        current, spare = t.current, t.spare
        if current is not None and spare is not None and t.head is not None and t.state is not None:
            try:
                st = os.fstat(current.fd)
                if st.st_nlink == 1 and os.pread(current.fd, len(t.head), 0) == t.head:
                    at_spare = os.stat(_layout.STATE_SPARE, dir_fd=dfd, follow_symlinks=False)
                    if (at_spare.st_dev, at_spare.st_ino) == spare.ident and at_spare.st_nlink == 1:
                        t.current = None  # the caller's now (it becomes the spare)
                        return t.state.copy(), st.st_mtime_ns, current
            except OSError:
                pass  # unreadable, or nothing at the spare's name: read by name
        t.forget_files()  # someone else wrote (or not both are held)
        return None

    def _remember_state(self, t: _Appending, head: bytes | None, state: State) -> None:
        t.state, t.head = (state, head) if head is not None else (None, None)
        if head is None:
            t.forget_files()

    def _finish_commit(
        self,
        t: _Appending,
        dfd: int,
        held: Held,
        state: State,
        state_mtime: int,
        seq: int,
        entries: list[dict[str, Any]],
        opened: StateFile | None,
    ) -> None:
        """Everything after the commit point. Nothing here fails the append.

        ``opened`` is state.json, open for writing (or None): once the new state is
        swapped in, it is the spare, kept for the next append (this takes it over).

        The batch is visible from the moment it got its name; raising now would make
        the SDK retry it, and a retried batch is stored twice (entries without a
        uuid are not de-duplicated). So failures here are logged: the state file
        and summary heal, and a failed directory fsync is the operator's to see.
        """
        path = t.path
        try:
            self._fs.sync_dir(dfd)
        except OSError as exc:
            code = errno.errorcode.get(exc.errno or 0, "EIO")
            log.error(
                "batch committed and visible, but the directory fsync failed (%s): it may not "
                "survive a power loss", exc,
                extra={"code": code, "operation": "append", "path": path, "errno": exc.errno},
            )
        new = self._after_commit(t, dfd, state, seq, entries)
        try:
            # A holder past its lease skips the write: another holder may have moved
            # on, and an old sequence in state.json could send later commits into a
            # segment's range. The state stays behind, which heals.
            held.check("append")
            spare, t.spare = t.spare, None  # write_state closes it or hands it back
            head, current = write_state(self._fs, dfd, new, after_ns=state_mtime, spare=spare, keep=True)
        except (OSError, FsStoreError) as exc:
            if opened is not None:
                os.close(opened.fd)
            self._remember_state(t, None, new)
            log_state_failure(exc, path)
            return
        self._remember_state(t, head, new)
        if current is not None:  # swapped: the previous state.json is the spare now
            t.current, t.spare = current, opened
        elif opened is not None:
            os.close(opened.fd)
        if self._compact_every and seq - new.compacted >= self._compact_every:
            self._auto_compact(t, dfd, held, new)

    def _auto_compact(self, t: _Appending, dfd: int, held: Held, state: State) -> None:
        path = t.path
        self._remember_state(t, None, state)  # compaction rewrites state.json
        try:
            _compact.compact(self._fs, dfd, path, held, state, everything=False, operation="compact")
        except (OSError, FsStoreError) as exc:
            # The append itself is committed; a failed compaction only costs load speed.
            # Try again only after another compact_every parts, not on every append.
            log.warning("automatic compaction failed: %s", exc,
                        extra={"code": "COMPACT_FAILED", "operation": "compact", "path": path})
            state.compacted = state.seq
            try:
                held.check("compact")
                write_state(self._fs, dfd, state)
            except (OSError, FsStoreError) as exc:
                log_state_failure(exc, path)

    def _after_commit(
        self,
        t: _Appending,
        dfd: int,
        state: State,
        seq: int,
        entries: list[dict[str, Any]],
    ) -> State:
        """The next state: new sequence, and for a main transcript the folded summary."""
        new = State(max(seq, state.seq), state.folded, state.summary, state.compacted)
        if t.key.subpath is not None or self._fold is None:
            return new
        key, path = t.sdk_key, t.path
        try:
            summary, folded = self._catch_up(dfd, path, key, state.summary, state.folded, seq - 1,
                                             locked=True)
            if folded < seq:
                summary, folded = _summaries.fold(self._fold, summary, key, [entries]), seq
        except (OSError, FsStoreError, Vanished) as exc:
            # The batch is committed; the summary stays behind and readers heal it.
            log.warning(
                "summary not updated after commit: %s", exc,
                extra={"code": "SUMMARY_BEHIND", "operation": "append", "path": path},
            )
            return new
        new.summary, new.folded = summary, folded
        return new

    def _catch_up(
        self,
        dfd: int,
        path: str,
        key: dict[str, str],
        summary: dict[str, Any] | None,
        folded: int,
        upto: int,
        *,
        locked: bool,
    ) -> tuple[dict[str, Any] | None, int]:
        """Fold committed parts ``folded+1..upto`` into ``summary``.

        Reads them by name; if one was merged into a segment, refolds the whole
        transcript instead (then the result may cover more than ``upto``). Without
        the lock (``locked``) a listing racing a compaction raises Vanished.
        """
        assert self._fold is not None
        if folded >= upto:
            return summary, folded
        if summary is not None or folded == 0:
            try:
                batches = [
                    parse(
                        _fsio.read_file(dfd, _layout.part_name(seq)),
                        f"{path}/{_layout.part_name(seq)}",
                        "summary",
                    )
                    for seq in range(folded + 1, upto + 1)
                ]
                return _summaries.fold(self._fold, summary, key, batches), upto
            except FileNotFoundError:
                pass  # merged into a segment: refold from the start below
        everything, damage = read_batches(dfd, path, "summary", locked=locked)
        if damage is not None:
            warn_damage(damage, path, "summary")
        if not everything:
            return None, 0
        return (
            _summaries.fold(self._fold, None, key, [b for _, b in everything]),
            everything[-1][0],
        )

    # -- load ----------------------------------------------------------------------

    def load(self, key: Mapping[str, Any]) -> list[Any] | None:
        op = "load"
        tk = _keys.parse_key(key, op)
        comps = _layout.transcript_dirs(tk)
        path = self._path(comps)
        with translating(op, path):
            stale: OSError | None = None
            names = [n for n, _ in comps]
            previous: tuple[object, ...] | None = None  # the damage the last listing showed
            wary = False  # a listing looked damaged: settle it under the lock
            for attempt in range(_LOAD_ATTEMPTS):
                with contextlib.ExitStack() as guard, self._open_root(create=False) as rfd:
                    if rfd is None:
                        return None
                    locked = (wary or attempt >= _OPTIMISTIC_LOADS) and self._hold_for_reading(guard, comps)
                    try:
                        dfd = self._open(rfd, comps, op)
                    except OSError as exc:
                        if exc.errno == errno.ESTALE:  # NFS: replaced by another host
                            stale = exc
                            continue
                        raise
                    if dfd is None:
                        return None
                    try:
                        try:
                            batches, damage = read_batches(dfd, path, op, locked=locked,
                                                           state_seq=_known_seq(dfd), previous=previous)
                        except Unsettled as exc:
                            wary = True
                            # damage if the next listing shows the same, in this directory
                            previous = exc.signature if _fsio.same_dir(dfd, rfd, names) else None
                            continue
                        except Vanished as exc:
                            previous = None  # the directory moved on: start the comparison over
                            if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ESTALE:
                                stale = exc.__cause__
                            continue
                        except FsStoreError:
                            if _fsio.same_dir(dfd, rfd, names):
                                raise
                            continue  # a half-removed directory (a delete) is not damage
                        if not _fsio.same_dir(dfd, rfd, names):
                            previous = None
                            continue  # deleted (renamed away) while we read: look again
                        if damage is not None:
                            warn_damage(damage, path, op)
                    finally:
                        os.close(dfd)
                return dedupe(batches) if batches else None
            if stale is not None:
                raise stale  # a mount that keeps answering ESTALE: say so, not "busy"
            raise FsStoreError(
                "EAGAIN",
                f"transcript changed under the reader {_LOAD_ATTEMPTS} times in a row",
                operation=op,
                path=path,
                errno=errno.EAGAIN,
            )

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
        """``(key part, mtime in epoch ms)`` of each child whose transcript
        ``parent/name+below`` has a committed part.

        The state file is rewritten at every commit, so its mtime is the time of the
        last commit by the storage's own clock; the summary uses the same stat. One
        symlink-proof probe per transcript: this runs over every session of a
        project each time the SDK lists them (names are ASCII: names
        :func:`decode_entry` accepted).
        """
        found = self._fs.mtimes_beneath(parent_fd, [name for name, _ in children],
                                        f"{below}/{_layout.STATE}".encode("ascii"))
        error = _fsio.MTIME_ERROR
        for (name, part), ns in zip(children, found):
            if ns > error:
                yield part, ns // 1_000_000
            elif (err := error - ns) not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
                # One transcript this process may not read must not hide the others.
                log.warning("left out of the listing: %s", os.strerror(err), extra={
                    "code": errno.errorcode.get(err, "EIO"), "operation": op,
                    "path": f"{where}/{name}", "errno": err})
            elif (ms := self._mtime_without_state(parent_fd, f"{name}{below}", err)) is not None:
                yield part, ms

    def _mtime_without_state(self, parent_fd: int, name: str, err: int) -> int | None:
        """:meth:`_transcript_mtimes` where state.json could not be stat'ed (``err``:
        missing, or a symlink on the way)."""
        if err in (errno.ELOOP, errno.EXDEV):
            return None  # a symlink inside the transcript path: not ours to report
        # No state file: a first commit whose writer died before writing it.
        try:
            fd = self._fs.open_dir(parent_fd, [(n, None) for n in name.split("/")],
                                   create=False, base_path=self.root, operation="list")
        except (FsStoreError, NotADirectoryError):  # a symlink or a file where a directory should be
            return None
        if fd is None:
            return None
        try:
            if not scan_items(fd):
                return None
            return os.fstat(fd).st_mtime_ns // 1_000_000
        finally:
            os.close(fd)

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
                        elif (part := decode_entry(pfd, entry)) is not None:
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
        """The summary, folded up to the newest committed part; None if not provable."""
        state, mtime_ns = read_state(mfd)
        if state is None:
            return None, 0
        latest = probe_latest(mfd, state.seq)
        if state.summary is not None and state.folded >= latest:
            return state.summary, mtime_ns
        if self._fold is None:
            return None, 0
        try:
            summary, _folded = self._catch_up(
                mfd, path, key, state.summary, state.folded, latest, locked=False
            )
        except (FsStoreError, Vanished) as exc:
            # Leave it out: the SDK then rebuilds this session's info through load(),
            # which reports the problem properly.
            log.warning("summary left out: %s", exc, extra={"code": "SUMMARY_BEHIND",
                        "operation": "list_session_summaries", "path": path})
            return None, 0
        return summary, mtime_ns

    # -- delete --------------------------------------------------------------------

    def delete(self, key: Mapping[str, Any]) -> None:
        op = "delete"
        tk = _keys.parse_key(key, op)
        if tk.subpath is None:
            comps = _layout.session_dirs(tk.project_key, tk.session_id)
        else:
            comps = _layout.transcript_dirs(tk)
        path = self._path(comps)
        with translating(op, path), self._open_root(create=False) as rfd:
            if rfd is None:
                return
            parent = self._open(rfd, comps[:-1], op)
            if parent is None:
                return
            try:
                self._move_to_trash(rfd, parent, comps[-1][0], path)
            finally:
                os.close(parent)
                self._forget(tk)

    def _forget(self, tk: TranscriptKey) -> None:
        """Drop what appends remember of a deleted session (or subagent transcript).

        Not needed for correctness (a new state.json does not begin with the head
        remembered), only to give the kept spare files' descriptors back at once.
        """
        with self._appending_guard:
            for ident in [i for i in self._appending if i[:2] == (tk.project_key, tk.session_id)
                          and (tk.subpath is None or i[2] == tk.subpath)]:
                del self._appending[ident]

    def _move_to_trash(self, rfd: int, parent: int, name: str, path: str) -> None:
        """Rename ``parent/name`` into ``.trash`` (atomic: readers see all or None), then remove it."""
        trash = self._open(rfd, [(_layout.TRASH, None)], "delete", create=True)
        assert trash is not None
        try:
            aside = _fsio.temp_name("-deleted")
            try:
                os.rename(name, aside, src_dir_fd=parent, dst_dir_fd=trash)
            except FileNotFoundError:
                return  # never written, or deleted already: not an error
            self._fs.sync_dir(parent)
            try:
                _fsio.remove_tree(trash, aside)
            except OSError as exc:
                # The transcript is already gone from every reader's view; what is left
                # in .trash (e.g. a racing writer's file) is removed by `fsstore gc`.
                log.warning("leftovers in .trash: %s", exc, extra={
                    "code": "TRASH_LEFT", "operation": "delete", "path": path})
        finally:
            os.close(trash)

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
            self._resolve_root()
            try:
                with self._locks.hold(self._lock_path(_layout.lock_name(comps), op), op) as held:
                    state, _st = read_state_stat(dfd)
                    if state is None:
                        state = rebuild_state(dfd)
                    return _compact.compact(
                        self._fs, dfd, path, held, state, everything=True, operation=op
                    )
            finally:
                os.close(dfd)

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
