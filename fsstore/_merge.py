"""Merging back what a delete moved into ``.trash`` by mistake, where another session
(or transcript) was made at its name meanwhile (:mod:`fsstore._delete`, step 4): its
batches are appended, one append a batch, to the one made since, then it is removed.
docs/format.md, "Deletes", has the whole story."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import TYPE_CHECKING, Any

from . import _commit, _delete, _fsio, _keys, _layout, _read, _trash, _views
from ._errors import FsStoreError, log
from ._layout import Component
from ._transcript import Deleted, Vanished, nonced, plan, scan_items, snapshot, whole

if TYPE_CHECKING:
    from ._store import SyncStore

MERGED_TAG = "-merged"  # what a delete moved by mistake, merged back, until it is removed
_TRIES = 3  # of a merge that another process's work there interrupted


def merge_back(store: SyncStore, orphan: str, comps: list[Component], mark: str, path: str) -> str:
    """Append the batches of ``.trash/<orphan>`` (each transcript's, in order, one
    append a file, its bytes as written) to the transcripts at its old name, then
    remove it. A hole (a part its writer took back) is merged past; a file its writer
    took back since the read, or whose bytes the transcript holds already (another
    merger's, whose lock this one took over before its mark), is not appended; a read
    another process's work spoilt is tried again (:data:`_TRIES`).

    Only into the session the look found there (never making it anew:
    :class:`_commit.Gone`), each batch looked at and appended under the locks a delete
    of the session (or of that transcript) takes: a delete that runs meanwhile has
    claimed it by the next look, and the rest are not appended. If the session is gone
    (or being deleted) or this one is back at the name, it is left where it is. Each
    batch appended is written back (``syncfs``) and then marked in the orphan
    (:func:`merged_name`), so a merge resumed by ``fsstore gc`` appends the rest (only
    a batch whose merger died, lost its power or failed between its append and its
    mark twice). Merged whole, it is renamed off its name under the lock before it is
    removed: a merger still going through it stops at its next look, and a removal
    cut short leaves garbage, never an orphan to merge again. So an orphan gone from
    ``.trash`` was merged whole or taken by a later delete (gc never removes one:
    :func:`_trash.holds_batches`).

    Returns how it ended: ``"merged"``; ``"claimed"``, ``"gone"``, ``"back"``,
    ``"done"`` (another process merged or removed it first), as logged; ``"busy"``
    (its session's lock held past the store's lock timeout: another merger's, or a
    writer's; it stays for the next gc); or ``"failed"`` (logged as an error; it
    stays)."""
    stopped: str | None = None
    for attempt in range(_TRIES):
        try:
            stopped = _merge_once(store, orphan, comps, mark, path)
            break
        except FsStoreError as exc:
            if exc.code != "LOCK_TIMEOUT":
                _orphaned(orphan, path, exc)
                return "failed"
            # Another merger (a gc, a delete) or a busy writer holds the session: nothing
            # is wrong; the merge is that merger's, or the next gc's (review: logged as
            # an error while the merge it waited for completed).
            log.warning("the transcript a delete moved by mistake is busy: %s; left for the "
                        "process that holds it, or the next gc", exc, extra={
                            "code": "LOCK_TIMEOUT", "operation": "delete", "path": path})
            return "busy"
        except (OSError, Vanished) as exc:  # Vanished: someone else's work there
            if not _in_trash(store, orphan):
                stopped = "done"  # merged and removed by another merger while this one read it (review)
                break
            if attempt == _TRIES - 1:
                _orphaned(orphan, path, exc)
                return "failed"
            # Another process's work in it, seen through a client's cache (a part its
            # writer took back, a directory another merger renamed): read it again
            # (review 115: left for gc although its deleter had returned).
            time.sleep(0.05 * (attempt + 1))
    log.warning("the transcript a delete moved by mistake is %s", {
        None: "merged into the one made since", "claimed": "deleted by a later delete",
        "gone": "left in .trash: the session was deleted while it was merged (that delete takes it)",
        "back": "back at its name (moved back while it was merged)",
        "done": "merged or deleted by another process meanwhile"}[stopped],
        extra={"code": "DELETE_RACED", "operation": "delete", "path": path})
    return stopped or "merged"

def _merge_once(store: SyncStore, orphan: str, comps: list[Component], mark: str, path: str) -> str | None:
    """One try of :func:`merge_back`: why it stopped (None: merged whole)."""
    stopped: str | None = None
    with store._open_root(create=False) as rfd:
        trash = store._open(rfd, [(_layout.TRASH, None)], "delete") if rfd is not None else None
        if rfd is None or trash is None:
            return "done"
        try:
            ident = os.stat(orphan, dir_fd=trash, follow_symlinks=False).st_ino
            target = (_layout.rel(comps), _layout.rel(comps[:4]))
            main = {"project_key": _part(comps[1]), "session_id": _part(comps[3])}
            transcripts = _transcripts(store, trash, orphan, comps, mark)
            for key, names in transcripts:
                stopped = _merge_transcript(store, rfd, trash, orphan, (ident, *target), names, mark,
                                            main, key, path)
                if stopped is not None:
                    break
            if stopped in (None, "claimed"):
                _fsio.sync_fs(rfd)  # the last mark too: a cut from here appends nothing twice
                # Off its name under the lock first: a merger still going through it
                # stops at its next look, and what a crash leaves is no orphan.
                with store.locked(main):
                    done = _fsio.temp_name(MERGED_TAG)
                    try:
                        os.rename(orphan, done, src_dir_fd=trash, dst_dir_fd=trash)
                    except FileNotFoundError:
                        done, stopped = "", "done"  # another merger's, a step ahead
                if done and stopped is None:
                    _remove_merged(trash, done, orphan, [names for _key, names in transcripts])
                elif done:
                    _fsio.remove_tree(trash, done)  # claimed: all of it a delete's
        finally:
            os.close(trash)
    return stopped


def _remove_merged(trash: int, done: str, orphan: str, merged: list[list[str]]) -> None:
    """Remove ``.trash/<done>``, the orphan merged whole, by the transcripts merged
    (``merged``: their directories below it): one this client did not see is never
    removed unmerged. A GlusterFS client can show a directory another client moved as
    empty, and not find a directory in it by name, for a minute (review 117: a session's
    subagent transcript): the orphan, then not empty, goes back under its name, and
    :class:`Vanished` has it read again (or by the next gc, on a host that sees it)."""
    fd = os.open(done, _fsio.DIR_FLAGS, dir_fd=trash)
    try:
        for names in filter(None, merged):  # (none: the orphan is a subagent transcript itself)
            parent = fd if len(names) == 1 else os.open(names[0], _fsio.DIR_FLAGS, dir_fd=fd)
            try:
                _fsio.remove_tree(parent, names[-1])
            finally:
                if parent != fd:
                    os.close(parent)
        with os.scandir(fd) as entries:  # what is left of it: its files (temp files, parts)...
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    _fsio.unlink_quiet(fd, entry.name)
        with contextlib.suppress(OSError):  # (not empty: the rmdir after it says so)
            os.rmdir(_layout.SUBKEYS, dir_fd=fd)  # ...and subkeys/, where it is empty now
        os.rmdir(done, dir_fd=trash)
    except OSError as exc:
        # Not removed whole (ENOTEMPTY: a transcript not seen; or a failure): back under
        # its name, where what it holds is merged, not taken for garbage.
        os.rename(done, orphan, src_dir_fd=trash, dst_dir_fd=trash)
        raise Vanished(f"{orphan}, merged, still holds what this client did not see in it "
                       f"({exc.strerror})") from exc
    finally:
        os.close(fd)


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
            _views.refresh_listing(tfd)  # a client's cache can still list a part taken back
            seen = whole(snapshot(tfd, f"{path}/{'/'.join(names)}", "delete"))
        except Deleted:
            return "claimed" if _delete.marked(trash, orphan, mark) else None
        if seen.gap is not None:
            # A part its writer took back (it commits the batch anew), or one lost: the rest
            # is merged, as a load returns it (review 115: raised, the orphan was merged by
            # no one, and the acknowledged batches above the hole were in no load).
            log.warning("part %s of what a delete moved by mistake is missing (taken back by "
                        "its writer, or lost); merging the rest", seen.gap, extra={
                            "code": "GAP", "operation": "delete", "path": path})
        read: dict[str, bytes] = {}  # the target's files read so far, in the session seen (read_in)
        read_in: int | None = None
        for (_first, last, name), (_last, entries) in zip(seen.chain, seen.batches):
            # The look and the append under the locks a delete of the session (or of this
            # transcript) takes: one that runs between two batches claims the orphan (its
            # ticket is in it) before the next look.
            with contextlib.ExitStack() as held:
                held.enter_context(store.locked(main))
                if key != main:
                    held.enter_context(store.locked(key))
                # The session at the name first, the claims after: a delete that took the session
                # seen here (or the orphan) before any session made since could be at the name has
                # claimed the orphan by then (review: a lock overtaken between the two looks).
                session = _views.looked_up_ino(rfd, itself[2])
                if session is None:
                    return "gone"
                if session != read_in:  # (a name's bytes never change while its session stays)
                    read, read_in = {}, session
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
                data = seen.data[name]
                if merged_name(last) in _fsio.listdir(tfd) or _taken_back(tfd, name):
                    continue  # appended by a merge of it that died; or taken back by its writer
                if nonced(data) and _there_already(store, rfd, key, data, read):
                    # Appended already by another merger whose lock this one took over before
                    # its mark (a stall): its bytes are there (review 115: twice).
                    os.close(os.open(merged_name(last), os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=tfd))
                    continue
                try:
                    # Its bytes as they were written (each batch's nonce with it): a writer whose
                    # part went with the orphan finds its batch committed by them (review 115:
                    # encoded anew, it was not recognised, and committed again: twice).
                    store._append(key, entries, payload=data, into=functools.partial(
                        _into_seen, store, trash, orphan, names, mark, session))
                except _commit.Gone:  # why: looked at again
                    claim = _claimed(store, trash, orphan, names, mark)
                    return {"gone": "done", "claimed": "claimed", "alone": None, None: "gone"}[claim]
                # The copy survives a power loss before its mark can, whatever the store's
                # fsync: a resumed merge skips a marked batch, and the orphan goes once all
                # are (found by power-loss reviews: marks on disk, copies empty, the
                # batches lost; the copies empty and the orphan gone).
                _fsio.sync_fs(tfd)
                os.close(os.open(merged_name(last), os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=tfd))
        return None
    finally:
        os.close(tfd)

def _into_seen(store: SyncStore, trash: int, orphan: str, names: list[str], mark: str, session: int,
               session_fd: int) -> bool:
    """Whether a merge's batch may go into ``session_fd``: only into the session seen
    (inode number ``session``), and only while nothing is claimed, looked at again once
    the commit has the directory it goes into: should the merger's lock be overtaken (a
    stall, a clock ahead), a delete and a session made since (ext4 may give it the same
    inode number) may come first; a delete after this look marks the session it moves,
    which the commit's check sees."""
    return os.fstat(session_fd).st_ino == session and _claimed(store, trash, orphan, names, mark) is None


