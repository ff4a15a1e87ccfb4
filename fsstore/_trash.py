"""Names in ``.trash``: what a delete moves there is named for what it was, and from a
name, where it came from, and whether it is an orphan (moved by mistake, unmarked,
with batches: no delete's to remove); the look at a delete's mark. Used by deletes
(:mod:`fsstore._delete`) and by ``fsstore gc`` and ``check``."""

from __future__ import annotations

import errno
import os
import re

from . import _fsio, _layout, _views
from ._layout import Component

ASIDE_TAG = "-deleted"  # what a delete moved into .trash, until it is emptied or moved back
FROM = "="  # in what a delete moves into .trash: the name it had (no key's name holds "=")

# What a delete moves into .trash is named for what it was: the session's tag (the
# first 16 hex digits of its main transcript's lock name), for a subagent transcript
# its own tag too, and the name it had (since stop 21; what a claim takes, already
# marked, has none). A directory of the session that holds no mark was moved by
# mistake (see :mod:`fsstore._delete`).
MOVED = re.compile(r"\.tmp-[0-9]+-[0-9a-f]+-[0-9]+-([0-9a-f]{16})(?:-([0-9a-f]{16}))?"
                   rf"(?:{FROM}([^/{FROM}]+))?{ASIDE_TAG}")


def orphan_target(name: str, transcripts: list[list[Component]]) -> tuple[list[Component], str] | None:
    """Where the orphan ``.trash/<name>`` (moved by mistake, unmarked) was moved from,
    if it was one of ``transcripts`` (their components) or their sessions: the
    arguments :func:`_merge.merge_back` takes (``comps``, ``mark``); None if none is there."""
    wanted = tags_of(name)
    for comps in transcripts if wanted is not None else []:
        found = tags(comps)
        if wanted == found[:1]:
            return comps[:4], _layout.MAIN
        if wanted == found:
            return comps, ""
    return None


def moved_by_mistake(trash: int, comps: list[Component]) -> str | None:
    """The name of a directory in ``.trash`` of the session ``comps[:4]`` (or of one of
    its transcripts) that no delete marked: moved there by mistake, and not moved back
    or merged yet (its batches are the session's); None if there is none. ``.trash``
    is listed afresh: a client's cached listing can miss what another host moved there
    (review 117, sshfs: a prune took the session for whole and deleted it, and the
    moved part came back after it)."""
    tag = tags(comps)[0]
    _views.refresh_listing(trash)
    return next((name for name in _fsio.listdir(trash)
                 if (tags_of(name) or [""])[0] == tag and surely_orphan(trash, name)), None)


def surely_orphan(trash: int, name: str) -> bool:
    try:
        return orphan(trash, name)
    except OSError:
        return False  # cannot be told now: left where it is (gc reports it)


def orphan(trash: int, name: str) -> bool:
    """Whether ``.trash/name`` is what a delete moved there by mistake (a ``-deleted``
    directory with no mark and batches in it: no delete's to remove), not yet moved
    back, merged or claimed. OSError where that cannot be told: its mark or its batches
    this process may not see (:func:`holds_batches`; a ``main/`` it may read but not
    search hid the mark of a deleted session's tomb, which gc then moved back: review)."""
    return (name.endswith(ASIDE_TAG) and not (mark_seen(trash, name, _layout.MAIN) or mark_seen(trash, name, ""))
            and holds_batches(trash, name))


def mark_seen(parent: int, name: str, below: str) -> bool:
    """:func:`_delete.marked`, raising where that cannot be told (EACCES...): for what must not
    take a mark it could not see for none (:func:`orphan`)."""
    try:
        return _fsio.exists(parent, mark_path(name, below))
    except NotADirectoryError:
        return False  # (``main`` a file: no mark in it)


def mark_path(name: str, below: str) -> str:
    return f"{name}/{below}/{_layout.DELETED}" if below else f"{name}/{_layout.DELETED}"


def moved_from(name: str, projects: list[str], sessions: list[tuple[str, ...]]) -> list[Component] | None:
    """The transcript whose session (or which) the orphan ``.trash/<name>`` was, by the
    name it had and its tags, looked for in ``projects`` (the names in ``projects/``)
    or ``sessions`` (each one's path components); None if not there."""
    m = MOVED.fullmatch(name)
    if m is None or m.group(3) is None:
        return None  # not moved by mistake, or moved by a delete before stop 21
    wanted = [t for t in (m.group(1), m.group(2)) if t]
    homes = ([(_layout.PROJECTS, p, _layout.SESSIONS, m.group(3), _layout.MAIN) for p in projects]
             if len(wanted) == 1 else [(*s, _layout.SUBKEYS, m.group(3)) for s in sessions])
    comps: list[list[Component]] = [[(c, None) for c in h] for h in homes]
    return next((c for c in comps if tags(c) == wanted), None)


def old_names(name: str, projects: list[str], sessions: list[tuple[str, ...]]) -> list[tuple[tuple[str, ...], str]]:
    """The names (parent, name) the directory ``.trash/<name>`` had before, as far as
    its name says: where a delete moved it from (looked for as :func:`moved_from`
    does) and, for a tomb (named so since stop 36), its name in ``.trash`` before."""
    out: list[tuple[tuple[str, ...], str]] = []
    if name.endswith(_layout.TOMB_TAG):
        name = name[: -len(_layout.TOMB_TAG)] + ASIDE_TAG
        out.append(((_layout.TRASH,), name))
    home = moved_from(name, projects, sessions)
    if home is not None:
        moved = home[:4] if home[-1][0] == _layout.MAIN else home
        out.append((tuple(c for c, _ in moved[:-1]), moved[-1][0]))
    return out


def tags(comps: list[Component]) -> list[str]:
    """The tags of the session ``comps[:4]`` and, below it, of a subagent transcript."""
    session = _layout.lock_name([*comps[:4], (_layout.MAIN, None)])[:16]
    return [session] if len(comps) <= 5 else [session, _layout.lock_name(comps)[:16]]


def tags_of(name: str) -> list[str] | None:
    """The tags of a name in ``.trash`` that a delete moved there; None for any other."""
    m = MOVED.fullmatch(name)
    return None if m is None else [t for t in (m.group(1), m.group(2)) if t]


def holds_batches(parent_fd: int, name: str,
                  known: tuple[str, ...] = (_layout.MAIN, _layout.SUBKEYS)) -> bool:
    """Whether a part or segment is anywhere below ``parent/name``. Where that cannot
    be told (a directory this process may not read now), the OSError is raised: what
    decides whether gc may remove it, or move it back, must not take batches it could
    not see for none, nor a mark it could not see for none (found by review: an orphan
    whose ``main/`` was unreadable for a moment was removed as "a leftover of a
    delete" once readable again, its batches lost). A session's ``known`` directories
    are looked up by name too: a GlusterFS client can list a directory another client
    moved as empty, for a minute, and find its ``main/`` by name (review 117)."""
    try:
        fd = os.open(name, _fsio.DIR_FLAGS, dir_fd=parent_fd)
    except (FileNotFoundError, NotADirectoryError):
        return False  # gone, or not a directory: no batch
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return False  # a symlink: never ours, nothing of ours below it
        raise
    try:
        with os.scandir(fd) as entries:
            listed = {e.name: e.is_dir(follow_symlinks=False) for e in entries}
        seen = any(holds_batches(fd, n, ()) if is_dir else _layout.parse_item(n) is not None
                   for n, is_dir in listed.items())
        return seen or any(holds_batches(fd, n, ()) for n in known if n not in listed)
    finally:
        os.close(fd)
