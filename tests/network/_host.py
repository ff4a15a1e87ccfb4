"""What the network tests run "on a host": ``python -m tests.network._host ROLE JSON``.

Started by :func:`tests.network._netmounts.child` inside a UTS namespace of its own.
Every role waits for ``start`` (a file) to exist, works until ``stop`` exists or
its work is done, and prints one JSON line with what it saw. Store errors are
counted by code, never raised: the parent decides what they mean.

Roles:
* ``writer``: append ``batches`` batches (``_check.batch``) to ``key``, ``pause``
  seconds apart (default: back to back); reports the acknowledged batches and the
  failed ones with their codes.
* ``reader``: load ``keys`` in a loop; every snapshot must be whole
  (``_check.verify``) and be a prefix of the longest one seen of the same key, or
  extend it (so that all are prefixes of the final transcript when the longest
  is; a shorter one after a longer one is counted as ``went_back``) (or be None
  where ``deletes`` says a key may vanish: then it must be None or ``full``
  entries long, never a part). Reports loads, problems, codes, last snapshots.
* ``lister``: ``list_sessions`` (``summaries``: ``list_session_summaries``;
  ``subkeys``: ``list_subkeys`` of that key) in a loop; counts codes, and listings
  that lack an id of ``expect``.
* ``churner``: make ``key``'s session (one batch to its main transcript and to each
  of ``subpaths``) and delete it, again and again, for ``seconds`` (``fresh``: a
  session named anew each round).
* ``deleter``: delete ``keys`` one by one, ``pause`` seconds apart.
* ``compactor``: append and ``compact`` ``key`` in turn.
* ``maintainer``: ``fsstore gc`` (or ``prune``: ``command``) with ``older_than`` in a
  loop, ``pause`` seconds apart; reports failed actions (code and detail) and how often.
* ``holder``: take ``key``'s lock and keep it ``hold`` seconds (touching ``inside``
  once in); reports when it was in, by the monotonic clock, which every "host" here
  shares.
* ``stall``: append one batch (or delete ``key``: ``op``), stopping at a named point of the commit (the
  parent SIGSTOPs it there).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
import traceback
from typing import Any

from fsstore import FsSessionStore, FsStoreError
from tests.reliability._check import batch, verify


def _wait_start(spec: dict[str, Any]) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(spec["start"]):
        if time.monotonic() > deadline:
            raise SystemExit("no start")
        time.sleep(0.005)


def _stopped(spec: dict[str, Any]) -> bool:
    return bool(spec.get("stop")) and os.path.exists(spec["stop"])


def writer(spec: dict[str, Any]) -> dict[str, Any]:
    store = FsSessionStore(spec["root"], create=True, **spec.get("opts", {})).sync
    key, wid = spec["key"], spec["wid"]
    sizes = spec.get("sizes") or [1 + (wid_hash(wid) + b) % 4 for b in range(spec["batches"])]
    acked: list[list[int]] = []
    failed: list[list[Any]] = []
    began: dict[int, float] = {}  # when each append was called (time.time())
    codes: collections.Counter[str] = collections.Counter()
    _wait_start(spec)
    deadline = time.monotonic() + spec.get("seconds", 600)
    for b, n in enumerate(sizes):
        if _stopped(spec) or time.monotonic() > deadline:
            break
        began[b] = time.time()
        try:
            store.append(key, batch(wid, b, n))
        except FsStoreError as exc:
            failed.append([b, exc.code, str(exc)[:300] + ("\n" + traceback.format_exc()[-1500:] if spec.get("tracebacks") else "")])
            codes[exc.code] += 1
        else:
            acked.append([b, n])
        time.sleep(spec.get("pause", 0))
    return {"acked": acked, "failed": failed, "codes": dict(codes), "began": began}


def wid_hash(wid: str) -> int:
    return sum(map(ord, wid))


def reader(spec: dict[str, Any]) -> dict[str, Any]:
    store = FsSessionStore(spec["root"], create=True, **spec.get("opts", {})).sync
    keys: list[dict[str, str]] = spec["keys"]
    full: int | None = spec.get("full")  # deletes: a load is None or this many entries
    prev: dict[int, list[list[Any]]] = {}  # the longest snapshot of each key so far
    went_back = 0  # a snapshot shorter than one seen before (a client cache showing an older listing)
    codes: collections.Counter[str] = collections.Counter()
    problems: list[str] = []
    loads = nones = 0
    _wait_start(spec)
    deadline = time.monotonic() + spec.get("seconds", 600)
    while not _stopped(spec) and time.monotonic() < deadline and len(problems) < 20:
        for k, key in enumerate(keys):
            try:
                entries = store.load(key)
            except FsStoreError as exc:
                codes[exc.code] += 1
                if len(problems) < 20 and spec.get("errors_are_problems", True):
                    problems.append(f"load {loads}: {str(exc)[:300]}")
                continue
            loads += 1
            if entries is None:
                nones += 1
                if full is None and prev.get(k):
                    problems.append(f"load {loads} of {key['session_id']}: None after {len(prev[k])} entries")
                continue
            v = verify(entries)
            if not v.ok():
                problems.append(f"load {loads} of {key['session_id']}: {v.problems[:2]}")
            snap = [[e["w"], e["b"], e["i"]] for e in entries]
            if full is not None:
                if len(snap) != full:
                    problems.append(f"load {loads} of {key['session_id']}: {len(snap)} of {full} entries")
                continue
            old = prev.get(k, [])
            if len(snap) < len(old):
                went_back += 1
                if old[: len(snap)] != snap:
                    problems.append(f"load {loads} of {key['session_id']}: {len(snap)} entries are not a prefix of the {len(old)} seen before")
            elif snap[: len(old)] != old:
                problems.append(f"load {loads} of {key['session_id']}: {len(snap)} entries do not extend the {len(old)} seen before")
            else:
                prev[k] = snap
    return {"loads": loads, "nones": nones, "went_back": went_back, "problems": problems, "codes": dict(codes),
            "last": {str(k): v for k, v in prev.items()}}


def lister(spec: dict[str, Any]) -> dict[str, Any]:
    store = FsSessionStore(spec["root"], create=True, **spec.get("opts", {})).sync

    def listing() -> set[str]:
        if spec.get("subkeys"):
            return set(store.list_subkeys(spec["subkeys"]))
        listed = store.list_session_summaries if spec.get("summaries") else store.list_sessions
        return {s["session_id"] for s in listed(spec["project"])}

    codes: collections.Counter[str] = collections.Counter()
    lists = missing = 0
    _wait_start(spec)
    deadline = time.monotonic() + spec.get("seconds", 600)
    while not _stopped(spec) and time.monotonic() < deadline:
        try:
            listed = listing()
            lists += 1
            missing += not set(spec.get("expect", [])) <= listed
        except FsStoreError as exc:
            codes[exc.code] += 1
    return {"lists": lists, "codes": dict(codes), "missing": missing}


def deleter(spec: dict[str, Any]) -> dict[str, Any]:
    store = FsSessionStore(spec["root"], create=True, **spec.get("opts", {})).sync
    codes: collections.Counter[str] = collections.Counter()
    _wait_start(spec)
    for key in spec["keys"]:
        time.sleep(spec.get("pause", 0.05))
        try:
            store.delete(key)
        except FsStoreError as exc:
            codes[exc.code] += 1
    ended = time.time()
    time.sleep(spec.get("linger", 0))  # the others go on this long after the last delete
    return {"deleted": len(spec["keys"]), "codes": dict(codes), "ended": ended}


def churner(spec: dict[str, Any]) -> dict[str, Any]:
    store = FsSessionStore(spec["root"], create=True, **spec.get("opts", {})).sync
    key = spec["key"]
    codes: collections.Counter[str] = collections.Counter()
    errors: list[str] = []
    rounds = 0
    _wait_start(spec)
    deadline = time.monotonic() + spec.get("seconds", 600)
    while not _stopped(spec) and time.monotonic() < deadline:
        try:
            if spec.get("fresh"):  # a session of its own each round
                key = {**spec["key"], "session_id": f"{spec['key']['session_id']}-{rounds}"}
            for sub in [None, *spec.get("subpaths", [])]:
                store.append(key if sub is None else {**key, "subpath": sub}, batch("c", rounds, 1))
            store.delete(key)
            rounds += 1
        except FsStoreError as exc:
            codes[exc.code] += 1
            errors.append(f"{exc.operation}: {exc}"[:300])
    return {"rounds": rounds, "codes": dict(codes), "errors": errors[:5]}


def compactor(spec: dict[str, Any]) -> dict[str, Any]:
    store = FsSessionStore(spec["root"], create=True, **spec.get("opts", {})).sync
    key, wid = spec["key"], spec["wid"]
    acked: list[list[int]] = []
    codes: collections.Counter[str] = collections.Counter()
    compactions = 0
    _wait_start(spec)
    for b in range(spec["batches"]):
        try:
            store.append(key, batch(wid, b, 2))
            acked.append([b, 2])
            if b % spec.get("every", 4) == spec.get("every", 4) - 1:
                store.compact(key)
                compactions += 1
        except FsStoreError as exc:
            codes[exc.code] += 1
    return {"acked": acked, "compactions": compactions, "codes": dict(codes)}


def maintainer(spec: dict[str, Any]) -> dict[str, Any]:
    """``fsstore gc`` (or ``prune``: ``command``) ``--older-than older_than``, in process,
    again and again; counts the actions that failed, by code."""
    from fsstore import _cleanup

    failed: collections.Counter[str] = collections.Counter()
    runs = removed = 0
    _wait_start(spec)
    while not _stopped(spec):
        if spec.get("command") == "prune":
            actions, _looked = _cleanup.prune(spec["root"], older_than=spec["older_than"])
        else:
            actions = _cleanup.gc(spec["root"], older_than=spec["older_than"])
        runs += 1
        removed += sum(a.done for a in actions)
        failed.update(f"{a.code}: {a.detail}" for a in actions if a.failed)
        time.sleep(spec.get("pause", 0.2))
    return {"runs": runs, "removed": removed, "failed": dict(failed)}


class _Say:
    """The tracer's pipe, as JSON lines on stdout."""

    def send(self, msg: Any) -> None:
        print(json.dumps(["paused" if msg[0] == "paused" else msg[0], *msg[1:4]]), flush=True)


