"""``python -m fsstore`` and the installed ``fsstore`` command (see :mod:`fsstore.cli`).

The command line's modules are imported here, inside ``main``, so that a Ctrl-C
pressed while they load exits 130 without a traceback, like one pressed later.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        sys.stderr.write("fsstore: interrupted\n")
        return 130
    return run()


if __name__ == "__main__":
    sys.exit(main())
