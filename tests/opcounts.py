"""Torch operations per request on the paths that move a request's bytes on the device (the
copy path, the prefill's pack, the decode's scatter), counted with ``torch.profiler`` on CPU
tensors forced onto the code path CUDA tensors take (``copy_with="torch"``; set
``TRITON_INTERPRET=1`` so that path's Triton kernel runs under Triton's interpreter).

Counted: every ``aten::`` operation, plus one per launch of akv's copy kernel (the
``akv::copy_runs`` range); the operations Triton's interpreter itself runs inside that range
emulate the device and are not counted (on a GPU the range is one kernel launch).

Run as a script for the figures of docs/performance.md::

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python -m tests.opcounts
"""

from __future__ import annotations

import inspect
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
from torch.profiler import ProfilerActivity, profile

import akv
from akv.kernels import KERNEL_RANGE
from akv.testing import fill_request
from tests.conftest import make_spec, prefill_engine

#: Operations that wait for the device (or copy device to host) before the host goes on.
HOST_SYNCS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::cpu")


def _accepts(cls: Any, name: str) -> bool:
    return name in inspect.signature(cls).parameters


@contextmanager
def counting() -> Iterator[Counter[str]]:
    """Count the torch operations run inside the block (see the module)."""
    ops: Counter[str] = Counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield ops
    for event in prof.events():
        parent, inside = event.cpu_parent, False
        while parent is not None:
            if parent.name == KERNEL_RANGE:
                inside = True
                break
            parent = parent.cpu_parent
        if inside:
            continue
        if event.name == KERNEL_RANGE or event.name.startswith("aten::"):
            ops[event.name] += 1


def spec(layers: int, blocks: int) -> akv.KVSpec:
    """A per-layer HND cache of 4 KV heads with room for a request of ``blocks`` blocks."""
    return make_spec(kv_heads=4, layers=layers, num_blocks=2 * blocks + 8, block_size=4, head_dim=8)


def _request(s: akv.KVSpec, blocks: int, n: int) -> tuple[list[int], list[int]]:
    """Fragmented remote blocks (every other one) and local blocks of request ``n``."""
    remote = list(range(n % 2, 2 * blocks, 2))
    local = list(range(2 * blocks - 1 - n % 2, -1, -2))
    return remote, local


async def _copy_or_scatter(
    layers: int, blocks: int, copy_with: str, packed: bool, push: bool = False
) -> Counter[str]:
    s = spec(layers, blocks)
    prefill_kw: dict[str, Any] = {"transfer": "packed"} if packed else {}
    async with prefill_engine(s, 2, **prefill_kw) as engine:
        consumer = akv.Consumer(
            akv.allocate_kv_cache(s, 0, 1),
            s,
            tp_rank=0,
            tp_size=1,
            same_process="nixl" if packed else "auto",
            copy_with=copy_with,
            transfer="packed" if packed else "direct",
            **({"mode": "push"} if push else {}),
        )
        async with consumer:
            session = await consumer.connect(engine.endpoint)
            counts: Counter[str] = Counter()
            for n in range(2):  # the first pull builds what a session keeps; the second is counted
                remote, local = _request(s, blocks, n)
                for p in engine.producers:
                    fill_request(p.kv_caches, s, p.tp_rank, p.tp_size, remote, seed=n)
                    p.expose(f"r{n}", remote)
                req = akv.PullRequest(
                    request_id=f"r{n}", local_block_ids=local, remote_block_ids=remote, num_tokens=blocks * 4
                )
                with counting() as ops:
                    transfer = await session.pull(req)
                    result = await transfer
                if result.path != ("push" if push else "packed" if packed else "copy"):
                    raise AssertionError(f"the pull took the {result.path} path")
                counts = ops
    return counts


def copy_ops(layers: int, blocks: int, copy_with: str = "torch") -> Counter[str]:
    """Operations of one same-process pull from 2 prefill ranks (head-sliced, fragmented)."""
    return anyio.run(_copy_or_scatter, layers, blocks, copy_with, False)


def scatter_ops(layers: int, blocks: int, copy_with: str = "torch") -> Counter[str]:
    """Operations of one packed pull (through NIXL) from 2 prefill ranks, the scatter included."""
    return anyio.run(_copy_or_scatter, layers, blocks, copy_with, True)


def packed_push_ops(layers: int, blocks: int, copy_with: str = "torch") -> Counter[str]:
    """Operations of one packed push from 2 prefill ranks (they WRITE their packed copies into
    the staging area), the decode's scatter included."""
    return anyio.run(_copy_or_scatter, layers, blocks, copy_with, True, True)


async def _pack(layers: int, blocks: int, copy_with: str) -> Counter[str]:
    s = spec(layers, blocks)
    kw: dict[str, Any] = {"copy_with": copy_with} if _accepts(akv.Producer, "copy_with") else {}
    async with prefill_engine(s, 2, transfer="packed", **kw) as engine:
        p = engine.producers[0]
        counts: Counter[str] = Counter()
        for n in range(2):
            remote, _ = _request(s, blocks, n)
            with counting() as ops:
                p.expose(f"r{n}", remote)
            counts = ops
            if p.metrics.counters.get("packed", 0) != n + 1:
                raise AssertionError("the request was not packed")
    return counts


def pack_ops(layers: int, blocks: int, copy_with: str = "torch") -> Counter[str]:
    """Operations of one ``expose()`` of a packed request on prefill rank 0 of 2."""
    return anyio.run(_pack, layers, blocks, copy_with)


