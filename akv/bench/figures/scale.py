"""``akv bench --only scale``: what akv costs as the work grows, one table per axis, each
beside the floor it can be held against, measured in the same run (DRAM, NIXL over UCX
loopback, this machine). Rows carry ``"table"``:

* ``"prompt"``: one request of 1k to 128k tokens of a 32-layer model in 16-token blocks, one
  KV head of 128 per rank, bfloat16, per-layer ``HND`` (vLLM's layout) and ``head-major``, TP
  1 -> 1 and head-sliced 2 -> 1 (to 64k tokens: 4 GiB a prefill rank past that), the
  prefill in ``akv prefill`` processes that pack: for ``transfer`` direct and packed, the
  milliseconds until ``pull()`` returned (``launch_ms``: planning and posting) and until the
  pull completed (``pull_ms``), the descriptors posted, the event loop's longest gap
  meanwhile (``loop_gap_ms``, a 1 ms ticker); the path ``transfer="auto"`` picks for such a
  request (and so its time); and raw NIXL on the direct read's descriptors (``nixl_ms``).
* ``"inflight"``: 1 to 4,096 one-block pulls in flight at once on one decode rank, from
  one ``akv prefill`` process, launched as ``pull`` calls (tasks) and as one ``pull_many``:
  the decode's CPU and wall microseconds per pull and the prefill process's CPU per pull.
* ``"engines"``: 1 to 128 TP-1 prefill engines (in helper processes of 32 engines each)
  linked by one decode rank: connect milliseconds per engine, decode memory (RSS) and open
  file descriptors per linked engine, and each engine's first and second pull (median ms).
* ``"readers"``: 1 to 64 decode ranks (one engine of that TP size, in a helper process)
  reading one request of one prefill rank (this process) at once: this process's CPU from
  the start of the reads to the release, over the readers (the prefill's poller, busy and
  idle), and milliseconds from the last reader's completion to the release (the release
  may come first: the reader's task records its end after the notice left).
* ``"etcd"``: 1 to 1,000 engines registered in an etcd of its own: milliseconds to resolve
  one engine (median), etcd keys per engine, and watch events per engine change (akv watches
  nothing: a decode rank resolves an engine when it links it, and re-links lost ranks).
"""

from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import IO, Any

import anyio
import anyio.lowlevel
import torch

import akv
from akv._poll import FLUSH_S
from akv.testing import EtcdServer, etcd_binary, fetch_requests, json_lines, spawn_prefill

__all__ = ["figures"]

LENGTHS = (1024, 4096, 16384, 65536, 131072)
INFLIGHT = (1, 16, 256, 1024, 4096)
ENGINES = (1, 8, 32, 128)
PER_HELPER = 32
READERS = (1, 4, 16, 64)
FLEET = (1, 10, 100, 1000)
LONG = ["--layers", "32", "--head-dim", "128", "--block-size", "16", "--dtype", "bfloat16"]
SMALL = ["--layers", "2", "--head-dim", "64", "--block-size", "16", "--dtype", "bfloat16", "--kv-heads", "1"]


class Ticker:
    """The event loop's longest gap between two 1 ms ticks (how long nothing else could run)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._last = 0.0

    async def run(self) -> None:
        self._last = time.perf_counter()
        while True:
            await anyio.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - self._last - 0.001)
            self._last = now


def _progress(row: dict[str, Any]) -> None:
    """One finished row on stderr (the tables take minutes)."""
    print(json.dumps({"name": "scale", **row}), file=sys.stderr, flush=True)


def cpu_of(pid: int) -> float:
    """CPU seconds (user and system) a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- prompt length -------------------------------------------------------------------------


async def prompt_rows() -> list[dict[str, Any]]:
    rows = []
    for layout in ("HND", "head-major"):
        for prefill_tp in (1, 2):
            for tokens in LENGTHS:
                if prefill_tp == 2 and tokens > 65536:  # 4 GiB a prefill rank: past this machine's memory
                    continue
                rows.append(await prompt_row(layout, prefill_tp, tokens))
                _progress(rows[-1])
                gc.collect()  # the last row's caches and staging (GiBs) go before the next's
    return rows


