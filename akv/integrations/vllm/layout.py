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

State groups (vLLM's ``MambaSpec``: Mamba2, Gated DeltaNet) hold one slot per block id. vLLM
hands each such layer an int8 ``[slots, 1, 1, page bytes]`` view whose slots sit a padded page
apart (the page of the attention layers sharing the tensor); each page holds the layer's conv
state, then its temporal state. akv describes the layer as one int8 region of whole pages
(``slot_stride``) whose components are the [`StatePiece`][akv.integrations.vllm.layout.StatePiece]s
in page order, so a slot moves in place, padding left out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from akv.errors import ConfigError
from akv.geometry.cache import DTYPE_SIZES, CacheSpec, Component, Group

__all__ = [
    "Content",
    "LayerGroup",
    "StatePiece",
    "content_for_device",
    "describe",
    "layer_index",
    "state_pieces",
]

Content = Literal["token", "block"]

_DTYPES = {getattr(torch, name): name for name in DTYPE_SIZES if hasattr(torch, name)}
_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True, slots=True)
class StatePiece:
    """One piece of a vLLM state page (Mamba2 ``x`` / ``B`` / ``C`` conv channels, its SSM
    state; GDN ``q`` / ``k`` / ``v`` conv channels, its recurrent state), in page order.

    Attributes:
        name: the akv component name.
        units: global units (heads or groups) over all TP ranks.
        unit_bytes: bytes of one unit in one state slot.
        shard: how vLLM spreads the units over TP ranks: ``"split"`` (each rank its share), or
            ``"heads"`` (split when there are at least as many units as ranks, else every rank
            holds them all: a Mamba2 model with one group replicates it on every rank).
    """

    name: str
    units: int
    unit_bytes: int
    shard: Literal["split", "heads"] = "split"


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
        pieces: state groups (``"mamba2"``, ``"gdn"``): the pieces of each slot, in order.
    """

    name: str
    kind: Literal["full", "sliding", "mla", "mamba2", "gdn"]
    layer_names: tuple[str, ...]
    total_kv_heads: int
    head_size: int
    window: int = 0
    pieces: tuple[StatePiece, ...] = ()

    @property
    def state(self) -> bool:
        """True for a state group (one slot per request, never trimmed)."""
        return self.kind in ("mamba2", "gdn")


def _dtype_bytes(dtype: torch.dtype) -> int:
    return int(torch.empty((), dtype=dtype).element_size())


def state_pieces(
    spec: Any, tp_size: int, conv_dim_first: bool, n_groups: int | None = None
) -> tuple[Literal["mamba2", "gdn"], tuple[StatePiece, ...]]:
    """A ``MambaSpec``'s akv kind and the pieces of its page, derived from vLLM's own state
    shapes and dtypes on one of ``tp_size`` ranks (conv state ``(dim, taps)``, as vLLM stores
    it with ``VLLM_SSM_CONV_STATE_LAYOUT=DS``; then the temporal state).

    - Mamba2: conv channels ``x`` (heads x head_dim) | ``B`` | ``C`` (groups x state);
      SSM state ``(heads, head_dim, state)``. ``n_groups`` is the model's own group count
      (its config's ``n_groups``): vLLM splits the groups over the ranks when the TP size
      divides them, and gives every rank the one group of a single-group model. One group per
      rank at TP > 1 can be either, so there ``n_groups`` is required.
    - Gated DeltaNet: conv channels ``q`` | ``k`` (key heads x key dim) | ``v`` (value heads x
      value dim); recurrent state ``(value heads, value dim, key dim)``.
    """
    mtype = getattr(getattr(spec, "mamba_type", None), "name", str(getattr(spec, "mamba_type", "")))
    if mtype not in ("MAMBA2", "GDN_ATTN"):
        raise ConfigError(
            f"AkvConnector: a {mtype} state group: akv moves Mamba2 and Gated DeltaNet state groups"
        )
    if not conv_dim_first:
        raise ConfigError(
            "AkvConnector: vLLM keeps the Mamba conv state as (taps, dim): start every instance with "
            "VLLM_SSM_CONV_STATE_LAYOUT=DS (akv reads each head's conv channels as one run)"
        )
    shapes, dtypes = tuple(tuple(int(x) for x in s) for s in spec.shapes), tuple(spec.dtypes)
    if len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3 or int(spec.num_speculative_blocks):
        raise ConfigError(
            f"AkvConnector: a {mtype} state of shapes {shapes} (speculative slots "
            f"{spec.num_speculative_blocks}): akv moves one conv and one temporal state per layer"
        )
    (dim, taps), (heads, d1, d2) = shapes
    cb, sb = _dtype_bytes(dtypes[0]), _dtype_bytes(dtypes[1])
    if mtype == "MAMBA2":  # ssm (heads, head_dim, state)
        head_dim, state = d1, d2
        rest = dim - heads * head_dim
        groups = rest // (2 * state)
        if groups < 1 or rest != 2 * groups * state:
            raise ConfigError(
                f"AkvConnector: Mamba2 conv dim {dim} is not heads x head_dim + 2 x groups x state"
            )
        if n_groups is None and groups == 1 and tp_size > 1:
            raise ConfigError(
                f"AkvConnector: one Mamba2 group per rank at TP {tp_size} is either {tp_size} groups split "
                "or one group replicated on every rank, and the model config names no n_groups "
                "(n_groups, mamba_n_groups or mamba_ngroups): add it to the model's config.json"
            )
        total = groups * tp_size if n_groups is None else n_groups
        if total != groups * tp_size and not (total == 1 and groups == 1):
            raise ConfigError(
                f"AkvConnector: the model has {n_groups} Mamba2 groups, but each of the {tp_size} "
                f"ranks holds {groups}: akv moves groups split evenly over the ranks or one group "
                "replicated on each"
            )
        pieces = (
            StatePiece("x", heads * tp_size, head_dim * taps * cb),
            StatePiece("B", total, state * taps * cb, shard="heads"),
            StatePiece("C", total, state * taps * cb, shard="heads"),
            StatePiece("ssm", heads * tp_size, head_dim * state * sb),
        )
        return "mamba2", pieces
    v_dim, k_dim = d1, d2  # GDN recurrent state (value heads, value dim, key dim)
    rest = dim - heads * v_dim
    k_heads = rest // (2 * k_dim)
    if k_heads < 1 or rest != 2 * k_heads * k_dim:
        raise ConfigError(
            f"AkvConnector: GDN conv dim {dim} is not 2 x key heads x key dim + value heads x value dim"
        )
    pieces = (
        StatePiece("q", k_heads * tp_size, k_dim * taps * cb),
        StatePiece("k", k_heads * tp_size, k_dim * taps * cb),
        StatePiece("v", heads * tp_size, v_dim * taps * cb),
        StatePiece("state", heads * tp_size, v_dim * k_dim * sb),
    )
    return "gdn", pieces


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


def _state_region(t: torch.Tensor, group: LayerGroup) -> torch.Tensor:
    """One state layer's ``[slots, 1, 1, page bytes]`` int8 view as its whole padded pages
    ``[slots, slot stride]`` (the same memory; the pieces fill each page's start)."""
    if t.dim() != 4 or t.shape[1] != 1 or t.shape[2] != 1 or t.dtype != torch.int8:
        raise ConfigError(
            f"group {group.name!r}: a state tensor is int8 [slots, 1, 1, page bytes], "
            f"got {t.dtype} {tuple(t.shape)}"
        )
    stride = t.stride(0)
    if t.stride(3) != 1 or stride < t.shape[3]:
        raise ConfigError(
            f"group {group.name!r}: state pages of {t.shape[3]} bytes {stride} bytes apart "
            f"(strides {t.stride()}): akv reads each layer's slots in place (use a layer-major layout)"
        )
    if t.storage_offset() + t.shape[0] * stride > t.untyped_storage().nbytes():
        raise ConfigError(
            f"group {group.name!r}: state pages {stride} bytes apart run past the KV allocation: "
            "akv reads each layer's slots in place (use a layer-major layout)"
        )
    return t.as_strided((t.shape[0], stride), (stride, 1))


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
            if g.state:
                view = _state_region(t, g)
                these = f"state:{view.shape[1]}"
            else:
                view, these = _region(t, g, content)
            if axes is None:
                axes, dtype = these, _DTYPES[t.dtype]
                num_blocks = t.shape[0]
                block_size = 1 if g.state else t.shape[1] if g.kind == "mla" else t.shape[2]
            elif these != axes or t.shape[0] != num_blocks:
                raise ConfigError(
                    f"group {g.name!r}: layer {name!r} is laid out unlike the group's first layer"
                )
            regions.append(view)
        slot_stride = 0
        if g.state:
            # one int8 page per slot and layer: conv channels (DS: each channel's taps
            # together), then the temporal state; every piece split on its own heads / groups
            # (a Mamba2 model's single group held whole by every rank)
            comps: tuple[Component, ...] = tuple(
                Component(name=p.name, units=p.units, unit_elems=p.unit_bytes, shard=p.shard, tensor="page")
                for p in g.pieces
            )
            slot_stride = int((axes or "state:0").split(":")[1])
        elif g.kind == "mla":
            comps = (Component(name="latent", units=1, unit_elems=g.head_size, shard="replicate"),)
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
                layout="HND" if g.state else axes or "block,unit,comp,token,elem",
                slot_stride=slot_stride,
            )
        )
    return CacheSpec.create(out_groups), regions
