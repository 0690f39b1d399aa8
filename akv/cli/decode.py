"""``akv decode``: decode ranks pulling and verifying every announced request, one process
per rank (``--tp-rank R`` runs one; without it the command starts one process per rank)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import numpy as np

from akv._log import get_logger
from akv.cli.args import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    check_model,
    check_seconds,
    emit,
    report,
    spec_from_args,
    tls_from_args,
)
from akv.cli.fanout import (
    ChildFailed,
    RankProcess,
    child_argv,
    exit_status,
    exit_with_parent,
    rank_processes,
)
from akv.errors import (
    AkvError,
    ConfigError,
    HandshakeError,
    TransferError,
    TransferTimeout,
    UnsafeReadError,
)
from akv.geometry.cache import CacheSpec, as_cache
from akv.options import check, check_transfer_flags, device_of, rank_device, use_gpu_environment
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
    a.tls = tls_from_args(a, serve=False, connect=True)
    check_model(a, "--tp-size")
    check_transfer_flags(a)
    device_of(a)  # checked before any I/O
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


def _peer_lost(exc: AkvError) -> bool:
    """A failure that every later pull needing that prefill rank would meet too: the rank is
    gone (its reads failed) or cannot be handshaken again. A timeout (maybe only slow) or a
    failed exposure check (the link is fine) concerns one request."""
    if isinstance(exc, HandshakeError):
        return True
    return isinstance(exc, TransferError) and not isinstance(exc, (TransferTimeout, UnsafeReadError))


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
    from akv.runtime.consumer import Consumer
    from akv.runtime.transfer import PullRequest

    spec = spec_from_args(a)
    size = a.tp_size
    mine = [a.tp_rank] if a.tp_rank is not None else list(range(size))
    log = get_logger("akv.cli.decode")
    engine_id = a.engine_id or default_engine_id("decode")
    requests = await fetch_requests(a.connect, spec, a.secret, engine_id, getattr(a, "tls", None))
    cache = as_cache(spec)
    stats = {"verified": 0, "bytes": 0, "descriptors": 0}
    failed: list[str] = []
    errors: list[str] = []
    started = time.monotonic()
    caches = {d: allocate_kv_cache(spec, d, size, device=rank_device(device_of(a), d)) for d in mine}
    paths: dict[str, int] = {}
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
                    tls=getattr(a, "tls", None),
                    mode=a.mode,
                    transfer=a.transfer,
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
        verified: set[str] = set()
        lost: list[str] = []

        async def pull(d: int, pr: PullRequest, seed: int, used: set[str]) -> bool:
            try:
                res = await (await sessions[d].pull(pr))
            except AkvError as exc:
                why = f"{type(exc).__name__}: {exc}"
                errors.append(f"{pr.request_id} rank {d}: {why}")
                if _peer_lost(exc):
                    if not lost:
                        # A lost prefill rank fails every pull that needs it: stop now, in one line,
                        # rather than fail the rest one re-handshake at a time.
                        lost.append(why)
                        log.error(
                            "prefill engine lost: the requests not pulled yet fail",
                            decode_rank=d,
                            request=pr.request_id,
                            error=why,
                            remaining=len(requests) - len(verified) - len(failed),
                        )
                    tg.cancel_scope.cancel()
                else:
                    log.warning("pull failed", decode_rank=d, request=pr.request_id, error=why)
                return False
            stats["bytes"] += res.bytes
            stats["descriptors"] += res.descriptors
            used.add(res.path)
            if verify_request(caches[d], spec, d, size, pr.local_block_ids, seed, num_tokens=pr.num_tokens):
                log.debug(
                    "request verified",
                    decode_rank=d,
                    request=pr.request_id,
                    bytes=res.bytes,
                    reads=res.reads,
                    seconds=round(res.seconds, 6),
                )
                return True
            errors.append(f"{pr.request_id} rank {d}: data mismatch")
            log.warning("pulled data does not match", decode_rank=d, request=pr.request_id)
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
                        generation=req.generation,  # bound to the exposure prefill announced
                    )
                    used: set[str] = set()
                    ok = all([await pull(d, pr, req.seed, used) for d in mine])
                    for path in used:  # requests per path
                        paths[path] = paths.get(path, 0) + 1
                finally:
                    for name, blocks_ in local.items():
                        allocators[name].release(blocks_)
            if ok:
                verified.add(req.request_id)
            else:
                failed.append(req.request_id)
            done += 1
            if progress:
                progress(done, len(requests))

        async with anyio.create_task_group() as tg:
            for i, req in enumerate(requests):
                tg.start_soon(one, i, req)
        stats["verified"] = len(verified)
        # After a lost peer, the requests cancelled in flight or never started fail too.
        failed = sorted({r.request_id for r in requests} - verified)
        if lost:
            errors.insert(0, f"a prefill rank was lost, the rest not pulled: {lost[0]}")
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
        "paths": paths,
        "descriptors": stats["descriptors"],
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
    for rp in ranks.procs:  # whichever rank failed, say which and why
        if rp.code != 0:
            print(
                f"akv decode: rank {rp.rank} failed ({exit_status(rp.code)}): {_why(rp.summary)}",
                file=sys.stderr,
            )
    requests = max((s.get("requests", 0) for s in summaries), default=0)
    failed = set().union(*(set(s.get("failed_ids", [])) for s in summaries))
    complete = all(s.get("requests") == requests for s in summaries)
    seconds = max((s.get("seconds", 0.0) for s in summaries), default=0.0)
    moved = sum(s.get("bytes", 0) for s in summaries)
    paths: dict[str, int] = {}
    for s in summaries:
        for path, n in s.get("paths", {}).items():  # requests per path: each rank saw them all
            paths[path] = max(paths.get(path, 0), n)
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
        "paths": paths,
        "descriptors": sum(s.get("descriptors", 0) for s in summaries),
        "errors": [e for s in summaries for e in s.get("errors", [])][:10],
        "exit_codes": codes,
        "failed_ranks": [rp.rank for rp in ranks.procs if rp.code != 0],
    }
    errs = [s["error"] for s in summaries if "error" in s]
    if errs:
        summary["error"] = errs[0]
    return summary


def _why(summary: dict[str, Any] | None) -> str:
    """A rank's failure in words, from its summary (or its absence)."""
    if summary is None:
        return "it printed no summary"
    if summary.get("error"):
        return str(summary["error"])
    first = (summary.get("errors") or ["no error recorded"])[0]
    return f"{summary.get('failed', 0)}/{summary.get('requests', 0)} requests failed; {first}"


def cmd_decode(a: argparse.Namespace) -> int:
    def progress(done: int, total: int) -> None:
        if a.json:
            emit({"event": "progress", "done": done, "total": total})

    validate(a)
    use_gpu_environment(device_of(a))
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
        if a.parent_pid is None:  # a rank process's parent says it, naming the rank
            print(f"akv decode{_rank(a)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    report(
        a,
        summary,
        f"decode: {summary['verified']}/{summary['requests']} requests verified, "
        f"{summary['bytes'] / 1e6:.1f} MB in {summary['seconds']:.2f}s",
    )
    ok = (
        summary["verified"] == summary["requests"]
        and not summary["failed"]
        and not summary.get("failed_ranks")
    )
    if not ok and a.parent_pid is None and "failed_ranks" not in summary:
        print(f"akv decode{_rank(a)}: {_why(summary)}", file=sys.stderr)
    return EXIT_OK if ok else EXIT_FAILED


def _rank(a: argparse.Namespace) -> str:
    return f" rank {a.tp_rank}" if a.tp_rank is not None and a.tp_size > 1 else ""
