"""Byte-level tests of transfer plans: descriptors applied as numpy copies must rebuild every
decode cache bit-exactly, for every TP relation and layout, including partial prefix hits."""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt
import pytest

from akv import sharding
from akv.errors import BlockIdError, IncompatiblePeerError, LayoutError
from akv.geometry.spec import KVSpec
from akv.plan import RankMemory, TransferPlan, expand_table, request_key
from akv.testing import expected_blocks

Mem = list[npt.NDArray[np.uint8]]


def alloc(spec: KVSpec, rank: int, size: int) -> Mem:
    nbytes = spec.block_bytes(rank, size) * spec.num_blocks
    return [np.zeros(nbytes, dtype=np.uint8) for _ in range(spec.num_regions)]


def memory(regions: Mem, rank: int, size: int) -> RankMemory:
    return RankMemory(rank, size, tuple(r.ctypes.data for r in regions))


def locate(regions: Mem, addr: int, length: int) -> tuple[npt.NDArray[np.uint8], int]:
    for arr in regions:
        base = arr.ctypes.data
        if base <= addr and addr + length <= base + arr.size:
            return arr, addr - base
    raise AssertionError(f"descriptor {addr:#x}+{length} outside every region")


def apply(
    plan: TransferPlan,
    local: Mem,
    remote: dict[int, Mem],
    rid: str,
    local_ids: list[int],
    remote_ids: list[int],
) -> int:
    """Run a request's descriptors as copies; returns the number of descriptors."""
    lblocks, rblocks = plan.block_ids(local_ids, remote_ids)
    reads = plan.reads(request_key(rid))
    total = 0
    for op in reads.ops:
        lidx, ridx = plan.indices(op, lblocks, rblocks)
        assert lidx.dtype == np.int32 and ridx.dtype == np.int32
        ltab = expand_table(plan.tables[op.local_table])
        rtab = expand_table(plan.tables[op.remote_table])
        for li, ri in zip(lidx, ridx, strict=True):
            (la, ll, _), (ra, rl, _) = ltab[li], rtab[ri]
            assert ll == rl
            dst, doff = locate(local, int(la), int(ll))
            src, soff = locate(remote[op.remote_rank], int(ra), int(rl))
            dst[doff : doff + ll] = src[soff : soff + rl]
        total += len(lidx)
    return total


def fill(spec: KVSpec, regions: Mem, rank: int, size: int, seed: int, ids: list[int]) -> None:
    bb = spec.block_bytes(rank, size)
    for r, arr in enumerate(regions):
        view = arr.reshape(spec.num_blocks, bb)
        view[ids] = expected_blocks(spec, rank, size, r, seed, np.arange(len(ids)))


def run_case(spec: KVSpec, p: int, d: int, hit: int = 0, rid: str = "req-7") -> None:
    rng = np.random.default_rng(p * 100 + d)
    n = 5
    remote_ids = rng.choice(spec.num_blocks, n, replace=False).tolist()
    local_ids = rng.choice(spec.num_blocks, n - hit, replace=False).tolist()
    seed = 11
    prefill = {q: alloc(spec, q, p) for q in range(p)}
    for q, regions in prefill.items():
        fill(spec, regions, q, p, seed, remote_ids)
    for rank in range(d):
        local = alloc(spec, rank, d)
        plan = TransferPlan(
            local_spec=spec,
            local=memory(local, rank, d),
            remote_spec=spec,
            remote={q: memory(m, q, p) for q, m in prefill.items()},
        )
        apply(plan, local, prefill, rid, local_ids, remote_ids)
        bb = spec.block_bytes(rank, d)
        other = sorted(set(range(spec.num_blocks)) - set(local_ids))
        for r, arr in enumerate(local):
            view = arr.reshape(spec.num_blocks, bb)
            want = expected_blocks(spec, rank, d, r, seed, np.arange(hit, n))
            np.testing.assert_array_equal(view[local_ids], want)
            assert not view[other].any(), "bytes landed outside the requested blocks"


DENSE_CASES = [
    (p, d, h)
    for p, d, h in itertools.product([1, 2, 3, 4, 6], [1, 2, 3, 4, 6], [1, 2, 4, 6, 12])
    if all(h % t == 0 or t % h == 0 for t in (p, d))
]


@pytest.mark.parametrize(("p", "d", "h"), DENSE_CASES)
@pytest.mark.parametrize("joint", [False, True])
def test_dense_hnd_every_tp_relation_bit_exact(p: int, d: int, h: int, joint: bool) -> None:
    """HND (separate or joint K/V): every TP relation, incl. non-multiples and GQA replicas."""
    spec = KVSpec.create(
        layers=2, num_blocks=12, block_size=4, kv_heads=h, head_dim=4, dtype="float16", joint_kv=joint
    )
    run_case(spec, p, d)


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 2), (1, 4), (4, 1), (3, 6), (6, 4)])
def test_mla_bit_exact(p: int, d: int) -> None:
    """MLA: one whole-block copy from one prefill rank rebuilds every decode rank."""
    spec = KVSpec.create(
        layers=3, num_blocks=10, block_size=4, kv_heads=1, head_dim=16, dtype="bfloat16", kind="mla"
    )
    run_case(spec, p, d)


@pytest.mark.parametrize("joint", [False, True])
def test_nhd_homogeneous_bit_exact(joint: bool) -> None:
    """NHD works for equal TP sizes (whole blocks)."""
    spec = KVSpec.create(
        layers=2, num_blocks=10, block_size=4, kv_heads=4, head_dim=4, layout="NHD", joint_kv=joint
    )
    run_case(spec, 2, 2)


