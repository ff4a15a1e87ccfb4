"""fsstore against the Postgres reference adapter, side by side (issue 16).

    python benchmarks/postgres.py             # three repeats, about 3 minutes on 2 cores
    python benchmarks/postgres.py --quick     # smaller sizes, for a smoke run
    python benchmarks/postgres.py --dir DIR   # where both stores live (default: this checkout)
    python benchmarks/run.py --postgres       # the same, as a section of run.py

The peer is ``PostgresSessionStore`` below: our own code following the schema and
statements of the reference adapter in claude-agent-sdk-python
(``examples/session_stores/postgres_session_store.py``): one ``jsonb`` row per
entry, a ``bigserial`` ``seq``, a multi-row ``INSERT ... unnest($4::jsonb[])`` per
append, ``SELECT entry ... ORDER BY seq`` per load, ``GROUP BY session_id`` with
``MAX(mtime)`` per listing, driven through an ``asyncpg`` pool.

Setup is the benchmark's own: the Debian ``postgresql`` server is installed with
apt-get if no ``/usr/lib/postgresql/*/bin/initdb`` exists, ``asyncpg`` with pip into
this interpreter if it does not import; a private cluster is made with ``initdb``
in a temporary directory next to fsstore's (same file system), started with default
settings on a unix socket in that directory only (no TCP), and stopped and removed
afterwards, also on Ctrl-C or a failure. ``synchronous_commit`` is set per
connection (the pool's ``server_settings``).

Every section runs its fsstore and Postgres operations interleaved (op by op, in
a shuffled order, or run by run for the multi-process sections), and the whole
set is repeated three times; each row prints the figures of the repeat with the
median ratio fsstore / Postgres, and every repeat's ratio.
Multi-process writers are fresh interpreters (``--worker``), each importing only
its own store, so their RSS is the writer's own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import importlib
import json
import os
import platform
import pwd
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROJECT = "-home-user-repo"
LIST_PROJECT = "-home-user-listed"
LONG_PROJECT = "-home-user-long"  # the same sessions, 50 entries each
TARGETS = {  # issue 16
    "append_p50": 1.0, "append_p99": 1.5, "load": 0.6, "list": 1.0,
    "eight_on_eight": 1.0, "eight_on_one": 0.5, "eight_on_one_p99_ms": 50.0,
}


def batch(i: int, tag: str, sid: str = "6f1c2a34-5b6d-4e7f-8a9b-0c1d2e3f4a5b") -> list[dict[str, Any]]:
    """Five entries shaped like Claude Code transcript lines (~1.8 KB together), as
    in benchmarks/run.py; ``tag`` keeps uuids unique per writer."""
    out = []
    for j in range(5):
        out.append({
            "parentUuid": f"{tag}-{i:08d}-{j - 1:04d}",
            "isSidechain": False, "userType": "external", "cwd": "/home/user/repo",
            "sessionId": sid, "version": "2.1.0", "gitBranch": "main",
            "type": "assistant" if j % 2 else "user",
            "message": {"role": "assistant" if j % 2 else "user",
                        "content": [{"type": "text", "text": f"turn {i}.{j} " + "lorem ipsum " * 12}]},
            "uuid": f"{tag}-{i:08d}-{j:04d}",
            "timestamp": "2026-11-30T10:00:00.000Z",
        })
    return out


# -- the peer: a Postgres SessionStore after the reference design ---------------------

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class PostgresSessionStore:
    """SessionStore on Postgres, one ``jsonb`` row per entry (the reference design).

    ``seq`` (a ``bigserial``) orders a transcript's entries; the main transcript's
    ``subpath`` is ``''`` so the primary key has no NULL; ``mtime`` is the insert
    time in ms; a partial index on ``(project_key, session_id) WHERE subpath = ''``
    serves the listing. asyncpg hands ``jsonb`` over as text both ways.
    """

    def __init__(self, pool: Any, table: str = "claude_session_store") -> None:
        if not _IDENT.fullmatch(table):
            raise ValueError(f"table name {table!r} is not a plain identifier")
        self.pool = pool
        self.table = table
        t = table
        self._insert = (
            f"INSERT INTO {t} (project_key, session_id, subpath, entry, mtime) "
            "SELECT $1, $2, $3, e, (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::bigint "
            "FROM unnest($4::jsonb[]) WITH ORDINALITY AS t(e, ord) ORDER BY ord")
        self._select = (f"SELECT entry FROM {t} WHERE project_key = $1 AND session_id = $2 "
                        "AND subpath = $3 ORDER BY seq")
        self._list = (f"SELECT session_id, MAX(mtime) AS mtime FROM {t} "
                      "WHERE project_key = $1 AND subpath = '' GROUP BY session_id")

    async def create_schema(self) -> None:
        t = self.table
        await self.pool.execute(f"""
            CREATE TABLE IF NOT EXISTS {t} (
              project_key text   NOT NULL,
              session_id  text   NOT NULL,
              subpath     text   NOT NULL DEFAULT '',
              seq         bigserial,
              entry       jsonb  NOT NULL,
              mtime       bigint NOT NULL,
              PRIMARY KEY (project_key, session_id, subpath, seq)
            );
            CREATE INDEX IF NOT EXISTS {t}_list_idx
              ON {t} (project_key, session_id) WHERE subpath = '';
        """)

    async def append(self, key: dict[str, Any], entries: list[Any]) -> None:
        if entries:
            await self.pool.execute(self._insert, key["project_key"], key["session_id"],
                                    key.get("subpath") or "", [json.dumps(e) for e in entries])

    async def load(self, key: dict[str, Any]) -> list[Any] | None:
        rows = await self.pool.fetch(self._select, key["project_key"], key["session_id"],
                                     key.get("subpath") or "")
        if not rows:
            return None
        return [json.loads(r[0]) if isinstance(r[0], (str, bytes)) else r[0] for r in rows]

    async def list_sessions(self, project_key: str) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(self._list, project_key)
        return [{"session_id": r[0], "mtime": int(r[1])} for r in rows]

    async def delete(self, key: dict[str, Any]) -> None:
        if key.get("subpath"):
            await self.pool.execute(
                f"DELETE FROM {self.table} WHERE project_key = $1 AND session_id = $2 AND subpath = $3",
                key["project_key"], key["session_id"], key["subpath"])
        else:
            await self.pool.execute(
                f"DELETE FROM {self.table} WHERE project_key = $1 AND session_id = $2",
                key["project_key"], key["session_id"])

    async def list_subkeys(self, key: dict[str, Any]) -> list[str]:
        rows = await self.pool.fetch(
            f"SELECT DISTINCT subpath FROM {self.table} "
            "WHERE project_key = $1 AND session_id = $2 AND subpath <> ''",
            key["project_key"], key["session_id"])
        return [r[0] for r in rows]


async def make_pool(dsn: dict[str, Any], synchronous_commit: str, max_size: int = 2) -> Any:
    import asyncpg  # type: ignore[import-untyped,unused-ignore]

    return await asyncpg.create_pool(**dsn, min_size=1, max_size=max_size,
                                     server_settings={"synchronous_commit": synchronous_commit})


# -- setup: the server, the driver, a private cluster --------------------------------


def ensure_asyncpg() -> None:
    try:
        import asyncpg
    except ImportError:
        print("installing asyncpg into this interpreter (pip)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "asyncpg"], check=True)
        importlib.invalidate_caches()
        import asyncpg  # noqa: F401


def _pg_bindirs() -> list[Path]:
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    return sorted(found, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)


def ensure_postgres() -> Path:
    """The newest installed server's bin directory; apt-get installs Debian's if none."""
    if not _pg_bindirs():
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            raise SystemExit("no PostgreSQL server (/usr/lib/postgresql/*/bin/initdb) and cannot "
                             "apt-get install it (needs root): apt-get install postgresql")
        print("installing postgresql (apt-get)", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "-q", "postgresql"]
        if subprocess.run(cmd, env=env, check=False).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, check=True)
            subprocess.run(cmd, env=env, check=True)
    dirs = _pg_bindirs()
    if not dirs:
        raise SystemExit("postgresql installed but no initdb under /usr/lib/postgresql")
    return dirs[-1]


class Cluster:
    """A private cluster: initdb into a temp dir, started on a unix socket there."""

    def __init__(self, bindir: Path, base: str) -> None:
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="fsstore-pg-", dir=base))
        self.data = self.dir / "data"
        self.user: str | None = None
        if os.geteuid() == 0:  # the server refuses to run as root
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.started = False

    def _run(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        check = kw.pop("check", True)
        return subprocess.run([str(self.bindir / args[0]), *args[1:]], check=check, user=self.user,
                              capture_output=True, text=True, cwd=self.dir, **kw)

    def start(self) -> dict[str, Any]:
        self._run("initdb", "-D", str(self.data), "-U", "bench", "-A", "trust", "-E", "UTF8",
                  "--no-instructions")
        # Default settings except where the server listens: no TCP, a socket here.
        opts = f"-c listen_addresses='' -k {self.dir} -p 5432"
        self.started = True
        r = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-t", "60",
                      "-o", opts, "start", check=False, start_new_session=True)
        if r.returncode != 0:
            log = (self.dir / "log").read_text(errors="replace") if (self.dir / "log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {r.stdout}{r.stderr}{log[-2000:]}")
        return {"host": str(self.dir), "port": 5432, "user": "bench", "database": "postgres"}

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def stop(self) -> None:
        try:
            if self.started and (self.data / "postmaster.pid").exists():
                r = self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop",
                              check=False)
                if r.returncode != 0:
                    self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def cpu_pressure_us() -> int | None:
    """Total µs some task waited for a CPU (PSI), or None where the kernel has no PSI."""
    try:
        with open("/proc/pressure/cpu") as fh:
            return int(fh.readline().rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def server_cpu(postmaster: int) -> float:
    """CPU seconds of the postmaster and its children, exited ones included (they are
    reaped by the postmaster: its cutime/cstime)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(name), int(fields[1])
        ut, st, cut, cst = (int(x) for x in fields[11:15])
        if pid == postmaster:
            total += ut + st + cut + cst
        elif ppid == postmaster:
            total += ut + st
    return total / tick


