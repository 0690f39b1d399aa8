"""``akv prefill``: prefill ranks exposing deterministic requests, one process per rank.

With ``--tp-rank R`` this process runs rank R (its own control endpoint; ranks > 0 register
with rank 0 through ``--bootstrap``); without it, the command starts one such process per
rank and aggregates their summaries."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from akv._log import get_logger
from akv.cli.args import (
    EXIT_EXPIRED,
    EXIT_FAILED,
    EXIT_OK,
    check_model,
    check_port,
    check_seconds,
    emit,
    report,
    size_pool,
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
from akv.errors import ConfigError
from akv.options import check, check_mode, check_transfer_flags, device_of, rank_device, use_gpu_environment
from akv.protocol.address import check_engine_id, is_loopback, parse_endpoint, parse_engine_address
from akv.protocol.handshake import SECRET_ENV, resolve_secret
from akv.protocol.messages import RequestInfo
from akv.testing import fill_request, load_requests, make_requests

__all__ = ["cmd_prefill", "run_prefill", "run_prefill_engine", "validate"]


def validate(a: argparse.Namespace) -> None:
    """Every flag of ``akv prefill``, before any I/O ([`ConfigError`][akv.errors.ConfigError] naming the flag)."""
    check(a.secret != "", "--secret is empty: give a non-empty shared secret, or leave it out")
    a.tls = tls_from_args(
        a,
        serve=True,
        connect=a.tp_size > 1 or a.bootstrap is not None,
        why=" (ranks > 0 register with rank 0 over TLS)",
    )
    check_model(a, "--tp-size")
    device_of(a)  # checked before any I/O
    check_transfer_flags(a)
    size_pool(a)
    check_port(a.port)
    check_seconds(a.lease, "--lease")
    check_seconds(a.timeout, "--timeout", zero_ok=True)
    check_seconds(a.etcd_ttl, "--etcd-ttl")
    check_mode(a)
    check(bool(a.engine_id), "--engine-id must not be empty")
    check_engine_id(a.engine_id)
    check(
        is_loopback(a.host) or a.allow_insecure or resolve_secret(a.secret) is not None,
        f"refusing to serve KV metadata on non-loopback --host {a.host} without a secret: "
        f"set {SECRET_ENV} or --secret, or pass --allow-insecure on a trusted network",
    )
    wildcards = ("0.0.0.0", "::", "[::]", "")
    check(
        a.host not in wildcards or a.advertise_host is not None,
        f"--host {a.host or repr(a.host)} binds every interface, and peers cannot connect to it: give "
        "--advertise-host H, the address other ranks and decode engines reach this host at",
    )
    check(
        a.advertise_host not in wildcards,
        f"--advertise-host {a.advertise_host or repr(a.advertise_host)} is not an address peers can "
        "reach: give this host's routable address",
    )
    if a.tp_rank is not None:
        check(
            0 <= a.tp_rank < a.tp_size,
            f"--tp-rank {a.tp_rank} is outside [0, --tp-size {a.tp_size})",
        )
        check(
            a.tp_rank == 0 or a.bootstrap is not None or a.etcd is not None,
            f"--tp-rank {a.tp_rank} needs --bootstrap HOST:PORT (rank 0's endpoint) or --etcd HOST:PORT",
        )
    check(
        a.bootstrap is None or a.tp_rank not in (None, 0),
        "--bootstrap is for ranks > 0 started with --tp-rank: rank 0 is the bootstrap",
    )
    if a.bootstrap is not None:
        try:
            parse_endpoint(a.bootstrap)
        except ConfigError:
            raise ConfigError(f"--bootstrap {a.bootstrap!r} is not HOST:PORT (rank 0's endpoint)") from None
    if a.etcd is not None:
        try:
            parse_engine_address(f"etcd://{a.etcd}/{a.engine_id}")
        except ConfigError:
            raise ConfigError(f"--etcd {a.etcd!r} is not HOST:PORT[,HOST:PORT...]") from None


def announced_generation(engine_id: str, seed: int, request_id: str) -> int:
    """The exposure generation every rank of a command-line engine gives a request: the same
    on each rank (they share --engine-id and --seed), in ``[1, 2**31)``."""
    digest = hashlib.sha256(f"{engine_id}/{seed}/{request_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % (2**31 - 1) + 1


def _requests(a: argparse.Namespace, spec: Any) -> list[RequestInfo]:
    if a.requests_file:
        return load_requests(a.requests_file)
    return make_requests(spec, a.requests, a.blocks_per_request, a.seed)


async def run_prefill(
    a: argparse.Namespace, on_ready: Callable[[dict[str, Any]], None] = emit
) -> dict[str, Any]:
    """Run one prefill rank (``--tp-rank``) in this process; returns its JSON summary."""
    from akv.geometry.tensors import allocate_kv_cache
    from akv.runtime.control import ControlServer
    from akv.runtime.producer import Producer, Release

    spec = spec_from_args(a)
    requests = _requests(a, spec)
    rank, size = a.tp_rank, a.tp_size
    reasons: dict[str, list[str]] = {r.request_id: [] for r in requests}

    log = get_logger("akv.cli.prefill")

    def on_release(rel: Release) -> None:
        reasons[rel.request_id].append(rel.reason)
        log.debug("request released", tp_rank=rank, request=rel.request_id, reason=rel.reason)

    server = ControlServer(
        host=a.host,
        port=a.port,
        secret=a.secret,
        allow_insecure=a.allow_insecure,
        directory=lambda: requests,
        advertise_host=a.advertise_host,
        tls=getattr(a, "tls", None),
    )
    kv = allocate_kv_cache(spec, rank, size, device=rank_device(device_of(a), rank))
    for req in requests if not a.no_fill else ():
        fill_request(kv, spec, rank, size, req.block_ids, req.seed, req.num_tokens or None)
    producer = Producer(
        kv,
        spec,
        tp_rank=rank,
        tp_size=size,
        engine_id=a.engine_id,
        server=server,
        lease=a.lease,
        on_release=on_release,
        bootstrap=a.bootstrap,
        etcd=a.etcd,
        etcd_ttl=a.etcd_ttl,
        max_exposed=max(16384, 2 * len(requests)),
        tls=getattr(a, "tls", None),
        modes=("pull", "push") if a.mode is None else (a.mode,),
        transfer=a.transfer,
        pack_pool_bytes=a.pack_pool_mib << 20,
    )
    streaming = a.layer_ms > 0
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        try:
            endpoint = await tg.start(server.serve)
        except OSError as exc:  # port in use, an address not of this machine, an unknown name
            raise ConfigError(
                f"cannot listen on --host {a.host} --port {a.port}: {exc.strerror or exc}: "
                "choose a free --port (0 picks one) and an address of this machine"
            ) from None
        async with producer:
            # Every rank exposes a request under one generation, announced to decode, which
            # binds its pulls to it (ReexposedError if the request was exposed again).
            requests[:] = [
                msgspec.structs.replace(
                    req, generation=announced_generation(a.engine_id, a.seed, req.request_id)
                )
                for req in requests
            ]
            for req in requests:
                producer.expose(
                    req.request_id,
                    req.block_ids,
                    generation=req.generation,
                    layers_ready=0 if streaming else None,
                )
            if streaming:
                tg.start_soon(_compute_layers, producer, [r.request_id for r in requests], a.layer_ms)
            ready = {
                "event": "ready",
                "endpoint": str(endpoint),
                "tp_rank": rank,
                "tp_size": size,
                "requests": len(requests),
                "pid": os.getpid(),
            }
            if rank == 0:
                ready["engine"] = f"etcd://{a.etcd}/{a.engine_id}" if a.etcd else str(endpoint)
            on_ready(ready)
            with anyio.move_on_after(a.timeout if a.timeout > 0 else math.inf) as serving:
                tg.start_soon(_cancel_on_signal, serving)
                await producer.wait_released()
                if a.hold or a.until_terminated:
                    # Keep serving: benchmarks (--hold), or rank 0 of an engine whose other ranks
                    # still need the bootstrap (the parent stops every rank once all released).
                    on_ready({"event": "released", "tp_rank": rank})
                    await anyio.sleep_forever()
            counters = producer.metrics.snapshot().counters
        tg.cancel_scope.cancel()
    outcome = list(reasons.values())
    return {
        "event": "summary",
        "role": "prefill",
        "tp_rank": rank,
        "requests": len(requests),
        "released": sum(1 for r in outcome if r in (["read"], ["pushed"])),
        "pushed": sum(1 for r in outcome if r == ["pushed"]),
        "expired": sum(1 for r in outcome if "expired" in r),
        "unreleased": sum(1 for r in outcome if not r),
        "duplicate_releases": sum(1 for r in outcome if len(r) > 1),
        "tp_size": size,
        "seconds": round(time.monotonic() - started, 3),
        "notifications_unknown": counters.get("notifications_unknown", 0),
        "notifications_invalid": counters.get("notifications_invalid", 0),
        "auth_failures": counters.get("auth_failures", 0),
        "released_ids": sorted(rid for rid, r in reasons.items() if r in (["read"], ["pushed"])),
        "expired_ids": sorted(rid for rid, r in reasons.items() if "expired" in r),
        "unreleased_ids": sorted(rid for rid, r in reasons.items() if not r),
    }


async def _compute_layers(producer: Any, request_ids: list[str], layer_ms: float) -> None:
    """Push mode's stand-in for a model: one more layer of every request ready each ``layer_ms``."""
    from akv.errors import UnknownRequestError

    for n in range(1, producer.cache.layers + 1):
        await anyio.sleep(layer_ms / 1000)
        for rid in request_ids:
            with contextlib.suppress(UnknownRequestError):  # released already (lease)
                producer.layers_ready(rid, n)


