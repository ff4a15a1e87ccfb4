"""Deletes stalled past their lease, in real processes (``strace -e
inject=renameat:delay_enter``: every rename of the deleter waits seconds, so its lock
is overtaken between its mark and its move, and between its move and its move back).

The cases of stop 14's adversarial reviews, each of which lost, hid or brought back a
batch before its fix (docs/reliability.md): a stalled delete moves a session another
writer made anew after its mark, and must neither hide it (the next load moves it
back), nor bring it back after a delete that began later, nor let a delete that began
earlier than the batch take it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fsstore._store import SyncStore

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")]

KEY = {"project_key": "p", "session_id": "s"}
STALE = {"stale_lock_seconds": 1.0, "lock_timeout_seconds": 20.0}


def _batch(name: str) -> list[dict[str, Any]]:
    return [{"uuid": name, "b": name}]


def _names(store: SyncStore) -> list[str] | None:
    got = store.load(KEY)
    return None if got is None else [e["b"] for e in got]


class _StalledDelete:
    """``delete(KEY)`` in a process whose every ``syscall`` (``renameat`` unless said)
    waits ``delay`` seconds, before it runs (``when="enter"``), after (``"exit"``:
    what it returns is from before the wait) or both (``"enter:exit"``); started when
    :meth:`go` is called (imports done, strace attached)."""

    def __init__(self, root: Path, delay: float, syscall: str = "renameat", when: str = "enter",
                 op: str = f"s.delete({KEY!r})") -> None:
        code = (f"import sys; from fsstore._store import SyncStore; "
                f"s = SyncStore({str(root)!r}, **{STALE!r}); print('ready', flush=True); "
                f"sys.stdin.readline(); {op}; print('done', flush=True)")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        self.strace = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", "/dev/null", "-p", str(self.proc.pid), "-e", f"trace={syscall}",
             "-e", f"inject={syscall}:" + ":".join(f"delay_{w}={int(delay * 1e6)}" for w in when.split(":"))])
        _until(lambda: _traced(self.proc.pid))

    def go(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return time.monotonic()

    def wait(self) -> None:
        out, _ = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0 and out.strip() == "done", out

    def kill(self) -> None:
        for proc in (self.proc, self.strace):
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def _traced(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line for line in status.splitlines() if line.startswith("TracerPid:")).split()[1] != "0"


def _until(what: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _moved_by_mistake(root: Path) -> bool:
    return any(p.name.endswith("-deleted") and not (p / "main" / ".deleted").exists()
               for p in (root / ".trash").iterdir())


def _move_by_mistake(store: SyncStore, d: _StalledDelete) -> None:
    """D marks the session and stalls in its rename; b1 finishes D's delete and makes
    the session anew; D's rename moves that one into .trash by mistake."""
    started = d.go()
    _until(lambda: time.monotonic() - started > 1.5)  # D marked, stalls in its rename
    store.append(KEY, _batch("b1"))
    _until(lambda: _moved_by_mistake(Path(store.root)))


@pytest.fixture
def store(tmp_path: Path) -> SyncStore:
    s = SyncStore(tmp_path / "store", create=True, **STALE)
    s.append(KEY, _batch("b0"))
    return s


