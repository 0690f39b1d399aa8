"""Packed push: prefill ranks WRITE their packed copies (`akv.packing`) into a staging range
the decode rank granted, a few descriptors each, and the decode rank scatters them.

Real NIXL agents over UCX loopback (DRAM); the prefill ranks of the in-process engines are
reached through NIXL (``same_process="nixl"``).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import akv
from akv.testing import make_requests, verify_request
from tests.conftest import decode_rank, make_spec, prefill_engine, wait_for
from tests.transfers import PULL_PAIRS, pull_every_request

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pusher(spec: Any, rank: int = 0, size: int = 1, transfer: str = "packed", **kw: Any) -> akv.Consumer:
    """A decode rank in push mode reaching prefill ranks of this process through NIXL."""
    return decode_rank(spec, rank, size, same_process="nixl", mode="push", transfer=transfer, **kw)


def counter(engine: Any, name: str) -> int:
    return sum(p.metrics.snapshot().counters.get(name, 0) for p in engine.producers)


@pytest.mark.parametrize(("pspec", "dspec", "p", "d"), PULL_PAIRS)
async def test_packed_pushes_are_bit_exact(pspec: Any, dspec: Any, p: int, d: int) -> None:
    """Every pairing kind (TP pairings, MLA, hybrid groups, sliding windows, mixed layouts and
    block sizes, a partial prefix hit) pushed packed: bit-exact, path "push", the bytes a
    direct push moves in fewer descriptors, every writer serving from its packed copy, each
    prefill rank releasing each request once; the staging area is all free afterwards."""
    staging: list[akv.Consumer] = []

    def packed(r: int) -> akv.Consumer:
        staging.append(pusher(dspec, r, d))
        return staging[-1]

    results, engine = await pull_every_request(
        pspec, dspec, p, d, packed, requests=2, seed=13, transfer="packed"
    )
    direct, _ = await pull_every_request(
        pspec, dspec, p, d, lambda r: pusher(dspec, r, d, "direct"), requests=2, seed=13, transfer="packed"
    )
    assert {r.path for r in results} == {"push"} and {r.path for r in direct} == {"push"}
    assert [r.bytes for r in results] == [r.bytes for r in direct]
    assert sum(r.descriptors for r in results) < sum(r.descriptors for r in direct)
    assert counter(engine, "packed_pushes") == sum(r.reads for r in results)
    assert {why for _, why in engine.reasons} <= {"pushed", "read"}
    for rid in {rid for rid, _ in engine.reasons}:
        assert sum(n for (r, _), n in engine.reasons.items() if r == rid) == p
    for c in staging:
        assert c.staging is not None and c.staging.arena.allocations == 0


async def test_a_writer_without_a_packed_copy_writes_the_blocks() -> None:
    """A packed push of a request its writer could not pack (pool full) is written into the
    paged blocks by that writer: bit-exact, as many descriptors as a direct push, nothing
    scattered, the staging range freed."""
    spec = make_spec(kv_heads=4)
    *reqs, other = make_requests(spec, 3, 3, seed=31)
    async with (
        prefill_engine(spec, 2, transfer="packed", pack_pool_bytes=256) as engine,
        pusher(spec) as c,
        pusher(spec, transfer="direct") as plain,
    ):
        engine.expose_requests([*reqs, other])
        assert counter(engine, "pack_fallbacks") == 6
        session = await c.connect(engine.endpoint)
        direct = await (
            await (await plain.connect(engine.endpoint)).pull(other.request_id, [0, 1, 2], other.block_ids)
        )
        for n, req in enumerate(reqs):
            local = [3 * n, 3 * n + 1, 3 * n + 2]
            result = await (await session.pull(req.request_id, local, req.block_ids))
            assert result.path == "push" and result.descriptors == direct.descriptors  # the blocks'
            assert verify_request(c.kv_caches, spec, 0, 1, local, req.seed)
        assert counter(engine, "packed_pushes") == 0 and counter(engine, "push_writes") >= 4
        assert c.staging is not None and c.staging.arena.allocations == 0


async def test_a_full_staging_area_pushes_the_blocks() -> None:
    """Packed pushes in flight beyond the staging area's room are granted the paged blocks
    instead (direct push): all bit-exact, the staging area free afterwards."""
    spec = make_spec(kv_heads=4)
    reqs = make_requests(spec, 4, 3, seed=37)
    slot = 2 * 4 * 12 * 2 * 16  # k and v, 4 heads x 12 tokens x 2 layers x 16 bytes
    async with (
        prefill_engine(spec, 1, transfer="packed") as engine,
        pusher(spec, pack_staging_bytes=slot) as c,
    ):
        engine.expose_requests(reqs, layers_ready=0)  # nothing written before every pull is granted
        session = await c.connect(engine.endpoint)
        pulls = [
            await session.pull(req.request_id, [3 * n, 3 * n + 1, 3 * n + 2], req.block_ids)
            for n, req in enumerate(reqs)
        ]
        await anyio.sleep(0.05)
        assert not any(t.done() for t in pulls)
        for req in reqs:
            engine.producers[0].layers_ready(req.request_id, spec.layers)
        for n, (t, req) in enumerate(zip(pulls, reqs, strict=True)):
            assert (await t).path == "push"
            assert verify_request(c.kv_caches, spec, 0, 1, [3 * n, 3 * n + 1, 3 * n + 2], req.seed)
        assert counter(engine, "packed_pushes") == 0  # none was packed before its last layer
        assert c.staging is not None and c.staging.arena.allocations == 0


async def test_a_cancelled_packed_push_scatters_nothing() -> None:
    """A packed push cancelled before its writer could serve it (not exposed yet) returns once
    the writer confirmed; exposing the request afterwards writes nothing into the blocks, and
    the staging range is free again."""
    spec = make_spec(kv_heads=4)
    (req,) = make_requests(spec, 1, 3, seed=41)
    async with prefill_engine(spec, 1, transfer="packed") as engine, pusher(spec) as c:
        session = await c.connect(engine.endpoint)
        t = await session.pull(req.request_id, [0, 1, 2], req.block_ids)
        await anyio.sleep(0.05)
        await t.cancel()
        with pytest.raises(akv.errors.TransferCancelledError):
            await t
        for region in c.kv_caches:
            region[:3].fill_(7)
        engine.expose_requests([req])
        await anyio.sleep(0.3)
        assert all(bool((region[:3] == 7).all()) for region in c.kv_caches)
        assert c.staging is not None and c.staging.arena.allocations == 0
        assert c.metrics.snapshot().counters.get("push_stops_unconfirmed", 0) == 0
        await wait_for(lambda: counter(engine, "packed_pushes") == 0)
