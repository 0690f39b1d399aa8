"""Churn seen from a decode rank that stays up: a prefill engine restarted at its address is
linked again by the same session, a dead prefill is told from a stalled one in about a
second (pull and push, the default transports and UCX over TCP), and the rounds of both run
in a loop (``AKV_CHURN_ROUNDS``, 10 in the chaos run: tests/test_chaos.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import akv
from akv.testing import EtcdServer, fetch_requests, spawn_prefill, stop_prefill, verify_request
from tests.conftest import cli_spec, decode_rank, stop

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MODEL = ["--layers", "2", "--kv-heads", "4", "--block-size", "16", "--head-dim", "64", "--dtype", "bfloat16"]
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
BLOCKS, REQUESTS, PER_REQUEST = 64, 4, 4
ENGINE = "churned"
#: restarts per transport of the restart test (the chaos run takes 10: tests/test_chaos.py)
ROUNDS = int(os.environ.get("AKV_CHURN_ROUNDS", "1"))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["default", "tcp"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The UCX transports of this process (the decode) and of the prefill processes: the
    defaults (shared memory here: the decode pulls), or TCP alone (the decode pushes)."""
    for key, value in TCP.items():
        if request.param == "tcp":
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)
    yield str(request.param)


def spec() -> akv.KVSpec:
    return cli_spec("--blocks", str(BLOCKS), *MODEL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start(port: int, seed: int, *extra: str, engine: str = ENGINE) -> tuple[subprocess.Popen[str], str]:
    """One TP-1 ``akv prefill`` at ``port`` (``seed``: its request ids, ``req-SEED-i``), started
    in a worker thread (this event loop runs on meanwhile, as a decode rank's would)."""
    return await anyio.to_thread.run_sync(lambda: _spawn(port, seed, engine, *extra))


def _spawn(port: int, seed: int, engine: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    return spawn_prefill(
        "--tp-size", "1", "--blocks", str(BLOCKS), "--requests", str(REQUESTS), "--blocks-per-request",
        str(PER_REQUEST), "--port", str(port), "--engine-id", engine, "--seed", str(seed), "--hold",
        "--timeout", "300", *MODEL, *extra,
    )  # fmt: skip


async def pull_exact(
    session: akv.TransferSession, consumer: akv.Consumer, req: Any, at: int, deadline: float | None = None
) -> str:
    """Pull ``req`` into blocks ``at...`` and verify every byte; returns the path it took."""
    local = list(range(at, at + PER_REQUEST))
    with anyio.fail_after(30):
        t = await session.pull(
            req.request_id, local, req.block_ids, num_tokens=req.num_tokens, transfer_timeout=deadline
        )
        result = await t
    assert verify_request(consumer.kv_caches, spec(), 0, 1, local, req.seed)
    return result.path


async def test_a_restarted_prefill_is_linked_again_by_the_same_session(transport: str) -> None:
    """A prefill engine killed (SIGKILL) and started again at its address, with its engine id,
    ``ROUNDS`` times: the decode rank's one session (``connect`` as before) links each new
    incarnation by itself and pulls its requests bit-exact, the old incarnation's requests
    fail typed (never reported pulled), each restart is counted once, and another engine id at
    the address is still refused with EngineChangedError."""
    await restart_rounds(transport, ROUNDS)


async def restart_rounds(transport: str, rounds: int) -> None:
    """The restart test's rounds (``transport``: what the environment already selects)."""
    port = free_port()
    s = spec()
    async with decode_rank(s, engine_id="churn-decode", transfer_timeout=10) as consumer:
        previous: list[Any] = []
        for k in range(rounds + 1):
            proc, endpoint = await start(port, seed=k)
            try:
                reqs = await fetch_requests(endpoint, s, None, "churn-decode")
                session = await consumer.connect(endpoint)
                assert session.mode == ("push" if transport == "tcp" else "pull"), session.mode
                path = "push" if transport == "tcp" else "read"
                for i, req in enumerate(reqs):  # the first one links the new incarnation
                    assert await pull_exact(session, consumer, req, i * PER_REQUEST) == path
                assert consumer.metrics.counters.get("engine_restarts", 0) == k
                for old in previous:  # exposed by the dead incarnation only (a push waits for it)
                    with pytest.raises(akv.TransferError):
                        await pull_exact(session, consumer, old, 0, deadline=1.0)
            finally:
                proc.kill()
                proc.wait(10)
                stop(proc)
            previous = reqs[:1]
        other, endpoint = await start(port, seed=99, engine="another-engine")
        try:
            with pytest.raises(akv.EngineChangedError) as info:
                await pull_exact(await consumer.connect(endpoint), consumer, previous[0], 0)
            assert info.value.field == "engine_id"
        finally:
            stop(other)


@pytest.mark.parametrize("when", ["in flight", "after"])
async def test_a_dead_prefill_fails_the_pull_within_two_seconds(transport: str, when: str) -> None:
    """A prefill process killed while a push of it is in flight (its layers still being
    computed), or before a pull starts (the decode's default mode: pull over shared memory,
    push over TCP): the pull fails with PeerLostError within 2 s of the kill or of its start,
    whichever is later, not at its 20 s timeout."""
    port = free_port()
    s = spec()
    flight = when == "in flight"
    layer_ms = ["--mode", "push", "--layer-ms", "2000"] if flight else []  # the push waits for the layers
    async with decode_rank(
        s, engine_id="churn-decode", transfer_timeout=20, mode="push" if flight else None
    ) as consumer:
        proc, endpoint = await start(port, 0, *layer_ms)
        try:
            reqs = await fetch_requests(endpoint, s, None, "churn-decode")
            session = await consumer.connect(endpoint)
            local = list(range(PER_REQUEST))
            transfer = None
            if flight:
                transfer = await session.pull(reqs[1].request_id, local, reqs[1].block_ids)
            else:
                await pull_exact(session, consumer, reqs[0], 0)
            await anyio.sleep(0.2)
            proc.kill()
            killed = time.monotonic()
            with pytest.raises(akv.PeerLostError), anyio.fail_after(10):
                if transfer is None:
                    await anyio.sleep(0.2)  # the pull starts after the kill
                    killed = time.monotonic()
                    await (await session.pull(reqs[1].request_id, local, reqs[1].block_ids))
                else:
                    await transfer
            assert time.monotonic() - killed < 2.0
        finally:
            stop(proc)


async def test_a_stalled_prefill_is_not_taken_for_dead(transport: str) -> None:
    """A prefill process stopped (SIGSTOP) under a push: the pull waits out its timeout and
    fails with TransferTimeout, not PeerLostError, no rank is counted lost; once the prefill
    resumes, the next pull of it succeeds bit-exact."""
    port = free_port()
    s = spec()
    async with decode_rank(
        s, engine_id="churn-decode", transfer_timeout=2.5, stop_grace_s=1, mode="push"
    ) as consumer:
        proc, endpoint = await start(port, 0, "--mode", "push", "--layer-ms", "300")
        try:
            reqs = await fetch_requests(endpoint, s, None, "churn-decode")
            session = await consumer.connect(endpoint)
            await pull_exact(session, consumer, reqs[0], 0)
            proc.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(akv.TransferTimeout):
                    await pull_exact(session, consumer, reqs[1], PER_REQUEST)
            finally:
                proc.send_signal(signal.SIGCONT)
            assert consumer.metrics.counters.get("peers_lost", 0) == 0
            await pull_exact(await consumer.connect(endpoint), consumer, reqs[2], 2 * PER_REQUEST)
        finally:
            stop(proc)


async def test_one_rank_restarted_through_etcd_fails_only_its_pulls(etcd: EtcdServer) -> None:
    """Prefill rank 1 of a TP-2 engine registered in etcd (each rank its own process) killed,
    then started again at a new port: decode rank 1's pulls (it reads rank 1 only) fail with
    PeerLostError while it is down and succeed once it is back, found again through etcd;
    decode rank 0 (rank 0 only) is never disturbed; every exposure of every rank process is
    released exactly once, by read or by lease."""
    name = f"churn-{os.getpid()}-{time.monotonic_ns() % 100000}"
    argv = [
        "--tp-size", "2", "--blocks", str(BLOCKS), "--requests", str(REQUESTS),
        "--blocks-per-request", str(PER_REQUEST), "--engine-id", name, "--etcd", etcd.endpoint,
        "--etcd-ttl", "2", "--lease", "8", "--hold", "--timeout", "120", *MODEL, "--kv-heads", "8",
    ]  # fmt: skip
    spec8 = cli_spec("--blocks", str(BLOCKS), *MODEL, "--kv-heads", "8")
    first, endpoint = spawn_prefill(*argv, "--tp-rank", "0", "--port", "0")
    ranks = {0: first, 1: spawn_prefill(*argv, "--tp-rank", "1", "--port", "0")[0]}
    summaries: dict[int, dict[str, Any] | None] = {}
    try:
        requests = await fetch_requests(endpoint, spec8, None, "churn-d2")
        address = f"etcd://{etcd.endpoint}/{name}"
        async with (
            decode_rank(spec8, 0, 2, engine_id="churn-d2") as d0,
            decode_rank(spec8, 1, 2, engine_id="churn-d2") as d1,
        ):
            sessions = [await d0.connect(address), await d1.connect(address)]
            assert [sorted(s.links) for s in sessions] == [[0], [1]]

            async def pull(d: int, i: int) -> BaseException | None:
                consumer, req = (d0, d1)[d], requests[i]
                local = list(range(i * PER_REQUEST, (i + 1) * PER_REQUEST))
                try:
                    with anyio.fail_after(15):
                        request = akv.PullRequest(
                            request_id=req.request_id,
                            local_block_ids=local,
                            remote_block_ids=req.block_ids,
                            generation=req.generation,
                        )
                        await (await sessions[d].pull(request))
                except akv.AkvError as exc:
                    return exc
                assert verify_request(consumer.kv_caches, spec8, d, 2, local, req.seed)
                return None

            assert [await pull(d, 0) for d in (0, 1)] == [None, None]
            stop(ranks[1])  # SIGKILL
            assert await pull(0, 1) is None
            assert isinstance(await pull(1, 1), akv.PeerLostError)
            ranks[1] = (
                await anyio.to_thread.run_sync(lambda: spawn_prefill(*argv, "--tp-rank", "1", "--port", "0"))
            )[0]
            assert await pull(0, 2) is None
            for i in (1, 2, 3):  # the new rank 1 exposes every request again
                assert await pull(1, i) is None, i
            assert await pull(0, 3) is None
        for r in (0, 1):
            summaries[r] = stop_prefill(ranks[r], timeout=20)
    finally:
        for proc in ranks.values():
            stop(proc)
    rank0, rank1 = summaries[0], summaries[1]  # rank 1: the restarted process
    assert rank0 is not None and rank1 is not None
    for summary in (rank0, rank1):
        assert summary["duplicate_releases"] == 0 and summary["unreleased"] == 0, summary
    # every request read once from rank 0; from the new rank 1 all but the first (read from
    # the old one), which is released as the engine stops
    assert (rank0["released"], rank1["released"]) == (REQUESTS, REQUESTS - 1), (rank0, rank1)


DECODE = """
import json, sys, anyio, akv
from akv.cli import build_parser
from akv.cli.args import spec_from_args
from akv.testing import fetch_requests, verify_request
endpoint, picks = sys.argv[1], [int(i) for i in sys.argv[2].split(",")]
spec = spec_from_args(build_parser().parse_args(sys.argv[3:]))
async def main():
    reqs = await fetch_requests(endpoint, spec, None, "restarted-decode")
    kv = akv.allocate_kv_cache(spec, 0, 1)
    async with akv.Consumer(kv, spec, tp_rank=0, tp_size=1, engine_id="restarted-decode") as c:
        session = await c.connect(endpoint)
        for i in picks:
            r, local = reqs[i], list(range(len(reqs[i].block_ids)))
            request = akv.PullRequest(request_id=r.request_id, local_block_ids=local,
                                      remote_block_ids=r.block_ids, generation=r.generation)
            try:
                await (await session.pull(request))
                outcome = "ok" if verify_request(kv, spec, 0, 1, local, r.seed) else "mismatch"
            except akv.AkvError as exc:
                outcome = type(exc).__name__
            print(json.dumps({"request": i, "outcome": outcome}), flush=True)
        await anyio.sleep_forever()  # until killed
anyio.run(main)
"""


async def test_a_decode_rank_restarted_under_its_engine_id_leaves_releases_exact() -> None:
    """A decode rank process (engine id D) killed after its pulls, and a new process of it
    (the same engine id and rank, a new agent) pulling the rest and again one the old one
    read: the new one's pulls succeed bit-exact, the one already read fails typed, and the
    prefill releases every request exactly once, by read, none by lease."""
    import json
    import sys

    prefill, endpoint = await anyio.to_thread.run_sync(
        lambda: spawn_prefill(
            "--tp-size",
            "1",
            "--blocks",
            str(BLOCKS),
            "--requests",
            str(REQUESTS),
            "--blocks-per-request",
            str(PER_REQUEST),
            "--lease",
            "20",
            "--timeout",
            "120",
            "--hold",
            *MODEL,
        )
    )
    argv = ["decode", "--connect", "x:1", "--tp-size", "1", "--blocks", str(BLOCKS), *MODEL]

    def decode(picks: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", DECODE, endpoint, picks, *argv], stdout=subprocess.PIPE, text=True
        )

    def outcomes(proc: subprocess.Popen[str], n: int) -> list[str]:
        assert proc.stdout is not None
        out = []
        while len(out) < n and (line := proc.stdout.readline()):
            if line.startswith("{"):
                out.append(json.loads(line)["outcome"])
        return out

    half = REQUESTS // 2
    first = decode(",".join(str(i) for i in range(half)))
    try:
        assert await anyio.to_thread.run_sync(outcomes, first, half) == ["ok"] * half
        await anyio.sleep(0.5)  # its last "done" notice leaves (else that request goes by lease)
    finally:
        stop(first)  # SIGKILL
    again = decode(",".join(str(i) for i in (*range(half, REQUESTS), 0)))
    try:
        got = await anyio.to_thread.run_sync(outcomes, again, REQUESTS - half + 1)
        assert got[:-1] == ["ok"] * (REQUESTS - half) and got[-1] in ("NotExposedError", "ReleasedError"), got
        await anyio.sleep(0.5)  # its last "done" notices leave too (else they go by lease)
    finally:
        stop(again)
    summary = await anyio.to_thread.run_sync(stop_prefill, prefill)
    assert summary is not None
    assert summary["released"] == REQUESTS and summary["expired"] == summary["unreleased"] == 0, summary
    assert summary["duplicate_releases"] == 0, summary
