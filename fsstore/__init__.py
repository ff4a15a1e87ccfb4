"""fsstore: agent session transcripts on a mounted filesystem.

``FsSessionStore(root=...)`` implements the Claude Agent SDK's and the Qoder Agent
SDK's ``SessionStore`` protocol on a directory (NFS, EFS, JuiceFS, CephFS, a FUSE
mount, or a local disk). Every failure is an :class:`FsStoreError`.

The two names are imported on first use (PEP 562): the ``fsstore`` command line
imports this package first, and loads the store's modules only where it can answer
a Ctrl-C pressed meanwhile without a traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._async import FsSessionStore
    from ._errors import FsStoreError

__all__ = ["FsSessionStore", "FsStoreError"]


def __getattr__(name: str) -> object:
    found: object
    if name == "FsSessionStore":
        from ._async import FsSessionStore as found
    elif name == "FsStoreError":
        from ._errors import FsStoreError as found
    else:
        raise AttributeError(f"module 'fsstore' has no attribute {name!r}")
    globals()[name] = found  # looked up here once
    return found
