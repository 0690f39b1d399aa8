"""Property tests of hybrid caches (groups of full, sliding, MLA, Mamba2 and GDN layers)
between a prefill engine of P ranks and a decode engine of D ranks, P and D up to 16.

Each decode rank's plan is executed on simulated memories (see `tests.test_plan`): every
unit of every group it holds must be read exactly once, from a prefill rank holding it,
inside the prefill rank's regions and the blocks the request exposed; the tokens read
follow each group's prefix hit, sliding window or state slot; notification sets and counts
match on both sides.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from akv import sharding
from akv.errors import BlockIdError, ConfigError, IncompatiblePeerError
from akv.geometry.cache import CacheSpec, Component, Group, check_peer
from akv.geometry.layout import rank_layout
from akv.plan import TransferPlan
from akv.presets import preset
from akv.testing import expected_blocks
from tests.test_plan import LAYOUTS, Request, Side, make_request, sides, simulate, token_range

SIZES = range(1, 17)
PAIRS = [(p, d) for p in SIZES for d in SIZES]
NMAX = 20  # tokens of a request at most
KINDS = ("full", "sliding", "mla", "mamba2", "gdn")


def heads_ok(units: int, tp: int) -> bool:
    return units % tp == 0 or tp % units == 0


def shards(c: Component, tp: int) -> bool:
    """Our own rule (not the library's): does component ``c`` shard over ``tp`` ranks?"""
    if c.shard == "replicate":
        return True
    if c.shard == "split":
        return c.units % tp == 0
    return heads_ok(c.units, tp)


# -- strategies ----------------------------------------------------------------------------------


@st.composite
def components(draw: st.DrawFn, kind: str, tps: tuple[int, ...]) -> tuple[Component, ...]:
    """The components of a group of ``kind`` that shard over every TP size in ``tps``
    (``tps=()``: unit counts that mostly shard over several sizes up to 16)."""
    elems = st.integers(1, 3)
    if kind in ("mamba2", "gdn"):
        step = math.lcm(*tps) if tps else 1
        split = st.sampled_from(list(range(step, 33, step)) if tps else [16, 8, 32, 48, 12, 24, 6, 4, 5, 3])
    else:
        heads = st.sampled_from([u for u in range(1, 17) if all(heads_ok(u, t) for t in tps)])
    if kind in ("full", "sliding"):
        h, e = draw(heads), draw(elems)
        ev = draw(st.sampled_from([e, draw(elems)]))  # V may be wider or narrower than K
        return (
            Component(name="k", units=h, unit_elems=e, shard="heads"),
            Component(name="v", units=h, unit_elems=ev, shard="heads"),
        )
    if kind == "mla":
        latent = (
            Component(
                name="latent", units=draw(st.integers(1, 2)), unit_elems=draw(elems), shard="replicate"
            ),
        )
        if draw(st.booleans()):
            latent += (Component(name="rope", units=1, unit_elems=draw(elems), shard="replicate"),)
        return latent
    if kind == "mamba2":
        h, g = draw(split), draw(split)
        return (
            Component(name="x", units=h, unit_elems=draw(elems), tensor="conv"),
            Component(name="B", units=g, unit_elems=draw(elems), tensor="conv"),
            Component(name="C", units=g, unit_elems=draw(elems), tensor="conv"),
            Component(name="ssm", units=h, unit_elems=draw(elems)),
        )
    kh, vh = draw(split), draw(split)
    return (
        Component(name="q", units=kh, unit_elems=draw(elems), tensor="conv"),
        Component(name="k", units=kh, unit_elems=draw(elems), tensor="conv"),
        Component(name="v", units=vh, unit_elems=draw(elems), tensor="conv"),
        Component(name="state", units=vh, unit_elems=draw(elems)),
    )


def kinds_for(tps: tuple[int, ...]) -> list[str]:
    """State groups split every unit: only where some unit count up to 32 splits over every size."""
    return list(KINDS) if math.lcm(*tps) <= 32 else ["full", "sliding", "mla"]


@st.composite
def structures(draw: st.DrawFn, tps: tuple[int, ...]) -> list[dict[str, Any]]:
    """1-4 groups (the fields both engines agree on), layers disjoint and interleaved."""
    kinds = draw(st.lists(st.sampled_from(kinds_for(tps)), min_size=1, max_size=4))
    counts = [draw(st.integers(1, 2)) for _ in kinds]
    order = draw(st.permutations(range(sum(counts))))
    dtype = st.sampled_from(["float16", "bfloat16", "float32", "int8"])
    out, used = [], 0
    for i, (kind, count) in enumerate(zip(kinds, counts, strict=True)):
        layers = tuple(sorted(order[used : used + count]))
        used += count
        out.append(
            dict(
                name=f"{kind}{i}",
                kind=kind,
                layers=layers,
                components=draw(components(kind, tps)),
                window=draw(st.integers(1, NMAX)) if kind == "sliding" else 0,
                dtype=draw(dtype),
            )
        )
    return out


@st.composite
def engine_fields(
    draw: st.DrawFn, group: dict[str, Any], chunk: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each engine's own fields of one group: block size (multiples of ``chunk``, one side's
    dividing the other's), pool size and layout."""
    comps = group["components"]
    uniform = len({(c.units, c.unit_elems, c.shard) for c in comps}) == 1
    state = group["kind"] in ("mamba2", "gdn")
    if state:
        layouts = [("HND", False), ("NHD", False), ("cross-layer", False), ("head-major", False)]
    elif uniform:
        layouts = LAYOUTS
    else:
        layouts = [("HND", False), ("NHD", False), ("cross-layer", False)]
    ka, kb = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (1, 3), (3, 1)]))
    out = []
    for k in (ka, kb):
        layout, joint = draw(st.sampled_from(layouts))
        joint = joint and group["kind"] in ("full", "sliding")  # K and V planes: attention only
        bs = 1 if state else chunk * k
        need = 1 if state else -(-NMAX // bs)
        out.append(
            dict(
                group, block_size=bs, num_blocks=need + draw(st.integers(0, 2)), layout=layout, joint_kv=joint
            )
        )
    return out[0], out[1]


@dataclass(frozen=True)
class Case:
    p: int
    d: int
    dspec: CacheSpec
    pspec: CacheSpec
    req: Request
    rid: str


@st.composite
def cases(draw: st.DrawFn, pairs: st.SearchStrategy[tuple[int, int]]) -> Case:
    """A (P, D) pair, two engines' caches of one model, and one request over them."""
    p, d = draw(pairs)
    groups = draw(structures((p, d)))
    chunk = draw(st.integers(1, 4))
    sided = [draw(engine_fields(g, chunk)) for g in groups]
    dspec = CacheSpec.create([a for a, _ in sided])
    pspec = CacheSpec.create([b for _, b in sided])
    n = draw(st.integers(1, NMAX))
    local, remote = [], []
    for lg, rg in zip(dspec.groups, pspec.groups, strict=True):
        if not lg.tokens:
            local.append(draw(st.sampled_from([1, 0])))  # 0: the state is cached already
            remote.append(1)
            continue
        nl, nr = -(-n // lg.block_size), -(-n // rg.block_size)
        ml = nl - draw(st.integers(0, nl))  # the group's own prefix hit: nl - ml blocks
        first = token_range(lg, rg, n, ml)[3] if ml else nr - 1
        local.append(ml)
        remote.append(draw(st.integers(nr - first, nr)))  # the prefill exposes at least what is read
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    req = make_request(dspec, pspec, n, local, remote, rng)
    return Case(p, d, dspec, pspec, req, f"req-{draw(st.integers(0, 10**6))}")


# -- checks --------------------------------------------------------------------------------------


def check_reads(plan: TransferPlan, cache: CacheSpec, d: int, dt: int, pt: int) -> None:
    """Every variant reads each unit of each component the decode rank holds exactly once,
    from a prefill rank that holds it and that the rank notifies."""
    assert plan.notify == cache.notify_ranks(d, dt, pt)
    assert set(plan.notify) == oracle_notify(cache, d, dt, pt)
    for reads in plan.variants:
        ranks = [op.remote_rank for op in reads.ops]
        assert ranks == sorted(set(ranks))
        assert set(ranks) | set(reads.standalone_notify) == set(plan.notify)
        assert not set(ranks) & set(reads.standalone_notify)
        assert {r.remote_rank for r in reads.detail} == set(ranks)
        for g in cache.groups:
            for c in g.components:
                got: list[int] = []
                for r in reads.detail:
                    if (r.group, r.component) != (g.name, c.name):
                        continue
                    assert r.local_units == r.remote_units  # the same global units on both sides
                    held = sharding.held_units(r.remote_rank, pt, c.units, c.shard)
                    assert set(r.remote_units) <= set(held), (
                        f"{g.name}.{c.name}: rank {r.remote_rank} lacks them"
                    )
                    got.extend(r.remote_units)
                assert sorted(got) == list(c.held(d, dt)), f"{g.name}.{c.name}: units not read exactly once"


def oracle_notify(cache: CacheSpec, d: int, dt: int, pt: int) -> set[int]:
    """Our own notify set: prefill ranks sharing a unit with decode rank d, or (replicated
    components) assigned to it, assignment ``p -> p*D//P`` or ``d -> d*P//D``."""
    out: set[int] = set()
    for g in cache.groups:
        for c in g.components:
            if c.shard == "replicate":
                out |= {q for q in range(pt) if q * dt // pt == d} if pt >= dt else {d * pt // dt}
                continue
            mine = set(sharding.held_units(d, dt, c.units, c.shard))
            out |= {q for q in range(pt) if mine & set(sharding.held_units(q, pt, c.units, c.shard))}
    return out


def run_case(case: Case) -> None:
    """Simulate every decode rank and check its plan; count the notifications of each
    prefill rank (a read's notice or a standalone one) over the decode ranks."""
    done = simulate(case.dspec, case.pspec, case.p, case.d, case.req, rid=case.rid, seed=5)
    notified = [0] * case.p
    for rank, x in enumerate(done):
        check_reads(x.plan, case.dspec, rank, case.d, case.p)
        for q in {op.remote_rank for op, _, _ in x.prepared.posts} | set(x.prepared.standalone):
            notified[q] += 1
    assert notified == [case.pspec.expected_notifications(q, case.p, case.d) for q in range(case.p)]
    assert min(notified) >= 1


# -- property tests --------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(cases(st.sampled_from(PAIRS)))
def test_every_unit_read_once_from_a_holder(case: Case) -> None:
    """Any (P, D) up to 16, any group mix, layouts, block-size pairs and prefix hits: each
    decode rank's reads rebuild every needed byte once, read only exposed prefill blocks."""
    run_case(case)


@pytest.mark.parametrize(("p", "d"), [(3, 6), (6, 4), (4, 6), (2, 3), (1, 16), (16, 2), (5, 10), (12, 8)])
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_non_multiple_tp_pairs(p: int, d: int, data: st.DataObject) -> None:
    """Pairs where neither TP size divides the other (or far apart ones), drawn every run."""
    run_case(data.draw(cases(st.just((p, d)))))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(KINDS), min_size=1, max_size=4), st.data())
def test_notify_sets_and_counts_every_pair(kinds: list[str], data: st.DataObject) -> None:
    """For one model and every (P, D) up to 16 where it shards: notify sets equal our own
    derivation, ``expected_notifications`` counts the decode ranks notifying each prefill
    rank (at least one each), and each component's reads cover its units once. Where it does
    not shard, ``check_rank`` raises a ConfigError naming the group and component."""
    groups = []
    for i, kind in enumerate(kinds):
        groups.append(
            Group(
                name=f"g{i}",
                kind=kind,  # type: ignore[arg-type]
                layers=(i,),
                components=data.draw(components(kind, ())),
                num_blocks=2,
                block_size=1 if kind in ("mamba2", "gdn") else 4,
                window=3 if kind == "sliding" else 0,
            )
        )
    cache = CacheSpec.create(groups)
    ok = {t: all(shards(c, t) for g in cache.groups for c in g.components) for t in SIZES}
    for t in SIZES:
        if ok[t]:
            cache.check_rank(t - 1, t)
            continue
        g, c = next((g, c) for g in cache.groups for c in g.components if not shards(c, t))
        with pytest.raises(ConfigError) as info:
            cache.check_rank(0, t)
        msg = str(info.value)
        assert msg.startswith(f"group {g.name!r}: ") and f"{c.units} " in msg
        assert re.search(rf"TP size {t}\b", msg), msg
        assert f" {c.name} " in msg or f": {c.name}: " in msg, msg
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    for pt in (t for t in SIZES if ok[t]):
        for dt in (t for t in SIZES if ok[t]):
            sets = [set(cache.notify_ranks(d, dt, pt)) for d in range(dt)]
            for d in range(dt):
                assert sets[d] == oracle_notify(cache, d, dt, pt)
            for q in range(pt):
                want = sum(q in s for s in sets)
                assert want >= 1, f"P={pt} D={dt}: prefill rank {q} is never notified"
                assert cache.expected_notifications(q, pt, dt) == want
            d, key = int(rng.integers(dt)), int(rng.integers(2**32))
            for g in cache.groups:
                for c in g.components:
                    got: list[int] = []
                    for r in sharding.component_reads(d, dt, pt, c.units, c.shard, key):
                        assert r.remote_rank in sets[d]
                        theirs = sharding.held_units(r.remote_rank, pt, c.units, c.shard)
                        mine = c.held(d, dt)
                        units = [theirs[i] for i in r.remote_heads]
                        assert units == [mine[i] for i in r.local_heads]
                        got.extend(units)
                    assert sorted(got) == list(c.held(d, dt))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(PAIRS), st.data())
