"""Store-wide maintenance: the logic behind the ``fsstore`` command line.

Plain synchronous functions that walk a store and return data (dataclasses); the
CLI (:mod:`fsstore.cli`) only parses arguments and prints. Operations:

* :func:`ls` -- sessions with last-modified time, files, bytes, subagents;
* :func:`check` -- parse every committed file, find sequence gaps, orphaned temp
  files, held and stale locks, unreadable files, names that do not decode;
* :func:`gc` -- remove old temp files and ``.trash`` leftovers, break old locks;
* :func:`prune` -- delete sessions not modified for a while (via ``SyncStore.delete``);
* :func:`locks` -- who holds which transcript lock, since when;
* :func:`compact` -- ``SyncStore.compact`` over many transcripts;
* :func:`import_projects` / :func:`export_session` -- to and from the local
  ``~/.claude/projects`` layout, idempotently.

Everything here is meant to run while other processes (on other hosts too) write
to the store:

* directories are opened one component at a time with ``O_NOFOLLOW`` (through
  :class:`fsstore._fsio.Fs`), so a symlink inside the store is reported, never
  followed;
* a file or directory that vanishes mid-walk (a compaction merged it, a delete
  moved it to ``.trash``, or ESTALE after another host replaced it) is skipped; a
  transcript whose listing changed under the reader is listed again;
* a sequence gap counts only if it survives three listings (a listing is not
  atomic), and a transcript deleted while it was read is not reported at all;
* young temp files and held locks are in-flight work, reported as such and never
  touched; only what is older than the caller's threshold is garbage. Temp files
  and ``.trash`` entries are aged by the later of mtime and ctime (ctime cannot be
  set back, and a rename sets it);
* the only deletions are: temp files, ``.trash`` entries and lock-recovery
  leftovers older than a threshold (:func:`gc`), lock files older than a threshold
  (through the store's own :func:`fsstore._lock.reclaim_if_stale`, which never
  removes a marker someone re-took), whole sessions through ``SyncStore.delete``
  (an atomic rename into ``.trash``) under the lock of every transcript of the
  session (:func:`prune`), and what ``SyncStore.compact`` merges.

Locks live in ``<root>/.locks/<sha256 of the transcript's path, 40 hex>.lock``.

Ages are measured against this host's clock (``time.time()``) while file times
come from the file server; see docs/operations.md about clock skew.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _fsio, _keys, _layout
from ._errors import FsStoreError
from ._keys import TranscriptKey
from ._lock import read_marker, reclaim_if_stale
from ._store import SyncStore, decode_entry
from ._transcript import dedupe, parse, plan

#: ``progress(done, total)``: called as a walk advances (the CLI draws a bar).
Progress = Callable[[int, int], None]

#: errnos that mean "it is not there any more": skipped while walking a live store.
_GONE = frozenset({errno.ENOENT, errno.ESTALE})
#: Names the NFS client gives a file that was deleted while still open on it.
NFS_SILLY_PREFIX = ".nfs"
# FUSE's silly rename (libfuse's hard_remove off): a file unlinked while open on that
# mount; the mount removes it at the last close, or never if the mount dies first.
FUSE_HIDDEN_PREFIX = ".fuse_hidden"
#: A lock take-over interrupted by a crash leaves ``<lock>.break.<pid>.<hex>`` or
#: ``<lock>.restore.<pid>.<hex>`` (filelock) or ``<lock>.stale-<pid>-<hex>`` (fsstore).
_LOCK_RECOVERY = re.compile(
    r"[0-9a-f]{40}\.lock\.(?:(?:break|restore)\.[0-9]+\.[0-9a-f]{32}|stale-[0-9]+-[0-9a-f]+)"
)
_LOCK_FILE = re.compile(r"[0-9a-f]{40}\.lock")
_LOCK_RECORD = re.compile(r"owner-[0-9]+-[0-9a-f]+")
#: A lock record shorter than this long after creation is malformed, not being written.
_MALFORMED_GRACE = 2.0
#: A file time this far ahead of our clock is reported as clock skew.
_SKEW_TOLERANCE = 60.0
#: How often a transcript whose listing keeps changing is listed again.
_ATTEMPTS = 20
_SETTLED_AFTER = 3  # lost listings, then the lock (see Walker.inspect)
#: Entries per append() when importing (each append is one part file).
_IMPORT_BATCH = 1000
_IMPORT_BATCH_BYTES = 8 << 20
#: Problem kinds that mean part of a session could not be looked at.
_UNSEEN = frozenset({"unreadable", "symlink", "bad-name"})

_LINE = re.compile(r"line ([0-9]+)")


class NoStore(Exception):
    """The store root does not exist or is not a directory."""


class NotFound(Exception):
    """The transcript or session asked for is not in the store."""


# -- records ---------------------------------------------------------------------


@dataclass
class Problem:
    """One finding. ``severity``: ``error`` and ``warning`` count; ``info`` does not."""

    severity: str
    kind: str
    path: str
    message: str
    line: int | None = None
    code: str | None = None

    @property
    def counts(self) -> bool:
        return self.severity in ("error", "warning")

    def as_dict(self) -> dict[str, Any]:
        return {
            "severity": self.severity,
            "kind": self.kind,
            "path": self.path,
            "line": self.line,
            "code": self.code,
            "message": self.message,
        }


@dataclass(frozen=True)
class SessionRef:
    """A session directory: its keys and its path components under the root."""

    project_key: str
    session_id: str
    comps: tuple[str, ...]

    def key(self) -> dict[str, str]:
        return {"project_key": self.project_key, "session_id": self.session_id}


@dataclass(frozen=True)
class TranscriptRef:
    """A transcript directory (``main`` or one subkey) and its key."""

    tk: TranscriptKey
    comps: tuple[str, ...]

    @property
    def subpath(self) -> str | None:
        return self.tk.subpath

    def key(self) -> dict[str, str]:
        return self.tk.as_dict()


@dataclass(frozen=True)
class Item:
    """A committed file: a part (``first == last``) or a segment."""

    first: int
    last: int
    name: str
    size: int
    mtime_ns: int
    ctime_ns: int


@dataclass
class Garbage:
    """A temp file, a ``.trash`` entry, a lock recovery file or a FUSE leftover, with its age."""

    kind: str  # "temp", "trash", "lock-recovery", "lock-record", "fuse-hidden"
    parent: tuple[str, ...]
    name: str
    path: str
    age: float
    is_dir: bool


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
    ident: tuple[int, int]  # (inode, mtime_ns) as found: the marker judged

    @property
    def stale(self) -> bool:
        return self.status != "held"

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}" if self.pid is not None else "an unreadable record"

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "key": self.key,
            "pid": self.pid,
            "host": self.host,
            "age_seconds": round(self.age, 3),
            "since": _iso(self.mtime),
            "status": self.status,
            "this_host": self.local,
        }


@dataclass
class TranscriptInfo:
    """What a listing (and, when verified, a full read) of one transcript found."""

    ref: TranscriptRef
    path: str
    items: list[Item]
    live: list[Item]
    temps: list[Garbage]
    entries: int | None = None
    marked: bool = False  # holds a .deleted mark: a delete under way, or interrupted

    @property
    def parts(self) -> int:
        return sum(1 for it in self.live if it.first == it.last)

    @property
    def segments(self) -> int:
        return sum(1 for it in self.live if it.first != it.last)

    @property
    def bytes(self) -> int:
        return sum(it.size for it in self.items)

    @property
    def last_seq(self) -> int:
        return self.live[-1].last if self.live else 0

    @property
    def mtime_ns(self) -> int | None:
        """When the newest committed file was written (None: nothing committed)."""
        return max((it.mtime_ns for it in self.items), default=None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "subpath": self.ref.subpath,
            "path": self.path,
            "modified": _iso_ns(self.mtime_ns),
            "mtime_ms": None if self.mtime_ns is None else self.mtime_ns // 1_000_000,
            "parts": self.parts,
            "segments": self.segments,
            "files": len(self.items),
            "bytes": self.bytes,
            "last_seq": self.last_seq,
            "entries": self.entries,
        }


# -- small helpers ---------------------------------------------------------------


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _iso_ns(ns: int | None) -> str | None:
    return None if ns is None else _iso(ns / 1e9)


def _gone(exc: OSError) -> bool:
    return exc.errno in _GONE


def _code(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, "EIO")


def _canon(entry: Any) -> str:
    """A comparable form of an entry (key order and spacing do not matter)."""
    return json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _changed_at(st: os.stat_result) -> float:
    """When a file was last written or moved: ctime cannot be set back (mtime can, by
    ``utime`` or a copy that keeps times), and a rename into ``.trash`` sets it."""
    return max(st.st_mtime, st.st_ctime)


#: What a store root holds once anything was written to it (``.fsstore``: a store marker).
_STORE_NAMES = (_layout.MARKER, _layout.PROJECTS, _layout.LOCKS)


def is_store(root: str) -> bool:
    """Whether the directory ``root`` looks like a store: it holds ``projects/``,
    ``.locks/`` or ``.fsstore`` (an empty directory, or ``/etc``, does not)."""
    return any(os.path.lexists(os.path.join(root, name)) for name in _STORE_NAMES)


def require_store(root: str, *, create: bool = False) -> None:
    """NoStore unless ``root`` is a store directory (or, with ``create``, a directory or
    nothing yet)."""
    if os.path.isdir(root):
        if not create and not is_store(root):
            raise NoStore(f"{root}: not an fsstore store (no {', '.join(_STORE_NAMES)})")
        return
    if os.path.lexists(root):
        raise NoStore(f"{root}: no store here (not a directory)")
    if not create:
        raise NoStore(f"{root}: no store here (does not exist)")


# -- the walker ------------------------------------------------------------------


class _Changed(Exception):
    """The transcript changed under the walker (a compaction or a commit): list again."""


class _Deleted(Exception):
    """The transcript directory was moved away (a delete) while the walker read it."""


class Walker:
    """Walks one store; collects problems and garbage as it goes.

    ``rfd`` is an open descriptor of the root of ``store``; every path below it is
    opened one component at a time without following symlinks. ``looks_only`` (check):
    a transcript lock is taken only where no marker exists, since taking one that
    exists reclaims it if it is stale, and a stale lock is check's to report and gc's
    to break.
    """

    def __init__(
        self,
        rfd: int,
        store: SyncStore,
        *,
        now: float | None = None,
        stale_lock_seconds: float = 30.0,
        looks_only: bool = False,
    ) -> None:
        self.rfd = rfd
        self.looks_only = looks_only
        self.store = store
        self.root = store.root
        self.now = time.time() if now is None else now
        self.stale_lock_seconds = stale_lock_seconds
        self.problems: list[Problem] = []
        self.garbage: list[Garbage] = []  # temp entries found outside transcript dirs
        self.max_skew = 0.0
        self._fs = store._fs

    # -- plumbing ----------------------------------------------------------------

    def path(self, comps: Sequence[str]) -> str:
        return "/".join((self.root, *comps)) if comps else self.root

    def problem(
        self, severity: str, kind: str, path: str, message: str, *,
        line: int | None = None, code: str | None = None,
    ) -> None:
        self.problems.append(Problem(severity, kind, path, message, line, code))

    def unreadable(self, path: str, what: str, exc: OSError) -> None:
        """Note an OSError as a problem, unless it says the thing is gone."""
        if not _gone(exc):
            self.problem("error", "unreadable", path, f"{what}: {exc.strerror}", code=_code(exc))

    def open(self, comps: Sequence[str]) -> int | None:
        """Open ``root/comps``; None if it is gone; a problem (and None) if unsafe or unreadable."""
        try:
            return self._fs.open_dir(
                self.rfd, [(c, None) for c in comps], create=False,
                base_path=self.root, operation="walk",
            )
        except FsStoreError as err:  # UNSAFE_PATH: a symlink where a directory belongs
            self.problem("error", "symlink", err.path or self.path(comps), err.message,
                         code=err.code)
        except OSError as exc:
            self.unreadable(self.path(comps), "cannot open directory", exc)
        return None

    def scan(self, fd: int, comps: Sequence[str]) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(fd) as it:
                return sorted(it, key=lambda e: e.name)
        except OSError as exc:
            self.unreadable(self.path(comps), "cannot list directory", exc)
            return []

    def entries(
        self, comps: tuple[str, ...]
    ) -> Iterator[tuple[int, os.DirEntry[str], os.stat_result]]:
        """``(dir fd, entry, lstat)`` of each entry of ``root/comps``, by name, skipping
        what vanished; none if the directory is gone or unreadable (a problem says which)."""
        fd = self.open(comps)
        if fd is None:
            return
        try:
            for entry in self.scan(fd, comps):
                st = self._stat(entry, comps)
                if st is not None:
                    yield fd, entry, st
        finally:
            os.close(fd)

    def _stat(self, entry: os.DirEntry[str], comps: Sequence[str]) -> os.stat_result | None:
        try:
            return entry.stat(follow_symlinks=False)
        except OSError as exc:
            self.unreadable(self.path((*comps, entry.name)), "cannot stat", exc)
            return None

    def _age(self, ts: float) -> float:
        age = self.now - ts
        self.max_skew = max(self.max_skew, -age)
        return max(age, 0.0)

    def _garbage(
        self, kind: str, comps: tuple[str, ...], entry: os.DirEntry[str], st: os.stat_result
    ) -> Garbage:
        return Garbage(kind, comps, entry.name, self.path((*comps, entry.name)),
                       self._age(_changed_at(st)), stat.S_ISDIR(st.st_mode))

    # -- names -------------------------------------------------------------------

    def decode(self, parent_fd: int, comps: tuple[str, ...], entry: os.DirEntry[str]) -> str | None:
        """The key part a directory name stands for; a problem and None if it has none."""
        path = self.path((*comps, entry.name))
        try:
            part = decode_entry(parent_fd, entry)
        except OSError as exc:
            self.unreadable(f"{path}/{_fsio.KEY_FILE}", "cannot read", exc)
            return None
        if part is None:
            self._bad_name(parent_fd, entry.name, path)
        return part

    def _bad_name(self, parent_fd: int, name: str, path: str) -> None:
        """Say why ``name`` stands for no key (``decode_entry`` only says that it does not)."""
        if not _keys.is_hashed(name):
            self.problem("error", "bad-name", path,
                         "directory name does not decode to a key (not a name fsstore makes)")
            return
        try:
            os.stat(f"{name}/{_fsio.KEY_FILE}", dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            if self._exists(parent_fd, name):  # else: deleted meanwhile
                self.problem("error", "bad-name", path,
                             "hashed directory name without its .key file: the key cannot be "
                             "recovered from the name, so listings skip this directory")
            return
        except OSError as exc:
            self.unreadable(f"{path}/{_fsio.KEY_FILE}", "cannot stat", exc)
            return
        self.problem("error", "bad-name", f"{path}/{_fsio.KEY_FILE}",
                     ".key is not a regular file, not UTF-8, or does not hold the key this "
                     "directory name was made from")

    def children(self, comps: tuple[str, ...], what: str) -> list[tuple[str, str]]:
        """``(key part, name)`` of every key directory under ``comps``; the rest is noted."""
        out: list[tuple[str, str]] = []
        for fd, entry, st in self.entries(comps):
            epath = self.path((*comps, entry.name))
            if self._stray(comps, entry, st):
                continue
            if stat.S_ISLNK(st.st_mode):
                self.problem("error", "symlink", epath,
                             f"symlink where a {what} directory belongs (never followed)")
            elif not stat.S_ISDIR(st.st_mode) or entry.name.startswith("."):
                self.problem("warning", "unexpected", epath,
                             f"unexpected entry among {what} directories")
            else:
                part = self.decode(fd, comps, entry)
                if part is not None:
                    out.append((part, entry.name))
        return out

    def _stray(self, comps: tuple[str, ...], entry: os.DirEntry[str], st: os.stat_result) -> bool:
        """Note a temp or ``.nfs*`` entry (True), or leave the entry to the caller (False)."""
        if entry.name.startswith(_fsio.TEMP_PREFIX):
            self.garbage.append(self._garbage("temp", comps, entry, st))
        elif entry.name.startswith(FUSE_HIDDEN_PREFIX):
            self.garbage.append(self._garbage("fuse-hidden", comps, entry, st))
        elif entry.name.startswith(NFS_SILLY_PREFIX):
            self._silly(self.path((*comps, entry.name)))
        else:
            return False
        return True

    def _silly(self, path: str) -> None:
        self.problem("info", "nfs-silly-rename", path,
                     "NFS silly-rename: a deleted file still open on some client; the client "
                     "removes it when the file is closed")

    def _container(self, comps: tuple[str, ...], allowed: set[str]) -> list[str]:
        """Check a directory that holds only known names; return the allowed ones present."""
        present: list[str] = []
        for _fd, entry, st in self.entries(comps):
            name = entry.name
            epath = self.path((*comps, name))
            if name in allowed:
                if stat.S_ISLNK(st.st_mode):
                    self.problem("error", "symlink", epath,
                                 "symlink where the store expects a directory (never followed)")
                elif name == _fsio.KEY_FILE or stat.S_ISDIR(st.st_mode):
                    present.append(name)
                else:
                    self.problem("warning", "unexpected", epath,
                                 "expected a directory, found a file")
            elif not self._stray(comps, entry, st):
                self.problem("warning", "unexpected", epath,
                             "unexpected entry (not something fsstore creates)")
        return present

    # -- the tree ----------------------------------------------------------------

    def sessions(self, project: str | None = None, session: str | None = None) -> list[SessionRef]:
        """Every session directory (optionally of one project, or with one session id)."""
        if project is not None:
            projects = [(project, _keys.encode(project))]
        else:
            projects = self.children((_layout.PROJECTS,), "project")
        out: list[SessionRef] = []
        for pkey, pname in projects:
            pcomps = (_layout.PROJECTS, pname)
            if project is None:
                self._container(pcomps, {_layout.SESSIONS, _fsio.KEY_FILE})
            scomps = (*pcomps, _layout.SESSIONS)
            if session is not None:
                sname = _keys.encode(session)
                fd = self.open((*scomps, sname))
                if fd is not None:
                    os.close(fd)
                    out.append(SessionRef(pkey, session, (*scomps, sname)))
                continue
            for skey, sname in self.children(scomps, "session"):
                out.append(SessionRef(pkey, skey, (*scomps, sname)))
        return out

    def transcripts(self, ref: SessionRef) -> list[TranscriptRef]:
        """The main transcript (if its directory exists) and every subkey of a session."""
        present = self._container(ref.comps, {_layout.MAIN, _layout.SUBKEYS, _fsio.KEY_FILE})
        out: list[TranscriptRef] = []
        if _layout.MAIN in present:
            tk = TranscriptKey(ref.project_key, ref.session_id, None)
            out.append(TranscriptRef(tk, (*ref.comps, _layout.MAIN)))
        if _layout.SUBKEYS in present:
            sub = (*ref.comps, _layout.SUBKEYS)
            for subpath, name in self.children(sub, "subagent"):
                try:
                    tk = _keys.parse_key({**ref.key(), "subpath": subpath}, "walk")
                except FsStoreError as err:
                    self.problem("error", "bad-name", self.path((*sub, name)),
                                 f"name decodes to an invalid subpath: {err.message}")
                    continue
                out.append(TranscriptRef(tk, (*sub, name)))
        return out

    def trash(self) -> list[Garbage]:
        """Every entry of ``.trash`` (deletes in progress, or their leftovers)."""
        comps = (_layout.TRASH,)
        return [self._garbage("trash", comps, entry, st) for _fd, entry, st in self.entries(comps)]

    def root_entries(self) -> None:
        """Note anything at the top level that is not ``projects``, ``.trash``, ``.locks``
        or the ``.fsstore`` marker."""
        for entry in self.scan(self.rfd, ()):
            if entry.name in (_layout.PROJECTS, _layout.TRASH, _layout.LOCKS, _layout.MARKER):
                continue
            self.problem("info", "unexpected", self.path((entry.name,)),
                         "not part of the store layout (left alone)")

    # -- one transcript ----------------------------------------------------------

    def inspect(self, ref: TranscriptRef, *, verify: bool = False) -> TranscriptInfo | None:
        """List (and with ``verify``, read and parse) one transcript; None if it is gone
        or could not be read (then a problem says why)."""
        attempt = 0
        while True:
            with contextlib.ExitStack() as guard:
                if attempt >= _SETTLED_AFTER and self._may_lock(ref):
                    # A writer compacting faster than this reads can change every
                    # listing before it is read: look under the transcript lock (if
                    # this process may take it), like a reader that keeps losing.
                    self.store._hold_for_reading(guard, _layout.transcript_dirs(ref.tk))
                fd = self.open(ref.comps)
                if fd is None:
                    return None
                mark = len(self.problems)
                try:
                    return self._inspect(fd, ref, verify=verify, attempt=attempt)
                except OSError as exc:
                    del self.problems[mark:]
                    self.unreadable(self.path(ref.comps), "cannot read the transcript", exc)
                    return None
                except _Changed:  # the last attempt never raises it
                    del self.problems[mark:]  # findings of the stale listing do not count
                except _Deleted:
                    del self.problems[mark:]
                    return None
                finally:
                    os.close(fd)
            time.sleep(0.005 * attempt)
            attempt += 1

    def _may_lock(self, ref: TranscriptRef) -> bool:
        """Whether :meth:`inspect` may take the transcript's lock (see ``looks_only``)."""
        if not self.looks_only:
            return True
        lock = f"{self.store.root}/{_layout.LOCKS}/{_layout.lock_name(_layout.transcript_dirs(ref.tk))}"
        return not os.path.lexists(lock)

    def _inspect(self, fd: int, ref: TranscriptRef, *, verify: bool, attempt: int) -> TranscriptInfo:
        last_try = attempt == _ATTEMPTS - 1
        # A listing is not atomic once it takes more than one getdents call: a part
        # committed or a segment made while it ran can be missing from it while a
        # later file is present. A gap seen in three listings in a row, or under the
        # lock (taken from then on where it can be), is damage.
        settled = attempt >= _SETTLED_AFTER
        path = self.path(ref.comps)
        items, temps, marked = self._listing(fd, ref, last_try)
        chain, _gap = plan([(i.first, i.last, i.name) for i in items])
        chosen = {name for _f, _l, name in chain}
        live = [it for it in items if it.name in chosen]
        info = TranscriptInfo(ref, path, items, live, temps, marked=marked)
        self._gaps(fd, info, settled, last_try)
        if verify:
            self._verify(fd, info, last_try)
        try:
            moved = not _fsio.same_dir(fd, self.rfd, ref.comps)
        except OSError as exc:  # ESTALE: replaced on another host
            if not _gone(exc):
                raise
            moved = True
        if moved:
            # Deleted (renamed into .trash) while we looked: whatever a half-removed
            # directory seemed to lack is not damage.
            raise _Deleted(path)
        return info

    def _listing(
        self, fd: int, ref: TranscriptRef, last_try: bool
    ) -> tuple[list[Item], list[Garbage], bool]:
        """The committed files (sorted by first, widest first) and temp files of a
        transcript, and whether it is marked deleted."""
        marked = False
        items: list[Item] = []
        temps: list[Garbage] = []
        path = self.path(ref.comps)
        for entry in self.scan(fd, ref.comps):
            name = entry.name
            rng = _layout.parse_item(name)
            st = self._stat(entry, ref.comps)
            if st is None:
                if rng is not None and not last_try:
                    raise _Changed(name)
            elif rng is not None:
                if st.st_nlink == 0:  # unlinked while we listed: gone (a compaction's leftover)
                    if not last_try:
                        raise _Changed(name)
                elif stat.S_ISREG(st.st_mode):
                    items.append(Item(rng[0], rng[1], name, st.st_size, st.st_mtime_ns,
                                      st.st_ctime_ns))
                    self._age(st.st_mtime)
                else:
                    kind = "symlink" if stat.S_ISLNK(st.st_mode) else "unreadable"
                    self.problem("error", kind, f"{path}/{name}",
                                 "committed file is not a regular file; load() cannot read it")
            elif name.startswith(_fsio.TEMP_PREFIX):
                temps.append(self._garbage("temp", ref.comps, entry, st))
            elif name.startswith(FUSE_HIDDEN_PREFIX):
                temps.append(self._garbage("fuse-hidden", ref.comps, entry, st))
            elif name == _layout.DELETED:
                marked = True  # a delete under way, or its deleter died
            elif name.startswith(NFS_SILLY_PREFIX):
                self._silly(f"{path}/{name}")
            elif name not in (_layout.STATE, _layout.STATE_SPARE) and not (
                name == _fsio.KEY_FILE and ref.subpath
            ):
                self.problem("warning", "unexpected", f"{path}/{name}",
                             "unexpected entry in a transcript directory (load() ignores it)")
        items.sort(key=lambda it: (it.first, -it.last))
        return items, temps, marked

    def _exists(self, fd: int, name: str) -> bool:
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return False
        return True

    def _gaps(self, fd: int, info: TranscriptInfo, settled: bool, last_try: bool) -> None:
        expected = 1
        for it in info.live:
            if it.first > expected:
                missing = range(expected, it.first)
                if not settled:
                    raise _Changed(it.name)
                # A listing older than a commit can miss a part another host just made;
                # looking it up by name goes past a stale directory cache.
                if not last_try and any(self._exists(fd, _layout.part_name(s)) for s in missing):
                    raise _Changed(it.name)
                span = (f"part {expected}" if len(missing) == 1
                        else f"parts {expected}..{it.first - 1}")
                self.problem("error", "gap", f"{info.path}/{it.name}",
                             f"sequence gap: {span} missing before this file "
                             "(lost files; load() returns the rest)")
            expected = it.last + 1

    def _verify(self, fd: int, info: TranscriptInfo, last_try: bool) -> None:
        total = 0
        for it in info.live:
            fpath = f"{info.path}/{it.name}"
            try:
                data = _fsio.read_file(fd, it.name)
            except OSError as exc:
                if _gone(exc) and not last_try:
                    raise _Changed(it.name) from exc
                self.problem("error", "unreadable", fpath, f"cannot read: {exc.strerror}",
                             code=_code(exc))
                continue
            try:
                total += len(parse(data, fpath, "check"))
            except FsStoreError as err:
                m = _LINE.search(err.message)
                line = int(m.group(1)) if m else (
                    data.count(b"\n") + 1 if data and not data.endswith(b"\n") else None)
                self.problem("error", "corrupt", fpath, err.message, line=line, code=err.code)
        info.entries = total

    # -- locks -------------------------------------------------------------------

    def unused_record(self, path: str, st: os.stat_result) -> bool:
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
        return self._age(_changed_at(st)) > self.stale_lock_seconds

    def lock_info(self, path: str, st: os.stat_result) -> LockInfo | None:
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
        age = self._age(st.st_mtime)
        pid, host = (marker.pid, marker.host) if marker is not None else (None, None)
        if marker is not None and (pid is None or host is None):
            status = "malformed" if age >= _MALFORMED_GRACE else "held"  # or being written
        elif not stat.S_ISREG(st.st_mode):
            status = "malformed"  # no writer can take or reclaim it
        elif marker is not None and marker.dead_here:
            status = "dead"
        else:
            status = "expired" if age > self.stale_lock_seconds else "held"
        local = marker is not None and marker.here
        return LockInfo(path, None, pid, host, age, status, local, st.st_mtime,
                        (st.st_ino, st.st_mtime_ns))


