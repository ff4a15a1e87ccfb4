"""Compaction: merging a transcript's committed files into one segment.

Thousands of small parts make ``load()`` open thousands of files; a segment is the
same bytes in one file. Compaction runs automatically from ``append()`` once
``compact_every`` parts follow the last segment, or on demand (``compact(key)``,
``fsstore compact``). Like a commit, it is correct whatever the lock does. It takes
the transcript lock around the look before its move, the move and its check (steps
3-4), where it keeps two compactions from wasting work, and again for its writes
and unlinks (steps 5-6), where it keeps the directory's mtime; its reads run beside
the appends that follow (the lock was held for all of it until stop 26: an append
waited behind a whole compaction, 100-200 ms on GlusterFS, 300 ms locally for a
merge of a few MB).

Steps, and what readers and crashes see:

1. List the directory; :func:`fsstore._transcript.plan_held` gives the chain of files
   that make up the transcript. A chain with a hole is not compacted (merging
   across it would hide it from ``fsstore check``).
2. Choose what to merge. On demand: everything. Automatically: the new parts plus
   every trailing segment whose size, rounded down to a power of two, is no larger
   than that of what is merged after it, like carries in a binary counter. A merged
   entry's segment is then at least twice as big as its previous one, so each entry
   is copied at most log2(n) times, and the segments' powers of two strictly decrease
   along the chain, so a transcript has at most log2(n) segments — however many parts
   each compaction finds (it runs after the append, in a thread, and may find more
   than ``compact_every``).
3. Read the chosen files (parts are parsed: a damaged part is never copied). Take
   the lock, then list twice more: a segment over the range that the first listing
   lacks means a name read may have been freed by another compaction and linked
   again by a stale writer, and ``.deleted`` a delete: start over. Write their bytes to a temp file
   and fsync it (whatever ``fsync`` says); move it, no-replace, to ``<first>-<last>.jsonl``. Readers now take the segment
   (fewer files) and skip what it merged; either way each entry once.
4. List again (the *check*): if another segment overlaps this one without one
   holding the other (two compactions that overlapped), remove this one and stop:
   its files are all still there. Readers racing it take the chain that continues.
   Give the lock back.
5. fsync the directory (whatever ``fsync`` says: the segment survives a power loss
   before what it merged stops surviving one). Take the lock again. Main
   transcripts: write the summary sidecar (state.json) folded up to ``last``.
6. Unlink the merged files and every other segment inside the range, and every
   part there whose bytes the segment holds (leftovers; a part a stale writer
   misplaced there stays: that writer commits it again above from its temp file, or
   ``fsstore check --repair`` does once gc took that). A reader that listed them gets ENOENT or a changed
   second listing and reads again.

A crash after step 3 leaves files covered by the segment: readers skip them, and
the next compaction removes them. A crash before leaves a temp file (``fsstore gc``).
Each lock hold puts the directory's mtime (the session's mtime in ``list_sessions``)
back where it found it (compacting an old session must not make it new), or, where
the hold may have been overlapped, only moves it forward (:func:`_mtime_kept`).
Entries are copied verbatim: duplicates by ``uuid`` stay, and load() still drops
them, so compaction never changes what ``load()`` returns.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import _fsio, _layout, _read, _summaries, _views
from ._errors import FsStoreError, log
from ._lock import Held
from ._transcript import (
    READ_ATTEMPTS,
    Item,
    State,
    Vanished,
    first_kept,
    misplaced,
    parse,
    past_now,
    plan_held,
    read_state,
    scan,
    tick_mtime,
    top,
    write_state,
)

# The SDK's fold function and the session key it is given.
Summary = tuple[_summaries.Fold, dict[str, str]]


def choose(chosen: list[Item], *, everything: bool) -> int:
    """Index of the first file of the suffix of ``chosen`` to merge."""
    if everything:
        return 0
    merged = 0
    start = len(chosen)
    for i in range(len(chosen) - 1, -1, -1):
        first, last, _name = chosen[i]
        span = last - first + 1
        if first != last and span.bit_length() > merged.bit_length():
            break  # a segment of a bigger power of two: merging it now would copy too much too often
        merged += span
        start = i
    return start


def fold_chain(
    summary: Summary, state: State, chain: list[Item], read: Callable[[str], list[dict[str, Any]]]
) -> tuple[dict[str, Any], int]:
    """The summary of the files of ``chain`` (in order), starting from ``state``'s
    where it ends exactly where a file of the chain begins; else from scratch."""
    fold, key = summary
    start = state.summary if state.folded > 0 else None
    if start is not None and any(last == state.folded for _f, last, _n in chain):
        rest = [it for it in chain if it[0] > state.folded]
    else:
        start, rest = None, chain
    return _summaries.fold(fold, start, key, [read(name) for _f, _l, name in rest]), chain[-1][1]


def compact(
    fs: _fsio.Fs,
    dir_fd: int,
    path: str,
    hold: Callable[[], contextlib.AbstractContextManager[Held]],
    *,
    everything: bool,
    operation: str,
    summary: Summary | None = None,
) -> int:
    """Merge (see the module docstring); return how many files were merged (0: none).
    ``hold()`` takes the transcript lock: for steps 3-4 (the look after the reads, the
    move, its check) and again for steps 5-6 (the sidecar, the unlinks)."""
    last = ""  # what the last lost look saw (said where it gives up, as a load does)
    for attempt in range(READ_ATTEMPTS):
        # As a load: the client may list from a cache (sshfs's 20 s) that still shows
        # what another host's compaction removed (review, stop 33: 30 of 133 `fsstore
        # compact` runs EAGAIN beside a writing host). Gone on the server: deleted.
        if attempt and not _views.refresh_listing(dir_fd):
            return 0
        try:
            return _merge(fs, dir_fd, path, hold, everything=everything, operation=operation,
                          summary=summary)
        except Vanished as exc:
            last = str(exc)
            continue  # a file merged by an overlapping compaction: look again
        except OSError as exc:
            # A session's delete takes its main transcript's lock only: it can mark,
            # move and empty a subagent transcript under its compaction (review, stop
            # 36: ENOENT on the segment's temp file, COMPACT_FAILED on routine deletes).
            if exc.errno not in (errno.ENOENT, errno.ESTALE) or not _deleted(dir_fd):
                raise
            return 0
    raise FsStoreError("EAGAIN", f"files kept vanishing under {READ_ATTEMPTS} compactions "
                       "(overlapping compactions, or a client that lists from a stale cache; "
                       f"the last time: {last})", operation=operation, path=path, errno=errno.EAGAIN)


def _deleted(dir_fd: int) -> bool:
    """Whether the transcript is marked deleted, or gone (its tomb removed: a local
    disk lists a removed directory as empty, a network mount says ENOENT/ESTALE)."""
    try:
        return os.fstat(dir_fd).st_nlink == 0 or scan(dir_fd)[1]
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ESTALE):
            raise
        return True


def _merge(
    fs: _fsio.Fs,
    dir_fd: int,
    path: str,
    hold: Callable[[], contextlib.AbstractContextManager[Held]],
    *,
    everything: bool,
    operation: str,
    summary: Summary | None,
) -> int:
    items, deleted = scan(dir_fd)
    seen: dict[str, bytes] = {}  # what plan_held judged is what is copied
    chain, gap = plan_held(items, dir_fd, seen)
    if deleted:
        return 0
    if gap is not None:
        # A gap in the transcript, or in a listing torn by a compaction or commits while
        # it was read in several parts (found by review: CORRUPT for honest writers).
        if sorted(scan(dir_fd)[0]) != sorted(items):
            raise Vanished("the listing changed")  # changing: looked at again
        raise FsStoreError("CORRUPT", f"sequence gap at part {gap}: refusing to compact across it",
                           operation=operation, path=path)
    merge = chain[choose(chain, everything=everything):]
    if len(merge) < 2:
        _tidy(fs, dir_fd, hold, operation, _covered(dir_fd, items, chain, seen))
        return 0
    blobs: dict[str, bytes] = {}
    newest = 0
    for first, last, name in merge:
        try:
            blob = seen[name] if name in seen else _read.read_file(dir_fd, name)
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ESTALE):  # ESTALE: another host removed it
                raise
            raise Vanished(f"{name} vanished") from exc  # merged by another compaction: looked at again
        if first == last:
            parse(blob, f"{path}/{name}", operation)  # never copy a damaged part
        blobs[name] = blob
        newest = max(newest, st.st_mtime_ns)
    first, last = merge[0][0], merge[-1][1]
    segment, data = _layout.segment_name(first, last), b"".join(blobs.values())
    first_read = first_kept({**seen, **blobs}, merge, items)  # (plan_held read before the loop)
    with hold() as held:
        now = _look_again(dir_fd, items, first, last)
        if now is None or (first_read is not None and not _read.still(dir_fd, *first_read)):
            # Found by review: a name read here can be one another compaction freed (its
            # segment over it published first) and a stale writer linked again since:
            # copied, that batch would take the merged one's place. And where directory
            # handles go by path (sshfs), another host's delete and new session since
            # the reads make every name the new session's (review, stop 31: the old
            # segment was published into it, hiding its acknowledged parts). Looked at again.
            raise Vanished("a file read changed before the move")
        with _mtime_kept(dir_fd, held, top(now)):
            # The segment carries the newest merged mtime: retention goes by file age.
            if not _publish(fs, dir_fd, segment, data, newest, lambda: held.check(operation)):
                return 0  # the same segment exists already: another compaction made it
            after, _deleted = scan(dir_fd)
            if any(f != l and name != segment and (f < first <= l < last or first < f <= last < l)
                   for f, l, name in after):
                _fsio.unlink_quiet(dir_fd, segment)  # overlapped another compaction: its files stay
                return 0

    def write_summary() -> None:
        assert summary is not None
        try:
            chain_to = [it for it in chain if it[1] <= last]
            write_state(fs, dir_fd, _summary_state(dir_fd, path, summary, chain_to, blobs))
        except (OSError, FsStoreError) as exc:
            # A hint: list_session_summaries folds what the sidecar lacks.
            log.warning("summary sidecar not written: %s", exc, extra={
                "code": "SUMMARY_BEHIND", "operation": operation, "path": path})

    doomed = _covered(dir_fd, after, [(first, last, segment)], {segment: data})
    _tidy(fs, dir_fd, hold, operation, doomed, write_summary if summary is not None else None,
          (segment, data))
    return len(merge)


def _tidy(fs: _fsio.Fs, dir_fd: int, hold: Callable[[], contextlib.AbstractContextManager[Held]],
          operation: str, doomed: list[str], write_summary: Callable[[], None] | None = None,
          made: tuple[str, bytes] | None = None) -> None:
    """Steps 5-6 under the lock again: the summary sidecar, and the unlinks of
    ``doomed``; not where the segment ``made`` is not there as made (the session was
    deleted and made anew meanwhile, seen through a handle that goes by path: sshfs).
    A busy lock (or a failed fsync) leaves both to the next compaction (readers skip
    leftovers, and fold what the sidecar lacks).

    The directory is fsynced first, whatever ``fsync`` says: a segment's name must
    survive a power loss before the files it covers stop surviving one (its bytes
    were fsynced before its move). Found by a power-loss test: with ``fsync=False``
    an ext4 journal commit could carry the unlinks while the segment's bytes were
    still in memory, and a power loss in the next ~30 s left it empty and the whole
    transcript lost."""
    if not doomed and write_summary is None:
        return
    with contextlib.suppress(OSError, FsStoreError):
        if doomed:
            fs.sync_dir(dir_fd, always=True)  # outside the lock: a journal commit
        with hold() as held, _mtime_kept(dir_fd, held, top(scan(dir_fd)[0])):
            if made is not None and not _read.still(dir_fd, *made):
                return
            if write_summary is not None:
                write_summary()
            for name in doomed:
                # Within the lease (review, stop 31: one stalled past it, on sshfs, unlinked
                # the parts of the session another host had deleted and made anew meanwhile).
                held.check(operation)
                _fsio.unlink_quiet(dir_fd, name)


@contextlib.contextmanager
def _mtime_kept(dir_fd: int, held: Held, highest: int) -> Iterator[None]:
    """Put the directory's mtime (the session's, which the SDK compares summaries with)
    back to what it was as the hold began: compaction never makes an old session new.
    Unless the hold may have been overlapped (its lease ran out, or a part above
    ``highest``, the highest number it saw as it began, appeared: a writer that took the lock over committed): then
    it only moves the mtime forward, past what it was and past any commit's (see
    :func:`fsstore._transcript.tick_mtime`), so no summary made before that commit
    looks current (found by review: put back, it hid the commit's). Also when the hold
    ends in an error: a temp file it made and removed moved the mtime too."""
    before = os.fstat(dir_fd).st_mtime_ns
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            st = os.fstat(dir_fd)
            def alone() -> bool:  # within the lease, and no part above ``highest`` appeared
                return time.monotonic() - held.since <= held.budget and top(scan(dir_fd)[0]) <= highest

            if alone():
                if st.st_mtime_ns != before:
                    os.utime(".", ns=(st.st_atime_ns, before), dir_fd=dir_fd)
                    if not alone():
                        past_now(dir_fd)  # put back late, maybe over another's commit
            else:
                tick_mtime(dir_fd, max(before, st.st_mtime_ns))


def _look_again(dir_fd: int, listed: list[Item], first: int, last: int) -> list[Item] | None:
    """Step 3's look, under the lock, after the reads: the listing, or None where a
    segment that ``listed`` lacks holds a number of ``first..last`` or the transcript
    is being deleted. A name is free again only once a segment over it exists, and one
    such segment exists from then on (the one replacing it is made first), so a file
    read after its name was freed leaves one here. Two listings, as a commit's check:
    one can be torn by a compaction."""
    known = {name for _f, _l, name in listed}
    items: list[Item] = []
    for _look in range(2):
        items, deleted = scan(dir_fd)
        if deleted or any(f != l and name not in known and f <= last and first <= l for f, l, name in items):
            return None
    return items


def _publish(fs: _fsio.Fs, dir_fd: int, segment: str, data: bytes, mtime_ns: int | None,
             before_move: Callable[[], None]) -> bool:
    """Write ``data`` to a temp file (with ``mtime_ns``) and move it, no-replace, to
    ``segment``; False (no file left) if that name exists already."""
    tmp = _fsio.temp_name("-segment")
    # fsynced whatever ``fsync`` says: what it merges is removed once it is there (_tidy)
    fs.write_new(dir_fd, tmp, data, sync=True)
    try:
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns), dir_fd=dir_fd, follow_symlinks=False)
        before_move()
        if not _fsio.move_noreplace(fs, dir_fd, tmp, segment):
            return False
        tmp = ""
    finally:
        if tmp:
            _fsio.unlink_quiet(dir_fd, tmp)
    return True


def _summary_state(dir_fd: int, path: str, summary: Summary, chain: list[Item],
                   blobs: dict[str, bytes]) -> State:
    def read(name: str) -> list[dict[str, Any]]:
        blob = blobs[name] if name in blobs else _read.read_file(dir_fd, name)
        return parse(blob, f"{path}/{name}", "summary")

    folded, through = fold_chain(summary, read_state(dir_fd) or State(), chain, read)
    return State(folded=through, summary=folded)


def _covered(dir_fd: int, items: list[Item], keep: list[Item], seen: dict[str, bytes]) -> list[str]:
    """Every file inside the range of a segment of ``keep`` (but those): the leftovers
    of compactions, for step 6. A part :func:`misplaced` there stays: a batch a stale
    writer linked at a freed name, which its writer commits again from its temp file,
    or ``check --repair`` once that is gone (found by review: removed, a batch whose
    temp file gc had taken was in no file). ``seen``: bytes already read, by name (a
    segment's are taken from it; a part is read afresh: its name may have been linked
    again since). A name freed and linked again between this look and the unlink is
    a stale writer's part that its writer links again above (the commit rule)."""
    names = {name for _f, _l, name in keep}

    def read(name: str) -> bytes:
        if name not in names:
            return _read.read_file(dir_fd, name)
        if name not in seen:
            seen[name] = _read.read_file(dir_fd, name)
        return seen[name]

    doomed = []
    for first, last, name in items:
        if name in names or not any(f != l and f <= first and last <= l for f, l, _n in keep):
            continue
        try:
            if first == last and misplaced(read, keep, first, name):
                continue
        except OSError:
            continue  # gone, or unreadable: the next compaction looks again
        doomed.append(name)
    return doomed
