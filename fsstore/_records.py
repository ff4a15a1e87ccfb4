"""A store object's lock holder records (``<root>/.locks/owner-<pid>-<random>``), which
its lock files are hard links of (:mod:`fsstore._lock`)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import weakref

from . import _fsio

RECORD_PREFIX = "owner-"


def host_name() -> str:
    """This host as filelock records it (with a PID-namespace suffix inside containers)."""
    try:
        from filelock._identity import host_name as filelock_host_name
    except ImportError:  # another filelock layout: the plain name is what older ones wrote
        return socket.gethostname()
    return str(filelock_host_name())


def _remove_records(directory: str, names: dict[str, bytes], pid: int) -> None:
    """A store object's records, when it goes: only in the process that wrote them (a
    forked child inherits the finalizer, not the records)."""
    if os.getpid() == pid:
        for name in list(names):
            with contextlib.suppress(OSError):
                os.unlink(f"{directory}/{name}")


def _record_text(name: str) -> bytes:
    """The holder record ``name``: pid, host, start token, as filelock writes its own,
    and the record's own name (what makes two store objects' records differ)."""
    token = None
    try:
        from filelock._identity import process_start_token
    except ImportError:  # another filelock layout: the token is optional in the record
        pass
    else:
        token = process_start_token(os.getpid())
    return f"{os.getpid()}\n{host_name()}\n{'' if token is None else token}\n{name}\n".encode()


class Records:
    """One store object's holder records in ``.locks``: ``owner-<pid>-<random>``, each
    written whole once, then hard-linked to the lock name of one hold at a time.

    A lock file is never seen without its record (filelock's own marker is created
    empty, then written: a holder killed in between leaves a marker that names
    nobody). Each acquire first touches the record it links, so the marker's mtime is
    the acquire time that others age it by (the storage's clock). A record serves one
    hold at a time and is reused by the next: a hold that stalls keeps its record, and
    its marker then ages, however many locks the store's other threads take meanwhile
    (with one record per store object, their touches kept a stuck thread's marker new
    for ever: review, stop 29). So a store object has as many records as it ever held
    locks at once; one whose marker was taken away (reclaimed) is retired, not used
    again. On a mount without hard links a record is moved to the lock name instead,
    and a new one written for the next acquire. Removed when the store object
    goes (or the process exits); one a killed process left is removed by ``fsstore gc``.
    """

    def __init__(self, fs: _fsio.Fs) -> None:
        self._fs = fs
        self._guard = threading.Lock()  # threads of one store share the pool
        self._free: list[tuple[str, bytes]] = []  # records no hold is using
        self._texts: dict[str, bytes] = {}  # every record written and still ours
        self._directory = ""  # where they are (.locks)
        self._finalizer: weakref.finalize[[str, dict[str, bytes], int], Records] | None = None

    def publish(self, directory: str, dir_fd: int, lock_name: str) -> tuple[str, bytes] | None:
        """Make ``lock_name`` (in ``directory``, open as ``dir_fd``) a record of ours not in
        use, unless it exists. Returns, if the lock is ours now, the name of the record
        it is (to pin, and to give back with :meth:`give_back` once released; the lock
        name itself where the record was moved there) and its content; None if it is
        held."""
        while True:
            name, text = self._take(directory, dir_fd)
            try:
                os.utime(name, dir_fd=dir_fd, follow_symlinks=False)
                linked = _fsio.link_noreplace(self._fs, dir_fd, name, lock_name)
            except FileNotFoundError:  # removed by someone's gc: anew
                self._forget(name)
                continue
            except BaseException:
                self.give_back(name)
                raise
            if linked is None:
                self.give_back(name)
                return None
            if linked is False:  # moved there (a mount without hard links): anew next time
                self._forget(name)
                return lock_name, text
            return name, text

    def texts(self) -> frozenset[bytes]:
        """The content of each record of ours (what a marker linked to it reads)."""
        with self._guard:
            return frozenset(self._texts.values())

    def give_back(self, name: str) -> None:
        """Record ``name`` serves no hold now (a name it was moved to is not ours)."""
        with self._guard:
            text = self._texts.get(name)
            if text is not None:
                self._free.append((name, text))

    def retire(self, name: str) -> None:
        """Record ``name`` is not to be linked again: emptied, removed, and no longer ours.

        Its hold found its marker taken away. A reclaimer that moved it aside and then
        found it was not the marker it had judged stale puts it back, maybe after this
        release looked: a marker naming a live process here, which waiters took for a
        live holder's until it aged out (review helper-90: 30 s of LOCK_TIMEOUT on
        GlusterFS). Emptied first, every link of the record (that marker too) names
        nobody, and waiters reclaim it after :data:`fsstore._reclaim.RECORDLESS_SECONDS`."""
        with self._guard:
            if self._texts.pop(name, None) is None:
                return  # a name it was moved to, not a record
        path = f"{self._directory}/{name}"
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)

    def _take(self, directory: str, dir_fd: int) -> tuple[str, bytes]:
        with self._guard:
            if self._free:
                return self._free.pop()
            name = f"{RECORD_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            text = _record_text(name)
            self._fs.write_new(dir_fd, name, text, sync=False)
            self._texts[name] = text
            self._directory = directory
            if self._finalizer is None:
                self._finalizer = weakref.finalize(
                    self, _remove_records, directory, self._texts, os.getpid())
            return name, text

    def _forget(self, name: str) -> None:
        with self._guard:
            self._texts.pop(name, None)


