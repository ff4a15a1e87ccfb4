"""Compaction after the append: in a thread of this process, off the append's
critical path (and off its lock hold).

An append that finds many parts since the last segment asks for one with
:meth:`Compactions.soon` once its batch is committed. The thread ends when nothing is
left to do; it is not a daemon, so a process waits for it at exit rather than leave a
lock file behind: it waits for a lock at most :data:`WAIT` seconds (a busy transcript:
the next append finds the parts due and asks again). A failure is logged
(``COMPACT_FAILED``) and only costs load speed; nothing here raises (the batch is
committed).

Once the interpreter is shutting down (the main thread is done: ``atexit`` handlers run
after the non-daemon threads were joined), it compacts in the caller's thread instead,
and no compaction waits for a busy lock (exit waits for the compactions' own work only).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from typing import TYPE_CHECKING

from . import _layout
from ._errors import FsStoreError, log
from ._interrupts import HeldOff
from ._keys import TranscriptKey

if TYPE_CHECKING:
    from ._store import SyncStore

#: How long an automatic compaction waits for a busy lock (seconds).
WAIT = 2.0
_THREAD_NAME = "fsstore-compact"


class Compactions:
    """The automatic compactions of one store object (which it does not hold: a store
    object that goes removes its lock record at once, see :mod:`fsstore._lock`)."""

    def __init__(self) -> None:
        self._queued: dict[TranscriptKey, None] = {}  # in order, once each
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()  # guards the two above

    def soon(self, store: SyncStore, tk: TranscriptKey) -> None:
        """Compact the transcript once the caller's append has returned. Never raises."""
        try:
            self._queue(store, tk)
        except Exception as exc:  # noqa: BLE001 - the batch is committed: never fail its append
            _failed(store, tk, exc)

    def done(self) -> None:
        """Wait for the compactions asked for so far (tests, benchmarks)."""
        while True:
            with self._guard:
                worker = self._thread
            if worker is None:
                return
            worker.join()

    def _queue(self, store: SyncStore, tk: TranscriptKey) -> None:
        interrupts = HeldOff()  # a Ctrl-C inside would note a thread never started
        try:
            with self._guard:
                threaded = threading.main_thread().is_alive()
                if threaded:
                    self._queued[tk] = None
                if threaded and self._thread is None:
                    # Never a daemon, whoever appended: a thread started from a daemon thread
                    # (a user's, or trio's worker threads) would otherwise be one, and be cut
                    # off at exit holding the lock.
                    self._thread = threading.Thread(target=self._run, args=(store,), name=_THREAD_NAME,
                                                    daemon=False)
                    try:
                        self._thread.start()
                    except RuntimeError:  # the interpreter refuses new threads (shutting down)
                        self._thread, threaded = None, False
                        self._queued.clear()
        finally:
            interrupts.restore()
        if not threaded:
            _now(store, tk)

    def _run(self, store: SyncStore) -> None:
        while True:
            with self._guard:
                if not self._queued:
                    self._thread = None
                    return
                tk = next(iter(self._queued))
                del self._queued[tk]
            try:
                _now(store, tk)
            except BaseException:  # a bug: the thread's excepthook shows it; the next append starts another
                with self._guard:
                    self._thread = None
                raise


@atexit.register
def _finish_at_exit() -> None:
    """A Ctrl-C at exit cuts short the interpreter's wait for the non-daemon threads
    (``threading._shutdown``), and a compaction cut off there leaves its lock file, like
    a killed process. The wait goes on here (``atexit`` runs after that one); a second
    Ctrl-C ends it."""
    with contextlib.suppress(KeyboardInterrupt):
        for thread in threading.enumerate():
            if thread.name == _THREAD_NAME and thread is not threading.current_thread():
                thread.join()


def _now(store: SyncStore, tk: TranscriptKey) -> None:
    # Exiting (the main thread is done), a busy lock is not waited for.
    wait = min(store._locks.timeout, WAIT) if threading.main_thread().is_alive() else 0.0
    try:
        store._compact(tk, everything=False, wait=wait)
    except (OSError, FsStoreError) as exc:
        if getattr(exc, "code", None) != "LOCK_TIMEOUT":  # busy: the next due append asks again
            _failed(store, tk, exc)


def _failed(store: SyncStore, tk: TranscriptKey, exc: Exception) -> None:
    log.warning("automatic compaction failed: %s", exc, extra={
        "code": "COMPACT_FAILED", "operation": "compact", "path": store._path(_layout.transcript_dirs(tk))})
