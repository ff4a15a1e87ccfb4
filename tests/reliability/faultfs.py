"""A fault-injecting passthrough FUSE filesystem for fsstore's reliability tests.

Run as its own process, in the foreground::

    python faultfs.py BACKING MOUNTPOINT CONTROL LOG [--threads]

Every path under MOUNTPOINT is BACKING's path, passed straight through, except
where a rule in CONTROL (a JSON file, re-read whenever it is replaced) says to
fail::

    {"rules": [{"op": "write", "path": "/\\\\.tmp-[^/]*$", "errno": "ENOSPC", "times": null}]}

* ``op``: the FUSE operation (``getattr`` also answers kernel lookups, ``create``,
  ``open``, ``read``, ``write``, ``fsync``, ``fsyncdir``, ``mkdir``, ``rename``,
  ``link``, ``unlink``, ``rmdir``, ``opendir``, ``readdir``, ...) or ``*``;
* ``path``: a regular expression searched in the path inside the mount (for
  ``rename``, ``link`` and ``symlink`` in either path);
* ``errno``: the POSIX name returned (``EIO``, ``ENOSPC``, ``EACCES``, ``EROFS``,
  ``ESTALE``, ``EINVAL``, ...);
* ``times``: how many calls fail (``null``: every call while the rule is there).

Each injected fault is appended to LOG as ``op errno path``, so a test can prove its
fault really fired. ``--threads`` runs libfuse multi-threaded (default: one thread,
so faults land deterministically).

The filesystem is mounted with entry/attr/negative timeouts of 0, ``direct_io``,
``use_ino`` and ``hard_remove``, so every lookup, read and write reaches it.
Renames honour ``RENAME_NOREPLACE`` (mfusepy drops rename flags under libfuse3;
:class:`_Fuse` passes them on).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import re
import sys
import threading
from typing import Any

import mfusepy

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int


def _rename_flags(src: str, dst: str, flags: int) -> None:
    if not flags:
        os.rename(src, dst)
        return
    if _renameat2 is None:
        raise OSError(errno.EINVAL, "rename flags not supported")
    at_fdcwd = -100
    if _renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), dst)


class _Fuse(mfusepy.FUSE):
    """mfusepy's FUSE, except that rename flags reach the operations (libfuse3)."""

    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        return self.operations.rename(  # type: ignore[no-any-return]
            old.decode(self.encoding, self.errors), new.decode(self.encoding, self.errors), flags
        )


