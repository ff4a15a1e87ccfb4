"""Walking a live store, for the ``fsstore`` command line: what is there, under which key.

:class:`Walker` lists the store's directories and decodes their names into keys,
notes what it finds on the way (:class:`Problem`, :class:`Garbage`), and looks at
one transcript at a time (:meth:`Walker.inspect`). The commands built on it:
``ls`` and ``check`` (:mod:`fsstore._check`), ``gc``, ``prune`` and ``compact``
(:mod:`fsstore._cleanup`), ``locks`` (:mod:`fsstore._lockfiles`), ``migrate`` and
``check --repair`` (:mod:`fsstore._migrate`). Import and export go through the
public API only (:mod:`fsstore._transfer`).

Everything here runs while other processes (on other hosts too) write to the store:

* directories are opened one component at a time with ``O_NOFOLLOW`` (through the
  store's :class:`fsstore._fsio.Fs`), so a symlink inside the store is reported,
  never followed;
* a file or directory that vanishes mid-walk (a compaction merged it, a delete
  moved it to ``.trash``, or ESTALE after another host replaced it) is skipped;
* a transcript is looked at the way ``load`` reads it
  (:func:`fsstore._transcript.snapshot`: list, read, list again), and looked at
  again while the two listings disagree, by the readers' limits; a transcript
  deleted while it was looked at is not reported at all;
* young temp files and held locks are in-flight work, reported as such and never
  touched; only what is older than the caller's threshold is garbage. Temp files
  and ``.trash`` entries are aged by the later of mtime and ctime (ctime cannot be
  set back, and a rename sets it).

File times come from the file server: ages go by its clock, read once from a file made
in the root (``offset``, :func:`_views.server_clock_offset`; review 99: ``prune
--older-than 1h`` on a host 2 h ahead deleted sessions being appended to). ``max_skew``:
how far ahead of that the newest file time is (docs/operations.md, clock skew).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from . import _fsio, _keys, _layout, _output, _trash, _views
from ._errors import FsStoreError, posix_code
from ._keys import TranscriptKey
from ._store import SyncStore
from ._transcript import READ_ATTEMPTS, UNLOCKED_READS, Damage, Item, Snapshot, snapshot

#: ``progress(done, total)``: called as a walk advances (the CLI draws a bar).
Progress = Callable[[int, int], None]

#: errnos that mean "it is not there any more": skipped while walking a live store.
_GONE = frozenset({errno.ENOENT, errno.ESTALE})
#: Names the NFS client gives a file that was deleted while still open on it.
NFS_SILLY_PREFIX = ".nfs"
# FUSE's silly rename (libfuse's hard_remove off): a file unlinked while open on that
# mount; the mount removes it at the last close, or never if the mount dies first.
FUSE_HIDDEN_PREFIX = ".fuse_hidden"
#: What a store root holds once anything was written to it (``.fsstore``: a store marker).
_STORE_NAMES = (_layout.MARKER, _layout.PROJECTS, _layout.LOCKS)


class NoStore(Exception):
    """The store root does not exist or is not a directory. ``code``: ``NOT_A_STORE``,
    or the POSIX name of why it could not be looked at."""

    def __init__(self, message: str, code: str = "NOT_A_STORE") -> None:
        super().__init__(message)
        self.code = code


class NotFound(Exception):
    """The transcript, session or project a command named is not in the store."""


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
        return asdict(self)


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
class File:
    """A committed file as listed: a part (``first == last``) or a segment."""

    first: int
    last: int
    name: str
    size: int
    mtime_ns: int
    ctime_ns: int = 0  # with the inode number: tells a file made anew at the name (prune)
    ino: int = 0


@dataclass
class Garbage:
    """A temp file, a ``.trash`` entry, a lock recovery file or a FUSE leftover, with its age."""

    kind: str  # "temp", "trash", "tomb", "orphan", "lock-recovery", "lock-record", "fuse-hidden"
    parent: tuple[str, ...]
    name: str
    path: str
    age: float
    is_dir: bool


@dataclass
class TranscriptInfo:
    """What a look at one transcript found (:meth:`Walker.inspect`)."""

    ref: TranscriptRef
    path: str
    items: list[File]  # every committed file that is a regular file
    live: list[File]  # those of the transcript's chain
    temps: list[Garbage]
    entries: int | None = None  # when read: entries in the chain's files (no de-duplication)
    marked: bool = False  # holds a .deleted mark: a delete under way, or interrupted
    mark_age: float = 0.0  # how old that mark is (0: not in the first listing)

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
            "modified": _output.iso_ns(self.mtime_ns),
            "mtime_ms": None if self.mtime_ns is None else self.mtime_ns // 1_000_000,
            "parts": self.parts,
            "segments": self.segments,
            "files": len(self.items),
            "bytes": self.bytes,
            "last_seq": self.last_seq,
            "entries": self.entries,
        }


# -- small helpers ---------------------------------------------------------------


def gone(exc: OSError) -> bool:
    """Whether an OSError says the thing is not there any more (not a problem)."""
    return exc.errno in _GONE


def unreadable(path: str, what: str, exc: OSError) -> list[Problem]:
    """An OSError as a problem, unless it says the thing is gone."""
    if gone(exc):
        return []
    return [Problem("error", "unreadable", path, f"{what}: {exc.strerror}", code=posix_code(exc.errno))]


def changed_at(st: os.stat_result) -> float:
    """When a file was last written or moved: ctime cannot be set back (mtime can, by
    ``utime`` or a copy that keeps times), and a rename into ``.trash`` sets it."""
    return max(st.st_mtime, st.st_ctime)


def tick(progress: Progress | None, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)


def _scandir(fd: int, path: str) -> tuple[list[os.DirEntry[str]], list[Problem]]:
    """The entries of an open directory by name, or why it could not be listed."""
    try:
        with os.scandir(fd) as it:
            return sorted(it, key=lambda e: e.name), []
    except OSError as exc:
        return [], unreadable(path, "cannot list directory", exc)


def _lstat(entry: os.DirEntry[str], path: str) -> tuple[os.stat_result | None, list[Problem]]:
    """An entry's lstat; None if it vanished (or cannot be had: then a problem)."""
    try:
        return entry.stat(follow_symlinks=False), []
    except OSError as exc:
        return None, unreadable(f"{path}/{entry.name}", "cannot stat", exc)


