"""A transcript's first batch: its directory made with part 1 already in it and
renamed into place (one rename), so no reader or listing ever sees a transcript
without a part (docs/format.md, "A new transcript"); and a transcript made anew where
this client still reaches a deleted one by its path. The commit of every later batch
is :mod:`fsstore._commit`'s."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import _commit, _delete, _fsio, _layout, _merge, _views
from ._layout import Component
from ._transcript import Deleted, check_session_marker

if TYPE_CHECKING:
    from ._store import SyncStore


def first_commit(
    store: SyncStore, rfd: int, t: _commit.Appending, payload: bytes, into: Callable[[int], bool] | None,
) -> bool:
    """Commit the first batch of a new transcript: its directory appears with part
    1 already in it (one rename), so no reader or listing ever sees a transcript
    without a part. False if another writer's directory appeared first. ``into``:
    only in that session (see :func:`_commit.append`), never making it."""
    if into is None:
        parent = store._open(rfd, t.comps[:-1], "append", create=True, path_only=True)
    else:
        session = store._open(rfd, t.comps[:4], "append", path_only=True)
        if session is None or not into(session):
            if session is not None:
                os.close(session)
            raise _commit.Gone(t.path)
        try:
            parent = store._open(session, t.comps[4:-1], "append", create=True, path_only=True)
        finally:
            os.close(session)
    assert parent is not None
    name, original = t.comps[-1]
    try:
        store._locks_dir("append")
        with store._locks.hold(t.lock_path, "append") as held:
            held.check("append")
            made = store._fs.new_dir(parent, name, original, _filler(store, [], payload))
            if made:
                _published(store, t, parent, [name], payload)
    finally:
        os.close(parent)
    if made and into is None:  # (a merge's own appends: it is the merger)
        _merge_what_was_moved(store, t)
    return made


def recreate(store: SyncStore, t: _commit.Appending, payload: bytes) -> bool:
    """Commit the batch as part 1 of the transcript made anew where its directory is
    gone on the server while its path still opens here: another host deleted the
    session and this client answers from a cache (sshfs keeps names 20 s; mkdir
    there says EEXIST; a GlusterFS client keeps reaching the moved directory while
    it uses it, see _views.listed_dir). The missing part of the path is made under a temp name,
    part 1 inside, and renamed over the stale name (a rename reaches the server).
    False if nothing is missing there (the caller starts over)."""
    with store._open_root(create=True, path_only=True) as rfd:
        assert rfd is not None
        i, fd = _views.gone_level(rfd, t.comps)
        try:
            if i == len(t.comps):
                return False
            name, original = t.comps[i]  # gone on the server: comps[i:] made anew
            store._locks_dir("append")
            with store._locks.hold(t.lock_path, "append") as held:
                def make() -> bool:
                    held.check("append")
                    return store._fs.new_dir(fd, name, original, _filler(store, t.comps[i + 1:], payload))
                # A GlusterFS brick that linked the deleted directory under its name again
                # refuses a rename onto it (review, stop 36: ESTALE after another host's prune).
                made = _views.rename_onto(fd, name, make)
            if made:
                _published(store, t, fd, [n for n, _ in t.comps[i:]], payload)
                _merge_what_was_moved(store, t)
            elif _views.listings_number_alike(rfd, _layout.PROJECTS):
                # Another directory is there on the server, and this client reaches the
                # old one: its view lapses once unused (GlusterFS: about 1 s). Not
                # touching it meanwhile is what lets it lapse.
                time.sleep(_views.STALE_VIEW_PAUSE)
            return made
        finally:
            os.close(fd)


def _merge_what_was_moved(store: SyncStore, t: _commit.Appending) -> None:
    """Once the transcript is made anew at its name (its first batch committed): what a
    delete moved from that name into ``.trash`` by mistake (unmarked: made anew after
    the delete's mark) is merged into it now (:func:`_merge.merge_moved`), not hidden
    until its deleter resumes or ``fsstore gc`` runs. The look before making it
    (:func:`_delete.restore`) moves such a directory back instead, but it misses one
    moved after it, by a deleter that then stalled or died, and one a client's cached
    listing of ``.trash`` does not show yet (sshfs: 20 s): review 114's runs. Its batches
    come after this one. A failed look is logged; the batch is committed."""
    def merge() -> None:
        _merge.merge_moved(store, t.comps)

    _commit.after_commit(t, merge, "the look in .trash for what a delete moved from its name by "
                         "mistake failed (%s): that stays there, out of loads, until the next gc")


def _filler(store: SyncStore, comps: list[Component], payload: bytes) -> Callable[[int], object]:
    """What :meth:`_fsio.Fs.new_dir` writes into a new directory: the directories
    ``comps`` below it (each with its ``.key`` where hashed), part 1 in the last."""
    def fill(dir_fd: int) -> None:
        if not comps:
            store._fs.write_new(dir_fd, _layout.part_name(1), payload)
            return
        (name, original), below = comps[0], _filler(store, comps[1:], payload)
        os.mkdir(name, store._fs.dir_mode, dir_fd=dir_fd)
        sub = os.open(name, _fsio.DIR_FLAGS, dir_fd=dir_fd)
        try:
            store._fs.fix_mode(sub)
            if original is not None:
                store._fs.write_new(sub, _fsio.KEY_FILE, original.encode("utf-8"))
            below(sub)
        finally:
            os.close(sub)
    return fill


def _published(store: SyncStore, t: _commit.Appending, parent: int, names: list[str], payload: bytes) -> None:
    """After ``parent/names[0]`` (part 1 in it) was renamed into place, nothing starts the
    append over (review: committed twice): :class:`Deleted` (its session marked; or its
    part 1, where it is not at its name, taken back or out of reach: ``left``), a failed
    check "may be committed", a failed fsync logged (step 8)."""
    try:
        _check_made(parent, names, t)
        made = os.open("/".join(names), _fsio.PATH_FLAGS, dir_fd=parent)
    except FileNotFoundError as exc:  # a delete took it since (review 103): not at its name
        raise Deleted(t.path, left=True) from exc  # (part 1 with it)
    except OSError as exc:
        if exc.errno == errno.ESTALE:  # where it was published is removed on the server?
            _commit.at_its_name_or_taken_back(store, t, parent, None, b"", len(names))
        raise _commit.may_be_committed(exc, t.path, "its batch was published as the transcript's "
                                       "first and could not be checked (retrying is safe with uuids)") from exc
    try:  # nothing from before vouches for a new directory: a session gc is removing can take it
        _commit.at_its_name_or_taken_back(store, t, made, 1, payload)
    finally:
        os.close(made)
    _commit.after_commit(t, lambda: store._fs.sync_dir(parent),
                         "the directory fsync failed (%s): it may not survive a power loss")
    t.next_seq, t.last_name = 2, _layout.part_name(1)


def _check_made(fd: int, names: list[str], t: _commit.Appending) -> None:
    """:class:`Deleted` if the subagent transcript just published at ``fd/names...``
    belongs to a session marked deleted: a session delete that marked it before the new
    directory appeared moves it away with the session (here the append finishes that
    delete, :func:`_commit.append`), so nothing of it is kept. What was made is not removed
    here: a removal goes by name, and where names go by path (sshfs) the name can be
    another's by then, a new session another host made and appended to (review 111:
    acknowledged batches so removed)."""
    if t.session_marker is None:
        return
    marker = "/".join([*names, t.session_marker])
    # A prune marks only the subagent transcripts it found: it commits in main/.
    _delete.cancel_prunes_in(fd, os.path.dirname(marker))
    check_session_marker(fd, marker)
