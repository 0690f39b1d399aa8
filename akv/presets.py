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

[`from_hf_config`][akv.presets.from_hf_config] derives the same description from a model's
own Hugging Face ``config.json`` (a dict or a path; transformers is not needed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from akv.errors import ConfigError
from akv.geometry.cache import CacheSpec, Component, Group

__all__ = ["PRESETS", "from_hf_config", "preset", "preset_layers"]


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
    return _scale(_model(name).kinds, layers, f"preset {name!r}")


def _scale(model_kinds: tuple[str, ...], layers: int | None, what: str) -> tuple[str, ...]:
    """The cache-holding kinds of ``model_kinds``, scaled to ``layers`` (see `preset_layers`)."""
    cached = [k for k in model_kinds if k]
    if layers is None or layers == len(cached):
        return tuple(cached)
    kinds = list(dict.fromkeys(cached))
    if not len(kinds) <= layers <= len(cached):
        raise ConfigError(
            f"--layers {layers}: {what} needs between {len(kinds)} (one per kind: "
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
    return _build(model.kinds, _COMPONENTS[name], model.window, layers, f"preset {name!r}",
                  blocks=blocks, block_size=block_size, dtype=dtype, layout=layout)  # fmt: skip


def _build(
    model_kinds: tuple[str, ...],
    components: Mapping[str, tuple[str, tuple[Component, ...]]],
    window: int,
    layers: int | None,
    what: str,
    *,
    blocks: int,
    block_size: int,
    dtype: str,
    layout: str,
) -> CacheSpec:
    """One group per layer kind of ``model_kinds`` (in the order of ``components``), with the
    model's own layer indices, or ``0..N-1`` when scaled to ``layers``."""
    kinds = _scale(model_kinds, layers, what)
    index = [i for i, k in enumerate(model_kinds) if k] if layers is None else list(range(len(kinds)))
    groups = []
    for kind, (group_kind, comps) in components.items():
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
                window=window if group_kind == "sliding" else 0,
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


# -- Hugging Face configurations ------------------------------------------------------------

#: ``layer_types`` / ``layers_block_type`` entries -> akv layer kinds ("" holds no cache).
#: ``linear_attention`` is a Gated DeltaNet or a Mamba2 layer, told apart by the config's fields.
_HF_LAYER_TYPES: dict[str, str] = {
    "full_attention": "full",
    "attention": "full",
    "sliding_attention": "swa",
    "linear_attention": "linear",
    "mamba": "mamba",
    "mamba2": "mamba",
    "mlp": "",
    "moe": "",
}
#: ``hybrid_override_pattern`` characters (Nemotron-H).
_HF_PATTERN: dict[str, str] = {"M": "mamba", "*": "full", "-": "", "E": ""}
#: Model types whose configs leave ``sliding_window_pattern`` to transformers' default.
_HF_DEFAULT_PATTERN: dict[str, int] = {"gemma3": 6, "gemma3_text": 6}


def from_hf_config(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    layers: int | None = None,
    blocks: int = 64,
    block_size: int = 16,
    dtype: str | None = None,
    layout: str = "HND",
) -> CacheSpec:
    """The cache of a model described by its Hugging Face ``config.json``.

    Reads the layer kinds (``layer_types``, ``layers_block_type``, Nemotron-H's
    ``hybrid_override_pattern``, Qwen3-Next's ``full_attention_interval``, Gemma 3's
    ``sliding_window_pattern``, Bamba's ``attn_layer_indices``; otherwise every layer is full
    attention, or MLA with ``kv_lora_rank``, or sliding with a ``sliding_window`` alone),
    KV heads and head dim, the sliding window, the MLA latent (``kv_lora_rank +
    qk_rope_head_dim``), Gated DeltaNet (``linear_*``) and Mamba2 (``mamba_*``, ``n_groups``,
    ``ssm_state_size``, ``conv_kernel``) shapes, and the dtype. A multimodal config's
    ``text_config`` describes its language model. The groups and components are those of
    [`preset`][akv.presets.preset]: the six presets equal what this derives from their
    public configs. No download, and transformers is not imported.

    Args:
        config: the parsed ``config.json``, or its path.
        layers: scale to this many cache-holding layers, keeping every kind and their order.
        blocks: blocks per group pool (state groups: state slots).
        block_size: tokens per block of the token groups.
        dtype: element type of every group (default: the config's ``torch_dtype`` / ``dtype``,
            else ``bfloat16``).
        layout: layout of every group.

    Raises:
        ConfigError: naming the field it cannot read or map (or the file it cannot read).
    """
    cfg = _hf_text_config(_hf_load(config))
    kinds = _hf_kinds(cfg)
    present = set(kinds) - {""}
    comps: dict[str, tuple[str, tuple[Component, ...]]] = {}
    window = 0
    if present & {"full", "swa"}:
        heads, dim = _hf_attention(cfg)
        if "full" in present:
            comps["full"] = ("full", _attn(heads, dim))
        if "swa" in present:
            comps["swa"] = ("sliding", _attn(heads, dim))
            window = _hf_int(cfg, "sliding_window")
    if "mla" in present:
        latent = _hf_int(cfg, "kv_lora_rank") + _hf_int(cfg, "qk_rope_head_dim")
        comps["mla"] = ("mla", (Component(name="latent", units=1, unit_elems=latent, shard="replicate"),))
    if "gdn" in present:
        comps["gdn"] = ("gdn", _gdn(*(_hf_int(cfg, f) for f in (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim"))))  # fmt: skip
    if "mamba" in present:
        comps["mamba"] = ("mamba2", _mamba2(*_hf_mamba(cfg)))
    return _build(
        kinds, comps, window, layers, f"model type {cfg.get('model_type', '?')!r}",
        blocks=blocks, block_size=block_size, dtype=dtype or _hf_dtype(cfg), layout=layout,
    )  # fmt: skip


def _hf_load(config: Mapping[str, Any] | str | os.PathLike[str]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    try:
        with open(config, "rb") as f:
            data = json.loads(f.read())
    except OSError as exc:
        raise ConfigError(
            f"cannot read the model config {os.fspath(config)!r}: {exc.strerror or exc}"
        ) from None
    except ValueError as exc:
        raise ConfigError(f"the model config {os.fspath(config)!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"the model config {os.fspath(config)!r} is not a JSON object")
    return data


def _hf_text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: ``text_config`` of a multimodal config, with the outer
    dtype when it has none of its own."""
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        return cfg
    outer = {k: cfg[k] for k in ("torch_dtype", "dtype") if cfg.get(k) is not None}
    return {**outer, **text}


def _hf_int(cfg: Mapping[str, Any], field: str, default: int | None = None) -> int:
    value = cfg.get(field, default)
    if value is None:
        raise ConfigError(f"model config: no {field!r} (needed for this model type)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model config: {field!r} must be a positive integer, got {value!r}")
    return value


def _hf_first(cfg: Mapping[str, Any], *fields: str) -> str | None:
    return next((f for f in fields if cfg.get(f) is not None), None)


def _hf_kinds(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The kind of every model layer: "full", "swa", "mla", "gdn", "mamba" or "" (no cache)."""
    field = _hf_first(cfg, "layer_types", "layers_block_type")
    if field is not None:
        types = cfg[field]
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ConfigError(f"model config: {field!r} must be a list of layer type names")
        kinds = []
        for i, t in enumerate(types):
            if t not in _HF_LAYER_TYPES:
                raise ConfigError(
                    f"model config: {field}[{i}] = {t!r} is a layer type akv cannot map "
                    f"(known: {', '.join(_HF_LAYER_TYPES)})"
                )
            kinds.append(_HF_LAYER_TYPES[t])
        if "linear" in kinds:
            linear = _hf_linear_kind(cfg, field)
            kinds = [linear if k == "linear" else k for k in kinds]
    elif cfg.get("hybrid_override_pattern") is not None:
        pattern = cfg["hybrid_override_pattern"]
        bad = (
            next((c for c in str(pattern) if c not in _HF_PATTERN), None) if isinstance(pattern, str) else ""
        )
        if bad is not None:
            raise ConfigError(
                f"model config: 'hybrid_override_pattern' holds {bad!r}; akv maps only "
                f"{', '.join(repr(c) for c in _HF_PATTERN)}"
            )
        kinds = [_HF_PATTERN[c] for c in pattern]
    else:
        n = _hf_int(cfg, "num_hidden_layers")
        if cfg.get("kv_lora_rank") is not None:
            kinds = ["mla"] * n
        elif cfg.get("full_attention_interval") is not None:
            every = _hf_int(cfg, "full_attention_interval")
            kinds = ["full" if (i + 1) % every == 0 else _hf_linear_kind(cfg, "full_attention_interval")
                     for i in range(n)]  # fmt: skip
        elif cfg.get("attn_layer_indices") is not None:
            idx = cfg["attn_layer_indices"]
            if not isinstance(idx, list) or not all(isinstance(i, int) and 0 <= i < n for i in idx):
                raise ConfigError(f"model config: 'attn_layer_indices' must list layer indices in [0, {n})")
            kinds = ["full" if i in idx else "mamba" for i in range(n)]
        elif cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True) is not False:
            default = _HF_DEFAULT_PATTERN.get(str(cfg.get("model_type")))
            if cfg.get("sliding_window_pattern") is not None or default is not None:
                every = _hf_int(cfg, "sliding_window_pattern", default)
                kinds = ["full" if (i + 1) % every == 0 else "swa" for i in range(n)]
            else:
                kinds = ["swa"] * n  # a window and no per-layer types: every layer slides
        else:
            kinds = ["full"] * n
    layers = cfg.get("num_hidden_layers")
    if layers is not None and layers != len(kinds):
        raise ConfigError(
            f"model config: 'num_hidden_layers' is {layers} but the layer types describe {len(kinds)} layers"
        )
    if not any(kinds):
        raise ConfigError("model config: no layer holds a KV cache or state")
    return tuple(kinds)


def _hf_linear_kind(cfg: Mapping[str, Any], field: str) -> str:
    """A ``linear_attention`` layer's kind: Gated DeltaNet or Mamba2, from the fields present."""
    if cfg.get("linear_num_value_heads") is not None:
        return "gdn"
    if _hf_first(cfg, "mamba_num_heads", "mamba_n_heads") is not None:
        return "mamba"
    raise ConfigError(
        f"model config: {field!r} names linear-attention layers but neither 'linear_num_value_heads' "
        "(Gated DeltaNet) nor 'mamba_num_heads' (Mamba2) describes their state"
    )


def _hf_attention(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """KV heads and head dim of the attention layers."""
    heads_field = _hf_first(cfg, "num_key_value_heads", "num_attention_heads")
    if heads_field is None:
        raise ConfigError("model config: no 'num_key_value_heads' (nor 'num_attention_heads')")
    heads = _hf_int(cfg, heads_field)
    dim_field = _hf_first(cfg, "head_dim", "attention_head_dim")
    if dim_field is not None:
        return heads, _hf_int(cfg, dim_field)
    hidden, q_heads = _hf_int(cfg, "hidden_size"), _hf_int(cfg, "num_attention_heads")
    if hidden % q_heads:
        raise ConfigError(
            f"model config: no 'head_dim', and 'hidden_size' {hidden} is not a multiple of "
            f"'num_attention_heads' {q_heads}"
        )
    return heads, hidden // q_heads


def _hf_mamba(cfg: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    """Mamba2 heads, head dim, groups, state size and conv kernel (Nemotron-H or Bamba names)."""
    if cfg.get("mamba_n_heads") is not None:  # Bamba
        heads = _hf_int(cfg, "mamba_n_heads")
        head_dim = cfg.get("mamba_d_head", "auto")
        if head_dim == "auto":
            inner = _hf_int(cfg, "mamba_expand") * _hf_int(cfg, "hidden_size")
            if inner % heads:
                raise ConfigError("model config: 'mamba_d_head' is 'auto' but the inner size does not divide")
            head_dim = inner // heads
        else:
            head_dim = _hf_int(cfg, "mamba_d_head")
        names = ("mamba_n_groups", "mamba_d_state", "mamba_d_conv")
    else:
        heads, head_dim = _hf_int(cfg, "mamba_num_heads"), _hf_int(cfg, "mamba_head_dim")
        names = ("n_groups", "ssm_state_size", "conv_kernel")
    groups, state, kernel = (_hf_int(cfg, f) for f in names)
    if kernel < 2:
        raise ConfigError(f"model config: {names[2]!r} must be >= 2 (a conv state holds kernel - 1 taps)")
    return heads, head_dim, groups, state, kernel


def _hf_dtype(cfg: Mapping[str, Any]) -> str:
    field = _hf_first(cfg, "torch_dtype", "dtype")
    if field is None:
        return "bfloat16"
    value = str(cfg[field]).removeprefix("torch.")
    from akv.geometry.cache import DTYPE_SIZES

    if value not in DTYPE_SIZES:
        raise ConfigError(
            f"model config: {field!r} is {value!r}; akv supports {', '.join(sorted(DTYPE_SIZES))} "
            "(or pass dtype=)"
        )
    return value
