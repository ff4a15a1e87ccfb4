"""Stores written by format 1 (fixtures made by fsstore at 131b31c): they load as
they are, and `fsstore migrate` / `fsstore check --repair` bring back what format 1
could not read, losing nothing."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from fsstore import FsSessionStore

from ._helpers import tdir
from .conftest import KEY

FIXTURES = Path(__file__).parent / "fixtures"
REPO = str(Path(__file__).parent.parent)


def _extract(name: str, dest: Path) -> Path:
    with tarfile.open(FIXTURES / name) as tar:
        tar.extractall(dest, filter="data")
    return dest / "store"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsstore", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120, check=False)


def test_a_format_1_store_loads_as_it_is_and_takes_appends(tmp_path: Path) -> None:
    root = _extract("format1-store.tar.gz", tmp_path)
    expected: dict[str, Any] = json.loads((root / "EXPECTED.json").read_text())
    store = FsSessionStore(root, create=True).sync
    for k, entries in expected.items():
        assert store.load(json.loads(k)) == entries
    assert len(store.list_sessions("-home-alice-repo")) == 2
    key = json.loads(next(iter(expected)))
    store.append(key, [{"uuid": "after-upgrade"}])
    assert store.load(key) == [*expected[next(iter(expected))], {"uuid": "after-upgrade"}]
    out = _cli("migrate", str(root))
    assert out.returncode == 0, out.stdout + out.stderr
    assert not list(root.rglob(".state.spare"))
    # (the fixtures' files are as old as the fixture: leftovers count as young)
    assert _cli("check", str(root), "--older-than", "3650d").returncode == 0


def test_migrate_recovers_a_transcript_format_1_left_corrupt(tmp_path: Path) -> None:
    """The fixture: four format-1 writers, one with its clock 10 minutes ahead; two
    lock holders overlapped and a batch was committed inside a compacted segment's
    range, which format 1 refused to load (CORRUPT) and format 2 alone would skip.
    migrate commits it again above; every acknowledged batch is back, once."""
    root = _extract("format1-corrupt.tar.gz", tmp_path)
    acked = set(json.loads((root / "ACKED.json").read_text()))
    key = {"project_key": "-overlap", "session_id": "s"}

    def batches() -> list[str]:
        got = FsSessionStore(root, create=True).sync.load(key) or []
        return [e["b"] for e in got if e["uuid"].endswith("-0")]

    assert not acked <= set(batches())  # format 2 alone skips the misplaced batch
    dry = _cli("migrate", str(root), "--dry-run")
    assert dry.returncode == 0 and "would commit again" in dry.stdout, dry.stdout + dry.stderr
    assert not acked <= set(batches())  # a dry run changes nothing
    out = _cli("migrate", str(root))
    assert out.returncode == 0, out.stdout + out.stderr
    got = batches()
    assert acked <= set(got) and len(got) == len(set(got))
    again = _cli("migrate", str(root), "--json")
    assert json.loads(again.stdout)["actions"] == [a for a in json.loads(again.stdout)["actions"]
                                                   if a["action"] == "remove"]  # idempotent
    # (the fixtures' files are as old as the fixture: leftovers count as young)
    assert _cli("check", str(root), "--older-than", "3650d").returncode == 0


def _one_transcript(tmp_path: Path, batches: list[list[dict[str, Any]]]) -> tuple[Path, Any, dict[str, str], Path]:
    """A store at ``tmp_path/store`` with ``batches`` appended to one main transcript:
    the root, its blocking store, the key and the transcript's directory."""
    root = tmp_path / "store"
    store = FsSessionStore(root, create=True).sync
    key = {"project_key": "p", "session_id": "s"}
    for entries in batches:
        store.append(key, entries)
    return root, store, key, root / "projects/p/sessions/s/main"


def test_check_repair_closes_a_gap_and_names_what_was_lost(tmp_path: Path) -> None:
    root, store, key, main = _one_transcript(tmp_path, [[{"uuid": f"u{i}"}] for i in range(5)])
    (main / "00000000000000000003.jsonl").rename(tmp_path / "moved-aside")  # damaged, moved by hand
    assert _cli("check", str(root)).returncode == 1
    out = _cli("check", str(root), "--repair")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "lost (gone before the repair): parts 3" in out.stdout
    assert store.load(key) == [{"uuid": f"u{i}"} for i in (0, 1, 3, 4)]
    store.append(key, [{"uuid": "u5"}])
    assert [e["uuid"] for e in store.load(key) or []] == ["u0", "u1", "u3", "u4", "u5"]


