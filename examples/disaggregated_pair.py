"""A prefill engine and a decode engine in two processes, with a toy router between them.

Prefill (TP 2) "computes" each prompt's KV into blocks from its own allocator, exposes them
and hands (request id, block ids) to the router; decode (TP 4) takes them from the router,
allocates its own blocks, pulls, checks every byte and frees. Prefill's allocator gets its
blocks back when akv reports the release. Run: ``python examples/disaggregated_pair.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from typing import Any

import anyio
import numpy as np
import torch

import akv
from akv.testing import expected_blocks

SPEC = akv.KVSpec.create(layers=4, num_blocks=128, block_size=16, kv_heads=8, head_dim=64, dtype="bfloat16")
PREFILL_TP, DECODE_TP, REQUESTS = 2, 4, 12


class Allocator:
    """The simplest block pool: a free list."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))

    def alloc(self, n: int) -> list[int]:
        got, self.free = self.free[:n], self.free[n:]
        return got

    def release(self, blocks: Any) -> None:
        self.free.extend(int(b) for b in blocks)


def write_kv(kv: list[torch.Tensor], rank: int, blocks: list[int], seed: int) -> None:
    """Stand-in for the model: deterministic contents from global indices."""
    for region, t in enumerate(kv):
        view = t.view(torch.uint8).view(SPEC.num_blocks, -1)
        view[blocks] = torch.from_numpy(
            expected_blocks(SPEC, rank, PREFILL_TP, region, seed, np.arange(len(blocks)))
        )


def prefill_main(router: Any, done: Any) -> None:
    async def run() -> None:
        allocator = Allocator(SPEC.num_blocks)
        released = 0
        async with anyio.create_task_group() as tg:
            server = akv.ControlServer()
            endpoint = await tg.start(server.serve)
            caches = [akv.allocate_kv_cache(SPEC, r, PREFILL_TP) for r in range(PREFILL_TP)]

            def free(rel: akv.EngineRelease) -> None:  # once every prefill rank released it
                nonlocal released
                allocator.release(rel.block_ids)
                released += 1

            releases = akv.EngineReleases(PREFILL_TP, on_release=free)
            producers = [
                akv.Producer(
                    caches[r], SPEC, tp_rank=r, tp_size=PREFILL_TP, server=server, on_release=releases.rank(r)
                )
                for r in range(PREFILL_TP)
            ]
            async with producers[0], producers[1]:
                router.put(("endpoint", str(endpoint)))
                for i in range(REQUESTS):
                    n = 3 + i % 5  # prompt length in blocks
                    blocks = allocator.alloc(n)
                    for r in range(PREFILL_TP):
                        write_kv(caches[r], r, blocks, seed=i)
                    rid = f"req-{i}"
                    for p in producers:
                        p.expose(rid, blocks)
                    router.put(("request", rid, blocks, i))
                router.put(("end",))
                for p in producers:
                    await p.wait_released()
            print(
                f"prefill: {released}/{REQUESTS} requests released, "
                f"{len(allocator.free)}/{SPEC.num_blocks} blocks free again"
            )
            done.put(released)
            tg.cancel_scope.cancel()

    anyio.run(run)


async def decode_main(router: Any) -> int:
    _, endpoint = await anyio.to_thread.run_sync(router.get)
    allocator = Allocator(SPEC.num_blocks)
    caches = [akv.allocate_kv_cache(SPEC, r, DECODE_TP) for r in range(DECODE_TP)]
    ok = 0
    consumers = [akv.Consumer(caches[r], SPEC, tp_rank=r, tp_size=DECODE_TP) for r in range(DECODE_TP)]
    async with consumers[0], consumers[1], consumers[2], consumers[3]:
        sessions = [await c.connect(endpoint) for c in consumers]
        while True:
            msg = await anyio.to_thread.run_sync(router.get)
            if msg[0] == "end":
                break
            _, rid, remote, seed = msg
            local = allocator.alloc(len(remote))
            transfers = [
                await s.pull(akv.PullRequest(request_id=rid, local_block_ids=local, remote_block_ids=remote))
                for s in sessions
            ]
            results = [await t for t in transfers]
            good = all(
                np.array_equal(
                    t.view(torch.uint8).view(SPEC.num_blocks, -1)[local].numpy(),
                    expected_blocks(SPEC, r, DECODE_TP, region, seed, np.arange(len(remote))),
                )
                for r in range(DECODE_TP)
                for region, t in enumerate(caches[r])
            )
            ok += good
            print(
                f"decode: {rid} {sum(x.bytes for x in results) / 1e6:.2f} MB on {DECODE_TP} ranks, "
                f"{max(x.seconds for x in results) * 1e3:.2f} ms, {'verified' if good else 'MISMATCH'}"
            )
            allocator.release(local)  # a real engine frees them when the request finishes decoding
    return ok


def main() -> int:
    ctx = mp.get_context("spawn")
    router, done = ctx.Queue(), ctx.Queue()
    prefill = ctx.Process(target=prefill_main, args=(router, done))
    prefill.start()
    verified = anyio.run(decode_main, router)
    released = done.get(timeout=60)
    prefill.join(30)
    print(f"{verified}/{REQUESTS} verified, {released}/{REQUESTS} released by prefill")
    return 0 if verified == released == REQUESTS and prefill.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
