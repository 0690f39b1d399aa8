"""Geometry (pure): the description of a rank's paged KV cache and its regions.

`akv.geometry.spec` holds [`KVSpec`][akv.KVSpec] (no torch); `akv.geometry.tensors`
allocates and checks torch tensors for a spec (imports torch).
"""

from akv.geometry.spec import COMPAT_FIELDS, DTYPE_SIZES, KVSpec

__all__ = ["COMPAT_FIELDS", "DTYPE_SIZES", "KVSpec"]
