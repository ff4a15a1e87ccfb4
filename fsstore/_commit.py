"""Committing a batch (format 2): the append path, in the order of its steps.

Commit (``append``), step by step, and what a crash at each step leaves:

1. Encode the batch (:func:`_transcript.encode_batch`: one JSON object per line; the
   last line ends with a random nonce written as JSON whitespace). Bad input raises
   ``INVALID_ENTRY`` here, before anything touches disk.
2. Write it to ``.tmp-<pid>-<random>`` in the transcript directory (``O_EXCL``);
   with ``fsync=True``, fsync it. Readers ignore temp files. Crash: a temp file,
   removed by ``fsstore gc`` once old.
3. Take the transcript lock (:mod:`fsstore._lock`). Crash: a lock file, reclaimed
   (a dead holder on this host at once, others by age).
4. Choose ``n``: one above the highest number this process saw at its last
   commit while the file that held it is still there (nothing merged or deleted
   since), else one above the highest of a listing.
5. ``link(temp, n)``: a link never replaces, so a committed file is never
   overwritten, whoever holds the lock. ``EEXIST``: list, ``n`` = highest + 1,
   again (unless only this client still had the name: an open of it that the
   server answers ``ENOENT`` drops it from a FUSE client's cache; then ``n`` again).
6. List the directory twice (the *check*: :func:`check`; a segment in either
   listing counts, since one listing can be torn by a compaction). A segment
   covering ``n`` that does not hold the batch's bytes (its own: the last line ends
   with a nonce, step 1) means that another writer used ``n`` and a compaction
   merged and removed it while this writer's view was old (two holders overlapped:
   a stall, a clock, a reclaimed lock). A part inside
   a segment's range is not in the chain, so the batch is not committed: remove
   the misplaced name, link it again above the highest number, check again. (A
   covering segment that holds the bytes merged this very part after the link:
   committed.) Likewise a part above a hole (``n - 1`` in no file): ``n`` came
   from a stale view (a client cache still showing a file of a directory another
   host deleted and made anew): remove it, and link it again above the highest
   number of the others (never both names at once: above a hole a reader takes
   every part). A ``.deleted`` marker means the transcript is being deleted: remove
   the name, and start over in a new directory; so does a part linked in a directory
   no longer at its name, looked at where the listing does not vouch for it
   (:func:`_unvouched`: gc removed a deleted directory's marks). Otherwise the part is
   in the chain of every listing from now on (a segment made later over its number was made
   from a listing that held it): **the batch is committed**. Crash before the
   check passed: an unacknowledged part, in the chain or skipped; both fine.
7. Unlink the temp name (a second link to the part; crash: gc removes it), move
   the directory's mtime 1 ms past every mtime a reader can have seen before the
   link (:func:`_transcript.tick_mtime`: summaries are current by it), release the lock.
8. With ``fsync=True``, fsync the directory: outside the lock, which orders the
   links and their checks (a fsync under it made the next writer wait for this
   one's journal commit). Compaction may follow (:mod:`fsstore._compact`).

A failed append leaves no part: every name it linked is unlinked before it
raises, or its error says "the batch may be committed" (a name that could not be
unlinked, which ``fsstore check --repair`` commits or removes as a copy; others'
repairs in flight). Errors come out as :class:`~fsstore.FsStoreError` with the
POSIX code.

Why order holds without the lock: numbers are taken first come, first served by
``link``, and a writer only keeps a number above everything committed when it
linked (a free number below the highest is always inside a segment: step 6). Two
overlapping holders may therefore reorder their own batches, nothing else.

A transcript's first batch is committed by making its directory with part 1
already in it (one rename: :func:`_create.first_commit`); an append to a session another
host deleted makes it anew (:func:`_create.recreate`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import _create, _delete, _fsio, _layout, _merge, _read, _transcript, _views
from ._errors import FsStoreError, from_oserror, log, posix_code
from ._keys import TranscriptKey
from ._layout import Component
from ._transcript import (
    Deleted,
    Item,
    check_session_marker,
    covering_segment,
    top,
)

if TYPE_CHECKING:
    from ._lock import Held
    from ._store import SyncStore

# An append whose transcript directory is deleted under it starts over this often.
_APPEND_ATTEMPTS = 50


@dataclasses.dataclass(eq=False)
class Appending:
    """One transcript as a process that appends to it remembers it between appends:
    the key validated and its paths worked out once, and where the next part goes."""

    key: TranscriptKey
    comps: list[Component]
    path: str  # <root>/<rel>, for messages
    lock_path: str  # <root>/.locks/<lock name>
    session_marker: str | None  # see _layout.session_marker
    # One above the highest number this process saw at its last commit, and the name
    # of the file that held it: while that file is still there, no compaction merged
    # it and no delete took the directory (a directory made anew can even reuse the
    # inode), so the number is still the next one or a link to it finds EEXIST.
    next_seq: int = 0
    last_name: str | None = None


def _last_of(items: list[Item]) -> tuple[int, str | None]:
    """One above the highest number of a listing, and the name of a file holding it."""
    last = max(items, key=lambda it: it[1], default=None)
    return (1, None) if last is None else (last[1] + 1, last[2])


# -- steps 2 to 8 ------------------------------------------------------------------


class PartLeft(FileNotFoundError):
    """The transcript directory went away after the batch's part was linked in it: the
    part may have gone with it (see :func:`_moved_back_with_it`)."""


class Gone(Exception):
    """``append(..., into=...)``: that session is not at the name (or is being deleted);
    nothing was committed."""


def append(
    store: SyncStore, t: Appending, payload: bytes, *, into: Callable[[int], bool] | None = None,
) -> None:
    """Commit ``payload`` (step 1 done) to ``t``, starting over where a delete took
    its directory away (see :func:`_delete.finish`). ``into``: only into the session
    at the name (the transcript may be new in it) and only if ``into`` says yes to its
    directory (a descriptor), asked once the commit holds the directory it goes into;
    raise :class:`Gone` instead of finishing a delete or making the session, or where
    ``into`` says no. For the merge of a session a delete moved by mistake
    (:func:`_merge.merge_back`): its batches are a deleted session's, and its
    caller's lock may have been overtaken since it looked."""
    for attempt in range(_APPEND_ATTEMPTS):
        try:
            try:
                _append_once(store, t, payload, into)
                return
            except Deleted as exc:
                if into is not None:
                    raise Gone(t.path) from exc
                # A delete is committed once marked: finish it (its deleter may have died)
                # and start over in a new directory. Nothing of ours is visible. Not under
                # our lock: finishing takes the lock of what it moves (the session's).
                _delete.finish(store, t.comps, t.path, session=exc.session)
                if exc.left and _moved_back_with_it(store, t, payload):
                    return
            # Where this client still reaches the deleted directory by its path.
            with contextlib.suppress(Deleted):
                if _create.recreate(store, t, payload):
                    return
        except PartLeft:  # moved away with our part in it: where is it now?
            if into is None and _moved_back_with_it(store, t, payload):
                return
        except FileNotFoundError:
            pass  # moved away by a delete before our commit: start over
        except OSError as exc:
            if exc.errno != errno.ESTALE or attempt == _APPEND_ATTEMPTS - 1:
                raise
            # NFS: a directory another host replaced (deleted and made anew) since this
            # client looked it up; looked up again next time (also where it was replaced
            # again while this append made it anew: stop 37, 2 of 4,786 on GlusterFS).
        t.last_name = None
        time.sleep(min(0.001 * attempt, 0.05))
    raise FsStoreError("ENOENT", "transcript directory kept disappearing (concurrent deletes)",
                       operation="append", path=t.path, errno=errno.ENOENT)


