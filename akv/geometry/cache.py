"""Cache descriptions made of KV-cache groups (pure, no torch).

A model's cache is a [`CacheSpec`][akv.CacheSpec]: named [`Group`][akv.Group]s, one per
kind of layer (full attention, sliding window, MLA latent, Mamba2 state, GDN state). Each
group has its own layers, block size, pool of blocks and block ids per request, and is made
of [`Component`][akv.Component]s: one tensor axis each, sharded over TP with a global
extent of ``units`` (KV heads, latent, conv channels grouped by head or group, state heads).

- ``shard="heads"``: split when ``units >= tp`` (must divide), else replicated on
  ``tp / units`` ranks (must divide): attention KV heads, GQA as usual.
- ``shard="replicate"``: every rank holds every unit (the MLA latent).
- ``shard="split"``: always split, ``units % tp == 0`` (Mamba2 / GDN pieces).

Token groups (``full``, ``sliding``, ``mla``) hold ``block_size`` tokens per block; a unit
holds ``unit_elems`` elements per token. State groups (``mamba2``, ``gdn``) hold one state
slot per block id (``block_size`` 1) and a unit holds ``unit_elems`` elements per slot.

Two engines exchange a group when its *structure* matches (name, kind, layers, window,
dtype, components); block size, pool size and layout are each engine's own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from akv import sharding
from akv.errors import BlockIdError, ConfigError, IncompatiblePeerError
from akv.geometry.axes import parse_axes

__all__ = [
    "LAYOUTS",
    "STATE_KINDS",
    "TOKEN_KINDS",
    "CacheSpec",
    "Component",
    "Group",
    "as_cache",
    "check_block_ids",
    "check_peer",
]

GroupKind = Literal["full", "sliding", "mla", "mamba2", "gdn"]
Shard = Literal["heads", "split", "replicate"]
Layout = Literal["HND", "NHD", "cross-layer", "head-major"]

TOKEN_KINDS = frozenset({"full", "sliding", "mla"})
STATE_KINDS = frozenset({"mamba2", "gdn"})
#: Layout names: per-layer HND / NHD, one region per group with every layer in a block
#: (``cross-layer``), or with every layer of one head together (``head-major``).
LAYOUTS: tuple[str, ...] = ("HND", "NHD", "cross-layer", "head-major")

#: Bytes per element of each supported dtype name.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class Component(msgspec.Struct, frozen=True, kw_only=True):
    """One sharded axis of a group.

    Attributes:
        name: unique within its group (``"k"``, ``"v"``, ``"latent"``, ``"x"``, ``"B"``, ...).
        units: global extent along the sharded axis (heads, groups or channels).
        unit_elems: elements of one unit per token (token groups) or per state slot.
        shard: ``"heads"``, ``"split"`` or ``"replicate"`` (see the module text).
        tensor: state groups only: components naming the same tensor share one region per
            layer, concatenated in order (a Mamba2 conv state holds x, B and C). Empty: its own.
    """

    name: str
    units: int
    unit_elems: int
    shard: Shard = "split"
    tensor: str = ""

    def held(self, rank: int, tp_size: int) -> range:
        """The global units rank ``rank`` of ``tp_size`` holds (raises ConfigError if they do not divide)."""
        return sharding.held_units(rank, tp_size, self.units, self.shard, what=self.name)


class Group(msgspec.Struct, frozen=True, kw_only=True):
    """A KV-cache group: layers of one kind sharing a block table per request.

    Attributes:
        name: unique within the cache (``"full"``, ``"swa"``, ``"mamba"``, ...).
        kind: ``"full"``, ``"sliding"``, ``"mla"``, ``"mamba2"`` or ``"gdn"``.
        layers: the model layer indices of this group, ascending.
        components: the sharded pieces (e.g. ``k`` and ``v``).
        num_blocks: blocks (state slots) in this rank's pool for the group.
        block_size: tokens per block (1 for state groups).
        window: sliding groups: the window in tokens; 0 otherwise.
        dtype: element type, one of ``DTYPE_SIZES``.
        layout: ``"HND"``, ``"NHD"``, ``"cross-layer"``, ``"head-major"``, or an axis order
            describing an engine's own tensors (``"comp,block,token,unit,elem"``; see
            [`parse_axes`][akv.geometry.axes.parse_axes]).
        joint_kv: per-layer layouts: all components in one region per layer.
        slot_stride: state groups whose components all name one tensor, per-layer layout:
            elements from one slot to the next in each layer's region (0: the components
            packed back to back). An engine's own padding (vLLM pads a state page to its
            attention page); like ``layout``, each engine's own.
    """

    name: str
    kind: GroupKind
    layers: tuple[int, ...]
    components: tuple[Component, ...]
    num_blocks: int
    block_size: int = 16
    window: int = 0
    dtype: str = "bfloat16"
    layout: str = "HND"
    joint_kv: bool = False
    slot_stride: int = 0

    @property
    def tokens(self) -> bool:
        """True for token groups (full, sliding, MLA), False for state groups."""
        return self.kind in TOKEN_KINDS

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    def validate(self) -> None:
        """Raise [`ConfigError`][akv.errors.ConfigError] naming the group and field that is out of range."""
        where = f"group {self.name!r}"
        if not self.name:
            raise ConfigError("a group needs a name")
        if not self.layers:
            raise ConfigError(f"{where}: 'layers' is empty")
        if any(x < 0 for x in self.layers) or list(self.layers) != sorted(set(self.layers)):
            raise ConfigError(f"{where}: 'layers' must be distinct ascending layer indices >= 0")
        for field in ("num_blocks", "block_size"):
            if getattr(self, field) < 1:
                raise ConfigError(f"{where}: {field!r} must be >= 1, got {getattr(self, field)}")
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(f"{where}: unsupported dtype {self.dtype!r}; use one of {sorted(DTYPE_SIZES)}")
        if not self.components:
            raise ConfigError(f"{where}: no components")
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ConfigError(f"{where}: component names repeat ({names})")
        for c in self.components:
            if c.units < 1 or c.unit_elems < 1:
                raise ConfigError(f"{where}: component {c.name!r} needs units >= 1 and unit_elems >= 1")
        if self.kind == "sliding" and self.window < 1:
            raise ConfigError(f"{where}: a sliding group needs 'window' (tokens) >= 1")
        if self.kind != "sliding" and self.window:
            raise ConfigError(f"{where}: 'window' is only for sliding groups")
        if self.kind == "mla" and any(c.shard != "replicate" for c in self.components):
            raise ConfigError(f"{where}: MLA components are replicated (shard='replicate')")
        if self.tokens:
            if any(c.tensor for c in self.components):
                raise ConfigError(f"{where}: 'tensor' is only for state groups")
            if self.slot_stride:
                raise ConfigError(f"{where}: slot_stride is for state groups")
        else:
            if self.block_size != 1:
                raise ConfigError(f"{where}: state groups hold one slot per block id: set block_size=1")
            if self.joint_kv:
                raise ConfigError(f"{where}: joint_kv is for attention groups")
            if self.slot_stride < 0:
                raise ConfigError(f"{where}: slot_stride must be >= 0, got {self.slot_stride}")
            if self.slot_stride and (
                len({c.tensor or c.name for c in self.components}) != 1 or self.layout not in ("HND", "NHD")
            ):
                raise ConfigError(
                    f"{where}: slot_stride needs every component in one tensor and a per-layer layout (HND)"
                )
        if "," in self.layout:
            try:
                axes = parse_axes(self.layout, tokens=self.tokens)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            if self.joint_kv:
                raise ConfigError(f"{where}: joint_kv is for the named per-layer layouts")
            if "comp" in axes and len({(c.units, c.unit_elems, c.shard) for c in self.components}) > 1:
                raise ConfigError(f"{where}: a 'comp' axis inside a region needs components of one shape")
        elif self.layout not in LAYOUTS:
            raise ConfigError(
                f"{where}: layout {self.layout!r}: use one of {', '.join(LAYOUTS)} or an axis order"
            )
        uniform = len({(c.units, c.unit_elems, c.shard) for c in self.components}) == 1
        if self.joint_kv and self.kind not in ("full", "sliding"):
            raise ConfigError(f"{where}: joint_kv is for attention groups with K and V")
        if self.joint_kv and (self.layout not in ("HND", "NHD") or not uniform):
            raise ConfigError(
                f"{where}: joint_kv needs a per-layer layout (HND or NHD) and components of one shape"
            )
        if self.tokens and self.layout == "head-major" and not uniform:
            raise ConfigError(f"{where}: the head-major layout needs components of one shape (K and V)")

    def structure(self) -> dict[str, Any]:
        """The fields two engines must agree on (not block size, pool size or layout)."""
        return {
            "kind": self.kind,
            "layers": list(self.layers),
            "window": self.window,
            "dtype": self.dtype,
            "components": [msgspec.structs.asdict(c) for c in self.components],
        }

    def check_rank(self, rank: int, tp_size: int) -> None:
        """Raise [`ConfigError`][akv.errors.ConfigError] unless every component shards onto ``rank`` of ``tp_size``."""
        for c in self.components:
            try:
                c.held(rank, tp_size)
            except ConfigError as exc:
                raise ConfigError(f"group {self.name!r}: {exc}") from None

    def check_ids(self, ids: Sequence[int] | npt.ArrayLike, what: str) -> npt.NDArray[np.int32]:
        """Validate `ids`, one list of this group's block ids (state groups: at most one slot);
        errors start with `what`."""
        arr = check_block_ids(ids, self.num_blocks, f"{what} of group {self.name!r}")
        if not self.tokens and arr.size > 1:
            raise BlockIdError(
                f"{what} of group {self.name!r}: a {self.kind} group holds one state slot per request, "
                f"got {arr.size} ids"
            )
        return arr


class CacheSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A model's KV cache on one engine: its groups, in order.

    Build with [`CacheSpec.create`][akv.CacheSpec.create] (validates), from a preset
    ([`akv.presets.preset`][akv.presets.preset]) or a one-group [`KVSpec`][akv.KVSpec]
    (its [`to_cache`][akv.KVSpec.to_cache]). Block ids of a request are given per
    group as a mapping ``{group name: ids}``; a one-group cache also takes a flat list.

    Attributes:
        groups: the groups, in order (their regions and flat ids follow this order).
    """

    groups: tuple[Group, ...]

    @classmethod
    def create(cls, groups: Sequence[Group | Mapping[str, Any]]) -> CacheSpec:
        """Build and validate a cache from `groups` (`Group`s, or their field mappings as in JSON)."""
        try:
            spec = msgspec.convert({"groups": list(groups)}, cls, from_attributes=True)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid cache description: {exc}") from None
        spec.validate()
        return spec

    @classmethod
    def from_json(cls, data: bytes | str) -> CacheSpec:
        """Parse `data`, the JSON form ``{"groups": [...]}`` (the schema of `Group`, `Component`)."""
        try:
            spec = msgspec.json.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ConfigError(f"invalid cache description: {exc}") from None
        spec.validate()
        return spec

    def to_json(self) -> bytes:
        """The JSON form that [`from_json`][akv.CacheSpec.from_json] reads."""
        return msgspec.json.format(msgspec.json.encode(self))

    def validate(self) -> None:
        """Raise [`ConfigError`][akv.errors.ConfigError] naming what is wrong."""
        if not self.groups:
            raise ConfigError("a cache needs at least one group")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ConfigError(f"group names repeat ({names})")
        seen: set[int] = set()
        for g in self.groups:
            g.validate()
            overlap = seen & set(g.layers)
            if overlap:
                raise ConfigError(f"group {g.name!r}: layers {sorted(overlap)} are in another group too")
            seen |= set(g.layers)
        if self.total_blocks >= 2**31:
            raise ConfigError(f"{self.total_blocks} blocks over all groups exceed 2**31")

    # -- groups and ids -------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Group names, in order."""
        return tuple(g.name for g in self.groups)

    @property
    def layers(self) -> int:
        """Model layers over all groups."""
        return sum(len(g.layers) for g in self.groups)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each group's first id in the rank's flat id space (groups in order)."""
        out, total = [], 0
        for g in self.groups:
            out.append(total)
            total += g.num_blocks
        return tuple(out)

    @property
    def total_blocks(self) -> int:
        """Blocks over all groups: the size of the flat id space."""
        return sum(g.num_blocks for g in self.groups)

    def group(self, name: str) -> Group:
        """The group named ``name`` (ConfigError naming the known ones if none)."""
        for g in self.groups:
            if g.name == name:
                return g
        raise ConfigError(f"no group {name!r}; this cache has {list(self.names)}")

    def per_group(self, ids: Any, what: str) -> tuple[npt.NDArray[np.int32], ...]:
        """Validate a request's block ids `ids` given per group (a mapping), or flat for one
        group; errors start with `what` (e.g. ``"local_block_ids"``).

        Returns one np.int32 array per group, in group order (empty for groups not given).
        """
        if isinstance(ids, Mapping):
            unknown = set(ids) - set(self.names)
            if unknown:
                raise BlockIdError(
                    f"{what}: no group {sorted(unknown, key=repr)}; this cache has {list(self.names)}"
                )
            return tuple(g.check_ids(ids.get(g.name, ()), what) for g in self.groups)
        if len(self.groups) != 1:
            raise BlockIdError(
                f"{what}: this cache has {len(self.groups)} groups {list(self.names)}: "
                "give block ids as a mapping {group name: ids}"
            )
        return (self.groups[0].check_ids(ids, what),)

    def flatten(self, per_group: Sequence[npt.NDArray[np.int32]]) -> npt.NDArray[np.int32]:
        """Map `per_group` (one id array per group, in order) into the rank's flat id space (group offset + id)."""
        if len(per_group) == 1:
            return per_group[0]
        parts = [ids.astype(np.int64) + off for ids, off in zip(per_group, self.offsets, strict=True)]
        return np.concatenate(parts).astype(np.int32) if parts else np.empty(0, np.int32)

    def split(self, flat: npt.NDArray[np.int32]) -> dict[str, npt.NDArray[np.int32]]:
        """The inverse of [`flatten`][akv.CacheSpec.flatten] for ids `flat`: ``{group name: ids}``."""
        out: dict[str, npt.NDArray[np.int32]] = {}
        for g, off in zip(self.groups, self.offsets, strict=True):
            mine = flat[(flat >= off) & (flat < off + g.num_blocks)]
            out[g.name] = (mine - off).astype(np.int32)
        return out

    # -- compatibility --------------------------------------------------------------------

    def structure(self) -> dict[str, Any]:
        """What two engines must agree on: every group's structure, by name, in order."""
        return {"groups": [{"name": g.name, **g.structure()} for g in self.groups]}

    def compat_hash(self) -> str:
        """A short stable hash of [`structure`][akv.CacheSpec.structure], sent in handshakes."""
        return hashlib.sha256(msgspec.json.encode(self.structure())).hexdigest()[:16]

    def differences(self, other: CacheSpec, ours: str, theirs: str) -> list[tuple[str, str]]:
        """``(field path, description)`` of every structural difference from `other`, the values
        labelled `ours` and `theirs` (e.g. ``"decode"``, ``"prefill"``)."""
        out: list[tuple[str, str]] = []
        if self.names != other.names:
            out.append(("groups", f"groups: {ours}={list(self.names)} {theirs}={list(other.names)}"))
            return out
        for a, b in zip(self.groups, other.groups, strict=True):
            sa, sb = a.structure(), b.structure()
            for field in ("kind", "layers", "window", "dtype"):
                if sa[field] != sb[field]:
                    out.append(
                        (
                            f"{a.name}.{field}",
                            f"group {a.name!r} {field}: {ours}={sa[field]!r} {theirs}={sb[field]!r}",
                        )
                    )
            ca, cb = {c.name: c for c in a.components}, {c.name: c for c in b.components}
            if list(ca) != list(cb):
                out.append(
                    (
                        f"{a.name}.components",
                        f"group {a.name!r} components: {ours}={list(ca)} {theirs}={list(cb)}",
                    )
                )
                continue
            for name, c in ca.items():
                for field in ("units", "unit_elems", "shard", "tensor"):
                    va, vb = getattr(c, field), getattr(cb[name], field)
                    if va != vb:
                        out.append(
                            (
                                f"{a.name}.{name}.{field}",
                                f"group {a.name!r} component {name!r} {field}: {ours}={va!r} {theirs}={vb!r}",
                            )
                        )
        return out

    def check_rank(self, rank: int, tp_size: int) -> None:
        """Raise [`ConfigError`][akv.errors.ConfigError] unless every group shards onto ``rank`` of ``tp_size``."""
        sharding.check_tp(rank, tp_size)
        for g in self.groups:
            g.check_rank(rank, tp_size)

    # -- sharding of this model -----------------------------------------------------------

    def notify_ranks(self, decode_rank: int, decode_tp: int, prefill_tp: int) -> tuple[int, ...]:
        """The prefill ranks `decode_rank` of a `decode_tp` engine notifies per request, reading
        from an engine of `prefill_tp` ranks (every prefill rank holding a unit it holds, or
        assigned to it for replicated components)."""
        ranks: set[int] = set()
        for g in self.groups:
            for c in g.components:
                ranks.update(sharding.component_notify(decode_rank, decode_tp, prefill_tp, c.units, c.shard))
        return tuple(sorted(ranks))

    def expected_notifications(self, prefill_rank: int, prefill_tp: int, decode_tp: int) -> int:
        """How many ranks of a ``decode_tp`` engine notify ``prefill_rank`` of a ``prefill_tp`` engine."""
        sharding.check_tp(prefill_rank, prefill_tp)
        return sum(prefill_rank in self.notify_ranks(d, decode_tp, prefill_tp) for d in range(decode_tp))