def test_check_repair_empties_parts_a_power_loss_left_unreadable_and_loses_nothing_else(
        tmp_path: Path) -> None:
    """With fsync=False a power loss leaves the last seconds' parts empty or torn
    (tests/reliability/test_power_loss.py) and every load CORRUPT; check --repair makes
    them lost batches' parts (no entry) and says their batches are lost: the rest loads,
    appends go on. A garbled line in a whole file is no power loss's: it stays, for the
    operator."""
    root, store, key, main = _one_transcript(
        tmp_path, [[{"uuid": f"u{i}"}, {"uuid": f"v{i}"}] for i in range(6)])
    (main / "00000000000000000003.jsonl").write_bytes(b"")  # empty
    (main / "00000000000000000006.jsonl").write_bytes(b'{"uuid":"u5"}\n{"uu')  # torn, the highest
    (main / "00000000000000000002.jsonl").write_bytes(b'{"uuid":"u1"}\n{"uuid" "v1"}\n')  # garbled
    before = {p.name: p.read_bytes() for p in main.iterdir()}
    with pytest.raises(Exception, match="CORRUPT"):
        store.load(key)
    dry = _cli("check", str(root), "--repair", "--dry-run")
    assert dry.returncode == 1, dry.stdout + dry.stderr  # (what check found is still there)
    assert "00000000000000000003.jsonl  empty: its batch is lost; would hold no entry" in dry.stdout
    assert "00000000000000000006.jsonl  18 bytes ending in a torn line: its batch is lost" in dry.stdout
    assert "00000000000000000002.jsonl  empty" not in dry.stdout
    assert {p.name: p.read_bytes() for p in main.iterdir()} == before  # a dry run changes nothing
    out = _cli("check", str(root), "--repair")
    assert out.returncode == 1, out.stdout + out.stderr  # the garbled part is still there
    assert "00000000000000000003.jsonl  empty: its batch is lost; it now holds no entry" in out.stdout
    assert (main / "00000000000000000006.jsonl").read_bytes() == b"\n"
    assert (main / "00000000000000000002.jsonl").read_bytes() == before["00000000000000000002.jsonl"]
    with pytest.raises(Exception, match="CORRUPT.*00000000000000000002.jsonl: line 2"):
        store.load(key)
    (main / "00000000000000000002.jsonl").write_bytes(b'{"uuid":"u1"}\n{"uuid":"v1"}\n')  # mended
    want = [{"uuid": f"{c}{i}"} for i in (0, 1, 3, 4) for c in "uv"]
    assert store.load(key) == want
    store.append(key, [{"uuid": "w"}])
    assert store.load(key) == [*want, {"uuid": "w"}]
    assert _cli("check", str(root)).returncode == 0
    again = _cli("check", str(root), "--repair", "--json")
    assert json.loads(again.stdout)["repairs"] == []  # idempotent


