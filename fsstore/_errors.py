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

log = logging.getLogger("fsstore")
log.addHandler(logging.NullHandler())

#: The store's own codes (POSIX names are used for everything the OS reports), each
#: listed in README's tables (tests/test_docs.py checks both against the source).
STORE_CODES: dict[str, str] = {
    # raised (FsStoreError.code)
    "INVALID_KEY": "a key part is empty, not a string, contains NUL, or a subpath is not relative",
    "INVALID_ENTRY": "entries is not a list of JSON objects that json.dumps accepts and every "
    "default reader can read back",
    "CORRUPT": "a committed part or segment cannot be parsed (file and line in the message)",
    "LOCK_TIMEOUT": "the transcript lock was not acquired within lock_timeout_seconds",
    "LOCK_EXPIRED": "the lock was held past half of stale_lock_seconds before publishing; "
    "nothing was written (retryable)",
    "UNSAFE_PATH": "something inside root is a symlink or not a directory where the store expects one",
    "NOT_A_STORE": "root is not a store (no .fsstore marker): a share not mounted, or a store "
    "never created (fsstore init, create=True); nothing was written",
    "UNSUPPORTED_FS": "the mount cannot host a store: it has neither renameat2(RENAME_NOREPLACE) "
    "nor hard links (link() fails), so a part cannot be committed without replacing; nothing "
    "was committed",
    # logged only (the operation succeeded, or went on)
    "SUMMARY_BEHIND": "the session summary sidecar was not updated; readers fold it themselves",
    "RELOCATED": "an append's number had been compacted away under it (two lock holders "
    "overlapped); the batch was committed again above",
    "COMPACT_FAILED": "automatic compaction failed; the append itself succeeded",
    "TRASH_LEFT": "a delete left files in .trash",
    "DELETE_RACED": "a delete whose lock was overtaken moved a session made anew after its "
    "mark, and moved it back or merged it into the one made since (error level: neither, "
    "left in .trash for the operator)",
    "TEMP_LEFT": "a commit could not remove the temp name of the committed part",
    "GAP": "load() returned a transcript with a sequence gap",
    "DIR_FSYNC_UNSUPPORTED": "the mount refuses directory fsync",
    "LOCK_RECLAIMED": "a stale lock was reclaimed",
    "LOCK_RELEASE_FAILED": "a lock could not be released after the work under it was done",
    # the command line (cat --json, export)
    "NOT_FOUND": "no such transcript or session",
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


def from_oserror(exc: OSError, operation: str, path: str | None) -> FsStoreError:
    """Wrap an OSError, keeping its POSIX name as the code."""
    num = exc.errno
    code = _errno.errorcode.get(num, "EIO") if num is not None else "EIO"
    where = exc.filename if isinstance(exc.filename, str) and exc.filename.startswith("/") else path
    err = FsStoreError(code, exc.strerror or str(exc), operation=operation, path=where, errno=num)
    err.__cause__ = exc
    return err


class translating:  # lower case: used like the function it replaced, `with translating(op, path):`
    """Turn any OSError raised inside into an FsStoreError and log it once.

    FsStoreErrors raised inside pass through unchanged (they already carry their
    operation and path); they are logged here because this is the public boundary.
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
