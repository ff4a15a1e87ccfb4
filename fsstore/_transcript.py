"""One transcript on disk: the commit protocol, the state file, and reading it back.

A transcript is a directory (``main/`` or ``subkeys/<SP>/``) of immutable JSONL
files. Each file is a *part* (one committed ``append()`` batch, named by its
20-digit sequence number) or a *segment* (parts ``first..last`` merged by
compaction, named ``first-last``). The transcript is the entries of those files in
sequence order.

Commit (``append``), step by step, and what a crash at each step leaves:

1. Encode the batch (``json.dumps`` per entry, one line each). Bad input raises
   ``INVALID_ENTRY`` here, before anything touches disk.
2. Write it to ``.tmp-<pid>-<random>`` in the transcript directory (``O_EXCL``,
   mode 0600); with ``fsync=True``, fsync it. Readers ignore temp files. A crash
   leaves a temp file: garbage, removed by ``fsstore gc`` once old.
3. Take the transcript lock (:mod:`fsstore._lock`). A crash leaves a lock file that
   filelock reclaims: at once if the holder was on this host and is dead, after
   ``stale_lock_seconds`` otherwise.
4. Read ``state.json`` for the last sequence ``N`` (if it is missing or torn,
   rebuild it from a directory listing, the only listing this path ever does).
5. Move the temp file to ``N+1`` with a *no-replace* move (renameat2
   ``RENAME_NOREPLACE``, or link()+unlink()). If the name exists, some writer
   committed there without the state file knowing (a crash after step 5, or a
   second holder after a stale-lock reclaim): take ``N+2`` and so on. This move is
   the commit point: before it, readers see nothing of the batch; after it, all of
   it. A committed part is never overwritten, whatever the lock did.
6. With ``fsync=True``, fsync the directory (skipped, with one warning, on mounts
   that refuse directory fsync).
7. Main transcript: fold the batch into the Claude summary, first folding any
   parts committed since ``state.folded`` (the self-healing step).
8. Write ``state.json`` (not fsynced: it is a hint; on local file systems the
   previous state file is rewritten and swapped in, elsewhere a temp file is
   renamed over it: see :func:`write_state`), unless the lock was held past half
   its lifetime. A failure here is logged, not raised: the batch is committed and the next
   writer or reader heals the state. A crash here leaves the state behind, which
   step 5 (for the sequence) and step 7 or the reader (for the summary) repair.
9. Release the lock.

A failed append leaves no part and no temp file (step 2 removes its file on error;
a failure between 2 and 5 unlinks the temp file). Errors come out as
:class:`~fsstore.FsStoreError` with the POSIX code of the failing call.

Reading (``load``): list the directory and plan (:func:`plan`: walk the items by
first sequence, widest first, skipping any inside a range already taken: leftovers
of a compaction in flight), read each file whole. A listing that skips a sequence
number is treated as a race and repeated (getdents is not atomic). A file that vanished between listing and opening means a
compaction or a delete ran: start over. Finally check that the directory still
sits at its path (a delete renames it away first): if not, start over, which
returns None for a deleted transcript. So a reader sees every committed batch
exactly once, never a partial one, and never a prefix of a deleted transcript.
"""

from __future__ import annotations

import errno
import json
import json.encoder
import os
import stat
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _fsio, _layout
from ._errors import FsStoreError, log
from ._limits import beyond_limits

_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=True)


