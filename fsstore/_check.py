"""What is in a store and what is wrong with it: ``fsstore ls`` and ``fsstore check``.

Both only look (nothing is created, removed or touched); the work of walking is
:mod:`fsstore._walk`'s. ``check`` reads every committed file of every transcript
and reports, with file and line where there is one: damaged files, sequence gaps,
files a compaction left behind, temp files and ``.trash`` entries (orphaned once
older than ``older_than``), held and stale locks, unreadable places, symlinks,
names that decode to no key, entries fsstore never makes, and file times ahead of
this host's clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import _layout
from ._lockfiles import LockInfo, name_locks, scan_locks
from ._output import age_text, iso_ns
from ._walk import (
    Garbage,
    Problem,
    Progress,
    SessionRef,
    TranscriptInfo,
    TranscriptRef,
    Walker,
    tick,
    walking,
)

#: A file time this far ahead of our clock is reported as clock skew.
_SKEW_TOLERANCE = 60.0

# -- ls --------------------------------------------------------------------------


@dataclass
class SessionInfo:
    """One session as ``fsstore ls`` shows it."""

    ref: SessionRef
    transcripts: list[TranscriptInfo]

    @property
    def main(self) -> TranscriptInfo | None:
        return next((t for t in self.transcripts if t.ref.subpath is None), None)

    @property
    def subagents(self) -> int:
        return sum(1 for t in self.transcripts if t.ref.subpath is not None and t.items)

    @property
    def mtime_ns(self) -> int | None:
        return max((t.mtime_ns for t in self.transcripts if t.mtime_ns is not None), default=None)

    @property
    def parts(self) -> int:
        return sum(t.parts for t in self.transcripts)

    @property
    def segments(self) -> int:
        return sum(t.segments for t in self.transcripts)

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.transcripts)

    def as_dict(self) -> dict[str, Any]:
        mt = self.mtime_ns
        return {
            "project_key": self.ref.project_key,
            "session_id": self.ref.session_id,
            "modified": iso_ns(mt),
            "mtime_ms": None if mt is None else mt // 1_000_000,
            "parts": self.parts,
            "segments": self.segments,
            "bytes": self.bytes,
            "subagents": self.subagents,
            "has_main": self.main is not None and bool(self.main.items),
            "transcripts": [t.as_dict() for t in self.transcripts if t.items],
        }


def session_info(w: Walker, ref: SessionRef, *, verify: bool = False) -> SessionInfo:
    infos = []
    for tref in w.transcripts(ref):
        info = w.inspect(tref, verify=verify)
        if info is not None:
            infos.append(info)
    return SessionInfo(ref, infos)


def ls(
    root: str, *, project: str | None = None, progress: Progress | None = None
) -> tuple[list[SessionInfo], list[Problem]]:
    """Every session with at least one committed file, newest first within a project."""
    with walking(root) as w:
        refs = w.sessions(project)
        out: list[SessionInfo] = []
        for i, ref in enumerate(refs):
            info = session_info(w, ref)
            if info.mtime_ns is not None:
                out.append(info)
            tick(progress, i + 1, len(refs))
    out.sort(key=lambda s: (s.ref.project_key, -(s.mtime_ns or 0), s.ref.session_id))
    return out, [p for p in w.problems if p.counts]


# -- check -----------------------------------------------------------------------


@dataclass
class CheckReport:
    """What ``fsstore check`` counted and found."""

    sessions: int = 0
    transcripts: int = 0
    entries: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    locks: list[LockInfo] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(1 for p in self.problems if p.severity == "error")

    @property
    def warnings(self) -> int:
        return sum(1 for p in self.problems if p.severity == "warning")

    @property
    def ok(self) -> bool:
        return not any(p.counts for p in self.problems)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "sessions": self.sessions,
            "transcripts": self.transcripts,
            "entries": self.entries,
            "bytes": self.bytes,
            "errors": self.errors,
            "warnings": self.warnings,
            "problems": [p.as_dict() for p in self.problems],
            "locks": [lk.as_dict() for lk in self.locks],
        }


_WHAT = {"temp": "temp file", "trash": ".trash entry", "lock-recovery": "lock recovery file",
         "lock-record": "lock holder record (its store object went without removing it: a killed "
                        "process, or one idle that long, which writes it again when it next locks)",
         "fuse-hidden": "FUSE leftover (a file unlinked while open on some client's mount)",
         "tomb": "deleted transcript's marks (kept so that a writer still reaching it sees the delete)"}


def _garbage_problem(g: Garbage, older_than: float) -> Problem:
    if g.kind == "orphan" and g.age > older_than:
        return Problem("error", "orphan", g.path, "a transcript a delete moved by mistake and did not "
                       "move back or merge (its deleter died, or the merge failed: see the log): fsstore gc "
                       "merges it into the session at its name, or moves it back there where nothing is "
                       "(as a listing of its project that finds its deleter's record, or a load or append "
                       "of it, does) (docs/operations.md: Deletes racing appends)")
    if g.kind == "orphan":
        return Problem("info", "young-orphan", g.path, f"a transcript a delete moved by mistake, "
                       f"{age_text(g.age)} old: being moved back or merged")
    what = "temp directory" if g.kind == "temp" and g.is_dir else _WHAT[g.kind]
    if g.kind in ("fuse-hidden", "tomb"):  # never damage: left on purpose
        return Problem("info", g.kind, g.path, f"{what}, {age_text(g.age)} old: "
                       "fsstore gc removes it once older than --older-than")
    if g.age > older_than:
        return Problem("warning", f"orphaned-{g.kind}", g.path,
                       f"orphaned {what}, {age_text(g.age)} old (fsstore gc removes it)")
    doing = {"temp": "a commit, compaction or delete in flight", "trash": "a delete in progress",
             "lock-recovery": "a lock take-over in flight",
             "lock-record": "a writer's record between its locks"}[g.kind]
    return Problem("info", f"young-{g.kind}", g.path,
                   f"{what}, {age_text(g.age)} old: {doing}")


def _lock_problem(lk: LockInfo, stale_lock_seconds: float) -> Problem:
    who = f"{lk.describe()}, on {lk.transcript()}"
    age = age_text(lk.age)
    if lk.status == "held":
        return Problem("info", "held-lock", lk.path, f"lock held by {who} for {age}")
    why = {
        "dead": "its holder is no longer running on this host",
        "expired": f"older than stale_lock_seconds={stale_lock_seconds:g}; "
        "the next writer reclaims it",
        "malformed": "not a regular file holding pid/host/start-token",
    }[lk.status]
    return Problem("warning", "stale-lock", lk.path,
                   f"stale lock of {who}, {age} old: {why}")


def _check_transcript(w: Walker, report: CheckReport, t: TranscriptInfo, older_than: float) -> None:
    """Count a verified transcript and note its temp files and compaction leftovers."""
    report.transcripts += 1 if t.items else 0
    report.entries += t.entries or 0
    report.bytes += t.bytes
    w.problems += [_garbage_problem(g, older_than) for g in t.temps]
    if t.marked:  # a young mark is a delete in flight, as a young temp file is
        w.problem("warning" if t.mark_age > older_than else "info", "deleting",
                  f"{t.path}/{_layout.DELETED}",
                  f"marked deleted {age_text(t.mark_age)} ago: a delete under way, or one whose "
                  "process died; load() returns None, and the next append or load under the "
                  "lock finishes it")
    segments = [it for it in t.live if it.first != it.last]
    live = {it.name for it in t.live}
    for it in t.items:
        if it.name in live:
            continue
        path = f"{t.path}/{it.name}"
        if not any(s.first <= it.first and it.last <= s.last for s in segments):
            continue  # a segment of an overlapping compaction: its twin removes it
        age = w.now - it.mtime_ns / 1e9
        w.problem("warning" if age > older_than else "info", "leftover", path,
                  f"inside a segment's range, {age_text(max(age, 0))} old, not part of the "
                  "transcript: a compaction's leftover (fsstore compact removes it), or a batch "
                  "misplaced by a writer whose lock was overtaken (it commits it again above; "
                  "once old, fsstore check --repair does)")


def check(
    root: str,
    *,
    older_than: float = 3600.0,
    stale_lock_seconds: float = 30.0,
    progress: Progress | None = None,
) -> CheckReport:
    """Verify every transcript; see the module docstring for what counts as a problem."""
    report = CheckReport()
    with walking(root, stale_lock_seconds=stale_lock_seconds, looks_only=True) as w:
        w.root_entries()
        refs = w.sessions()
        report.sessions = len(refs)
        seen: list[TranscriptRef] = []
        for i, ref in enumerate(refs):
            for t in session_info(w, ref, verify=True).transcripts:
                seen.append(t.ref)
                _check_transcript(w, report, t, older_than)
            tick(progress, i + 1, len(refs))
        report.locks, lock_garbage = scan_locks(w)
        name_locks(report.locks, seen)
        w.problems += [_lock_problem(lk, stale_lock_seconds) for lk in report.locks]
        w.problems += [_garbage_problem(g, older_than)
                       for g in (*w.garbage, *w.trash(), *lock_garbage)]
        if abs(w.offset) > _SKEW_TOLERANCE:
            w.problem("warning", "clock-skew", w.root,
                      f"this host's clock is {age_text(abs(w.offset))} "
                      f"{'behind' if w.offset > 0 else 'ahead of'} the file server's (a file "
                      "made in the store): fsstore's commands here age files by the server's "
                      "clock, but this host's writers and listings time summaries by their own")
        if w.max_skew > _SKEW_TOLERANCE:
            w.problem("warning", "clock-skew", w.root,
                      f"a file time is {age_text(w.max_skew)} ahead of the file server's clock: "
                      "a client set it (sshfs sends its own time), and clocks differ between "
                      "that client and the server")
    rank = {"error": 0, "warning": 1, "info": 2}
    report.problems = sorted(w.problems, key=lambda p: (rank[p.severity], p.path, p.line or 0))
    return report

