"""One transcript on disk (format 2): committing a batch, and reading the transcript back.

A transcript is a directory (``main/`` or ``subkeys/<SP>/``) of immutable JSONL
files: *parts* ``<n>.jsonl`` (one committed ``append()`` batch each, ``n`` a
20-digit number) and *segments* ``<first>-<last>.jsonl`` (the parts
``first..last`` merged by compaction). The transcript is the **shortest chain of
files whose ranges follow each other from 1 to the highest number** (:func:`plan`),
without a part that a segment over it does not hold (:func:`plan_held`); any other
file (a leftover inside a segment's range, a segment overlapping the chain) is not
part of it. Nothing in this module needs the transcript lock to be
exclusive: the lock orders writers and keeps contention cheap.

Reading (:func:`read_snapshot`): list, plan, read every file of the chain (each
once), list twice again (a name read may have been freed and linked again since).
A listing is not atomic once it takes more than one ``getdents`` call: it can
miss a segment made behind its cursor while the parts it merged are gone ahead of
it (a hole, or at the tail a listing that ends early). Files that exist
for the whole listing are always in it, so a part the first listing lacks was
committed after the load began; a segment it lacks may hold parts committed
before. So the snapshot holds only when the later listings' chains begin with
the first's and continue with parts only; otherwise (a compaction ran) the
caller reads again. A file that vanished between listing and reading is the same
race. A ``.deleted`` marker means the transcript is gone (:class:`Deleted`).
"""

from __future__ import annotations

import bisect
import errno
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _fsio, _layout, _read
from ._errors import FsStoreError, log
from ._limits import beyond_limits

ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=True)


# -- a batch's bytes (step 1 of a commit: fsstore._commit) -----------------------


