"""vLLM's KV-cache tensors as akv's cache description, without copying (no vLLM import).

vLLM hands a worker one tensor per attention layer. Its logical shape is
``[blocks, kv_heads, block_size, content]`` for K/V attention (``content`` is
``2 * head_size``) and ``[blocks, block_size, latent]`` for MLA; the *physical* order of those
axes follows the engine's KV-cache layout and shows in the strides. What ``content`` holds
depends on the attention backend:

- ``"token"`` (CUDA backends: FlashAttention, FlashInfer, Triton): each token's K then V,
  ``[..., token, (K|V), head_size]``;
- ``"block"`` (vLLM's CPU backend): each (block, head) holds all its tokens' K, then all
  their V, ``[..., (K|V), token, head_size]`` (the tensor is read as
  ``[blocks, heads, 2 * block_size, head_size]`` and chunked in two).

[`describe`][akv.integrations.vllm.layout.describe] turns the tensors of each vLLM KV-cache
group into an akv [`Group`][akv.Group] whose ``layout`` is an axis order, and each tensor into
a view with exactly that order (the same memory), so akv's plan reads head slices and blocks
in place. Layouts that put blocks outside layers (one allocation for every layer) are
refused with a [`ConfigError`][akv.errors.ConfigError]: the connector asks vLLM for a
layer-major layout.

vLLM's hybrid KV-cache allocator gives one tensor to several layers, each of a different
KV-cache group (``KVCacheTensor.shared_by``): the groups draw their blocks from one pool, so a
block id belongs to one group at a time and the layers never use the same block at once.
Each such layer still gets a region of its own (several regions then alias one tensor), and
akv reads each group's blocks through its own layers' regions. Two layers of one group
sharing a tensor would write the same blocks, and are refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from akv.errors import ConfigError
from akv.geometry.cache import DTYPE_SIZES, CacheSpec, Component, Group

__all__ = ["Content", "LayerGroup", "content_for_device", "describe", "layer_index"]

Content = Literal["token", "block"]

_DTYPES = {getattr(torch, name): name for name in DTYPE_SIZES if hasattr(torch, name)}
_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """One vLLM KV-cache group, as far as akv needs it.

    Attributes:
        name: the akv group name (the same on every instance of one model).
        kind: ``"full"``, ``"sliding"`` or ``"mla"``.
        layer_names: vLLM's layer names of the group (any order; sorted by layer index).
        total_kv_heads: the model's KV heads (1 for MLA).
        head_size: elements per head (the latent size for MLA).
        window: sliding groups: the window in tokens.
    """

    name: str
    kind: Literal["full", "sliding", "mla"]
    layer_names: tuple[str, ...]
    total_kv_heads: int
    head_size: int
    window: int = 0


def layer_index(name: str) -> int:
    """The model layer index in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    m = _LAYER_RE.search(name)
    if m is None:
        raise ConfigError(f"vLLM layer name {name!r} holds no layer index")
    return int(m.group(1))


def content_for_device(device_type: str) -> Content:
    """What a K/V tensor's last axis holds on vLLM's attention backends of ``device_type``."""
    return "block" if device_type == "cpu" else "token"


def _physical_order(t: torch.Tensor) -> list[int]:
    """The tensor's axes, outermost first (by stride; a size-1 axis may stand anywhere)."""
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    if not t.permute(order).is_contiguous():
        raise ConfigError(
            f"a KV tensor of shape {tuple(t.shape)} and strides {t.stride()} is not a permutation of a "
            "dense array: akv reads each layer's tensor in place (use a layer-major KV-cache layout)"
        )
    return order


