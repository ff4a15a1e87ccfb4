"""Safe for operators and newcomers (issue 15): what a new user, an operator and an
attacker tried, and what the store and the CLI must do instead.

Each test states the promise. Permission cases run the CLI (or the library) as
uid 65534, a user that is not root (root ignores file modes): they need root to
switch to it and skip otherwise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fsstore import FsSessionStore, FsStoreError, _layout
from fsstore._store import SyncStore

from ._helpers import (
    DAY,
    NOBODY,
    P,
    S,
    age,
    age_tree,
    as_nobody,
    chown_tree,
    fsstore,
    lock_file,
    snapshot,
    stall,
    tdir,
    write_jsonl,
)
from .conftest import KEY, entry

#: The nesting depth append accepts (README: "Entries").
MAX_DEPTH = 500


def nested(depth: int) -> dict[str, Any]:
    """An entry whose containers nest ``depth`` levels deep (the entry itself is level 1)."""
    top: dict[str, Any] = {"uuid": f"deep-{depth}"}
    cur = top
    for _ in range(depth - 1):
        cur["a"] = {}
        cur = cur["a"]
    return top


def deep_line(depth: int) -> str:
    """One JSONL line nested ``depth`` levels deep, as a writer with a raised recursion
    limit (or another implementation) could leave it."""
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1) + "\n"


def as_nobody_call(fn: Callable[[], Any]) -> Any:
    """``fn()`` run as uid 65534 in a forked child; its result (or exception) comes back."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to switch to another uid")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out: Any = ("ok", fn())
            except BaseException as exc:  # noqa: BLE001 - sent back to the test
                out = ("raised", repr(exc))
            with open(w, "wb") as fh:
                pickle.dump(out, fh)
        finally:
            os._exit(0)
    os.close(w)
    with open(r, "rb") as fh:
        status, value = pickle.load(fh)
    os.waitpid(pid, 0)
    assert status == "ok", value
    return value


# -- 2: a duration needs a unit ----------------------------------------------------------


def test_a_bare_number_is_not_a_duration_in_prune_and_gc(root: Path, store: SyncStore) -> None:
    store.append(KEY, [entry(1)])
    age_tree(tdir(root, KEY).parent, 3600)
    for command in ("prune", "gc"):
        for bare in ("30", "1h30", "0"):
            proc = fsstore(command, root, "--older-than", bare)
            assert proc.returncode == 2, (command, bare, proc.stdout + proc.stderr)
            assert "unit" in proc.stderr
    assert store.load(KEY) == [entry(1)]
    assert fsstore("prune", root, "--older-than", "30d").returncode == 0
    assert store.load(KEY) == [entry(1)]


def test_a_lease_of_no_time_is_a_usage_error_not_a_traceback(root: Path, store: SyncStore) -> None:
    """``--stale-lock-seconds 0s`` parsed as a duration, and the store refused it with
    a ValueError: a traceback, exit 1 (review, stop 36: 3 of 3 commands)."""
    store.append(KEY, [entry(1)])
    for command in ("check", "locks", "migrate", "compact", "prune"):
        extra = ("--older-than", "1d") if command == "prune" else ()
        proc = fsstore(command, root, *extra, "--stale-lock-seconds", "0s")
        assert proc.returncode == 2, (command, proc.stdout + proc.stderr)
        assert "must be more than 0s" in proc.stderr and "Traceback" not in proc.stderr
    assert store.load(KEY) == [entry(1)]


# -- 3: check only looks; "is it a store" ------------------------------------------------


