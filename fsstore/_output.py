"""What the command line prints: aligned tables and JSON, names made safe for a
terminal, and a progress counter (:mod:`fsstore.cli` decides what; this, how)."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO


def _raw(c: str) -> bytes:
    """The bytes a character stands for on the command line: a lone surrogate from
    os.fsdecode is the byte it escapes (the shell passes that byte back)."""
    try:
        return c.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that escapes no byte
        return c.encode("utf-8", "surrogatepass")


def shown(key: str) -> str:
    """A key as the tables print it: as it is when the shell would pass it back unchanged."""
    if key.isprintable():
        return shlex.quote(key)
    body = "".join(
        c if c.isprintable() and c not in "'\\" else
        ("\\'" if c == "'" else "\\\\" if c == "\\" else
         "".join(f"\\x{b:02x}" for b in _raw(c)))
        for c in key
    )
    return f"$'{body}'"


def size_text(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def when_text(ns: int | None) -> str:
    if ns is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def age_or_dash(seconds: float | None) -> str:
    return "-" if seconds is None else age_text(max(seconds, 0.0))


def rel_path(root: str, path: str) -> str:
    """``path`` relative to ``root`` where it is inside it, for a person (:func:`clean`)."""
    try:
        rel = os.path.relpath(path, root)
    except ValueError:
        return clean(path)
    return clean(path if rel.startswith("..") else rel)


def clean(text: str) -> str:
    """``text`` safe for a terminal: every character that is not printable (control
    characters, so escape sequences; the lone surrogates of names that are not UTF-8)
    as a backslash escape. File names, lock records and local file names are written
    by whoever can write to the store or the directory: they never reach the
    terminal raw. Everything printed for a person goes through here or :func:`shown`."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def table(
    out: TextIO, headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> None:
    """Print aligned columns; column indexes in ``right`` are right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = []
        for i, cell in enumerate(cells):
            last = i == len(cells) - 1
            if i in right:
                parts.append(cell.rjust(widths[i]))
            else:
                parts.append(cell if last else cell.ljust(widths[i]))
        return "  ".join(parts).rstrip()

    out.write(line(headers) + "\n")
    for row in rows:
        out.write(line(row) + "\n")


def dump_json(out: TextIO, doc: Any) -> None:
    # ASCII: a name that is not UTF-8 (a lone surrogate from os.fsdecode) is written as
    # a \udcXX escape, which any JSON reader accepts, whatever the output encoding.
    json.dump(doc, out, indent=2, ensure_ascii=True)
    out.write("\n")


class Progress:
    """A ``\\r`` progress counter on a terminal; silent when the stream is not a TTY."""

    def __init__(self, label: str, stream: TextIO, *, interval: float = 0.1) -> None:
        self.label = label
        self.stream = stream
        self.interval = interval
        try:
            self.enabled = stream.isatty()
        except (AttributeError, ValueError):
            self.enabled = False
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        width = 24
        filled = width * done // total if total else width
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total}")
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False


def iso(ts: float | None) -> str | None:
    """A time as ``2026-01-01T10:00:00Z`` (None stays None)."""
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def iso_ns(ns: int | None) -> str | None:
    return None if ns is None else iso(ns / 1e9)


def age_text(seconds: float) -> str:
    """An age for a person: ``4.2s``, ``42s``, ``5m07s``, ``3h00m``, ``40d01h``."""
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def say(err: TextIO | None, text: str) -> None:
    """Write to stderr, which may itself not be writable (a full disk) or be closed."""
    if err is None:
        return
    try:
        err.write(text)
        err.flush()
    except OSError:
        quiet(sys.stderr)


def quiet(stream: TextIO | None) -> None:
    """Keep Python from complaining (exit 120) when it flushes, at exit, a standard
    stream that cannot be written."""
    if stream is None:
        return
    try:
        fileno = stream.fileno()
    except (OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fileno)
    os.close(devnull)
