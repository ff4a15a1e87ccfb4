"""Power loss: an ext4 file system on a loop device stopped at one instant, its journal
not flushed and no dirty page written (``EXT4_IOC_SHUTDOWN``, as xfstests' godown), then
mounted again: the store as a machine would find it after its power came back.

Promises (docs/format.md, "What a crash can leave"; docs/operations.md, "After a power
loss or a host crash"):

* ``fsync=True``: an append that returned (and logged no failed directory fsync) is in
  every load after the power comes back, whole and once; no load fails.
* ``fsync=False``: a power loss may lose what was not written back, and leaves those
  parts empty or torn (every load CORRUPT); ``fsstore check --repair`` writes them
  over with one empty line (a lost batch's part), and then every transcript loads with
  every batch that was written back.
* Either setting: what was on disk before a compaction, a merge back of what a delete
  moved by mistake (``fsstore gc``) or an import is on disk after it (found by a review
  with this harness: the merge's copies and the imported parts were empty after a cut
  3 s later, the original gone or the session CORRUPT). A
  compaction fsyncs its segment and the directory before it removes what the segment
  merged (found by this file: with ``fsync=False`` a power loss within ~30 s of a
  compaction left the segment empty and its parts gone, the whole transcript lost).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fsstore import FsSessionStore

from .._helpers import orphan_of
from . import _mounts
from ._check import assert_transcript, batch, verify

pytestmark = pytest.mark.skipif(bool(_mounts.ext4_loop_unavailable()),
                                reason=str(_mounts.ext4_loop_unavailable()))

MAIN = {"project_key": "p", "session_id": "s"}
SUB = {**MAIN, "subpath": "subagents/agent-1"}
JOURNAL_COMMITTED = 2.5  # s: the loop mount commits its journal every second

# A writer: appends batch b = 0, 1, ... to KEY and writes "ok <b>" to its ack file (on
# another file system) once append returned with no error logged ("nd <b>": the batch is
# visible, a fsync after it failed).
WRITER = r"""
import json, logging, sys
sys.path.insert(0, sys.argv[1])
from fsstore import FsSessionStore
from tests.reliability._check import batch
root, wid, key, fsync = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5] == "1"
acks = open(sys.argv[6], "a", buffering=1)
errors = []
class Note(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.ERROR:
            errors.append(record)
logging.getLogger("fsstore").addHandler(Note())
store = FsSessionStore(root=root, create=True, fsync=fsync, compact_every=4)
for b in range(100000):
    errors.clear()
    store.sync.append(key, batch(wid, b, 1 + b % 3))
    print("nd" if errors else "ok", b, file=acks, flush=True)
"""


REPO = str(Path(__file__).resolve().parents[2])


class _Writers:
    """A WRITER process per ``wid: key``, each with its ack file in ``acks`` (a directory
    off the mount whose power is cut)."""

    def __init__(self, root: str, keys: dict[str, dict[str, Any]], acks: Path, *, fsync: bool) -> None:
        acks.mkdir(parents=True, exist_ok=True)
        self.files = {wid: acks / f"{wid}.acks" for wid in keys}
        self.procs = {wid: subprocess.Popen(
            [sys.executable, "-c", WRITER, REPO, root, wid, json.dumps(key), "1" if fsync else "0",
             str(self.files[wid])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for wid, key in keys.items()}

    def wait_first(self, timeout: float = 60) -> None:
        """Until each has acknowledged a batch."""
        deadline = time.monotonic() + timeout
        while not all(self.acks(wid) for wid in self.files):
            assert time.monotonic() < deadline, "a writer acknowledged nothing"
            assert all(p.poll() is None for p in self.procs.values()), "a writer died"
            time.sleep(0.02)

    def acks(self, wid: str, *, durable_only: bool = False) -> set[int]:
        """The batches its whole lines say were acknowledged (``durable_only``: with no
        error logged)."""
        out = self.files[wid].read_text() if self.files[wid].exists() else ""
        return {int(m.group(2)) for m in re.finditer(r"^(ok|nd) (\d+)\n", out, re.MULTILINE)
                if not durable_only or m.group(1) == "ok"}

    def signal(self, sig: int) -> None:
        for p in self.procs.values():
            p.send_signal(sig)

    def kill(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait(30)


def _fsstore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsstore", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120, check=False)


def _load(root: str, key: dict[str, Any]) -> list[dict[str, Any]] | None:
    return FsSessionStore(root=root).sync.load(key)


@pytest.mark.parametrize("fsync", [False, True], ids=["fsync_off", "fsync_on"])
def test_a_compaction_keeps_what_was_on_disk_through_a_power_loss(
        tmp_path: Path, figures: Any, fsync: bool) -> None:
    with _mounts.ext4_loop(tmp_path) as mnt:
        root = f"{mnt}/store"
        store = FsSessionStore(root=root, create=True, fsync=fsync, compact_every=0)
        want: dict[str, list[tuple[str, int]]] = {"main": [], "sub": []}
        entries = 0
        for b in range(40):
            for name, key in (("main", MAIN), ("sub", SUB)):
                store.sync.append(key, batch(name, b, 2))
                want[name].append((name, b))
                entries += 2
        _mounts.sync_fs(mnt)  # every batch on disk: a power loss from here loses none
        for key in (MAIN, SUB):
            store.sync.compact(key)
        time.sleep(JOURNAL_COMMITTED)  # the journal carries the compactions' unlinks
        _mounts.cut_power(mnt)
        figures.add("power cuts")
        _mounts.remount(mnt)
        assert_transcript(_load(root, MAIN), want["main"], 80)
        assert_transcript(_load(root, SUB), want["sub"], 80)
        figures.add("entries that survived a power cut", entries)


def test_every_acknowledged_batch_survives_a_power_cut_at_any_instant(tmp_path: Path, figures: Any) -> None:
    """fsync=True: three writers on one transcript and one on another, compacting every
    4 parts, the power cut at a random instant; several rounds."""
    rng = random.Random()
    for rnd in range(5):
        with _mounts.ext4_loop(tmp_path / f"round{rnd}") as mnt:
            root = f"{mnt}/store"
            other = {"project_key": "p", "session_id": "other"}
            writers = _Writers(root, {"w0": MAIN, "w1": MAIN, "w2": MAIN, "w3": other},
                               tmp_path / f"acks{rnd}", fsync=True)
            try:
                writers.wait_first()  # each has one acknowledged: then a random instant
                time.sleep(rng.uniform(0.0, 1.0))
                _mounts.cut_power(mnt)
                figures.add("power cuts")
            finally:
                writers.kill()
            acked: dict[str, set[tuple[str, int]]] = {"main": set(), "other": set()}
            for wid in writers.files:
                acks = writers.acks(wid, durable_only=True)
                acked["other" if wid == "w3" else "main"] |= {(wid, b) for b in acks}
            _mounts.remount(mnt)
            for name, key in (("main", MAIN), ("other", other)):
                got = _load(root, key)
                v = verify(got)
                assert v.ok(), (rnd, name, v.problems[:10])
                lost = acked[name] - set(v.batches)
                assert not lost, (rnd, name, sorted(lost)[:20], f"{len(acked[name])} acknowledged")
                assert acked[name], (rnd, name, "no append was acknowledged before the cut")
                figures.add("acknowledged batches that survived a power cut", len(acked[name]))


def test_after_a_power_cut_with_fsync_off_check_repair_makes_it_load_with_all_written_back(
        tmp_path: Path, figures: Any) -> None:
    """Three writers (fsync=False, compacting every 4 parts); stopped, written back
    (``sync -f``), let go, the power cut 0-3 s later; three rounds, and more (up to six)
    until one cut has left a part for the repair (a loaded machine's slower writers left
    none in three: a CI run of stop 44)."""
    rng = random.Random()
    repaired = 0
    for rnd in range(6):
        if rnd >= 3 and repaired:
            break
        with _mounts.ext4_loop(tmp_path / f"round{rnd}") as mnt:
            root = f"{mnt}/store"
            writers = _Writers(root, {"w0": MAIN, "w1": MAIN, "w2": MAIN}, tmp_path / f"acks{rnd}",
                               fsync=False)
            try:
                writers.wait_first()
                time.sleep(rng.uniform(0.2, 1.0))
                writers.signal(signal.SIGSTOP)
                durable = {(wid, b) for wid in writers.files for b in writers.acks(wid)}
                _mounts.sync_fs(mnt)  # all those acknowledged so far are on disk
                writers.signal(signal.SIGCONT)
                time.sleep(rng.uniform(0.0, 3.0))
                _mounts.cut_power(mnt)
                figures.add("power cuts")
            finally:
                writers.kill()
            _mounts.remount(mnt)
            out = _fsstore("check", root, "--repair")
            assert out.returncode == 0, (rnd, out.stdout[-3000:], out.stderr[-2000:])
            repaired += "its batch is lost; it now holds no entry" in out.stdout
            v = verify(_load(root, MAIN))
            assert v.ok(), (rnd, v.problems[:10])
            lost = durable - set(v.batches)
            assert not lost, (rnd, sorted(lost)[:20], f"{len(durable)} written back")
            figures.add("written-back batches that survived a power cut (fsync off)", len(durable))
    assert repaired, "no cut left a part to repair: the repair was never tried"


def test_a_session_merged_back_by_gc_survives_a_power_loss(tmp_path: Path, figures: Any) -> None:
    """A delete moved a session into .trash by mistake (a session was made at its name
    since); ``fsstore gc`` merges its batches into the new one and removes it; the power
    goes 2.5 s later."""
    with _mounts.ext4_loop(tmp_path) as mnt:
        root = Path(mnt) / "store"
        orphan_of(root, [batch("old", b, 2) for b in range(20)], key=MAIN, made_since=batch("new", 0, 2))
        _mounts.sync_fs(mnt)
        time.sleep(1.2)  # older than gc's --older-than
        out = _fsstore("gc", str(root), "--older-than", "1s")
        assert out.returncode == 0 and "merged" in out.stdout, out.stdout + out.stderr
        time.sleep(JOURNAL_COMMITTED)
        _mounts.cut_power(mnt)
        figures.add("power cuts")
        _mounts.remount(mnt)
        assert_transcript(_load(str(root), MAIN), [("new", 0), *(("old", b) for b in range(20))], 42)


def test_an_import_survives_a_power_loss_once_reported(tmp_path: Path, figures: Any) -> None:
    """``fsstore import`` extends a session that was on disk; the power goes 2.5 s
    after it reported."""
    key = {"project_key": "-home-u-repo", "session_id": "sess1"}
    entries = [{"type": "user", "uuid": f"u{i}", "message": {"role": "user", "content": f"m{i}"}}
               for i in range(40)]
    local = tmp_path / "local" / "-home-u-repo"
    local.mkdir(parents=True)
    (local / "sess1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    with _mounts.ext4_loop(tmp_path / "disk") as mnt:
        root = f"{mnt}/store"
        store = FsSessionStore(root=root, create=True, fsync=True)
        for i in range(0, 20, 2):
            store.sync.append(key, entries[i:i + 2])
        out = _fsstore("import", root, str(tmp_path / "local"))
        assert out.returncode == 0 and "extended" in out.stdout, out.stdout + out.stderr
        time.sleep(JOURNAL_COMMITTED)
        _mounts.cut_power(mnt)
        figures.add("power cuts")
        _mounts.remount(mnt)
        assert _load(root, key) == entries


def test_a_merge_back_cut_midway_loses_nothing_once_repaired_and_resumed(tmp_path: Path, figures: Any) -> None:
    """``fsstore gc`` merges back 1,500 batches a delete moved by mistake, each marked in
    the orphan once appended; the power goes midway. ``check --repair`` and ``gc`` (which
    resumes the merge) then leave every batch in the session: a marked copy must be on
    disk (found by review: marks on disk, copies empty, then set aside by the repair
    and skipped by the resumed merge). At most one batch twice: the one whose mark the
    cut took (docs/format.md, "Deletes")."""
    rng = random.Random()
    with _mounts.ext4_loop(tmp_path, size_mb=128) as mnt:
        root = Path(mnt) / "store"
        old = [("old", b) for b in range(1500)]
        orphan_of(root, [batch(*b, 1) for b in old], key=MAIN, made_since=batch("new", 0, 1),
                  compact_every=0)  # (a merge appends a batch per file)
        _mounts.sync_fs(mnt)
        time.sleep(1.2)  # older than gc's --older-than
        gc = subprocess.Popen([sys.executable, "-m", "fsstore", "gc", str(root), "--older-than", "1s"],
                              cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        time.sleep(rng.uniform(1.2, 2.0))  # marks older than a journal commit, the merge going on
        _mounts.cut_power(mnt)
        figures.add("power cuts")
        gc.communicate(timeout=120)
        _mounts.remount(mnt)
        for args in (["check", str(root), "--repair"], ["gc", str(root), "--older-than", "1s"]):
            time.sleep(1.2)
            out = _fsstore(*args)
            assert "Traceback" not in out.stderr, out.stderr
        v = verify(_load(str(root), MAIN))
        twice = set(re.findall(r"\('old', (\d+)\) appears twice", "\n".join(v.problems)))
        others = [p for p in v.problems
                  if not any(f"'old', {b})" in p or f"batch {b} after batch {b}" in p for b in twice)]
        assert len(twice) <= 1 and not others, v.problems[:10]
        lost = {("new", 0), *old} - set(v.batches)
        assert not lost, (len(lost), sorted(lost)[:10])
        assert not [n for n in os.listdir(root / ".trash") if n.endswith("-deleted")]  # merged whole
