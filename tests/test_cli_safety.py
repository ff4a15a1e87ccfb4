"""The CLI never deletes what it could not look at or what is in use, never hangs on a
FIFO, never crashes on a name that is not UTF-8, and says when it could not do its job.

Each test here reproduces a finding of the CLI review (the scripts were /tmp/rv/r*).
Permission cases run the CLI as uid 65534 (root ignores file modes), so they need root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fsstore import _check, _cleanup, _layout, _transfer
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
    made_anew_blind,
    moved_by_a_dead_deleter,
    orphan_of,
    snapshot,
    tdir,
    write_jsonl,
)
from .conftest import KEY, entry

SUB = {**KEY, "subpath": "subagents/a"}
def actions(root: Path, older_than: float, **kw: object) -> list[tuple[str, bool, bool]]:
    found, _examined = _cleanup.prune(str(root), older_than=older_than, **kw)  # type: ignore[arg-type]
    return [(a.action, a.done, a.failed) for a in found]


# -- prune -----------------------------------------------------------------------------


def test_prune_skips_a_session_whose_transcript_it_cannot_read(shared: Path) -> None:
    root = shared / "store"
    store = SyncStore(root, create=True, summaries=False)
    store.append(KEY, [entry(1)])  # written just now
    session = tdir(root, KEY).parent
    chown_tree(shared, NOBODY)
    tdir(root, KEY).chmod(0)  # EACCES for the operator: its age cannot be known
    age(session, 40 * DAY)  # only the session directory itself looks old

    rc, out = as_nobody("prune", root, "--older-than", "30d")
    assert rc == 1, out
    assert "FAILED" in out and "cannot" in out
    assert "EACCES: " in out  # operators alert on the code of what failed
    rc, out = as_nobody("ls", root)  # a problem line on stderr carries its code too
    assert rc == 1 and "fsstore: error: EACCES: " in out, out
    rc, out = as_nobody("prune", root, "--older-than", "30d", "--json")
    assert rc == 1 and [a["code"] for a in json.loads(out)["actions"] if a["failed"]] == ["EACCES"], out
    assert session.exists()
    tdir(root, KEY).chmod(0o700)
    assert store.load(KEY) == [entry(1)]


def test_a_prune_committed_but_not_finished_says_so_and_cat_and_export_say_the_session_is_gone(
    shared: Path,
) -> None:
    """``.trash`` the operator may not write: prune commits its delete (the mark) and
    cannot move the session. Review (stop 36): prune said only ``FAILED ... EACCES``
    (read as "kept"), and `export` exited 0 with "nothing found" where `cat` and
    load() said it was gone. (`ls`, as list_sessions, lists it until a load or append
    under the lock finishes the delete: docs/operations.md.)"""
    root = shared / "store"
    store = SyncStore(root, create=True, summaries=False)
    store.append(KEY, [entry(1)])
    store.append(SUB, [entry(2)])
    store.append({**KEY, "session_id": "other"}, [entry(3)])
    store.delete({**KEY, "session_id": "other"})  # .trash exists
    chown_tree(shared, NOBODY)
    os.chown(root / _layout.TRASH, 0, 0)
    (root / _layout.TRASH).chmod(0o700)
    rc, out = as_nobody("prune", root, "--older-than", "0s", "--json")
    [action] = json.loads(out)["actions"]
    assert rc == 1 and action["failed"] and action["code"] == "EACCES", out
    assert "deleted (committed: load() returns None)" in action["detail"], out
    rc, out = as_nobody("ls", root, "--json")  # as list_sessions: listed till a load finishes it
    assert rc == 0 and [s["session_id"] for s in json.loads(out)["sessions"]] == [KEY["session_id"]], out
    for command in (("cat", root, KEY["project_key"], KEY["session_id"]),
                    ("export", root, KEY["project_key"], KEY["session_id"], shared / "out")):
        rc, out = as_nobody(*command)
        assert rc == 1 and "NOT_FOUND" in out, (command, out)
    assert store.load(KEY) is None and not (shared / "out").exists()
    assert store.list_sessions(KEY["project_key"]) == []  # root's load finished the delete


def test_prune_skips_a_session_with_a_symlink_and_one_with_nothing_committed(
    root: Path, store: SyncStore
) -> None:
    linked = {"project_key": P, "session_id": "linked"}
    store.append({**linked, "subpath": "subagents/a"}, [entry(1)])
    store.append(KEY, [entry(2)])
    session = tdir(root, linked).parent
    (session / "main").symlink_to(tdir(root, KEY))  # main cannot be looked at
    empty = tdir(root, {"project_key": P, "session_id": "empty"})
    empty.mkdir(parents=True)  # a first append that never committed
    for d in (session, empty.parent):
        age_tree(d, 40 * DAY)

    found, examined = _cleanup.prune(str(root), older_than=30 * DAY)
    assert examined == 3
    by_name = {Path(a.path).name: a for a in found}
    assert by_name["linked"].action == "skip" and by_name["linked"].failed
    assert "symlink" in by_name["linked"].detail
    # Nothing committed: never deleted (reported, not failed, once its directory's
    # ctime is old too).
    assert by_name.keys() <= {"linked", "empty"}
    assert not any(a.done or (a.failed and name == "empty") for name, a in by_name.items())
    assert session.exists() and empty.exists()


def test_prune_keeps_a_session_with_an_append_in_flight(root: Path, store: SyncStore) -> None:
    store.append(KEY, [entry(1)])
    store.append(SUB, [entry(2)])
    age_tree(tdir(root, KEY).parent, 40 * DAY)
    # A writer that has written its batch to a temp file and now waits for the lock
    # prune holds (in the main transcript, or in a subagent's).
    for d in (tdir(root, KEY), tdir(root, SUB)):
        temp = d / ".tmp-4242-00000000000000aa"
        temp.write_bytes(b'{"uuid":"resumed"}\n')
        age(temp, 40 * DAY)  # even back-dated: its ctime says it was written just now
        found, _ = _cleanup.prune(str(root), older_than=30 * DAY)
        assert [(a.action, a.done) for a in found] == [("keep", False)]
        assert "in flight" in found[0].detail
        assert store.load(KEY) == [entry(1)]
        temp.unlink()

    # A temp file older than the threshold is a crashed writer's: it keeps nothing.
    (tdir(root, SUB) / ".tmp-4243-00000000000000bb").write_bytes(b"half")
    time.sleep(1.1)
    assert actions(root, 1.0) == [("delete", True, False)]
    assert store.load(KEY) is None and store.load(SUB) is None


@pytest.mark.parametrize("moved", ["a subagent transcript", "the session, made anew since"])
def test_prune_keeps_a_session_part_of_which_a_delete_moved_into_trash_by_mistake(
    root: Path, store: SyncStore, moved: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: a stalled delete moved part of the session into .trash by mistake and
    died; prune's look does not see what is there, and did not claim it as a delete
    does: pruned, its batch came back into the session made at the name since (by the
    next load, or gc's merge; 3 of 3 each). Prune keeps the session until that part is
    moved back or merged; then a prune deletes all of it, and nothing comes back."""
    if moved == "a subagent transcript":
        store.append(KEY, [entry(0)])
        store.append(SUB, [entry(1)])
        moved_by_a_dead_deleter(root, SUB)
    else:
        orphan_of(root, [[entry(0)]])  # and a session made at its name since, with entry(2)
        made_anew_blind(monkeypatch, store, SUB, [entry(1)])
    time.sleep(1.1)
    assert actions(root, 1.0, dry_run=True) == [("keep", False, False)]
    found, _ = _cleanup.prune(str(root), older_than=1.0)
    assert [(a.action, a.done) for a in found] == [("keep", False)], [a.as_dict() for a in found]
    assert "moved there by a delete by mistake" in found[0].detail
    if moved == "a subagent transcript":
        assert store.load(SUB) == [entry(1)]  # moved back by the load
    else:
        _cleanup.gc(str(root), older_than=0.0)  # merged into the session made since
        assert store.load(KEY) == [entry(2), entry(0)] and store.load(SUB) == [entry(1)]
        time.sleep(1.1)
    time.sleep(1.1)
    assert actions(root, 1.0) == [("delete", True, False)]
    store.append(KEY, [entry(3)])
    assert store.load(SUB) is None and store.load(KEY) == [entry(3)]
    assert fsstore("check", root).returncode == 0