def _moved_back_with_it(store: SyncStore, t: Appending, payload: bytes) -> bool:
    """Whether the batch is committed after all, after an attempt whose directory went
    away with its part in it, out of reach (:class:`PartLeft`, ``Deleted.left``). A
    delete that moved a directory made anew after its mark (not marked) moves it back,
    and the part comes back with it: where handles go by path (sshfs) the attempt could
    not reach it to take it back (review 112: the batch twice, or hidden in .trash until
    merged into a session made since). What a delete moved by mistake is moved back
    here (``.trash`` listed afresh), and the transcript at the name is read as a load
    reads it: the batch in its chain is committed. Where another session is at the
    name, the directory is merged into it, our part with it (:func:`_merge.merge_moved`:
    a merge appends the bytes as written), and the chain is read again: there, it is
    committed; not there (a delete claimed the directory; it went before), False: the
    append commits it anew. Where the merge could not be done (busy, failed), the
    append says its batch may be committed (review 114). Only then: reading a
    directory a delete on this client is emptying is what crashes sshfs 3.7's client (a
    ``NULL`` path in its cache: see docs/operations.md)."""
    try:
        with store._open_root(create=False, path_only=True) as rfd:
            if rfd is None:
                return False
            trash = store._open(rfd, [(_layout.TRASH, None)], "append", path_only=True)
            if trash is not None:  # listed afresh: another host's move, which sshfs's cache hides
                _views.refresh_listing(trash)
                os.close(trash)
            _delete.restore(store, rfd, t.comps)
            seen = _chain_at_the_name(store, rfd, t)
            if seen is None:
                return False  # not there, being deleted, or changing: the next start-over looks
            if not _in_chain(seen, payload):
                t.last_name = None
                ended = _merge.merge_moved(store, t.comps)
                seen = _chain_at_the_name(store, rfd, t)
                if not _in_chain(seen, payload):
                    if {"busy", "failed"} & set(ended):
                        busy = "busy" in ended
                        raise FsStoreError("LOCK_TIMEOUT" if busy else "EAGAIN",
                                           "its part went with its directory, which a delete moved by "
                                           "mistake, and that directory could not be merged now: the batch "
                                           "may be committed", operation="append", path=t.path,
                                           errno=None if busy else errno.EAGAIN)
                    return False
            assert seen is not None
            t.next_seq, t.last_name = _last_of(seen.items)
            return True
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ESTALE):
            raise
        return False