def test_check_leaves_a_stale_lock_of_a_damaged_transcript_and_reports_it(
    root: Path, store: SyncStore
) -> None:
    for n in (1, 2, 3):
        store.append(KEY, [entry(n)])
    (tdir(root, KEY) / _layout.part_name(2)).unlink()  # a gap: check looks under the lock
    lock = lock_file(root, KEY)
    lock.write_text("4242\nother-host\n1\n")
    age(lock, 2 * 3600)
    before = snapshot(root)

    proc = fsstore("check", root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "gap" in proc.stdout
    assert "stale lock" in proc.stdout and lock.name in proc.stdout
    assert lock.read_text() == "4242\nother-host\n1\n"
    assert snapshot(root) == before  # nothing was created, removed or touched


@pytest.mark.parametrize("stray", [_layout.MAX_SEQ, 1_000_000])
def test_a_stray_file_numbered_far_above_the_others_loses_no_append_and_repair_refuses_it(
        root: Path, store: SyncStore, stray: int) -> None:
    """Review (helper-78, stop 33): a file numbered 99999999999999999999 dropped into a
    transcript made every later append return with its batch linked at a 21-digit name
    that load() ignores (3 of 3 lost), and ``check --repair``, even ``--dry-run``, listed
    the missing numbers one by one (3.7 GB after 41 s; a stray 20000 made 19,998 files).
    Now an append past the top is ``CORRUPT`` and links nothing, and a repair names the
    stray file instead of closing a gap wider than 10,000 numbers."""
    store.append(KEY, [entry(0)])
    stray_name = _layout.part_name(stray)
    (tdir(root, KEY) / stray_name).write_text('{"stray": 1}\n')
    store = SyncStore(root)  # a new process: its next number comes from a listing
    if stray == _layout.MAX_SEQ:
        with pytest.raises(FsStoreError) as raised:
            store.append(KEY, [entry(1)])
        assert raised.value.code == "CORRUPT" and "move it aside" in str(raised.value)
    else:
        store.append(KEY, [entry(1)])  # linked above the stray file: loaded, not lost
        assert entry(1) in (store.load(KEY) or [])
    names = sorted(p.name for p in tdir(root, KEY).iterdir())
    assert all(_layout.parse_item(n) for n in names), names  # no name readers ignore
    before = {k: v for k, v in snapshot(root).items() if not k.startswith(_layout.LOCKS)}
    for args in (["--dry-run"], []):
        proc = fsstore("check", root, "--repair", *args, timeout=60)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"not repaired: {stray - 2} part numbers are missing" in proc.stdout, proc.stdout
        assert f"past the widest gap ({stray_name})" in proc.stdout
        assert {k: v for k, v in snapshot(root).items() if not k.startswith(_layout.LOCKS)} == before
    if stray == _layout.MAX_SEQ:  # nothing was linked above it: aside, the transcript is whole
        shutil.move(tdir(root, KEY) / stray_name, root.parent / stray_name)
        assert fsstore("check", root).returncode == 0


def test_repair_names_the_stray_file_not_the_batch_appended_above_it(root: Path, store: SyncStore) -> None:
    """Review (helper-79, stop 33): a stray numbered just below the top let one more
    append through, acknowledged at the top number; ``check --repair`` then named that
    file, the acknowledged batch, as the one to move aside. It names the file past the
    widest gap."""
    store.append(KEY, [entry(0)])
    stray_name = _layout.part_name(_layout.MAX_SEQ - 1)
    (tdir(root, KEY) / stray_name).write_text('{"stray": 1}\n')
    SyncStore(root).append(KEY, [entry(1)])  # a new process: numbered from a listing
    assert (tdir(root, KEY) / _layout.part_name(_layout.MAX_SEQ)).exists()
    proc = fsstore("check", root, "--repair", "--dry-run")
    assert proc.returncode == 1 and f"past the widest gap ({stray_name})" in proc.stdout, proc.stdout
    assert (store.load(KEY) or [])[-1] == entry(1)


def test_a_segment_name_of_one_number_is_no_transcript_file(root: Path, store: SyncStore) -> None:
    """Review (helper-79, stop 33): a file named ``4-4`` put next to parts 1-3: readers
    took it for part 4, and the writer, for which it was no segment, linked part 4
    beside it, acknowledged and hidden (2 of 2). Such a name is no part or segment for
    anyone now (``fsstore check`` calls it unexpected)."""
    for i in range(3):
        store.append(KEY, [entry(i)])
    (tdir(root, KEY) / "00000000000000000004-00000000000000000004.jsonl").write_text('{"stray": 1}\n')
    store.append(KEY, [entry(3)])
    assert store.load(KEY) == [entry(i) for i in range(4)]
    assert _layout.parse_item("00000000000000000005-00000000000000000004.jsonl") is None


def test_check_of_a_directory_that_is_not_a_store_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for not_a_store in (empty, Path("/etc")):
        proc = fsstore("check", not_a_store)
        assert proc.returncode != 0, proc.stdout
        assert "not an fsstore store" in proc.stderr
    assert list(empty.iterdir()) == []


# -- 4: prune keeps what it cannot read --------------------------------------------------


def test_prune_keeps_a_session_with_an_unreadable_part(shared: Path) -> None:
    root = shared / "store"
    store = SyncStore(root, create=True, summaries=False)
    store.append(KEY, [entry(1)])
    store.append(KEY, [entry(2)])
    chown_tree(shared, NOBODY)
    part = tdir(root, KEY) / _layout.part_name(2)
    part.chmod(0)  # unreadable for the operator (uid 65534), readable for root
    age_tree(tdir(root, KEY).parent, 40 * DAY)

    rc, out = as_nobody("prune", root, "--older-than", "30d")
    assert rc == 1, out
    assert "FAILED" in out and part.name in out
    assert part.exists()
    assert store.load(KEY) == [entry(1), entry(2)]


# -- 5: entries no default reader can read back -------------------------------------------


def test_append_rejects_what_a_default_reader_cannot_read_back(store: SyncStore) -> None:
    for bad in (nested(MAX_DEPTH + 1), nested(991), {"n": 10**4300}, {"l": [[-(10**4300)]]}):
        with pytest.raises(FsStoreError) as err:
            store.append(KEY, [entry(1), bad])
        assert err.value.code == "INVALID_ENTRY"
        assert store.load(KEY) is None  # nothing written
    ok = [nested(MAX_DEPTH), {"n": 10**4300 - 1, "m": -(10**4300 - 1)}]
    store.append(KEY, ok)
    assert store.load(KEY) == ok
    # A reader in another thread (the async API's worker) reads it back too.
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(store.load(KEY)))
    reader.start()
    reader.join()
    assert got == [ok]


