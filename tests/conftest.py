"""Shared fixtures: a store in a fresh temp directory, both async backends, and a
directory another uid can reach."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsstore import FsSessionStore

# FSSTORE_TEST_ROOT lets the whole suite run with the store on another mount (the
# FUSE job in tests/reliability points it at a bindfs mount).
_BASE = os.environ.get("FSSTORE_TEST_ROOT")

# FSSTORE_TEST_DENY_OPENAT2=EPERM|ENOSYS: the kernel refuses openat2 to this run (a
# seccomp filter), as a container profile or a kernel before 5.6 does; fsstore must
# fall back to its component-by-component walk (tests/reliability/test_no_openat2.py).
if os.environ.get("FSSTORE_TEST_DENY_OPENAT2"):
    import errno

    from ._seccomp import SYS_OPENAT2, deny

    deny(SYS_OPENAT2, getattr(errno, os.environ["FSSTORE_TEST_DENY_OPENAT2"]))


# The reliability figures (tests/reliability/conftest.py) are printed here, in the
# process that reports: in a parallel run (pytest-xdist: pyproject's addopts) that is
# the controller, which sums what each worker counted.
@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    from .reliability import conftest as reliability

    reliability.merge(node.workeroutput.get("fsstore_figures"))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    from .reliability import conftest as reliability

    reliability.report(terminalreporter)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    if _BASE:
        d = Path(_BASE) / tmp_path.name
        d.mkdir(parents=True, exist_ok=True)
        return d / "store"
    return tmp_path / "store"


@pytest.fixture
def astore(root: Path) -> FsSessionStore:
    return FsSessionStore(root, create=True)


@pytest.fixture
def store(astore: FsSessionStore):  # type: ignore[no-untyped-def]
    return astore.sync


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


KEY = {"project_key": "-home-user-repo", "session_id": "6f1c2a34-5b6d-4e7f-8a9b-0c1d2e3f4a5b"}


def entry(n: int, **extra: object) -> dict[str, object]:
    """A realistic-looking transcript entry with a unique uuid."""
    return {"type": "user", "uuid": f"u-{n}", "timestamp": "2024-01-01T00:00:00.000Z",
            "message": {"role": "user", "content": f"message {n}"}, **extra}


def trash_left(root: Path) -> list[str]:
    """What a delete left in ``<root>/.trash`` besides its tombstones (``*-tomb``
    directories holding only ``.deleted`` marks, kept for writers that still reach the
    deleted directory: docs/format.md "Deletes"): should be nothing."""
    trash = root / ".trash"
    if not trash.exists():
        return []
    out = []
    for entry in trash.iterdir():
        if not entry.name.endswith("-tomb"):
            out.append(entry.name)
            continue
        out += [str(p.relative_to(trash)) for p in entry.rglob("*") if not p.is_dir() and p.name != ".deleted"]
    return out


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory another uid can reach (pytest's tmp_path is 0700 root's)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the CLI as another uid")
    d = Path(tempfile.mkdtemp(prefix="fsstore-cli-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
