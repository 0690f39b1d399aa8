"""Where each unit of each group lives on one rank: regions and strides (pure, no torch).

A rank's cache is a list of *regions* (contiguous tensors), group after group. Each
component of a group is *placed* by strides, in bytes::

    address(layer i, unit u, token t, block b) =
        base[regions[i]] + offset + b * block + i * layer + u * unit + t * token

and one unit of one token is ``run`` contiguous bytes. The plan only ever uses placements,
so any layout expressible by strides works, including an engine's own tensors: a group's
``layout`` may be an axis order such as ``"comp,block,token,unit,elem"`` (vLLM's per-layer
``[2, num_blocks, block_size, heads, dim]``), see [`parse_axes`][akv.geometry.axes.parse_axes].

Layouts of token groups (``lu`` local units, ``bs`` tokens per block, ``e`` unit elements,
``C`` components, ``L`` layers), region shapes:

================  ==================================================  ===================
``HND``           ``(blocks, lu, bs, e)`` per layer and component     per layer
``NHD``           ``(blocks, bs, lu, e)`` per layer and component     per layer
``joint_kv``      ``(blocks, C, lu, bs, e)`` / ``(blocks, C, bs, lu, e)``  per layer
``cross-layer``   ``(blocks, L, C, lu, bs, e)``                       one per group
``head-major``    ``(blocks, lu, L, C, bs, e)``                       one per group
================  ==================================================  ===================

MLA groups (one replicated unit) keep the per-layer shape ``(blocks, bs, e)``. State groups
hold per layer one region ``(slots, n)`` per tensor (components naming one tensor are
concatenated; ``slot_stride`` widens a one-tensor group's ``n`` to an engine's padded slot);
with ``cross-layer`` one region ``(slots, L, n)``; with ``head-major`` one region
``(slots, n)`` holding, component after component, each unit's every layer together (a unit
range of a component is one run).
"""

from __future__ import annotations

from dataclasses import dataclass

from akv.errors import ConfigError
from akv.geometry.axes import AXES, parse_axes
from akv.geometry.cache import CacheSpec, Group

__all__ = ["AXES", "GroupLayout", "Placement", "RankLayout", "group_layout", "parse_axes", "rank_layout"]


