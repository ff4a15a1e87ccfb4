"""The documents say what the code does: every error code a user can meet is in README's
tables, README's Python runs, and README installs this project, not another.

README's ```python blocks run as they are, each in a fresh interpreter in an empty
directory. A block that needs the real model API is marked, on the line before it, with
``<!-- readme-test: compile-only -->``: it is compiled and checked for undefined names
(ruff's pyflakes rules, where ruff is installed), not run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsstore._errors import STORE_CODES

TOP = Path(__file__).resolve().parents[1]
README = (TOP / "README.md").read_text()
COMPILE_ONLY = "<!-- readme-test: compile-only -->"
_BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.DOTALL)
#: How the source raises or logs a code: FsStoreError("CODE", ...), "code": "CODE", code="CODE".
_CODE_USE = re.compile(r'(?:FsStoreError\(\s*|"code":\s*|code=)"([A-Z][A-Z0-9_]+)"')


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def codes_in_source() -> set[str]:
    return {code for path in (TOP / "fsstore").glob("*.py")
            for code in _CODE_USE.findall(path.read_text())}


# -- 11 -----------------------------------------------------------------------------------


def test_every_code_raised_or_logged_is_in_readmes_code_tables() -> None:
    used = codes_in_source()
    assert {"NOT_FOUND", "EAGAIN", "TEMP_LEFT", "LOCK_RECLAIMED", "LOCK_RELEASE_FAILED"} <= used
    tables = _section(README, "Error codes")
    listed = set(re.findall(r"^\| ([^|]*)\|", tables, re.MULTILINE))
    listed_codes = {c for cell in listed for c in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)}
    assert used - listed_codes == set()
    # One registry: every code of the store's own (not an errno name) is in it, and
    # everything in it is used.
    own = {c for c in used if not re.fullmatch(r"E[A-Z0-9]+", c)}
    assert own == set(STORE_CODES)


def test_readmes_code_tables_say_what_the_registry_says_to_do() -> None:
    """README's "retry?"/"action" cell of each of the store's own codes is the
    registry's, word for word: one place says whether to retry."""
    tables = _section(README, "Error codes")
    rows = re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|.*\| ([^|]+) \|$", tables, re.MULTILINE)
    said = {code: action for code, action in rows if code in STORE_CODES}
    assert said == {code: c.action for code, c in STORE_CODES.items()}


# -- 17 -----------------------------------------------------------------------------------


def test_readme_installs_this_projects_distribution() -> None:
    project = (TOP / "pyproject.toml").read_text().split("[project]\n", 1)[1]
    name = re.search(r'^name = "([^"]+)"', project, re.MULTILINE)[1]  # type: ignore[index]
    # "fsstore" on the package index is someone else's project (2012, dict-like file I/O).
    assert name == "fsstore-sessions"
    installs = re.findall(r"pip install (?:-e )?'?([A-Za-z0-9_.\-]+)", README)
    assert installs and all(i.startswith((name, ".")) for i in installs), installs


# -- 18 -----------------------------------------------------------------------------------


def readme_blocks() -> list[tuple[bool, str]]:
    """``(compile only, code)`` of each ```python block of README."""
    return [(m["before"].strip() == COMPILE_ONLY, m["code"]) for m in _BLOCK.finditer(README)]


def test_readme_has_python_to_run_and_the_sdk_quick_start_is_marked() -> None:
    blocks = readme_blocks()
    assert any(not only for only, _ in blocks)
    assert any(only and "query(" in code for only, code in blocks)


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_python_block_runs(index: int, tmp_path: Path) -> None:
    compile_only, code = readme_blocks()[index]
    compile(code, f"README block {index}", "exec")
    if compile_only:
        ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
        if ruff is None:
            pytest.skip("compiled; ruff (for undefined names) is not installed")
        proc = subprocess.run([ruff, "check", "--isolated", "--select", "F", "--stdin-filename",
                               "block.py", "-"], input=code, capture_output=True, text=True,
                              check=False)
        assert proc.returncode == 0, proc.stdout
        return
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
