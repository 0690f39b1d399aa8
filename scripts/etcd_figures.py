"""Figures for etcd discovery: time from a rank's death (SIGKILL) to its key vanishing, and
resolution time of an 8-rank engine. Runs its own etcd (Debian's etcd-server) on loopback.

    PYTHONPATH=. .venv/bin/python scripts/etcd_figures.py [--kills 3] [--resolves 20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time

import anyio

from akv.runtime.discovery import DEFAULT_TTL, EtcdRegistry, RankRecord
from akv.testing import EtcdServer, spawn_registrant


async def death_to_gone(etcd: str, ttl: float, engine: str) -> float:
    """Seconds from SIGKILL of a registered rank's process until its key is gone."""
    proc = spawn_registrant(etcd, engine, 0, 1, "127.0.0.1:7000", ttl=ttl)
    try:
        async with EtcdRegistry(etcd) as reg:
            await anyio.sleep(ttl / 2)  # a random-ish point in the keep-alive cycle
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            while 0 in (await reg.list_engines()).get(engine, {}):  # noqa: ASYNC110 (polling etcd)
                await anyio.sleep(0.005)
            return time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()


async def resolve_times(etcd: str, ranks: int, n: int) -> tuple[list[float], list[float]]:
    """Resolution times of an engine of ``ranks`` registered ranks: warm client, then a new client each time."""
    engine = "bench-8"
    warm, cold = [], []
    async with EtcdRegistry(etcd) as reg, anyio.create_task_group() as tg:
        for r in range(ranks):
            await tg.start(reg.keep_registered, RankRecord.create(engine, r, ranks, f"127.0.0.1:{7000 + r}"))
        await reg.resolve(engine)
        for _ in range(n):
            t0 = time.perf_counter()
            assert len(await reg.resolve(engine)) == ranks
            warm.append(time.perf_counter() - t0)
        for _ in range(n):
            t0 = time.perf_counter()
            async with EtcdRegistry(etcd) as fresh:
                assert len(await fresh.resolve(engine)) == ranks
            cold.append(time.perf_counter() - t0)
        tg.cancel_scope.cancel()
    return warm, cold


async def main(a: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as d, EtcdServer(d) as etcd:
        out: dict[str, object] = {}
        for ttl in (DEFAULT_TTL, 1.0):
            times = [await death_to_gone(etcd.endpoint, ttl, f"kill-{ttl:g}-{i}") for i in range(a.kills)]
            out[f"kill_to_gone_ttl{ttl:g}_s"] = [round(t, 3) for t in times]
            print(f"ttl {ttl:g} s: SIGKILL -> key gone {', '.join(f'{t:.2f}' for t in times)} s")
        warm, cold = await resolve_times(etcd.endpoint, 8, a.resolves)
        out["resolve8_warm_median_ms"] = round(statistics.median(warm) * 1e3, 3)
        out["resolve8_cold_median_ms"] = round(statistics.median(cold) * 1e3, 3)
        print(
            f"resolve 8 ranks: median {out['resolve8_warm_median_ms']} ms (warm client), "
            f"{out['resolve8_cold_median_ms']} ms (new client) over {a.resolves}"
        )
        print(json.dumps(out))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--resolves", type=int, default=20)
    args = p.parse_args()
    anyio.run(main, args)
