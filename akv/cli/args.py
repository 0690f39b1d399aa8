"""Flags, validation, exit codes and output helpers shared by the ``akv`` commands (the
options ``akv bench`` takes too, mode, device and transfer, are in `akv.options`).

Every command validates its arguments before any I/O (`check`, `check_model`,
...); a mistake found later (a port in use, an unbindable host) still arrives as a
[`ConfigError`][akv.errors.ConfigError] or an ``OSError``, possibly wrapped in exception groups by
task groups: `usage_error` finds it, and ``akv`` prints it as one line and exits 64.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from akv.errors import ConfigError
from akv.geometry.cache import LAYOUTS, CacheSpec
from akv.geometry.spec import DTYPE_SIZES, KVSpec
from akv.options import check
from akv.presets import PRESETS, from_hf_config, preset

if sys.version_info < (3, 11):  # pragma: no cover - anyio brings the backport
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "DEFAULT_BLOCKS",
    "EXIT_EXPIRED",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_PIPE",
    "EXIT_USAGE",
    "add_common",
    "add_model_flags",
    "check_model",
    "check_port",
    "check_seconds",
    "described_by",
    "emit",
    "first_leaf",
    "model_argv",
    "report",
    "size_pool",
    "spec_from_args",
    "usage_error",
    "verbosity_argv",
]

EXIT_OK, EXIT_FAILED, EXIT_EXPIRED, EXIT_USAGE = 0, 1, 3, 64  # 2 is argparse's usage error
EXIT_PIPE = 141  # stdout closed early (``akv plan | head -1``): as a command killed by SIGPIPE

#: Blocks in each rank's pool when ``--blocks`` is not given (prefill and demo raise it to
#: fit ``--requests`` x ``--blocks-per-request``).
DEFAULT_BLOCKS = 256


def emit(obj: dict[str, Any]) -> None:
    """Write one JSON line to stdout and flush."""
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def add_model_flags(
    p: argparse.ArgumentParser,
    *,
    sized: bool = False,
    kv_heads: int | None = None,
    kv_heads_default: int | None = None,
) -> None:
    """The model-shape flags. ``sized``: ``--blocks`` defaults to what the requests need;
    ``kv_heads_default``: ``--kv-heads`` when neither it, ``--mla``, ``--preset``, ``--config`` nor
    ``--hf-config`` is given."""
    g = p.add_argument_group(
        "model shape (must match on both sides, except --blocks, --block-size and --layout)"
    )
    g.add_argument(
        "--preset",
        metavar="NAME",
        help=f"a real model's cache: {', '.join(PRESETS)} (with --layers: scaled down, same kinds)",
    )
    g.add_argument(
        "--config",
        metavar="FILE.json",
        help='a cache description {"groups": [...]} in the schema of akv.CacheSpec (docs/concepts.md)',
    )
    g.add_argument(
        "--hf-config",
        metavar="FILE.json",
        help="a model's own Hugging Face config.json (akv.presets.from_hf_config; with --layers: scaled "
        "down, same kinds; its dtype unless --dtype)",
    )
    g.add_argument(
        "--kv-heads",
        type=int,
        default=kv_heads,
        metavar="H",
        help="total KV heads of the model; required unless --mla, --preset, --config or --hf-config"
        + (" (default: %(default)s)" if kv_heads is not None else "")
        + (f" (default: {kv_heads_default})" if kv_heads_default is not None else ""),
    )
    p.set_defaults(kv_heads_default=kv_heads_default)
    g.add_argument("--mla", action="store_true", help="MLA latent cache, replicated on every rank")
    g.add_argument(
        "--layers",
        type=int,
        default=None,
        help="transformer layers (default: 4; a --preset's or --hf-config's own count)",
    )
    blocks_help = (
        f"blocks in each rank's pool (default: {DEFAULT_BLOCKS}, or --requests x --blocks-per-request "
        "if larger)"
        if sized
        else "blocks in each rank's pool (default: %(default)s)"
    )
    g.add_argument("--blocks", type=int, default=None if sized else DEFAULT_BLOCKS, help=blocks_help)
    g.add_argument(
        "--block-size", type=int, default=None, help="tokens per block of this engine (default: 16)"
    )
    g.add_argument(
        "--head-dim", type=int, default=None, help="head dim, or latent dim with --mla (default: 64)"
    )
    g.add_argument(
        "--dtype",
        default=None,
        help=f"element type: {', '.join(sorted(DTYPE_SIZES))} (default: bfloat16)",
    )
    g.add_argument(
        "--layout",
        choices=list(LAYOUTS),
        default=None,
        help="this engine's layout: per-layer HND or NHD, cross-layer (a block holds every layer) or "
        "head-major (a block holds each head's every layer together) (default: HND)",
    )
    g.add_argument("--joint-kv", action="store_true", help="K and V in one region per layer")


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="JSON lines on stdout, the summary last")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logs on stderr (-vv: debug)")
    p.add_argument("--secret", default=None, help="shared secret of the control plane (default: $AKV_SECRET)")


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca``: TLS on the control plane (issue 24, item 11)."""
    g = p.add_argument_group("TLS on the control plane (handshakes; the NIXL data plane is not covered)")
    g.add_argument("--tls-cert", metavar="PEM", help="this side's certificate (serving: required for TLS)")
    g.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    g.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="CA that verifies the peer: servers' certificates when connecting; when serving, "
        "clients must then present a certificate it signed",
    )


