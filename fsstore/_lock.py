"""The per-transcript commit lock: an in-process lock, then a marker file, through
filelock's lock machinery.

The lock file is ``<root>/.locks/<hash of the transcript path>.lock`` (see
:func:`fsstore._layout.lock_name`): a hard link to the holder's record
``<root>/.locks/owner-<pid>-<random>`` (``pid\nhost\nstart-token\nits name\n``, written whole
once, serving one hold at a time, touched before each acquire so the marker's mtime
is the acquire time). ``link`` never replaces, so the lock is taken by whoever links first,
and a lock file is never seen without its holder's record (:class:`~fsstore._records.Records`,
:class:`_MarkerLock`). It lives in one flat directory right under root, not in the
transcript directory, so a delete that moves a transcript away never moves or
recreates a lock.

A marker whose holder is gone, or past its lease, is reclaimed by its waiters
(:mod:`fsstore._reclaim`, which ``fsstore gc`` uses too). What the waiter saw is timed
by its own monotonic clock: a waiter whose clock runs ahead of the storage's (every
marker looks old) or behind it (none ever does) waits as long as one whose clock is
right.

Age-based expiry can admit a second holder while a stalled first one still runs.
fsstore is built so that this costs ordering at worst, never data: commits use a
no-replace link and a check (see :mod:`fsstore._commit`); nothing on the append
path is a shared file to roll back.

Threads and tasks of one process first queue on a ``threading.Lock`` per lock path,
so they do not poll the lock file against each other.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import errno
import itertools
import math
import os
import threading
import time
import types
import typing
from collections.abc import Iterator, Mapping

import filelock

from . import _fsio
from ._errors import FsStoreError, log, posix_code
from ._interrupts import HeldOff
from ._reclaim import (
    CANNOT_TELL,
    Identity,
    aside_name,
    content,
    listing_says,
    put_back,
    read_marker,
    reclaim,
)
from ._records import Records

_IDLE_LOCKS = 1024  # as many as an appending store remembers transcripts (_store._APPENDING)
_WATCHED_MARKERS = 1024
# The locks held by SyncStore.locked in this context, by lock path (see Locks.held_here).
_HELD_HERE: contextvars.ContextVar[Mapping[str, Held]] = contextvars.ContextVar(
    "fsstore_held_here", default=types.MappingProxyType({})
)


# Permission errors creating a lock marker, with no marker there each time, before
# fsstore takes them for what they say (see _SoftLock._acquire).
_REFUSALS = 5
_PATH_FILE_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


# How often a waiter looks at the marker for a stale holder (filelock polls the
# lock itself every 50 ms in between).
_RECLAIM_POLL = 0.25


class _MarkerLock(filelock.BaseFileLock):
    """filelock's lock machinery (waiting, timeouts, fork safety) with fsstore's marker:
    the holder's :class:`_Record`, hard-linked to the lock name.

    Subclassed as filelock intends (``_acquire``/``_release``) instead of using its
    ``SoftFileLock``, whose marker is created empty and then written (a holder killed
    in between blocks everyone until the marker ages out) and which re-reads
    ``/proc`` for this process's identity on every acquire (most of an append's time
    on local disk). Stale markers are judged by :func:`fsstore._reclaim.reclaim`.
    """

    record: Records
    _mine = ""  # the record this lock was taken with (the lock name where it was moved there)
    _text = b""  # and its content
    _poll_backoff_cap = 0.05  # waiters poll from 2 ms, backing off to 50 ms, with jitter
    _refused = 0  # permission errors in a row with no marker there
    unlink_until = math.inf  # monotonic: half the lease; set by the hold before it releases (Held.__exit__)

    def _acquire(self) -> None:
        directory, name = os.path.split(self.lock_file)
        dfd = os.open(directory, _fsio.PATH_FLAGS)
        try:
            try:
                published = self.record.publish(directory, dfd, name)
                if published is None:
                    self._refused = 0
                    return
            except PermissionError:
                # SFTP (sshfs) has no EEXIST: a link that lost the race for the marker
                # can come back as EPERM/EACCES after the winner released it. Try
                # again, a few times, before taking it for a real permission problem.
                self._refused += 1
                if self._refused >= _REFUSALS:
                    self._refused = 0
                    raise
                return
            self._refused = 0
            self._mine, self._text = published
            # Our record, pinned (not the lock name: by now it may be another's marker)
            fd = os.open(self._mine, _PATH_FILE_FLAGS, dir_fd=dfd)
        finally:
            os.close(dfd)
        st = os.fstat(fd)
        self._mark_descriptor_owned(fd, (st.st_dev, st.st_ino))

    def _ours(self, path: str, identity: object) -> bool:
        """Whether the marker at ``path`` is this hold's. sshfs numbers each name's inode
        on its own (a hard link has another ``st_ino``): there, the content says."""
        st = os.lstat(path)
        return (st.st_dev, st.st_ino) == identity or content(path) == self._text

    def _release(self) -> None:
        fd = self._context.lock_file_fd
        assert fd is not None
        identity = self._context.lock_file_fd_identity
        released = False
        try:
            if not self._ours(self.lock_file, identity):
                pass  # reclaimed, and taken by another: not ours to touch
            elif time.monotonic() < self.unlink_until:
                # A stall from here to the unlink must outlast half a lease before a
                # waiter may reclaim the marker (and the unlink remove the next holder's).
                os.unlink(self.lock_file)
                released = True
            else:
                # Near or past the lease's end a waiter may reclaim the marker and take the
                # lock between the look and an unlink, which then removed the new holder's
                # marker (a release stalled 3 s there let a third process in beside it: stop
                # 31; one 1.5 s in its unlink, 0.1 s before its lease ended, review
                # helper-92). Ours is moved aside (atomic) and checked there; another's is
                # put back.
                aside = aside_name(self.lock_file)
                os.rename(self.lock_file, aside)
                try:
                    said = listing_says(aside)  # (not a lookup of it: see listing_says)
                except OSError:
                    said = None  # nothing to go by: put back
                if self._ours(aside, identity) if said == CANNOT_TELL else (
                        identity is not None and said == identity[1]):
                    os.unlink(aside)
                    released = True
                else:
                    put_back(aside, self.lock_file)
        except FileNotFoundError:
            pass  # reclaimed (also between the look and the unlink): nothing of ours is there
        finally:
            self._mark_descriptor_released()
            os.close(fd)
        # Not after a failed unlink (still linked). A record whose marker was taken
        # away is not used again: a reclaimer may yet put that marker back (it found it
        # touched), and the touches of the record's next holds would keep it young.
        (self.record.give_back if released else self.record.retire)(self._mine)




class _Local:
    """The in-process lock of one lock path, and its SoftFileLock (made on first use)."""

    __slots__ = ("lock", "soft", "taken", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0  # holders and waiters: an entry in use is never dropped
        self.soft: _MarkerLock | None = None
        self.taken = 0.0  # when its holder took the marker (monotonic), while held


@typing.final
class Held:
    """The transcript lock, held as a context manager (:meth:`Locks.hold`), and how
    long we may act on it.

    Another process may reclaim our lock once it has seen the marker unchanged for
    half of ``stale_lock_seconds`` (and the marker looks ``stale_lock_seconds`` old by
    its clock; see :mod:`fsstore._reclaim`). So before each step that publishes
    something (a commit move, a segment move) the holder checks that it has held the
    lock for less than half the lifetime, and otherwise gives up with LOCK_EXPIRED
    (retryable: nothing was published). This is lease-style fencing: an overlap then
    needs a stall between the check and the publishing system call, which format 2
    makes cost ordering only.

    A class rather than a generator context manager: it is on every append's path.
    """

    __slots__ = ("_entry", "_interrupts", "_locks", "_operation", "_pid", "budget", "path", "released", "since",
                 "timeout")

    def __init__(self, locks: Locks, path: str, operation: str, timeout: float | None = None) -> None:
        self._locks = locks
        self.timeout = locks.timeout if timeout is None else timeout
        self._pid = os.getpid()  # a forked child holds nothing of its parent's
        self.path = path
        self._operation = operation
        self.since = 0.0
        self.budget = locks.stale / 2
        self.released = False

    def __enter__(self) -> Held:
        # Ctrl-C is held off from here until the lock is given back (see _interrupts):
        # it runs between the waiter's tries, at check(), or once __exit__ is done.
        self._interrupts = HeldOff()
        try:
            self._take(self._interrupts)
        except BaseException:
            self._interrupts.restore()
            raise
        return self

    def _take(self, interrupts: HeldOff) -> None:
        """The in-process lock, then the marker; on any exception, neither."""
        locks, path, operation = self._locks, self.path, self._operation
        deadline = time.monotonic() + self.timeout
        entry = self._entry = locks._use(path)
        try:
            while True:
                if entry.lock.acquire(timeout=max(min(deadline - time.monotonic(), _RECLAIM_POLL), 0)):
                    if locks._current(path, entry):
                        break
                    entry.lock.release()  # left behind for a stuck holder while queued
                else:
                    interrupts.deliver()
                    if time.monotonic() >= deadline:
                        raise locks._timeout(path, operation, None)
                entry = self._entry = locks._past_stuck(path, entry)
            try:
                soft = entry.soft
                if soft is None:
                    soft = entry.soft = _MarkerLock(path, thread_local=False, poll_interval=0.002)
                    soft.record = locks._records
                self.since = entry.taken = locks._acquire(soft, path, operation, deadline, interrupts)
            except BaseException:
                entry.lock.release()
                raise
        except BaseException:
            locks._done(entry)
            raise

    def live(self) -> bool:
        """Held in this process, not yet released: a task spawned inside the hold with
        its context copied may outlive it (review, stop 30: it appended under the next
        holder's hold)."""
        return not self.released and self._pid == os.getpid()

    def __exit__(self, *exc_info: object) -> None:
        self.released = True
        entry = self._entry
        try:
            try:
                assert entry.soft is not None
                entry.soft.unlink_until = self.since + self.budget / 2
                entry.soft.release()
            except OSError as exc:
                # The work under the lock is done (a commit may be visible);
                # failing now would make the caller retry it. A marker left
                # behind is reclaimed like a crashed holder's.
                log.warning("lock release failed: %s", exc, extra={
                    "code": "LOCK_RELEASE_FAILED", "operation": self._operation, "path": self.path})
            finally:
                entry.taken = 0.0
                entry.lock.release()
                self._locks._done(entry)
        finally:
            self._interrupts.restore()  # a Ctrl-C that came while it was held runs now

    def check(self, operation: str) -> None:
        """Before each step that publishes: a Ctrl-C that came while the lock was
        held runs now (nothing published yet), and LOCK_EXPIRED past the lease or
        once the hold was given back under a call still running in it (its task,
        inside ``locked()``, cancelled natively on asyncio: review, stop 30)."""
        if self.released:
            raise FsStoreError("LOCK_EXPIRED", "the lock was given back while this call ran "
                               "under it (its caller stopped waiting), so nothing was published",
                               operation=operation, path=self.path)
        self._interrupts.deliver()
        held = time.monotonic() - self.since
        if held > self.budget:
            raise FsStoreError(
                "LOCK_EXPIRED",
                f"held the lock {held:.1f}s, past half of stale_lock_seconds; "
                "another writer may have reclaimed it, so nothing was published",
                operation=operation,
                path=self.path,
            )


class Locks:
    def __init__(self, fs: _fsio.Fs, *, stale_lock_seconds: float, lock_timeout_seconds: float) -> None:
        self.stale = stale_lock_seconds
        self.timeout = lock_timeout_seconds
        self._fs = fs
        self._forget_all()
        _fsio.in_forked_child(self, "_forget_all")

    def _forget_all(self) -> None:
        """Start with no lock objects (also in a forked child: filelock refuses to use
        a parent's, and a thread that held the guard does not exist there)."""
        self._guard = threading.Lock()
        self._records = Records(self._fs)
        # Every lock path lately used, least recent first, with its _Local: building a
        # SoftFileLock resolves its path and registers it (~150 us), so a writer that
        # keeps appending reuses its own. At most _IDLE_LOCKS unused ones are kept.
        self._local: collections.OrderedDict[str, _Local] = collections.OrderedDict()
        # The marker seen at each lock path waited on, and since when (see :func:`fsstore._reclaim.reclaim`).
        # Kept across acquires, so that a waiter that timed out and is retried goes on
        # watching; paths not looked at for a while are forgotten once it grows large.
        self._watched: dict[str, tuple[Identity, float]] = {}

    @staticmethod
    def held_here(lock_path: str) -> bool:
        """Whether the caller's context holds the lock at ``lock_path`` through
        :meth:`marked_held` (``SyncStore.locked``). Taking it again would wait for
        itself until LOCK_TIMEOUT: the in-process lock is not reentrant. A context
        variable, not the thread: the async API runs a load in a worker thread with
        the caller's context while the caller's task holds the lock."""
        held = _HELD_HERE.get().get(lock_path)
        return held is not None and held.live()

    @staticmethod
    def holds_any() -> bool:
        """Whether the caller's context holds a lock through :meth:`marked_held`."""
        return any(held.live() for held in _HELD_HERE.get().values())

    @staticmethod
    @contextlib.contextmanager
    def marked_held(held: Held) -> Iterator[None]:
        before = _HELD_HERE.get()
        _HELD_HERE.set({**before, held.path: held})
        try:
            yield
        finally:
            _HELD_HERE.set(before)

    def hold(
        self, lock_path: str, operation: str, timeout: float | None = None,
    ) -> contextlib.AbstractContextManager[Held]:
        """``with locks.hold(path, op) as held:`` holds the transcript lock at
        ``lock_path``; LOCK_TIMEOUT if not had within ``timeout`` (default: the
        store's ``lock_timeout_seconds``).

        In a context that holds it already through these locks' :meth:`marked_held`
        (``store.locked(key)``, then ``store.append(key, ...)``), the work runs under
        that hold and its lease instead of waiting for itself; releasing stays the
        outer holder's. Other contexts (threads, tasks) and other stores wait.
        """
        outer = _HELD_HERE.get().get(lock_path)
        if outer is not None and outer._locks is self and outer.live():
            return contextlib.nullcontext(outer)
        return Held(self, lock_path, operation, timeout)

    def _use(self, lock_path: str) -> _Local:
        with self._guard:
            entry = self._local.get(lock_path)
            if entry is None:
                entry = self._local[lock_path] = _Local()
                if len(self._local) > _IDLE_LOCKS:
                    self._trim()
            else:
                self._local.move_to_end(lock_path)
            entry.users += 1
        return entry

    def _trim(self) -> None:
        """Drop the least recently used entries nobody is using, down to _IDLE_LOCKS."""
        excess = len(self._local) - _IDLE_LOCKS
        idle = (path for path, entry in self._local.items() if entry.users == 0)
        for path in list(itertools.islice(idle, excess)):  # (the oldest first: mostly one look)
            del self._local[path]

    def _current(self, path: str, entry: _Local) -> bool:
        """Whether ``entry`` is still the one of ``path``: its in-process lock, just
        taken, is the path's (a waiter that another left behind for a stuck holder
        must follow to the new entry, or two threads of the store hold the path at once:
        review, stop 30). Under the guard, so that :meth:`_past_stuck` cannot replace
        it between this look and the taking of the marker."""
        with self._guard:
            return self._local.get(path) is entry

    def _past_stuck(self, path: str, entry: _Local) -> _Local:
        """The entry of ``path`` to wait on: ``entry``, unless its holder (a thread or
        task of this store) has held the marker for ``stale`` seconds. That holder is
        stuck, as another process judges by the marker; its siblings, waiting here,
        never look at the marker, so without this they waited for it for ever (review,
        stop 30). The stuck holder keeps its entry; the path gets a new one, whose
        first holder reclaims the marker as this store's own (``mine``: the holder is
        long past its lease, and publishes nothing)."""
        with self._guard:
            current = self._local.get(path)
            if current is entry and (not entry.taken or time.monotonic() - entry.taken < self.stale):
                return entry
            if current is entry or current is None:  # (None: another's new one, trimmed since)
                current = self._local[path] = _Local()
            entry.users -= 1
            current.users += 1
            return current

    def _done(self, entry: _Local) -> None:
        with self._guard:
            entry.users -= 1

    def _acquire(
        self, soft: _MarkerLock, lock_path: str, operation: str, deadline: float, interrupts: HeldOff,
    ) -> float:
        """Acquire, checking every :data:`_RECLAIM_POLL` seconds (first at once) for a stale
        marker filelock cannot break.

        Returns when the lease began: the start of the attempt that succeeded, which is
        no later than the marker's creation (others age the lock from that), so a stall
        between creating the marker and returning counts against the lease.
        """
        poll = min(_RECLAIM_POLL, max(self.stale / 4, 0.05))
        wait = 0.0  # the first try does not wait: a dead holder's marker is judged at once
        if len(self._watched) > _WATCHED_MARKERS:
            now = time.monotonic()
            # A copy: threads of this store waiting on other locks add to it meanwhile.
            for path, (_ident, since) in self._watched.copy().items():
                if now - since > 2 * self.stale + 60:
                    self._watched.pop(path, None)
        # The error of the looks at the marker, while they fail (twice or more in a row:
        # one that failed once has no say): a marker that cannot be judged is that
        # error's doing, not a holder's (review: a .locks whose listing kept failing EIO
        # ended LOCK_TIMEOUT, naming the holder, without a word of EIO).
        unjudged: OSError | None = None
        failed = 0
        while True:
            started = time.monotonic()
            remaining = deadline - started
            try:
                soft.acquire(timeout=max(min(remaining, wait), 0))
                return started
            except filelock.Timeout as exc:
                interrupts.deliver()
                if time.monotonic() >= deadline:
                    raise self._timeout(lock_path, operation, exc, unjudged) from exc
            except (NotADirectoryError, OSError) as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                # .locks is not a real directory (swapped for a symlink): never followed
                raise _fsio.unsafe(os.path.dirname(lock_path), operation) from exc
            judged = reclaim(lock_path, older_than=self.stale, operation=operation,
                             watched=self._watched, mine=self._records.texts())
            failed = failed + 1 if isinstance(judged, OSError) else 0
            unjudged = judged if isinstance(judged, OSError) and failed > 1 else None
            wait = poll

    def _timeout(self, path: str, operation: str, exc: filelock.Timeout | None,
                 unjudged: OSError | None = None) -> FsStoreError:
        """LOCK_TIMEOUT; or, where the looks at whether the marker is stale kept failing
        up to the deadline (twice or more in a row), that failure's code (EIO, EACCES):
        nothing was committed either way."""
        # Deliberately not a TimeoutError: the SDK does not retry those, and a lock
        # timeout is safe to retry (nothing was committed).
        if unjudged is not None:
            return FsStoreError(
                posix_code(unjudged.errno), f"transcript lock not acquired within {self.timeout:g}s: "
                f"whether its marker is stale could not be told ({unjudged})", operation=operation,
                path=path, errno=unjudged.errno)
        return FsStoreError(
            "LOCK_TIMEOUT",
            f"transcript lock not acquired within {self.timeout:g}s{_holder(path)}",
            operation=operation,
            path=path,
        )


def _holder(lock_path: str) -> str:
    """`` (held by pid P on HOST since T, Ns)`` from the lock's marker, for messages."""
    try:
        marker = read_marker(lock_path)
    except OSError as exc:  # not ours to read: say so rather than guess
        return f" (its marker cannot be read: {exc.strerror})"
    if marker is None:
        return " (released just now)"
    who = "an unreadable record" if marker.pid is None else f"pid {marker.pid}"
    host = "" if marker.host is None else f" on {marker.host}"
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(marker.stat.st_mtime))
    # The host line is whatever was written to the marker: printable only.
    return ascii(f" (held by {who}{host} since {since}, {max(marker.age, 0):.0f}s ago)")[1:-1]
