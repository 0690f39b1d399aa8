"""``akv decode``: decode ranks pulling and verifying every announced request."""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import numpy as np

from akv.cli.args import EXIT_FAILED, EXIT_OK, check, check_model, check_seconds, emit, report, spec_from_args
from akv.errors import AkvError, ConfigError
from akv.protocol.address import parse_endpoint
from akv.testing import fetch_requests, verify_request

__all__ = ["BlockAllocator", "cmd_decode", "run_decode", "validate"]


def validate(a: argparse.Namespace) -> None:
    """Every flag of ``akv decode``, before connecting ([`ConfigError`][akv.errors.ConfigError] naming the flag)."""
    try:
        parse_endpoint(a.connect)
    except ConfigError:
        raise ConfigError(
            f"--connect {a.connect!r} is not HOST:PORT: pass the endpoint of the prefill engine's "
            "ready line (for example 127.0.0.1:5555)"
        ) from None
    check_model(a, "--tp-size")
    check(a.concurrency >= 1, f"--concurrency must be >= 1, got {a.concurrency}")
    check_seconds(a.transfer_timeout, "--transfer-timeout")
    check(a.engine_id is None or bool(a.engine_id), "--engine-id must not be empty")


class BlockAllocator:
    """A toy decode-side block pool: random free blocks, waits when empty."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(np.random.default_rng(seed).permutation(num_blocks).tolist())
        self._changed = anyio.Event()

    async def alloc(self, n: int) -> list[int]:
        while len(self.free) < n:
            await self._changed.wait()
        got, self.free = self.free[:n], self.free[n:]
        return got

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)
        self._changed.set()
        self._changed = anyio.Event()


async def run_decode(
    a: argparse.Namespace, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    from akv.geometry.tensors import allocate_kv_cache
    from akv.runtime.consumer import Consumer, PullRequest

    spec = spec_from_args(a)
    engine_id = a.engine_id or f"decode-{uuid.uuid4().hex[:8]}"
    requests = await fetch_requests(a.connect, spec, a.secret, engine_id)
    largest = max((len(r.block_ids) for r in requests), default=0)
    check(
        largest <= spec.num_blocks,
        f"the prefill engine announces requests of {largest} blocks, more than --blocks {spec.num_blocks}: "
        f"raise --blocks to at least {largest}",
    )
    stats = {"verified": 0, "failed": 0, "bytes": 0}
    errors: list[str] = []
    started = time.monotonic()
    async with AsyncExitStack() as stack:
        caches = [allocate_kv_cache(spec, d, a.tp_size) for d in range(a.tp_size)]
        consumers = [
            await stack.enter_async_context(
                Consumer(
                    caches[d],
                    spec,
                    tp_rank=d,
                    tp_size=a.tp_size,
                    engine_id=engine_id,
                    secret=a.secret,
                    transfer_timeout=a.transfer_timeout,
                )
            )
            for d in range(a.tp_size)
        ]
        sessions = [await c.connect(a.connect) for c in consumers]
        allocator = BlockAllocator(spec.num_blocks, seed=a.seed)
        limiter = anyio.CapacityLimiter(max(1, a.concurrency))
        done = 0

        async def one(i: int, req: Any) -> None:
            nonlocal done
            n = len(req.block_ids)
            hit = 1 if i % 3 == 2 and n > 1 else 0  # every third request: a partial prefix hit
            async with limiter:
                local = await allocator.alloc(n - hit)
                try:
                    pr = PullRequest(
                        request_id=req.request_id, local_block_ids=local, remote_block_ids=req.block_ids
                    )
                    transfers = [await s.pull(pr) for s in sessions]
                    ok = True
                    for d, t in enumerate(transfers):
                        try:
                            res = await t
                            stats["bytes"] += res.bytes
                        except AkvError as exc:
                            ok = False
                            errors.append(f"{req.request_id} rank {d}: {exc}")
                            continue
                        ok &= verify_request(
                            caches[d], spec, d, a.tp_size, local, req.seed, np.arange(hit, n)
                        )
                    if not ok and not errors:
                        errors.append(f"{req.request_id}: data mismatch")
                except AkvError as exc:
                    ok = False
                    errors.append(f"{req.request_id}: {exc}")
                finally:
                    allocator.release(local)
            stats["verified" if ok else "failed"] += 1
            done += 1
            if progress:
                progress(done, len(requests))

        async with anyio.create_task_group() as tg:
            for i, req in enumerate(requests):
                tg.start_soon(one, i, req)
    seconds = time.monotonic() - started
    return {
        "event": "summary",
        "role": "decode",
        "requests": len(requests),
        "verified": stats["verified"],
        "failed": stats["failed"],
        "bytes": stats["bytes"],
        "seconds": round(seconds, 3),
        "gbps": round(stats["bytes"] / seconds / 1e9, 3) if seconds > 0 else 0.0,
        "tp_size": a.tp_size,
        "errors": errors[:10],
    }


def cmd_decode(a: argparse.Namespace) -> int:
    def progress(done: int, total: int) -> None:
        if a.json:
            emit({"event": "progress", "done": done, "total": total})

    validate(a)
    try:
        summary = anyio.run(run_decode, a, progress)
    except ConfigError:
        raise  # exit 64, one line (akv.cli.main)
    except AkvError as exc:
        summary = {
            "event": "summary",
            "role": "decode",
            "requests": 0,
            "verified": 0,
            "failed": 0,
            "bytes": 0,
            "seconds": 0.0,
            "error": f"{type(exc).__name__}: {exc}",
        }
        report(a, summary, f"decode failed: {type(exc).__name__}: {exc}")
        return EXIT_FAILED
    report(
        a,
        summary,
        f"decode: {summary['verified']}/{summary['requests']} requests verified, "
        f"{summary['bytes'] / 1e6:.1f} MB in {summary['seconds']:.2f}s",
    )
    ok = summary["verified"] == summary["requests"] and not summary["failed"]
    return EXIT_OK if ok else EXIT_FAILED
