"""fsstore on a real network filesystem: a one-brick GlusterFS volume on loopback,
mounted twice (tests/network/_netmounts.py makes and removes it; needs root,
/dev/fuse, glusterfs-server and glusterfs-client).

    python benchmarks/network.py [--quick] [--rtt-us 500]   # an emulated round trip: below
    python benchmarks/run.py --only network      # the same rows in run.py's table

Per append (fsync off and on): the file operations the brick served, counted by
``gluster volume profile VOL info incremental`` (by kind and in total), for fsstore
and for floor a (filelock SoftFileLock acquire + temp write + link + unlink +
release, benchmarks/run.py's ``Floor``) on the same mount; p50 latency of both,
interleaved op by op, as a ratio. The same for ``load`` of a 1,000-append
transcript (vs reading one JSONL file of the same entries) and ``list_sessions`` of
1,000 sessions (vs scandir + one stat per session), read through the second mount.

Network latency: ``--rtt-us N`` mounts the clients with benchmarks/rtt_shim.c
preloaded (built with ``cc``): each request a client sends its brick waits N µs, as on
a network with that round trip. Without it the times are loopback (~0.2 ms per brick
operation) and what carries over to a real network is the operation count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from fsstore import FsSessionStore
from tests.network import _netmounts


def unavailable() -> str | None:
    return _netmounts.gluster_unavailable()


def _shim(tmp: Path) -> Path:
    """benchmarks/rtt_shim.c built into ``tmp``."""
    out = tmp / "rtt_shim.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(out), str(HERE / "rtt_shim.c"), "-ldl"],
                   check=True)
    return out


def _cold_ops(vol: str, fn: Callable[[], Any]) -> dict[str, int]:
    """The brick operations of one ``fn()`` with the client's 1 s caches expired."""
    time.sleep(1.5)
    _netmounts.profile_ops(vol)  # reset the interval
    fn()
    return _netmounts.profile_ops(vol)


_CYCLE = 64  # appends per compaction: compact_every's default


def _interleaved(a: Callable[[int], Any], b: Callable[[int], Any], n: int) -> tuple[list[float], list[float]]:
    """``a(i)`` and ``b(i)`` timed one after the other, for i in range(n)."""
    t_a, t_b = [], []
    for i in range(n):
        t0 = time.perf_counter()
        a(i)
        t1 = time.perf_counter()
        b(i)
        t_b.append(time.perf_counter() - t1)
        t_a.append(t1 - t0)
    return t_a, t_b


def _per(ops: dict[str, int], n: int) -> dict[str, float]:
    return {k: v / n for k, v in sorted(ops.items(), key=lambda kv: -kv[1])}


def _fmt(ops: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in ops.items() if v >= 0.05)


