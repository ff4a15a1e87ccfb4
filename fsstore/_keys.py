"""Session keys: validation, and the encoding of key parts into directory names.

A name on disk is built from one key part (a project key, a session id, or a whole
subpath) like this:

* characters in ``[a-z0-9._-]`` stand for themselves, except a ``.`` at the start
  or the end of the part;
* an upper-case ASCII letter is ``^`` and its lower-case form (``User`` -> ``^user``);
* every other character is written as ``%XX`` for each byte of its UTF-8 form,
  with upper-case hex digits (``/`` -> ``%2F``, ``é`` -> ``%C3%A9``, ``^`` -> ``%5E``);
* if the result is longer than :data:`MAX_PLAIN` characters it is cut to
  :data:`KEEP_PREFIX` characters (never inside an escape) and ``~`` plus the first
  32 hex digits of the part's SHA-256 are appended; the original part is then kept
  in a ``.key`` file inside that directory.

Why this is safe:

* Injective: unescaped names decode back to exactly one part; hashed names carry a
  128-bit digest of the whole part.
* Traversal-proof: ``/`` and NUL never appear, and a name never starts with ``.``,
  so ``.``, ``..`` and every store-internal name (all begin with ``.``) are out of
  reach of any key.
* Case-insensitive filesystems: literal letters are always lower case (an upper-case
  letter is marked by ``^``, not by its case) and escape digits always upper case,
  so two different names never differ only in case.
* Unicode-normalizing filesystems: names are plain ASCII.
* NAME_MAX: a name is at most ``KEEP_PREFIX + 33`` = 113 bytes.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ._errors import FsStoreError

_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")
_HEX = frozenset("0123456789ABCDEF")
_UPPER = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_LOWER = frozenset("abcdefghijklmnopqrstuvwxyz")
MAX_PLAIN = 120
KEEP_PREFIX = 80
HASH_MARK = "~"


@dataclass(frozen=True)
class TranscriptKey:
    """A validated key. ``subpath`` is None for the main transcript."""

    project_key: str
    session_id: str
    subpath: str | None

    def as_dict(self) -> dict[str, str]:
        out = {"project_key": self.project_key, "session_id": self.session_id}
        if self.subpath is not None:
            out["subpath"] = self.subpath
        return out


def _invalid(message: str, operation: str) -> FsStoreError:
    return FsStoreError("INVALID_KEY", message, operation=operation)


def check_part(value: object, what: str, operation: str) -> str:
    """A project key or session id: a non-empty str without NUL, valid Unicode."""
    if not isinstance(value, str):
        raise _invalid(f"{what} must be a str, not {type(value).__name__}", operation)
    if not value:
        raise _invalid(f"{what} is empty", operation)
    if "\x00" in value:
        raise _invalid(f"{what} contains NUL", operation)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _invalid(f"{what} is not valid Unicode (lone surrogate)", operation) from None
    return value


def parse_key(key: object, operation: str, *, allow_subpath: bool = True) -> TranscriptKey:
    """Validate an SDK ``SessionKey`` before anything touches disk."""
    if not isinstance(key, Mapping):
        raise _invalid(f"key must be a mapping, not {type(key).__name__}", operation)
    for name in ("project_key", "session_id"):
        if name not in key:
            raise _invalid(f"key has no {name}", operation)
    project_key = check_part(key["project_key"], "project_key", operation)
    session_id = check_part(key["session_id"], "session_id", operation)
    subpath = key.get("subpath") if allow_subpath else None
    if subpath is None or subpath == "":
        return TranscriptKey(project_key, session_id, None)
    check_part(subpath, "subpath", operation)
    assert isinstance(subpath, str)
    for segment in subpath.split("/"):
        if segment in ("", ".", ".."):
            raise _invalid(
                f"subpath {subpath!r} must be relative with no empty, '.' or '..' segments",
                operation,
            )
    return TranscriptKey(project_key, session_id, subpath)


@functools.lru_cache(maxsize=4096)
def encode(part: str) -> str:
    """The directory name for one key part (see the module docstring)."""
    out: list[str] = []
    last = len(part) - 1
    for i, ch in enumerate(part):
        if ch in _PLAIN and not (ch == "." and (i == 0 or i == last)):
            out.append(ch)
        elif ch in _UPPER:
            out.append("^" + ch.lower())
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    name = "".join(out)
    if len(name) <= MAX_PLAIN:
        return name
    cut = KEEP_PREFIX
    # Do not leave half an escape at the end of the readable prefix.
    pct = name.rfind("%", cut - 2, cut)
    if pct != -1:
        cut = pct
    elif name[cut - 1] == "^":
        cut -= 1
    digest = hashlib.sha256(part.encode("utf-8")).hexdigest()[:32]
    return f"{name[:cut]}{HASH_MARK}{digest}"


def is_hashed(name: str) -> bool:
    return HASH_MARK in name


# Names that are their own key part: the common case, recognized without decoding.
_SELF = re.compile(r"[a-z0-9_-]|[a-z0-9_-][a-z0-9._-]*[a-z0-9_-]")
is_own_name = _SELF.fullmatch


def decode(name: str) -> str | None:
    """The key part an unhashed name stands for, or None if no key encodes to it."""
    if _SELF.fullmatch(name):
        return name
    if is_hashed(name):
        return None
    raw = bytearray()
    i = 0
    while i < len(name):
        ch = name[i]
        if ch == "%":
            hexpair = name[i + 1 : i + 3]
            if len(hexpair) != 2 or not set(hexpair) <= _HEX:
                return None
            raw.append(int(hexpair, 16))
            i += 3
        elif ch == "^":
            letter = name[i + 1 : i + 2]
            if letter not in _LOWER or not letter:
                return None
            raw.append(ord(letter.upper()))
            i += 2
        elif ch in _PLAIN:
            raw.append(ord(ch))
            i += 1
        else:
            return None
    try:
        part = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    # Only the canonical spelling decodes: this keeps the mapping one-to-one.
    return part if part and encode(part) == name else None


def matches(name: str, part: str) -> bool:
    """Whether ``name`` is the directory name of ``part`` (used to verify .key files)."""
    return encode(part) == name
