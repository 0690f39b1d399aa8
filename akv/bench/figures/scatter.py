"""``akv bench --only scatter``: the decode side of a packed pull on DRAM, how fast
`akv.packing.scatter` writes a staged copy into a paged cache.

A decode rank of TP 2 (4 of 8 KV heads of 128, bfloat16, 16 layers, blocks of 16 tokens, a
pool of 128 blocks) receives 8 MiB pulls of 16 fragmented blocks, K and V, from eight staged
copies in turn (so that no copy stays in the core's cache), on the per-layer NHD and HND
layouts, in one thread. One row per layout: milliseconds per pull and GB/s.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

import akv
from akv.geometry.cache import as_cache
from akv.geometry.layout import rank_layout
from akv.packing import CacheViews, scatter

__all__ = ["case", "figures"]

ROUNDS = 4
BLOCKS = 16


def case(layout: str) -> dict[str, Any]:
    """Mean time of one pull's scatter (both components) on ``layout``."""
    spec = akv.KVSpec.create(
        layers=16, num_blocks=128, block_size=16, kv_heads=8, head_dim=128, dtype="bfloat16", layout=layout
    )
    views = CacheViews(akv.allocate_kv_cache(spec, 0, 2), rank_layout(as_cache(spec), 0, 2))
    rng = np.random.default_rng(5)
    blocks = np.repeat(rng.permutation(spec.num_blocks)[:BLOCKS].astype(np.int64), spec.block_size)
    positions = np.tile(np.arange(spec.block_size), BLOCKS)
    units = range(0, 4)  # the heads rank 0 of 2 holds
    nbytes = len(units) * spec.layers * len(blocks) * spec.head_dim * 2  # one component
    staged = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8) for _ in range(8)]

    def pull(copy: torch.Tensor) -> None:
        for component in (0, 1):  # K, V
            scatter(views, 0, component, units, copy, blocks, positions)

    for copy in staged:  # warm-up: first touches of the cache's pages
        pull(copy)
    started = time.perf_counter()
    for _ in range(ROUNDS):
        for copy in staged:
            pull(copy)
    seconds = (time.perf_counter() - started) / (ROUNDS * len(staged))
    return {
        "layout": layout,
        "pull_mib": 2 * nbytes >> 20,
        "ms": round(seconds * 1e3, 3),
        "gbps": round(2 * nbytes / seconds / 1e9, 2),
    }


async def figures(transfer: str = "direct") -> list[dict[str, Any]]:
    """Both layouts (``transfer`` is not used)."""
    torch.set_num_threads(1)
    return [case(layout) for layout in ("NHD", "HND")]