def _region(t: torch.Tensor, group: LayerGroup, content: Content) -> tuple[torch.Tensor, str]:
    """One layer's tensor as (a view in akv's axis order, that axis order)."""
    if group.kind == "mla":
        if t.dim() != 3:
            raise ConfigError(
                f"group {group.name!r}: an MLA tensor is [blocks, block_size, latent], got {tuple(t.shape)}"
            )
        names = ["block", "token", "unit,elem"]
        order = _physical_order(t)
        if order[-1] != 2:
            raise ConfigError(f"group {group.name!r}: the MLA latent must be innermost, strides {t.stride()}")
        view = t.permute(order)
        return view.reshape(*view.shape[:-1], 1, view.shape[-1]), ",".join(names[d] for d in order)
    if t.dim() != 4:
        raise ConfigError(
            f"group {group.name!r}: a K/V tensor is [blocks, kv_heads, block_size, 2 * head_size], got {tuple(t.shape)}"
        )
    if t.shape[-1] != 2 * group.head_size:
        raise ConfigError(
            f"group {group.name!r}: the last axis holds K and V ({2 * group.head_size} elements), got {t.shape[-1]}"
        )
    order = _physical_order(t)
    view = t.permute(order)
    hs = group.head_size
    dims = {0: "block", 1: "unit", 2: "token"}
    if content == "token":
        if order[-1] != 3:
            raise ConfigError(f"group {group.name!r}: K/V content must be innermost, strides {t.stride()}")
        axes = [dims[d] if d != 3 else "comp,elem" for d in order]
        return view.reshape(*view.shape[:-1], 2, hs), ",".join(axes)
    if order[-2:] != [2, 3]:
        raise ConfigError(
            f"group {group.name!r}: vLLM's CPU layout keeps each block's tokens and K/V innermost; "
            f"strides {t.stride()} do not"
        )
    outer = [dims[d] for d in order[:-2]]
    return view.reshape(*view.shape[:-2], 2, t.shape[2], hs), ",".join([*outer, "comp", "token", "elem"])


def describe(
    kv_caches: Mapping[str, torch.Tensor],
    groups: Sequence[LayerGroup],
    *,
    content: Content,
) -> tuple[CacheSpec, list[torch.Tensor]]:
    """The akv cache description of vLLM's per-layer tensors, and the tensors as akv's regions.

    Args:
        kv_caches: vLLM's ``register_kv_caches`` argument, layer name -> tensor.
        groups: vLLM's KV-cache groups (each layer in at most one; layers of different
            groups may share one tensor, see the module text).
        content: what the K/V tensors' last axis holds (see the module text).

    Raises:
        ConfigError: a tensor that akv cannot read in place, layers named twice or missing,
            an unsupported dtype; the message names the group or layer.
    """
    out_groups: list[Group] = []
    regions: list[torch.Tensor] = []
    seen: dict[int, tuple[str, str]] = {}  # tensor address -> (group, layer) first using it
    for g in groups:
        names = sorted(g.layer_names, key=layer_index)
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ConfigError(f"group {g.name!r}: vLLM registered no KV tensor for layers {missing}")
        layers = tuple(layer_index(n) for n in names)
        if len(set(layers)) != len(layers):
            raise ConfigError(f"group {g.name!r}: two layers share a layer index ({names})")
        axes: str | None = None
        block_size = num_blocks = 0
        dtype = ""
        for name in names:
            t = kv_caches[name]
            ptr = t.data_ptr()
            if ptr in seen and seen[ptr][0] == g.name:
                raise ConfigError(
                    f"layers {seen[ptr][1]!r} and {name!r} of group {g.name!r} share one KV tensor: "
                    "akv moves each layer of a group from its own"
                )
            seen.setdefault(ptr, (g.name, name))
            if t.dtype not in _DTYPES:
                raise ConfigError(
                    f"layer {name!r}: KV dtype {t.dtype} is not one akv moves ({sorted(DTYPE_SIZES)})"
                )
            view, these = _region(t, g, content)
            if axes is None:
                axes, dtype = these, _DTYPES[t.dtype]
                num_blocks = t.shape[0]
                block_size = t.shape[1] if g.kind == "mla" else t.shape[2]
            elif these != axes or t.shape[0] != num_blocks:
                raise ConfigError(
                    f"group {g.name!r}: layer {name!r} is laid out unlike the group's first layer"
                )
            regions.append(view)
        if g.kind == "mla":
            comps: tuple[Component, ...] = (
                Component(name="latent", units=1, unit_elems=g.head_size, shard="replicate"),
            )
        else:
            comps = tuple(
                Component(name=c, units=g.total_kv_heads, unit_elems=g.head_size, shard="heads")
                for c in ("k", "v")
            )
        out_groups.append(
            Group(
                name=g.name,
                kind=g.kind,
                layers=layers,
                components=comps,
                num_blocks=num_blocks,
                block_size=block_size,
                window=g.window,
                dtype=dtype,
                layout=axes or "block,unit,comp,token,elem",
            )
        )
    return CacheSpec.create(out_groups), regions
