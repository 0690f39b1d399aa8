"""Push mode: prefill ranks WRITE into the blocks a decode rank granted, layer by layer.

Real NIXL agents over UCX loopback (DRAM) throughout; the prefill ranks of the in-process
engines are read through NIXL (``same_process="nixl"``), and the crash test runs its writer
in another process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest
import torch

import akv
from akv.geometry.cache import as_cache
from akv.protocol.push import PushNotice, encode_push
from akv.testing import fill_request, make_requests, verify_request
from tests.conftest import (
    MODEL,
    Engine,
    decode_rank,
    local_ids,
    make_spec,
    prefill_engine,
    prefill_process,
    stop,
    summary_of,
    wait_for,
)
from tests.transfers import pairs, pull_request

pytestmark = pytest.mark.anyio


def consumer(spec: Any, rank: int, size: int, **kw: Any) -> akv.Consumer:
    """A decode rank in push mode that reaches prefill ranks of this process through NIXL."""
    kw.setdefault("mode", "push")
    return decode_rank(spec, rank, size, same_process="nixl", **kw)


def written(kv: Sequence[torch.Tensor]) -> int:
    """How many of a rank's regions hold some non-zero byte."""
    return sum(bool(t.view(torch.uint8).any()) for t in kv)


async def pull_with_one_layer_ready(engine: Engine, c: akv.Consumer, req: Any) -> akv.Transfer:
    """Write ``req`` on ``engine``'s one rank, expose it with only its first layer computed, and
    start ``c``'s pull of it into blocks 0, 1, 2."""
    engine.expose_requests([req], layers_ready=1)
    session = await c.connect(engine.endpoint)
    return await session.pull(req.request_id, [0, 1, 2], req.block_ids)


PAIRS = pairs(
    "dense-1to2",
    "dense-2to1",
    "gqa-4to6",
    "mla-2to3",
    "headmajor8-to-nhd4",
    "headmajor-runs-span-layers",
    "gemma3-sliding",
    "qwen3-next-hybrid",
)


@pytest.mark.parametrize(("pspec", "dspec", "p", "d"), PAIRS)
async def test_push_streams_layers_bit_exact(pspec: Any, dspec: Any, p: int, d: int) -> None:
    """Every pairing kind pushed: exposed with no layer ready, a pull completes only after the
    last layer is ready, bit-exact, path "push"; each prefill rank releases each request once
    ("pushed" where it wrote, "read" where it was only notified, as MLA's other ranks)."""
    layers = 1 + max(x for g in as_cache(pspec).groups for x in g.layers)
    reqs = make_requests(pspec, 2, 3, seed=11)
    async with prefill_engine(pspec, p) as engine, AsyncExitStack() as stack:
        engine.expose_requests(reqs, layers_ready=0)
        consumers = [await stack.enter_async_context(consumer(dspec, r, d)) for r in range(d)]
        sessions = [await c.connect(engine.endpoint) for c in consumers]
        for n, req in enumerate(reqs):
            pulls = []
            for c, s in zip(consumers, sessions, strict=True):
                local = local_ids(dspec, n, req.num_tokens, hit=n % 2)
                pulls.append((c, local, await s.pull(pull_request(req, local))))
            for ready in range(1, layers + 1):
                await anyio.sleep(0.02)
                assert not any(t.done() for _, _, t in pulls), f"done with {ready - 1} of {layers} layers"
                for prod in engine.producers:
                    prod.layers_ready(req.request_id, ready)
            for c, local, t in pulls:
                result = await t
                assert result.path == "push" and result.bytes > 0
                assert verify_request(
                    c.kv_caches, dspec, c.tp_rank, d, local, req.seed, num_tokens=req.num_tokens
                )
        await wait_for(lambda: sum(engine.reasons.values()) == p * len(reqs), timeout=10)
        await anyio.sleep(0.05)  # no rank releases twice
        for req in reqs:
            assert sum(n for (rid, _), n in engine.reasons.items() if rid == req.request_id) == p
        assert {why for _, why in engine.reasons} <= {"pushed", "read"}
        assert "pushed" in {why for _, why in engine.reasons}


async def test_first_layer_lands_before_the_last_is_ready() -> None:
    """With one of two layers ready, that layer's bytes are already in decode's blocks."""
    spec = make_spec(kv_heads=4)
    (req,) = make_requests(spec, 1, 3, seed=3)
    async with prefill_engine(spec, 1) as engine, consumer(spec, 0, 1) as c:
        prod = engine.producers[0]
        t = await pull_with_one_layer_ready(engine, c, req)
        await wait_for(lambda: written(c.kv_caches) == 2)  # layer 0's K and V regions
        await anyio.sleep(0.1)
        assert written(c.kv_caches) == 2 and not t.done()
        prod.layers_ready(req.request_id, 2)
        assert (await t).path == "push"
        assert written(c.kv_caches) == 4