@dataclass(frozen=True, slots=True)
class Placement:
    """Strides of one component of one group on one rank (bytes; see the module text).

    Attributes:
        regions: the region index (in the rank's list) of each layer of the group.
        offset: bytes from a region's start to layer 0, unit 0, token 0 of block 0.
        block: bytes between blocks.
        layer: bytes between layers inside one region (0 with a region per layer).
        unit: bytes between units.
        token: bytes between tokens (0 for state groups).
        run: contiguous bytes of one unit of one token.
        units: the global units this rank holds.
    """

    regions: tuple[int, ...]  # region index (in the rank's list) per layer of the group
    offset: int
    block: int
    layer: int
    unit: int
    token: int
    run: int
    units: range  # the global units this rank holds


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """One group on one rank.

    Attributes:
        group: the group.
        shapes: its region shapes, in elements of the group's dtype.
        placements: one `Placement` per component, in order.
    """

    group: Group
    shapes: tuple[tuple[int, ...], ...]
    placements: tuple[Placement, ...]  # one per component, in order

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (or state slot) of this group over all its regions."""
        g = self.group
        tokens = g.block_size if g.tokens else 1
        return sum(len(g.layers) * len(p.units) * tokens * p.run for p in self.placements)


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Every group of a cache on one rank, regions numbered across groups in order.

    Attributes:
        groups: one `GroupLayout` per group.
    """

    groups: tuple[GroupLayout, ...]

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """All region shapes of the rank, in order."""
        return tuple(s for g in self.groups for s in g.shapes)

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtype of each region."""
        return tuple(g.group.dtype for g in self.groups for _ in g.shapes)


def group_layout(group: Group, rank: int, tp_size: int, first_region: int = 0) -> GroupLayout:
    """The regions and placements of ``group`` on ``rank`` of ``tp_size``; region indices
    start at ``first_region``."""
    g = group
    held = [c.held(rank, tp_size) for c in g.components]
    lus = [len(h) for h in held]
    es = [c.unit_elems for c in g.components]
    E = g.element_size
    L, C, nb, bs = len(g.layers), len(g.components), g.num_blocks, g.block_size
    shapes: list[tuple[int, ...]] = []
    places: list[Placement] = []

    def add(regions: list[int], offset: int, block: int, layer: int, unit: int, token: int, ci: int) -> None:
        places.append(
            Placement(
                tuple(first_region + r for r in regions),
                offset,
                block,
                layer,
                unit,
                token,
                es[ci] * E,
                held[ci],
            )
        )

    if "," in g.layout:
        return _axes_layout(g, lus, es, held, first_region)
    if not g.tokens:
        tensors: list[str] = []
        for c in g.components:
            key = c.tensor or c.name
            if key not in tensors:
                tensors.append(key)
        widths = {
            t: sum(
                lu * e for c, lu, e in zip(g.components, lus, es, strict=False) if (c.tensor or c.name) == t
            )
            for t in tensors
        }
        if g.layout == "head-major":  # [slot][component][unit][layer][elems]: a unit range is one run
            total = sum(lu * L * e for lu, e in zip(lus, es, strict=True))
            shapes.append((nb, total))
            off = 0
            for ci in range(C):
                add([0] * L, off * E, total * E, es[ci] * E, L * es[ci] * E, 0, ci)
                off += lus[ci] * L * es[ci]
            return GroupLayout(g, tuple(shapes), tuple(places))
        if g.layout == "cross-layer":
            per_layer = sum(widths.values())
            shapes.append((nb, L, per_layer))
            off = 0
            for ci in range(C):
                add([0] * L, off * E, L * per_layer * E, per_layer * E, es[ci] * E, 0, ci)
                off += lus[ci] * es[ci]
        else:
            if g.slot_stride:  # validated: one tensor; the engine pads each slot
                if g.slot_stride < widths[tensors[0]]:
                    raise ConfigError(
                        f"group {g.name!r}: slot_stride {g.slot_stride} is below the "
                        f"{widths[tensors[0]]} elements of a slot on rank {rank} of {tp_size}"
                    )
                widths[tensors[0]] = g.slot_stride
            for _ in range(L):
                for t in tensors:
                    shapes.append((nb, widths[t]))
            used: dict[str, int] = dict.fromkeys(tensors, 0)
            for ci, c in enumerate(g.components):
                t = c.tensor or c.name
                ti = tensors.index(t)
                regions = [i * len(tensors) + ti for i in range(L)]
                add(regions, used[t] * E, widths[t] * E, 0, es[ci] * E, 0, ci)
                used[t] += lus[ci] * es[ci]
        return GroupLayout(g, tuple(shapes), tuple(places))

    if g.kind == "mla" and g.layout in ("HND", "NHD"):
        for _ in range(L):
            for ci in range(C):
                shapes.append((nb, bs, lus[ci] * es[ci]))
        for ci in range(C):
            add(
                [i * C + ci for i in range(L)],
                0,
                bs * lus[ci] * es[ci] * E,
                0,
                es[ci] * E,
                lus[ci] * es[ci] * E,
                ci,
            )
        return GroupLayout(g, tuple(shapes), tuple(places))

    if g.layout in ("HND", "NHD") and not g.joint_kv:
        for _ in range(L):
            for ci in range(C):
                lu, e = lus[ci], es[ci]
                shapes.append((nb, lu, bs, e) if g.layout == "HND" else (nb, bs, lu, e))
        for ci in range(C):
            lu, e = lus[ci], es[ci]
            unit, token = (bs * e * E, e * E) if g.layout == "HND" else (e * E, lu * e * E)
            add([i * C + ci for i in range(L)], 0, lu * bs * e * E, 0, unit, token, ci)
        return GroupLayout(g, tuple(shapes), tuple(places))

    lu, e = lus[0], es[0]
    if g.joint_kv:  # validated: per-layer layout, uniform components
        for _ in range(L):
            shapes.append((nb, C, lu, bs, e) if g.layout == "HND" else (nb, C, bs, lu, e))
        unit, token = (bs * e * E, e * E) if g.layout == "HND" else (e * E, lu * e * E)
        for ci in range(C):
            add(list(range(L)), ci * lu * bs * e * E, C * lu * bs * e * E, 0, unit, token, ci)
        return GroupLayout(g, tuple(shapes), tuple(places))

    if g.layout == "cross-layer":
        per_layer = sum(lus[ci] * bs * es[ci] for ci in range(C))
        if len(set(lus)) == 1 and len(set(es)) == 1:
            shapes.append((nb, L, C, lu, bs, e))
        else:
            shapes.append((nb, L, per_layer))
        off = 0
        for ci in range(C):
            add([0] * L, off * E, L * per_layer * E, per_layer * E, bs * es[ci] * E, es[ci] * E, ci)
            off += lus[ci] * bs * es[ci]
        return GroupLayout(g, tuple(shapes), tuple(places))

    # head-major: [block][unit][layer][component][token][elems]; validated uniform
    shapes.append((nb, lu, L, C, bs, e))
    for ci in range(C):
        add([0] * L, ci * bs * e * E, lu * L * C * bs * e * E, C * bs * e * E, L * C * bs * e * E, e * E, ci)
    return GroupLayout(g, tuple(shapes), tuple(places))


def _axes_layout(
    g: Group, lus: list[int], es: list[int], held: list[range], first_region: int
) -> GroupLayout:
    """A layout given as an axis order (see `parse_axes`): strides follow from the sizes."""
    axes = parse_axes(g.layout, tokens=g.tokens)
    E, L, C = g.element_size, len(g.layers), len(g.components)
    if "comp" in axes and (len(set(lus)) > 1 or len(set(es)) > 1):
        raise ConfigError(f"group {g.name!r}: a 'comp' axis inside a region needs components of one shape")
    shapes: list[tuple[int, ...]] = []
    places: list[Placement] = []
    per_layer, per_comp = "layer" not in axes, "comp" not in axes
    for ci in range(C):
        size = {
            "block": g.num_blocks,
            "layer": L,
            "comp": C,
            "unit": lus[ci],
            "token": g.block_size,
            "elem": es[ci],
        }
        stride: dict[str, int] = {}
        acc = E
        for axis in reversed(axes):
            stride[axis] = acc
            acc *= size[axis]
        shape = tuple(size[a] for a in axes)
        if per_layer and per_comp:
            regions = [i * C + ci for i in range(L)]
        elif per_layer:
            regions = list(range(L))
        elif per_comp:
            regions = [ci] * L
        else:
            regions = [0] * L
        places.append(
            Placement(
                tuple(first_region + r for r in regions),
                ci * stride["comp"] if "comp" in axes else 0,
                stride["block"],
                stride.get("layer", 0),
                stride["unit"],
                stride.get("token", 0),
                es[ci] * E,
                held[ci],
            )
        )
        shapes.append(shape)  # per component; equal for all when 'comp' is an axis
    # one region per (layer, component), layer-major; per layer; per component; or one
    per_region = [shapes[ci] for _ in range(L if per_layer else 1) for ci in range(C if per_comp else 1)]
    return GroupLayout(g, tuple(per_region), tuple(places))


def rank_layout(cache: CacheSpec, rank: int, tp_size: int) -> RankLayout:
    """Every group of ``cache`` on ``rank`` of ``tp_size``, regions numbered across groups."""
    out: list[GroupLayout] = []
    first = 0
    for g in cache.groups:
        gl = group_layout(g, rank, tp_size, first)
        out.append(gl)
        first += len(gl.shapes)
    return RankLayout(tuple(out))
