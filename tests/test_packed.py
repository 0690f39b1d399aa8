"""Packed transfers: prefill ranks stage each request contiguously, decode ranks read the
staged copy with a few descriptors and scatter it, through real NIXL agents on DRAM."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

import akv
from akv.geometry.cache import as_cache
from akv.testing import fill_request, local_counts, make_requests, verify_request
from tests.conftest import wait_for
from tests.test_paths import PAIRS

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Prefill:
    producers: list[akv.Producer]
    endpoint: str
    releases: Counter[tuple[str, str]] = field(default_factory=Counter)
    blocks_back: list[tuple[str, str]] = field(default_factory=list)


@asynccontextmanager
async def prefill_engine(spec: Any, tp: int, lease: float = 30.0, **kw: Any) -> AsyncIterator[Prefill]:
    """``tp`` prefill ranks of this process behind one control server, packing as ``kw`` says."""
    async with AsyncExitStack() as stack:
        tg = await stack.enter_async_context(anyio.create_task_group())
        server = akv.ControlServer()
        engine = Prefill([], str(await tg.start(server.serve)))

        def on_release(rel: akv.Release) -> None:
            engine.releases[(rel.request_id, rel.reason)] += 1

        for r in range(tp):
            engine.producers.append(
                await stack.enter_async_context(
                    akv.Producer(
                        akv.allocate_kv_cache(spec, r, tp),
                        spec,
                        tp_rank=r,
                        tp_size=tp,
                        server=server,
                        lease=lease,
                        on_release=on_release,
                        **kw,
                    )
                )
            )
        yield engine
        tg.cancel_scope.cancel()


def expose_all(engine: Prefill, spec: Any, reqs: list[Any]) -> None:
    """Fill and expose ``reqs`` on every rank of ``engine``."""
    for req in reqs:
        for prod in engine.producers:
            tp = len(engine.producers)
            fill_request(prod.kv_caches, spec, prod.tp_rank, tp, req.block_ids, req.seed, req.num_tokens)
            prod.expose(req.request_id, req.block_ids)


def local_ids(dspec: Any, req: Any, n: int, hit: int) -> Any:
    """Decode block ids for request ``n`` after a prefix hit of ``hit`` blocks."""
    counts = local_counts(dspec, req.num_tokens, hit=hit)
    cache = as_cache(dspec)
    local: Any = {g.name: list(range(n * 8, n * 8 + counts[g.name])) for g in cache.groups}
    return local[cache.groups[0].name] if len(cache.groups) == 1 else local


async def pull_all(
    pspec: Any, dspec: Any, p: int, d: int, mode: str, requests: int = 2, **kw: Any
) -> tuple[list[akv.TransferResult], Prefill]:
    """Pull ``requests`` requests on each of ``d`` decode ranks (the second after a one-block
    prefix hit) with ``transfer=mode``; verify every byte."""
    reqs = make_requests(pspec, requests, 3, seed=11)
    results = []
    async with prefill_engine(pspec, p, **kw) as engine, AsyncExitStack() as stack:
        expose_all(engine, pspec, reqs)
        for r in range(d):
            consumer = await stack.enter_async_context(
                akv.Consumer(
                    akv.allocate_kv_cache(dspec, r, d),
                    dspec,
                    tp_rank=r,
                    tp_size=d,
                    same_process="nixl",
                    transfer=mode,
                )
            )
            session = await consumer.connect(engine.endpoint)
            for n, req in enumerate(reqs):
                local = local_ids(dspec, req, n, n % 2)
                transfer_ = await session.pull(
                    akv.PullRequest(
                        request_id=req.request_id,
                        local_block_ids=local,
                        remote_block_ids=req.block_ids,
                        num_tokens=req.num_tokens,
                    )
                )
                results.append(await transfer_)
                assert verify_request(
                    consumer.kv_caches, dspec, r, d, local, req.seed, num_tokens=req.num_tokens
                ), (req.request_id, r)
        await wait_for(lambda: sum(engine.releases.values()) >= p * requests, timeout=10)
    return results, engine


@pytest.mark.parametrize(("pspec", "dspec", "p", "d"), PAIRS)
async def test_packed_pulls_are_bit_exact(pspec: Any, dspec: Any, p: int, d: int) -> None:
    """A packed pull fills the decode cache bit-exact (every TP pairing, MLA, hybrid groups,
    mixed layouts and block sizes, a partial prefix hit), moving the bytes a direct one
    moves, with the same releases."""
    packed, engine = await pull_all(pspec, dspec, p, d, "packed", transfer="packed")
    direct, _ = await pull_all(pspec, dspec, p, d, "direct", transfer="packed")
    assert {r.path for r in packed} == {"packed"} and {r.path for r in direct} == {"read"}
    assert [r.bytes for r in packed] == [r.bytes for r in direct]
    assert {why for _, why in engine.releases} == {"read"} and set(engine.releases.values()) == {p}
