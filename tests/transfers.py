"""Pulls between in-process engines, shared by the transfer-path tests (test_paths, test_gpu,
test_packed, test_push, test_session, test_write_after_return) and the per-rank engine tests
(test_engines, test_deployment): the cache pairings they run, a pull of every request on every
decode rank checked bit-exact, and a backend whose reads NIXL reports running for a while."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
import torch

import akv
from akv.backends import XferHandle, XferState
from akv.backends.nixl import NixlBackend
from akv.errors import PeerLostError
from akv.testing import make_requests, verify_request
from tests.conftest import Engine, local_ids, make_spec, prefill_engine, wait_for

#: (prefill cache, decode cache, prefill TP, decode TP) by test id: every pairing kind of
#: ranks, MLA, hybrid groups, sliding windows, mixed layouts and block sizes.
PAIRINGS: dict[str, tuple[Any, Any, int, int]] = {
    "dense-1to2": (make_spec(kv_heads=4), make_spec(kv_heads=4), 1, 2),
    "dense-2to1": (make_spec(kv_heads=4), make_spec(kv_heads=4), 2, 1),
    "gqa-replicas-4to2": (make_spec(kv_heads=2), make_spec(kv_heads=2), 4, 2),
    "gqa-4to6": (make_spec(kv_heads=2), make_spec(kv_heads=2), 4, 6),
    "dense-4to6": (make_spec(kv_heads=12), make_spec(kv_heads=12), 4, 6),
    "mla-2to3": (make_spec(mla=True), make_spec(mla=True), 2, 3),
    "headmajor8-to-nhd4": (
        make_spec(kv_heads=4, layout="head-major", block_size=8),
        make_spec(kv_heads=4, layout="NHD", block_size=4),
        2,
        1,
    ),
    "headmajor-runs-span-layers": (
        make_spec(kv_heads=4, layout="head-major"),
        make_spec(kv_heads=4, layout="head-major"),
        2,
        1,
    ),
    "qwen3-next-hybrid": (
        akv.preset("qwen3-next-80b", layers=4, blocks=32, dtype="float32", layout="head-major"),
        akv.preset("qwen3-next-80b", layers=4, blocks=32, dtype="float32", block_size=32),
        2,
        1,
    ),
    "gemma3-sliding": (
        akv.preset("gemma-3-27b", layers=3, blocks=32, dtype="float16"),
        akv.preset("gemma-3-27b", layers=3, blocks=32, dtype="float16", layout="cross-layer"),
        1,
        2,
    ),
}


def pairs(*ids: str) -> list[Any]:
    """The `PAIRINGS` named, in order, as parameters ``(pspec, dspec, p, d)`` with their ids."""
    return [pytest.param(*PAIRINGS[i], id=i) for i in ids]


#: The pairings the pull paths (copy, NIXL read, packed) are checked on.
PULL_PAIRS = pairs(
    "dense-1to2",
    "dense-2to1",
    "gqa-replicas-4to2",
    "dense-4to6",
    "mla-2to3",
    "headmajor8-to-nhd4",
    "qwen3-next-hybrid",
    "gemma3-sliding",
)

#: (prefill TP, decode TP, KV heads) of engines whose every rank serves its own endpoint; with
#: `MLA_TP_PAIRS` ((prefill TP, decode TP) on an MLA cache), every way their ranks pair up.
TP_PAIRS = [(4, 2, 8), (2, 4, 8), (4, 6, 12), (8, 2, 2), (3, 6, 6)]
MLA_TP_PAIRS = [(4, 2), (2, 3)]


def pull_request(req: Any, local: Any) -> akv.PullRequest:
    """The pull of announced request ``req`` (`akv.testing.make_requests`) into blocks ``local``."""
    return akv.PullRequest(
        request_id=req.request_id,
        local_block_ids=local,
        remote_block_ids=req.block_ids,
        num_tokens=req.num_tokens,
    )


async def pull_every_request(
    pspec: Any,
    dspec: Any,
    p: int,
    d: int,
    decode: Callable[[int], akv.Consumer],
    *,
    requests: int,
    seed: int,
    **prefill_kw: Any,
) -> tuple[list[akv.TransferResult], Engine]:
    """Expose ``requests`` requests of 3 blocks (``make_requests(pspec, requests, 3, seed)``) on
    a ``p``-rank `prefill_engine` (options ``prefill_kw``); on each of ``d`` decode ranks
    ``decode(rank)`` pull each of them (every other one after a one-block prefix hit) and assert
    it landed bit-exact; wait until every prefill rank released every request.

    Returns the results (decode rank by decode rank, request by request) and the engine."""
    reqs = make_requests(pspec, requests, 3, seed=seed)
    results = []
    async with prefill_engine(pspec, p, **prefill_kw) as engine, AsyncExitStack() as stack:
        engine.expose_requests(reqs)
        for r in range(d):
            consumer = await stack.enter_async_context(decode(r))
            session = await consumer.connect(engine.endpoint)
            for n, req in enumerate(reqs):
                local = local_ids(dspec, n, req.num_tokens, hit=n % 2)
                results.append(await (await session.pull(pull_request(req, local))))
                assert verify_request(
                    consumer.kv_caches, dspec, r, d, local, req.seed, num_tokens=req.num_tokens
                ), (req.request_id, r)
        await wait_for(lambda: sum(engine.reasons.values()) >= p * requests, timeout=10)
    return results, engine


async def pull_everything(
    pspec: Any,
    dspec: Any,
    p: int,
    d: int,
    same_process: str,
    requests: int = 3,
    inline: int = 128 << 20,
    device: str = "cpu",
    copy_with: str = "auto",
    views: bool = False,
) -> tuple[list[akv.TransferResult], Engine]:
    """`pull_every_request` (3 requests by default) from a ``p``-rank engine to ``d`` decode
    ranks reaching it with ``same_process`` (copies of ``copy_with``, inline up to ``inline``
    bytes), both on ``device``; ``views``: decode regions that start inside their storage."""
    regions = as_views if views else akv.allocate_kv_cache
    return await pull_every_request(
        pspec,
        dspec,
        p,
        d,
        lambda r: akv.Consumer(
            regions(dspec, r, d, device=device),
            dspec,
            tp_rank=r,
            tp_size=d,
            same_process=same_process,
            copy_inline_bytes=inline,
            copy_with=copy_with,
        ),
        requests=requests,
        seed=7,
        device=device,
    )


def as_views(spec: Any, rank: int, size: int, device: str = "cpu") -> list[torch.Tensor]:
    """The rank's regions as views into one buffer, each starting 2 bytes past an 8-byte
    boundary (an engine's own tensors need not start where their storage does)."""
    shapes = [(t.shape, t.dtype) for t in akv.allocate_kv_cache(spec, rank, size)]
    sizes = [int(torch.empty(s, dtype=d).nbytes) for s, d in shapes]
    buffer = torch.zeros(sum(sizes) + 2 * len(sizes) + 2, dtype=torch.uint8, device=device)
    out, at = [], 2
    for (shape, dtype), n in zip(shapes, sizes, strict=True):
        out.append(buffer[at : at + n].view(dtype).view(shape))
        at += n + 2
    return out


class HeldBackend(NixlBackend):
    """The real agent, reporting every transfer running until ``hold_until`` (a read NIXL
    cannot confirm finished), and failing the ``fail_post``-th post (counting from 1; 0: none)."""

    hold_until = 0.0
    fail_post = 0
    posts = 0

    def state(self, handle: XferHandle) -> XferState:
        if time.monotonic() < self.hold_until:
            return "PROC"
        return super().state(handle)

    def read(self, *args: Any, **kwargs: Any) -> XferHandle:
        self.posts += 1
        if self.posts == self.fail_post:
            raise PeerLostError("injected: posting failed")
        return super().read(*args, **kwargs)
