"""``akv prefill``: prefill ranks exposing deterministic requests."""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio

from akv.cli.args import EXIT_EXPIRED, EXIT_FAILED, EXIT_OK, emit, report, spec_from_args
from akv.testing import fill_request, load_requests, make_requests

__all__ = ["cmd_prefill", "run_prefill"]


async def run_prefill(
    a: argparse.Namespace, on_ready: Callable[[dict[str, Any]], None] = emit
) -> dict[str, Any]:
    from akv.geometry.tensors import allocate_kv_cache
    from akv.runtime.control import ControlServer
    from akv.runtime.producer import Producer, Release

    spec = spec_from_args(a)
    if a.requests_file:
        requests = load_requests(a.requests_file)
    else:
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
    report(
        a,
        summary,
        f"prefill: {summary['released']}/{summary['requests']} requests released by read, "
        f"{summary['expired']} expired",
    )
    if summary["released"] == summary["requests"]:
        return EXIT_OK
    return EXIT_EXPIRED if summary["expired"] else EXIT_FAILED
