"""What ``akv bench`` reports: one summary row per workload (`row`), head-major against HND
and akv against the hand-written loop (`comparisons`), the printed table (`print_table`) and
the plot (`check_plot`, `plot`). It reports figures and checks nothing.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from akv.bench.workloads import TARGETS, Figures

__all__ = ["check_plot", "comparisons", "plot", "print_table", "row"]


def _transfer_columns(f: Figures) -> dict[str, Any]:
    """``transfer`` and ``paths`` (pulls per path); for packed and auto, ``descriptors`` is
    what akv posted per request (packed reads use unprepared lists, no merging), and
    ``pack_ms`` the gather (prefill side, per request); the three stages of a packed pull,
    per packed pull: ``lookup_ms`` (the directory lookup), ``read_ms`` (the reads and the
    exposure check), ``unpack_ms`` (the scatter); per pull read directly, ``data_ms`` (from
    posting its data reads until they were seen done; ``data_p50_ms`` and ``data_p99_ms``,
    its percentiles: a slow tail there is in the reads or in seeing them done, not in akv's
    work around them) and ``check_ms`` (from then until its exposure check was seen
    verified)."""
    stages = {}
    if f.data_ms:  # where a direct pull's time goes: its data reads, then its exposure check
        stages = {
            "data_ms": round(float(np.mean(f.data_ms)), 3),
            "data_p50_ms": round(float(np.percentile(f.data_ms, 50)), 3),
            "data_p99_ms": round(float(np.percentile(f.data_ms, 99)), 3),
            "check_ms": round(1e3 * f.check_s / len(f.data_ms), 3),
        }
    if f.transfer == "direct":
        return {"transfer": "direct", "paths": dict(f.paths), **stages}
    packed = max(f.paths.get("packed", 0), 1)
    return {
        "transfer": f.transfer,
        "paths": dict(f.paths),
        **stages,
        "descriptors": round(f.descriptors_submitted, 1),
        "pack_ms": round(f.pack_ms, 3),
        "lookup_ms": round(1e3 * f.lookup_s / packed, 3),
        "read_ms": round(1e3 * f.read_s / packed, 3),
        "unpack_ms": round(1e3 * f.unpack_s / packed, 3),
    }


def row(f: Figures) -> dict[str, Any]:
    """One workload's line of the summary."""
    w = f.workload
    layout = tp = block_size = ""
    if w is not None:
        dl, dbs = w.decode_layout or w.layout, w.decode_block_size or w.block_size
        layout = w.layout if dl == w.layout else f"{w.layout}->{dl}"
        tp = f"{w.prefill_tp}->{w.decode_tp}"
        block_size = str(w.block_size) if dbs == w.block_size else f"{w.block_size}->{dbs}"
    return {
        "name": f.name,
        "layout": layout,
        "tp": tp,
        "block_size": block_size,
        "contiguous": w.contiguous if w is not None else True,
        "bytes": f.bytes,
        "descriptors": round(f.descriptors, 1),
        "descriptors_submitted": round(f.descriptors_submitted, 1),
        "nixl_descriptors_submitted": round(f.nixl_submitted, 1),  # the same posts as akv's
        "perblock_descriptors": round(f.perblock_descriptors, 1),
        "akv_gbps": round(f.gbps["akv"], 3),
        "nixl_gbps": round(f.gbps["nixl"], 3),
        "perblock_gbps": round(f.gbps["perblock"], 3),
        "memcpy_gbps": round(f.gbps["memcpy"], 3),
        "akv_vs_nixl": round(f.gbps["akv"] / f.gbps["nixl"], 3),
        "p50_ms": round(float(np.percentile(f.latency_ms, 50)), 3),
        "p99_ms": round(float(np.percentile(f.latency_ms, 99)), 3),
        "unchecked_gbps": round(f.gbps["akv_unchecked"], 3),
        "unchecked_p50_ms": round(float(np.percentile(f.latency_unchecked_ms, 50)), 3),
        "unchecked_p99_ms": round(float(np.percentile(f.latency_unchecked_ms, 99)), 3),
        "check_cost": round(f.gbps["akv_unchecked"] / f.gbps["akv"], 3),
        **(
            {
                "nixl_p50_ms": round(float(np.percentile(f.latency_nixl_ms, 50)), 3),
                "nixl_p99_ms": round(float(np.percentile(f.latency_nixl_ms, 99)), 3),
            }
            if f.latency_nixl_ms
            else {}
        ),
        "control_ops": {k: round(v, 3) for k, v in f.control_ops.items()},
        "data_xfers": round(f.data_xfers, 3),
        **_transfer_columns(f),
        **(
            {"nixl_write_gbps": round(f.gbps["nixl_write"], 3), "torch_gbps": round(f.gbps["memcpy"], 3)}
            if "nixl_write" in f.gbps
            else {}
        ),
        **(
            {
                "push_gbps": round(f.gbps["akv_push"], 3),
                "push_vs_pull": round(f.gbps["akv_push"] / f.gbps["akv"], 3),
                "push_control_ops": {k: round(v, 3) for k, v in f.push_control_ops.items()},
            }
            if "akv_push" in f.gbps
            else {}
        ),
    }