async def prompt_row(layout: str, prefill_tp: int, tokens: int) -> dict[str, Any]:
    """One request read direct from a prefill engine that does not pack, and two read packed
    (the first and the second packed pull) from one that does (each engine in processes of its
    own, one after the other); auto's choice for such a request is its path there, and its
    time that path's. While the direct and the first packed pull move, the same decode rank
    pulls one block from another engine of one rank, another process (``side_ms``)."""
    per = tokens // 16
    heads = prefill_tp  # one KV head of 128 per prefill rank; the decode rank holds them all
    row: dict[str, Any] = {"table": "prompt", "layout": layout, "tp": f"{prefill_tp}->1", "tokens": tokens}
    row["bytes"] = nbytes = per * 16 * 32 * 2 * 128 * 2 * heads
    spec = akv.KVSpec.create(
        layers=32,
        num_blocks=per,
        block_size=16,
        kv_heads=heads,
        head_dim=128,
        dtype="bfloat16",
        layout=layout,
    )
    model = ["--kv-heads", str(heads), *LONG, "--layout", layout]
    side_argv = [
        "--tp-size", "1", *model, "--blocks", "2", "--requests", "2", "--blocks-per-request", "1", "--no-fill",
        "--hold", "--timeout", "900", "--engine-id", "side", "--transfer", "packed", "--pack-pool-mib", "64",
    ]  # fmt: skip
    side, side_endpoint = await anyio.to_thread.run_sync(functools.partial(spawn_prefill, *side_argv))
    try:
        sides = iter(await fetch_requests(side_endpoint, spec, None, "scale-prompt"))
        for how, copies in (("direct", 1), ("packed", 2)):
            argv = [
                "--tp-size", str(prefill_tp), *model, "--blocks", str(per * copies), "--requests", str(copies),
                "--blocks-per-request", str(per), "--no-fill", "--hold", "--lease", "600", "--timeout", "900",
                "--transfer", how, "--pack-pool-mib", str((copies * nbytes // prefill_tp >> 20) + 16),
            ]  # fmt: skip
            proc, endpoint = await anyio.to_thread.run_sync(functools.partial(spawn_prefill, *argv))
            try:
                await _prompt_pulls(row, spec, how, per, nbytes, endpoint, side_endpoint, next(sides))
            finally:
                proc.kill()
                await anyio.to_thread.run_sync(proc.communicate)
            gc.collect()
    finally:
        side.kill()
        await anyio.to_thread.run_sync(side.communicate)
    auto = "packed" if row["auto_path"] == "packed" else "direct"
    row["auto_pull_ms"] = row[f"{auto}_pull_ms"]
    return row


async def _prompt_pulls(
    row: dict[str, Any], spec: akv.KVSpec, how: str, per: int, nbytes: int, endpoint: str, side_endpoint: str,
    side_req: Any,
) -> None:  # fmt: skip
    reqs = await fetch_requests(endpoint, spec, None, "scale-prompt")
    req = reqs[0]
    kv = akv.allocate_kv_cache(spec, 0, 1)
    for t in kv:  # a serving engine's cache is in use: no first-touch page faults timed
        t.view(-1).view(torch.uint8).fill_(1)
    async with akv.Consumer(
        kv,
        spec,
        tp_rank=0,
        tp_size=1,
        engine_id="scale-prompt",
        transfer=how,
        pack_staging_bytes=nbytes + (1 << 20),
        transfer_timeout=300,
    ) as consumer:
        session = await consumer.connect(endpoint)
        side_session = await consumer.connect(side_endpoint)
        local = list(range(per))
        plan = session.plan
        if plan is None:  # a handshake sets it or raises
            raise akv.AkvError("the session has no transfer plan after connecting")
        prepared = plan.prepare(req.request_id, local, req.block_ids)
        if how == "packed":
            consumer.transfer = "auto"  # what auto would pick for it, from an engine that packs
            row["auto_path"] = session.path_for(prepared)
            consumer.transfer = how
        else:  # the floor: the hand-written loop on the direct read's descriptors, after
            await raw_read(consumer, session, prepared)  # one read untimed (first touches)
            row["nixl_ms"] = round(await raw_read(consumer, session, prepared) * 1e3, 2)
        ticker = Ticker()
        side_ms: list[float] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            await anyio.sleep(0.005)
            t0 = time.perf_counter()
            transfer = await session.pull(req.request_id, local, req.block_ids)
            launched = time.perf_counter() - t0
            tg.start_soon(_side_pull, side_session, side_req, side_ms)
            result = await transfer
            total = time.perf_counter() - t0
            tg.cancel_scope.cancel()
        row[f"{how}_launch_ms"] = round(launched * 1e3, 2)
        row[f"{how}_pull_ms"] = round(total * 1e3, 2)
        row[f"{how}_descriptors"] = result.descriptors
        row[f"{how}_loop_gap_ms"] = round(ticker.longest * 1e3, 2)
        row[f"{how}_path"] = result.path
        row[f"{how}_side_ms"] = round(side_ms[0] * 1e3, 2) if side_ms else None
        if how == "packed":  # the second packed pull: warm staging and pools
            t0 = time.perf_counter()
            await (await session.pull(reqs[1].request_id, local, reqs[1].block_ids))
            row["packed_second_pull_ms"] = round((time.perf_counter() - t0) * 1e3, 2)


async def _side_pull(session: akv.TransferSession, req: Any, out: list[float]) -> None:
    """A one-block pull of another engine, timed from its start to its end."""
    await anyio.sleep(0.002)  # the long pull is under way
    t0 = time.perf_counter()
    await (await session.pull(req.request_id, [0], req.block_ids))
    out.append(time.perf_counter() - t0)


async def raw_read(consumer: akv.Consumer, session: akv.TransferSession, prepared: Any) -> float:
    """Seconds of the hand-written NIXL loop on a prepared request's direct-read descriptors
    (its READs posted at once and polled until DONE; nothing checked)."""
    backend, dlists = consumer.backend, session.dlists
    t0 = time.perf_counter()
    handles = [
        backend.read(dlists[op.local_table], li, dlists[op.remote_table], ri, b"")
        for op, li, ri in prepared.posts
    ]
    for h in handles:
        while backend.state(h) != "DONE":
            await anyio.lowlevel.checkpoint()
    seconds = time.perf_counter() - t0
    for h in handles:
        backend.release(h)
    return seconds


# -- pulls in flight -----------------------------------------------------------------------


async def inflight_rows() -> list[dict[str, Any]]:
    """Each (launch, count) three times, the median kept; the heap frozen meanwhile (as vLLM
    freezes its own once started: collections of a grown heap fall on whichever pull runs)."""
    tries = 3
    total = tries * 2 * sum(INFLIGHT) + 64
    argv = [
        "--tp-size", "1", *SMALL, "--blocks", str(total), "--requests", str(total), "--blocks-per-request", "1",
        "--no-fill", "--hold", "--lease", "900", "--timeout", "1800",
    ]  # fmt: skip
    proc, endpoint = await anyio.to_thread.run_sync(functools.partial(spawn_prefill, *argv))
    spec = akv.KVSpec.create(
        layers=2, num_blocks=total, block_size=16, kv_heads=1, head_dim=64, dtype="bfloat16"
    )
    rows = []
    try:
        requests = iter(await fetch_requests(endpoint, spec, None, "scale-inflight"))
        async with akv.Consumer(
            akv.allocate_kv_cache(spec, 0, 1),
            spec,
            tp_rank=0,
            tp_size=1,
            engine_id="scale-inflight",
            max_checks=8192,
            transfer_timeout=120,
        ) as consumer:
            session = await consumer.connect(endpoint)
            for _ in range(64):  # warm: caches, the first pulls' one-off costs
                r = next(requests)
                await (await session.pull(r.request_id, [0], r.block_ids))
            for how in ("pull", "pull_many"):
                for n in INFLIGHT:
                    samples = []
                    for _ in range(tries):
                        batch = [next(requests) for _ in range(n)]
                        samples.append(await _inflight_batch(session, proc.pid, how, batch))
                        await anyio.sleep(0.2)  # the prefill's last notices
                    cpu, wall, peer = (statistics.median(x[k] for x in samples) for k in range(3))
                    rows.append(
                        {
                            "table": "inflight",
                            "launch": how,
                            "pulls": n,
                            "decode_cpu_us": round(cpu * 1e6 / n, 1),
                            "wall_us": round(wall * 1e6 / n, 1),
                            # /proc counts CPU in ticks of 1/CLK_TCK s: per pull, that over n
                            "prefill_cpu_us": round(peer * 1e6 / n, 1),
                            "prefill_cpu_tick_us": round(1e6 / os.sysconf("SC_CLK_TCK") / n, 1),
                        }
                    )
    finally:
        proc.kill()
        await anyio.to_thread.run_sync(proc.communicate)
    return rows


async def _inflight_batch(
    session: akv.TransferSession, pid: int, how: str, batch: list[Any]
) -> tuple[float, float, float]:
    """Decode CPU, wall and prefill CPU seconds of ``batch``'s one-block pulls in flight at once."""
    pulls = [
        akv.PullRequest(request_id=r.request_id, local_block_ids=[i], remote_block_ids=r.block_ids)
        for i, r in enumerate(batch)
    ]
    gc.collect()
    gc.freeze()
    try:
        cpu0, peer0, t0 = time.process_time(), cpu_of(pid), time.perf_counter()
        if how == "pull_many":
            for t in await session.pull_many(pulls):
                await t
        else:
            async with anyio.create_task_group() as tg:
                for p in pulls:
                    tg.start_soon(_pull_one, session, p)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        await anyio.sleep(0.05)  # the prefill takes the last notices
        return cpu, wall, cpu_of(pid) - peer0
    finally:
        gc.unfreeze()


async def _pull_one(session: akv.TransferSession, request: akv.PullRequest) -> None:
    await (await session.pull(request))


# -- engines per decode rank ---------------------------------------------------------------

HOST_ENGINES = """
import json, sys, anyio, akv
n, tag = int(sys.argv[1]), sys.argv[2]
spec = akv.KVSpec.create(layers=2, num_blocks=4, block_size=16, kv_heads=1, head_dim=64, dtype="bfloat16")
async def main():
    async with anyio.create_task_group() as tg:
        out = []
        for i in range(n):
            server = akv.ControlServer()
            await tg.start(server.serve)
            p = akv.Producer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1,
                             engine_id=f"{tag}-{i}", server=server, lease=600)
            await p.__aenter__()
            p.expose("r", [0, 1])
            p.expose("r2", [2, 3])
            out.append(str(server.endpoint))
        print(json.dumps({"event": "ready", "endpoints": out}), flush=True)
        await anyio.sleep_forever()
anyio.run(main)
"""


def host_engines(n: int, tag: str) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOST_ENGINES, str(n), tag], stdout=subprocess.PIPE, text=True
    )
    for msg in json_lines(_pipe(proc.stdout)):
        if msg.get("event") == "ready":
            return proc, list(msg["endpoints"])
    raise akv.AkvError(f"the engines' helper process exited ({proc.wait()})")