def test_a_writer_with_raised_limits_cannot_write_what_readers_fail_on(store: SyncStore) -> None:
    limit, digits = sys.getrecursionlimit(), sys.get_int_max_str_digits()
    sys.setrecursionlimit(20_000)
    sys.set_int_max_str_digits(0)
    try:
        for bad in (nested(3000), {"n": 10**5000}):
            with pytest.raises(FsStoreError) as err:
                store.append(KEY, [bad])
            assert err.value.code == "INVALID_ENTRY"
    finally:
        sys.setrecursionlimit(limit)
        sys.set_int_max_str_digits(digits)
    assert store.load(KEY) is None


@pytest.mark.anyio
async def test_the_async_api_rejects_deep_entries_its_worker_could_encode(root: Path) -> None:
    astore = FsSessionStore(root, create=True)
    with pytest.raises(FsStoreError) as err:
        await astore.append(KEY, [nested(991)])
    assert err.value.code == "INVALID_ENTRY"
    await astore.append(KEY, [nested(MAX_DEPTH)])
    assert await astore.load(KEY) == [nested(MAX_DEPTH)]


def test_load_of_a_file_no_reader_can_parse_is_corrupt_with_file_and_line(
    root: Path, store: SyncStore
) -> None:
    store.append(KEY, [entry(1)])
    part = tdir(root, KEY) / _layout.part_name(2)
    for line2 in (deep_line(5000), '{"n":' + "9" * 5000 + "}\n"):
        part.write_text(json.dumps(entry(2)) + "\n" + line2)
        with pytest.raises(FsStoreError) as err:
            store.load(KEY)
        assert err.value.code == "CORRUPT"
        assert err.value.path is not None and err.value.path.endswith(part.name)
        assert "line 2" in err.value.message
        for command in ("cat", "check"):
            proc = fsstore(command, root, *((P, S) if command == "cat" else ()))
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert "Traceback" not in proc.stderr and "CORRUPT" in proc.stdout + proc.stderr