def stall(spec: dict[str, Any]) -> dict[str, Any]:
    """Append one batch and stop at ``point`` (tests/reliability/_children.POINTS) for
    ``pause`` seconds, after saying so: the parent SIGSTOPs us there."""
    from tests.reliability import _children

    tracer = _children.Tracer(_Say(), _children.POINTS[spec["point"]][2])
    tracer.pause = spec["pause"]
    _children.install(tracer)
    store = FsSessionStore(spec["root"], create=True, **spec.get("opts", {})).sync
    _wait_start(spec)
    tracer.armed = True
    try:
        if spec.get("op") == "delete":
            store.delete(spec["key"])
            return {"deleted": 1, "codes": {}}
        store.append(spec["key"], batch(spec["wid"], 0, 3))
        store._compactions.done()  # an automatic compaction is the append's work too (its thread's)
    except FsStoreError as exc:
        return {"acked": [], "codes": {exc.code: 1}, "message": str(exc)}
    finally:
        tracer.armed = False
    return {"acked": [[0, 3]], "codes": {}}


def holder(spec: dict[str, Any]) -> dict[str, Any]:
    store = FsSessionStore(spec["root"], create=True, **spec.get("opts", {})).sync
    _wait_start(spec)
    with store.locked(spec["key"]):
        tin = time.monotonic()
        if spec.get("inside"):
            open(spec["inside"], "w").close()
        time.sleep(spec["hold"])
        tend = time.monotonic()
    return {"tin": tin, "tend": tend, "codes": {}}


ROLES = {"holder": holder, "stall": stall, "writer": writer, "reader": reader, "lister": lister, "deleter": deleter,
         "churner": churner, "compactor": compactor, "maintainer": maintainer}


def main(argv: list[str]) -> None:
    role, spec = argv[0], json.loads(argv[1])
    try:
        out: dict[str, Any] = ROLES[role](spec)
        out["host"] = os.uname().nodename
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        out = {"error": traceback.format_exc()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
