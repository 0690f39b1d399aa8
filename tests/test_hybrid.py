"""Hybrid caches and geometries end to end, with the deployment shape on the prefill side.

Each prefill engine is ``akv prefill`` started without ``--tp-rank``: one process per rank,
rank 0 the bootstrap. Decode ranks each have their own NIXL agent in this process. Every
pull is checked bit-exact per group (the fill encodes group, layer, component, unit, token
and byte), and the prefill engine must report every request released by read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import Any

import msgspec
import pytest

import akv
from akv.geometry.cache import as_cache
from akv.presets import preset
from akv.testing import fetch_requests, json_lines, local_counts, spawn_prefill, verify_request

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # processes and agents dominate; the event loop is covered elsewhere


LAYERS = 4
BLOCKS = 48


@contextmanager
def prefill(*argv: str, requests: int) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """An ``akv prefill`` engine (one process per rank); yields its endpoint and, after the
    block, the summary it printed once every request was released."""
    proc, endpoint = spawn_prefill(*argv, "--requests", str(requests), "--lease", "60", "--timeout", "120")
    summary: list[dict[str, Any]] = []
    try:
        yield endpoint, summary
        out = proc.communicate(timeout=60)[0]
        summary.extend(m for m in json_lines(out.splitlines()) if m.get("event") == "summary")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@asynccontextmanager
async def decode(spec: Any, tp: int, engine: str) -> AsyncIterator[list[akv.Consumer]]:
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                akv.Consumer(
                    akv.allocate_kv_cache(spec, d, tp), spec, tp_rank=d, tp_size=tp, engine_id=engine
                )
            )
            for d in range(tp)
        ]


async def pull_all(endpoint: str, spec: Any, tp: int, engine: str, pick: Sequence[int]) -> int:
    """Decode engine ``engine`` (``tp`` ranks, cache ``spec``) pulls the announced requests at
    positions ``pick``, every other one after a one-block prefix hit; returns bytes moved."""
    cache = as_cache(spec)
    moved = 0
    async with decode(spec, tp, engine) as consumers:
        sessions = [await c.connect(endpoint) for c in consumers]
        announced = await fetch_requests(endpoint, spec, None, engine)
        next_free = {g.name: 0 for g in cache.groups}
        for n, i in enumerate(pick):
            req = announced[i]
            counts = local_counts(cache, req.num_tokens, hit=n % 2)
            local = {}
            for name, count in counts.items():
                local[name] = list(range(next_free[name], next_free[name] + count))
                next_free[name] += count
            ids: Any = local if len(cache.groups) > 1 else local[cache.groups[0].name]
            pr = akv.PullRequest(
                request_id=req.request_id,
                local_block_ids=ids,
                remote_block_ids=req.block_ids,
                num_tokens=req.num_tokens,
            )
            results = [await (await s.pull(pr)) for s in sessions]
            moved += sum(r.bytes for r in results)
            for d, c in enumerate(consumers):
                assert verify_request(c.kv_caches, spec, d, tp, ids, req.seed, num_tokens=req.num_tokens), (
                    req.request_id,
                    d,
                )
    return moved


# Per preset: (prefill TP, [decode TPs]): prefill TP 2 to decode TP 1 and 4, fewer and more
# ranks than prefill (tests/test_tp.py checks the plans of every size pair; tests/test_deployment.py
# moves bytes between rank processes of other sizes, P8 -> D2 and MLA P4 -> D2 among them).
PAIRS: dict[str, list[tuple[int, list[int]]]] = {
    "llama-3.1-8b": [(2, [1, 4])],
    "deepseek-v3": [(2, [1, 4])],
    "gemma-3-27b": [(2, [1, 4])],
    "gpt-oss-120b": [(2, [1, 4])],
    # P=4 -> D=2: a decode rank reads its attention head from one prefill rank but its
    # GDN state from two (attention heads are replicated there, state is always split).
    "qwen3-next-80b": [(4, [2, 1]), (1, [2])],
    "nemotron-h-8b": [(2, [1, 4])],
}


@pytest.mark.parametrize("name", list(PAIRS))
async def test_each_preset_bit_exact_over_tp_pairs(name: str) -> None:
    """Every preset (scaled to 4 layers, all kinds kept) pulls bit-exact per group over TP pairs
    with fewer and more decode ranks than prefill ranks, with per-group prefix hits and
    per-group block ids, and every request is released by read."""
    spec = preset(name, layers=LAYERS, blocks=BLOCKS)
    flags = ["--preset", name, "--layers", str(LAYERS), "--blocks", str(BLOCKS), "--blocks-per-request", "4"]
    for p, decode_tps in PAIRS[name]:
        per = 2
        with prefill("--tp-size", str(p), *flags, requests=per * len(decode_tps)) as (endpoint, summary):
            for k, d in enumerate(decode_tps):
                moved = await pull_all(
                    endpoint, spec, d, f"dec-{name}-{p}-{d}", range(k * per, (k + 1) * per)
                )
                assert moved > 0
        assert summary and summary[-1]["released"] == per * len(decode_tps), summary
        assert summary[-1]["expired"] == 0


async def test_state_needs_more_prefill_ranks_than_attention() -> None:
    """Qwen3-Next at P=4 -> D=2: the attention group is read from one prefill rank, the GDN
    state from two, and the decode rank notifies exactly those two."""
    spec = preset("qwen3-next-80b", layers=LAYERS, blocks=BLOCKS)
    with prefill("--tp-size", "4", "--preset", "qwen3-next-80b", "--layers", str(LAYERS), requests=1) as (
        endpoint,
        _,
    ):
        async with decode(spec, 2, "dec-q") as consumers:
            session = await consumers[0].connect(endpoint)
            assert session.plan is not None
            reads = session.plan.reads(0).detail
            attention = {r.remote_rank for r in reads if r.group == "full"}
            state = {r.remote_rank for r in reads if r.group == "gdn"}
            assert len(attention) == 1 and state == {0, 1}
            assert session.plan.notify == (0, 1)
            # the request is read by both decode ranks, so the engine can finish
            await pull_all(endpoint, spec, 2, "dec-q2", [0])


LAYOUTS = ("HND", "NHD", "cross-layer", "head-major")
KV = ["--kv-heads", "4", "--head-dim", "16", "--layers", "3", "--blocks", "64", "--dtype", "float16"]


def kv_spec(layout: str, block_size: int) -> akv.KVSpec:
    return akv.KVSpec.create(
        layers=3,
        num_blocks=64,
        block_size=block_size,
        kv_heads=4,
        head_dim=16,
        dtype="float16",
        layout=layout,
    )


@pytest.mark.parametrize("prefill_layout", LAYOUTS)
@pytest.mark.parametrize(
    ("prefill_tp", "prefill_bs", "cases"), [(2, 16, [(1, 16), (4, 32), (2, 16)]), (1, 32, [(2, 16), (4, 64)])]
)
async def test_every_layout_pair_and_block_size_pair(
    prefill_layout: str, prefill_tp: int, prefill_bs: int, cases: list[tuple[int, int]]
) -> None:
    """Per-rank prefill processes with one layout and block size; decode engines of every
    layout, several TP sizes and block sizes (smaller and larger) pull bit-exact, including a
    last block the tokens only partly fill, and the engine releases every request by read.

    Each decode layout pulls once per prefill engine, with the (TP size, block size) cases
    taken in turn from where the prefill layout's rotation starts: over the four prefill
    layouts every (decode layout, case) pair runs, and every layout pair in each engine
    shape (the full product is four times the suite's time for the same pairs)."""
    start = LAYOUTS.index(prefill_layout)
    combos = [(layout, *cases[(start + k) % len(cases)]) for k, layout in enumerate(LAYOUTS)]
    argv = ["--tp-size", str(prefill_tp), *KV, "--layout", prefill_layout, "--block-size", str(prefill_bs)]
    with prefill(*argv, "--blocks-per-request", "3", requests=len(combos)) as (endpoint, summary):
        for i, (layout, d, bs) in enumerate(combos):
            await pull_all(endpoint, kv_spec(layout, bs), d, f"dec-{i}", [i])
    assert summary and summary[-1]["released"] == len(combos) and summary[-1]["expired"] == 0, summary


async def test_non_dividing_shapes_are_typed_errors_and_the_engine_keeps_serving() -> None:
    """A decode TP that does not divide a component, a structure that differs, a block size
    that is not a multiple, and a request with two state slots are typed errors naming what
    to change; the prefill engine keeps serving and a good decode engine then pulls bit-exact."""
    name = "nemotron-h-8b"
    spec = preset(name, layers=3, blocks=BLOCKS)
    flags = ["--preset", name, "--layers", "3", "--blocks", str(BLOCKS), "--blocks-per-request", "2"]
    with prefill("--tp-size", "2", *flags, requests=1) as (endpoint, summary):
        with pytest.raises(
            akv.ConfigError, match=r"group 'mamba': B: 8 units cannot be split over TP size 16"
        ):
            akv.Consumer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=16)
        other = preset(name, layers=4, blocks=BLOCKS)
        async with decode(other, 1, "bad-structure") as (consumer,):
            with pytest.raises(akv.IncompatiblePeerError, match="group 'mamba' layers") as info:
                await consumer.connect(endpoint)
            assert "mamba.layers" in info.value.fields
        odd = preset(name, layers=3, blocks=BLOCKS, block_size=24)
        async with decode(odd, 1, "bad-bs") as (consumer,):
            with pytest.raises(akv.IncompatiblePeerError, match="block sizes must be multiples"):
                await consumer.connect(endpoint)
        async with decode(spec, 1, "bad-ids") as (consumer,):
            session = await consumer.connect(endpoint)
            req = (await fetch_requests(endpoint, spec, None, "bad-ids"))[0]
            with pytest.raises(akv.BlockIdError, match="one state slot per request"):
                await session.pull(req.request_id, {"full": [0, 1], "mamba": [0, 1]}, req.block_ids)
            with pytest.raises(akv.BlockIdError, match="no group"):
                await session.pull(req.request_id, {"attn": [0]}, req.block_ids)
        await pull_all(endpoint, spec, 1, "good", [0])
    assert summary and summary[-1]["released"] == 1, summary


