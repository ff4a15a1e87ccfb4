"""Ctrl-C held off while this process takes, holds or gives back a lock.

Python runs signal handlers in the main thread, between any two bytecodes, also on
entry to a ``with`` statement's ``__exit__`` before its first line: a
``KeyboardInterrupt`` could land after a lock was taken and before its taker noted
it, or as it was to be given back, leaving an in-process lock held by nobody (or
filelock's bookkeeping half changed); every later append of that process to that
transcript then waited for it in vain. So from the moment a lock is asked for until
it is given back, the main thread's SIGINT handler is swapped for one that only
notes the signal, and the real one runs where nothing is half taken
(:meth:`HeldOff.deliver`): between a waiter's tries (Ctrl-C still ends a long wait
within one try) and at the holder's last check before it publishes (nothing
committed), through every hold it nests in; or once the lock is given back
(:meth:`HeldOff.restore`). Other threads never run handlers: there it does nothing.
"""

from __future__ import annotations

import os
import signal
import threading
import types
from typing import Any


class HeldOff:
    """SIGINT held off from construction until :meth:`restore` (call it on every path;
    nested ones restore in reverse order, a held-off Ctrl-C passing outwards)."""

    __slots__ = ("_pending", "_previous")

    def __init__(self) -> None:
        self._pending = False
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if previous is not None:  # None: a handler not set from Python, left alone
                self._hold_off()
                self._previous = previous

    def _hold_off(self) -> None:
        # Never raises, so that a lock is given back whatever came: swapping the handler
        # first runs it for a Ctrl-C that came just before, and where it raised, it runs
        # again later (its exception is dropped here).
        while True:
            try:
                signal.signal(signal.SIGINT, self._note)
                return
            except BaseException:  # noqa: BLE001 - the handler's own: raised again later
                self._pending = True

    def _note(self, signum: int, frame: types.FrameType | None) -> None:
        self._pending = True

    def deliver(self) -> None:
        """Run the real handler now for a Ctrl-C that came while this one, or one it
        nests in, held it off (by default it raises ``KeyboardInterrupt``); held off
        again after it, whether it raised or not. Nested in another hold (inside
        ``locked()``, or a delete taking several locks), a wait or a last check runs
        it too: the caller's way out gives that hold back."""
        if self._due():
            previous, outer = self._previous, self._outer()
            try:
                self.restore()  # one of ours runs an outer one's note: due there
                if outer is not None:
                    outer.deliver()
            finally:
                self._hold_off()
                self._previous = previous

    def _outer(self) -> HeldOff | None:
        """The one this nests in (whose note was the handler this one held off)."""
        outer = getattr(self._previous, "__self__", None)
        return outer if isinstance(outer, HeldOff) else None

    def _due(self) -> bool:
        outer = self._outer()
        return self._pending or (outer is not None and outer._due())

    def restore(self) -> None:
        """Put the handler back, and run it for a Ctrl-C that came meanwhile (it may
        raise). Calling it again does nothing."""
        previous, self._previous = self._previous, None
        if previous is not None:
            signal.signal(signal.SIGINT, previous)  # runs ours for one that came just now
            if self._pending:
                self._pending = False
                signal.raise_signal(signal.SIGINT)


def _in_forked_child() -> None:
    """A child forked by another thread while the main thread held SIGINT off gets the
    handler that was held off (that thread, and its restore, are not in the child)."""
    handler = signal.getsignal(signal.SIGINT)
    while isinstance(getattr(handler, "__self__", None), HeldOff):
        handler = handler.__self__._previous  # type: ignore[union-attr]
    if handler is not None and handler is not signal.getsignal(signal.SIGINT):
        signal.signal(signal.SIGINT, handler)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_forked_child)