def _chain_at_the_name(store: SyncStore, rfd: int, t: Appending) -> _transcript.Snapshot | None:
    """The transcript at ``t``'s name read as a load reads it (listed afresh); None where
    nothing is there, it is being deleted, or it kept changing."""
    dfd = store._open(rfd, t.comps, "append", path_only=True)  # no handle to keep open
    if dfd is None:
        return None
    try:
        for _try in range(_transcript.UNLOCKED_READS):
            _views.refresh_listing(dfd)
            seen = _transcript.snapshot(dfd, t.path, "append", session_marker=t.session_marker)
            if seen.race is None:
                break
    finally:
        os.close(dfd)
    return seen if seen.race is None and seen.deleted is None else None


def _in_chain(seen: _transcript.Snapshot | None, payload: bytes) -> bool:
    return seen is not None and seen.holding(payload) is not None


def _append_once(store: SyncStore, t: Appending, payload: bytes, into: Callable[[int], bool] | None) -> None:
    """Steps 2 to 8 (the first batch of a transcript: :func:`_create.first_commit`)."""
    op = "append"
    with store._open_root(create=False, path_only=True) as rfd:
        dfd = store._open(rfd, t.comps, op, path_only=True) if rfd is not None else None
        if into is not None and rfd is None:
            raise Gone(t.path)
        if into is not None and dfd is not None:
            _only_into(dfd, t, into)  # (a transcript new in the session: its first commit asks)
        elif into is None and dfd is None and rfd is not None and _delete.restore(store, rfd, t.comps):
            raise FileNotFoundError(errno.ENOENT, "moved back just now: look again", t.path)
    if dfd is None:
        with store._open_root(create=True, path_only=True) as rfd:
            assert rfd is not None
            try:
                made = _create.first_commit(store, rfd, t, payload, into)
            except FileNotFoundError:
                # A directory of the path (the session's, another host deleted it) still
                # opens here but is gone on the server, so making one in it fails: sshfs
                # keeps the name for seconds, past every start-over (found by review:
                # 65 of 1,733 appends ran out of attempts). As for a part's temp file:
                if into is not None:
                    raise
                made = _create.recreate(store, t, payload)
            if made:
                return
        raise FileNotFoundError(errno.ENOENT, "created and deleted meanwhile", t.path)
    try:
        tmp = _fsio.temp_name()
        try:  # the temp file's cleanup covers its making: an interrupt there leaves none
            try:
                # The directory as it was: the temp file's creation can move its mtime back
                # (a coarse clock behind the last commit's tick: see _transcript.tick_mtime).
                before = os.fstat(dfd)
                store._fs.write_new(dfd, tmp, payload)
            except (FileNotFoundError, FileExistsError) as exc:
                # Gone on the server while its path still opens here (another host deleted
                # it; sshfs keeps names longer than attributes). A new random name cannot
                # exist: EEXIST is how a GlusterFS client answers for a directory another
                # client just moved away (a delete), like ENOENT.
                tmp = ""
                if into is not None:
                    raise Gone(t.path) from exc
                if _create.recreate(store, t, payload):
                    return
                raise FileNotFoundError(errno.ENOENT, "transcript directory gone", t.path) from exc
            store._locks_dir(op)
            with store._locks.hold(t.lock_path, op) as held:
                now = os.fstat(dfd)  # after any commit that came before ours
                remembered, seq = t.last_name, _next_seq(t, dfd)
                held.check(op)
                seq, items = link_and_check(store._fs, dfd, tmp, seq, payload, t.session_marker)
                if _unvouched(seq, items, remembered):
                    at_its_name_or_taken_back(store, t, dfd, seq, payload)
                t.next_seq, t.last_name = _last_of(items)
                tmp = _drop_temp(dfd, tmp, t.path)
                since_ns = max(before.st_mtime_ns, now.st_mtime_ns)  # (after the unlink: it stamps)
                after_commit(t, lambda: _tick(dfd, since_ns, held), "the directory's "
                             "mtime tick failed (%s): a summary made just before may look current")
            # Not the lock's to cover (it orders the links and their checks): a fsync under
            # it made the next writer wait for this one's journal commit.
            after_commit(t, lambda: store._fs.sync_dir(dfd),
                         "the directory fsync failed (%s): it may not survive a power loss")
        finally:
            if tmp:
                _drop_temp(dfd, tmp, t.path)
    finally:
        os.close(dfd)
    if _compaction_due(store, items):
        store._compactions.soon(store, t.key)  # after the append, in a thread of its own; never raises