def encode_batch(entries: object, operation: str) -> bytes:
    """The part-file bytes for a batch: one JSON object per line, ASCII only; the first
    line begins with :data:`BATCH_START`, the last ends with the batch's :func:`nonce`."""
    if not isinstance(entries, list):
        raise FsStoreError("INVALID_ENTRY", f"entries must be a list, not {type(entries).__name__}",
                           operation=operation)
    lines = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise FsStoreError("INVALID_ENTRY", f"entry {i} must be a JSON object (dict), not "
                               f"{type(entry).__name__}", operation=operation)
        try:
            line = ENCODER.encode(entry)
        except (TypeError, ValueError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else exc
            raise FsStoreError(
                "INVALID_ENTRY", f"entry {i} is not JSON-serializable: {why}", operation=operation
            ) from exc
        beyond = beyond_limits(entry, line)  # what readers could not parse back
        if beyond is not None:
            raise FsStoreError("INVALID_ENTRY", f"entry {i} {beyond}", operation=operation)
        lines.append(line)
    lines[0] = BATCH_START + lines[0]
    lines[-1] += nonce()
    lines.append("")
    return "\n".join(lines).encode("ascii")


# What begins a batch's first line (since stop 43): JSON whitespace, which every JSON
# reader skips. A batch that begins with it ends with its nonce, so a file cut short at
# a line boundary inside its last batch is told from a whole one (:func:`parse`); a
# batch written before has neither mark, or only the nonce (stop 23), and is read as
# it always was.
BATCH_START = " "
_NONCE_BITS = 32
_AS_WHITESPACE = str.maketrans("01", " \t")
_NONCED_END = re.compile(rb"[ \t]\r?\n")  # a batch's last line: its nonce, then the newline
_START = BATCH_START.encode("ascii")


def nonce() -> str:
    """What ends a batch's last line: :data:`_NONCE_BITS` random bits written as JSON
    whitespace (spaces and tabs), which every JSON reader skips. Two batches of equal
    entries differ by it, so a segment that holds a batch's bytes holds that very
    batch (step 6), not another writer's equal one. From the system's random source:
    an application that seeds :mod:`random` must not make two batches equal (found by
    review)."""
    bits = int.from_bytes(os.urandom(_NONCE_BITS // 8), "big")
    return format(bits, f"0{_NONCE_BITS}b").translate(_AS_WHITESPACE)


def nonced(batch: bytes) -> bool:
    """Whether ``batch`` ends with a nonce (written since stop 23): its bytes are then
    this batch's only."""
    return batch.rstrip(b"\n")[-1:] in (b" ", b"\t")


# -- the state file: the Claude summary, written by compaction -------------------


@dataclass
class State:
    """``state.json``: the session summary folded up to part ``folded`` (a hint)."""

    folded: int = 0
    summary: dict[str, Any] | None = None

    def to_bytes(self) -> bytes:
        return ENCODER.encode({"format": 2, "folded": self.folded,
                                "summary": self.summary}).encode("ascii")


def read_state(dir_fd: int) -> State | None:
    """The state file, or None if there is none fsstore can use (missing, torn, foreign).

    It is the one file another host replaces. A GlusterFS client resolves its name to
    the replaced file until it lists the directory (the open succeeds; fstat, read
    and close answer ESTALE, for up to a second: found by review, summaries left a
    session out), so after ESTALE it lists and reads once more."""
    try:
        try:
            raw = _read.read_file(dir_fd, _layout.STATE, limit=MAX_STATE_BYTES)
        except OSError as exc:
            if exc.errno != errno.ESTALE:
                raise
            _fsio.listdir(dir_fd)
            raw = _read.read_file(dir_fd, _layout.STATE, limit=MAX_STATE_BYTES)
    except (FileNotFoundError, _read.NotAFile):
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
    transcript is, which deletes the whole session): a delete is under way. Or (``left``)
    its directory is no longer at its name, and the part an append linked there was
    taken back, or could not be reached to be: a merge may have copied it meanwhile
    (:func:`fsstore._commit._moved_back_with_it` looks)."""

    def __init__(self, what: str, *, session: bool = False, left: bool = False) -> None:
        super().__init__(what)
        self.session, self.left = session, left


def check_session_marker(dir_fd: int, session_marker: str | None) -> None:
    """:class:`Deleted` if ``session_marker`` (a path relative to a subagent
    transcript: its session's ``main/.deleted``) is there, as the server says
    (:func:`_read.mark_there`)."""
    if session_marker is not None and _read.mark_there(dir_fd, session_marker):
        raise Deleted(session_marker, session=True)


class Vanished(Exception):
    """A listed file disappeared, or the directory changed while it was read: read again.
    Its text says which (a reader that gives up names the last)."""


def scan(dir_fd: int) -> tuple[list[Item], bool]:
    """Every part and segment as ``(first, last, name)``, and whether the directory
    is marked deleted."""
    items, deleted, _pruning = scan_marks(dir_fd)
    return items, deleted


def scan_marks(dir_fd: int) -> tuple[list[Item], bool, list[str]]:
    """:func:`scan`, and the prunes' marks not yet committed (``_layout.pruning``)."""
    items = []
    deleted = False
    pruning = []
    for name in _fsio.listdir(dir_fd):
        rng = _layout.parse_item(name)
        if rng is not None:
            items.append((rng[0], rng[1], name))
        elif name == _layout.DELETED:
            deleted = True
        elif _layout.pruning(name):
            pruning.append(name)
    return items, deleted, pruning


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
    it merged (leftovers of a compaction in flight or killed), and of two segments
    that overlap (two compactions that overlapped) the one the chain can continue
    from is taken; with two such, a chain can run through a part inside the other's
    range (:func:`plan_held` takes it only if that segment holds it). Where no such
    chain exists (a file lost outside fsstore), the files that do not overlap and
    cover the most numbers are taken (the fewest of them among equals), and the
    first hole reported: where a compactor that died before its check left a
    segment crossing another, the parts beside them still make a chain through
    either (found by review: the widest file at each start hid what the other held).
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
    return _covering_most(items)


def _covering_most(items: list[Item]) -> tuple[list[Item], int | None]:
    """:func:`plan` where no whole chain exists: weighted interval scheduling over the
    files' ranges (numbers covered, then fewer files), and the first hole."""
    ordered = sorted(items, key=lambda it: (it[1], it[0]))
    ends = [it[1] for it in ordered]
    # best[i]: (numbers covered, -files, the last file taken and best[] index before it)
    # using the first i files of ``ordered``.
    best: list[tuple[int, int, tuple[int, int] | None]] = [(0, 0, None)]
    for i, (first, last, _name) in enumerate(ordered):
        j = bisect.bisect_left(ends, first)  # the files that end before this one begins
        covered, files, _ = best[j]
        take = (covered + last - first + 1, files - 1, (i, j))
        best.append(take if take[:2] > best[i][:2] else best[i])
    chosen: list[Item] = []
    link = best[-1][2]
    while link is not None:
        chosen.append(ordered[link[0]])
        link = best[link[1]][2]
    chosen.reverse()
    covered = 0
    for first, last, _name in chosen:
        if first != covered + 1:
            return chosen, covered + 1
        covered = last
    return chosen, None


def tick_mtime(dfd: int, before_ns: int) -> None:
    """Move the directory's mtime (the session's mtime) 1 ms past both what it is now,
    after the commit's link, and what it was before the commit. The SDK takes a summary
    whose mtime equals list_sessions' (in whole ms) for current, and file systems stamp
    with a coarse clock (ext4: a few ms): a summary listed before the link, stamped
    with an mtime that another writer's temp file (made outside the lock) or a
    compaction's writes had set in the link's tick, would otherwise look current
    without this batch (found by review, stop 32: 4 to 12 of 200 staged appends, 1 of
    1,572 summaries unstaged). Every mtime a reader saw before the link is at most the
    later of the two. Only ever forward, from the storage's own times. Only the owner
    may set times: in a store shared by a group, another uid's commit is left as its
    link stamped it."""
    st = os.fstat(dfd)
    if os.geteuid() not in (0, st.st_uid):
        return
    ms = max(st.st_mtime_ns, before_ns) // 1_000_000 + 1
    os.utime(".", ns=(st.st_atime_ns, ms * 1_000_000), dir_fd=dfd)


def past_now(dfd: int) -> None:
    """Move the directory's mtime 1 ms past the storage's now, which is past every link
    made so far: after a write of the mtime that may have come late (its hold past the
    lease, or overlapped): another holder may have committed and ticked meanwhile, and
    that write set the mtime below it, so a summary made before that commit looked
    current again (review, stop 32: a stalled tick or compaction put-back)."""
    os.utime(".", dir_fd=dfd)  # the storage's own now
    tick_mtime(dfd, 0)


# The clock file systems stamp with: every later stamp is at least what it reads now.
# On Linux the coarse one, which Python does not name (5); the precise clock runs up to
# a few ms ahead of it, and kernels stamp files within that (review, stop 33).
_STAMP_CLOCK = getattr(time, "CLOCK_REALTIME_COARSE", 5 if sys.platform == "linux" else time.CLOCK_REALTIME)


def settled_mtime(dfd: int, deadline: float) -> tuple[int, bool]:
    """The directory's mtime (ns), once this host's clock has passed the stamp unit it
    falls in (1 ms; 1 s where the storage keeps whole seconds, as SFTP does), and
    whether it did before ``deadline`` (``time.monotonic()``); a session that changes
    while waited for is not waited for again.

    A summary read after this is current as of that mtime: every change after its
    listing is stamped later, in a later unit, so the SDK's ``summary.mtime <
    list_sessions mtime`` sees it. Stamping a summary with the mtime read before its
    listing was not enough (review, stop 33): a commit's tick can run ahead of the
    clock (a tick is 1 ms past the last, and appends come faster), and another
    writer's temp file then set the mtime back to the clock's now, below a summary
    that left out the commit (29 of 30 staged; 4 of 65 summaries of one back-to-back
    writer); and on sshfs the tick is cut to the second (92 of 99). Where this host's
    clock is ahead of the storage's (another host's NFS server), the promise holds
    only as far as the clocks agree: run NTP."""
    waited_for = None
    while True:
        mtime = os.fstat(dfd).st_mtime_ns
        unit = 1_000_000_000 if mtime % 1_000_000_000 == 0 else 1_000_000
        wait = (mtime - mtime % unit + unit - time.clock_gettime_ns(_STAMP_CLOCK)) / 1e9
        if wait <= 0:
            return mtime, True
        if waited_for not in (None, mtime) or time.monotonic() + wait > deadline:
            return mtime, False  # changed while waited for (being written): not chased
        time.sleep(max(wait, 0.001))  # (the coarse clock moves in ticks of a few ms)
        waited_for = mtime


def summary_stamp(mtime_ns: int, settled: bool) -> int:
    """A summary's ``mtime`` (ms) from :func:`settled_mtime`: the mtime where it settled,
    else 1 ms below it (the SDK then folds the session from its transcript)."""
    return mtime_ns // 1_000_000 - (0 if settled else 1)


def misplaced(read: Callable[[str], bytes | None], items: list[Item], n: int, part: str) -> bool:
    """Whether ``part`` (number ``n``) is a batch misplaced under a segment of ``items``:
    one whose range holds ``n`` does not hold its bytes. The one test of the commit
    rule: a compaction's leftover is byte for byte a piece of every segment made over
    it (each batch's nonce makes its bytes its own); a batch a stale writer linked at a
    name a compaction freed is in none. ``read`` gives a file's bytes (None: unreadable,
    counted as holding) or raises."""
    over = [name for first, last, name in items if first != last and first <= n <= last]
    data = read(part) if over else None
    return data is not None and any(held is not None and data not in held for held in map(read, over))


def plan_held(items: list[Item], dir_fd: int, seen: dict[str, bytes]) -> tuple[list[Item], int | None]:
    """:func:`plan`, never taking a part that a listed segment over its number does not
    hold: a stale writer's link at a name a compaction freed (not committed: its writer
    links it again above, or the next compaction removes it), which a reader or a
    compaction would otherwise read in place of the batch the segment holds (found by
    review). A segment over a committed part holds its bytes (made from a chain that
    held the part; nonces make equal batches differ): taking either is the same.

    Files are read only where the plan takes a part under a segment, which
    overlapping segments of two compactions can make it do. What is read goes into
    ``seen`` (and is taken from it): the caller uses those very bytes, since the name
    can be freed and linked again after this look (found by review). A file gone
    meanwhile raises :class:`Vanished`; one that cannot be read otherwise counts as
    holding (the caller's own read reports it)."""
    segments = [it for it in items if it[0] != it[1]]
    below = top(segments)  # parts above every segment (the usual tail) need no look

    def read(name: str) -> bytes | None:
        if name not in seen:
            try:
                seen[name] = _read.read_file(dir_fd, name)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ESTALE):  # ESTALE: another host removed it
                    raise Vanished(f"{name} vanished") from exc
                return None
        return seen[name]

    skip: set[str] = set()
    while True:
        chain, gap = plan([it for it in items if it[2] not in skip])
        wrong = {name for first, last, name in chain if first == last <= below
                 and misplaced(read, segments, first, name)}
        if not wrong:
            return chain, gap
        skip |= wrong


# -- reading ---------------------------------------------------------------------


def cut_short(data: bytes) -> int | None:
    """The line where the last batch of ``data`` (a whole file, ending with a newline)
    begins, if the file was cut at a line boundary inside that batch: it begins with
    :data:`BATCH_START`, no line after ends with a nonce, and the file's last line ends
    as a whole entry does (``}``; a last byte garbled is another damage, named by
    :func:`parse`). Stop 33's open item: such a file loaded short, silently. A file
    whose trailing whitespace a copy stripped reads the same (review 110): ``CORRUPT``,
    never repaired by removing it. Carriage returns before the newlines (a CRLF copy)
    are whitespace, as JSON has them."""
    if data.endswith((b" \n", b"\t\n", b" \r\n", b"\t\r\n", b"\n\n")) or len(data) < 2:
        return None  # the usual: ends with a nonce (or a lost batch's empty line); O(1)
    start = data.rfind(b"\n" + _START) + 1
    if (data.startswith(_START, start) and data.endswith((b"}\n", b"}\r\n"))
            and _NONCED_END.search(data, start) is None):
        return data.count(b"\n", 0, start) + 1
    return None


def parse(data: bytes, path: str, operation: str) -> list[dict[str, Any]]:
    """Entries of one part or segment; CORRUPT (with the line) if it does not parse. An
    empty line holds no entry (:data:`_layout.LOST`: a lost batch's place)."""
    if not data.endswith(b"\n"):
        raise FsStoreError(
            "CORRUPT",
            "file is empty or its last line is torn (no final newline)",
            operation=operation,
            path=path,
        )
    begins = cut_short(data)
    if begins is not None:
        raise FsStoreError("CORRUPT", f"cut short: the batch that begins at line {begins} has lost "
                           "its end (whole lines are missing after the last)", operation=operation, path=path)
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
    found: list[dict[str, Any]] = []
    for lineno, line in enumerate(data.split(b"\n")[:-1], start=1):
        if not line:
            continue
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
        found.append(entry)
    return found


def read_snapshot(
    dir_fd: int, path: str, operation: str, session_marker: str | None = None
) -> tuple[list[tuple[int, list[dict[str, Any]]]], int | None]:
    """``(last number, entries)`` of every file of the chain, in order, and the first
    missing number if the chain has a hole: :func:`snapshot`, raised from.
    :class:`Deleted` if the transcript is being deleted, :class:`Vanished` on a race
    with a compaction (see the module docstring), else the first damaged file's error
    (``CORRUPT`` naming file and line, or the read's OSError)."""
    seen = whole(snapshot(dir_fd, path, operation, session_marker=session_marker))
    return seen.batches, seen.gap


def whole(seen: Snapshot) -> Snapshot:
    """``seen``, where it is the whole transcript (its ``batches`` then follow its
    ``chain`` one for one); else :class:`Deleted`, :class:`Vanished` or the first damaged
    file's error is raised."""
    if seen.deleted is not None:
        raise seen.deleted
    if seen.race is not None:
        raise seen.race
    if seen.damage:
        raise seen.damage[0].error
    return seen


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
    data: dict[str, bytes]  # the bytes read, by name (what was judged is what was returned)

    def holding(self, payload: bytes) -> int | None:
        """The last number of the file of the chain whose bytes hold ``payload`` (a
        batch's bytes carry its nonce: its own), or None."""
        return next((last for _f, last, name in self.chain if payload in self.data.get(name, b"")), None)


def snapshot(
    dir_fd: int, path: str, operation: str, *, read: bool = True,
    first: tuple[list[Item], bool] | None = None, session_marker: str | None = None,
) -> Snapshot:
    """List, plan, read every file of the chain (unless ``read`` is false), list again
    (twice where it read; see the module docstring), and return everything seen:
    ``load`` raises from it (:func:`read_snapshot`), ``fsstore check`` reports it. ``first``: the first
    listing (what :func:`scan` returns), where the caller made it itself (with a
    ``stat`` of each entry, say).

    The snapshot holds (``race`` is None) when the second listing's chain begins with
    the first's and continues with parts only, and no file of the chain vanished
    before it was read (see the module docstring); a gap or damage in a snapshot
    that holds is in the transcript, not in the listing."""
    items, marked = scan(dir_fd) if first is None else first
    batches: list[tuple[int, list[dict[str, Any]]]] = []
    damage: list[Damage] = []
    race: Vanished | None = None
    seen: dict[str, bytes] = {}  # each file read once: what is judged is what is returned
    try:
        chain, gap = plan_held(items, dir_fd, seen) if read else plan(items)
    except Vanished as exc:
        (chain, gap), race = plan(items), exc
    for _first, last, name in chain if read and race is None else ():
        fpath = f"{path}/{name}"
        try:
            data = seen[name] if name in seen else _read.read_file(dir_fd, name)
            seen[name] = data
        except _read.NotAFile as exc:
            err = FsStoreError("CORRUPT", "not a regular file", operation=operation, path=fpath)
            err.__cause__ = exc
            damage.append(Damage(name, err))
            continue
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ESTALE):  # ESTALE: another host removed it
                damage.append(Damage(name, exc))
            elif race is None:
                race = Vanished(f"{name} vanished")
                race.__cause__ = exc
            continue
        try:
            batches.append((last, parse(data, fpath, operation)))
        except FsStoreError as err:
            m = _LINE.search(err.message)
            line = int(m.group(1)) if m else (
                data.count(b"\n") + 1 if data and not data.endswith(b"\n") else None)
            damage.append(Damage(name, err, line))
    marked_again = False
    # After reading, two listings, as a commit's check: a name read can have been freed
    # by a compaction and linked again by a stale writer, and one listing torn by two
    # compactions can miss every segment over it (found by review).
    for _look in range(2 if read else 1):
        again, marked_now = scan(dir_fd)
        marked_again = marked_again or marked_now
        try:
            after = (plan_held(again, dir_fd, seen) if read else plan(again))[0]
        except Vanished as exc:
            after, race = [], race or exc
        if race is None and (after[: len(chain)] != chain
                             or any(f != l for f, l, _n in after[len(chain):])):
            race = Vanished("the listing changed")
        if race is not None:
            break
    # The file read first still there, the same (review, stop 31: on sshfs a load that
    # read its first file before another host deleted the session and made it anew read
    # the rest from the new one, under the same names: mixed).
    first_read = first_kept(seen, chain, items) if read and race is None else None
    if first_read is not None and not _read.still(dir_fd, *first_read):
        race = Vanished(f"{first_read[0]} is no longer the file read")
    deleted = None
    try:
        check_session_marker(dir_fd, session_marker)  # first: the session's delete, if it is one
    except Deleted as exc:
        deleted = exc
    if deleted is None and (marked or marked_again):
        deleted = Deleted(path)
    return Snapshot(items, chain, gap, batches, damage, deleted, race, seen)


def first_kept(read: dict[str, bytes], files: list[Item], items: list[Item]) -> tuple[str, bytes] | None:
    """Of ``files``, the one read first (``read``: bytes by name, in the order read) whose
    name only a delete frees: none of ``items``' other segments holds its range (a
    compaction frees a name inside one, and a stale writer may link it again). While it
    is the same file, the directory a handle names is the one read (where handles go by
    path, sshfs, a delete and a new session at the key make it another)."""
    wanted = {name for first, last, name in files
              if not any(f != l and n != name and f <= first and last <= l for f, l, n in items)}
    return next(((name, data) for name, data in read.items() if name in wanted), None)


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