def test_a_repair_stalled_after_its_look_never_touches_a_batch_committed_at_that_number_since(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repair judges part 4 torn and stalls past its lease; meanwhile another file
    takes the name and a writer's acknowledged batch number 4 (staged: moved away and
    appended; on sshfs a delete and a session made anew do it). A repair that moved
    the name aside, or moved it and looked after, lost or left aside that batch (found
    by reviews: 18 of 18 runs on local disk, GlusterFS and sshfs; a killed repair).
    It writes only through a descriptor of the bytes it judged."""
    from fsstore import _migrate

    root, store, key, main = _one_transcript(tmp_path, [[{"uuid": f"u{i}"}] for i in range(3)])
    part4 = main / "00000000000000000004.jsonl"
    part4.write_bytes(b'{"uuid":"u3"}\n{"uu')  # torn by a power loss
    writer = FsSessionStore(root, stale_lock_seconds=0.5).sync  # takes the stalled repair's lock
    real, staged = os.open, list[int]()

    def stalled(name: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if not staged and flags & os.O_RDWR and str(name) == part4.name:
            staged.append(1)
            os.rename(part4, tmp_path / "torn-elsewhere")
            writer.append(key, [{"uuid": "X"}])  # acknowledged, at number 4
            assert part4.read_bytes().startswith(b' {"uuid":"X"}')
        return real(name, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", stalled)
    actions = _migrate.repair(str(root))
    monkeypatch.undo()
    assert staged
    assert not [a for a in actions if a.action == "mark-lost"], actions
    assert store.load(key) == [{"uuid": "u0"}, {"uuid": "u1"}, {"uuid": "u2"}, {"uuid": "X"}]


@pytest.mark.parametrize("args", [["migrate"], ["check", "--repair"]])
def test_migrate_and_repair_of_a_healthy_format_2_store_change_nothing(tmp_path: Path, args: list[str]) -> None:
    root = tmp_path / "store"
    store = FsSessionStore(root, create=True).sync
    key = {"project_key": "p", "session_id": "s"}
    for i in range(20):
        store.append(key, [{"uuid": f"u{i}"}])
    before = sorted(p.name for p in root.rglob("*"))
    out = _cli(*args, str(root))
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in root.rglob("*")) == before


@pytest.mark.parametrize("written", ["just now", "2 h ago by this clock"])
@pytest.mark.parametrize("args", [["migrate"], ["check", "--repair"]])
def test_repair_leaves_a_misplaced_batch_its_live_writer_is_committing_again(
    tmp_path: Path, args: list[str], written: str
) -> None:
    """Found by review (real processes): a writer whose lock was overtaken linked its
    batch at a number a compaction had merged away (inside segment 1-5), and before
    its check committed it again above, `check --repair` (or `migrate`) took it for
    format 1's late batch and committed it again too: there twice. A misplaced batch
    younger than ``--older-than``, or still in a temp file (the re-review: a repairing
    host whose clock is 2 h ahead, or a writer stalled that long), is left to its
    writer; an old one (format 1's) is committed again."""
    from fsstore import _commit, _layout, _transcript

    store, d = _five_compacted(tmp_path)
    root = tmp_path / "store"
    w_batch = _transcript.encode_batch([{"type": "x", "n": "W"}], "append")
    (d / ".tmp-w").write_bytes(w_batch)
    os.link(d / ".tmp-w", d / _layout.part_name(4))  # the stale writer's link; its check to come
    if written != "just now":
        os.utime(d / ".tmp-w", (time.time() - 7200, time.time() - 7200))
    out = _cli(*args, str(root))
    # (check warns of an old file inside a segment's range: what it is for)
    ok = out.returncode == 0 or (written != "just now" and "0 error(s), 1 warning(s)" in out.stdout)
    assert ok and "writer may be committing it again" in out.stdout, out.stdout + out.stderr
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:  # the writer's check: inside 1-5, which does not hold it: committed again above
        assert _commit.link_and_check(store._fs, fd, ".tmp-w", 4, w_batch)[0] == 6
    finally:
        os.close(fd)
    want = [{"type": "x", "n": n} for n in [1, 2, 3, 4, 5, "W"]]
    assert store.load(KEY) == want
    # An old one (a format-1 store's late batch) is committed again.
    old = d / _layout.part_name(3)
    old.write_bytes(_transcript.encode_batch([{"type": "x", "n": "late"}], "append"))
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    out = _cli(*args, str(root))
    assert out.returncode == 0 and "committed again as" in out.stdout, out.stdout + out.stderr
    assert store.load(KEY) == [*want, {"type": "x", "n": "late"}]


@pytest.mark.parametrize("during_the_look", [False, True], ids=["look undisturbed", "a compaction during the look"])
def test_a_misplaced_batch_repair_committed_after_gc_took_its_temp_file_is_not_committed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, during_the_look: bool
) -> None:
    """Found by review (real processes, 7 of 7): a writer stalled around its link put
    its batch at a number a compaction had freed (inside segment 1-5); ``fsstore gc``
    on a host whose clock runs 2 h ahead took its temp file for garbage, so ``check
    --repair`` found no temp twin and committed the misplaced batch again above; the
    writer's check then found its temp file gone, took that for a delete, and
    started over: the batch twice. A writer that cannot link its batch again looks
    for it first: here it is committed (by the repair), and the append returns.

    The re-review (4 of 4): that look listed once, and a compaction merged the
    repair's link and the segment under it before the reads: both gone, the batch
    taken for lost: twice again. A file gone during the look, or a segment new
    after it, is a compaction's doing: looked at again."""
    from fsstore import _cleanup, _commit, _compact, _migrate, _transcript

    store, d = _five_compacted(tmp_path)
    real_next, real_check, real_scan = _commit._next_seq, _commit.check, _transcript.scan
    monkeypatch.setattr(_commit, "_next_seq", lambda t, dfd: 4)  # a view from before the compaction
    steps: list[str] = []

    class Unfenced:  # a compactor's lock, overtaken from the stalled writer
        since, budget = 0.0, math.inf

        def check(self, _op: str) -> None:
            pass

    def check(dir_fd: int, seq: int, marker: str | None) -> Any:
        if not steps:
            steps.append("gc, repair")
            monkeypatch.setattr(_commit, "_next_seq", real_next)
            assert [a.action for a in _cleanup.gc(str(store.root), older_than=-1)] == ["remove-temp"]
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:  # check --repair, its lock overtaken (or taken over from the stalled writer)
                done = _migrate._fix(store.fs, fd, str(d), False, gaps=False, spare=False, older_than=-1)
            finally:
                os.close(fd)
            assert [a.action for a in done] == ["recommit"], done
        return real_check(dir_fd, seq, marker)

    def scan(dir_fd: int) -> Any:
        items, deleted = real_scan(dir_fd)
        if during_the_look and steps == ["gc, repair"] and any(it[0] == 6 for it in items):
            steps.append("compaction during the look")  # after the listing, before the reads
            _compact.compact(store.fs, dir_fd, str(d), lambda: contextlib.nullcontext(Unfenced()),  # type: ignore[arg-type]
                             everything=True, operation="compact")
        return items, deleted

    monkeypatch.setattr(_commit, "check", check)
    monkeypatch.setattr(_transcript, "scan", scan)
    store.append(KEY, [{"type": "x", "n": "W"}])
    assert len(steps) == 1 + during_the_look
    assert store.load(KEY) == [{"type": "x", "n": n} for n in [1, 2, 3, 4, 5, "W"]]
    assert not [p for p in os.listdir(d) if p.startswith(".tmp-")]
    store.append(KEY, [{"type": "x", "n": "after"}])
    assert store.load(KEY)[-2:] == [{"type": "x", "n": "W"}, {"type": "x", "n": "after"}]