def as_cache(spec: Any) -> CacheSpec:
    """A [`CacheSpec`][akv.CacheSpec] for a `CacheSpec` (itself) or a one-group `KVSpec`."""
    if isinstance(spec, CacheSpec):
        return spec
    to_cache = getattr(spec, "to_cache", None)
    if to_cache is None:
        raise ConfigError(f"expected a KVSpec or CacheSpec, got {type(spec).__name__}")
    result: CacheSpec = to_cache()
    return result


def check_peer(local: CacheSpec, remote: CacheSpec) -> None:
    """Raise [`IncompatiblePeerError`][akv.errors.IncompatiblePeerError] naming the group and field
    unless blocks of ``remote`` can be read into ``local`` (structure equal, block sizes of
    each token group multiples of each other)."""
    diffs = local.differences(remote, "decode", "prefill")
    if diffs:
        raise IncompatiblePeerError(
            "KV caches differ (" + "; ".join(d for _, d in diffs) + ")", tuple(f for f, _ in diffs)
        )
    for a, b in zip(local.groups, remote.groups, strict=True):
        big, small = max(a.block_size, b.block_size), min(a.block_size, b.block_size)
        if big % small:
            raise IncompatiblePeerError(
                f"group {a.name!r} block size: decode={a.block_size} prefill={b.block_size}; "
                "block sizes must be multiples of each other (change --block-size on one side)",
                (f"{a.name}.block_size",),
            )


def check_block_ids(ids: Sequence[int] | npt.ArrayLike, num_blocks: int, what: str) -> npt.NDArray[np.int32]:
    """Validate one list of block ids; returns them as np.int32 or raises [`BlockIdError`][akv.errors.BlockIdError]."""
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise BlockIdError(f"{what}: not a sequence of integers ({exc})") from None
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise BlockIdError(f"{what}: expected a flat sequence of integers, got {arr.dtype} {arr.shape}")
    # Python's min, max and set are several times cheaper than numpy's reductions and
    # np.unique for the short lists of real requests (a few microseconds a pull).
    if arr.size <= 512:
        listed = arr.tolist()
        lo, hi, distinct = min(listed), max(listed), len(set(listed))
    else:
        lo, hi, distinct = int(arr.min()), int(arr.max()), np.unique(arr).size
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise BlockIdError(f"{what}: block id {bad} is outside [0, {num_blocks})")
    if distinct != arr.size:
        raise BlockIdError(f"{what}: duplicate block ids")
    return arr.astype(np.int32, copy=False)