def _unvouched(seq: int, items: list[Item], remembered: str | None) -> bool:
    """Whether nothing in the check's listing (``items``) shows that the directory is a
    live transcript, not a deleted one whose marks gc has removed (it removes a deleted
    directory's marks after everything else in it, and puts them back where its rmdir
    then finds a file made meanwhile: a writer that stalled past gc's threshold, or whose
    client still resolves the old path, can check in between). A file from before the
    delete shows it: the file this writer remembered from its last commit here, or a
    segment. Without either (a writer's first append to a transcript never compacted;
    part 1 linked, which only a directory holding no committed file lets happen: a live
    transcript's first batch comes with its directory, but a power loss can empty one;
    or a killed writer's part left in the tomb), the writer looks."""
    names = {name for _f, _l, name in items} - {_layout.part_name(seq)}  # (ours is new)
    return seq == 1 or (remembered not in names and all(f == last for f, last, _n in items))


def at_its_name_or_taken_back(store: SyncStore, t: Appending, dfd: int, seq: int | None,
                              payload: bytes, up: int = 0) -> None:
    """Step 6's last look where the listing does not vouch for the directory
    (:func:`_unvouched`): committed where it is still the one its path names on the
    server; else part ``seq`` is taken back, and :class:`Deleted`: the append starts over
    at the name. ``up``: ``dfd`` is the directory that many levels above the transcript's.
    Where handles go by path (sshfs), ``dfd`` names whatever is at the path now: so the
    part must be there, holding this batch (its bytes are its own), for the batch to be
    committed (review 113: a directory made anew at the name passed for the one the part
    was linked in, which a delete had emptied), and only such a file is taken back
    (:func:`_moved_back_with_it` looks for it where it went)."""
    comps = t.comps[: len(t.comps) - up]
    try:
        with store._open_root(create=False, path_only=True) as rfd:
            moved = tuple(i for i in _layout.moved_by_deletes(t.comps) if i < len(comps))
            here = rfd is not None and _views.at_its_name(rfd, comps, dfd, moved)
        ours = seq is None or _holds(dfd, _layout.part_name(seq), payload) is True
    except OSError as exc:
        raise may_be_committed(exc, t.path, "whether its directory is still the transcript's "
                               "could not be told") from exc
    if here and ours:
        return
    if seq is not None and ours:
        _fsio.unlink_quiet(dfd, _layout.part_name(seq))
    # Taken back or out of reach, the part may have been copied before: a merge of the
    # moved directory appends its bytes as written (review 116: where a handle follows
    # the move, the part was taken back after that copy, and the batch came twice).
    raise Deleted(t.path, left=True)


