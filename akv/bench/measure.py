"""The measuring loops of ``akv bench``: one workload against a real ``akv prefill`` process,
every method interleaved in a Williams design (`bench_workload`), and the same-process
workload, prefill ranks and a decode rank in this process (`same_process`).

Each workload's measured batches run with the garbage collector's heap frozen (`frozen_heap`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from typing import Any

import anyio
import numpy as np

from akv.bench.methods import Methods, cuda_count
from akv.bench.workloads import SAME_PROCESS, Figures, Workload, ids_json, pick_requests, specs
from akv.protocol.messages import RequestInfo
from akv.testing import save_requests, stop_prefill

__all__ = ["PACK_POOL_MIB", "bench_workload", "same_process"]

_WILLIAMS = ((0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1))


def _start_prefill(
    w: Workload, spec: Any, requests_file: str, device: str, transfer: str = "direct", pool_mib: int = 1
) -> tuple[subprocess.Popen[str], str]:
    from akv.geometry.spec import KVSpec
    from akv.testing import spawn_prefill, spec_argv

    if isinstance(spec, KVSpec):
        model = spec_argv(spec)  # --layout and --block-size included
    else:  # a hybrid cache: described by a --config file next to the requests
        path = requests_file + ".cache.json"
        with open(path, "wb") as f:
            f.write(spec.to_json())
        model = ["--config", path]

    return spawn_prefill(
        "--requests-file",
        requests_file,
        "--tp-size",
        str(w.prefill_tp),
        "--requests",
        "1",
        "--blocks-per-request",
        "1",
        "--hold",
        "--no-fill",
        "--lease",
        "3600",
        "--timeout",
        "900",
        "--device",
        device,
        "--transfer",
        "direct" if transfer == "direct" else "packed",
        "--pack-pool-mib",
        str(pool_mib),
        *model,
    )


#: Largest staging pool of a bench prefill rank, in MiB.
PACK_POOL_MIB = 1024


def _pack_mib(w: Workload, prefill: Any, remotes: list[Any]) -> int:
    """MiB of staging pool a prefill rank needs to keep a packed copy of every exposure."""
    from akv.geometry.cache import as_cache
    from akv.packing import ALIGN, sections

    cache = as_cache(prefill)
    total = 0
    for remote in remotes:
        ids = cache.per_group(ids_json(remote), "bench")
        total += max(sections(cache, r, w.prefill_tp, [len(i) for i in ids])[1] for r in range(w.prefill_tp))
        total += ALIGN
    # the warm-up copy and the measured one of each (the lead-in's: ``remotes`` lists those
    # requests twice), up to PACK_POOL_MIB (requests beyond it are read directly: the JSON's
    # ``paths`` says how many)
    return min(2 * total // (1 << 20) + 1, PACK_POOL_MIB)


def _pack_cost(w: Workload, prefill: Any, reqs: list[tuple[str, Any, Any]], device: str) -> float:
    """Mean milliseconds prefill rank 0 spends packing one request (the gather at ``expose``;
    on CUDA until the gather is done on the device)."""
    import akv
    from akv.device import parse_device
    from akv.geometry.cache import as_cache
    from akv.runtime.packer import Packer

    cache = as_cache(prefill)
    dev = parse_device(device).for_rank(0, cuda_count())
    kv = akv.allocate_kv_cache(prefill, 0, w.prefill_tp, device=dev)
    packer = Packer(
        kv, cache, 0, w.prefill_tp, _pack_mib(w, prefill, [r for _, _, r in reqs[:8]]) << 20, 64, False
    )
    spent = []
    for i, (rid, _, remote) in enumerate(reqs[:8]):
        ids = cache.per_group(ids_json(remote), rid)
        started = time.perf_counter()
        packer.pack(rid, ids, i + 1)
        if kv[0].is_cuda:  # the gather is queued: count until it is done on the device
            import torch

            torch.cuda.synchronize(kv[0].device)
        spent.append(time.perf_counter() - started)
        packer.settle()  # publish it (on CUDA once its event fired), so that drop frees the slot now
        packer.drop(rid)
    return 1e3 * float(np.mean(spent[1:] if len(spent) > 1 else spent))


async def bench_workload(
    w: Workload,
    layers: int,
    progress: Callable[[str], None],
    device: str = "cpu",
    mode: str = "pull",
    transfer: str = "direct",
    nixl_threads: int = 0,
) -> Figures:
    """Start the workload's prefill engine and measure every method against it (the decode
    ranks' NIXL agents with ``nixl_threads`` worker threads)."""
    prefill_spec, spec = specs(w, layers)
    rng = np.random.default_rng(7)
    reqs = pick_requests(w, prefill_spec, spec, rng)
    with tempfile.TemporaryDirectory() as tmp:
        # The prefill exposes exactly what akv pulls (checked pulls of unexposed requests fail):
        # each request once for the warm-up and once for the measured pull, and the first
        # batch's once more for the lead-in (see `_measure`).
        push = mode == "push"
        exposed = [
            RequestInfo(request_id=f"{rid}{suffix}", block_ids=ids_json(remote))
            for rid, _, remote in reqs
            for suffix in ("", "-warm", *(("-p", "-warm-p") if push else ()))
        ] + [
            RequestInfo(request_id=f"{rid}{suffix}", block_ids=ids_json(remote))
            for rid, _, remote in reqs[: w.concurrency]
            for suffix in ("-lead", *(("-lead-p",) if push else ()))
        ]
        save_requests(f"{tmp}/requests.json", exposed)
        # The file stays until the prefill is gone: it reads it again for its summary.
        remotes = [remote for _, _, remote in reqs + reqs[: w.concurrency]]
        pool = _pack_mib(w, prefill_spec, remotes) if transfer != "direct" else 1
        proc, endpoint = _start_prefill(w, prefill_spec, f"{tmp}/requests.json", device, transfer, pool)
        try:
            fig = await _measure(
                w, prefill_spec, spec, reqs, endpoint, progress, device, mode, transfer, nixl_threads
            )
            if transfer != "direct":
                fig.pack_ms = _pack_cost(w, prefill_spec, reqs, device)
            return fig
        finally:
            stop_prefill(proc)  # reads its summary, which can outgrow the pipe


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Run the measured batches with every object that exists now frozen (``gc.freeze``), as
    vLLM freezes its heap once started: a collection then scans what the batches allocate, not
    the bench process's own heap. Without it, collections of a heap grown over several
    workloads (up to 166 ms each) fell on whichever pull was running and, since akv allocates
    more per pull than the hand-written loop, mostly on akv's (docs/performance.md, "Garbage
    collection in the bench"). Unfrozen afterwards: the workload's objects may go then."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _measure(
    w: Workload,
    prefill_spec: Any,
    spec: Any,
    reqs: list[tuple[str, Any, Any]],
    endpoint: str,
    progress: Callable[[str], None],
    device: str = "cpu",
    mode: str = "pull",
    transfer: str = "direct",
    nixl_threads: int = 0,
) -> Figures:
    """Every method on the workload's requests, read from the prefill at ``endpoint`` (``mode``
    "push": and akv in push mode, the prefill writing)."""
    import akv
    from akv.backends.nixl import NixlBackend
    from akv.device import parse_device

    fig = Figures(w.name, w, transfer=transfer)
    async with AsyncExitStack() as stack:
        consumers: list[Any] = []
        unchecked: list[Any] = []
        for d in range(w.decode_tp):
            for verify_exposure, group in ((True, consumers), (False, unchecked)):
                tag = "" if verify_exposure else "u"
                dev = parse_device(device).for_rank(d, cuda_count())
                c = akv.Consumer(
                    akv.allocate_kv_cache(spec, d, w.decode_tp, device=dev),
                    spec,
                    tp_rank=d,
                    tp_size=w.decode_tp,
                    verify_exposure=verify_exposure,
                    transfer=transfer,
                    pack_staging_bytes=256 << 20,
                    backend=NixlBackend(
                        f"bench-d{d}{tag}-{os.getpid()}-{w.name}",
                        telemetry=True,
                        cuda_device=int(dev.split(":")[1]) if dev.startswith("cuda") else None,
                        num_threads=nixl_threads,
                    ),
                )
                group.append(await stack.enter_async_context(c))
        pushing: list[Any] = []
        for d in range(w.decode_tp if mode == "push" else 0):
            dev = parse_device(device).for_rank(d, cuda_count())
            c = akv.Consumer(
                akv.allocate_kv_cache(spec, d, w.decode_tp, device=dev),
                spec,
                tp_rank=d,
                tp_size=w.decode_tp,
                mode="push",
                transfer=transfer,  # --transfer packed: packed pushes
                pack_staging_bytes=256 << 20,
                backend=NixlBackend(
                    f"bench-d{d}p-{os.getpid()}-{w.name}",
                    cuda_device=int(dev.split(":")[1]) if dev.startswith("cuda") else None,
                    num_threads=nixl_threads,
                ),
            )
            pushing.append(await stack.enter_async_context(c))
        sessions = [await c.connect(endpoint) for c in consumers]
        unchecked_sessions = [await c.connect(endpoint) for c in unchecked]
        batches = [reqs[i : i + w.concurrency] for i in range(0, len(reqs), w.concurrency)]

        methods = Methods(sessions, consumers, spec, prefill_spec, reqs[0], fig, device)
        methods.unchecked = unchecked_sessions
        methods.pushing = [await c.connect(endpoint) for c in pushing]
        order = ["akv", "nixl", "perblock", "memcpy"]
        extra = ["akv_unchecked", *(["nixl_write"] if device != "cpu" else [])]
        if pushing:
            extra.append("akv_push")
        totals: dict[str, list[float]] = {m: [0.0, 0.0] for m in [*order, *extra]}
        progress(f"{w.name}: warming up")
        warm = [(f"{rid}-warm", local, remote) for rid, local, remote in batches[0]]
        for m in [*order, *extra]:
            await methods.run(m, warm, record=False)
        await anyio.sleep(0.05)  # the warm-up's background reads go out before counting starts
        stack.enter_context(frozen_heap())  # until the workload's end
        counted = {"akv": consumers, "push": pushing}
        before = {k: [dict(c.metrics.snapshot().counters) for c in cs] for k, cs in counted.items()}
        # A lead-in, unrecorded but counted: after the pause the caches are cold and the prefill's
        # poller sleeps, which would fall on whichever method the first batch runs first (akv:
        # its first pull took 2.7 ms where the others took 0.4 on the latency workload).
        lead = [(f"{rid}-lead", local, remote) for rid, local, remote in batches[0]]
        for m in [*order, *extra]:
            await methods.run(m, lead, record=False)
        progress(f"{w.name}: {len(batches)} batches x {len(order) + 1} methods, interleaved")
        for i, batch in enumerate(batches):
            # A Williams design: over 4 batches each method runs in each position once and
            # follows each other method once, so cache and CPU after-effects cancel out.
            # akv without the exposure check runs next to akv, in alternating order.
            for m in (order[k] for k in _WILLIAMS[i % 4]):
                pair = ["akv", "akv_unchecked"] if i % 2 else ["akv_unchecked", "akv"]
                if pushing:  # push beside pull, in alternating order too
                    pair = [*pair, "akv_push"] if i % 2 else ["akv_push", *pair]
                raw = [m, "nixl_write"] if m == "nixl" and "nixl_write" in extra else [m]
                for method in pair if m == "akv" else raw:
                    nbytes, seconds = await methods.run(method, batch, record=True)
                    totals[method][0] += nbytes
                    totals[method][1] += seconds
        await anyio.sleep(0.05)  # the last pulls' background reads, posted after they returned
        for k, cs in counted.items():
            after = [dict(c.metrics.snapshot().counters) for c in cs]
            spent_ops = _control_ops(before[k], after, len(reqs) + len(lead))
            if k == "akv":
                fig.data_xfers = spent_ops.pop("data_xfers")
                fig.control_ops = spent_ops
            elif cs:
                spent_ops.pop("data_xfers")
                fig.push_control_ops = spent_ops
        for m, (moved, spent) in totals.items():
            fig.gbps[m] = moved / spent / 1e9
        fig.bytes = int(totals["akv"][0]) // len(reqs)
        fig.descriptors_submitted /= len(reqs)
        fig.nixl_submitted /= len(reqs)
        fig.descriptors /= len(reqs)
        fig.perblock_descriptors /= len(reqs)
    return fig