def test_structural_differences_name_the_field(pair: tuple[int, int], data: st.DataObject) -> None:
    """A peer whose model differs in one place (a component's units or unit_elems, a group's
    dtype or layers, a missing group) is refused by check_peer, naming that one field by
    group and component; pool size, block size and layout never count."""
    groups = data.draw(structures(pair))
    base = [dict(g, block_size=1 if g["kind"] in ("mamba2", "gdn") else 4, num_blocks=4) for g in groups]
    gi = data.draw(st.integers(0, len(base) - 1))
    g = base[gi]
    other = [dict(x, num_blocks=7, layout="cross-layer", joint_kv=False) for x in base]
    how = data.draw(st.sampled_from(["units", "unit_elems", "dtype", "layers", "groups"]))
    if how in ("units", "unit_elems"):
        ci = data.draw(st.integers(0, len(g["components"]) - 1))
        c = g["components"][ci]
        changed = msgspec.structs.replace(c, **{how: getattr(c, how) * 2})
        comps = tuple(changed if i == ci else x for i, x in enumerate(g["components"]))
        other[gi]["components"] = comps
        field, text = f"{g['name']}.{c.name}.{how}", f"group {g['name']!r} component {c.name!r} {how}"
    elif how == "dtype":
        other[gi]["dtype"] = "float32" if g["dtype"] != "float32" else "int8"
        field, text = f"{g['name']}.dtype", f"group {g['name']!r} dtype"
    elif how == "layers":
        other[gi]["layers"] = (*g["layers"], 100)
        field, text = f"{g['name']}.layers", f"group {g['name']!r} layers"
    else:
        del other[gi]
        other = other or [dict(g, name="other")]
        field, text = "groups", "groups: decode="
    a, b = CacheSpec.create(base), CacheSpec.create(other)
    with pytest.raises(IncompatiblePeerError) as info:
        check_peer(a, b)
    assert info.value.fields == (field,)
    assert text in str(info.value)
    assert a.compat_hash() != b.compat_hash()
    same = [dict(x, num_blocks=9, layout="NHD", joint_kv=False) for x in base]
    check_peer(a, CacheSpec.create(same))
    assert a.compat_hash() == CacheSpec.create(same).compat_hash()