def _scan_locks(w: Walker) -> tuple[list[LockInfo], list[Garbage]]:
    """Every lock in ``<root>/.locks`` (``key`` not filled in) and the garbage there."""
    comps = (_layout.LOCKS,)
    found: list[LockInfo] = []
    garbage: list[Garbage] = []
    for _fd, entry, st in w.entries(comps):
        path = w.path((*comps, entry.name))
        if _LOCK_FILE.fullmatch(entry.name):
            lk = w.lock_info(path, st)
            if lk is not None:  # else released meanwhile
                found.append(lk)
        elif _LOCK_RECOVERY.fullmatch(entry.name):
            garbage.append(w._garbage("lock-recovery", comps, entry, st))
        elif _LOCK_RECORD.fullmatch(entry.name):
            if w.unused_record(path, st):
                garbage.append(w._garbage("lock-record", comps, entry, st))
        elif not w._stray(comps, entry, st):
            w.problem("warning", "unexpected", path, "unexpected entry among lock files")
    return found, garbage


def _name_locks(found: list[LockInfo], refs: Iterable[TranscriptRef]) -> None:
    """Fill in the key of each lock whose transcript is among ``refs``."""
    index = {_layout.lock_name([(c, None) for c in ref.comps]): ref for ref in refs}
    for lk in found:
        ref = index.get(os.path.basename(lk.path))
        lk.key = ref.key() if ref is not None else None


