"""Lease safety: a pull reports success only if every block it read was still exposed for its
request when the reads completed (real NIXL agents, DRAM, UCX over loopback)."""

from __future__ import annotations

import anyio
import pytest
import torch

import akv
from akv.testing import fill_request
from tests.conftest import decode_engine, make_spec, prefill_engine, verify, wait_for

pytestmark = pytest.mark.anyio


def overwrite(engine_spec: akv.KVSpec, producer: akv.Producer, block_ids: list[int]) -> None:
    """What an engine reusing freed blocks does: new data lands in them."""
    for t in producer.kv_caches:
        t.view(torch.uint8).view(engine_spec.num_blocks, -1)[block_ids] = 0xAB


async def test_pull_after_lease_release_and_reuse_fails_never_succeeds() -> None:
    """The reported reproduction: blocks released by lease and refilled by their next owner;
    a later pull fails with LeaseExpiredError and never reports success."""
    spec = make_spec()
    async with prefill_engine(spec, 1, lease=1.0) as engine, decode_engine(spec, 1) as (consumer,):
        producer = engine.producers[0]
        producer.on_release = lambda rel: overwrite(spec, producer, rel.block_ids.tolist())
        engine.fill("r1", [0, 1, 2], seed=5)
        session = await consumer.connect(engine.endpoint)
        await anyio.sleep(2.0)
        transfer = await session.pull("r1", [10, 11, 12], [0, 1, 2])
        with pytest.raises(akv.LeaseExpiredError, match="released by lease") as info:
            await transfer
        assert info.value.prefill_rank == 0 and info.value.block_ids == (0, 1, 2)
        assert transfer.done() and isinstance(transfer.exception(), akv.UnsafeReadError)
        assert consumer.metrics.counters["transfers"] == 0
        assert consumer.metrics.counters["unsafe_reads"] == 1


async def test_never_exposed_request_fails_not_exposed() -> None:
    """A request id that was never exposed fails with NotExposedError."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine, decode_engine(spec, 1) as (consumer,):
        session = await consumer.connect(engine.endpoint)
        with pytest.raises(akv.NotExposedError, match="'ghost' on prefill rank 0 is not exposed"):
            await (await session.pull("ghost", [1, 2], [3, 4]))
        assert consumer.metrics.counters["transfers"] == 0


@pytest.mark.parametrize(
    ("wrong", "error"),
    [([7, 8, 9], akv.OutsideExposureError), ([0, 1, 5], akv.OutsideExposureError)],
    ids=["disjoint", "overlapping"],
)
async def test_blocks_outside_the_exposure_fail_and_do_not_release(
    wrong: list[int], error: type[akv.UnsafeReadError]
) -> None:
    """Remote block ids other than the exposed ones fail typed, and the real request is not
    released as 'read' because of that pull's notice; a correct pull then succeeds."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine, decode_engine(spec, 1) as (consumer,):
        engine.fill("real", [0, 1, 2], seed=3)
        session = await consumer.connect(engine.endpoint)
        with pytest.raises(error, match="blocks outside its exposure"):
            await (await session.pull("real", [20, 21, 22], wrong))
        await anyio.sleep(0.2)
        assert engine.releases == []
        assert engine.producers[0].metrics.counters["notifications_invalid"] >= 1
        await (await session.pull("real", [20, 21, 22], [0, 1, 2]))
        assert verify(consumer, [20, 21, 22], 3, [0, 1, 2])
        await wait_for(lambda: [r.reason for r in engine.releases] == ["read"])


async def test_already_released_request_fails_released() -> None:
    """Pulling a request again after every reader released it fails with ReleasedError."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine, decode_engine(spec, 1) as (consumer,):
        engine.fill("once", [4, 5], seed=2)
        session = await consumer.connect(engine.endpoint)
        await (await session.pull("once", [6, 7], [4, 5]))
        await wait_for(lambda: [r.reason for r in engine.releases] == ["read"])
        with pytest.raises(akv.ReleasedError, match=r"released .* before the reads finished"):
            await (await session.pull("once", [8, 9], [4, 5]))


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "kv_heads", "mla"),
    [(2, 1, 4, False), (4, 2, 2, False), (1, 2, 2, False), (2, 1, 1, True), (1, 3, 1, True)],
)
async def test_every_tp_pairing_checks_every_rank_read(
    prefill_tp: int, decode_tp: int, kv_heads: int, mla: bool
) -> None:
    """On every pairing a pull succeeds (bit-exact, prefix tails included) while exposed, and
    fails typed on every decode rank once a prefill rank it reads from released by lease."""
    spec = make_spec(kv_heads=kv_heads, mla=mla)
    async with (
        prefill_engine(spec, prefill_tp, lease=30) as engine,
        decode_engine(spec, decode_tp) as consumers,
    ):
        sessions = [await c.connect(engine.endpoint) for c in consumers]
        engine.fill("ok", [1, 2, 3], seed=7)
        for s in sessions:
            await (await s.pull("ok", [9, 10], [1, 2, 3]))  # a partial prefix hit: the tail
        assert all(verify(c, [9, 10], 7, [1, 2]) for c in consumers)
        engine.fill("late", [4, 5], seed=8, lease=0.05)
        await wait_for(lambda: sum(r.request_id == "late" for r in engine.releases) == prefill_tp)
        for s in sessions:
            with pytest.raises(akv.LeaseExpiredError):
                await (await s.pull("late", [11, 12], [4, 5]))


async def test_concurrent_pulls_with_a_lease_running_out_never_succeed_stale() -> None:
    """Under concurrency, pulls of requests released mid-way fail typed; the rest succeed
    bit-exact; nothing succeeds with another request's bytes."""
    spec = make_spec(num_blocks=64)
    async with prefill_engine(spec, 2, lease=30) as engine, decode_engine(spec, 2) as consumers:
        sessions = [await c.connect(engine.endpoint) for c in consumers]
        live = {f"live-{i}": [2 * i, 2 * i + 1] for i in range(8)}
        gone = {f"gone-{i}": [16 + 2 * i, 17 + 2 * i] for i in range(8)}
        for i, (rid, blocks) in enumerate(live.items()):
            engine.fill(rid, blocks, seed=100 + i)
        for i, (rid, blocks) in enumerate(gone.items()):
            engine.fill(rid, blocks, seed=200 + i, lease=0.05)
        for p in engine.producers:  # the engine reuses released blocks for a new owner
            p.on_release = lambda rel, p=p: fill_request(
                p.kv_caches, spec, p.tp_rank, p.tp_size, rel.block_ids.tolist(), 999
            )
        await anyio.sleep(0.3)
        outcomes: dict[str, list[str]] = {}

        async def pull(i: int, rid: str, blocks: list[int]) -> None:
            local = [32 + 2 * i, 33 + 2 * i]
            for d, s in enumerate(sessions):
                try:
                    await (await s.pull(rid, local, blocks))
                    ok = verify(consumers[d], local, int(rid.split("-")[1]) + 100, [0, 1])
                    outcomes.setdefault(rid, []).append("ok" if ok else "corrupt")
                except akv.UnsafeReadError:
                    outcomes.setdefault(rid, []).append("unsafe")

        async with anyio.create_task_group() as tg:
            for i, (rid, blocks) in enumerate([*live.items(), *gone.items()]):
                tg.start_soon(pull, i, rid, blocks)
        assert all(outcomes[rid] == ["ok", "ok"] for rid in live)
        assert all(outcomes[rid] == ["unsafe", "unsafe"] for rid in gone)