def test_prune_holds_the_lock_of_every_transcript(root: Path, store: SyncStore) -> None:
    store.append(KEY, [entry(1)])
    store.append(SUB, [entry(2)])
    age_tree(tdir(root, KEY).parent, 40 * DAY)
    with store.locked(SUB):  # a subagent's commit in progress
        found, _ = _cleanup.prune(str(root), older_than=30 * DAY, lock_timeout_seconds=0.3)
    assert [(a.action, a.done, a.failed) for a in found] == [("delete", False, True)]
    assert "LOCK_TIMEOUT" in found[0].detail
    assert store.load(SUB) == [entry(2)]


# -- gc --------------------------------------------------------------------------------


def test_gc_ages_temp_files_by_ctime_too(root: Path, store: SyncStore) -> None:
    store.append(KEY, [entry(1)])
    temp = tdir(root, KEY) / ".tmp-4242-00000000000000cc"
    temp.write_bytes(b"a batch being committed")
    age(temp, 2 * 3600)  # mtime set back; its ctime cannot be
    assert _cleanup.gc(str(root)) == []
    assert temp.exists()
    report = _check.check(str(root))
    assert report.ok and [p.kind for p in report.problems] == ["young-temp"]


def test_gc_fails_on_a_lock_it_cannot_break(shared: Path) -> None:
    root = shared / "store"
    SyncStore(root, create=True, summaries=False, dir_mode=0o755, file_mode=0o644).append(KEY, [entry(1)])
    lock = lock_file(root, KEY)
    lock.write_text("999999\nother-host\n1\n")
    age(lock, 7200)
    rc, out = as_nobody("gc", root)  # .locks is root's: the operator cannot rename in it
    assert rc == 1, out
    assert "FAILED" in out and lock.name in out and "EACCES: " in out
    assert "taken again" not in out
    rc, out = as_nobody("gc", root, "--json")
    assert rc == 1 and [a["code"] for a in json.loads(out)["actions"] if a["failed"]] == ["EACCES"], out
    assert lock.exists()


