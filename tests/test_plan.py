"""Byte-level tests of transfer plans: the descriptors of `TransferPlan.prepare`, applied as
numpy copies between fake rank memories, must rebuild every decode cache bit-exactly, for
every TP relation, layout and block-size pair, including partial prefix hits.

The simulation: every rank's regions live in one numpy buffer at a fake base address (with
gaps between regions), the prefill ranks hold the deterministic contents of
`akv.testing` in their exposed blocks (and noise elsewhere), and a prepared request is
"executed" by expanding its tables and copying bytes. Each destination byte counts its
writes, so overlaps, missed units and stray writes all show up.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from akv import sharding
from akv.errors import BlockIdError, ConfigError, IncompatiblePeerError
from akv.geometry.cache import CacheSpec, as_cache
from akv.geometry.layout import rank_layout
from akv.geometry.spec import KVSpec
from akv.plan import Prepared, RankMemory, TransferPlan, chunks, expand_table, request_key
from akv.testing import _region_pattern

GAP = 64  # bytes between regions: a read or write that strays from its region lands in a gap

# -- the simulation ----------------------------------------------------------------------------


class Side:
    """One rank's regions in one numpy buffer at a fake base address (layouts whose blocks
    are contiguous: the block axis outermost in every region)."""

    def __init__(self, spec: Any, rank: int, size: int, *, base: int, device: int = 0) -> None:
        self.spec = spec
        self.cache = as_cache(spec)
        self.rank, self.size, self.base, self.device = rank, size, base, device
        layout = rank_layout(self.cache, rank, size)
        self.group_of: list[int] = []
        self.num_blocks: list[int] = []
        self.block_bytes: list[int] = []
        sizes: list[int] = []
        for gi, gl in enumerate(layout.groups):
            for shape in gl.shapes:
                bb = math.prod(shape[1:]) * gl.group.element_size
                self.group_of.append(gi)
                self.num_blocks.append(shape[0])
                self.block_bytes.append(bb)
                sizes.append(shape[0] * bb)
            for place in gl.placements:
                assert all(self.block_bytes[r] == place.block for r in place.regions), "blocks not contiguous"
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.starts = GAP + np.concatenate([[0], np.cumsum(self.sizes + GAP)[:-1]]).astype(np.int64)
        self.mem = np.zeros(int(self.starts[-1] + self.sizes[-1] + GAP), dtype=np.uint8)

    @property
    def memory(self) -> RankMemory:
        """What a handshake would announce for this rank."""
        return RankMemory(self.rank, self.size, tuple(int(self.base + s) for s in self.starts), self.device)

    def regions(self, group: int) -> list[int]:
        """The region indices of one group."""
        return [r for r, g in enumerate(self.group_of) if g == group]

    def view(self, region: int, buf: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
        """Region ``region`` of ``buf`` (default: the memory) as ``(blocks, block_bytes)``."""
        a = self.mem if buf is None else buf
        start = int(self.starts[region])
        return a[start : start + int(self.sizes[region])].reshape(self.num_blocks[region], -1)

    def locate(
        self, addr: npt.NDArray[np.int64], length: npt.NDArray[np.int64], what: str
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The region and block of each descriptor; fails unless each lies in one block of one region."""
        off = addr - self.base
        region = np.searchsorted(self.starts, off, side="right") - 1
        assert (region >= 0).all(), f"{what}: descriptor below the first region of rank {self.rank}"
        rel = off - self.starts[region]
        outside = rel + length > self.sizes[region]
        assert not outside.any(), (
            f"{what}: descriptor {int(addr[outside][0]):#x}+{int(length[outside][0])} "
            f"outside every region of rank {self.rank}"
        )
        bb = np.asarray(self.block_bytes, dtype=np.int64)[region]
        block = rel // bb
        straddle = (rel + length - 1) // bb != block
        assert not straddle.any(), f"{what}: a descriptor straddles two blocks of rank {self.rank}"
        return region, block


def sides(spec: Any, size: int, *, base: int, device: int = 0) -> dict[int, Side]:
    """Every rank of an engine, each at its own fake base address and device id."""
    return {r: Side(spec, r, size, base=base + (r << 32), device=device + r) for r in range(size)}


