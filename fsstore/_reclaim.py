"""Judging a lock marker stale, and breaking it (:func:`reclaim`): for the waiters of
:mod:`fsstore._lock` and for ``fsstore gc``.

A marker is reclaimed when the recorded holder is on this host and dead; when it is
older than ``stale_lock_seconds`` whoever holds it (a holder on another host is judged
by age only, never by a local pid check) and the waiter has seen it unchanged for
half of that (a holder's lease), or for the whole of it whatever its mtime says; or
when it has no record and the waiter saw it unchanged for :data:`RECORDLESS_SECONDS`
(a file left by an older fsstore, or made by hand). Reclaiming is: rename the marker
aside, check that what moved is the marker judged (by a listing, which reaches the
server, where a lookup may answer from a client's cache), remove it; one a new holder
took meanwhile is put back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import secrets
import stat
import time
import typing
from collections.abc import Collection

from . import _fsio, _views
from ._errors import log
from ._records import host_name

Identity = tuple[int, int, int, bytes]  # a marker as a waiter sees it: inode, size, mtime (ns), content


@dataclasses.dataclass(frozen=True)
class Marker:
    """A lock file as found: who wrote it, when, and whether that holder is provably gone."""

    stat: os.stat_result
    pid: int | None
    host: str | None
    age: float  # seconds, by this host's clock against the storage's mtime
    text: bytes  # the holder's record as read (its first 4 KiB)

    @property
    def here(self) -> bool:
        """Recorded on this host (as filelock names it)."""
        return self.host == host_name()

    @property
    def dead_here(self) -> bool:
        """Recorded on this host by a process that no longer exists."""
        return self.pid is not None and self.here and not _alive(self.pid)


def read_marker(lock_path: str) -> Marker | None:
    """The marker at ``lock_path``; None if there is none (or it is not a regular file)."""
    try:
        st = os.lstat(lock_path)
        if not stat.S_ISREG(st.st_mode):
            return None
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            text = os.read(fd, 4096)
        finally:
            os.close(fd)
    except FileNotFoundError:  # released meanwhile
        return None
    lines = text.decode("utf-8", "replace").split("\n")
    pid = int(lines[0]) if lines[0].isdigit() else None
    host = lines[1] if len(lines) > 2 else None
    return Marker(st, pid, host, time.time() - st.st_mtime, text)


# A marker without its holder's record (filelock creates the file, then writes the
# record: a holder killed in between leaves it empty), unchanged for this long by the
# waiter's own clock, is taken for a dead holder's.
RECORDLESS_SECONDS = 0.5


Reclaimed = typing.Literal["broken", "gone", "not stale", "taken"]


def reclaim(
    lock_path: str, *, older_than: float, operation: str,
    watched: dict[str, tuple[Identity, float]] | None = None, mine: Collection[bytes] = (),
) -> Reclaimed | OSError:
    """Remove the marker at ``lock_path`` if :func:`_stale` judges it so, or if it is one
    of the waiter's own records ``mine`` (a waiter holds no marker: one linked to its
    record was put back by a reclaim after it was released, and its own touches before
    each try keep it young). ``"broken"``: the marker judged stale is gone; ``"gone"``:
    none was there (released meanwhile, or not a regular file); ``"not stale"``: as
    :func:`_stale` judges it now; ``"taken"``: another marker is there now (taken
    again); or the OSError that kept it from being read, listed or moved aside.

    Rename it aside, check that what was moved is the marker judged stale (same inode
    and mtime), remove it. A marker that a new holder took meanwhile is put back
    (``link`` refuses to replace a newer one still). A live holder here is never
    broken before ``older_than``; a holder on another host is judged by age only.
    Breaking a live holder that stalled between
    creating and writing it costs ordering at worst (see the module docstring).
    """
    try:
        marker = read_marker(lock_path)
    except OSError as exc:  # not ours to read: nothing we can judge
        return exc
    if marker is None:
        return "gone"
    ours = marker.text in mine
    why = "this waiter's own record, left at the lock name" if ours else _stale(
        marker, lock_path, older_than, watched)
    if why is None:
        return "not stale"
    before = marker.stat
    if not ours:
        try:
            said = listing_says(lock_path)
        except OSError as exc:
            return exc
        if said not in (CANNOT_TELL, before.st_ino):
            # This client's view of the name is old: another marker is there now, or none.
            return "gone" if said is None else "taken"
    aside = aside_name(lock_path)
    try:
        os.rename(lock_path, aside)
    except OSError as exc:  # someone else reclaimed or released it first?
        return "gone" if exc.errno in (errno.ENOENT, errno.ESTALE) else exc
    if ours:  # by content: where inode numbers go by name (sshfs), the moved one has another
        try:
            judged = content(aside) == marker.text
        except OSError as exc:  # gc took the moved name meanwhile (review 108): nothing is left
            return "gone" if exc.errno in (errno.ENOENT, errno.ESTALE) else exc
    else:
        judged = _moved(aside) == (before.st_ino, before.st_mtime_ns)
    if not judged:  # a new holder took the lock since we looked
        put_back(aside, lock_path)
        return "taken"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside)
    log.warning(
        "reclaimed a stale lock (%s)", ascii(why)[1:-1],
        extra={"code": "LOCK_RECLAIMED", "operation": operation, "path": lock_path},
    )
    return "broken"


def _moved(aside: str) -> tuple[int, int] | None:
    """The inode number and mtime of what a rename just moved to ``aside``, as the
    server has it (:func:`listing_says`); None if it cannot be looked at now (then it
    is put back, and judged again)."""
    try:
        said = listing_says(aside)
    except OSError:
        return None
    if said is None:
        return None
    try:
        st = os.lstat(aside)  # (after the listing: its attributes)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns) if said in (CANNOT_TELL, st.st_ino) else (said, 0)


CANNOT_TELL = -1


def listing_says(path: str) -> int | None:
    """The inode number a listing of ``path``'s directory (``.locks``) gives it, None if
    not listed, or :data:`CANNOT_TELL` where the mount's listings do not number inodes
    as its lookups do (sshfs: :func:`_views.listings_number_alike`) or this user may not
    list; OSError where it cannot be listed now (EIO, ESTALE: nothing to go by).

    A lookup may answer from the client's view of the name: a GlusterFS client that
    still saw a stuck holder's marker at the lock name judged it stale after another
    waiter had taken the lock, moved that waiter's live marker aside, and carried its
    view over to the new name (``lstat`` answered the stuck holder's inode), so the
    reclaim removed it; with three waiters, its put-back came too late. A listing
    reaches the server (review helper-92: two waiters on two hosts in the lock at
    once, 7 of 19 rounds; helper-93, 6 of 10 with three waiters).

    The store's root may itself be a symlink (the operator's choice, as for
    ``_store.SyncStore._open_root``); nothing below it is followed (review 106: opened
    with ``O_NOFOLLOW``, a symlinked root was never listed, so no marker but a waiter's
    own was ever reclaimed there, and a dead holder's blocked every writer for good)."""
    locks, name = os.path.split(path)
    root, locks_name = os.path.split(locks)
    try:
        rfd = os.open(root, (_fsio.PATH_FLAGS & ~os.O_NOFOLLOW))
        try:
            if not _views.listings_number_alike(rfd, locks_name):
                return CANNOT_TELL
            lfd = os.open(locks_name, _fsio.PATH_FLAGS, dir_fd=rfd)
            try:
                return _views.listed_ino(lfd, name)
            finally:
                os.close(lfd)
        finally:
            os.close(rfd)
    except PermissionError:
        return CANNOT_TELL


def aside_name(lock_path: str) -> str:
    """A name to move the marker at ``lock_path`` to, to look at it (``.stale-*``)."""
    return f"{lock_path}.stale-{os.getpid()}-{secrets.token_hex(8)}"


def put_back(aside: str, lock_path: str) -> None:
    """A live holder's marker, moved aside by mistake: back at the lock name. If yet
    another marker is there already (link refuses to replace it: EEXIST, or EPERM over
    SFTP, which has no EEXIST), the moved one stays where it is rather than replace a
    live holder's marker; ``fsstore gc`` removes ``.stale-*`` files once old."""
    try:
        os.link(aside, lock_path)
    except (FileExistsError, PermissionError, FileNotFoundError):  # (ENOENT: not ours to put back now)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside)


def _stale(marker: Marker, lock_path: str, older_than: float,
           watched: dict[str, tuple[Identity, float]] | None) -> str | None:
    """Why the marker at ``lock_path`` is stale, or None: its holder is provably dead on
    this host, or it is stale by ``watched``, the waiter's memory of the marker at each
    lock path (its identity: inode, size, mtime, content; since when seen so, on the
    monotonic clock, updated here): seen unchanged for :data:`RECORDLESS_SECONDS` where
    it has no record; else older than ``older_than`` seconds by its mtime and seen
    unchanged for half of that (the holder's lease: an honest holder has released by
    then, whatever the clocks say), or seen unchanged for ``older_than`` (a clock
    behind the storage's). Where mtimes are whole seconds (sshfs), holds of one record
    begun within one second look the same: a second more. Without ``watched`` (one
    look: ``fsstore gc``) its mtime alone, and never a holder alive on this host (a
    clock ahead makes every marker look old: review, stop 31)."""
    st = marker.stat
    now = time.monotonic()
    seen_for = 0.0
    if watched is not None:
        ident: Identity = (st.st_ino, st.st_size, st.st_mtime_ns, marker.text)
        before_ident, since = watched.get(lock_path, (None, now))
        if before_ident != ident:
            watched[lock_path] = (ident, since := now)
        seen_for = now - since
    grain = 1.0 if st.st_mtime_ns % 1_000_000_000 == 0 else 0.0
    if marker.dead_here:
        return f"holder pid {marker.pid} on this host is gone"
    if watched is None and marker.here and marker.pid is not None:
        return None  # one look, by a clock that may run ahead: a live holder here is its waiters' to judge
    if watched is not None and (marker.pid is None or marker.host is None):
        if seen_for < RECORDLESS_SECONDS:
            return None
        return f"no holder recorded, unchanged for {RECORDLESS_SECONDS:g}s"
    if (marker.age >= older_than and (watched is None or seen_for >= older_than / 2 + grain)) or (
            seen_for >= older_than + grain):
        return (f"holder pid {marker.pid} on {marker.host}, {marker.age:.0f}s old by its mtime, "
                f"seen unchanged for {seen_for:.1f}s")
    return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs here (a zombie, killed and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:  # no /proc, or gone meanwhile: the signal said it existed
        return True
    return state not in ([b"Z"], [b"X"])

def content(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)
