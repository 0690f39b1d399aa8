"""Figures for hybrid caches: per preset and TP pair, each decode rank's descriptors and bytes
per request per group; and, at full layer count, plan-build and handshake time.

Descriptors and bytes come from [`TransferPlan.prepare`][akv.plan.TransferPlan.prepare] on
the plan of decode rank 0 (pure: fake addresses), for a request of ``--tokens`` tokens
(sliding groups: their window; state groups: one slot), per-layer HND and head-major on both
sides. Handshake time: one ``Consumer.connect()`` to an in-process prefill engine of real NIXL
agents (TP 2 -> 4 and 4 -> 2), the median of ``--samples``.

    PYTHONPATH=. .venv/bin/python scripts/groups_figures.py [--tokens 1024] [--samples 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import AsyncExitStack

import anyio

import akv
from akv.geometry.layout import rank_layout
from akv.plan import RankMemory, TransferPlan
from akv.presets import PRESETS
from akv.testing import local_counts


def _memory(cache: akv.CacheSpec, rank: int, tp: int) -> RankMemory:
    n = len(rank_layout(cache, rank, tp).shapes)
    return RankMemory(rank, tp, tuple(2**40 + i * 2**34 for i in range(n)))


def _plan(cache: akv.CacheSpec, p: int, d: int) -> TransferPlan:
    remote = {r: _memory(cache, r, p) for r in range(p)}
    return TransferPlan(local_spec=cache, local=_memory(cache, 0, d), remote_spec=cache, remote=remote)


def per_group(tokens: int) -> None:
    print(
        f"per request of {tokens} tokens, decode rank 0 (descriptors / bytes), HND -> HND and head-major -> head-major"
    )
    print(f"{'preset':16} {'TP':6} {'group':6} {'HND descs':>10} {'HM descs':>9} {'bytes':>12}")
    for name in PRESETS:
        for p, d in ((2, 4), (4, 2)):
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
            for g, (hd, hb, md, mb) in rows.items():
                assert hb == mb, (name, g, hb, mb)
                print(f"{name:16} {p}->{d:<3} {g:6} {hd:>10} {md:>9} {hb:>12}")


async def handshakes(samples: int) -> None:
    print(f"{'preset':16} {'TP':6} {'plan build ms':>14} {'connect ms (median)':>20}")
    for name in ("deepseek-v3", "qwen3-next-80b"):
        cache = akv.preset(name, blocks=64)
        for p, d in ((2, 4), (4, 2)):
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
            print(
                f"{name:16} {p}->{d:<3} {statistics.median(builds):>14.1f} {statistics.median(times):>20.1f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=5)
    a = ap.parse_args()
    per_group(a.tokens)
    anyio.run(handshakes, a.samples)


if __name__ == "__main__":
    main()