@pytest.mark.parametrize("summaries", [False, None])
def test_nothing_after_the_commit_point_raises_out_of_append(root: Path, summaries: bool | None) -> None:
    store = SyncStore(root, create=True, compact_every=2, summaries=summaries)
    store.append(KEY, [entry(1)])
    (tdir(root, KEY) / _layout.part_name(2)).write_text(deep_line(5000))  # what an old writer left
    store.append(KEY, [entry(3)])  # commits; the compaction (and summary) after it fail, logged
    store.append(KEY, [entry(4)])
    parts = sorted(p.name for p in tdir(root, KEY).glob("*.jsonl"))
    assert parts == [_layout.part_name(n) for n in (1, 2, 3, 4)]  # each batch once
    assert json.loads((tdir(root, KEY) / _layout.part_name(3)).read_text()) == entry(3)


# -- 6: import goes on past a file it cannot take -----------------------------------------


def test_import_reports_a_file_with_an_unreadable_line_and_goes_on(
    root: Path, store: SyncStore, tmp_path: Path
) -> None:
    store.append({"project_key": P, "session_id": "other"}, [entry(0)])
    projects = tmp_path / "projects"
    write_jsonl(projects / P / "a.jsonl", [entry(1)])
    (projects / P / "b.jsonl").write_text(json.dumps(entry(2)) + "\n" + deep_line(5000))
    write_jsonl(projects / P / "c.jsonl", [nested(800)])  # parses, but no store takes it
    write_jsonl(projects / P / "d.jsonl", [entry(4)])

    proc = fsstore("import", root, projects)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    failed = [line for line in proc.stdout.splitlines() if line.startswith("failed")]
    assert len(failed) == 2 and "b.jsonl" in failed[0] and "line 2" in failed[0]
    assert "c.jsonl" in failed[1] and "INVALID_ENTRY" in failed[1]
    for name, n in (("a", 1), ("d", 4)):
        assert store.load({"project_key": P, "session_id": name}) == [entry(n)]


# -- 7, 8: unreadable directories are said, not hidden ------------------------------------


def test_locks_says_when_it_cannot_read_the_lock_directory(shared: Path) -> None:
    root = shared / "store"
    SyncStore(root, create=True, summaries=False, dir_mode=0o755, file_mode=0o644).append(KEY, [entry(1)])
    (root / _layout.LOCKS).chmod(0o700)  # root's: the operator cannot list it
    rc, out = as_nobody("locks", root)
    assert rc == 1, out
    assert "EACCES" in out or "ermission denied" in out
    assert "0 lock(s), 0 stale; incomplete: 1 place(s) could not be read" in out


def test_list_sessions_lists_the_readable_sessions_and_names_the_other(shared: Path) -> None:
    root = shared / "store"
    store = SyncStore(root, create=True, summaries=False, dir_mode=0o755, file_mode=0o644)
    hidden = {"project_key": P, "session_id": "hidden"}
    store.append(KEY, [entry(1)])
    store.append(hidden, [entry(2)])
    tdir(root, hidden).parent.chmod(0o700)  # root's: unreadable for uid 65534

    def listing() -> tuple[list[str], list[str]]:
        seen: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                seen.append(f"{getattr(record, 'code', '?')} {getattr(record, 'path', '')}")

        logging.getLogger("fsstore").addHandler(Keep())
        sessions = SyncStore(root, create=True, summaries=False).list_sessions(P)
        return [s["session_id"] for s in sessions], seen

    sessions, logged = as_nobody_call(listing)
    assert sessions == [S]
    assert any(line.startswith("EACCES ") and line.endswith("/hidden") for line in logged), logged


# -- 9, 10: the lock, held and waited for --------------------------------------------------


def test_append_and_compact_inside_locked_do_not_wait_for_themselves(root: Path) -> None:
    store = SyncStore(root, create=True, lock_timeout_seconds=5)
    started = time.monotonic()
    with store.locked(KEY):
        store.append(KEY, [entry(1)])
        store.append(KEY, [entry(2)])
        assert store.compact(KEY) == 2
        with store.locked(KEY):  # nested: still the same holder
            store.append(KEY, [entry(3)])
        store.append(KEY, [entry(4)])
    assert time.monotonic() - started < 2
    assert store.load(KEY) == [entry(n) for n in (1, 2, 3, 4)]
    assert not lock_file(root, KEY).exists()  # released once, at the end


