"""The ``akv`` command line: ``plan``, ``prefill``, ``decode``, ``demo`` and ``bench``.

This is the only place that configures logging. Machine-readable output goes to stdout as
JSON lines (with ``--json`` the last line is the summary); logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import anyio
import numpy as np

from akv import tp
from akv._log import configure_cli_logging
from akv.errors import AkvError
from akv.spec import KVSpec

__all__ = ["build_parser", "fetch_requests", "main", "spawn_prefill"]

EXIT_OK, EXIT_FAILED, EXIT_EXPIRED, EXIT_USAGE = 0, 1, 3, 64  # 2 is argparse's usage error


def emit(obj: dict[str, Any]) -> None:
    """Write one JSON line to stdout and flush."""
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


# -- shared flags ---------------------------------------------------------------------------


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model shape (must match on both sides)")
    g.add_argument("--kv-heads", type=int, required=True, help="total KV heads of the model")
    g.add_argument("--mla", action="store_true", help="MLA latent cache (replicated on every rank)")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--blocks", type=int, default=256, help="blocks in each rank's pool")
    g.add_argument("--block-size", type=int, default=16, help="tokens per block")
    g.add_argument("--head-dim", type=int, default=64, help="head dim (latent dim for MLA)")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--layout", choices=["HND", "NHD"], default="HND")
    g.add_argument("--joint-kv", action="store_true", help="K and V in one region per layer")


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="JSON lines on stdout, summary last")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logs on stderr")
    p.add_argument("--secret", default=None, help="shared secret (default: $AKV_SECRET)")


def spec_from_args(a: argparse.Namespace) -> KVSpec:
    return KVSpec.create(
        layers=a.layers,
        num_blocks=a.blocks,
        block_size=a.block_size,
        kv_heads=1 if a.mla else a.kv_heads,
        head_dim=a.head_dim,
        dtype=a.dtype,
        kind="mla" if a.mla else "dense",
        layout=a.layout,
        joint_kv=a.joint_kv,
    )


def model_argv(a: argparse.Namespace) -> list[str]:
    argv = [
        "--kv-heads",
        str(a.kv_heads),
        "--layers",
        str(a.layers),
        "--blocks",
        str(a.blocks),
        "--block-size",
        str(a.block_size),
        "--head-dim",
        str(a.head_dim),
        "--dtype",
        a.dtype,
        "--layout",
        a.layout,
    ]
    if a.mla:
        argv.append("--mla")
    if a.joint_kv:
        argv.append("--joint-kv")
    return argv


# -- plan -----------------------------------------------------------------------------------


def _heads(r: range) -> str:
    return f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def cmd_plan(a: argparse.Namespace) -> int:
    P, D, H, mla = a.prefill_tp, a.decode_tp, a.kv_heads, a.mla
    ranks = []
    for d in range(D):
        plan = tp.plan_reads(
            decode_rank=d, decode_tp=D, prefill_tp=P, kv_heads=H, mla=mla, request_key=a.request_key
        )
        ranks.append((d, plan))
    expected = [
        tp.expected_notifications(prefill_rank=p, prefill_tp=P, decode_tp=D, kv_heads=H, mla=mla)
        for p in range(P)
    ]
    if a.json:
        emit(
            {
                "prefill_tp": P,
                "decode_tp": D,
                "kv_heads": H,
                "mla": mla,
                "request_key": a.request_key,
                "decode": [
                    {
                        "rank": d,
                        "reads": [
                            {
                                "remote_rank": r.remote_rank,
                                "local_heads": [r.local_heads.start, r.local_heads.stop],
                                "remote_heads": [r.remote_heads.start, r.remote_heads.stop],
                            }
                            for r in plan.reads
                        ],
                        "notify": list(plan.notify),
                    }
                    for d, plan in ranks
                ],
                "expected_notifications": expected,
            }
        )
        return EXIT_OK
    kind = "MLA (latent cache replicated on every rank)" if mla else f"{H} KV heads"
    print(f"prefill TP {P} -> decode TP {D}, {kind}, request key {a.request_key}")
    if not mla:
        for p in range(P):
            g = tp.held_heads(p, P, H)
            print(f"  prefill rank {p} holds head{'s' if len(g) > 1 else ''} {_heads(g)}")
    for d, plan in ranks:
        mine = "" if mla else f" (heads {_heads(tp.held_heads(d, D, H))})"
        print(f"decode rank {d}{mine}:")
        for r in plan.reads:
            if mla:
                print(f"  reads the whole latent cache from prefill rank {r.remote_rank}")
            else:
                g = tp.held_heads(r.remote_rank, P, H)
                glob = range(g.start + r.remote_heads.start, g.start + r.remote_heads.stop)
                print(
                    f"  reads global head{'s' if len(glob) > 1 else ''} {_heads(glob)} from prefill rank {r.remote_rank} "
                    f"(its heads {_heads(r.remote_heads)}) into local heads {_heads(r.local_heads)}"
                )
        print(f"  notifies prefill ranks {', '.join(map(str, plan.notify))}")
    print(
        "notifications each prefill rank expects per request: "
        + ", ".join(f"rank {p}: {n}" for p, n in enumerate(expected))
    )
    return EXIT_OK


# -- prefill --------------------------------------------------------------------------------


def make_requests(spec: KVSpec, count: int, per_request: int, seed: int) -> list[Any]:
    """Deterministic requests over distinct, shuffled (fragmented) prefill blocks."""
    from akv.errors import ConfigError
    from akv.wire import RequestInfo

    if count * per_request > spec.num_blocks:
        raise ConfigError(
            f"{count} requests x {per_request} blocks exceed the {spec.num_blocks}-block pool: "
            "raise --blocks or lower --requests/--blocks-per-request"
        )
    order = np.random.default_rng(seed).permutation(spec.num_blocks)
    return [
        RequestInfo(
            request_id=f"req-{seed}-{i}",
            block_ids=order[i * per_request : (i + 1) * per_request].tolist(),
            seed=i + 1,
        )
        for i in range(count)
    ]


def fill_request(
    kv: Sequence[Any], spec: KVSpec, rank: int, size: int, block_ids: Sequence[int], seed: int
) -> None:
    import torch

    from akv.fill import expected_blocks

    idx = torch.as_tensor(list(block_ids))
    for region, t in enumerate(kv):
        view = t.view(torch.uint8).view(spec.num_blocks, -1)
        view[idx] = torch.from_numpy(
            expected_blocks(spec, rank, size, region, seed, np.arange(len(block_ids)))
        )


async def run_prefill(
    a: argparse.Namespace, on_ready: Callable[[dict[str, Any]], None] = emit
) -> dict[str, Any]:
    from akv.control import ControlServer
    from akv.producer import Producer, Release
    from akv.tensors import allocate_kv_cache

    spec = spec_from_args(a)
    requests = make_requests(spec, a.requests, a.blocks_per_request, a.seed)
    per_request: dict[str, list[str]] = {r.request_id: [] for r in requests}

    def on_release(rel: Release) -> None:
        per_request[rel.request_id].append(rel.reason)

    server = ControlServer(
        host=a.host, port=a.port, secret=a.secret, allow_insecure=a.allow_insecure, directory=lambda: requests
    )
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        endpoint = await tg.start(server.serve)
        async with AsyncExitStack() as stack:
            producers = []
            for rank in range(a.tp_size):
                kv = allocate_kv_cache(spec, rank, a.tp_size)
                for req in requests if not a.no_fill else ():
                    fill_request(kv, spec, rank, a.tp_size, req.block_ids, req.seed)
                producers.append(
                    await stack.enter_async_context(
                        Producer(
                            kv,
                            spec,
                            tp_rank=rank,
                            tp_size=a.tp_size,
                            engine_id=a.engine_id,
                            server=server,
                            lease=a.lease,
                            on_release=on_release,
                        )
                    )
                )
            for prod in producers:
                for req in requests:
                    prod.expose(req.request_id, req.block_ids)
            on_ready(
                {
                    "event": "ready",
                    "endpoint": str(endpoint),
                    "tp_size": a.tp_size,
                    "requests": len(requests),
                    "pid": os.getpid(),
                }
            )
            with anyio.move_on_after(a.timeout if a.timeout > 0 else math.inf):
                for prod in producers:
                    await prod.wait_released()
                if a.hold:  # keep serving (benchmarks) until terminated or timed out
                    await anyio.sleep_forever()
            counters: dict[str, int] = {}
            for prod in producers:
                for k, v in prod.metrics.snapshot().counters.items():
                    counters[k] = counters.get(k, 0) + v
        tg.cancel_scope.cancel()
    reasons = list(per_request.values())
    released = sum(1 for r in reasons if len(r) == a.tp_size and all(x == "read" for x in r))
    expired = sum(1 for r in reasons if "expired" in r)
    return {
        "event": "summary",
        "role": "prefill",
        "requests": len(requests),
        "released": released,
        "expired": expired,
        "unreleased": sum(1 for r in reasons if len(r) < a.tp_size),
        "duplicate_releases": sum(1 for r in reasons if len(r) > a.tp_size),
        "tp_size": a.tp_size,
        "seconds": round(time.monotonic() - started, 3),
        "notifications_unknown": counters.get("notifications_unknown", 0),
        "notifications_invalid": counters.get("notifications_invalid", 0),
        "auth_failures": counters.get("auth_failures", 0),
    }


def cmd_prefill(a: argparse.Namespace) -> int:
    summary = anyio.run(run_prefill, a)
    _report(
        a,
        summary,
        f"prefill: {summary['released']}/{summary['requests']} requests released by read, "
        f"{summary['expired']} expired",
    )
    if summary["released"] == summary["requests"]:
        return EXIT_OK
    return EXIT_EXPIRED if summary["expired"] else EXIT_FAILED


def _report(a: argparse.Namespace, summary: dict[str, Any], text: str) -> None:
    if a.json:
        emit(summary)
    else:
        print(text)


def spawn_prefill(*argv: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """Start ``akv prefill ARGV --json`` in another process; returns it and its endpoint.

    For demos, examples, tests and benchmarks. Raises :class:`AkvError` if the process
    exits before printing its ``ready`` line.
    """
    cmd = [sys.executable, "-m", "akv", "prefill", *argv, "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    for line in proc.stdout or ():
        if line.startswith("{"):  # UCX may print its own lines to stdout
            msg = json.loads(line)
            if msg.get("event") == "ready":
                return proc, str(msg["endpoint"])
    raise AkvError(f"akv prefill exited ({proc.wait()}) before it was ready: {' '.join(cmd)}")


# -- decode ---------------------------------------------------------------------------------


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


async def fetch_requests(endpoint: str, spec: KVSpec, secret: str | None, engine_id: str) -> list[Any]:
    """Ask a prefill engine which requests it exposed (the demo's stand-in for a router)."""
    from akv.control import client_handshake, parse_endpoint, resolve_secret
    from akv.wire import Hello

    hello = Hello(
        engine_id=engine_id,
        tp_rank=0,
        tp_size=1,
        spec=spec,
        compat=spec.compat_hash(),
        nonce=secrets.token_bytes(16),
    )
    result = await client_handshake(
        parse_endpoint(endpoint),
        hello,
        secret=resolve_secret(secret),
        choose_ranks=lambda ch: [],
        list_requests=True,
    )
    return list(result.requests or [])


async def run_decode(
    a: argparse.Namespace, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    import torch

    from akv.consumer import Consumer, PullRequest
    from akv.fill import expected_blocks
    from akv.tensors import allocate_kv_cache

    spec = spec_from_args(a)
    engine_id = a.engine_id or f"decode-{uuid.uuid4().hex[:8]}"
    requests = await fetch_requests(a.connect, spec, a.secret, engine_id)
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

        def verify(d: int, local: list[int], seed: int, positions: np.ndarray[Any, Any]) -> bool:
            idx = torch.as_tensor(local)
            for region, t in enumerate(caches[d]):
                got = t.view(torch.uint8).view(spec.num_blocks, -1)[idx].numpy()
                if not np.array_equal(got, expected_blocks(spec, d, a.tp_size, region, seed, positions)):
                    return False
            return True

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
                        ok &= verify(d, local, req.seed, np.arange(hit, n))
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

    try:
        summary = anyio.run(run_decode, a, progress)
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
        _report(a, summary, f"decode failed: {type(exc).__name__}: {exc}")
        return EXIT_FAILED
    _report(
        a,
        summary,
        f"decode: {summary['verified']}/{summary['requests']} requests verified, "
        f"{summary['bytes'] / 1e6:.1f} MB in {summary['seconds']:.2f}s",
    )
    ok = summary["verified"] == summary["requests"] and not summary["failed"]
    return EXIT_OK if ok else EXIT_FAILED


# -- demo -----------------------------------------------------------------------------------


class _Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def update(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        width = 30
        filled = width * done // total
        sys.stderr.write(f"\r  pulling [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def _lines(stream: Any) -> Any:
    from anyio.streams.buffered import BufferedByteReceiveStream

    buf = BufferedByteReceiveStream(stream)
    while True:
        try:
            line = await buf.receive_until(b"\n", 1 << 20)
        except (anyio.IncompleteRead, anyio.EndOfStream):
            return
        text = line.decode(errors="replace").strip()
        if text.startswith("{"):  # UCX may print its own log lines to stdout
            yield text


async def run_demo(a: argparse.Namespace) -> tuple[dict[str, Any], int]:
    env = dict(os.environ)
    env.setdefault("AKV_SECRET", a.secret or secrets.token_hex(16))  # the demo authenticates its peers
    env["NIXL_LOG_LEVEL"] = env.get("NIXL_LOG_LEVEL", "WARN")
    py = [sys.executable, "-m", "akv"]
    model = model_argv(a)
    prefill_cmd = [
        *py,
        "prefill",
        "--tp-size",
        str(a.prefill_tp),
        "--requests",
        str(a.requests),
        "--blocks-per-request",
        str(a.blocks_per_request),
        "--port",
        "0",
        "--lease",
        str(a.lease),
        "--timeout",
        str(a.timeout),
        "--json",
        *model,
    ]
    bar = _Progress(sys.stderr.isatty() and not a.json)
    started = time.monotonic()
    prefill_summary: dict[str, Any] = {}
    decode_summary: dict[str, Any] = {}
    codes: dict[str, int | None] = {}
    with anyio.move_on_after(a.timeout) as scope:
        async with await anyio.open_process(prefill_cmd, env=env, stderr=None) as prefill:
            endpoint = None
            lines = _lines(prefill.stdout)
            async for line in lines:
                msg = json.loads(line)
                if msg.get("event") == "ready":
                    endpoint = msg["endpoint"]
                    break
            if endpoint is None:
                await prefill.wait()
                return {"event": "summary", "error": "prefill exited before it was ready"}, EXIT_FAILED
            decode_cmd = [
                *py,
                "decode",
                "--connect",
                endpoint,
                "--tp-size",
                str(a.decode_tp),
                "--json",
                "--concurrency",
                str(a.concurrency),
                *model,
            ]
            async with await anyio.open_process(decode_cmd, env=env, stderr=None) as decode:
                async for line in _lines(decode.stdout):
                    msg = json.loads(line)
                    if msg.get("event") == "progress":
                        bar.update(msg["done"], msg["total"])
                    elif msg.get("event") == "summary":
                        decode_summary = msg
                codes["decode"] = await decode.wait()
            bar.close()
            if codes["decode"] != 0:
                prefill.terminate()  # nothing will read the rest: do not wait for the leases
            async for line in lines:
                msg = json.loads(line)
                if msg.get("event") == "summary":
                    prefill_summary = msg
            codes["prefill"] = await prefill.wait()
    if scope.cancelled_caught:
        return {"event": "summary", "error": f"demo timed out after {a.timeout}s"}, EXIT_FAILED
    seconds = time.monotonic() - started
    summary = {
        "event": "summary",
        "prefill_tp": a.prefill_tp,
        "decode_tp": a.decode_tp,
        "kv_heads": a.kv_heads,
        "mla": a.mla,
        "requests": decode_summary.get("requests", 0),
        "verified": decode_summary.get("verified", 0),
        "failed": decode_summary.get("failed", 0),
        "released": prefill_summary.get("released", 0),
        "expired": prefill_summary.get("expired", 0),
        "bytes": decode_summary.get("bytes", 0),
        "seconds": round(seconds, 3),
        "transfer_seconds": decode_summary.get("seconds", 0.0),
        "exit_codes": codes,
    }
    if decode_summary.get("error") or decode_summary.get("errors"):
        summary["errors"] = decode_summary.get("errors") or [decode_summary.get("error")]
    ok = (
        summary["requests"] == a.requests
        and summary["verified"] == a.requests
        and not summary["failed"]
        and summary["released"] == a.requests
        and not summary["expired"]
    )
    return summary, EXIT_OK if ok else EXIT_FAILED


def cmd_demo(a: argparse.Namespace) -> int:
    summary, code = anyio.run(run_demo, a)
    if a.json:
        emit(summary)
    else:
        kind = "MLA" if a.mla else f"{a.kv_heads} KV heads"
        status = "OK" if code == EXIT_OK else "FAILED"
        print(f"akv demo: prefill TP {a.prefill_tp} -> decode TP {a.decode_tp}, {kind}: {status}")
        print(
            f"  {summary.get('verified', 0)}/{summary.get('requests', 0)} requests verified bit-exact, "
            f"{summary.get('released', 0)} released by read, {summary.get('expired', 0)} expired, "
            f"{summary.get('failed', 0)} failed"
        )
        print(
            f"  {summary.get('bytes', 0) / 1e6:.1f} MB pulled in {summary.get('transfer_seconds', 0):.2f}s "
            f"(whole run {summary.get('seconds', 0):.2f}s)"
        )
        for err in summary.get("errors", []) or ([summary["error"]] if "error" in summary else []):
            print(f"  error: {err}")
    return code


# -- parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="akv", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="print which decode rank reads which heads from which prefill rank")
    p.add_argument("--prefill-tp", type=int, required=True)
    p.add_argument("--decode-tp", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--mla", action="store_true")
    p.add_argument("--request-key", type=int, default=0, help="request key (picks among replicas)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("prefill", help="run P prefill ranks that expose deterministic requests")
    p.add_argument("--tp-size", type=int, required=True)
    add_model_flags(p)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--blocks-per-request", type=int, default=8)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--lease", type=float, default=60.0, help="seconds before unread blocks are released")
    p.add_argument("--timeout", type=float, default=0.0, help="give up after this many seconds (0: never)")
    p.add_argument("--engine-id", default="prefill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hold", action="store_true", help="keep serving after every request is released")
    p.add_argument("--no-fill", action="store_true", help="leave the cache zeroed (benchmarks)")
    p.add_argument(
        "--allow-insecure",
        action="store_true",
        help="serve a non-loopback address without a secret (trusted networks only)",
    )
    add_common(p)
    p.set_defaults(func=cmd_prefill)

    p = sub.add_parser("decode", help="run D decode ranks that pull and verify every announced request")
    p.add_argument("--connect", required=True, metavar="HOST:PORT")
    p.add_argument("--tp-size", type=int, required=True)
    add_model_flags(p)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--engine-id", default=None)
    p.add_argument("--seed", type=int, default=0)
    add_common(p)
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser("demo", help="run prefill and decode as separate processes and verify every byte")
    p.add_argument("--prefill-tp", type=int, default=2)
    p.add_argument("--decode-tp", type=int, default=4)
    add_model_flags(p)
    p.set_defaults(kv_heads=8)
    for action in p._actions:
        if action.dest == "kv_heads":
            action.required = False
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--blocks-per-request", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--lease", type=float, default=60.0)
    p.add_argument("--timeout", type=float, default=300.0)
    add_common(p)
    p.set_defaults(func=cmd_demo)

    from akv.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    verbose = getattr(a, "verbose", 0)
    configure_cli_logging(logging.WARNING - 10 * min(verbose, 2))
    try:
        code: int = a.func(a)
    except AkvError as exc:
        print(f"akv {a.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED if not isinstance(exc, ValueError) else EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return code
