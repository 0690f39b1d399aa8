"""Costs that must not grow with the wrong thing, held as counts (the times are the bench's:
``akv bench --only scale``, docs/performance.md "Scale"): a long request's launch runs the
same Python whatever its blocks and posts bounded slices, a pull posts the same transfers
however many engines its rank has linked, and the polls a pull takes do not grow with the
pulls in flight beside it. Real NIXL agents over UCX loopback, both sides in this process."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from types import FrameType
from typing import Any

import anyio
import numpy as np
import pytest

import akv
from akv._poll import FLUSH_S
from akv.backends import SLICE_BYTES, SLICE_DESCS, XferHandle, XferState
from akv.backends.nixl import NixlBackend
from akv.metrics import CONTROL_OPS
from akv.testing import fill_request, verify_request
from tests.conftest import make_spec, prefill_rank

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class CountingBackend(NixlBackend):
    """The real agent, counting what it is asked: READs posted (with their descriptors),
    transfer states polled, notices sent."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.reads: list[int] = []
        self.states = 0
        self.notices = 0

    def read(
        self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, notif: bytes, **kw: Any
    ) -> XferHandle:
        self.reads.append(len(local_idx))
        return super().read(local, local_idx, remote, remote_idx, notif, **kw)

    def state(self, handle: XferHandle) -> XferState:
        self.states += 1
        return super().state(handle)

    def notify(self, agent: str, message: bytes) -> None:
        self.notices += 1
        super().notify(agent, message)


def decode(spec: Any, backend: NixlBackend, **kw: Any) -> akv.Consumer:
    kv = akv.allocate_kv_cache(spec, 0, 1)
    return akv.Consumer(kv, spec, tp_rank=0, tp_size=1, backend=backend, same_process="nixl", **kw)


@asynccontextmanager
async def engines(spec: Any, count: int) -> AsyncIterator[list[akv.Producer]]:
    """``count`` TP-1 prefill engines of this process, each behind its own control server."""
    async with AsyncExitStack() as stack:
        out = []
        for i in range(count):
            out.append(await stack.enter_async_context(prefill_rank(spec, engine_id=f"scale-{i}", lease=60)))
        yield out


def calls_in(counter: list[int]) -> Any:
    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_lasti < 10:  # a resumed coroutine is no call
            counter[0] += 1

    return profile


async def test_a_long_requests_launch_runs_the_same_python_whatever_its_blocks() -> None:
    """Pulls of 1,024 and 4,096 blocks of a per-layer layout (16,384 and 65,536 descriptors,
    both planned in a worker thread):
    ``pull()`` runs about the same Python calls for both (planning is numpy's, and only the
    first slices are posted then), every READ posted carries at most SLICE_DESCS
    descriptors and SLICE_BYTES bytes, and both land bit-exact."""
    spec = make_spec(kv_heads=1, layers=8, num_blocks=4096, block_size=4, head_dim=8)
    backend = CountingBackend("scale-long")
    calls = {}
    async with engines(spec, 1) as (prefill,), decode(spec, backend) as consumer:
        session = await consumer.connect(prefill.endpoint)
        run = 4 * 8 * 2  # bytes of one descriptor: 4 tokens of 8 float16
        for n in (1024, 4096):
            ids = list(range(n))
            fill_request(prefill.kv_caches, spec, 0, 1, ids, n)
            generation = prefill.expose(f"long-{n}", ids)
            request = akv.PullRequest(
                request_id=f"long-{n}", local_block_ids=ids, remote_block_ids=ids, generation=generation
            )
            # both pollers quiet (past the link's wire-up window, and the prefill's past its
            # busy ceiling after the expose): their rounds while the launch plans in a worker
            # thread are not counted below
            await anyio.sleep(FLUSH_S + 0.15)
            counter = [0]
            backend.reads.clear()
            sys.setprofile(calls_in(counter))
            try:
                transfer = await session.pull(request)
            finally:
                sys.setprofile(None)
            calls[n] = counter[0]
            assert (
                len(backend.reads) <= 2
            )  # a slice posted and one more at its first poll: the rest as it is polled
            await transfer
            assert verify_request(consumer.kv_caches, spec, 0, 1, ids, n)
            assert len(backend.reads) >= 2 * 8 * n // SLICE_DESCS
            assert max(backend.reads) <= SLICE_DESCS and max(backend.reads) * run <= SLICE_BYTES
    # 4 times the blocks: the same calls, but for what the launch's first poll found done
    # (each handle it releases); a launch that walked the blocks would run thousands more
    assert calls[4096] < 2 * calls[1024], calls