def tls_from_args(a: argparse.Namespace, *, serve: bool, connect: bool, why: str = "") -> Any:
    """The [`TLSConfig`][akv.TLSConfig] of the TLS flags (None without any), its files loaded
    now: a [`ConfigError`][akv.errors.ConfigError] naming the flag otherwise."""
    from akv.tls import TLSConfig

    cert, key, ca = (getattr(a, f"tls_{n}", None) for n in ("cert", "key", "ca"))
    if cert is None and key is None and ca is None:
        return None
    check((cert is None) == (key is None), "--tls-cert and --tls-key go together: give both, or neither")
    check(
        not serve or cert is not None,
        "serving TLS needs --tls-cert and --tls-key (this engine's certificate and its key)",
    )
    check(
        not connect or ca is not None,
        f"connecting over TLS needs --tls-ca, the CA that signed the prefill ranks' certificates{why}",
    )
    try:
        tls = TLSConfig(cert=cert, key=key, ca=ca)
        tls.check(serve=serve, connect=connect)
    except ConfigError as exc:
        raise ConfigError(f"--tls-cert/--tls-key/--tls-ca: {exc}") from None
    return tls


# -- validation (no I/O) ------------------------------------------------------------------


def check_seconds(value: float, flag: str, *, zero_ok: bool = False) -> None:
    """A finite number of seconds, > 0 (or >= 0 with ``zero_ok``)."""
    ok = math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
    check(ok, f"{flag} must be a number of seconds {'>= 0' if zero_ok else '> 0'}, got {value}")


def check_port(port: int) -> None:
    check(0 <= port <= 65535, f"--port must be in 0-65535 (0 picks a free port), got {port}")


def described_by(a: argparse.Namespace) -> str | None:
    """The flag describing the whole model (``--preset``, ``--config`` or ``--hf-config``), if
    any; ConfigError if several are given."""
    given = [f for f, v in (("--preset", a.preset), ("--config", a.config),
                            ("--hf-config", getattr(a, "hf_config", None))) if v]  # fmt: skip
    check(len(given) <= 1, f"{' and '.join(given)} exclude each other: give one")
    return given[0] if given else None


def check_model(a: argparse.Namespace, *tp_flags: str) -> None:
    """The model flags, and that the model can be sharded over each TP size in ``tp_flags``."""
    described = described_by(a)
    if described:
        given = [f for f, v in (("--kv-heads", a.kv_heads), ("--head-dim", a.head_dim)) if v is not None]
        given += ["--mla"] * bool(a.mla) + ["--joint-kv"] * bool(a.joint_kv)
        check(not given, f"{described} describes the model: drop {', '.join(given)}")
        check(not (a.config and a.layers), "--layers scales a --preset: drop it with --config")
    elif a.kv_heads is None and not a.mla and getattr(a, "kv_heads_default", None):
        a.kv_heads = a.kv_heads_default
    elif a.kv_heads is None and not a.mla:
        raise ConfigError(
            "--kv-heads is required (the model's total KV heads), unless --mla, --preset or --hf-config"
        )
    flags = {"layers": a.layers, "block-size": a.block_size, "head-dim": a.head_dim, "blocks": a.blocks}
    if not a.mla and not described:
        flags["kv-heads"] = a.kv_heads
    for flag, value in flags.items():
        check(value is None or value >= 1, f"--{flag} must be >= 1, got {value}")
    check(
        a.dtype is None or a.dtype in DTYPE_SIZES,
        f"--dtype {a.dtype} is not supported: use one of {', '.join(sorted(DTYPE_SIZES))}",
    )
    check(not (a.mla and a.joint_kv), "--mla and --joint-kv exclude each other: an MLA cache has no K and V")
    spec = spec_from_args(a)
    for flag in tp_flags:
        tp = getattr(a, flag.lstrip("-").replace("-", "_"))
        check(tp >= 1, f"{flag} must be >= 1, got {tp}")
        try:
            spec.check_rank(0, tp)
        except ConfigError as exc:
            raise ConfigError(f"{flag} {tp}: {exc}") from None


