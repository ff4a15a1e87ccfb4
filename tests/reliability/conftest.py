"""Fixtures of the reliability tests: real processes, mounts, and the run's figures.

* ``procs``: a multiprocessing context whose children are real processes forked
  from a warm server (``forkserver``, with fsstore and claude-agent-sdk preloaded,
  so a child starts in milliseconds instead of ~0.6 s of imports).
* ``figures``: counters every test adds to (appends, writer processes, crash
  points, faults injected, entries lost); printed at the end of the run and, with
  ``FSSTORE_RELIABILITY_FIGURES=path``, written there as JSON (docs/reliability.md
  quotes them). In a parallel run each worker counts its own, which the controller
  sums (tests/conftest.py).
* Mount fixtures skip with the reason when root, /dev/fuse or the binaries are
  missing, and always unmount, also when a test fails.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import _mounts

FIGURES: collections.Counter[str] = collections.Counter()
CRASH_POINTS: set[str] = set()
FAULT_KINDS: set[str] = set()
MAXIMA: set[str] = set()  # figures that are the largest value seen, not a count


class Figures:
    def add(self, name: str, n: int = 1) -> None:
        FIGURES[name] += n

    def crash_point(self, name: str) -> None:
        CRASH_POINTS.add(name)
        FIGURES["crash rounds (kill -9)"] += 1

    def maximum(self, name: str, value: int) -> None:
        MAXIMA.add(name)
        FIGURES[name] = max(FIGURES[name], value)

    def fault(self, kind: str, n: int = 1) -> None:
        FAULT_KINDS.add(kind)
        FIGURES["faults injected"] += n


@pytest.fixture(scope="session")
def figures() -> Figures:
    return Figures()


@pytest.fixture(scope="session")
def procs() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.reliability._children"])
    return ctx


@pytest.fixture
def tmpfs_dir(tmp_path: Path) -> Iterator[Path]:
    """Skips without root/mount; yields a directory for size-limited tmpfs mounts."""
    if reason := _mounts.tmpfs_unavailable():
        pytest.skip(reason)
    yield tmp_path


@pytest.fixture(scope="module")
def fault_mount(tmp_path_factory: pytest.TempPathFactory, figures: Figures) -> Iterator[_mounts.FaultFs]:
    if reason := _mounts.faultfs_unavailable():
        pytest.skip(reason)
    try:
        mount = _mounts.faultfs(tmp_path_factory.mktemp("faultfs"))
        ffs = mount.__enter__()
    except RuntimeError as exc:  # the environment cannot mount FUSE (e.g. no CAP_SYS_ADMIN)
        pytest.skip(f"faultfs cannot mount here: {exc}")
    try:
        yield ffs
    finally:
        mount.__exit__(None, None, None)


@pytest.fixture(scope="module")
def bindfs_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if reason := _mounts.bindfs_unavailable():
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("bindfs")
    with _mounts.bindfs(base / "src", base / "mnt") as mnt:
        yield Path(mnt)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for path in list(reversed(_mounts.MOUNTED)):
        _mounts.unmount(path)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: handed to the controller
        from ._check import TOTALS

        workeroutput["fsstore_figures"] = {
            "figures": dict(FIGURES), "maxima": sorted(MAXIMA), "totals": dict(TOTALS),
            "crash_points": sorted(CRASH_POINTS), "fault_kinds": sorted(FAULT_KINDS)}


def merge(worker: dict[str, Any] | None) -> None:
    """Add a worker's figures (what its ``pytest_sessionfinish`` handed over) to these."""
    if not worker:
        return
    from ._check import TOTALS

    MAXIMA.update(worker["maxima"])
    for name, value in worker["figures"].items():
        FIGURES[name] = max(FIGURES[name], value) if name in MAXIMA else FIGURES[name] + value
    for name, value in worker["totals"].items():
        TOTALS[name] += value
    CRASH_POINTS.update(worker["crash_points"])
    FAULT_KINDS.update(worker["fault_kinds"])


def summary() -> dict[str, Any]:
    from ._check import TOTALS

    out: dict[str, Any] = dict(FIGURES)
    out.update(TOTALS)
    out["distinct crash points"] = len(CRASH_POINTS)
    out["crash points"] = sorted(CRASH_POINTS)
    out["fault kinds"] = sorted(FAULT_KINDS)
    return out


def report(terminalreporter: Any) -> None:
    """Print the figures (and write them where ``FSSTORE_RELIABILITY_FIGURES`` says)."""
    from ._check import TOTALS

    if not FIGURES and not any(TOTALS.values()):
        return
    data = summary()
    terminalreporter.section("fsstore reliability figures")
    for name in sorted(data):
        if isinstance(data[name], list):
            terminalreporter.write_line(f"{name}: {', '.join(map(str, data[name]))}")
        else:
            terminalreporter.write_line(f"{name}: {data[name]}")
    if target := os.environ.get("FSSTORE_RELIABILITY_FIGURES"):
        Path(target).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
