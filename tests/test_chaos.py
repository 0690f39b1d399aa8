"""Chaos: 1000+ requests over random TP configurations through a fault-injecting wrapper
around the real NIXL backend. Each pull completes bit-exact or fails typed; each exposed
request is released exactly once per prefill rank; nothing hangs."""

from __future__ import annotations

import random
from collections import Counter
from contextlib import AsyncExitStack

import anyio
import numpy as np
import pytest
import torch

import akv
from akv.backends import XferHandle, XferState
from akv.backends.nixl import NixlBackend
from akv.errors import PeerLostError, TransferError
from akv.testing import expected_blocks
from tests.conftest import decode_rank, make_spec, prefill_rank, verify

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FaultyBackend(NixlBackend):
    """The real backend, with dropped notifications, failing posts and polls, and delayed polls."""

    def __init__(self, name: str, rng: random.Random, faults: Counter[str]) -> None:
        super().__init__(name)
        self.rng = rng
        self.faults = faults

    def notifications(self) -> dict[str, list[bytes]]:
        got = super().notifications()
        kept = {}
        for agent, msgs in got.items():
            keep = [m for m in msgs if self.rng.random() >= 0.03]
            self.faults["dropped_notification"] += len(msgs) - len(keep)
            if keep:
                kept[agent] = keep
        return kept

    def read(self, *args: object) -> XferHandle:
        if self.rng.random() < 0.02:
            self.faults["post_error"] += 1
            raise PeerLostError("injected: posting failed")
        return super().read(*args)  # type: ignore[arg-type]

    def state(self, handle: XferHandle) -> XferState:
        r = self.rng.random()
        if r < 0.02:
            self.faults["poll_error"] += 1
            raise TransferError("injected: transfer failed")
        if r < 0.10:
            self.faults["delayed_poll"] += 1
            return "PROC"  # the poll "did not happen" this time
        return super().state(handle)


CONFIGS = [
    (p, d, h, False)
    for p in (1, 2, 3, 4)
    for d in (1, 2, 3, 4)
    for h in (1, 2, 4, 6, 12)
    if all(h % t == 0 or t % h == 0 for t in (p, d))
] + [(p, d, 1, True) for p in (1, 2, 4) for d in (1, 3)]


async def run_round(rng: random.Random, faults: Counter[str], n_requests: int, kill: bool) -> Counter[str]:
    p, d, h, mla = rng.choice(CONFIGS)
    spec = make_spec(kv_heads=h, mla=mla, num_blocks=4 * n_requests + 16)
    outcome: Counter[str] = Counter()
    releases: dict[tuple[int, str], int] = Counter()
    async with AsyncExitStack() as stack:
        tg = await stack.enter_async_context(anyio.create_task_group())
        server = akv.ControlServer()
        endpoint = await tg.start(server.serve)
        producers = []
        for r in range(p):

            def on_release(rel: akv.Release, r: int = r) -> None:
                releases[(r, rel.request_id)] += 1

            prod = prefill_rank(
                spec,
                r,
                p,
                server=server,
                lease=0.5,
                on_release=on_release,
                backend=FaultyBackend(f"chaos-p{r}-{rng.random():.9f}", rng, faults),
            )
            producers.append(await stack.enter_async_context(prod))
        consumers = [
            await stack.enter_async_context(
                decode_rank(
                    spec,
                    r,
                    d,
                    transfer_timeout=2.0,
                    retries=0,
                    backend=FaultyBackend(f"chaos-d{r}-{rng.random():.9f}", rng, faults),
                    same_process="nixl",  # the faults are injected into NIXL reads
                )
            )
            for r in range(d)
        ]
        sessions = [await c.connect(endpoint) for c in consumers]
        order = list(range(spec.num_blocks))
        rng.shuffle(order)
        requests = []
        for i in range(n_requests):
            n = rng.randint(1, 4)
            remote = order[i * 4 : i * 4 + n]  # distinct blocks for every exposed request
            rid = f"c{i}-{rng.random():.6f}"
            for prod in producers:
                for region, t in enumerate(prod.kv_caches):
                    view = t.view(torch.uint8).view(spec.num_blocks, -1)
                    view[remote] = torch.from_numpy(
                        expected_blocks(spec, prod.tp_rank, p, region, i, np.arange(n))
                    )
                prod.expose(rid, remote)
            requests.append((rid, remote, i))
        free = list(range(spec.num_blocks))

        async def pull_one(rid: str, remote: list[int], seed: int) -> None:
            hit = rng.randint(0, len(remote) - 1) if rng.random() < 0.2 else 0
            local = [free.pop() for _ in range(len(remote) - hit)]
            try:
                for s, c in zip(sessions, consumers, strict=True):
                    try:
                        with anyio.fail_after(10):  # nothing may hang
                            await (await s.pull(rid, local, remote))
                    except akv.AkvError as exc:
                        outcome[type(exc).__name__] += 1
                        continue
                    assert verify(c, local, seed, range(hit, len(remote))), f"corrupt data for {rid}"
                    outcome["ok"] += 1
            finally:
                free.extend(local)

        async with anyio.create_task_group() as pulls:
            for k, (rid, remote, seed) in enumerate(requests):
                pulls.start_soon(pull_one, rid, remote, seed)
                if k % 8 == 7:
                    await anyio.sleep(0.01)
                if kill and k == len(requests) // 2:
                    for prod in producers:  # the prefill engine's agents die mid-run
                        prod.backend.close()
                    outcome["killed"] += 1
        with anyio.fail_after(10):  # every exposure ends: read, lease or close
            for prod in producers:
                await prod.wait_released()
        for prod in producers:
            for rid, _, _ in requests:
                assert releases[(prod.tp_rank, rid)] == 1, (
                    f"rank {prod.tp_rank} released {rid} {releases[(prod.tp_rank, rid)]} times"
                )
        for c in consumers:
            assert not c.inflight
        tg.cancel_scope.cancel()
    return outcome


async def test_chaos_thousand_requests_exactly_once() -> None:
    """1000+ requests with injected faults: bit-exact or typed failure, exactly-once release."""
    rng = random.Random(20261121)
    faults: Counter[str] = Counter()
    total: Counter[str] = Counter()
    requests = 0
    rounds = 0
    while requests < 1000:
        n = 60
        total += await run_round(rng, faults, n, kill=rounds % 5 == 3)
        requests += n
        rounds += 1
    print(f"\nchaos: {requests} requests in {rounds} rounds; outcomes {dict(total)}; faults {dict(faults)}")
    assert total["ok"] > 0 and sum(v for k, v in total.items() if k not in ("ok", "killed")) > 0
    assert all(faults[k] > 0 for k in ("dropped_notification", "post_error", "poll_error", "delayed_poll"))


#: restarts of a prefill engine per transport in the chaos run (tests/test_churn.py)
CHURN_ROUNDS = 10


@pytest.mark.parametrize("ucx", ["default", "tcp"])
@pytest.mark.timeout(300)
async def test_chaos_ten_restarts_of_a_prefill_engine_served_by_one_session(
    ucx: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten SIGKILLs and restarts of a prefill engine at its address, over the default
    transports and UCX over TCP: one decode session links every new incarnation by itself and
    pulls its requests bit-exact, and never reports a request of a dead one pulled
    (tests/test_churn.py's restart test, ten rounds)."""
    from tests.test_churn import TCP, restart_rounds

    for key, value in TCP.items():
        if ucx == "tcp":
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)
    await restart_rounds(ucx, CHURN_ROUNDS)