@dataclass(frozen=True)
class Request:
    """One request: per group, the ids and sequence block positions on both sides."""

    num_tokens: int
    local: tuple[npt.NDArray[np.int32], ...]
    remote: tuple[npt.NDArray[np.int32], ...]
    local_pos: tuple[npt.NDArray[np.int64], ...]
    remote_pos: tuple[npt.NDArray[np.int64], ...]

    def ids(self, cache: CacheSpec, side: str) -> Any:
        """The ids as `prepare` takes them (flat for a one-group cache)."""
        per = self.local if side == "local" else self.remote
        if len(cache.groups) == 1:
            return per[0].tolist()
        return {g.name: ids.tolist() for g, ids in zip(cache.groups, per, strict=True)}


def token_range(local: Any, remote: Any, n: int, ml: int) -> tuple[int, int, int, int]:
    """For one token group: tokens ``[need, n)`` must be read, only tokens ``[lo, hi)`` may
    be written (whole chunks), and the prefill side must expose its blocks from ``first``."""
    bl, br = local.block_size, remote.block_size
    g = min(bl, br)
    nl = -(-n // bl)
    need = (nl - ml) * bl
    if local.kind == "sliding":
        need = max(need, n - local.window)
    lo, hi = need // g * g, -(-n // g) * g
    return need, lo, hi, lo // br


def make_request(
    dspec: Any,
    pspec: Any,
    num_tokens: int,
    local_counts: Sequence[int],
    remote_counts: Sequence[int],
    rng: np.random.Generator,
) -> Request:
    """Random distinct ids for ``local_counts`` / ``remote_counts`` blocks per group, naming
    the last blocks of a ``num_tokens``-token sequence (state groups: slot position 0)."""
    dc, pc = as_cache(dspec), as_cache(pspec)
    loc, rem, lpos, rpos = [], [], [], []
    for lg, rg, ml, mr in zip(dc.groups, pc.groups, local_counts, remote_counts, strict=True):
        loc.append(rng.choice(lg.num_blocks, ml, replace=False).astype(np.int32))
        rem.append(rng.choice(rg.num_blocks, mr, replace=False).astype(np.int32))
        if lg.tokens:
            nl, nr = -(-num_tokens // lg.block_size), -(-num_tokens // rg.block_size)
            lpos.append(np.arange(nl - ml, nl, dtype=np.int64))
            rpos.append(np.arange(nr - mr, nr, dtype=np.int64))
        else:
            lpos.append(np.zeros(ml, np.int64))
            rpos.append(np.zeros(mr, np.int64))
    return Request(num_tokens, tuple(loc), tuple(rem), tuple(lpos), tuple(rpos))


def fill(prefill: dict[int, Side], req: Request, seed: int) -> None:
    """Noise everywhere, then request ``seed``'s contents in the exposed blocks of every rank."""
    noise = np.random.default_rng(seed)
    for side in prefill.values():
        side.mem[:] = noise.integers(0, 256, side.mem.size, dtype=np.uint8)
        for region, gi in enumerate(side.group_of):
            ids = req.remote[gi]
            if ids.size:
                want = _region_pattern(side.spec, side.rank, side.size, region, seed, req.remote_pos[gi])[0]
                side.view(region)[ids] = want


@dataclass
class Executed:
    """What executing a prepared request did on one decode rank."""

    plan: TransferPlan
    prepared: Prepared
    writes: npt.NDArray[np.int32]  # per byte of the decode memory
    read: set[int]  # remote blocks read, flat over groups
    ranks: set[int]  # prefill ranks read from
    descriptors: int
    bytes: int


def execute(plan: TransferPlan, prepared: Prepared, local: Side, prefill: dict[int, Side]) -> Executed:
    """Copy every descriptor pair of ``prepared``; check each lies in one exposed block."""
    writes = np.zeros(local.mem.size, dtype=np.int32)
    exposed = as_cache(plan.remote_spec).split(prepared.remote_ids)
    offsets = plan.remote_spec.offsets
    out = Executed(plan, prepared, writes, set(), set(), 0, 0)
    tables: dict[Any, npt.NDArray[np.int64]] = {}
    for op, li, ri in prepared.posts:
        src = prefill[op.remote_rank]
        assert op.local_table[0] == "local" and op.remote_table[:2] == ("remote", op.remote_rank)
        assert li.dtype == np.int32 and ri.dtype == np.int32 and li.shape == ri.shape and li.size
        for key in (op.local_table, op.remote_table):
            if key not in tables:
                tables[key] = expand_table(plan.tables[key])
        lt, rt = tables[op.local_table], tables[op.remote_table]
        assert li.min() >= 0 and li.max() < len(lt) and ri.min() >= 0 and ri.max() < len(rt)
        lrows, rrows = lt[li], rt[ri]
        length = lrows[:, 1]
        assert (length > 0).all() and (length == rrows[:, 1]).all(), "descriptor lengths differ"
        assert (lrows[:, 2] == local.device).all() and (rrows[:, 2] == src.device).all()
        lreg, _ = local.locate(lrows[:, 0], length, "write")
        rreg, rblk = src.locate(rrows[:, 0], length, "read")
        lgroup = np.asarray(local.group_of)[lreg]
        rgroup = np.asarray(src.group_of)[rreg]
        assert (lgroup == rgroup).all(), "a read lands in another group"
        for gi, block in set(zip(rgroup.tolist(), rblk.tolist(), strict=True)):
            name = plan.remote_spec.groups[gi].name
            assert block in set(exposed[name].tolist()), f"read block {block} of group {name!r}: not exposed"
            out.read.add(offsets[gi] + block)
        total = int(length.sum())
        first = np.repeat(np.cumsum(length) - length, length)
        within = np.arange(total, dtype=np.int64) - first
        dst = np.repeat(lrows[:, 0] - local.base, length) + within
        srcb = np.repeat(rrows[:, 0] - src.base, length) + within
        local.mem[dst] = src.mem[srcb]
        np.add.at(writes, dst, 1)
        out.ranks.add(op.remote_rank)
        out.descriptors += int(li.size)
        out.bytes += total
    return out


def check_decode(local: Side, pspec: Any, done: Executed, req: Request, seed: int) -> None:
    """Every byte the request must read holds the prefill's contents and was written once;
    nothing outside the request's local blocks (or outside whole chunks) was written."""
    dc, pc = local.cache, as_cache(pspec)
    n = req.num_tokens
    inside = np.zeros(local.mem.size, dtype=bool)
    for gi, (lg, rg) in enumerate(zip(dc.groups, pc.groups, strict=True)):
        ids = req.local[gi]
        if not ids.size:
            continue
        if lg.tokens:
            need, lo, hi, _ = token_range(lg, rg, n, ids.size)
        for region in local.regions(gi):
            want, tok = _region_pattern(local.spec, local.rank, local.size, region, seed, req.local_pos[gi])
            got, count = local.view(region)[ids], local.view(region, done.writes)[ids]
            local.view(region, inside)[ids] = True
            if lg.tokens:
                required = (tok >= need) & (tok < n)
                allowed = (tok >= lo) & (tok < hi)
            else:
                required = allowed = np.ones(tok.shape, dtype=bool)
            where = f"rank {local.rank}/{local.size} group {lg.name!r} region {region}"
            assert (count[required] == 1).all(), f"{where}: needed bytes not written exactly once"
            assert not count[~allowed].any(), f"{where}: bytes written outside the tokens to read"
            hit = count > 0
            assert np.array_equal(got[hit], want[hit]), f"{where}: wrong bytes"
    assert done.writes.max(initial=0) <= 1, "overlapping descriptors"
    assert not done.writes[~inside].any(), "bytes written outside the request's local blocks"


def check_prepared(plan: TransferPlan, prepared: Prepared, done: Executed, req: Request) -> None:
    """Notify sets, reported counts and read ids agree with what the descriptors did."""
    local = plan.local
    assert plan.notify == plan.local_spec.notify_ranks(local.tp_rank, local.tp_size, plan.prefill_tp)
    posted = [op.remote_rank for op, _, _ in prepared.posts]
    assert len(set(posted)) == len(posted), "two posts to one prefill rank"
    assert set(posted) | set(prepared.standalone) == set(plan.notify)
    assert not set(posted) & set(prepared.standalone)
    assert prepared.descriptors == done.descriptors and prepared.bytes == done.bytes
    exposed = plan.remote_spec.flatten(req.remote)
    assert np.array_equal(prepared.remote_ids, exposed)
    assert set(prepared.read_ids.tolist()) <= set(exposed.tolist())
    assert set(prepared.read_ids.tolist()) == done.read


def simulate(
    dspec: Any,
    pspec: Any,
    p: int,
    d: int,
    req: Request,
    *,
    rid: str = "req-7",
    seed: int = 11,
    whole_blocks: bool = False,
) -> list[Executed]:
    """Pull ``req`` into every decode rank of ``d`` from a ``p``-rank prefill engine and check
    every byte. ``whole_blocks``: `prepare` gets no token count (the blocks are full)."""
    prefill = sides(pspec, p, base=1 << 44, device=100)
    fill(prefill, req, seed)
    out = []
    for rank in range(d):
        local = Side(dspec, rank, d, base=(1 << 40) + (rank << 32), device=rank)
        plan = TransferPlan(
            local_spec=dspec,
            local=local.memory,
            remote_spec=pspec,
            remote={q: s.memory for q, s in prefill.items()},
        )
        tokens = None if whole_blocks else req.num_tokens
        prepared = plan.prepare(
            rid, req.ids(local.cache, "local"), req.ids(plan.remote_spec, "remote"), tokens
        )
        done = execute(plan, prepared, local, prefill)
        check_decode(local, pspec, done, req, seed)
        check_prepared(plan, prepared, done, req)
        out.append(done)
    return out


def one_group(
    dspec: KVSpec, pspec: KVSpec, p: int, d: int, blocks: int, hit: int = 0, **kw: Any
) -> list[Executed]:
    """A one-group request of ``blocks`` whole prefill blocks, ``hit`` of them cached locally."""
    n = blocks * pspec.block_size
    ml = -(-n // dspec.block_size) - hit * pspec.block_size // dspec.block_size
    rng = np.random.default_rng(p * 100 + d)
    return simulate(dspec, pspec, p, d, make_request(dspec, pspec, n, [ml], [blocks], rng), **kw)


def kv(**fields: Any) -> KVSpec:
    base: dict[str, Any] = dict(
        layers=2, num_blocks=12, block_size=4, kv_heads=4, head_dim=4, dtype="float16"
    )
    return KVSpec.create(**{**base, **fields})


def valid(size: int, heads: int) -> bool:
    return heads % size == 0 or size % heads == 0


# -- dense and MLA, every TP relation ------------------------------------------------------------

DENSE_CASES = [
    (p, d, h)
    for p, d, h in itertools.product([1, 2, 3, 4, 6], [1, 2, 3, 4, 6], [1, 2, 4, 6, 12])
    if valid(p, h) and valid(d, h)
]


@pytest.mark.parametrize(("p", "d", "h"), DENSE_CASES)
@pytest.mark.parametrize("joint", [False, True])
def test_dense_hnd_every_tp_relation_bit_exact(p: int, d: int, h: int, joint: bool) -> None:
    """HND (separate or joint K/V): every TP relation, incl. non-multiples and GQA replicas."""
    spec = kv(kv_heads=h, joint_kv=joint)
    one_group(spec, spec, p, d, blocks=5)


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 2), (1, 4), (4, 1), (3, 6), (6, 4), (5, 3)])
def test_mla_bit_exact(p: int, d: int) -> None:
    """MLA: one whole-block copy from one prefill rank rebuilds every decode rank."""
    spec = kv(layers=3, num_blocks=10, kv_heads=1, head_dim=16, dtype="bfloat16", kind="mla")
    done = one_group(spec, spec, p, d, blocks=5)
    assert all(len(x.ranks) == 1 for x in done)


@pytest.mark.parametrize("joint", [False, True])
@pytest.mark.parametrize(("p", "d", "h"), [(2, 2, 4), (1, 4, 4), (4, 1, 4), (2, 4, 4), (3, 6, 6), (4, 8, 2)])
def test_nhd_every_tp_relation_bit_exact(p: int, d: int, h: int, joint: bool) -> None:
    """NHD works for any TP relation: head slices of a token are separate runs when TP differs."""
    spec = kv(kv_heads=h, layout="NHD", joint_kv=joint)
    one_group(spec, spec, p, d, blocks=5)


def test_nhd_hetero_tp_uses_one_descriptor_per_token_run() -> None:
    """NHD, P=1, D=2, 4 heads: each decode rank's two heads of one token are one run, so a
    block takes ``layers * 2 * block_size`` descriptors; HND takes one per region and block."""
    nhd, hnd = kv(layout="NHD"), kv()
    blocks = 3
    per_block = nhd.layers * 2 * nhd.block_size
    for x in one_group(nhd, nhd, 1, 2, blocks):
        assert x.descriptors == per_block * blocks
        assert x.bytes == blocks * nhd.block_bytes(0, 2) * nhd.num_regions
    for x in one_group(hnd, hnd, 1, 2, blocks):
        assert x.descriptors == hnd.num_regions * blocks


