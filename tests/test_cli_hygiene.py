"""What the CLI prints to a person, and how it fails: escape sequences planted in the
store never reach the terminal, bad arguments are usage errors, not tracebacks, what
it creates has the store's modes, and a partial answer says it is partial.

Driven as a user drives it: the CLI in a subprocess.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fsstore import _layout
from fsstore._store import SyncStore

from ._helpers import SUB, P, S, age, fsstore, lock_file, tdir, write_jsonl
from .conftest import KEY, entry

TOP = Path(__file__).resolve().parents[1]
#: Terminal escape sequences: set the window title, clear the screen, colour.
PLANTED = ("\x1b]0;owned\x07", "\x1b[2J", "\x1b[31m")


def assert_no_control(*texts: str) -> None:
    for text in texts:
        assert not any(c in text for c in "\x1b\x07\x9b"), text


# -- 13 ------------------------------------------------------------------------------------


def test_names_and_lock_records_planted_in_the_store_are_printed_escaped(
    root: Path, store: SyncStore, tmp_path: Path
) -> None:
    store.append(KEY, [entry(1)])
    (tdir(root, KEY) / f"x{PLANTED[0]}").write_text("planted")  # check: unexpected entry
    (tdir(root, KEY).parents[1] / f"bad{PLANTED[1]}").mkdir()  # ls: a name that does not decode
    lock_file(root, KEY).write_text(f"4242\nhost{PLANTED[2]}\n1\n")  # locks: the host line
    age(lock_file(root, KEY), 7200)  # stale, so that gc would break it (and names its host)
    projects = tmp_path / "projects"
    write_jsonl(projects / P / f"s{PLANTED[0]}.jsonl", [entry(2)])  # import: a local name

    for args in (("check", root), ("ls", root), ("locks", root), ("import", root, projects),
                 ("gc", root, "--older-than", "0s", "--dry-run")):
        proc = fsstore(*args)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert_no_control(proc.stdout, proc.stderr)
        assert "\\x1b" in proc.stdout + proc.stderr, (args, proc.stdout, proc.stderr)


# -- 14 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ("ls", "{root}", "--project", b"\xff"),
    ("compact", "{root}", "--project", b"-home-\xfe"),
    ("compact", "{root}", "--session", b"\xff"),
    ("prune", "{root}", "--older-than", "30d", "--project", b"\xff"),
])
def test_keys_that_are_not_utf8_are_invalid_keys(
    root: Path, store: SyncStore, args: tuple[str | bytes, ...]
) -> None:
    store.append(KEY, [entry(1)])
    argv = [str(root) if a == "{root}" else a for a in args]
    proc = subprocess.run([sys.executable, "-m", "fsstore", *argv], capture_output=True,
                          text=True, errors="replace", timeout=60, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "INVALID_KEY" in proc.stderr and "Traceback" not in proc.stderr
    assert store.load(KEY) == [entry(1)]


_INTERRUPTED_START = """
import sys

class CtrlC:
    # Ctrl-C pressed while fsstore's modules load.
    def find_spec(self, name, path=None, target=None):
        if name == "fsstore._store":
            raise KeyboardInterrupt
        return None

form, root, entry_point = sys.argv[1:]
sys.meta_path.insert(0, CtrlC())
sys.argv = ["fsstore", "ls", root]
if form == "console-script":  # what the installed `fsstore` script runs
    import importlib
    module, function = entry_point.split(":")
    sys.exit(getattr(importlib.import_module(module), function)())