def size_pool(a: argparse.Namespace) -> None:
    """Check ``--requests`` and ``--blocks-per-request``; size ``--blocks`` to fit them if not given."""
    check(a.requests >= 1, f"--requests must be >= 1, got {a.requests}")
    check(a.blocks_per_request >= 1, f"--blocks-per-request must be >= 1, got {a.blocks_per_request}")
    need = a.requests * a.blocks_per_request
    if a.blocks is None:
        a.blocks = max(DEFAULT_BLOCKS, need)
    check(
        need <= a.blocks,
        f"--requests {a.requests} x --blocks-per-request {a.blocks_per_request} = {need} blocks exceed "
        f"--blocks {a.blocks}: raise --blocks (or leave it out) or lower the others",
    )


def spec_from_args(
    a: argparse.Namespace, *, layout: str | None = None, block_size: int | None = None
) -> KVSpec | CacheSpec:
    """The cache the model flags describe (``layout`` / ``block_size`` override the flags)."""
    layout = layout or a.layout
    block_size = block_size or a.block_size
    blocks = a.blocks if a.blocks is not None else DEFAULT_BLOCKS
    if a.preset:
        return preset(
            a.preset,
            layers=a.layers,
            blocks=blocks,
            block_size=block_size or 16,
            dtype=a.dtype or "bfloat16",
            layout=layout or "HND",
        )
    if a.config:
        return _config(a.config, a.blocks, block_size, layout, a.dtype)
    if getattr(a, "hf_config", None):
        try:
            return from_hf_config(
                a.hf_config,
                layers=a.layers,
                blocks=blocks,
                block_size=block_size or 16,
                dtype=a.dtype,
                layout=layout or "HND",
            )
        except ConfigError as exc:
            raise ConfigError(f"--hf-config {a.hf_config}: {exc}") from None
    return KVSpec.create(
        layers=a.layers or 4,
        num_blocks=blocks,
        block_size=block_size or 16,
        kv_heads=1 if a.mla else a.kv_heads,
        head_dim=a.head_dim or 64,
        dtype=a.dtype or "bfloat16",
        kind="mla" if a.mla else "dense",
        layout=layout or "HND",
        joint_kv=a.joint_kv,
    )


def _config(
    path: str, blocks: int | None, block_size: int | None, layout: str | None, dtype: str | None
) -> CacheSpec:
    """A ``--config`` file, with the flags given on the command line applied to every group."""
    import msgspec

    try:
        with open(path, "rb") as f:
            spec = CacheSpec.from_json(f.read())
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    groups = []
    for g in spec.groups:
        changes: dict[str, Any] = {}
        if blocks is not None:
            changes["num_blocks"] = blocks
        if block_size is not None and g.tokens:
            changes["block_size"] = block_size
        if layout is not None:
            changes["layout"] = layout
        if dtype is not None:
            changes["dtype"] = dtype
        groups.append(msgspec.structs.replace(g, **changes))
    return CacheSpec.create(groups)


def model_argv(
    a: argparse.Namespace, *, layout: str | None = None, block_size: int | None = None
) -> list[str]:
    """The model flags to start another ``akv`` command with (``layout`` / ``block_size``: its own)."""
    argv: list[str] = []
    if a.preset:
        argv += ["--preset", a.preset]
    elif a.config:
        argv += ["--config", a.config]
    elif getattr(a, "hf_config", None):
        argv += ["--hf-config", a.hf_config]
    else:
        argv += ["--kv-heads", str(a.kv_heads)] if not a.mla else ["--mla"]
        argv += ["--head-dim", str(a.head_dim or 64)]
        argv += ["--joint-kv"] if a.joint_kv else []
    for flag, value in (("--layers", a.layers), ("--blocks", a.blocks), ("--dtype", a.dtype)):
        if value is not None:
            argv += [flag, str(value)]
    for flag, value in (("--layout", layout or a.layout), ("--block-size", block_size or a.block_size)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def verbosity_argv(a: argparse.Namespace) -> list[str]:
    """``-v`` flags that pass this command's verbosity on to a child command."""
    return ["-" + "v" * a.verbose] if getattr(a, "verbose", 0) else []


# -- errors -------------------------------------------------------------------------------


def first_leaf(
    exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]
) -> BaseException | None:
    """The first exception of ``kind`` in ``exc``, looking inside (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_leaf(inner, kind)
            if found is not None:
                return found
        return None
    return exc if isinstance(exc, kind) else None


def usage_error(exc: BaseException) -> BaseException | None:
    """The configuration error inside ``exc``: a [`ConfigError`][akv.errors.ConfigError], else an ``OSError``
    (binding a port or host), else None. Task groups wrap both in exception groups."""
    return first_leaf(exc, ConfigError) or first_leaf(exc, OSError)


def report(a: argparse.Namespace, summary: dict[str, Any], text: str) -> None:
    """The summary as a JSON line with ``--json``, else ``text``."""
    if a.json:
        emit(summary)
    else:
        print(text)
