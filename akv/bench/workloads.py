"""The workloads of ``akv bench``: what each reads (`Workload`; the standard `WORKLOADS`; a
model's, `preset_workloads`), the caches and block ids of both sides (`specs`,
`pick_requests`), and what a run measured of one (`Figures`).

Workloads name the prefill and decode TP sizes as ``P->D``; ``hnd_*`` and ``headmajor_*``
read head-sliced between TP sizes on the per-layer ``HND`` layout and on ``head-major`` (one
descriptor per block and read instead of one per layer, K/V and block), from contiguous or
fragmented (``_frag``) block ids; ``mixed_bs`` reads prefill blocks of 16 tokens into decode
blocks of 32.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "HEADMAJOR_PAIRS",
    "SAME_PROCESS",
    "TARGETS",
    "WORKLOADS",
    "Figures",
    "Workload",
    "config_name",
    "ids_json",
    "pick_requests",
    "preset_workloads",
    "specs",
]


@dataclass(frozen=True)
class Workload:
    """One benchmark workload.

    ``blocks`` counts decode blocks per request; the prefill side exposes the same tokens in
    its own block size. ``layers`` fixes the layer count (else the run's: 8 quick, 16 full).
    """

    name: str
    prefill_tp: int
    decode_tp: int
    kv_heads: int = 8
    mla: bool = False
    blocks: tuple[int, int] = (64, 64)  # decode blocks per request: min, max
    contiguous: bool = True
    concurrency: int = 1
    requests: int = 24
    layout: str = "HND"  # the prefill engine's
    decode_layout: str = ""  # "": the prefill's
    block_size: int = 16  # the prefill engine's
    decode_block_size: int = 0  # 0: the prefill's
    layers: int = 0  # 0: the run's
    pool: int = 512  # blocks in each prefill rank's pool (the decode pool holds as many bytes)
    preset: str = ""  # a model preset (akv.presets) instead of kv_heads / mla
    hf_config: str = ""  # a model's Hugging Face config.json (akv.presets.from_hf_config) instead


def _hetero_tp() -> tuple[tuple[Workload, ...], tuple[tuple[str, str, str, bool], ...]]:
    """Head-sliced reads between TP sizes on HND and head-major; the (HND, head-major) pairs."""
    out: list[Workload] = []
    pairs: list[tuple[str, str, str, bool]] = []
    for p, d in ((1, 2), (2, 1)):
        for contiguous in (True, False):
            names = []
            for prefix, layout in (("hnd", "HND"), ("headmajor", "head-major")):
                name = f"{prefix}_{p}->{d}{'' if contiguous else '_frag'}"
                # 16 layers even when quick (per-layer HND posts 2 x layers descriptors per block),
                # on a smaller pool (fewer bytes to allocate and register per workload)
                out.append(
                    Workload(
                        name, p, d, contiguous=contiguous, layout=layout, layers=16, requests=12, pool=256
                    )
                )
                names.append(name)
            pairs.append((names[0], names[1], f"{p}->{d}", contiguous))
    return tuple(out), tuple(pairs)


_HETERO, HEADMAJOR_PAIRS = _hetero_tp()

#: The large workloads' prompt: 2,048 tokens of an 8B model (Llama 3.1 8B: 32 layers, 8 KV
#: heads of 128, bf16), 128 KiB a token, 256 MiB a request at TP 1.
LARGE_TOKENS, LARGE_LAYERS = 2048, 32


def _large() -> tuple[Workload, ...]:
    """One 256 MiB request at a time (``large``, 1->1), and head-sliced on head-major between
    TP 1 and 2 (``large_1->2``, ``large_2->1``): bandwidth, with the fixed costs of a pull
    small beside its bytes. A pool of one request and a few blocks more on each side."""
    n = LARGE_TOKENS // 16
    return tuple(
        Workload(name, p, d, layout=layout, blocks=(n, n), layers=LARGE_LAYERS, requests=4, pool=n + 4)
        for name, p, d, layout in (
            ("large", 1, 1, "HND"),
            ("large_1->2", 1, 2, "head-major"),
            ("large_2->1", 2, 1, "head-major"),
        )
    )


WORKLOADS: tuple[Workload, ...] = (
    Workload("bulk", 1, 1),
    Workload("fragmented", 1, 1, contiguous=False),
    Workload("decode_tp>prefill_tp", 1, 2),
    Workload("prefill_tp>decode_tp", 2, 1),
    Workload("mla_prefill>decode", 2, 1, kv_heads=1, mla=True, requests=64),
    Workload("small_concurrent", 1, 1, blocks=(1, 4), contiguous=False, concurrency=32, requests=512),
    # one block a pull, one at a time: the fixed cost of a pull (p50_ms beside nixl_p50_ms)
    Workload("latency", 1, 1, blocks=(1, 1), requests=64),
    *_HETERO,
    Workload("mixed_bs", 1, 1, blocks=(32, 32), block_size=16, decode_block_size=32),
    # head-sliced NHD between TP sizes: one run per token, layer and K/V plane (packed transfers)
    Workload("head_sliced_nhd", 1, 2, layout="NHD", blocks=(16, 16), layers=16, requests=8, pool=128),
    *_large(),
)


#: The same-process workload: head-sliced HND reads 2 -> 1 from fragmented blocks.
SAME_PROCESS = Workload("same_process", 2, 1, contiguous=False, requests=12, pool=256)

#: What the issue asks of head-major hetero-TP reads against per-layer HND, and of akv
#: against the hand-written loop (printed next to the figures, never checked).
TARGETS = {"headmajor_descriptor_ratio": 20.0, "headmajor_gbps_ratio": 1.5, "akv_vs_nixl": 0.9}


def preset_workloads(
    name: str, hf_config: str = ""
) -> tuple[tuple[Workload, ...], tuple[tuple[str, str, str, bool], ...]]:
    """A preset's (or, with ``hf_config``, a Hugging Face config's) hybrid cache at the TP pairs
    it shards to, per-layer HND against head-major (every group: attention, sliding window,
    MLA and state alike); the (HND, head-major) pairs."""
    from akv.errors import ConfigError
    from akv.presets import from_hf_config, preset

    cache = from_hf_config(hf_config, layers=8) if hf_config else preset(name, layers=8)
    out: list[Workload] = []
    pairs: list[tuple[str, str, str, bool]] = []
    for p, d in ((1, 2), (2, 1), (2, 4), (4, 2)):
        try:
            cache.check_rank(0, p)
            cache.check_rank(0, d)
        except ConfigError:
            continue
        names = [f"{name}_{prefix}_{p}->{d}" for prefix in ("hnd", "headmajor")]
        for n, layout in zip(names, ("HND", "head-major"), strict=True):
            out.append(
                Workload(
                    n,
                    p,
                    d,
                    preset="" if hf_config else name,
                    hf_config=hf_config,
                    layout=layout,
                    blocks=(32, 32),
                    requests=12,
                    pool=64,
                )
            )
        pairs.append((names[0], names[1], f"{p}->{d}", True))
    return tuple(out), tuple(pairs)


def config_name(path: str) -> str:
    """A workload name for a config file: its model type, else the file's name."""
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read())
        text = config.get("text_config", config) if isinstance(config, dict) else {}
        name = str(text.get("model_type") or config.get("model_type") or "")
    except (OSError, ValueError, AttributeError):
        name = ""
    return name or os.path.splitext(os.path.basename(path))[0]