def test_plan_command_shows_each_group() -> None:
    """``akv plan --preset`` prints per group and component who reads what from whom, and exits
    64 with one line for a TP size a component does not divide."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "akv",
            "plan",
            "--preset",
            "qwen3-next-80b",
            "--prefill-tp",
            "4",
            "--decode-tp",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    plan = json.loads(out)
    rank0 = plan["decode"][0]
    groups = {g["group"]: g for g in rank0["groups"]}
    assert set(groups) == {"full", "gdn"}
    state = next(c for c in groups["gdn"]["components"] if c["component"] == "state")
    assert [(r["remote_rank"], r["units"]) for r in state["reads"]] == [(0, [0, 8]), (1, [8, 16])]
    assert rank0["notify"] == [0, 1] and plan["expected_notifications"] == [1, 1, 1, 1]
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "akv",
            "plan",
            "--preset",
            "nemotron-h-8b",
            "--prefill-tp",
            "16",
            "--decode-tp",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 64 and bad.stderr.count("\n") == 1 and "B: 8 units" in bad.stderr


async def test_engine_tensors_described_by_axis_order(tmp_path: Any) -> None:
    """A prefill engine whose tensors are per-layer ``[2, blocks, tokens, heads, dim]`` (K/V
    outside the blocks, as vLLM allocates them), described by ``--config`` with an axis-order
    layout, serves decode engines on head-major and HND bit-exact; its per-layer views are
    the K and V planes of each layer tensor."""
    base = preset("llama-3.1-8b", layers=3, blocks=BLOCKS)
    own = akv.CacheSpec.create(
        [msgspec.structs.replace(g, layout="comp,block,token,unit,elem") for g in base.groups]
    )
    kv = akv.allocate_kv_cache(own, 0, 2)
    assert [tuple(t.shape) for t in kv] == [(2, BLOCKS, 16, 4, 128)] * 3
    views = akv.layer_views(kv, own, 0, 2)["full"][1]
    assert views["v"].data_ptr() == kv[1][1].data_ptr() and views["k"].shape == (BLOCKS, 4, 16, 128)
    path = tmp_path / "own.json"
    path.write_bytes(own.to_json())
    with prefill("--tp-size", "2", "--config", str(path), "--blocks-per-request", "3", requests=2) as (
        endpoint,
        summary,
    ):
        await pull_all(
            endpoint,
            msgspec.structs.replace(
                base, groups=tuple(msgspec.structs.replace(g, layout="head-major") for g in base.groups)
            ),
            4,
            "hm",
            [0],
        )
        await pull_all(endpoint, base, 1, "hnd", [1])
    assert summary and summary[-1]["released"] == 2, summary
