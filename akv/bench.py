"""``akv bench``: placeholder parser hook, replaced by the benchmark issue."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_bench_parser"]


def add_bench_parser(sub: Any) -> None:
    """Register ``akv bench`` (not implemented yet)."""
    p: argparse.ArgumentParser = sub.add_parser("bench", help="benchmarks (see docs/performance.md)")

    def run(a: argparse.Namespace) -> int:
        print("akv bench: not implemented yet", flush=True)
        return 1

    p.set_defaults(func=run)