@pytest.mark.parametrize(("p", "d", "h", "hit"), [(1, 1, 4, 2), (2, 4, 4, 3), (4, 2, 2, 1), (3, 6, 6, 4)])
def test_partial_prefix_hit_reads_only_the_tail(p: int, d: int, h: int, hit: int) -> None:
    """With k blocks already cached, only the last n-k remote blocks are read, into the local blocks."""
    spec = kv(layers=1, block_size=2, kv_heads=h)
    for x in one_group(spec, spec, p, d, blocks=5, hit=hit):
        assert len(x.read) == 5 - hit


@pytest.mark.parametrize("hit", [0, 2])
def test_whole_blocks_without_num_tokens(hit: int) -> None:
    """Without num_tokens (equal block sizes), the local ids receive the last remote blocks."""
    spec = kv()
    one_group(spec, spec, 2, 2, blocks=5, hit=hit, whole_blocks=True)


@pytest.mark.parametrize(("dbs", "pbs"), [(4, 8), (8, 4), (2, 6), (6, 2), (4, 4)])
@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (2, 2)])
def test_block_sizes_multiples_of_each_other_bit_exact(dbs: int, pbs: int, p: int, d: int) -> None:
    """Block sizes may differ when one divides the other, in either direction, with hetero TP."""
    dspec, pspec = kv(block_size=dbs), kv(block_size=pbs)
    for n in (1, 11, 24):
        rng = np.random.default_rng(n)
        req = make_request(dspec, pspec, n, [-(-n // dbs)], [-(-n // pbs)], rng)
        simulate(dspec, pspec, p, d, req)
    # None: the prefill's blocks are all full
    req = make_request(dspec, pspec, 24, [24 // dbs], [24 // pbs], np.random.default_rng(0))
    simulate(dspec, pspec, p, d, req, whole_blocks=True)


LAYOUTS = [
    ("HND", False),
    ("NHD", False),
    ("HND", True),
    ("NHD", True),
    ("cross-layer", False),
    ("head-major", False),
]


@pytest.mark.parametrize(("dl", "pl"), list(itertools.product(LAYOUTS, LAYOUTS)))
def test_every_layout_pair_bit_exact(dl: tuple[str, bool], pl: tuple[str, bool]) -> None:
    """Layouts are each side's own: every pair of layouts moves the same bytes."""
    dspec = kv(layout=dl[0], joint_kv=dl[1], block_size=4)
    pspec = kv(layout=pl[0], joint_kv=pl[1], block_size=8, num_blocks=6)
    req = make_request(dspec, pspec, 21, [5], [3], np.random.default_rng(3))
    simulate(dspec, pspec, 2, 4, req)


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 4), (4, 2), (3, 6), (6, 4), (4, 8)])
def test_head_major_reads_one_run_per_block_and_rank(p: int, d: int) -> None:
    """Head-major on both sides: a rank's share of a block is one run for any TP pair."""
    spec = kv(kv_heads=12 if 3 in (p, d) or 6 in (p, d) else 8, layout="head-major", layers=3)
    for x in one_group(spec, spec, p, d, blocks=4):
        assert x.descriptors == 4 * len(x.ranks)


def test_cross_layer_homogeneous_one_run_per_block() -> None:
    """Cross-layer, equal TP: a whole block (every layer, K and V) is one descriptor."""
    spec = kv(layout="cross-layer", layers=3)
    for x in one_group(spec, spec, 2, 2, blocks=4):
        assert x.descriptors == 4


def test_homogeneous_contiguous_runs_are_contiguous_indices() -> None:
    """Whole-block reads: one table row per region, descriptor ``row * num_blocks + block``
    sits ``block * block_bytes`` after the row's base, on both sides."""
    spec = kv(layers=2, num_blocks=16, kv_heads=2, head_dim=8)
    local, remote = Side(spec, 0, 1, base=1 << 40), Side(spec, 0, 1, base=1 << 44)
    plan = TransferPlan(local_spec=spec, local=local.memory, remote_spec=spec, remote={0: remote.memory})
    (op,) = plan.reads(0).ops
    table = plan.tables[op.local_table]
    bb = spec.block_bytes(0, 1)
    assert table.shape == (spec.num_regions, 5)
    assert (table[:, 1] == bb).all() and (table[:, 3] == bb).all() and (table[:, 4] == 16).all()
    prepared = plan.prepare("r", [3, 4, 5, 6], [8, 9, 10, 11])
    (_, li, ri) = prepared.posts[0]
    rows = np.arange(spec.num_regions)[:, None] * 16
    assert np.array_equal(li, (rows + np.array([3, 4, 5, 6])).ravel())
    assert np.array_equal(ri, (rows + np.array([8, 9, 10, 11])).ravel())
    addrs = expand_table(table)[li].reshape(spec.num_regions, 4, 3)
    assert (np.diff(addrs[:, :, 0], axis=1) == bb).all()
    assert prepared.descriptors == spec.num_regions * 4 and prepared.bytes == spec.num_regions * 4 * bb


# -- chunks and tables ---------------------------------------------------------------------------


def test_chunks_of_mixed_block_sizes() -> None:
    """Chunks of the smaller block size: local block, remote block and position per chunk."""
    small, big = kv(block_size=4).to_cache().groups[0], kv(block_size=8).to_cache().groups[0]
    ids = np.arange(10, 20, dtype=np.int32)
    # decode 4, prefill 8, 20 tokens: 5 local blocks, 3 remote; chunks 0..4
    c = chunks(small, big, ids[:5], ids[5:8], 20)
    assert c.local.tolist() == [10, 11, 12, 13, 14]
    assert c.remote.tolist() == [15, 15, 16, 16, 17]
    assert c.pattern is not None and c.pattern.tolist() == [0, 1, 0, 1, 0]
    # decode 8, prefill 4, 20 tokens, prefix hit of one local block: tokens 8..19
    c = chunks(big, small, ids[:2], ids[2:7], 20)
    assert c.local.tolist() == [10, 10, 11]
    assert c.remote.tolist() == [14, 15, 16]
    assert c.pattern is not None and c.pattern.tolist() == [0, 1, 0]
    # equal sizes: no pattern
    c = chunks(small, small, ids[:2], ids[:5], 20)
    assert c.remote.tolist() == [13, 14] and c.pattern is None


def test_expand_table_one_row_per_descriptor() -> None:
    """expand_table turns ``(addr, len, dev, stride, count)`` rows into one row per block."""
    table = np.array([[1000, 8, 3, 100, 3], [5000, 4, 3, 16, 2]], dtype=np.int64)
    assert expand_table(table).tolist() == [
        [1000, 8, 3],
        [1100, 8, 3],
        [1200, 8, 3],
        [5000, 4, 3],
        [5016, 4, 3],
    ]


def test_request_key_is_stable() -> None:
    """Request keys are CRC-32 of the id: equal in every process (unlike hash())."""
    assert request_key("req-1") == zlib.crc32(b"req-1")
    assert request_key("req-1") != request_key("req-2")


def test_nixl_32_bit_index_limit() -> None:
    """A table of 2**31 descriptors or more is refused at plan time; below that, the highest
    index (the last block of the last row) is still an int32."""
    fake = RankMemory(0, 1, (1 << 40, 1 << 41))  # 1 layer, K and V; never touched

    def plan(blocks: int) -> TransferPlan:
        spec = kv(layers=1, num_blocks=blocks, kv_heads=1, head_dim=1)
        return TransferPlan(local_spec=spec, local=fake, remote_spec=spec, remote={0: fake})

    with pytest.raises(ConfigError, match="32-bit"):
        plan(2**30)  # 2 rows of 2**30 blocks
    ok = plan(2**28)
    last = 2**28 - 1
    (_, li, ri) = ok.prepare("r", [last], [last]).posts[0]
    assert li.dtype == np.int32 and li.tolist() == [last, 2**28 + last] == ri.tolist()


# -- errors --------------------------------------------------------------------------------------


def spec_pair() -> tuple[KVSpec, TransferPlan]:
    spec = kv(layers=1, num_blocks=8, block_size=2, kv_heads=2)
    local, remote = Side(spec, 0, 1, base=1 << 40), Side(spec, 0, 1, base=1 << 44)
    return spec, TransferPlan(
        local_spec=spec, local=local.memory, remote_spec=spec, remote={0: remote.memory}
    )


@pytest.mark.parametrize(
    ("local", "remote", "tokens", "match"),
    [
        ([0, 8], [1, 2], None, r"local_block_ids of group 'kv': block id 8 is outside \[0, 8\)"),
        ([-1], [1], None, r"local_block_ids of group 'kv': block id -1 is outside"),
        ([1], [9], None, r"remote_block_ids of group 'kv': block id 9 is outside"),
        ([1, 1], [2, 3], None, "local_block_ids.*duplicate"),
        ([1], [2, 2], None, "remote_block_ids.*duplicate"),
        ([1, 2, 3], [4, 5], None, "3 local blocks but only 2 remote blocks"),
        ([[1, 2]], [[3, 4]], None, "flat"),
        (["a"], [1], None, "integers"),
        ([1, 2, 3], [4, 5, 6], 4, r"3 local blocks for 4 tokens of 2 per block \(at most 2\)"),
        ([1], [4, 5, 6], 4, r"3 remote blocks for 4 tokens"),
        ([1, 2], [4], 4, "exposes tokens from 2 of 4, but tokens from 0 are needed"),
        ([1], [2], -1, "num_tokens must be >= 0"),
        ({"other": [1]}, [2], None, "no group"),
    ],
)
def test_bad_block_ids_raise_block_id_error(local: Any, remote: Any, tokens: int | None, match: str) -> None:
    """Out-of-range, negative, duplicate ids, count mismatches and unknown groups are typed
    errors naming the side and group, not crashes."""
    _, plan = spec_pair()
    with pytest.raises(BlockIdError, match=match):
        plan.prepare("r", local, remote, tokens)


def test_empty_request_reads_nothing() -> None:
    """No local ids (a full prefix hit) or no tokens: no posts, every notified rank standalone."""
    _, plan = spec_pair()
    for prepared in (plan.prepare("r", [], [1, 2]), plan.prepare("r", [], [], 0)):
        assert prepared.posts == () and prepared.bytes == prepared.descriptors == 0
        assert prepared.standalone == plan.notify == (0,)
        assert prepared.read_ids.size == 0


@pytest.mark.parametrize(
    ("change", "fields", "message"),
    [
        (
            dict(layers=3, dtype="float32"),
            {"kv.layers", "kv.dtype"},
            "dtype: decode='float16' prefill='float32'",
        ),
        (dict(kv_heads=8), {"kv.k.units", "kv.v.units"}, "component 'v' units: decode=4 prefill=8"),
        (dict(head_dim=8), {"kv.k.unit_elems", "kv.v.unit_elems"}, "'k' unit_elems: decode=4 prefill=8"),
        (dict(kind="mla", kv_heads=1), {"kv.kind", "kv.components"}, "kind: decode='full' prefill='mla'"),
        (dict(block_size=6), {"kv.block_size"}, "block size: decode=4 prefill=6"),
    ],
)
def test_incompatible_specs_name_the_fields(change: dict[str, Any], fields: set[str], message: str) -> None:
    """Specs differing in model shape (or in block sizes not multiples of each other) are
    refused at plan time, naming each differing field by group and component."""
    a, b = kv(), kv(**change)
    mem = Side(a, 0, 1, base=1 << 40).memory
    with pytest.raises(IncompatiblePeerError) as info:
        TransferPlan(local_spec=a, local=mem, remote_spec=b, remote={0: Side(b, 0, 1, base=1 << 44).memory})
    assert set(info.value.fields) == fields
    assert message in str(info.value) and "group 'kv'" in str(info.value)


def test_compat_hash_covers_structure_only() -> None:
    """Pool size, block size and layout are each engine's own; dtype and shape are not."""
    a = kv()
    for same in (kv(num_blocks=99), kv(block_size=8), kv(layout="NHD"), kv(joint_kv=True)):
        assert a.compat_hash() == same.compat_hash()
    for other in (kv(dtype="bfloat16"), kv(kv_heads=2), kv(layers=3), kv(head_dim=8)):
        assert a.compat_hash() != other.compat_hash()


def test_plan_needs_every_notified_rank_and_matching_regions() -> None:
    """A missing prefill rank or a region count that does not fit the cache is a ConfigError."""
    spec = kv()
    local = Side(spec, 0, 1, base=1 << 40).memory
    prefill = sides(spec, 2, base=1 << 44)
    with pytest.raises(ConfigError, match=r"no memory description for prefill ranks \[1\]"):
        TransferPlan(local_spec=spec, local=local, remote_spec=spec, remote={0: prefill[0].memory})
    short = RankMemory(1, 2, prefill[1].memory.region_addrs[:-1])
    with pytest.raises(ConfigError, match="prefill rank 1 has 3 regions, the cache needs 4"):
        TransferPlan(local_spec=spec, local=local, remote_spec=spec, remote={0: prefill[0].memory, 1: short})


# -- replica choice ------------------------------------------------------------------------------


def test_replica_reads_follow_request_keys() -> None:
    """Plans precompute a variant per replica choice and index them by request key; over
    request ids, every replica of each head is read."""
    spec = kv(layers=1, num_blocks=4, block_size=2, kv_heads=2)
    prefill = sides(spec, 8, base=1 << 44)
    plan = TransferPlan(
        local_spec=spec,
        local=Side(spec, 0, 1, base=1 << 40).memory,
        remote_spec=spec,
        remote={q: s.memory for q, s in prefill.items()},
    )
    assert len(plan.variants) == 4
    for key in range(8):
        want = sharding.plan_reads(decode_rank=0, decode_tp=1, prefill_tp=8, kv_heads=2, request_key=key)
        got = plan.reads(key)
        assert [op.remote_rank for op in got.ops] == [r.remote_rank for r in want.reads]
        assert set(got.standalone_notify) | {op.remote_rank for op in got.ops} == set(range(8))
    used: set[int] = set()
    for i in range(40):
        prepared = plan.prepare(f"req-{i}", [0], [1])
        ranks = [op.remote_rank for op, _, _ in prepared.posts]
        assert len(ranks) == 2 and ranks[0] < 4 <= ranks[1]  # head 0 from 0-3, head 1 from 4-7
        used.update(ranks)
    assert used == set(range(8))


@pytest.mark.parametrize(("p", "d"), [(4, 1), (6, 2), (2, 4)])
def test_mla_replica_rotates_over_assigned_ranks(p: int, d: int) -> None:
    """MLA: each request reads one assigned prefill rank and notifies the others standalone;
    request ids spread the reads over every assigned rank."""
    spec = kv(kind="mla", kv_heads=1)
    prefill = sides(spec, p, base=1 << 44)
    for rank in range(d):
        plan = TransferPlan(
            local_spec=spec,
            local=Side(spec, rank, d, base=1 << 40).memory,
            remote_spec=spec,
            remote={q: s.memory for q, s in prefill.items()},
        )
        assert plan.notify == spec.notify_ranks(rank, d, p)
        used = set()
        for i in range(30):
            prepared = plan.prepare(f"req-{i}", [0], [1])
            ((op, _, _),) = prepared.posts
            assert set(prepared.standalone) == set(plan.notify) - {op.remote_rank}
            used.add(op.remote_rank)
        assert used == set(plan.notify)
