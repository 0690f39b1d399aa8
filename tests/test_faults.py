"""Faults with real processes and real NIXL: killed, hung and crashing peers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import anyio
import pytest

import akv
from akv.testing import fetch_requests, spawn_prefill
from tests.conftest import (
    MODEL,
    cli_spec,
    decode_rank,
    prefill_process,
    read_json_line,
    stop,
    summary_of,
    verify,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

BIG = ["--layers", "8", "--blocks", "256", "--block-size", "64", "--head-dim", "128", "--dtype", "float16"]
TCP = {"UCX_TLS": "tcp"}  # data over TCP (pushed there): transfers stay in flight long enough to be cut


TIMEOUT, GRACE = 4.0, 2.0  # the killed-peer consumer's transfer_timeout, and stop_grace_s


def big_spec() -> akv.KVSpec:
    return cli_spec("--kv-heads", "4", *BIG)


def start_prefill(*extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    return spawn_prefill(
        "--tp-size",
        "1",
        "--kv-heads",
        "4",
        "--requests",
        "8",
        "--blocks-per-request",
        "16",
        "--timeout",
        "60",
        *BIG,
        *extra,
        env=env,
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # processes: one event loop is enough
async def test_killed_peer_fails_fast_others_unaffected_and_session_rehandshakes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGKILL mid-push: its pulls fail typed once the other peer's pulls in flight are done,
    within the stop grace (the watch of its process sees it gone, none of its writers can
    confirm a stop, and the agent's replacement waits for no more), and the other peer's
    succeed; another engine on the same endpoint is refused by the old session
    (EngineChangedError naming engine_id), and the same engine restarted there is linked
    again by it, with fresh agent metadata."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    spec = big_spec()
    victim, ep_a = start_prefill(env=TCP)  # engine id "prefill", the CLI's default
    other, ep_b = start_prefill("--seed", "1", env=TCP)
    try:
        reqs_a = await fetch_requests(ep_a, spec, None, "t")
        reqs_b = await fetch_requests(ep_b, spec, None, "t")
        # over TCP it pushes: a killed writer is noticed by its closed control connection; it
        # cannot confirm the stop, so its pulls settle once this rank replaced its agent
        # (nothing the dead writer's sockets still deliver can land); the other engine's
        # pulls finish meanwhile
        async with decode_rank(spec, transfer_timeout=TIMEOUT, stop_grace_s=GRACE) as consumer:
            sa, sb = await consumer.connect(ep_a), await consumer.connect(ep_b)
            old_agent = sa.agents[0]
            # the other engine's pulls first, then the victim's, killed right after they were
            # launched: its 96 MiB are still being pushed then, however fast the machine
            tb = [
                await sb.pull(r.request_id, list(range(128 + i * 16, 144 + i * 16)), r.block_ids)
                for i, r in enumerate(reqs_b[:6])
            ]
            ta = [
                await sa.pull(r.request_id, list(range(i * 16, i * 16 + 16)), r.block_ids)
                for i, r in enumerate(reqs_a[:6])
            ]
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            failed = 0
            for i, t in enumerate(ta):
                try:
                    await t
                    assert verify(consumer, list(range(i * 16, i * 16 + 16)), reqs_a[i].seed, range(16))
                except akv.TransferError:
                    failed += 1
                    assert time.monotonic() - killed < GRACE + 1.0
            assert failed > 0, "the kill landed after every read finished; nothing was tested"
            for i, t in enumerate(tb):
                await t
                assert verify(consumer, list(range(128 + i * 16, 144 + i * 16)), reqs_b[i].seed, range(16))
            victim.wait(5)
            port = ep_a.rsplit(":", 1)[1]
            r = reqs_a[7]
            # Another engine at the same address (other contents): the old session refuses it,
            # typed, and adopts nothing of it.
            reborn, _ = start_prefill("--port", port, "--engine-id", "engine-b", "--seed", "5", env=TCP)
            try:
                with pytest.raises(akv.EngineChangedError) as info:
                    await (await sa.pull(r.request_id, list(range(16)), r.block_ids))
                assert info.value.field == "engine_id" and sa.agents[0] == old_agent
            finally:
                stop(reborn)
            # The same engine name restarted there: the same session links it by itself.
            reborn, _ = start_prefill("--port", port, env=TCP)
            try:
                assert await consumer.connect(ep_a) is sa
                await (await sa.pull(r.request_id, list(range(16)), r.block_ids))
                assert sa.agents[0] != old_agent  # new agent: stale metadata was dropped
                assert verify(consumer, list(range(16)), r.seed, range(16))
                assert consumer.metrics.counters["engine_restarts"] == 1
            finally:
                stop(reborn)
    finally:
        for proc in (victim, other):
            stop(proc)


async def test_hung_peer_times_out_and_releases_by_lease() -> None:
    """SIGSTOP: handshakes fail on their timeout; once resumed, prefill releases every
    request exactly once, unread ones by lease."""
    with prefill_process(1, 4, "--lease", "1", requests=4) as (proc, endpoint):
        spec = cli_spec("--kv-heads", "4", *MODEL)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            async with decode_rank(spec, handshake_timeout=0.5, retries=0) as consumer:
                started = time.monotonic()
                with pytest.raises(akv.HandshakeError, match="timed out"):
                    await consumer.connect(endpoint)
                assert time.monotonic() - started < 3
            await anyio.sleep(1.2)  # the leases run out while the peer is stopped
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        summary = summary_of(proc)
    assert summary["expired"] == 4 and summary["duplicate_releases"] == 0 and summary["unreleased"] == 0
    assert proc.returncode == 3  # some requests were released by lease, not by read


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # processes: one event loop is enough
async def test_transfer_to_hung_peer_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A push from a stopped peer (TCP transport, the default mode there) fails with
    TransferTimeout, not a hang; the rank replaced its agent (nothing the silent writer sends
    can land), so the next pulls handshake again and fail with HandshakeError while the peer
    stays stopped."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    spec = big_spec()
    proc, endpoint = start_prefill(env=TCP)
    try:
        reqs = await fetch_requests(endpoint, spec, None, "t")
        async with decode_rank(
            spec,
            transfer_timeout=1.0,
            stop_grace_s=GRACE,  # over TCP it pushes: the stopped writer cannot confirm the stop
            handshake_timeout=1.0,
        ) as consumer:
            session = await consumer.connect(endpoint)
            await (await session.pull(reqs[0].request_id, list(range(16)), reqs[0].block_ids))  # warm
            os.kill(proc.pid, signal.SIGSTOP)
            results = []
            for i, r in enumerate(reqs[1:4], start=1):
                try:  # after a timeout the agent is replaced: the next pulls must handshake again
                    t = await session.pull(r.request_id, list(range(i * 16, i * 16 + 16)), r.block_ids)
                    with anyio.fail_after(GRACE + 5):
                        await t
                    results.append("ok")
                except akv.TransferTimeout:
                    results.append("timeout")
                except akv.HandshakeError:
                    results.append("handshake")
            assert results[0] == "timeout" and set(results[1:]) == {"handshake"}
            assert not consumer.inflight
            assert consumer.metrics.counters["agent_resets"] == 1
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        stop(proc)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # processes: one event loop is enough
async def test_decode_crash_after_handshake_releases_everything_by_lease_once() -> None:
    """A decode process killed after its handshake: prefill releases every request once
    (read or lease) and reports the counts."""
    # the lease outlives decode start-up (two rank processes), also on a loaded machine
    with prefill_process(2, 4, "--lease", "15", requests=12) as (proc, endpoint):
        cmd = [
            sys.executable,
            "-m",
            "akv",
            "decode",
            "--connect",
            endpoint,
            "--tp-size",
            "2",
            "--kv-heads",
            "4",
            *MODEL,
            "--json",
            "--concurrency",
            "1",
        ]
        decode = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            first = read_json_line(decode)  # one request pulled: handshakes are done
            assert first["event"] == "progress", first
            decode.send_signal(signal.SIGKILL)
        finally:
            stop(decode)
        summary = summary_of(proc)
    assert summary["duplicate_releases"] == 0 and summary["unreleased"] == 0
    assert summary["released"] + summary["expired"] == 12
    assert summary["expired"] >= 1  # the crashed reader never notified for the rest


LOST_PEER_SCRIPT = """
import signal, subprocess, sys, anyio, akv
from akv.testing import fetch_requests, spawn_prefill, spec_argv
spec = akv.KVSpec.create(layers=2, num_blocks=64, block_size=4, kv_heads=4, head_dim=16, dtype="float16")
async def main():
    proc, boot = spawn_prefill("--tp-size", "1", *spec_argv(spec), "--requests", "4",
                               "--blocks-per-request", "4", "--hold")
    async with akv.Consumer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1) as c:
        s = await c.connect(boot)
        reqs = await fetch_requests(boot, spec, None, c.engine_id)
        await (await s.pull(reqs[0].request_id, [0, 1, 2, 3], reqs[0].block_ids))
        proc.kill(); proc.wait(); proc.stdout.close()
        try:
            await (await s.pull(reqs[1].request_id, [4, 5, 6, 7], reqs[1].block_ids))
        except akv.TransferError as e:
            print("failed typed:", type(e).__name__)