def is_store(root: str) -> bool:
    """Whether the directory ``root`` looks like a store: it holds ``projects/``,
    ``.locks/`` or ``.fsstore`` (an empty directory, or ``/etc``, does not). An
    OSError other than "not there" (EACCES: a store this user may not enter) is
    raised: it says what is wrong, where "not a store" would not (review)."""
    for name in _STORE_NAMES:
        try:
            os.lstat(os.path.join(root, name))
            return True
        except (FileNotFoundError, NotADirectoryError):
            continue
    return False


def require_store(root: str, *, create: bool = False) -> None:
    """NoStore unless ``root`` is a store directory (or, with ``create``, an empty
    directory or nothing yet). Where ``root`` cannot be looked at (EACCES on a parent,
    ELOOP), that OSError is raised: its code says what is wrong."""
    try:
        is_dir = stat.S_ISDIR(os.stat(root).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        is_dir = False
    if is_dir:
        if is_store(root):
            return
        if not create:
            raise NoStore(f"{root}: not an fsstore store (no {', '.join(_STORE_NAMES)})")
        try:
            crowded = bool(os.listdir(root))
        except OSError as exc:
            raise NoStore(f"{root}: cannot list ({exc.strerror})", posix_code(exc.errno)) from exc
        if crowded:
            raise NoStore(f"{root}: not an fsstore store, and not empty: not made into one "
                          "(`fsstore init ROOT` marks a directory as a store on purpose)")
        return
    if os.path.islink(root) and not os.path.exists(root):
        raise NoStore(f"{root}: no store here (a symlink to {os.readlink(root)}, which does not exist)")
    if os.path.lexists(root):
        raise NoStore(f"{root}: no store here (not a directory)")
    if not create:
        raise NoStore(f"{root}: no store here (does not exist)")


# -- the walker ------------------------------------------------------------------


class Walker:
    """Walks one store; collects problems and garbage as it goes.

    ``rfd`` is an open descriptor of the root of ``store``; every path below it is
    opened one component at a time without following symlinks. ``looks_only`` (check):
    a transcript lock is taken only where no marker exists, since taking one that
    exists reclaims it if it is stale, and a stale lock is check's to report and gc's
    to break.
    """

    def __init__(self, rfd: int, store: SyncStore, *, stale_lock_seconds: float = 30.0,
                 looks_only: bool = False) -> None:
        self.rfd = rfd
        self.looks_only = looks_only
        self.store = store
        self.root = store.root
        self.offset = _views.server_clock_offset(rfd, inside=_layout.LOCKS)
        self.now = self.clock()
        self.stale_lock_seconds = stale_lock_seconds
        self.problems: list[Problem] = []
        self.garbage: list[Garbage] = []  # temp entries found outside transcript dirs
        self.max_skew = 0.0

    # -- plumbing ----------------------------------------------------------------

    def path(self, comps: Sequence[str]) -> str:
        return "/".join((self.root, *comps)) if comps else self.root

    def problem(
        self, severity: str, kind: str, path: str, message: str, *,
        line: int | None = None, code: str | None = None,
    ) -> None:
        self.problems.append(Problem(severity, kind, path, message, line, code))

    def open(self, comps: Sequence[str]) -> int | None:
        """Open ``root/comps``; None if it is gone; a problem (and None) if unsafe or unreadable."""
        try:
            return self.store.fs.open_dir(
                self.rfd, [(c, None) for c in comps], create=False,
                base_path=self.root, operation="walk",
            )
        except FsStoreError as err:  # UNSAFE_PATH: a symlink where a directory belongs
            self.problem("error", "symlink", err.path or self.path(comps), err.message,
                         code=err.code)
        except OSError as exc:
            self.problems += unreadable(self.path(comps), "cannot open directory", exc)
        return None

    def entries(
        self, comps: tuple[str, ...]
    ) -> Iterator[tuple[int, os.DirEntry[str], os.stat_result]]:
        """``(dir fd, entry, lstat)`` of each entry of ``root/comps``, by name, skipping
        what vanished; none if the directory is gone or unreadable (a problem says which)."""
        fd = self.open(comps)
        if fd is None:
            return
        try:
            listed, unlisted = _scandir(fd, self.path(comps))
            self.problems += unlisted
            for entry in listed:
                st, problems = _lstat(entry, self.path(comps))
                self.problems += problems
                if st is not None:
                    yield fd, entry, st
        finally:
            os.close(fd)

    def clock(self) -> float:
        """Now, by the file server's clock as this walk measured it."""
        return time.time() + self.offset

    def age(self, ts: float) -> float:
        """How old a file time is by this host's clock (0 if ahead: noted as skew)."""
        age = self.now - ts
        self.max_skew = max(self.max_skew, -age)
        return max(age, 0.0)

    def garbage_entry(
        self, kind: str, comps: tuple[str, ...], entry: os.DirEntry[str], st: os.stat_result
    ) -> Garbage:
        return Garbage(kind, comps, entry.name, self.path((*comps, entry.name)),
                       self.age(changed_at(st)), stat.S_ISDIR(st.st_mode))

    # -- names -------------------------------------------------------------------

    def decode(self, parent_fd: int, comps: tuple[str, ...], entry: os.DirEntry[str]) -> str | None:
        """The key part a directory name stands for; a problem and None if it has none."""
        path = self.path((*comps, entry.name))
        try:
            part = _layout.decode_entry(parent_fd, entry)
        except OSError as exc:
            self.problems += unreadable(f"{path}/{_fsio.KEY_FILE}", "cannot read", exc)
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
            if _fsio.exists(parent_fd, name):  # else: deleted meanwhile
                self.problem("error", "bad-name", path,
                             "hashed directory name without its .key file: the key cannot be "
                             "recovered from the name, so listings skip this directory")
            return
        except OSError as exc:
            self.problems += unreadable(f"{path}/{_fsio.KEY_FILE}", "cannot stat", exc)
            return
        self.problem("error", "bad-name", f"{path}/{_fsio.KEY_FILE}",
                     ".key is not a regular file, not UTF-8, or does not hold the key this "
                     "directory name was made from")

    def children(self, comps: tuple[str, ...], what: str) -> list[tuple[str, str]]:
        """``(key part, name)`` of every key directory under ``comps``; the rest is noted."""
        out: list[tuple[str, str]] = []
        for fd, entry, st in self.entries(comps):
            epath = self.path((*comps, entry.name))
            if self.stray(comps, entry, st):
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

    def stray(self, comps: tuple[str, ...], entry: os.DirEntry[str], st: os.stat_result) -> bool:
        """Note a temp or ``.nfs*`` entry (True), or leave the entry to the caller (False)."""
        found = self._leftover(comps, entry, st)
        if isinstance(found, Garbage):
            self.garbage.append(found)
        elif found is not None:
            self.problems.append(found)
        return found is not None

    def _leftover(
        self, comps: tuple[str, ...], entry: os.DirEntry[str], st: os.stat_result
    ) -> Garbage | Problem | None:
        """A temp file or FUSE's hidden file (garbage), an NFS silly-rename (an info), or None."""
        if entry.name.startswith(_fsio.TEMP_PREFIX):
            return self.garbage_entry("temp", comps, entry, st)
        if entry.name.startswith(FUSE_HIDDEN_PREFIX):
            return self.garbage_entry("fuse-hidden", comps, entry, st)
        if entry.name.startswith(NFS_SILLY_PREFIX):
            return Problem("info", "nfs-silly-rename", self.path((*comps, entry.name)),
                           "NFS silly-rename: a deleted file still open on some client; the "
                           "client removes it when the file is closed")
        return None

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
            elif not self.stray(comps, entry, st):
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
        """Every entry of ``.trash`` (deletes in progress, or their leftovers), but one
        this walker cannot tell an orphan from a leftover (it may not read it): that is
        a problem, and nothing is done to it."""
        comps = (_layout.TRASH,)
        found = []
        for fd, entry, st in self.entries(comps):
            try:
                kind = ("tomb" if entry.name.endswith(_layout.TOMB_TAG) else
                        "orphan" if _moved_by_mistake(fd, entry, st) else "trash")
            except OSError as exc:
                self.problems += unreadable(self.path((*comps, entry.name)),
                                            "cannot tell whether it holds batches", exc)
                continue
            found.append(self.garbage_entry(kind, comps, entry, st))
        return found

    def root_entries(self) -> None:
        """Note anything at the top level that is not ``projects``, ``.trash``, ``.locks``,
        the ``.fsstore`` marker or a temp file (a command's clock probe: garbage once old)."""
        for _fd, entry, st in self.entries(()):
            if entry.name in (_layout.PROJECTS, _layout.TRASH, _layout.LOCKS, _layout.MARKER) or (
                    self.stray((), entry, st)):
                continue
            self.problem("info", "unexpected", self.path((entry.name,)),
                         "not part of the store layout (left alone)")

    # -- one transcript ----------------------------------------------------------

    def inspect(self, ref: TranscriptRef, *, verify: bool = False) -> TranscriptInfo | None:
        """List (and with ``verify``, read and parse) one transcript; None if it is gone
        or could not be read (then a problem says why).

        A look is a :func:`~fsstore._transcript.snapshot`, judged by the readers' rule:
        while the transcript changes under it (its two listings disagree), it is looked
        at again, under the transcript lock after a few tries where this walker may take
        it (a writer compacting faster than this reads can change every listing); the
        last look is taken as it is. Only the findings of the look taken count.
        """
        attempt = 0
        while True:
            with contextlib.ExitStack() as guard:
                if attempt >= UNLOCKED_READS and self._may_lock(ref):
                    guard.enter_context(self.store.reading_lock(ref.key()))
                fd = self.open(ref.comps)
                if fd is None:
                    return None
                try:
                    info, snap, problems = self._look(fd, ref, verify=verify)
                    moved = not self._still_there(fd, ref)
                except OSError as exc:
                    self.problems += unreadable(self.path(ref.comps),
                                                "cannot read the transcript", exc)
                    return None
                finally:
                    os.close(fd)
            if moved:
                # Deleted (renamed into .trash) while we looked: whatever a half-removed
                # directory seemed to lack is not damage.
                return None
            if snap.race is None or attempt == READ_ATTEMPTS - 1:
                self.problems += problems
                return info
            time.sleep(min(0.005 * attempt, 0.05))  # let a compaction finish
            attempt += 1

    def _may_lock(self, ref: TranscriptRef) -> bool:
        """Whether :meth:`inspect` may take the transcript's lock (see ``looks_only``)."""
        if not self.looks_only:
            return True
        lock = f"{self.root}/{_layout.LOCKS}/{_layout.lock_name(_layout.transcript_dirs(ref.tk))}"
        return not os.path.lexists(lock)

    def _still_there(self, fd: int, ref: TranscriptRef) -> bool:
        try:
            return _fsio.same_dir(fd, self.rfd, ref.comps)
        except OSError as exc:  # ESTALE: replaced on another host
            if not gone(exc):
                raise
            return False

    def _look(
        self, fd: int, ref: TranscriptRef, *, verify: bool
    ) -> tuple[TranscriptInfo, Snapshot, list[Problem]]:
        """One look at a transcript: what it holds, the snapshot, and what is wrong."""
        path = self.path(ref.comps)
        names: list[Item] = []  # every part and segment name listed, as the snapshot lists
        files: list[File] = []  # those that are regular files, with their stat
        temps: list[Garbage] = []
        marked = False
        mark_age = 0.0
        listed, problems = _scandir(fd, path)
        for entry in listed:
            name = entry.name
            rng = _layout.parse_item(name)
            st, unstat = _lstat(entry, path)
            problems += unstat
            if rng is not None:
                names.append((rng[0], rng[1], name))
                if st is None or st.st_nlink == 0:
                    continue  # vanished while we listed (a compaction merged it)
                if stat.S_ISREG(st.st_mode):
                    files.append(File(rng[0], rng[1], name, st.st_size, st.st_mtime_ns,
                                      st.st_ctime_ns, st.st_ino))
                    self.age(st.st_mtime)
                else:
                    kind = "symlink" if stat.S_ISLNK(st.st_mode) else "unreadable"
                    problems.append(Problem("error", kind, f"{path}/{name}", "committed file "
                                            "is not a regular file; load() cannot read it"))
            elif st is None:
                continue
            elif isinstance(found := self._leftover(ref.comps, entry, st), Garbage):
                temps.append(found)
            elif found is not None:
                problems.append(found)
            elif name == _layout.DELETED:
                marked = True  # a delete under way, or its deleter died
                mark_age = self.age(st.st_mtime)
            elif name not in (_layout.STATE, _layout.STATE_SPARE) and not (
                name == _fsio.KEY_FILE and ref.subpath
            ):
                problems.append(Problem("warning", "unexpected", f"{path}/{name}", "unexpected "
                                        "entry in a transcript directory (load() ignores it)"))
        snap = snapshot(fd, path, "check", read=verify, first=(names, marked))
        chain = {name for _first, _last, name in snap.chain}
        files.sort(key=lambda it: (it.first, -it.last))
        info = TranscriptInfo(ref, path, files, [f for f in files if f.name in chain], temps,
                              marked=snap.deleted is not None, mark_age=mark_age)
        problems += _gaps(path, snap.chain)
        if verify:
            info.entries = sum(len(batch) for _last, batch in snap.batches)
            regular = {f.name for f in files}  # the others: the listing said what they are
            problems += [_damage(path, d) for d in snap.damage if d.name in regular]
        return info, snap, problems


def _gaps(path: str, chain: list[Item]) -> list[Problem]:
    """A problem for each hole in a transcript's chain, at the file after it."""
    out = []
    expected = 1
    for first, last, name in chain:
        if first > expected:
            span = f"part {expected}" if first == expected + 1 else f"parts {expected}..{first - 1}"
            out.append(Problem("error", "gap", f"{path}/{name}",
                               f"sequence gap: {span} missing before this file "
                               "(lost files; load() returns the rest)"))
        expected = last + 1
    return out


def _damage(path: str, damage: Damage) -> Problem:
    """A file of the chain that could not be read or parsed, as a problem."""
    fpath = f"{path}/{damage.name}"
    err = damage.error
    if isinstance(err, FsStoreError):
        return Problem("error", "corrupt", fpath, err.message, damage.line, err.code)
    return Problem("error", "unreadable", fpath, f"cannot read: {err.strerror}",
                   code=posix_code(err.errno))


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
            rfd = stack.enter_context(store.open_root())  # (EACCES, ELOOP: raised as they are)
        except NotADirectoryError:
            rfd = None
        if rfd is None:
            require_store(root)  # what is wrong, in words (a missing root: "does not exist")
            raise NoStore(f"{root}: no store here (removed, or replaced by a file, just now)")
        require_store(root)
        yield Walker(rfd, store, stale_lock_seconds=stale_lock_seconds, looks_only=looks_only)


def _moved_by_mistake(trash_fd: int, entry: os.DirEntry[str], st: os.stat_result) -> bool:
    """A directory a delete moved into ``.trash`` that holds no mark: made anew after the
    delete's mark, its batches are no delete's to remove. Its deleter moves it back or
    merges it (young, in flight); if that deleter died, it is an orphan for the operator."""
    return stat.S_ISDIR(st.st_mode) and _trash.orphan(trash_fd, entry.name)
