"""kill -9 at every step of the commit, of compaction, of delete and of a summary update.

A child process runs one store operation with its filesystem-changing system calls
traced (tests/reliability/_children.py) and stops at a chosen point; the test
SIGKILLs it there, reaps it, and then checks the promises:

* ``load`` works and returns exactly the batches committed so far, each whole, none
  twice, in commit order; the killed batch is there if and only if the child's
  trace shows the move of its temp file to a part name (the commit point);
* a delete is all or nothing: the session is gone if and only if the trace shows
  its ``.deleted`` marker made (whoever finds a marked transcript finishes it);
* every summary the store reports agrees with a fold of the transcript;
* ``list_sessions`` / ``list_subkeys`` report exactly the transcripts that load;
* a new writer gets the lock within ``stale_lock_seconds`` plus a small margin,
  and its batch lands after everything else.

The named points run in every test run; the random campaign picks operation,
batch, fsync, compaction and the k-th system call from a seed, printed so that a
failure replays with ``FSSTORE_CRASH_SEED=<seed>`` (``FSSTORE_CRASH_ROUNDS`` sets
the rounds per seed).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from . import _children
from ._crash import MAIN, PROJECT, SUB, crash_round, fresh_model, named_point


@pytest.mark.parametrize("point", sorted(_children.POINTS))
def test_kill_9_at_named_point_leaves_store_consistent(
    point: str, procs: Any, tmp_path: Path, figures: Any
) -> None:
    named_point(procs, tmp_path / "store", figures, point)


def _campaign(procs: Any, root: Path, seed: int, rounds: int, figures: Any) -> None:
    rng = random.Random(seed)
    model = fresh_model(root / f"seed-{seed}", compact_every=rng.choice([0, 3, 5]))
    estimate: dict[str, int] = {}
    for r in range(rounds):
        roll = rng.random()
        if roll < 0.55:
            op, key = "append", MAIN
        elif roll < 0.75:
            op, key = "append", SUB
        elif roll < 0.82:
            op, key = "append", {"project_key": PROJECT, "session_id": rng.choice(["s-b", "s" * 200])}
        elif roll < 0.92:
            op, key = "delete", rng.choice([MAIN, SUB])
        else:
            op, key = "compact", rng.choice([MAIN, SUB])
        est = estimate.get(op, 30)
        spec = {
            "k": rng.randint(1, est),
            "phase": rng.choice(["before", "after"]),
            "n": rng.randint(1, 6),
            "opts": {"fsync": rng.random() < 0.3},
        }
        label = f"{op}:{spec['phase']}#{spec['k']}"
        print(f"seed {seed} round {r}: {op} {key} {spec}")
        kind, count = crash_round(procs, model, figures, op=op, key=key, spec=dict(spec), label=label)
        if kind == "completed":
            # k was past the end: aim inside this operation's calls from now on
            estimate[op] = max(2, count)


def _seeds(default: list[int]) -> list[int]:
    env = os.environ.get("FSSTORE_CRASH_SEED")
    return [int(s) for s in env.split(",")] if env else default


@pytest.mark.parametrize("seed", _seeds([20250101, 7, 42]))
def test_kill_9_at_random_syscall_keeps_every_promise(seed: int, procs: Any, tmp_path: Path, figures: Any) -> None:
    rounds = int(os.environ.get("FSSTORE_CRASH_ROUNDS", "15"))
    print(f"crash campaign seed={seed} rounds={rounds} (replay: FSSTORE_CRASH_SEED={seed})")
    _campaign(procs, tmp_path, seed, rounds, figures)


@pytest.mark.soak
@pytest.mark.parametrize("seed", _seeds(list(range(1000, 1020))))
def test_soak_kill_9_campaign(seed: int, procs: Any, tmp_path: Path, figures: Any) -> None:
    rounds = int(os.environ.get("FSSTORE_CRASH_ROUNDS", "60"))
    print(f"crash campaign seed={seed} rounds={rounds} (replay: FSSTORE_CRASH_SEED={seed})")
    _campaign(procs, tmp_path, seed, rounds, figures)