async def engines_rows() -> list[dict[str, Any]]:
    rows = []
    spec = akv.KVSpec.create(layers=2, num_blocks=4, block_size=16, kv_heads=1, head_dim=64, dtype="bfloat16")
    for n in ENGINES:
        helpers: list[subprocess.Popen[str]] = []
        try:
            endpoints: list[str] = []
            for k in range(0, n, PER_HELPER):
                proc, eps = await anyio.to_thread.run_sync(
                    host_engines, min(PER_HELPER, n - k), f"scale-{n}-{k}"
                )
                helpers.append(proc)
                endpoints += eps
            async with akv.Consumer(
                akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, engine_id="scale-engines"
            ) as consumer:
                rss0, fds0 = rss_mb(), fds()
                t0 = time.perf_counter()
                sessions = [await consumer.connect(ep) for ep in endpoints]
                connect = (time.perf_counter() - t0) / n
                rss, open_fds = rss_mb() - rss0, fds() - fds0
                times: dict[str, list[float]] = {"r": [], "r2": []}
                for rid in times:  # each engine's first pull, then its second
                    for s in sessions:
                        t0 = time.perf_counter()
                        await (await s.pull(rid, [0, 1], [0, 1] if rid == "r" else [2, 3]))
                        times[rid].append(time.perf_counter() - t0)
                rows.append(
                    {
                        "table": "engines",
                        "engines": n,
                        "connect_ms": round(connect * 1e3, 2),
                        "rss_mb_per_engine": round(rss / n, 3),
                        "fds_per_engine": round(open_fds / n, 2),
                        "first_pull_ms_median": round(statistics.median(times["r"]) * 1e3, 3),
                        "pull_ms_median": round(statistics.median(times["r2"]) * 1e3, 3),
                    }
                )
        finally:
            for proc in helpers:
                proc.kill()
                await anyio.to_thread.run_sync(proc.communicate)
    return rows


