"""``python -m fsstore``: the ``fsstore`` command line (see :mod:`fsstore.cli`)."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
