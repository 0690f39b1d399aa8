"""Where packed reads start to beat direct ones: the threshold of ``transfer="auto"``.

One prefill rank and one decode rank of TP 2 in this process (NIXL over UCX loopback, DRAM,
bfloat16, 8 KV heads of 128, 16 layers, blocks of 16 tokens): the decode rank reads half the
heads of requests of 1 to 16 blocks, on the per-layer HND layout (one descriptor per layer,
K/V plane and block) and on NHD (one per token too), directly and packed, alternating, and
prints per case the descriptors a direct read posts and the mean milliseconds of a pull each
way (launch to verified bytes in place, the packed scatter included) as JSON lines.

    PYTHONPATH=. .venv/bin/python scripts/packed_threshold.py
"""

from __future__ import annotations

import json
import time

import anyio
import numpy as np
import torch

import akv

ROUNDS = 6


async def case(layout: str, blocks: int) -> dict[str, object]:
    """Mean pull time of ``blocks``-block requests, direct and packed, on ``layout``."""
    spec = akv.KVSpec.create(
        layers=16, num_blocks=64, block_size=16, kv_heads=8, head_dim=128, dtype="bfloat16", layout=layout
    )
    spent: dict[str, list[float]] = {"direct": [], "packed": []}
    descriptors = 0
    async with anyio.create_task_group() as tg:
        server = akv.ControlServer()
        endpoint = await tg.start(server.serve)
        kv = akv.allocate_kv_cache(spec, 0, 1)
        async with (
            akv.Producer(kv, spec, tp_rank=0, tp_size=1, server=server, transfer="packed") as producer,
            akv.Consumer(
                akv.allocate_kv_cache(spec, 0, 2),
                spec,
                tp_rank=0,
                tp_size=2,
                same_process="nixl",
                transfer="direct",
            ) as direct,
            akv.Consumer(
                akv.allocate_kv_cache(spec, 0, 2),
                spec,
                tp_rank=0,
                tp_size=2,
                same_process="nixl",
                transfer="packed",
            ) as packed,
        ):
            sessions = {"direct": await direct.connect(endpoint), "packed": await packed.connect(endpoint)}
            ids = list(range(blocks, 2 * blocks))
            for i in range(ROUNDS + 1):
                for mode in ("direct", "packed") if i % 2 else ("packed", "direct"):
                    rid = f"{mode}-{i}"
                    producer.expose(rid, ids)
                    started = time.perf_counter()
                    result = await (await sessions[mode].pull(rid, list(range(blocks)), ids))
                    if i:  # the first round warms up
                        spent[mode].append(time.perf_counter() - started)
                    if mode == "direct":
                        descriptors = result.descriptors
        tg.cancel_scope.cancel()
    return {
        "layout": layout,
        "blocks": blocks,
        "direct_descriptors": descriptors,
        "direct_ms": round(1e3 * float(np.mean(spent["direct"])), 3),
        "packed_ms": round(1e3 * float(np.mean(spent["packed"])), 3),
    }


async def main() -> None:
    torch.set_num_threads(1)
    for layout in ("HND", "NHD"):
        for blocks in (1, 2, 4, 8, 16):
            print(json.dumps(await case(layout, blocks)), flush=True)


if __name__ == "__main__":
    anyio.run(main)
