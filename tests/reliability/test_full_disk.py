"""A full disk, for real: the store on a size-limited tmpfs (``mount -t tmpfs -o size=``).

When the disk is full an append fails with ``code == "ENOSPC"``, ``errno ==
errno.ENOSPC`` and ``operation == "append"``; the failed batch is absent, no temp
file and no lock file are left, the earlier entries load intact and the summaries
still agree with them; once space is freed, appends succeed again. The sweep
leaves 0, 1, 2, ... pages free so that the disk fills up at each step in turn (the
part's temp file, the lock marker, the state file, a compaction's segment): every
step either fails the whole append cleanly or lets it commit whole.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from fsstore import FsStoreError
from fsstore._store import SyncStore

from . import _mounts
from ._check import assert_summaries_consistent, assert_transcript, batch, lock_files, temp_files

PAGE = os.sysconf("SC_PAGE_SIZE")
PROJECT = "-full-disk"
KEY = {"project_key": PROJECT, "session_id": "s"}
SUB = {**KEY, "subpath": "subagents/a"}


def fill(path: Path) -> int:
    """Write ``path`` until the filesystem is full; returns its size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    chunk = b"\0" * PAGE
    size = 0
    try:
        while True:
            try:
                size += os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                return size
    finally:
        os.close(fd)


def leave_free(filler: Path, pages: int) -> None:
    size = filler.stat().st_size
    os.truncate(filler, max(size - pages * PAGE, 0))


def no_leftovers(root: str) -> None:
    assert temp_files(root) == [], "a failed append left a temp file"
    assert lock_files(root) == [], "a lock file was left"


def assert_enospc(err: FsStoreError, root: str, operation: str = "append") -> None:
    assert err.code == "ENOSPC", err
    assert err.errno == errno.ENOSPC, err
    assert err.operation == operation, err
    assert err.path is not None and err.path.startswith(root), err
    assert "ENOSPC" in str(err) and operation in str(err)


class Book:
    """The store and what it must hold."""

    def __init__(self, root: str, **opts: Any) -> None:
        self.root = root
        self.store = SyncStore(root, create=True, **opts)
        self.expected: dict[str, list[tuple[Any, int]]] = {"main": [], "sub": []}
        self.sizes: dict[tuple[Any, int], int] = {}
        self.keys = {"main": KEY, "sub": SUB}
        self.n = 0

    def append(self, which: str, n: int = 2, pad: int = 0) -> FsStoreError | None:
        self.n += 1
        try:
            self.store.append(self.keys[which], batch(which, self.n, n, pad=pad))
        except FsStoreError as exc:
            return exc
        finally:
            self.store._compactions.done()  # one an append left to its thread
        self.expected[which].append((which, self.n))
        self.sizes[(which, self.n)] = n
        return None

    def check(self) -> None:
        for which, key in self.keys.items():
            loaded = self.store.load(key)
            if self.expected[which]:
                v = assert_transcript(loaded, self.expected[which], sum(self.sizes[b] for b in self.expected[which]))
                assert v.batches == self.expected[which]
            else:
                assert loaded is None
        assert_summaries_consistent(self.store, PROJECT)


def test_append_on_full_disk_fails_cleanly_and_recovers(tmpfs_dir: Path, figures: Any) -> None:
    with _mounts.tmpfs(tmpfs_dir / "mnt", "size=1m") as mnt:
        root = f"{mnt}/store"
        book = Book(root)
        for which in ("main", "sub", "main"):
            assert book.append(which) is None
        filler = Path(mnt) / "filler"
        fill(filler)
        for which in ("main", "sub"):
            err = book.append(which)
            assert err is not None, "append on a full disk succeeded?"
            assert_enospc(err, root)
            figures.fault("ENOSPC (tmpfs full)")
        no_leftovers(root)
        book.check()
        assert {s["session_id"] for s in book.store.list_sessions(PROJECT)} == {"s"}
        filler.unlink()  # space again
        assert book.append("main") is None and book.append("sub") is None
        book.check()
        figures.add("appends", 8)


