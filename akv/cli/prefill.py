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

from akv.cli.args import (
    EXIT_EXPIRED,
    EXIT_FAILED,
    EXIT_OK,
    check,
    check_model,
    check_port,
    check_seconds,
    emit,
    report,
    size_pool,
    spec_from_args,
)
from akv.errors import ConfigError
from akv.protocol.address import is_loopback
from akv.protocol.handshake import SECRET_ENV, resolve_secret
from akv.testing import fill_request, load_requests, make_requests

__all__ = ["cmd_prefill", "run_prefill", "validate"]


def validate(a: argparse.Namespace) -> None:
    """Every flag of ``akv prefill``, before any I/O ([`ConfigError`][akv.errors.ConfigError] naming the flag)."""
    check_model(a, "--tp-size")
    size_pool(a)
    check_port(a.port)
    check_seconds(a.lease, "--lease")
    check_seconds(a.timeout, "--timeout", zero_ok=True)
    check(bool(a.engine_id), "--engine-id must not be empty")
    check(
        is_loopback(a.host) or a.allow_insecure or resolve_secret(a.secret) is not None,
        f"refusing to serve KV metadata on non-loopback --host {a.host} without a secret: "
        f"set {SECRET_ENV} or --secret, or pass --allow-insecure on a trusted network",
    )


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
        try:
            endpoint = await tg.start(server.serve)
        except OSError as exc:  # port in use, an address not of this machine, an unknown name
            raise ConfigError(
                f"cannot listen on --host {a.host} --port {a.port}: {exc.strerror or exc}: "
                "choose a free --port (0 picks one) and an address of this machine"
            ) from None
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
    validate(a)
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