async def test_a_pull_posts_the_same_transfers_however_many_engines_are_linked() -> None:
    """A one-block pull from one engine of a decode rank linked to 1 and to 8 prefill engines:
    the same READs, notices and control operations, and every engine's pull lands."""
    spec = make_spec(kv_heads=2, layers=2, num_blocks=16)
    posted = {}
    for count in (1, 8):
        backend = CountingBackend(f"scale-engines-{count}")
        async with engines(spec, count) as ranks, decode(spec, backend) as consumer:
            sessions = [await consumer.connect(p.endpoint) for p in ranks]
            for i, (p, s) in enumerate(zip(ranks, sessions, strict=True)):
                fill_request(p.kv_caches, spec, 0, 1, [i], i + 1)
                p.expose("warm", [i])
                await (await s.pull("warm", [i], [i]))
                assert verify_request(consumer.kv_caches, spec, 0, 1, [i], i + 1)
            for p in ranks:  # every notice of the warm pulls is in: nothing of them is counted
                with anyio.fail_after(10):
                    await p.wait_released()
            ranks[0].expose("counted", [3])
            await anyio.sleep(0.3)  # and the READs behind them (FLUSH_DELAY_S) are done
            before = (len(backend.reads), backend.notices, dict(consumer.metrics.counters))
            await (await sessions[0].pull("counted", [9], [3]))
            with anyio.fail_after(10):  # its notice is in (it may ride on a READ of its own)
                await ranks[0].wait_released()
            await anyio.sleep(0.3)  # and the READ behind it
            counters = consumer.metrics.counters
            ops = {k: counters.get(k, 0) - before[2].get(k, 0) for k in (*CONTROL_OPS.values(), "xfers_data")}
            posted[count] = (len(backend.reads) - before[0], backend.notices - before[1], ops)
    assert posted[8] == posted[1], posted


async def test_the_polls_a_pull_takes_do_not_grow_with_the_pulls_in_flight() -> None:
    """Batches of 16 and of 512 one-block pulls launched together (``pull_many``): the
    transfer states polled per pull stay within 1.25x of each other, all land bit-exact."""
    spec = make_spec(kv_heads=1, layers=2, num_blocks=1024, head_dim=8)
    per_pull = {}
    backend = CountingBackend("scale-inflight")
    async with engines(spec, 1) as (prefill,), decode(spec, backend, max_checks=1024) as consumer:
        session = await consumer.connect(prefill.endpoint)
        at = 0
        for n in (16, 512, 16, 512):  # each size twice: the second of each counts
            ids = list(range(at, at + n))
            at = (at + n) % 512
            requests = []
            for b in ids:
                fill_request(prefill.kv_caches, spec, 0, 1, [b], b + 1)
                generation = prefill.expose(f"f{b}-{n}-{len(per_pull)}", [b])
                requests.append(
                    akv.PullRequest(
                        request_id=f"f{b}-{n}-{len(per_pull)}",
                        local_block_ids=[b],
                        remote_block_ids=[b],
                        generation=generation,
                    )
                )
            await anyio.sleep(0.05)
            before = backend.states
            for t in await session.pull_many(requests):
                await t
            per_pull[n] = (backend.states - before) / n
            assert all(verify_request(consumer.kv_caches, spec, 0, 1, [b], b + 1) for b in ids)
            await prefill.wait_released()
    ratio = max(per_pull.values()) / min(per_pull.values())
    assert ratio <= 1.25, per_pull
    assert np.isfinite(ratio)


async def test_a_session_idle_past_idle_timeout_is_closed_and_linked_again_at_its_next_connect() -> None:
    """A decode rank with ``idle_timeout`` linked to two engines and pulling from one only:
    the idle engine's session closes (its watch goes: that prefill serves none), the busy one
    stays; the closed session refuses pulls, and ``connect`` handshakes again and its pull
    lands bit-exact."""
    spec = make_spec(kv_heads=2, layers=2, num_blocks=16)
    backend = NixlBackend("scale-idle")
    with pytest.raises(akv.ConfigError, match="idle_timeout must be"):
        decode(spec, backend, idle_timeout=0)
    async with engines(spec, 2) as (busy, idle), decode(spec, backend, idle_timeout=0.4) as consumer:
        sessions = [await consumer.connect(p.endpoint) for p in (busy, idle)]
        for i, (p, s) in enumerate(zip((busy, idle), sessions, strict=True)):
            fill_request(p.kv_caches, spec, 0, 1, [i], i + 1)
            p.expose("warm", [i])
            await (await s.pull("warm", [i], [i]))
            assert verify_request(consumer.kv_caches, spec, 0, 1, [i], i + 1)
        assert busy.server.watches == idle.server.watches == 1
        handshakes = consumer.metrics.counters["handshakes"]
        for n in range(10):  # 1.5 s of pulls from one engine, every 0.15 s
            fill_request(busy.kv_caches, spec, 0, 1, [2], n + 10)
            busy.expose(f"busy-{n}", [2])
            await (await (await consumer.connect(busy.endpoint)).pull(f"busy-{n}", [4], [2]))
            assert verify_request(consumer.kv_caches, spec, 0, 1, [4], n + 10)
            await anyio.sleep(0.15)
        assert sessions[1].closed and not sessions[0].closed
        assert await consumer.connect(busy.endpoint) is sessions[0]
        assert consumer.metrics.counters["sessions_closed_idle"] == 1
        with anyio.fail_after(5):
            while idle.server.watches:  # its end of the watch sees the close
                await anyio.sleep(0.01)
        assert busy.server.watches == 1
        idle.expose("again", [5])
        with pytest.raises(akv.ClosedError):
            await sessions[1].pull("again", [6], [5])
        fill_request(idle.kv_caches, spec, 0, 1, [5], 99)
        again = await consumer.connect(idle.endpoint)
        assert again is not sessions[1]
        await (await again.pull("again", [6], [5]))
        assert verify_request(consumer.kv_caches, spec, 0, 1, [6], 99)
        assert consumer.metrics.counters["handshakes"] == handshakes + 1