def comparisons(figures: list[Figures], pairs: tuple[tuple[str, str, str, bool], ...]) -> dict[str, Any]:
    """Head-major against per-layer HND on the same hetero-TP reads; akv against the hand-written loop."""
    by_name = {f.name: f for f in figures}
    headmajor = []
    for hnd_name, hm_name, tp, contiguous in pairs:
        hnd, hm = by_name.get(hnd_name), by_name.get(hm_name)
        if hnd is None or hm is None:
            continue
        headmajor.append(
            {
                "tp": tp,
                "contiguous": contiguous,
                "hnd": hnd_name,
                "headmajor": hm_name,
                "hnd_descriptors": round(hnd.descriptors_submitted, 1),
                "headmajor_descriptors": round(hm.descriptors_submitted, 1),
                # how many times fewer descriptors head-major posts per request (akv, all decode ranks)
                "descriptor_ratio": round(hnd.descriptors_submitted / max(hm.descriptors_submitted, 1e-9), 2),
                "hnd_gbps": round(hnd.gbps["akv"], 3),
                "headmajor_gbps": round(hm.gbps["akv"], 3),
                "gbps_ratio": round(hm.gbps["akv"] / hnd.gbps["akv"], 3),
                "nixl_gbps_ratio": round(hm.gbps["nixl"] / hnd.gbps["nixl"], 3),
            }
        )
    ratios = {f.name: f.gbps["akv"] / f.gbps["nixl"] for f in figures}
    worst = min(ratios, key=ratios.__getitem__) if ratios else ""
    return {
        "targets": dict(TARGETS),
        "headmajor_vs_hnd": headmajor,
        "akv_vs_nixl": {
            "min": round(ratios[worst], 3) if worst else None,
            "min_workload": worst,
            "below_target": [n for n, r in ratios.items() if r < TARGETS["akv_vs_nixl"]],
        },
    }