@contextlib.contextmanager
def walking(
    root: str, *, stale_lock_seconds: float = 30.0, lock_timeout_seconds: float = 10.0,
    looks_only: bool = False,
) -> Iterator[Walker]:
    """A walker over the store at ``root`` (NoStore if there is none); the root itself
    may be a symlink. ``looks_only``: see :class:`Walker`."""
    store = SyncStore(root, summaries=False, stale_lock_seconds=stale_lock_seconds,
                      lock_timeout_seconds=lock_timeout_seconds)
    with contextlib.ExitStack() as stack:
        try:
            rfd = stack.enter_context(store._open_root(create=False))
        except NotADirectoryError:
            rfd = None
        if rfd is None:
            raise NoStore(f"{root}: no store here (not a directory)")
        require_store(root)
        yield Walker(rfd, store, stale_lock_seconds=stale_lock_seconds, looks_only=looks_only)


def _tick(progress: Progress | None, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)


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
            "modified": _iso_ns(mt),
            "mtime_ms": None if mt is None else mt // 1_000_000,
            "parts": self.parts,
            "segments": self.segments,
            "bytes": self.bytes,
            "subagents": self.subagents,
            "has_main": self.main is not None and bool(self.main.items),
            "transcripts": [t.as_dict() for t in self.transcripts if t.items],
        }