def test_new_session_on_full_disk_is_enospc_and_invisible(tmpfs_dir: Path, figures: Any) -> None:
    with _mounts.tmpfs(tmpfs_dir / "mnt", "size=512k") as mnt:
        root = f"{mnt}/store"
        store = SyncStore(root, create=True)
        store.append(KEY, batch("w", 0, 1))
        fill(Path(mnt) / "filler")
        for sid in ("new-session", "N" * 300):  # a plain and a hashed directory name
            key = {"project_key": PROJECT, "session_id": sid}
            with pytest.raises(FsStoreError) as info:
                store.append(key, batch("w", 1, 1))
            assert_enospc(info.value, root)
            figures.fault("ENOSPC (tmpfs full)")
            assert store.load(key) is None
        no_leftovers(root)
        assert [s["session_id"] for s in store.list_sessions(PROJECT)] == ["s"]
        assert_summaries_consistent(store, PROJECT)


@pytest.mark.parametrize("compact_every", [0, 2])
def test_disk_filling_up_at_each_step_of_an_append(
    tmpfs_dir: Path, figures: Any, compact_every: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Leave k pages free for k = 0..11: each append either fails whole or commits whole.

    Small k fails the part's temp file or the lock marker (ENOSPC, batch absent);
    more lets the append commit but not a compaction's segment (committed, logged
    COMPACT_FAILED).
    """
    seen: dict[int, set[str]] = {}
    with _mounts.tmpfs(tmpfs_dir / "mnt", "size=2m") as mnt:
        root = f"{mnt}/store"
        book = Book(root, compact_every=compact_every)
        assert book.append("main") is None
        filler = Path(mnt) / "filler"
        for k in range(12):
            fill(filler)
            leave_free(filler, k)
            which = "main" if k % 3 else "sub"
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="fsstore"):
                err = book.append(which, n=3, pad=PAGE // 2)  # a part of about 1.5 pages
            seen[k] = {str(getattr(r, "code", "?")) for r in caplog.records}
            if err is not None:
                assert_enospc(err, root)
                figures.fault("ENOSPC (tmpfs full)")
            else:
                seen[k].add("committed")
                figures.fault("ENOSPC (tmpfs full)", len(seen[k] & {"SUMMARY_BEHIND", "COMPACT_FAILED"}))
            no_leftovers(root)
            filler.unlink()
            book.check()  # after a failed compaction the summary must still agree
        figures.add("appends", 13)
        covered = set().union(*seen.values())
        want = {"ENOSPC", "committed"} | ({"COMPACT_FAILED"} if compact_every else set())
        assert want <= covered, seen
        assert book.append("main") is None and book.append("sub") is None
        book.check()


def test_batch_bigger_than_the_free_space_leaves_no_partial_file(tmpfs_dir: Path, figures: Any) -> None:
    with _mounts.tmpfs(tmpfs_dir / "mnt", "size=1m") as mnt:
        root = f"{mnt}/store"
        book = Book(root)
        assert book.append("main") is None
        filler = Path(mnt) / "filler"
        fill(filler)
        leave_free(filler, 8)
        err = book.append("main", n=40, pad=PAGE // 2)  # ~20 pages: fails in the middle of the write
        assert err is not None
        assert_enospc(err, root)
        figures.fault("ENOSPC (tmpfs full)")
        no_leftovers(root)
        book.check()
        filler.unlink()
        assert book.append("main", n=40, pad=PAGE // 2) is None
        book.check()
        figures.add("appends", 3)


def test_no_free_inodes_is_enospc_too(tmpfs_dir: Path, figures: Any) -> None:
    with _mounts.tmpfs(tmpfs_dir / "mnt", "size=4m,nr_inodes=64") as mnt:
        root = f"{mnt}/store"
        book = Book(root)
        assert book.append("main") is None and book.append("sub") is None
        spare = Path(mnt) / "spare"
        spare.mkdir()
        n = 0
        while True:
            try:
                (spare / str(n)).touch()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
            n += 1
        err = book.append("main")
        assert err is not None
        assert_enospc(err, root)
        figures.fault("ENOSPC (no inodes)")
        no_leftovers(root)
        book.check()
        for p in spare.iterdir():
            p.unlink()
        assert book.append("main") is None
        book.check()
        figures.add("appends", 4)