def print_table(summary: dict[str, Any]) -> None:
    cols = (
        "name",
        "layout",
        "tp",
        "block_size",
        "bytes",
        "descriptors_submitted",
        "descriptors",
        "perblock_descriptors",
        "akv_gbps",
        "nixl_gbps",
        "unchecked_gbps",
        "perblock_gbps",
        "memcpy_gbps",
        "akv_vs_nixl",
        "p50_ms",
        "p99_ms",
        "unchecked_p50_ms",
        "nixl_p50_ms",
    )
    rows = [[str(w.get(c, "")) for c in cols] for w in summary["workloads"] if "perblock_gbps" in w]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(widths[i]) for i, c in enumerate(cols)))
    for r in rows:
        print("  ".join(v.ljust(widths[i]) for i, v in enumerate(r)))
    print(
        "descriptors_submitted: what akv posts per request (all decode ranks); descriptors: what "
        "NIXL used after merging (hand-written loop, the same posts); perblock: unstrided, unmerged"
    )
    comp = summary["comparisons"]
    t = comp["targets"]
    print(
        f"head-major vs per-layer HND, akv (targets: >= {t['headmajor_descriptor_ratio']:g}x fewer "
        f"descriptors, >= {t['headmajor_gbps_ratio']:g}x GB/s):"
    )
    for c in comp["headmajor_vs_hnd"]:
        print(
            f"  TP {c['tp']} {'contiguous' if c['contiguous'] else 'fragmented'}: descriptors/request "
            f"{c['hnd_descriptors']} -> {c['headmajor_descriptors']} ({c['descriptor_ratio']}x fewer), "
            f"GB/s {c['hnd_gbps']} -> {c['headmajor_gbps']} ({c['gbps_ratio']}x; "
            f"hand-written NIXL {c['nixl_gbps_ratio']}x)"
        )
    a = comp["akv_vs_nixl"]
    below = ", ".join(a["below_target"]) or "none"
    print(
        f"akv vs hand-written NIXL on the same descriptors (target >= {t['akv_vs_nixl']:g}x): "
        f"lowest {a['min']}x ({a['min_workload']}); below target: {below}"
    )
    if "launch" in summary:  # not with --only
        launch = summary["launch"]
        print(
            f"launch overhead p50: akv {launch['akv_us_p50']} us, raw make_prepped_xfer+transfer "
            f"{launch['nixl_us_p50']} us"
        )
    for w in summary["workloads"]:
        if w["name"] == "same_process":
            print(
                f"same process ({w['tp']} {w['layout']}, {w['bytes']} bytes/request): akv copy path "
                f"{w['akv_gbps']} GB/s, raw NIXL between two agents of the process {w['nixl_gbps']} GB/s "
                f"({w['akv_vs_nixl']}x), akv through NIXL {w['akv_read_gbps']} GB/s"
            )
        elif "nixl_write_gbps" in w:
            print(
                f"{w['name']}: raw NIXL WRITE {w['nixl_write_gbps']} GB/s, torch copy {w['torch_gbps']} GB/s"
            )
        elif w["name"] == "layerwise":
            print(
                f"layerwise ({w['layers']} layers, {w['compute_ms']} ms each, {w['bytes']} bytes): pushed "
                f"tail {w['tail_ms']} ms after the last layer, pulled {w['pull_tail_ms']} ms; one layer's "
                f"bytes move in {w['layer_ms']} ms (tail {w['tail_vs_layer']}x; target <= 1.5x)"
            )
        if "push_gbps" in w and w["name"] != "layerwise":
            print(f"{w['name']}: push {w['push_gbps']} GB/s, {w['push_vs_pull']}x pull (target >= 0.9x)")
    if "poller" in summary:
        print(f"poller: {summary['poller']}")
        print(f"table preparation: {summary['table_prep']}")
    for w in summary["workloads"]:
        if w.get("transfer", "direct") != "direct":
            print(
                f"{w['name']} ({w['transfer']}): paths {w['paths']}, {w['descriptors']} descriptors/request, "
                f"pack {w['pack_ms']} ms per request; per packed pull: lookup {w['lookup_ms']} ms, "
                f"read {w['read_ms']} ms, unpack {w['unpack_ms']} ms"
            )


