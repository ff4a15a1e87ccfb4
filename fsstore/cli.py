"""The ``fsstore`` command line (also ``python -m fsstore``).

What each command does and prints (its arguments: :mod:`fsstore._cliargs`; the printing itself: :mod:`fsstore._output`); the work is done by :mod:`fsstore._check`
(ls, check), :mod:`fsstore._cleanup` (gc, prune, compact), :mod:`fsstore._lockfiles`
(locks), :mod:`fsstore._transfer` (import, export), :mod:`fsstore._migrate` (init,
migrate, check --repair) and :class:`fsstore._store.SyncStore` (cat). Every command
prints a human-readable table by default and JSON with ``--json``; commands that walk
a whole store draw a progress counter on stderr when stderr is a terminal.

Exit codes: 0 ok; 1 problems found, or the operation failed (anything reported as
FAILED); 2 usage error (bad arguments, an invalid key, ROOT is not a directory or
not a store, or, for ``import`` without ``--create``, does not exist). Interrupted
(also while starting: see :mod:`fsstore.__main__`): 130; stdout closed early
(``| head``): 141.

Claude's project keys start with ``-`` (``-home-user-repo``). argparse alone would
read such an argument as an option, so before parsing, every argument of a
subcommand that starts with ``-`` but is not one of that subcommand's options is
marked as a value (see :func:`fsstore._cliargs.mark_values`): keys are accepted exactly as
``fsstore ls`` prints them, positionally or as option values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO, final

from . import _check, _cleanup, _lockfiles, _migrate, _transfer
from ._cliargs import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, UsageError, build_parser, mark_values
from ._errors import FsStoreError, posix_code
from ._keys import check_part
from ._output import (
    Progress,
    age_or_dash,
    clean,
    dump_json,
    quiet,
    rel_path,
    say,
    shown,
    size_text,
    table,
    when_text,
)
from ._store import SyncStore
from ._walk import NoStore, NotFound, Problem, is_store, require_store

# -- commands ----------------------------------------------------------------------

Handler = Callable[[argparse.Namespace, TextIO, TextIO, Progress], int]


def cmd_ls(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress) -> int:
    sessions, problems = _check.ls(args.root, project=args.project, progress=progress)
    progress.close()
    # Exit 1 only when the listing itself is incomplete; damage is check's business.
    errors = [p for p in problems if p.kind in ("unreadable", "symlink")]
    if args.json:
        dump_json(out, {"root": args.root, "sessions": [s.as_dict() for s in sessions],
                    "problems": [p.as_dict() for p in problems]})
    else:
        rows = [
            [shown(s.ref.project_key), shown(s.ref.session_id), when_text(s.mtime_ns),
             str(s.parts + s.segments), size_text(s.bytes), str(s.subagents)]
            for s in sessions
        ]
        table(out, ["PROJECT", "SESSION", "MODIFIED", "PARTS", "BYTES", "SUBAGENTS"], rows,
              right=(3, 4, 5))
        projects = len({s.ref.project_key for s in sessions})
        total = sum(s.bytes for s in sessions)
        out.write(f"{projects} project(s), {len(sessions)} session(s), {size_text(total)}\n")
    _problems(args, err, problems)
    if problems:
        err.write("fsstore: run `fsstore check` for the details\n")
    return EXIT_PROBLEMS if errors else EXIT_OK


def _problems(args: argparse.Namespace, err: TextIO, problems: Sequence[Problem]) -> None:
    """What a command could not look at, on stderr (also with --json: stdout has it too)."""
    err.writelines(f"fsstore: {p.severity}: {p.code + ': ' if p.code else ''}{rel_path(args.root, p.path)}: "
                   f"{clean(p.message)}\n" for p in problems)


def cmd_cat(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress) -> int:
    require_store(args.root)
    store = SyncStore(args.root, summaries=False)
    key = {"project_key": args.project, "session_id": args.session}
    if args.subpath:
        key["subpath"] = args.subpath
    with _Noting("GAP") as gaps:
        entries = store.load(key)
    if entries is None:
        what = f"subpath {args.subpath!r} of " if args.subpath else ""
        raise NotFound(f"no transcript: {what}session {args.session!r} in project {args.project!r}")
    if args.json:
        json.dump(entries, out, separators=(",", ":"))
        out.write("\n")
    else:
        for entry in entries:
            out.write(json.dumps(entry, separators=(",", ":")))
            out.write("\n")
    # A transcript with a piece missing is printed (it is what load() returns), but
    # a prefix must not pass for the whole.
    err.writelines(f"fsstore: warning: the transcript is incomplete: {clean(r.getMessage())}\n"
                   for r in gaps.records)
    return EXIT_PROBLEMS if gaps.records else EXIT_OK


@final
class _Noting(logging.Handler):
    """The ``fsstore`` logger's records with one code, kept while in the ``with``."""

    def __init__(self, code: str) -> None:
        super().__init__(logging.WARNING)
        self.code = code
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "code", None) == self.code:
            self.records.append(record)

    def __enter__(self) -> _Noting:
        logging.getLogger("fsstore").addHandler(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        logging.getLogger("fsstore").removeHandler(self)


def cmd_check(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress) -> int:
    repairs: list[_cleanup.Action] = []
    if args.repair:
        repairs = _migrate.repair(args.root, dry_run=args.dry_run, older_than=args.older_than,
                                  stale_lock_seconds=args.stale_lock_seconds)
        if not args.json:
            out.writelines(f"{'FAILED' if a.failed else 'REPAIR' if a.done else 'SKIP' if a.action == 'skip' else 'WOULD':<8} "
                          f"{rel_path(args.root, a.path)}  {_detail(a)}\n" for a in repairs)
    report = _check.check(args.root, older_than=args.older_than,
                          stale_lock_seconds=args.stale_lock_seconds, progress=progress)
    progress.close()
    if args.json:
        dump_json(out, {"root": args.root, **report.as_dict(),
                    **({"repairs": [a.as_dict() for a in repairs]} if args.repair else {})})
    else:
        for p in report.problems:
            where = rel_path(args.root, p.path) + (f":{p.line}" if p.line else "")
            code = f"{p.code} " if p.code and p.code not in p.message else ""
            out.write(f"{p.severity.upper():<8} {where}  {code}{clean(p.message)}\n")
        verdict = "ok" if report.ok else (
            f"{report.errors} error(s), {report.warnings} warning(s)")
        out.write(f"checked {report.sessions} session(s), {report.transcripts} transcript(s), "
                  f"{report.entries} entries, {size_text(report.bytes)}: {verdict}\n")
    return EXIT_OK if report.ok and not any(a.failed for a in repairs) else EXIT_PROBLEMS


_DONE_VERB = {"mark": "marked", "recommit": "committed again", "remove": "removed", "close-gap": "closed a gap",
             "repair": "repair", "remove-temp": "removed", "remove-trash": "removed",
             "remove-fuse-hidden": "removed",
              "remove-lock-recovery": "removed", "remove-lock-record": "removed", "remove-tomb": "removed",
              "break-lock": "broke lock", "delete": "deleted",
              "compact": "compacted", "merge": "merged", "restore": "moved back", "keep": "kept", "skip": "skipped"}
_DRY_VERB = {"mark": "would mark", "recommit": "would commit again", "remove": "would remove",
             "close-gap": "would close a gap", "repair": "repair",
             "remove-temp": "would remove", "remove-trash": "would remove",
             "remove-fuse-hidden": "would remove",
             "remove-lock-recovery": "would remove", "remove-lock-record": "would remove",
             "remove-tomb": "would remove",
             "break-lock": "would break lock",
             "delete": "would delete", "compact": "would compact", "merge": "would merge",
             "restore": "would move back", "keep": "kept",
             "skip": "skipped"}


def _detail(a: _cleanup.Action) -> str:
    """An action's detail as printed: a failure's code first, where it has one."""
    return f"{a.code}: {clean(a.detail)}" if a.failed and a.code else clean(a.detail)


def _actions(
    args: argparse.Namespace, out: TextIO, actions: list[_cleanup.Action], what: str,
    extra: dict[str, Any] | None = None,
) -> int:
    dry = bool(getattr(args, "dry_run", False))
    failed = [a for a in actions if a.failed]
    if args.json:
        doc: dict[str, Any] = {"root": args.root, "dry_run": dry, **(extra or {}),
                               "actions": [a.as_dict() for a in actions],
                               "failed": len(failed)}
        dump_json(out, doc)
    else:
        for a in actions:
            if a.failed:
                verb = "FAILED"
            elif a.done or dry:
                verb = (_DRY_VERB if dry else _DONE_VERB)[a.action]
            else:
                verb = {"keep": "kept", "skip": "skipped"}.get(a.action, "nothing")
            out.write(f"{verb:<17} {rel_path(args.root, a.path)}  {_detail(a)}\n")
        done = sum(1 for a in actions if a.done)
        summary = (f"{what}: {len(actions)} action(s) in a dry run; nothing changed" if dry
                   else f"{what}: {done} done, {len(failed)} failed")
        out.write(summary + "\n")
    return EXIT_PROBLEMS if failed else EXIT_OK


def cmd_init(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress) -> int:
    if os.path.lexists(args.root) and not os.path.isdir(args.root):
        require_store(args.root)  # a file, a dangling symlink: says why (exit 2)
    existed = is_store(args.root) if os.path.isdir(args.root) else False
    _migrate.init(args.root)
    if args.json:
        dump_json(out, {"root": args.root, "created": not existed})
    else:
        out.write(f"{clean(args.root)}: {'a store already' if existed else 'store created'}\n")
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress) -> int:
    actions = _migrate.migrate(args.root, dry_run=args.dry_run, older_than=args.older_than,
                               stale_lock_seconds=args.stale_lock_seconds, progress=progress)
    progress.close()
    return _actions(args, out, actions, "migrate")