# -- readers per prefill rank --------------------------------------------------------------

READERS_HELPER = """
import json, sys, time, anyio, akv
endpoint, n = sys.argv[1], int(sys.argv[2])
spec = akv.KVSpec.create(layers=2, num_blocks=4, block_size=16, kv_heads=64, head_dim=8, dtype="bfloat16")
async def main():
    from contextlib import AsyncExitStack
    async with AsyncExitStack() as stack:
        ranks = [await stack.enter_async_context(akv.Consumer(akv.allocate_kv_cache(spec, r, n), spec,
                 tp_rank=r, tp_size=n, engine_id="scale-readers")) for r in range(n)]
        sessions = [await c.connect(endpoint) for c in ranks]
        for s in sessions:  # each reader's first read (its transport's set-up) is not counted
            await (await s.pull("w", [2, 3], [2, 3]))
        print(json.dumps({"event": "linked"}), flush=True)
        sys.stdin.readline()
        done = []
        async def one(s):
            await (await s.pull("r", [0, 1], [0, 1]))
            done.append(time.monotonic())
        async with anyio.create_task_group() as tg:
            for s in sessions:
                tg.start_soon(one, s)
        print(json.dumps({"event": "done", "last": max(done)}), flush=True)
        await anyio.sleep(1.0)
anyio.run(main)
"""


