"""The ``akv`` command line: ``plan``, ``prefill``, ``decode``, ``demo``, ``engines`` and ``bench``.

This is the only place that configures logging. Machine-readable output goes to stdout as
JSON lines (with ``--json`` the last line is the summary); logs go to stderr.
"""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import argparse
import logging
import sys
from collections.abc import Sequence

from akv._log import configure_cli_logging
from akv.cli.args import (
    EXIT_FAILED,
    EXIT_PIPE,
    EXIT_USAGE,
    add_common,
    add_model_flags,
    add_tls_flags,
    first_leaf,
    usage_error,
)
from akv.cli.decode import cmd_decode
from akv.cli.demo import cmd_demo
from akv.cli.engines import add_engines_parser
from akv.cli.fanout import ChildFailed, Interrupted
from akv.cli.plan import cmd_plan
from akv.cli.prefill import cmd_prefill
from akv.errors import AkvError
from akv.geometry.cache import LAYOUTS
from akv.options import add_device_flag, add_mode_flags, add_transfer_flags

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="akv",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="exit codes: 0 success; 1 a transfer, verification or handshake failed; 2 unknown or "
        "missing options; 3 (prefill) a request was released by lease, not by read; 64 an invalid "
        "configuration (one line on stderr says what to change); 130/143 interrupted by SIGINT/SIGTERM; "
        "141 stdout was closed early",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "plan",
        help="print which decode rank reads which heads from which prefill rank",
        description="Which decode rank reads which heads from which prefill rank, who notifies whom, "
        "and how many notifications each prefill rank expects per request. No I/O.",
    )
    p.add_argument("--prefill-tp", type=int, required=True, metavar="P", help="TP size of the prefill engine")
    p.add_argument("--decode-tp", type=int, required=True, metavar="D", help="TP size of the decode engine")
    p.add_argument(
        "--kv-heads", type=int, metavar="H", help="total KV heads of the model; required unless --mla"
    )
    p.add_argument("--mla", action="store_true", help="MLA latent cache, replicated on every rank")
    p.add_argument(
        "--preset",
        metavar="NAME",
        help="a real model's cache groups (see akv prefill --help); shows every group and component",
    )
    p.add_argument("--config", metavar="FILE.json", help="a cache description in the schema of akv.CacheSpec")
    p.add_argument(
        "--hf-config",
        metavar="FILE.json",
        help="a model's own Hugging Face config.json (see akv prefill --help)",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="with --preset or --hf-config: scale to this many layers"
    )
    p.add_argument(
        "--request-key", type=int, default=0, help="request key, picks among replicas (default: %(default)s)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object; its head ranges are half-open [start, stop), the text's are inclusive",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "prefill",
        help="run prefill ranks that expose deterministic requests (one process per rank)",
        description="Run prefill rank --tp-rank R in this process (its own NIXL agent and control "
        "endpoint), or, without --tp-rank, all P ranks as processes of their own: rank 0 is the "
        "engine's bootstrap, the others register with it. Expose deterministic requests and "
        "report how each was released.",
    )
    p.add_argument("--tp-size", type=int, required=True, metavar="P", help="TP size of this prefill engine")
    p.add_argument(
        "--tp-rank",
        type=int,
        metavar="R",
        help="run only this rank, in this process (default: start one process per rank)",
    )
    p.add_argument(
        "--bootstrap",
        metavar="HOST:PORT",
        help="rank 0's control endpoint, for --tp-rank > 0: register there so the engine is found "
        "through one address",
    )
    p.add_argument(
        "--etcd",
        metavar="HOST:PORT",
        help="also register each rank in etcd under --engine-id (several endpoints: comma-separated)",
    )
    p.add_argument(
        "--etcd-ttl",
        type=float,
        default=5.0,
        help="seconds a dead rank's etcd key outlives it (default: %(default)s)",
    )
    add_model_flags(p, sized=True)
    p.add_argument("--requests", type=int, default=16, help="requests to expose (default: %(default)s)")
    p.add_argument(
        "--blocks-per-request", type=int, default=8, help="blocks of each request (default: %(default)s)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address the control server binds (default: %(default)s)"
    )
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="port of the control server (default: 0, a free port; ranks started for you by "
        "rank 0's process always take a free port)",
    )
    p.add_argument(
        "--advertise-host",
        metavar="H",
        help="the address other ranks and decode engines reach this one at (default: --host; "
        "give it when --host is 0.0.0.0)",
    )
    p.add_argument(
        "--lease",
        type=float,
        default=60.0,
        help="seconds before unread blocks are released (default: %(default)s)",
    )
    p.add_argument(
        "--timeout", type=float, default=0.0, help="give up after this many seconds (default: 0, never)"
    )
    p.add_argument("--engine-id", default="prefill", help="name of this engine (default: %(default)s)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the requests' ids, blocks and contents (default: %(default)s)",
    )
    p.add_argument("--hold", action="store_true", help="keep serving after every request is released")
    # Set for the rank processes an engine's command starts: serve until stopped; exit with it.
    p.add_argument("--until-terminated", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--no-fill", action="store_true", help="leave the cache zeroed (benchmarks)")
    p.add_argument(
        "--requests-file",
        metavar="FILE.json",
        help="expose these requests instead of generated ones: a JSON list of "
        '{"request_id": ..., "block_ids": [...], "seed": N} (benchmarks)',
    )
    p.add_argument(
        "--allow-insecure",
        action="store_true",
        help="serve a non-loopback address without a secret (trusted networks only)",
    )
    add_common(p)
    add_device_flag(p)
    add_tls_flags(p)
    add_mode_flags(p, served=True, layers=True)
    add_transfer_flags(p, "prefill", "direct")
    p.set_defaults(func=cmd_prefill)

    p = sub.add_parser(
        "decode",
        help="run D decode ranks that pull and verify every announced request",
        description="Run the D ranks of a decode engine in this process, pull every request a prefill "
        "engine announces (a partial prefix hit on every third) and verify every byte.",
    )
    p.add_argument(
        "--connect",
        required=True,
        metavar="ENGINE",
        help="the prefill engine: HOST:PORT (its bootstrap, the endpoint of its ready line), "
        "HOST:PORT,HOST:PORT,... (every rank, in rank order) or etcd://HOST:PORT/ENGINE_ID",
    )
    p.add_argument("--tp-size", type=int, required=True, metavar="D", help="TP size of this decode engine")
    p.add_argument(
        "--tp-rank",
        type=int,
        metavar="R",
        help="run only this rank, in this process (default: start one process per rank); needs "
        "--engine-id when --tp-size > 1",
    )
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # rank processes exit with it
    add_model_flags(p)
    p.add_argument(
        "--concurrency", type=int, default=8, help="requests in flight at once (default: %(default)s)"
    )
    p.add_argument(
        "--transfer-timeout",
        type=float,
        default=30.0,
        help="seconds one pull may take before it fails (default: %(default)s)",
    )
    p.add_argument(
        "--engine-id",
        default=None,
        help="name of this engine, the same on each rank (default: decode-<random>)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the local block choice (default: %(default)s)"
    )
    add_common(p)
    add_device_flag(p)
    add_tls_flags(p)
    add_mode_flags(p, auto=True)
    add_transfer_flags(p, "decode", "auto")
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser(
        "demo",
        help="run prefill and decode as separate processes and verify every byte",
        description="Start `akv prefill` and `akv decode` as two processes, authenticated by a random "
        "shared secret; exit 0 only if every request was pulled bit-exact and released by read.",
    )
    p.add_argument(
        "--prefill-tp",
        type=int,
        default=2,
        metavar="P",
        help="TP size of the prefill engine (default: %(default)s)",
    )
    p.add_argument(
        "--decode-tp",
        type=int,
        default=4,
        metavar="D",
        help="TP size of the decode engine (default: %(default)s)",
    )
    add_model_flags(p, sized=True, kv_heads=None, kv_heads_default=8)
    p.add_argument("--requests", type=int, default=16, help="requests to pull (default: %(default)s)")
    p.add_argument(
        "--blocks-per-request", type=int, default=8, help="blocks of each request (default: %(default)s)"
    )
    p.add_argument(
        "--concurrency", type=int, default=8, help="requests in flight at once (default: %(default)s)"
    )
    p.add_argument(
        "--lease",
        type=float,
        default=60.0,
        help="seconds before unread blocks are released (default: %(default)s)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="give up after this many seconds (default: %(default)s)"
    )
    p.add_argument(
        "--etcd",
        action="store_true",
        help="start a local etcd server, register the prefill ranks there and let decode find them "
        "as etcd://HOST:PORT/ENGINE_ID; stop it at the end",
    )
    for side in ("prefill", "decode"):
        p.add_argument(
            f"--{side}-layout",
            choices=list(LAYOUTS),
            metavar="L",
            help=f"layout of the {side} engine: {', '.join(LAYOUTS)} (default: --layout)",
        )
        p.add_argument(
            f"--{side}-block-size",
            type=int,
            metavar="N",
            help=f"tokens per block of the {side} engine (default: --block-size)",
        )
    add_common(p)
    add_device_flag(p, "prefill", "decode")
    add_tls_flags(p)
    add_mode_flags(p, layers=True)
    add_transfer_flags(p, "demo", "direct")
    p.set_defaults(func=cmd_demo)

    add_engines_parser(sub)

    from akv.bench.command import add_bench_parser

    add_bench_parser(sub)
    return parser


def _describe(exc: BaseException) -> str:
    if isinstance(exc, AkvError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``akv`` command; returns its exit code."""
    parser = build_parser()
    a = parser.parse_args(argv)
    verbose = getattr(a, "verbose", 0)
    configure_cli_logging(logging.WARNING - 10 * min(verbose, 2))
    a.argv = list(sys.argv[1:] if argv is None else argv)  # what rank processes are started with
    try:
        code: int = a.func(a)
    except BaseException as exc:
        # Task groups wrap errors in (nested) exception groups: report the leaf, in one line.
        if first_leaf(exc, BrokenPipeError) is not None:
            return _stdout_closed()
        interrupted = first_leaf(exc, Interrupted)
        if isinstance(interrupted, Interrupted):
            print(f"akv {a.command}: {interrupted}; every process it started is stopped", file=sys.stderr)
            return 128 + interrupted.signum
        if first_leaf(exc, KeyboardInterrupt) is not None:
            return 130
        child = first_leaf(exc, ChildFailed)
        if isinstance(child, ChildFailed):
            return child.code
        usage = usage_error(exc)
        if usage is not None:
            print(f"akv {a.command}: {_describe(usage)}", file=sys.stderr)
            return EXIT_USAGE
        failure = first_leaf(exc, AkvError)
        if failure is None:
            raise
        print(f"akv {a.command}: {type(failure).__name__}: {failure}", file=sys.stderr)
        return EXIT_FAILED
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return _stdout_closed()
    return code


def _stdout_closed() -> int:
    """Whoever read stdout stopped reading (``akv plan | head -1``): end quietly, as a command
    killed by SIGPIPE does (exit 141), and keep the interpreter's final flush from complaining."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE
