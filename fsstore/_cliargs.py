"""The command line's grammar: exit codes, argument types, the parser and its usage
errors, and how values that start with ``-`` are told from options (:func:`mark_values`).
The commands themselves are in :mod:`fsstore.cli`."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ._output import say

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2

# argv can never contain NUL, so a NUL prefix marks "this is a value" unambiguously.
_MARK = "\x00"
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


# -- argument types ----------------------------------------------------------------


def _text(value: str) -> str:
    """A positional or option value, with the value mark (if any) taken off."""
    return value[1:] if value.startswith(_MARK) else value


def _key_part(value: str) -> str:
    value = _text(value)
    if not value:
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def parse_duration(value: str) -> float:
    """Seconds in ``30d``, ``1h30m``, ``90m``, ``45s``, ``2w``.

    Every number needs its unit: ``--older-than 30`` meant to be days deleted every
    session as 30 seconds, so a bare number is a usage error.
    """
    text = _text(value).strip().lower()
    pos = 0
    total = 0.0
    for match in _DURATION.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if not text or pos != len(text):
        raise argparse.ArgumentTypeError(
            f"invalid duration {_text(value)!r}: every number needs a unit "
            "(s, m, h, d, w; e.g. 45s, 90m, 1h30m, 30d, 2w)"
        )
    return total


def parse_lease(value: str) -> float:
    """:func:`parse_duration`, more than zero (``--stale-lock-seconds``: a store's lease)."""
    seconds = parse_duration(value)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"invalid age {_text(value)!r}: must be more than 0s")
    return seconds


# -- the parser --------------------------------------------------------------------


class UsageError(SystemExit):
    """A command line argparse refused (exit 2), its message and command."""

    def __init__(self, message: str, command: str | None) -> None:
        super().__init__(EXIT_USAGE)
        self.message, self.command = message, command


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        message = message.replace(_MARK, "")
        self.print_usage(sys.stderr)
        say(sys.stderr, f"{self.prog}: error: {message}\n")  # (stderr may be full)
        raise UsageError(message, self.prog.partition(" ")[2] or None)


class _Options:
    """The option strings of each subcommand, and whether each takes a value."""

    def __init__(self) -> None:
        self.by_command: dict[str, dict[str, bool]] = {}

    def add(self, command: str, parser: argparse.ArgumentParser, *names: str, **kw: Any) -> None:
        parser.add_argument(*names, **kw)
        takes_value = kw.get("action") not in ("store_true", "store_false", "count")
        table = self.by_command.setdefault(command, {"-h": False, "--help": False})
        for name in names:
            table[name] = takes_value


_EPILOG = """\
exit codes: 0 ok, 1 problems found (or the operation failed), 2 usage error.
Claude project keys start with '-' (e.g. -home-user-repo); pass them as they are.
"""