async def readers_rows() -> list[dict[str, Any]]:
    rows = []
    spec = akv.KVSpec.create(layers=2, num_blocks=4, block_size=16, kv_heads=64, head_dim=8, dtype="bfloat16")
    for n in READERS:
        released = anyio.Event()
        at = [0.0]

        def on_release(release: akv.Release, at: list[float] = at, released: anyio.Event = released) -> None:
            if release.request_id == "r":
                at[0] = time.monotonic()
                released.set()

        async with akv.Producer(  # no spinning: its CPU is the notices' work, not its waiting
            akv.allocate_kv_cache(spec, 0, 1),
            spec,
            tp_rank=0,
            tp_size=1,
            lease=600,
            on_release=on_release,
            spin_s=0.0,
        ) as prefill:
            prefill.expose("w", [2, 3])
            helper = _start_readers(str(prefill.endpoint), n)
            try:
                stdin = _pipe(helper.stdin)
                lines = json_lines(_pipe(helper.stdout))
                await anyio.to_thread.run_sync(_next_event, lines, "linked")
                await anyio.sleep(FLUSH_S + 0.1)  # past the links' wire-up, the poller quiet
                prefill.expose("r", [0, 1])
                cpu0 = time.process_time()
                stdin.write("go\n")
                stdin.flush()
                done = await anyio.to_thread.run_sync(_next_event, lines, "done")
                with anyio.fail_after(60):
                    await released.wait()
                cpu = time.process_time() - cpu0
                rows.append(
                    {
                        "table": "readers",
                        "readers": n,
                        "prefill_cpu_us_per_notice": round(cpu * 1e6 / n, 1),
                        "last_read_to_release_ms": round((at[0] - float(done["last"])) * 1e3, 3),
                    }
                )
            finally:
                helper.kill()
                await anyio.to_thread.run_sync(helper.communicate)
    return rows


