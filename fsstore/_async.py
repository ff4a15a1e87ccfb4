"""The async facade: the SDK protocol, each call run in a worker thread by anyio.

There is no async storage logic: every method hands the synchronous
implementation (:class:`fsstore._store.SyncStore`, also reachable as
``store.sync``) to ``anyio.to_thread.run_sync``, so no file I/O ever runs on the
event loop, and the same code serves asyncio and trio. An append either commits
or not, never halfway. Cancelled through anyio (a cancel scope: ``fail_after``,
``move_on_after``, a task group, on asyncio or trio), a call waits for its worker and
returns what it did; cancelled natively on asyncio (``task.cancel()``,
``asyncio.wait_for``, ``asyncio.timeout``), the await ends at once while the worker
finishes: the batch may still commit (a caller that retries it may store it twice;
entries with a ``uuid`` load once). A ``delete`` waits for its worker however it is
cancelled (:func:`_to_the_end`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any, TypeVar

from anyio import CancelScope, CapacityLimiter, to_thread
from anyio.lowlevel import RunVar

from ._lock import Held, Locks
from ._store import SyncStore

_T = TypeVar("_T")


class FsSessionStore:
    """A ``SessionStore`` on a directory, typically on a shared mount.

    Entries and listings are typed ``list[Any]`` so that the class matches the
    SDKs' ``SessionStore`` protocols (whose TypedDicts fsstore does not import).

    Every method runs the blocking implementation (``store.sync``) in a worker
    thread and raises only :class:`~fsstore.FsStoreError` (with a stable ``code``;
    see README "Error codes"), plus ``ValueError``/``TypeError`` from the
    constructor. Cancellation: see the module docstring (anyio's waits for the
    worker; asyncio's native one does not).

    Args:
        root: the store directory (a store: see ``create``).
        create: make ``root`` (never its parents) and its ``.fsstore`` marker on the
            first write if it is not a store yet; without it such a write is
            ``NOT_A_STORE`` (an unmounted share) and nothing is written.
        fsync: fsync each part before it becomes visible and the directory after
            (default False: the SDK's local transcript is the durable copy; see
            docs/operations.md).
        stale_lock_seconds: a lock file older than this is reclaimed, whoever holds it.
        lock_timeout_seconds: how long a writer waits for the lock before LOCK_TIMEOUT.
        dir_mode, file_mode: permissions of what the store creates (0700 / 0600).
        summaries: maintain the Claude summary sidecar (None: when claude-agent-sdk
            is importable).
        compact_every: merge parts into segments once this many accumulated, in a
            thread of this process after the append that found them returned (0:
            never automatically; ``compact(key)`` still works).
    """

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
        self.sync = SyncStore(
            root,
            fsync=fsync,
            stale_lock_seconds=stale_lock_seconds,
            lock_timeout_seconds=lock_timeout_seconds,
            dir_mode=dir_mode,
            file_mode=file_mode,
            summaries=summaries,
            compact_every=compact_every,
            create=create,
        )

    @property
    def root(self) -> str:
        """The store directory, absolute."""
        return self.sync.root

    def __repr__(self) -> str:
        return f"FsSessionStore(root={self.root!r})"

    async def append(self, key: Mapping[str, Any], entries: list[Any]) -> None:
        """Commit ``entries`` (JSON objects) as one batch of the transcript ``key``.

        Guarantees: once it returns, the batch is in every later :meth:`load` on
        every host whose client sees the file, exactly once and whole, whatever
        other writers, clocks, stalls, compactions and deletes do (two writers
        whose lock holds overlapped may see their own batches reordered). An empty
        list writes nothing. A session another host deleted is started anew.

        Raises:
            FsStoreError: ``INVALID_KEY``/``INVALID_ENTRY`` before anything touches
                disk; otherwise with the POSIX or store code of what failed, and
                nothing of the batch committed (safe to retry), except where the
                message says the batch may be committed (``EAGAIN`` after others'
                compactions or repairs, ``EIO`` where a part it linked could not be
                removed, ``LOCK_TIMEOUT`` where its part went with a directory a
                delete moved by mistake that could not be merged at once): a
                retry may then store it twice (entries with a ``uuid`` still load
                once).
        """
        await _run(self.sync.append, key, entries)

    async def load(self, key: Mapping[str, Any]) -> list[Any] | None:
        """The transcript ``key``: its entries in commit order, or None if it has none.

        Every batch whose append returned before the call is in it, each once and
        whole; entries with a string ``uuid`` seen before are dropped. A load
        racing a delete returns the whole transcript or None; through a client's
        stale cache, an older whole prefix.

        Raises:
            FsStoreError: ``CORRUPT`` (damaged bytes, with file and line),
                ``EAGAIN`` (lost too many races with compactions; retry), or the
                POSIX code of an I/O error.
        """
        return await _run(self.sync.load, key)

    async def list_sessions(self, project_key: str) -> list[Any]:
        """``[{"session_id", "mtime"}]`` of the project's sessions that have a main
        transcript; ``mtime`` (epoch ms) is the storage's time of its last commit.
        A missing project (or store) lists nothing. A session this process may not
        read is left out and logged, not raised."""
        return await _run(self.sync.list_sessions, project_key)

    async def list_session_summaries(self, project_key: str) -> list[Any]:
        """The Claude SDK's session summaries of the project (``session_id``,
        ``mtime`` and the folded fields), each current as of its ``mtime``; a
        session whose summary cannot be had now is left out (the SDK then loads it)."""
        return await _run(self.sync.list_session_summaries, project_key)

    async def delete(self, key: Mapping[str, Any]) -> None:
        """Delete the transcript ``key`` (without ``subpath``: the whole session, its
        subagent transcripts too). All or nothing for every reader: a load racing
        it returns the whole transcript or None. Deleting what does not exist is
        not an error. Raises :class:`~fsstore.FsStoreError` if it could not (one raised
        after its marks leaves it in effect: docs/format.md, "Deletes").

        Cancelled in any way, natively on asyncio too, it waits for its worker: a
        delete that went on after its caller had moved on would remove the batches
        the caller appended next (review, stop 33: 2 of ~2,430 timed-out deletes)."""
        await _to_the_end(_run(self.sync.delete, key))

    async def list_subkeys(self, key: Mapping[str, Any]) -> list[str]:
        """The ``subpath`` of every subagent transcript of the session ``key``."""
        return await _run(self.sync.list_subkeys, key)

    async def compact(self, key: Mapping[str, Any]) -> int:
        """Merge all of a transcript's files into one segment; return how many were merged."""
        return await _run(self.sync.compact, key)

    @contextlib.asynccontextmanager
    async def locked(self, key: Mapping[str, Any]) -> AsyncIterator[None]:
        """``async with store.locked(key):`` holds the transcript's commit lock (the
        blocking one is ``store.sync.locked(key)``).

        Inside, this task's ``append``, ``compact`` and ``load`` of that transcript run
        under it instead of waiting for it. Taking and releasing are shielded from
        cancellation: a cancelled task never leaves the lock behind (cancelled natively
        on asyncio while it waits, its worker gives back what it then takes).
        """
        taking = _Taking(self.sync, key)
        with CancelScope(shield=True):
            try:
                hold, held = await _run(taking.take)  # (nested in another hold: its pool)
            except BaseException:
                taking.abandon()
                raise
        release = _Once(hold.__exit__)
        try:
            with Locks.marked_held(held):
                yield
        finally:
            try:
                with CancelScope(shield=True):
                    await to_thread.run_sync(release, limiter=_under_a_hold())
            finally:
                if not release.started:
                    # Cancelled natively on asyncio before a worker ran it (anyio's
                    # checkpoints come first): rather than leave the lock held by
                    # nobody (review, stop 30: Ctrl-C under asyncio.run with gather).
                    _in_a_thread(release)


