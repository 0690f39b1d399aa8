"""Flags, exit codes and output helpers shared by the ``akv`` commands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from akv.geometry.spec import KVSpec

__all__ = [
    "EXIT_EXPIRED",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "add_common",
    "add_model_flags",
    "emit",
    "report",
    "spec_from_args",
]

EXIT_OK, EXIT_FAILED, EXIT_EXPIRED, EXIT_USAGE = 0, 1, 3, 64  # 2 is argparse's usage error


def emit(obj: dict[str, Any]) -> None:
    """Write one JSON line to stdout and flush."""
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


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


def report(a: argparse.Namespace, summary: dict[str, Any], text: str) -> None:
    """The summary as a JSON line with ``--json``, else ``text``."""
    if a.json:
        emit(summary)
    else:
        print(text)
