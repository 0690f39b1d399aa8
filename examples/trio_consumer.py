"""The same pull under trio: a decode rank in a trio program pulls every request of an
``akv prefill`` peer it starts itself, and checks every byte. Run with no arguments."""

from __future__ import annotations

import sys

import numpy as np
import torch
import trio

import akv
from akv.testing import expected_blocks, fetch_requests, spawn_prefill

SPEC = akv.KVSpec.create(layers=2, num_blocks=128, block_size=16, kv_heads=4, head_dim=64, dtype="bfloat16")
MODEL_ARGS = [
    "--kv-heads",
    "4",
    "--layers",
    "2",
    "--blocks",
    "128",
    "--block-size",
    "16",
    "--head-dim",
    "64",
    "--dtype",
    "bfloat16",
]


async def main(endpoint: str) -> int:
    requests = await fetch_requests(endpoint, SPEC, None, "router")
    cache = akv.allocate_kv_cache(SPEC, 0, 2)  # decode rank 0 of TP 2: heads 0-1 of 4
    verified = 0
    async with akv.Consumer(cache, SPEC, tp_rank=0, tp_size=2) as consumer:
        session = await consumer.connect(endpoint)
        transfers = []
        for i, req in enumerate(requests):  # launch them all, then await
            local = list(range(i * 8, i * 8 + len(req.block_ids)))
            transfers.append((req, local, await session.pull(req.request_id, local, req.block_ids)))
        for req, local, transfer in transfers:
            result = await transfer
            good = all(
                np.array_equal(
                    t.view(torch.uint8).view(SPEC.num_blocks, -1)[local].numpy(),
                    expected_blocks(SPEC, 0, 2, region, req.seed, np.arange(len(local))),
                )
                for region, t in enumerate(cache)
            )
            verified += good
            print(
                f"trio: {req.request_id} {result.bytes} bytes from {result.reads} prefill ranks, "
                f"{'verified' if good else 'MISMATCH'}"
            )
    print(f"{verified}/{len(requests)} verified under trio")
    return 0 if verified == len(requests) else 1


if __name__ == "__main__":
    peer, prefill_endpoint = spawn_prefill(
        "--tp-size", "4", "--requests", "8", "--timeout", "120", *MODEL_ARGS
    )
    try:
        sys.exit(trio.run(main, prefill_endpoint))
    finally:
        peer.kill()
        peer.wait()
