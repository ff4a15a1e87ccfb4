"""fsstore where the kernel refuses ``openat2``: a kernel before 5.6 (``ENOSYS``) or a
container whose seccomp profile predates it (``EPERM``, Docker's default did so).

fsstore then walks paths one component at a time with ``O_NOFOLLOW`` (and stats
transcripts for listings the same way). A real seccomp filter makes the kernel refuse
the call (tests/_seccomp.py); the tests run in a subprocess that installs it. In every
run: every store operation with each, and the symlink-safety tests with ``EPERM``. As a
soak test: the whole suite (this directory excepted) with each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers import NESTED_SUITE_SECONDS, nested_suite

REPO = Path(__file__).resolve().parents[2]

# Runs under the filter: every store operation, then proof that the fallback was taken.
_PROBE = """
import errno, sys
import tests.conftest  # installs the filter (FSSTORE_TEST_DENY_OPENAT2)
from fsstore._fsio import _SYS_OPENAT2, _syscall
import ctypes
assert _syscall(_SYS_OPENAT2, -100, b"/", None, 24) == -1
assert ctypes.get_errno() == getattr(errno, sys.argv[2]), ctypes.get_errno()
from fsstore._store import SyncStore
s = SyncStore(sys.argv[1], create=True)
key = {"project_key": "p", "session_id": "s", "subpath": "agents/a"}
for k in ({"project_key": "p", "session_id": "s"}, key):
    s.append(k, [{"type": "user", "uuid": "u1"}])
    s.append(k, [{"type": "user", "uuid": "u2"}])
assert [e["uuid"] for e in s.load(key)] == ["u1", "u2"]
assert [x["session_id"] for x in s.list_sessions("p")] == ["s"]
assert s.list_subkeys({"project_key": "p", "session_id": "s"}) == ["agents/a"]
assert s.compact(key) == 2
s.delete({"project_key": "p", "session_id": "s"})
assert s.list_sessions("p") == []
assert not s._fs.openat2_ok, "fsstore did not notice that openat2 is refused"
print("fallback ok")
"""


@pytest.fixture(autouse=True, scope="module")
def _filter_possible() -> None:
    r = subprocess.run([sys.executable, "-c", "import errno, tests._seccomp as s; s.deny(s.SYS_OPENAT2, errno.EPERM)"],
                       cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    if r.returncode != 0:
        pytest.skip(f"this machine does not let a process install a seccomp filter: {r.stderr[-300:]}")


def _env(err: str) -> dict[str, str]:
    return {**os.environ, "FSSTORE_TEST_DENY_OPENAT2": err,
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _pytest(err: str, basetemp: Path, *args: str) -> None:
    r = nested_suite(f"--basetemp={basetemp}", *args, env=_env(err), cwd=REPO)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


@pytest.mark.parametrize("err", ["EPERM", "ENOSYS"])
def test_every_operation_falls_back_to_the_walk(tmp_path: Path, err: str) -> None:
    r = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "store"), err], cwd=REPO,
                       env=_env(err), capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and "fallback ok" in r.stdout, r.stdout + r.stderr


def test_symlink_safety_tests_pass_without_openat2(tmp_path: Path) -> None:
    _pytest("EPERM", tmp_path / "basetemp", "-n", "0", "tests/reliability/test_security.py")  # (a worker already)


@pytest.mark.soak
@pytest.mark.timeout(NESTED_SUITE_SECONDS + 120)
@pytest.mark.parametrize("err", ["EPERM", "ENOSYS"])
def test_soak_whole_suite_without_openat2(tmp_path: Path, err: str) -> None:
    _pytest(err, tmp_path / "basetemp", "--ignore=tests/reliability", "tests")