def check_plot(path: str) -> None:
    """Before running: ``--plot`` needs matplotlib and a directory to write into."""
    from akv.errors import ConfigError

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'akv[bench]' (or leave out --plot)") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"--plot {path}: cannot write into {folder}: choose a writable path")


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = [w for w in summary["workloads"] if w.get("name") == "scale"]
    if scale:
        plot_scale(scale, path, plt)
        return
    rows = [w for w in summary["workloads"] if "perblock_gbps" in w]
    names = [w["name"] for w in rows]
    methods = ("akv", "nixl", "perblock", "memcpy")
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(max(11.0, 0.8 * len(names)), 5))
    for i, m in enumerate(methods):
        ax.bar(x + (i - 1.5) * 0.2, [w[f"{m}_gbps"] for w in rows], 0.2, label=m)
    ax.set_xticks(x, names, rotation=35, ha="right")
    ax.set_ylabel("GB/s")
    ax.set_title(f"akv bench ({summary['mode']}, {summary['machine']['cpus']} CPUs, DRAM over UCX loopback)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_scale(rows: list[dict[str, Any]], path: str, plt: Any) -> None:
    """``akv bench --only scale``: one panel per table, each curve beside its floor."""
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    (prompt_ax, gap_ax, inflight_ax), (engines_ax, readers_ax, etcd_ax) = axes
    prompt = [r for r in rows if r.get("table") == "prompt"]
    for layout in sorted({r["layout"] for r in prompt}):
        for tp in sorted({r["tp"] for r in prompt}):
            sel = [r for r in prompt if r["layout"] == layout and r["tp"] == tp]
            if not sel:
                continue
            x = [r["tokens"] for r in sel]
            prompt_ax.plot(x, [r["auto_pull_ms"] for r in sel], "o-", label=f"akv auto {layout} {tp}")
            prompt_ax.plot(x, [r["nixl_ms"] for r in sel], "x--", label=f"raw NIXL {layout} {tp}")
            gap_ax.plot(
                x,
                [max(r["direct_loop_gap_ms"], r["packed_loop_gap_ms"]) for r in sel],
                "o-",
                label=f"{layout} {tp}",
            )
    for ax, title, ylabel in (
        (prompt_ax, "one request: pull time by auto's path, and raw NIXL", "ms"),
        (gap_ax, "the event loop's longest wait while it moved", "ms"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens (32 layers, 16-token blocks)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
    for how in ("pull", "pull_many"):
        sel = [r for r in rows if r.get("table") == "inflight" and r["launch"] == how]
        inflight_ax.plot(
            [r["pulls"] for r in sel], [r["decode_cpu_us"] for r in sel], "o-", label=f"decode CPU ({how})"
        )
    inflight_ax.set(
        xscale="log", xlabel="one-block pulls in flight", ylabel="us per pull", title="pulls in flight"
    )
    inflight_ax.legend(fontsize=7)
    sel = [r for r in rows if r.get("table") == "engines"]
    engines_ax.plot(
        [r["engines"] for r in sel], [r["connect_ms"] for r in sel], "o-", label="connect ms per engine"
    )
    engines_ax.plot(
        [r["engines"] for r in sel], [r["pull_ms_median"] for r in sel], "o-", label="pull ms (median)"
    )
    engines_ax.plot(
        [r["engines"] for r in sel], [r["rss_mb_per_engine"] for r in sel], "o-", label="MB per engine"
    )
    engines_ax.set(
        xscale="log", xlabel="prefill engines linked by one decode rank", title="engines per decode rank"
    )
    engines_ax.legend(fontsize=7)
    for ax, table, xkey, ykey, xlabel, ylabel, title in (
        (readers_ax, "readers", "readers", "prefill_cpu_us_per_notice", "decode ranks reading one prefill rank",
         "prefill CPU us per notice", "readers per prefill rank"),
        (etcd_ax, "etcd", "engines", "resolve_ms_median", "engines registered in etcd", "resolve ms (median)",
         "a fleet in etcd"),
    ):  # fmt: skip
        sel = [r for r in rows if r.get("table") == table]
        ax.plot([r[xkey] for r in sel], [r[ykey] for r in sel], "o-")
        ax.set(xscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    fig.suptitle("akv bench --only scale (DRAM over UCX loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
