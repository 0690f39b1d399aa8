"""Command-line options that both the ``akv`` commands (`akv.cli`) and ``akv bench``
(`akv.bench`) take, below both: the transfer mode (``--mode``, ``--layer-ms``), the device
(``--device``, and the UCX settings it needs), packed transfers (``--transfer``,
``--pack-pool-mib``), and `check`, which turns a bad value into the one-line
[`ConfigError`][akv.errors.ConfigError] that ``akv`` prints before exiting 64.

Nothing here does I/O beyond reading the environment; nothing in the library proper imports it.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING

from akv.errors import ConfigError

if TYPE_CHECKING:
    from akv.device import Device

__all__ = [
    "add_device_flag",
    "add_mode_flags",
    "add_transfer_flags",
    "check",
    "check_mode",
    "check_transfer_flags",
    "device_of",
    "rank_device",
    "use_gpu_environment",
]


def check(ok: bool, message: str) -> None:
    """Raise [`ConfigError`][akv.errors.ConfigError] with ``message`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)


# -- transfer mode (push mode, issue 23) --------------------------------------------------


def add_mode_flags(
    p: argparse.ArgumentParser, *, served: bool = False, layers: bool = False, auto: bool = False
) -> None:
    """``--mode`` (``served``: what a prefill engine serves, both when not given; ``auto``:
    the consumer's choice when not given) and, where prefill computes layers (``layers``),
    ``--layer-ms``."""
    p.add_argument(
        "--mode",
        choices=("pull", "push"),
        default=None if served or auto else "pull",
        help="serve only this transfer mode (default: both)"
        if served
        else "pull: decode READs; push: prefill WRITEs into blocks decode grants, layer by layer "
        + (
            "(default: per engine, push where UCX would serve reads over TCP: another host without "
            "RDMA, or UCX_TLS=tcp; else pull; pull is refused where reads would go over TCP)"
            if auto
            else "(default: %(default)s)"
        ),
    )
    if layers:
        p.add_argument(
            "--layer-ms",
            type=float,
            default=0.0,
            metavar="MS",
            help="push mode: prefill 'computes' each layer in this many ms after exposing a request, "
            "and the layers ready so far are pushed (default: 0, every layer ready at once)",
        )


def check_mode(a: argparse.Namespace) -> None:
    """``--layer-ms`` is >= 0, and only for ``--mode push``."""
    layer_ms = getattr(a, "layer_ms", 0.0)
    check(layer_ms >= 0 and math.isfinite(layer_ms), f"--layer-ms must be >= 0, got {layer_ms}")
    check(
        layer_ms == 0 or a.mode == "push",
        "--layer-ms streams layers to pushing decode ranks: add --mode push",
    )


# -- devices ------------------------------------------------------------------------------


def add_device_flag(p: argparse.ArgumentParser, *sides: str) -> None:
    """``--device`` (and ``--SIDE-device`` for each of ``sides``, overriding it for that side)."""
    p.add_argument(
        "--device",
        default="cpu",
        metavar="DEV",
        help="where the KV caches live: cpu (DRAM), cuda (rank r on GPU r %% count, one process per "
        "GPU) or cuda:N (every rank on GPU N) (default: %(default)s)",
    )
    for side in sides:
        p.add_argument(
            f"--{side}-device",
            default=None,
            metavar="DEV",
            help=f"the {side} engine's device, if not --device's",
        )


def device_of(a: argparse.Namespace, side: str | None = None) -> Device:
    """The device flag of ``side`` (its own flag, else ``--device``), parsed and checked
    usable: a one-line [`ConfigError`][akv.errors.ConfigError] otherwise."""
    from akv.device import check_usable, parse_device

    own = getattr(a, f"{side}_device", None) if side else None
    flag = f"--{side}-device" if own is not None else "--device"
    device = parse_device(own if own is not None else getattr(a, "device", "cpu"), flag)
    check_usable(device, flag)
    return device


def rank_device(device: Device, rank: int) -> str:
    """The torch device of TP rank ``rank`` for a checked device flag."""
    if not device.cuda:
        return "cpu"
    import torch

    return device.for_rank(rank, torch.cuda.device_count())


def use_gpu_environment(device: Device) -> None:
    """For VRAM, set the UCX variables of `akv.device.GPU_UCX_ENV` this process (and the rank
    processes it starts) lacks, and say so on stderr once."""
    import os

    from akv.device import gpu_environment

    changes = gpu_environment(os.environ, device.cuda)
    for key, value in changes.items():
        os.environ[key] = value
        print(
            f"akv: set {key}={value} for VRAM transfers (UCX reads VRAM on a slow path without it); "
            "set it yourself to choose",
            file=sys.stderr,
        )


# -- packed transfers ------------------------------------------------------------------------

_TRANSFER_HELP = {
    "prefill": "whether ranks keep packed copies of exposed requests: packed (always), auto (when "
    "a head slice of a block is several runs on this layout) or direct (never)",
    "decode": "which copy to read: packed (the prefill ranks' packed copies), direct (the paged "
    "blocks) or auto (packed where the direct read would take many descriptors)",
    "demo": "passed to both engines (see akv prefill --help and akv decode --help)",
    "bench": "run each workload with packed copies, direct reads or auto's choice",
}


def add_transfer_flags(p: argparse.ArgumentParser, command: str, default: str) -> None:
    """``--transfer {auto,direct,packed}`` (and, where a prefill engine runs, ``--pack-pool-mib``)."""
    p.add_argument(
        "--transfer",
        choices=("auto", "direct", "packed"),
        default=default,
        help=f"{_TRANSFER_HELP[command]} (default: %(default)s)",
    )
    if command in ("prefill", "demo"):
        p.add_argument(
            "--pack-pool-mib",
            type=int,
            default=256,
            metavar="MIB",
            help="each prefill rank's staging pool for packed copies (default: %(default)s)",
        )


def check_transfer_flags(a: argparse.Namespace) -> None:
    """A one-line ConfigError for a bad ``--pack-pool-mib``."""
    mib = getattr(a, "pack_pool_mib", 1)
    check(mib >= 1, f"--pack-pool-mib must be >= 1, got {mib}")
