"""Engines as deployed, in one process: every prefill rank serves its own control endpoint, the
engine is found through its bootstrap (rank 0) or a list of rank endpoints, a lost rank fails
only the pulls that need it and is found again (real NIXL agents, real sockets)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager

import anyio
import anyio.abc
import pytest

import akv
from akv.testing import fill_request, verify_request
from tests.conftest import decode_engine, make_spec, prefill_rank
from tests.transfers import MLA_TP_PAIRS, TP_PAIRS

pytestmark = pytest.mark.anyio


class RankEngine:
    """Prefill ranks, each a Producer with its own control server, each run by its own task
    (so one can stop and start again); ranks > 0 use the bootstrap."""

    def __init__(self, spec: akv.KVSpec, tp_size: int, tg: anyio.abc.TaskGroup) -> None:
        self.spec, self.tp_size, self.tg = spec, tp_size, tg
        self.ranks: dict[int, akv.Producer] = {}
        self.stops: dict[int, tuple[anyio.CancelScope, anyio.Event]] = {}
        self.releases: list[tuple[int, akv.Release]] = []

    async def _run(
        self, rank: int, kw: dict[str, object], *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        done = anyio.Event()
        try:
            with anyio.CancelScope() as scope:
                boot = None if rank == 0 else str(self.ranks[0].endpoint)
                async with prefill_rank(
                    self.spec,
                    rank,
                    self.tp_size,
                    bootstrap=boot,
                    on_release=lambda rel: self.releases.append((rank, rel)),
                    **kw,
                ) as producer:
                    self.ranks[rank] = producer
                    self.stops[rank] = (scope, done)
                    task_status.started()
                    await anyio.sleep_forever()
        finally:
            done.set()

    async def start(self, rank: int, **kw: object) -> None:
        await self.tg.start(self._run, rank, kw)

    async def stop(self, rank: int) -> None:
        scope, done = self.stops.pop(rank)
        scope.cancel()
        await done.wait()

    @property
    def bootstrap(self) -> str:
        return str(self.ranks[0].endpoint)

    @property
    def rank_list(self) -> str:
        return ",".join(str(self.ranks[r].endpoint) for r in range(self.tp_size))

    def expose(self, rid: str, blocks: list[int], seed: int, ranks: list[int] | None = None) -> None:
        for r in ranks if ranks is not None else range(self.tp_size):
            p = self.ranks[r]
            fill_request(p.kv_caches, self.spec, r, self.tp_size, blocks, seed)
            p.expose(rid, blocks)


@asynccontextmanager
async def rank_engine(spec: akv.KVSpec, tp_size: int, **kw: object) -> AsyncIterator[RankEngine]:
    async with anyio.create_task_group() as tg:
        engine = RankEngine(spec, tp_size, tg)
        for r in range(tp_size):
            await engine.start(r, **kw)
        yield engine
        tg.cancel_scope.cancel()


def decode_ranks(
    spec: akv.KVSpec, tp_size: int, **kw: object
) -> AbstractAsyncContextManager[list[akv.Consumer]]:
    """``tp_size`` decode ranks of engine "decode-test" (`decode_engine`)."""
    return decode_engine(spec, tp_size, engine_id="decode-test", **kw)


CONFIGS = [(p, d, h, False) for p, d, h in TP_PAIRS] + [(p, d, 1, True) for p, d in MLA_TP_PAIRS]


@pytest.mark.parametrize("form", ["bootstrap", "list"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp", "kv_heads", "mla"), CONFIGS)
async def test_per_rank_endpoints_bit_exact_and_released_by_read(
    prefill_tp: int, decode_tp: int, kv_heads: int, mla: bool, form: str
) -> None:
    """Every pairing through both address forms: each decode rank links exactly the prefill
    ranks it needs, reads bit-exact, and every prefill rank releases by read."""
    spec = make_spec(kv_heads=kv_heads, mla=mla)
    async with rank_engine(spec, prefill_tp) as engine, decode_ranks(spec, decode_tp) as consumers:
        address = engine.bootstrap if form == "bootstrap" else engine.rank_list
        sessions = [await c.connect(address) for c in consumers]
        for c, s in zip(consumers, sessions, strict=True):
            assert set(s.links) == set(spec.notify_ranks(c.tp_rank, decode_tp, prefill_tp))
        engine.expose("r", [1, 2, 3], seed=11)
        for s in sessions:
            await (await s.pull("r", [4, 5, 6], [1, 2, 3]))
        assert all(
            verify_request(c.kv_caches, spec, c.tp_rank, decode_tp, [4, 5, 6], 11, range(3))
            for c in consumers
        )
        with anyio.fail_after(5):
            for p in engine.ranks.values():
                await p.wait_released()
        assert sorted(r for r, rel in engine.releases if rel.reason == "read") == list(range(prefill_tp))


async def test_rank_not_registered_is_a_typed_error_naming_it() -> None:
    """A bootstrap whose other ranks never registered: MissingRanksError names them."""
    spec = make_spec(kv_heads=4)
    async with AsyncExitStack() as stack:
        kv = akv.allocate_kv_cache(spec, 0, 2)
        lonely = await stack.enter_async_context(akv.Producer(kv, spec, tp_rank=0, tp_size=2))
        (consumer,) = [
            await stack.enter_async_context(
                akv.Consumer(
                    akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, handshake_timeout=0.5
                )
            )
        ]
        with pytest.raises(akv.MissingRanksError, match=r"prefill ranks \[1\] .* --bootstrap") as info:
            await consumer.connect(str(lonely.endpoint))
        assert info.value.missing == (1,)


async def test_registration_with_another_engine_shape_is_refused_at_start() -> None:
    """A rank registering with a bootstrap of another TP size fails at start with
    IncompatiblePeerError naming ``tp_size``."""
    spec = make_spec(kv_heads=4)
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(
            akv.Producer(akv.allocate_kv_cache(spec, 0, 2), spec, tp_rank=0, tp_size=2)
        )
        with pytest.raises(akv.IncompatiblePeerError, match="tp_size 4") as info:
            async with akv.Producer(
                akv.allocate_kv_cache(spec, 1, 4), spec, tp_rank=1, tp_size=4, bootstrap=str(boot.endpoint)
            ):
                pass
        assert info.value.fields == ("tp_size",)


async def test_notices_are_bound_to_the_agent_that_handshook() -> None:
    """A notice from an agent that never handshook is counted and ignored; one claiming another
    decode rank's identity too; the request is still released by its real readers."""
    spec = make_spec(kv_heads=4)
    async with rank_engine(spec, 1) as engine, decode_ranks(spec, 2) as (d0, d1):
        s0 = await d0.connect(engine.bootstrap)
        engine.expose("x", [1, 2], seed=1)
        producer = engine.ranks[0]
        stranger = akv.Consumer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1)
        async with stranger:
            # load the producer's metadata without a handshake that would bind the agent
            name = stranger.backend.add_remote(producer.backend.metadata())  # type: ignore[attr-defined]
            stranger.backend.connect(name)  # type: ignore[attr-defined]
            notice = s0.done_notice("x", __import__("numpy").array([1, 2], dtype="int32"))
            stranger.backend.notify(name, notice)
            for _ in range(20):
                stranger.backend.progress()
                await anyio.sleep(0.01)
            # d1 handshakes, then sends d0's notice (claiming to be decode rank 0)
            s1 = await d1.connect(engine.bootstrap)
            d1.backend.notify(s1.agents[0], notice)
            for _ in range(30):  # progress d1's agent: the notice leaves
                d1.backend.progress()
                await anyio.sleep(0.01)
        counters = producer.metrics.counters
        assert counters["notifications_unbound"] == 1 and counters["notifications_invalid"] >= 1
        assert engine.releases == []
        for s in (s0, s1):
            await (await s.pull("x", [3, 4], [1, 2]))
        with anyio.fail_after(5):
            await producer.wait_released()
        assert [rel.reason for _, rel in engine.releases] == ["read"]


def test_default_engine_ids_are_unique_per_process() -> None:
    """Ranks of one process share a default engine id; another process gets another one."""
    import subprocess
    import sys

    spec = make_spec(kv_heads=4)
    kv = akv.allocate_kv_cache(spec, 0, 1)
    producers = {akv.Producer(kv, spec, tp_rank=0, tp_size=1).engine_id for _ in range(2)}
    consumers = {akv.Consumer(kv, spec, tp_rank=0, tp_size=1).engine_id for _ in range(2)}
    assert len(producers) == len(consumers) == 1 and producers != consumers
    code = "from akv.runtime.rank import default_engine_id as d; print(d('decode'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() not in consumers
