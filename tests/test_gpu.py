"""Pulls on CUDA tensors (VRAM). Run with ``nox -s gpu``; skipped where CUDA is absent.

Across two processes (an ``akv prefill --device cuda`` engine, one process per rank, and
decode ranks of this process) the bytes move by NIXL READs of VRAM; within one process by
the copy path (torch on the device). Every TP pairing kind (1->2, 2->1, MLA, a hybrid preset,
mixed layouts and block sizes) must verify bit-exact and release by read on both.
"""

from __future__ import annotations

import ctypes
from contextlib import AsyncExitStack
from typing import Any

import pytest
import torch

import akv
from akv.geometry.cache import as_cache
from akv.testing import fetch_requests, json_lines, local_counts, spawn_prefill, verify_request
from tests.conftest import make_spec
from tests.transfers import PULL_PAIRS, pull_everything

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.anyio,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch"),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(("pspec", "dspec", "p", "d"), PULL_PAIRS)
async def test_vram_copy_path_in_one_process(pspec: Any, dspec: Any, p: int, d: int) -> None:
    """Prefill and decode ranks of one process on the GPU: the copy path, bit-exact, released by read."""
    results, engine = await pull_everything(pspec, dspec, p, d, "auto", device="cuda")
    assert {r.path for r in results} == {"copy"}
    assert {reason for _, reason in engine.reasons} == {"read"}
    assert set(engine.reasons.values()) == {p}


def _model_argv(spec: Any) -> list[str]:
    """``akv prefill`` flags for a spec (a --config file is not needed for these)."""
    cache = as_cache(spec)
    g = cache.groups[0]
    if isinstance(spec, akv.KVSpec):
        return [
            *(["--mla"] if spec.kind == "mla" else ["--kv-heads", str(spec.kv_heads)]),
            "--head-dim",
            str(spec.head_dim),
            "--layers",
            str(spec.layers),
            "--block-size",
            str(spec.block_size),
            "--dtype",
            spec.dtype,
            "--layout",
            spec.layout,
        ]
    raise AssertionError(f"no flags for {g}")


HM16 = make_spec(kv_heads=8, block_size=16, head_dim=64, num_blocks=64, layout="head-major")
CROSS = [
    pytest.param(
        make_spec(kv_heads=4, block_size=16, head_dim=64, num_blocks=64), 1, 2, None, "read", id="1to2"
    ),
    pytest.param(
        make_spec(kv_heads=4, block_size=16, head_dim=64, num_blocks=64), 2, 1, None, "read", id="2to1"
    ),
    pytest.param(
        make_spec(mla=True, block_size=16, head_dim=64, num_blocks=64), 2, 1, None, "read", id="mla-2to1"
    ),
    pytest.param(
        HM16,
        2,
        4,
        make_spec(kv_heads=8, block_size=32, head_dim=64, num_blocks=32),
        "read",
        id="headmajor16-to-hnd32",
    ),
    # packed push: the prefill ranks WRITE their packed copies into VRAM staging, decode scatters
    pytest.param(
        make_spec(kv_heads=4, block_size=16, head_dim=64, num_blocks=64, layout="NHD"),
        2,
        1,
        None,
        "packed-push",
        id="packed-push-nhd-2to1",
    ),
    pytest.param(
        HM16,
        2,
        4,
        make_spec(kv_heads=8, block_size=32, head_dim=64, num_blocks=32),
        "packed-push",
        id="packed-push-headmajor16-to-hnd32",
    ),
]


