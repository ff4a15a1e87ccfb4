"""Reading a whole file: a regular file only (a FIFO planted under a part's name never
blocks the open), at the size its file system has now (a FUSE client can hold a size
from before another host replaced the file at that name)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import stat
import sys
from typing import Any

from ._fsio import READ_FLAGS


class NotAFile(OSError):
    """Something other than a regular file sits where the store expects one (a FIFO...)."""


def read_file(dir_fd: int, name: str, *, limit: int | None = None) -> bytes:
    """The whole content of a regular file; NotAFile for a FIFO, device or directory,
    or for a file larger than ``limit`` bytes.

    O_NONBLOCK keeps a FIFO planted under a part's name from blocking the open. On a
    FUSE mount the size is asked of the file system (:func:`_fresh_size`) before the
    read: the kernel stops a read at the size it holds, and a FUSE client can hold
    one from before another host replaced the file at that name.
    """
    fd = os.open(name, READ_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        return read_fd(fd, name, limit=limit)
    finally:
        os.close(fd)


def read_fd(fd: int, name: str, *, limit: int | None = None) -> bytes:
    """:func:`read_file` of a file open as ``fd`` (at its start), named ``name``."""
    chunks = []
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (limit is not None and st.st_size > limit):
        raise NotAFile(errno.EINVAL, "not a regular file of the expected size", name)
    size = _fresh_size(fd) if _on_fuse(st.st_dev) else st.st_size
    while True:
        chunk = os.read(fd, max(size, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# How many last bytes of a file tell it from another at the same name: the last line
# of its last batch, with the batch's nonce (a new file there ends with another).
_TAIL = 256


def still(dir_fd: int, name: str, data: bytes) -> bool:
    """Whether the file at ``name`` is still the one read as ``data``: the same size
    now, and the same last bytes (a batch's last line ends with its random nonce). Where
    directory handles go by path (sshfs, bindfs: FUSE's path-based API), a delete and a
    new session made at the same key by another host turn every name under a handle
    into the new session's file of that name."""
    try:
        fd = os.open(name, READ_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ESTALE):
            return False
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        size = _fresh_size(fd) if _on_fuse(st.st_dev) else st.st_size
        n = min(len(data), _TAIL)
        if size != len(data):
            return False
        os.lseek(fd, size - n, os.SEEK_SET)
        return os.read(fd, n) == data[size - n:]
    finally:
        os.close(fd)


# statx(2) with AT_STATX_FORCE_SYNC makes a FUSE (or NFS) client ask its server for the
# attributes of the open file instead of answering from its cache. Through ctypes, as
# _fsio's openat2: the os module has no statx. stx_size is the 64-bit field at byte 40
# of struct statx.
_AT_EMPTY_PATH, _AT_STATX_FORCE_SYNC, _STATX_SIZE = 0x1000, 0x2000, 0x200
_statx: Any = None
with contextlib.suppress(OSError, AttributeError):  # pragma: no cover - glibc < 2.28, musl < 1.2.5
    _statx = ctypes.CDLL(None, use_errno=True).statx
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p]
    _statx.restype = ctypes.c_int


def _fresh_size(fd: int) -> int:
    """The open file's size as its file system has it now, not as this client cached
    it: sshfs keeps the sizes a listing showed (8-20 s), and reads of a file another
    host replaced at that name stopped there (a torn last line, or whole lines
    missing: found by review). The cached size where statx cannot ask."""
    buf = ctypes.create_string_buffer(256)
    if _statx is not None and _statx(fd, b"", _AT_EMPTY_PATH | _AT_STATX_FORCE_SYNC, _STATX_SIZE, buf) == 0:
        return int.from_bytes(buf.raw[40:48], sys.byteorder)
    return os.fstat(fd).st_size


def _on_fuse(dev: int) -> bool:
    """Whether the file system on device ``dev`` is a FUSE mount, whose files another
    host can replace behind this client's cache. Local disks, tmpfs and NFS (which
    checks a file's attributes as it opens it) read without asking."""
    return os.major(dev) == 0 and _anonymous_is_fuse(dev)  # FUSE mounts have no block device


@functools.lru_cache(maxsize=32)
def _anonymous_is_fuse(dev: int) -> bool:
    """/proc/self/mountinfo's type for ``dev`` is ``fuse`` or ``fuse.<name>``. Cached;
    a store object made clears it (:func:`forget_mounts`): device numbers without a
    block device are reused by the next mount, of any type."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    with (contextlib.suppress(OSError, ValueError, IndexError),
          open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh):
        for line in fh:
            fields = line.split()
            if fields[2] == want:
                return fields[fields.index("-") + 1].split(".")[0] == "fuse"
    return False


def forget_mounts() -> None:
    """Forget which devices are FUSE mounts (see :func:`_anonymous_is_fuse`)."""
    _anonymous_is_fuse.cache_clear()


_MARK_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def mark_there(dir_fd: int, name: str) -> bool:
    """Whether the mark ``name`` (an empty file: ``.deleted``) is there, as the server
    says: asked by an open, which reaches it, where a ``stat`` can be answered from a
    client's cache by path (sshfs keeps a deleted session's names past a new session
    made at its name: review 111, a writer took the new session for the deleted one and
    removed it). A symlink there counts (nothing followed); where the open is refused
    (permissions), the ``stat`` says."""
    try:
        os.close(os.open(name, _MARK_FLAGS, dir_fd=dir_fd))
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM):
            raise
        if exc.errno != errno.ELOOP:  # refused: the stat says
            try:
                os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
    return True
