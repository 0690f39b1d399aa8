"""Engines found by name through a real etcd: per-rank registration, etcd:// addresses in
Consumer.connect and --connect, sessions that outlive an etcd outage."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import pytest

import akv
from akv.testing import EtcdServer, fill_request, verify_request
from tests.conftest import decode_engine, decode_rank, make_spec, prefill_rank

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def etcd_engine(
    spec: akv.KVSpec, tp_size: int, etcd_endpoint: str, name: str
) -> AsyncIterator[list[akv.Producer]]:
    """Prefill ranks that register only in etcd (no bootstrap), each with its own endpoint."""
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                prefill_rank(spec, r, tp_size, engine_id=name, etcd=etcd_endpoint, etcd_ttl=2.0)
            )
            for r in range(tp_size)
        ]


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_etcd_address_finds_every_rank_bit_exact(etcd: EtcdServer, mode: str) -> None:
    """P=4 ranks registered in etcd, D=2 decode ranks connect by etcd://HOST:PORT/NAME: each
    links the ranks it needs, pulls bit-exact (pull mode: reads; push mode: the ranks write),
    and every prefill rank releases the request once."""
    spec = make_spec(kv_heads=8)
    name = f"p-{uuid.uuid4().hex[:8]}"
    async with etcd_engine(spec, 4, etcd.endpoint, name) as ranks, AsyncExitStack() as stack:
        for p in ranks:
            fill_request(p.kv_caches, spec, p.tp_rank, 4, [1, 2, 3], 9)
            p.expose("r", [1, 2, 3])
        consumers = await stack.enter_async_context(
            decode_engine(
                spec,
                2,
                engine_id="d-etcd",
                mode=mode,
                same_process="nixl" if mode == "push" else "auto",  # push: through NIXL
            )
        )
        sessions = [await c.connect(f"etcd://{etcd.endpoint}/{name}") for c in consumers]
        assert [sorted(s.links) for s in sessions] == [[0, 1], [2, 3]]
        for s in sessions:
            result = await (await s.pull("r", [5, 6, 7], [1, 2, 3]))
            assert mode == "pull" or result.path == "push"
        assert all(verify_request(c.kv_caches, spec, c.tp_rank, 2, [5, 6, 7], 9, range(3)) for c in consumers)
        with anyio.fail_after(5):
            for p in ranks:
                await p.wait_released()


async def test_sessions_keep_pulling_while_etcd_is_down(own_etcd: EtcdServer) -> None:
    """etcd stops after the handshake: pulls go on; a new connect fails typed; etcd back, it works."""
    spec = make_spec(kv_heads=2)
    name = f"p-{uuid.uuid4().hex[:8]}"
    address = f"etcd://{own_etcd.endpoint}/{name}"
    async with etcd_engine(spec, 2, own_etcd.endpoint, name) as ranks, AsyncExitStack() as stack:
        first = await stack.enter_async_context(decode_rank(spec, handshake_timeout=2))
        session = await first.connect(address)
        await anyio.to_thread.run_sync(own_etcd.stop)
        for p in ranks:
            fill_request(p.kv_caches, spec, p.tp_rank, 2, [4, 5], 3)
            p.expose("during-outage", [4, 5])
        await (await session.pull("during-outage", [8, 9], [4, 5]))
        assert verify_request(first.kv_caches, spec, 0, 1, [8, 9], 3, range(2))
        late = await stack.enter_async_context(decode_rank(spec, handshake_timeout=2))
        with pytest.raises(akv.DiscoveryError):
            await late.connect(address)
        await anyio.to_thread.run_sync(own_etcd.start)
        with anyio.fail_after(15):  # the ranks register again once etcd is back
            while True:
                try:
                    await late.connect(address)
                    break
                except akv.DiscoveryError:
                    await anyio.sleep(0.2)


@pytest.mark.slow
def test_demo_through_etcd() -> None:
    """``akv demo --etcd``: per-rank processes registered in a local etcd, decode finds them by
    name, every byte verified, every request released by read."""
    proc = subprocess.run(
        [sys.executable, "-m", "akv", "demo", "--etcd", "--prefill-tp", "4", "--decode-tp", "2",
         "--kv-heads", "4", "--layers", "2", "--head-dim", "16", "--requests", "4", "--json"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    summary = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert proc.returncode == 0, (summary, proc.stderr[-2000:])
    assert summary["verified"] == summary["released"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_killed_rank_leaves_etcd_and_its_restart_is_found(etcd: EtcdServer, anyio_backend: str) -> None:
    """Rank processes registered in etcd: a SIGKILLed rank's key goes within its TTL and only the
    pulls needing it fail; restarted on a new port, it is found again through etcd."""
    from akv.runtime.discovery import EtcdRegistry
    from akv.testing import fetch_requests, spawn_prefill, spec_argv
    from tests.conftest import stop

    spec = make_spec(kv_heads=2)
    name = f"p-{uuid.uuid4().hex[:8]}"
    common = ["--tp-size", "2", *spec_argv(spec), "--requests", "4", "--blocks-per-request", "2",
              "--hold", "--etcd", etcd.endpoint, "--etcd-ttl", "2", "--engine-id", name]  # fmt: skip
    procs = {r: spawn_prefill(*common, "--tp-rank", str(r))[0] for r in range(2)}
    address = f"etcd://{etcd.endpoint}/{name}"
    try:
        async with AsyncExitStack() as stack:
            d0, d1 = await stack.enter_async_context(
                decode_engine(spec, 2, engine_id="d-kill", transfer_timeout=5, handshake_timeout=5)
            )
            s0, s1 = await d0.connect(address), await d1.connect(address)
            reqs = await fetch_requests(address, spec, None, "d-kill")
            first, second = reqs[0], reqs[1]
            for s, c in ((s0, d0), (s1, d1)):
                await (await s.pull(first.request_id, [10, 11], first.block_ids))
                assert verify_request(c.kv_caches, spec, c.tp_rank, 2, [10, 11], first.seed, range(2))
            stop(procs.pop(1))
            killed = anyio.current_time()
            async with EtcdRegistry(etcd.endpoint) as registry:
                with anyio.fail_after(2 + 2.5):  # the TTL, plus etcd's 0.5 s expiry sweep and slack
                    while 1 in (await registry.list_engines()).get(name, {}):
                        await anyio.sleep(0.1)
            print(f"rank 1's key gone {anyio.current_time() - killed:.2f}s after SIGKILL (ttl 2 s)")
            await (await s0.pull(second.request_id, [12, 13], second.block_ids))  # needs rank 0 only
            assert verify_request(d0.kv_caches, spec, 0, 2, [12, 13], second.seed, range(2))
            with pytest.raises((akv.TransferError, akv.HandshakeError)):
                await (await s1.pull(second.request_id, [12, 13], second.block_ids))
            procs[1] = spawn_prefill(*common, "--tp-rank", "1")[0]  # a new process, a new port
            with anyio.fail_after(30):
                while True:  # the first pulls may still find the old rank gone: until re-linked
                    try:
                        await (await s1.pull(second.request_id, [14, 15], second.block_ids))
                        break
                    except (akv.TransferError, akv.HandshakeError):
                        await anyio.sleep(0.5)
            assert verify_request(d1.kv_caches, spec, 1, 2, [14, 15], second.seed, range(2))
            assert d0.metrics.counters["handshakes"] == 1  # decode rank 0 never re-linked
    finally:
        for proc in procs.values():
            stop(proc)
