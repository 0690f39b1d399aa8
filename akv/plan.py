"""Transfer plans: byte runs matched between two geometries, built once per remote engine. Pure.

For every group, the plan enumerates the *atoms* a decode rank reads (one unit of one
component of one layer for one token, ``run`` bytes) with their address on both sides (see
[`akv.geometry.layout`][akv.geometry.layout]), and merges neighbours contiguous on *both*
sides into runs. Each run becomes one row of a strided table ``(addr, len, device,
block_stride, count)``: NIXL's compressed form for ``count`` descriptors, one per block.
Descriptor ``b`` of a row sits at index ``row_base + b``, so a request's indices are
``row_base + block_id``.

Block sizes may differ between the two sides when one divides the other: tokens are moved
in *chunks* of the smaller block size, and the chunk's position inside the larger block
(its *pattern*) picks the rows. A head-major or cross-layer layout on both sides merges a
whole block's share of a rank into one run, for any pair of TP sizes.

Which tokens a request reads, per group (``n`` tokens, ``g`` the chunk size): each id list
names the *last* blocks of the sequence (all of them for a full group on the prefill side;
after a partial prefix hit, fewer on the decode side). Chunks from the first local token
(or ``n - window`` for sliding groups, whichever is later) up to the chunk holding token
``n - 1`` are read; state groups read their one slot, never trimmed.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from akv import sharding
from akv.errors import BlockIdError, ConfigError, IncompatiblePeerError
from akv.geometry.cache import Group, as_cache, check_block_ids, check_peer
from akv.geometry.layout import GroupLayout, Placement, rank_layout

__all__ = [
    "Chunks",
    "GroupRead",
    "Prepared",
    "RankMemory",
    "ReadOp",
    "RequestReads",
    "TableKey",
    "TransferPlan",
    "check_block_ids",
    "check_peer",
    "chunks",
    "expand_table",
    "request_key",
]

IndexArray = npt.NDArray[np.int32]

#: ``("local", digest)`` or ``("remote", rank, digest)`` of the table's rows.
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


def expand_table(table: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The ``(N, 3)`` form ``(addr, len, device)`` of a strided table, one row a descriptor."""
    counts = table[:, 4]
    n = int(counts.sum())
    rows = np.repeat(np.arange(len(table)), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    block = np.arange(n, dtype=np.int64) - starts
    out = np.empty((n, 3), dtype=np.int64)
    out[:, 0] = table[rows, 0] + block * table[rows, 3]
    out[:, 1] = table[rows, 1]
    out[:, 2] = table[rows, 2]
    return out


# -- chunks of a request --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Chunks:
    """The chunks one group of a request reads: local block, remote block and pattern each."""

    local: IndexArray
    remote: IndexArray
    pattern: IndexArray | None  # None: every chunk has pattern 0
    offset: int = 0  # chunk 0's first token, counted from the first token of the exposed blocks

    @property
    def size(self) -> int:
        """Number of chunks."""
        return int(self.local.size)


def chunks(
    local_group: Group,
    remote_group: Group,
    local_ids: IndexArray,
    remote_ids: IndexArray,
    num_tokens: int | None,
) -> Chunks:
    """The chunks of one group for one request (see the module text); BlockIdError if the
    ids cannot hold the tokens to read."""
    name = local_group.name
    if not local_group.tokens:
        if local_ids.size == 0:
            return Chunks(local_ids, remote_ids[:0], None)
        if remote_ids.size != 1:
            raise BlockIdError(
                f"group {name!r}: the prefill side exposes {remote_ids.size} state slots, not 1"
            )
        return Chunks(local_ids, remote_ids, None)
    bl, br = local_group.block_size, remote_group.block_size
    ml, mr = local_ids.size, remote_ids.size
    # Without a token count the listed blocks are full and read whole (sliding groups too:
    # their window is applied only when the token count says where the sequence ends).
    window = local_group.window if local_group.kind == "sliding" and num_tokens is not None else 0
    if num_tokens is None:
        if bl == br:  # whole blocks, the common case
            if ml > mr:
                raise BlockIdError(
                    f"group {name!r}: {ml} local blocks but only {mr} remote blocks: "
                    "a decode rank cannot receive more blocks than the prefill rank exposed"
                )
            return Chunks(local_ids, remote_ids[mr - ml :], None, (mr - ml) * br)
        num_tokens = mr * br
    n = num_tokens
    if ml == 0:
        return Chunks(local_ids[:0], remote_ids[:0], None)
    if n <= 0:
        raise BlockIdError(
            f"group {name!r}: {ml} local blocks for a request of {n} tokens: give num_tokens > 0 "
            "(or leave it out when the blocks are full)"
        )
    g = min(bl, br)
    nl, nr = -(-n // bl), -(-n // br)  # blocks the sequence fills on each side
    if ml > nl:
        raise BlockIdError(
            f"group {name!r}: {ml} local blocks for {n} tokens of {bl} per block (at most {nl})"
        )
    if mr > nr:
        raise BlockIdError(
            f"group {name!r}: {mr} remote blocks for {n} tokens of {br} per block (at most {nr})"
        )
    start = (nl - ml) * bl
    if window:
        start = max(start, n - window)
    first, stop = start // g, -(-n // g)
    if (nr - mr) * br > first * g:
        raise BlockIdError(
            f"group {name!r}: the prefill side exposes tokens from {(nr - mr) * br} of {n}, but "
            f"tokens from {first * g} are needed: check num_tokens and the remote block ids"
        )
    c = np.arange(first, stop, dtype=np.int64)
    t0 = c * g
    lb = local_ids[t0 // bl - (nl - ml)]
    rb = remote_ids[t0 // br - (nr - mr)]
    pattern = None if bl == br else ((t0 % max(bl, br)) // g).astype(np.int32)
    return Chunks(lb, rb, pattern, int(first * g - (nr - mr) * br))


# -- plans -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupRead:
    """Who reads what: units ``local_units`` of component ``component`` of group ``group`` on
    this rank come from units ``remote_units`` of prefill rank ``remote_rank`` (global units)."""

    group: str
    component: str
    remote_rank: int
    local_units: range
    remote_units: range


@dataclass(frozen=True, slots=True)
class _Part:
    """One group's rows in a read op, per pattern."""

    group: int
    lcol: tuple[IndexArray, ...]  # per pattern: (rows, 1) descriptor index of block 0 of each local row
    rcol: tuple[IndexArray, ...]
    chunk_bytes: tuple[int, ...]  # per pattern: bytes one chunk moves


@dataclass(frozen=True, slots=True)
class ReadOp:
    """One read of a request from one prefill rank: its tables and per-group rows."""

    remote_rank: int
    local_table: TableKey
    remote_table: TableKey
    parts: tuple[_Part, ...]


@dataclass(frozen=True, slots=True)
class RequestReads:
    """A request's reads for one request key, and the ranks notified without a read."""

    ops: tuple[ReadOp, ...]
    standalone_notify: tuple[int, ...]
    detail: tuple[GroupRead, ...] = ()


@dataclass(frozen=True, slots=True)
class Prepared:
    """One request, ready to post: indices per read op and what they move."""

    reads: RequestReads
    posts: tuple[tuple[ReadOp, IndexArray, IndexArray], ...]
    standalone: tuple[int, ...]  # notified prefill ranks this request reads nothing from
    remote_ids: IndexArray  # the whole exposure, flat over groups
    read_ids: IndexArray  # the remote blocks actually read, flat over groups
    bytes: int
    descriptors: int
    chunks: tuple[Chunks, ...] = ()  # per group: the chunks read (the packed path's tokens)
    remote_counts: tuple[int, ...] = ()  # per group: blocks the request exposes


def _atoms(
    lp: Placement,
    rp: Placement,
    local_units: range,
    remote_units: range,
    layers: tuple[int, ...],
    g: int,
    jl: int,
    jr: int,
) -> list[npt.NDArray[np.int64]]:
    """Columns lreg, loff, rreg, roff, len, lstride, rstride, layer (the model layer) of one
    component's atoms."""
    i = np.arange(len(layers), dtype=np.int64)[:, None, None]
    u = np.arange(len(local_units), dtype=np.int64)[None, :, None]
    t = np.arange(g, dtype=np.int64)[None, None, :]
    lu0 = local_units.start - lp.units.start
    ru0 = remote_units.start - rp.units.start
    loff = lp.offset + i * lp.layer + (lu0 + u) * lp.unit + (jl * g + t) * lp.token
    roff = rp.offset + i * rp.layer + (ru0 + u) * rp.unit + (jr * g + t) * rp.token
    shape = loff.shape if loff.size >= roff.size else roff.shape
    lreg = np.broadcast_to(np.asarray(lp.regions, dtype=np.int64)[:, None, None], shape)
    rreg = np.broadcast_to(np.asarray(rp.regions, dtype=np.int64)[:, None, None], shape)
    n = int(np.prod(shape))
    return [
        lreg.ravel(),
        np.broadcast_to(loff, shape).ravel(),
        rreg.ravel(),
        np.broadcast_to(roff, shape).ravel(),
        np.full(n, lp.run, np.int64),
        np.full(n, lp.block, np.int64),
        np.full(n, rp.block, np.int64),
        np.broadcast_to(np.asarray(layers, dtype=np.int64)[:, None, None], shape).ravel(),
    ]


def _merge(cols: list[npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
    """Merge atoms contiguous on both sides into runs: rows lreg, loff, rreg, roff, len,
    lstride, rstride, layer (the last model layer a run holds bytes of)."""
    lreg, loff = cols[0], cols[1]
    order = np.lexsort((loff, lreg))
    lreg, loff, rreg, roff, length, ls, rs, layer = (c[order] for c in cols)
    if lreg.size == 0:
        return np.empty((0, 8), np.int64)
    joined = np.zeros(lreg.size, dtype=bool)
    joined[1:] = (
        (lreg[1:] == lreg[:-1])
        & (rreg[1:] == rreg[:-1])
        & (loff[1:] == loff[:-1] + length[:-1])
        & (roff[1:] == roff[:-1] + length[:-1])
        & (ls[1:] == ls[:-1])
        & (rs[1:] == rs[:-1])
    )
    starts = np.flatnonzero(~joined)
    out = np.empty((starts.size, 8), np.int64)
    out[:, 0] = lreg[starts]
    out[:, 1] = loff[starts]
    out[:, 2] = rreg[starts]
    out[:, 3] = roff[starts]
    out[:, 4] = np.add.reduceat(length, starts)
    out[:, 5] = ls[starts]
    out[:, 6] = rs[starts]
    out[:, 7] = np.maximum.reduceat(layer, starts)
    return out


def _key(side: str, rows: npt.NDArray[np.int64], *rank: int) -> TableKey:
    return (side, *rank, hashlib.blake2b(rows.tobytes(), digest_size=12).hexdigest())


class TransferPlan:
    """Everything a decode rank needs to read from one prefill engine, built at handshake.

    ``tables`` maps table keys to strided tables to prepare once; [`prepare`][akv.plan.TransferPlan.prepare]
    turns a request's block ids into the indices of its reads.
    """

    def __init__(
        self,
        *,
        local_spec: Any,
        local: RankMemory,
        remote_spec: Any,
        remote: dict[int, RankMemory],
    ) -> None:
        lc, rc = as_cache(local_spec), as_cache(remote_spec)
        try:
            rc.validate()  # the peer's description, as it sent it
        except ConfigError as exc:
            raise IncompatiblePeerError(f"the prefill engine's cache is invalid: {exc}", ("spec",)) from None
        check_peer(lc, rc)
        self.local_spec = lc
        self.remote_spec = rc
        self.local = local
        self.remote = remote
        self.decode_tp = local.tp_size
        self.prefill_tp = next(iter(remote.values())).tp_size if remote else 0
        d, dt, pt = local.tp_rank, local.tp_size, self.prefill_tp
        lc.check_rank(d, dt)  # errors name the group and component
        rc.check_rank(0, pt)
        self.notify: tuple[int, ...] = lc.notify_ranks(d, dt, pt)
        missing = sorted(set(self.notify) - set(remote))
        if missing:
            raise ConfigError(f"no memory description for prefill ranks {missing}")
        self._llayout = rank_layout(lc, d, dt)
        self._rlayouts = {r: rank_layout(rc, r, pt) for r in self.notify}
        for what, mem, lay in [("local", local, self._llayout)] + [
            (f"prefill rank {r}", remote[r], self._rlayouts[r]) for r in self.notify
        ]:
            if len(mem.region_addrs) != len(lay.shapes):
                raise ConfigError(
                    f"{what} has {len(mem.region_addrs)} regions, the cache needs {len(lay.shapes)}"
                )
        period = 1
        for g in lc.groups:
            for c in g.components:
                period = math.lcm(period, sharding.component_period(d, dt, pt, c.units, c.shard))
        self.tables: dict[TableKey, npt.NDArray[np.int64]] = {}
        #: per remote table, the last model layer each row holds bytes of (push mode streams
        #: a row once its layers are ready)
        self.layers: dict[TableKey, npt.NDArray[np.int64]] = {}
        self.variants: tuple[RequestReads, ...] = tuple(self._variant(k) for k in range(period))
        total = sum(int(t[:, 4].sum()) for t in self.tables.values())
        if total >= 2**31:
            raise ConfigError(f"{total} descriptors exceed NIXL's 32-bit index space")

    # -- building ---------------------------------------------------------------------------

    def _variant(self, key: int) -> RequestReads:
        lc = self.local_spec
        d, dt, pt = self.local.tp_rank, self.decode_tp, self.prefill_tp
        detail: list[GroupRead] = []
        by_rank: dict[int, list[tuple[int, int, sharding.HeadRead]]] = {}
        for gi, g in enumerate(lc.groups):
            for ci, c in enumerate(g.components):
                mine = c.held(d, dt)
                for read in sharding.component_reads(d, dt, pt, c.units, c.shard, key):
                    theirs = c.held(read.remote_rank, pt)
                    lu = range(mine.start + read.local_heads.start, mine.start + read.local_heads.stop)
                    ru = range(theirs.start + read.remote_heads.start, theirs.start + read.remote_heads.stop)
                    by_rank.setdefault(read.remote_rank, []).append(
                        (gi, ci, sharding.HeadRead(read.remote_rank, lu, ru))
                    )
                    detail.append(GroupRead(g.name, c.name, read.remote_rank, lu, ru))
        ops = tuple(self._op(rank, reads) for rank, reads in sorted(by_rank.items()))
        return RequestReads(ops, tuple(r for r in self.notify if r not in by_rank), tuple(detail))

    def _op(self, rank: int, reads: list[tuple[int, int, sharding.HeadRead]]) -> ReadOp:
        lmem, rmem = self.local, self.remote[rank]
        laddr = np.asarray(lmem.region_addrs, dtype=np.int64)
        raddr = np.asarray(rmem.region_addrs, dtype=np.int64)
        ltab: list[npt.NDArray[np.int64]] = []
        rtab: list[npt.NDArray[np.int64]] = []
        row_layers: list[npt.NDArray[np.int64]] = []
        parts: list[_Part] = []
        lrow = rrow = 0  # descriptor index of the next row's block 0
        for gi in sorted({gi for gi, _, _ in reads}):
            lg: GroupLayout = self._llayout.groups[gi]
            rg: GroupLayout = self._rlayouts[rank].groups[gi]
            bl, br = lg.group.block_size, rg.group.block_size
            g, k = min(bl, br), max(bl, br) // min(bl, br)
            lbases, rbases, sizes = [], [], []
            for p in range(k):
                jl, jr = (p, 0) if bl >= br else (0, p)
                cols: list[list[npt.NDArray[np.int64]]] = []
                for _, ci, read in (x for x in reads if x[0] == gi):
                    cols.append(
                        _atoms(
                            lg.placements[ci],
                            rg.placements[ci],
                            read.local_heads,
                            read.remote_heads,
                            lg.group.layers,
                            g,
                            jl,
                            jr,
                        )
                    )
                runs = _merge([np.concatenate(c) for c in zip(*cols, strict=True)])
                n = len(runs)
                lt = np.empty((n, 5), np.int64)
                lt[:, 0] = laddr[runs[:, 0]] + runs[:, 1]
                lt[:, 1] = runs[:, 4]
                lt[:, 2] = lmem.device_id
                lt[:, 3] = runs[:, 5]
                lt[:, 4] = lg.group.num_blocks
                rt = np.empty((n, 5), np.int64)
                rt[:, 0] = raddr[runs[:, 2]] + runs[:, 3]
                rt[:, 1] = runs[:, 4]
                rt[:, 2] = rmem.device_id
                rt[:, 3] = runs[:, 6]
                rt[:, 4] = rg.group.num_blocks
                ltab.append(lt)
                rtab.append(rt)
                row_layers.append(runs[:, 7])
                lbases.append((lrow + np.arange(n, dtype=np.int64) * lg.group.num_blocks).astype(np.int32))
                rbases.append((rrow + np.arange(n, dtype=np.int64) * rg.group.num_blocks).astype(np.int32))
                lrow += n * lg.group.num_blocks
                rrow += n * rg.group.num_blocks
                sizes.append(int(runs[:, 4].sum()))
            parts.append(
                _Part(gi, tuple(b[:, None] for b in lbases), tuple(b[:, None] for b in rbases), tuple(sizes))
            )
        if max(lrow, rrow) >= 2**31:
            raise ConfigError(f"{max(lrow, rrow)} descriptors exceed NIXL's 32-bit index space")
        lrows, rrows = np.concatenate(ltab), np.concatenate(rtab)
        lkey, rkey = _key("local", lrows), _key("remote", rrows, rank)
        self.tables.setdefault(lkey, lrows)
        self.tables.setdefault(rkey, rrows)
        self.layers.setdefault(rkey, np.concatenate(row_layers))
        return ReadOp(rank, lkey, rkey, tuple(parts))

    # -- requests ---------------------------------------------------------------------------

    def reads(self, key: int) -> RequestReads:
        """The reads for a request key (see `request_key`)."""
        return self.variants[key % len(self.variants)]

    def prepare(
        self,
        request_id: str,
        local_ids: Any,
        remote_ids: Any,
        num_tokens: int | None = None,
    ) -> Prepared:
        """Validate a request's block ids and compute the indices of its reads.

        ``local_ids`` / ``remote_ids``: ``{group name: ids}``, or a flat list for a one-group
        cache. Raises [`BlockIdError`][akv.errors.BlockIdError] for bad ids or ids that cannot
        hold the tokens to read.
        """
        lc, rc = self.local_spec, self.remote_spec
        local = lc.per_group(local_ids, "local_block_ids")
        remote = rc.per_group(remote_ids, "remote_block_ids")
        if num_tokens is not None and (not isinstance(num_tokens, int) or isinstance(num_tokens, bool)):
            raise BlockIdError(f"num_tokens must be an integer, got {num_tokens!r}")
        if num_tokens is not None and num_tokens < 0:
            raise BlockIdError(f"num_tokens must be >= 0, got {num_tokens}")
        per = [
            chunks(lg, rg, li, ri, num_tokens)
            for lg, rg, li, ri in zip(lc.groups, rc.groups, local, remote, strict=True)
        ]
        reads = self.reads(request_key(request_id))
        posts = []
        total = descs = 0
        for op in reads.ops:
            lparts, rparts = [], []
            for part in op.parts:
                ch = per[part.group]
                n = ch.local.size
                if not n:
                    continue
                if ch.pattern is None:
                    lb, rb = part.lcol[0], part.rcol[0]
                    lparts.append((lb + ch.local).ravel())
                    rparts.append((rb + ch.remote).ravel())
                    total += part.chunk_bytes[0] * n
                    descs += lb.size * n
                    continue
                for p, (lb, rb, size) in enumerate(zip(part.lcol, part.rcol, part.chunk_bytes, strict=True)):
                    mask = ch.pattern == p
                    lsel, rsel = ch.local[mask], ch.remote[mask]
                    lparts.append((lb + lsel).ravel())
                    rparts.append((rb + rsel).ravel())
                    total += size * lsel.size
                    descs += lb.size * lsel.size
            if lparts:
                li = lparts[0] if len(lparts) == 1 else np.concatenate(lparts)
                ri = rparts[0] if len(rparts) == 1 else np.concatenate(rparts)
                posts.append((op, li, ri))
        read_ids = rc.flatten([np.unique(c.remote) if c.pattern is not None else c.remote for c in per])
        posted = {op.remote_rank for op, _, _ in posts}
        standalone = tuple(r for r in self.notify if r not in posted)
        return Prepared(
            reads,
            tuple(posts),
            standalone,
            rc.flatten(remote),
            read_ids,
            total,
            descs,
            tuple(per),
            tuple(int(r.size) for r in remote),
        )
