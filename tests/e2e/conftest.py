"""Fixtures for the end-to-end tests: the stand-in model, and "hosts" that share a store.

These tests drive the real ``claude-agent-sdk`` and the real Claude Code CLI it
bundles, offline: the CLI talks to :mod:`examples.fake_model` on loopback. A
*host* is one SDK session with its own ``CLAUDE_CONFIG_DIR`` (its private local
transcript copy); hosts share nothing but the store root and the model, so
whatever a later host knows about an earlier session came through the store.

``Hosts.run`` starts a host as a separate Python process (``_host.py``);
``Hosts.run_here`` runs it in the test process (async). Each host gets its own
API key (``key-<name>``), which the stand-in records, so a test can pick out
exactly the requests a given host's CLI sent.

The whole directory is skipped, with the reason, when claude-agent-sdk or its
bundled CLI is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

sdk = pytest.importorskip("claude_agent_sdk", reason="claude-agent-sdk is not installed")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
HOST_SCRIPT = HERE / "_host.py"
BUNDLED_CLI = Path(sdk.__file__).parent / "_bundled" / "claude"

if not BUNDLED_CLI.exists():  # pragma: no cover - depends on the installed wheel
    pytest.skip(
        f"claude-agent-sdk has no bundled CLI at {BUNDLED_CLI} (a source install?)",
        allow_module_level=True,
    )


def load_by_path(name: str, path: Path) -> ModuleType:
    """Import a file that is not on sys.path (examples/ is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


fake_model = load_by_path("fsstore_e2e_fake_model", REPO / "examples" / "fake_model.py")
host = load_by_path("fsstore_e2e_host", HOST_SCRIPT)

# Environment variables of the machine running the tests that could point the CLI
# elsewhere (a real key, another base URL, a developer's config dir): never inherited.
_SCRUB_PREFIXES = ("ANTHROPIC_", "CLAUDE_CODE_", "CLAUDE_CONFIG_DIR", "CLAUDE_AGENT_SDK_")


def clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES)}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _hermetic_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(_SCRUB_PREFIXES):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    """One stand-in Messages API per test module."""
    with fake_model.FakeModel() as server:
        yield server


class Hosts:
    """Hosts sharing one store root and one project directory under ``tmp``."""

    def __init__(self, tmp: Path, model: Any, root: Path | None = None) -> None:
        self.tmp = tmp
        self.model = model
        self.root = root if root is not None else tmp / "store"
        self.cwd = tmp / "project"
        self.cwd.mkdir(parents=True, exist_ok=True)
        self.timings: list[tuple[str, float]] = []
        self._since = len(model.requests)

    def config_dir(self, name: str) -> Path:
        return self.tmp / "hosts" / name / "claude-config"

    def spec(self, name: str, prompt: str, **extra: Any) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "cwd": str(self.cwd),
            "config_dir": str(self.config_dir(name)),
            "env": self.model.env(api_key=f"key-{name}"),
            "prompt": prompt,
            **extra,
        }

    def start(self, name: str, prompt: str, **extra: Any) -> subprocess.Popen[str]:
        """Start a host process; finish it with :meth:`wait`."""
        return subprocess.Popen(
            [sys.executable, str(HOST_SCRIPT), json.dumps(self.spec(name, prompt, **extra))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_environ(),
            cwd=str(self.tmp),
        )

    def wait(
        self, proc: subprocess.Popen[str], name: str = "host", *, expect_error: bool = False
    ) -> dict[str, Any]:
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(
                f"{name} did not finish in 180 s; stderr:\n{err[-4000:]}"
            ) from None
        if proc.returncode != 0:
            raise AssertionError(f"{name} exited {proc.returncode}; stderr:\n{err[-4000:]}")
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        result["stderr"] = err
        return self._check(name, result, expect_error)

    def _check(self, name: str, result: dict[str, Any], expect_error: bool) -> dict[str, Any]:
        self.timings.append((name, result["elapsed_s"]))
        if result["error"] and not expect_error:
            raise AssertionError(
                f"{name}: the SDK session failed: {result['error']}\n{result.get('stderr', '')[-4000:]}"
            )
        return result

    def run(
        self, name: str, prompt: str, *, expect_error: bool = False, **extra: Any
    ) -> dict[str, Any]:
        """One SDK session in a separate process (another "host")."""
        return self.wait(self.start(name, prompt, **extra), name, expect_error=expect_error)

    async def run_here(
        self, name: str, prompt: str, *, expect_error: bool = False, **extra: Any
    ) -> dict[str, Any]:
        """One SDK session in this process (async)."""
        result: dict[str, Any] = await host.run_session(self.spec(name, prompt, **extra))
        return self._check(name, result, expect_error)

    def requests(self, name: str) -> list[Any]:
        """The /v1/messages requests host ``name``'s CLI sent during this test."""
        return list(self.model.messages_requests(api_key=f"key-{name}", since=self._since))

    @property
    def project_key(self) -> str:
        """The SDK's project key for the hosts' working directory."""
        from claude_agent_sdk import project_key_for_directory

        return str(project_key_for_directory(str(self.cwd)))

    def key(self, session_id: str, subpath: str | None = None) -> dict[str, str]:
        out = {"project_key": self.project_key, "session_id": session_id}
        if subpath is not None:
            out["subpath"] = subpath
        return out

    def local_transcript(self, name: str, session_id: str) -> Path:
        """The host's own copy of a session, written by its CLI."""
        return next(self.config_dir(name).glob(f"projects/*/{session_id}.jsonl"))


@pytest.fixture
def hosts(tmp_path: Path, model: Any, request: pytest.FixtureRequest) -> Iterator[Hosts]:
    try:  # the suite's `root` fixture, if any, may put the store on another mount
        root = Path(request.getfixturevalue("root"))
    except pytest.FixtureLookupError:
        root = tmp_path / "store"
    h = Hosts(tmp_path, model, root)
    yield h
    if h.timings:
        # Visible with -s / -rA: how long each real CLI session took.
        print("\nCLI sessions: " + ", ".join(f"{n} {s:.2f}s" for n, s in h.timings))


@pytest.fixture
def fake_model_module() -> ModuleType:
    return fake_model