async def test_runs_spanning_layers_wait_for_their_last_layer() -> None:
    """Head-major on both sides merges a block's layers into one run: with one of two layers
    ready nothing is written yet; the last layer brings every byte."""
    spec = make_spec(kv_heads=4, layout="head-major")
    (req,) = make_requests(spec, 1, 3, seed=6)
    async with prefill_engine(spec, 1) as engine, consumer(spec, 0, 1) as c:
        prod = engine.producers[0]
        t = await pull_with_one_layer_ready(engine, c, req)
        await anyio.sleep(0.2)
        assert written(c.kv_caches) == 0 and not t.done()
        prod.layers_ready(req.request_id, 2)
        assert (await t).path == "push"
        assert verify_request(c.kv_caches, spec, 0, 1, [0, 1, 2], req.seed, num_tokens=req.num_tokens)


async def test_announcement_before_the_exposure_is_served_once_exposed() -> None:
    """A pull announced before prefill exposed the request waits, then completes bit-exact
    once the request is exposed."""
    spec = make_spec(kv_heads=4)
    (req,) = make_requests(spec, 1, 3, seed=8)
    async with prefill_engine(spec, 1) as engine, consumer(spec, 0, 1) as c:
        prod = engine.producers[0]
        session = await c.connect(engine.endpoint)
        t = await session.pull(req.request_id, [4, 5, 6], req.block_ids)
        await anyio.sleep(0.1)
        assert not t.done()
        fill_request(prod.kv_caches, spec, 0, 1, req.block_ids, req.seed, req.num_tokens)
        prod.expose(req.request_id, req.block_ids)
        assert (await t).path == "push"
        assert verify_request(c.kv_caches, spec, 0, 1, [4, 5, 6], req.seed, num_tokens=req.num_tokens)
        await wait_for(lambda: engine.reasons[(req.request_id, "pushed")] == 1)


async def test_cancel_waits_for_writers_and_nothing_lands_after() -> None:
    """A pull cancelled mid-stream returns only once its writer stopped; layers made ready
    afterwards never reach the blocks (a sentinel written after the return survives), and a
    late notice for the cancelled grant is dropped and counted."""
    spec = make_spec(kv_heads=4)
    (req,) = make_requests(spec, 1, 3, seed=5)
    async with prefill_engine(spec, 1) as engine, consumer(spec, 0, 1) as c:
        prod = engine.producers[0]
        t = await pull_with_one_layer_ready(engine, c, req)
        await wait_for(lambda: written(c.kv_caches) == 2)
        await t.cancel()
        with pytest.raises(akv.errors.TransferCancelledError):
            await t
        for region in c.kv_caches:
            region[:3].fill_(7)  # the engine reuses the blocks
        prod.layers_ready(req.request_id, 2)
        late = PushNotice(
            kind="pushed",
            engine_id=c.engine_id,
            decode_rank=0,
            decode_tp=1,
            request_id=req.request_id,
            grant=t.op.grant,  # type: ignore[attr-defined]
            prefill_rank=0,
        )
        prod.backend.notify(c.backend.name, encode_push(late))  # a late notice for the cancelled grant
        await wait_for(lambda: c.metrics.snapshot().counters.get("push_notices_dropped", 0) == 1)
        await anyio.sleep(0.3)
        assert all(bool((region[:3] == 7).all()) for region in c.kv_caches)
        assert c.metrics.snapshot().counters.get("push_stops_unconfirmed", 0) == 0