def _session_info(w: Walker, ref: SessionRef, *, verify: bool = False) -> SessionInfo:
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
            info = _session_info(w, ref)
            if info.mtime_ns is not None:
                out.append(info)
            _tick(progress, i + 1, len(refs))
    out.sort(key=lambda s: (s.ref.project_key, -(s.mtime_ns or 0), s.ref.session_id))
    return out, [p for p in w.problems if p.counts]


# -- check -----------------------------------------------------------------------


@dataclass
class CheckReport:
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


def _age_text(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


_WHAT = {"temp": "temp file", "trash": ".trash entry", "lock-recovery": "lock recovery file",
         "lock-record": "lock holder record (its store object went without removing it: a killed "
                        "process, or one idle that long, which writes it again when it next locks)",
         "fuse-hidden": "FUSE leftover (a file unlinked while open on some client's mount)"}


def _garbage_problem(g: Garbage, older_than: float) -> Problem:
    what = "temp directory" if g.kind == "temp" and g.is_dir else _WHAT[g.kind]
    if g.kind == "fuse-hidden":  # never damage: its bytes are in a segment, or deleted
        return Problem("info", "fuse-hidden", g.path, f"{what}, {_age_text(g.age)} old: "
                       "fsstore gc removes it once older than --older-than")
    if g.age > older_than:
        return Problem("warning", f"orphaned-{g.kind}", g.path,
                       f"orphaned {what}, {_age_text(g.age)} old (fsstore gc removes it)")
    doing = {"temp": "a commit or compaction in flight", "trash": "a delete in progress",
             "fuse-hidden": "",
             "lock-recovery": "a lock take-over in flight",
             "lock-record": "a writer's record between its locks"}[g.kind]
    return Problem("info", f"young-{g.kind}", g.path,
                   f"{what}, {_age_text(g.age)} old: {doing}")


def key_label(key: Mapping[str, str] | None) -> str:
    """``project session [subpath]`` of a key, for messages."""
    if key is None:
        return "an unknown transcript (deleted, or not written yet)"
    return " ".join(key[k] for k in ("project_key", "session_id", "subpath") if k in key)


def _lock_problem(lk: LockInfo, stale_lock_seconds: float) -> Problem:
    who = f"{lk.describe()}, on {key_label(lk.key)}"
    age = _age_text(lk.age)
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
    if t.marked:
        w.problem("warning", "deleting", f"{t.path}/{_layout.DELETED}",
                  "marked deleted: a delete under way, or one whose process died; load() "
                  "returns None, and the next append or load under the lock finishes it")
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
                  f"already merged into a segment, {_age_text(max(age, 0))} old: "
                  "left by an interrupted compaction (fsstore compact removes it)")


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
            for t in _session_info(w, ref, verify=True).transcripts:
                seen.append(t.ref)
                _check_transcript(w, report, t, older_than)
            _tick(progress, i + 1, len(refs))
        report.locks, lock_garbage = _scan_locks(w)
        _name_locks(report.locks, seen)
        w.problems += [_lock_problem(lk, stale_lock_seconds) for lk in report.locks]
        w.problems += [_garbage_problem(g, older_than)
                       for g in (*w.garbage, *w.trash(), *lock_garbage)]
        if w.max_skew > _SKEW_TOLERANCE:
            w.problem("warning", "clock-skew", w.root,
                      f"a file time is {_age_text(w.max_skew)} ahead of this host's clock: "
                      "clocks differ between this host and the file server, so ages (and "
                      "stale-lock expiry) are off by as much")
    rank = {"error": 0, "warning": 1, "info": 2}
    report.problems = sorted(w.problems, key=lambda p: (rank[p.severity], p.path, p.line or 0))
    return report


