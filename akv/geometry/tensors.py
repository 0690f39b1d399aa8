"""Allocating and validating KV-cache tensors for a spec."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from akv.errors import ConfigError
from akv.geometry.spec import KVSpec

__all__ = ["allocate_kv_cache", "check_kv_cache", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a spec dtype name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"torch has no dtype {name!r}")
    return dtype


def allocate_kv_cache(
    spec: KVSpec, tp_rank: int, tp_size: int, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Zeroed regions for rank ``tp_rank`` of a TP group of ``tp_size``, in the order akv
    expects (layer-major, K before V), shaped by [`KVSpec.region_shape`][akv.KVSpec.region_shape].

    Args:
        spec: the cache description.
        tp_rank: the rank's index in ``[0, tp_size)``.
        tp_size: the engine's tensor-parallel size.
        device: where to allocate (``"cpu"`` registers as DRAM, ``"cuda:N"`` as VRAM).
    """
    shape = spec.region_shape(tp_rank, tp_size)
    dtype = torch_dtype(spec.dtype)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_regions)]


def check_kv_cache(tensors: Sequence[torch.Tensor], spec: KVSpec, tp_rank: int, tp_size: int) -> None:
    """Raise [`ConfigError`][akv.errors.ConfigError] unless ``tensors`` match the spec for this rank."""
    if len(tensors) != spec.num_regions:
        raise ConfigError(
            f"expected {spec.num_regions} KV regions ({spec.layers} layers x {spec.regions_per_layer}), "
            f"got {len(tensors)}"
        )
    shape = spec.region_shape(tp_rank, tp_size)
    dtype = torch_dtype(spec.dtype)
    for i, t in enumerate(tensors):
        if tuple(t.shape) != shape:
            raise ConfigError(f"KV region {i} has shape {tuple(t.shape)}, spec needs {shape}")
        if t.dtype != dtype:
            raise ConfigError(f"KV region {i} has dtype {t.dtype}, spec says {spec.dtype}")
        if not t.is_contiguous():
            raise ConfigError(f"KV region {i} is not contiguous")
    if len({t.device for t in tensors}) > 1:
        raise ConfigError("all KV regions of a rank must live on one device")
