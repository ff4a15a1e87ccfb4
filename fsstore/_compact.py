"""Compaction: merging a transcript's committed files into one segment.

Thousands of small parts make ``load()`` open thousands of files; a segment is the
same bytes in one file. Compaction runs under the transcript lock, automatically
from ``append()`` once ``compact_every`` parts have accumulated since the last one,
or on demand (``compact(key)``, ``fsstore compact``).

Steps, and what readers and crashes see:

1. List the directory; :func:`fsstore._transcript.plan` gives the files that make
   up the transcript, in order.
2. Choose what to merge. On demand: everything. Automatically: the new parts plus
   every trailing segment no larger than what is merged after it, like carries in
   a binary counter, so each byte is copied O(log n) times and a transcript has
   O(log n) segments.
3. Concatenate the chosen files' bytes into a temp file (parts are validated
   first; segments were validated when they were made); fsync if ``fsync=True``.
4. Check that the lock is still ours to act on (:class:`fsstore._lock.Held`), then
   move the temp file, no-replace, to ``<first>-<last>.jsonl``. This is the commit
   point: before it readers read the small files; after it they pick the segment
   and skip every file inside its range. Either way each entry once.
5. fsync the directory; record ``compacted = last`` in the state file.
6. Unlink the merged files and any other leftovers inside the range. A reader that
   listed them before the unlink gets ENOENT opening one and starts over.

A crash after step 4 leaves files covered by the segment: readers skip them, and
the next compaction removes them. A crash before leaves a temp file (``fsstore gc``).
Entries are copied verbatim: duplicates by ``uuid`` stay, and load() still drops
them, so compaction never changes what ``load()`` returns.
"""

from __future__ import annotations

import os

from . import _fsio, _layout
from ._errors import FsStoreError
from ._lock import Held
from ._transcript import (
    State,
    check_no_late_parts,
    checked_plan,
    first_gap,
    parse,
    scan_items,
    write_state,
)

Item = tuple[int, int, str]


def choose(chosen: list[Item], *, everything: bool) -> int:
    """Index of the first file of the suffix of ``chosen`` to merge."""
    if everything:
        return 0
    merged = 0
    start = len(chosen)
    for i in range(len(chosen) - 1, -1, -1):
        first, last, _name = chosen[i]
        span = last - first + 1
        if first != last and span > merged:
            break  # a bigger segment: merging it now would copy too much too often
        merged += span
        start = i
    return start


def compact(
    fs: _fsio.Fs,
    dir_fd: int,
    path: str,
    held: Held,
    state: State,
    *,
    everything: bool,
    operation: str,
) -> int:
    """Merge (see the module docstring); return how many files were merged (0: none)."""
    items = scan_items(dir_fd)
    chosen = checked_plan(items, path, operation)
    # A part committed after the segment that covers it must not be unlinked as a
    # leftover (see check_no_late_parts): refuse, and leave it for `fsstore check`.
    check_no_late_parts(dir_fd, items, chosen, path, operation)
    if first_gap(chosen) is not None:
        # Merging across a gap would hide it (a part lost by hand, or by a disk):
        # leave the files as they are for `fsstore check` to report.
        raise FsStoreError("CORRUPT", "sequence gap: refusing to compact across it",
                           operation=operation, path=path)
    start = choose(chosen, everything=everything)
    merge = chosen[start:]
    covered = {name for _f, _l, name in items} - {name for _f, _l, name in chosen}
    if len(merge) < 2:
        _remove(dir_fd, covered)
        return 0
    data = []
    newest = 0
    for first, last, name in merge:
        blob = _fsio.read_file(dir_fd, name)
        if first == last:
            parse(blob, f"{path}/{name}", operation)  # never copy a damaged part
        data.append(blob)
        newest = max(newest, os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime_ns)
    first, last = merge[0][0], merge[-1][1]
    tmp = _fsio.temp_name("-segment")
    fs.write_new(dir_fd, tmp, b"".join(data))
    segment = _layout.segment_name(first, last)
    try:
        # Compaction changes how entries are stored, not when they were written: the
        # segment carries the newest merged mtime (retention goes by file age). Set
        # on the temp file, so that the move is the last change of the segment's
        # ctime: readers tell a leftover from a later commit by ctime. (`fsstore gc`
        # ages temp files by their ctime too, so the back-dated temp is not garbage.)
        os.utime(tmp, ns=(newest, newest), dir_fd=dir_fd, follow_symlinks=False)
        held.check(operation)
        if not _fsio.move_noreplace(fs, dir_fd, tmp, segment):
            return 0  # the same segment exists already: a crashed compaction made it
        tmp = ""
    finally:
        if tmp:
            _fsio.unlink_quiet(dir_fd, tmp)
    fs.sync_dir(dir_fd)
    state.compacted = max(state.compacted, last)
    state.seq = max(state.seq, last)
    held.check(operation)  # a holder past its lease must not write an old sequence
    _write_state_keeping_mtime(fs, dir_fd, state)
    _remove(dir_fd, covered | {name for _f, _l, name in merge})
    return len(merge)


def _write_state_keeping_mtime(fs: _fsio.Fs, dir_fd: int, state: State) -> None:
    """Record ``compacted`` without moving the session's mtime (state.json's mtime is
    what list_sessions reports; compacting an old session must not make it look new)."""
    try:
        old = os.stat(_layout.STATE, dir_fd=dir_fd, follow_symlinks=False).st_mtime_ns
    except FileNotFoundError:
        old = None
    write_state(fs, dir_fd, state)
    if old is not None:
        os.utime(_layout.STATE, ns=(old, old), dir_fd=dir_fd, follow_symlinks=False)


def _remove(dir_fd: int, names: set[str]) -> None:
    for name in sorted(names):
        _fsio.unlink_quiet(dir_fd, name)
