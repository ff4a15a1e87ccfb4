"""Where everything lives under the store root (see docs/format.md).

    <root>/projects/<P>/sessions/<S>/main/            the main transcript
    <root>/projects/<P>/sessions/<S>/subkeys/<SP>/    one subagent transcript
    <root>/.trash/                                    deletes in progress
    <root>/.locks/<hash>.lock                         commit locks, while held

``P``, ``S`` and ``SP`` are encoded key parts (:mod:`fsstore._keys`). Inside a
transcript directory:

    00000000000000000001.jsonl                        a part: one committed batch
    00000000000000000001-00000000000000000300.jsonl   a segment: parts 1..300 merged
                                                      (a part of one empty line: a lost batch's place)
    state.json                                        the summary as of a compaction (a hint)
    .deleted                                          a delete is under way (committed)
    .tmp-*-pruning                                    a prune's mark, until its last look
    .tmp-*                                            temp files (garbage once old)
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import re

from . import _fsio, _keys, _read
from ._errors import FsStoreError
from ._keys import TranscriptKey

PROJECTS = "projects"
SESSIONS = "sessions"
MAIN = "main"
SUBKEYS = "subkeys"
TRASH = ".trash"
LOCKS = ".locks"
MARKER = ".fsstore"  # in the root: this directory is a store (format, created when, by which host)
STATE = "state.json"
STATE_SPARE = ".state.spare"  # format 1's previous state.json: ignored, removed by migrate
DELETED = ".deleted"  # created in a transcript directory before a delete moves it away
# What `fsstore check --repair` links at the number of a batch lost outside fsstore: one
# empty line, which holds no entry. The chain is whole again; a writer that wanted the
# number finds it taken and goes above; under a segment it is a leftover like any part.
LOST = b"\n"
# A prune's mark until its last look says delete: a temp file (``.tmp-*-pruning``) it then
# renames to ``.deleted`` in ``main/`` (its commit, like a batch's). An append that finds
# one removes it first: that prune then keeps the session (see _delete._prune).
PRUNING_TAG = "-pruning"
# The tag of what a delete leaves in .trash: the deleted directories' marks only, so that
# a writer still reaching them sees the delete (removed by `fsstore gc` once old).
TOMB_TAG = "-tomb"

Component = tuple[str, "str | None"]

_SEQ_DIGITS = 20
MAX_SEQ = 10**_SEQ_DIGITS - 1
_ITEM = re.compile(r"([0-9]{20})(?:-([0-9]{20}))?\.jsonl")


def _named(part: str) -> Component:
    name = _keys.encode(part)
    return (name, part if _keys.is_hashed(name) else None)


def project_dirs(project_key: str) -> list[Component]:
    """Components of ``<root>/projects/<P>/sessions``."""
    return [(PROJECTS, None), _named(project_key), (SESSIONS, None)]


def session_dirs(project_key: str, session_id: str) -> list[Component]:
    return [*project_dirs(project_key), _named(session_id)]


def transcript_dirs(key: TranscriptKey) -> list[Component]:
    base = session_dirs(key.project_key, key.session_id)
    if key.subpath is None:
        return [*base, (MAIN, None)]
    return [*base, (SUBKEYS, None), _named(key.subpath)]


def moved_by_deletes(transcript: list[Component]) -> tuple[int, ...]:
    """The indexes in ``transcript`` (:func:`transcript_dirs`) of the directories a delete
    moves away: the session's (``<S>``), and a subagent transcript's own (``<SP>``)."""
    session = len(transcript) - (2 if transcript[-1][0] == MAIN else 3)
    return (session,) if transcript[-1][0] == MAIN else (session, len(transcript) - 1)


def pruning(name: str) -> bool:
    """Whether ``name`` is a prune's mark not yet committed (see ``PRUNING_TAG``)."""
    return name.startswith(_fsio.TEMP_PREFIX) and name.endswith(PRUNING_TAG)


def session_marker(key: TranscriptKey) -> str | None:
    """Where a subagent transcript's directory sees its session's delete marker (the
    main transcript's ``.deleted``: a session delete marks it first)."""
    return None if key.subpath is None else f"../../{MAIN}/{DELETED}"


def rel(components: list[Component]) -> str:
    return "/".join(name for name, _ in components)


def lock_name(transcript: list[Component]) -> str:
    """``.locks/`` entry of a transcript: SHA-256 of its relative path, 40 hex digits."""
    return hashlib.sha256(rel(transcript).encode("ascii")).hexdigest()[:40] + ".lock"


def part_name(seq: int) -> str:
    """The name of part ``seq``. Past :data:`MAX_SEQ` (20 digits) there is none: a
    longer name is one that readers ignore, so a batch linked there would be lost (a
    file numbered at the top, dropped in by hand, made every later append such a
    loss: review, stop 33). That is ``CORRUPT``, and nothing is linked."""
    if seq > MAX_SEQ:
        raise FsStoreError("CORRUPT", f"no part number left above {MAX_SEQ}: a file numbered "
                           "at the top of the range is not this store's (made by hand?); move it "
                           "aside (fsstore check names it)", operation="append")
    return f"{seq:0{_SEQ_DIGITS}d}.jsonl"


def segment_name(first: int, last: int) -> str:
    return f"{first:0{_SEQ_DIGITS}d}-{last:0{_SEQ_DIGITS}d}.jsonl"


@functools.lru_cache(maxsize=4096)  # every commit's check parses its directory's names twice
def parse_item(name: str) -> tuple[int, int] | None:
    """``(first, last)`` for a part or segment name; None for anything else."""
    m = _ITEM.fullmatch(name)
    if m is None:
        return None
    first = int(m.group(1))
    last = int(m.group(2)) if m.group(2) else first
    # No compaction makes an `N-N`: readers took one put there by hand for part N, and
    # the part a writer then linked at N was hidden (review, stop 33).
    if m.group(2) and last <= first:
        return None
    return (first, last) if first >= 1 else None


def decode_entry(parent_fd: int, entry: os.DirEntry[str]) -> str | None:
    """The key part a directory entry stands for; None for anything not ours.

    Hashed names are decoded from their ``.key`` file, which must encode back to
    the name; store-internal names (starting with ``.``) and non-directories are
    not keys.
    """
    name = entry.name
    if name.startswith(".") or not _fsio.is_dir_entry(entry):
        return None
    if not _keys.is_hashed(name):
        return _keys.decode(name)
    try:
        fd = os.open(name, _fsio.DIR_FLAGS, dir_fd=parent_fd)
        try:
            original = _read.read_file(fd, _fsio.KEY_FILE).decode("utf-8")
        finally:
            os.close(fd)
    except (FileNotFoundError, NotADirectoryError, _read.NotAFile, UnicodeDecodeError):
        return None  # vanished meanwhile, or not a directory/.key fsstore made
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None  # a symlink: never ours
        raise
    return original if _keys.matches(name, original) else None
