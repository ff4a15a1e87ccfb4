"""The store on a real FUSE mount: bindfs over a temp directory.

In every run: both SDK conformance suites, the multi-process workload, the kill -9
points and lock reclaim, with root on bindfs. As a soak test: the whole test suite
(tests/, this directory excepted) in a subprocess with ``FSSTORE_TEST_ROOT`` and
``--basetemp`` on bindfs, so that every store and every tmp_path is on FUSE.

bindfs supports ``RENAME_NOREPLACE`` but not ``RENAME_EXCHANGE`` -- like many FUSE
filesystems; NFS supports neither. That exposed a lock-reclaim bug (filelock only
takes a stale marker over by exchange, so a killed writer's lock stayed forever),
fixed in ac24c9e by fsstore reclaiming such markers itself.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from fsstore import FsSessionStore
from fsstore._store import SyncStore
from tests._helpers import NESTED_SUITE_SECONDS, nested_suite

from . import _children
from ._crash import named_point
from ._workload import run_workload

REPO = Path(__file__).resolve().parents[2]

def fresh(mount: Path, name: str) -> Path:
    d = mount / f"{name}-{time.monotonic_ns()}"
    d.mkdir()
    return d


def test_claude_conformance_suite_on_bindfs(bindfs_mount: Path) -> None:
    from claude_agent_sdk.testing import run_session_store_conformance

    base = fresh(bindfs_mount, "claude")
    n = itertools.count()
    anyio.run(run_session_store_conformance, lambda: FsSessionStore(base / f"store-{next(n)}", create=True))


def test_qoder_conformance_suite_on_bindfs(bindfs_mount: Path) -> None:
    from qoder_agent_sdk.testing import run_session_store_conformance

    base = fresh(bindfs_mount, "qoder")
    n = itertools.count()
    anyio.run(run_session_store_conformance, lambda: FsSessionStore(base / f"store-{next(n)}", create=True))


def test_concurrent_writers_on_bindfs(bindfs_mount: Path, procs: Any, figures: Any) -> None:
    run_workload(
        procs, str(fresh(bindfs_mount, "concurrency") / "store"), shared_writers=3, batches=20,
        opts={"compact_every": 8}, seed=11, figures=figures,
    )


@pytest.mark.parametrize("point", sorted(_children.POINTS))
def test_kill_9_on_bindfs_leaves_store_consistent(
    bindfs_mount: Path, procs: Any, figures: Any, point: str
) -> None:
    named_point(procs, fresh(bindfs_mount, "crash") / "store", figures, f"{point}")


def test_dead_holder_lock_is_reclaimed_on_bindfs(bindfs_mount: Path, procs: Any) -> None:
    root = str(fresh(bindfs_mount, "lock") / "store")
    key = {"project_key": "p", "session_id": "s"}
    parent, child = procs.Pipe(duplex=False)
    p = procs.Process(target=_children.hold_lock, args=(root, key, {"stale_lock_seconds": 1.0}, child))
    p.start()
    child.close()
    assert parent.poll(30) and parent.recv()[0] == "locked"
    p.kill()
    p.join(10)
    # dead on this host: at once; and in any case after stale_lock_seconds (1 s)
    SyncStore(root, create=True, stale_lock_seconds=1.0, lock_timeout_seconds=3.0).append(key, [{"n": 1}])


@pytest.mark.soak
@pytest.mark.timeout(NESTED_SUITE_SECONDS + 120)
def test_soak_whole_suite_on_bindfs(bindfs_mount: Path) -> None:
    """``FSSTORE_TEST_ROOT`` (honoured by tests/conftest.py) and ``--basetemp`` on bindfs."""
    base = fresh(bindfs_mount, "suite")
    env = {**os.environ, "FSSTORE_TEST_ROOT": str(base / "roots")}
    r = nested_suite(f"--basetemp={base / 'basetemp'}", "--ignore=tests/reliability", "tests",
                     env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_subkeys_of_a_session_another_host_moved_after_the_listing_read_them_are_listed(
    bindfs_mount: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review (stop 29, sshfs): a delete whose lock was overtaken, on another host, moved
    a session made anew into .trash after ``list_subkeys`` had read its ``subkeys/``.
    Where a directory handle goes by path (sshfs, bindfs: FUSE's path-based API, which
    does not see a rename made on the server), the look at each subagent transcript
    then failed, and the listing's re-read of ``subkeys/`` failed too (the record of
    that delete is in ``sessions/``): nothing listed. It moves the session back, as it
    does where it finds it gone when it opens it, and looks again."""
    from fsstore import _listing
    from tests._helpers import moved_by_a_dead_deleter

    from ._check import batch

    d = fresh(bindfs_mount, "subkeys")
    root, server = d / "store", bindfs_mount.parent / "src" / d.name / "store"
    key = {"project_key": "p", "session_id": "s"}
    sub = {**key, "subpath": "agents/a1"}
    store = SyncStore(root, create=True)
    store.append(key, batch("m", 0, 1))
    store.append(sub, batch("a", 0, 1))
    # FUSE's entry cache (1 s): the first batches' looks up of the path lapse, so the
    # listing's look goes to bindfs, which sees the move (stop 39: within the second
    # the cached entry answered, and the listing listed it without moving it back).
    time.sleep(1.1)
    real_scan, staged = _listing.scan_children, []

    def scan_then_move(pfd: int) -> Any:
        found = real_scan(pfd)
        if not staged:  # on the "server", as the other host's rename is
            staged.append(moved_by_a_dead_deleter(server, key))
        return found

    monkeypatch.setattr(_listing, "scan_children", scan_then_move)
    assert SyncStore(root).list_subkeys(key) == [sub["subpath"]]
    assert staged and not staged[0].exists()
    monkeypatch.undo()
    assert [e["w"] for e in SyncStore(root).load(sub) or []] == ["a"]