import runpy
runpy.run_module("fsstore", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("form", ["console-script", "python -m"])
def test_ctrl_c_during_start_up_prints_no_traceback(root: Path, store: SyncStore, form: str) -> None:
    store.append(KEY, [entry(1)])
    scripts = (TOP / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1]
    entry_point = re.search(r'^fsstore = "([^"]+)"', scripts, re.MULTILINE)[1]  # type: ignore[index]
    proc = subprocess.run([sys.executable, "-c", _INTERRUPTED_START, form, str(root), entry_point],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "interrupted" in proc.stderr


# -- 15 ------------------------------------------------------------------------------------


def test_export_under_umask_0_creates_every_directory_with_the_stores_mode(
    root: Path, store: SyncStore, tmp_path: Path
) -> None:
    store.append(KEY, [entry(1)])
    store.append(SUB, [entry(2)])
    dest = tmp_path / "out" / "projects"
    proc = subprocess.run(
        ["sh", "-c", 'umask 000 && exec "$0" -m fsstore export "$@"', sys.executable,
         str(root), P, S, str(dest)],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    created = [tmp_path / "out", dest, dest / P, dest / P / S, dest / P / S / "subagents"]
    modes = {str(d.relative_to(tmp_path)): oct(stat.S_IMODE(d.stat().st_mode)) for d in created}
    assert set(modes.values()) == {"0o700"}, modes
    files = [dest / P / f"{S}.jsonl", dest / P / S / "subagents" / "agent-1.jsonl"]
    assert {oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {"0o600"}


# -- 16 ------------------------------------------------------------------------------------


def test_cat_of_a_transcript_with_a_gap_says_so_and_exits_1(root: Path, store: SyncStore) -> None:
    for n in (1, 2, 3):
        store.append(KEY, [entry(n)])
    (tdir(root, KEY) / _layout.part_name(2)).unlink()
    proc = fsstore("cat", root, P, S)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [json.loads(line) for line in proc.stdout.splitlines()] == [entry(1), entry(3)]
    assert "gap" in proc.stderr and "incomplete" in proc.stderr
    doc = fsstore("cat", root, P, S, "--json")
    assert doc.returncode == 1 and json.loads(doc.stdout) == [entry(1), entry(3)]
    assert "gap" in doc.stderr
    store.append(SUB, [entry(4)])
    whole = fsstore("cat", root, P, S, "--subpath", SUB["subpath"])
    assert whole.returncode == 0 and whole.stderr == "", whole.stderr


@pytest.mark.parametrize("case", ["missing root", "not a store", "no such session", "export into a file",
                                  "import from nowhere", "invalid subpath", "compact of no such session",
                                  "compact of no such project"])
def test_a_command_that_fails_names_its_code(root: Path, store: SyncStore, tmp_path: Path,
                                                  case: str) -> None:
    """An operator alerts on codes: a command that cannot do its job says which one on
    stderr (``CODE`` in the line) and, with ``--json``, as ``{"error": {"code": ...}}``;
    a usage error exits 2, the rest 1. Before, a missing or foreign root, a missing
    session (cat) and an OSError printed no code (and a missing root read "not a
    directory")."""
    from fsstore._errors import STORE_CODES

    store.append(KEY, [entry(1)])
    (tmp_path / "plain").mkdir()
    (tmp_path / "file").write_text("x")
    args, code, rc, says = {
        "missing root": (["ls", tmp_path / "nothing"], "NOT_A_STORE", 2, "does not exist"),
        "not a store": (["check", tmp_path / "plain"], "NOT_A_STORE", 2, "not an fsstore store"),
        "no such session": (["cat", root, P, "nosuch"], "NOT_FOUND", 1, "no transcript"),
        "export into a file": (["export", root, P, S, tmp_path / "file" / "out"], "ENOTDIR", 1, "Not a directory"),
        "import from nowhere": (["import", root, tmp_path / "nothing"], "ENOENT", 2, "cannot list"),
        "invalid subpath": (["cat", root, P, S, "--subpath", "/abs"], "INVALID_KEY", 2, "must be relative"),
        # (review 105: "compact: 0 done" and exit 0 hid a mistyped name)
        "compact of no such session": (["compact", root, "--session", "nosuch"], "NOT_FOUND", 1, "no session"),
        "compact of no such project": (["compact", root, "--project", "-nosuch"], "NOT_FOUND", 1, "no project"),
    }[case]
    assert code in STORE_CODES or code.startswith("E")
    proc = fsstore(*args)
    assert proc.returncode == rc and code in proc.stderr and says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    doc = fsstore(*args, "--json")
    assert doc.returncode == rc, doc.stderr
    assert json.loads(doc.stdout)["error"]["code"] == code, doc.stdout
