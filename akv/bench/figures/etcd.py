"""``akv bench --only etcd``: etcd discovery, on an etcd of its own (Debian's etcd-server, or
``$AKV_ETCD``) on loopback.

* ``"table": "kill_to_gone"`` rows, one per TTL (akv's default, 5 s, and 1 s): seconds from
  SIGKILL of a registered rank's process until its key is gone, three kills each;
* one ``"table": "resolve"`` row: median milliseconds to resolve an engine of 8 registered
  ranks over 20 tries, with a warm client and with a new client each time.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from typing import Any

import anyio

from akv.errors import AkvError
from akv.runtime.discovery import DEFAULT_TTL, EtcdRegistry, RankRecord
from akv.testing import EtcdServer, spawn_registrant

__all__ = ["figures"]

KILLS = 3
RESOLVES = 20


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
            _check_ranks(await reg.resolve(engine), ranks)
            warm.append(time.perf_counter() - t0)
        for _ in range(n):
            t0 = time.perf_counter()
            async with EtcdRegistry(etcd) as fresh:
                _check_ranks(await fresh.resolve(engine), ranks)
            cold.append(time.perf_counter() - t0)
        tg.cancel_scope.cancel()
    return warm, cold


async def figures(transfer: str = "direct") -> list[dict[str, Any]]:
    """Both tables (``transfer`` is not used)."""
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d, EtcdServer(d) as etcd:
        for ttl in (DEFAULT_TTL, 1.0):
            times = [await death_to_gone(etcd.endpoint, ttl, f"kill-{ttl:g}-{i}") for i in range(KILLS)]
            out.append({"table": "kill_to_gone", "ttl_s": ttl, "seconds": [round(t, 3) for t in times]})
        warm, cold = await resolve_times(etcd.endpoint, 8, RESOLVES)
        out.append(
            {
                "table": "resolve",
                "ranks": 8,
                "tries": RESOLVES,
                "warm_median_ms": round(statistics.median(warm) * 1e3, 3),
                "new_client_median_ms": round(statistics.median(cold) * 1e3, 3),
            }
        )
    return out


def _check_ranks(records: Any, ranks: int) -> None:
    """A resolution that found fewer ranks than registered makes the timing meaningless."""
    if len(records) != ranks:
        raise AkvError(f"etcd resolved {len(records)} ranks where {ranks} are registered")