# -- measurement helpers -------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def fs_type(path: str) -> str:
    best, kind = "", "?"
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/mounts") as fh:
        for line in fh:
            _dev, mnt, typ = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, typ
    return kind


class Worker:
    """A writer process (``--worker``): one store, commands on stdin, JSON on stdout."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker",
                                   json.dumps(cfg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, bufsize=1, start_new_session=True)
        # Its own session: a Ctrl-C reaches only this process, which ends the workers
        # (they also exit when their stdin closes).

    def send(self, obj: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def recv(self) -> Any:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.p.wait()})")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send({"op": "quit"})
        with contextlib.suppress(Exception):
            assert self.p.stdin is not None
            self.p.stdin.close()

    def reap(self, deadline: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(timeout=max(0.0, deadline - time.monotonic()))
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def close_workers(workers: list[Worker]) -> None:
    for w in workers:
        w.close()
    deadline = time.monotonic() + 5
    for w in workers:
        w.reap(deadline)


def run_writers(workers: list[Worker], sessions: list[str], durable: bool, n: int, tag: str) -> dict[str, Any]:
    """All workers append n batches at once (after a 3-batch warm-up each)."""
    for i, (w, s) in enumerate(zip(workers, sessions)):
        w.send({"op": "run", "session": s, "durable": durable, "n": n, "warm": 3, "tag": f"{tag}-w{i}"})
    for w in workers:
        assert w.recv() == "ready"
    for w in workers:
        w.send("go")
    res = [w.recv() for w in workers]
    lat = [x for r in res for x in r["lat"]]
    wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
    return {"per_s": len(lat) / wall, "p99_ms": pct(lat, 0.99) * 1e3, "p50_ms": pct(lat, 0.5) * 1e3}


async def _worker_main(cfg: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def out(obj: Any) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    stores: dict[bool, Any]
    if cfg["kind"] == "fs":
        from fsstore import FsSessionStore

        summaries = cfg.get("summaries")
        stores = {True: FsSessionStore(cfg["root_on"], fsync=True, summaries=summaries),
                  False: FsSessionStore(cfg["root_off"], fsync=False, summaries=summaries)}
    else:
        stores = {True: PostgresSessionStore(await make_pool(cfg["dsn"], "on")),
                  False: PostgresSessionStore(await make_pool(cfg["dsn"], "off"))}
    out("ready")
    while True:
        line = await reader.readline()
        if not line:
            return
        cmd = json.loads(line)
        if cmd == "go":
            continue
        if cmd["op"] == "quit":
            return
        if cmd["op"] == "rss":
            status = Path("/proc/self/status").read_text()
            out({k: int(re.search(rf"^{k}:\s+(\d+)", status, re.MULTILINE).group(1))  # type: ignore[union-attr]
                 for k in ("VmHWM", "VmRSS")})
            continue
        store = stores[cmd["durable"]]
        key = {"project_key": PROJECT, "session_id": cmd["session"]}
        for i in range(cmd["warm"]):
            await store.append(key, batch(i, cmd["tag"] + "-warm"))
        out("ready")
        go = await reader.readline()
        if not go:  # the parent is gone
            return
        assert json.loads(go) == "go"
        lat = []
        c0, t0 = time.process_time(), time.monotonic()
        for i in range(cmd["n"]):
            a = time.perf_counter()
            await store.append(key, batch(i, cmd["tag"]))
            lat.append(time.perf_counter() - a)
        t1, c1 = time.monotonic(), time.process_time()
        out({"t0": t0, "t1": t1, "cpu": c1 - c0, "lat": lat})


# -- the comparison ------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, dsn: dict[str, Any], cluster: Cluster, fsdir: Path) -> None:
        from fsstore import FsSessionStore

        self.args = args
        self.dsn = dsn
        self.cluster = cluster
        self.fsdir = fsdir
        self.rng = random.Random(16)
        q = args.quick
        self.n_append = 200 if q else 1000
        self.load_entries = 2000 if q else 10000
        self.list_sessions = 500 if q else 2000
        self.n_writer = 40 if q else 150
        # Per repeat: lists of (fsstore, postgres) figures.
        self.data: dict[str, list[tuple[float, float]]] = {}
        self.extra: dict[str, Any] = {}
        self.workers: list[Worker] = []
        self.fs_workers: list[Worker] = []
        self.pg_workers: list[Worker] = []
        self.fs_on = FsSessionStore(fsdir / "on", fsync=True, create=True)
        self.fs_off = FsSessionStore(fsdir / "off", fsync=False, create=True)

    def add(self, name: str, fs: float, pg: float) -> None:
        self.data.setdefault(name, []).append((fs, pg))

    async def setup(self) -> None:
        self.pg_on = PostgresSessionStore(await make_pool(self.dsn, "on"))
        self.pg_off = PostgresSessionStore(await make_pool(self.dsn, "off"))
        await self.pg_on.create_schema()
        self.pg_version = await self.pg_on.pool.fetchval("SHOW server_version")
        # The load transcript and the listed project, built once, the same in both.
        t0 = time.perf_counter()
        self.load_key = {"project_key": PROJECT, "session_id": "load-10k"}
        for i in range(self.load_entries // 5):
            b = batch(i, "load")
            self.fs_off.sync.append(self.load_key, b)
            await self.pg_off.append(self.load_key, b)
        self.fs_off.sync.compact(self.load_key)
        one = batch(0, "list")
        fifty = [e for i in range(10) for e in batch(i, "long")]
        for i in range(self.list_sessions):
            sid = f"{i:08d}-0000-4000-8000-000000000000"
            for project, entries in ((LIST_PROJECT, one), (LONG_PROJECT, fifty)):
                k = {"project_key": project, "session_id": sid}
                self.fs_off.sync.append(k, entries)
                await self.pg_off.append(k, entries)
        await self.pg_on.pool.execute("ANALYZE")  # what autovacuum would do within a minute
        assert await self.fs_off.load(self.load_key) == await self.pg_off.load(self.load_key)
        fs_l = {r["session_id"] for r in await self.fs_off.list_sessions(LIST_PROJECT)}
        pg_l = {r["session_id"] for r in await self.pg_off.list_sessions(LIST_PROJECT)}
        assert fs_l == pg_l and len(fs_l) == self.list_sessions
        print(f"  built the load transcript ({self.load_entries} entries) and 2 x {self.list_sessions} "
              f"listed sessions in {time.perf_counter() - t0:.1f} s", flush=True)
        # Writer processes: 8 per store, started once, reused by every run.
        cfg_fs = {"kind": "fs", "root_on": str(self.fsdir / "on"), "root_off": str(self.fsdir / "off")}
        for _ in range(8):
            self.fs_workers.append(Worker(cfg_fs))
            self.workers.append(self.fs_workers[-1])
        self.fs_plain = Worker(dict(cfg_fs, summaries=False))
        self.workers.append(self.fs_plain)
        for _ in range(8):
            self.pg_workers.append(Worker({"kind": "pg", "dsn": self.dsn}))
            self.workers.append(self.pg_workers[-1])
        for w in self.workers:
            assert w.recv() == "ready"

    async def close(self) -> None:
        close_workers(self.workers)
        for s in (getattr(self, "pg_on", None), getattr(self, "pg_off", None)):
            if s is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(s.pool.close(), 10)

    async def appends(self, r: int) -> None:
        """One writer per store, four stores interleaved op by op in a shuffled order."""
        n, warm = self.n_append, 20
        keys = {name: {"project_key": PROJECT, "session_id": f"append-{r}-{name}"}
                for name in ("fs_on", "pg_on", "fs_off", "pg_off")}
        stores: dict[str, Any] = {"fs_on": self.fs_on, "pg_on": self.pg_on, "fs_off": self.fs_off, "pg_off": self.pg_off}
        lat: dict[str, list[float]] = {k: [] for k in stores}
        cpu: dict[str, float] = dict.fromkeys(stores, 0.0)
        names = list(stores)
        pm = self.cluster.postmaster_pid()
        s0 = server_cpu(pm)
        for i in range(n + warm):
            self.rng.shuffle(names)
            for name in names:
                b = batch(i, f"a{r}{name}")
                c0, t0 = time.process_time(), time.perf_counter()
                await stores[name].append(keys[name], b)
                t1, c1 = time.perf_counter(), time.process_time()
                if i >= warm:
                    lat[name].append(t1 - t0)
                    cpu[name] += c1 - c0
        server = (server_cpu(pm) - s0) / (2 * (n + warm))
        for pair, (fs, pg) in {"on": ("fs_on", "pg_on"), "off": ("fs_off", "pg_off")}.items():
            self.add(f"append_p50_{pair}", pct(lat[fs], 0.5) * 1e6, pct(lat[pg], 0.5) * 1e6)
            self.add(f"append_p99_{pair}", pct(lat[fs], 0.99) * 1e6, pct(lat[pg], 0.99) * 1e6)
            self.add(f"append_mean_{pair}", statistics.fmean(lat[fs]) * 1e6,
                     statistics.fmean(lat[pg]) * 1e6)
            self.add(f"cpu_client_{pair}", cpu[fs] / n * 1e6, cpu[pg] / n * 1e6)
        self.add("cpu_server", 0.0, server * 1e6)
        self.add("cpu_total_off", cpu["fs_off"] / n * 1e6, cpu["pg_off"] / n * 1e6 + server * 1e6)

    async def loads_and_lists(self) -> None:
        t: dict[str, list[float]] = {k: [] for k in ("fs_load", "pg_load", "fs_list", "pg_list",
                                                     "fs_long", "pg_long")}
        ops: list[tuple[str, Callable[[], Any]]] = [
            ("fs_load", lambda: self.fs_off.load(self.load_key)),
            ("pg_load", lambda: self.pg_off.load(self.load_key)),
            ("fs_list", lambda: self.fs_off.list_sessions(LIST_PROJECT)),
            ("pg_list", lambda: self.pg_off.list_sessions(LIST_PROJECT)),
            ("fs_long", lambda: self.fs_off.list_sessions(LONG_PROJECT)),
            ("pg_long", lambda: self.pg_off.list_sessions(LONG_PROJECT)),
        ]
        for _ in range(2 + (7 if self.args.quick else 15)):
            self.rng.shuffle(ops)
            for name, op in ops:
                t0 = time.perf_counter()
                await op()
                t[name].append(time.perf_counter() - t0)
        t = {k: v[2:] for k, v in t.items()}  # warm-up
        self.add("load", pct(t["fs_load"], 0.5) * 1e3, pct(t["pg_load"], 0.5) * 1e3)
        self.add("list", pct(t["fs_list"], 0.5) * 1e3, pct(t["pg_list"], 0.5) * 1e3)
        self.add("list_long", pct(t["fs_long"], 0.5) * 1e3, pct(t["pg_long"], 0.5) * 1e3)

    def contention(self, r: int) -> None:
        runs = []
        for durable in (False, True):
            pair = "on" if durable else "off"
            for scen in ("eight_on_eight", "eight_on_one"):
                for kind in ("fs", "pg"):
                    runs.append((durable, pair, scen, kind))
        self.rng.shuffle(runs)
        got: dict[tuple[str, str, str], dict[str, Any]] = {}
        for durable, pair, scen, kind in runs:
            workers = self.fs_workers if kind == "fs" else self.pg_workers
            tag = f"c{r}-{pair}-{scen}"
            sessions = [f"{tag}-{i}" for i in range(8)] if scen == "eight_on_eight" else [tag] * 8
            got[(pair, scen, kind)] = run_writers(workers, sessions, durable, self.n_writer, f"{tag}-{kind}")
        for pair in ("off", "on"):
            for scen in ("eight_on_eight", "eight_on_one"):
                fs, pg = got[(pair, scen, "fs")], got[(pair, scen, "pg")]
                self.add(f"{scen}_{pair}", fs["per_s"], pg["per_s"])
                if scen == "eight_on_one":
                    self.add(f"eight_on_one_p99_{pair}", fs["p99_ms"], pg["p99_ms"])
        # The shared transcript holds every batch once (8 writers x (warm-up + n) x 5).
        k = {"project_key": PROJECT, "session_id": f"c{r}-off-eight_on_one"}
        assert len(self.fs_off.sync.load(k) or []) == 8 * (3 + self.n_writer) * 5
        # A writer without the summary sidecar (so without claude_agent_sdk), for its RSS.
        self.fs_plain.send({"op": "run", "session": f"plain-{r}", "durable": False,
                            "n": self.n_writer, "warm": 3, "tag": f"plain{r}"})
        assert self.fs_plain.recv() == "ready"
        self.fs_plain.send("go")
        self.fs_plain.recv()

    def rss(self) -> None:
        def hwm(ws: list[Worker]) -> float:
            vals: list[float] = []
            for w in ws:
                w.send({"op": "rss"})
                vals.append(w.recv()["VmHWM"] / 1024)
            return statistics.median(vals)

        fs, pg, plain = hwm(self.fs_workers), hwm(self.pg_workers), hwm([self.fs_plain])
        self.extra["rss_mib"] = {"fsstore": fs, "fsstore_summaries_false": plain, "postgres": pg}


# -- report --------------------------------------------------------------------------

ROWS: list[dict[str, Any]] = []


def _row(name: str, figure: float, baseline: float, target: float, unit: str = "µs", *,
         higher_is_better: bool = False, note: str = "") -> None:
    ratio = figure / baseline if baseline else float("inf")
    ok = ratio >= target if higher_is_better else ratio <= target
    ROWS.append({"name": name, "figure": figure, "baseline": baseline, "ratio": ratio,
                 "target": f"{'≥' if higher_is_better else '≤'} {target:g}", "pass": ok,
                 "unit": unit, "note": note})


def report(b: Bench, row: Callable[..., None]) -> None:
    def one(key: str, label: str, target: float, unit: str, higher: bool = False, note: str = "") -> None:
        # The repeat with the median ratio is reported (as run.py does with its rounds);
        # every repeat's ratio is in the note.
        pairs = b.data[key]
        ranked = sorted(pairs, key=lambda p: p[0] / p[1])
        fs, pg = ranked[len(ranked) // 2]
        ratios = ", ".join(f"{f / p:.2f}" for f, p in pairs)
        row(label, fs, pg, target, unit, higher_is_better=higher,
            note=f"per repeat: {ratios}" + (f"; {note}" if note else ""))

    T = TARGETS
    one("append_p50_on", "append p50, fsync=True vs synchronous_commit=on", T["append_p50"], "µs")
    one("append_p99_on", "append p99, fsync=True vs synchronous_commit=on", T["append_p99"], "µs")
    one("append_p50_off", "append p50, fsync=False vs synchronous_commit=off", T["append_p50"], "µs")
    one("append_p99_off", "append p99, fsync=False vs synchronous_commit=off", T["append_p99"], "µs")
    one("load", f"load of {b.load_entries:,} entries (fsstore compacted)", T["load"], "ms")
    one("list", f"list_sessions over {b.list_sessions:,} sessions", T["list"], "ms",
        note="5 entries each")
    one("list_long", f"list_sessions over {b.list_sessions:,} sessions of 50 entries", float("inf"),
        "ms", note="informational: the reference's listing reads every entry row of the project")
    for pair, label in (("off", "fsync=False vs off"), ("on", "fsync=True vs on")):
        one(f"eight_on_eight_{pair}", f"8 processes on 8 sessions, appends/s ({label})",
            T["eight_on_eight"], "/s", True)
        one(f"eight_on_one_{pair}", f"8 processes on 1 session, appends/s ({label})",
            T["eight_on_one"], "/s", True)
        p99 = b.data[f"eight_on_one_p99_{pair}"]
        fs99 = statistics.median(p[0] for p in p99)
        row(f"8 processes on 1 session, writer p99 ({label})", fs99, T["eight_on_one_p99_ms"],
            1.0, "ms", note="fsstore against the 50 ms target; Postgres: "
            + ", ".join(f"{p[1]:.1f}" for p in p99) + " ms; fsstore per repeat: "
            + ", ".join(f"{p[0]:.1f}" for p in p99) + " ms")
    tot = b.data["cpu_total_off"]
    i = sorted(range(len(tot)), key=lambda k: tot[k][0] / tot[k][1])[len(tot) // 2]
    cl, srv = b.data["cpu_client_off"][i][1], b.data["cpu_server"][i][1]
    one("cpu_total_off", "CPU per append: fsstore process / Postgres client + server",
        float("inf"), "µs", note=f"Postgres client {cl:.0f} µs + server {srv:.0f} µs (fsync=False vs off)")
    one("cpu_client_off", "CPU per append: fsstore process / Postgres client alone", float("inf"), "µs")
    rss = b.extra["rss_mib"]
    row("writer RSS (VmHWM), MiB", rss["fsstore"], rss["postgres"], float("inf"), "MiB",
        note=f"fsstore with summaries=False: {rss['fsstore_summaries_false']:.1f} MiB")


def print_table(meta: dict[str, Any]) -> None:
    print()
    print(f"{'fsstore / Postgres adapter':<62} {'fsstore':>12} {'Postgres':>12} {'ratio':>7} {'target':>8}")
    for r in ROWS:
        info = r["target"].endswith("inf")
        print(f"{r['name']:<62} {r['figure']:>9.1f} {r['unit']:<3}{r['baseline']:>9.1f} {r['unit']:<3}"
              f"{r['ratio']:>6.2f} {'—' if info else r['target']:>8}  "
              f"{'info' if info else ('pass' if r['pass'] else 'FAIL')}"
              + (f"  ({r['note']})" if r["note"] else ""))
    print("\n" + ", ".join(f"{k}: {v}" for k, v in meta.items()))


@contextlib.contextmanager
def _interrupts() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt wherever the main thread is, also in
    a blocking read inside the event loop (asyncio.run's own SIGINT handler only
    cancels the main task, which a blocking read never notices), so the cleanup
    runs."""
    def handler(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def run(*, quick: bool = False, base: str | None = None, repeats: int = 3,
        row: Callable[..., None] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Set up, measure ``repeats`` times, report rows through ``row`` (run.py's, or
    this module's own), tear down. Returns the run's description."""
    base = base or str(REPO)
    ensure_asyncpg()
    bindir = ensure_postgres()
    args = argparse.Namespace(quick=quick)
    load_before = os.getloadavg()[0]
    psi0, wall0 = cpu_pressure_us(), time.monotonic()
    with _interrupts():
        cluster = Cluster(bindir, base)
        fsdir = Path(tempfile.mkdtemp(prefix="fsstore-pgpeer-", dir=base))
        try:
            dsn = cluster.start()

            async def main() -> Bench:
                b = Bench(args, dsn, cluster, fsdir)
                try:
                    await b.setup()
                    for r in range(repeats):
                        t0 = time.perf_counter()
                        await b.appends(r)
                        await b.loads_and_lists()
                        b.contention(r)
                        print(f"  repeat {r + 1}/{repeats} done in {time.perf_counter() - t0:.0f} s",
                              flush=True)
                    b.rss()
                finally:
                    await b.close()
                return b

            print(f"fsstore vs the Postgres reference adapter ({repeats} repeats, "
                  f"in {base}: {fs_type(base)})", flush=True)
            b = asyncio.run(main())
        finally:
            cluster.stop()
            shutil.rmtree(fsdir, ignore_errors=True)
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True,
                              check=False).stdout.strip()

    # The code under test: the last commit that touched fsstore/ (and the checkout's HEAD).
    commit = f"{git('log', '-1', '--format=%h', '--', 'fsstore')} (HEAD {git('rev-parse', '--short', 'HEAD')}" \
             + (", modified" if git("status", "--porcelain", "--", "fsstore") else "") + ")"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}",
            "fs": f"{fs_type(base)} ({base})", "postgres": b.pg_version,
            "python": platform.python_version(), "fsstore_commit": commit, "quick": quick,
            "repeats": repeats,
            "load_average": f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after (1 min)"}
    psi1 = cpu_pressure_us()
    if psi0 is not None and psi1 is not None:
        # Share of the run's wall time in which some runnable task waited for a CPU.
        meta["cpu_pressure"] = f"{(psi1 - psi0) / 1e6 / (time.monotonic() - wall0):.0%} (PSI some)"
    report(b, row or _row)
    if extra is not None:
        extra["postgres"] = {"meta": meta, "data": b.data, **b.extra}
    return {"meta": meta, "data": b.data, **b.extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=str(REPO), help="where both stores live (a real disk)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends it
        asyncio.run(_worker_main(json.loads(args.worker)))
        return
    try:
        res = run(quick=args.quick, base=args.dir, repeats=args.repeats)
    except KeyboardInterrupt:
        print("interrupted: the cluster was stopped and its directory removed", file=sys.stderr)
        sys.exit(130)
    print_table(res["meta"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "postgres.json").write_text(json.dumps({**res, "rows": ROWS}, indent=2))
    print(f"results: {out / 'postgres.json'}")


if __name__ == "__main__":
    main()