def _tick(dfd: int, since_ns: int, held: Held) -> None:
    """Step 7's mtime tick; past the storage's now where it came past the lease."""
    _transcript.tick_mtime(dfd, since_ns)
    if time.monotonic() - held.since > held.budget:
        _transcript.past_now(dfd)


def _only_into(dfd: int, t: Appending, into: Callable[[int], bool]) -> None:
    """:class:`Gone` (``dfd`` closed) unless ``into`` says yes to the session directory
    holding the transcript directory ``dfd``. Past this, a delete of that session
    marks it before moving it: the commit's check sees the mark (step 6)."""
    up = "/".join([".."] * (len(t.comps) - 4))  # main -> <S>; subkeys/<SP> -> <S>
    session = os.open(up, _fsio.PATH_FLAGS, dir_fd=dfd)
    try:
        if into(session):
            return
    finally:
        os.close(session)
    os.close(dfd)
    raise Gone(t.path)


def _next_seq(t: Appending, dfd: int) -> int:
    """Where this process's next part goes (step 4 of the commit)."""
    if t.last_name is not None:
        try:
            os.stat(t.last_name, dir_fd=dfd, follow_symlinks=False)
            return t.next_seq
        except FileNotFoundError:
            pass
    t.next_seq, t.last_name = _last_of(_transcript.scan_items(dfd))
    return t.next_seq


# How often a commit that landed above a hole links again lower (a client whose cache
# still names files that are gone can refuse every lower number: sshfs's 20 s cache).
_HOLE_RETRIES = 2
# How often a commit's check looks again for the segment over its part that went before
# it could be read (each time a compaction's doing).
_COVER_READS = 8
# How often a link refused for a name the server no longer has is tried again (see
# _views.forgot_stale_name): a bound, should a client keep refusing it.
_FORGET_RETRIES = 8
# s: how long a writer whose batch lost its names waits for a repair's copy of it to be
# committed or removed (a stalled repair: found by review, 0.36 s gave up on it, and a
# caller's retry then had the batch twice).
_COPY_WAIT = 30.0


