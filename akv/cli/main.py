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
from akv.cli.args import EXIT_FAILED, EXIT_USAGE, add_common, add_model_flags
from akv.cli.decode import cmd_decode
from akv.cli.demo import cmd_demo
from akv.cli.engines import add_engines_parser
from akv.cli.plan import cmd_plan
from akv.cli.prefill import cmd_prefill
from akv.errors import AkvError

__all__ = ["build_parser", "main"]


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

    add_engines_parser(sub)

    from akv.bench.run import add_bench_parser

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