# -- gc --------------------------------------------------------------------------


@dataclass
class Action:
    """Something gc, prune or compact did (or, in a dry run, would do)."""

    action: str
    path: str
    detail: str
    done: bool
    age: float | None = None
    failed: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "path": self.path,
            "detail": self.detail,
            "done": self.done,
            "failed": self.failed,
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


def _remove_garbage(w: Walker, g: Garbage, older_than: float, dry_run: bool) -> Action:
    verb = f"remove-{g.kind}"
    what = {"temp": "orphaned temp " + ("directory" if g.is_dir else "file"),
            "trash": "leftover of a delete", "lock-recovery": "lock recovery leftover",
            "lock-record": "unused lock holder record",
            "fuse-hidden": "FUSE leftover"}[g.kind]
    detail = f"{what}, {_age_text(g.age)} old"
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
        if w.now - _changed_at(st) <= older_than:
            return Action("keep", g.path, "touched again since the walk; left alone", False, g.age)
        if stat.S_ISDIR(st.st_mode):
            silly = _has_silly(pfd, g.name)
            if silly:
                return Action("keep", g.path,
                              f"holds {silly}: a deleted file still open on an NFS client; "
                              "gc retries on its next run", False, g.age)
            _fsio.remove_tree(pfd, g.name)
        else:
            _fsio.unlink_quiet(pfd, g.name)
    except OSError as exc:
        return Action(verb, g.path, f"{detail}: {_code(exc)} {exc.strerror}", False, g.age,
                      failed=True)
    finally:
        os.close(pfd)
    return Action(verb, g.path, detail, True, g.age)


def _break(lk: LockInfo, older_than: float, dry_run: bool) -> Action | None:
    """Break a lock older than ``older_than`` with the store's own reclaim (a marker
    someone re-took meanwhile is put back, never removed)."""
    if lk.age <= older_than:
        return None
    detail = f"stale lock of {lk.describe()} on {key_label(lk.key)}, {_age_text(lk.age)} old"
    if dry_run:
        return Action("break-lock", lk.path, detail, False, lk.age)
    if reclaim_if_stale(lk.path, older_than=max(older_than, 0.0), operation="gc"):
        return Action("break-lock", lk.path, detail, True, lk.age)
    try:
        st = os.lstat(lk.path)
    except FileNotFoundError:
        return Action("break-lock", lk.path, detail + " (released meanwhile)", False, lk.age)
    except OSError as exc:
        return Action("break-lock", lk.path, f"{detail}: {_code(exc)} {exc.strerror}", False,
                      lk.age, failed=True)
    if (st.st_ino, st.st_mtime_ns) != lk.ident:
        return Action("keep", lk.path, "lock was taken again meanwhile; left alone", False, lk.age)
    # The very marker judged stale is still there: the reclaim could not move it.
    locks_dir = os.path.dirname(lk.path)
    why = ("it is not a regular file: remove it by hand" if not stat.S_ISREG(st.st_mode)
           else f"no permission to rename it in {locks_dir}"
           if not os.access(locks_dir, os.W_OK | os.X_OK)
           else "it could not be moved aside")
    return Action("break-lock", lk.path, f"{detail}: not broken: {why}", False, lk.age,
                  failed=True)