def cmd_gc(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress) -> int:
    actions = _cleanup.gc(args.root, older_than=args.older_than, dry_run=args.dry_run,
                          progress=progress)
    progress.close()
    return _actions(args, out, actions, "gc", {"older_than_seconds": args.older_than})


def cmd_compact(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress) -> int:
    actions = _cleanup.compact(args.root, project=args.project, session=args.session,
                               dry_run=args.dry_run, stale_lock_seconds=args.stale_lock_seconds,
                               progress=progress)
    progress.close()
    return _actions(args, out, actions, "compact")


def cmd_prune(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress) -> int:
    actions, examined = _cleanup.prune(args.root, older_than=args.older_than,
                                       project=args.project, dry_run=args.dry_run,
                                       stale_lock_seconds=args.stale_lock_seconds,
                                       progress=progress)
    progress.close()
    return _actions(args, out, actions, f"prune ({examined} session(s) examined)",
                    {"older_than_seconds": args.older_than, "sessions_examined": examined})


def cmd_locks(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress) -> int:
    found, problems = _lockfiles.locks(args.root, stale_lock_seconds=args.stale_lock_seconds,
                                       progress=progress)
    progress.close()
    stale = [lk for lk in found if lk.stale]
    if args.json:
        dump_json(out, {"root": args.root, "locks": [lk.as_dict() for lk in found],
                    "stale": len(stale), "problems": [p.as_dict() for p in problems]})
    else:
        rows = []
        for lk in found:
            if lk.key is None:
                label = "(unknown: deleted, or not written yet)"
            else:
                label = " ".join(shown(v) for v in lk.key.values())
            since = when_text(int(lk.mtime * 1e9))
            rows.append([label, "-" if lk.pid is None else str(lk.pid), clean(lk.host or "-"),
                         since, age_or_dash(lk.age), lk.status + (" (this host)" if lk.local else "")])
        table(out, ["TRANSCRIPT", "PID", "HOST", "SINCE", "AGE", "STATUS"], rows, right=(1, 4))
        incomplete = (f"; incomplete: {len(problems)} place(s) could not be read"
                      if problems else "")
        out.write(f"{len(found)} lock(s), {len(stale)} stale{incomplete}\n")
    _problems(args, err, problems)
    return EXIT_PROBLEMS if stale or problems else EXIT_OK


