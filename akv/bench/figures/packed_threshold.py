"""``akv bench --only packed_threshold``: where packed reads start to beat direct ones, the
threshold of ``transfer="auto"``.

One prefill rank and one decode rank of TP 2 in this process (NIXL over UCX loopback, DRAM,
bfloat16, 8 KV heads of 128, 16 layers, blocks of 16 tokens): the decode rank reads half the
heads of requests of 1 to 16 blocks, on the per-layer HND layout (one descriptor per layer,
K/V plane and block) and on NHD (one per token too), directly and packed, alternating. One
row per case: the descriptors a direct read posts and the mean milliseconds of a pull each
way (launch to bytes in place, the packed scatter included), over 6 rounds after a warm-up.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import numpy as np
import torch

import akv

__all__ = ["case", "figures"]

ROUNDS = 6


async def case(layout: str, blocks: int) -> dict[str, Any]:
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
        direct, packed = (
            akv.Consumer(
                akv.allocate_kv_cache(spec, 0, 2), spec, tp_rank=0, tp_size=2, same_process="nixl", transfer=t
            )
            for t in ("direct", "packed")
        )
        async with (
            akv.Producer(kv, spec, tp_rank=0, tp_size=1, server=server, transfer="packed") as producer,
            direct,
            packed,
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


async def figures(transfer: str = "direct") -> list[dict[str, Any]]:
    """HND and NHD, 1 to 16 blocks (``transfer`` is not used: both ways run)."""
    torch.set_num_threads(1)
    return [await case(layout, blocks) for layout in ("HND", "NHD") for blocks in (1, 2, 4, 8, 16)]