# -- examples ------------------------------------------------------------------------------------


def plans(spec: CacheSpec, p: int, d: int) -> list[TransferPlan]:
    prefill = sides(spec, p, base=1 << 44)
    return [
        TransferPlan(
            local_spec=spec,
            local=Side(spec, r, d, base=1 << 40).memory,
            remote_spec=spec,
            remote={q: s.memory for q, s in prefill.items()},
        )
        for r in range(d)
    ]


def test_qwen3_next_needs_more_prefill_ranks_for_state_than_for_heads() -> None:
    """Qwen3-Next (2 KV heads, GDN state split 4 ways) at P=4, D=1: attention comes from 2
    prefill ranks (one replica of each head), the GDN state from all 4; all 4 are notified."""
    spec = preset("qwen3-next-80b", layers=4, blocks=8)
    (plan,) = plans(spec, 4, 1)
    assert plan.notify == (0, 1, 2, 3)
    assert len(plan.variants) == 2
    for reads in plan.variants:
        full = {r.remote_rank for r in reads.detail if r.group == "full"}
        gdn = {r.remote_rank for r in reads.detail if r.group == "gdn"}
        assert len(full) == 2 and len({q // 2 for q in full}) == 2  # one of {0, 1}, one of {2, 3}
        assert gdn == {0, 1, 2, 3}
    n = 40
    req = make_request(spec, spec, n, [3, 1], [3, 1], np.random.default_rng(1))
    (done,) = simulate(spec, spec, 4, 1, req)
    assert done.ranks == {0, 1, 2, 3}
    assert [spec.expected_notifications(q, 4, 1) for q in range(4)] == [1, 1, 1, 1]


def test_nemotron_h_at_tp_16_names_the_groups_that_do_not_split() -> None:
    """Nemotron-H-8B: 8 Mamba2 groups (B, C) do not split over 16 ranks; 8 KV heads do not
    split over 3. The errors name the group, the component and both sizes."""
    spec = preset("nemotron-h-8b", layers=3, blocks=4)
    spec.check_rank(0, 8)
    with pytest.raises(ConfigError, match=r"group 'mamba': B: 8 units cannot be split over TP size 16"):
        spec.check_rank(0, 16)
    with pytest.raises(ConfigError, match=r"group 'full': k: 8 heads cannot be split over TP size 3"):
        spec.check_rank(0, 3)
    with pytest.raises(ConfigError, match="16"):
        plans(spec, 8, 16)


def test_block_sizes_not_multiples_are_refused() -> None:
    """Block sizes 16 and 24: IncompatiblePeerError naming the group's block_size and both sizes."""
    a = preset("llama-3.1-8b", layers=1, blocks=4, block_size=16)
    b = preset("llama-3.1-8b", layers=1, blocks=4, block_size=24)
    for x, y in ((a, b), (b, a)):
        with pytest.raises(
            IncompatiblePeerError, match=r"group 'full' block size: decode=\d+ prefill=\d+"
        ) as info:
            check_peer(x, y)
        assert info.value.fields == ("full.block_size",)
    assert a.compat_hash() == b.compat_hash()
    check_peer(a, preset("llama-3.1-8b", layers=1, blocks=4, block_size=32))


def swa_group(comps: tuple[Component, ...], *, window: int, block_size: int = 4) -> Group:
    """A sliding-window group "swa" of model layer 0, 8 blocks of ``block_size`` tokens."""
    return Group(
        name="swa",
        kind="sliding",
        layers=(0,),
        components=comps,
        num_blocks=8,
        block_size=block_size,
        window=window,
    )


def sliding_spec(window: int) -> CacheSpec:
    comps = (
        Component(name="k", units=2, unit_elems=2, shard="heads"),
        Component(name="v", units=2, unit_elems=2, shard="heads"),
    )
    return CacheSpec.create(
        [
            Group(name="full", kind="full", layers=(1,), components=comps, num_blocks=8, block_size=4),
            swa_group(comps, window=window),
        ]
    )


@pytest.mark.parametrize(
    ("n", "window", "blocks"), [(20, 8, [3, 4]), (18, 8, [2, 3, 4]), (20, 1, [4]), (6, 100, [0, 1])]
)
def test_sliding_window_reads_only_window_blocks(n: int, window: int, blocks: list[int]) -> None:
    """A sliding group reads only the blocks holding its last ``window`` tokens, even when
    both sides hold every block of the sequence."""
    spec = sliding_spec(window)
    nb = -(-n // 4)
    req = make_request(spec, spec, n, [nb, nb], [nb, nb], np.random.default_rng(0))
    for done in simulate(spec, spec, 2, 1, req):
        swa = spec.offsets[1] + req.remote[1][blocks]
        full = spec.offsets[0] + req.remote[0]
        assert done.read == set(swa.tolist()) | set(full.tolist())


def test_sliding_window_needs_the_token_count_to_trim() -> None:
    """Without num_tokens a sliding group reads every block both lists name (nothing is lost
    when the last block is partly filled); with it, only the blocks of the window."""
    comps = (Component(name="k", units=1, unit_elems=1, shard="heads"),)
    spec = CacheSpec.create([swa_group(comps, window=2, block_size=2)])
    (plan,) = plans(spec, 1, 1)
    whole = plan.prepare("r", [0, 1, 2], [3, 4, 5])
    assert whole.read_ids.tolist() == [3, 4, 5] and whole.bytes == 3 * 2 * 2  # 3 blocks of 2 tokens
    trimmed = plan.prepare("r", [0, 1, 2], [3, 4, 5], 6)
    assert trimmed.read_ids.tolist() == [5] and trimmed.bytes == 2 * 2
    # 5 tokens: the window [3, 5) spans the last two blocks
    assert plan.prepare("r", [0, 1, 2], [3, 4, 5], 5).read_ids.tolist() == [4, 5]


@pytest.mark.parametrize(
    ("num_tokens", "match"),
    [(0, "give num_tokens > 0"), (7.5, "must be an integer"), (True, "must be an integer"), (-1, ">= 0")],
)
def test_bad_token_counts_are_block_id_errors(num_tokens: object, match: str) -> None:
    """A token count that is 0 with blocks to fill, not an integer, or negative is refused
    instead of reading nothing (or the wrong bytes) and reporting success."""
    spec = preset("llama-3.1-8b", layers=1, blocks=8, block_size=4)
    (plan,) = plans(spec, 1, 1)
    with pytest.raises(BlockIdError, match=match):
        plan.prepare("r", [0, 1], [2, 3], num_tokens)  # type: ignore[arg-type]


def state_spec() -> CacheSpec:
    return preset("nemotron-h-8b", layers=2, blocks=4, block_size=4)


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        (
            {"full": [0], "mamba": [1, 2]},
            {"full": [0], "mamba": [1]},
            "local_block_ids of group 'mamba'.*2 ids",
        ),
        (
            {"full": [0], "mamba": [1]},
            {"full": [0], "mamba": [1, 2]},
            "remote_block_ids of group 'mamba'.*2 ids",
        ),
        ({"full": [0], "mamba": [1]}, {"full": [0]}, "group 'mamba': the prefill side exposes 0 state slots"),
        ([0, 1], [0, 1], "give block ids as a mapping"),
        ({"full": [0], "ssm": [1]}, {"full": [0]}, r"no group \['ssm'\]"),
    ],
)
def test_state_groups_hold_one_slot(local: Any, remote: Any, match: str) -> None:
    """A state group takes one slot per request on each side; ids of a hybrid cache are per group."""
    (plan,) = plans(state_spec(), 1, 1)
    with pytest.raises(BlockIdError, match=match):
        plan.prepare("r", local, remote, 4)


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 4), (4, 2), (8, 1)])
def test_state_slot_read_whole_whatever_the_tokens(p: int, d: int) -> None:
    """The state slot is read whole even when the attention group has a full prefix hit, and
    not at all when the decode side gives no slot."""
    spec = state_spec()
    layout = Side(spec, 0, d, base=0)
    slot = sum(layout.block_bytes[r] for r in layout.regions(1))
    req = make_request(spec, spec, 9, [0, 1], [3, 1], np.random.default_rng(2))
    for done in simulate(spec, spec, p, d, req):
        assert done.bytes == slot and done.read == {spec.offsets[1] + int(req.remote[1][0])}
    req = make_request(spec, spec, 9, [3, 0], [3, 1], np.random.default_rng(2))
    for done in simulate(spec, spec, p, d, req):
        assert done.read == set((spec.offsets[0] + req.remote[0]).tolist())