def _five_compacted(tmp_path: Path) -> tuple[Any, Path]:
    """A store whose transcript KEY is segment 1-5, and that transcript's directory."""
    from fsstore._store import SyncStore

    store = SyncStore(tmp_path / "store", create=True, compact_every=0)
    for i in range(1, 6):
        store.append(KEY, [{"type": "x", "n": i}])
    store.compact(KEY)
    return store, tdir(tmp_path / "store", KEY)


def test_repair_never_closes_a_hole_that_only_a_torn_listing_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review (by reading): repair judged a gap from one listing, which a
    compaction racing it (its lock overtaken) can tear: a segment made behind the
    cursor and the parts it merged gone ahead of it. Closing that hole merged the rest
    and removed the real segment: its batches lost. The gap is now judged as a load
    judges it (the listings after agree), and closed without removing anything."""
    from fsstore import _migrate, _transcript
    from fsstore._store import SyncStore

    root = tmp_path / "store"
    store = SyncStore(root, create=True, compact_every=0)
    for i in range(1, 7):
        store.append(KEY, [{"type": "x", "n": i}])
    d = tdir(root, KEY)
    # What a compaction racing the listing leaves: 3-4 made behind the cursor, 3 and 4
    # gone ahead of it: the listing shows neither.
    (d / "00000000000000000003-00000000000000000004.jsonl").write_bytes(
        (d / "00000000000000000003.jsonl").read_bytes() + (d / "00000000000000000004.jsonl").read_bytes())
    for n in (3, 4):
        (d / f"0000000000000000000{n}.jsonl").unlink()
    real_scan = _transcript.scan
    torn: list[int] = []

    def scan(dir_fd: int) -> Any:  # every other listing torn (the repair looks three times)
        items, deleted = real_scan(dir_fd)
        torn.append(1)
        if len(torn) % 2:
            items = [it for it in items if it[0] != 3]
        return items, deleted

    monkeypatch.setattr(_transcript, "scan", scan)
    monkeypatch.setattr(_migrate, "scan", scan)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        done = _migrate._fix(store.fs, fd, str(d), False, gaps=True, spare=False, older_than=3600)
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert torn and [a.action for a in done] == ["repair"] and "run again" in done[0].detail, done
    assert store.load(KEY) == [{"type": "x", "n": i} for i in range(1, 7)]



def test_repair_closes_a_gap_without_removing_a_batch_committed_into_it_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review (real processes, 6 of 6 with a stalled repair, 5 of 5 with a
    writer's clock +2 h): a writer whose last part was still there linked its batch at
    the number a part moved aside had freed, after the repair's look; the repair's
    compaction across the gap then removed it as covered. A gap is now closed by a
    part of one empty line at each missing number, linked no-replace: the writer's
    batch stays, and the repair reports only what was really lost."""
    from fsstore import _commit, _layout, _migrate, _transcript

    store = _sync(tmp_path)
    for i in range(1, 8):
        store.append(KEY, [{"type": "x", "n": i}])
    d = tdir(tmp_path / "store", KEY)
    (d / _layout.part_name(6)).rename(tmp_path / "moved-aside")
    real_snapshot = _migrate.snapshot

    def snapshot(dir_fd: int, *args: Any, **kwargs: Any) -> Any:
        seen = real_snapshot(dir_fd, *args, **kwargs)
        if (d / _layout.part_name(6)).exists():
            return seen  # the repair's look after its links
        # After the repair's look, W (its part 5 is there: 6 next), the repair's lock
        # overtaken, commits: its link and check.
        w = _transcript.encode_batch([{"type": "x", "n": "W"}], "append")
        (d / ".tmp-w").write_bytes(w)
        assert _commit.link_and_check(store.fs, dir_fd, ".tmp-w", 6, w)[0] == 6
        (d / ".tmp-w").unlink()
        return seen

    monkeypatch.setattr(_migrate, "snapshot", snapshot)
    done = _migrate.repair(str(tmp_path / "store"))
    assert [a.action for a in done] == ["close-gap"] and "nothing lost" in done[0].detail, done
    want = [{"type": "x", "n": n} for n in [1, 2, 3, 4, 5, "W", 7]]
    assert store.load(KEY) == want
    monkeypatch.undo()
    assert _migrate.repair(str(tmp_path / "store")) == []  # nothing left to repair
    store.append(KEY, [{"type": "x", "n": 8}])
    assert store.load(KEY) == [*want, {"type": "x", "n": 8}]