class FaultFS(mfusepy.Operations):
    use_ns = True

    def __init__(self, backing: str, control: str, log: str) -> None:
        self.backing = os.path.realpath(backing)
        self.control = control
        self.logpath = log
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._rules: list[dict[str, Any]] = []

    # -- rules ---------------------------------------------------------------------

    def _reload(self) -> None:
        try:
            st = os.stat(self.control)
        except FileNotFoundError:
            stamp = None
        else:
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        doc: dict[str, Any] = {}
        if stamp is not None:
            with open(self.control, encoding="utf-8") as fh:
                doc = json.load(fh)
        rules = []
        for raw in doc.get("rules", []):
            rules.append(
                {
                    "op": raw.get("op", "*"),
                    "path": re.compile(raw.get("path", "")),
                    "errno": getattr(errno, raw["errno"]),
                    "left": raw.get("times"),
                }
            )
        self._rules = rules

    def _check(self, op: str, *paths: str) -> None:
        with self._lock:
            self._reload()
            for rule in self._rules:
                if rule["op"] not in ("*", op):
                    continue
                if not any(p is not None and rule["path"].search(p) for p in paths):
                    continue
                if rule["left"] is not None:
                    if rule["left"] <= 0:
                        continue
                    rule["left"] -= 1
                err = rule["errno"]
                with open(self.logpath, "a", encoding="utf-8") as fh:
                    fh.write(f"{op} {errno.errorcode[err]} {' '.join(p for p in paths if p)}\n")
                raise mfusepy.FuseOSError(err)

    def _full(self, path: str) -> str:
        return self.backing + path

    # -- metadata ------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        self._check("getattr", path)
        st = os.fstat(fh) if fh is not None else os.lstat(self._full(path))
        return {
            "st_mode": st.st_mode,
            "st_ino": st.st_ino,
            "st_nlink": st.st_nlink,
            "st_uid": st.st_uid,
            "st_gid": st.st_gid,
            "st_size": st.st_size,
            "st_blocks": st.st_blocks,
            "st_atime": st.st_atime_ns,
            "st_mtime": st.st_mtime_ns,
            "st_ctime": st.st_ctime_ns,
        }

    def access(self, path: str, amode: int) -> int:
        self._check("access", path)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        self._check("chmod", path)
        os.chmod(self._full(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        self._check("chown", path)
        os.chown(self._full(path), uid, gid, follow_symlinks=False)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        self._check("utimens", path)
        if times is None:
            os.utime(self._full(path), follow_symlinks=False)
        else:
            os.utime(self._full(path), ns=times, follow_symlinks=False)
        return 0

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._check("truncate", path)
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._full(path), length)
        return 0

    def statfs(self, path: str) -> dict[str, Any]:
        self._check("statfs", path)
        sv = os.statvfs(self._full(path))
        return {
            key: getattr(sv, key)
            for key in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax",
            )
        }

    # -- names ---------------------------------------------------------------------

    def mkdir(self, path: str, mode: int) -> int:
        self._check("mkdir", path)
        os.mkdir(self._full(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        self._check("rmdir", path)
        os.rmdir(self._full(path))
        return 0

    def unlink(self, path: str) -> int:
        self._check("unlink", path)
        os.unlink(self._full(path))
        return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        self._check("rename", old, new)
        _rename_flags(self._full(old), self._full(new), flags)
        return 0

    def link(self, target: str, source: str) -> int:
        self._check("link", source, target)
        os.link(self._full(source), self._full(target), follow_symlinks=False)
        return 0

    def symlink(self, target: str, source: str) -> int:
        self._check("symlink", target)
        os.symlink(source, self._full(target))
        return 0

    def readlink(self, path: str) -> str:
        self._check("readlink", path)
        return os.readlink(self._full(path))

    # -- files ---------------------------------------------------------------------

    def create(self, path: str, mode: int, flags: int) -> int:
        self._check("create", path)
        return os.open(self._full(path), flags | os.O_CREAT, mode)

    def open(self, path: str, flags: int) -> int:
        self._check("open", path)
        return os.open(self._full(path), flags)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        self._check("read", path)
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._check("write", path)
        return os.pwrite(fh, data, offset)

    def flush(self, path: str, fh: int) -> int:
        self._check("flush", path)
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._check("fsync", path)
        os.fsync(fh)
        return 0

    # -- directories ---------------------------------------------------------------

    def opendir(self, path: str) -> int:
        self._check("opendir", path)
        return os.open(self._full(path), os.O_RDONLY | os.O_DIRECTORY)

    def readdir(self, path: str, fh: int) -> Any:
        self._check("readdir", path)
        full = self._full(path)
        # use_ino: the kernel needs real inode numbers (glibc hides d_ino == 0).
        own = os.stat(full).st_ino
        yield (".", {"st_ino": own, "st_mode": 0o040000}, 0)
        yield ("..", {"st_ino": own, "st_mode": 0o040000}, 0)
        with os.scandir(full) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                yield (entry.name, {"st_ino": st.st_ino, "st_mode": st.st_mode & 0o170000}, 0)

    def releasedir(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        self._check("fsyncdir", path)
        os.fsync(fh)
        return 0


def main(argv: list[str]) -> None:
    threads = "--threads" in argv
    args = [a for a in argv if a != "--threads"]
    backing, mountpoint, control, log = args
    os.umask(0)  # modes arrive already masked by the caller's umask
    _Fuse(
        FaultFS(backing, control, log),
        mountpoint,
        foreground=True,
        nothreads=not threads,
        fsname="faultfs",
        entry_timeout=0,
        attr_timeout=0,
        negative_timeout=0,
        use_ino=True,
        hard_remove=True,
        direct_io=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