def link_and_check(
    fs: _fsio.Fs, dir_fd: int, tmp: str, seq: int, payload: bytes,
    session_marker: str | None = None,
) -> tuple[int, list[Item]]:
    """Give the temp file ``tmp`` (holding ``payload``) a part name from ``seq`` on (steps
    5 and 6); return its number and the listing that checked it. Raises :class:`Deleted`
    (the directory is being deleted), FileNotFoundError (it or the batch vanished: nothing
    committed, the caller starts over), FsStoreError "may be committed" (cannot tell)."""
    misplaced: list[str] = []  # linked by us, not committed: removed on the way out
    relinked: set[str] = set()  # ours, removed already (a cached listing may still show them)
    passed: list[str] = []  # a repair's misplaced links: removed once the batch is committed
    kept: list[str] = []  # our misplaced links that could not be removed (EIO)
    src, holes, forgotten = tmp, 0, 0
    try:
        while True:
            name = _layout.part_name(seq)
            try:
                linked = _fsio.link_noreplace(fs, dir_fd, src, name)
            except FileNotFoundError as exc:  # our names went: a repair may have committed it
                if not (relinked or kept or src != tmp):
                    raise
                if (found := _found(dir_fd, payload)) is None:
                    # The directory went after our part was linked in it: a merge of it (a
                    # delete moved it by mistake) may have copied the part (review 116).
                    raise PartLeft(errno.ENOENT, "the directory went away after the link", name) from exc
                return found
            if linked is None and forgotten < _FORGET_RETRIES and _views.forgot_stale_name(dir_fd, name):
                forgotten += 1
                continue  # a name another host removed, which only this client still had
            if linked is None:  # taken: our view was old; a client cache may be too (sshfs)
                _views.refresh_listing(dir_fd)
                seq = max(seq, top(_transcript.scan_items(dir_fd))) + 1
                continue
            if not linked:
                src = name  # moved, not linked (a mount without hard links)
            try:
                checked = _check_holding(dir_fd, seq, session_marker, payload)
            except BaseException as exc:
                misplaced.append(name)  # not committed: the check did not pass
                if isinstance(exc, FileNotFoundError):
                    raise PartLeft(errno.ENOENT, "the directory went away after the link", name) from exc
                raise
            if checked is None:
                raise FsStoreError("EAGAIN", f"the segments over part {seq} kept vanishing (compactions); the "
                                   "batch may be committed", operation="append", path=name, errno=errno.EAGAIN)
            items, cover, merged = checked
            others = [it for it in items if it[2] != name and it[2] not in relinked]
            hole = seq > 1 and not any(f <= seq - 1 <= last for f, last, _n in others)
            if merged or (cover is None and (not hole or holes >= _HOLE_RETRIES)):
                # In the chain (past the retries: a client naming gone files), or merged.
                for old in passed:
                    _removed(dir_fd, old)  # (left: a copy, which the next repair removes)
                return seq, items
            holes += cover is None
            # Not in the chain: inside a compacted range (two lock holders overlapped, or a client
            # cache, sshfs's, still showed a compacted file), or above a hole (a number taken from
            # a stale view: a client cache still showing a file of a directory made anew).
            _relocating(name, inside=cover is not None)
            # Inside a segment's range no reader takes it: a repair links onward from it
            # (its source is a writer's, who may remove it), a writer removes it or, where
            # it cannot (EIO), leaves a copy for the repair. Above a hole a reader takes
            # every part: gone before the batch is linked again (all found by review).
            if linked and cover is not None and not tmp.startswith(_fsio.TEMP_PREFIX):
                passed.append(name)
                src = name
            elif linked and cover is not None:
                (relinked.add if _removed(dir_fd, name) else kept.append)(name)
            elif linked:
                misplaced.append(name)
                _fsio.unlink_quiet(dir_fd, name)
                misplaced.remove(name)
                relinked.add(name)
            seq = top(others) + 1
    except (OSError, FsStoreError) as exc:
        if kept and "may be committed" not in str(exc):
            raise may_be_committed(exc, kept[0], f"{kept[0]}, a misplaced copy of the batch, could "
                                   "not be removed (fsstore check --repair commits it)") from exc
        raise
    finally:
        _remove_unchecked(dir_fd, misplaced)