async def test_duplicate_and_late_notices_are_dropped_and_counted() -> None:
    """A writer's repeated "pushed", a notice from another prefill rank's agent for a live
    grant, and a notice for a grant already finished are dropped and counted; the live pull
    completes only on its real writer's notice."""
    spec = make_spec(kv_heads=4)
    reqs = make_requests(spec, 2, 2, seed=9)
    async with prefill_engine(spec, 2) as engine, consumer(spec, 0, 1) as c:
        for req in reqs:
            for prod in engine.producers:
                fill_request(prod.kv_caches, spec, prod.tp_rank, 2, req.block_ids, req.seed, req.num_tokens)
                prod.expose(req.request_id, req.block_ids, layers_ready=0 if req is reqs[1] else None)
        session = await c.connect(engine.endpoint)
        first = await session.pull(reqs[0].request_id, [0, 1], reqs[0].block_ids)
        await first
        second = await session.pull(reqs[1].request_id, [8, 9], reqs[1].block_ids)

        def notice(rank: int, transfer: akv.Transfer, kind: str = "pushed") -> bytes:
            return encode_push(
                PushNotice(
                    kind=kind,  # type: ignore[arg-type]
                    engine_id=c.engine_id,
                    decode_rank=0,
                    decode_tp=1,
                    request_id=transfer.request_id,
                    grant=transfer.op.grant,  # type: ignore[attr-defined]
                    generation=transfer.generation,
                    prefill_rank=rank,
                )
            )

        p0, p1 = engine.producers
        name = c.backend.name
        p0.backend.notify(name, notice(0, first))  # late: that grant finished
        p1.backend.notify(name, notice(0, second))  # rank 1's agent claims rank 0's share
        p0.backend.notify(name, notice(0, second, "stopped"))  # a "stopped" no stop asked for
        await wait_for(lambda: c.metrics.snapshot().counters.get("push_notices_dropped", 0) == 3)
        assert not second.done()
        for prod in engine.producers:
            prod.layers_ready(reqs[1].request_id, 2)
        assert (await second).path == "push"
        assert verify_request(c.kv_caches, spec, 0, 1, [8, 9], reqs[1].seed, num_tokens=reqs[1].num_tokens)
        p0.backend.notify(name, notice(0, second))  # a repeat of a grant that finished
        await wait_for(lambda: c.metrics.snapshot().counters.get("push_notices_dropped", 0) == 4)


async def test_lease_expired_before_the_announcement_fails_fast() -> None:
    """A request whose lease ran out before the decode rank announced it fails at once, typed,
    and its blocks were released by lease exactly once."""
    spec = make_spec(kv_heads=4)
    (req,) = make_requests(spec, 1, 2, seed=1)
    async with prefill_engine(spec, 1, lease=0.2) as engine, consumer(spec, 0, 1, transfer_timeout=20) as c:
        engine.producers[0].expose(req.request_id, req.block_ids)
        session = await c.connect(engine.endpoint)
        await wait_for(lambda: engine.reasons[(req.request_id, "expired")] == 1)
        started = time.monotonic()
        with pytest.raises(akv.errors.LeaseExpiredError):
            await (await session.pull(req.request_id, [0, 1], req.block_ids))
        assert time.monotonic() - started < 2
        assert sum(engine.reasons.values()) == 1


@pytest.mark.parametrize(("served", "asked"), [(("pull",), "push"), (("push",), "pull")])
async def test_mode_mismatch_is_a_typed_error(served: tuple[str, ...], asked: str) -> None:
    """A decode rank asking for a mode the prefill engine does not serve gets an
    IncompatiblePeerError naming ``mode``."""
    spec = make_spec(kv_heads=4)
    async with prefill_engine(spec, 1, modes=served) as engine, consumer(spec, 0, 1, mode=asked) as c:
        with pytest.raises(akv.errors.IncompatiblePeerError) as info:
            await c.connect(engine.endpoint)
        assert "mode" in info.value.fields


WRITER = """
import json, sys, anyio, akv
from akv.testing import fill_request, make_requests
spec = akv.KVSpec.create(layers=2, num_blocks=32, block_size=4, kv_heads=4, head_dim=8, dtype="float16")
(req,) = make_requests(spec, 1, 3, seed=4)
async def main():
    async with akv.Producer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1) as p:
        fill_request(p.kv_caches, spec, 0, 1, req.block_ids, req.seed, req.num_tokens)
        p.expose(req.request_id, req.block_ids, layers_ready=1)
        print(json.dumps({"endpoint": str(p.endpoint), "request": req.request_id, "blocks": req.block_ids}), flush=True)
        await anyio.sleep_forever()
anyio.run(main)
"""