def gc(
    root: str,
    *,
    older_than: float = 3600.0,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> list[Action]:
    """Remove temp files, ``.trash`` leftovers and lock recovery files older than
    ``older_than``; break locks older than it. Nothing younger is touched."""
    actions: list[Action] = []
    with walking(root) as w:
        refs = w.sessions()
        seen: list[TranscriptRef] = []
        for i, ref in enumerate(refs):
            for tref in w.transcripts(ref):
                seen.append(tref)
                info = w.inspect(tref)
                temps = info.temps if info is not None else []
                actions += [_remove_garbage(w, g, older_than, dry_run)
                            for g in temps if g.age > older_than]
            _tick(progress, i + 1, len(refs))
        found, lock_garbage = _scan_locks(w)
        _name_locks(found, seen)
        actions += [a for lk in found if (a := _break(lk, older_than, dry_run)) is not None]
        actions += [_remove_garbage(w, g, older_than, dry_run)
                    for g in (*w.garbage, *w.trash(), *lock_garbage) if g.age > older_than]
        actions += [Action("skip", p.path, p.message, False, failed=True)
                    for p in w.problems if p.severity == "error" and p.kind == "unreadable"]
    return actions


# -- locks -----------------------------------------------------------------------


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
        found = _scan_locks(w)[0]
        if found:
            refs = w.sessions()
            seen: list[TranscriptRef] = []
            for i, ref in enumerate(refs):
                seen += w.transcripts(ref)
                _tick(progress, i + 1, len(refs))
            _name_locks(found, seen)
    return found, [p for p in w.problems if p.counts]


# -- prune -----------------------------------------------------------------------


@dataclass
class _Look:
    """One look at a session, for prune."""

    transcripts: list[TranscriptRef]
    mtime_ns: int | None  # its newest committed file; None: nothing committed
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
    temps = [*w.garbage[gmark:], *(g for i in infos for g in i.temps)]
    return _Look(trefs, mtime, unseen, temps)


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
                if not _gone(exc):  # a file merged away meanwhile is not unreadable
                    return Problem("error", "unreadable", f"{info.path}/{it.name}",
                                   f"cannot read: {exc.strerror}", code=_code(exc))
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
    Each deletion is a ``SyncStore.delete`` (mark, then an atomic rename into
    ``.trash``), done while holding the lock of every transcript of the session; the
    session is looked at once more after it is marked and before it is moved: a
    commit since, a transcript added since, or a temp file younger than ``older_than``
    (a writer that wrote its batch and waits for a lock) keeps it (the mark is taken
    back). The lock only saves work; the look after the mark is what makes it safe.
    """
    actions: list[Action] = []
    with walking(root, stale_lock_seconds=stale_lock_seconds,
                 lock_timeout_seconds=lock_timeout_seconds) as w:
        refs = w.sessions(project)
        for i, ref in enumerate(refs):
            _tick(progress, i, len(refs))
            act = _prune_one(w, ref, older_than, dry_run)
            if act is not None:
                actions.append(act)
        _tick(progress, len(refs), len(refs))
    return actions, len(refs)


def _unseen(path: str, problem: Problem) -> Action:
    where = "" if problem.path == path else f" ({problem.path})"
    return Action("skip", path, f"not deleted: part of the session cannot be looked at, so its "
                  f"age is unknown: {problem.message}{where}", False, failed=True)


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
    detail = f"last modified {_iso_ns(first.mtime_ns)} ({_age_text(age)} ago)"
    if dry_run:
        return Action("delete", path, detail, False, age)
    try:
        with contextlib.ExitStack() as held:
            since = time.monotonic()
            # Sorted: two prunes of one session never wait for each other crosswise.
            for tref in sorted(first.transcripts, key=lambda t: t.comps):
                held.enter_context(w.store.locked(tref.key()))
            kept: list[Action] = []

            def keep() -> bool:
                # The last look, made after the session is marked: an append whose
                # check passed before the mark shows here; one after it sees the mark
                # and commits nowhere (it starts over in a new session). So whatever
                # stalls prune, no acknowledged batch is deleted unseen.
                w.now = time.time()
                reason = _reason_to_keep(w, ref, first, older_than)
                if reason is None and time.monotonic() - since > w.stale_lock_seconds / 2:
                    # Like a writer's lease (fsstore._lock.Held): past half the lifetime,
                    # a writer may have taken the lock, found the mark and finished the
                    # delete, and made the session anew with a batch of its own.
                    reason = Action("delete", path, f"{detail}: not deleted: taking the locks and "
                                    "looking took too long; run prune again", False, age, failed=True)
                if reason is not None:
                    kept.append(reason)
                return reason is not None

            w.store.delete_unless(ref.key(), keep)
            if kept:
                return kept[0]
    except FsStoreError as err:
        return Action("delete", path, f"{detail}: {err}", False, age, failed=True)
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
    if {t.comps for t in again.transcripts} != {t.comps for t in first.transcripts}:
        return Action("keep", path, "a transcript was added or removed meanwhile; kept (the "
                      "next prune looks again)", False)
    young = [g for g in again.temps if g.age <= older_than]
    if young:
        return Action("keep", path, f"an append is in flight ({young[0].path}, "
                      f"{_age_text(young[0].age)} old); kept", False)
    if again.mtime_ns is None or w.now - again.mtime_ns / 1e9 <= older_than:
        return Action("keep", path, "written to meanwhile; kept", False)
    return None


def _uncommitted(w: Walker, ref: SessionRef, older_than: float) -> Action | None:
    """A session without any committed file is never deleted (nothing tells how old its
    content is: a first append may be in flight); reported once its directory is old."""
    try:
        st = w._fs.stat_beneath(w.rfd, "/".join(ref.comps))
    except OSError:
        return None  # gone
    age = w.now - _changed_at(st)
    if age <= older_than:
        return None
    return Action("skip", w.path(ref.comps), f"no committed transcript (directory "
                  f"{_age_text(age)} old): nothing to age it by; left alone", False, age)


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
    """
    actions: list[Action] = []
    with walking(root, stale_lock_seconds=stale_lock_seconds) as w:
        refs = w.sessions(project, session)
        for i, ref in enumerate(refs):
            for tref in w.transcripts(ref):
                act = _compact_one(w, tref, dry_run)
                if act is not None:
                    actions.append(act)
            _tick(progress, i + 1, len(refs))
        actions += [Action("skip", p.path, p.message, False, failed=True)
                    for p in w.problems if p.kind in ("unreadable", "symlink")]
    return actions


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
                      False, failed=True)
    try:
        merged = w.store.compact(tref.key())
    except FsStoreError as err:
        if err.code == "CORRUPT":  # a gap or damage: merging would hide it
            return Action("skip", info.path, f"{detail}: not compacted: {err.message} "
                          "(see fsstore check)", False, failed=True)
        return Action("compact", info.path, f"{detail}: {err}", False, failed=True)
    what = (f"merged {merged} files into one segment" if merged
            else "nothing to merge (leftovers removed)")
    return Action("compact", info.path, what, merged > 0)


# -- import ----------------------------------------------------------------------


@dataclass
class Transfer:
    """One transcript file moved between the local layout and the store."""

    path: str
    key: dict[str, str] | None
    status: str  # new, extended, merged, up-to-date, store-ahead, failed, ...
    local: int = 0
    stored: int = 0
    added: int = 0
    detail: str = ""
    failed: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "key": self.key,
            "status": self.status,
            "local_entries": self.local,
            "stored_entries": self.stored,
            "added": self.added,
            "detail": self.detail,
            "failed": self.failed,
        }


