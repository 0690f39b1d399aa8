"""Figures of ``akv bench`` beside the workloads: the pollers' idle CPU and release latency
(`poller_figures`), and the time and memory of registering and preparing a large descriptor
table (`table_prep`, run in a fresh process by `table_prep_fresh`).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time

import anyio
import anyio.lowlevel
import numpy as np

__all__ = ["poller_figures", "table_prep", "table_prep_fresh"]


async def poller_figures(idle_seconds: float, device: str = "cpu") -> dict[str, float]:
    """Idle CPU of a producer+consumer pair (caches on ``device``: cpu, cuda or cuda:N), and
    notification-to-release latency under load."""
    import torch

    import akv
    from akv.bench.methods import cuda_count
    from akv.device import parse_device
    from akv.testing import expected_blocks  # noqa: F401  (warm imports outside the timing)

    dev = parse_device(device).for_rank(0, cuda_count())

    spec = akv.KVSpec.create(layers=2, num_blocks=64, block_size=4, kv_heads=2, head_dim=16, dtype="float16")
    released: dict[str, float] = {}
    out: dict[str, float] = {}
    async with anyio.create_task_group() as tg:
        server = akv.ControlServer()
        ep = await tg.start(server.serve)
        async with (
            akv.Producer(
                akv.allocate_kv_cache(spec, 0, 1, device=dev),
                spec,
                tp_rank=0,
                tp_size=1,
                server=server,
                on_release=lambda r: released.__setitem__(r.request_id, time.monotonic()),
            ) as prod,
            akv.Consumer(akv.allocate_kv_cache(spec, 0, 1, device=dev), spec, tp_rank=0, tp_size=1) as cons,
        ):
            session = await cons.connect(ep)
            # idle: nothing exposed; then one request exposed and unread (the producer must poll)
            for label, expose in (("idle_cpu_percent", False), ("idle_cpu_percent_pending", True)):
                if expose:
                    prod.expose("pending", [0])
                await anyio.sleep(0.3)
                c0, w0 = time.process_time(), time.perf_counter()
                await anyio.sleep(idle_seconds)
                out[label] = 100 * (time.process_time() - c0) / (time.perf_counter() - w0)
            # reaction under load: back-to-back tiny pulls; done -> release latency on the producer
            lat = []
            for i in range(300):
                rid = f"lat-{i}"
                prod.expose(rid, [1 + i % 60])
                t = await session.pull(rid, [1 + i % 60], [1 + i % 60])
                res = await t
                done_at = t.started + res.seconds  # when the consumer's poller saw DONE
                with anyio.fail_after(5):
                    while rid not in released:
                        await anyio.lowlevel.checkpoint()
                lat.append((released[rid] - done_at) * 1e6)
            arr = np.array(lat)
            out["release_after_done_us_p50"] = float(np.percentile(arr, 50))
            out["release_after_done_us_p99"] = float(np.percentile(arr, 99))
            del torch
        tg.cancel_scope.cancel()
    return out


def _rss_mib() -> float:
    """Resident memory now (Linux), in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def table_prep(blocks: int, layers: int = 64, device: str = "cpu") -> dict[str, float]:
    """Register and prepare a (layers x 2) x blocks table on ``device`` (cpu, cuda or cuda:N),
    strided and expanded: time and peak RSS."""
    import torch

    from akv.backends import mem_type
    from akv.backends.nixl import NixlBackend
    from akv.bench.methods import cuda_count, cuda_index
    from akv.device import parse_device
    from akv.geometry.spec import KVSpec
    from akv.plan import RankMemory, TransferPlan

    spec = KVSpec.create(
        layers=layers, num_blocks=blocks, block_size=1, kv_heads=1, head_dim=8, dtype="float16"
    )
    dev = parse_device(device).for_rank(0, cuda_count())
    kv = [
        torch.zeros(spec.region_shape(0, 1), dtype=torch.float16, device=dev) for _ in range(spec.num_regions)
    ]
    kind = mem_type(kv)[0]
    out: dict[str, float] = {"layers": layers, "blocks": blocks}
    for mode in ("strided", "expanded"):  # strided first: the expanded list's memory stays mapped
        b = NixlBackend(f"prep-{mode}-{os.getpid()}", cuda_device=cuda_index(dev))
        t = time.perf_counter()
        b.register(kv)
        out["register_ms"] = (time.perf_counter() - t) * 1e3
        # the local table of a plan onto the same geometry: one row per region, one block each
        mem = RankMemory(0, 1, tuple(x.data_ptr() for x in kv))
        plan = TransferPlan(local_spec=spec, local=mem, remote_spec=spec, remote={0: mem})
        table = next(t for k, t in plan.tables.items() if k[0] == "local")
        out["descriptors"] = int(table[:, 4].sum())
        rss0 = _rss_mib()
        peak = [rss0]
        stop = threading.Event()

        def sample(stop: threading.Event = stop, peak: list[float] = peak) -> None:
            while not stop.wait(0.002):  # VmRSS every 2 ms: the transient peak while preparing
                peak.append(_rss_mib())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t = time.perf_counter()
        (b.prep if mode == "strided" else b.prep_expanded)("", table, kind)
        out[f"{mode}_prep_ms"] = (time.perf_counter() - t) * 1e3
        stop.set()
        sampler.join()
        out[f"{mode}_peak_rss_growth_mib"] = max(peak) - rss0
        out[f"{mode}_retained_rss_mib"] = _rss_mib() - rss0  # what the prepared list keeps
        b.close()
    return out


def table_prep_fresh(blocks: int, device: str = "cpu") -> dict[str, float]:
    """`table_prep` in a fresh process, so that memory figures are not hidden by reuse."""
    code = (
        "import json; from akv.bench.overhead import table_prep; "
        f"print(json.dumps(table_prep({blocks}, device={device!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))