PATHS: dict[str, Callable[[int, int, str], Counter[str]]] = {
    "copy": copy_ops,
    "pack": pack_ops,
    "scatter": scatter_ops,
    "packed_push": packed_push_ops,
}


def runs_cost(layout: str) -> tuple[int, int, float, int, float]:
    """The host's share of packing one request of 128 fragmented blocks of 16 tokens, 32
    layers, 8 KV heads of 128 bf16 on rank 0 of 2, best of 5: ``(bytes, runs, ms deriving the
    runs one by one (`akv.packing.gather_runs`, neighbours merged), entries, ms of the
    segments the kernel takes instead (`akv.packing.gather_segment`, `RunCopier.copy_blocks`
    up to its upload))``."""
    import time

    import numpy as np
    import torch

    from akv.geometry.cache import as_cache
    from akv.geometry.layout import rank_layout
    from akv.kernels import RunCopier, merge_runs
    from akv.packing import CacheViews, gather_runs, gather_segment, sections

    s = akv.KVSpec.create(
        layers=32, num_blocks=256, block_size=16, kv_heads=8, head_dim=128, dtype="bfloat16", layout=layout
    )
    cache = as_cache(s)
    views = CacheViews(akv.allocate_kv_cache(s, 0, 2), rank_layout(cache, 0, 2))
    ids = np.arange(0, 256, 2, dtype=np.int32)
    secs, size = sections(cache, 0, 2, [len(ids)])
    copier = RunCopier(torch.device("cpu"))
    old = new = float("inf")
    runs = entries = 0
    for _ in range(5):
        started = time.perf_counter()
        parts = [gather_runs(views, sec, ids, 1 << 40) for sec in secs]
        dst, src, length = (np.concatenate(p) for p in zip(*parts, strict=True))
        runs = len(merge_runs(dst, src, length)[2])
        old = min(old, time.perf_counter() - started)
    for _ in range(50):
        started = time.perf_counter()
        segments = [gather_segment(views, sec, ids, 1 << 40) for sec in secs]
        copier.copy_blocks(segments, launch=False)
        new = min(new, time.perf_counter() - started)
        entries = sum(len(seg[1]) for seg in segments)
    return size, runs, 1e3 * old, entries, 1e3 * new


async def _copy_host(layers: int, blocks: int, pulls: int) -> float:
    s = akv.KVSpec.create(
        layers=layers, num_blocks=2 * blocks + 8, block_size=16, kv_heads=8, head_dim=128, dtype="bfloat16"
    )
    async with prefill_engine(s, 2) as engine:
        consumer = akv.Consumer(akv.allocate_kv_cache(s, 0, 1), s, tp_rank=0, tp_size=1, copy_with="torch")
        async with consumer:
            session = await consumer.connect(engine.endpoint)
            best = float("inf")
            for n in range(pulls + 1):  # the first pull builds what a session keeps
                remote, local = _request(s, blocks, n)
                for p in engine.producers:
                    p.expose(f"r{n}", remote)
                req = akv.PullRequest(request_id=f"r{n}", local_block_ids=local, remote_block_ids=remote)
                started = time.perf_counter()
                result = await (await session.pull(req))
                if n:
                    best = min(best, time.perf_counter() - started)
                if result.path != "copy":
                    raise AssertionError(f"the pull took the {result.path} path")
    return 1e3 * best


def copy_host_ms(layers: int = 32, blocks: int = 128, pulls: int = 20) -> float:
    """The host's share of one same-process pull on the kernel's path (what a CUDA pull costs
    besides the kernel itself), best of ``pulls``: 2 prefill ranks to 1 decode rank, per-layer
    HND, 8 KV heads of 128 bf16, blocks of 16 tokens, fragmented; the kernel launch made a
    no-op (nothing is copied: only the host's work is timed)."""
    import os

    from akv import kernels

    class _NoLaunch:
        def __getitem__(self, grid: Any) -> Callable[..., None]:
            return lambda *args, **kwargs: None

    saved = kernels._kernel, kernels._block_kernel, os.environ.get("TRITON_INTERPRET")
    kernels._kernel = kernels._block_kernel = lambda interpret: _NoLaunch()  # type: ignore[assignment]
    os.environ["TRITON_INTERPRET"] = "1"  # the kernel's path on CPU tensors
    try:
        return anyio.run(_copy_host, layers, blocks, pulls)
    finally:
        kernels._kernel, kernels._block_kernel = saved[0], saved[1]
        if saved[2] is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved[2]


def main() -> None:
    """Print the counts of every path for 4 / 16 / 32 layers and 16 / 128 blocks."""
    for name, fn in PATHS.items():
        for blocks in (16, 128):
            row = []
            for layers in (4, 16, 32):
                ops = fn(layers, blocks, "torch")
                row.append(f"{sum(ops.values())}")
            print(f"{name:8s} blocks={blocks:4d} layers 4/16/32: {' / '.join(row)}", flush=True)
    print("host syncs:", {n: sum(fn(4, 16, "torch")[s] for s in HOST_SYNCS) for n, fn in PATHS.items()})
    for layout in ("HND", "NHD"):
        size, runs, ms, entries, new_ms = runs_cost(layout)
        print(
            f"pack on the host, {layout}, {size} bytes: run by run {runs} runs, {ms:.2f} ms; "
            f"templates {entries} entries, {new_ms:.3f} ms"
        )
    for layers, blocks in ((8, 16), (32, 16), (32, 128)):
        print(
            f"copy path on the host, {layers} layers, {blocks} blocks: {copy_host_ms(layers, blocks):.3f} ms per pull"
        )


if __name__ == "__main__":
    sys.exit(main())