def test_an_append_inside_locked_keeps_the_holders_lease(root: Path) -> None:
    store = SyncStore(root, create=True, stale_lock_seconds=0.4)
    with store.locked(KEY):
        time.sleep(0.3)  # past half of stale_lock_seconds: another host may reclaim it
        with pytest.raises(FsStoreError) as err:
            store.append(KEY, [entry(1)])
    assert err.value.code == "LOCK_EXPIRED"
    assert store.load(KEY) is None


def test_another_thread_still_waits_for_a_lock_held_by_locked(root: Path) -> None:
    store = SyncStore(root, create=True, lock_timeout_seconds=0.3)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            store.append(KEY, [entry(2)])
        except FsStoreError as exc:
            errors.append(exc)

    with store.locked(KEY):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert [getattr(e, "code", None) for e in errors] == ["LOCK_TIMEOUT"]
    assert f"pid {os.getpid()}" in str(errors[0])


@pytest.mark.anyio
async def test_the_async_store_locks_with_async_with(root: Path) -> None:
    astore = FsSessionStore(root, create=True, lock_timeout_seconds=5)
    started = time.monotonic()
    async with astore.locked(KEY):
        assert lock_file(root, KEY).exists()
        await astore.append(KEY, [entry(1)])
        assert await astore.load(KEY) == [entry(1)]
        assert await astore.compact(KEY) == 0
    assert not lock_file(root, KEY).exists()
    assert time.monotonic() - started < 2
    with astore.sync.locked(KEY):  # the blocking one
        assert lock_file(root, KEY).exists()


def test_lock_timeout_says_who_holds_the_lock(root: Path, store: SyncStore) -> None:
    store.append(KEY, [entry(1)])
    lock = lock_file(root, KEY)
    lock.write_text("4242\nbuild-host-7\n1\n")
    age(lock, 5)
    waiter = SyncStore(root, create=True, lock_timeout_seconds=0.2, stale_lock_seconds=3600)
    with pytest.raises(FsStoreError) as err:
        waiter.append(KEY, [entry(2)])
    message = str(err.value)
    assert err.value.code == "LOCK_TIMEOUT"
    assert "pid 4242" in message and "build-host-7" in message and "since" in message
    assert "The file lock" not in message and "held by held" not in message


# -- 11: every code a user can meet is in README -------------------------------------------


# -- 12: the library does not print -------------------------------------------------------


