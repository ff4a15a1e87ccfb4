"""docs/operations.md sends readers to docs/format.md, not to source files (issue 15 #19),
and docs/format.md describes the format the code writes."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).parent.parent / "docs"


def test_operations_points_at_the_format_document_not_at_source_files() -> None:
    text = (DOCS / "operations.md").read_text()
    assert "format.md" in text
    assert not re.search(r"`fsstore/_\w+\.py`", text)


def test_format_document_names_the_format_the_store_writes() -> None:
    first = (DOCS / "format.md").read_text().splitlines()[0]
    assert first == "# fsstore on-disk format (format 2)"
