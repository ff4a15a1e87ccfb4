"""A mount that cannot host a store says so: ``UNSUPPORTED_FS``, not a bare EIO.

rclone's VFS mount has no hard links (link() answers EIO) and no
RENAME_NOREPLACE; the fault-injecting FUSE filesystem (tests/reliability/faultfs.py)
stages such a mount: renames onto a part or segment name with the flag are refused
(EINVAL, as FUSE filesystems without the flag answer) and every link() fails.
"""

from __future__ import annotations

import os

import pytest

from fsstore import FsSessionStore, FsStoreError
from tests.reliability._check import temp_files
from tests.reliability._mounts import FaultFs

COMMIT_NAMES = r"/[0-9]{20}(-[0-9]{20})?\.jsonl$"
KEY = {"project_key": "p", "session_id": "s"}


@pytest.mark.parametrize("link_errno", ["EIO", "EPERM", "EOPNOTSUPP"])
def test_a_mount_without_hard_links_and_rename_noreplace_is_unsupported_fs(
    fault_mount: FaultFs, link_errno: str
) -> None:
    root = os.path.join(fault_mount.mountpoint, f"unsupported-{link_errno}")
    # A new transcript's first batch is committed by renaming its new directory into
    # place (format 2): the mount's refusals show from the next append on.
    FsSessionStore(root, create=True).sync.append(KEY, [{"n": 0}])
    fault_mount.set(
        {"op": "rename", "path": COMMIT_NAMES, "errno": "EINVAL", "times": None},
        {"op": "link", "path": ".", "errno": link_errno, "times": None},
    )
    try:
        store = FsSessionStore(root, create=True).sync
        for _ in range(2):  # the first append learns that the flag is refused, the second knows
            with pytest.raises(FsStoreError) as info:
                store.append(KEY, [{"n": 1}])
            err = info.value
            assert err.code == "UNSUPPORTED_FS", err
            assert err.errno == getattr(__import__("errno"), link_errno)
            assert "cannot host a store" in str(err) and "link()" in str(err)
            assert err.path is not None and err.path.startswith(root), err.path
        injected = fault_mount.take_injected()
        assert any(line.startswith("link ") for line in injected), injected
    finally:
        fault_mount.clear()
    assert store.load(KEY) == [{"n": 0}]  # nothing committed
    assert temp_files(root) == []  # and nothing left behind
    store.append(KEY, [{"n": 2}])  # the same mount with links back: fine
    assert store.load(KEY) == [{"n": 0}, {"n": 2}]
