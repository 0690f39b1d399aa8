"""KV-cache specs: one uniform group of layers (dense or MLA), the common case.

A [`KVSpec`][akv.KVSpec] is shorthand for a one-group [`CacheSpec`][akv.CacheSpec]
(`KVSpec.to_cache`); hybrid models describe several groups with a `CacheSpec`.
A rank's cache is a list of *regions* (one contiguous tensor each), ordered layer-major.
Each region's first axis is the block id. Per layout, one region's tensor shape is:

========================  =========================================================
dense, HND                ``(num_blocks, local_heads, block_size, head_dim)`` (K, V)
dense, NHD                ``(num_blocks, block_size, local_heads, head_dim)`` (K, V)
dense, HND, ``joint_kv``  ``(num_blocks, 2, local_heads, block_size, head_dim)``
dense, NHD, ``joint_kv``  ``(num_blocks, 2, block_size, local_heads, head_dim)``
MLA                       ``(num_blocks, block_size, head_dim)`` (the latent cache)
cross-layer               ``(num_blocks, layers, 2, local_heads, block_size, head_dim)``
head-major                ``(num_blocks, local_heads, layers, 2, block_size, head_dim)``
========================  =========================================================

The ``cross-layer`` and ``head-major`` layouts have one region for the whole cache (see
[`akv.geometry.layout`][akv.geometry.layout]).

Dense layouts without ``joint_kv`` have two regions per layer (K then V); the others one.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from akv import sharding
from akv.errors import ConfigError
from akv.geometry.cache import DTYPE_SIZES, CacheSpec, Component, Group

__all__ = ["COMPAT_FIELDS", "DTYPE_SIZES", "KVSpec"]

#: The spec fields two engines must agree on (block size, pool size and layout are each
#: engine's own; see [`CacheSpec.differences`][akv.CacheSpec.differences]).
COMPAT_FIELDS: tuple[str, ...] = ("layers", "kv_heads", "head_dim", "dtype", "kind")


class KVSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The model-level shape of a paged KV cache plus this engine's pool size.

    Per-rank head counts follow from the TP size (see [`held_heads`][akv.held_heads]).
    Construct with [`KVSpec.create`][akv.KVSpec.create] to validate. Two engines exchange
    blocks when ``COMPAT_FIELDS`` match; ``num_blocks``, ``layout``, ``joint_kv`` and
    ``block_size`` (one a multiple of the other) are each engine's own.

    Attributes:
        layers: transformer layers.
        num_blocks: blocks in this rank's pool (may differ between engines).
        block_size: tokens per block.
        kv_heads: the model's total number of KV heads (1 for MLA).
        head_dim: elements per head (the latent dim for MLA).
        dtype: element type, one of ``DTYPE_SIZES`` (``"bfloat16"``, ``"float16"``, ...).
        kind: ``"dense"`` (K and V per head) or ``"mla"`` (one latent cache, replicated on every rank).
        layout: ``"HND"`` (heads before tokens within a block), ``"NHD"``, ``"cross-layer"`` or
            ``"head-major"`` (see [`akv.geometry.layout`][akv.geometry.layout]).
        joint_kv: K and V in one region per layer instead of two.
    """

    layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    kind: Literal["dense", "mla"] = "dense"
    layout: Literal["HND", "NHD", "cross-layer", "head-major"] = "HND"
    joint_kv: bool = False

    def to_cache(self, name: str = "kv") -> CacheSpec:
        """This spec as a one-group [`CacheSpec`][akv.CacheSpec] (group ``name``)."""
        if self.kind == "mla":
            comps: tuple[Component, ...] = (
                Component(name="latent", units=1, unit_elems=self.head_dim, shard="replicate"),
            )
        else:
            comps = tuple(
                Component(name=n, units=self.kv_heads, unit_elems=self.head_dim, shard="heads")
                for n in ("k", "v")
            )
        group = Group(
            name=name,
            kind="mla" if self.kind == "mla" else "full",
            layers=tuple(range(self.layers)),
            components=comps,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            dtype=self.dtype,
            layout=self.layout,
            joint_kv=self.joint_kv,
        )
        return CacheSpec(groups=(group,))

    @classmethod
    def create(cls, **fields: object) -> KVSpec:
        """Build and validate a spec from the ``fields`` above (keywords).

        Raises [`ConfigError`][akv.errors.ConfigError] naming the bad field.
        """
        try:
            spec = msgspec.convert(fields, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid KV spec: {exc}") from None
        spec.validate()
        return spec

    def validate(self) -> None:
        """Raise [`ConfigError`][akv.errors.ConfigError] if any field is out of range."""
        for name in ("layers", "num_blocks", "block_size", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"KV spec field {name!r} must be >= 1, got {value}")
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(f"unsupported dtype {self.dtype!r}; use one of {sorted(DTYPE_SIZES)}")
        if self.kind == "mla" and self.joint_kv:
            raise ConfigError("an MLA cache has no separate K and V: set joint_kv=False")
        if self.joint_kv and self.layout not in ("HND", "NHD"):
            raise ConfigError(f"joint_kv is for the per-layer layouts (HND, NHD), not {self.layout!r}")

    # -- geometry -------------------------------------------------------------------------

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def regions_per_layer(self) -> int:
        """Regions (tensors) per layer: 2 for dense K/V in separate tensors, else 1 (0 for the
        layouts with one region for every layer)."""
        if self.layout in ("cross-layer", "head-major"):
            return 0
        return 2 if self.kind == "dense" and not self.joint_kv else 1

    @property
    def num_regions(self) -> int:
        """Total number of regions (tensors) of one rank."""
        if self.layout in ("cross-layer", "head-major"):
            return 1
        return self.layers * self.regions_per_layer

    @property
    def planes(self) -> int:
        """K/V planes inside one block of one region (2 for ``joint_kv``, else 1)."""
        return 2 if self.joint_kv else 1

    def local_heads(self, tp_rank: int, tp_size: int) -> int:
        """Number of KV heads rank ``tp_rank`` of a TP group of ``tp_size`` stores (always 1 for MLA)."""
        if self.kind == "mla":
            sharding.check_tp(tp_rank, tp_size)
            return 1
        return len(sharding.held_heads(tp_rank, tp_size, self.kv_heads))

    def head_bytes(self) -> int:
        """Bytes of one head of one plane of one block."""
        return self.block_size * self.head_dim * self.element_size

    def block_bytes(self, tp_rank: int, tp_size: int) -> int:
        """Bytes of one block in one region of rank ``tp_rank`` of ``tp_size``."""
        from akv.geometry.layout import group_layout

        gl = group_layout(self.to_cache().groups[0], tp_rank, tp_size)
        return gl.block_bytes // len(gl.shapes)

    def region_shape(self, tp_rank: int, tp_size: int) -> tuple[int, ...]:
        """The tensor shape of each region of rank ``tp_rank`` of a TP group of ``tp_size``.

        Per layout: dense HND ``(num_blocks, local_heads, block_size, head_dim)`` per K and V
        region; dense NHD ``(num_blocks, block_size, local_heads, head_dim)``; with
        ``joint_kv`` a ``2`` axis (K, V) after ``num_blocks`` in one region per layer; MLA
        ``(num_blocks, block_size, head_dim)``.
        """
        from akv.geometry.layout import group_layout

        return group_layout(self.to_cache().groups[0], tp_rank, tp_size).shapes[0]

    # -- compatibility --------------------------------------------------------------------

    def compat_dict(self) -> dict[str, object]:
        """The fields that must match between two engines."""
        return {name: getattr(self, name) for name in COMPAT_FIELDS}

    def compat_hash(self) -> str:
        """The compat hash of [`to_cache`][akv.KVSpec.to_cache] (what handshakes compare)."""
        return self.to_cache().compat_hash()

    def diff(self, other: KVSpec) -> tuple[str, ...]:
        """Names of the compatibility fields whose values differ from ``other``'s."""
        return tuple(n for n in COMPAT_FIELDS if getattr(self, n) != getattr(other, n))

    def describe_diff(self, other: KVSpec, ours: str, theirs: str) -> str:
        """The fields differing from ``other`` with both values, labelled ``ours`` and ``theirs``.

        For example ``"layers: prefill=4 decode=2"`` for ``ours="prefill", theirs="decode"``.
        """
        return ", ".join(
            f"{f}: {ours}={getattr(self, f)!r} {theirs}={getattr(other, f)!r}" for f in self.diff(other)
        )

    # -- sharding of this model -----------------------------------------------------------

    def notify_ranks(self, decode_rank: int, decode_tp: int, prefill_tp: int) -> tuple[int, ...]:
        """The prefill ranks that ``decode_rank`` of a ``decode_tp`` engine notifies per request,
        reading from an engine of ``prefill_tp`` ranks."""
        return sharding.notify_ranks(
            decode_rank=decode_rank,
            decode_tp=decode_tp,
            prefill_tp=prefill_tp,
            kv_heads=self.kv_heads,
            mla=self.kind == "mla",
        )

    def expected_notifications(self, prefill_rank: int, prefill_tp: int, decode_tp: int) -> int:
        """How many ranks of a ``decode_tp`` engine notify ``prefill_rank`` of a ``prefill_tp``
        engine per request."""
        return sharding.expected_notifications(
            prefill_rank=prefill_rank,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            kv_heads=self.kv_heads,
            mla=self.kind == "mla",
        )

    def check_rank(self, tp_rank: int, tp_size: int) -> None:
        """Raise [`ConfigError`][akv.errors.ConfigError] unless this model can be sharded onto
        ``tp_rank`` of a TP group of ``tp_size``."""
        if self.kind == "dense":
            sharding.held_heads(tp_rank, tp_size, self.kv_heads)
        else:
            sharding.check_tp(tp_rank, tp_size)
