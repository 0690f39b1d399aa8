"""Races and defects from the review: connect waiters, the peer-lost flag, shared
re-handshakes, bounded release streams, counters, error types (real NIXL agents)."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import msgspec
import pytest
from anyio.abc import SocketStream

import akv
from akv.backends import XferHandle, XferState
from akv.backends.nixl import NixlBackend
from akv.errors import PeerLostError, TransferError
from akv.metrics import COUNTERS
from akv.protocol.messages import decode_message
from tests.conftest import make_spec, prefill_engine, verify, wait_for

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def flaky_proxy(target: str, drop_first: int) -> AsyncIterator[str]:
    """A TCP relay to ``target`` that closes its first ``drop_first`` connections at once."""
    host, port = target.rsplit(":", 1)
    seen = 0

    async def relay(src: SocketStream, dst: SocketStream) -> None:
        try:
            async for chunk in src:
                await dst.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        finally:
            await dst.aclose()

    async def handle(client: SocketStream) -> None:
        nonlocal seen
        seen += 1
        async with client:
            if seen <= drop_first:
                return
            async with await anyio.connect_tcp(host, int(port)) as server, anyio.create_task_group() as tg:
                tg.start_soon(relay, client, server)
                tg.start_soon(relay, server, client)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        yield f"127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        tg.cancel_scope.cancel()


async def test_waiters_on_a_failed_handshake_retry_one_at_a_time() -> None:
    """When the shared handshake fails, its waiters retry in turn: exactly one session, no KeyError."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine, flaky_proxy(engine.endpoint, drop_first=1) as proxy:
        kv = akv.allocate_kv_cache(spec, 0, 1)
        async with akv.Consumer(kv, spec, tp_rank=0, tp_size=1, retries=0) as consumer:
            results: list[object] = []

            async def connect() -> None:
                try:
                    results.append(await consumer.connect(proxy))
                except akv.HandshakeError as exc:
                    results.append(exc)

            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(connect)
            sessions = [r for r in results if isinstance(r, akv.TransferSession)]
            errors = [r for r in results if isinstance(r, akv.HandshakeError)]
            assert len(errors) == 1 and len(sessions) == 3
            assert len({id(s) for s in sessions}) == 1
            assert consumer.metrics.counters["handshakes"] == 1


class ScriptedBackend(NixlBackend):
    """The real backend; ``script`` holds outcomes for the next polls ("PROC" or an error)."""

    script: deque[object]

    def state(self, handle: XferHandle) -> XferState:
        if getattr(self, "script", None):
            step = self.script.popleft()
            if isinstance(step, BaseException):
                raise step
            return "PROC"
        return super().state(handle)


@asynccontextmanager
async def scripted_consumer(spec: akv.KVSpec) -> AsyncIterator[tuple[akv.Consumer, ScriptedBackend]]:
    backend = ScriptedBackend("scripted-d0")
    backend.script = deque()
    kv = akv.allocate_kv_cache(spec, 0, 1)
    async with akv.Consumer(kv, spec, tp_rank=0, tp_size=1, backend=backend, same_process="nixl") as consumer:
        yield consumer, backend


async def test_a_later_plain_transfer_error_keeps_the_peer_lost_flag() -> None:
    """A PeerLostError followed by a plain TransferError still re-handshakes on the next pull."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine, scripted_consumer(spec) as (consumer, backend):
        session = await consumer.connect(engine.endpoint)
        for rid, blocks in (("a", [1]), ("b", [2]), ("c", [3])):
            engine.fill(rid, blocks, seed=1)
        backend.script.extend(["PROC", "PROC", PeerLostError("injected"), TransferError("injected")])
        first = await session.pull("a", [10], [1])
        second = await session.pull("b", [11], [2])
        with pytest.raises(PeerLostError):
            await first
        with pytest.raises(TransferError):
            await second
        await (await session.pull("c", [12], [3]))
        assert consumer.metrics.counters["handshakes"] == 2


async def test_pulls_after_a_lost_peer_share_one_rehandshake() -> None:
    """Many pulls waiting on a lost peer's re-handshake share one; all then succeed."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine, scripted_consumer(spec) as (consumer, backend):
        session = await consumer.connect(engine.endpoint)
        engine.fill("lost", [1], seed=1)
        backend.script.append(PeerLostError("injected"))
        with pytest.raises(PeerLostError):
            await (await session.pull("lost", [10], [1]))
        for i in range(6):
            engine.fill(f"r{i}", [2 + i], seed=i)
        done: list[akv.TransferResult] = []

        async def pull(i: int) -> None:
            done.append(await (await session.pull(f"r{i}", [20 + i], [2 + i])))

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(pull, i)
        assert len(done) == 6
        assert consumer.metrics.counters["handshakes"] == 2