async def _cancel_on_signal(scope: anyio.CancelScope) -> None:
    """SIGTERM or SIGINT ends serving (the summary is still printed)."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async for _ in received:
            scope.cancel()
            return


async def run_prefill_engine(
    a: argparse.Namespace, on_ready: Callable[[dict[str, Any]], None] = emit
) -> dict[str, Any]:
    """Run every rank of the engine as its own process (rank 0 first: it is the bootstrap; then
    the others at once); returns the engine's summary, aggregated from the ranks' (today's fields)."""
    argv = [*a.argv, "--until-terminated"]
    released_ranks: set[int] = set()
    lost: list[RankProcess] = []

    def on_line(rp: RankProcess, msg: dict[str, Any]) -> None:
        if msg.get("event") == "released":
            released_ranks.add(rp.rank)
            if len(released_ranks) == a.tp_size and not a.hold:
                ranks.terminate()  # every rank released everything: stop them all (they print summaries)

    def on_exit(rp: RankProcess) -> None:
        # A rank that exits unasked without its summary (killed, crashed) is lost: the engine
        # cannot serve its share any more, so stop the others now rather than wait on leases.
        if not rp.stopped and rp.summary is None:
            lost.append(rp)
            ranks.terminate()

    async with rank_processes(on_line, on_exit) as ranks:
        first = await ranks.start(0, child_argv(argv, "--tp-rank", "0"))
        if first.ready is None:
            raise ChildFailed(first.code or EXIT_FAILED)  # the child said why, on stderr
        boot = first.ready["endpoint"]
        # The other ranks need only the bootstrap: start them all at once (one after another,
        # the engine would take P start-ups to be ready, and rank 0's leases would run meanwhile).
        rest = [
            await ranks.start(
                r, child_argv(argv, "--tp-rank", str(r), "--bootstrap", boot, "--port", "0"), ready=False
            )
            for r in range(1, a.tp_size)
        ]
        for rp in rest:
            await rp.started.wait()
            if rp.ready is None:
                raise ChildFailed(rp.code or EXIT_FAILED)
        on_ready(
            {
                "event": "ready",
                "endpoint": first.ready.get("engine", boot),
                "engine": first.ready.get("engine", boot),
                "endpoints": [rp.ready["endpoint"] for rp in ranks.procs if rp.ready],
                "tp_size": a.tp_size,
                "requests": first.ready["requests"],
                "pid": os.getpid(),
            }
        )
        await ranks.wait()
    for rp in lost:
        print(
            f"akv prefill: rank {rp.rank} was lost ({exit_status(rp.code)}); stopped the other ranks",
            file=sys.stderr,
        )
    summaries = [rp.summary or {} for rp in ranks.procs]
    ids: set[str] = {r.request_id for r in _requests(a, spec_from_args(a))}
    released = ids.intersection(*(set(s.get("released_ids", [])) for s in summaries))
    expired: set[str] = set().union(*(set(s.get("expired_ids", [])) for s in summaries))
    unreleased: set[str] = set().union(*(set(s.get("unreleased_ids", ids)) for s in summaries))
    return {
        "event": "summary",
        "role": "prefill",
        "requests": len(ids),
        "released": len(released),
        "pushed": min((s.get("pushed", 0) for s in summaries), default=0),
        "expired": len(expired),
        "unreleased": len(unreleased),
        "duplicate_releases": sum(s.get("duplicate_releases", 0) for s in summaries),
        "tp_size": a.tp_size,
        "seconds": max((s.get("seconds", 0.0) for s in summaries), default=0.0),
        "notifications_unknown": sum(s.get("notifications_unknown", 0) for s in summaries),
        "notifications_invalid": sum(s.get("notifications_invalid", 0) for s in summaries),
        "auth_failures": sum(s.get("auth_failures", 0) for s in summaries),
        "exit_codes": [rp.code for rp in ranks.procs],
        "lost_ranks": [rp.rank for rp in lost],
    }


def cmd_prefill(a: argparse.Namespace) -> int:
    validate(a)
    use_gpu_environment(device_of(a))
    exit_with_parent(a.parent_pid)
    if a.tp_rank is None and a.tp_size == 1:
        a.tp_rank = 0  # an engine of one rank: this process is that rank
    summary = anyio.run(run_prefill if a.tp_rank is not None else run_prefill_engine, a)
    report(
        a,
        summary,
        f"prefill{'' if a.tp_rank is None else f' rank {a.tp_rank}'}: {summary['released']}/"
        f"{summary['requests']} requests released by read{' or push' if summary.get('pushed') else ''}, "
        f"{summary['expired']} expired",
    )
    if summary.get("lost_ranks"):
        return EXIT_FAILED
    if summary["released"] == summary["requests"]:
        return EXIT_OK
    return EXIT_EXPIRED if summary["expired"] else EXIT_FAILED