def test_gc_fails_on_a_lock_that_is_no_file_and_leaves_it(root: Path, store: SyncStore) -> None:
    store.append(KEY, [entry(1)])
    lock = lock_file(root, KEY)
    lock.mkdir()  # made by hand: no writer can take the lock, and gc must not guess
    age(lock, 7200)
    proc = fsstore("gc", root, "--json")
    rc, out = proc.returncode, proc.stdout
    failed = [a for a in json.loads(out)["actions"] if a["failed"]]
    assert rc == 1 and [a["code"] for a in failed] == ["UNSAFE_PATH"], out
    assert "not a regular file" in failed[0]["detail"] and lock.is_dir()


# -- import and export -----------------------------------------------------------------


def test_import_says_which_jsonl_files_it_skips_because_they_are_no_files(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO or a socket named ``*.jsonl`` (main or subagent) was skipped without a
    word (review, stop 36), where a symlink gets an info line."""
    import socket

    SyncStore(root, create=True).init()
    projects = tmp_path / "projects"
    write_jsonl(projects / P / f"{S}.jsonl", [entry(1)])
    (projects / P / "other" / "subagents").mkdir(parents=True)
    os.mkfifo(projects / P / "fifo.jsonl")
    os.mkfifo(projects / P / "other" / "subagents" / "agent-1.jsonl")
    monkeypatch.chdir(projects / P)  # a socket's path is short (108 bytes): bound by a relative one
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind("sock.jsonl")
        proc = fsstore("import", root, projects, "--json", timeout=20)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    skipped = sorted(Path(p["path"]).name for p in doc["problems"] if p["kind"] == "not-a-file")
    assert skipped == ["agent-1.jsonl", "fifo.jsonl", "sock.jsonl"], doc["problems"]
    assert [f["status"] for f in doc["files"]] == ["new"]


def test_import_and_export_do_not_hang_on_a_fifo_sidecar(
    root: Path, store: SyncStore, tmp_path: Path
) -> None:
    store.append({"project_key": P, "session_id": "other"}, [entry(0)])
    projects = tmp_path / "projects"
    agent = projects / P / S / "subagents" / "agent-1.jsonl"
    write_jsonl(agent, [entry(1)])
    os.mkfifo(agent.with_name("agent-1.meta.json"))
    proc = fsstore("import", root, projects, timeout=20)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not a regular file" in proc.stdout
    assert store.load({**KEY, "subpath": "subagents/agent-1"}) == [entry(1)]

    store.append({**KEY, "subpath": "subagents/agent-1"},
                 [{"type": "agent_metadata", "agentType": "Plan"}])
    out = tmp_path / "out"
    meta = out / P / S / "subagents" / "agent-1.meta.json"
    meta.parent.mkdir(parents=True)
    os.mkfifo(meta)
    proc = fsstore("export", root, P, S, out, timeout=20)
    assert proc.returncode == 1 and "refused" in proc.stdout, proc.stdout + proc.stderr
    assert fsstore("export", root, P, S, out, "--force", timeout=20).returncode == 0
    assert json.loads(meta.read_text()) == {"agentType": "Plan"}


def test_import_root_must_exist_unless_create(tmp_path: Path) -> None:
    projects = tmp_path / "projects"
    write_jsonl(projects / P / f"{S}.jsonl", [entry(1)])
    a_file = tmp_path / "a-file"
    a_file.write_text("not a store")
    typo = tmp_path / "typo" / "root"
    proc = fsstore("import", typo, projects)
    assert proc.returncode == 2 and "--create" in proc.stderr, proc.stdout + proc.stderr
    assert not typo.parent.exists()
    proc = fsstore("import", a_file, projects)
    assert proc.returncode == 2 and "not a directory" in proc.stderr, proc.stdout + proc.stderr
    transfers, _ = _transfer.import_projects(str(typo), str(projects), create=True)
    assert [t.status for t in transfers] == ["failed"] and not typo.parent.exists()  # no parents made
    typo.parent.mkdir()
    transfers, _ = _transfer.import_projects(str(typo), str(projects), create=True)
    assert [t.status for t in transfers] == ["new"]
    assert SyncStore(typo, create=True).load(KEY) == [entry(1)]


def test_import_create_takes_an_empty_directory_not_a_crowded_one(tmp_path: Path) -> None:
    """Found by review: ``import --create`` made a store next to ``.ssh/`` in a home
    directory given by mistake (exit 0). A directory that is not a store must be empty."""
    projects = tmp_path / "projects"
    write_jsonl(projects / P / f"{S}.jsonl", [entry(1)])
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id").write_text("secret")
    proc = fsstore("import", home, projects, "--create")
    assert proc.returncode == 2 and "not empty" in proc.stderr, proc.stdout + proc.stderr
    assert sorted(p.name for p in home.iterdir()) == [".ssh"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert fsstore("import", empty, projects, "--create").returncode == 0
    assert SyncStore(empty).load(KEY) == [entry(1)]
    assert fsstore("import", empty, projects, "--create").returncode == 0  # a store now: fine


@pytest.mark.parametrize("planted", ["projects", ".trash", ".locks"])
def test_a_store_directory_replaced_by_a_symlink_fails_gc_and_prune_loudly(
    root: Path, store: SyncStore, planted: str
) -> None:
    """Found by review: with ``projects`` a symlink, prune said "0 session(s) examined"
    and gc, migrate said nothing, all exit 0: a job not done looked done."""
    store.append(KEY, [entry(1)])
    store.delete({"project_key": P, "session_id": "gone"})  # makes .trash
    real = root.parent / "elsewhere"
    (root / planted).rename(real)
    (root / planted).symlink_to(real)
    before = snapshot(real)
    for args in (("gc", "--older-than", "0s"), ("prune", "--older-than", "0s")):
        proc = fsstore(args[0], root, *args[1:])
        assert proc.returncode == 1 and "FAILED" in proc.stdout, (args, proc.stdout, proc.stderr)
    assert snapshot(real) == before  # never followed


# -- output ----------------------------------------------------------------------------


def test_names_that_are_not_utf8_do_not_crash_the_output(root: Path, store: SyncStore,
                                                          tmp_path: Path) -> None:
    store.append(KEY, [entry(1)])
    os.mkdir(os.fsencode(root / "projects") + b"/\xff")
    projects = tmp_path / "projects"
    (projects / P).mkdir(parents=True)
    with open(os.fsencode(projects / P) + b"/\xfe.jsonl", "w") as fh:
        fh.write('{"uuid":"x"}\n')
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}  # strict: a lone surrogate cannot be written

    def run(*args: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fsstore", *map(str, args)], check=False,
                              capture_output=True, text=True, timeout=60, env=env,
                              errors="replace")

    text = run("check", root)
    assert text.returncode == 1 and "Traceback" not in text.stderr
    assert "\\udcff" in text.stdout
    doc = run("check", root, "--json")
    assert doc.returncode == 1 and "Traceback" not in doc.stderr
    assert any(p["path"].endswith("\udcff") for p in json.loads(doc.stdout)["problems"])
    imp = run("import", root, projects)
    assert imp.returncode == 1 and "Traceback" not in imp.stderr


def test_dry_runs_and_looks_leave_every_file_of_the_store_as_it_was(tmp_path: Path) -> None:
    """``--dry-run`` of every command that has one, and the commands that only look,
    change nothing under the store root: no file or directory made, removed or
    touched (mtime, ctime, inode, size), but the root's own times: each command reads
    the file server's clock from a file it makes and removes there (stop 38). Before,
    ``migrate --dry-run`` and ``check --repair --dry-run`` took each transcript's lock,
    which wrote in ``.locks``."""
    root = tmp_path / "store"
    store = SyncStore(root, create=True, compact_every=0, summaries=False)
    for n in range(5):
        store.append(KEY, [entry(n)])
    store.append(SUB, [entry(9)])
    del store
    (tdir(root, KEY) / ".tmp-1-0123456789ab").write_bytes(b"{}\n")  # garbage for gc
    age_tree(root, 40 * DAY)  # old enough for prune and gc to act

    def look() -> dict[str, tuple[int, int, int, int]]:
        return {str(p.relative_to(root)): (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                if p != root else (st.st_ino, st.st_size, 0, 0)
                for p in [root, *root.rglob("*")] for st in [p.lstat()]}

    before = look()
    commands = [["gc", "--older-than", "0s", "--dry-run"], ["prune", "--older-than", "30d", "--dry-run"],
                ["compact", "--dry-run"], ["migrate", "--dry-run"], ["check", "--repair", "--dry-run"],
                ["check"], ["ls"], ["locks"], ["cat", P, S], ["export", P, S, tmp_path / "out", "--dry-run"],
                ["import", tmp_path / "local", "--dry-run"]]
    write_jsonl(tmp_path / "local" / P / "new-session.jsonl", [{"type": "user", "uuid": "u1"}])  # to import
    outs = []
    for args in commands:
        proc = fsstore(args[0], root, *args[1:])
        assert proc.returncode in (0, 1), (args, proc.stdout + proc.stderr)
        assert look() == before, (args, proc.stdout + proc.stderr)
        outs.append(proc.stdout)
    # Each dry run had something to do (check --repair: nothing to repair here).
    assert [i for i, out in enumerate(outs) if "would" not in out and "dry run" not in out] == [4, 5, 6, 7, 8], outs


@pytest.mark.parametrize("where", ["the store", "its parent"])
def test_a_store_the_user_may_not_enter_is_eacces_not_no_store(shared: Path, where: str) -> None:
    """A store in a directory this user may not enter (or below one) is EACCES, exit 1:
    "not a store" or "does not exist" would send an operator to look for an unmounted
    share (found by reviews: NOT_A_STORE, exit 2, for every walking command, and for
    import below a parent it may not enter)."""
    root = shared / "hidden" / "store"
    root.parent.mkdir()
    SyncStore(root, create=True).append(KEY, [entry(1)])
    (root if where == "the store" else root.parent).chmod(0o700)  # root's: uid 65534 may not enter
    write_jsonl(shared / "local" / P / "s.jsonl", [{"type": "user", "uuid": "u1"}])  # for import
    for d in [shared / "local", *(shared / "local").rglob("*")]:
        d.chmod(0o755 if d.is_dir() else 0o644)
    for command in ("ls", "check", "gc", "locks", "cat", "import"):
        args = [command, root, *({"cat": [P, S], "import": [shared / "local"]}.get(command, []))]
        rc, out = as_nobody(*args)
        assert rc == 1 and "EACCES" in out and "NOT_A_STORE" not in out, (command, out)


def test_a_standard_stream_that_cannot_be_written_is_an_error_with_its_code(tmp_path: Path) -> None:
    """stdout on a full device, with and without ``--json``, on the error and the
    success paths: said on stderr with its code, the exit code the error's (ENOSPC: 1),
    no traceback and no "Exception ignored" (exit 120) from Python's flush at exit; a
    reader gone is 141; stdout closed (``>&-``): the command's own error, or EBADF where
    it succeeded; stderr full: the exit code alone. Found by reviews: the JSON of an
    error written to the stdout that had just failed (a traceback); a small output's
    failure left to the flush at exit (120, no code); ``>&-`` an AttributeError.
    Python's output is block-buffered here, as in a shell (not ``PYTHONUNBUFFERED``)."""
    root = tmp_path / "store"
    SyncStore(root, create=True).append(KEY, [entry(1)])
    (tmp_path / "plain").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}

    def run(*args: object, **kw: Any) -> subprocess.CompletedProcess[str]:
        kw.setdefault("stderr", subprocess.PIPE)
        proc = subprocess.run([sys.executable, "-m", "fsstore", *map(str, args)], check=False, text=True,
                              timeout=60, env=env, **kw)
        assert "Traceback" not in (proc.stderr or "") and "Exception ignored" not in (proc.stderr or ""), proc.stderr
        return proc

    with open("/dev/full", "w") as full:
        for where, rc, code in ((tmp_path / "missing", 2, "NOT_A_STORE"), (tmp_path / "plain", 2, "NOT_A_STORE"),
                                (root, 1, "ENOSPC")):  # (the listing itself cannot be written)
            for json_flag in (["--json"], []):
                proc = run("ls", where, *json_flag, stdout=full)
                assert proc.returncode == rc and code in proc.stderr, (where, json_flag, proc.stderr)
        assert run("ls", tmp_path / "missing", stdout=subprocess.PIPE, stderr=full).returncode == 2
        assert run("ls", "--bogus", root, stdout=subprocess.PIPE, stderr=full).returncode == 2  # a usage error
    assert run("ls", "--bogus", root, stdout=subprocess.PIPE, stderr=None,
               preexec_fn=lambda: os.close(2)).returncode == 2  # ... with stderr closed
    r, w = os.pipe()
    os.close(r)
    assert run("ls", root, stdout=w).returncode == 141  # a reader gone
    os.close(w)
    for where, rc, code in ((root, 1, "EBADF"), (tmp_path / "missing", 2, "NOT_A_STORE")):
        proc = run("ls", where, preexec_fn=lambda: os.close(1))
        assert proc.returncode == rc and code in proc.stderr, proc.stderr


