"""The SDKs' own conformance suites, every optional method included, on both backends."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from fsstore import FsSessionStore

pytestmark = pytest.mark.anyio


def _factory(base: Path):  # type: ignore[no-untyped-def]
    base.mkdir(parents=True, exist_ok=True)
    counter = itertools.count()
    return lambda: FsSessionStore(base / f"store-{next(counter)}", create=True)


async def test_claude_conformance_all_14_contracts(root: Path) -> None:
    from claude_agent_sdk.testing import run_session_store_conformance
    from claude_agent_sdk.testing.session_store_conformance import _has_optional

    probe = FsSessionStore(root / "probe", create=True)
    for method in ("list_sessions", "list_session_summaries", "delete", "list_subkeys"):
        assert _has_optional(probe, method, frozenset()), method  # nothing skipped
    await run_session_store_conformance(_factory(root))


async def test_qoder_conformance(root: Path) -> None:
    from qoder_agent_sdk.testing import run_session_store_conformance

    await run_session_store_conformance(_factory(root))