# -- layouts given as axis orders ------------------------------------------------------------------

ATTENTION_ORDERS = [
    "block,unit,token,elem",
    "block,token,unit,elem",
    "block,layer,comp,unit,token,elem",
    "block,unit,layer,comp,token,elem",
    "block,comp,token,unit,elem",
    "block,token,layer,unit,comp,elem",
]
STATE_ORDERS = ["block,unit,elem", "block,layer,unit,elem"]


def axis_cache(full: str, state: str, block_size: int) -> CacheSpec:
    attn = (
        Component(name="k", units=4, unit_elems=2, shard="heads"),
        Component(name="v", units=4, unit_elems=2, shard="heads"),
    )
    gdn = (
        Component(name="q", units=4, unit_elems=2, tensor="conv"),
        Component(name="v", units=8, unit_elems=1, tensor="conv"),
        Component(name="state", units=8, unit_elems=3),
    )
    return CacheSpec.create(
        [
            Group(
                name="full",
                kind="full",
                layers=(1, 3),
                components=attn,
                num_blocks=8,
                block_size=block_size,
                layout=full,
            ),
            Group(
                name="gdn",
                kind="gdn",
                layers=(0, 2),
                components=gdn,
                num_blocks=3,
                block_size=1,
                layout=state,
            ),
        ]
    )