def build_parser() -> tuple[argparse.ArgumentParser, _Options]:
    opts = _Options()
    parser = _Parser(
        prog="fsstore",
        description="Inspect and maintain an fsstore session store.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False,
                           epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        opts.add(name, p, "--json", action="store_true", help="print JSON for scripts")
        opts.add(name, p, "-v", "--verbose", action="count", default=0,
                 help="show the fsstore logger's messages on stderr (-vv: debug)")
        p.add_argument("root", metavar="ROOT", type=_text, help="the store root directory")
        return p

    command("init", "Create a store at ROOT (its parent must exist): writes ROOT/.fsstore.")

    p = command("ls", "List sessions: last-modified time, parts, bytes, subagent transcripts.")
    opts.add("ls", p, "--project", metavar="P", type=_key_part, help="only this project key")

    p = command("cat", "Print a transcript as JSONL, exactly the entries load() returns.")
    p.add_argument("project", metavar="PROJECT", type=_key_part)
    p.add_argument("session", metavar="SESSION", type=_key_part)
    opts.add("cat", p, "--subpath", metavar="S", type=_key_part,
             help="a subagent transcript (e.g. subagents/agent-1) instead of the main one")

    p = command("check", "Verify every transcript; exit 1 if anything is wrong.")
    opts.add("check", p, "--older-than", metavar="AGE", type=parse_duration, default=3600.0,
             help="temp files and .trash entries older than this are orphaned, and --repair "
             "commits again only misplaced batches older than this (default 1h)")
    opts.add("check", p, "--stale-lock-seconds", metavar="AGE", type=parse_lease, default=30.0,
             help="the stores' stale_lock_seconds: locks older than this are stale (default 30s)")
    opts.add("check", p, "--repair", action="store_true",
             help="then commit misplaced batches again, write over parts a power loss left empty "
             "or torn (their batches named lost) and close gaps (nothing readable that is "
             "there is lost; what was lost before is named), and check again")
    opts.add("check", p, "--dry-run", action="store_true", help="with --repair: show the repairs only")

    p = command("migrate", "Bring a store written by format 1 to format 2 (safe while writers run).")
    opts.add("migrate", p, "--dry-run", action="store_true", help="show what would be done")
    opts.add("migrate", p, "--older-than", metavar="AGE", type=parse_duration, default=3600.0,
             help="commit again only misplaced batches older than this: a younger one may be "
             "a live writer's, about to commit it again itself (default 1h)")
    opts.add("migrate", p, "--stale-lock-seconds", metavar="AGE", type=parse_lease, default=30.0,
             help="the stores' stale_lock_seconds (default 30s)")

    p = command("gc", "Remove orphaned temp files and .trash leftovers; break stale locks.")
    opts.add("gc", p, "--older-than", metavar="AGE", type=parse_duration, default=3600.0,
             help="only touch what is older than this (default 1h)")
    opts.add("gc", p, "--dry-run", action="store_true", help="show what would be done; change nothing")

    p = command("compact", "Merge each transcript's files into one segment.")
    opts.add("compact", p, "--project", metavar="P", type=_key_part, help="only this project key")
    opts.add("compact", p, "--session", metavar="S", type=_key_part, help="only this session id")
    opts.add("compact", p, "--dry-run", action="store_true", help="show what would be compacted")
    opts.add("compact", p, "--stale-lock-seconds", metavar="AGE", type=parse_lease, default=30.0,
             help="the stores' stale_lock_seconds (default 30s)")

    p = command("prune", "Delete sessions not modified for a while (retention).")
    opts.add("prune", p, "--older-than", metavar="AGE", type=parse_duration, required=True,
             help="delete sessions whose newest transcript file is older than this (e.g. 30d)")
    opts.add("prune", p, "--project", metavar="P", type=_key_part, help="only this project key")
    opts.add("prune", p, "--dry-run", action="store_true", help="show what would be deleted")
    opts.add("prune", p, "--stale-lock-seconds", metavar="AGE", type=parse_lease, default=30.0,
             help="the stores' stale_lock_seconds (default 30s)")

    p = command("locks", "Show who holds which transcript lock, since when.")
    opts.add("locks", p, "--stale-lock-seconds", metavar="AGE", type=parse_lease, default=30.0,
             help="the stores' stale_lock_seconds: locks older than this are stale (default 30s)")

    p = command("import", "Import local ~/.claude/projects transcripts into the store.")
    p.add_argument("projects_dir", metavar="PROJECTS_DIR", type=_text,
                   help="a projects directory laid out like ~/.claude/projects")
    opts.add("import", p, "--project", metavar="P", type=_key_part, help="only this project")
    opts.add("import", p, "--dry-run", action="store_true", help="show what would be imported")
    opts.add("import", p, "--create", action="store_true",
             help="ROOT may not exist yet: start a new store there (without it, a missing "
             "ROOT is an error, so a mistyped path does not become an empty store)")

    p = command("export", "Write a session back to the local ~/.claude/projects layout.")
    p.add_argument("project", metavar="PROJECT", type=_key_part)
    p.add_argument("session", metavar="SESSION", type=_key_part)
    p.add_argument("dest", metavar="DIR", type=_text,
                   help="a projects directory (e.g. ~/.claude/projects); writes DIR/PROJECT/...")
    opts.add("export", p, "--force", action="store_true",
             help="overwrite local files that diverged from the store")
    opts.add("export", p, "--dry-run", action="store_true", help="show what would be written")
    return parser, opts


def mark_values(argv: Sequence[str], opts: _Options) -> list[str]:
    """Mark every argument that starts with ``-`` but is not an option as a value.

    Arguments before the subcommand and after ``--`` are left to argparse.
    """
    args = list(argv)
    out: list[str] = []
    i = 0
    while i < len(args) and args[i].startswith("-"):
        out.append(args[i])
        i += 1
    if i == len(args):
        return out
    command = args[i]
    out.append(command)
    i += 1
    table = opts.by_command.get(command)
    if table is None:
        return out + args[i:]
    expect_value = False
    while i < len(args):
        arg = args[i]
        i += 1
        if expect_value:
            out.append(_MARK + arg if arg.startswith("-") else arg)
            expect_value = False
        elif arg == "--":
            out.append(arg)  # argparse takes everything after it as positional
            out.extend(args[i:])
            break
        elif arg.startswith("-") and arg != "-":
            name = arg.split("=", 1)[0] if arg.startswith("--") else arg
            if name in table:
                out.append(arg)
                expect_value = table[name] and "=" not in arg
            elif re.fullmatch(r"-v+", arg):
                out.append(arg)
            else:
                # Even "--something": session ids are arbitrary strings. A mistyped
                # option still fails, as a surplus or misplaced positional.
                out.append(_MARK + arg)
        else:
            out.append(arg)
    return out


# -- output helpers ----------------------------------------------------------------


#: The distribution's name ("fsstore" on the package index is another project).
DISTRIBUTION = "fsstore-sessions"


class _VersionAction(argparse.Action):
    """``--version``: the package metadata is read only when asked for (reading it
    imports ``email`` and stats every installed distribution: ~210 file lookups at
    every start of every command before)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(f"{parser.prog} {_version()}")
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    # "fsstore": a checkout installed before the distribution was renamed.
    for name in (DISTRIBUTION, "fsstore"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"  # not installed as a distribution (a checkout on PYTHONPATH)
