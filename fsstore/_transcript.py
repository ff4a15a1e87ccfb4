"""One transcript on disk (format 2): committing a batch, and reading the transcript back.

A transcript is a directory (``main/`` or ``subkeys/<SP>/``) of immutable JSONL
files: *parts* ``<n>.jsonl`` (one committed ``append()`` batch each, ``n`` a
20-digit number) and *segments* ``<first>-<last>.jsonl`` (the parts
``first..last`` merged by compaction). The transcript is the **shortest chain of
files whose ranges follow each other from 1 to the highest number** (:func:`plan`);
any other file (a part inside a segment's range, a segment overlapping the chain)
is not part of it. Nothing in this module needs the transcript lock to be
exclusive: the lock orders writers and keeps contention cheap.

Commit (``append``), step by step, and what a crash at each step leaves:

1. Encode the batch (one JSON object per line). Bad input raises ``INVALID_ENTRY``
   here, before anything touches disk.
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
   again.
6. List the directory twice (the *check*: :func:`check`; a segment in either
   listing counts, since one listing can be torn by a compaction). A segment
   covering ``n`` that does not hold the batch's bytes means that another writer
   used ``n`` and a compaction merged and removed it while this writer's view was
   old (two holders overlapped: a stall, a clock, a reclaimed lock). A part inside
   a segment's range is not in the chain, so the batch is not committed: link it
   again above the highest number, remove the misplaced name, check again. (A
   covering segment that holds the bytes merged this very part after the link:
   committed.) Likewise a part above a hole (``n - 1`` in no file): ``n`` came
   from a stale view (a client cache still showing a file of a directory another
   host deleted and made anew): link it again above the highest number of the
   others. A ``.deleted`` marker means the transcript is being deleted: remove
   the name, and start over in a new directory. Otherwise the part is in the chain
   of every listing from now on (a segment made later over its number was made
   from a listing that held it): **the batch is committed**. Crash before the
   check passed: an unacknowledged part, in the chain or skipped; both fine.
7. With ``fsync=True``, fsync the directory.
8. Unlink the temp name (a second link to the part; crash: gc removes it), release
   the lock. Compaction may follow (:mod:`fsstore._compact`).

A failed append leaves no part: every name it linked is unlinked before it
raises. Errors come out as :class:`~fsstore.FsStoreError` with the POSIX code.

Why order holds without the lock: numbers are taken first come, first served by
``link``, and a writer only keeps a number above everything committed when it
linked (a free number below the highest is always inside a segment: step 6). Two
overlapping holders may therefore reorder their own batches, nothing else.

Reading (:func:`read_snapshot`): list, plan, read every file of the chain, list
again. A listing is not atomic once it takes more than one ``getdents`` call: it
can miss a segment made behind its cursor while the parts it merged are gone
ahead of it (a hole, or at the tail a listing that ends early). Files that exist
for the whole listing are always in it, so a part the first listing lacks was
committed after the load began; a segment it lacks may hold parts committed
before. So the snapshot holds only when the second listing's chain begins with
the first's and continues with parts only; otherwise (a compaction ran) the
caller reads again. A file that vanished between listing and reading is the same
race. A ``.deleted`` marker means the transcript is gone (:class:`Deleted`).
"""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from . import _fsio, _layout
from ._errors import FsStoreError, log
from ._limits import beyond_limits

_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=True)




