"""Deletes: a session (its main and subagent transcripts) or one subagent transcript.

A delete, holding the lock of what it moves (a session's: its main transcript's):

1. identifies the directory by a listing of its parent (:func:`_views.listed_dir`:
   the server's inode for the name, whatever this client's lookups remember);
2. marks it: ``.deleted`` in ``main/`` first (the commit point of a session delete:
   subagent transcripts look there too; made for the mark where the session has no
   main transcript), then in each subagent transcript. From here the delete is
   committed: whoever finds a mark under the lock finishes it (its deleter may have
   died). A reader holding the directory open, or reaching it through a stale client
   cache, sees the mark: whole transcript or None;
3. renames it into ``.trash`` (one atomic rename: every reader on every host sees it
   gone at once), under a name carrying the transcript's *tag* (the first 16 hex
   digits of its lock name);
4. checks what the rename moved: by name, so a deleter whose lock was overtaken (a
   stall, a clock ahead) can move a session another writer finished the delete of and
   made anew. What is not marked (or not the directory listed) was never its own: it
   is put back (:func:`_put_back`). Until then a load or append that finds it missing
   moves it back (:func:`restore`), and so does a listing of its parent, where the
   delete left a record of the name (:func:`moving_record`, :func:`restore_named`),
   and ``fsstore gc`` once old. Where another session was made at the name meanwhile,
   its batches are appended to that one (:func:`merge_back`). A delete that began
   while it was at the name or in ``.trash`` claims and takes it (:func:`_claim_moved`,
   :func:`_tickets`);
5. empties it there, keeping the marks (a tombstone ``.trash/*-tomb``: a writer whose
   client still reaches the old path sees the delete; ``fsstore gc`` removes it once
   old).

Crash table: before 2, nothing happened; after 2, the next writer or reader under
the lock finishes it (``fsstore prune`` takes its marks back where its last look says
keep); after 3, a marked directory in ``.trash`` is garbage for ``fsstore gc``, an
unmarked one (step 4) is moved back by the next listing, load or append, or merged
by gc, once old, into a session made at its name since (``fsstore check``: an orphan
once old). docs/format.md, "Deletes", has the whole story.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from . import _commit, _fsio, _keys, _layout, _read, _views
from ._errors import FsStoreError, log
from ._layout import Component
from ._transcript import Deleted, Vanished, read_snapshot

if TYPE_CHECKING:
    from ._store import SyncStore

ASIDE_TAG = "-deleted"  # what a delete moved into .trash, until it is emptied or moved back
CLAIM_TAG = "-claim"  # a delete's ticket in what it is to delete (see _tickets)
MERGED_TAG = "-merged"  # what a delete moved by mistake, merged back, until it is removed
MOVING_TAG = "-moving"  # beside what a delete moves, its name, until the delete knows what it moved


def moving_record(aside: str) -> str:
    """The record a delete leaves beside what it moves to ``.trash/aside``: its name."""
    return aside[: -len(ASIDE_TAG)] + MOVING_TAG


def remove(
    store: SyncStore, comps: list[Component], path: str, mark: str, op: str,
    keep: Callable[[], bool] | None, *, finishing: bool = False,
) -> None:
    """Delete the session (``mark="main"``) or transcript (``mark=""``) at ``comps``
    under the lock of its main transcript (or its own): see the module docstring.
    ``keep`` is asked after the marks and before the move: True takes the marks back
    (``fsstore prune``'s last look). ``finishing``: the marks are someone else's.

    The lock serializes the deleters, and whoever finishes a delete, with the writers
    that make the session (or transcript) anew: so what a delete moves is what it
    marked. Correctness does not rest on it (step 4)."""
    lock_name = _layout.lock_name([*comps, (_layout.MAIN, None)] if mark else comps)
    tags, name = _tags(comps), comps[-1][0]
    claiming = not finishing and keep is None  # a plain delete (see _claim_moved)
    with store._open_root(create=False) as rfd:
        if rfd is None:
            return
        parent = store._open(rfd, comps[:-1], op)
        if parent is None and claiming and restore(store, rfd, comps):
            parent = store._open(rfd, comps[:-1], op)  # its session was hidden in .trash
        if parent is None and not (claiming and not mark):
            return
        # A subagent transcript with nothing at its name (its session holds no subagent
        # transcripts) may still be in a session moved by mistake, in .trash: claimed.
        ticket, orphan = _fsio.temp_name(CLAIM_TAG) if claiming else "", None
        try:
            with store._locks.hold(store._lock_path(lock_name, op), op):
                try:
                    if claiming:  # what this delete is to delete, as it begins
                        _tickets(store, rfd, parent, name, mark, path, tags, ticket)
                    for _round in range(3 if claiming else 1):
                        if parent is not None:
                            orphan = _move_to_trash(store, rfd, parent, name, path, mark, keep,
                                                    "-".join(tags), finishing=finishing)
                        if not claiming or orphan is not None:
                            break
                        _claim_moved(store, rfd, tags, ticket, path)
                        if parent is None or not _holds(store, parent, name, mark,
                                                        path.rsplit("/", 1)[0], ticket):
                            break
                        # One of ours, moved back meanwhile (by its stalled deleter, or a load
                        # that found it missing) before this delete could claim it: again.
                finally:
                    if claiming:
                        with contextlib.suppress(OSError, FsStoreError):  # else gc's, once old
                            _tickets(store, rfd, parent, name, mark, path, tags, ticket, undo=True)
        finally:
            if parent is not None:
                os.close(parent)
    if orphan is not None:  # not under the lock: appending takes the locks it needs
        merge_back(store, orphan, comps, mark, path)


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


def marked(parent: int, name: str, below: str) -> bool:
    """Whether ``parent/name`` (``below``: its ``main``) holds a ``.deleted`` mark;
    False where that cannot be told (the caller then leaves the directory where it is)."""
    rel = f"{name}/{below}/{_layout.DELETED}" if below else f"{name}/{_layout.DELETED}"
    try:
        return _fsio.exists(parent, rel)
    except OSError:
        return False


def _move_to_trash(
    store: SyncStore, rfd: int, parent: int, name: str, path: str, mark: str,
    keep: Callable[[], bool] | None, tag: str, *, finishing: bool,
) -> str | None:
    """Steps 1 to 5 for ``parent/name``; the name of an orphan left in ``.trash``
    (step 4: to be merged back), else None."""
    trash = store._open(rfd, [(_layout.TRASH, None)], "delete", create=True)
    assert trash is not None
    try:
        ident = _views.listed_dir(store._fs, rfd, parent, name, wait=not finishing)
        if ident is None:
            return None  # never written, or deleted already
        if finishing:
            if not marked(parent, name, mark):
                return None  # finished already: what is there now was made anew
        else:
            _mark(store, parent, name, path, mark)
            try:
                kept = keep is not None and keep()
            except BaseException:
                _mark(store, parent, name, path, mark, undo=True)
                raise
            if kept:
                _mark(store, parent, name, path, mark, undo=True)
                return None
        aside = _fsio.temp_name(f"-{tag}{ASIDE_TAG}")
        moving = moving_record(aside)
        try:
            # Named beside it until this delete knows what it moved (restore_named).
            store._fs.write_temp(parent, moving, name.encode("ascii"))
            os.rename(name, aside, src_dir_fd=parent, dst_dir_fd=trash)
        except FileNotFoundError:
            _fsio.unlink_quiet(parent, moving)
            return None  # never written, or deleted already: not an error
        except OSError:
            _fsio.unlink_quiet(parent, moving)
            if not finishing:
                _mark(store, parent, name, path, mark, undo=True)
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
            store._fs.write_temp(parent, moving, name.encode("ascii"))
    except OSError as exc:  # a hint: the delete goes on
        log.debug("could not renew a delete's record: %s", exc)


def _after_move(
    store: SyncStore, trash: int, parent: int, name: str, aside: str, ident: int, path: str, mark: str,
) -> str | None:
    """Steps 4 and 5, once ``parent/name`` is ``.trash/aside``."""
    # Marked (by us, or made anew and deleted again), it is a committed delete;
    # else put back. A mark is believed only through a lookup that agrees with the
    # listing: a client's stale entry moves with its rename to the new name (GlusterFS).
    agrees = not ident or _views.listed_ino(trash, aside) == _views.looked_up_ino(trash, aside)
    if not (agrees and marked(trash, aside, mark)):
        return _put_back(trash, aside, parent, name, path)
    store._fs.sync_dir(parent)
    _empty(trash, aside, path)
    return None


def _empty(trash: int, aside: str, path: str) -> None:
    """Step 5: everything but the marks of the deleted ``.trash/aside`` goes."""
    try:
        if _fsio.empty_tree(trash, aside, _layout.DELETED):
            os.rename(aside, _fsio.temp_name(_layout.TOMB_TAG), src_dir_fd=trash, dst_dir_fd=trash)
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


def restore(store: SyncStore, rfd: int, comps: list[Component]) -> bool:
    """Move back an unmarked directory in ``.trash`` of the session of transcript
    ``comps``, or of the transcript, that a delete moved by mistake (its deleter stalled
    or died between its two renames): for whoever finds it missing. True if one was."""
    session = comps[:4]
    sub = comps[-1][0] != _layout.MAIN
    trash = store._open(rfd, [(_layout.TRASH, None)], "load")
    if trash is None:
        return False
    restored = False
    try:
        names = _fsio.listdir(trash)
        for target, tags, mark in [(session, _tags(session), _layout.MAIN)] + (
                [(comps, _tags(comps), "")] if sub else []):
            for name in names:
                if _tags_of(name) != tags or marked(trash, name, mark):
                    continue
                parent = store._open(rfd, target[:-1], "load")
                if parent is None:
                    continue
                try:
                    _rename_back(trash, name, parent, target[-1][0])
                    _fsio.unlink_quiet(parent, moving_record(name))
                except OSError:
                    continue  # moved back by its deleter, claimed, or a new one is there
                finally:
                    os.close(parent)
                restored = True
                log.warning("moved back a transcript a delete had moved by mistake (its deleter "
                            "stalled or died)", extra={"code": "DELETE_RACED", "operation": "load",
                                                       "path": store._path(target)})
    finally:
        os.close(trash)
    return restored


def _rename_back(trash: int, name: str, parent: int, to: str) -> None:
    """Rename ``.trash/name`` to ``parent/to`` (:func:`_views.forgot_stale_dir`)."""
    try:
        os.rename(name, to, src_dir_fd=trash, dst_dir_fd=parent)
    except OSError as exc:
        if exc.errno != errno.ESTALE or not _views.forgot_stale_dir(parent, to):
            raise
        os.rename(name, to, src_dir_fd=trash, dst_dir_fd=parent)


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
                            else target)
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
        for name in _fsio.listdir(trash):
            found = _tags_of(name)
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
                if _holds(store, holder, what, mark, base, ticket) and not marked(holder, what, mark):
                    _mark(store, holder, what, f"{base}/{name}", mark)
                    log.warning("marked what another delete had moved by mistake: deleted now",
                                extra={"code": "DELETE_RACED", "operation": "delete", "path": path})
                    # What another delete marked is its to take (or its own move, marked).
                    _take(trash, holder, what, taken, path)
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
            found = _tags_of(moved)
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


# What a delete moves into .trash is named for what it was: the session's tag (the
# first 16 hex digits of its main transcript's lock name), and for a subagent
# transcript its own tag too. A directory of the session that holds no mark was
# moved by mistake (see the module docstring).
_MOVED = re.compile(r"\.tmp-[0-9]+-[0-9a-f]+-[0-9]+-([0-9a-f]{16})(?:-([0-9a-f]{16}))?" + ASIDE_TAG)


def orphan_target(name: str, transcripts: list[list[Component]]) -> tuple[list[Component], str] | None:
    """Where the orphan ``.trash/<name>`` (moved by mistake, unmarked) was moved from,
    if it was one of ``transcripts`` (their components) or their sessions: the
    arguments :func:`merge_back` takes (``comps``, ``mark``); None if none is there."""
    tags = _tags_of(name)
    for comps in transcripts if tags is not None else []:
        found = _tags(comps)
        if tags == found[:1]:
            return comps[:4], _layout.MAIN
        if tags == found:
            return comps, ""
    return None


def _tags(comps: list[Component]) -> list[str]:
    """The tags of the session ``comps[:4]`` and, below it, of a subagent transcript."""
    session = _layout.lock_name([*comps[:4], (_layout.MAIN, None)])[:16]
    return [session] if len(comps) <= 5 else [session, _layout.lock_name(comps)[:16]]


def _tags_of(name: str) -> list[str] | None:
    """The tags of a name in ``.trash`` that a delete moved there; None for any other."""
    m = _MOVED.fullmatch(name)
    return None if m is None else [t for t in (m.group(1), m.group(2)) if t]


def merge_back(store: SyncStore, orphan: str, comps: list[Component], mark: str, path: str) -> str:
    """Append the batches of ``.trash/<orphan>`` (each transcript's, in order, one
    append a batch) to the transcripts at its old name, then remove it.

    Only into the session the look found there (never making it anew:
    :class:`_commit.Gone`), each batch looked at and appended under the locks a delete
    of the session (or of that transcript) takes: a delete that runs meanwhile has
    claimed it by the next look, and the rest are not appended. If the session is gone
    (or being deleted) or this one is back at the name, it is left where it is. Each
    batch appended is marked in the orphan (:func:`merged_name`), so a merge resumed by
    ``fsstore gc`` appends the rest (only a batch whose merger died between its append
    and its mark twice). Merged whole, it is renamed off its name under the lock before
    it is removed: a merger still going through it stops at its next look, and a
    removal cut short leaves garbage, never an orphan to merge again.

    Returns how it ended: ``"merged"``; ``"claimed"``, ``"gone"``, ``"back"``,
    ``"done"`` (another process merged or removed it first), as logged; or
    ``"failed"`` (logged as an error; it stays)."""
    stopped: str | None = None
    try:
        with store._open_root(create=False) as rfd:
            trash = store._open(rfd, [(_layout.TRASH, None)], "delete") if rfd is not None else None
            if rfd is None or trash is None:
                return "done"
            try:
                ident = os.stat(orphan, dir_fd=trash, follow_symlinks=False).st_ino
                target = (_layout.rel(comps), _layout.rel(comps[:4]))
                main = {"project_key": _part(comps[1]), "session_id": _part(comps[3])}
                for key, names in _transcripts(store, trash, orphan, comps, mark):
                    stopped = _merge_transcript(store, rfd, trash, orphan, (ident, *target), names, mark,
                                                main, key, path)
                    if stopped is not None:
                        break
                if stopped in (None, "claimed"):
                    # Off its name under the lock first: a merger still going through it
                    # stops at its next look, and what a crash leaves is no orphan.
                    with store.locked(main):
                        done = _fsio.temp_name(MERGED_TAG)
                        try:
                            os.rename(orphan, done, src_dir_fd=trash, dst_dir_fd=trash)
                        except FileNotFoundError:
                            done, stopped = "", "done"  # another merger's, a step ahead
                    if done:
                        _fsio.remove_tree(trash, done)
            finally:
                os.close(trash)
    except (OSError, FsStoreError, Vanished) as exc:  # Vanished: someone else's work there
        _orphaned(orphan, path, exc)
        return "failed"
    log.warning("the transcript a delete moved by mistake is %s", {
        None: "merged into the one made since", "claimed": "deleted by a later delete",
        "gone": "left in .trash: the session was deleted while it was merged (that delete takes it)",
        "back": "back at its name (moved back while it was merged)",
        "done": "merged or deleted by another process meanwhile"}[stopped],
        extra={"code": "DELETE_RACED", "operation": "delete", "path": path})
    return stopped or "merged"


def _merge_transcript(
    store: SyncStore, rfd: int, trash: int, orphan: str, itself: tuple[int, str, str], names: list[str],
    mark: str, main: dict[str, Any], key: dict[str, Any], path: str,
) -> str | None:
    """Append the batches of the transcript ``orphan/names...`` to ``key``; why it
    stopped ("claimed", "gone", "back", "done": see :func:`merge_back`), None when done. A
    subagent transcript of it that is claimed alone (a delete of that transcript) is
    skipped. ``itself``: the orphan's inode number, the path of its old name and of
    its session's."""
    tfd = store._open(trash, [(n, None) for n in [orphan, *names]], "delete")
    if tfd is None:
        return None
    try:
        try:
            batches, gap = read_snapshot(tfd, f"{path}/{'/'.join(names)}", "delete")
        except Deleted:
            return "claimed" if marked(trash, orphan, mark) else None
        if gap is not None:
            raise FsStoreError("GAP", f"part {gap} is missing", operation="delete", path=path)
        for last, entries in batches:
            # The look and the append under the locks a delete of the session (or of this
            # transcript) takes: one that runs between two batches claims the orphan (its
            # ticket is in it) before the next look.
            with contextlib.ExitStack() as held:
                held.enter_context(store.locked(main))
                if key != main:
                    held.enter_context(store.locked(key))
                # The session at the name first, the claims after: a delete that took
                # the session seen here (or the orphan) before any session made since
                # could be at the name has claimed the orphan by then (found by review:
                # a lock overtaken between the two looks, the other way round).
                session = _views.looked_up_ino(rfd, itself[2])
                if session is None:
                    return "gone"
                if _views.looked_up_ino(rfd, itself[1]) == itself[0]:
                    return "back"
                # Through listings made afresh, not lookups: a client's caches (GlusterFS
                # about 1 s, sshfs 20 s) can still show what another host's merger took
                # off its name, or not yet a mark it made (found by review: a batch twice).
                if not (_views.refresh_listing(trash) and _views.refresh_listing(tfd)
                        and orphan in _fsio.listdir(trash)):  # its name is its own (random)
                    return "done"  # merged (or taken by its delete) by another merger
                claim = _claimed(store, trash, orphan, names, mark)
                if claim is not None:
                    return {"gone": "done", "claimed": "claimed", "alone": None}[claim]  # alone: skipped
                if merged_name(last) in _fsio.listdir(tfd):
                    continue  # appended by a merge of it that died before removing it

                def into(session_fd: int, session: int = session) -> bool:
                    """Only into the session seen here, and only while nothing is claimed,
                    looked at again once the commit has the directory it goes into:
                    should this lock be overtaken (a stall, a clock ahead), a delete and
                    a session made since (ext4 may give it the same inode number) may
                    come first; a delete after this look marks the session it moves,
                    which the commit's check sees."""
                    return (os.fstat(session_fd).st_ino == session
                            and _claimed(store, trash, orphan, names, mark) is None)

                try:
                    store._append(key, entries, into=into)
                except _commit.Gone:  # why: looked at again
                    claim = _claimed(store, trash, orphan, names, mark)
                    return {"gone": "done", "claimed": "claimed", "alone": None, None: "gone"}[claim]
                os.close(os.open(merged_name(last), os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=tfd))
        return None
    finally:
        os.close(tfd)


def _claimed(store: SyncStore, trash: int, orphan: str, names: list[str], mark: str) -> str | None:
    """``"gone"`` where the orphan is no longer in .trash (merged, or claimed and
    removed, by another process), ``"claimed"`` where a delete has marked it (its
    session's mark, or a subagent orphan's own), ``"alone"`` where it marked only the
    subagent transcript ``names`` of it, else None: through listings made afresh (a
    client's cached lookups may not show what another host did yet)."""
    looks = [([orphan], None), ([orphan, _layout.MAIN] if mark else [orphan], "claimed")]
    if names not in ([], [_layout.MAIN]):
        looks.append(([orphan, *names], "alone"))
    for where, what in looks:
        fd = store._open(trash, [(n, None) for n in where], "delete")
        if fd is None and what is None:
            return "gone"
        if fd is None:
            continue  # no main (a session of subagent transcripts)
        try:
            fresh = _views.refresh_listing(fd)
            if what is None and not fresh:
                return "gone"  # gone on the server: this client still had it
            if what is not None and fresh and _layout.DELETED in _fsio.listdir(fd):
                return what
        finally:
            os.close(fd)
    return None


def merged_name(last: int) -> str:
    """The mark a merge leaves in an orphan's transcript once the batch ending at part
    ``last`` is appended, so that a merge resumed (its merger died: ``fsstore gc``)
    appends each batch once. A temp name: garbage wherever else it ends up."""
    return f"{_fsio.TEMP_PREFIX}merged-{last}"


def _transcripts(
    store: SyncStore, trash: int, orphan: str, comps: list[Component], mark: str,
) -> list[tuple[dict[str, Any], list[str]]]:
    """``(key, directory names below the orphan)`` of each transcript in it."""
    project, session = _part(comps[1]), _part(comps[3])
    if not mark:  # a subagent transcript: .../<S>/subkeys/<SP>
        return [({"project_key": project, "session_id": session, "subpath": _part(comps[5])}, [])]
    found: list[tuple[dict[str, Any], list[str]]] = [
        ({"project_key": project, "session_id": session}, [_layout.MAIN])]
    subkeys = store._open(trash, [(orphan, None), (_layout.SUBKEYS, None)], "delete")
    if subkeys is not None:
        try:
            with os.scandir(subkeys) as entries:
                for entry in entries:
                    sub = _layout.decode_entry(subkeys, entry)
                    if sub is not None:
                        found.append(({"project_key": project, "session_id": session, "subpath": sub},
                                      [_layout.SUBKEYS, entry.name]))
        finally:
            os.close(subkeys)
    return found


def _part(comp: Component) -> str:
    name, original = comp
    part = original if original is not None else _keys.decode(name)
    assert part is not None  # comps come from a parsed key
    return part


def _orphaned(name: str, path: str, exc: BaseException) -> None:
    log.error("a delete moved a transcript made anew after its mark and could not move it "
              "back or merge it (%s): its batches are in .trash/%s, in no load; see "
              "docs/operations.md", exc, name, extra={
                  "code": "DELETE_RACED", "operation": "delete", "path": path})


def _mark(store: SyncStore, parent: int, name: str, path: str, below: str, *, undo: bool = False) -> None:
    """Create (``undo``: remove) ``.deleted`` in the transcript directory
    ``parent/name`` (``below=""``), or for a session in ``parent/name/main`` first
    (made for the mark in a session without a main transcript), then in each of its
    subagent transcripts."""
    base = path.rsplit("/", 1)[0]
    if below:
        top = store._fs.open_dir(parent, [(name, None)], create=False, base_path=base,
                                 operation="delete")
        if top is None:
            return
        try:
            if undo:  # a main made for the mark goes with it (one with parts stays)
                _mark_dirs(store, parent, name, base, below, undo=True)
                with contextlib.suppress(OSError):
                    os.rmdir(below, dir_fd=top)
                return
            made = store._fs.open_dir(top, [(below, None)], create=True, base_path=path,
                                      operation="delete")
            assert made is not None
            os.close(made)
        finally:
            os.close(top)
    _mark_dirs(store, parent, name, base, below, undo=undo)


def _mark_dirs(store: SyncStore, parent: int, name: str, base: str, below: str, *, undo: bool) -> None:
    with _transcript_dirs(store, parent, name, below, base) as tfds:
        for tfd in tfds:
            if undo:
                _fsio.unlink_quiet(tfd, _layout.DELETED)
            else:
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    store._fs.mark(tfd, _layout.DELETED)


@contextlib.contextmanager
def _transcript_dirs(store: SyncStore, parent: int, name: str, below: str, base: str) -> Iterator[list[int]]:
    """The transcript directories of ``parent/name``, open for the ``with`` (all closed
    after it, also on an error): the directory itself, or for a session (``below``: its
    ``main``) main and each subagent transcript's; those that do not exist are left out."""
    dirs = [[name]] if not below else [[name, below]] + [
        [name, _layout.SUBKEYS, sp]
        for sp in store._fs.subdirs_beneath(parent, [name, _layout.SUBKEYS], base, "delete")]
    opened: list[int] = []
    try:
        for names in dirs:
            tfd = store._fs.open_dir(parent, [(n, None) for n in names], create=False,
                                     base_path=base, operation="delete")
            if tfd is not None:
                opened.append(tfd)
        yield opened
    finally:
        for tfd in opened:
            os.close(tfd)