def _relocating(name: str, *, inside: bool) -> None:
    log.warning("part %s landed %s; committing it again", name,
                "inside a compacted range (a stale view: lock holders overlapped, or a client "
                "cache still showed a compacted file)" if inside
                else "above a hole (a stale view of the directory)", extra={
                    "code": "RELOCATED", "operation": "append", "path": name})


def _remove_unchecked(dir_fd: int, names: list[str]) -> None:
    """Unlink the parts an append linked and did not check. One that stays is where a
    reader may take it: the append cannot say nothing of it is committed (review)."""
    for name in names:
        if not _removed(dir_fd, name):
            raise FsStoreError("EIO", f"{name}, linked and not checked, could not be removed; "
                               "the batch may be committed", operation="append", path=name,
                               errno=errno.EIO)


def may_be_committed(exc: OSError | FsStoreError, path: str, why: str) -> FsStoreError:
    """The error of an append that fails where its batch may be committed (``why``): after
    a misplaced copy of it could not be removed (`check --repair` commits that copy once
    old), or after its new directory was published. It can neither say that nothing of
    it is committed nor start over (found by review: committed twice after a retry, or
    after the writer started over)."""
    err = exc if isinstance(exc, FsStoreError) else from_oserror(exc, "append", path)
    return FsStoreError(err.code, f"{err.message}; {why}: the batch may be committed",
                        operation="append", path=path, errno=err.errno)


def _removed(dir_fd: int, name: str) -> bool:
    """Unlink a name of ours; False where that failed (EIO, say), not where it is gone."""
    try:
        _fsio.unlink_quiet(dir_fd, name)
    except OSError:
        return False
    return True


def _check_holding(
    dir_fd: int, seq: int, session_marker: str | None, payload: bytes,
) -> tuple[list[Item], str | None, bool] | None:
    """The check of part ``seq`` (:func:`check`: the listing and the segment over it, if
    any) and whether that segment holds ``payload`` (it merged our part after the link);
    None where the segments over it kept vanishing before they were read."""
    for _read_attempt in range(_COVER_READS):
        items, cover = check(dir_fd, seq, session_marker)
        merged = cover is not None and _holds(dir_fd, cover, payload)
        if merged is not None:
            return items, cover, merged
        # The segment went before it was read: merged into a bigger one, or removed by
        # its compaction, which lost to an overlapping one (found by review: our part, in
        # the chain or merged, was taken for misplaced: a gap, or the batch twice).
        # Looked at again.
        _views.refresh_listing(dir_fd)
    return None


def _found(dir_fd: int, payload: bytes) -> tuple[int, list[Item]] | None:
    """Where a batch that was linked (misplaced) and then lost both its names is
    committed now, if anywhere: ``check --repair`` commits a misplaced batch again
    once no temp file holds it, which ``fsstore gc`` on a host whose clock runs ahead
    can have removed (found by review: the writer, taking the vanished names for a
    delete, started over: the batch twice). A repair links the batch above before it
    unlinks the misplaced name, so that link, or a segment merging it, is there.

    The transcript is read as a load reads it (a snapshot: a compaction during the
    read means reading again; found by review, one listing missed the repair's link
    and the batch was there twice). Only a file of the chain counts (a repair's link
    can itself be misplaced, and be removed by its check: found by review, the batch
    lost); a copy outside it means the repair is not done: looked at again. None:
    nothing of the batch is committed, and its writer starts over. Rare: it reads
    the whole transcript."""
    deadline = time.monotonic() + _COPY_WAIT
    look = 0
    while look == 0 or time.monotonic() < deadline:
        look += 1
        _views.refresh_listing(dir_fd)
        seen = _transcript.snapshot(dir_fd, "", "append")
        if seen.race is not None:
            continue
        if (last := seen.holding(payload)) is not None:
            return last, seen.items
        taken = {name for _f, _l, name in seen.chain}
        try:
            copied = any(payload in _read.read_file(dir_fd, name)
                         for first, last, name in seen.items if first == last and name not in taken)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ESTALE):  # ESTALE: another host removed it
                raise
            continue
        if not copied:
            return None
        time.sleep(min(0.5, 0.01 * 2 ** min(look, 6)))
    raise FsStoreError("EAGAIN", "the batch's names were removed by others (gc, check --repair) "
                       f"and for {_COPY_WAIT:g} s it was neither committed nor gone (a repair's "
                       "copy in flight, or compactions); it may be committed: it is once a "
                       "repair commits that copy", operation="append", errno=errno.EAGAIN)