@pytest.mark.parametrize("order", ATTENTION_ORDERS)
@pytest.mark.parametrize(("p", "d"), [(2, 4), (4, 1)])
def test_axis_order_layouts_bit_exact(order: str, p: int, d: int) -> None:
    """An engine's own tensors described as an axis order (block outermost) pair with the
    named layouts of the other side, in both directions, with different block sizes."""
    for i, (a, b) in enumerate(
        [
            ((order, STATE_ORDERS[0]), ("HND", "HND")),
            (("head-major", "cross-layer"), (order, STATE_ORDERS[1])),
        ]
    ):
        dspec, pspec = axis_cache(*a, block_size=4), axis_cache(*b, block_size=8)
        req = make_request(dspec, pspec, 13, [3, 1], [2, 1], np.random.default_rng(i))
        simulate(dspec, pspec, p, d, req)


def test_expected_blocks_with_the_block_axis_inside_a_region() -> None:
    """akv.testing's expected_blocks, for an axis order with the block axis inside a region
    (vLLM's per-layer ``[2, blocks, tokens, heads, dim]``), gives ``(positions, block_bytes)``
    or refuses with a ConfigError saying why; it never fails with an IndexError."""
    spec = axis_cache("comp,block,token,unit,elem", "block,unit,elem", block_size=2)
    shape = rank_layout(spec, 0, 1).shapes[0]
    assert shape == (2, 8, 2, 4, 2)
    try:
        want = expected_blocks(spec, 0, 1, 0, 1, [0, 1])
    except ConfigError as exc:
        assert "layout" in str(exc) or "axis" in str(exc), exc
        return
    assert want.shape == (2, math.prod(shape) // 8 * 2)  # bfloat16
