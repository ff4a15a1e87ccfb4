"""``fsstore migrate`` and ``fsstore check --repair``: bring transcripts written by
format 1 (or damaged by hand) back to whole format-2 transcripts, losing nothing.

Format 2 reads format-1 transcripts as they are: the part and segment names are the
same. Two things need a command, both safe while writers run (each transcript is
repaired under its lock, and every step is a link, a new segment or an unlink of a
name whose bytes are elsewhere), idempotent, and reported by ``--dry-run`` first:

* **Misplaced parts** (migrate and repair). When two format-1 lock holders
  overlapped, a batch could be committed under a number inside a segment's range
  (format 1 told it from a compaction's leftover by its later ctime; here, by its
  bytes: a leftover is a piece of the segment that merged it); format 1 then
  refused the whole transcript (CORRUPT) and format 2 would skip the part. Each
  such part is committed again above the transcript's highest number, oldest
  first (ctime order, the order they were committed in), then its old name is
  removed. A batch with a nonce is known by its bytes: one the chain holds already
  only loses its misplaced copies, and copies of one batch are committed once.
* **Unreadable parts** (repair only). A part of the chain that is empty or ends in a
  torn line (a power loss with ``fsync=False``) is made a lost batch's part in place
  (one empty line, as a closed gap's), through a descriptor of the file judged.
* **Gaps** (repair only). A part lost outside fsstore (moved aside by an operator)
  leaves a hole that makes every load warn. Each missing number gets a part of one
  empty line (:data:`_layout.LOST`, no entry), linked no-replace, which closes the
  hole; the numbers are reported as lost (their bytes were already gone). Nothing is
  removed or rewritten: where a writer linked its batch at the number first, the
  link fails and the batch stays; where a segment the repair's listing missed holds
  the number, the part is a leftover under it (found by review: a compaction across
  the hole removed a batch committed into it meanwhile).

``migrate`` also removes format 1's ``.state.spare`` and gives a store made before
the marker existed its ``.fsstore`` marker.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable

from . import _fsio, _layout, _read
from ._cleanup import Action, not_looked_at
from ._commit import link_and_check
from ._errors import FsStoreError, posix_code
from ._store import SyncStore
from ._transcript import (
    UNLOCKED_READS,
    Item,
    Snapshot,
    misplaced,
    nonced,
    plan,
    scan,
    snapshot,
    top,
)
from ._walk import Progress, TranscriptRef, Walker, tick, walking


def init(root: str) -> None:
    """Create a store at ``root`` (its parent must exist), or mark an existing one."""
    SyncStore(root, create=True, summaries=False).init()


def migrate(root: str, *, dry_run: bool = False, stale_lock_seconds: float = 30.0,
            older_than: float = 3600.0, progress: Progress | None = None) -> list[Action]:
    """Misplaced parts committed again above, ``.state.spare`` removed, the marker
    written (see the module)."""
    actions = _each_transcript(root, stale_lock_seconds, progress,
                               lambda w, t: _migrate_one(w, t, dry_run, older_than, gaps=False))
    if not os.path.lexists(os.path.join(root, _layout.MARKER)):
        if not dry_run:
            init(root)
        actions.append(Action("mark", root, "a store made before .fsstore existed: marked", not dry_run))
    return actions


def repair(root: str, *, dry_run: bool = False, stale_lock_seconds: float = 30.0,
           older_than: float = 3600.0, progress: Progress | None = None) -> list[Action]:
    """Misplaced parts committed again above, gaps closed (see the module)."""
    return _each_transcript(root, stale_lock_seconds, progress,
                            lambda w, t: _migrate_one(w, t, dry_run, older_than, gaps=True))


def _each_transcript(root: str, stale_lock_seconds: float, progress: Progress | None,
                     one: Callable[[Walker, TranscriptRef], list[Action]]) -> list[Action]:
    actions: list[Action] = []
    with walking(root, stale_lock_seconds=stale_lock_seconds) as w:
        refs = w.sessions()
        for i, ref in enumerate(refs):
            for tref in w.transcripts(ref):
                actions += one(w, tref)
            tick(progress, i + 1, len(refs))
        actions += not_looked_at(w)
    return actions


def misplaced_parts(dir_fd: int, items: list[Item]) -> list[tuple[str, bytes, float, int]]:
    """Parts :func:`misplaced` under a segment (format 1's late parts, a stale writer's
    batch), with their bytes, age (seconds since written) and inode number, in the
    order they were committed (ctime). (Format 1 told them from a compaction's
    leftovers by ctime, which a backup and restore resets.)"""
    blobs: dict[str, bytes] = {}

    def read(name: str) -> bytes:
        if name not in blobs:
            blobs[name] = _read.read_file(dir_fd, name)
        return blobs[name]

    late: list[tuple[int, str, bytes, float, int]] = []
    for first, last, name in items:
        try:
            if first != last or not misplaced(read, items, first, name):
                continue
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        late.append((st.st_ctime_ns, name, blobs[name], time.time() - st.st_mtime, st.st_ino))
    return [(name, part, age, ino) for _ctime, name, part, age, ino in sorted(late)]


def _temp_batches(dir_fd: int) -> set[bytes]:
    """The bytes of the temp files in a transcript directory: batches writers are
    committing (a temp name is a writer's until its check passes)."""
    found: set[bytes] = set()
    for name in _fsio.listdir(dir_fd):
        if name.startswith(_fsio.TEMP_PREFIX):
            try:
                found.add(_read.read_file(dir_fd, name))
            except OSError:
                continue  # gone meanwhile, or not a file
    return found


def _migrate_one(w: Walker, tref: TranscriptRef, dry_run: bool, older_than: float, *,
                 gaps: bool) -> list[Action]:
    store = w.store
    path = w.path(tref.comps)
    # A dry run takes no lock: taking one writes in .locks, and a dry run changes
    # nothing. What it shows may then include a commit in flight, as a look can.
    with contextlib.nullcontext() if dry_run else store.locked(tref.key()):
        fd = w.open(tref.comps)
        if fd is None:
            return []
        try:
            return _fix(store.fs, fd, path, dry_run, gaps=gaps, spare=not gaps, older_than=older_than)
        except (OSError, FsStoreError) as exc:
            code = exc.code if isinstance(exc, FsStoreError) else posix_code(exc.errno)
            return [Action("repair", path, f"not repaired: {exc}", False, failed=True, code=code)]
        finally:
            os.close(fd)


def _fix(fs: _fsio.Fs, fd: int, path: str, dry_run: bool, *, gaps: bool, spare: bool,
         older_than: float) -> list[Action]:
    """Misplaced parts committed again, ``.state.spare`` removed (``spare``), gaps
    closed (``gaps``), under the transcript lock, which another holder may have
    overtaken (see the module); a dry run holds none."""
    actions = _recommit(fs, fd, path, dry_run, older_than)
    if spare and _fsio.exists(fd, _layout.STATE_SPARE):
        if not dry_run:
            _fsio.unlink_quiet(fd, _layout.STATE_SPARE)
        actions.append(Action("remove", f"{path}/{_layout.STATE_SPARE}", "format 1's spare state file",
                              not dry_run))
    if not gaps:
        return actions
    seen = _settled(fd, path)
    if seen is not None and (unreadable := _unreadable_parts(seen)):
        actions += _emptied(fd, path, unreadable, seen.data, dry_run)
        if not dry_run:
            seen = _settled(fd, path)
    if seen is None:
        return [*actions, Action("repair", path, "not repaired: the transcript changed while it "
                                 "was looked at (compactions); run again", False, failed=True)]
    if seen.gap is None:
        return actions
    missing, past = _missing(seen.items)
    if missing > _GAP_LIMIT:  # never listed one by one (found by review: 1e20 numbers)
        return [*actions, Action("repair", path, f"not repaired: {missing} part numbers are missing, "
                                 f"more than {_GAP_LIMIT} one repair closes; the file past the widest "
                                 f"gap ({past}) may not be this store's (put there by hand?): move it "
                                 f"aside if so; batches committed above it stay (load() returns them "
                                 f"after the gap)", False, failed=True)]
    # Numbers no listed file holds (a segment the plan left out still holds its own).
    lost = [n for n in range(1, top(seen.items) + 1)
            if not any(first <= n <= last for first, last, _name in seen.items)]
    # Numbers held only by a segment the chain cannot take (it crosses the chain's: a
    # compaction killed between its move and its check), their batches cut out of it.
    cut = _cut_out(fd, seen.items, seen.chain, lost)
    if not dry_run:
        cut = {n: batch for n, batch in cut.items() if _mark_lost(fs, fd, n, batch)}
        lost = [n for n in lost if _mark_lost(fs, fd, n, _layout.LOST)]
        after = snapshot(fd, path, "repair", read=False)
        gap = after.gap if after.race is None else None
    else:  # what the real run's look after its links would see
        gap = plan([*seen.items, *((n, n, _layout.part_name(n)) for n in [*lost, *cut])])[1]
    what = f"lost (gone before the repair): parts {_ranges(lost)}" if lost else "nothing lost"
    if cut:
        what += (f"; parts {_ranges(sorted(cut))} {'would be' if dry_run else 'were'} cut out of "
                 f"a segment that crosses another")
    if gap is not None:
        # Held only by a segment that crosses the chain's, whose batches cannot be told
        # apart (written before batches carried a nonce; found by review: reported closed).
        return [*actions, Action("repair", path, f"not repaired: part {gap} is held only by a "
                                 f"segment that overlaps another (a compaction killed before its "
                                 f"check) and whose batches cannot be told apart; {what}", False,
                                 failed=True)]
    if dry_run:
        return [*actions, Action("close-gap", path, f"would be gap closed; {what}", False)]
    return [*actions, Action("close-gap", path, f"gap closed; {what}" if lost
                             else "filled meanwhile by commits: nothing lost", bool(lost))]


def _unreadable_parts(seen: Snapshot) -> list[str]:
    """The parts of the chain that are empty or end in a torn line: what a power loss
    with ``fsync=False`` leaves of the last seconds' parts on ext4. A committed part
    never is (its bytes were written whole before its link), so none is a batch in
    flight. A garbled line in a whole file (bit rot, a hand edit), a part cut short at
    a line boundary (:func:`_transcript.cut_short`: a copy that stripped trailing
    whitespace reads the same, whole batches; review 110) and segments (many batches;
    compaction fsyncs them) are left for the operator to look at."""
    parts = {name for first, last, name in seen.chain if first == last}
    return [d.name for d in seen.damage if d.name in parts and isinstance(d.error, FsStoreError)
            and d.name in seen.data and not seen.data[d.name].endswith(b"\n")]


def _emptied(fd: int, path: str, names: list[str], judged: dict[str, bytes],
             dry_run: bool) -> list[Action]:
    """Make each unreadable part ``names`` a lost batch's part in place:
    :data:`_layout.LOST` (one empty line, no entry) written over its bytes, through a
    descriptor of the file whose bytes are the ones judged.

    Never by name: what is at the name by now may be another file (this repair stalled
    past its lease, and a delete and a session made anew put an acknowledged batch
    there). Found by reviews: a move by name, then a move by name looked at after,
    moved or left aside an acknowledged batch. A file
    read through the descriptor that is not the judged bytes is left as it is (an
    intact part ends with a newline, so it never is); a committed part is written by
    nobody else, so what was judged stays what the descriptor holds."""
    actions = []
    for name in names:
        where, data = f"{path}/{name}", judged[name]
        what = "empty" if not data else f"{len(data)} bytes ending in a torn line"
        if dry_run:
            actions.append(Action("mark-lost", where, f"{what}: its batch is lost; would hold "
                                  "no entry", False))
            continue
        try:
            part = os.open(name, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except FileNotFoundError:
            continue  # gone meanwhile: the look after says what is left
        try:
            if _read.read_fd(part, name) != data:
                continue  # another file at the name by now: not the one judged
            os.ftruncate(part, 0)
            os.pwrite(part, _layout.LOST, 0)
            os.fsync(part)
            if os.fstat(part).st_nlink == 0:
                continue  # deleted meanwhile (with its session): nothing to report
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ESTALE):  # deleted meanwhile (another host)
                continue
            raise
        finally:
            os.close(part)
        actions.append(Action("mark-lost", where, f"{what}: its batch is lost; it now holds no "
                              "entry", True))
    return actions


# The most part numbers one repair marks lost (a file each).
_GAP_LIMIT = 10_000


def _missing(items: list[Item]) -> tuple[int, str]:
    """How many numbers from 1 to the highest no listed file holds (without listing
    them), and the name of the file right past the widest gap."""
    held, reach, widest, past = 0, 0, -1, ""
    for first, last, name in sorted(items):
        if first - reach - 1 > widest:
            widest, past = first - reach - 1, name
        if last > reach:
            held += last - max(first, reach + 1) + 1
            reach = last
    return reach - held, past


def _cut_out(fd: int, items: list[Item], chain: list[Item], lost: list[int]) -> dict[int, bytes]:
    """The batches of the numbers that neither the chain nor any part holds, cut out of
    a listed segment that holds them: one that crosses the chain's, made by a compaction
    killed before its check (found by review: a part lost since was hidden, its batch
    only there). A segment is its parts' bytes, each batch ending with its nonce (an
    empty line: a lost batch's place); one whose batches cannot be counted exactly
    (files written before the nonce) gives nothing."""
    held = {n for first, last, _name in chain for n in range(first, last + 1)}
    held |= {first for first, last, _name in items if first == last}
    cut: dict[int, bytes] = {}
    for first, last, name in items:
        wanted = [n for n in range(first, last + 1) if n not in held and n not in lost and n not in cut]
        if first == last or not wanted:
            continue
        try:
            batches = _batches(_read.read_file(fd, name))
        except OSError:
            continue  # gone meanwhile: the look after the repair says what is left
        if len(batches) == last - first + 1:
            cut.update((n, batches[n - first]) for n in wanted)
    return cut


def _batches(data: bytes) -> list[bytes]:
    """A segment's bytes split into its parts' batches: each ends with a line ending in
    its nonce (JSON whitespace before the newline) or is one empty line."""
    out: list[bytes] = []
    begin = end = 0
    for line in data.split(b"\n")[:-1]:  # each ended with a newline (what follows: torn)
        end += len(line) + 1
        if not line or nonced(line):
            out.append(data[begin:end])
            begin = end
    return out if begin == len(data) else []


def _recommit(fs: _fsio.Fs, fd: int, path: str, dry_run: bool, older_than: float) -> list[Action]:
    """Each batch misplaced inside a segment's range committed again above, once, and
    its misplaced copies removed after (see the module).

    A batch that carries a nonce (written since stop 23) is one batch wherever its
    bytes are: copies of it (a repair killed, failed or overtaken between its link and
    its removals) are committed once, and one already in the chain (another repair's
    commit, its writer's) only loses its misplaced copies (found by review: each copy
    committed again, the acknowledged batch there two or three times). Nothing is
    removed before the batch is in a file of the chain."""
    actions: list[Action] = []
    misplaced = misplaced_parts(fd, scan(fd)[0])
    if not misplaced:
        return actions
    in_flight = _temp_batches(fd)
    seen = _settled(fd, path)
    if seen is None:
        return [Action("recommit", path, "not repaired: the transcript changed while it was "
                       "looked at (compactions); run again", False, failed=True)]
    # A batch is one wherever its bytes are (its nonce) or its inode is (a repair's link
    # of it: format 1's batches have no nonce, and equal ones are different batches).
    chain_inodes = _inodes(fd, [n for f, last, n in seen.chain if f == last])
    # (Bytes too, with an inode: a number freed and reused meanwhile is another file.)
    copies: dict[object, list[str]] = {}
    for name, data, _age, ino in misplaced:  # oldest first
        copies.setdefault(data if nonced(data) else (ino, data), []).append(name)
    for name, data, age, ino in misplaced:
        names = copies.pop(data if nonced(data) else (ino, data), None)
        where = f"{path}/{name}"
        if names is None:
            continue  # a copy of a batch handled with its first
        if age < older_than or data in in_flight:
            # Format 2 never acknowledges a batch left there: a writer whose lock was
            # overtaken is between its link and its check, about to commit it again
            # above itself (found by review: taken here too, it was there twice). Its
            # temp file still holds the batch (whatever this host's clock says).
            actions.append(Action("skip", where, "a batch inside a segment's range, written "
                                  "recently or still in a temp file: its writer may be "
                                  "committing it again", False, age=age))
            continue
        same = chain_inodes.get(ino)
        held = same if same is not None and seen.data.get(same) == data else next(
            (n for _f, _l, n in seen.chain if nonced(data) and data in seen.data.get(n, b"")), None)
        if held is not None:
            left = "" if dry_run else _remove_copies(fd, names)
            actions.append(Action("remove", where, f"a copy of a batch committed in {held}: "
                                  f"{len(names)} misplaced cop{'y' if len(names) == 1 else 'ies'} "
                                  f"removed{left}", not dry_run))
            continue
        if dry_run:
            actions.append(Action("recommit", where, "a batch inside a segment's range, "
                                  "committed after it: would be committed again above", False))
            continue
        for source in names:
            try:
                seq, _items = link_and_check(fs, fd, source, top(seen.items) + 1, data)
                break
            except FileNotFoundError:
                continue  # removed meanwhile (its writer, another repair): the next copy
        else:
            actions.append(Action("skip", where, "a batch inside a segment's range, gone before "
                                  "it could be committed again (its writer took it back, or "
                                  "another repair committed it)", False, age=age))
            continue
        left = _remove_copies(fd, names)
        actions.append(Action("recommit", where, f"committed again as {_layout.part_name(seq)}{left}", True))
    return actions


def _remove_copies(fd: int, names: list[str]) -> str:
    """Unlink a committed batch's misplaced copies; what could not be, said (found by
    review: an EIO here made a repair that had committed the batch say FAILED)."""
    failed = []
    for name in names:
        try:
            _fsio.unlink_quiet(fd, name)
        except OSError as exc:
            failed.append(f"{name} ({exc.strerror})")
    return f"; not removed: {', '.join(failed)}: run again" if failed else ""


def _inodes(fd: int, names: list[str]) -> dict[int, str]:
    """The inode numbers of parts, by number: a repair's link of a misplaced part is that
    part's inode (where the mount has hard links and numbers them alike: not sshfs)."""
    found: dict[int, str] = {}
    for name in names:
        try:
            found[os.stat(name, dir_fd=fd, follow_symlinks=False).st_ino] = name
        except OSError:
            continue  # gone meanwhile: merged into a segment, which holds the bytes
    return found


def _settled(fd: int, path: str) -> Snapshot | None:
    """The transcript read as a load reads it; None where compactions kept changing it."""
    for _look in range(UNLOCKED_READS):  # (under the lock already: no reading under it)
        seen = snapshot(fd, path, "repair")
        if seen.race is None:
            return seen
    return None


def _mark_lost(fs: _fsio.Fs, fd: int, n: int, batch: bytes) -> bool:
    """Link ``batch`` (:data:`_layout.LOST`: no entry) at part ``n``, no-replace; False
    where a file is there (a writer's batch, linked since the look: it stays)."""
    tmp = _fsio.temp_name("-lost")
    fs.write_new(fd, tmp, batch)
    try:
        return _fsio.link_noreplace(fs, fd, tmp, _layout.part_name(n)) is not None
    finally:
        _fsio.unlink_quiet(fd, tmp)


def _ranges(numbers: list[int]) -> str:
    out: list[str] = []
    for n in numbers:
        if out and out[-1].split("..")[-1] == str(n - 1):
            out[-1] = f"{out[-1].split('..')[0]}..{n}"
        else:
            out.append(str(n))
    return ", ".join(out)