@dataclass
class Figures:
    """Measured figures of one workload."""

    name: str
    workload: Workload | None = None
    bytes: int = 0
    descriptors: float = 0.0
    descriptors_submitted: float = 0.0
    nixl_submitted: float = 0.0
    perblock_descriptors: float = 0.0
    gbps: dict[str, float] = field(default_factory=dict)
    latency_ms: list[float] = field(default_factory=list)
    latency_unchecked_ms: list[float] = field(default_factory=list)
    latency_nixl_ms: list[float] = field(default_factory=list)  # the hand-written loop's (READ)
    #: mean per pull (one decode rank's pull of one request) of each control operation of akv's
    #: checked pulls (`akv.metrics.CONTROL_OPS`), and of its pushed pulls (``--mode push``)
    control_ops: dict[str, float] = field(default_factory=dict)
    push_control_ops: dict[str, float] = field(default_factory=dict)
    data_xfers: float = 0.0  # data transfers akv's checked pulls posted, per pull
    launch_akv_us: list[float] = field(default_factory=list)
    launch_nixl_us: list[float] = field(default_factory=list)
    transfer: str = "direct"
    pack_ms: float = 0.0  # prefill side: gather of one request into its packed copy
    unpack_s: float = 0.0  # decode side: scatters of packed pulls, summed
    lookup_s: float = 0.0  # decode side: directory lookups of packed pulls, summed
    read_s: float = 0.0  # decode side: reads (and exposure checks) of packed pulls, summed
    check_s: float = 0.0  # decode side: exposure checks of direct pulls, until seen verified, summed
    data_ms: list[float] = field(default_factory=list)  # each direct pull's data reads, until seen done
    paths: dict[str, int] = field(default_factory=dict)


