"""Fixtures of the network tests: GlusterFS and sshfs, each mounted twice.

Session-scoped: a mount pair is made when the first test asks for it and torn down
at the end of the run (a session-end finalizer unmounts and stops whatever is
left, also after a failure). Each skips with the reason where it cannot run here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

import pytest

# the run's figures, and faultfs (test_unsupported): the reliability tests' fixtures
from tests.reliability.conftest import fault_mount, figures  # noqa: F401

from . import _netmounts
from ._netmounts import Pair

PAIRS = ("gluster", "sshfs", "sshfs_nocache")
T = TypeVar("T")


def _made(make: Callable[[], AbstractContextManager[T]], what: str) -> Iterator[T]:
    """Enter what ``make`` returns for the session (skip, saying why, if it cannot run)."""
    try:
        ctx = make()
        value = ctx.__enter__()
    except RuntimeError as exc:
        pytest.skip(f"{what} cannot run here: {exc}")
    try:
        yield value
    finally:
        ctx.__exit__(None, None, None)


@pytest.fixture(scope="session")
def gluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    if reason := _netmounts.gluster_unavailable():
        pytest.skip(reason)
    yield from _made(lambda: _netmounts.gluster_pair(tmp_path_factory.mktemp("gluster")), "GlusterFS")


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    if reason := _netmounts.sshfs_unavailable():
        pytest.skip(reason)
    yield from _made(lambda: _netmounts.sshd(tmp_path_factory.mktemp("sshd")), "sshd")


def _sshfs(tmp_path_factory: pytest.TempPathFactory, sshd: tuple[int, Path], cached: bool) -> Iterator[Pair]:
    yield from _made(
        lambda: _netmounts.sshfs_pair(tmp_path_factory.mktemp("sshfs"), *sshd, cached=cached), "sshfs")


@pytest.fixture(scope="session")
def sshfs(tmp_path_factory: pytest.TempPathFactory, sshd: tuple[int, Path]) -> Iterator[Pair]:
    yield from _sshfs(tmp_path_factory, sshd, True)


@pytest.fixture(scope="session")
def sshfs_nocache(tmp_path_factory: pytest.TempPathFactory, sshd: tuple[int, Path]) -> Iterator[Pair]:
    yield from _sshfs(tmp_path_factory, sshd, False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _netmounts.cleanup_all()


