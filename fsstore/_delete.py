"""Deletes: a session (its main and subagent transcripts) or one subagent transcript.

A delete, holding the lock of what it moves (a session's: its main transcript's):

1. identifies the directory by a listing of its parent (:func:`_views.listed_dir`:
   the server's inode for the name, whatever this client's lookups remember);
2. marks it: ``.deleted`` in ``main/`` first (the commit point of a session delete:
   subagent transcripts look there too; made for the mark where the session has no
   main transcript), then in each subagent transcript. From here the delete is
   committed: whoever finds a mark under the lock finishes it (its deleter may have
   died). A reader holding the directory open, or reaching it through a stale client
   cache, sees the mark: whole transcript or None. ``fsstore prune`` marks with a temp
   file first, looks once more, and commits by renaming the one in ``main/`` to
   ``.deleted``; an append that finds its marks before that removes them, and the
   prune keeps the session (:func:`_prune`, :func:`cancel_prunes`);
3. renames it into ``.trash`` (one atomic rename: every reader on every host sees it
   gone at once), under a name carrying the transcript's *tag* (the first 16 hex
   digits of its lock name);
4. checks what the rename moved: by name, so a deleter whose lock was overtaken (a
   stall, a clock ahead) can move a session another writer finished the delete of and
   made anew. What is not marked (every ``.deleted`` is a committed delete's) was never
   its own: it is put back (:func:`_put_back`). Until then a load or append that finds
   it missing moves it back (:func:`restore`), and so does a listing of its parent, where the
   delete left a record of the name (:func:`moving_record`, :func:`restore_named`),
   and ``fsstore gc`` once old. Where another session was made at the name meanwhile,
   its batches are appended to that one (:func:`_merge.merge_back`). A delete that began
   while it was at the name or in ``.trash`` claims and takes it (:func:`_claim_moved`,
   :func:`_tickets`);
5. empties it there, keeping the marks (a tombstone ``.trash/*-tomb``: a writer whose
   client still reaches the old path sees the delete; ``fsstore gc`` removes it once
   old).

Crash table: before 2, nothing happened (a prune's marks not committed are taken
back by the next append, or removed by ``fsstore gc`` once old); after 2, the next
writer or reader under the lock finishes it; after 3, a marked directory in
``.trash`` is garbage for ``fsstore gc``, an unmarked one (step 4) is moved back by
the next listing, load or append, or merged by gc, once old, into a session made at
its name since (``fsstore check``: an orphan once old). docs/format.md, "Deletes", has the whole story.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from . import _fsio, _keys, _layout, _merge, _read, _trash, _views
from ._errors import FsStoreError, log
from ._layout import Component
from ._trash import ASIDE_TAG, FROM

if TYPE_CHECKING:
    from ._store import SyncStore

T = TypeVar("T")

CLAIM_TAG = "-claim"  # a delete's ticket in what it is to delete (see _tickets)
MOVING_TAG = "-moving"  # beside what a delete moves, its name, until the delete knows what it moved


def moving_record(aside: str) -> str:
    """The record a delete leaves beside what it moves to ``.trash/aside``: its name."""
    return aside[: -len(ASIDE_TAG)] + MOVING_TAG


def remove(
    store: SyncStore, comps: list[Component], path: str, mark: str, op: str,
    keep: Callable[[], bool] | None, *, finishing: bool = False,
) -> bool:
    """Delete the session (``mark="main"``) or transcript (``mark=""``) at ``comps``
    under the lock of its main transcript (or its own): see the module docstring.
    ``keep``: a prune's (:func:`_prune`), asked after its marks and before its commit;
    False if kept. ``finishing``: the marks are someone else's.

    The lock serializes the deleters, and whoever finishes a delete, with the writers
    that make the session (or transcript) anew: so what a delete moves is what it
    marked. Correctness does not rest on it (step 4)."""
    lock_name = _layout.lock_name([*comps, (_layout.MAIN, None)] if mark else comps)
    tags, name = _trash.tags(comps), comps[-1][0]
    claiming = not finishing and keep is None  # a plain delete (see _claim_moved)
    with store._open_root(create=False) as rfd:
        if rfd is None:
            return True
        parent = _open_parent(store, rfd, comps, op)
        if parent is None and claiming and restore(store, rfd, comps):
            parent = _open_parent(store, rfd, comps, op)  # its session was hidden in .trash
        if parent is None and not (claiming and not mark):
            return True
        # A subagent transcript with nothing at its name (its session holds no subagent
        # transcripts) may still be in a session moved by mistake, in .trash: claimed.
        ticket, orphan = _fsio.temp_name(CLAIM_TAG) if claiming else "", None
        try:
            with store._locks.hold(store._lock_path(lock_name, op), op):
                try:
                    if claiming:  # what this delete is to delete, as it begins
                        _tickets(store, rfd, parent, name, mark, path, tags, ticket)
                    wait = not finishing  # for this client's view (see _views.listed_dir)
                    if keep is not None:
                        assert parent is not None
                        if not _prune(store, parent, name, path, mark, keep):
                            return False
                        finishing = True  # committed: finished as anyone's (what is at the
                        # name now is another session if not marked)
                    orphan = _again_if_stale(parent, name, lambda: _move_and_claim(
                        store, rfd, parent, name, path, mark, tags, ticket if claiming else None,
                        finishing=finishing, wait=wait))
                finally:
                    if claiming:
                        with contextlib.suppress(OSError, FsStoreError):  # else gc's, once old
                            _tickets(store, rfd, parent, name, mark, path, tags, ticket, undo=True)
        finally:
            if parent is not None:
                os.close(parent)
    if orphan is not None:  # not under the lock: appending takes the locks it needs
        _merge.merge_back(store, orphan, comps, mark, path)
    return True


def _move_and_claim(
    store: SyncStore, rfd: int, parent: int | None, name: str, path: str, mark: str,
    tags: list[str], ticket: str | None, *, finishing: bool, wait: bool,
) -> str | None:
    """Steps 1 to 5 for ``parent/name``, and, for a plain delete (its ``ticket``), the
    claim of what other deletes moved by mistake: the orphan to merge, if any."""
    orphan = None
    for _round in range(1 if ticket is None else 3):
        if parent is not None:
            orphan = _move_to_trash(store, rfd, parent, name, path, mark, "-".join(tags),
                                    finishing=finishing, wait=wait)
        if ticket is None or orphan is not None:
            break
        _claim_moved(store, rfd, tags, ticket, path)
        if parent is None or not _holds(store, parent, name, mark, path.rsplit("/", 1)[0], ticket):
            break
        # One of ours, moved back meanwhile (by its stalled deleter, or a load that
        # found it missing) before this delete could claim it: again.
    return orphan


_STALE_TRIES = 4  # a GlusterFS client two hosts' deletes of one session kept answering so


def _again_if_stale(parent: int | None, name: str, step: Callable[[], T]) -> T:
    """``step()``, again after ESTALE from ``parent/name`` (a path) and a lookup of it (another
    host's delete, or this one's move), up to :data:`_STALE_TRIES` times: any step can be."""
    for attempt in range(_STALE_TRIES - 1):
        try:
            return step()
        except OSError as exc:
            if exc.errno != errno.ESTALE or parent is None:
                raise
        forget_old_name(parent, name)
        time.sleep(0.05 * attempt)
    return step()


def forget_old_name(parent: int, name: str) -> None:
    """Look ``parent/name`` up: a GlusterFS brick that handled a client's listing of a
    directory after another host moved a directory in it away links that under its old
    name again, and answers ESTALE for it until the name is looked up (gluster#1411)."""
    with contextlib.suppress(OSError):
        _views.looked_up_ino(parent, name)


def _prune(store: SyncStore, parent: int, name: str, path: str, mark: str,
           keep: Callable[[], bool]) -> bool:
    """A prune's commit: whether its delete of ``parent/name`` is committed. Its marks
    are a temp file (``_layout.PRUNING_TAG``), in ``main/`` first, then in each subagent
    transcript; ``keep`` (its last look) is asked; then the one in ``main/`` is renamed
    to ``.deleted``, unless an append removed it meanwhile (:func:`cancel_prunes`): an
    append that came after the look wins. Where kept, its marks are taken back. Nobody
    else ever acts on a mark not committed (one left by a prune that died is garbage
    for ``fsstore gc``)."""
    pruning = _fsio.temp_name(_layout.PRUNING_TAG)
    at = f"{name}/{mark}/" if mark else f"{name}/"
    committed = False
    try:
        _mark(store, parent, name, path, mark, pruning)
        committed = not keep() and _rename_if_there(parent, at + pruning, at + _layout.DELETED)
    finally:
        if not committed:
            _mark(store, parent, name, path, mark, pruning, undo=True)
    return committed


def _rename_if_there(dir_fd: int, src: str, dst: str) -> bool:
    """Rename ``dir_fd/src`` to ``dir_fd/dst``; False where ``src`` is gone."""
    try:
        os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def cancel_prunes(dir_fd: int, marks: list[str], main: str | None) -> None:
    """For an append that found the prunes' marks ``marks`` (not committed) in its
    transcript directory ``dir_fd``: remove them, first where the prune commits (its
    session's ``main/``: at ``main`` from ``dir_fd``, for a subagent transcript), so
    that prune keeps the session (:func:`_prune`). The caller then looks for
    ``.deleted`` again: a prune that committed first renamed its mark to that."""
    for pruning in marks:
        if main is not None:
            _fsio.unlink_quiet(dir_fd, f"{main}/{pruning}")
        _fsio.unlink_quiet(dir_fd, pruning)


def cancel_prunes_in(dir_fd: int, main: str) -> None:
    """:func:`cancel_prunes` for the first commit of a subagent transcript (prunes mark
    only those they found): every prune's mark in its session's ``main/`` (at ``main``
    from ``dir_fd``; none if it has no main transcript)."""
    try:
        names = _fsio.listdir(dir_fd, main)
    except FileNotFoundError:
        return
    for name in names:
        if _layout.pruning(name):
            _fsio.unlink_quiet(dir_fd, f"{main}/{name}")


def finish(store: SyncStore, comps: list[Component], path: str, *, session: bool) -> None:
    """Move a marked transcript into the trash, or its whole session where the main
    transcript is marked (``session``: a subagent transcript saw that mark). Called
    by whoever finds a mark, holding no transcript lock."""
    if comps[-1][0] == _layout.MAIN and len(comps) == 5:
        comps, mark = comps[:-1], _layout.MAIN  # <S>/main -> <S>
    elif session:
        comps, mark = comps[:-2], _layout.MAIN  # <S>/subkeys/<SP> -> <S>
    else:
        mark = ""
    try:
        remove(store, comps, path, mark, "delete", None, finishing=True)
    except (OSError, FsStoreError) as exc:  # a read-only mount: the delete stays marked
        log.debug("could not finish a marked delete: %s", exc)


def marked(parent: int, name: str, below: str, *, asked: bool = False) -> bool:
    """Whether ``parent/name`` (``below``: its ``main``) holds a ``.deleted`` mark;
    False where that cannot be told (the caller then leaves the directory where it is).
    ``asked``: for a look that decides to move or empty a directory, a mark the ``stat``
    sees is confirmed by an open (:func:`_read.mark_there`): sshfs answers a ``stat`` from
    what it saw at the path, and moves that along with a rename made through it (stop
    45: a new session taken for the deleted one and emptied). Where the open cannot
    tell (``ESTALE`` on GlusterFS, where the ``stat`` reaches the server), the stat says."""
    try:
        seen = _trash.mark_seen(parent, name, below)
    except OSError:
        return False
    try:
        return seen and (not asked or _read.mark_there(parent, _trash.mark_path(name, below)))
    except OSError:
        return True


_SESSION_VIEW_TRIES = 4  # pauses for a client's lookups of a session to lapse (_views.STALE_VIEW_PAUSE)


def _open_parent(store: SyncStore, rfd: int, comps: list[Component], op: str) -> int | None:
    """The directory holding ``comps``' last name; for a subagent transcript, in the
    session at the name on the server: a client can resolve the session's name to one
    deleted since, for a second (GlusterFS's cached lookups), and a delete there would
    empty that one's copy in .trash and leave the transcript at the name (review 118:
    4 of 4). Looked up again once the view lapses; ESTALE if it does not."""
    for _try in range(_SESSION_VIEW_TRIES):
        parent = store._open(rfd, comps[:-1], op)
        if parent is None or len(comps) < 6 or _views.at_its_name(rfd, comps[:-1], parent, (3,)):
            return parent
        os.close(parent)
        time.sleep(_views.STALE_VIEW_PAUSE)
    raise OSError(errno.ESTALE, "this client keeps resolving the session's name to another "
                  "directory than the server has", store._path(comps[:4]))


def _move_to_trash(store: SyncStore, rfd: int, parent: int, name: str, path: str, mark: str,
                   tag: str, *, finishing: bool, wait: bool) -> str | None:
    """Steps 1 to 5 for ``parent/name``: the name of an orphan left in ``.trash`` (step
    4: to be merged back), else None."""
    trash = store._open(rfd, [(_layout.TRASH, None)], "delete", create=True)
    assert trash is not None
    try:
        ident = _views.listed_dir(rfd, parent, name, wait=wait)
        if ident is None:
            return None  # never written, or deleted already
        if not finishing:
            try:  # gone on the server, reached by a cached name (review 109: sshfs)
                _mark(store, parent, name, path, mark, _layout.DELETED)
            except FileNotFoundError:
                return None
        elif not marked(parent, name, mark, asked=True):
            return None  # finished already: what is there now was made anew
        aside = _fsio.temp_name(f"-{tag}{FROM}{name}{ASIDE_TAG}")  # names what it was (moved_from)
        moving = moving_record(aside)
        try:
            # Named beside it until this delete knows what it moved (restore_named).
            store._fs.write_new(parent, moving, name.encode("ascii"))
            os.rename(name, aside, src_dir_fd=parent, dst_dir_fd=trash)
        except FileNotFoundError:
            _fsio.unlink_quiet(parent, moving)
            return None  # never written, or deleted already: not an error
        except OSError:
            _fsio.unlink_quiet(parent, moving)
            raise
        try:
            _renew(store, parent, moving, name)
            return _after_move(store, trash, parent, name, aside, ident, path, mark)
        finally:
            _fsio.unlink_quiet(parent, moving)
    finally:
        os.close(trash)


def _renew(store: SyncStore, parent: int, moving: str, name: str) -> None:
    """Touch (or write again) the record ``moving`` once the move is done: gc removes
    records by age, and this delete may have stalled longer than that before its rename
    (found by review); gc keeps a young one, and one that names an orphan."""
    try:
        try:
            os.utime(moving, dir_fd=parent)
        except FileNotFoundError:
            store._fs.write_new(parent, moving, name.encode("ascii"))
    except OSError as exc:  # a hint: the delete goes on
        log.debug("could not renew a delete's record: %s", exc)


def _after_move(
    store: SyncStore, trash: int, parent: int, name: str, aside: str, ident: int, path: str, mark: str,
) -> str | None:
    """Steps 4 and 5, once ``parent/name`` is ``.trash/aside`` (what
    :func:`_move_to_trash` returns)."""
    # Marked (by us, or made anew and deleted again: every .deleted is a committed
    # delete), it is a delete's to finish; else put back. A mark is believed only
    # through a lookup that agrees with the listing: a client's stale entry moves with
    # its rename to the new name (GlusterFS).
    moved = _views.listed_ino(trash, aside)
    agrees = not ident or moved == _views.looked_up_ino(trash, aside)
    if not (agrees and marked(trash, aside, mark, asked=True)):
        return _put_back(trash, aside, parent, name, path)
    store._fs.sync_dir(parent)
    _empty(trash, aside, path)
    return None


def _empty(trash: int, aside: str, path: str) -> None:
    """Step 5: everything but the marks of the deleted ``.trash/aside`` goes."""
    try:
        if _fsio.empty_tree(trash, aside, _layout.DELETED):
            # Named as it was, so that it says what it was (old_names): ``-tomb`` for ``-deleted``.
            os.rename(aside, aside[: -len(ASIDE_TAG)] + _layout.TOMB_TAG, src_dir_fd=trash, dst_dir_fd=trash)
        else:
            _fsio.remove_tree(trash, aside)
    except OSError as exc:
        # Gone from every reader's view already; what is left in .trash (e.g. a
        # racing writer's file) is removed by `fsstore gc`.
        log.warning("leftovers in .trash: %s", exc, extra={
            "code": "TRASH_LEFT", "operation": "delete", "path": path})


def _put_back(trash: int, aside: str, parent: int, name: str, path: str) -> str | None:
    """Move back a directory a delete moved that was not the one it marked; where
    another is at the name now, return its name in ``.trash``, to merge (it keeps that
    name: a listing of ``.trash`` never misses it in a rename)."""
    try:
        # Replaces only an empty directory (a writer's mkdir before its first commit
        # into it: that commit then fails in the replaced one, and retries).
        os.rename(aside, name, src_dir_fd=trash, dst_dir_fd=parent)
    except FileNotFoundError:
        return None  # moved back already, by whoever found the transcript missing (restore)
    except OSError as exc:
        log.warning("a delete moved a transcript made anew after its mark and could not move "
                    "it back (%s): merging it into the one made since", exc.strerror, extra={
                        "code": "DELETE_RACED", "operation": "delete", "path": path})
        return aside
    log.warning("a delete moved a transcript made anew after its mark; moved back",
                extra={"code": "DELETE_RACED", "operation": "delete", "path": path})
    return None


def restore(store: SyncStore, rfd: int, comps: list[Component], *, listing: bool = False) -> bool:
    """Move back an unmarked directory in ``.trash`` of the session of transcript
    ``comps``, or of the transcript, that a delete moved by mistake (its deleter stalled
    or died between its two renames): for whoever finds it missing. True if one was.

    ``listing``: for a listing, which holds no lock and reads no mark, a directory found
    marked once moved back is a committed delete, finished here (a load or append that
    moved it finds the mark itself): a GlusterFS client can find no mark in what a
    delete has just moved (review, stop 28: deleted sessions listed again, 4 of 4 runs)."""
    session = comps[:4]
    sub = comps[-1][0] != _layout.MAIN
    trash = store._open(rfd, [(_layout.TRASH, None)], "load")
    if trash is None:
        return False
    restored = False
    try:
        names = _fsio.listdir(trash)
        for target, tags, mark in [(session, _trash.tags(session), _layout.MAIN)] + (
                [(comps, _trash.tags(comps), "")] if sub else []):
            for name in names:
                if _trash.tags_of(name) != tags or marked(trash, name, mark):
                    continue
                parent = store._open(rfd, target[:-1], "load")
                if parent is None:
                    continue
                try:
                    to = target[-1][0]
                    _views.rename_onto(parent, to, functools.partial(
                        os.rename, name, to, src_dir_fd=trash, dst_dir_fd=parent))
                    _fsio.unlink_quiet(parent, moving_record(name))
                    deleted = listing and marked(parent, target[-1][0], mark)
                except OSError:
                    continue  # moved back by its deleter, claimed, or a new one is there
                finally:
                    os.close(parent)
                if deleted:
                    finish(store, [*target, (_layout.MAIN, None)] if mark else target,
                           store._path(target), session=False)
                    continue
                restored = True
                log.warning("moved back a transcript a delete had moved by mistake (its deleter "
                            "stalled or died)", extra={"code": "DELETE_RACED", "operation": "load",
                                                       "path": store._path(target)})
    finally:
        os.close(trash)
    return restored


def restore_named(store: SyncStore, rfd: int, parent: int, comps: list[Component], records: list[str]) -> bool:
    """Move back what the deletes that left ``records`` (:func:`moving_record`) in
    ``parent`` (at ``comps``: ``sessions`` or ``subkeys``) moved by mistake, for a
    listing of ``parent`` (its deleter stalled or died between its two renames). True
    if one was moved back."""
    restored = False
    for record in records:
        try:
            name = _read.read_file(parent, record, limit=_keys.MAX_PLAIN).decode("ascii")
        except (OSError, UnicodeDecodeError):
            continue  # removed meanwhile (the delete is done), or not a record
        if not name or "/" in name or name.startswith(".") or "\0" in name:
            continue
        # restore() moves back only a directory whose tags are this name's.
        target = [*comps, (name, None)]
        restored |= restore(store, rfd, [*target, (_layout.MAIN, None)] if comps[-1][0] == _layout.SESSIONS
                            else target, listing=True)
    return restored


def _claim_moved(store: SyncStore, rfd: int, tags: list[str], ticket: str, path: str) -> None:
    """Mark and take (:func:`_take`) what other deletes moved by mistake into ``.trash``
    (on its way back or being merged) where it holds this delete's ``ticket``: it was
    at the name as this delete began (:func:`_tickets`). Of this transcript (``tags``),
    or, for a session delete, of the session or any of its subagent transcripts. A
    directory made at the name after this delete began holds no ticket: it may hold
    batches acknowledged after this delete took effect, and is not claimed."""
    trash = store._open(rfd, [(_layout.TRASH, None)], "delete")
    if trash is None:
        return
    base = f"{store.root}/{_layout.TRASH}"
    try:
        # Listed afresh, marks confirmed by an open: a client's cache can hide what a
        # stalled deleter moved here, or show a mark its rename carried along (review 118,
        # sshfs: what was at the name as this delete began came back after it returned).
        with contextlib.suppress(OSError):  # (committed: a probe left is gc's)
            _views.refresh_listing(trash)
        for name in _fsio.listdir(trash):
            found = _trash.tags_of(name)
            if found is None or found[0] != tags[0]:
                continue  # not of this session
            if len(tags) == 2 and len(found) == 2 and found[1] != tags[1]:
                continue  # another subagent transcript of it
            if len(tags) == 2 and len(found) == 1:  # the session, moved whole: our transcript in it
                holder = store._open(trash, [(name, None), (_layout.SUBKEYS, None)], "delete")
                what, mark, taken = path.rsplit("/", 1)[-1], "", tags
            else:
                holder, what, mark, taken = os.dup(trash), name, _layout.MAIN if len(found) == 1 else "", found
            if holder is None:
                continue
            try:
                if _holds(store, holder, what, mark, base, ticket) and not marked(holder, what, mark, asked=True):
                    _mark(store, holder, what, f"{base}/{name}", mark, _layout.DELETED)
                    log.warning("marked what another delete had moved by mistake: deleted now",
                                extra={"code": "DELETE_RACED", "operation": "delete", "path": path})
                    # What another delete marked is its to take (or its own move, marked).
                    _take(trash, holder, what, taken, path)
            except OSError as exc:
                # Gone from .trash since the listing: moved back to the name (the caller
                # looks there again) or merged by another process. This delete is
                # committed: not its failure (review 117: ENOENT from a delete that had
                # deleted, 1 of 262 on GlusterFS).
                if exc.errno not in (errno.ENOENT, errno.ESTALE):
                    raise
            finally:
                os.close(holder)
    finally:
        os.close(trash)


def _take(trash: int, holder: int, what: str, tags: list[str], path: str) -> None:
    """Move what this delete claimed (marked) off its name in ``.trash`` and empty it: a
    deleter, load or listing that looked before the mark finds nothing to move back
    (found by review: it came back at its name after the claiming delete returned).
    Moved back first (ENOENT), it holds this delete's ticket at the name: taken there."""
    aside = _fsio.temp_name(f"-{'-'.join(tags)}{ASIDE_TAG}")
    try:
        os.rename(what, aside, src_dir_fd=holder, dst_dir_fd=trash)
    except FileNotFoundError:
        return
    _empty(trash, aside, path)


def _tickets(
    store: SyncStore, rfd: int, parent: int | None, name: str, mark: str, path: str, tags: list[str],
    ticket: str, *, undo: bool = False,
) -> None:
    """Leave (``undo``: take back) an empty file named ``ticket`` in each transcript
    directory this delete is to delete, as it begins: at the name, then in what deletes
    had moved from it into ``.trash``. A stalled deleter's mistaken move carries it
    along (:func:`_claim_moved`). A name, not an inode number: those are reused."""
    # At the name first: what a mistaken move takes from there after this look is then
    # in .trash when it is listed, or carries the ticket.
    if parent is not None:
        _ticket_dirs(store, parent, name, mark, path.rsplit("/", 1)[0], ticket, undo=undo)
    trash = store._open(rfd, [(_layout.TRASH, None)], "delete")
    if trash is None:
        return
    try:
        for moved in _fsio.listdir(trash):
            found = _trash.tags_of(moved)
            if found is not None and found[0] == tags[0]:
                _ticket_dirs(store, trash, moved, _layout.MAIN if len(found) == 1 else "",
                             f"{store.root}/{_layout.TRASH}", ticket, undo=undo)
    finally:
        os.close(trash)


def _ticket_dirs(store: SyncStore, parent: int, name: str, mark: str, base: str, ticket: str,
                 *, undo: bool) -> None:
    with _transcript_dirs(store, parent, name, mark, base) as tfds:
        for tfd in tfds:
            if undo:
                _fsio.unlink_quiet(tfd, ticket)
            else:
                with contextlib.suppress(OSError):  # removed meanwhile: nothing to claim there
                    os.close(os.open(ticket, _fsio.CREATE_FLAGS, 0o600, dir_fd=tfd))


def _holds(store: SyncStore, parent: int, name: str, mark: str, base: str, ticket: str) -> bool:
    """Whether a transcript directory of ``parent/name`` (a session's, with ``mark``)
    holds ``ticket``."""
    with _transcript_dirs(store, parent, name, mark, base) as tfds:
        return any(_fsio.exists(tfd, ticket) for tfd in tfds)


def _mark(store: SyncStore, parent: int, name: str, path: str, below: str, mark: str, *, undo: bool = False) -> None:
    """Create the file ``mark`` (``.deleted``, or a prune's: :func:`_prune`) in the
    transcript directory ``parent/name`` (``below=""``), or for a session in
    ``parent/name/main`` first (made for the mark in a session without a main
    transcript), then in each of its subagent transcripts. ``undo``: remove them (a
    prune's)."""
    base = path.rsplit("/", 1)[0]
    if below:
        top = store._fs.open_dir(parent, [(name, None)], create=False, base_path=base,
                                 operation="delete")
        if top is None:
            return
        try:
            if undo:  # a main made for the mark goes with it (one with parts stays)
                _mark_dirs(store, parent, name, base, below, mark, undo)
                with contextlib.suppress(OSError):
                    os.rmdir(below, dir_fd=top)
                return
            made = store._fs.open_dir(top, [(below, None)], create=True, base_path=path,
                                      operation="delete")
            assert made is not None
            os.close(made)
        finally:
            os.close(top)
    _mark_dirs(store, parent, name, base, below, mark, undo)


def _mark_dirs(store: SyncStore, parent: int, name: str, base: str, below: str, mark: str,
               undo: bool) -> None:
    with _transcript_dirs(store, parent, name, below, base) as tfds:
        for tfd in tfds:
            if undo:
                _fsio.unlink_quiet(tfd, mark)
            else:
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    store._fs.mark(tfd, mark)


@contextlib.contextmanager
def _transcript_dirs(
    store: SyncStore, parent: int, name: str, below: str, base: str,
) -> Iterator[list[int]]:
    """The transcript directories of ``parent/name``, open
    for the ``with`` (all closed after it, also on an error): the directory itself, or
    for a session (``below``: its ``main``) main and each subagent transcript's; those
    that do not exist are left out."""
    subs = [] if not below else _again_if_stale(  # ESTALE: deleted and made anew elsewhere
        parent, f"{name}/{_layout.SUBKEYS}", functools.partial(
            store._fs.subdirs_beneath, parent, [name, _layout.SUBKEYS], base, "delete"))
    dirs = [[name]] if not below else [[name, below]] + [[name, _layout.SUBKEYS, sp] for sp in subs]
    opened: list[int] = []
    try:
        for names in dirs:
            tfd = _again_if_stale(parent, "/".join(names), functools.partial(
                store._fs.open_dir, parent, [(n, None) for n in names], create=False, base_path=base,
                operation="delete"))
            if tfd is not None:
                opened.append(tfd)
        yield opened
    finally:
        for tfd in opened:
            os.close(tfd)