def specs(w: Workload, layers: int) -> tuple[Any, Any]:
    """The prefill and decode specs of a workload (the same pool bytes on both sides)."""
    from akv.geometry.spec import KVSpec

    layers = w.layers or layers
    decode_bs = w.decode_block_size or w.block_size
    if w.preset or w.hf_config:
        from akv.presets import from_hf_config, preset

        def model(**kw: Any) -> Any:
            return (
                from_hf_config(w.hf_config, layers=layers, **kw)
                if w.hf_config
                else preset(w.preset, layers=layers, **kw)
            )

        return (
            model(blocks=w.pool, block_size=w.block_size, layout=w.layout),
            model(
                blocks=max(1, w.pool * w.block_size // decode_bs),
                block_size=decode_bs,
                layout=w.decode_layout or w.layout,
            ),
        )
    common: dict[str, Any] = {
        "layers": layers,
        "kv_heads": 1 if w.mla else w.kv_heads,
        "head_dim": 576 if w.mla else 128,
        "dtype": "bfloat16",
        "kind": "mla" if w.mla else "dense",
    }
    prefill = KVSpec.create(**common, num_blocks=w.pool, block_size=w.block_size, layout=w.layout)
    decode = KVSpec.create(
        **common,
        num_blocks=max(1, w.pool * w.block_size // decode_bs),
        block_size=decode_bs,
        layout=w.decode_layout or w.layout,
    )
    return prefill, decode


def pick_requests(
    w: Workload, prefill: Any, decode: Any, rng: np.random.Generator
) -> list[tuple[str, Any, Any]]:
    """(request id, decode block ids, prefill block ids): the same tokens on both sides."""
    out: list[tuple[str, Any, Any]] = []
    if w.preset or w.hf_config:  # per group: the blocks (or state slot) of the same tokens on both sides
        from akv.testing import local_counts

        for i in range(w.requests):
            tokens = int(rng.integers(w.blocks[0], w.blocks[1] + 1)) * decode.groups[0].block_size
            sides = []
            for spec in (decode, prefill):
                ids = {}
                for g in spec.groups:
                    n = local_counts(spec, tokens)[g.name]
                    start = int(rng.integers(0, g.num_blocks - n + 1))
                    picked = (
                        np.arange(start, start + n)
                        if w.contiguous
                        else rng.choice(g.num_blocks, n, replace=False)
                    )
                    ids[g.name] = picked.astype(np.int32)
                sides.append(ids)
            out.append((f"bench-{w.name}-{i}", sides[0], sides[1]))
        return out
    for i in range(w.requests):
        n = int(rng.integers(w.blocks[0], w.blocks[1] + 1))
        m = n * decode.block_size // prefill.block_size  # whole blocks on both sides (sizes divide)
        if w.contiguous:
            r0 = int(rng.integers(0, prefill.num_blocks - m))
            l0 = int(rng.integers(0, decode.num_blocks - n))
            remote, local = np.arange(r0, r0 + m), np.arange(l0, l0 + n)
        else:
            remote = rng.choice(prefill.num_blocks, m, replace=False)
            local = rng.choice(decode.num_blocks, n, replace=False)
        out.append((f"bench-{w.name}-{i}", local.astype(np.int32), remote.astype(np.int32)))
    return out


def ids_json(ids: Any) -> Any:
    """Block ids as JSON: a flat list, or ``{group: ids}``."""
    if isinstance(ids, dict):
        return {name: v.tolist() for name, v in ids.items()}
    return ids.tolist()
