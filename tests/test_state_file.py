"""state.json: rewritten in place on local file systems, and a torn one is never trusted."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsstore import _fsio, _layout, _transcript
from fsstore._store import SyncStore
from fsstore._transcript import State, read_state

from .conftest import KEY, entry
from .test_store import parts_of, tdir

LOCAL = _fsio.is_local_fs(tempfile.gettempdir())


@pytest.fixture
def local_root(root: Path) -> Path:
    """The store root, where the state file is rewritten in place (a local file system);
    the suite also runs with its roots on FUSE (FSSTORE_TEST_ROOT)."""
    if not _fsio.is_local_fs(str(root.parent)):
        pytest.skip("the store root is not on a local file system")
    return root


def state_inode(root: Path) -> int:
    return (tdir(root, KEY) / _layout.STATE).stat().st_ino


def write_raw_state(root: Path, raw: bytes) -> None:
    (tdir(root, KEY) / _layout.STATE).write_bytes(raw)


def test_local_file_systems_are_told_from_network_and_fuse_ones() -> None:
    assert _fsio.is_local_fs("/dev/shm") if os.path.isdir("/dev/shm") else True
    assert not _fsio.is_local_fs("/proc")
    assert not _fsio.is_local_fs("/no/such/path")


def test_on_a_local_fs_two_state_files_take_turns_and_nothing_else_is_created(local_root: Path) -> None:
    root = local_root
    store = SyncStore(root, compact_every=0)
    inodes = set()
    for i in range(10):
        store.append(KEY, [entry(i)])
        inodes.add(state_inode(root))
    assert len(inodes) == 2  # state.json and .state.spare swap names; no file per commit
    names = sorted(p.name for p in tdir(root, KEY).iterdir())
    assert names == sorted([_layout.STATE, _layout.STATE_SPARE, *parts_of(root, KEY)])
    assert json.loads((tdir(root, KEY) / _layout.STATE).read_text())["seq"] == 10
    assert json.loads((tdir(root, KEY) / _layout.STATE_SPARE).read_text())["seq"] == 9
    assert stat.S_IMODE((tdir(root, KEY) / _layout.STATE_SPARE).stat().st_mode) == 0o600


def test_a_state_whose_check_fails_is_rebuilt_not_trusted(root: Path) -> None:
    store = SyncStore(root, compact_every=0)
    for i in range(5):
        store.append(KEY, [entry(i)])
    good = (tdir(root, KEY) / _layout.STATE).read_bytes()
    torn = good.replace(b'"seq":5', b'"seq":9')  # still JSON: a mix of two writes could be
    assert torn != good and json.loads(torn)["seq"] == 9
    write_raw_state(root, torn)
    other = SyncStore(root, compact_every=0)  # remembers nothing: must read the file
    other.append(KEY, [entry(5)])
    # trusting seq 9 would have committed part 10 and left a gap 6..9
    assert parts_of(root, KEY) == [_layout.part_name(n) for n in range(1, 7)]
    assert other.load(KEY) == [entry(i) for i in range(6)]
    [summary] = other.list_session_summaries(KEY["project_key"])
    assert summary["session_id"] == KEY["session_id"]


def test_a_format_1_state_without_check_is_still_read(root: Path) -> None:
    store = SyncStore(root, compact_every=0)
    for i in range(3):
        store.append(KEY, [entry(i)])
    doc = json.loads((tdir(root, KEY) / _layout.STATE).read_text())
    del doc["check"]
    doc["format"] = 1  # what fsstore wrote before the check existed
    write_raw_state(root, json.dumps(doc).encode())
    d = os.open(tdir(root, KEY), os.O_RDONLY)
    try:
        state, _mtime = read_state(d)
    finally:
        os.close(d)
    assert state is not None and state.seq == 3
    doc["format"] = 2  # a newer file that lost its check is a torn one
    write_raw_state(root, json.dumps(doc).encode())
    d = os.open(tdir(root, KEY), os.O_RDONLY)
    try:
        assert read_state(d)[0] is None
    finally:
        os.close(d)


_summaries = st.none() | st.fixed_dictionaries(
    {"session_id": st.text(max_size=8), "mtime": st.integers(0, 2**40),
     "data": st.dictionaries(st.text(max_size=6), st.text(max_size=12) | st.integers(), max_size=3)})
_states = st.builds(State, st.integers(0, 10**6), st.integers(0, 10**6), _summaries, st.integers(0, 10**6))


@settings(max_examples=60, deadline=None)
@given(a=_states, b=_states, data=st.data())
def test_a_read_that_mixes_two_writes_is_never_taken_for_a_state(a: State, b: State, data: Any) -> None:
    """A reader of a file being rewritten in place sees a prefix of the new bytes over
    the old ones (or the reverse): every such mix other than the two states is refused."""
    old, new = a.to_bytes(), b.to_bytes()
    cut = data.draw(st.integers(0, max(len(old), len(new))))
    with tempfile.TemporaryDirectory() as d:
        fd = os.open(d, os.O_RDONLY)
        try:
            for mix in (new[:cut] + old[cut:], old[:cut] + new[cut:]):
                Path(d, _layout.STATE).write_bytes(mix)
                state, _mtime = read_state(fd)
                assert state is None or (mix in (old, new) and state in (a, b)), mix
        finally:
            os.close(fd)


@pytest.mark.parametrize("planted", ["symlink", "fifo", "hardlink", "directory"])
@pytest.mark.parametrize("before", [1, 3], ids=["spare not held yet", "spare held open"])
def test_whatever_is_planted_at_the_spare_name_is_never_written_through(
    local_root: Path, planted: str, before: int
) -> None:
    """With the spare held open, the swap would have moved the planted thing into
    state.json (every later append failing EISDIR or ELOOP; found by review)."""
    root = local_root
    store = SyncStore(root, compact_every=0)
    for i in range(before):
        store.append(KEY, [entry(i)])
    spare = tdir(root, KEY) / _layout.STATE_SPARE
    spare.unlink(missing_ok=True)
    victim = root.parent / "victim"  # beside root: a hard link needs the same file system
    victim.write_text("precious")
    if planted == "symlink":
        spare.symlink_to(victim)
    elif planted == "fifo":
        os.mkfifo(spare)
    elif planted == "hardlink":
        os.link(victim, spare)
    else:
        spare.mkdir()
    for i in range(before, before + 3):
        store.append(KEY, [entry(i)])
    assert victim.read_text() == "precious"
    assert stat.S_ISREG(os.lstat(tdir(root, KEY) / _layout.STATE).st_mode)
    assert SyncStore(root).load(KEY) == [entry(i) for i in range(before + 3)]
    assert json.loads((tdir(root, KEY) / _layout.STATE).read_text())["seq"] == before + 3


def test_an_old_state_put_at_the_spare_name_never_becomes_state_json(local_root: Path) -> None:
    """A valid state from before a compaction, copied to .state.spare by hand while a
    writer holds the spare: swapped in, it would send another writer's commit into
    the segment (CORRUPT on load; found by review). The writer checks the name."""
    root = local_root
    a = SyncStore(root, compact_every=0)
    for i in range(3):
        a.append(KEY, [entry(i)])
    old = (tdir(root, KEY) / _layout.STATE).read_bytes()  # seq 3
    for i in range(3, 10):
        a.append(KEY, [entry(i)])
    a.compact(KEY)
    a.append(KEY, [entry(10)])
    a.append(KEY, [entry(11)])  # holds both state files again
    spare = tdir(root, KEY) / _layout.STATE_SPARE
    spare.unlink()
    spare.write_bytes(old)
    a.append(KEY, [entry(12)])
    SyncStore(root, compact_every=0).append(KEY, [entry(13)])
    assert SyncStore(root).load(KEY) == [entry(i) for i in range(14)]


def test_a_mount_refusing_rename_exchange_falls_back_to_new_files(
    local_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = local_root
    store = SyncStore(root, compact_every=0)
    store.append(KEY, [entry(0)])
    store.append(KEY, [entry(1)])
    calls = []

    def refuse(fs: _fsio.Fs, dir_fd: int, a: str, b: str) -> bool:
        calls.append(a)
        fs.exchange_ok = False
        raise NotImplementedError("RENAME_EXCHANGE")

    monkeypatch.setattr(_fsio, "exchange", refuse)
    before = state_inode(root)
    for i in range(2, 5):
        store.append(KEY, [entry(i)])
    assert len(calls) == 1 and not store._fs.exchange_ok  # asked once, then never again
    assert state_inode(root) != before
    assert not (tdir(root, KEY) / _layout.STATE_SPARE).exists()
    assert json.loads((tdir(root, KEY) / _layout.STATE).read_text())["seq"] == 5
    assert store.load(KEY) == [entry(i) for i in range(5)]


def test_state_bytes_end_in_a_check_of_everything_before_it() -> None:
    raw = State(3, 3, {"data": {"x": "é"}}, 0).to_bytes()
    doc = json.loads(raw)
    assert doc["format"] == 2 and raw.endswith(b',"check":%-10d}' % doc["check"])
    assert _transcript._checked(raw, doc)
    # The check is padded to a fixed width: a state's length does not depend on it.
    lengths = {len(State(seq, seq, None, 0).to_bytes("id")) for seq in range(100, 1000)}
    assert len(lengths) == 1
    unpadded = raw[: raw.rfind(b":") + 1] + b"%d}" % doc["check"]  # as written before padding
    assert _transcript._checked(unpadded, json.loads(unpadded))


def test_a_state_rewritten_in_place_before_a_reboot_is_rebuilt_not_trusted(local_root: Path) -> None:
    """After a power loss an in-place rewrite may be lost while the swap survived: the
    old content passes its check. Only the boot that wrote it trusts it."""
    root = local_root
    store = SyncStore(root, compact_every=0)
    for i in range(5):
        store.append(KEY, [entry(i)])
    doc = json.loads((tdir(root, KEY) / _layout.STATE).read_text())
    assert doc["boot"] == _fsio.boot_id()
    stale = State(9, 0, None, 0).to_bytes(boot="an-earlier-boot")  # valid, and wrong
    write_raw_state(root, stale)
    after_reboot = SyncStore(root, compact_every=0)
    after_reboot.append(KEY, [entry(5)])
    assert parts_of(root, KEY) == [_layout.part_name(n) for n in range(1, 7)]  # not part 10
    assert json.loads((tdir(root, KEY) / _layout.STATE).read_text())["boot"] == _fsio.boot_id()


@pytest.mark.skipif(not LOCAL or os.geteuid() != 0, reason="needs root (to be two users) on a local fs")
def test_two_users_sharing_a_store_by_group_take_the_spare_over_in_turn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another user's spare cannot take our mode or mtime: it is replaced, not written."""
    import subprocess
    import sys

    shared = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's own tmp_path is 0700 root's
    os.chmod(shared, 0o755)
    root = shared / "store"
    root.mkdir()
    os.chown(root, 0, 65534)
    os.chmod(root, 0o2770)  # setgid: everything below belongs to the shared group
    opts = {"dir_mode": 0o2770, "file_mode": 0o660, "compact_every": 0}
    store = SyncStore(root, **opts)
    store.append(KEY, [entry(0)])
    store.append(KEY, [entry(1)])  # the spare now exists, owned by root
    ahead = time.time_ns() + 10**10  # the next state must be dated after this: a utime
    os.utime(tdir(root, KEY) / _layout.STATE, ns=(ahead, ahead))
    code = f"""
import os, tempfile
from fsstore._store import SyncStore
# everything imported lazily is imported now, while the interpreter's files are readable
SyncStore(tempfile.mkdtemp(), **{opts!r}).append({KEY!r}, [{entry(9)!r}])
os.setgroups([]); os.setgid(65534); os.setuid(65534)
import logging
logging.basicConfig(format="%(code)s %(message)s")  # every fsstore record carries a code
s = SyncStore({str(root)!r}, **{opts!r})
s.append({KEY!r}, [{entry(2)!r}])
s.append({KEY!r}, [{entry(3)!r}])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and not r.stderr, r.stderr
    with caplog.at_level("WARNING", logger="fsstore"):
        store.append(KEY, [entry(4)])
    assert not caplog.records
    assert store.load(KEY) == [entry(i) for i in range(5)]
    doc = json.loads((tdir(root, KEY) / _layout.STATE).read_text())
    assert doc["seq"] == 5 and doc["folded"] == 5
    shutil.rmtree(shared)


def test_a_shorter_state_rewritten_over_a_longer_one_leaves_no_tail(tmp_path: Path) -> None:
    if not _fsio.is_local_fs(str(tmp_path)):
        pytest.skip("the temp directory is not on a local file system")
    fs = _fsio.Fs(fsync=False, dir_mode=0o700, file_mode=0o600)
    fs.exchange_ok = True
    d = os.open(tmp_path, os.O_RDONLY)
    try:
        big = State(1, 1, {"data": {"first_prompt": "x" * 500}}, 0)
        _transcript.write_state(fs, d, big)
        _transcript.write_state(fs, d, State(2, 2, big.summary, 0))
        _transcript.write_state(fs, d, State(3, 0, None, 0))  # into the inode of the first
        assert read_state(d)[0] == State(3, 0, None, 0)
        raw = (tmp_path / _layout.STATE).read_bytes()
        assert raw.endswith(b"}") and json.loads(raw)["seq"] == 3  # no tail of the longer one
    finally:
        os.close(d)


@pytest.mark.parametrize("seq", [-5, 10**20, "1e20"])
def test_a_state_with_a_sequence_no_part_can_carry_is_rebuilt(root: Path, seq: Any) -> None:
    store = SyncStore(root, compact_every=0)
    for i in range(3):
        store.append(KEY, [entry(i)])
    doc = {"format": 1, "seq": seq, "folded": 0, "compacted": 0, "summary": None}
    write_raw_state(root, json.dumps(doc).encode())
    SyncStore(root, compact_every=0).append(KEY, [entry(3)])
    assert parts_of(root, KEY) == [_layout.part_name(n) for n in range(1, 5)]
    assert store.load(KEY) == [entry(i) for i in range(4)]


def test_a_held_state_file_swapped_back_by_another_writer_is_read_again(local_root: Path) -> None:
    """A writer holds the state.json it swapped in and trusts it while state.json is
    still that inode and begins with its write id. Another writer's next two swaps
    bring the same inode back as state.json with their state in it (here: after a
    compaction, so the remembered sequence points inside the segment). The write id
    tells: the writer reads the file again and commits after the segment."""
    root = local_root
    a, b = SyncStore(root, compact_every=0), SyncStore(root, compact_every=0)
    a.append(KEY, [entry(0)])
    a.append(KEY, [entry(1)])  # a now holds state.json (and the spare) open
    (held,) = a._appending.values()
    assert held.current is not None
    b.append(KEY, [entry(2)])  # swaps the spare in: state.json is the other inode
    b.compact(KEY)  # swaps again: a's held inode is state.json again, b's state in it
    st = os.stat(tdir(root, KEY) / _layout.STATE)
    assert (st.st_dev, st.st_ino) == held.current.ident  # the case this test is about
    a.append(KEY, [entry(3)])
    assert SyncStore(root).load(KEY) == [entry(i) for i in range(4)]
    assert parts_of(root, KEY)[-1] == _layout.part_name(4)


def test_a_process_that_only_compacts_rewrites_the_state_in_place_too(local_root: Path) -> None:
    """Whether state.json is rewritten in place was decided on the append path only:
    a process that had only compacted replaced it by a new file, which the held-files
    check of other writers cannot see behind a state.json renamed away by hand."""
    root = local_root
    writer = SyncStore(root, compact_every=0)
    for i in range(3):
        writer.append(KEY, [entry(i)])
    d = tdir(root, KEY)
    inodes = {os.lstat(d / _layout.STATE).st_ino, os.lstat(d / _layout.STATE_SPARE).st_ino}
    assert SyncStore(root, compact_every=0).compact(KEY) == 3
    assert os.lstat(d / _layout.STATE).st_ino in inodes  # swapped, not a new file
    writer.append(KEY, [entry(3)])
    assert SyncStore(root).load(KEY) == [entry(i) for i in range(4)]


@pytest.mark.parametrize("content", [
    pytest.param(b'{"format":1,"seq":1e999,"folded":0,"summary":null,"compacted":0}', id="a sequence of 1e999"),
    pytest.param(b'{"format":1,"x":' + b"[" * 200_000 + b"]" * 200_000 + b"}", id="nested deeper than json parses"),
    pytest.param(None, id="bigger than any state"),
])
def test_a_state_file_fsstore_did_not_write_never_breaks_a_load_or_an_append(
    root: Path, monkeypatch: pytest.MonkeyPatch, content: bytes | None
) -> None:
    """load() reads state.json before listing (a hint); append() reads it under the
    lock. A file fsstore did not write is rebuilt from the parts, never an error, and
    an oversized one is not read whole."""
    store = SyncStore(root, compact_every=0)
    for i in range(2):
        store.append(KEY, [entry(i)])
    state = tdir(root, KEY) / _layout.STATE
    state.unlink()
    if content is None:
        with open(state, "wb") as f:
            f.truncate(_transcript.MAX_STATE_BYTES + 1)  # sparse: a huge file of zeros
    else:
        state.write_bytes(content)
    reads: list[int] = []
    real_pread = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        reads.append(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    reader = SyncStore(root, compact_every=0)
    assert reader.load(KEY) == [entry(0), entry(1)]
    reader.append(KEY, [entry(2)])
    assert SyncStore(root).load(KEY) == [entry(i) for i in range(3)]
    assert max(reads, default=0) <= _transcript.MAX_STATE_BYTES