def _there_already(store: SyncStore, rfd: int, key: dict[str, Any], data: bytes, read: dict[str, bytes]) -> bool:
    """Whether a file of the transcript ``key`` at its name holds ``data`` (a batch's
    bytes with its nonce: its own): appended by another merger whose lock this one took
    over before its mark. Listed once (under the locks, which keep compactions out), each
    file read once per merge (``read``); a file that cannot be read counts as not
    holding it (appended again, never lost)."""
    dfd = store._open(rfd, _layout.transcript_dirs(_keys.parse_key(key, "delete")), "delete", path_only=True)
    if dfd is None:
        return False
    try:
        _views.refresh_listing(dfd)
        for _first, _last, name in plan(scan_items(dfd))[0]:
            if name not in read:
                try:
                    read[name] = _read.read_file(dfd, name)
                except OSError:
                    continue
            if data in read[name]:
                return True
        return False
    finally:
        os.close(dfd)


def _taken_back(tfd: int, name: str) -> bool:
    """Whether the file ``name`` read from the orphan is gone from it since: its writer
    took the part back (a GlusterFS handle reaches the moved directory) and commits the
    batch anew. Asked of the server by name (a cached listing could miss a file there:
    merged past and removed with the orphan, it would be lost)."""
    try:
        os.stat(name, dir_fd=tfd, follow_symlinks=False)
    except FileNotFoundError:
        return True
    return False