def test_a_gap_next_to_crossing_segments_hides_nothing_they_hold_and_repair_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review (real processes, 5 of 5): compactor A published 1-10 and died
    before its check, after an automatic compaction had made 9-12 (the two cross); then
    part 13 was lost. With no whole chain, loads and check took the widest file at
    each start: 1-10, hiding 11 and 12 (in 9-12), reported missing; `check --repair`
    then removed 9-12. Now the files covering the most numbers are taken (parts 1..8,
    9-12): only 13 is missing, and the repair marks only 13 lost."""
    from fsstore import _layout

    store = _sync(tmp_path)
    for i in range(1, 15):
        store.append(KEY, [{"type": "x", "n": i}])
    d = tdir(tmp_path / "store", KEY)
    part = {n: (d / _layout.part_name(n)).read_bytes() for n in range(1, 15)}
    (d / _layout.segment_name(9, 12)).write_bytes(b"".join(part[n] for n in range(9, 13)))
    for n in range(9, 13):
        (d / _layout.part_name(n)).unlink()
    (d / _layout.segment_name(1, 10)).write_bytes(b"".join(part[n] for n in range(1, 11)))  # A's
    (d / _layout.part_name(13)).rename(tmp_path / "moved-aside")
    want = [{"type": "x", "n": n} for n in range(1, 15) if n != 13]
    assert store.load(KEY) == want
    assert [r for r in caplog.records if getattr(r, "code", None) == "GAP"]
    out = _cli("check", "--repair", str(tmp_path / "store"))
    assert out.returncode == 0 and "lost (gone before the repair): parts 13\n" in out.stdout, out.stdout
    assert (d / _layout.segment_name(9, 12)).exists()
    caplog.clear()
    assert store.load(KEY) == want
    assert not [r for r in caplog.records if getattr(r, "code", None) == "GAP"]
    assert _cli("check", str(tmp_path / "store")).returncode == 0


@pytest.mark.parametrize("repair", ["removes its copy", "commits its copy above"])
def test_a_writers_look_for_its_batch_never_takes_a_misplaced_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repair: str
) -> None:
    """Found by review (real processes, 5 of 5 repair, 2 of 2 migrate): the repair's
    link of a writer's misplaced batch was itself misplaced (its number freed by a
    compaction of 6-8), the writer's look found its bytes there and returned, and the
    repair's check then removed that link: the acknowledged batch lost. Only a file
    of the chain counts; a copy outside it is a repair in flight, looked at again
    until it is committed (found there) or removed (the writer starts over)."""
    import time as _time

    from fsstore import _cleanup, _commit, _layout

    store, d = _five_compacted(tmp_path)
    for i in range(6, 9):
        store.append(KEY, [{"type": "x", "n": i}])
    parts = [d / _layout.part_name(n) for n in range(6, 9)]
    (d / _layout.segment_name(6, 8)).write_bytes(b"".join(p.read_bytes() for p in parts))
    for p in parts:
        p.unlink()  # 6-8: B's compaction; 7 is free, inside it
    real_check, real_sleep, real_next = _commit.check, _time.sleep, _commit._next_seq
    monkeypatch.setattr(_commit, "_next_seq", lambda t, dfd: 4)  # W: a view from before 1-5
    steps: list[str] = []

    def check(dir_fd: int, seq: int, marker: str | None) -> Any:
        if not steps:
            steps.append("gc, the repair's misplaced link")
            monkeypatch.setattr(_commit, "_next_seq", real_next)
            _cleanup.gc(str(store.root), older_than=-1)
            os.link(d / _layout.part_name(4), d / _layout.part_name(7))  # the repair's copy, under 6-8
            (d / _layout.part_name(4)).unlink()
        return real_check(dir_fd, seq, marker)

    def sleep(seconds: float) -> None:  # the writer waits: the repair's check goes on
        if steps == ["gc, the repair's misplaced link"]:
            steps.append(repair)
            if repair == "commits its copy above":
                os.link(d / _layout.part_name(7), d / _layout.part_name(9))
            (d / _layout.part_name(7)).unlink()
        real_sleep(seconds)

    monkeypatch.setattr(_commit, "check", check)
    monkeypatch.setattr(_time, "sleep", sleep)
    store.append(KEY, [{"type": "x", "n": "W"}])
    monkeypatch.undo()
    assert steps == ["gc, the repair's misplaced link", repair]
    assert store.load(KEY) == [{"type": "x", "n": n} for n in [1, 2, 3, 4, 5, 6, 7, 8, "W"]]


@pytest.mark.parametrize("writer", ["gives up first", "looks again meanwhile", "waits 2 s for the repair",
                                    "starts over before the repair links"])
def test_a_stalled_repair_whose_link_is_misplaced_again_never_loses_the_batch_its_writer_gave_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """Found by review (real processes, 4 of 4): a writer W misplaced its batch at 4
    (inside 1-5; its lock overtaken), ``fsstore gc`` with a clock ahead took its temp
    file, and ``check --repair`` linked the batch from 4 to 7, a number a compaction
    of 6-8 had freed meanwhile: misplaced again. The repair stalled there; W's check
    removed its misplaced 4, could not link from its vanished temp file, and its look
    found the batch only in the repair's misplaced 7: it gave up (``EAGAIN``, "may be
    committed"). The repair then removed 7 and could not link again from 4: the
    batch in no file. A repair now moves on from its own link (the new name first,
    then the old one goes), so the batch always has a name: committed once, whenever
    the writer looks; it waits up to 30 s for a repair's copy (it gave up after 0.36
    s: a caller's retry had the batch twice). (With a shorter stall the writer removed 4 and started over
    before the repair linked from it: the batch once, and the repair said FAILED;
    its source gone, the batch is its writer's: skipped.)"""
    import threading
    import time as _time

    from fsstore import FsStoreError, _cleanup, _commit, _layout, _migrate

    store, d = _five_compacted(tmp_path)
    store.append(KEY, [{"type": "x", "n": 6}])
    real_check, real_sleep, real_next = _commit.check, _time.sleep, _commit._next_seq
    real_link_and_check = _migrate.link_and_check
    monkeypatch.setattr(_commit, "_next_seq", lambda t, dfd: 4)  # W: a view from before 1-5
    repair_linked, repair_goes_on = threading.Event(), threading.Event()
    done: list[Any] = []

    def compaction_then_link(*args: Any, **kwargs: Any) -> Any:
        # B2 (its lock overtaken from the stalled repair) appends 7, 8 and compacts 6-8.
        for n in (7, 8):
            (d / _layout.part_name(n)).write_bytes(json.dumps({"type": "x", "n": n}).encode() + b"\n")
        parts = [d / _layout.part_name(n) for n in (6, 7, 8)]
        (d / _layout.segment_name(6, 8)).write_bytes(b"".join(p.read_bytes() for p in parts))
        for p in parts:
            p.unlink()
        if writer == "starts over before the repair links":
            repair_linked.set()  # stalled before its link, not after it
            assert repair_goes_on.wait(30)
        return real_link_and_check(*args, **kwargs)

    def repair() -> None:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            done.extend(_migrate._fix(store.fs, fd, str(d), False, gaps=False, spare=False, older_than=-1))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            done.append(exc)
        finally:
            os.close(fd)

    def check(dir_fd: int, seq: int, marker: str | None) -> Any:
        if threading.current_thread() is not threading.main_thread():
            if seq == 7:  # the repair's link, misplaced under 6-8: it stalls after it
                repair_linked.set()
                assert repair_goes_on.wait(30)
        elif seq == 4 and not repair_linked.is_set():  # W, after its misplaced link
            monkeypatch.setattr(_commit, "_next_seq", real_next)
            assert [a.action for a in _cleanup.gc(str(store.root), older_than=-1)] == ["remove-temp"]
            threading.Thread(target=repair, daemon=True).start()
            assert repair_linked.wait(30)
        return real_check(dir_fd, seq, marker)

    slept: list[float] = []

    def sleep(seconds: float) -> None:  # W's look waits for a repair in flight
        slept.append(seconds)
        if threading.current_thread() is threading.main_thread() and (
                writer == "looks again meanwhile" or writer == "waits 2 s for the repair" and sum(slept) > 2):
            repair_goes_on.set()
            while not done:
                real_sleep(0.01)
        real_sleep(seconds)

    monkeypatch.setattr(_migrate, "link_and_check", compaction_then_link)
    monkeypatch.setattr(_commit, "check", check)
    monkeypatch.setattr(_time, "sleep", sleep)
    if writer == "gives up first":
        monkeypatch.setattr(_commit, "_COPY_WAIT", 1.0)  # the writer's wait for the repair's copy
    try:
        store.append(KEY, [{"type": "x", "n": "W"}])
        returned = True
    except FsStoreError as exc:
        assert exc.code == "EAGAIN" and "may be committed" in str(exc)
        returned = False
    repair_goes_on.set()
    for _ in range(3000):
        if done:
            break
        real_sleep(0.01)
    monkeypatch.undo()
    assert returned == (writer != "gives up first")
    want = "skip" if writer == "starts over before the repair links" else "recommit"
    assert [getattr(a, "action", a) for a in done] == [want], done
    assert not any(a.failed for a in done)
    assert store.load(KEY) == [{"type": "x", "n": n} for n in [1, 2, 3, 4, 5, 6, 7, 8, "W"]]
    assert not [p for p in os.listdir(d) if p.startswith(".tmp-")]
    assert _cli("check", str(tmp_path / "store")).returncode == 0


