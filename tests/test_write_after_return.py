"""No write lands after control returns: a failed, timed-out or closed pull never changes its
blocks afterwards (real processes, real NIXL, UCX over TCP, where a consumer pushes by
default, 64 MiB requests in flight, also packed pushes into the staging area; and reads NIXL
still reports, with an agent handed in)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import anyio
import pytest
import torch

import akv
from akv.errors import PeerLostError
from akv.protocol.messages import RequestInfo
from akv.testing import fetch_requests, spawn_prefill, verify_request
from tests.conftest import cli_spec, decode_rank, make_spec, prefill_engine, stop
from tests.transfers import HeldBackend

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

BLOCKS, PER_REQUEST = 640, 64  # 1 MiB blocks: 64 MiB requests (8, 9: spares)
GEOMETRY = [
    "--layers",
    "8",
    "--kv-heads",
    "4",
    "--block-size",
    "64",
    "--head-dim",
    "128",
    "--dtype",
    "float16",
]
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}  # data over TCP, not cma: reads stay in flight
SENTINEL = 0x5A
TIMEOUT, GRACE = 2.0, 3.0  # the stalled pulls' transfer_timeout and stop_grace_s


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def prefill() -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc, endpoint = spawn_prefill(
        "--tp-size", "1", "--blocks", str(BLOCKS), "--requests", str(BLOCKS // PER_REQUEST),
        "--blocks-per-request", str(PER_REQUEST), "--timeout", "120", "--lease", "120", "--hold", *GEOMETRY,
        "--transfer", "packed", "--pack-pool-mib", str(BLOCKS + 64),  # packed copies of every request
        env=TCP,
    )  # fmt: skip
    try:
        yield proc, endpoint
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        stop(proc)


@pytest.fixture(autouse=True)
def over_tcp(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """UCX over TCP for the tests that talk to the prefill process."""
    if "prefill" in request.fixturenames:
        for key, value in TCP.items():
            monkeypatch.setenv(key, value)


def spec() -> akv.KVSpec:
    return cli_spec("--blocks", str(BLOCKS), *GEOMETRY)


@asynccontextmanager
async def reader(
    endpoint: str, **kw: float
) -> AsyncIterator[tuple[list[RequestInfo], list[torch.Tensor], akv.Consumer, akv.TransferSession]]:
    """The requests the engine at ``endpoint`` announced, and a one-rank decode engine in its
    default mode (which pushes over TCP) taking them: its regions, itself, and its session."""
    reqs = await fetch_requests(endpoint, spec(), None, "w")
    async with decode_rank(spec(), same_process="nixl", **kw) as consumer:
        session = await consumer.connect(endpoint)
        assert session.mode == "push"
        yield reqs, consumer.kv_caches, consumer, session


def local_ids(slot: int) -> list[int]:
    return list(range(slot * PER_REQUEST, (slot + 1) * PER_REQUEST))


def poison(kv: list[torch.Tensor], blocks: list[int], value: int = SENTINEL) -> None:
    """Write ``value`` into every byte of ``blocks`` (the caller reusing them)."""
    for region in kv:
        region.view(torch.uint8)[blocks] = value  # regions are [blocks, ...]


def intact(kv: list[torch.Tensor], blocks: list[int]) -> bool:
    return all(bool((region.view(torch.uint8)[blocks] == SENTINEL).all()) for region in kv)


async def stop_mid_push(proc: subprocess.Popen[str], kv: list[torch.Tensor], blocks: list[int]) -> None:
    """SIGSTOP the writer once its first bytes landed in ``blocks`` (poisoned with 0xFF before
    the pull): the rest of the request is still to come."""
    first = kv[0].view(torch.uint8)[blocks[0]]
    with anyio.fail_after(20):
        while bool((first == 0xFF).all()):
            await anyio.sleep(0.0005)  # the consumer's poller receives meanwhile
    os.kill(proc.pid, signal.SIGSTOP)


async def resume_then_check(
    proc: subprocess.Popen[str], consumer: akv.Consumer, session: akv.TransferSession,
    reqs: list[RequestInfo], kv: list[torch.Tensor], poisoned: list[int],
) -> None:  # fmt: skip
    """Resume the writer; 8 s later the blocks refilled right after the pull raised are still
    intact and the writer still runs; then a new pull from the same engine verifies."""
    os.kill(proc.pid, signal.SIGCONT)
    await anyio.sleep(8.0)  # the consumer's poller keeps progressing its agent meanwhile
    assert intact(kv, poisoned), "bytes of a failed push landed in blocks handed back"
    assert proc.poll() is None, f"the writer died ({proc.returncode})"
    session = await consumer.connect(session.endpoint)
    r = reqs[3 + poisoned[0] // PER_REQUEST]  # a request of its own, into other blocks
    result = await (await session.pull(r.request_id, local_ids(5), r.block_ids, transfer_timeout=30))
    assert result.bytes == PER_REQUEST << 20 and result.path == "push"
    assert verify_request(kv, spec(), 0, 1, local_ids(5), r.seed)
    assert intact(kv, poisoned)


async def test_stalled_writer_past_the_deadline_lands_nothing_after_the_pull_raised(
    prefill: tuple[subprocess.Popen[str], str],
) -> None:
    """Push over TCP (the default mode there): the writer SIGSTOPped mid-push past the pull's
    timeout and stop grace (a push that landed before the stop is tried again with another
    request); the pull raises TransferTimeout within timeout + grace + 5 s, only
    once this rank replaced its agent; the blocks refilled right away stay intact for 8 s after
    the writer resumes, the writer keeps running, and a pull afterwards verifies."""
    proc, endpoint = prefill
    async with reader(endpoint, stop_grace_s=GRACE) as (reqs, kv, consumer, session):
        for r in (reqs[0], reqs[8], reqs[9]):
            poison(kv, local_ids(0), 0xFF)
            t = await session.pull(r.request_id, local_ids(0), r.block_ids, transfer_timeout=TIMEOUT)
            start = time.monotonic()
            await stop_mid_push(proc, kv, local_ids(0))
            await anyio.sleep(0.2)  # a stopped writer sends no "pushed": a pull done now was done before
            if not t.done():
                break
            await t  # its push landed before the writer could be stopped: again, with a spare request
            os.kill(proc.pid, signal.SIGCONT)
        else:
            pytest.fail("every push landed before its writer could be stopped")
        with pytest.raises(akv.TransferTimeout):
            with anyio.fail_after(TIMEOUT + GRACE + 10):
                await t
        poison(kv, local_ids(0))
        elapsed = time.monotonic() - start
        print(
            f"stalled writer: TransferTimeout {elapsed:.2f}s after the post (timeout {TIMEOUT}, grace {GRACE})"
        )
        assert elapsed < TIMEOUT + GRACE + 5
        assert consumer.metrics.snapshot().counters["agent_resets"] == 1
        await resume_then_check(proc, consumer, session, reqs, kv, local_ids(0))


async def test_session_closed_mid_push_lands_nothing_after_it_closed(
    prefill: tuple[subprocess.Popen[str], str],
) -> None:
    """Closing a session mid-push (writer stopped) fails its pull with ClosedError; once aclose
    returns, nothing of the push lands, even once the writer resumes, and the writer survives."""
    proc, endpoint = prefill
    async with reader(endpoint, stop_grace_s=GRACE) as (reqs, kv, consumer, session):
        poison(kv, local_ids(1), 0xFF)
        t = await session.pull(reqs[1].request_id, local_ids(1), reqs[1].block_ids, transfer_timeout=30)
        await stop_mid_push(proc, kv, local_ids(1))
        with anyio.fail_after(GRACE + 10):
            await session.aclose()
        poison(kv, local_ids(1))
        with pytest.raises(akv.errors.ClosedError):
            await t
        await resume_then_check(proc, consumer, session, reqs, kv, local_ids(1))


async def test_stalled_packed_writer_lands_nothing_after_the_pull_raised(
    prefill: tuple[subprocess.Popen[str], str],
) -> None:
    """Packed push over TCP: the writer SIGSTOPped mid-WRITE of its packed copy into the
    staging area, past the pull's timeout and stop grace. The pull raises TransferTimeout only
    once this rank replaced its agent, having scattered nothing into its blocks; the blocks
    refilled right away stay intact for 8 s after the writer resumes, and a packed push
    afterwards reuses the staging area, bit-exact."""
    proc, endpoint = prefill
    async with reader(endpoint, stop_grace_s=GRACE, transfer="packed") as (reqs, kv, consumer, session):
        assert consumer.staging is not None
        staging = consumer.staging.tensor
        staging.fill_(0xFF)
        poison(kv, local_ids(3), 0xFF)
        t = await session.pull(reqs[6].request_id, local_ids(3), reqs[6].block_ids, transfer_timeout=TIMEOUT)
        with anyio.fail_after(20):
            while bool((staging[:4096] == 0xFF).all()):  # its first bytes landed in the staging area
                await anyio.sleep(0.0005)
        os.kill(proc.pid, signal.SIGSTOP)
        with pytest.raises(akv.TransferTimeout):
            with anyio.fail_after(TIMEOUT + GRACE + 10):
                await t
        assert all(bool((region.view(torch.uint8)[local_ids(3)] == 0xFF).all()) for region in kv)
        poison(kv, local_ids(3))
        assert consumer.metrics.snapshot().counters["agent_resets"] == 1
        os.kill(proc.pid, signal.SIGCONT)
        await anyio.sleep(8.0)
        assert intact(kv, local_ids(3)), "bytes of a failed packed push reached blocks handed back"
        assert proc.poll() is None, f"the writer died ({proc.returncode})"
        session = await consumer.connect(session.endpoint)
        r = reqs[7]
        result = await (await session.pull(r.request_id, local_ids(4), r.block_ids, transfer_timeout=30))
        assert result.path == "push" and result.descriptors <= 2  # k and v, one run each
        assert verify_request(kv, spec(), 0, 1, local_ids(4), r.seed)
        assert intact(kv, local_ids(3))


async def test_short_timeout_leaves_blocks_alone(prefill: tuple[subprocess.Popen[str], str]) -> None:
    """A timeout shorter than the push (no signal): once the pull raises, nothing of it lands."""
    proc, endpoint = prefill
    async with reader(endpoint) as (reqs, kv, consumer, session):
        t = await session.pull(reqs[2].request_id, local_ids(2), reqs[2].block_ids, transfer_timeout=0.002)
        with pytest.raises(akv.TransferTimeout):
            with anyio.fail_after(10):
                await t
        poison(kv, local_ids(2))
        await resume_then_check(proc, consumer, session, reqs, kv, local_ids(2))


async def test_reads_nixl_reports_running_hold_back_the_error() -> None:
    """With a backend it did not create (so it cannot replace the agent), a consumer reports a
    timed-out pull, and a pull whose second post failed, only once NIXL reports the reads
    already posted finished (quarantine), never before."""
    spec = make_spec(kv_heads=4)
    async with prefill_engine(spec, 2) as engine:
        engine.fill("a", [1, 2], seed=1)
        engine.fill("b", [3, 4], seed=2)
        backend = HeldBackend("held-war-d0")
        async with decode_rank(spec, backend=backend, same_process="nixl", mode="pull") as c:
            session = await c.connect(engine.endpoint)
            backend.hold_until = time.monotonic() + 1.0
            t = await session.pull("a", [0, 1], [1, 2], transfer_timeout=0.1)
            with pytest.raises(akv.TransferTimeout):
                await t
            assert time.monotonic() >= backend.hold_until
            backend.posts, backend.fail_post = 0, 2  # 2 -> 1: one read per prefill rank
            backend.hold_until = time.monotonic() + 1.0
            with pytest.raises(PeerLostError, match="injected"):
                await session.pull("b", [2, 3], [3, 4])
            assert time.monotonic() >= backend.hold_until
