"""Real processes whose lock holds overlap: writers with skewed clocks or stalled
system calls, readers recording every snapshot, and the checks of format 2's promise.

Each writer appends batches ``<name>-<i>`` of ``PER_BATCH`` entries (uuids
``<name>-<i>-<j>``) and writes the name of each batch whose ``append`` returned to
its log file, so the check knows exactly what was acknowledged. Each reader writes
one line per load: the batch names of that snapshot, in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = str(Path(__file__).resolve().parents[2])
KEY = {"project_key": "-overlap", "session_id": "s"}
PER_BATCH = 3
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"

WRITER = """
import json, sys, time
sys.path.insert(0, {repo!r})
from fsstore._store import SyncStore
from fsstore import FsStoreError
s = SyncStore({root!r}, create=True, **{opts!r})
key = {key!r}
with open({log!r}, "a") as log:
    for i in range({n}):
        name = "{name}-%d" % i
        try:
            s.append(key, [{{"uuid": "%s-%d" % (name, j), "b": name}} for j in range({per})])
        except FsStoreError as exc:
            print("failed", name, exc.code, file=sys.stderr, flush=True)
            continue
        log.write(name + "\\n")
        log.flush()
        time.sleep({pause})
"""

READER = """
import json, sys, time
sys.path.insert(0, {repo!r})
from fsstore._store import SyncStore
s = SyncStore({root!r}, create=True)
key = {key!r}
deadline = time.monotonic() + {seconds}
with open({log!r}, "a") as log:
    while time.monotonic() < deadline:
        got = s.load(key) or []
        names = []
        for e in got:
            if not names or names[-1] != e["b"]:
                names.append(e["b"])
        log.write(json.dumps(names) + "\\n")
        log.flush()
"""

COMPACTOR = """
import sys, time
sys.path.insert(0, {repo!r})
from fsstore._store import SyncStore
from fsstore import FsStoreError
s = SyncStore({root!r}, create=True, **{opts!r})
deadline = time.monotonic() + {seconds}
while time.monotonic() < deadline:
    try:
        s.compact({key!r})
    except FsStoreError as exc:
        print("compact failed", exc.code, file=sys.stderr, flush=True)
    time.sleep(0.05)
"""


def faketime_env(offset: str) -> dict[str, str]:
    """The environment of a process whose clock is ``offset`` off (libfaketime; file
    times stay the storage's, as on NFS)."""
    return {**os.environ, "LD_PRELOAD": FAKETIME_LIB, "FAKETIME": offset,
            "FAKETIME_DONT_RESET": "1", "FAKETIME_NO_CACHE": "1"}


def start_writer(root: Path, work: Path, name: str, n: int, opts: dict[str, Any], *,
                 prefix: list[str] | None = None, env: dict[str, str] | None = None,
                 pause: float = 0.0) -> subprocess.Popen[str]:
    code = WRITER.format(repo=REPO, root=str(root), opts=opts, key=KEY, log=str(work / f"{name}.acked"),
                         n=n, name=name, per=PER_BATCH, pause=pause)
    with open(work / f"{name}.err", "w") as err:  # the child keeps its own copy
        return subprocess.Popen([*(prefix or []), sys.executable, "-c", code], env=env,
                                stderr=err, text=True)


def start_reader(root: Path, work: Path, name: str, seconds: float) -> subprocess.Popen[str]:
    code = READER.format(repo=REPO, root=str(root), key=KEY, log=str(work / f"{name}.snaps"),
                         seconds=seconds)
    with open(work / f"{name}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-c", code], stderr=err, text=True)


def start_compactor(root: Path, work: Path, seconds: float, opts: dict[str, Any]) -> subprocess.Popen[str]:
    code = COMPACTOR.format(repo=REPO, root=str(root), opts=opts, key=KEY, seconds=seconds)
    with open(work / "compactor.err", "w") as err:
        return subprocess.Popen([sys.executable, "-c", code], stderr=err, text=True)


def wait_all(procs: list[subprocess.Popen[str]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            raise AssertionError(f"{p.args[:3]} did not finish in {timeout} s") from None


def verify(root: Path, work: Path) -> dict[str, int]:
    """Every acknowledged batch exactly once and whole in the final load; every reader
    snapshot a prefix of it; no error output but failed appends. Returns figures."""
    from fsstore._store import SyncStore

    got = SyncStore(root, create=True).load(KEY) or []
    order: list[str] = []
    count: dict[str, int] = {}
    for e in got:
        count[e["b"]] = count.get(e["b"], 0) + 1
        if not order or order[-1] != e["b"]:
            order.append(e["b"])
    acked = [ln for f in sorted(work.glob("*.acked")) for ln in f.read_text().split()]
    lost = [b for b in acked if b not in count]
    torn = [b for b, c in count.items() if c != PER_BATCH]
    assert not lost, f"{len(lost)} acknowledged batches lost: {lost[:10]}"
    assert not torn, f"batches not whole or twice: {torn[:10]}"
    assert len(order) == len(set(order)), "a batch appears in two places"
    snapshots = 0
    for f in sorted(work.glob("*.snaps")):
        for line in f.read_text().splitlines():
            snap = json.loads(line)
            snapshots += 1
            assert snap == order[: len(snap)], f"{f.name}: a snapshot is not a prefix of the final order"
    failed = 0
    for f in sorted(work.glob("*.err")):
        for line in f.read_text().splitlines():
            if line.startswith("failed "):
                failed += 1
                name, code = line.split()[1:3]
                assert name not in count, f"{name} failed with {code} but is in the transcript"
                continue
            assert line.startswith("compact failed "), f"{f.name}: {line}"  # a traceback, a CORRUPT
    return {"acked": len(acked), "snapshots": snapshots, "failed": failed, "batches": len(order)}