def _sync(tmp_path: Path) -> Any:
    from fsstore._store import SyncStore

    return SyncStore(tmp_path / "store", create=True, compact_every=0)


@pytest.mark.parametrize("nonces", [True, False], ids=["batches with nonces", "written before the nonce"])
def test_repair_cuts_a_lost_part_out_of_a_segment_crossing_another_or_says_why_not(
    tmp_path: Path, nonces: bool
) -> None:
    """Found by review (real processes, 2 of 3; 4 of 4 by hand): compaction L made 1-12
    and passed its check, D made 11-14 and was killed before its own (which would have
    removed it); then part 13 was lost by hand. Its batch is only in 11-14, which no
    chain can take with 1-12: hidden. `check --repair` said "gap closed" where it
    filled another hole and this one stayed; then it said "not repaired". A segment is
    its parts' bytes, each batch ending with its nonce: the repair cuts 13's batch out
    of D and links it as part 13. Where the batches cannot be counted (files written
    before the nonce), it still says it is not repaired, and why."""
    import re

    from fsstore import _layout

    store = _sync(tmp_path)
    for i in range(1, 18):
        store.append(KEY, [{"type": "x", "n": i}, {"type": "y", "n": i}])
    d = tdir(tmp_path / "store", KEY)
    part = {n: (d / _layout.part_name(n)).read_bytes() for n in range(1, 18)}
    if not nonces:
        part = {n: re.sub(rb"[ \t]+\n", b"\n", b).lstrip(b" ") for n, b in part.items()}  # no nonce, no mark
        for n, b in part.items():
            (d / _layout.part_name(n)).write_bytes(b)
    (d / _layout.segment_name(11, 14)).write_bytes(b"".join(part[n] for n in range(11, 15)))  # D's
    (d / _layout.segment_name(1, 12)).write_bytes(b"".join(part[n] for n in range(1, 13)))  # L's
    for n in [*range(1, 14), 16]:  # L removed what it merged; 13 and 16 lost by hand
        (d / _layout.part_name(n)).unlink()
    dry = _cli("check", "--repair", "--dry-run", str(tmp_path / "store"))  # (review: it promised the repair)
    assert not (d / _layout.part_name(16)).exists() and not (d / _layout.part_name(13)).exists()
    out = _cli("check", "--repair", str(tmp_path / "store"))
    assert "lost (gone before the repair): parts 16" in out.stdout, out.stdout
    if nonces:
        assert "would be gap closed" in dry.stdout and "parts 13 would be cut out" in dry.stdout, dry.stdout
        assert "gap closed" in out.stdout and "parts 13 were cut out" in out.stdout, out.stdout
        assert (d / _layout.part_name(13)).read_bytes() == part[13]
        want = [{"type": t, "n": n} for n in range(1, 18) if n != 16 for t in "xy"]
        assert store.load(KEY) == want
        assert _cli("check", str(tmp_path / "store")).returncode == 0
        store.compact(KEY)
        assert store.load(KEY) == want
        return
    for run in (dry, out):
        assert "not repaired: part 13 is held only by a segment that overlaps" in run.stdout, run.stdout
        assert "gap closed" not in run.stdout
    assert out.returncode != 0 and out.stdout.startswith("FAILED ")  # (review: labelled WOULD)