# A task's calls while it holds a transcript lock (``locked``), its release and the
# takes nested in it, run on worker threads of their own, never waiting for one: each
# task waiting for a lock occupies a worker thread, and the holder's append waited
# behind them past its lease (review, stop 30: 40 tasks appending to the transcript
# on anyio's 40 default threads; and 41 nested takes on a pool of 40 for holders).
# As many as tasks hold locks at once.
_UNDER_A_HOLD: RunVar[CapacityLimiter] = RunVar("fsstore_under_a_hold")


def _under_a_hold() -> CapacityLimiter:
    try:
        return _UNDER_A_HOLD.get()
    except LookupError:
        limiter = CapacityLimiter(math.inf)
        _UNDER_A_HOLD.set(limiter)
        return limiter


async def _run(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` in a worker thread (of the pool for holders, in a task that holds
    a lock through :meth:`FsSessionStore.locked`)."""
    return await to_thread.run_sync(fn, *args, limiter=_under_a_hold() if Locks.holds_any() else None)


async def _to_the_end(call: Coroutine[Any, Any, _T]) -> _T:
    """Await ``call``; cancelled natively on asyncio (which anyio's wait for the worker
    does not cover), wait for it to end all the same, then pass the cancellation on."""
    try:
        asyncio.current_task()
    except RuntimeError:  # not asyncio (trio): every cancellation is a cancel scope
        return await call
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller gets
        raise


def _in_a_thread(fn: Callable[[], object]) -> None:
    """``fn()`` in a thread of its own, not waited for: on a path where the task was
    cancelled natively, with no file I/O on the event loop (not a daemon: the process
    waits for it at exit)."""
    threading.Thread(target=fn, name="fsstore-release").start()


class _Once:
    """``hold.__exit__`` the first time it is called, from any thread; later calls wait
    for that one to be done and do nothing."""

    def __init__(self, fn: Callable[[None, None, None], object]) -> None:
        self._fn: Callable[[None, None, None], object] | None = fn
        self._guard = threading.Lock()

    @property
    def started(self) -> bool:
        return self._fn is None

    def __call__(self) -> None:
        with self._guard:
            fn, self._fn = self._fn, None
            if fn is not None:
                fn(None, None, None)


class _Taking:
    """A transcript lock taken in a worker thread for a task that may stop waiting:
    cancelled natively on asyncio (``task.cancel()``, ``asyncio.timeout``, Ctrl-C under
    ``asyncio.run``), its await ends at once and the worker goes on, and the hold it
    took was left to nobody (review, stop 30: the transcript blocked for the store's
    other tasks and every other process). Whichever of the two comes second gives the
    hold back."""

    def __init__(self, store: SyncStore, key: Mapping[str, Any]) -> None:
        self._store, self._key = store, key
        self._guard = threading.Lock()
        self._hold: contextlib.AbstractContextManager[Held] | None = None
        self._abandoned = False

    def take(self) -> tuple[contextlib.AbstractContextManager[Held], Held]:
        hold, held = self._store._take_lock(self._key)
        with self._guard:
            if not self._abandoned:
                self._hold = hold
                return hold, held
        hold.__exit__(None, None, None)  # nobody waits for it any more
        return hold, held

    def abandon(self) -> None:
        """The task stopped waiting: give back a hold taken just before (in a thread:
        no file I/O on the event loop), or have the worker give it back."""
        with self._guard:
            self._abandoned = True
            hold, self._hold = self._hold, None
        if hold is not None:
            _in_a_thread(_Once(hold.__exit__))


__all__ = ["FsSessionStore"]
