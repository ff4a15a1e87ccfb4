"""File-system primitives, all relative to directory descriptors.

Nothing here follows a symlink inside the store root: directories are opened one
component at a time with ``O_NOFOLLOW | O_DIRECTORY`` and files with ``O_NOFOLLOW``,
so a directory swapped for a symlink between two operations is refused
(``UNSAFE_PATH``) instead of being written through.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import itertools
import os
import secrets
import stat
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import FsStoreError, log, posix_code

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
# A directory held only to name things in it (``*at`` calls, fstat): no open on the
# server of a network mount. Listing it opens a handle of its own (:func:`listdir`).
PATH_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
KEY_FILE = ".key"
TEMP_PREFIX = ".tmp-"

# A symlink where a directory should be: O_NOFOLLOW gives ELOOP (or ENOTDIR with
# O_DIRECTORY on some kernels/filesystems).
_UNSAFE = (errno.ELOOP, errno.ENOTDIR)
# What a filesystem answers when it cannot fsync a directory.
_NO_DIR_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.ENOSYS}


def _read_umask() -> int:
    # os.umask() is the only portable read, but it briefly changes the process-wide
    # umask; /proc avoids that race on Linux.
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):  # not Linux, or an old kernel without the field
        pass
    old = os.umask(0o077)
    os.umask(old)
    return old


UMASK = _read_umask()


_temp_prefix = ""
_temp_count = itertools.count()


def _new_temp_prefix() -> None:
    global _temp_prefix
    _temp_prefix = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}-"


_new_temp_prefix()
_in_child: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def in_forked_child(obj: object, method: str) -> None:
    """Call ``obj.<method>()`` in a forked child, for as long as ``obj`` lives.

    A child forked from a process that used a store inherits its lock objects
    (filelock refuses them across a fork) and its held descriptors (the parent's
    open files): the objects that keep them start over there.
    """
    _in_child[obj] = method


def _after_fork_in_child() -> None:
    _new_temp_prefix()
    for obj, method in list(_in_child.items()):
        getattr(obj, method)()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def temp_name(tag: str = "") -> str:
    """A fresh temp-file name: never a part, never a key (it starts with '.').

    ``.tmp-<pid>-<random>-<counter>``: the pid and random part are drawn once per
    process (and again in a forked child), so naming a temp file costs no system
    call (``os.getpid()`` is one, glibc no longer caches it).
    """
    return f"{_temp_prefix}{next(_temp_count)}{tag}"


# openat2(2) (Linux >= 5.6) resolves a whole relative path in one call and refuses
# symlinks anywhere in it (RESOLVE_NO_SYMLINKS) and escapes (RESOLVE_BENEATH): the
# component-by-component walk below in one system call. Called through ctypes
# because the os module has no wrapper.
_SYS_OPENAT2 = (
    {"x86_64": 437, "aarch64": 437, "arm64": 437}.get(os.uname().machine)
    if sys.platform == "linux"
    else None
)
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x02, 0x04, 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_DIR_HOW = _OpenHow(
    os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC, 0,
    _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH,
)
_syscall: Any = None
_syncfs: Any = None  # syncfs(2): see sync_fs
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
    _syncfs = getattr(_libc, "syncfs", None)
except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
    _syscall = None


_O_PATH = getattr(os, "O_PATH", 0)
_PATH_HOW = _OpenHow(
    _O_PATH | os.O_NOFOLLOW | _CLOEXEC, 0,
    _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH,
)


_PATH_DIR_HOW = _OpenHow(
    _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC, 0,
    _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH,
)
_HOW_SIZE = ctypes.c_size_t(ctypes.sizeof(_OpenHow))


def _openat2_dir(base_fd: int, relpath: bytes, how: _OpenHow = _DIR_HOW) -> int:
    """fd of ``base/relpath`` resolved without symlinks; OSError as openat2 reports it."""
    fd = _syscall(_SYS_OPENAT2, base_fd, relpath, ctypes.byref(how), _HOW_SIZE)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)



class Fs:
    """Per-store settings and the one-way fallbacks it has learned about its mount."""

    def __init__(self, *, fsync: bool, dir_mode: int, file_mode: int) -> None:
        self.fsync = fsync
        self.dir_mode = dir_mode
        self.file_mode = file_mode
        self.dir_fsync_ok = True
        self.openat2_ok = _SYS_OPENAT2 is not None and _syscall is not None
        self.renameat2_ok = _renameat2 is not None
        self.link_ok = True  # turned off for good on a mount without hard links
        self._fchmod_files = (file_mode & ~UMASK) != file_mode
        self._fchmod_dirs = (dir_mode & ~UMASK) != dir_mode

    # -- directories -------------------------------------------------------------

    def open_dir(
        self,
        base_fd: int,
        components: Sequence[tuple[str, str | None]],
        *,
        create: bool,
        base_path: str,
        operation: str,
        path_only: bool = False,
    ) -> int | None:
        """Open ``base/c1/c2/...`` one component at a time; None if missing and not create.

        Each component is ``(name, original)``; ``original`` is the key part for
        hashed names, written to ``.key`` when the directory is created.
        ``path_only``: an ``O_PATH`` handle (:data:`PATH_FLAGS`), for ``*at`` calls,
        ``fstat`` and :func:`listdir` only.
        """
        flags = PATH_FLAGS if path_only else DIR_FLAGS
        if self.openat2_ok and components:
            rel = "/".join(name for name, _ in components)
            try:
                return _openat2_dir(base_fd, os.fsencode(rel), _PATH_DIR_HOW if path_only else _DIR_HOW)
            except OSError as exc:
                if exc.errno in (errno.ENOSYS, errno.E2BIG, errno.EPERM):
                    self.openat2_ok = False  # old kernel or seccomp filter: walk instead
                elif exc.errno in (*_UNSAFE, errno.EXDEV):
                    raise unsafe(f"{base_path}/{rel}", operation) from exc
                elif exc.errno != errno.ENOENT:
                    raise
                elif not create:
                    return None
                # Missing: the walk below creates what is missing (and re-checks).
        fd = os.dup(base_fd)
        path = base_path
        try:
            for name, original in components:
                path = f"{path}/{name}"
                try:
                    nfd = os.open(name, flags, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        return None
                    self.make_dir(fd, name, original)
                    nfd = os.open(name, flags, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in _UNSAFE:
                        raise unsafe(path, operation) from exc
                    raise
                fd, nfd = nfd, fd
                os.close(nfd)  # after the swap: an interrupt here never closes it twice
            out, fd = fd, -1
            return out
        finally:
            if fd >= 0:
                os.close(fd)

    def stat_beneath(self, base_fd: int, relpath: str) -> os.stat_result:
        """``lstat`` of ``base/relpath`` without following a symlink in any component.

        Raises FileNotFoundError, or NotADirectoryError / an ELOOP OSError where a
        component is not a real directory.
        """
        if self.openat2_ok and _O_PATH:
            try:
                fd = _openat2_dir(base_fd, os.fsencode(relpath), _PATH_HOW)
            except OSError as exc:
                if exc.errno not in (errno.ENOSYS, errno.E2BIG, errno.EPERM):
                    raise
                self.openat2_ok = False
            else:
                try:
                    return os.fstat(fd)
                finally:
                    os.close(fd)
        *dirs, last = relpath.split("/")
        fd = os.dup(base_fd)
        try:
            for name in dirs:
                nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
                fd, nfd = nfd, fd
                os.close(nfd)
            return os.stat(last, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)

    def make_dir(self, parent_fd: int, name: str, original: str | None) -> None:
        """Create a directory; hashed names appear atomically with their ``.key`` file."""
        if original is not None:
            if self.new_dir(parent_fd, name, original):
                self.sync_dir(parent_fd)
            return
        try:
            os.mkdir(name, self.dir_mode, dir_fd=parent_fd)
        except OSError as exc:
            if lost_race(exc, parent_fd, name):
                return  # another writer made it first
            raise
        self._fix_dir_mode(parent_fd, name)
        self.sync_dir(parent_fd)

    def new_dir(
        self, parent_fd: int, name: str, original: str | None,
        fill: Callable[[int], object] | None = None,
    ) -> bool:
        """Publish ``parent/name`` with its content: made as ``tmp/tmp`` (``tmp`` a temp
        name in ``parent``), given its ``.key`` (hashed names) and whatever ``fill`` writes
        into it, then renamed into place. False (nothing left behind) if ``name`` exists
        already. The caller fsyncs ``parent`` (``sync_dir``) once it may: the rename
        is a commit point for some callers, after which a failure must not be raised
        as if nothing was published.

        rename() would replace an *empty* directory, but a directory published this
        way is never empty, so a racing creator gets EEXIST/ENOTEMPTY and uses the
        winner's directory. It is never under a name a listing of ``parent`` shows: a
        GlusterFS brick that handles another client's listing (READDIRP) after the
        rename links the directory under the name the listing showed, and then answers
        ESTALE for it to every client until that gone name is looked up (gluster#1411).
        ``fsstore gc`` takes both names of an old one off before emptying it: this
        writer, stalled, then fails its rename and starts over.
        """
        tmp = temp_name("-dir")
        os.mkdir(tmp, self.dir_mode, dir_fd=parent_fd)
        try:
            sfd = os.open(tmp, PATH_FLAGS, dir_fd=parent_fd)
            try:
                os.mkdir(tmp, self.dir_mode, dir_fd=sfd)
                self._fix_dir_mode(sfd, tmp)
                tfd = os.open(tmp, DIR_FLAGS, dir_fd=sfd)
                try:
                    if original is not None:
                        self.write_new(tfd, KEY_FILE, original.encode("utf-8"))
                    if fill is not None:
                        fill(tfd)
                    self.sync_dir(tfd)
                finally:
                    os.close(tfd)
                os.rename(tmp, name, src_dir_fd=sfd, dst_dir_fd=parent_fd)
            finally:
                os.close(sfd)
        except OSError as exc:
            if not lost_race(exc, parent_fd, name):
                raise
            return False
        finally:
            with contextlib.suppress(OSError):  # else an orphaned temp directory: gc's
                try:
                    os.rmdir(tmp, dir_fd=parent_fd)  # empty once published
                except OSError:
                    remove_tree(parent_fd, tmp)
        return True

    def fix_mode(self, fd: int) -> None:
        """Give a directory this store's mode where the umask narrowed it."""
        if self._fchmod_dirs:
            os.fchmod(fd, self.dir_mode)

    def _fix_dir_mode(self, parent_fd: int, name: str) -> None:
        if self._fchmod_dirs:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
            try:
                os.fchmod(fd, self.dir_mode)
            finally:
                os.close(fd)

    def mark(self, dir_fd: int, name: str) -> None:
        """Create the empty file ``name`` (a marker) unless it exists."""
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC,
                         self.file_mode, dir_fd=dir_fd)
        except FileExistsError:
            return
        except PermissionError:  # SFTP (sshfs) answers a lost O_EXCL race so
            if exists(dir_fd, name):
                return
            raise
        os.close(fd)

    def subdirs_beneath(self, base_fd: int, names: list[str], base_path: str, operation: str) -> list[str]:
        """Names of the directories in ``base/names...`` (none if it does not exist, or is
        gone by its listing: sshfs goes by path); no symlink followed."""
        fd = self.open_dir(base_fd, [(n, None) for n in names], create=False,
                           base_path=base_path, operation=operation)
        if fd is None:
            return []
        try:
            with os.scandir(fd) as it:
                return [e.name for e in it if is_dir_entry(e)]
        except FileNotFoundError:
            return []
        finally:
            os.close(fd)

    def sync_dir(self, fd: int, *, always: bool = False) -> None:
        """fsync a directory if fsync is on (or ``always``); degrade once, loudly, where
        the mount refuses. ``fd`` may be an ``O_PATH`` handle: the fsync goes through a
        handle of its own."""
        if not ((self.fsync or always) and self.dir_fsync_ok):
            return
        try:
            own = os.open(".", DIR_FLAGS, dir_fd=fd)
            try:
                os.fsync(own)
            finally:
                os.close(own)
        except OSError as exc:
            if exc.errno not in _NO_DIR_FSYNC:
                raise
            self.dir_fsync_ok = False
            if not self.fsync:
                return  # (compaction's own fsync, ``always``: not what the user turned on)
            log.warning(
                "directory fsync is not supported on this mount (%s); continuing with file "
                "fsync only",
                posix_code(exc.errno),
                extra={"code": "DIR_FSYNC_UNSUPPORTED", "operation": "fsync", "path": None},
            )

    # -- files -------------------------------------------------------------------

    def write_new(self, dir_fd: int, name: str, data: bytes, *, sync: bool | None = None) -> None:
        """Create ``name`` (must not exist), write ``data``, fsync if on (or ``sync``);
        no file on failure."""
        fd = os.open(name, CREATE_FLAGS, self.file_mode, dir_fd=dir_fd)
        try:
            if self._fchmod_files:
                os.fchmod(fd, self.file_mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync if sync is None else sync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            unlink_quiet(dir_fd, name)
            raise
        os.close(fd)


def unlink_quiet(dir_fd: int, name: str) -> None:
    """Remove a file we own; a file already gone is fine (a cleanup, not a commit)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


# -- the no-replace move -------------------------------------------------------

_RENAME_NOREPLACE = 1
_renameat2: Any = None
try:
    _renameat2 = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int
except (OSError, AttributeError):  # no glibc >= 2.28 (musl, macOS): link()+unlink() only
    _renameat2 = None


def link_noreplace(fs: Fs, dir_fd: int, src: str, dst: str) -> bool | None:
    """Give the file ``src`` the second name ``dst`` unless ``dst`` exists.

    True when linked (``src`` stays: a commit can still move its batch elsewhere);
    None when ``dst`` exists. Where the mount has no hard links it moves instead
    (:func:`move_noreplace`) and returns False: ``src`` is gone then.
    """
    if fs.link_ok:
        try:
            os.link(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            return True
        except FileExistsError:
            # On NFS a retransmitted LINK whose first reply was lost answers EEXIST
            # for a link that did happen: it is ours if dst is the same inode as src.
            return True if _same_inode(dir_fd, src, dst) else None
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise
            refused = _refused_link(exc, dir_fd, src, dst)
            if refused is not False:
                return refused
            fs.link_ok = False  # a mount without hard links: moves from now on
    return False if move_noreplace(fs, dir_fd, src, dst) else None


def move_noreplace(fs: Fs, dir_fd: int, src: str, dst: str) -> bool:
    """Move ``src`` to ``dst`` in one directory unless ``dst`` exists.

    True when moved; False when ``dst`` already exists (``src`` is then untouched).
    Uses renameat2(RENAME_NOREPLACE) where the filesystem has it, else
    link()+unlink(); both refuse to replace, which is what keeps committed parts safe
    even when two writers both believe they hold the lock.
    """
    if fs.renameat2_ok and _renameat2 is not None:
        if _renameat2(dir_fd, os.fsencode(src), dir_fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            return False
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), dst)
        fs.renameat2_ok = False  # NFS and many FUSE filesystems: link() from now on
    try:
        os.link(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        # On NFS a retransmitted LINK whose first reply was lost answers EEXIST for a
        # link that did happen (open(2) gives the same advice for O_EXCL): it is ours
        # if dst is the same inode as src.
        if not _same_inode(dir_fd, src, dst):
            return False
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
        refused = _refused_link(exc, dir_fd, src, dst)
        if refused is None:
            return False
        if refused is False:  # no RENAME_NOREPLACE, no hard links (rclone: EIO)
            raise unsupported_fs(exc, _dir_path(dir_fd, dst)) from exc
    try:
        os.unlink(src, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        # The batch is committed under dst already; the temp name is only a second
        # link to it, garbage for `fsstore gc`. Raising now would make the caller
        # retry a committed batch.
        log.warning("temp link left after commit: %s", exc, extra={
            "code": "TEMP_LEFT", "operation": "append", "path": src})
    return True


#: link() errors of a mount without hard links (after RENAME_NOREPLACE was refused)
_NO_LINK = {errno.EPERM, errno.EIO, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


def unsupported_fs(exc: OSError, path: str) -> FsStoreError:
    name = posix_code(exc.errno)
    return FsStoreError(
        "UNSUPPORTED_FS",
        f"this mount cannot host a store: it refuses renameat2(RENAME_NOREPLACE) and "
        f"link() ({name}: {exc.strerror}), so nothing can be committed without replacing",
        operation="append", path=path, errno=exc.errno,
    )


def _refused_link(exc: OSError, dir_fd: int, src: str, dst: str) -> bool | None:
    """What ``link(src, dst)`` refused with ``exc`` (one of :data:`_NO_LINK`) means.

    SFTP v3 (sshfs) has no EEXIST: a link onto a name that exists is EPERM there, and
    under contention the name can be gone again by the time we look (a lock released,
    a part merged by a compaction). True: ``dst`` is ``src`` already; None: ``dst`` was
    taken (it is there, or the refusal was EPERM and this process can link ``src`` to
    another name here, so it was about the name); False: this mount makes no hard
    links. Raises ``exc`` where links work and this one failed otherwise (EIO).
    """
    if exists(dir_fd, dst):
        return True if _same_inode(dir_fd, src, dst) else None
    probe = temp_name("-probe")
    try:
        os.link(src, probe, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except OSError as probe_exc:
        if probe_exc.errno in _NO_LINK:
            return False
        raise exc from probe_exc
    with contextlib.suppress(OSError):
        os.unlink(probe, dir_fd=dir_fd)
    if exc.errno == errno.EPERM:
        return None
    raise exc  # links work here: a real error of this one (EIO)


def _dir_path(dir_fd: int, name: str) -> str:
    try:
        return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)
    except OSError:
        return name


def lost_race(exc: OSError, dir_fd: int | None, name: str) -> bool:
    """Whether a create of ``name`` (mkdir, ``O_EXCL`` open, rename into place) that failed
    with ``exc`` lost to another creator: ``EEXIST``, or, since SFTP v3 (sshfs) has no
    EEXIST, a permission error with the name there now (another client made it between
    this client's lookup and its request)."""
    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
        return True
    if exc.errno not in (errno.EPERM, errno.EACCES):
        return False
    if dir_fd is None:
        return os.path.lexists(name)
    return exists(dir_fd, name)


def exists(dir_fd: int, name: str) -> bool:
    """Whether ``name`` is there (a symlink counts; nothing followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _same_inode(dir_fd: int, a: str, b: str) -> bool:
    try:
        sa = os.stat(a, dir_fd=dir_fd, follow_symlinks=False)
        sb = os.stat(b, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (sa.st_ino, sa.st_dev) == (sb.st_ino, sb.st_dev)


def remove_tree(parent_fd: int, name: str, mark: str | None = None) -> None:
    """Remove ``parent/name`` and everything below, never following symlinks (a file
    or a symlink at ``name``: the link itself). ``mark``: a directory that held a file
    of that name gets it back when its ``rmdir`` finds a file made after the mark went,
    before ENOTEMPTY is raised (a writer that still reaches a deleted transcript then
    sees the mark in its check)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno in _UNSAFE:
            unlink_quiet(parent_fd, name)
            return
        raise
    try:
        marked = False
        with os.scandir(fd) as entries:  # its own descriptor: closed on an error too
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    remove_tree(fd, entry.name, mark)
                else:
                    marked = marked or entry.name == mark
                    unlink_quiet(fd, entry.name)
        try:
            os.rmdir(name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if marked and mark and exc.errno == errno.ENOTEMPTY:
                with contextlib.suppress(FileExistsError):
                    os.close(os.open(mark, CREATE_FLAGS, 0o644, dir_fd=fd))
            raise
    finally:
        os.close(fd)


def sync_fs(fd: int) -> None:
    """Write back everything of the file system the directory ``fd`` is on
    (``syncfs``; ``sync`` where libc has none): what was written without fsync
    survives a power loss from here on. For the few steps that drop (or mark done) a
    batch's only other copy once theirs is written (a merge back, an import's report)."""
    own = os.open(".", DIR_FLAGS, dir_fd=fd)
    try:
        if _syncfs is None:  # pragma: no cover - not glibc/musl
            os.sync()
        elif _syncfs(own) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}")
    finally:
        os.close(own)


def listdir(dir_fd: int, path: str = ".") -> list[str]:
    """The names in the directory open as ``dir_fd`` (or at ``path`` from it), through
    a handle of its own.

    ``os.listdir(fd)`` reads through a duplicate of ``fd``, whose offset it then
    rewinds; sshfs without a directory cache cannot seek a directory back, so a
    second listing through one descriptor came back empty there (a transcript read
    as changing forever: EAGAIN).
    """
    fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def empty_tree(parent_fd: int, name: str, keep: str) -> bool:
    """Remove everything below ``parent/name`` but the files named ``keep`` (and the
    directories that hold one), never following symlinks; True if something was kept."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return False
    kept = False
    try:
        with os.scandir(fd) as entries:  # its own descriptor: closed on an error too
            for entry in entries:
                if entry.name == keep and not entry.is_dir(follow_symlinks=False):
                    kept = True
                elif entry.is_dir(follow_symlinks=False):
                    if empty_tree(fd, entry.name, keep):
                        kept = True
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            os.rmdir(entry.name, dir_fd=fd)
                else:
                    unlink_quiet(fd, entry.name)
    finally:
        os.close(fd)
    return kept


def is_dir_entry(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:  # vanished between readdir and stat: not there any more
        return False


def same_dir(fd: int, parent_fd: int, components: Sequence[str]) -> bool:
    """Whether ``parent/components...`` still names the directory open as ``fd``."""
    try:
        st = os.stat("/".join(components), dir_fd=parent_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return False
    own = os.fstat(fd)
    return stat.S_ISDIR(st.st_mode) and (st.st_ino, st.st_dev) == (own.st_ino, own.st_dev)


def unsafe(path: str, operation: str) -> FsStoreError:
    return FsStoreError("UNSAFE_PATH", "expected a directory, found a symlink or another kind of "
                        "file; refusing to follow it", operation=operation, path=path, errno=errno.ELOOP)