@pytest.mark.parametrize("copies", [
    "one in the chain", "two misplaced", "format 1: one in the chain", "format 1: two misplaced",
    "format 1's equal batches"])
def test_repair_commits_a_batch_with_misplaced_copies_once(tmp_path: Path, copies: str) -> None:
    """Found by review (real processes; 8 of 8, 4 of 4, 3 of 3): a repair killed, failed
    (EIO) or overtaken between its link of a misplaced batch and the removal of its
    source left copies: the source at 3 and its own link (committed at 9, or misplaced
    again at 7), and the next repair committed each copy again: the acknowledged batch
    loaded two or three times. A batch is its bytes (its nonce), or its inode (a
    repair's link; format 1's batches carry no nonce): a copy of one in the chain is
    removed, copies that are all misplaced are committed once. Format 1's equal batches
    in files of their own are different batches, each committed."""
    import re

    from fsstore import _layout, _transcript

    store, d = _five_compacted(tmp_path)
    for i in range(6, 9):
        store.append(KEY, [{"type": "x", "n": i}])
    batch = _transcript.encode_batch([{"type": "x", "n": "W"}], "append")
    if copies.startswith("format 1"):
        batch = re.sub(rb"[ \t]+\n", b"\n", batch).lstrip(b" ")  # neither nonce nor mark
    source = d / _layout.part_name(3)  # the writer's misplaced link, under 1-5
    source.write_bytes(batch)
    if copies.endswith("one in the chain"):
        os.link(source, d / _layout.part_name(9))  # the killed repair's commit
    else:
        parts = [d / _layout.part_name(n) for n in range(6, 9)]
        (d / _layout.segment_name(6, 8)).write_bytes(b"".join(p.read_bytes() for p in parts))
        for p in parts:
            p.unlink()
        if copies == "format 1's equal batches":
            (d / _layout.part_name(7)).write_bytes(batch)  # another batch, equal
        else:
            os.link(source, d / _layout.part_name(7))  # the repair's link, misplaced under 6-8
    out = _cli("check", "--repair", "--older-than", "0s", str(tmp_path / "store"))
    assert out.returncode == 0, out.stdout + out.stderr
    times = 2 if copies == "format 1's equal batches" else 1
    assert store.load(KEY) == [{"type": "x", "n": n} for n in [*range(1, 9), *["W"] * times]]
    assert not (d / _layout.part_name(3)).exists()
    assert copies.endswith("one in the chain") or not (d / _layout.part_name(7)).exists()
    again = _cli("check", "--repair", "--older-than", "0s", str(tmp_path / "store"))
    assert again.returncode == 0 and "REPAIR" not in again.stdout and "REMOVE" not in again.stdout, again.stdout
    assert store.load(KEY) == [{"type": "x", "n": n} for n in [*range(1, 9), *["W"] * times]]