def test_the_library_prints_nothing_when_logging_is_not_configured(root: Path) -> None:
    script = f"""
import json, logging
from fsstore import FsSessionStore, FsStoreError
store = FsSessionStore({str(root)!r}, create=True).sync
key = {json.dumps(KEY)}
store.append(key, [{{"uuid": "a"}}])
with open({str(tdir(root, KEY) / _layout.part_name(2))!r}, "w") as fh:
    fh.write("not json\\n")
try:
    store.load(key)
except FsStoreError as exc:
    assert exc.code == "CORRUPT"
else:
    raise SystemExit("no error")
assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("fsstore").handlers)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


# -- 1. a missing mount never becomes a local store ------------------------------------


def test_a_missing_mount_is_refused_not_made_a_local_store(tmp_path: Path) -> None:
    """The mount point exists while the share is not mounted: an empty directory.
    Nothing is written there, and nothing above a root that does not exist is made."""
    from fsstore import FsSessionStore, FsStoreError

    key = {"project_key": "p", "session_id": "s"}
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    for root in (mount_point, mount_point / "agent-sessions", tmp_path / "gone" / "agent-sessions"):
        store = FsSessionStore(root).sync
        with pytest.raises(FsStoreError) as info:
            store.append(key, [{"uuid": "u"}])
        assert info.value.code == "NOT_A_STORE" and info.value.path == str(root)
        assert "mounted" in info.value.message
        assert store.load(key) is None and store.list_sessions("p") == []
    assert list(mount_point.iterdir()) == [] and not (tmp_path / "gone").exists()


def test_create_makes_the_root_and_its_marker_but_never_its_parents(tmp_path: Path) -> None:
    import json as json_mod
    import socket

    from fsstore import FsSessionStore, FsStoreError

    key = {"project_key": "p", "session_id": "s"}
    store = FsSessionStore(tmp_path / "store", create=True).sync
    assert not (tmp_path / "store").exists()  # nothing before the first write
    store.append(key, [{"uuid": "u"}])
    marker = json_mod.loads((tmp_path / "store" / ".fsstore").read_text())
    assert marker["format"] == 2 and marker["host"] == socket.gethostname() and marker["created"]
    deep = FsSessionStore(tmp_path / "no" / "such" / "store", create=True).sync
    with pytest.raises(FsStoreError) as info:
        deep.append(key, [{"uuid": "u"}])
    assert info.value.code == "ENOENT" and not (tmp_path / "no").exists()


def test_fsstore_init_creates_a_store_that_opens_without_create(tmp_path: Path) -> None:
    from fsstore import FsSessionStore

    r = subprocess.run([sys.executable, "-m", "fsstore", "init", str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and "store created" in r.stdout, r.stdout + r.stderr
    FsSessionStore(tmp_path / "store").sync.append({"project_key": "p", "session_id": "s"}, [{"u": 1}])
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([sys.executable, "-m", "fsstore", "check", str(empty)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0 and "not an fsstore store" in r.stdout + r.stderr


def test_a_root_that_cannot_be_a_store_is_said_plainly_by_init_and_the_library(tmp_path: Path) -> None:
    """A root that is a file, a FIFO or a symlink to nothing (a share not mounted where
    the link points) is named for what it is: `fsstore init` exits 2 with
    ``NOT_A_STORE`` (was: a raw ``[Errno 20]``, exit 1), and an append with
    ``create=True`` says the symlink's target is missing (was: ``ENOENT`` "transcript
    directory kept disappearing (concurrent deletes)"). A missing parent is said with
    the operation that met it (was: "during append" for `init`)."""
    key = {"project_key": "p", "session_id": "s"}
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "unmounted" / "share")
    for name, why in (("file", "not a directory"), ("fifo", "not a directory"),
                      ("link", f"a symlink to {tmp_path}/unmounted/share, which does not exist")):
        r = fsstore("init", tmp_path / name, "--json")
        assert r.returncode == 2, r.stdout + r.stderr
        error = json.loads(r.stdout)["error"]
        assert error["code"] == "NOT_A_STORE" and why in error["message"], error
    with pytest.raises(FsStoreError) as info:
        FsSessionStore(tmp_path / "link", create=True).sync.append(key, [{"uuid": "u"}])
    assert info.value.code == "ENOENT" and "a symlink to" in str(info.value), info.value
    with pytest.raises(FsStoreError) as info:
        FsSessionStore(tmp_path / "link").sync.append(key, [{"uuid": "u"}])
    assert info.value.code == "NOT_A_STORE" and "a symlink to" in str(info.value), info.value
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # cannot be looked at: its code, exit 1
    r = fsstore("check", tmp_path / "loop", "--json")
    assert (r.returncode, json.loads(r.stdout)["error"]["code"]) == (1, "ELOOP"), r.stdout + r.stderr
    r = fsstore("init", tmp_path / "no" / "store", "--json")
    error = json.loads(r.stdout)["error"]
    assert (r.returncode, error["code"], error["operation"]) == (1, "ENOENT", "init"), error
    assert not (tmp_path / "no").exists() and not (tmp_path / "unmounted").exists()
    assert (tmp_path / "file").read_text() == "x"


def test_a_store_made_before_the_marker_is_recognized_and_migrate_marks_it(tmp_path: Path) -> None:
    from fsstore import FsSessionStore

    root = tmp_path / "store"
    FsSessionStore(root, create=True).sync.append({"project_key": "p", "session_id": "s"}, [{"u": 1}])
    (root / ".fsstore").unlink()  # as fsstore before the marker left it: projects/, .locks/
    FsSessionStore(root).sync.append({"project_key": "p", "session_id": "t"}, [{"u": 2}])
    r = subprocess.run([sys.executable, "-m", "fsstore", "migrate", str(root)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and (root / ".fsstore").exists(), r.stdout + r.stderr


def test_a_task_that_stops_waiting_for_locked_leaves_no_lock_behind(root: Path) -> None:
    """``asyncio.wait_for`` (a native cancel) around ``async with store.locked(key)``
    ends the wait at once while the worker thread goes on waiting; the hold it took
    when the holder released was left to nobody: every other task of the store and
    every other process waited for it (review, stop 30: LOCK_TIMEOUT). The worker gives
    it back."""
    import asyncio

    store = FsSessionStore(root, create=True, lock_timeout_seconds=5)

    async def main() -> float:
        async def holder() -> None:
            async with store.locked(KEY):
                await asyncio.sleep(0.6)

        async def impatient() -> None:
            async with store.locked(KEY):
                raise AssertionError("not reached: the wait is cut at 0.2 s")

        task = asyncio.create_task(holder())
        await asyncio.sleep(0.1)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(impatient(), 0.2)
        await task
        await asyncio.sleep(0.3)  # the impatient task's worker has taken the lock by now
        started = time.monotonic()
        await store.append(KEY, [entry(1)])
        return time.monotonic() - started

    waited = asyncio.run(main())
    assert waited < 1.0, waited
    assert not lock_file(root, KEY).exists()
    assert store.sync.load(KEY) == [entry(1)]


@pytest.mark.parametrize("outer", ["one lock", "a lock each"])
def test_more_tasks_than_worker_threads_waiting_for_one_lock_let_its_holder_work(root: Path, outer: str) -> None:
    """45 tasks, each ``async with store.locked(key): await store.append(key, ...)``
    (holding a second lock inside it too; or each holding a lock of its own, and then the
    one they all wait for: 41 such nested takes on a pool of 40 for holders stalled).
    Those waiting for the lock each occupy one of anyio's default worker threads (40);
    the holder's append needed one more and waited behind them past its lease (review,
    stop 30: 5 appended, 38 LOCK_TIMEOUT, 2 LOCK_EXPIRED). A holder's calls run on
    worker threads of their own."""
    import asyncio

    store = FsSessionStore(root, create=True, stale_lock_seconds=4, lock_timeout_seconds=10)
    other = {**KEY, "session_id": "other"}

    async def one(i: int) -> None:
        first = KEY if outer == "one lock" else {**KEY, "session_id": f"own-{i}"}
        async with store.locked(first), store.locked(other):  # nested: its take too (review)
            await store.append(KEY, [entry(i)])

    async def main() -> list[BaseException | None]:
        return await asyncio.gather(*(one(i) for i in range(45)), return_exceptions=True)

    started = time.monotonic()
    results = asyncio.run(main())
    assert [r for r in results if r is not None] == [], results
    assert time.monotonic() - started < 5
    assert sorted(e["uuid"] for e in store.sync.load(KEY) or []) == sorted(f"u-{i}" for i in range(45))


def test_a_task_cancelled_as_its_locked_block_ends_leaves_no_lock_behind(root: Path) -> None:
    """A native asyncio cancel that lands as ``async with store.locked(key)`` starts its
    release (anyio's checkpoints before the worker runs it) skipped the release: the
    lock file stayed and the next append in the process failed LOCK_TIMEOUT (review,
    stop 30; Ctrl-C under ``asyncio.run`` with ``gather`` did it every time)."""
    import asyncio

    store = FsSessionStore(root, create=True, lock_timeout_seconds=2)

    async def body() -> None:
        async with store.locked(KEY):
            await store.append(KEY, [entry(1)])
            task = asyncio.current_task()
            assert task is not None
            asyncio.get_running_loop().call_soon(task.cancel)  # at the release's first wait

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(body())
        await store.append(KEY, [entry(2)])

    asyncio.run(main())
    assert not lock_file(root, KEY).exists()
    assert store.sync.load(KEY) == [entry(1), entry(2)]


def test_a_task_spawned_inside_locked_that_outlives_it_waits_like_any_other(root: Path) -> None:
    """A task created inside ``async with store.locked(key)`` carries its context: once
    the block had ended, its ``locked(key)`` and appends still ran as the holder's,
    inside the next holder's hold (review, stop 30). A released hold is nobody's."""
    import asyncio

    store = FsSessionStore(root, create=True, lock_timeout_seconds=5)
    seen: dict[str, object] = {}

    async def child() -> None:
        await asyncio.sleep(0.2)  # the parent has released; the other task holds it
        async with store.locked(KEY):
            await store.append(KEY, [entry(1)])

    async def other() -> None:
        await asyncio.sleep(0.1)
        async with store.locked(KEY):
            before = await store.load(KEY)
            await asyncio.sleep(0.4)
            seen["changed under its hold"] = await store.load(KEY) != before

    async def main() -> None:
        async with store.locked(KEY):
            spawned = asyncio.create_task(child())
        await other()
        await spawned

    asyncio.run(main())
    assert seen == {"changed under its hold": False}
    assert store.sync.load(KEY) == [entry(1)]



CANCELLED_HOLDER = """
import asyncio, sys
sys.path.insert(0, {repo!r})
from fsstore import FsSessionStore
store = FsSessionStore({root!r}, stale_lock_seconds=30)
print("ready", flush=True)
sys.stdin.readline()

async def hold() -> None:
    async with store.locked({key!r}):
        await store.append({key!r}, [{{"n": "cancelled"}}])

async def main() -> None:
    try:
        await asyncio.wait_for(hold(), 0.5)  # cancels the task natively
    except (TimeoutError, asyncio.TimeoutError):
        pass
    print("released", flush=True)
    await asyncio.sleep(4)  # the append's worker runs on, and ends

asyncio.run(main())
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_an_append_cancelled_natively_inside_locked_publishes_nothing_once_the_lock_is_given_back(
        root: Path) -> None:
    """``async with store.locked(key): await store.append(...)`` cancelled natively on
    asyncio (``wait_for``) ends the block at once and gives the lock back, while the
    append's worker runs on. A worker stalled past its lease check (strace: 1.5 s on
    a ``stat`` of the transcript directory) committed inside the next holder's hold
    (review, stop 30; 3 of 3). It now finds its hold given back, and publishes
    nothing (LOCK_EXPIRED, to nobody)."""
    store = SyncStore(root, create=True)
    store.append(KEY, [entry(1)])
    code = CANCELLED_HOLDER.format(repo=str(Path(__file__).resolve().parents[1]), root=str(root), key=KEY)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    tracer = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        # The second look at the transcript directory: the first is before the lock
        # (the temp file's), the second the one after it, before the lease check.
        tracer = stall(proc.pid, "newfstatat", 1_500_000, path=tdir(root, KEY), when="2")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "released"
        with store.locked(KEY):
            before = store.load(KEY)
            time.sleep(2.5)  # the stalled worker goes on meanwhile
            assert store.load(KEY) == before
        proc.wait(10)
    finally:
        for p in (proc, tracer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert store.load(KEY) == [entry(1)]
    assert not lock_file(root, KEY).exists()


def test_a_delete_cancelled_natively_ends_before_the_callers_next_append(root: Path) -> None:
    """Review (helper-77, stop 33): ``asyncio.wait_for(store.delete(key), t)`` timed out
    while the delete's worker waited for the lock; the worker went on, and took the lock
    after the caller's next append: the acknowledged batch deleted (2 of ~2,430). A
    natively cancelled delete now waits for its worker: when the cancellation reaches
    the caller, the delete is done, and what the caller appends next stays."""
    store = FsSessionStore(root, create=True)
    store.sync.append(KEY, [entry(1)])
    holding, release = threading.Event(), threading.Event()

    def holder() -> None:
        with store.sync.locked(KEY):
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    holding.wait(10)
    threading.Timer(0.6, release.set).start()

    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(store.delete(KEY), 0.1)
        waited = time.monotonic() - started
        assert store.sync.load(KEY) is None  # done when the cancellation came
        await store.append(KEY, [entry(2)])
        return waited

    waited = asyncio.run(main())
    thread.join(10)
    assert waited >= 0.5
    time.sleep(0.3)  # a delete worker still running would have its turn here
    assert store.sync.load(KEY) == [entry(2)]
