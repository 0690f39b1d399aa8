"""Where a serving engine calls akv: a pseudo-engine with two scheduler loops (docs/integration.md).

Prefill (TP 2) "computes" each prompt into blocks of its allocator, exposes them, and frees them
when akv reports the engine-wide release. Decode (TP 1) runs two scheduler styles over it:

- ``StepScheduler`` (vLLM-style): each engine step launches the pulls of newly admitted
  requests, then checks ``transfer.done()`` without waiting; a request joins the running batch
  once its KV is in place, and its blocks are freed when it finishes decoding.
- ``PollScheduler`` (SGLang-style): each request owns a receiver whose ``poll()`` walks
  ``WAITING -> TRANSFERRING -> SUCCESS | FAILED``; the event loop polls every receiver per tick.

Neither awaits a transfer inside its step: a step never blocks on the network. Both check
every byte. The ranks share one process here for brevity; in a deployment each rank is its own
process (one per GPU) and the calls are the same. Run: ``python examples/engine_loop.py``.
"""

from __future__ import annotations

import enum
import sys
from collections import deque
from dataclasses import dataclass, field

import anyio
import numpy as np
import torch

import akv
from akv.testing import expected_blocks

SPEC = akv.KVSpec.create(layers=2, num_blocks=96, block_size=16, kv_heads=4, head_dim=32, dtype="float16")
PREFILL_TP, DECODE_TP, REQUESTS, DECODE_STEPS = 2, 1, 8, 3


class Allocator:
    """A block pool: a free list."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))

    def alloc(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None  # the scheduler keeps the request waiting
        got, self.free = self.free[:n], self.free[n:]
        return got

    def release(self, blocks: object) -> None:
        self.free.extend(int(b) for b in blocks)  # type: ignore[attr-defined]


@dataclass
class Request:
    """What the router hands decode: the request, its prefill blocks, and (here) its content seed."""

    request_id: str
    remote_blocks: list[int]
    seed: int
    local_blocks: list[int] = field(default_factory=list)
    steps: int = 0


def correct(cache: list[torch.Tensor], req: Request) -> bool:
    """Every byte of the request's blocks is what prefill wrote."""
    rows = np.arange(len(req.remote_blocks))
    return all(
        np.array_equal(
            t.view(torch.uint8).view(SPEC.num_blocks, -1)[req.local_blocks].numpy(),
            expected_blocks(SPEC, 0, DECODE_TP, region, req.seed, rows),
        )
        for region, t in enumerate(cache)
    )


class StepScheduler:
    """vLLM-style: one ``step()`` per engine iteration; pulls are launched and polled, never awaited."""

    def __init__(self, session: akv.TransferSession, cache: list[torch.Tensor]) -> None:
        self.session, self.cache = session, cache
        self.allocator = Allocator(SPEC.num_blocks)
        self.waiting: deque[Request] = deque()  # admitted, KV not requested yet
        self.receiving: dict[str, tuple[Request, akv.Transfer]] = {}
        self.running: list[Request] = []
        self.finished: list[str] = []
        self.failed: list[str] = []

    async def step(self) -> None:
        # 1. Launch the pulls of waiting requests that fit in the pool.
        while self.waiting:
            req = self.waiting[0]
            blocks = self.allocator.alloc(len(req.remote_blocks))
            if blocks is None:
                break
            self.waiting.popleft()
            req.local_blocks = blocks
            try:
                transfer = await self.session.pull(
                    akv.PullRequest(
                        request_id=req.request_id, local_block_ids=blocks, remote_block_ids=req.remote_blocks
                    )
                )
            except akv.AkvError as exc:  # bad ids, or a needed prefill rank cannot be reached
                self.fail(req, exc)
                continue
            self.receiving[req.request_id] = (req, transfer)
        # 2. Requests whose KV arrived join the batch; failed ones leave it.
        for rid, (req, transfer) in list(self.receiving.items()):
            if not transfer.done():
                continue
            del self.receiving[rid]
            error = transfer.exception()
            if error is not None:
                self.fail(req, error)
            elif correct(self.cache, req):
                self.running.append(req)
            else:
                self.fail(req, akv.TransferError("data mismatch"))
        # 3. The model's forward pass over the running batch (here: count steps).
        for req in list(self.running):
            req.steps += 1
            if req.steps == DECODE_STEPS:
                self.running.remove(req)
                self.allocator.release(req.local_blocks)
                self.finished.append(req.request_id)

    def fail(self, req: Request, error: akv.AkvError) -> None:
        # UnsafeReadError: prefill released the blocks first (lease) -> recompute the prompt here.
        # PeerLostError / HandshakeError: the prefill rank is gone -> re-route or recompute.
        # TransferTimeout: a hung peer -> the same. Whatever the error, the local blocks are ours again.
        print(f"step scheduler: {req.request_id} failed: {type(error).__name__}: {error}")
        self.allocator.release(req.local_blocks)
        self.failed.append(req.request_id)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.receiving or self.running)