def encode_batch(entries: object, operation: str) -> bytes:
    """The part-file bytes for a batch: one JSON object per line, ASCII only."""
    if not isinstance(entries, list):
        raise FsStoreError(
            "INVALID_ENTRY",
            f"entries must be a list, not {type(entries).__name__}",
            operation=operation,
        )
    lines = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise FsStoreError(
                "INVALID_ENTRY",
                f"entry {i} must be a JSON object (dict), not {type(entry).__name__}",
                operation=operation,
            )
        try:
            line = _ENCODER.encode(entry)
        except (TypeError, ValueError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else exc
            raise FsStoreError(
                "INVALID_ENTRY", f"entry {i} is not JSON-serializable: {why}", operation=operation
            ) from exc
        beyond = beyond_limits(entry, line)  # what readers could not parse back
        if beyond is not None:
            raise FsStoreError("INVALID_ENTRY", f"entry {i} {beyond}", operation=operation)
        lines.append(line)
    lines.append("")
    return "\n".join(lines).encode("ascii")


# -- the state file: the Claude summary, written by compaction -------------------


@dataclass
class State:
    """``state.json``: the session summary folded up to part ``folded`` (a hint)."""

    folded: int = 0
    summary: dict[str, Any] | None = None

    def to_bytes(self) -> bytes:
        return _ENCODER.encode({"format": 2, "folded": self.folded,
                                "summary": self.summary}).encode("ascii")


def read_state(dir_fd: int) -> State | None:
    """The state file, or None if there is none fsstore can use (missing, torn, foreign)."""
    try:
        raw = _fsio.read_file(dir_fd, _layout.STATE, limit=MAX_STATE_BYTES)
    except (FileNotFoundError, _fsio.NotAFile):
        return None
    return parse_state(raw)


# A summary holds as much as an entry's longest last-wins field (a 20 MB prompt).
MAX_STATE_BYTES = 1 << 30


def parse_state(raw: bytes) -> State | None:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    folded, summary = doc.get("folded"), doc.get("summary")
    if type(folded) is not int or not 0 <= folded <= _layout.MAX_SEQ:
        return None
    if not isinstance(summary, dict):
        summary, folded = None, 0
    return State(folded, summary)


def write_state(fs: _fsio.Fs, dir_fd: int, state: State) -> None:
    """Replace state.json with a temp file renamed over it (readers see old or new)."""
    tmp = _fsio.temp_name("-state")
    fs.write_new(dir_fd, tmp, state.to_bytes(), sync=False)
    try:
        os.rename(tmp, _layout.STATE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        _fsio.unlink_quiet(dir_fd, tmp)
        raise


# -- listing ---------------------------------------------------------------------

Item = tuple[int, int, str]


class Deleted(Exception):
    """The transcript is marked ``.deleted`` (``session``: its session's main
    transcript is, which deletes the whole session): a delete is under way."""

    def __init__(self, what: str, *, session: bool = False) -> None:
        super().__init__(what)
        self.session = session


def check_session_marker(dir_fd: int, session_marker: str | None) -> None:
    """:class:`Deleted` if ``session_marker`` (a path relative to a subagent
    transcript: its session's ``main/.deleted``) exists."""
    if session_marker is None:
        return
    try:
        os.stat(session_marker, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    raise Deleted(session_marker, session=True)


class Vanished(Exception):
    """A listed file disappeared, or the directory changed while it was read: read again."""


def scan(dir_fd: int) -> tuple[list[Item], bool]:
    """Every part and segment as ``(first, last, name)``, and whether the directory
    is marked deleted."""
    items = []
    deleted = False
    for name in _fsio.listdir(dir_fd):
        rng = _layout.parse_item(name)
        if rng is not None:
            items.append((rng[0], rng[1], name))
        elif name == _layout.DELETED:
            deleted = True
    return items, deleted


def scan_items(dir_fd: int) -> list[Item]:
    return scan(dir_fd)[0]


def top(items: list[Item]) -> int:
    """The highest number any file holds (0 for none)."""
    return max((last for _first, last, _name in items), default=0)


def covering_segment(items: list[Item], seq: int) -> str | None:
    """A segment whose range holds ``seq``, if any."""
    for first, last, name in items:
        if first != last and first <= seq <= last:
            return name
    return None


def plan(items: list[Item]) -> tuple[list[Item], int | None]:
    """The files that make up the transcript, in order, and the first missing number
    (None when the chain is whole).

    The chain is the one with the fewest files among those whose ranges follow each
    other exactly from 1 to the highest number: a segment is preferred to the parts
    it merged (leftovers of a compaction in flight or killed), a part inside a
    segment's range is never taken (see the commit's step 6), and of two segments
    that overlap (two compactions that overlapped) the one the chain can continue
    from is taken. Where no such chain exists (a file lost outside fsstore), the
    widest file at each start is taken and the first hole reported.
    """
    if not items:
        return [], None
    best: dict[int, tuple[int, Item | None]] = {0: (0, None)}
    for item in sorted(items, key=lambda it: (it[1], it[0])):
        prev = best.get(item[0] - 1)
        if prev is None:
            continue
        known = best.get(item[1])
        if known is None or prev[0] + 1 < known[0]:
            best[item[1]] = (prev[0] + 1, item)
    end = top(items)
    if end in best:
        chain = []
        while end:
            link = best[end][1]
            assert link is not None
            chain.append(link)
            end = link[0] - 1
        chain.reverse()
        return chain, None
    chosen: list[Item] = []
    covered = 0
    gap = None
    for item in sorted(items, key=lambda it: (it[0], -it[1])):
        if item[0] <= covered:
            continue
        if gap is None and item[0] != covered + 1:
            gap = covered + 1
        chosen.append(item)
        covered = item[1]
    return chosen, gap


# -- commit ----------------------------------------------------------------------


# How often a commit that landed above a hole links again lower (a client whose cache
# still names files that are gone can refuse every lower number: sshfs's 20 s cache).
_HOLE_RETRIES = 2


def commit(
    fs: _fsio.Fs, dir_fd: int, tmp: str, seq: int, payload: bytes,
    session_marker: str | None = None,
) -> tuple[int, list[Item]]:
    """Give the temp file ``tmp`` (holding ``payload``) a part name from ``seq`` on
    (steps 5 and 6 of the module docstring); return its number and the listing that
    checked it.

    Raises :class:`Deleted` (nothing left behind) when the directory is being
    deleted, FileNotFoundError when the directory or the batch vanished under us
    (the caller starts over; nothing of the batch is committed).
    """
    misplaced: list[str] = []
    src = tmp
    holes = 0
    try:
        while True:
            name = _layout.part_name(seq)
            linked = _fsio.link_noreplace(fs, dir_fd, src, name)
            if linked is None:  # taken: our view was old; a client cache may be too (sshfs)
                _fsio.refresh_listing(dir_fd)
                seq = max(seq, top(scan_items(dir_fd))) + 1
                continue
            if not linked:
                src = name  # moved, not linked (a mount without hard links)
            try:
                items, cover = check(dir_fd, seq, session_marker)
                if cover is not None and payload in _fsio.read_file(dir_fd, cover):
                    # A compaction that listed our part after we linked it merged it:
                    # the batch is in the chain, in that segment.
                    return seq, items
            except BaseException:
                misplaced.append(name)  # not committed: the check did not pass
                raise
            others = [it for it in items if it[2] != name and it[2] not in misplaced]
            hole = seq > 1 and not any(f <= seq - 1 <= last for f, last, _n in others)
            if cover is None and (not hole or holes >= _HOLE_RETRIES):
                return seq, items  # (past the retries: a client that keeps naming gone files)
            holes += cover is None
            # Not in the chain: inside a compacted range (two lock holders overlapped),
            # or above a hole (a number taken from a stale view: a client cache that
            # still shows a file of a directory deleted and made anew).
            log.warning("part %s landed %s; committing it again", name,
                        "inside a compacted range (two lock holders overlapped)" if cover
                        else "above a hole (a stale view of the directory)", extra={
                            "code": "RELOCATED", "operation": "append", "path": name})
            if linked:
                misplaced.append(name)
            seq = top(others) + 1
    finally:
        for name in misplaced:
            _fsio.unlink_quiet(dir_fd, name)


def check(dir_fd: int, seq: int, session_marker: str | None) -> tuple[list[Item], str | None]:
    """The commit's check of part ``seq``: the listing, and a segment whose range holds
    ``seq`` (None: the part is in the chain); :class:`Deleted` if marked.

    Two listings, and a segment in either counts: one listing that takes several
    ``getdents`` calls can miss a segment that a compaction made behind its cursor
    while removing, ahead of it, the segment it replaced (found by review: a stale
    writer then took its misplaced part for committed). A segment made over ``seq``
    exists for the whole of the second listing unless yet another compaction
    replaces it during it."""
    first, deleted = scan(dir_fd)
    again, deleted_again = scan(dir_fd)
    check_session_marker(dir_fd, session_marker)  # first: the session's delete, if it is one
    if deleted or deleted_again:
        raise Deleted(_layout.part_name(seq))
    cover = covering_segment(first, seq) or covering_segment(again, seq)
    return again, cover


# -- reading ---------------------------------------------------------------------


def parse(data: bytes, path: str, operation: str) -> list[dict[str, Any]]:
    """Entries of one part or segment; CORRUPT (with the line) if it does not parse."""
    if not data.endswith(b"\n"):
        raise FsStoreError(
            "CORRUPT",
            "file is empty or its last line is torn (no final newline)",
            operation=operation,
            path=path,
        )
    lines = data.count(b"\n")
    # A JSON string never holds a raw newline, so the lines joined by commas form
    # one JSON array: one json.loads call instead of one per line.
    try:
        entries = json.loads(b"[" + data[:-1].replace(b"\n", b",") + b"]")
    except (ValueError, RecursionError):  # RecursionError: nested deeper than we can parse
        entries = None
    if (
        isinstance(entries, list)
        and len(entries) == lines
        and all(type(e) is dict for e in entries)
    ):
        return entries
    for lineno, line in enumerate(data.split(b"\n")[:-1], start=1):
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise FsStoreError(
                "CORRUPT", f"line {lineno} is not valid JSON: {exc}", operation=operation, path=path
            ) from exc
        if not isinstance(entry, dict):
            raise FsStoreError(
                "CORRUPT", f"line {lineno} is not a JSON object", operation=operation, path=path
            )
    raise FsStoreError("CORRUPT", "line structure is damaged", operation=operation, path=path)


def read_snapshot(
    dir_fd: int, path: str, operation: str, session_marker: str | None = None
) -> tuple[list[tuple[int, list[dict[str, Any]]]], int | None]:
    """``(last number, entries)`` of every file of the chain, in order, and the first
    missing number if the chain has a hole: :func:`snapshot`, raised from.
    :class:`Deleted` if the transcript is being deleted, :class:`Vanished` on a race
    with a compaction (see the module docstring), else the first damaged file's error
    (``CORRUPT`` naming file and line, or the read's OSError)."""
    seen = snapshot(dir_fd, path, operation, session_marker=session_marker)
    if seen.deleted is not None:
        raise seen.deleted
    if seen.race is not None:
        raise seen.race
    if seen.damage:
        raise seen.damage[0].error
    return seen.batches, seen.gap


# -- reading: what a reader saw -------------------------------------------------

#: How often a reader reads a transcript that keeps changing under it (compactions,
#: deletes), and after how many lost reads it reads under the transcript lock where
#: it may take it (a writer compacting faster than a listing is read can make every
#: listing stale): ``load`` and ``fsstore``'s commands read by these.
READ_ATTEMPTS = 50
UNLOCKED_READS = 8

_LINE = re.compile(r"line ([0-9]+)")


@dataclass
class Damage:
    """A file of the chain that could not be read or parsed."""

    name: str
    error: FsStoreError | OSError  # CORRUPT (the message says what), or the read's OSError
    line: int | None = None  # the first bad line, where a line is to blame


@dataclass
class Snapshot:
    """What one read of a transcript saw (:func:`snapshot`). The reader decides what it
    means: ``fsstore check`` reports it, ``load`` raises from it."""

    items: list[Item]  # the first listing's parts and segments
    chain: list[Item]  # the files of the transcript, in order (:func:`plan`)
    gap: int | None  # the first missing number, where the chain has a hole
    batches: list[tuple[int, list[dict[str, Any]]]]  # (last number, entries) of each file read
    damage: list[Damage]  # files of the chain that could not be read or parsed, in order
    deleted: Deleted | None  # a ``.deleted`` mark (``session``: the session's) was seen
    race: Vanished | None  # the transcript changed while it was read: read it again


def snapshot(
    dir_fd: int, path: str, operation: str, *, read: bool = True,
    first: tuple[list[Item], bool] | None = None, session_marker: str | None = None,
) -> Snapshot:
    """List, plan, read every file of the chain (unless ``read`` is false), list again
    (see the module docstring), and return everything seen: ``load`` raises from it
    (:func:`read_snapshot`), ``fsstore check`` reports it. ``first``: the first
    listing (what :func:`scan` returns), where the caller made it itself (with a
    ``stat`` of each entry, say).

    The snapshot holds (``race`` is None) when the second listing's chain begins with
    the first's and continues with parts only, and no file of the chain vanished
    before it was read (see the module docstring); a gap or damage in a snapshot
    that holds is in the transcript, not in the listing."""
    items, marked = scan(dir_fd) if first is None else first
    chain, gap = plan(items)
    batches: list[tuple[int, list[dict[str, Any]]]] = []
    damage: list[Damage] = []
    race: Vanished | None = None
    for _first, last, name in chain if read else ():
        fpath = f"{path}/{name}"
        try:
            data = _fsio.read_file(dir_fd, name)
        except _fsio.NotAFile as exc:
            err = FsStoreError("CORRUPT", "not a regular file", operation=operation, path=fpath)
            err.__cause__ = exc
            damage.append(Damage(name, err))
            continue
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ESTALE):  # ESTALE: another host removed it
                damage.append(Damage(name, exc))
            elif race is None:
                race = Vanished(name)
                race.__cause__ = exc
            continue
        try:
            batches.append((last, parse(data, fpath, operation)))
        except FsStoreError as err:
            m = _LINE.search(err.message)
            line = int(m.group(1)) if m else (
                data.count(b"\n") + 1 if data and not data.endswith(b"\n") else None)
            damage.append(Damage(name, err, line))
    again, marked_again = scan(dir_fd)
    after = plan(again)[0]
    if race is None and (after[: len(chain)] != chain
                         or any(f != l for f, l, _n in after[len(chain):])):
        race = Vanished(path)
    deleted = None
    try:
        check_session_marker(dir_fd, session_marker)  # first: the session's delete, if it is one
    except Deleted as exc:
        deleted = exc
    if deleted is None and (marked or marked_again):
        deleted = Deleted(path)
    return Snapshot(items, chain, gap, batches, damage, deleted, race)


def warn_gap(gap: int, path: str, operation: str) -> None:
    """The GAP warning of a transcript read with a piece missing."""
    log.warning("sequence gap: part %d is missing (files lost outside fsstore?); run "
                "`fsstore check`", gap, extra={"code": "GAP", "operation": operation, "path": path})


def dedupe(batches: list[tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Concatenate; an entry whose string ``uuid`` was seen before is dropped."""
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    add = seen.add
    for _last, batch in batches:
        for entry in batch:
            uuid = entry.get("uuid")
            if type(uuid) is str:
                if uuid in seen:
                    continue
                add(uuid)
            out.append(entry)
    return out
