"""``akv bench --only groups``: hybrid caches per preset and TP pair (2 -> 4 and 4 -> 2), at
full layer count.

* ``"table": "per_group"`` rows: decode rank 0's descriptors and bytes per request of 1024
  tokens (sliding groups: their window; state groups: one slot), per group, on per-layer HND
  and on head-major on both sides, from [`TransferPlan.prepare`][akv.plan.TransferPlan.prepare]
  on a plan of fake addresses (pure);
* ``"table": "connect"`` rows (deepseek-v3, qwen3-next-80b): the plan build, and one
  ``Consumer.connect()`` to an in-process prefill engine of real NIXL agents, medians of 5.
"""

from __future__ import annotations

import statistics
import time
from contextlib import AsyncExitStack
from typing import Any

import anyio

import akv
from akv.errors import AkvError
from akv.geometry.layout import rank_layout
from akv.plan import RankMemory, TransferPlan
from akv.presets import PRESETS
from akv.testing import local_counts

__all__ = ["figures"]

TOKENS = 1024
SAMPLES = 5
PAIRS = ((2, 4), (4, 2))


def _plan(cache: akv.CacheSpec, p: int, d: int) -> TransferPlan:
    """The plan of decode rank 0 of ``d`` reading from ``p`` prefill ranks (fake addresses)."""

    def memory(rank: int, tp: int) -> RankMemory:
        n = len(rank_layout(cache, rank, tp).shapes)
        return RankMemory(rank, tp, tuple(2**40 + i * 2**34 for i in range(n)))

    remote = {r: memory(r, p) for r in range(p)}
    return TransferPlan(local_spec=cache, local=memory(0, d), remote_spec=cache, remote=remote)


def per_group(tokens: int = TOKENS) -> list[dict[str, Any]]:
    """Descriptors (HND, head-major) and bytes per group of every preset and TP pair."""
    out = []
    for name in PRESETS:
        for p, d in PAIRS:
            rows: dict[str, list[int]] = {}
            for layout in ("HND", "head-major"):
                cache = akv.preset(name, blocks=max(64, tokens // 16 + 2), layout=layout)
                plan = _plan(cache, p, d)
                counts = local_counts(cache, tokens)
                for g in cache.groups:
                    ids: dict[str, list[int]] = {x.name: [] for x in cache.groups}
                    ids[g.name] = list(range(counts[g.name]))
                    prep = plan.prepare("r", ids, ids, tokens)
                    rows.setdefault(g.name, []).extend([prep.descriptors, prep.bytes])
            for group, (hd, hb, md, mb) in rows.items():
                if hb != mb:  # the two layouts must move the same bytes, or the figure is wrong
                    raise AkvError(f"{name} group {group}: {hb} bytes head-major, {mb} per layer")
                out.append(
                    {
                        "table": "per_group",
                        "preset": name,
                        "tp": f"{p}->{d}",
                        "group": group,
                        "tokens": tokens,
                        "hnd_descriptors": hd,
                        "headmajor_descriptors": md,
                        "bytes": hb,
                        "mib": round(hb / (1 << 20), 1),
                    }
                )
    return out


async def connect_times(samples: int = SAMPLES) -> list[dict[str, Any]]:
    """Plan build and ``Consumer.connect()`` times, medians of ``samples``."""
    out = []
    for name in ("deepseek-v3", "qwen3-next-80b"):
        cache = akv.preset(name, blocks=64)
        for p, d in PAIRS:
            builds = []
            for _ in range(samples):
                t = time.perf_counter()
                _plan(cache, p, d)
                builds.append((time.perf_counter() - t) * 1e3)
            async with AsyncExitStack() as stack:
                server = akv.ControlServer()
                tg = await stack.enter_async_context(anyio.create_task_group())
                await tg.start(server.serve)
                for r in range(p):
                    kv = akv.allocate_kv_cache(cache, r, p)
                    await stack.enter_async_context(
                        akv.Producer(kv, cache, tp_rank=r, tp_size=p, server=server)
                    )
                times = []
                for i in range(samples):
                    kv = akv.allocate_kv_cache(cache, 0, d)
                    async with akv.Consumer(kv, cache, tp_rank=0, tp_size=d, engine_id=f"d{i}") as consumer:
                        t = time.perf_counter()
                        await consumer.connect(str(server.endpoint))
                        times.append((time.perf_counter() - t) * 1e3)
                tg.cancel_scope.cancel()
            out.append(
                {
                    "table": "connect",
                    "preset": name,
                    "tp": f"{p}->{d}",
                    "plan_build_ms": round(statistics.median(builds), 1),
                    "connect_ms": round(statistics.median(times), 1),
                }
            )
    return out


async def figures(transfer: str = "direct") -> list[dict[str, Any]]:
    """Both tables (``transfer`` is not used)."""
    return [*per_group(), *await connect_times()]
