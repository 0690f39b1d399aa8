"""``akv decode``: decode ranks pulling and verifying every announced request, one process
per rank (``--tp-rank R`` runs one; without it the command starts one process per rank)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import numpy as np

from akv.cli.args import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    check,
    check_model,
    check_seconds,
    emit,
    report,
    spec_from_args,
)
from akv.cli.fanout import ChildFailed, RankProcess, child_argv, exit_with_parent, rank_processes
from akv.errors import AkvError, ConfigError
from akv.geometry.cache import CacheSpec, as_cache
from akv.protocol.address import check_engine_id, parse_engine_address
from akv.runtime.rank import default_engine_id
from akv.testing import fetch_requests, local_counts, verify_request

__all__ = ["BlockAllocator", "cmd_decode", "run_decode", "run_decode_engine", "validate"]


def validate(a: argparse.Namespace) -> None:
    """Every flag of ``akv decode``, before connecting ([`ConfigError`][akv.errors.ConfigError] naming the flag)."""
    try:
        parse_engine_address(a.connect)
    except ConfigError as exc:
        raise ConfigError(
            f"--connect: {exc} (the endpoint of the prefill engine's ready line is its bootstrap)"
        ) from None
    check(a.secret != "", "--secret is empty: give a non-empty shared secret, or leave it out")
    check_model(a, "--tp-size")
    check(a.concurrency >= 1, f"--concurrency must be >= 1, got {a.concurrency}")
    check_seconds(a.transfer_timeout, "--transfer-timeout")
    check(a.engine_id is None or bool(a.engine_id), "--engine-id must not be empty")
    if a.engine_id is not None:
        check_engine_id(a.engine_id)
    if a.tp_rank is not None:
        check(0 <= a.tp_rank < a.tp_size, f"--tp-rank {a.tp_rank} is outside [0, --tp-size {a.tp_size})")
        check(
            a.tp_size == 1 or a.engine_id is not None,
            "--tp-rank needs --engine-id when --tp-size > 1: give every rank of this decode engine the "
            "same name (prefill counts readers per engine)",
        )


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


def _tokens(remote: CacheSpec, req: Any) -> int:
    """A request's tokens: announced, or the prefill engine's blocks of its first token group
    that the request lists are full."""
    if req.num_tokens:
        return int(req.num_tokens)
    ids = req.block_ids if isinstance(req.block_ids, dict) else {remote.groups[0].name: req.block_ids}
    group = next((g for g in remote.groups if g.tokens and ids.get(g.name)), None)
    if group is None:
        raise ConfigError(f"request {req.request_id!r} announces no token blocks and no num_tokens")
    return len(ids[group.name]) * group.block_size


async def run_decode(
    a: argparse.Namespace, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Run decode rank ``--tp-rank`` in this process (without it: every rank, in this process);
    returns the JSON summary."""
    from akv.geometry.tensors import allocate_kv_cache
    from akv.runtime.consumer import Consumer, PullRequest

    spec = spec_from_args(a)
    size = a.tp_size
    mine = [a.tp_rank] if a.tp_rank is not None else list(range(size))
    engine_id = a.engine_id or default_engine_id("decode")
    requests = await fetch_requests(a.connect, spec, a.secret, engine_id)
    cache = as_cache(spec)
    stats = {"verified": 0, "bytes": 0}
    failed: list[str] = []
    errors: list[str] = []
    started = time.monotonic()
    caches = {d: allocate_kv_cache(spec, d, size) for d in mine}
    async with AsyncExitStack() as stack:
        consumers = {
            d: await stack.enter_async_context(
                Consumer(
                    caches[d],
                    spec,
                    tp_rank=d,
                    tp_size=size,
                    engine_id=engine_id,
                    secret=a.secret,
                    transfer_timeout=a.transfer_timeout,
                )
            )
            for d in mine
        }
        sessions = {d: await c.connect(a.connect) for d, c in consumers.items()}
        remote = sessions[mine[0]].remote_spec
        if remote is None:  # connect() sets it; a session closed meanwhile has none
            raise ConfigError("the prefill engine went away during the handshake")
        for req in requests:
            for name, n in local_counts(cache, _tokens(remote, req)).items():
                pool = cache.group(name).num_blocks
                check(
                    n <= pool,
                    f"the prefill engine announces requests needing {n} blocks of group {name!r}, more "
                    f"than --blocks {pool}: raise --blocks to at least {n}",
                )
        allocators = {g.name: BlockAllocator(g.num_blocks, seed=a.seed) for g in cache.groups}
        limiter = anyio.CapacityLimiter(max(1, a.concurrency))
        done = 0

        async def pull(d: int, pr: PullRequest, seed: int) -> bool:
            try:
                res = await (await sessions[d].pull(pr))
            except AkvError as exc:
                errors.append(f"{pr.request_id} rank {d}: {type(exc).__name__}: {exc}")
                return False
            stats["bytes"] += res.bytes
            if verify_request(caches[d], spec, d, size, pr.local_block_ids, seed, num_tokens=pr.num_tokens):
                return True
            errors.append(f"{pr.request_id} rank {d}: data mismatch")
            return False

        async def one(i: int, req: Any) -> None:
            nonlocal done
            tokens = _tokens(remote, req)
            full = next((g for g in cache.groups if g.kind in ("full", "mla")), None)
            blocks = -(-tokens // full.block_size) if full is not None else 0
            hit = 1 if i % 3 == 2 and blocks > 1 else 0  # every third request: a partial prefix hit
            counts = local_counts(cache, tokens, hit)
            async with limiter:
                local = {name: await allocators[name].alloc(n) for name, n in counts.items()}
                try:
                    ids: Any = local if len(cache.groups) > 1 else local[cache.groups[0].name]
                    pr = PullRequest(
                        request_id=req.request_id,
                        local_block_ids=ids,
                        remote_block_ids=req.block_ids,
                        num_tokens=tokens,
                    )
                    ok = all([await pull(d, pr, req.seed) for d in mine])
                finally:
                    for name, blocks_ in local.items():
                        allocators[name].release(blocks_)
            if ok:
                stats["verified"] += 1
            else:
                failed.append(req.request_id)
            done += 1
            if progress:
                progress(done, len(requests))

        async with anyio.create_task_group() as tg:
            for i, req in enumerate(requests):
                tg.start_soon(one, i, req)
    seconds = time.monotonic() - started
    summary = {
        "event": "summary",
        "role": "decode",
        "requests": len(requests),
        "verified": stats["verified"],
        "failed": len(failed),
        "bytes": stats["bytes"],
        "seconds": round(seconds, 3),
        "gbps": round(stats["bytes"] / seconds / 1e9, 3) if seconds > 0 else 0.0,
        "tp_size": size,
        "errors": errors[:10],
        "failed_ids": sorted(failed),
    }
    if a.tp_rank is not None:
        summary["tp_rank"] = a.tp_rank
    return summary


async def run_decode_engine(
    a: argparse.Namespace, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Run every rank of the decode engine as its own process (one shared engine id); returns
    the engine's summary, aggregated from the ranks' (today's fields)."""
    engine_id = a.engine_id or default_engine_id("decode")
    done: dict[int, int] = {}

    def on_line(rp: RankProcess, msg: dict[str, Any]) -> None:
        if msg.get("event") == "progress" and progress is not None:
            done[rp.rank] = int(msg["done"])
            if len(done) == a.tp_size:
                progress(min(done.values()), int(msg["total"]))

    async with rank_processes(on_line) as ranks:
        for d in range(a.tp_size):
            # Decode ranks print no ready line: start them all at once (they pull concurrently).
            argv = child_argv(a.argv, "--tp-rank", str(d), "--engine-id", engine_id)
            await ranks.start(d, argv, ready=False)
        await ranks.wait()
    summaries = [rp.summary or {} for rp in ranks.procs]
    codes = [rp.code for rp in ranks.procs]
    if any(code == EXIT_USAGE for code in codes):
        raise ChildFailed(EXIT_USAGE)  # a rank said what to change, on stderr
    requests = max((s.get("requests", 0) for s in summaries), default=0)
    failed = set().union(*(set(s.get("failed_ids", [])) for s in summaries))
    complete = all(s.get("requests") == requests for s in summaries)
    seconds = max((s.get("seconds", 0.0) for s in summaries), default=0.0)
    moved = sum(s.get("bytes", 0) for s in summaries)
    summary: dict[str, Any] = {
        "event": "summary",
        "role": "decode",
        "requests": requests,
        "verified": requests - len(failed) if complete else 0,
        "failed": len(failed) if complete else requests,
        "bytes": moved,
        "seconds": seconds,
        "gbps": round(moved / seconds / 1e9, 3) if seconds > 0 else 0.0,
        "tp_size": a.tp_size,
        "errors": [e for s in summaries for e in s.get("errors", [])][:10],
        "exit_codes": codes,
    }
    errs = [s["error"] for s in summaries if "error" in s]
    if errs:
        summary["error"] = errs[0]
    return summary


def cmd_decode(a: argparse.Namespace) -> int:
    def progress(done: int, total: int) -> None:
        if a.json:
            emit({"event": "progress", "done": done, "total": total})

    validate(a)
    exit_with_parent(a.parent_pid)
    try:
        one_process = a.tp_rank is not None or a.tp_size == 1
        summary = anyio.run(run_decode if one_process else run_decode_engine, a, progress)
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