def test_a_session_a_stalled_delete_moved_by_mistake_is_in_the_next_load_and_gone_after_a_later_delete(
    store: SyncStore
) -> None:
    """b1 is acknowledged after the stalled delete D began (D's mark was finished by the
    writer, who made the session anew); D's rename then moves that session into .trash.
    A load meanwhile sees b1 (it moves the session back); a delete E that begins after
    b1 takes it, and D, still stalled, never brings it back; b2, after E, stays."""
    root = Path(store.root)
    d = _StalledDelete(root, 3.0)
    try:
        _move_by_mistake(store, d)
        assert _names(store) == ["b1"]
        store.delete(KEY)
        assert _names(store) is None
        store.append(KEY, _batch("b2"))
        d.wait()
        time.sleep(0.2)
        assert _names(store) == ["b2"]
    finally:
        d.kill()
    check = subprocess.run([sys.executable, "-m", "fsstore", "check", str(root)],
                           check=False, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout


def test_a_stalled_delete_never_takes_a_batch_acknowledged_after_another_stalled_delete_moved_it(
    store: SyncStore
) -> None:
    """Review: D marks S0 and stalls; b1 remakes the session (S1); D2 begins, marks S1 and
    stalls; b2 finishes D2's delete and remakes it (S2); D's rename moves S2 into .trash
    by mistake, D2's finds nothing. D2 must not claim what D moved after D2 began: b2
    stays (it was lost: D2 marked it, D moved it back marked)."""
    root = Path(store.root)
    d, d2 = _StalledDelete(root, 4.0), _StalledDelete(root, 3.0)
    try:
        started = d.go()
        _until(lambda: time.monotonic() - started > 1.5)
        store.append(KEY, _batch("b1"))
        d2.go()
        time.sleep(1.0)
        store.append(KEY, _batch("b2"))
        d2.wait()
        d.wait()
        time.sleep(0.2)
        assert _names(store) == ["b2"]
    finally:
        d.kill()
        d2.kill()


def test_a_delete_takes_the_session_it_began_with_though_a_stalled_delete_moves_it_meanwhile(
    store: SyncStore
) -> None:
    """Review: D marks S0 and stalls in its rename; b1 finishes D's delete and remakes
    the session (S1); E begins (b1 acknowledged) and stalls in its listings; D's
    rename moves S1 into .trash by mistake after E has looked at .trash and before E
    looks at the name, and D moves it back after E is done. E must take S1 all the
    same (it was at the name when E began): b1 came back after E returned."""
    root = Path(store.root)
    d = _StalledDelete(root, 6.0)  # moves S1 at ~6 s, moves it back at ~12 s
    e = _StalledDelete(root, 1.5, "getdents64", "exit")  # each listing takes 3 s
    try:
        started = d.go()
        _until(lambda: time.monotonic() - started > 1.5)  # D marked, stalls in its rename
        store.append(KEY, _batch("b1"))
        e.go()
        e.wait()
        d.wait()
        time.sleep(0.2)
        assert _names(store) is None
        store.append(KEY, _batch("b2"))
        assert _names(store) == ["b2"]
    finally:
        d.kill()
        e.kill()


@pytest.mark.parametrize("finder", ["list_sessions", "gc"])
def test_a_session_a_stalled_delete_moved_by_mistake_and_died_is_listed_again(
    store: SyncStore, finder: str
) -> None:
    """D marks S0 and stalls in its rename; b1 finishes D's delete and remakes the session
    (S1); D's rename moves S1 into .trash by mistake, and D is killed (kill -9) in its
    move back. Nothing names the session any more (.trash names carry a hash): the next
    `list_sessions` must list it all the same (it was hidden until a load or append of
    it by name), or `fsstore gc` move it back once old (it kept it as an orphan)."""
    root = Path(store.root)
    d = _StalledDelete(root, 3.0)
    try:
        _move_by_mistake(store, d)  # D stalls in its move back
        d.proc.kill()
        d.proc.wait(10)
        assert _moved_by_mistake(root)
    finally:
        d.kill()
    other = SyncStore(root, **STALE)
    if finder == "gc":
        time.sleep(1.1)
        dry = subprocess.run([sys.executable, "-m", "fsstore", "gc", str(root), "--older-than", "1s", "--dry-run"],
                             check=False, capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0 and "would move back" in dry.stdout and _moved_by_mistake(root), dry.stdout
        gc = subprocess.run([sys.executable, "-m", "fsstore", "gc", str(root), "--older-than", "1s"],
                            check=False, capture_output=True, text=True, timeout=60)
        assert gc.returncode == 0 and "moved back" in gc.stdout, gc.stdout + gc.stderr
        assert not _moved_by_mistake(root)
    assert [s["session_id"] for s in other.list_sessions("p")] == ["s"]
    assert _names(other) == ["b1"]
    check = subprocess.run([sys.executable, "-m", "fsstore", "check", str(root)],
                           check=False, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "-moving" not in check.stdout, check.stdout  # its record went with it


def test_gc_keeps_the_record_of_a_deleter_stalled_past_its_threshold(store: SyncStore) -> None:
    """Review: D stalls (6 s) between writing its record and its rename; `fsstore gc
    --older-than 1s` at 2.8 s removes the record (old, and nothing in .trash yet); b1
    remakes the session, D's rename moves it by mistake, and D is killed in its move
    back. D renews its record after the rename, so the next listing lists the session
    (it was hidden: no record named it)."""
    root = Path(store.root)
    d = _StalledDelete(root, 6.0)
    try:
        started = d.go()
        _until(lambda: time.monotonic() - started > 1.5)  # D marked, wrote its record, stalls
        store.append(KEY, _batch("b1"))
        _until(lambda: time.monotonic() - started > 2.8)
        gc = subprocess.run([sys.executable, "-m", "fsstore", "gc", str(root), "--older-than", "1s"],
                            check=False, capture_output=True, text=True, timeout=60)
        assert gc.returncode == 0, gc.stdout + gc.stderr
        _until(lambda: _moved_by_mistake(root))
        time.sleep(1.0)  # D is in its move back's stall
        d.proc.kill()
        d.proc.wait(10)
    finally:
        d.kill()
    other = SyncStore(root, **STALE)
    assert [s["session_id"] for s in other.list_sessions("p")] == ["s"]
    assert _names(other) == ["b1"]


def test_a_session_a_deleter_killed_before_renewing_its_record_moved_by_mistake_is_moved_back_by_gc(
    store: SyncStore,
) -> None:
    """Review of stop 20: as above, but D is killed in the rename's return, before it
    renews its record: nothing beside the session's name says where it went, and a
    listing leaves it out. `fsstore gc` moves it back all the same, by the name its
    `.trash` name carries (it kept it as an orphan for good: 3 of 3)."""
    root = Path(store.root)
    d = _StalledDelete(root, 6.0, when="enter:exit")
    try:
        started = d.go()
        _until(lambda: time.monotonic() - started > 1.5)
        store.append(KEY, _batch("b1"))
        _until(lambda: time.monotonic() - started > 2.8)
        gc = subprocess.run([sys.executable, "-m", "fsstore", "gc", str(root), "--older-than", "1s"],
                            check=False, capture_output=True, text=True, timeout=60)
        assert gc.returncode == 0, gc.stdout + gc.stderr
        _until(lambda: _moved_by_mistake(root))  # D's rename is done: it waits in its return
        d.proc.kill()
        d.proc.wait(10)
    finally:
        d.kill()
    other = SyncStore(root, **STALE)
    assert other.list_sessions("p") == []  # hidden, until the next gc
    time.sleep(1.1)
    gc = subprocess.run([sys.executable, "-m", "fsstore", "gc", str(root), "--older-than", "1s"],
                        check=False, capture_output=True, text=True, timeout=60)
    assert gc.returncode == 0 and "moved back into" in gc.stdout, gc.stdout + gc.stderr
    assert [s["session_id"] for s in other.list_sessions("p")] == ["s"]
    assert _names(other) == ["b1"]


def test_a_stalled_delete_never_takes_a_session_a_prune_marked_and_kept(store: SyncStore) -> None:
    """Review: D marks S0 and stalls in its rename; b1 finishes D's delete and makes the
    session anew (S1); a prune marks S1 and looks slowly (every getdents waits 0.1 s),
    and keeps it (written to meanwhile); D's rename lands in between and moves S1 with
    the prune's marks in it. D took them for its own and emptied S1 (b1 lost: 13 of 13
    runs where the timing landed). Since stop 22 a prune's marks are no delete's before
    its commit (a ``-pruning`` temp file, not ``.deleted``): D finds S1 unmarked and puts
    it back."""
    root = Path(store.root)
    d = _StalledDelete(root, 4.7)
    prune = _StalledDelete(root, 0.1, syscall="getdents64", op=(
        f"__import__('fsstore._cleanup')._cleanup.prune({str(root)!r}, older_than=1.0, "
        "stale_lock_seconds=1.0, lock_timeout_seconds=20.0)"))
    try:
        started = d.go()
        _until(lambda: time.monotonic() - started > 1.5)  # D marked, stalls in its rename
        store.append(KEY, _batch("b1"))
        _until(lambda: time.monotonic() - started > 2.7)
        prune.go()
        prune.wait()
        d.wait()
    finally:
        d.kill()
        prune.kill()
    assert _names(store) == ["b1"]
    check = subprocess.run([sys.executable, "-m", "fsstore", "check", str(root)],
                           check=False, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout


def test_a_stalled_delete_whose_ticket_gc_removed_still_deletes_the_session_it_marked(
    store: SyncStore,
) -> None:
    """Review of the rule above: D stalls in its rename longer than `fsstore gc
    --older-than`, which removes D's ticket (an old temp file); D's rename then moves the
    very session it marked, without its ticket: D put it back at its name, marked, and
    returned with the session still listed (6 of 6, when a delete took only what held
    its ticket). Every ``.deleted`` is a committed delete's (since stop 22 a prune's
    marks are not ``.deleted`` before its commit): D empties what it moved, marked."""
    root = Path(store.root)
    time.sleep(1.0)
    d = _StalledDelete(root, 4.0)
    try:
        started = d.go()
        _until(lambda: time.monotonic() - started > 2.2)  # D marked, stalls in its rename
        gc = subprocess.run([sys.executable, "-m", "fsstore", "gc", str(root), "--older-than", "1s"],
                            check=False, capture_output=True, text=True, timeout=60)
        assert gc.returncode == 0 and ".tmp-" in gc.stdout, gc.stdout + gc.stderr  # its ticket, its record
        d.wait()
    finally:
        d.kill()
    other = SyncStore(root, **STALE)
    assert other.list_sessions("p") == [] and _names(other) is None


@pytest.mark.soak  # the mechanism it guarded went in stop 22 (a prune never makes .deleted)
def test_a_prune_that_keeps_a_session_takes_back_only_the_marks_it_made(store: SyncStore) -> None:
    """Review: a prune that kept a session (its look took too long: every getdents waits
    0.2 s) took back every mark in it, a dead deleter's too: the deleted session came
    back (6 of 6, after a stalled delete put its own marked session back). A prune's
    marks are temp files of its own (since stop 22), and ``.deleted`` is never taken
    back."""
    root = Path(store.root)
    (root / "projects" / "p" / "sessions" / "s" / "main" / ".deleted").touch()  # D died after its mark
    time.sleep(0.6)
    prune = _StalledDelete(root, 0.2, syscall="getdents64", op=(
        f"__import__('fsstore._cleanup')._cleanup.prune({str(root)!r}, older_than=0.5, "
        "stale_lock_seconds=1.0, lock_timeout_seconds=20.0)"))
    try:
        prune.go()
        prune.wait()
    finally:
        prune.kill()
    other = SyncStore(root, **STALE)
    assert _names(other) is None and other.list_sessions("p") == []


@pytest.mark.soak  # the mechanism it guarded went in stop 22 (a prune never makes .deleted)
def test_a_delete_whose_marks_a_prune_took_back_marks_again(store: SyncStore) -> None:
    """Review: a prune marks the session and stalls (its look: here a keep() that sleeps
    2.5 s, then keeps); a delete D takes over the stale lock, finds the marks made (it
    makes none) and stalls in its rename; gc removes D's ticket; the prune takes its
    marks back; D's rename moves the session it marked, unmarked, and puts it back. D
    then returned, the session still there for good (10 of 10). Since stop 22 a prune's
    marks are not ``.deleted``: D makes its own, which nobody takes back."""
    root = Path(store.root)
    store.append({**KEY, "subpath": "agents/a"}, _batch("a1"))
    prune = _StalledDelete(root, 0.001, syscall="getdents64", op=(
        f"s.delete_unless({KEY!r}, lambda: __import__('time').sleep(2.5) or True)"))
    d = _StalledDelete(root, 3.5)
    try:
        started = prune.go()
        _until(lambda: time.monotonic() - started > 1.4)  # its lock is stale
        d.go()
        _until(lambda: time.monotonic() - started > 3.6)  # D's ticket is older than 1 s
        gc = subprocess.run([sys.executable, "-m", "fsstore", "gc", str(root), "--older-than", "1s"],
                            check=False, capture_output=True, text=True, timeout=60)
        assert gc.returncode == 0 and "-claim" in gc.stdout, gc.stdout + gc.stderr
        prune.wait()
        d.wait()
    finally:
        prune.kill()
        d.kill()
    other = SyncStore(root, **STALE)
    assert other.list_sessions("p") == [] and _names(other) is None
    assert other.load({**KEY, "subpath": "agents/a"}) is None


def test_a_prune_killed_after_its_marks_deletes_nothing(store: SyncStore) -> None:
    """Review (stop 21, open until stop 22): b1 is appended after a prune's first look
    (the session looked old) and before its marks; the prune is killed before its last
    look, which would have kept the session. The next load took the prune's marks for a
    committed delete, finished it, and b1 was lost. A prune's mark is a delete only
    once its last look has passed (renamed to ``.deleted``): a dead prune's is ignored
    by readers, taken back by the next append, and removed by ``fsstore gc`` once old."""
    root = Path(store.root)
    store.append(KEY, _batch("b1"))  # after the prune's (notional) first look
    marked = root / "marked"
    prune = _StalledDelete(root, 0.001, syscall="getdents64", op=(
        f"s.delete_unless({KEY!r}, lambda: open({str(marked)!r}, 'w').close() or "
        "__import__('time').sleep(60))"))
    try:
        prune.go()
        _until(marked.exists)  # marked; its last look under way
    finally:
        prune.kill()
    other = SyncStore(root, **STALE)
    assert _names(other) == ["b0", "b1"] and other.list_sessions("p") != []
    other.append(KEY, _batch("b2"))
    assert _names(other) == ["b0", "b1", "b2"]
    main = root / "projects" / "p" / "sessions" / "s" / "main"
    assert sorted(p.name for p in main.iterdir() if p.name.startswith(".")) == []  # taken back
    check = subprocess.run([sys.executable, "-m", "fsstore", "check", str(root)],
                           check=False, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout


@pytest.mark.parametrize("into", ["the main transcript", "a subagent transcript", "a new subagent transcript"])
def test_an_append_after_a_prunes_last_look_keeps_the_session(store: SyncStore, into: str) -> None:
    """A prune that stalls between its last look (which said delete) and its commit,
    long enough for its lock to be overtaken: an append made meanwhile, into any
    transcript of the session, removes the prune's marks, and the prune keeps the
    session (before stop 22 the append found a committed mark, took b0's session to
    .trash with it and started a new one)."""
    root = Path(store.root)
    sub = {**KEY, "subpath": "agents/a"}
    if into == "a subagent transcript":
        store.append(sub, _batch("a0"))
    key = KEY if into == "the main transcript" else sub
    looked, result = root / "looked", root / "result"
    prune = _StalledDelete(root, 0.001, syscall="getdents64", op=(
        f"open({str(result)!r}, 'w').write(repr(s.delete_unless({KEY!r}, lambda: "
        f"open({str(looked)!r}, 'w').close() or __import__('time').sleep(2.5) or False)))"))
    try:
        prune.go()
        _until(looked.exists)  # marked, looked: about to commit, stalled
        store.append(key, _batch("b1"))
        prune.wait()
    finally:
        prune.kill()
    assert result.read_text() == "False"  # kept
    other = SyncStore(root, **STALE)
    assert _names(other) == (["b0", "b1"] if key is KEY else ["b0"])
    if key is not KEY:
        got = other.load(sub)
        assert got is not None and [e["b"] for e in got][-1] == "b1"
    leftovers = [p for p in root.rglob("*-pruning")]
    assert leftovers == []


def test_gc_never_empties_a_new_session_a_stalled_writer_is_publishing(store: SyncStore) -> None:
    """Review (stop 22, 3 of 3, and with gc's clock 10 min ahead instead of the stall, 3
    of 3): a writer's first commit into a new session stalls (every rename 2.5 s) before
    it publishes the directory it made under a temp name, longer than `fsstore gc
    --older-than 1s`; gc emptied that temp directory in place, the writer's rename
    published it empty and its append returned: the batch lost, `check` exit 0. gc now
    takes a temp directory off its name before emptying it: the writer's rename fails
    and it starts over."""
    root = Path(store.root)
    new = {"project_key": "p", "session_id": "new"}
    w = _StalledDelete(root, 2.5, syscall="renameat,renameat2", op=f"s.append({new!r}, {_batch('x')!r})")
    session = root / "projects" / "p" / "sessions" / "new"
    try:
        w.go()
        _until(lambda: session.is_dir() and any(p.name.endswith("-dir") for p in session.iterdir()))
        time.sleep(1.2)  # older than gc's threshold
        gc = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=unlinkat",
                             "-e", "inject=unlinkat:delay_exit=3000000:when=1",  # between emptying and rmdir
                             sys.executable, "-m", "fsstore", "gc", str(root), "--older-than", "1s"],
                            check=False, capture_output=True, text=True, timeout=60)
        assert gc.returncode == 0, gc.stdout + gc.stderr
        w.wait()
    finally:
        w.kill()
    got = SyncStore(root, **STALE).load(new)
    assert got is not None and [e["b"] for e in got] == ["x"]


_PRUNE = ("__import__('fsstore._cleanup')._cleanup.prune(s.root, older_than=1.0, "
          "stale_lock_seconds=1.0, lock_timeout_seconds=20.0)")


@pytest.mark.parametrize("made_anew", ["the session", "a subagent transcript"])
def test_a_prune_never_deletes_what_was_deleted_and_made_anew_after_its_first_look(
    store: SyncStore, made_anew: str
) -> None:
    """Review (stop 22; a prune stalled before its lock, 10 of 10, also on GlusterFS; and
    two prunes with no stall, 4 of 40): after a prune's first look the session (or a
    subagent transcript) was deleted and made anew by an append, its one part at the
    same name as before; the last look compared names only, and the prune deleted the
    batch acknowledged after its first look. Files are told by inode number and ctime
    too."""
    root = Path(store.root)
    sub = {**KEY, "subpath": "agents/a"}
    if made_anew != "the session":
        store.append(sub, _batch("a0"))
    time.sleep(1.2)  # old
    prune = _StalledDelete(root, 3.0, syscall="linkat", op=_PRUNE)  # its first lock: after its first look
    try:
        prune.go()
        time.sleep(1.0)  # looked, waits in linkat
        key = KEY if made_anew == "the session" else sub
        store.delete(key)
        store.append(key, _batch("b1"))
        prune.wait()
    finally:
        prune.kill()
    got = SyncStore(root, **STALE).load(key)
    assert got is not None and [e["b"] for e in got] == ["b1"]


def test_prune_deletes_a_session_of_subagent_transcripts_only(store: SyncStore) -> None:
    """Review (stop 22; also before): prune's mark makes main/ where a session has none,
    and its last look took that for a transcript added meanwhile: such a session was
    never pruned."""
    root = Path(store.root)
    for sid in ("subs-only", "left"):
        store.append({"project_key": "p", "session_id": sid, "subpath": "agents/a"}, _batch("a0"))
    (root / "projects" / "p" / "sessions" / "left" / "main").mkdir()  # a dead prune's, emptied
    time.sleep(1.2)
    out = subprocess.run([sys.executable, "-m", "fsstore", "prune", str(root), "--older-than", "1s"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert SyncStore(root, **STALE).list_sessions("p") == []


@pytest.mark.parametrize("mover", ["its deleter", "a listing"])
def test_a_session_a_delete_claimed_in_trash_is_not_moved_back_after_it_returned(
    store: SyncStore, mover: str
) -> None:
    """Review: D1 (stalled) moves the session b1 made anew into .trash by mistake; before
    it, or a listing that saw its record, moves it back (each stalled in that rename,
    having looked: unmarked), a delete D2 begins, claims it there and returns. The move
    back must not land: the session was listed (and `check` saw a marked session at the
    name) after D2 returned, until a load or append finished the delete."""
    root = Path(store.root)
    d1 = _StalledDelete(root, 4.0 if mover == "its deleter" else 8.0)
    lister = (_StalledDelete(root, 3.0, op="s.list_sessions('p')") if mover == "a listing" else None)
    try:
        started = d1.go()
        _until(lambda: time.monotonic() - started > 1.5)
        store.append(KEY, _batch("b1"))
        _until(lambda: _moved_by_mistake(root))
        if lister is not None:
            lister.go()
            time.sleep(0.5)  # it read D1's record, looked at the session (unmarked), stalls
        time.sleep(0.3)
        store.delete(KEY)
        if lister is not None:
            lister.wait()
        d1.wait()
    finally:
        d1.kill()
        if lister is not None:
            lister.kill()
    time.sleep(0.2)
    assert store.list_sessions("p") == [] and store.list_session_summaries("p") == []
    check = subprocess.run([sys.executable, "-m", "fsstore", "check", str(root)],
                           check=False, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout
    assert _names(store) is None
