"""A network client's view of a directory against the server's.

Local disks have one view. A network client answers lookups, and sometimes
listings, from its caches: sshfs keeps names and listings 20 s by default; a
GlusterFS client keeps resolving a name to the directory it last knew there while
that directory is in use. A listing (GlusterFS) or a change made in a directory
(sshfs) reaches the server. Used where a stale view would move, mark or number the
wrong thing: deletes (:mod:`fsstore._delete`) and a writer's numbering and
recreation (:mod:`fsstore._commit`).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import TypeVar

from ._fsio import CREATE_FLAGS, DIR_FLAGS, PATH_FLAGS, READ_FLAGS, temp_name, unlink_quiet
from ._layout import PROJECTS, Component

T = TypeVar("T")

STALE_VIEW_PAUSE = 1.1  # s: a GlusterFS client's cached lookups (1 s) lapse unused


def refresh_listing(dir_fd: int) -> bool:
    """Make the client list the directory afresh; False if it is gone on the server.

    Creating and removing a name in a directory is a change this client made, so
    its own caches of that directory go: sshfs's 20 s directory cache otherwise
    keeps listing files another host compacted or deleted. ENOENT/ESTALE: the
    directory no longer exists there. A mount this process may not write to tells
    nothing (True).
    """
    name = temp_name("-probe")
    try:
        os.close(os.open(name, CREATE_FLAGS, 0o600, dir_fd=dir_fd))
    except OSError as exc:
        return exc.errno not in (errno.ENOENT, errno.ESTALE)
    unlink_quiet(dir_fd, name)
    return True


def server_clock_offset(dir_fd: int, *, inside: str | None = None) -> float:
    """How far the file server's clock is ahead of this host's (negative: behind), in
    seconds: the mtime it gives a file made in ``dir_fd`` (``.tmp-…-probe``, removed at
    once), or where that cannot be (a root this user may not write in, made immutable),
    in its directory ``inside``, against this host's clock around it. 0 where none can be
    made (a read-only mount: this host's clock it is), or where within a second."""
    name = temp_name("-probe")
    before = time.time()
    try:
        fd = os.open(name, CREATE_FLAGS, 0o600, dir_fd=dir_fd)
    except OSError:
        if inside is None:
            return 0.0
        try:
            sub = os.open(inside, DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            return 0.0
        try:
            return server_clock_offset(sub)
        finally:
            os.close(sub)
    try:
        made = os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        unlink_quiet(dir_fd, name)
    offset = made - (before + time.time()) / 2
    return offset if abs(offset) > 1.0 else 0.0


def forgot_stale_name(dir_fd: int, name: str) -> bool:
    """Whether ``name`` (a link to it was refused: EEXIST) was there for this client
    only, and is forgotten now: an open of it that the server answers ENOENT makes a
    FUSE client drop the name (sshfs keeps names another host removed; a link onto
    one is refused by this client's kernel, never asked of the server)."""
    try:
        os.close(os.open(name, READ_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd))
    except FileNotFoundError:
        return True
    except OSError:
        pass  # there, of some other kind, or not ours to open: taken
    return False


def forgot_stale_dir(parent: int, name: str) -> bool:
    """Whether this client has dropped ``name``, a directory another host moved away,
    so that a rename to that name can go through: a GlusterFS client that knew the
    directory there keeps resolving the name to it (see :func:`listed_dir`) and
    refuses (ESTALE) to rename it back to the name from where it is now. An ``rmdir``
    of the name, which the server answers ENOENT, makes the client drop it. Only where
    the server lists nothing there: an empty directory made at the name since would
    go, as a rename onto it would replace it."""
    if listed_ino(parent, name) is not None:
        return False
    try:
        os.rmdir(name, dir_fd=parent)
    except OSError:
        pass  # ENOENT: dropped
    return True


def rename_onto(parent: int, name: str, rename: Callable[[], T]) -> T:
    """``rename()``, a rename onto ``parent/name``, this client's name for a directory
    another host moved away from there dropped first (:func:`forgot_stale_dir`): to
    the client's kernel a rename onto it replaces that directory, which it then takes
    for destroyed wherever it is now (empty listings, ENOENT lookups in it, for as long
    as anything keeps it cached: review 117, a GlusterFS client; a session a delete had
    moved by mistake looked empty there, its batches in no load of that host, and a
    delete there deleted nothing). Once more after ESTALE, where the client kept it."""
    forgot_stale_dir(parent, name)
    try:
        return rename()
    except OSError as exc:
        if exc.errno != errno.ESTALE or not forgot_stale_dir(parent, name):
            raise
    return rename()


def listed_ino(parent: int, name: str) -> int | None:
    """The inode number a listing of ``parent`` gives ``name`` (None: not listed)."""
    fd = os.open(".", DIR_FLAGS, dir_fd=parent)
    try:
        with os.scandir(fd) as it:
            return next((e.inode() for e in it if e.name == name), None)
    finally:
        os.close(fd)


def looked_up_ino(parent: int, name: str) -> int | None:
    """``name``'s inode number as a lookup gives it (None: not there)."""
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False).st_ino
    except FileNotFoundError:
        return None


_NUMBERED: dict[int, bool] = {}  # by device (a mount): see listings_number_alike


def forget_mounts() -> None:
    """Forget what :func:`listings_number_alike` learned: device numbers without a block
    device are reused by the next mount, of any type (a store object made clears it)."""
    _NUMBERED.clear()


def listings_number_alike(parent: int, name: str) -> bool:
    """Whether the mount ``parent`` is on gives in its listings the inode numbers its
    lookups give: true on local disks, NFS and GlusterFS; not on sshfs or overlayfs.
    Learned once per mount (its device number) from ``parent/name``, a directory that
    is never replaced (the store's ``projects``, or ``.locks``)."""
    dev = os.fstat(parent).st_dev
    known = _NUMBERED.get(dev)
    if known is None:
        listed, looked = listed_ino(parent, name), looked_up_ino(parent, name)
        if listed is None or looked is None:
            return False  # nothing to learn from yet
        known = _NUMBERED[dev] = listed == looked
    return known


def gone_on_server(root_fd: int, parent: int, name: str, fd: int) -> bool:
    """Whether the directory ``fd`` that ``parent/name`` opened here is no longer what the
    server has at that name: gone there (a name created in it fails: sshfs's cached
    names), or, where listings can tell, another directory or none is listed there
    (GlusterFS's lookups, see listed_dir)."""
    if not refresh_listing(fd):
        return True
    return listings_number_alike(root_fd, PROJECTS) and listed_ino(parent, name) != os.fstat(fd).st_ino


def gone_level(
    root_fd: int, comps: list[Component], only: tuple[int, ...] | None = None,
) -> tuple[int, int]:
    """Walk ``comps`` from the store's root: the index of the first directory of the
    path (of those at the indexes ``only``, if given) that is gone on the server while
    its name still opens here (``len(comps)``: none is; see :func:`gone_on_server`), and
    a descriptor, the caller's to close, of the directory holding it (of the whole path
    where none is gone)."""
    fd = os.dup(root_fd)
    try:
        for i, (name, _original) in enumerate(comps):
            nfd = os.open(name, PATH_FLAGS, dir_fd=fd)
            if (only is None or i in only) and gone_on_server(root_fd, fd, name, nfd):
                os.close(nfd)
                return i, fd
            fd, nfd = nfd, fd
            os.close(nfd)
    except BaseException:
        os.close(fd)
        raise
    return len(comps), fd


def at_its_name(root_fd: int, comps: list[Component], fd: int, moved: tuple[int, ...]) -> bool:
    """Whether the directory ``fd`` is still the one the path ``comps`` names on the
    server, the directories of the path that can be moved away (at the indexes
    ``moved``) judged as :func:`gone_level` does. ``fd`` answering ESTALE (removed on
    the server: review 104, a GlusterFS pair) is not."""
    try:
        i, found = gone_level(root_fd, comps, moved)
        try:
            return i == len(comps) and os.path.samestat(os.fstat(found), os.fstat(fd))
        finally:
            os.close(found)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ESTALE):
            return False
        raise


def listed_dir(root_fd: int, parent: int, name: str, *, wait: bool) -> int | None:
    """The inode of the directory at ``parent/name`` as the server has it, once this
    client's lookups agree with it; None if not listed; 0 where the mount's listings
    cannot tell (their inode numbers are not the lookups': sshfs, overlayfs).

    A listing reaches the server; a lookup by name may not. A GlusterFS client keeps
    resolving a name to the directory it last knew there (md-cache answers from its
    own table for as long as that directory is in use), even after another host
    moved it away and made a new one: a rename then moves what the server has, not
    what the lookups showed. A lookup that disagrees is, with ``wait``, looked at
    again for about a second (the cache lapses within about a second unused); ESTALE
    if it keeps disagreeing.
    ``root_fd``: the store's root (see listings_number_alike)."""
    if not listings_number_alike(root_fd, PROJECTS):
        return 0
    for attempt in range(6 if wait else 1):
        if attempt:
            time.sleep(0.05 * attempt)
        listed = listed_ino(parent, name)
        if listed is None or listed == looked_up_ino(parent, name):
            return listed
    raise OSError(errno.ESTALE, "this client keeps resolving the name to another directory "
                  "than the server lists", name)