def cmd_import(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress) -> int:
    transfers, problems = _transfer.import_projects(
        args.root, args.projects_dir, project=args.project, dry_run=args.dry_run,
        create=args.create, progress=progress)
    progress.close()
    return _transfers(args, out, err, transfers, problems, "import")


def cmd_export(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress) -> int:
    transfers = _transfer.export_session(args.root, args.project, args.session, args.dest,
                                         force=args.force, dry_run=args.dry_run)
    return _transfers(args, out, err, transfers, [], "export")


def _transfers(
    args: argparse.Namespace, out: TextIO, err: TextIO, transfers: list[_transfer.Transfer],
    problems: list[Problem], what: str,
) -> int:
    failed = [t for t in transfers if t.failed] + [p for p in problems if p.severity == "error"]
    if args.json:
        dump_json(out, {"root": args.root, "dry_run": args.dry_run,
                    "files": [t.as_dict() for t in transfers],
                    "problems": [p.as_dict() for p in problems], "failed": len(failed)})
    else:
        for t in transfers:
            if t.key is None:
                key = "-"
            else:
                key = " ".join(shown(v) for v in t.key.values())
            added = f"+{t.added}" if t.added else ""
            note = f"  ({clean(t.detail)})" if t.detail else ""
            out.write(f"{t.status:<12} {added:>6}  {clean(t.path)}  [{key}]{note}\n")
        err.writelines(f"fsstore: {p.severity}: {clean(p.path)}: {clean(p.message)}\n"
                       for p in problems)
        total = sum(t.added for t in transfers)
        counts: dict[str, int] = {}
        for t in transfers:
            counts[t.status] = counts.get(t.status, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "nothing found"
        dry = " (dry run: nothing written)" if args.dry_run else ""
        out.write(f"{what}: {len(transfers)} file(s): {summary}; {total} entries{dry}\n")
    return EXIT_PROBLEMS if failed else EXIT_OK


HANDLERS: dict[str, Handler] = {
    "ls": cmd_ls, "cat": cmd_cat, "check": cmd_check, "gc": cmd_gc, "compact": cmd_compact,
    "migrate": cmd_migrate, "init": cmd_init,
    "prune": cmd_prune, "locks": cmd_locks, "import": cmd_import, "export": cmd_export,
}


def _logging(verbose: int, err: TextIO) -> None:
    log = logging.getLogger("fsstore")
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
    if verbose <= 0:
        # Failures reach the user through the command's own output; without a
        # handler, Python's last-resort handler would print them a second time.
        log.addHandler(logging.NullHandler())
        return
    handler = logging.StreamHandler(err)
    handler.setFormatter(_CleanFormatter("fsstore: log %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)


class _CleanFormatter(logging.Formatter):
    """Log lines name files in the store: escaped like everything else (:func:`clean`)."""

    def format(self, record: logging.LogRecord) -> str:
        return clean(super().format(record))


def _check_keys(args: argparse.Namespace) -> None:
    """INVALID_KEY (exit 2) for a project or session that is no key (e.g. not UTF-8:
    a lone surrogate from os.fsdecode), before anything is walked or encoded."""
    for name, what in (("project", "project_key"), ("session", "session_id")):
        value = getattr(args, name, None)
        if value is not None:
            check_part(value, what, args.command)


def _tolerant_output() -> None:
    """Names on disk need not be UTF-8 (os.fsdecode makes lone surrogates of their
    bytes): print those as backslash escapes rather than fail with UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    try:
        return _run(argv)
    except KeyboardInterrupt:  # before the command started (parsing, setting up)
        sys.stderr.write("fsstore: interrupted\n")
        return 130


def _run(argv: Sequence[str] | None) -> int:
    _tolerant_output()
    parser, opts = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    marked = mark_values(raw, opts)
    try:
        args = parser.parse_args(marked)
    except UsageError as exc:
        # A script that asked for JSON gets its error as JSON too (code USAGE); an
        # option's value (marked) or an operand after "--" is not asking.
        options = marked[: marked.index("--") if "--" in marked else None]
        if "--json" in options and sys.stdout is not None:
            command = exc.command or next((a for a in options if a in opts.by_command), None)
            with contextlib.suppress(OSError):
                dump_json(sys.stdout, {"error": {"code": "USAGE", "message": exc.message,
                                                 "operation": command, "path": None}})
                sys.stdout.flush()
        raise
    # Started with fd 1 or 2 closed (`>&-`): the command runs, what it would print there
    # goes nowhere, and a command that succeeded says its output was lost (EBADF).
    closed = sys.stdout is None
    out = sys.stdout if sys.stdout is not None else open(os.devnull, "w")  # noqa: SIM115
    err = sys.stderr if sys.stderr is not None else open(os.devnull, "w")  # noqa: SIM115
    _logging(args.verbose, err)
    progress = Progress(f"fsstore {args.command}", err)
    try:
        _check_keys(args)
        status = HANDLERS[args.command](args, out, err, progress)
        out.flush()  # here, not at exit: a stdout that cannot be written is an error with its code
        if closed:
            say(err, "fsstore: error: EBADF: standard output is closed: what the command printed is lost\n")
            return EXIT_PROBLEMS
        return status
    except NoStore as exc:
        return _failed(args, progress, out, err, exc.code, str(exc), EXIT_USAGE)
    except NotFound as exc:
        return _failed(args, progress, out, err, code="NOT_FOUND", message=str(exc), status=EXIT_PROBLEMS)
    except FsStoreError as exc:
        return _failed(args, progress, out, err, exc.code, exc.message,
                       EXIT_USAGE if exc.code == "INVALID_KEY" else EXIT_PROBLEMS, exc)
    except KeyboardInterrupt:
        progress.close()
        err.write("fsstore: interrupted\n")
        return 130
    except BrokenPipeError:
        quiet(sys.stdout)  # the reader went away (| head): say nothing more
        return 141
    except OSError as exc:
        return _failed(args, progress, out, err, posix_code(exc.errno), str(exc), EXIT_PROBLEMS)


def _failed(args: argparse.Namespace, progress: Progress, out: TextIO, err: TextIO, code: str,
            message: str, status: int, exc: FsStoreError | None = None) -> int:
    """A command that could not do its job: its code and why on stderr (and, with
    ``--json``, as ``{"error": {...}}`` on stdout), every way it can fail alike:
    operators alert on the code."""
    progress.close()
    say(err, f"{clean(str(exc))}\n" if exc is not None else f"fsstore: error: {code}: {clean(message)}\n")
    try:
        if getattr(args, "json", False):
            dump_json(out, {"error": {"code": code, "message": message,
                                      "operation": exc.operation if exc else args.command,
                                      "path": exc.path if exc else None}})
        out.flush()
    except OSError:  # stdout itself is what failed (a full disk, a reader gone): said above
        quiet(sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