async def test_writer_crash_mid_request_fails_typed_after_the_writer_is_gone() -> None:
    """A writer process killed after writing its first layer: the pull fails with
    PeerLostError within 2 s of the kill (its process seen gone: no stop is waited for, and
    this rank's agent is replaced before the pull reports), long before its timeout."""
    spec = make_spec(kv_heads=4)
    proc = subprocess.Popen([sys.executable, "-c", WRITER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        async with consumer(spec, 0, 1, transfer_timeout=20.0, stop_grace_s=5.0) as c:
            session = await c.connect(info["endpoint"])
            t = await session.pull(info["request"], [0, 1, 2], info["blocks"])
            await wait_for(lambda: written(c.kv_caches) == 2)
            proc.kill()
            killed = time.monotonic()
            with pytest.raises(akv.errors.PeerLostError):
                await t
            assert time.monotonic() - killed < 2.0
            counters = c.metrics.snapshot().counters
            assert counters["push_stops_unconfirmed"] == 1 and counters["agent_resets"] == 1
            assert session.broken  # the writer's agent is gone: the next pull links again
    finally:
        stop(proc)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_rank_processes_push_over_the_cli() -> None:
    """`akv prefill --mode push --layer-ms` runs each of its two ranks as its own process and
    streams layers; `akv decode --mode push` (3 ranks) verifies every byte, every request is
    released on every prefill rank by push, and the decode summary's paths say "push"."""
    from akv.cli import build_parser
    from akv.cli.decode import run_decode

    with prefill_process(2, 6, "--mode", "push", "--layer-ms", "20", requests=4) as (proc, endpoint):
        args = build_parser().parse_args(
            ["decode", "--connect", endpoint, "--tp-size", "3", "--kv-heads", "6", *MODEL, "--mode", "push"]
        )
        summary = await run_decode(args)
        assert summary["verified"] == 4 and summary["failed"] == 0, summary.get("errors")
        assert summary["paths"] == {"push": 4}
        prefill = summary_of(proc)
    assert prefill["released"] == 4 and prefill["pushed"] == 4 and prefill["expired"] == 0


class PushRank:
    """What the control server sees of a prefill rank that serves push (sans-IO handshake)."""

    engine_id = "p"
    tp_rank = 0
    tp_size = 1
    lease_s = 1.0
    modes = ("pull", "push")

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.pushers: list[Any] = []

    def rank_info(self) -> Any:
        from akv.protocol.messages import RankInfo

        return RankInfo(tp_rank=0, agent_name="p0", agent_metadata=b"P", region_addrs=[1, 2, 3, 4])

    def peer_connected(self, engine_id: str, decode_rank: int, decode_tp: int, agent_name: str) -> None:
        pass

    def push_peer(self, hello: Any) -> None:
        self.pushers.append(hello)


@pytest.mark.parametrize("field", ["agent_metadata", "region_addrs", "mode", "staging_addr"])
def test_a_pushing_hello_is_bound_by_the_transcript_mac(field: str) -> None:
    """A relay that alters a pushing decode rank's agent metadata, regions, mode or staging
    area (where packed copies are written) makes the prefill side refuse the MAC and never
    load the agent; unaltered, the agent is loaded."""
    import msgspec

    from akv.errors import AuthenticationError
    from akv.protocol.handshake import ClientConversation, ServerConversation
    from akv.protocol.messages import Error, Hello, decode_message, encode_body

    cache = as_cache(make_spec(kv_heads=4))
    hello = Hello(
        engine_id="d",
        tp_rank=0,
        tp_size=1,
        spec=cache,
        compat=cache.compat_hash(),
        nonce=b"n" * 16,
        agent_name="d0",
        mode="push",
        agent_metadata=b"D" * 64,
        region_addrs=[10, 20, 30, 40],
        staging_addr=50,
        staging_bytes=1024,
    )
    altered = {
        "agent_metadata": b"X" * 64,
        "region_addrs": [10, 20, 30, 41],
        "mode": "pull",
        "staging_addr": 60,
    }
    for tamper in (False, True):
        rank = PushRank(cache)
        server = ServerConversation({0: rank}, b"secret")
        client = ClientConversation(hello, b"secret", lambda ch: [0])
        first = client.start()
        assert isinstance(first, Hello)
        sent = msgspec.structs.replace(first, **{field: altered[field]}) if tamper else first
        body = encode_body(sent)
        replies, _ = server.receive(decode_message(body), body)
        request = client.receive(replies[0], encode_body(replies[0]))
        assert request is not None
        body = encode_body(request)
        replies, _ = server.receive(decode_message(body), body)
        if tamper:
            assert isinstance(replies[0], Error) and replies[0].code == "auth"
            with pytest.raises(AuthenticationError):
                client.receive(replies[0], encode_body(replies[0]))
            assert rank.pushers == []
        else:
            assert client.receive(replies[0], encode_body(replies[0])) is None
            assert [h.agent_metadata for h in rank.pushers] == [b"D" * 64]
