"""Cleaning a live store up: ``fsstore gc``, ``prune`` and ``compact``.

Each returns the :class:`Action` s it took (or, with ``dry_run``, would take). The
only deletions are:

* temp files, ``.trash`` entries and lock-recovery leftovers older than a threshold
  (:func:`gc`), aged by the later of mtime and ctime, and looked at again just
  before removal;
* lock files older than a threshold, through the store's own
  :func:`fsstore._reclaim.reclaim`, which never removes a marker someone
  re-took (:func:`gc`);
* whole sessions, through ``SyncStore.delete_unless`` (a mark, then an atomic rename
  into ``.trash``) under the lock of every transcript of the session, after a last
  look made once the session is marked (:func:`prune`);
* what ``SyncStore.compact`` merges (:func:`compact`).

Nothing that could not be looked at is removed, nor anything younger than the
threshold: that is in-flight work.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from typing import Any

from . import _delete, _fsio, _keys, _layout, _merge, _trash
from ._errors import FsStoreError, posix_code
from ._layout import Component
from ._lockfiles import LockInfo, name_locks, scan_locks
from ._output import age_text, iso_ns
from ._reclaim import reclaim
from ._walk import (
    NFS_SILLY_PREFIX,
    Garbage,
    NotFound,
    Problem,
    Progress,
    SessionRef,
    TranscriptInfo,
    TranscriptRef,
    Walker,
    changed_at,
    gone,
    tick,
    walking,
)

#: Problem kinds that mean part of a session could not be looked at.
_UNSEEN = frozenset({"unreadable", "symlink", "bad-name"})


def not_looked_at(w: Walker) -> list[Action]:
    """What the walk so far could not look at (a directory it cannot read, or that is a
    symlink or a file where the layout has a directory): reported FAILED, so that the
    exit code says the job is not all done."""
    return [Action("skip", p.path, p.message, False, failed=True, code=p.code)
            for p in w.problems if p.severity == "error" and p.kind in ("unreadable", "symlink")]


@dataclass
class Action:
    """Something gc, prune or compact did (or, in a dry run, would do)."""

    action: str
    path: str
    detail: str
    done: bool
    age: float | None = None
    failed: bool = False
    code: str | None = None  # of a failure, where it has one (an errno name, a store code)

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "path": self.path,
            "detail": self.detail,
            "done": self.done,
            "failed": self.failed,
            "code": self.code,
            "age_seconds": None if self.age is None else round(self.age, 3),
        }


def _has_silly(parent_fd: int, name: str, depth: int = 0) -> str | None:
    """The first ``.nfsXXXX`` name inside ``parent/name`` (no symlinks followed)."""
    if name.startswith(NFS_SILLY_PREFIX):
        return name
    try:
        fd = os.open(name, _fsio.DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return None  # a file, a symlink, or gone
    try:
        with os.scandir(fd) as it:
            entries = list(it)
        for entry in entries:
            if entry.name.startswith(NFS_SILLY_PREFIX):
                return entry.name
            if depth < 64 and _fsio.is_dir_entry(entry):
                found = _has_silly(fd, entry.name, depth + 1)
                if found:
                    return found
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def _subdirs_off_their_names(parent_fd: int, name: str) -> None:
    """Rename each directory in ``parent/name`` to a temp name of its own, in place: a
    writer renames a new directory into place from inside its temp directory by a
    handle of that one (``_fsio.Fs.new_dir``), which renaming the temp directory does
    not stop; a rename of a name that is gone fails."""
    fd = os.open(name, _fsio.DIR_FLAGS, dir_fd=parent_fd)
    try:
        with os.scandir(fd) as it:
            subdirs = [e.name for e in it if _fsio.is_dir_entry(e)]
        for sub in subdirs:
            with contextlib.suppress(FileNotFoundError):  # published meanwhile: not ours
                os.rename(sub, _fsio.temp_name("-dir"), src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)


def _remove_garbage(w: Walker, g: Garbage, older_than: float, dry_run: bool) -> Action:
    verb = f"remove-{g.kind}"
    what = {"temp": "orphaned temp " + ("directory" if g.is_dir else "file"),
            "trash": "leftover of a delete", "lock-recovery": "lock recovery leftover",
            "lock-record": "unused lock holder record",
            "fuse-hidden": "FUSE leftover", "tomb": "deleted transcript's marks"}[g.kind]
    detail = f"{what}, {age_text(g.age)} old"
    if dry_run:
        return Action(verb, g.path, detail, False, g.age)
    pfd = w.open(g.parent)
    if pfd is None:
        return Action(verb, g.path, detail + " (gone already)", False, g.age)
    try:
        try:
            st = os.stat(g.name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return Action(verb, g.path, detail + " (gone already)", False, g.age)
        if w.now - changed_at(st) <= older_than:
            return Action("keep", g.path, "touched again since the walk; left alone", False, g.age)
        if stat.S_ISDIR(st.st_mode):
            silly = _has_silly(pfd, g.name)
            if silly:
                return Action("keep", g.path,
                              f"holds {silly}: a deleted file still open on an NFS client; "
                              "gc retries on its next run", False, g.age)
            name = g.name
            if g.kind == "temp":
                # Taken off its name first: a writer stalled past the threshold (or this
                # host's clock ahead) may be about to publish it (_fsio.Fs.new_dir); its
                # rename then fails and it starts over (found by review: emptied in place,
                # the directory was published empty and the append acknowledged).
                # So is the directory inside it that the writer renames into place (by
                # its handle of this one, which the first rename does not stop).
                name = _fsio.temp_name("-dir")
                try:
                    os.rename(g.name, name, src_dir_fd=pfd, dst_dir_fd=pfd)
                except FileNotFoundError:
                    return Action("keep", g.path, "published by its writer meanwhile", False, g.age)
                _subdirs_off_their_names(pfd, name)
            _remove_marked_tree(pfd, name, _layout.DELETED)  # cut short: never an orphan
        else:
            _fsio.unlink_quiet(pfd, g.name)
    except OSError as exc:
        return Action(verb, g.path, f"{detail}: {exc.strerror}", False, g.age,
                      failed=True, code=posix_code(exc.errno))
    finally:
        os.close(pfd)
    return Action(verb, g.path, detail, True, g.age)


def _remove_marked_tree(parent_fd: int, name: str, mark: str) -> None:
    """Remove ``parent/name`` and everything below, the files named ``mark`` last:
    cut short (a crash), what is left still carries its marks. A directory that a file
    was made in after its mark went (a writer that still reaches a deleted transcript)
    gets its mark back before its ``rmdir``'s ENOTEMPTY is raised: that writer's check
    then sees it."""
    _fsio.empty_tree(parent_fd, name, mark)
    _fsio.remove_tree(parent_fd, name, mark)


def _remove_trash(w: Walker, g: Garbage, older_than: float, dry_run: bool,
                  homes: tuple[list[str], list[tuple[str, ...]]]) -> Action:
    """:func:`_remove_garbage` for what a delete left in ``.trash``, judged again first:
    an orphan (unmarked, with batches) is never removed, however it looked at the walk
    (a GlusterFS client can list a directory another client moved as empty for a
    minute: review 117). ``ESTALE``: a GlusterFS brick that handled a listing of the
    directory's old parent while it was moved answers so until its old name is looked
    up (gluster#1411; review, stop 36: every gc failing on the same tombs for minutes):
    looked up, and removed again."""
    if not dry_run and g.kind == "trash" and _orphan_now(w, g):
        return Action("keep", g.path, "holds batches and no mark now (moved by mistake): "
                      "merged by the next gc, not removed", False, g.age)
    act = _remove_garbage(w, g, older_than, dry_run)
    if act.code != "ESTALE":
        return act
    for where, name in _trash.old_names(g.name, *homes):
        pfd = w.open(where)
        if pfd is not None:
            try:
                _delete.forget_old_name(pfd, name)
            finally:
                os.close(pfd)
    return _remove_garbage(w, g, older_than, dry_run)


def _orphan_now(w: Walker, g: Garbage) -> bool:
    """Whether ``g`` in .trash is an orphan as it is now (True where that cannot be told)."""
    pfd = w.open(g.parent)
    if pfd is None:
        return False
    try:
        return _trash.orphan(pfd, g.name)
    except OSError:
        return True
    finally:
        os.close(pfd)


def _break(lk: LockInfo, older_than: float, stale_lock_seconds: float, dry_run: bool) -> Action | None:
    """Break a lock older than ``older_than`` that the store's own waiters would break
    too (its holder dead on this host, older than ``stale_lock_seconds``, or no record),
    with the store's own reclaim (a marker someone re-took meanwhile is put back, never
    removed). A live holder's lock is not garbage, however low the threshold or far
    ahead this host's clock: one here is kept (another host's is judged by age)."""
    if lk.age <= older_than:
        return None
    if lk.status == "held":
        if not lk.local or lk.age <= stale_lock_seconds:
            return None
        # A live holder here, its marker old by this host's clock (see _reclaim._stale).
        return Action("keep", lk.path, f"lock of {lk.describe()} on {lk.transcript()}, "
                      f"{age_text(lk.age)} old by this host's clock, held by a live process here: "
                      "left to its waiters", False, lk.age)
    detail = f"stale lock of {lk.describe()} on {lk.transcript()}, {age_text(lk.age)} old"
    if dry_run:
        return Action("break-lock", lk.path, detail, False, lk.age)
    # Judged again as it is now, as a waiter would: a live holder may have taken the
    # lock since the scan, and its marker is older than a low --older-than at once.
    # Not by a lookup after a failed try: a client can answer one from its cache after
    # the holder gave the lock back or took it again (GlusterFS, sshfs; review 104: 80 of
    # gc's 99 failed actions beside a writer whose clock ran behind said such a lock
    # "could not be moved aside"). The reclaim's own listing and move say.
    outcome = reclaim(lk.path, older_than=max(older_than, stale_lock_seconds), operation="gc")
    if outcome == "broken":
        return Action("break-lock", lk.path, detail, True, lk.age)
    if outcome == "taken":
        return Action("keep", lk.path, "lock was taken again meanwhile; left alone", False, lk.age)
    if outcome == "not stale":  # (a record-less marker younger than the lease, say)
        return Action("keep", lk.path, f"lock of {lk.describe()} on {lk.transcript()} is not stale "
                      "as its waiters judge it now; left to them", False, lk.age)
    if outcome == "gone":  # no marker at the name, or none of ours to judge:
        try:
            st = os.lstat(lk.path)
        except FileNotFoundError:
            return Action("break-lock", lk.path, detail + " (released meanwhile)", False, lk.age)
        except OSError as exc:
            outcome = exc
        else:
            if not stat.S_ISREG(st.st_mode):
                return Action("break-lock", lk.path, f"{detail}: not broken: it is not a regular "
                              "file: remove it by hand", False, lk.age, failed=True, code="UNSAFE_PATH")
            return Action("break-lock", lk.path, detail + " (released meanwhile)", False, lk.age)
    why = (f"no permission to read it or to rename it in {os.path.dirname(lk.path)}"
           if outcome.errno in (errno.EACCES, errno.EPERM) else f"cannot read or move it: {outcome.strerror}")
    return Action("break-lock", lk.path, f"{detail}: not broken: {why}", False, lk.age,
                  failed=True, code=posix_code(outcome.errno))


def gc(
    root: str,
    *,
    older_than: float = 3600.0,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> list[Action]:
    """Remove temp files, ``.trash`` leftovers and lock recovery files older than
    ``older_than``; break stale locks older than it (see :func:`_break`). Nothing
    younger is touched."""
    actions: list[Action] = []
    with walking(root) as w:
        w.root_entries()  # (a command's clock probe left by a kill: garbage)
        refs = w.sessions()
        seen: list[TranscriptRef] = []
        for i, ref in enumerate(refs):
            for tref in w.transcripts(ref):
                seen.append(tref)
                info = w.inspect(tref)
                temps = info.temps if info is not None else []
                actions += [_remove_garbage(w, g, older_than, dry_run)
                            for g in temps if g.age > older_than]
            tick(progress, i + 1, len(refs))
        found, lock_garbage = scan_locks(w)
        name_locks(found, seen)
        actions += [a for lk in found
                    if (a := _break(lk, older_than, w.stale_lock_seconds, dry_run)) is not None]
        trash = w.trash()
        # Orphans first; a record of where one came from (for listings) is kept while it is.
        orphans = [g for g in trash if g.kind == "orphan"]
        actions += [a for g in orphans if g.age > older_than
                    and (a := _merge_orphan(w, g, [_layout.transcript_dirs(t.tk) for t in seen],
                                            [ref.comps for ref in refs], dry_run)) is not None]
        kept = {_delete.moving_record(g.name) for g in orphans}
        actions += [_remove_garbage(w, g, older_than, dry_run)
                    for g in (*w.garbage, *lock_garbage) if g.age > older_than and g.name not in kept]
        homes = (_projects(w), [ref.comps for ref in refs])
        actions += [_remove_trash(w, g, older_than, dry_run, homes)
                    for g in trash if g.age > older_than and g.kind != "orphan"]
        actions += not_looked_at(w)
    return actions


def _merge_orphan(
    w: Walker, g: Garbage, transcripts: list[list[Component]], sessions: list[tuple[str, ...]], dry_run: bool,
) -> Action | None:
    """Finish the merge of what a delete moved by mistake into the session (or
    transcript) at its name (its merger died, or failed: :func:`_merge.merge_back`);
    where nothing is at its name, move it back there (:func:`_trash.moved_from`; a load
    or append of it by name moves it back too); else None."""
    name = g.name
    target = _trash.orphan_target(name, transcripts)
    if target is None:
        home = _trash.moved_from(name, _projects(w), sessions)
        return None if home is None else _restore_orphan(w, g, home, dry_run)
    comps, mark = target
    into = w.path([c for c, _ in comps])
    if dry_run:
        return Action("merge", g.path, f"would be merged into {into}", False, age=g.age)
    how = _merge.merge_back(w.store, name, comps, mark, into)
    detail = {"merged": f"merged into {into}",
              "claimed": "taken by a delete of its session meanwhile",
              "gone": "left for the delete of its session that runs meanwhile",
              "back": "moved back to its name meanwhile",
              "done": "merged or removed by another process meanwhile",
              "busy": "left for the next gc: its session's lock was busy",
              "failed": f"not merged into {into} (see the log)"}[how]
    return Action("merge", g.path, detail, how == "merged", age=g.age, failed=how == "failed",
                  code="DELETE_RACED" if how == "failed" else None)  # the log line's code


def _projects(w: Walker) -> list[str]:
    fd = w.open((_layout.PROJECTS,))
    if fd is None:
        return []
    try:
        return _fsio.listdir(fd)
    finally:
        os.close(fd)


def _restore_orphan(w: Walker, g: Garbage, home: list[Component], dry_run: bool) -> Action:
    where = w.path([c for c, _ in (home[:-2] if home[-1][0] == _layout.MAIN else home[:-1])])
    if dry_run:
        return Action("restore", g.path, f"would be moved back into {where}", False, age=g.age)
    with w.store.open_root() as rfd:
        done = rfd is not None and _delete.restore(w.store, rfd, home)
    return Action("restore", g.path, f"moved back into {where}" if done else
                  "not moved back: moved, claimed or made anew meanwhile", done, age=g.age)


# -- prune -----------------------------------------------------------------------


@dataclass
class _Look:
    """One look at a session, for prune."""

    transcripts: list[TranscriptRef]
    mtime_ns: int | None  # its newest committed file; None: nothing committed
    # Every committed file: transcript path, name, and what tells a file made anew at
    # that name (a session deleted and made again meanwhile: found by review, pruned
    # with a batch acknowledged after the first look): inode number and ctime.
    files: frozenset[tuple[str, str, int, int]]
    unseen: Problem | None  # the first error that hid part of it: its age is unknown
    temps: list[Garbage]  # temp files in its transcript and subkey directories


def _look(w: Walker, ref: SessionRef) -> _Look:
    mark, gmark = len(w.problems), len(w.garbage)
    trefs = w.transcripts(ref)
    infos = [info for t in trefs if (info := w.inspect(t)) is not None]
    unseen = next((p for p in w.problems[mark:]
                   if p.severity == "error" and p.kind in _UNSEEN), None)
    unseen = unseen or next((p for i in infos if (p := _unreadable_file(w, i)) is not None), None)
    mtime = max((i.mtime_ns for i in infos if i.mtime_ns is not None), default=None)
    files = frozenset((i.path, it.name, it.ino, it.ctime_ns) for i in infos for it in i.items)
    temps = [*w.garbage[gmark:], *(g for i in infos for g in i.temps)]
    return _Look(trefs, mtime, files, unseen, temps)


def _unreadable_file(w: Walker, info: TranscriptInfo) -> Problem | None:
    """The first committed file of a transcript that this process cannot open for
    reading (a listing does not tell): a session with one is not looked at entirely."""
    fd = w.open(info.ref.comps)
    if fd is None:
        return None  # gone meanwhile (or unreadable: the next look says so)
    try:
        for it in info.items:
            try:
                os.close(os.open(it.name, _fsio.READ_FLAGS | os.O_NONBLOCK, dir_fd=fd))
            except OSError as exc:
                if not gone(exc):  # a file merged away meanwhile is not unreadable
                    return Problem("error", "unreadable", f"{info.path}/{it.name}",
                                   f"cannot read: {exc.strerror}", code=posix_code(exc.errno))
    finally:
        os.close(fd)
    return None


def prune(
    root: str,
    *,
    older_than: float,
    project: str | None = None,
    dry_run: bool = False,
    stale_lock_seconds: float = 30.0,
    lock_timeout_seconds: float = 10.0,
    progress: Progress | None = None,
) -> tuple[list[Action], int]:
    """Delete every session whose newest committed file is older than ``older_than``.

    Returns the actions and how many sessions were looked at. A session is never
    deleted if any part of it could not be looked at (an unreadable directory, a
    symlink, a name that does not decode) or if it has no committed file at all.
    Each deletion is a ``SyncStore.delete_unless`` done while holding the lock of every
    transcript of the session: the session is marked as a prune's and looked at once
    more: a committed file added, gone or made anew since the first look (a commit, a
    compaction, a delete and an append: by name, inode number and ctime, not by age), a
    transcript added since, or a temp file younger than
    ``older_than`` (a writer that wrote its batch and waits for a lock) keeps it; else
    the delete is committed, unless an append removed the marks meanwhile (it wins).
    The lock only saves work; the marks and the look after them make it safe.
    """
    actions: list[Action] = []
    with walking(root, stale_lock_seconds=stale_lock_seconds,
                 lock_timeout_seconds=lock_timeout_seconds) as w:
        refs = w.sessions(project)
        above = not_looked_at(w)  # the way down to the sessions (each session's own: _unseen)
        for i, ref in enumerate(refs):
            tick(progress, i, len(refs))
            act = _prune_one(w, ref, older_than, dry_run)
            if act is not None:
                actions.append(act)
        tick(progress, len(refs), len(refs))
        actions += above
    return actions, len(refs)


def _unseen(path: str, problem: Problem) -> Action:
    where = "" if problem.path == path else f" ({problem.path})"
    return Action("skip", path, f"not deleted: part of the session cannot be looked at, so its "
                  f"age is unknown: {problem.message}{where}", False, failed=True, code=problem.code)


def _prune_one(w: Walker, ref: SessionRef, older_than: float, dry_run: bool) -> Action | None:
    path = w.path(ref.comps)
    first = _look(w, ref)
    if first.unseen is not None:
        return _unseen(path, first.unseen)
    if first.mtime_ns is None:
        return _uncommitted(w, ref, older_than)
    age = w.now - first.mtime_ns / 1e9
    if age <= older_than:
        return None
    detail = f"last modified {iso_ns(first.mtime_ns)} ({age_text(age)} ago)"
    if dry_run:
        moved = _moved_by_mistake(w, ref)
        return Action("delete", path, detail, False, age) if moved is None else _kept_for(path, moved)
    try:
        with contextlib.ExitStack() as held:
            # Sorted: two prunes of one session never wait for each other crosswise.
            for tref in sorted(first.transcripts, key=lambda t: t.comps):
                held.enter_context(w.store.locked(tref.key()))
            kept: list[Action] = []

            def keep() -> bool:
                # The last look, made once the session is marked as a prune's: an append
                # whose check passed before the marks shows here; one after them removes
                # them, and this prune then keeps it (fsstore._delete._prune). So
                # whatever stalls prune, no acknowledged batch is deleted unseen.
                w.now = w.clock()
                reason = _reason_to_keep(w, ref, first, older_than)
                if reason is not None:
                    kept.append(reason)
                return reason is not None

            if not w.store.delete_unless(ref.key(), keep):
                return kept[0] if kept else Action(
                    "keep", path, "written to after the last look; kept (the next prune looks "
                    "again)", False)
    except FsStoreError as err:
        if os.path.lexists(os.path.join(path, _layout.MAIN, _layout.DELETED)):
            # Committed, then failed (review, stop 36: EACCES on .trash read as "kept")
            detail += (": deleted (committed: load() returns None), but not moved into .trash; "
                       "the next load or append of it under the lock finishes the delete")
        return Action("delete", path, f"{detail}: {err}", False, age, failed=True, code=err.code)
    return Action("delete", path, detail, True, age)


def _reason_to_keep(w: Walker, ref: SessionRef, first: _Look, older_than: float) -> Action | None:
    """None if the session can go; else why not. Runs under the locks of the transcripts
    ``first`` found, so no commit to them can start until the delete is done."""
    path = w.path(ref.comps)
    again = _look(w, ref)
    if again.unseen is not None:
        return _unseen(path, again.unseen)
    if not again.transcripts:
        return Action("delete", path, "deleted meanwhile", False)
    # By what they hold: the main/ a prune makes for its mark in a session of subagent
    # transcripts only holds none (found by review: such a session was never pruned).
    if {f[0] for f in again.files} != {f[0] for f in first.files}:
        return Action("keep", path, "a transcript was added or removed meanwhile; kept (the "
                      "next prune looks again)", False)
    moved = _moved_by_mistake(w, ref)
    if moved is not None:
        return _kept_for(path, moved)
    young = [g for g in again.temps if g.age <= older_than and not _layout.pruning(g.name)]
    if young:
        return Action("keep", path, f"an append is in flight ({young[0].path}, "
                      f"{age_text(young[0].age)} old); kept", False)
    # Any committed file added, gone or made anew since the first look (a commit, a
    # compaction, a delete and an append): not by age, since a stall between the looks
    # can make a new batch look old.
    if again.files != first.files:
        return Action("keep", path, "written to meanwhile; kept (the next prune looks again)", False)
    return None


def _kept_for(path: str, moved: str) -> Action:
    return Action("keep", path, f"part of it is in .trash ({moved}), moved there by a delete by "
                  "mistake: kept until it is moved back or merged", False)


def _moved_by_mistake(w: Walker, ref: SessionRef) -> str | None:
    """What a delete moved of the session into ``.trash`` by mistake, not yet moved back
    or merged: prune's look does not see its batches, and a later delete of the session
    is the one that claims it (found by review: pruned, it came back into the session
    made at the name since)."""
    trash = w.open((_layout.TRASH,))
    if trash is None:
        return None
    try:
        return _trash.moved_by_mistake(trash, [(c, None) for c in ref.comps])
    finally:
        os.close(trash)


def _uncommitted(w: Walker, ref: SessionRef, older_than: float) -> Action | None:
    """A session without any committed file is never deleted (nothing tells how old its
    content is: a first append may be in flight); reported once its directory is old."""
    try:
        st = w.store.fs.stat_beneath(w.rfd, "/".join(ref.comps))
    except OSError:
        return None  # gone
    age = w.now - changed_at(st)
    if age <= older_than:
        return None
    return Action("skip", w.path(ref.comps), f"no committed transcript (directory "
                  f"{age_text(age)} old): nothing to age it by; left alone", False, age)


# -- compact ---------------------------------------------------------------------


def compact(
    root: str,
    *,
    project: str | None = None,
    session: str | None = None,
    dry_run: bool = False,
    stale_lock_seconds: float = 30.0,
    progress: Progress | None = None,
) -> list[Action]:
    """``SyncStore.compact`` on every transcript with more than one committed file.

    The store keeps the newest merged file's time on the segment, so compaction does
    not restart the retention clock, and refuses (CORRUPT) to merge across a gap.
    :class:`NotFound` where the project or session named is not there (review 105:
    "0 done" and exit 0 hid a mistyped name).
    """
    actions: list[Action] = []
    with walking(root, stale_lock_seconds=stale_lock_seconds) as w:
        refs = w.sessions(project, session)
        if not refs and (session is not None or (project is not None and not _there(w, project))):
            raise NotFound(f"no project {project!r}" if session is None else f"no session {session!r}"
                           + ("" if project is None else f" in project {project!r}"))
        for i, ref in enumerate(refs):
            for tref in w.transcripts(ref):
                act = _compact_one(w, tref, dry_run)
                if act is not None:
                    actions.append(act)
            tick(progress, i + 1, len(refs))
        actions += not_looked_at(w)
    return actions


def _there(w: Walker, project: str) -> bool:
    """Whether the project's directory is in the store."""
    fd = w.open((_layout.PROJECTS, _keys.encode(project)))
    if fd is not None:
        os.close(fd)
    return fd is not None


def _compact_one(w: Walker, tref: TranscriptRef, dry_run: bool) -> Action | None:
    mark = len(w.problems)
    info = w.inspect(tref)
    if info is None or (len(info.live) < 2 and len(info.items) == len(info.live)):
        return None
    detail = f"{len(info.items)} files, {info.bytes} bytes"
    if dry_run:
        damage = next((p for p in w.problems[mark:] if p.kind in ("gap", "corrupt")), None)
        if damage is None:
            return Action("compact", info.path, detail, False)
        return Action("skip", info.path, f"{detail}: compact would refuse: {damage.message}",
                      False, failed=True, code="CORRUPT")  # as compact's refusal says it
    try:
        merged = w.store.compact(tref.key())
    except FsStoreError as err:
        if err.code == "CORRUPT":  # a gap or damage: merging would hide it
            return Action("skip", info.path, f"{detail}: not compacted: {err.message} "
                          "(see fsstore check)", False, failed=True, code=err.code)
        return Action("compact", info.path, f"{detail}: {err}", False, failed=True, code=err.code)
    what = (f"merged {merged} files into one segment" if merged
            else "nothing to merge (leftovers its segments hold removed)")
    return Action("compact", info.path, what, merged > 0)

