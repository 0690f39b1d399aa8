"""End-to-end pulls on CUDA tensors (VRAM). Run with ``nox -s gpu``; skipped without CUDA."""

from __future__ import annotations

from contextlib import AsyncExitStack

import anyio
import numpy as np
import pytest
import torch

import akv
from akv.testing import expected_blocks
from tests.conftest import make_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.anyio,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch"),
]


def region_bytes(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    return t.view(torch.uint8).view(num_blocks, -1)


@pytest.mark.parametrize(
    ("p", "d", "h", "mla"), [(1, 1, 4, False), (2, 4, 4, False), (4, 2, 8, False), (2, 1, 1, True)]
)
async def test_vram_pull_bit_exact(p: int, d: int, h: int, mla: bool) -> None:
    """Prefill and decode caches in VRAM: every TP relation verifies bit-exact and releases by read."""
    spec = make_spec(kv_heads=h, mla=mla, num_blocks=64, block_size=16, head_dim=64)
    released: list[akv.Release] = []
    async with anyio.create_task_group() as tg, AsyncExitStack() as stack:
        server = akv.ControlServer()
        endpoint = await tg.start(server.serve)
        for r in range(p):
            kv = akv.allocate_kv_cache(spec, r, p, device="cuda")
            for region, t in enumerate(kv):
                region_bytes(t, spec.num_blocks)[:8] = torch.from_numpy(
                    expected_blocks(spec, r, p, region, 5, np.arange(8))
                ).cuda()
            prod = await stack.enter_async_context(
                akv.Producer(kv, spec, tp_rank=r, tp_size=p, server=server, on_release=released.append)
            )
            prod.expose("g", list(range(8)))
        for r in range(d):
            kv = akv.allocate_kv_cache(spec, r, d, device="cuda")
            consumer = await stack.enter_async_context(akv.Consumer(kv, spec, tp_rank=r, tp_size=d))
            session = await consumer.connect(endpoint)
            await (await session.pull("g", list(range(20, 28)), list(range(8))))
            for region, t in enumerate(kv):
                got = region_bytes(t, spec.num_blocks)[20:28].cpu().numpy()
                np.testing.assert_array_equal(got, expected_blocks(spec, r, d, region, 5, np.arange(8)))
        with anyio.fail_after(5):
            while len(released) < p:
                await anyio.sleep(0.01)
        assert {rel.reason for rel in released} == {"read"}
        tg.cancel_scope.cancel()
