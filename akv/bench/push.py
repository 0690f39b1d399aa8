"""The ``layerwise`` workload of ``akv bench --mode push``: how much of a transfer is left
once prefill computed its last layer, pushed (layers streamed as they finish) against pulled
(the read starts once prefill ends).

One prefill rank and one decode rank in this process, linked through NIXL (UCX loopback);
prefill "computes" each layer with a fixed sleep. Figures, medians over the rounds:

* ``tail_ms``: from the last ``layers_ready`` call to the decode rank's completion, pushed;
* ``pull_tail_ms``: from the exposure (after the same computing) to completion, pulled;
* ``layer_ms``: the time to move one layer's bytes (a whole request pushed with every layer
  ready, divided by the layers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import numpy as np

__all__ = ["LAYERWISE_BLOCKS", "layerwise"]

#: Decode blocks per request of the layerwise workload (16 tokens, 8 KV heads of 128, bf16).
LAYERWISE_BLOCKS = 64


async def layerwise(
    layers: int, compute_ms: float, progress: Callable[[str], None], rounds: int = 8, device: str = "cpu"
) -> dict[str, Any]:
    """Run the layerwise workload (see the module) with both sides' caches on ``device`` (cpu,
    cuda or cuda:N: GPU 0 or N); returns its summary row."""
    import akv
    from akv.backends.nixl import NixlBackend
    from akv.bench.methods import cuda_count, cuda_index
    from akv.device import parse_device

    dev = parse_device(device).for_rank(0, cuda_count())

    spec = akv.KVSpec.create(
        layers=layers,
        num_blocks=4 * LAYERWISE_BLOCKS,
        block_size=16,
        kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
    )
    blocks = list(range(LAYERWISE_BLOCKS))
    tails: list[float] = []
    pull_tails: list[float] = []
    whole: list[float] = []
    nbytes = 0
    progress(f"layerwise: {rounds} rounds of {layers} layers x {compute_ms:g} ms")
    async with AsyncExitStack() as stack:
        tg = await stack.enter_async_context(anyio.create_task_group())
        server = akv.ControlServer()
        endpoint = await tg.start(server.serve)
        producer = await stack.enter_async_context(
            akv.Producer(
                akv.allocate_kv_cache(spec, 0, 1, device=dev), spec, tp_rank=0, tp_size=1, server=server
            )
        )
        sessions = {}
        for mode in ("push", "pull"):
            consumer = await stack.enter_async_context(
                akv.Consumer(
                    akv.allocate_kv_cache(spec, 0, 1, device=dev),
                    spec,
                    tp_rank=0,
                    tp_size=1,
                    mode=mode,
                    same_process="nixl",
                    backend=NixlBackend(
                        f"bench-layerwise-{mode}-{time.monotonic_ns()}", cuda_device=cuda_index(dev)
                    ),
                )
            )
            sessions[mode] = await consumer.connect(str(endpoint))
        for i in range(rounds + 1):  # round 0 warms up
            # whole: every layer ready, pushed
            rid = f"lw-whole-{i}"
            producer.expose(rid, blocks)
            t0 = time.perf_counter()
            res = await (await sessions["push"].pull(rid, blocks, blocks))
            if i:
                whole.append(time.perf_counter() - t0)
            nbytes = res.bytes
            # pushed: announced before prefill starts, layers streamed
            rid = f"lw-push-{i}"
            producer.expose(rid, blocks, layers_ready=0)
            transfer = await sessions["push"].pull(rid, blocks, blocks)
            for n in range(1, layers + 1):
                await anyio.sleep(compute_ms / 1000)
                producer.layers_ready(rid, n)
            t_last = time.perf_counter()
            await transfer
            if i:
                tails.append(time.perf_counter() - t_last)
            # pulled: prefill computes every layer, exposes, then decode reads
            rid = f"lw-pull-{i}"
            await anyio.sleep(layers * compute_ms / 1000)
            producer.expose(rid, blocks)
            t_last = time.perf_counter()
            await (await sessions["pull"].pull(rid, blocks, blocks))
            if i:
                pull_tails.append(time.perf_counter() - t_last)
        tg.cancel_scope.cancel()
    layer_ms = float(np.median(whole)) * 1e3 / layers
    tail_ms = float(np.median(tails)) * 1e3
    return {
        "name": "layerwise",
        "layout": "HND",
        "tp": "1->1",
        "device": dev,
        "layers": layers,
        "compute_ms": compute_ms,
        "bytes": nbytes,
        "tail_ms": round(tail_ms, 3),
        "pull_tail_ms": round(float(np.median(pull_tails)) * 1e3, 3),
        "layer_ms": round(layer_ms, 3),
        "tail_vs_layer": round(tail_ms / layer_ms, 3),
        "push_gbps": round(nbytes / float(np.median(whole)) / 1e9, 3),
    }
