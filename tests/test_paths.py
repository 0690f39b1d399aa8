"""Transfer paths: the same-process copy path against NIXL reads, on DRAM.

Every prefill rank of these engines lives in this process, so ``same_process="auto"`` (the
default) copies with torch; ``"nixl"`` reads through real NIXL agents. Both must give the
same bytes, the same releases and the same typed errors, for every TP pairing kind, MLA,
hybrid groups, mixed layouts and block sizes, and partial prefix hits.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest

import akv
from akv.testing import fetch_requests, fill_request, verify_request
from tests.conftest import make_spec, prefill_engine, prefill_process, wait_for
from tests.transfers import PULL_PAIRS, pull_everything

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(("pspec", "dspec", "p", "d"), PULL_PAIRS)
async def test_torch_copies_match_nixl_reads(pspec: Any, dspec: Any, p: int, d: int) -> None:
    """The GPU's way of copying (torch gathers and scatters over strided views), run on CPU
    tensors, moves exactly what NIXL reads move."""
    copied, engine = await pull_everything(pspec, dspec, p, d, "auto", copy_with="torch")
    assert {r.path for r in copied} == {"copy"}
    assert set(engine.reasons.values()) == {p} and {why for _, why in engine.reasons} == {"read"}


@pytest.mark.parametrize("copy_with", ["auto", "torch"])
async def test_copies_into_tensors_that_start_inside_their_storage(copy_with: str) -> None:
    """Decode regions that are views into one larger buffer (not 8-byte aligned) are filled
    bit-exact by both ways of copying."""
    spec = make_spec(kv_heads=4, dtype="float16")
    results, _ = await pull_everything(spec, spec, 2, 1, "auto", copy_with=copy_with, views=True)
    assert {r.path for r in results} == {"copy"}


@pytest.mark.parametrize(("pspec", "dspec", "p", "d"), PULL_PAIRS)
async def test_copy_path_matches_nixl_reads(pspec: Any, dspec: Any, p: int, d: int) -> None:
    """The copy path moves exactly the bytes NIXL reads move, with the same sizes and releases."""
    copied, eng_c = await pull_everything(pspec, dspec, p, d, "auto")
    read, eng_r = await pull_everything(pspec, dspec, p, d, "nixl")
    assert {r.path for r in copied} == {"copy"} and {r.path for r in read} == {"read"}
    assert [(r.bytes, r.descriptors, r.reads) for r in copied] == [
        (r.bytes, r.descriptors, r.reads) for r in read
    ]
    assert {reason for _, reason in eng_c.reasons} == {"read"} == {reason for _, reason in eng_r.reasons}
    assert set(eng_c.reasons.values()) == {p} == set(eng_r.reasons.values())  # once per rank and request


async def test_large_dram_copies_run_off_the_event_loop() -> None:
    """With copy_inline_bytes=0 every DRAM copy runs in the worker thread: same bytes, same path."""
    spec = make_spec(kv_heads=4)
    results, engine = await pull_everything(spec, spec, 2, 1, "auto", inline=0)
    assert {r.path for r in results} == {"copy"}
    assert {reason for _, reason in engine.reasons} == {"read"}


async def test_copy_path_keeps_the_exposure_check() -> None:
    """Copying never reports success for blocks not exposed for the request, or no longer exposed."""
    spec = make_spec()
    async with prefill_engine(spec, 1, lease=0.2) as engine, AsyncExitStack() as stack:
        consumer = await stack.enter_async_context(
            akv.Consumer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, same_process="copy")
        )
        session = await consumer.connect(engine.endpoint)
        with pytest.raises(akv.errors.NotExposedError):
            await (await session.pull("never", [0], [1]))
        engine.producers[0].expose("r", [1, 2], lease=30)
        with pytest.raises(akv.errors.OutsideExposureError):
            await (await session.pull("r", [0, 1, 2], [1, 2, 3]))
        engine.producers[0].expose("short", [5, 6])
        await wait_for(lambda: ("short", "expired") in engine.reasons)
        with pytest.raises(akv.LeaseExpiredError):
            await (await session.pull("short", [0, 1], [5, 6]))
        result = await (await session.pull("r", [0, 1], [1, 2]))
        assert result.path == "copy"
        await wait_for(lambda: ("r", "read") in engine.reasons)
        assert consumer.metrics.counters["unsafe_reads"] == 3


async def test_copy_required_from_another_process_is_a_typed_error() -> None:
    """same_process='copy' refuses a prefill engine of another process at connect; 'auto' reads it."""
    spec = make_spec(num_blocks=64, head_dim=16)
    with prefill_process(1, 4) as (_proc, endpoint):
        async with akv.Consumer(
            akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, same_process="copy", retries=0
        ) as consumer:
            with pytest.raises(akv.IncompatiblePeerError, match="same_process") as info:
                await consumer.connect(endpoint)
            assert info.value.fields == ("same_process",)
        async with akv.Consumer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1) as consumer:
            session = await consumer.connect(endpoint)
            req = (await fetch_requests(endpoint, spec, None, consumer.engine_id))[0]
            result = await (await session.pull(req.request_id, [0, 1, 2, 3], req.block_ids))
            assert result.path == "read"
            assert verify_request(consumer.kv_caches, spec, 0, 1, [0, 1, 2, 3], req.seed)


async def test_a_restarted_rank_of_this_process_is_linked_again() -> None:
    """After the prefill rank of this process closes, the next pull fails typed or re-links; a
    rank started again behind the same address serves copies again."""
    spec = make_spec()
    async with anyio.create_task_group() as tg:
        server = akv.ControlServer()
        endpoint = await tg.start(server.serve)
        async with akv.Consumer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1) as consumer:
            for round_ in range(2):
                async with akv.Producer(
                    akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, server=server
                ) as prod:
                    fill_request(prod.kv_caches, spec, 0, 1, [3, 4], seed=round_ + 1)
                    prod.expose(f"r{round_}", [3, 4])
                    session = await consumer.connect(endpoint)
                    result = await (await session.pull(f"r{round_}", [8, 9], [3, 4]))
                    assert result.path == "copy"
                    assert verify_request(consumer.kv_caches, spec, 0, 1, [8, 9], seed=round_ + 1)
            assert consumer.metrics.counters["handshakes"] == 2
        tg.cancel_scope.cancel()


def test_same_process_option_is_checked() -> None:
    """An unknown same_process value is a ConfigError naming the choices."""
    spec = make_spec()
    with pytest.raises(akv.ConfigError, match="'auto', 'copy' or 'nixl'"):
        akv.Consumer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, same_process="fast")