@pytest.mark.parametrize("then", ["nothing else", "its next link fails", "gc and a repair meanwhile"])
def test_a_misplaced_link_its_writer_cannot_remove_is_a_copy_the_repair_removes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """Found by review (strace `inject=unlinkat:error=EIO`, 3 of 3): a writer whose
    batch landed at 4, inside 1-5 (its view old), could not remove that name (EIO);
    its append raised "nothing committed" and left the part, which a later `check
    --repair` committed: twice after the caller's retry. Inside a segment's range no
    reader takes it: the writer goes on and commits the batch above, and the repair
    removes the part as a copy of a committed batch. The next review: where the writer
    then failed (its next link: EIO), it still said nothing was committed (twice after
    a retry, 6 of 6); where gc took its temp file and a repair committed the copy
    meanwhile, it started over (twice, 4 of 4). It says "may be committed", and looks
    for the repair's commit."""
    from fsstore import FsStoreError, _commit, _fsio, _layout

    store, d = _five_compacted(tmp_path)
    monkeypatch.setattr(_commit, "_next_seq", lambda t, dfd: 4)  # a view from before 1-5
    real_unlink, real_link = _fsio.unlink_quiet, _fsio.link_noreplace
    refused: list[str] = []

    def unlink(dir_fd: int, name: str) -> None:
        if name == _layout.part_name(4) and not refused:
            refused.append(name)
            raise OSError(5, "Input/output error")
        real_unlink(dir_fd, name)

    def link(fs: Any, dir_fd: int, src: str, dst: str) -> Any:
        if refused and dst != _layout.part_name(4) and len(refused) == 1:
            refused.append(dst)
            if then == "its next link fails":
                raise OSError(5, "Input/output error")
            for name in os.listdir(d):  # gc at +2 h, then a repair: 4 committed as 6
                if name.startswith(".tmp-"):
                    (d / name).unlink()
            os.link(d / _layout.part_name(4), d / _layout.part_name(6))
        return real_link(fs, dir_fd, src, dst)

    monkeypatch.setattr(_fsio, "unlink_quiet", unlink)
    if then != "nothing else":
        monkeypatch.setattr(_fsio, "link_noreplace", link)
    try:
        store.append(KEY, [{"type": "x", "n": "W"}])
    except FsStoreError as exc:
        assert then == "its next link fails" and exc.code == "EIO" and "may be committed" in str(exc), exc
    else:
        assert then != "its next link fails"
    monkeypatch.undo()
    assert refused and (d / _layout.part_name(4)).exists()
    want = [{"type": "x", "n": n} for n in [1, 2, 3, 4, 5, "W"]]
    if then != "its next link fails":
        assert store.load(KEY) == want
    out = _cli("check", "--repair", "--older-than", "0s", str(tmp_path / "store"))
    assert out.returncode == 0, out.stdout
    assert then != "nothing else" or "a copy of a batch committed in" in out.stdout, out.stdout
    assert not (d / _layout.part_name(4)).exists() and store.load(KEY) == want


def test_an_append_whose_unchecked_part_cannot_be_removed_says_it_may_be_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README (EIO): the check of a linked part fails, and the part cannot be removed
    either: it is in the chain, where every reader takes it, so the append cannot say
    nothing of it is committed (found by review: it did, and a retry stored it twice)."""
    from fsstore import FsStoreError, _commit, _fsio, _layout

    store, _d = _five_compacted(tmp_path)
    real_unlink = _fsio.unlink_quiet

    def check(dir_fd: int, seq: int, marker: str | None) -> Any:
        raise OSError(5, "Input/output error")

    def unlink(dir_fd: int, name: str) -> None:
        if name == _layout.part_name(6):
            raise OSError(5, "Input/output error")
        real_unlink(dir_fd, name)

    monkeypatch.setattr(_commit, "check", check)
    monkeypatch.setattr(_fsio, "unlink_quiet", unlink)
    with pytest.raises(FsStoreError) as err:
        store.append(KEY, [{"type": "x", "n": "W"}])
    monkeypatch.undo()
    assert err.value.code == "EIO" and "may be committed" in str(err.value), err.value
    assert store.load(KEY) == [{"type": "x", "n": n} for n in [1, 2, 3, 4, 5, "W"]]
