"""Cache descriptions of real models, from their public configurations.

[`preset`][akv.presets.preset] builds a [`CacheSpec`][akv.CacheSpec] with each model's
per-layer geometry: KV heads and head dims, sliding windows, MLA latent width, Mamba2 and
Gated DeltaNet state dimensions, and the order of its layer kinds. ``layers=N`` scales a
model down to ``N`` cache-holding layers while keeping every kind it has and their order.

State layouts: a Mamba2 layer holds its conv state as one ``[x | B | C]`` tensor (this
rank's share of each piece, each channel's ``conv_kernel - 1`` taps together) plus the SSM
state ``(heads, head_dim, state)``; a GDN layer holds ``[q | k | v]`` conv state plus the
recurrent state ``(v_heads, k_dim, v_dim)``. Every piece is split along its own head or
group axis, never as one slice of the concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass

from akv.errors import ConfigError
from akv.geometry.cache import CacheSpec, Component, Group

__all__ = ["PRESETS", "preset", "preset_layers"]


@dataclass(frozen=True)
class _Model:
    """A model: the kind of every cache-holding layer, and a group builder per kind."""

    source: str
    kinds: tuple[str, ...]  # per model layer: "full", "swa", "mla", "mamba", "gdn" or "" (no cache)
    window: int = 0


def _attn(heads: int, dim: int) -> tuple[Component, ...]:
    return (
        Component(name="k", units=heads, unit_elems=dim, shard="heads"),
        Component(name="v", units=heads, unit_elems=dim, shard="heads"),
    )


def _mamba2(heads: int, head_dim: int, groups: int, state: int, kernel: int) -> tuple[Component, ...]:
    taps = kernel - 1
    return (
        Component(name="x", units=heads, unit_elems=head_dim * taps, tensor="conv"),
        Component(name="B", units=groups, unit_elems=state * taps, tensor="conv"),
        Component(name="C", units=groups, unit_elems=state * taps, tensor="conv"),
        Component(name="ssm", units=heads, unit_elems=head_dim * state),
    )


def _gdn(k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int) -> tuple[Component, ...]:
    taps = kernel - 1
    return (
        Component(name="q", units=k_heads, unit_elems=k_dim * taps, tensor="conv"),
        Component(name="k", units=k_heads, unit_elems=k_dim * taps, tensor="conv"),
        Component(name="v", units=v_heads, unit_elems=v_dim * taps, tensor="conv"),
        Component(name="state", units=v_heads, unit_elems=k_dim * v_dim),
    )


#: Group kind and components per layer kind, per preset.
_COMPONENTS: dict[str, dict[str, tuple[str, tuple[Component, ...]]]] = {
    # meta-llama/Llama-3.1-8B: 32 layers, 8 KV heads of 128.
    "llama-3.1-8b": {"full": ("full", _attn(8, 128))},
    # deepseek-ai/DeepSeek-V3: 61 MLA layers, latent kv_lora_rank 512 + rope 64.
    "deepseek-v3": {"mla": ("mla", (Component(name="latent", units=1, unit_elems=576, shard="replicate"),))},
    # google/gemma-3-27b: 62 layers, 16 KV heads of 128, window 1024, every 6th layer global.
    "gemma-3-27b": {"full": ("full", _attn(16, 128)), "swa": ("sliding", _attn(16, 128))},
    # openai/gpt-oss-120b: 36 layers alternating sliding (first) and full, 8 KV heads of 64, window 128.
    "gpt-oss-120b": {"full": ("full", _attn(8, 64)), "swa": ("sliding", _attn(8, 64))},
    # Qwen/Qwen3-Next-80B-A3B: 48 layers, full attention every 4th (2 KV heads of 256), the rest
    # Gated DeltaNet (16 key heads, 32 value heads, dims 128, conv kernel 4).
    "qwen3-next-80b": {"full": ("full", _attn(2, 256)), "gdn": ("gdn", _gdn(16, 32, 128, 128, 4))},
    # nvidia/Nemotron-H-8B-Base-8K: 52 layers (M = Mamba2, * = attention, - = MLP), attention
    # 8 KV heads of 128; Mamba2 128 heads of 64, 8 groups, state 128, conv kernel 4.
    "nemotron-h-8b": {"full": ("full", _attn(8, 128)), "mamba": ("mamba2", _mamba2(128, 64, 8, 128, 4))},
}

_NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

_MODELS: dict[str, _Model] = {
    "llama-3.1-8b": _Model("meta-llama/Llama-3.1-8B", ("full",) * 32),
    "deepseek-v3": _Model("deepseek-ai/DeepSeek-V3", ("mla",) * 61),
    "gemma-3-27b": _Model(
        "google/gemma-3-27b", tuple("full" if (i + 1) % 6 == 0 else "swa" for i in range(62)), window=1024
    ),
    "gpt-oss-120b": _Model(
        "openai/gpt-oss-120b", tuple("swa" if i % 2 == 0 else "full" for i in range(36)), window=128
    ),
    "qwen3-next-80b": _Model(
        "Qwen/Qwen3-Next-80B-A3B", tuple("full" if (i + 1) % 4 == 0 else "gdn" for i in range(48))
    ),
    "nemotron-h-8b": _Model(
        "nvidia/Nemotron-H-8B-Base-8K", tuple({"M": "mamba", "*": "full", "-": ""}[c] for c in _NEMOTRON_H_8B)
    ),
}

#: Preset names and the public model each describes.
PRESETS: dict[str, str] = {name: m.source for name, m in _MODELS.items()}


def preset_layers(name: str, layers: int | None = None) -> tuple[str, ...]:
    """The layer kinds of preset ``name`` (cache-holding layers only), scaled to ``layers``.

    Scaling keeps the first layer of every kind and spreads the rest evenly over the model,
    so the order of kinds is the model's own.
    """
    model = _model(name)
    cached = [k for k in model.kinds if k]
    if layers is None or layers == len(cached):
        return tuple(cached)
    kinds = list(dict.fromkeys(cached))
    if not len(kinds) <= layers <= len(cached):
        raise ConfigError(
            f"--layers {layers}: preset {name!r} needs between {len(kinds)} (one per kind: "
            f"{', '.join(kinds)}) and {len(cached)} layers"
        )
    keep = {cached.index(k) for k in kinds}
    rest = [i for i in range(len(cached)) if i not in keep]
    extra = layers - len(keep)
    keep |= {rest[(j * len(rest)) // extra] for j in range(extra)} if extra else set()
    return tuple(cached[i] for i in sorted(keep))


def preset(
    name: str,
    *,
    layers: int | None = None,
    blocks: int = 64,
    block_size: int = 16,
    dtype: str = "bfloat16",
    layout: str = "HND",
) -> CacheSpec:
    """The cache of model ``name`` (see `PRESETS`).

    Args:
        name: a preset name, e.g. ``"qwen3-next-80b"``.
        layers: scale to this many cache-holding layers (default: the model's own count).
        blocks: blocks per group pool (state groups: state slots).
        block_size: tokens per block of the token groups.
        dtype: element type of every group.
        layout: layout of every group (see [`akv.geometry.layout`][akv.geometry.layout]).
    """
    model = _model(name)
    kinds = preset_layers(name, layers)
    # the model's own layer indices (MLP layers of Nemotron-H hold no cache), or 0..N-1 scaled
    index = [i for i, k in enumerate(model.kinds) if k] if layers is None else list(range(len(kinds)))
    groups = []
    for kind, (group_kind, comps) in _COMPONENTS[name].items():
        mine = tuple(i for i, k in zip(index, kinds, strict=True) if k == kind)
        if not mine:
            continue
        groups.append(
            Group(
                name=kind,
                kind=group_kind,  # type: ignore[arg-type]
                layers=mine,
                components=comps,
                num_blocks=blocks,
                block_size=block_size if group_kind in ("full", "sliding", "mla") else 1,
                window=model.window if group_kind == "sliding" else 0,
                dtype=dtype,
                layout=layout,
            )
        )
    return CacheSpec.create(groups)


def _model(name: str) -> _Model:
    model = _MODELS.get(name)
    if model is None:
        raise ConfigError(f"unknown preset {name!r}; use one of {', '.join(_MODELS)}")
    return model
