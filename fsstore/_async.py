"""The async facade: the SDK protocol, each call run in a worker thread by anyio.

There is no async storage logic: every method hands the synchronous
implementation (:class:`fsstore._store.SyncStore`, also reachable as
``store.sync``) to ``anyio.to_thread.run_sync``, so no file I/O ever runs on the
event loop, and the same code serves asyncio and trio. A cancelled caller does
not abandon the worker: an append either commits or not, never halfway.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

from anyio import CancelScope, to_thread

from ._lock import Locks
from ._store import SyncStore


class FsSessionStore:
    """A ``SessionStore`` on a directory, typically on a shared mount.

    Entries and listings are typed ``list[Any]`` so that the class matches the
    SDKs' ``SessionStore`` protocols (whose TypedDicts fsstore does not import).

    Args:
        root: the store directory; created on first write.
        fsync: fsync each part before it becomes visible and the directory after
            (default False: the SDK's local transcript is the durable copy; see
            docs/operations.md).
        stale_lock_seconds: a lock file older than this is reclaimed, whoever holds it.
        lock_timeout_seconds: how long a writer waits for the lock before LOCK_TIMEOUT.
        dir_mode, file_mode: permissions of what the store creates (0700 / 0600).
        summaries: maintain the Claude summary sidecar (None: when claude-agent-sdk
            is importable).
        compact_every: merge parts into segments once this many accumulated
            (0: never automatically; ``compact(key)`` still works).
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
        return self.sync.root

    def __repr__(self) -> str:
        return f"FsSessionStore(root={self.root!r})"

    async def append(self, key: Mapping[str, Any], entries: list[Any]) -> None:
        await to_thread.run_sync(self.sync.append, key, entries)

    async def load(self, key: Mapping[str, Any]) -> list[Any] | None:
        return await to_thread.run_sync(self.sync.load, key)

    async def list_sessions(self, project_key: str) -> list[Any]:
        return await to_thread.run_sync(self.sync.list_sessions, project_key)

    async def list_session_summaries(self, project_key: str) -> list[Any]:
        return await to_thread.run_sync(self.sync.list_session_summaries, project_key)

    async def delete(self, key: Mapping[str, Any]) -> None:
        await to_thread.run_sync(self.sync.delete, key)

    async def list_subkeys(self, key: Mapping[str, Any]) -> list[str]:
        return await to_thread.run_sync(self.sync.list_subkeys, key)

    async def compact(self, key: Mapping[str, Any]) -> int:
        """Merge all of a transcript's files into one segment; return how many were merged."""
        return await to_thread.run_sync(self.sync.compact, key)

    @contextlib.asynccontextmanager
    async def locked(self, key: Mapping[str, Any]) -> AsyncIterator[None]:
        """``async with store.locked(key):`` holds the transcript's commit lock (the
        blocking one is ``store.sync.locked(key)``).

        Inside, this task's ``append``, ``compact`` and ``load`` of that transcript run
        under it instead of waiting for it. Taking and releasing are shielded from
        cancellation: a cancelled task never leaves the lock behind.
        """
        with CancelScope(shield=True):
            hold, held = await to_thread.run_sync(self.sync._take_lock, key)
        try:
            with Locks.marked_held(held):
                yield
        finally:
            with CancelScope(shield=True):
                await to_thread.run_sync(hold.__exit__, None, None, None)


__all__ = ["FsSessionStore"]
