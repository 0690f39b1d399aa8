"""Deterministic KV contents from global indices, for demos, tests and benchmarks.

Byte ``i`` of the element at (layer, K/V, global head, token of the request, dim) of
request ``seed`` gets a hash of those global indices, so any misplaced head, token, layer,
K/V plane or block shows up when a decode rank compares its cache with :func:`expected_blocks`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from akv import tp
from akv.spec import KVSpec

__all__ = ["expected_blocks"]


def expected_blocks(
    spec: KVSpec,
    tp_rank: int,
    tp_size: int,
    region: int,
    seed: int,
    positions: npt.ArrayLike,
) -> npt.NDArray[np.uint8]:
    """The bytes of the blocks at ``positions`` (block index within the request) of one region.

    Returns an array of shape ``(len(positions), block_bytes)`` in the rank's own layout.
    """
    pos = np.asarray(positions, dtype=np.int64)
    seed &= 0xFFFF
    nbytes = spec.head_dim * spec.element_size
    if spec.kind == "mla":
        layer, kvs, heads = region, np.zeros(1, np.int64), np.zeros(1, np.int64)
    else:
        held = tp.held_heads(tp_rank, tp_size, spec.kv_heads)
        heads = np.arange(held.start, held.stop, dtype=np.int64)
        if spec.joint_kv:
            layer, kvs = region, np.arange(2, dtype=np.int64)
        else:
            layer, kvs = region // 2, np.array([region % 2], dtype=np.int64)
    tokens = np.arange(spec.block_size, dtype=np.int64)
    byte = np.arange(nbytes, dtype=np.int64)
    # Axes: (pos, kv, head, token, byte); NHD swaps head and token.
    key = (
        (
            ((seed * 1_000_003 + layer) * 2 + kvs[None, :, None, None, None]) * 4096
            + heads[None, None, :, None, None]
        )
        * 65_536
        + pos[:, None, None, None, None] * spec.block_size
        + tokens[None, None, None, :, None]
    ) * 65_536 + byte[None, None, None, None, :]
    mixed = _mix(key)
    out = mixed.astype(np.uint8)
    if spec.layout == "NHD" and spec.kind == "dense":
        out = out.transpose(0, 1, 3, 2, 4)
    if not spec.joint_kv:
        out = out[:, 0]
    return np.ascontiguousarray(out).reshape(len(pos), -1)


def _mix(key: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    x = key.astype(np.uint64)
    x ^= x >> np.uint64(29)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(32)
    out: npt.NDArray[np.uint64] = x >> np.uint64(24)
    return out