class Poll(enum.Enum):
    WAITING = "waiting"  # no blocks yet
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


class Receiver:
    """SGLang-style: one receiver per request, polled by the event loop."""

    def __init__(self, req: Request, session: akv.TransferSession, allocator: Allocator) -> None:
        self.req, self.session, self.allocator = req, session, allocator
        self.transfer: akv.Transfer | None = None
        self.error: akv.AkvError | None = None
        self.state = Poll.WAITING

    async def poll(self) -> Poll:
        if self.state is Poll.WAITING:
            blocks = self.allocator.alloc(len(self.req.remote_blocks))
            if blocks is not None:
                self.req.local_blocks = blocks
                try:
                    self.transfer = await self.session.pull(
                        self.req.request_id, blocks, self.req.remote_blocks
                    )
                    self.state = Poll.TRANSFERRING
                except akv.AkvError as exc:
                    self.error, self.state = exc, Poll.FAILED
        elif self.state is Poll.TRANSFERRING and self.transfer is not None and self.transfer.done():
            self.error = self.transfer.exception()
            self.state = Poll.FAILED if self.error is not None else Poll.SUCCESS
        return self.state


async def run_poll_loop(session: akv.TransferSession, cache: list[torch.Tensor], reqs: list[Request]) -> int:
    allocator = Allocator(SPEC.num_blocks)
    pending = [Receiver(r, session, allocator) for r in reqs]
    ok = 0
    while pending:
        for receiver in list(pending):
            state = await receiver.poll()
            if state in (Poll.SUCCESS, Poll.FAILED):
                pending.remove(receiver)
                good = state is Poll.SUCCESS and correct(cache, receiver.req)
                ok += good
                if not good:
                    print(f"poll scheduler: {receiver.req.request_id} failed: {receiver.error}")
                allocator.release(receiver.req.local_blocks)  # after decoding, in a real engine
        await anyio.sleep(0.001)  # the rest of the event loop's tick
    return ok


async def main() -> int:
    released: list[str] = []
    prefill_alloc = Allocator(SPEC.num_blocks)

    def free(rel: akv.EngineRelease) -> None:  # once every prefill rank is done with the request
        prefill_alloc.release(rel.block_ids)
        released.append(rel.request_id)

    async with anyio.create_task_group() as tg:
        server = akv.ControlServer()
        endpoint = await tg.start(server.serve)
        releases = akv.EngineReleases(PREFILL_TP, on_release=free)
        caches = [akv.allocate_kv_cache(SPEC, r, PREFILL_TP) for r in range(PREFILL_TP)]
        producers = [
            akv.Producer(
                caches[r], SPEC, tp_rank=r, tp_size=PREFILL_TP, server=server, on_release=releases.rank(r)
            )
            for r in range(PREFILL_TP)
        ]
        decode_cache = akv.allocate_kv_cache(SPEC, 0, DECODE_TP)
        async with (
            producers[0],
            producers[1],
            akv.Consumer(decode_cache, SPEC, tp_rank=0, tp_size=DECODE_TP) as consumer,
        ):

            def prefill(name: str) -> list[Request]:
                """The prefill engine computes and exposes; the router forwards (id, blocks)."""
                out = []
                for i in range(REQUESTS):
                    blocks = prefill_alloc.alloc(1 + i % 3)
                    assert blocks is not None
                    for r, p in enumerate(producers):
                        for region, t in enumerate(caches[r]):
                            view = t.view(torch.uint8).view(SPEC.num_blocks, -1)
                            rows = np.arange(len(blocks))
                            view[blocks] = torch.from_numpy(
                                expected_blocks(SPEC, r, PREFILL_TP, region, i, rows)
                            )
                        p.expose(f"{name}-{i}", blocks)
                    out.append(Request(f"{name}-{i}", blocks, seed=i))
                return out

            session = await consumer.connect(str(endpoint))
            step = StepScheduler(session, decode_cache)
            step.waiting.extend(prefill("step"))
            while step.busy:
                await step.step()
                await anyio.sleep(0.001)
            print(f"step scheduler: {len(step.finished)}/{REQUESTS} requests pulled, verified and decoded")

            polled = await run_poll_loop(session, decode_cache, prefill("poll"))
            print(f"poll scheduler: {polled}/{REQUESTS} requests pulled and verified")
            for p in producers:
                await p.wait_released()
        tg.cancel_scope.cancel()
    print(f"prefill: {len(released)}/{2 * REQUESTS} requests released, blocks free again")
    ok = len(step.finished) == polled == REQUESTS and len(released) == 2 * REQUESTS
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))
