"""Transfer plans: descriptor tables built once per remote engine, indices per request. Pure.

A *table* describes, for one side of a read, one segment of every block of every region:
row ``s`` of the ``(S, 5)`` int64 array ``(addr, len, device, stride, count)`` stands for
``count`` descriptors of ``len`` bytes, ``stride`` bytes apart (NIXL's strided form), so
descriptor ``s * count + block`` is segment ``s`` of block ``block``. Both sides of a read
use tables with the same segment order, so a request's indices are
``seg * num_blocks + block_ids`` on each side: contiguous block ids become contiguous
indices, and where the bytes are contiguous too (whole blocks) NIXL merges them.

Whole-block tables have one segment per region. Head-sliced tables (HND only) have one
segment per region and K/V plane, covering a contiguous range of heads.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from akv import sharding
from akv.errors import BlockIdError, ConfigError, IncompatiblePeerError, LayoutError
from akv.geometry.spec import KVSpec

__all__ = [
    "RankMemory",
    "ReadOp",
    "RequestReads",
    "TableKey",
    "TransferPlan",
    "build_table",
    "check_block_ids",
    "expand_table",
    "request_key",
]

IndexArray = npt.NDArray[np.int32]

#: ``("local", heads)`` or ``("remote", rank, heads)``; ``heads`` is None for whole blocks.
TableKey = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Where one rank's regions live: what a handshake tells the peer."""

    tp_rank: int
    tp_size: int
    region_addrs: tuple[int, ...]
    device_id: int = 0


def request_key(request_id: str) -> int:
    """A key for spreading replica choices; stable across processes (unlike ``hash``)."""
    return zlib.crc32(request_id.encode())


def build_table(spec: KVSpec, memory: RankMemory, heads: range | None) -> npt.NDArray[np.int64]:
    """The strided table of one rank for whole blocks (``heads=None``) or a head range."""
    if len(memory.region_addrs) != spec.num_regions:
        raise ConfigError(
            f"rank {memory.tp_rank} has {len(memory.region_addrs)} regions, spec needs {spec.num_regions}"
        )
    block = spec.block_bytes(memory.tp_rank, memory.tp_size)
    addrs = np.asarray(memory.region_addrs, dtype=np.int64)
    if heads is None:
        rows = np.empty((len(addrs), 5), dtype=np.int64)
        rows[:, 0] = addrs
        rows[:, 1] = block
    else:
        if spec.layout != "HND":
            raise LayoutError(
                "head-sliced reads need the HND layout (a head range of an NHD block is not "
                "contiguous); use equal TP sizes or allocate the cache as HND"
            )
        local = spec.local_heads(memory.tp_rank, memory.tp_size)
        if not (0 <= heads.start < heads.stop <= local):
            raise ConfigError(f"head range {heads} outside [0, {local}) of rank {memory.tp_rank}")
        hb = spec.head_bytes()
        plane = local * hb
        offsets = np.arange(spec.planes, dtype=np.int64) * plane + heads.start * hb
        rows = np.empty((len(addrs) * spec.planes, 5), dtype=np.int64)
        rows[:, 0] = (addrs[:, None] + offsets[None, :]).ravel()
        rows[:, 1] = len(heads) * hb
    rows[:, 2] = memory.device_id
    rows[:, 3] = block
    rows[:, 4] = spec.num_blocks
    return rows