def _control_ops(
    before: list[dict[str, int]], after: list[dict[str, int]], requests: int
) -> dict[str, float]:
    """Mean count per pull (one decode rank's pull of one request) of each control operation
    (`akv.metrics.CONTROL_OPS`) between two snapshots of the decode ranks' counters, and of the
    data transfers (``data_xfers``)."""
    from akv.metrics import CONTROL_OPS

    pulls = max(requests * len(after), 1)

    def spent(counter: str) -> float:
        return sum(a.get(counter, 0) - b.get(counter, 0) for b, a in zip(before, after, strict=True)) / pulls

    return {
        **{kind: spent(counter) for kind, counter in CONTROL_OPS.items()},
        "data_xfers": spent("xfers_data"),
    }


async def same_process(layers: int, device: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Prefill ranks and a decode rank in this process: akv's copy path against raw NIXL between
    two agents of this process on the same descriptors (and akv's NIXL read path beside it)."""
    import akv
    from akv.backends.nixl import NixlBackend
    from akv.device import parse_device
    from akv.runtime.control import ControlServer

    w = SAME_PROCESS
    prefill_spec, spec = specs(w, layers)
    reqs = pick_requests(w, prefill_spec, spec, np.random.default_rng(11))
    dev = parse_device(device)
    fig = Figures(w.name, w)
    progress("same_process: copy path and in-process NIXL")
    async with AsyncExitStack() as stack:
        tg = await stack.enter_async_context(anyio.create_task_group())
        server = ControlServer()
        endpoint = await tg.start(server.serve)
        producers = []
        for r in range(w.prefill_tp):
            prod = await stack.enter_async_context(
                akv.Producer(
                    akv.allocate_kv_cache(
                        prefill_spec, r, w.prefill_tp, device=dev.for_rank(r, cuda_count())
                    ),
                    prefill_spec,
                    tp_rank=r,
                    tp_size=w.prefill_tp,
                    server=server,
                    lease=3600,
                )
            )
            producers.append(prod)
            for rid, _, remote in reqs:
                for suffix in ("", "-warm", "-u", "-warm-u"):
                    prod.expose(f"{rid}{suffix}", remote)
        sides = {}
        for mode in ("auto", "nixl"):
            c = await stack.enter_async_context(
                akv.Consumer(
                    akv.allocate_kv_cache(spec, 0, 1, device=dev.for_rank(0, cuda_count())),
                    spec,
                    tp_rank=0,
                    tp_size=1,
                    same_process=mode,
                    backend=NixlBackend(
                        f"bench-same-{mode}-{os.getpid()}",
                        telemetry=True,
                        cuda_device=(dev.index or 0) if dev.cuda else None,
                    ),
                )
            )
            sides[mode] = (c, await c.connect(str(endpoint)))
        copy_c, copy_s = sides["auto"]
        nixl_c, nixl_s = sides["nixl"]
        methods = Methods([nixl_s], [nixl_c], spec, prefill_spec, reqs[0], fig, device)
        methods.unchecked = [nixl_s]  # akv's NIXL read path, in the "akv_unchecked" slot
        methods.drive = [p.backend.raw for p in producers]
        copier = Methods([copy_s], [copy_c], spec, prefill_spec, reqs[0], fig, device)
        totals: dict[str, list[float]] = {m: [0.0, 0.0] for m in ("copy", "nixl", "read")}
        runs = {"copy": (copier, "akv"), "nixl": (methods, "nixl"), "read": (methods, "akv_unchecked")}
        for who, method in runs.values():  # warm up
            await who.run(method, [(f"{reqs[0][0]}-warm", reqs[0][1], reqs[0][2])], record=False)
        with frozen_heap():
            for i, batch in enumerate([r] for r in reqs):
                for name in list(runs) if i % 2 else reversed(list(runs)):
                    who, method = runs[name]
                    moved, seconds = await who.run(method, batch, record=True)
                    totals[name][0] += moved
                    totals[name][1] += seconds
        tg.cancel_scope.cancel()
    gbps = {m: moved / spent / 1e9 for m, (moved, spent) in totals.items()}
    return {
        "name": w.name,
        "layout": w.layout,
        "tp": f"{w.prefill_tp}->{w.decode_tp}",
        "contiguous": w.contiguous,
        "bytes": int(totals["copy"][0]) // len(reqs),
        "akv_gbps": round(gbps["copy"], 3),
        "nixl_gbps": round(gbps["nixl"], 3),
        "akv_read_gbps": round(gbps["read"], 3),
        "akv_vs_nixl": round(gbps["copy"] / gbps["nixl"], 3),
        "path": "copy",
    }
