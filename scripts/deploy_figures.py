"""Handshake time of a decode rank that needs 1, 2, 4 or 8 prefill ranks, each rank serving its
own control endpoint (the deployed shape), through the engine's bootstrap and through a rank
list. One process, real NIXL agents, loopback sockets.

A model of 8 KV heads read by a decode engine of TP 1: its one rank needs every prefill rank,
and handshakes with them concurrently. Each sample is one ``Consumer.connect()`` on a fresh
Consumer (its NIXL agent created beforehand, not timed): the bootstrap conversation (which
also brings rank 0's metadata), the other ranks' handshakes, loading their agents and
preparing the descriptor lists.

    PYTHONPATH=. .venv/bin/python scripts/deploy_figures.py [--samples 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import AsyncExitStack

import anyio

import akv

SPEC = akv.KVSpec.create(layers=4, num_blocks=256, block_size=16, kv_heads=8, head_dim=64, dtype="float16")


async def figures(sizes: list[int], samples: int) -> None:
    print(f"{'prefill ranks':>13} {'form':>9} {'median ms':>9} {'min ms':>7} {'max ms':>7}")
    for p in sizes:
        async with AsyncExitStack() as stack:
            ranks: list[akv.Producer] = []
            for r in range(p):
                boot = str(ranks[0].endpoint) if r else None
                kv = akv.allocate_kv_cache(SPEC, r, p)
                ranks.append(
                    await stack.enter_async_context(
                        akv.Producer(kv, SPEC, tp_rank=r, tp_size=p, bootstrap=boot)
                    )
                )
            forms = {
                "bootstrap": str(ranks[0].endpoint),
                "rank list": ",".join(str(x.endpoint) for x in ranks),
            }
            for form, address in forms.items():
                times = []
                for _ in range(samples + 1):  # the first one warms up
                    async with akv.Consumer(
                        akv.allocate_kv_cache(SPEC, 0, 1), SPEC, tp_rank=0, tp_size=1
                    ) as c:
                        t0 = time.perf_counter()
                        session = await c.connect(address)
                        times.append(time.perf_counter() - t0)
                        assert set(session.links) == set(range(p))
                ms = [t * 1000 for t in times[1:]]
                print(
                    f"{p:>13} {form:>9} {statistics.median(ms):>9.1f} {min(ms):>7.1f} {max(ms):>7.1f}",
                    flush=True,
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--sizes", default="1,2,4,8", help="prefill TP sizes (default: %(default)s)")
    a = ap.parse_args()
    anyio.run(figures, [int(x) for x in a.sizes.split(",")], a.samples)


if __name__ == "__main__":
    main()