def expand_table(table: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The ``(N, 3)`` form ``(addr, len, device)`` of a strided table, one row a descriptor."""
    count = int(table[0, 4]) if len(table) else 0
    blocks = np.arange(count, dtype=np.int64)
    out = np.empty((len(table) * count, 3), dtype=np.int64)
    out[:, 0] = (table[:, 0:1] + blocks[None, :] * table[:, 3:4]).ravel()
    out[:, 1] = np.repeat(table[:, 1], count)
    out[:, 2] = np.repeat(table[:, 2], count)
    return out


def check_block_ids(ids: Sequence[int] | npt.ArrayLike, num_blocks: int, what: str) -> IndexArray:
    """Validate one list of block ids; returns them as np.int32 or raises [`BlockIdError`][akv.errors.BlockIdError]."""
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise BlockIdError(f"{what}: not a sequence of integers ({exc})") from None
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise BlockIdError(f"{what}: expected a flat sequence of integers, got {arr.dtype} {arr.shape}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise BlockIdError(f"{what}: block id {bad} is outside [0, {num_blocks})")
    # A set is several times cheaper than np.unique for the short lists of real requests.
    distinct = len(set(arr.tolist())) if arr.size <= 512 else np.unique(arr).size
    if distinct != arr.size:
        raise BlockIdError(f"{what}: duplicate block ids")
    return arr.astype(np.int32, copy=False)


@dataclass(frozen=True, slots=True)
class ReadOp:
    """One read of a request: which tables, and how to turn block ids into indices."""

    remote_rank: int
    local_table: TableKey
    remote_table: TableKey
    segments: int
    bytes_per_block: int
    local_offsets: IndexArray  # (segments, 1): seg * local num_blocks
    remote_offsets: IndexArray  # (segments, 1): seg * remote num_blocks


@dataclass(frozen=True, slots=True)
class RequestReads:
    """A request's reads for one request key, and the ranks notified without a read."""

    ops: tuple[ReadOp, ...]
    standalone_notify: tuple[int, ...]
    bytes_per_block: int = 0  # summed over ops: a request moves this many bytes per local block
    segments: int = 0  # descriptors per local block, summed over ops


class TransferPlan:
    """Everything a decode rank needs to read from one prefill engine, built at handshake.

    ``tables`` maps table keys to strided tables to prepare once; `reads` picks the
    reads for a request key and `indices` turns block ids into np.int32 indices.
    """

    def __init__(
        self,
        *,
        local_spec: KVSpec,
        local: RankMemory,
        remote_spec: KVSpec,
        remote: dict[int, RankMemory],
    ) -> None:
        differ = local_spec.diff(remote_spec)
        if differ:
            detail = local_spec.describe_diff(remote_spec, "local", "remote")
            raise IncompatiblePeerError(f"KV specs differ ({detail})", differ)
        self.local_spec = local_spec
        self.remote_spec = remote_spec
        self.local = local
        self.remote = remote
        self.decode_tp = local.tp_size
        self.prefill_tp = next(iter(remote.values())).tp_size if remote else 0
        mla = local_spec.kind == "mla"
        d, dt, pt, h = local.tp_rank, local.tp_size, self.prefill_tp, local_spec.kv_heads
        self.notify: tuple[int, ...] = local_spec.notify_ranks(d, dt, pt)
        missing = sorted(set(self.notify) - set(remote))
        if missing:
            raise ConfigError(f"no memory description for prefill ranks {missing}")
        period = sharding.read_period(decode_rank=d, decode_tp=dt, prefill_tp=pt, kv_heads=h, mla=mla)
        self.tables: dict[TableKey, npt.NDArray[np.int64]] = {}
        self.variants: tuple[RequestReads, ...] = tuple(
            self._variant(
                sharding.plan_reads(
                    decode_rank=d, decode_tp=dt, prefill_tp=pt, kv_heads=h, mla=mla, request_key=k
                )
            )
            for k in range(period)
        )
        total = sum(len(t) * int(t[0, 4]) for t in self.tables.values() if len(t))
        if total >= 2**31:
            raise ConfigError(f"{total} descriptors exceed NIXL's 32-bit index space")

    def _table(self, key: TableKey, spec: KVSpec, memory: RankMemory, heads: range | None) -> None:
        if key not in self.tables:
            self.tables[key] = build_table(spec, memory, heads)

    def _variant(self, plan: sharding.ReadPlan) -> RequestReads:
        local_all = self.local_spec.local_heads(self.local.tp_rank, self.local.tp_size)
        ops = []
        for read in plan.reads:
            mem = self.remote[read.remote_rank]
            remote_all = self.remote_spec.local_heads(read.remote_rank, self.prefill_tp)
            whole_l = len(read.local_heads) == local_all
            whole_r = len(read.remote_heads) == remote_all
            # One plane per region: a side holding all its heads reads whole blocks.
            single = self.local_spec.planes == 1
            lheads = None if whole_l and (whole_r or single) else read.local_heads
            rheads = None if whole_r and (whole_l or single) else read.remote_heads
            lkey: TableKey = ("local", lheads)
            rkey: TableKey = ("remote", read.remote_rank, rheads)
            self._table(lkey, self.local_spec, self.local, lheads)
            self._table(rkey, self.remote_spec, mem, rheads)
            ltab, rtab = self.tables[lkey], self.tables[rkey]
            segs = len(ltab)
            if len(rtab) != segs or not np.array_equal(ltab[:, 1], rtab[:, 1]):
                raise LayoutError(f"segment shapes differ between local and remote rank {read.remote_rank}")
            ops.append(
                ReadOp(
                    remote_rank=read.remote_rank,
                    local_table=lkey,
                    remote_table=rkey,
                    segments=segs,
                    bytes_per_block=int(ltab[:, 1].sum()),
                    local_offsets=(np.arange(segs, dtype=np.int32) * self.local_spec.num_blocks)[:, None],
                    remote_offsets=(np.arange(segs, dtype=np.int32) * self.remote_spec.num_blocks)[:, None],
                )
            )
        read_ranks = {op.remote_rank for op in ops}
        return RequestReads(
            tuple(ops),
            tuple(r for r in plan.notify if r not in read_ranks),
            sum(op.bytes_per_block for op in ops),
            sum(op.segments for op in ops),
        )

    def reads(self, key: int) -> RequestReads:
        """The reads for a request key (see `request_key`)."""
        return self.variants[key % len(self.variants)]

    def block_ids(
        self,
        local_ids: Sequence[int] | npt.ArrayLike,
        remote_ids: Sequence[int] | npt.ArrayLike,
        *,
        tail: bool = True,
    ) -> tuple[IndexArray, IndexArray]:
        """Validate a request's block ids; on a partial prefix hit keep the remote tail
        (``tail=False``: return every remote id).

        Raises [`BlockIdError`][akv.errors.BlockIdError] for bad ids or more local than remote blocks.
        """
        local = check_block_ids(local_ids, self.local_spec.num_blocks, "local_block_ids")
        remote = check_block_ids(remote_ids, self.remote_spec.num_blocks, "remote_block_ids")
        if local.size > remote.size:
            raise BlockIdError(
                f"{local.size} local blocks but only {remote.size} remote blocks: "
                "a decode rank cannot receive more blocks than the prefill rank exposed"
            )
        if tail and local.size < remote.size:  # partial prefix hit: the first blocks are cached locally
            remote = remote[remote.size - local.size :]
        return local, remote

    @staticmethod
    def indices(op: ReadOp, local: IndexArray, remote: IndexArray) -> tuple[IndexArray, IndexArray]:
        """The local and remote descriptor indices of one read (np.int32, same length)."""
        return (
            (op.local_offsets + local[None, :]).ravel(),
            (op.remote_offsets + remote[None, :]).ravel(),
        )
