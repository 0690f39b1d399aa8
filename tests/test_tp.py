"""Property tests of the TP head mapping over every valid pair of TP sizes up to 16."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from akv import sharding
from akv.errors import AkvError, ConfigError

SIZES = range(1, 17)
HEADS = [1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 48]


def valid(size: int, heads: int) -> bool:
    return heads % size == 0 or size % heads == 0


DENSE = [(p, d, h) for p in SIZES for d in SIZES for h in HEADS if valid(p, h) and valid(d, h)]
MLA = [(p, d) for p in SIZES for d in SIZES]


@pytest.mark.parametrize("tp_size", SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_held_heads_partition_or_replicate(tp_size: int, heads: int) -> None:
    """Every head is held; each rank holds H/T heads, or one head replicated T/H times."""
    if not valid(tp_size, heads):
        with pytest.raises(ConfigError, match="cannot be split"):
            sharding.held_heads(0, tp_size, heads)
        return
    held = [sharding.held_heads(r, tp_size, heads) for r in range(tp_size)]
    counts = [0] * heads
    for rng in held:
        assert len(rng) == max(1, heads // tp_size)
        for h in rng:
            counts[h] += 1
            assert rng.start <= h < rng.stop
    assert counts == [max(1, tp_size // heads)] * heads
    for h in range(heads):
        assert list(sharding.holders(h, tp_size, heads)) == [r for r in range(tp_size) if h in held[r]]


def check_dense(p: int, d: int, h: int, key: int) -> None:
    expected = [0] * p
    for rank in range(d):
        plan = sharding.plan_reads(decode_rank=rank, decode_tp=d, prefill_tp=p, kv_heads=h, request_key=key)
        mine = sharding.held_heads(rank, d, h)
        seen: list[int] = []
        for read in plan.reads:
            assert len(read.local_heads) == len(read.remote_heads) > 0
            theirs = sharding.held_heads(read.remote_rank, p, h)
            assert read.remote_heads.stop <= len(theirs)
            assert read.local_heads.stop <= len(mine)
            for lh, rh in zip(read.local_heads, read.remote_heads, strict=True):
                assert mine[lh] == theirs[rh]  # the same global head on both sides
                seen.append(mine[lh])
            assert read.remote_rank in plan.notify
        assert sorted(seen) == list(mine)  # each needed head exactly once
        assert len({r.remote_rank for r in plan.reads}) == len(plan.reads)  # one read per rank
        overlapping = {q for q in range(p) if set(sharding.held_heads(q, p, h)) & set(mine)}
        assert set(plan.notify) == overlapping
        for q in plan.notify:
            expected[q] += 1
        # notify sets never depend on the request
        other = sharding.plan_reads(
            decode_rank=rank, decode_tp=d, prefill_tp=p, kv_heads=h, request_key=key + 1
        )
        assert other.notify == plan.notify
    for q in range(p):
        n = sharding.expected_notifications(prefill_rank=q, prefill_tp=p, decode_tp=d, kv_heads=h)
        assert n == expected[q] >= 1


@pytest.mark.parametrize(("p", "d", "h"), DENSE)
def test_dense_reads_cover_each_head_once_and_counts_match(p: int, d: int, h: int) -> None:
    """Dense: reads cover every held head once from a rank holding it; notify counts match."""
    check_dense(p, d, h, key=0)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(DENSE), st.integers(0, 2**32 - 1))
def test_dense_mapping_any_request_key(cfg: tuple[int, int, int], key: int) -> None:
    """Dense invariants hold for every request key, not just key 0."""
    check_dense(*cfg, key=key)


@pytest.mark.parametrize(("p", "h"), [(p, h) for p in SIZES for h in HEADS if h < p and valid(p, h)])
def test_gqa_replica_choice_spreads_over_request_keys(p: int, h: int) -> None:
    """With prefill replicas, varying the request key uses every replica of a head."""
    used = {
        sharding.plan_reads(decode_rank=0, decode_tp=1, prefill_tp=p, kv_heads=h, request_key=k)
        .reads[0]
        .remote_rank
        for k in range(p // h)
    }
    assert used == set(sharding.holders(0, p, h))


@pytest.mark.parametrize(("p", "d"), MLA)
def test_mla_one_full_read_rotating_and_counts_match(p: int, d: int) -> None:
    """MLA: one whole read from an assigned rank, rotating by key; every P rank counted exactly."""
    expected = [0] * p
    for rank in range(d):
        targets = set()
        period = sharding.read_period(decode_rank=rank, decode_tp=d, prefill_tp=p, kv_heads=1, mla=True)
        for key in range(period * 2):
            plan = sharding.plan_reads(
                decode_rank=rank, decode_tp=d, prefill_tp=p, kv_heads=1, mla=True, request_key=key
            )
            assert len(plan.reads) == 1
            assert plan.reads[0].remote_rank in plan.notify
            targets.add(plan.reads[0].remote_rank)
        assert targets == set(plan.notify)
        for q in plan.notify:
            expected[q] += 1
    assert all(n >= 1 for n in expected)
    for q in range(p):
        assert (
            sharding.expected_notifications(prefill_rank=q, prefill_tp=p, decode_tp=d, kv_heads=1, mla=True)
            == expected[q]
        )


def test_uneven_pairs_example() -> None:
    """H=12, P=4, D=6: decode rank 1 holds heads 2-3, which live on prefill rank 0 (heads 0-2) and 1."""
    plan = sharding.plan_reads(decode_rank=1, decode_tp=6, prefill_tp=4, kv_heads=12)
    assert [(r.remote_rank, r.local_heads, r.remote_heads) for r in plan.reads] == [
        (0, range(0, 1), range(2, 3)),
        (1, range(1, 2), range(0, 1)),
    ]
    assert plan.notify == (0, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(decode_rank=0, decode_tp=2, prefill_tp=3, kv_heads=4), "cannot be split"),
        (dict(decode_rank=2, decode_tp=2, prefill_tp=2, kv_heads=4), "outside"),
        (dict(decode_rank=0, decode_tp=0, prefill_tp=2, kv_heads=4), ">= 1"),
        (dict(decode_rank=0, decode_tp=2, prefill_tp=2, kv_heads=0), ">= 1"),
    ],
)
def test_invalid_configs_raise_typed_errors(kwargs: dict[str, int], match: str) -> None:
    """Invalid TP configurations raise a ConfigError (an AkvError) that says what is wrong."""
    with pytest.raises(ConfigError, match=match) as info:
        sharding.plan_reads(**kwargs)
    assert isinstance(info.value, AkvError)
