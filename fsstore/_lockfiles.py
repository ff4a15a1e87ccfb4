"""The lock files in ``<root>/.locks``, as ``fsstore check``, ``gc`` and ``locks`` see them.

A transcript's lock is ``.locks/<sha256 of the transcript's path, 40 hex>.lock``
(:mod:`fsstore._lock`): a hard link to its holder's record ``owner-<pid>-<random>``
(pid, host, process start token, the record's name). Its
name says nothing of the transcript: :func:`name_locks` finds it among the
transcripts a walk found. A marker is judged the way the store judges it: dead (its
holder is not running on this host), expired (older than ``stale_lock_seconds``, its
holder not running here: a holder alive on this host is held, however far ahead this
host's clock runs), malformed (no record long after it was made, or not a regular
file), else held.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from . import _layout
from ._output import iso
from ._reclaim import read_marker
from ._walk import Garbage, Problem, Progress, TranscriptRef, Walker, changed_at, tick, walking

#: A lock take-over interrupted by a crash leaves ``<lock>.break.<pid>.<hex>`` or
#: ``<lock>.restore.<pid>.<hex>`` (filelock) or ``<lock>.stale-<pid>-<hex>`` (fsstore).
_LOCK_RECOVERY = re.compile(
    r"[0-9a-f]{40}\.lock\.(?:(?:break|restore)\.[0-9]+\.[0-9a-f]{32}|stale-[0-9]+-[0-9a-f]+)"
)
_LOCK_FILE = re.compile(r"[0-9a-f]{40}\.lock")
_LOCK_RECORD = re.compile(r"owner-[0-9]+-[0-9a-f]+")
#: A lock record shorter than this long after creation is malformed, not being written.
_MALFORMED_GRACE = 2.0


@dataclass
class LockInfo:
    """A transcript's lock file and what its record says."""

    path: str
    key: dict[str, str] | None
    pid: int | None
    host: str | None
    age: float
    status: str  # "held", "expired", "dead", "malformed"
    local: bool
    mtime: float

    @property
    def stale(self) -> bool:
        return self.status != "held"

    def describe(self) -> str:
        """Who holds it, for messages."""
        return f"pid {self.pid} on {self.host}" if self.pid is not None else "an unreadable record"

    def transcript(self) -> str:
        """``project session [subpath]`` of the transcript it locks, for messages."""
        if self.key is None:
            return "an unknown transcript (deleted, or not written yet)"
        return " ".join(self.key[k] for k in ("project_key", "session_id", "subpath")
                        if k in self.key)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "key": self.key,
            "pid": self.pid,
            "host": self.host,
            "age_seconds": round(self.age, 3),
            "since": iso(self.mtime),
            "status": self.status,
            "this_host": self.local,
        }


def judge(w: Walker, path: str, st: os.stat_result) -> LockInfo | None:
    """What the marker at ``path`` (as listed: ``st``) says; None if released meanwhile."""
    try:
        marker = read_marker(path)
    except OSError:  # not ours to read: judged by age alone, like the store does
        marker = None
    else:
        if marker is None and stat.S_ISREG(st.st_mode):
            return None  # released since the listing
    if marker is not None:
        st = marker.stat
    age = w.age(st.st_mtime)
    pid, host = (marker.pid, marker.host) if marker is not None else (None, None)
    if marker is not None and (pid is None or host is None):
        status = "malformed" if age >= _MALFORMED_GRACE else "held"  # or being written
    elif not stat.S_ISREG(st.st_mode):
        status = "malformed"  # no writer can take or reclaim it
    elif marker is not None and marker.dead_here:
        status = "dead"
    elif marker is not None and marker.here:
        status = "held"  # alive here: one look by a clock that may run ahead (see _reclaim._stale)
    else:
        status = "expired" if age > w.stale_lock_seconds else "held"
    local = marker is not None and marker.here
    return LockInfo(path, None, pid, host, age, status, local, st.st_mtime)


def unused_record(w: Walker, path: str, st: os.stat_result) -> bool:
    """Whether the lock record at ``path`` is nobody's: not linked to a lock, and its
    process dead here (or, elsewhere, not locking for ``stale_lock_seconds``)."""
    if st.st_nlink != 1:
        return False  # a held lock's record
    try:
        marker = read_marker(path)
    except OSError:
        return False
    if marker is None:
        return False
    if marker.here:
        return marker.dead_here
    return w.age(changed_at(st)) > w.stale_lock_seconds


def scan_locks(w: Walker) -> tuple[list[LockInfo], list[Garbage]]:
    """Every lock in ``<root>/.locks`` (``key`` not filled in) and the garbage there."""
    comps = (_layout.LOCKS,)
    found: list[LockInfo] = []
    garbage: list[Garbage] = []
    for _fd, entry, st in w.entries(comps):
        path = w.path((*comps, entry.name))
        if _LOCK_FILE.fullmatch(entry.name):
            lk = judge(w, path, st)
            if lk is not None:  # else released meanwhile
                found.append(lk)
        elif _LOCK_RECOVERY.fullmatch(entry.name):
            garbage.append(w.garbage_entry("lock-recovery", comps, entry, st))
        elif _LOCK_RECORD.fullmatch(entry.name):
            if unused_record(w, path, st):
                garbage.append(w.garbage_entry("lock-record", comps, entry, st))
        elif not w.stray(comps, entry, st):
            w.problem("warning", "unexpected", path, "unexpected entry among lock files")
    return found, garbage


def name_locks(found: list[LockInfo], refs: Iterable[TranscriptRef]) -> None:
    """Fill in the key of each lock whose transcript is among ``refs``."""
    index = {_layout.lock_name([(c, None) for c in ref.comps]): ref for ref in refs}
    for lk in found:
        ref = index.get(os.path.basename(lk.path))
        lk.key = ref.key() if ref is not None else None


def locks(
    root: str, *, stale_lock_seconds: float = 30.0, progress: Progress | None = None
) -> tuple[list[LockInfo], list[Problem]]:
    """Every transcript lock file in the store and what its record says, and what could
    not be read (an unreadable ``.locks``: then the list is not all there is).

    The lock names are hashes; the store is walked (its session and subkey
    directories listed, no transcript opened) only to name the transcripts of the
    locks found.
    """
    with walking(root, stale_lock_seconds=stale_lock_seconds) as w:
        found = scan_locks(w)[0]
        if found:
            refs = w.sessions()
            seen: list[TranscriptRef] = []
            for i, ref in enumerate(refs):
                seen += w.transcripts(ref)
                tick(progress, i + 1, len(refs))
            name_locks(found, seen)
    return found, [p for p in w.problems if p.counts]