REMADE = {"project_key": "p", "session_id": "s"}


def _old_session(mount: Path, name: str, batches: int) -> tuple[Path, Path, SyncStore]:
    """A session of ``batches`` old batches on bindfs: the store's root through the
    mount, the same directory on the "server" (bindfs's underlying one), the store."""
    from ._check import batch

    d = fresh(mount, name)
    store = SyncStore(d / "store", create=True, compact_every=0)
    for b in range(batches):
        store.append(REMADE, batch("old", b, 1))
    return d / "store", mount.parent / "src" / d.name / "store", store


def _the_other_host_deletes_and_remakes(server: Path, key: dict[str, str], batches: int,
                                        stale: float = 30.0) -> None:
    """On the "server" (bindfs's underlying directory), as another host would: delete
    the session and write ``batches`` new batches at its key."""
    from ._check import batch

    other = SyncStore(server, compact_every=0, stale_lock_seconds=stale)
    other.delete(key)
    for b in range(batches):
        other.append(key, batch("new", b, 1))


def test_a_compaction_that_read_before_the_other_host_remade_the_session_keeps_out_of_the_new_one(
    bindfs_mount: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review (stop 31, sshfs: 3 of 3, and on its own in campaigns): a compaction read
    parts 1-6, then another host deleted the session and wrote 8 new batches at the
    key. Where a directory handle goes by path (sshfs, bindfs), the compaction's handle
    then named the new session: it published its segment 1-6 of deleted batches there,
    and every load returned them in place of the 6 acknowledged new ones (left on disk
    as misplaced parts). It now checks, under the lock, that the file it read first is
    still the same, and looks again."""
    from fsstore import _compact

    root, server, store = _old_session(bindfs_mount, "remade", 6)
    key = REMADE
    real = _compact.compact

    def read_then_remade(fs: Any, dfd: int, path: str, hold: Any, **kw: Any) -> int:
        def hold_after_remade() -> Any:  # the compaction's first hold comes after its reads
            if not staged:
                staged.append(True)
                _the_other_host_deletes_and_remakes(server, key, 8)
            return hold()
        return real(fs, dfd, path, hold_after_remade, **kw)

    staged: list[bool] = []
    monkeypatch.setattr(_compact, "compact", read_then_remade)
    store.compact(key)
    monkeypatch.undo()
    assert staged
    assert [(e["w"], e["b"]) for e in SyncStore(root).load(key) or []] == [("new", b) for b in range(8)]


def test_a_load_that_read_before_the_other_host_remade_the_session_returns_one_of_them(
    bindfs_mount: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review (stop 31, sshfs: 3 of 3): a load read its first file, then another host
    deleted the session and wrote as many new batches at the key; where a directory
    handle goes by path, the load read the rest from the new session under the same
    names and returned ``[old 0, new 1, new 2]``. A load racing a delete returns the
    whole transcript or None (or the new one, whole): it now checks that the file it
    read first is still the same, and reads again."""
    from fsstore import _read

    _root, server, store = _old_session(bindfs_mount, "torn", 3)
    key = REMADE
    real = _read.read_file

    def read_then_remade(dir_fd: int, name: str, **kw: Any) -> bytes:
        data = real(dir_fd, name, **kw)
        if not staged:
            staged.append(name)
            _the_other_host_deletes_and_remakes(server, key, 3)
        return data

    staged: list[str] = []
    monkeypatch.setattr(_read, "read_file", read_then_remade)
    got = [(e["w"], e["b"]) for e in store.load(key) or []]
    monkeypatch.undo()
    assert staged
    assert got == [("new", b) for b in range(3)], got


def test_a_compaction_stalled_past_its_lease_before_its_unlinks_leaves_a_remade_session_whole(
    bindfs_mount: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review (stop 31, sshfs: 4 of 4): a compaction published its segment, then stalled
    past its lease after its second hold's look and before its unlinks; another host
    reclaimed the lock, deleted the session and made it anew with 6 acknowledged
    batches; the compaction's unlinks of the merged names, through a handle that goes
    by path, removed them. It checks its lease before each unlink."""
    from fsstore import _compact, _read

    root, server, store = _old_session(bindfs_mount, "tidy", 6)
    store = SyncStore(root, stale_lock_seconds=1.0, compact_every=0)  # a lease of 0.5 s
    real, looks = _read.still, []

    def still_then_stalled(dir_fd: int, name: str, data: bytes) -> bool:
        same = real(dir_fd, name, data)
        looks.append(name)
        if len(looks) == 2:  # the second hold's look at its segment: the other host acts
            _the_other_host_deletes_and_remakes(server, REMADE, 6, stale=1.0)  # reclaims it
        return same

    monkeypatch.setattr(_compact._read, "still", still_then_stalled)
    store.compact(REMADE)
    monkeypatch.undo()
    assert len(looks) == 2
    assert [(e["w"], e["b"]) for e in SyncStore(server).load(REMADE) or []] == [("new", b) for b in range(6)]