@pytest.mark.parametrize(("p", "d", "h", "hit"), [(1, 1, 4, 2), (2, 4, 4, 3), (4, 2, 2, 1), (3, 6, 6, 4)])
def test_partial_prefix_hit_reads_only_the_tail(p: int, d: int, h: int, hit: int) -> None:
    """With k blocks already cached, only the last n-k remote blocks land in the local blocks."""
    spec = KVSpec.create(layers=1, num_blocks=12, block_size=2, kv_heads=h, head_dim=4)
    run_case(spec, p, d, hit=hit)


def test_nhd_hetero_refused_with_reason() -> None:
    """Hetero TP on NHD fails at plan time (handshake) with a LayoutError saying why."""
    spec = KVSpec.create(layers=1, num_blocks=4, block_size=2, kv_heads=4, head_dim=4, layout="NHD")
    prefill = {q: alloc(spec, q, 2) for q in range(2)}
    local = alloc(spec, 0, 4)
    with pytest.raises(LayoutError, match="HND"):
        TransferPlan(
            local_spec=spec,
            local=memory(local, 0, 4),
            remote_spec=spec,
            remote={q: memory(m, q, 2) for q, m in prefill.items()},
        )


def test_homogeneous_contiguous_runs_are_contiguous_indices() -> None:
    """Whole-block reads: a run of contiguous block ids maps to a run of contiguous addresses."""
    spec = KVSpec.create(layers=2, num_blocks=16, block_size=4, kv_heads=2, head_dim=8)
    local, remote = alloc(spec, 0, 1), alloc(spec, 0, 1)
    plan = TransferPlan(
        local_spec=spec, local=memory(local, 0, 1), remote_spec=spec, remote={0: memory(remote, 0, 1)}
    )
    op = plan.reads(0).ops[0]
    assert op.local_table == ("local", None) and op.segments == spec.num_regions
    lidx, _ = plan.indices(op, *plan.block_ids([3, 4, 5, 6], [8, 9, 10, 11]))
    addrs = expand_table(plan.tables[op.local_table])[lidx]
    bb = spec.block_bytes(0, 1)
    for seg in range(spec.num_regions):
        run = addrs[seg * 4 : (seg + 1) * 4]
        assert (np.diff(run[:, 0]) == bb).all()


def spec_pair() -> tuple[KVSpec, TransferPlan]:
    spec = KVSpec.create(layers=1, num_blocks=8, block_size=2, kv_heads=2, head_dim=4)
    local, remote = alloc(spec, 0, 1), alloc(spec, 0, 1)
    return spec, TransferPlan(
        local_spec=spec, local=memory(local, 0, 1), remote_spec=spec, remote={0: memory(remote, 0, 1)}
    )


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        ([0, 8], [1, 2], "outside"),
        ([-1], [1], "outside"),
        ([1, 1], [2, 3], "duplicate"),
        ([1], [2, 2], "duplicate"),
        ([1, 2, 3], [4, 5], "3 local blocks but only 2"),
        ([[1, 2]], [[3, 4]], "flat"),
        (["a"], [1], "integers"),
    ],
)
def test_bad_block_ids_raise_block_id_error(local: list[int], remote: list[int], match: str) -> None:
    """Out-of-range, negative, duplicate ids and count mismatches are typed errors, not crashes."""
    _, plan = spec_pair()
    with pytest.raises(BlockIdError, match=match):
        plan.block_ids(local, remote)


def test_incompatible_specs_name_the_fields() -> None:
    """Specs differing in model shape are refused, naming each differing field."""
    a = KVSpec.create(layers=2, num_blocks=8, block_size=16, kv_heads=2, head_dim=4)
    b = KVSpec.create(layers=2, num_blocks=9, block_size=32, kv_heads=2, head_dim=4, dtype="float16")
    with pytest.raises(IncompatiblePeerError) as info:
        TransferPlan(
            local_spec=a,
            local=memory(alloc(a, 0, 1), 0, 1),
            remote_spec=b,
            remote={0: memory(alloc(b, 0, 1), 0, 1)},
        )
    assert set(info.value.fields) == {"block_size", "dtype"}
    assert a.compat_hash() != b.compat_hash()
    assert a.compat_hash() == KVSpec.create(**{**a.compat_dict(), "num_blocks": 99}).compat_hash()


def test_replica_reads_follow_request_keys() -> None:
    """Plans precompute a variant per replica choice and index them by request key."""
    spec = KVSpec.create(layers=1, num_blocks=4, block_size=2, kv_heads=2, head_dim=4)
    prefill = {q: alloc(spec, q, 8) for q in range(8)}
    plan = TransferPlan(
        local_spec=spec,
        local=memory(alloc(spec, 0, 1), 0, 1),
        remote_spec=spec,
        remote={q: memory(m, q, 8) for q, m in prefill.items()},
    )
    assert len(plan.variants) == 4
    for key in range(8):
        want = sharding.plan_reads(decode_rank=0, decode_tp=1, prefill_tp=8, kv_heads=2, request_key=key)
        got = plan.reads(key)
        assert [op.remote_rank for op in got.ops] == [r.remote_rank for r in want.reads]
        assert set(got.standalone_notify) | {op.remote_rank for op in got.ops} == set(range(8))