def _prebuilt_encoder() -> Callable[[Any], str]:
    """``_ENCODER.encode``, without the C encoder it builds on every call.

    ``JSONEncoder.encode`` makes a new ``json.encoder.c_make_encoder`` object per call
    (~3 µs: as much as encoding a typical entry, and an append encodes one per
    entry). Here each thread makes one (same arguments as ``JSONEncoder.iterencode``
    passes, CPython 3.6 to 3.13), used only if it encodes a probe exactly as
    ``_ENCODER`` does; otherwise ``_ENCODER.encode`` it is. Each thread has its own
    because of the circular-reference markers: a dict of the containers being
    encoded, which a failed call leaves filled (cleared here), and which another
    thread's call would see. Without markers a cycle would recurse until the C
    stack overflows under a raised recursion limit before Python 3.12 (a crash,
    found by review), instead of a ValueError.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator (another Python implementation)
        return _ENCODER.encode
    per_thread = threading.local()

    def encode(o: Any) -> str:
        try:
            encoder, markers = per_thread.encoder, per_thread.markers
        except AttributeError:
            markers = per_thread.markers = {}
            encoder = per_thread.encoder = make(
                markers, _ENCODER.default, json.encoder.encode_basestring_ascii, None,
                ":", ",", False, False, True)
        try:
            return "".join(encoder(o, 0))
        except BaseException:
            markers.clear()  # what the failed call was inside of
            raise

    probe = {"s": 'a"\\\n\u00e9\u2028\U0001f600', "n": [0, -1, 10**40, 2.5, 1e300, float("nan"),
             float("inf"), -float("inf"), True, False, None], "o": {"": {}, "1": [[]]}}
    try:
        same = encode(probe) == _ENCODER.encode(probe)
    except (TypeError, ValueError):  # another signature
        same = False
    return encode if same else _ENCODER.encode


_encode = _prebuilt_encoder()


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
            line = _encode(entry)
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


# -- the state file --------------------------------------------------------------


@dataclass
class State:
    """``state.json``: a hint, never the truth; every field can be rebuilt from the parts."""

    seq: int = 0  # last committed sequence this writer knew of
    folded: int = 0  # last sequence folded into ``summary``
    summary: dict[str, Any] | None = None
    compacted: int = 0  # last sequence merged into a segment

    def copy(self) -> State:
        return State(self.seq, self.folded, self.summary, self.compacted)

    def to_bytes(self, write_id: str = "", boot: str | None = None) -> bytes:
        """JSON starting with :func:`state_head` and ending in ``"check"``: the CRC-32
        of the same object without it, padded with spaces to 10 characters (so the
        length of a state does not depend on its check: a rewrite in place of a
        state as long as the last one needs no truncate).

        ``write_id`` names this one write (see :func:`write_state`); ``boot`` marks a
        state rewritten in place.
        """
        doc: dict[str, Any] = {"format": 2, "id": write_id, "seq": self.seq, "folded": self.folded,
                               "compacted": self.compacted, "summary": self.summary}
        if boot is not None:
            doc["boot"] = boot
        body = _encode(doc).encode("ascii")
        return b'%s,"check":%-10d}' % (body[:-1], zlib.crc32(body))


def _checked(raw: bytes, doc: dict[str, Any]) -> bool:
    """Whether a state file read whole is one a writer finished (not a torn mix).

    Format 1 (fsstore before the in-place state file) had no check and was always
    replaced whole by rename.
    """
    check = doc.get("check")
    if check is None:
        return bool(doc.get("format") == 1)
    cut = raw.rfind(b',"check":')
    return cut > 0 and zlib.crc32(raw[:cut] + b"}") == check


def read_state(dir_fd: int) -> tuple[State | None, int]:
    """The state and its mtime in ns; (None, 0) if it is missing or unreadable as JSON."""
    state, st = read_state_stat(dir_fd)
    return state, st.st_mtime_ns if st is not None else 0


def read_state_stat(dir_fd: int) -> tuple[State | None, os.stat_result | None]:
    """The state and the fstat of the file it was read from (None if there is none).

    The state is None when the file is missing or unreadable as JSON.
    """
    try:
        fd = os.open(_layout.STATE, _fsio.READ_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, None
    try:
        st = os.fstat(fd)
        return parse_state(read_raw_state(fd, st)), st
    finally:
        os.close(fd)


# A state holds a sequence and one session summary: a few KB, or as much as the
# longest string field of an entry (a 20 MB lastPrompt is tested). A file beyond
# this is not one fsstore wrote, and every load and append would read it whole.
MAX_STATE_BYTES = 1 << 30


def read_raw_state(fd: int, st: os.stat_result) -> bytes:
    """The bytes of an open state file (empty if it is not a regular file of at most
    :data:`MAX_STATE_BYTES`).

    Opening the file (rather than a stat by name) is what makes NFS revalidate it
    (close-to-open consistency), so a writer under the lock sees the newest state.
    """
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_STATE_BYTES:
        return b""  # not a state fsstore wrote: rebuilt from the parts
    return os.pread(fd, st.st_size + 1, 0)


def parse_state(raw: bytes) -> State | None:
    """The state in ``raw``; None if it is not a whole state this boot may trust."""
    try:
        doc = json.loads(raw)
        if not _checked(raw, doc):
            return None  # torn (a rewrite read halfway): rebuilt from the parts
        if doc.get("boot", _fsio.boot_id()) != _fsio.boot_id():
            return None  # rewritten in place before a reboot: maybe stale (see write_state)
        state = State(int(doc["seq"]), int(doc["folded"]), doc["summary"], int(doc["compacted"]))
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
        return None  # torn or foreign (1e999, nesting deeper than json can parse): rebuilt from the parts
    if not 0 <= state.seq < 10**20 or not 0 <= state.compacted <= state.seq:
        return None  # not a sequence of ours (a hand-edited file): rebuilt from the parts
    summary = state.summary
    if summary is not None and not (isinstance(summary, dict) and isinstance(summary.get("data"), dict)):
        state.summary, state.folded = None, 0  # not a summary we wrote: refold it
    return state


def state_head(write_id: str) -> bytes:
    """How the state file of one write begins: every write has its own ``write_id``,
    so a file that begins so is the file of that write."""
    return b'{"format":2,"id":"%s",' % write_id.encode("ascii")


@dataclass
class StateFile:
    """A state file a writer holds open between appends (local file systems only)."""

    fd: int
    ident: tuple[int, int]  # (st_dev, st_ino): no other file has them while fd is open

    @classmethod
    def of(cls, fd: int, st: os.stat_result) -> StateFile:
        return cls(fd, (st.st_dev, st.st_ino))


def write_state(
    fs: _fsio.Fs, dir_fd: int, state: State, *, after_ns: int = 0, spare: StateFile | None = None,
    keep: bool = False,
) -> tuple[bytes, StateFile | None]:
    """Replace state.json (a hint, so never fsynced).

    Returns how the new file begins (:func:`state_head`: each write has its own id,
    so a writer that later finds state.json beginning so knows nobody wrote since)
    and, with ``keep``, the new state.json still open if it was swapped in (the
    previous state file is then the spare); else None, and nothing is left open.

    Its mtime is the session's mtime for the SDK, which compares a summary's mtime
    with list_sessions' in whole milliseconds: with ``after_ns`` (the previous
    state's mtime) the new one is made at least 1 ms later, so two writes inside
    one millisecond (or one coarse filesystem tick) still read as a change.

    On local file systems (:attr:`fsstore._fsio.Fs.exchange_ok`) the previous
    state file is kept as ``.state.spare``, rewritten with the new state and swapped
    with state.json in one RENAME_EXCHANGE: no file is created or freed per commit,
    which on ext4 is most of what a commit costs. ``spare`` is ``.state.spare``
    held open, if the caller knows it is still that file (it is closed here, or
    returned); otherwise the spare is opened by name. A reader that opened
    state.json just before two such swaps could read a mix; the check field tells
    (see :func:`parse_state`). A rewrite of existing blocks is not ordered with the
    journal, so after a power loss state.json may hold an older state that passes
    its check; a sequence from before a compaction would then send the next commit
    into the segment's range. So a state rewritten in place records the boot that
    wrote it and is only trusted in that boot (after a reboot it is rebuilt from
    the directory, once per transcript). Elsewhere (NFS, FUSE) every write is a new
    temp file renamed over state.json: a new inode each time, which other hosts'
    caches cannot confuse with an old one.
    """
    write_id = _fsio.temp_name()[len(_fsio.TEMP_PREFIX):]  # pid, random, counter: unique
    head = state_head(write_id)
    if fs.exchange_ok:
        data = state.to_bytes(write_id, _fsio.boot_id())
        if spare is None:
            try:
                spare = _open_spare(fs, dir_fd)
            except OSError:
                spare = None  # something that cannot be replaced sits there: a new file instead
        if spare is not None:
            try:
                swapped = _rewrite_spare(fs, dir_fd, spare, data, after_ns)
            except BaseException:
                os.close(spare.fd)
                raise
            if swapped and keep:
                return head, spare
            os.close(spare.fd)
            return head, None
    else:
        data = state.to_bytes(write_id)
    if spare is not None:
        os.close(spare.fd)
    tmp = _fsio.temp_name("-state")
    st = fs.write_new(dir_fd, tmp, data, sync=False)
    try:
        _later_than(st.st_mtime_ns, after_ns, tmp, dir_fd)
        os.rename(tmp, _layout.STATE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        _fsio.unlink_quiet(dir_fd, tmp)
        raise
    return head, None


def _later_than(mtime: int, after_ns: int, target: int | str, dir_fd: int) -> int:
    """``mtime``, or (set on ``target``) the first millisecond after ``after_ns``."""
    if after_ns and mtime // 1_000_000 <= after_ns // 1_000_000:
        mtime = (after_ns // 1_000_000 + 1) * 1_000_000
        if isinstance(target, int):
            os.utime(target, ns=(mtime, mtime))
        else:
            os.utime(target, ns=(mtime, mtime), dir_fd=dir_fd, follow_symlinks=False)
    return mtime


def _rewrite_spare(fs: _fsio.Fs, dir_fd: int, spare: StateFile, data: bytes, after_ns: int) -> bool:
    """Write ``data`` into the open ``spare`` and swap it in; True if swapped (False:
    it was renamed to state.json, there being none, or the mount refused the swap)."""
    fd = spare.fd
    done = os.pwrite(fd, data, 0)
    while done < len(data):
        done += os.pwrite(fd, memoryview(data)[done:], done)
    st = os.fstat(fd)
    if st.st_size > len(data):  # (its mtime is then later still: fine for _later_than)
        os.ftruncate(fd, len(data))
    _later_than(st.st_mtime_ns, after_ns, fd, dir_fd)
    try:
        if _fsio.exchange(fs, dir_fd, _SPARE_NAME, _STATE_NAME):
            return True
    except NotImplementedError:  # refused by this mount: new files from now on
        pass
    # No state.json yet (or no exchange): the spare becomes it.
    os.rename(_layout.STATE_SPARE, _layout.STATE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return False


_SPARE_NAME, _STATE_NAME = os.fsencode(_layout.STATE_SPARE), os.fsencode(_layout.STATE)


def _open_spare(fs: _fsio.Fs, dir_fd: int) -> StateFile:
    """The spare state file, open for writing; anything else found under its name is
    replaced.

    Only a regular file with one link, owned by this user, is written into: a
    symlink, FIFO or hard link planted there would make the rewrite land elsewhere,
    and another user's file could not take our mode or mtime.
    """
    # Read too: held open as state.json after the swap, its head is checked by pread.
    flags = _fsio.RW_FLAGS | os.O_CREAT
    for _attempt in range(2):
        try:
            fd = os.open(_layout.STATE_SPARE, flags, fs.file_mode, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EACCES):
                raise
        else:
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid():
                    if stat.S_IMODE(st.st_mode) != fs.file_mode:
                        os.fchmod(fd, fs.file_mode)  # created under a umask, or changed by hand
                    fd, spare = -1, fd
                    return StateFile.of(spare, st)
            finally:
                if fd >= 0:
                    os.close(fd)
        _fsio.unlink_quiet(dir_fd, _layout.STATE_SPARE)
    raise OSError(errno.EEXIST, "cannot replace what sits at the spare state file's name",
                  _layout.STATE_SPARE)


def scan_items(dir_fd: int) -> list[tuple[int, int, str]]:
    """Every part and segment as ``(first, last, name)``, sorted by first, widest first."""
    items = []
    for name in os.listdir(dir_fd):
        rng = _layout.parse_item(name)
        if rng is not None:
            items.append((rng[0], rng[1], name))
    items.sort(key=lambda it: (it[0], -it[1]))
    return items


def rebuild_state(dir_fd: int) -> State:
    """A state from a listing: the sequence is right, the summary must be refolded."""
    items = scan_items(dir_fd)
    last = max((it[1] for it in items), default=0)
    compacted = max((it[1] for it in items if it[0] != it[1]), default=0)
    return State(seq=last, compacted=compacted)


# -- commit ----------------------------------------------------------------------


def commit(fs: _fsio.Fs, dir_fd: int, tmp: str, after: int) -> int:
    """Move ``tmp`` to the first free sequence above ``after``; return that sequence."""
    seq = after + 1
    while not _fsio.move_noreplace(fs, dir_fd, tmp, _layout.part_name(seq)):
        seq += 1
    return seq


def probe_latest(dir_fd: int, seq: int) -> int:
    """The last sequence of the run of parts that continues after ``seq``."""
    while True:
        try:
            os.stat(_layout.part_name(seq + 1), dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return seq
        seq += 1


# -- reading ---------------------------------------------------------------------


class Vanished(Exception):
    """A listed file disappeared before it was read: a compaction or delete ran."""


class Unsettled(Vanished):
    """A listing that looks damaged but was not made under the lock: a race until the
    same damage (``signature``) is seen again (see :func:`read_batches`)."""

    def __init__(self, signature: tuple[object, ...], why: str) -> None:
        super().__init__(why)
        self.signature = signature


def plan(items: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """The files that make up the transcript, in order, each sequence once."""
    chosen = []
    covered = 0
    for first, last, name in items:
        if last <= covered:
            continue  # merged into a segment already chosen
        if first <= covered:
            # Compaction only ever merges whole files, so ranges nest or are disjoint.
            raise ValueError(f"{name} overlaps a segment")
        chosen.append((first, last, name))
        covered = last
    return chosen


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


def checked_plan(items: list[tuple[int, int, str]], path: str, operation: str) -> list[tuple[int, int, str]]:
    """:func:`plan`, with an impossible layout reported as CORRUPT."""
    try:
        return plan(items)
    except ValueError as exc:
        raise FsStoreError("CORRUPT", str(exc), operation=operation, path=path) from exc


def late_part(
    dir_fd: int, items: list[tuple[int, int, str]], chosen: list[tuple[int, int, str]]
) -> tuple[str, str] | None:
    """``(part, segment)`` where a part inside a segment's range was committed after it.

    Parts inside a segment's range are normally leftovers of a compaction (older
    than the segment) and are skipped. One committed *later* can only come from two
    lock holders overlapping (a holder stalled past its lease wrote an old sequence
    into state.json); skipping it would silently drop a batch. Costs a stat only
    while such files exist (during a compaction).

    A leftover being unlinked right now can look the same: the unlink bumps its
    ctime, and a ``stat`` racing it can see the new ctime before the link count
    drops (often on tmpfs, which sets the ctime first; rarely on ext4). Only a
    caller holding the lock may take the answer as damage.
    """
    segments = [it for it in chosen if it[0] != it[1]]
    chosen_names = {name for _f, _l, name in chosen}
    for first, last, name in items:
        if first != last or name in chosen_names:
            continue
        covering = next((seg for seg in segments if seg[0] <= first <= seg[1]), None)
        if covering is None:
            continue
        try:
            part = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            seg = os.stat(covering[2], dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # the leftover was just removed
        # A leftover whose unlink has finished has no link left while its name is
        # still found: not late.
        if part.st_nlink and part.st_ctime_ns > seg.st_ctime_ns:
            return name, covering[2]
    return None


def check_no_late_parts(
    dir_fd: int,
    items: list[tuple[int, int, str]],
    chosen: list[tuple[int, int, str]],
    path: str,
    operation: str,
) -> None:
    """CORRUPT if :func:`late_part` finds one; for callers holding the lock."""
    late = late_part(dir_fd, items, chosen)
    if late is not None:
        raise _late_part_error(*late, path, operation)


def _late_part_error(name: str, segment: str, path: str, operation: str) -> FsStoreError:
    return FsStoreError(
        "CORRUPT",
        f"part {name} was committed after segment {segment} that covers it "
        "(two lock holders overlapped); nothing was dropped: see `fsstore check`",
        operation=operation, path=f"{path}/{name}",
    )


def first_gap(chosen: list[tuple[int, int, str]]) -> tuple[int, str] | None:
    """``(missing sequence, the file after it)`` where the chosen files skip a
    sequence number (fsstore itself never leaves one)."""
    expected = 1
    for first, last, name in chosen:
        if first != expected:
            return expected, name
        expected = last + 1
    return None


def read_batches(
    dir_fd: int,
    path: str,
    operation: str,
    *,
    locked: bool,
    state_seq: int = 0,
    previous: tuple[object, ...] | None = None,
) -> tuple[list[tuple[int, list[dict[str, Any]]]], str | None]:
    """``(last sequence, raw entries)`` of every committed file in order, and what is
    wrong with them if something is (a gap: the caller warns); Vanished on a race.

    A directory listing is not atomic once it takes more than one getdents call: it
    can miss a segment made behind its cursor while the parts that segment replaced
    are gone ahead of it. That shows as a sequence gap, or, at the tail, as a
    listing that ends before ``state_seq`` (the state, read before listing, records
    a sequence already committed; parts after the listing that exist by name, as a
    stale directory cache on NFS hides them, are read by name). A leftover caught
    mid-unlink can look like a late commit (:func:`late_part`). Without the
    transcript lock (``locked``) such a listing raises :class:`Unsettled` unless it
    shows the same damage as ``previous`` (the signature the last one raised):
    damage stays while a race moves on, also while appends go on at the tail.
    Damage that stays: a gap or a short listing is returned with its description,
    a late part is CORRUPT.
    """
    items = scan_items(dir_fd)
    chosen = checked_plan(items, path, operation)
    gap = first_gap(chosen)
    listed = chosen[-1][1] if chosen else 0
    short = None
    if gap is None and listed < state_seq:
        found = probe_latest(dir_fd, listed)
        chosen += [(seq, seq, _layout.part_name(seq)) for seq in range(listed + 1, found + 1)]
        if found < state_seq:
            short = (found, state_seq)
    late = late_part(dir_fd, items, chosen)
    damage = None
    if gap is not None or short is not None or late is not None:
        signature = (gap, short, late)
        if not locked and signature != previous:
            raise Unsettled(signature, "the listing looks damaged: list again")
        if late is not None:
            raise _late_part_error(*late, path, operation)
        damage = (f"sequence gap: part {gap[0]} missing before {gap[1]}" if gap is not None
                  else f"state.json records sequence {state_seq}, the newest committed file "
                       f"ends at {short[0] if short else listed}")
    batches = []
    for _first, last, name in chosen:
        try:
            data = _fsio.read_file(dir_fd, name)
        except FileNotFoundError as exc:
            raise Vanished(name) from exc
        except _fsio.NotAFile as exc:
            raise FsStoreError("CORRUPT", "not a regular file", operation=operation,
                               path=f"{path}/{name}") from exc
        except OSError as exc:
            if exc.errno == errno.ESTALE:  # NFS: removed by another host since we listed
                raise Vanished(name) from exc
            raise
        batches.append((last, parse(data, f"{path}/{name}", operation)))
    return batches, damage


def warn_damage(damage: str, path: str, operation: str) -> None:
    """The GAP warning of a transcript read with a piece missing (see read_batches)."""
    log.warning("%s (files lost outside fsstore?); run `fsstore check`", damage,
                extra={"code": "GAP", "operation": operation, "path": path})


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


def log_state_failure(exc: OSError | FsStoreError, path: str) -> None:
    log.warning(
        "state file not updated after a successful commit (%s); the next writer heals it",
        exc,
        extra={"code": "STATE_WRITE_FAILED", "operation": "append", "path": path},
    )