def bench_network(row: Callable[..., None], floor_cls: Any, batch: Callable[[int], list[dict[str, Any]]],
                  *, quick: bool, rtt_us: int, extra: dict[str, Any]) -> None:
    if reason := unavailable():
        print(f"network: skipped ({reason})")
        return
    n_app = 20 if quick else 60
    n_big = 200 if quick else 1000
    key = {"project_key": "-home-user-repo", "session_id": "6f1c2a34-5b6d-4e7f-8a9b-0c1d2e3f4a5b"}
    with tempfile.TemporaryDirectory(prefix="fsstore-bench-net-") as tmp, \
            _netmounts.gluster_pair(Path(tmp), env={"LD_PRELOAD": str(_shim(Path(tmp))),
                                                    "FSSTORE_RTT_US": str(rtt_us)} if rtt_us else None) as pair:
        vol = pair.volume
        assert vol is not None
        _netmounts.profile_start(vol)
        where = f"GlusterFS, {rtt_us} µs round trip" if rtt_us else "GlusterFS, loopback"
        print(f"network: appends, load, list_sessions on {where}", flush=True)
        result: dict[str, Any] = {"rtt_us": rtt_us}
        for fsync in (False, True):
            tag = "fsync on" if fsync else "fsync off"
            d1 = pair.m1 / f"append-{int(fsync)}"
            d1.mkdir()
            store = FsSessionStore(d1 / "store", create=True, fsync=fsync).sync
            floor = floor_cls(d1 / "floor", fsync=fsync)
            for i in range(3):  # warm: directories made, first-append work done
                store.append(key, batch(i))
                floor.op(batch(i))
            counts: dict[str, dict[str, int]] = {}
            ops: list[tuple[str, Callable[[int], None]]] = [
                ("fsstore", lambda i, s=store: s.append(key, batch(i))),  # type: ignore[misc]
                ("floor", lambda i, f=floor: f.op(batch(i))),  # type: ignore[misc]
            ]
            for name, fn in ops:
                _netmounts.profile_ops(vol)  # reset the interval
                for i in range(n_app):
                    fn(100 + i)
                counts[name] = _netmounts.profile_ops(vol)
            # p50 of each round's interleaved appends, a round being one compaction cycle
            # (a listing's cost grows with the parts since the last compaction); the
            # median round is the row (this VM is shared: rounds differ by up to 0.3).
            rounds: list[tuple[float, float]] = []
            for r in range(3):
                t_s, t_f = _interleaved(
                    lambda i, s=store, r=r: s.append(key, batch(1000 + _CYCLE * r + i)),  # type: ignore[misc]
                    lambda i, f=floor, r=r: f.op(batch(1000 + _CYCLE * r + i)), _CYCLE)  # type: ignore[misc]
                rounds.append((statistics.median(t_s) * 1e6, statistics.median(t_f) * 1e6))
            ps, pf = sorted(rounds, key=lambda sf: sf[0] / sf[1])[1]
            spread = ", ".join(f"{s_ / f_:.2f}" for s_, f_ in rounds)
            # Compaction's share: whole compaction cycles counted, the thread's work waited for.
            store_c = FsSessionStore(d1 / "cycles", create=True, fsync=fsync).sync
            for i in range(3):
                store_c.append(key, batch(i))
            store_c._compactions.done()
            time.sleep(1.5)  # the client's 1 s caches expire, as for the counts above
            _netmounts.profile_ops(vol)
            for i in range(2 * _CYCLE):
                store_c.append(key, batch(100 + i))
            store_c._compactions.done()
            with_compaction = _netmounts.profile_ops(vol)
            s_ops, f_ops = sum(counts["fsstore"].values()) / n_app, sum(counts["floor"].values()) / n_app
            c_ops = sum(with_compaction.values()) / (2 * _CYCLE)
            row(f"network append {tag}: brick ops / floor a", s_ops, f_ops, float("inf"), unit="ops",
                note=f"informational; fsstore: {_fmt(_per(counts['fsstore'], n_app))}; "
                     f"floor a: {_fmt(_per(counts['floor'], n_app))}")
            row(f"network append {tag}: brick ops with compaction's share / floor a", c_ops, f_ops,
                float("inf"), unit="ops",
                note=f"informational; {2 * _CYCLE} appends, 2 compactions: "
                     f"{_fmt(_per(with_compaction, 2 * _CYCLE))}")
            row(f"network append {tag}: p50 / floor a ({where})", ps, pf, float("inf"),
                note=f"informational; median of 3 rounds of {_CYCLE}: {spread}")
            result[f"append_{tag}"] = {"ops_fsstore": _per(counts["fsstore"], n_app), "ops_floor": _per(counts["floor"], n_app),
                                      "ops_total_fsstore": s_ops, "ops_total_floor": f_ops,
                                      "ops_with_compaction": c_ops, "p50_us_fsstore": ps,
                                      "p50_us_floor": pf, "p50_rounds": rounds}
            print(f"  {tag}: fsstore {s_ops:.1f} ops ({c_ops:.1f} with compaction's share), "
                  f"{ps:.0f} µs; floor a {f_ops:.1f} ops, {pf:.0f} µs; p50 ratio per round {spread}",
                  flush=True)

        # load of a long transcript, read through the other mount
        d1 = pair.m1 / "load"
        d1.mkdir()
        store = FsSessionStore(d1 / "store", create=True).sync
        single = d1 / "single.jsonl"
        with open(single, "wb") as fh:
            for i in range(n_big):
                store.append(key, batch(i))
                fh.write(("\n".join(json.dumps(e) for e in batch(i)) + "\n").encode())
        reader = FsSessionStore(pair.m2 / "load" / "store", create=True).sync
        single2 = pair.m2 / "load" / "single.jsonl"

        def naive_load() -> list[Any]:
            with open(single2, "rb") as fh:
                return [json.loads(line) for line in fh]

        assert reader.load(key) == naive_load()
        load_ops, naive_ops = _cold_ops(vol, lambda: reader.load(key)), _cold_ops(vol, naive_load)
        t_s, t_f = _interleaved(lambda _i: reader.load(key), lambda _i: naive_load(), 7 if quick else 15)
        row(f"network load {n_big} appends: brick ops / one JSONL file", sum(load_ops.values()),
            sum(naive_ops.values()), float("inf"), unit="ops",
            note=f"informational; cold caches; fsstore: {_fmt(_per(load_ops, 1))}; file: {_fmt(_per(naive_ops, 1))}")
        row(f"network load {n_big} appends: p50 / one JSONL file", statistics.median(t_s) * 1e3,
            statistics.median(t_f) * 1e3, float("inf"), unit="ms", note="informational")
        result["load"] = {"appends": n_big, "ops_fsstore": load_ops, "ops_file": naive_ops,
                          "p50_ms_fsstore": statistics.median(t_s) * 1e3, "p50_ms_file": statistics.median(t_f) * 1e3}

        # list_sessions of many sessions, through the other mount
        d1 = pair.m1 / "list"
        d1.mkdir()
        store = FsSessionStore(d1 / "store", create=True, summaries=False).sync
        one = batch(0)[:1]
        for i in range(n_big):
            store.append({**key, "session_id": f"{i:08d}-0000-4000-8000-000000000000"}, one)
        lister = FsSessionStore(pair.m2 / "list" / "store", create=True, summaries=False).sync
        sessions = pair.m2 / "list" / "store" / "projects" / key["project_key"] / "sessions"

        def naive_list() -> list[dict[str, Any]]:
            return [{"session_id": e.name, "mtime": e.stat().st_mtime_ns // 1_000_000} for e in os.scandir(sessions)]

        assert len(lister.list_sessions(key["project_key"])) == n_big == len(naive_list())
        list_ops = _cold_ops(vol, lambda: lister.list_sessions(key["project_key"]))
        nlist_ops = _cold_ops(vol, naive_list)
        t_s, t_f = _interleaved(lambda _i: lister.list_sessions(key["project_key"]), lambda _i: naive_list(), 5 if quick else 9)
        row(f"network list_sessions({n_big}): brick ops per session / scandir + stat",
            sum(list_ops.values()) / n_big, sum(nlist_ops.values()) / n_big, float("inf"), unit="ops",
            note=f"informational; cold caches; fsstore: {_fmt(_per(list_ops, n_big))}; "
                 f"scandir+stat: {_fmt(_per(nlist_ops, n_big))}")
        row(f"network list_sessions({n_big}): p50 / scandir + stat", statistics.median(t_s) * 1e3,
            statistics.median(t_f) * 1e3, float("inf"), unit="ms", note="informational")
        result["list"] = {"sessions": n_big, "ops_fsstore": list_ops, "ops_naive": nlist_ops,
                          "p50_ms_fsstore": statistics.median(t_s) * 1e3, "p50_ms_naive": statistics.median(t_f) * 1e3}
        _netmounts.profile_stop(vol)
        extra["network"] = result


def main() -> None:
    import run  # benchmarks/run.py: its row(), Floor and batch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rtt-us", type=int, default=0, help="an emulated network round trip per brick request")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    extra: dict[str, Any] = {}
    bench_network(run.row, run.Floor, run.batch, quick=args.quick, rtt_us=args.rtt_us, extra=extra)
    for r in run.ROWS:
        print(f"{r['name']:<70} {r['figure']:>9.1f} {r['unit']:<3}{r['baseline']:>9.1f} {r['unit']:<3}"
              f"{r['ratio']:>6.2f}  ({r['note']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": run.ROWS, "extra": extra}, indent=2, default=str))


if __name__ == "__main__":
    main()
