"""What an entry may hold: only what every default reader can read back.

``json.dumps`` writes whatever the writing process can encode, and a writer can
encode more than a reader can parse: a writer that raised its recursion limit (or
runs in a thread with more stack to spare) can nest deeper than ``json.loads``
reads in another process, and one that called ``sys.set_int_max_str_digits(0)``
writes integers every reader with Python's default limit refuses. Such an entry
would be committed and then make every ``load()`` of its transcript fail. So
``append`` refuses it (``INVALID_ENTRY``, nothing written), by fixed limits that do
not depend on the writer's settings:

* :data:`MAX_DEPTH` levels of nesting (the entry itself is level 1): ``json.loads``
  recurses once per level, and half of Python's default recursion limit (1000)
  leaves the reader's own call stack room;
* :data:`MAX_INT_DIGITS` digits in an integer: Python's default
  ``sys.int_info.default_max_str_digits``.
"""

from __future__ import annotations

import re
from typing import Any

MAX_DEPTH = 500
MAX_INT_DIGITS = 4300

_TOO_BIG = 10**MAX_INT_DIGITS
# A run of digits longer than any float repr: an integer (or a string) worth a look.
_LONG_DIGITS = re.compile(rf"(?<![0-9])[0-9]{{{MAX_INT_DIGITS + 1}}}")


def beyond_limits(entry: Any, line: str) -> str | None:
    """Why no default reader could read back ``entry`` (encoded as ``line``); None if
    one can.

    The encoded line is a cheap first look (C-speed counts and one regex): only a
    line with more than :data:`MAX_DEPTH` brackets or a long run of digits has its
    entry walked, without recursion, whatever the recursion limit.
    """
    if line.count("{") + line.count("[") <= MAX_DEPTH and (
        len(line) <= MAX_INT_DIGITS or _LONG_DIGITS.search(line) is None
    ):
        return None
    stack: list[tuple[Any, int]] = [(entry, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list, tuple)):
            if depth > MAX_DEPTH:
                return f"is nested deeper than {MAX_DEPTH} levels"
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(value, int) and (value >= _TOO_BIG or value <= -_TOO_BIG):
            return f"holds an integer of more than {MAX_INT_DIGITS} digits"
    return None