anyio.run(main)
print("exited cleanly")
"""


def test_process_exits_cleanly_after_a_read_to_a_killed_peer() -> None:
    """A read to a SIGKILLed peer fails typed, and the process then exits 0: UCX retires what it
    held for the lost peer before the agent closes (no abort at exit)."""
    res = subprocess.run(
        [sys.executable, "-c", LOST_PEER_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert "failed typed: PeerLostError" in res.stdout, res.stdout + res.stderr[-2000:]
    assert res.returncode == 0 and "exited cleanly" in res.stdout, res.stderr[-2000:]
    assert "Assertion" not in res.stdout + res.stderr


async def test_pulls_waiting_on_a_lost_peer_fail_together() -> None:
    """After a prefill engine dies, concurrent pulls needing it share one failed re-link and all
    fail with a typed error in about the time of one attempt, not one attempt after another."""
    spec = akv.KVSpec.create(layers=2, num_blocks=64, block_size=4, kv_heads=4, head_dim=16, dtype="float16")
    with prefill_process(1, 4, requests=12) as (proc, endpoint):
        async with decode_rank(spec, retries=1, connect_timeout=1.0) as consumer:
            session = await consumer.connect(endpoint)
            reqs = await fetch_requests(endpoint, spec, None, consumer.engine_id)
            await (await session.pull(reqs[0].request_id, [0, 1, 2, 3], reqs[0].block_ids))
            proc.kill()
            proc.wait(10)
            t0 = time.monotonic()
            with pytest.raises(akv.AkvError):  # the lost peer shows on this pull (read or re-link)
                await (await session.pull(reqs[1].request_id, [4, 5, 6, 7], reqs[1].block_ids))
            one = time.monotonic() - t0
            errors: list[BaseException] = []

            async def pull(i: int) -> None:
                try:
                    await (
                        await session.pull(
                            reqs[i].request_id, [i * 4 + j for j in range(4)], reqs[i].block_ids
                        )
                    )
                except akv.AkvError as exc:
                    errors.append(exc)

            t0 = time.monotonic()
            async with anyio.create_task_group() as tg:
                for i in range(2, 10):
                    tg.start_soon(pull, i)
            together = time.monotonic() - t0
            assert len(errors) == 8, errors
            assert together < 3 * max(one, 0.5), (one, together)
