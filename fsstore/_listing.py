"""Listing a project's sessions or a session's subagent transcripts: the children of
one directory that are keys' names, and the mtime of each one's transcript directory
(the time of its last commit). Used by ``list_sessions``, ``list_subkeys`` and
``list_session_summaries`` (:func:`children`); the latter's summaries
(:func:`summaries`)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from . import _compact, _delete, _fsio, _keys, _layout, _read, _summaries, _views
from ._errors import FsStoreError, log, posix_code, translating
from ._layout import Component
from ._transcript import (
    READ_ATTEMPTS,
    UNLOCKED_READS,
    State,
    parse,
    read_state,
    settled_mtime,
    snapshot,
    summary_stamp,
)

if TYPE_CHECKING:
    from ._store import SyncStore


def scan_children(pfd: int) -> tuple[list[tuple[str, str]], list[str]]:
    """``(name, decoded key part)`` of each directory in ``pfd``, and the records deletes
    in flight left there (:func:`_delete.moving_record`)."""
    children: list[tuple[str, str]] = []
    moving: list[str] = []
    # decode_entry's common case inline: this loop runs once per session each time
    # the SDK lists a project.
    own, is_dir, add = _keys.is_own_name, _fsio.is_dir_entry, children.append
    with os.scandir(pfd) as it:
        for entry in it:
            name = entry.name
            if own(name):
                if is_dir(entry):
                    add((name, name))
            elif name.startswith(_fsio.TEMP_PREFIX) and name.endswith(_delete.MOVING_TAG):
                moving.append(name)  # (a key's name never starts with ".")
            elif (part := _layout.decode_entry(pfd, entry)) is not None:
                add((name, part))
    return children, moving


def transcript_mtimes(
    parent_fd: int, children: list[tuple[str, str]], below: str | None, where: str, op: str,
    moved_back: Callable[[], bool],
) -> Iterator[tuple[str, int]]:
    """``(key part, mtime in epoch ms)`` of each child's transcript directory:
    ``parent/name``, or ``parent/name/below``; a child gone since the listing is looked
    at again after ``moved_back`` (see :func:`probe`).

    A commit links a file into that directory, so its mtime is the time of the
    last commit (or compaction) by the storage's own clock; the summary uses
    the same stat. Plain system calls, none of which follows a symlink: one
    ``stat`` of the child (``AT_SYMLINK_NOFOLLOW``), or an ``O_PATH`` open of the
    child (``O_NOFOLLOW``), a ``stat`` of ``below`` in it and a ``close``: this runs
    over every session of a project each time the SDK lists them.
    """
    def stat_of(name: str) -> os.stat_result | None:
        if below is None:
            return os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        fd = os.open(name, _fsio.PATH_FLAGS, dir_fd=parent_fd)
        try:
            return os.stat(below, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None  # a session without a main transcript (subagents only)
        finally:
            os.close(fd)

    for name, part in children:
        st = probe(stat_of, name, op, f"{where}/{name}", moved_back)
        if st is not None and stat.S_ISDIR(st.st_mode):
            yield part, st.st_mtime_ns // 1_000_000


_T = TypeVar("_T")


#: How many times a listing moves back what records of deletes in flight name and
#: reads the directory (or looks at a child) again while records remain: a stalled
#: delete's move can come between its move-back attempt and its next read.
MOVE_BACK_ROUNDS = 3


def probe(look: Callable[[str], _T | None], name: str, op: str, path: str,
          moved_back: Callable[[], bool]) -> _T | None:
    """``look(name)`` for a child of a listing; None where it says so, or where it
    fails (logged where :func:`left_out` says). ENOENT (ESTALE on a network mount) from
    ``look`` means the child is gone: a delete whose lock was overtaken (stalled past
    its lease) may have moved it into ``.trash`` by mistake after the listing, its
    record in the parent only since. So ``moved_back`` is called (it reads the parent
    again, which also refreshes a GlusterFS client's view of it, moves back what
    records there name, and says whether there were any) and, where there were, the
    child is looked at again, up to :data:`MOVE_BACK_ROUNDS` times: moved back by this
    call or, first, by another listing, a load or the deleter (found by review: a
    session made anew left out of listings while a stalled delete had it)."""
    for look_no in range(MOVE_BACK_ROUNDS + 1):
        try:
            return look(name)
        except OSError as exc:
            if (exc.errno not in (errno.ENOENT, errno.ESTALE) or look_no == MOVE_BACK_ROUNDS
                    or not moved_back()):
                left_out(exc, op, path)
                return None
    return None  # (not reached: the last look returns above)


def left_out(exc: OSError, op: str, path: str) -> None:
    """A child a listing leaves out, for ``exc``: one transcript this process may not
    read must not hide the others. Logged, except where nothing is wrong: a symlink
    inside the transcript path is not ours to report (ELOOP, ENOTDIR; EXDEV: a rename
    racing the open), and a session without a main transcript (only subagents, or
    removed meanwhile) has none (ENOENT)."""
    err = exc.errno or errno.EIO
    if err not in (errno.ELOOP, errno.EXDEV, errno.ENOENT, errno.ENOTDIR):
        log.warning("left out of the listing: %s", os.strerror(err), extra={
            "code": posix_code(err), "operation": op, "path": path, "errno": err})


@contextlib.contextmanager
def children(store: SyncStore, comps: list[Component], op: str
             ) -> Iterator[tuple[int, list[tuple[str, str]], Callable[[], bool]]]:
    """The directory under ``comps`` (fd), ``(name, decoded key part)`` of each
    directory in it (none if it does not exist, or no longer: removed after it was
    opened), and what to call where a child is gone when looked at (:func:`probe`):
    it reads the directory again, moves back what records of deletes in flight there
    name, and says whether there were any (a session's ``subkeys/`` itself gone: it
    moves the session back and opens it again)."""
    session_main = [*comps[:4], (_layout.MAIN, None)]  # (where comps is a session's subkeys/)
    with store._open_root(create=False) as rfd:
        pfd = store._open(rfd, comps, op) if rfd is not None else None
        if pfd is None and rfd is not None and len(comps) > 4 and not store._exists(rfd, comps[:4]):
            # The session, moved into .trash by a delete that stalled or died: back, as a
            # load would move it (its record is in sessions/, which this does not list),
            # here or by whoever got there first (review: another listing).
            _delete.restore(store, rfd, session_main, listing=True)
            pfd = store._open(rfd, comps, op)
        if rfd is None or pfd is None:
            yield -1, [], lambda: False
            return

        def rescan() -> tuple[list[tuple[str, str]], list[str]]:
            # A handle of its own: sshfs lists nothing through one that listed to its end.
            fd = os.open(".", _fsio.DIR_FLAGS, dir_fd=pfd)
            try:
                return scan_children(fd)
            finally:
                os.close(fd)

        try:
            try:
                children, moving = scan_children(pfd)
                for _round in range(MOVE_BACK_ROUNDS):
                    if not moving:
                        break
                    # With what a delete hid by mistake, moved back by us or another;
                    # again while records remain: its move can come in between. Every
                    # read's children are kept: one gone when looked at is moved back
                    # then (probe), where the rounds ran out before the move landed.
                    _delete.restore_named(store, rfd, pfd, comps, moving)
                    again, moving = rescan()
                    known = {name for name, _part in children}
                    children += [child for child in again if child[0] not in known]
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ESTALE):
                    raise
                # Removed since it was opened (a delete): a FUSE or NFS client says
                # so where a local disk reads an empty directory (found by review).
                children = []

            def moved_back() -> bool:
                try:
                    records = rescan()[1]
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ESTALE) or len(comps) <= 4:
                        return False
                    return session_back()
                if records:
                    _delete.restore_named(store, rfd, pfd, comps, records)
                return bool(records)

            def session_back() -> bool:
                # A session's subkeys/ gone where handles go by path (sshfs, bindfs):
                # the session may have been moved since it was read, and such a handle
                # stays dead once it is back. Moved back (here, or first by another
                # listing, a load) and opened again at its name, as pfd.
                try:
                    _delete.restore(store, rfd, session_main, listing=True)
                    fd = store._open(rfd, comps, op)
                except (OSError, FsStoreError):  # left out, as a look that fails
                    return False
                if fd is None:
                    return False
                os.dup2(fd, pfd, inheritable=False)
                os.close(fd)
                return True

            yield pfd, children, moved_back
        finally:
            os.close(pfd)


# How long one listing of summaries waits, in all, for the clock to pass the mtimes of
# sessions changed just before (settled_mtime; a second where mtimes are whole seconds).
_SETTLE_SECONDS = 1.5


def summaries(store: SyncStore, project_key: str) -> list[dict[str, Any]]:
    """:meth:`SyncStore.list_session_summaries`."""
    op = "list_session_summaries"
    _keys.check_part(project_key, "project_key", op)
    comps = _layout.project_dirs(project_key)
    out: list[dict[str, Any]] = []
    fold = store._fold  # the SDK's first import, if it comes now: never under a lock
    deadline = time.monotonic() + _SETTLE_SECONDS  # the whole listing's (see settled_mtime)
    with translating(op, store._path(comps)), children(store, comps, op) as (pfd, sessions, moved_back):

        def open_main(name: str) -> int | None:  # as list_sessions probes a session
            sfd = os.open(name, _fsio.PATH_FLAGS, dir_fd=pfd)
            try:
                return os.open(_layout.MAIN, _fsio.DIR_FLAGS, dir_fd=sfd)
            except FileNotFoundError:
                return None  # subagent transcripts only
            finally:
                os.close(sfd)

        for name, session_id in sessions:
            mfd = probe(open_main, name, op, f"{store._path(comps)}/{name}", moved_back)
            if mfd is None:
                continue
            try:
                path = f"{store._path(comps)}/{name}/{_layout.MAIN}"
                key = {"project_key": project_key, "session_id": session_id}
                summary, stamp = _fresh_summary(store, mfd, path, key, fold, deadline)
            finally:
                os.close(mfd)
            if summary is not None:
                out.append({**summary, "session_id": session_id, "mtime": stamp})
    return out

def _fresh_summary(store: SyncStore, mfd: int, path: str, key: dict[str, str], fold: _summaries.Fold | None,
                   deadline: float) -> tuple[dict[str, Any] | None, int]:
    """The summary of every part committed before its mtime (the stat comes first,
    :func:`settled_mtime`), and its stamp (ms, :func:`summary_stamp`): the sidecar a
    compaction left plus the parts after it, of a chain listed and read as a load
    does it (:func:`snapshot`; its retries, and its lock); None if it cannot be had
    now (the SDK then rebuilds it through load())."""
    problem = f"no whole listing in {READ_ATTEMPTS} reads (compactions racing)"
    with contextlib.ExitStack() as guard:
        for attempt in range(READ_ATTEMPTS):
            if attempt and not _views.refresh_listing(mfd):  # as a load: a client may list
                return None, 0  # from a cache (sshfs); gone on the server: deleted
            if attempt == UNLOCKED_READS and not store._hold_for_reading(
                    guard, _layout.transcript_dirs(_keys.parse_key(key, "list_session_summaries"))):
                break
            try:
                stamp = summary_stamp(*settled_mtime(mfd, deadline))
                state = read_state(mfd) or State()
                seen = snapshot(mfd, path, "list_session_summaries", read=False)
                chain = seen.chain
                if seen.deleted is not None or not chain:
                    return None, 0
                if seen.race is not None:
                    continue  # a listing torn by a compaction
                if seen.gap is not None:  # in the transcript: the listings agree
                    problem = f"part {seen.gap} is missing (see fsstore check)"
                    break
                if state.summary is not None and state.folded == chain[-1][1]:
                    return state.summary, stamp
                if fold is None:
                    return None, 0
                return _compact.fold_chain((fold, key), state, chain, lambda name: parse(
                    _read.read_file(mfd, name), f"{path}/{name}", "summary"))[0], stamp
            except OSError as exc:  # a compaction removed a part after the listing, or
                if exc.errno not in (errno.ENOENT, errno.ESTALE):  # another host replaced
                    raise  # state.json (ESTALE: GlusterFS, NFS)
            except FsStoreError as exc:
                problem = str(exc)
                break
    log.warning("summary left out: %s", problem, extra={
        "code": "SUMMARY_BEHIND", "operation": "list_session_summaries", "path": path})
    return None, 0
