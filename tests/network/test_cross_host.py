"""The store on real network filesystems, each mounted twice: two hosts, one storage.

Pairs: GlusterFS (one brick on loopback, default options), sshfs with its default
caching, sshfs with every cache off (see _netmounts.py). Processes of host 1 work
through mount 1, those of host 2 through mount 2, each in its own UTS namespace.

What the store must do on every pair: keep every acknowledged batch exactly once
and whole, never show a reader a hole or a non-prefix. Where the current code
fails in a way the issue (12) lists, the test is a strict ``xfail`` that raises a
:class:`Defect` subclass (``raises=``): a broken guarantee (lost batch, hole) is
an ordinary assertion and fails the test even where a defect is expected.
"""

from __future__ import annotations

import collections
import itertools
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from fsstore import FsSessionStore, FsStoreError
from tests.reliability._check import assert_transcript, batch, ids

from ._netmounts import Pair, Role, run_roles

KEY = {"project_key": "-net", "session_id": "shared"}


class Defect(AssertionError):
    """A shortcoming the issue lists (the store loses nothing, but fails or misreports)."""


class AppendsFailed(Defect):
    pass


class LoadsFailed(Defect):
    pass


def xfail(reason: str, raises: type[Defect] = Defect) -> Any:
    return pytest.mark.xfail(strict=True, raises=raises, reason=reason)


GLUSTER_ESTALE = "GlusterFS: another host replaced state.json (every commit does); the open by a cached name reads a stale handle: ESTALE"
SSHFS_EPERM = "sshfs (SFTP v3 has no EEXIST): a lost O_EXCL race on the lock marker comes back as EPERM and fails the append"
SSHFS_CACHE = "sshfs default caching (20 s): a load after another host's change reads a cached listing: EAGAIN/ENOENT"
SSHFS_DELETED = "sshfs default caching: an append to a session another host just deleted fails with ENOENT"


def pair_of(request: pytest.FixtureRequest, kind: str) -> Pair:
    return request.getfixturevalue(kind)  # type: ignore[no-any-return]


def params(**marks: Any) -> list[Any]:
    """The three pairs, with ``marks[kind]`` (an xfail) where a defect shows."""
    out = []
    for kind in ("gluster", "sshfs", "sshfs_nocache"):
        m = marks.get(kind)
        out.append(pytest.param(kind, marks=[m] if m else [], id=kind))
    return out


# -- the SDK conformance suites -------------------------------------------------------


class SplitStore:
    """Writes through one mount, reads through the other: the store as two hosts see it."""

    def __init__(self, writes: FsSessionStore, reads: FsSessionStore) -> None:
        self.w, self.r = writes, reads

    async def append(self, key: Any, entries: Any) -> None:
        await self.w.append(key, entries)

    async def delete(self, key: Any) -> None:
        await self.w.delete(key)

    async def load(self, key: Any) -> Any:
        return await self.r.load(key)

    async def list_sessions(self, project_key: str) -> Any:
        return await self.r.list_sessions(project_key)

    async def list_session_summaries(self, project_key: str) -> Any:
        return await self.r.list_session_summaries(project_key)

    async def list_subkeys(self, key: Any) -> Any:
        return await self.r.list_subkeys(key)