def file_path_to_session_key(file_path: str, projects_dir: str) -> dict[str, str] | None:
    """The session key of a local transcript file, by the Claude SDK's rule.

    claude_agent_sdk has this only in a private module
    (``_internal.session_store.file_path_to_session_key``), which can change under
    us in any release, so the rule is written out here; the tests compare the two.
    """
    rel = os.path.relpath(file_path, projects_dir)
    parts = rel.split(os.sep)
    if not parts or parts[0] == ".." or os.path.isabs(rel) or len(parts) < 2:
        return None
    if len(parts) == 2 and parts[1].endswith(".jsonl"):
        return {"project_key": parts[0], "session_id": parts[1][: -len(".jsonl")]}
    if len(parts) >= 4:
        sub = parts[2:]
        sub[-1] = sub[-1].removesuffix(".jsonl")
        return {"project_key": parts[0], "session_id": parts[1], "subpath": "/".join(sub)}
    return None


def _local_jsonl(directory: str, out: list[str], skipped: list[Problem], depth: int = 0) -> None:
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        if not _gone(exc):
            skipped.append(Problem("error", "unreadable", directory,
                                   f"cannot list: {exc.strerror}", code=_code(exc)))
        return
    for entry in entries:
        if entry.is_symlink():
            skipped.append(Problem("info", "symlink", entry.path, "symlink skipped"))
        elif entry.is_dir(follow_symlinks=False) and depth < 32:
            _local_jsonl(entry.path, out, skipped, depth + 1)
        elif entry.is_file(follow_symlinks=False) and entry.name.endswith(".jsonl"):
            out.append(entry.path)


