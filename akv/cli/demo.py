"""``akv demo``: prefill and decode as separate processes, every byte verified."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile
import time
from typing import Any

import anyio
from anyio.abc import Process

from akv.cli.args import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    check_model,
    check_seconds,
    described_by,
    emit,
    model_argv,
    size_pool,
    spec_from_args,
    tls_from_args,
    verbosity_argv,
)
from akv.cli.fanout import Interrupted
from akv.errors import ConfigError, IncompatiblePeerError
from akv.geometry.cache import as_cache, check_peer
from akv.options import check, check_mode, check_transfer_flags, device_of, use_gpu_environment
from akv.testing import EtcdServer, ProgressBar, ajson_lines, etcd_binary

__all__ = ["cmd_demo", "run_demo", "validate"]


def validate(a: argparse.Namespace) -> None:
    """Every flag of ``akv demo``, before starting anything; sizes ``--blocks`` if not given."""
    check(a.secret != "", "--secret is empty: give a non-empty shared secret, or leave it out")
    tls_from_args(a, serve=True, connect=True, why=" (the demo's decode verifies its prefill)")
    check_model(a, "--prefill-tp", "--decode-tp")
    check_transfer_flags(a)
    a.devices = {side: device_of(a, side) for side in ("prefill", "decode")}
    for flag, value in (
        ("--prefill-block-size", a.prefill_block_size),
        ("--decode-block-size", a.decode_block_size),
    ):
        check(value is None or value >= 1, f"{flag} must be >= 1, got {value}")
    prefill = spec_from_args(a, layout=a.prefill_layout, block_size=a.prefill_block_size)
    decode = spec_from_args(a, layout=a.decode_layout, block_size=a.decode_block_size)
    try:
        check_peer(as_cache(decode), as_cache(prefill))
    except IncompatiblePeerError:
        pairs = zip(as_cache(prefill).groups, as_cache(decode).groups, strict=True)
        bad = next(
            f"{p.block_size} and {d.block_size}"
            for p, d in pairs
            if p.block_size % d.block_size and d.block_size % p.block_size
        )
        raise ConfigError(
            f"--prefill-block-size and --decode-block-size ({bad}) must be multiples of each other"
        ) from None
    size_pool(a)
    check(a.concurrency >= 1, f"--concurrency must be >= 1, got {a.concurrency}")
    check_seconds(a.lease, "--lease")
    check_seconds(a.timeout, "--timeout")
    check_mode(a)
    check(
        not a.etcd or etcd_binary() is not None,
        "--etcd needs an etcd binary: run bash scripts/setup.sh (installs etcd-server) or set AKV_ETCD",
    )


async def run_demo(a: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """Run the demo; SIGTERM or SIGINT stops both commands (and so every rank) within a few
    seconds and raises [`Interrupted`][akv.cli.fanout.Interrupted]."""
    procs: list[Process] = []
    signalled: list[int] = []

    async def stop_on_signal() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:  # the receiver stays open: a second signal changes nothing
                if signalled:
                    continue
                signalled.append(int(signum))
                for proc in procs:  # each stops its rank processes
                    if proc.returncode is None:
                        proc.terminate()
                with anyio.move_on_after(5):
                    for proc in procs:
                        await proc.wait()
                for proc in procs:  # still there: no more waiting (their ranks exit with their parent)
                    if proc.returncode is None:
                        proc.kill()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_on_signal)
        result = await _run_demo_etcd(a, procs)
        tg.cancel_scope.cancel()
    if signalled:
        raise Interrupted(signalled[0])
    return result


async def _run_demo_etcd(a: argparse.Namespace, procs: list[Process]) -> tuple[dict[str, Any], int]:
    if not a.etcd:
        return await _run_demo(a, [], None, procs)
    with tempfile.TemporaryDirectory(prefix="akv-demo-etcd-") as data:
        server = EtcdServer(data)  # a local etcd for this demo only
        await anyio.to_thread.run_sync(server.start)
        try:
            engine = f"demo-{secrets.token_hex(4)}"
            return await _run_demo(
                a,
                ["--etcd", server.endpoint, "--engine-id", engine],
                f"etcd://{server.endpoint}/{engine}",
                procs,
            )
        finally:
            await anyio.to_thread.run_sync(server.stop)


async def _run_demo(
    a: argparse.Namespace, prefill_extra: list[str], connect: str | None, procs: list[Process]
) -> tuple[dict[str, Any], int]:
    env = dict(os.environ)
    env.setdefault("AKV_SECRET", a.secret or secrets.token_hex(16))  # the demo authenticates its peers
    env["NIXL_LOG_LEVEL"] = env.get("NIXL_LOG_LEVEL", "WARN")
    py = [sys.executable, "-m", "akv"]
    with_parent = ["--parent-pid", str(os.getpid())]  # if this process is killed, they stop too
    prefill_model = [
        *model_argv(a, layout=a.prefill_layout, block_size=a.prefill_block_size),
        *verbosity_argv(a),
    ]
    decode_model = [
        *model_argv(a, layout=a.decode_layout, block_size=a.decode_block_size),
        *verbosity_argv(a),
    ]
    tls = [  # both sides use the same certificate (a client certificate too, when --tls-ca is given)
        arg
        for flag in ("cert", "key", "ca")
        if getattr(a, f"tls_{flag}")
        for arg in (f"--tls-{flag}", getattr(a, f"tls_{flag}"))
    ]
    prefill_model += tls
    decode_model += tls
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
        "--device",
        str(a.devices["prefill"]),
        "--transfer",
        a.transfer,
        "--pack-pool-mib",
        str(a.pack_pool_mib),
        *prefill_model,
        *prefill_extra,
        *(["--mode", "push", "--layer-ms", str(a.layer_ms)] if a.mode == "push" else []),
        *with_parent,
    ]
    bar = ProgressBar(sys.stderr.isatty() and not a.json)
    started = time.monotonic()
    prefill_summary: dict[str, Any] = {}
    decode_summary: dict[str, Any] = {}
    codes: dict[str, int | None] = {}
    with anyio.move_on_after(a.timeout) as scope:
        async with await anyio.open_process(prefill_cmd, env=env, stderr=None) as prefill:
            procs.append(prefill)
            endpoint = None
            lines = ajson_lines(prefill.stdout)
            async for msg in lines:
                if msg.get("event") == "ready":
                    endpoint = msg["endpoint"]
                    break
            if endpoint is None:
                code = await prefill.wait()
                error = {"event": "summary", "error": f"prefill exited ({code}) before it was ready"}
                return error, EXIT_USAGE if code == EXIT_USAGE else EXIT_FAILED
            decode_cmd = [
                *py,
                "decode",
                "--connect",
                connect or endpoint,
                "--tp-size",
                str(a.decode_tp),
                "--json",
                "--concurrency",
                str(a.concurrency),
                "--device",
                str(a.devices["decode"]),
                "--transfer",
                a.transfer,
                *decode_model,
                "--mode",
                a.mode,
                *with_parent,
            ]
            async with await anyio.open_process(decode_cmd, env=env, stderr=None) as decode:
                procs.append(decode)
                async for msg in ajson_lines(decode.stdout):
                    if msg.get("event") == "progress":
                        bar.update(msg["done"], msg["total"])
                    elif msg.get("event") == "summary":
                        decode_summary = msg
                codes["decode"] = await decode.wait()
            bar.close()
            if codes["decode"] != 0:
                prefill.terminate()  # nothing will read the rest: do not wait for the leases
            async for msg in lines:
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
        "kv_heads": None if described_by(a) else 1 if a.mla else a.kv_heads,
        "mla": a.mla,
        "model": a.preset or a.config or a.hf_config or ("mla" if a.mla else "dense"),
        "prefill_layout": a.prefill_layout or a.layout or "HND",
        "decode_layout": a.decode_layout or a.layout or "HND",
        "requests": decode_summary.get("requests", 0),
        "verified": decode_summary.get("verified", 0),
        "failed": decode_summary.get("failed", 0),
        "released": prefill_summary.get("released", 0),
        "expired": prefill_summary.get("expired", 0),
        "bytes": decode_summary.get("bytes", 0),
        "paths": decode_summary.get("paths", {}),
        "descriptors": decode_summary.get("descriptors", 0),
        "devices": {side: str(d) for side, d in a.devices.items()},
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
    validate(a)
    for device in a.devices.values():
        use_gpu_environment(device)
    summary, code = anyio.run(run_demo, a)
    if a.json:
        emit(summary)
    elif code == EXIT_USAGE:
        pass  # the child said what to change, in one line on stderr
    else:
        kind = a.preset or a.config or a.hf_config or ("MLA" if a.mla else f"{a.kv_heads} KV heads")
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
