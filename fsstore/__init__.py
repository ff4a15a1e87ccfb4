"""fsstore: agent session transcripts on a mounted filesystem.

``FsSessionStore(root=...)`` implements the Claude Agent SDK's and the Qoder Agent
SDK's ``SessionStore`` protocol on a directory (NFS, EFS, JuiceFS, CephFS, a FUSE
mount, or a local disk). Every failure is an :class:`FsStoreError`.
"""

from ._async import FsSessionStore
from ._errors import FsStoreError

__all__ = ["FsSessionStore", "FsStoreError"]
