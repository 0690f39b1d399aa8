"""Axis orders: a layout named by the order of its axes, outermost first (pure).

Owns only the parsing of such an order; `akv.geometry.cache` checks a group's layout with it
and `akv.geometry.layout` turns the order into strides.
"""

from __future__ import annotations

from akv.errors import ConfigError

__all__ = ["AXES", "parse_axes"]


AXES = ("layer", "comp", "block", "unit", "token", "elem")


def parse_axes(layout: str, *, tokens: bool = True) -> tuple[str, ...]:
    """The axes of `layout`, an order of ``layer, comp, block, unit, token, elem``
    (outermost first). ``block``, ``unit`` and ``elem`` (last) are required, ``token`` for token
    groups (`tokens`) only; ``layer`` / ``comp`` left out make one region per layer / component.

    For example vLLM's per-layer ``[2, num_blocks, block_size, heads, dim]`` tensors are
    ``"comp,block,token,unit,elem"``; ``HND`` is ``"block,unit,token,elem"``.
    """
    axes = tuple(a.strip() for a in layout.split(","))
    need = {"block", "unit", "elem"} | ({"token"} if tokens else set())
    allowed = need | {"layer", "comp"}
    if len(set(axes)) != len(axes) or not need <= set(axes) or not set(axes) <= allowed or axes[-1] != "elem":
        raise ConfigError(
            f"layout {layout!r}: give an order of {', '.join(sorted(allowed))} with "
            f"{', '.join(sorted(need))} present and elem last"
        )
    return axes
