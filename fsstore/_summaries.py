"""The Claude SDK's session-summary sidecar, kept in the main transcript's state file.

``claude_agent_sdk.fold_session_summary`` is pure and incremental; a compaction of a
main transcript folds the files it covers and stores the result with ``folded`` = the
last number folded (:func:`fsstore._compact.fold_chain`). A listing of summaries folds
the files committed after it itself, so a compactor killed before its state write, or
two overlapping ones, cannot leave a summary that disagrees with the transcript.

The SDK is imported when a summary is first needed: without it (a Qoder-only install)
summaries are simply not maintained and :meth:`list_session_summaries` returns what it
can prove fresh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

from ._errors import FsStoreError

Fold = Callable[[Any, Any, list[Any]], dict[str, Any]]


@functools.cache
def fold_function() -> Fold | None:
    try:
        from claude_agent_sdk import fold_session_summary
    except ImportError:  # the Claude SDK is optional: no summaries without it
        return None
    return cast(Fold, fold_session_summary)


def fold(
    fn: Fold, prev: dict[str, Any] | None, key: dict[str, str], batches: list[list[Any]]
) -> dict[str, Any]:
    """Fold batches in commit order, one call per committed batch (as appends did).

    A failure of the SDK's fold (it is third-party code run over stored data, e.g. a
    damaged state file's summary) is FsStoreError CORRUPT, which callers treat as
    "summary behind": it must never fail a committed append or break a listing.
    """
    summary = prev
    try:
        for batch in batches:
            summary = fn(summary, key, batch)
    except Exception as exc:  # see the docstring: any failure of foreign code, wrapped
        raise FsStoreError("CORRUPT", f"summary fold failed: {exc!r}", operation="summary") from exc
    assert summary is not None
    return summary