async def test_release_streams_are_bounded_and_pruned() -> None:
    """A release stream that is not read keeps at most max_buffer releases (the rest are
    counted as dropped); a closed stream is pruned; on_release misses nothing."""
    spec = make_spec()
    async with prefill_engine(spec, 1, lease=0.05) as engine:
        producer = engine.producers[0]
        slow = producer.releases(max_buffer=2)
        gone = producer.releases()
        await gone.aclose()
        for i in range(5):
            engine.fill(f"r{i}", [i], seed=i)
        await wait_for(lambda: len(engine.releases) == 5)
        assert producer.metrics.counters["releases_dropped"] == 3
        with slow:
            got = [slow.receive_nowait().request_id for _ in range(2)]
            assert got == ["r0", "r1"]
            with pytest.raises(anyio.WouldBlock):
                slow.receive_nowait()


def test_every_release_reason_has_a_counter() -> None:
    """released_read / _expired / _closed (and dropped releases) are all in the counter table."""
    for name in ("released_read", "released_expired", "released_closed", "releases_dropped", "unsafe_reads"):
        assert name in COUNTERS
    assert akv.Metrics().counters["released_closed"] == 0


def test_transfer_timeout_is_a_timeout_error() -> None:
    """TransferTimeout is both a TransferError and a TimeoutError."""
    exc = akv.TransferTimeout("late")
    assert isinstance(exc, akv.TransferError) and isinstance(exc, TimeoutError)


def test_protocol_version_mismatch_has_its_own_error() -> None:
    """A frame of another protocol version raises VersionMismatchError (a ProtocolError)."""
    body = msgspec.msgpack.encode({"type": "Hello", "v": 99})
    with pytest.raises(akv.VersionMismatchError, match="version 99"):
        decode_message(body)
    assert issubclass(akv.VersionMismatchError, akv.ProtocolError)


FIRST_POLLS = {
    "as NIXL says": [],
    "running": ["PROC"],
    "running twice": ["PROC", "PROC"],
    "in error": [TransferError("injected")],
}


@pytest.mark.parametrize("first", list(FIRST_POLLS))
async def test_a_single_pull_settles_and_counts_the_same_whatever_its_first_poll_finds(first: str) -> None:
    """One pull from a prefill rank that shares its exposure table with this process, whatever
    its READ's first polls report (NIXL's own answer, "still running" once or twice, an
    error): the pull settles once with the outcome that READ earned (the bytes in place, or a TransferError),
    counts one data READ and, once its data is in, one check made in shared memory and one
    transfer, the prefill releases the request once (on the notice, or by lease after an
    error), and no NIXL transfer handle is left behind."""
    spec = make_spec()
    async with prefill_engine(spec, 1, lease=1.0) as engine, scripted_consumer(spec) as (consumer, backend):
        session = await consumer.connect(engine.endpoint)
        engine.fill("r", [3, 4], seed=9)
        before = dict(consumer.metrics.counters)
        backend.script.extend(FIRST_POLLS[first])
        transfer = await session.pull("r", [20, 21], [3, 4])
        counters = consumer.metrics.counters

        def spent(name: str) -> int:
            return counters.get(name, 0) - before.get(name, 0)

        if first == "in error":
            with pytest.raises(TransferError):
                await transfer
            assert (spent("checks_shared"), spent("transfers")) == (0, 0)
            await wait_for(lambda: engine.reasons[("r", "expired")] == 1)
        else:
            result = await transfer
            assert result.bytes > 0 and result.path == "read"
            assert verify(consumer, [20, 21], 9, [0, 1])
            assert (spent("checks_shared"), spent("transfers")) == (1, 1)
            await wait_for(lambda: engine.reasons[("r", "read")] == 1)
        assert spent("xfers_data") == 1
        await wait_for(lambda: backend.active_transfers == 0)
        assert sum(engine.reasons.values()) == 1


async def test_a_single_pull_of_a_released_request_fails_typed_without_a_notice() -> None:
    """One pull of a request its prefill rank released by lease before the pull (checked in
    shared memory): an UnsafeReadError, counted as one check and one unsafe read, and no
    "done" notice for it: the same request exposed again afterwards stays exposed."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine, scripted_consumer(spec) as (consumer, _backend):
        session = await consumer.connect(engine.endpoint)
        engine.fill("gone", [5], seed=2, lease=0.2)
        await wait_for(lambda: engine.reasons[("gone", "expired")] == 1)
        before = dict(consumer.metrics.counters)
        with pytest.raises(akv.UnsafeReadError):
            await (await session.pull("gone", [30], [5]))
        engine.fill("gone", [5], seed=3)  # exposed again, with the default lease
        await anyio.sleep(0.3)  # a notice would have gone out and been handled by now
        counters = consumer.metrics.counters

        def spent(name: str) -> int:
            return counters.get(name, 0) - before.get(name, 0)

        assert (spent("unsafe_reads"), spent("checks_shared"), spent("xfers_notice")) == (1, 1, 0)
        assert engine.reasons[("gone", "read")] == 0 and engine.producers[0].pending == 1