def _start_readers(endpoint: str, n: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", READERS_HELPER, endpoint, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _pipe(stream: IO[str] | None) -> IO[str]:
    """A helper process's pipe (opened with ``subprocess.PIPE``, so never None)."""
    if stream is None:
        raise akv.AkvError("a helper process was started without its pipe")
    return stream


def _next_event(lines: Iterator[dict[str, Any]], event: str) -> dict[str, Any]:
    return next(m for m in lines if m.get("event") == event)


# -- a fleet in etcd -----------------------------------------------------------------------


async def etcd_rows() -> list[dict[str, Any]]:
    from akv.runtime.discovery import EtcdRegistry, RankRecord

    rows: list[dict[str, Any]] = []
    if etcd_binary() is None:
        return [{"table": "etcd", "skipped": "no etcd binary (bash scripts/setup.sh installs etcd-server)"}]
    with tempfile.TemporaryDirectory() as d, EtcdServer(d) as etcd:
        async with EtcdRegistry(etcd.endpoint, ttl=600) as reg, anyio.create_task_group() as tg:
            registered = 0
            for n in FLEET:
                while registered < n:
                    record = RankRecord.create(
                        f"fleet-{registered}", 0, 1, f"127.0.0.1:{7000 + registered % 50000}"
                    )
                    await tg.start(reg.keep_registered, record)
                    registered += 1
                times = []
                for i in range(20):
                    t0 = time.perf_counter()
                    found = await reg.resolve(f"fleet-{i % n}")
                    times.append(time.perf_counter() - t0)
                    if len(found) != 1:
                        raise akv.AkvError(f"etcd resolved {len(found)} ranks of a TP-1 engine")
                keys = sum(len(r) for r in (await reg.list_engines()).values())
                rows.append(
                    {
                        "table": "etcd",
                        "engines": n,
                        "resolve_ms_median": round(statistics.median(times) * 1e3, 3),
                        "keys_per_engine": keys / n,
                        "watch_events_per_change": 0,
                    }
                )
            tg.cancel_scope.cancel()
    return rows


TABLES: dict[str, Callable[[], Awaitable[list[dict[str, Any]]]]] = {
    "prompt": prompt_rows,
    "inflight": inflight_rows,
    "engines": engines_rows,
    "readers": readers_rows,
    "etcd": etcd_rows,
}


async def figures(transfer: str = "direct") -> list[dict[str, Any]]:
    """Every table (``transfer`` is not used: the prompt table measures each choice); only
    those named in ``$AKV_SCALE_TABLES`` (comma-separated) where it is set."""
    wanted = [t for t in os.environ.get("AKV_SCALE_TABLES", ",".join(TABLES)).split(",") if t]
    out: list[dict[str, Any]] = []
    for name in wanted:
        rows = await TABLES[name]()
        if name != "prompt":  # its rows were printed as they came
            for r in rows:
                _progress(r)
        out.extend(rows)
    return out
