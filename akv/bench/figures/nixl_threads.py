"""``akv bench --only nixl_threads``: NIXL agent worker threads (``nixl_threads``) against the
default, on the decode side.

Pulls the same 8 requests again and again from one ``akv prefill`` process (a ninth stays
exposed, so the prefill rank polls as it does under load): HND, 16 layers, 64 fragmented
blocks of 16 tokens, 8 KV heads of 128, bfloat16, 64 MiB per request; 6 rounds of 8 pulls
by a decode agent created with 0, 1 and 2 worker threads, each setting in a process of its
own (agents of one process with worker threads would take the cores of the others), the
three in turn, three times. One row per setting: GB/s over its three runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import anyio
import numpy as np

import akv
from akv.testing import fetch_requests, spawn_prefill

__all__ = ["SETTINGS", "figures", "measure"]

SETTINGS = (0, 1, 2)
TURNS = 3
MODEL = [
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--layers",
    "16",
    "--block-size",
    "16",
    "--dtype",
    "bfloat16",
]


async def measure(n: int) -> tuple[int, float]:
    """Bytes and seconds of 6 rounds of 8 pulls by a decode agent with ``n`` worker threads."""
    spec = akv.KVSpec.create(
        layers=16, num_blocks=576, block_size=16, kv_heads=8, head_dim=128, dtype="bfloat16"
    )
    proc, endpoint = spawn_prefill(
        "--tp-size", "1", "--requests", "9", "--blocks-per-request", "64", "--blocks", "576",
        "--hold", "--no-fill", "--lease", "600", "--timeout", "600", *MODEL,
    )  # fmt: skip
    moved, spent = 0, 0.0
    try:
        async with akv.Consumer(
            akv.allocate_kv_cache(spec, 0, 1),
            spec,
            tp_rank=0,
            tp_size=1,
            engine_id=f"threads-{n}",
            verify_exposure=False,  # the same requests are read again and again
            nixl_threads=n,
        ) as consumer:
            session = await consumer.connect(endpoint)
            # the ninth request stays exposed, so the prefill rank keeps polling as under load
            requests = (await fetch_requests(endpoint, spec, None, f"threads-{n}"))[:8]
            rng = np.random.default_rng(3)
            await (await session.pull(requests[0].request_id, list(range(64)), requests[0].block_ids))
            for _ in range(6):
                for req in requests:
                    local = rng.choice(576, 64, replace=False).tolist()
                    t0 = time.perf_counter()
                    result = await (await session.pull(req.request_id, local, req.block_ids))
                    spent += time.perf_counter() - t0
                    moved += result.bytes
    finally:
        proc.kill()
        proc.communicate()
    return moved, spent


def _run(n: int) -> tuple[int, float]:
    """`measure` in a process of its own."""
    code = f"import anyio, json; from akv.bench.figures.nixl_threads import measure; print(json.dumps(anyio.run(measure, {n})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    moved, spent = json.loads(out.stdout.strip().splitlines()[-1])
    return int(moved), float(spent)


async def figures(transfer: str = "direct") -> list[dict[str, Any]]:
    """Every setting, `TURNS` times in turn (``transfer`` is not used)."""
    totals = {n: [0, 0.0] for n in SETTINGS}
    for _ in range(TURNS):
        for n in SETTINGS:
            moved, spent = await anyio.to_thread.run_sync(_run, n)
            totals[n][0] += moved
            totals[n][1] += spent
    return [{"nixl_threads": n, "gbps": round(m / s / 1e9, 3)} for n, (m, s) in totals.items()]
