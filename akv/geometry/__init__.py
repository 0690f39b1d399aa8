"""Geometry (pure): the description of a rank's paged KV cache and its regions.

`akv.geometry.cache` holds [`CacheSpec`][akv.CacheSpec] (groups of sharded components),
`akv.geometry.spec` the one-group [`KVSpec`][akv.KVSpec], `akv.geometry.layout` where each
unit lives (strides); `akv.geometry.tensors` allocates, checks and views torch tensors.
"""

from akv.geometry.cache import LAYOUTS, CacheSpec, Component, Group
from akv.geometry.spec import COMPAT_FIELDS, DTYPE_SIZES, KVSpec

__all__ = ["COMPAT_FIELDS", "DTYPE_SIZES", "LAYOUTS", "CacheSpec", "Component", "Group", "KVSpec"]