def _holds(dir_fd: int, name: str, payload: bytes) -> bool | None:
    """Whether the file ``name`` holds ``payload``; None where it is gone."""
    try:
        return payload in _read.read_file(dir_fd, name)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ESTALE):  # ESTALE: another host removed it
            return None
        raise


def check(dir_fd: int, seq: int, session_marker: str | None) -> tuple[list[Item], str | None]:
    """The commit's check of part ``seq``: the listing, and a segment whose range holds
    ``seq`` (None: the part is in the chain); :class:`Deleted` if marked.

    Two listings, and a segment in either counts: one listing that takes several
    ``getdents`` calls can miss a segment that a compaction made behind its cursor
    while removing, ahead of it, the segment it replaced (found by review: a stale
    writer then took its misplaced part for committed). A segment made over ``seq``
    exists for the whole of the second listing unless yet another compaction
    replaces it during it."""
    first, deleted, pruning = _transcript.scan_marks(dir_fd)
    again, deleted_again, pruning_again = _transcript.scan_marks(dir_fd)
    if pruning or pruning_again:
        # A prune's marks, not committed: this batch wins (that prune keeps the session),
        # unless the prune committed first (its mark renamed to .deleted).
        _delete.cancel_prunes(dir_fd, sorted({*pruning, *pruning_again}),
                              None if session_marker is None else os.path.dirname(session_marker))
        deleted = deleted or _read.mark_there(dir_fd, _layout.DELETED)
    check_session_marker(dir_fd, session_marker)  # first: the session's delete, if it is one
    if deleted or deleted_again:
        raise Deleted(_layout.part_name(seq))
    cover = covering_segment(first, seq) or covering_segment(again, seq)
    return again, cover


def _drop_temp(dfd: int, tmp: str, path: str) -> str:
    """Unlink a batch's temp name; a failure is logged (gc takes the name), not raised:
    after the commit point the SDK would retry a committed batch, and on a failed append's
    way out it would take the place of why the append failed. Returns ``""``."""
    try:
        _fsio.unlink_quiet(dfd, tmp)
    except OSError as exc:
        log.warning("temp file left: %s", exc, extra={
            "code": "TEMP_LEFT", "operation": "append", "path": f"{path}/{tmp}"})
    return ""


def after_commit(t: Appending, step: Callable[[], None], failed: str) -> None:
    """``step()``, after the commit point: a failure is logged (``failed`` % the error),
    never raised. The batch is committed; raising now would make the SDK retry it, and a
    retried batch is stored twice (entries without a uuid are not de-duplicated). A
    directory gone meanwhile (ENOENT, ESTALE: deleted since the commit) has nothing left
    to tick or fsync: no error (review 113: logged as one)."""
    try:
        step()
    except (OSError, FsStoreError) as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOENT, errno.ESTALE):
            log.debug("after the commit, the directory was gone: %s", exc)
            return
        code = exc.code if isinstance(exc, FsStoreError) else posix_code(exc.errno)
        log.error("batch committed and visible, but " + failed, exc,
                  extra={"code": code, "operation": "append", "path": t.path, "errno": exc.errno})


def _compaction_due(store: SyncStore, items: list[Item]) -> bool:
    """Whether the check's listing (``items``) shows ``compact_every`` parts after the
    last segment: then compaction follows, once the append has returned
    (:mod:`fsstore._autocompact`)."""
    if not store._compact_every:
        return False
    compacted = max((last for first, last, _ in items if first != last), default=0)
    return sum(1 for first, last, _ in items if first == last and first > compacted) >= store._compact_every
