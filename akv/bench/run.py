"""``akv bench``: akv against hand-written NIXL, the per-block scheme and memcpy, in one run
(`run_bench`).

Each workload (`akv.bench.workloads`) starts a real ``akv prefill`` process and reads from
it in this (decode) process with every method (`akv.bench.methods`), interleaved
(`akv.bench.measure`); the poller and table figures (`akv.bench.overhead`) follow. The
summary (`akv.bench.report`) compares head-major with HND on the same reads and akv with
the hand-written loop; it reports figures and checks nothing. The command's flags are in
`akv.bench.command`; the figure programs that run only when named (``--only NAME``) in
`akv.bench.figures`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from akv.bench.figures import PROGRAMS, run_program
from akv.bench.measure import bench_workload, same_process
from akv.bench.overhead import poller_figures, table_prep_fresh
from akv.bench.report import comparisons, row
from akv.bench.workloads import HEADMAJOR_PAIRS, WORKLOADS, config_name, preset_workloads

__all__ = ["run_bench"]


async def run_bench(
    quick: bool,
    progress: Callable[[str], None],
    preset: str | None = None,
    device: str = "cpu",
    hf_config: str | None = None,
    mode: str = "pull",
    layer_ms: float = 0.0,
    only: Sequence[str] = (),
    transfer: str = "direct",
    nixl_threads: int = 0,
) -> dict[str, Any]:
    """Run every workload (or, with ``preset``, that model's), the same-process workload and
    the poller and table figures; returns the JSON summary. ``device``: cpu, cuda or cuda:N
    (the caches of both sides of each pairing there). ``mode`` "push": akv in push mode beside
    every workload, and the ``layerwise`` workload (``layer_ms`` of computing per layer).
    ``only``: just these workloads (``layerwise`` and ``same_process`` among them), and the
    figure programs named there (`akv.bench.figures.PROGRAMS`, run only when named), no
    other figures. ``transfer``: the decode side's choice of copy (the prefill packs unless it is
    ``"direct"``). ``nixl_threads``: worker threads of the decode ranks' NIXL agents (the
    library's ``nixl_threads``)."""
    layers = 8 if quick else 16
    if hf_config:
        workloads, pairs = preset_workloads(config_name(hf_config), hf_config)
    else:
        workloads, pairs = (WORKLOADS, HEADMAJOR_PAIRS) if preset is None else preset_workloads(preset)
    if only:
        workloads = tuple(w for w in workloads if w.name in only)
    figures = []
    for w in workloads:
        if not quick:
            w = replace(w, requests=w.requests * 4)
        figures.append(await bench_workload(w, layers, progress, device, mode, transfer, nixl_threads))
    lw: list[dict[str, Any]] = []
    if mode == "push" and (not only or "layerwise" in only):
        from akv.bench.push import layerwise

        lw.append(await layerwise(layers, layer_ms or 5.0, progress, rounds=4 if quick else 8, device=device))
    if only:
        named: list[dict[str, Any]] = []
        if "same_process" in only:
            named.append(await same_process(layers, device, progress))
        for name in dict.fromkeys(n for n in only if n in PROGRAMS):  # in the order given, once
            progress(name)
            named.extend(await run_program(name, transfer))
        return {
            "workloads": [*(row(f) for f in figures), *named, *lw],
            "comparisons": comparisons(figures, pairs),
            "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
            "device": device,
            "mode": "quick" if quick else "full",
            "transfer": transfer,
            "nixl_threads": nixl_threads,
        }
    same = await same_process(layers, device, progress)
    progress("poller")
    poller = await poller_figures(2.0 if quick else 5.0, device)
    progress("table preparation")
    table = table_prep_fresh(10_000 if quick else 100_000, device)
    small = "small_concurrent" if preset is None and not hf_config else figures[0].name
    launch_akv = [x for f in figures if f.name == small for x in f.launch_akv_us]
    launch_nixl = [x for f in figures if f.name == small for x in f.launch_nixl_us]
    return {
        "workloads": [*(row(f) for f in figures), same, *lw],
        "comparisons": comparisons(figures, pairs),
        "launch": {
            "akv_us_p50": round(float(np.percentile(launch_akv, 50)), 1),
            "nixl_us_p50": round(float(np.percentile(launch_nixl, 50)), 1),
        },
        "idle_cpu_percent": round(poller["idle_cpu_percent_pending"], 3),
        "poller": {k: round(v, 3) for k, v in poller.items()},
        "table_prep": {k: round(v, 3) for k, v in table.items()},
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
        "device": device,
        "mode": "quick" if quick else "full",
        "transfer": transfer,
        "nixl_threads": nixl_threads,
    }
