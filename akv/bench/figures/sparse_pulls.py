"""``akv bench --only sparse_pulls [--transfer T]``: how long a small pull takes when pulls are
sparse (the prefill rank's poller sleeps between them, as on a lightly loaded engine).

An ``akv prefill`` of TP 1 in another process exposes 12 requests of 4 blocks (2 layers, 2
KV heads of 16, float16, blocks of 4 tokens: 2 KiB each) and keeps them; one decode rank in
this process pulls them one at a time, 0.3 s apart, with ``--transfer``. One row: the
milliseconds of each pull after the first (launch to bytes in place), their median and
maximum.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import anyio

import akv
from akv.testing import fetch_requests, spawn_prefill, spec_argv

__all__ = ["figures"]

BLOCKS = 4
GAP = 0.3


async def figures(transfer: str = "direct", gap: float = GAP) -> list[dict[str, Any]]:
    """Pull the 12 requests ``gap`` s apart with ``transfer``; one row."""
    spec = akv.KVSpec.create(layers=2, num_blocks=64, block_size=4, kv_heads=2, head_dim=16, dtype="float16")
    proc, endpoint = spawn_prefill(
        *("--tp-size", "1", "--requests", "12", "--blocks-per-request", str(BLOCKS), "--hold"),
        *("--timeout", "120", "--transfer", "direct" if transfer == "direct" else "packed"),
        *spec_argv(spec),
    )
    try:
        requests = await fetch_requests(endpoint, spec, None, "sparse")
        kv = akv.allocate_kv_cache(spec, 0, 1)
        async with akv.Consumer(kv, spec, tp_rank=0, tp_size=1, engine_id="sparse", transfer=transfer) as c:
            session = await c.connect(endpoint)
            ms = []
            for i, req in enumerate(requests):
                await anyio.sleep(gap)
                started = time.perf_counter()
                local = list(range(BLOCKS * i % 60, BLOCKS * i % 60 + BLOCKS))
                pull = akv.PullRequest(
                    request_id=req.request_id,
                    local_block_ids=local,
                    remote_block_ids=req.block_ids,
                    generation=req.generation,
                )
                await (await session.pull(pull))
                ms.append((time.perf_counter() - started) * 1e3)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    after = ms[1:]  # the first pull also connects UCX's endpoints
    return [
        {
            "transfer": transfer,
            "gap_s": gap,
            "pull_ms": [round(x, 2) for x in after],
            "median_ms": round(statistics.median(after), 2),
            "max_ms": round(max(after), 2),
        }
    ]
