"""Allocating and validating KV-cache tensors for a spec, and per-layer views of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from akv.errors import ConfigError
from akv.geometry.cache import as_cache
from akv.geometry.layout import rank_layout

__all__ = ["allocate_kv_cache", "check_kv_cache", "layer_views", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a spec dtype name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"torch has no dtype {name!r}")
    return dtype


def allocate_kv_cache(
    spec: Any, tp_rank: int, tp_size: int, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Zeroed regions for rank ``tp_rank`` of a TP group of ``tp_size``, in the order akv
    expects (group after group; per-layer layouts layer-major, K before V), shaped as
    [`akv.geometry.layout`][akv.geometry.layout] describes.

    Args:
        spec: the cache description (a [`KVSpec`][akv.KVSpec] or [`CacheSpec`][akv.CacheSpec]).
        tp_rank: the rank's index in ``[0, tp_size)``.
        tp_size: the engine's tensor-parallel size.
        device: where to allocate (``"cpu"`` registers as DRAM, ``"cuda:N"`` as VRAM).
    """
    layout = rank_layout(as_cache(spec), tp_rank, tp_size)
    return [
        torch.zeros(shape, dtype=torch_dtype(dtype), device=device)
        for shape, dtype in zip(layout.shapes, layout.dtypes, strict=True)
    ]


def check_kv_cache(tensors: Sequence[torch.Tensor], spec: Any, tp_rank: int, tp_size: int) -> None:
    """Raise [`ConfigError`][akv.errors.ConfigError] unless ``tensors`` match the spec for this rank."""
    cache = as_cache(spec)
    layout = rank_layout(cache, tp_rank, tp_size)
    if len(tensors) != len(layout.shapes):
        per = ", ".join(f"{g.group.name}: {len(g.shapes)}" for g in layout.groups)
        raise ConfigError(f"expected {len(layout.shapes)} KV regions ({per}), got {len(tensors)}")
    for i, (t, shape, dtype) in enumerate(zip(tensors, layout.shapes, layout.dtypes, strict=True)):
        if tuple(t.shape) != shape:
            raise ConfigError(f"KV region {i} has shape {tuple(t.shape)}, spec needs {shape}")
        if t.dtype != torch_dtype(dtype):
            raise ConfigError(f"KV region {i} has dtype {t.dtype}, spec says {dtype}")
        if not t.is_contiguous():
            raise ConfigError(f"KV region {i} is not contiguous")
    if len({t.device for t in tensors}) > 1:
        raise ConfigError("all KV regions of a rank must live on one device")


def layer_views(
    tensors: Sequence[torch.Tensor], spec: Any, tp_rank: int, tp_size: int
) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Per group, per layer, per component: a strided view of this rank's units in `tensors`
    (allocated for `spec` on rank `tp_rank` of `tp_size`).

    Token groups: ``(num_blocks, local_units, block_size, unit_elems)`` (HND order, whatever
    the layout; NHD layouts give the same axes with other strides). State groups:
    ``(num_slots, local_units, unit_elems)``. The views share memory with ``tensors``:
    attention kernels and state updates write through them.
    """
    cache = as_cache(spec)
    layout = rank_layout(cache, tp_rank, tp_size)
    out: dict[str, list[dict[str, torch.Tensor]]] = {}
    for gl in layout.groups:
        g = gl.group
        esize = g.element_size
        per_layer: list[dict[str, torch.Tensor]] = []
        for i in range(len(g.layers)):
            views: dict[str, torch.Tensor] = {}
            for c, p in zip(g.components, gl.placements, strict=True):
                base = tensors[p.regions[i]]
                size: tuple[int, ...]
                stride: tuple[int, ...]
                if g.tokens:
                    size = (g.num_blocks, len(p.units), g.block_size, c.unit_elems)
                    stride = (p.block // esize, p.unit // esize, p.token // esize, 1)
                else:
                    size = (g.num_blocks, len(p.units), c.unit_elems)
                    stride = (p.block // esize, p.unit // esize, 1)
                offset = (p.offset + i * p.layer) // esize
                views[c.name] = base.reshape(-1).as_strided(size, stride, base.storage_offset() + offset)
            per_layer.append(views)
        out[g.name] = per_layer
    return out