@pytest.mark.parametrize(("pspec", "p", "d", "dspec", "how"), CROSS)
async def test_vram_reads_across_processes(pspec: Any, p: int, d: int, dspec: Any, how: str) -> None:
    """Prefill ranks in their own processes on the GPU, decode here: NIXL READs of VRAM, or
    packed pushes (the prefill ranks WRITE their packed copies into the decode's VRAM staging
    area, a few descriptors each, and the decode scatters them), bit-exact."""
    dspec = dspec or pspec
    packed = how == "packed-push"
    proc, endpoint = spawn_prefill(
        "--tp-size", str(p), "--device", "cuda", "--requests", "3", "--blocks-per-request", "4",
        "--lease", "60", "--timeout", "120", "--blocks", str(as_cache(pspec).groups[0].num_blocks),
        *_model_argv(pspec), *(["--transfer", "packed"] if packed else []),
    )  # fmt: skip
    try:
        async with AsyncExitStack() as stack:
            consumers = [
                await stack.enter_async_context(
                    akv.Consumer(
                        akv.allocate_kv_cache(dspec, r, d, device="cuda"),
                        dspec,
                        tp_rank=r,
                        tp_size=d,
                        engine_id="gpu-decode",
                        **({"mode": "push", "transfer": "packed"} if packed else {}),
                    )
                )
                for r in range(d)
            ]
            sessions = [await c.connect(endpoint) for c in consumers]
            requests = await fetch_requests(endpoint, dspec, None, "gpu-decode")
            for n, req in enumerate(requests):
                count = local_counts(dspec, req.num_tokens)[as_cache(dspec).groups[0].name]
                local = list(range(n * 8, n * 8 + count))
                for r, (c, s) in enumerate(zip(consumers, sessions, strict=True)):
                    pr = akv.PullRequest(
                        request_id=req.request_id,
                        local_block_ids=local,
                        remote_block_ids=req.block_ids,
                        num_tokens=req.num_tokens,
                    )
                    result = await (await s.pull(pr))
                    assert result.path == ("push" if packed else "read")
                    if packed:  # the packed copies' runs: k and v per prefill rank written from
                        assert result.descriptors <= 2 * result.reads
                    assert verify_request(
                        c.kv_caches, dspec, r, d, local, req.seed, num_tokens=req.num_tokens
                    )
        out = proc.communicate(timeout=60)[0]
        summary = [m for m in json_lines(out.splitlines()) if m.get("event") == "summary"][-1]
        assert summary["released"] == summary["requests"] == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


async def test_vllm_worker_half_on_cuda_tensors() -> None:
    """The vLLM connector's worker half on CUDA tensors shaped as vLLM's CUDA backends shape
    them (tokens before heads, K then V per token): a step's exposure (after a CUDA event, no
    device synchronize) and pull are handed over without waiting for akv's threads, and the
    pull lands bit-exact (`tests/test_vllm_layout.py::worker_hand_over`)."""
    import anyio

    from tests.test_vllm_layout import worker_hand_over

    await anyio.to_thread.run_sync(worker_hand_over, "cuda", "token", "LBNHC")


@pytest.mark.parametrize("layout", ["NHD", "HND", "head-major"])
async def test_kernels_copy_runs_and_templates_bit_exact_on_the_device(layout: str) -> None:
    """The Triton kernels compiled for the GPU (not the interpreter): a table of runs of any
    alignment and length, and a pack's segments (templates on the device, bases per block),
    move exactly the bytes the host derives."""
    import numpy as np

    from akv import kernels
    from akv.geometry.layout import rank_layout
    from akv.packing import CacheViews, gather_segment, sections
    from tests.test_kernels import RUNS

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(5)
    src = torch.randint(0, 256, (300_000,), dtype=torch.uint8, device=dev, generator=gen)
    dst = torch.zeros(300_000, dtype=torch.uint8, device=dev)
    want = dst.clone()
    starts_d, starts_s, lengths = RUNS
    for d, s, n in zip(starts_d, starts_s, lengths, strict=True):
        want[d : d + n] = src[s : s + n]
    copier = kernels.RunCopier(dev)
    assert kernels.mode("cuda", "auto") == "kernel"
    copier.copy(
        dst.data_ptr() + np.array(starts_d, dtype=np.int64),
        src.data_ptr() + np.array(starts_s, dtype=np.int64),
        np.array(lengths, dtype=np.int64),
    )
    torch.cuda.synchronize()
    assert torch.equal(dst, want)

    # a pack's segments on the device against the same runs moved on the host (a CPU copy)
    spec = make_spec(kv_heads=4, layers=3, block_size=4, head_dim=8, layout=layout, num_blocks=16)
    cache = as_cache(spec)
    caches = akv.allocate_kv_cache(spec, 0, 2, device="cuda")
    for t in caches:
        t.copy_(torch.randint(-100, 100, t.shape, device=dev, generator=gen).to(t.dtype))
    host = [t.cpu() for t in caches]
    views = CacheViews(caches, rank_layout(cache, 0, 2))
    host_views = CacheViews(host, rank_layout(cache, 0, 2))
    ids = np.array([7, 2, 11], dtype=np.int32)
    secs, _ = sections(cache, 0, 2, [len(ids)])
    for sec in secs:
        out = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
        copier.copy_blocks([gather_segment(views, sec, ids, out.data_ptr())])
        ref = torch.zeros(1 << 20, dtype=torch.uint8)
        for d, s, n in zip(
            *kernels.expand(gather_segment(host_views, sec, ids, ref.data_ptr())), strict=True
        ):
            ctypes.memmove(int(d), int(s), int(n))
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), ref), sec