def _suite(sdk: str) -> Any:
    if sdk == "claude":
        from claude_agent_sdk.testing import run_session_store_conformance
    else:
        from qoder_agent_sdk.testing import run_session_store_conformance
    return run_session_store_conformance


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("sdk", ["claude", "qoder"])
@pytest.mark.parametrize("kind", params())
def test_conformance_on_mount_1(request: pytest.FixtureRequest, kind: str, sdk: str, backend: str) -> None:
    base, _ = pair_of(request, kind).fresh(f"conf-{sdk}")
    n = itertools.count()
    anyio.run(_suite(sdk), lambda: FsSessionStore(base / f"store-{next(n)}"), backend=backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("sdk", ["claude", "qoder"])
@pytest.mark.parametrize("kind", params())
def test_conformance_split_writes_mount_1_reads_mount_2(
    request: pytest.FixtureRequest, kind: str, sdk: str, backend: str
) -> None:
    b1, b2 = pair_of(request, kind).fresh(f"split-{sdk}")
    n = itertools.count()

    def factory() -> SplitStore:
        name = f"store-{next(n)}"
        return SplitStore(FsSessionStore(b1 / name), FsSessionStore(b2 / name))

    anyio.run(_suite(sdk), factory, backend=backend)


# -- cross-host concurrency ---------------------------------------------------------


def _appends_failed(outs: list[dict[str, Any]]) -> collections.Counter[str]:
    codes: collections.Counter[str] = collections.Counter()
    for o in outs:
        codes.update(o["codes"])
    return codes


@pytest.mark.parametrize("kind", params(sshfs=xfail(SSHFS_EPERM, AppendsFailed),
                                        sshfs_nocache=xfail(SSHFS_EPERM, AppendsFailed)))
def test_writers_on_two_hosts_lose_nothing(request: pytest.FixtureRequest, kind: str, tmp_path: Path, figures: Any) -> None:
    """4 writers on each host append to one transcript; a reader loads on each host.

    Every acknowledged batch is there exactly once and whole through both mounts,
    immediately and after the mounts' cache window; every failed one is absent;
    every reader snapshot is a prefix of the final order. Then: no append failed.
    (GlusterFS's ESTALE shows here too, a few in a thousand appends, too rarely to
    fail reliably: test_alternating_hosts_append_without_error shows it every time.)
    """
    pair = pair_of(request, kind)
    r1, r2 = pair.fresh("writers")
    roots = {1: str(r1 / "store"), 2: str(r2 / "store")}
    opts = {"compact_every": 16}
    writers = [Role(h, "writer", {"root": roots[h], "key": KEY, "wid": f"h{h}w{i}", "batches": 25,
                                  "seconds": 20, "opts": opts}) for h in (1, 2) for i in range(4)]
    readers = [Role(h, "reader", {"root": roots[h], "keys": [KEY], "opts": opts, "errors_are_problems": False})
               for h in (1, 2)]
    outs = run_roles(writers + readers, tmp_path, timeout=120, stop_after=list(range(len(writers))))
    wouts, routs = outs[: len(writers)], outs[len(writers):]
    acked = [(r.spec["wid"], b) for r, o in zip(writers, wouts) for b, _n in o["acked"]]
    nentries = sum(n for o in wouts for _b, n in o["acked"])
    failed = _appends_failed(wouts)
    figures.add(f"{kind}: appends", len(acked) + sum(failed.values()))
    figures.add(f"{kind}: failed appends", sum(failed.values()))
    finals = []
    for when in ("now", "after the cache window"):
        if when != "now":
            time.sleep(pair.cache_window)
        for root in roots.values():
            loaded = FsSessionStore(root).sync.load(KEY)
            assert_transcript(loaded, acked, nentries)  # failed batches absent, acked ones once
            finals.append(ids(loaded or []))
    assert all(f == finals[0] for f in finals), "the mounts disagree on the order"
    for o in routs:
        assert o["problems"] == [], o["problems"][:5]
        assert o["loads"] >= 5, f"a reader hardly ran: {o}"
        last = [tuple(e) for e in o["last"].get("0", [])]
        assert finals[0][: len(last)] == last, "a reader snapshot is not a prefix of the final order"
    figures.add(f"{kind}: reader loads", sum(o["loads"] for o in routs))
    if kind == "gluster":  # only the known ESTALE (see the docstring)
        assert set(failed) <= {"ESTALE"}, failed
    elif failed:
        raise AppendsFailed(f"{sum(failed.values())} of {len(acked) + sum(failed.values())} appends failed: {dict(failed)}")
    load_errors = _appends_failed(routs)
    if load_errors:
        raise LoadsFailed(f"loads failed: {dict(load_errors)}")


@pytest.mark.parametrize("kind", params(gluster=xfail(GLUSTER_ESTALE, AppendsFailed)))
def test_alternating_hosts_append_without_error(request: pytest.FixtureRequest, kind: str) -> None:
    """One append through mount 1, one through mount 2, in turn: each replaces state.json
    that the other mount has cached (deterministic; GlusterFS fails about every other)."""
    r1, r2 = pair_of(request, kind).fresh("alternate")
    stores = [FsSessionStore(r / "store").sync for r in (r1, r2)]
    codes: collections.Counter[str] = collections.Counter()
    acked = []
    for b in range(30):
        try:
            stores[b % 2].append(KEY, batch(f"m{b % 2 + 1}", b, 2))
            acked.append((f"m{b % 2 + 1}", b))
        except FsStoreError as exc:
            codes[exc.code] += 1
    for s in stores:
        assert_transcript(s.load(KEY), acked, 2 * len(acked))
    if codes:
        raise AppendsFailed(f"{sum(codes.values())} of 30 appends failed: {dict(codes)}")