def test_gc_never_takes_an_orphan_it_cannot_read_for_a_leftover(shared: Path) -> None:
    """A session a delete moved by mistake (an orphan: acknowledged batches, no mark)
    whose ``main/`` gc may not read is an orphan, not "a leftover of a delete": gc
    cannot tell it holds no batch (found by review: unreadable for a moment when gc
    sorted .trash, it was removed as a leftover once readable again, its 5 batches
    lost). Here it stays unreadable: gc fails to merge it, loudly, and keeps it; once
    readable, gc merges it."""
    root = shared / "store"
    batches = [[{"type": "user", "n": n}] for n in range(5)]
    orphan = orphan_of(root, batches, compact_every=0)
    chown_tree(shared, NOBODY)
    main = root / ".trash" / orphan / "main"
    main.chmod(0)
    rc, out = as_nobody("gc", root, "--older-than", "0s")
    assert rc == 1 and "leftover" not in out, out
    assert main.exists()
    main.chmod(0o700)
    rc, out = as_nobody("gc", root, "--older-than", "0s")
    assert rc == 0 and "merged into" in out, out
    assert SyncStore(root).load(KEY) == [entry(2), *(b[0] for b in batches)]


@pytest.mark.parametrize("mode", [0o000, 0o400], ids=["unreadable", "readable, not searchable"])
def test_gc_never_brings_back_a_deleted_sessions_tomb_it_cannot_look_into(shared: Path, mode: int) -> None:
    """A deleted session's tomb in .trash (its ``.deleted`` mark in ``main/``, its deleter
    killed before emptying it, nothing at its name) whose ``main/`` gc may not search:
    gc cannot see the mark, so it must not take the tomb for a session moved by mistake
    and move it back (found by review: with ``main/`` 0400, gc moved it back and ``ls``
    listed the deleted session again). It reports it, and once it can look, removes it."""
    root = shared / "store"
    store = SyncStore(root, create=True, compact_every=0)
    for n in range(3):
        store.append(KEY, [entry(n)])
    (tdir(root, KEY) / ".deleted").touch()  # the delete's commit point
    tomb = moved_by_a_dead_deleter(root)
    chown_tree(shared, NOBODY)
    (tomb / "main").chmod(mode)
    rc, out = as_nobody("gc", root, "--older-than", "0s")
    assert rc == 1 and "EACCES" in out and "moved back" not in out, out
    (tomb / "main").chmod(0o700)
    assert SyncStore(root).list_sessions(P) == []
    rc, out = as_nobody("gc", root, "--older-than", "0s")
    assert rc == 0, out
    assert SyncStore(root).load(KEY) is None and SyncStore(root).list_sessions(P) == []
