"""The one error type fsstore raises, and the table of its codes.

Every failure of a public operation is an :class:`FsStoreError`. Operators alert on
``code``; the SDKs only report ``str(err)`` in their mirror-error message, so the
string carries code, operation and path too.

Codes are either the POSIX name of the underlying ``errno`` (``ENOSPC``, ``EIO``,
``EACCES``, ``ESTALE``, ...) or one of the store's own codes in :data:`STORE_CODES`.

Everything is also logged to the ``fsstore`` logger (with ``code``, ``operation``,
``path`` and ``errno`` as record attributes), which has a ``NullHandler``, as the
standard library advises for libraries: an application that configured no logging
sees nothing twice, one that did gets every record (docs/operations.md, "Alerting").
"""

from __future__ import annotations

import errno as _errno
import logging
from typing import NamedTuple

log = logging.getLogger("fsstore")
log.addHandler(logging.NullHandler())


class Code(NamedTuple):
    """One of the store's own codes: what it means, and what to do about it."""

    meaning: str
    action: str


#: The store's own codes (POSIX names are used for everything the OS reports): for
#: each, what it means and what to do (README's "retry?" or "action" column, word for
#: word). tests/test_docs.py checks the codes against the source and README's tables.
STORE_CODES: dict[str, Code] = {
    # raised (FsStoreError.code)
    "INVALID_KEY": Code("a key part is empty, not a string, contains NUL, or a subpath is not relative",
                        "no"),
    "INVALID_ENTRY": Code("entries is not a list of JSON objects that json.dumps accepts and every "
                          "default reader can read back", "no"),
    "CORRUPT": Code("a committed part or segment cannot be parsed (file and line in the message)",
                    "repair (`fsstore check`)"),
    "LOCK_TIMEOUT": Code("the transcript lock was not acquired within lock_timeout_seconds", "yes"),
    "LOCK_EXPIRED": Code("the lock was held past half of stale_lock_seconds before publishing, or "
                         "given back while the call ran under it (its task cancelled); nothing was "
                         "written", "yes"),
    "UNSAFE_PATH": Code("something inside root is a symlink or not a directory where the store "
                        "expects one", "investigate"),
    "NOT_A_STORE": Code("root is not a store (no .fsstore marker): a share not mounted, or a store "
                        "never created (fsstore init, create=True); nothing was written", "mount the share"),
    "UNSUPPORTED_FS": Code("the mount cannot host a store: it has neither renameat2(RENAME_NOREPLACE) "
                           "nor hard links (link() fails), so a part cannot be committed without "
                           "replacing; nothing was committed", "no: use another mount (docs/operations.md)"),
    # logged only (the operation succeeded, or went on)
    "SUMMARY_BEHIND": Code("the session summary sidecar was not updated",
                           "none: readers fold it themselves"),
    "RELOCATED": Code("an append's number had been compacted away under it (two lock holders "
                      "overlapped, or a client cache still showed a compacted file), or was "
                      "above a hole (a stale view of the directory); the batch was committed "
                      "again above", "alert if frequent: writers are overtaking each other's "
                      "locks, or the mount caches directories (sshfs: docs/operations.md)"),
    "COMPACT_FAILED": Code("automatic compaction failed; the append itself succeeded", "`fsstore check`"),
    "TRASH_LEFT": Code("a delete left files in .trash", "none: `fsstore gc` removes them"),
    "DELETE_RACED": Code("a delete whose lock was overtaken moved a session made anew after its "
                         "mark, and moved it back or merged it into the one made since (error "
                         "level: neither, left in .trash for the operator)",
                         "warning: none, alert if frequent (stalls); error: see docs/operations.md "
                         "\"Deletes racing appends\""),
    "TEMP_LEFT": Code("an append could not remove its batch's temp file (after the commit: "
                      "a second link to the part)",
                      "none: `fsstore gc` removes it"),
    "GAP": Code("load() returned a transcript with a sequence gap", "`fsstore check`"),
    "DIR_FSYNC_UNSUPPORTED": Code("the mount refuses directory fsync",
                                  "know that power-loss safety is per file"),
    "LOCK_RECLAIMED": Code("a stale lock was reclaimed", "alert if frequent"),
    "LOCK_RELEASE_FAILED": Code("a lock could not be released after the work under it was done",
                                "check the mount"),
    # the command line (cat --json, export)
    "NOT_FOUND": Code("no such transcript, session or project", "—"),
    "USAGE": Code("the command line is wrong (an unknown option, a bad value, a missing "
                  "argument): exit 2, nothing was done", "no: fix the command"),
}


class FsStoreError(Exception):
    """A failed fsstore operation.

    Attributes: ``code`` (stable string), ``errno`` (int or None), ``operation``
    (``append``, ``load``, ``list_sessions``, ``delete``, ``lock``, ...), ``path``
    (the file or directory involved, or None). The original exception, if any, is
    ``__cause__``.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        operation: str,
        path: str | None = None,
        errno: int | None = None,
    ) -> None:
        self.code = code
        self.message = message
        self.operation = operation
        self.path = path
        self.errno = errno
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f" at {self.path}" if self.path else ""
        return f"fsstore {self.code} during {self.operation}{where}: {self.message}"

    def __reduce__(self) -> tuple[object, ...]:
        # Keeps the error picklable across process pools with all its attributes.
        return (
            _rebuild,
            (self.code, self.message, self.operation, self.path, self.errno),
        )


def _rebuild(
    code: str, message: str, operation: str, path: str | None, err: int | None
) -> FsStoreError:
    return FsStoreError(code, message, operation=operation, path=path, errno=err)


def posix_code(err: int | None) -> str:
    """The POSIX name of an errno, the code an OSError gets (``EIO`` where it has none)."""
    return _errno.errorcode.get(err or 0, "EIO")


def from_oserror(exc: OSError, operation: str, path: str | None) -> FsStoreError:
    """Wrap an OSError, keeping its POSIX name as the code."""
    num = exc.errno
    code = posix_code(num)
    where = exc.filename if isinstance(exc.filename, str) and exc.filename.startswith("/") else path
    err = FsStoreError(code, exc.strerror or str(exc), operation=operation, path=where, errno=num)
    err.__cause__ = exc
    return err


class translating:  # lower case: used like the function it replaced, `with translating(op, path):`
    """Turn any OSError raised inside into an FsStoreError and log it once.

    FsStoreErrors raised inside pass through (they already carry their operation, and
    their path unless it was not known there: then the call's); they are logged here
    because this is the public boundary.
    (A class, not a generator context manager: every public call goes through it.)
    """

    __slots__ = ("operation", "path")

    def __init__(self, operation: str, path: str | None) -> None:
        self.operation = operation
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, FsStoreError):
            if exc.path is None:  # raised where the path was not known (a part's name)
                exc.path = self.path
                exc.args = (str(exc),)
            _log(exc)
        elif isinstance(exc, OSError):
            wrapped = from_oserror(exc, self.operation, self.path)
            _log(wrapped)
            raise wrapped from exc


def _log(err: FsStoreError) -> None:
    log.warning(
        "%s",
        err,
        extra={"code": err.code, "operation": err.operation, "path": err.path, "errno": err.errno},
    )