def local_transcripts(
    projects_dir: str, project: str | None = None
) -> tuple[list[str], list[Problem]]:
    """``<project>/<session>.jsonl`` and ``<project>/<session>/subagents/**/*.jsonl`` files."""
    files: list[str] = []
    skipped: list[Problem] = []
    try:
        projects = sorted(os.scandir(projects_dir), key=lambda e: e.name)
    except OSError as exc:
        raise NoStore(f"{projects_dir}: cannot list ({exc.strerror})") from exc
    for pentry in projects:
        if project is not None and pentry.name != project:
            continue
        if pentry.is_symlink() or not pentry.is_dir(follow_symlinks=False):
            continue
        try:
            entries = sorted(os.scandir(pentry.path), key=lambda e: e.name)
        except OSError as exc:
            skipped.append(Problem("error", "unreadable", pentry.path,
                                   f"cannot list: {exc.strerror}", code=_code(exc)))
            continue
        mains: list[str] = []
        subs: list[str] = []
        for entry in entries:
            if entry.is_symlink():
                continue
            if entry.is_file(follow_symlinks=False) and entry.name.endswith(".jsonl"):
                mains.append(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                sub = os.path.join(entry.path, "subagents")
                if os.path.isdir(sub) and not os.path.islink(sub):
                    _local_jsonl(sub, subs, skipped)
        files += mains + subs  # main transcripts first, like a live session
    return files, skipped


def _read_local_file(path: str) -> bytes:
    """A local file's bytes, not through a symlink and never blocking on a FIFO;
    ``_fsio.NotAFile`` for anything but a regular file."""
    dfd = os.open(os.path.dirname(path) or ".", _fsio.DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        return _fsio.read_file(dfd, os.path.basename(path))
    finally:
        os.close(dfd)


def read_local(path: str) -> tuple[list[dict[str, Any]], str]:
    """The entries of a local JSONL transcript and a note; ValueError (with the line) if bad.

    A last line without its newline is being written right now (or was torn by a
    crash): it is left out, and the note says so.
    """
    lines = _read_local_file(path).split(b"\n")
    note = ""
    tail = lines.pop()  # b"" after a final newline
    if tail.strip():
        note = f"last line {len(lines) + 1} has no newline yet; left out"
    entries: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise ValueError(f"line {lineno} is not valid JSON: {exc}") from exc
        if not isinstance(entry, dict):
            raise ValueError(f"line {lineno} is not a JSON object")  # noqa: TRY004
        entries.append(entry)
    return entries, note


def _identity(entry: dict[str, Any], canon: str) -> tuple[str, str]:
    uuid = entry.get("uuid")
    return ("uuid", uuid) if type(uuid) is str else ("json", canon)


def missing_entries(
    stored: list[dict[str, Any]], local: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], str]:
    """What of ``local`` the store lacks, and how the two relate.

    ``local`` is first reduced the way load() reduces a transcript (the same
    ``dedupe``), so "equal" means "load() would return the same". If the store holds
    the local transcript as a prefix, the missing entries are the rest (``new`` /
    ``extended``); if it holds all of it, nothing (``up-to-date`` / ``store-ahead``).
    Otherwise the two diverged: the local entries the store lacks (by ``uuid``, or by
    content for entries without one) are missing, in local order (``merged``).
    Appending what this returns and asking again returns nothing: import is idempotent.
    """
    local = dedupe([(0, local)])
    cs = [_canon(e) for e in stored]
    cl = [_canon(e) for e in local]
    n = min(len(cs), len(cl))
    if cs[:n] == cl[:n]:
        if len(cl) > len(cs):
            return local[len(cs):], ("extended" if cs else "new")
        return [], ("store-ahead" if len(cs) > len(cl) else "up-to-date")
    have = Counter(_identity(e, c) for e, c in zip(stored, cs))
    missing = []
    for e, c in zip(local, cl):
        ident = _identity(e, c)
        if have[ident] > 0:
            have[ident] -= 1
        else:
            missing.append(e)
    return missing, ("merged" if missing else "up-to-date")


def _split_metadata(
    entries: list[dict[str, Any]],
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The last ``agent_metadata`` entry (a subagent's ``.meta.json``) and the rest."""
    meta = None
    rest = []
    for e in entries:
        if e.get("type") == "agent_metadata":
            meta = e
        else:
            rest.append(e)
    return meta, rest


def _meta_path(jsonl: str) -> str:
    return jsonl[: -len(".jsonl")] + ".meta.json"


def _read_meta(jsonl: str) -> tuple[dict[str, Any] | None, str]:
    """The ``.meta.json`` sidecar of a subagent transcript (None if absent or unusable,
    like the SDK) and a note on why an existing one was left out."""
    path = _meta_path(jsonl)
    try:
        meta = json.loads(_read_local_file(path))
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"{os.path.basename(path)} left out: {exc.strerror}"
    except ValueError as exc:
        return None, f"{os.path.basename(path)} left out: {exc}"
    if not isinstance(meta, dict):
        return None, f"{os.path.basename(path)} left out: not a JSON object"
    return meta, ""


def _batches(entries: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    size = 0
    for e in entries:
        batch.append(e)
        size += len(_canon(e))
        if len(batch) >= _IMPORT_BATCH or size >= _IMPORT_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _import_file(
    store: SyncStore, path: str, key: dict[str, str], dry_run: bool
) -> Transfer:
    try:
        _keys.parse_key(key, "import")
        local, note = read_local(path)
    except FsStoreError as err:
        return Transfer(path, key, "failed", detail=err.message, failed=True)
    except ValueError as exc:
        return Transfer(path, key, "failed", detail=str(exc), failed=True)
    except OSError as exc:
        if _gone(exc):
            return Transfer(path, key, "gone", detail="removed while importing")
        return Transfer(path, key, "failed", detail=f"{_code(exc)} {exc.strerror}", failed=True)
    t, todo, meta_entry = _compare(store, path, key, local, note)
    if dry_run or not t.added:
        return t
    for batch in _batches(todo):
        store.append(key, batch)
    if meta_entry is not None:
        store.append(key, [meta_entry])
    return t


def _compare(
    store: SyncStore, path: str, key: dict[str, str], local: list[dict[str, Any]], note: str
) -> tuple[Transfer, list[dict[str, Any]], dict[str, Any] | None]:
    """What importing ``local`` means: the transfer, the entries to append, the sidecar entry."""
    stored = store.load(key) or []
    is_sub = "subpath" in key
    stored_meta, stored_rest = _split_metadata(stored) if is_sub else (None, stored)
    todo, status = missing_entries(stored_rest, local)
    meta_entry = None
    if is_sub:
        meta, meta_note = _read_meta(path)
        note = "; ".join(n for n in (note, meta_note) if n)
        if meta is not None:
            # Like the SDK's import: the sidecar travels as a synthetic entry, "type" last.
            meta_entry = {**meta, "type": "agent_metadata"}
            if stored_meta is not None and _canon(stored_meta) == _canon(meta_entry):
                meta_entry = None
    added = len(todo) + (1 if meta_entry is not None else 0)
    if status in ("up-to-date", "store-ahead") and meta_entry is not None:
        status = "metadata"
    t = Transfer(path, key, status, local=len(local), stored=len(stored_rest), added=added,
                 detail=note)
    return t, todo, meta_entry


def import_projects(
    root: str,
    projects_dir: str,
    *,
    project: str | None = None,
    dry_run: bool = False,
    create: bool = False,
    progress: Progress | None = None,
) -> tuple[list[Transfer], list[Problem]]:
    """Import every local transcript under ``projects_dir`` (see :func:`missing_entries`).

    ``root`` must be a store directory; with ``create`` it may also not exist yet (a
    new store), so that a mistyped root is not silently made into one.
    """
    if not create and not os.path.lexists(root):
        raise NoStore(f"{root}: no store here (does not exist; --create starts a new one)")
    require_store(root, create=create)
    projects_dir = os.path.abspath(projects_dir)
    files, problems = local_transcripts(projects_dir, project)
    store = SyncStore(root, create=create)
    out: list[Transfer] = []
    for i, path in enumerate(files):
        key = file_path_to_session_key(path, projects_dir)
        if key is None:
            out.append(Transfer(path, None, "skipped", detail="not a transcript path"))
        else:
            try:
                out.append(_import_file(store, path, key, dry_run))
            except FsStoreError as err:
                out.append(Transfer(path, key, "failed", detail=str(err), failed=True))
        _tick(progress, i + 1, len(files))
    return out, problems


# -- export ----------------------------------------------------------------------


def _safe_component(part: str, what: str) -> str:
    if part in ("", ".", "..") or "/" in part or "\x00" in part:
        raise NotFound(f"{what} {part!r} cannot be a local file name")
    return part


def _encode_jsonl(entries: list[dict[str, Any]]) -> bytes:
    # The SDK's own local writer (resume materialization) writes exactly this.
    return b"".join(json.dumps(e, separators=(",", ":")).encode("utf-8") + b"\n"
                    for e in entries)


def _make_dirs(path: str, mode: int) -> None:
    """``os.makedirs`` where every directory it creates gets ``mode``, the store's
    default ``dir_mode`` (makedirs gives it to the last one only, the others get 0777
    less the umask: world-writable under umask 000), set exactly, whatever the umask."""
    missing: list[str] = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            continue  # made meanwhile (or not a directory: the write says so)
        os.chmod(directory, mode)


def _atomic_write(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all: temp file, fsync, rename over."""
    directory = os.path.dirname(path)
    _make_dirs(directory, 0o700)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-"
                                  f"{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        tmp = ""
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _export_file(
    path: str, key: dict[str, str], entries: list[dict[str, Any]], *, force: bool, dry_run: bool
) -> Transfer:
    """Make the local file hold ``entries``: written if missing or a prefix of them, left
    alone if it already holds all of them, refused (unless ``force``) if it holds
    entries the store lacks while lacking some of the store's."""
    t = Transfer(path, key, "new", stored=len(entries), added=len(entries))
    if os.path.lexists(path):
        try:
            local, _note = read_local(path)
        except (ValueError, OSError) as exc:
            if not force:
                return _refused(path, key, len(entries), exc)
            local = []
        local = dedupe([(0, local)])
        missing, status = missing_entries(local, entries)
        t.local, t.added = len(local), len(missing)
        if not missing:
            t.status = "unchanged"
            return t
        if status not in ("new", "extended") and not force:
            t.status, t.failed = "refused", True
            t.detail = ("the local file and the store diverged (each has entries the other "
                        "lacks); --force overwrites the local file")
            return t
        t.status = "updated" if status in ("new", "extended") else "overwritten"
    if not dry_run:
        _atomic_write(path, _encode_jsonl(entries))
    return t


def _refused(path: str, key: dict[str, str], stored: int, exc: Exception) -> Transfer:
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return Transfer(path, key, "refused", stored=stored, failed=True,
                    detail=f"existing file is unreadable ({why}); --force overwrites")


def _export_meta(
    path: str, key: dict[str, str], meta: dict[str, Any], *, force: bool, dry_run: bool
) -> Transfer:
    content = {k: v for k, v in meta.items() if k != "type"}
    existed = os.path.lexists(path)
    if existed:
        try:
            if json.loads(_read_local_file(path)) == content:
                return Transfer(path, key, "unchanged", stored=1)
        except OSError as exc:  # a FIFO, a symlink, no permission: not ours to replace
            if not force:
                return _refused(path, key, 1, exc)
        except ValueError:
            pass  # a damaged sidecar: rewritten
    if not dry_run:
        _atomic_write(path, json.dumps(content).encode("utf-8"))
    return Transfer(path, key, "updated" if existed else "new", stored=1, added=1)


def export_session(
    root: str,
    project: str,
    session: str,
    projects_dir: str,
    *,
    force: bool = False,
    dry_run: bool = False,
) -> list[Transfer]:
    """Write a stored session to ``<projects_dir>/<project>/<session>.jsonl`` (+ subagents).

    Each file is written atomically and only if it changes; a local file holding
    entries the store lacks (or that cannot be read) is left alone unless ``force``.
    """
    require_store(root)
    store = SyncStore(root, summaries=False)
    key = {"project_key": project, "session_id": session}
    base = os.path.join(os.path.abspath(projects_dir), _safe_component(project, "project key"))
    sid = _safe_component(session, "session id")
    main = store.load(key)
    subpaths = store.list_subkeys(key)
    if main is None and not subpaths:
        raise NotFound(f"no session {session!r} in project {project!r}")
    out: list[Transfer] = []
    if main is not None:
        out.append(_export_file(os.path.join(base, f"{sid}.jsonl"), key, main,
                                force=force, dry_run=dry_run))
    for subpath in sorted(subpaths):
        skey = {**key, "subpath": subpath}
        entries = store.load(skey)
        if not entries:
            continue
        parts = subpath.split("/")
        for p in parts:
            _safe_component(p, "subpath segment")
        target = os.path.join(base, sid, *parts[:-1], parts[-1] + ".jsonl")
        meta, transcript = _split_metadata(entries)
        if transcript:
            out.append(_export_file(target, skey, transcript, force=force, dry_run=dry_run))
        if meta is not None:
            out.append(_export_meta(_meta_path(target), skey, meta, force=force,
                                    dry_run=dry_run))
    return out
