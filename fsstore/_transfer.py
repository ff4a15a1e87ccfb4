"""Between the local ``~/.claude/projects`` layout and the store: ``fsstore import`` and
``fsstore export``.

Both go through the store's public operations only (``load``, ``append``,
``list_subkeys``) and are idempotent: a transcript is compared with what the other
side holds first (:func:`missing_entries`, with load()'s own de-duplication), and
only what is missing is appended (import) or written (export). Local files are read
without following a symlink and never block on a FIFO; exported files are written
whole or not at all (temp file, fsync, rename).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import _fsio, _keys, _read
from ._errors import FsStoreError, from_oserror, posix_code
from ._store import SyncStore
from ._transcript import dedupe
from ._walk import NoStore, NotFound, Problem, Progress, gone, require_store, tick

#: Entries per append() when importing (each append is one part file).
_IMPORT_BATCH = 1000
_IMPORT_BATCH_BYTES = 8 << 20


def _canon(entry: Any) -> str:
    """A comparable form of an entry (key order and spacing do not matter)."""
    return json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


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


def _passed_over(entry: os.DirEntry[str], skipped: list[Problem]) -> bool:
    """Whether import leaves ``entry`` alone, said in ``skipped``: a symlink, or a
    ``*.jsonl`` that is neither a file nor a directory (a FIFO, a socket, a device)."""
    if entry.is_symlink():
        skipped.append(Problem("info", "symlink", entry.path, "symlink skipped"))
        return True
    if entry.name.endswith(".jsonl") and not (
        entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False)
    ):
        skipped.append(Problem("info", "not-a-file", entry.path, "not a regular file: skipped"))
        return True
    return False


def _local_jsonl(directory: str, out: list[str], skipped: list[Problem], depth: int = 0) -> None:
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        if not gone(exc):
            skipped.append(Problem("error", "unreadable", directory,
                                   f"cannot list: {exc.strerror}", code=posix_code(exc.errno)))
        return
    for entry in entries:
        if _passed_over(entry, skipped):
            continue
        if entry.is_dir(follow_symlinks=False):
            if depth >= 32:
                skipped.append(Problem("error", "too-deep", entry.path,
                                       "more than 32 directories below the session: not read"))
            else:
                _local_jsonl(entry.path, out, skipped, depth + 1)
        elif entry.is_file(follow_symlinks=False) and entry.name.endswith(".jsonl"):
            out.append(entry.path)


def local_transcripts(
    projects_dir: str, project: str | None = None
) -> tuple[list[str], list[Problem]]:
    """``<project>/<session>.jsonl`` and ``<project>/<session>/**/*.jsonl`` files (the
    subagent transcripts: ``subagents/...`` as Claude Code writes them, and any other
    subpath as the SDK and ``fsstore export`` write it: ``<session>/<subpath>.jsonl``)."""
    files: list[str] = []
    skipped: list[Problem] = []
    try:
        projects = sorted(os.scandir(projects_dir), key=lambda e: e.name)
    except OSError as exc:
        raise NoStore(f"{projects_dir}: cannot list ({exc.strerror})", posix_code(exc.errno)) from exc
    for pentry in projects:
        if project is not None and pentry.name != project:
            continue
        if pentry.is_symlink():
            skipped.append(Problem("info", "symlink", pentry.path, "symlink skipped"))
            continue
        if not pentry.is_dir(follow_symlinks=False):
            continue
        try:
            entries = sorted(os.scandir(pentry.path), key=lambda e: e.name)
        except OSError as exc:
            skipped.append(Problem("error", "unreadable", pentry.path,
                                   f"cannot list: {exc.strerror}", code=posix_code(exc.errno)))
            continue
        mains: list[str] = []
        subs: list[str] = []
        for entry in entries:
            if _passed_over(entry, skipped):
                continue
            if entry.is_file(follow_symlinks=False) and entry.name.endswith(".jsonl"):
                mains.append(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                _local_jsonl(entry.path, subs, skipped)
        files += mains + subs  # main transcripts first, like a live session
    return files, skipped


def _read_local_file(path: str) -> bytes:
    """A local file's bytes, not through a symlink and never blocking on a FIFO;
    ``_read.NotAFile`` for anything but a regular file."""
    dfd = os.open(os.path.dirname(path) or ".", _fsio.DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        return _read.read_file(dfd, os.path.basename(path))
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
        if gone(exc):
            return Transfer(path, key, "gone", detail="removed while importing")
        return Transfer(path, key, "failed", detail=f"{posix_code(exc.errno)} {exc.strerror}", failed=True)
    t = _compare(store, path, key, local, note)[0]
    if dry_run or not t.added:
        return t
    # Compared again and appended under the transcript's lock: two imports of one file at
    # once appended it twice (review 105: entries without a uuid then load twice).
    with store.locked(key):
        t, todo, meta_entry = _compare(store, path, key, local, note)
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
    try:
        os.lstat(root)
    except (FileNotFoundError, NotADirectoryError):
        if not create:
            raise NoStore(f"{root}: no store here (does not exist; --create starts a new one)") from None
    require_store(root, create=create)  # (EACCES, ELOOP: raised as they are)
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
        tick(progress, i + 1, len(files))
    if not dry_run:
        # Written back before it is reported (an operator may remove the local files
        # then), whatever fsync says (found by a power-loss review: a cut 3 s after an
        # import left the session's imported parts empty, the whole session CORRUPT).
        with store.open_root() as rfd:
            if rfd is not None:
                try:
                    _fsio.sync_fs(rfd)
                except OSError as exc:
                    raise from_oserror(exc, "import", root) from exc
    return out, problems


# -- export ----------------------------------------------------------------------


# Bytes in a file name on Linux's file systems (NAME_MAX).
_NAME_MAX = 255


def _safe_component(part: str, what: str, suffix: str = "") -> str:
    """``part`` as a local file name, checked before anything is written: NotFound where
    it cannot be one; ENAMETOOLONG where it, with ``suffix`` (the longest name made from
    it), is longer than a file name may be (review 105: an export that failed so left an
    empty ``DIR/PROJECT/``)."""
    if part in ("", ".", "..") or "/" in part or "\x00" in part:
        raise NotFound(f"{what} {part!r} cannot be a local file name")
    size = len((part + suffix).encode("utf-8", "surrogateescape"))
    if size > _NAME_MAX:
        raise FsStoreError("ENAMETOOLONG", f"a {what} of {size - len(suffix)} bytes ({part[:40]}...) "
                           f"cannot be a local file name (at most {_NAME_MAX - len(suffix)}); nothing "
                           "was written", operation="export", errno=errno.ENAMETOOLONG)
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
        fd, closing = -1, fd
        os.close(closing)
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
    sid = _safe_component(session, "session id", ".jsonl")
    main = store.load(key)
    subpaths = store.list_subkeys(key)
    if main is None and not subpaths:
        raise NotFound(f"no session {session!r} in project {project!r}")
    out: list[Transfer] = []
    if main is not None:
        out.append(_export_file(os.path.join(base, f"{sid}.jsonl"), key, main,
                                force=force, dry_run=dry_run))
    loaded = [(subpath, store.load({**key, "subpath": subpath})) for subpath in sorted(subpaths)]
    if main is None and all(entries is None for _subpath, entries in loaded):
        # Listed, but deleted (its delete committed, not finished: review, stop 36)
        raise NotFound(f"no session {session!r} in project {project!r}")
    for subpath, entries in loaded:
        skey = {**key, "subpath": subpath}
        if not entries:
            continue
        parts = subpath.split("/")
        for i, p in enumerate(parts):
            _safe_component(p, "subpath segment", ".meta.json" if i == len(parts) - 1 else "")
        target = os.path.join(base, sid, *parts[:-1], parts[-1] + ".jsonl")
        if len(parts) == 1:
            # <session>/<subpath>.jsonl: the SDK's rule reads no key from a file one level
            # below the session (import would not take it back), so it is not written.
            out.append(Transfer(target, skey, "refused", stored=len(entries), failed=True,
                                detail="a one-segment subpath has no place in the local layout "
                                       "(<session>/<subpath>.jsonl needs two segments); not written"))
            continue
        meta, transcript = _split_metadata(entries)
        if transcript or meta is not None:  # an empty file carries a sidecar back in on import
            out.append(_export_file(target, skey, transcript, force=force, dry_run=dry_run))
        if meta is not None:
            out.append(_export_meta(_meta_path(target), skey, meta, force=force,
                                    dry_run=dry_run))
    return out