def _in_trash(store: SyncStore, orphan: str) -> bool:
    """Whether ``orphan`` is still in .trash, by a listing made afresh (True where that
    cannot be told: what failed is then said)."""
    try:
        with store._open_root(create=False) as rfd:
            trash = store._open(rfd, [(_layout.TRASH, None)], "delete") if rfd is not None else None
            if trash is None:
                return False
            try:
                return _views.refresh_listing(trash) and orphan in _fsio.listdir(trash)
            finally:
                os.close(trash)
    except (OSError, FsStoreError):
        return True

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

def merge_moved(store: SyncStore, comps: list[Component]) -> list[str]:
    """Merge into the session (or transcript) at the name of transcript ``comps`` what a
    delete moved from that name into ``.trash`` by mistake (unmarked: made anew after
    the delete's mark), listed afresh: for the writer that has made it anew
    (:mod:`fsstore._create`), and for one whose part went with the moved directory
    (:func:`_commit._moved_back_with_it`). How each merge ended (:func:`merge_back`)."""
    with store._open_root(create=False, path_only=True) as rfd:
        trash = store._open(rfd, [(_layout.TRASH, None)], "append") if rfd is not None else None
        if trash is None:
            return []
        try:
            _views.refresh_listing(trash)  # another host's move, which a cached listing hides
            found = [(name, target) for name in _fsio.listdir(trash)
                     if (target := _trash.orphan_target(name, [comps])) is not None
                     and _trash.surely_orphan(trash, name)]
        finally:
            os.close(trash)
    return [merge_back(store, name, where, mark, store._path(where)) for name, (where, mark) in found]


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
              "back or merge it (%s): its batches not merged yet are in .trash/%s, in no load "
              "(the next gc merges them; one appended just before this failure may come "
              "twice); see docs/operations.md", exc, name, extra={
                  "code": "DELETE_RACED", "operation": "delete", "path": path})
