"""The ``akv bench`` command: its flags, their checks (before anything runs), the progress
bar and the output (`add_bench_parser`). The run itself is `akv.bench.run.run_bench`.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from typing import Any

from akv.bench.figures import PROGRAMS
from akv.bench.workloads import WORKLOADS
from akv.options import add_mode_flags, check, check_mode, device_of, use_gpu_environment

__all__ = ["add_bench_parser"]

#: ``--only`` names beside the standard workloads that run only when named.
NAMED_ONLY = ("same_process", *PROGRAMS)


def _epilog() -> str:
    """The names ``--only`` takes, for ``--help``."""
    names = ", ".join(w.name for w in WORKLOADS)
    lines = [
        textwrap.fill(f"workloads for --only: {names}; same_process; layerwise (with --mode push).", 79),
        "",
        textwrap.fill(
            "figure programs, run only when named with --only NAME (DRAM; they take neither "
            "--quick nor --mode, and --device cuda refuses them; the docs quote their figures):",
            79,
        ),
    ]
    width = max(len(n) for n in PROGRAMS)
    lines += [f"  {name.ljust(width)}  {what}" for name, what in PROGRAMS.items()]
    return "\n".join(lines)


def add_bench_parser(sub: Any) -> None:
    """Register ``akv bench``."""
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="benchmarks: akv vs hand-written NIXL, per-block, memcpy",
        description="akv against a hand-written NIXL loop, the per-block scheme and memcpy on the same "
        "reads, plus poller and table-preparation figures (docs/performance.md).",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller workloads (8 layers where a workload does not fix them; the large ones at full "
        "size), a few minutes on 2 CPU cores (the full run: 16 layers everywhere and 4x the requests, "
        "several minutes)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--preset",
        metavar="NAME",
        help="instead of the standard workloads: this model's hybrid cache (akv.presets, scaled to 8 "
        "layers) at the TP pairs it shards to, per-layer HND against head-major",
    )
    p.add_argument(
        "--hf-config",
        metavar="FILE.json",
        help="like --preset, for the cache a model's own Hugging Face config.json describes",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw bandwidth per workload and method (needs matplotlib: pip install 'akv[bench]')",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logs on stderr (-vv: debug)")
    p.add_argument(
        "--device",
        default="cpu",
        metavar="DEV",
        help="where both sides' caches live: cpu, cuda (decode rank r and prefill rank r on GPU r %% count) "
        "or cuda:N; on CUDA each workload adds raw NIXL WRITE and a torch device copy (default: %(default)s)",
    )

    p.add_argument(
        "--only",
        metavar="NAME[,NAME...]",
        help="run just these workloads (layerwise: with --mode push) or figure programs (listed "
        "below), and no same-process, poller or table figures unless named",
    )
    p.add_argument(
        "--transfer",
        choices=("direct", "packed", "auto"),
        default="direct",
        help="run each workload with direct reads, packed copies (the prefill packs every "
        "request; with --mode push, the pushes write packed copies too) or auto's choice per "
        "pull (default: %(default)s)",
    )
    p.add_argument(
        "--nixl-threads",
        type=int,
        default=0,
        metavar="N",
        help="worker threads of the decode ranks' NIXL agents (nixl_threads; docs/gpu.md): a "
        "transfer of 8 or more descriptors is split across them (default: %(default)s, none)",
    )
    add_mode_flags(p, layers=True)

    def run(a: argparse.Namespace) -> int:
        import anyio

        from akv.bench.report import check_plot, plot, print_table
        from akv.bench.run import run_bench
        from akv.bench.workloads import config_name, preset_workloads
        from akv.device import parse_device
        from akv.errors import ConfigError
        from akv.testing import ProgressBar, etcd_binary

        check_mode(a)
        only = [n for n in (a.only or "").split(",") if n]
        known = {w.name for w in WORKLOADS} | {"layerwise", *NAMED_ONLY}
        check(
            bool(a.preset or a.hf_config) or all(n in known for n in only),
            f"--only {a.only}: unknown workloads {sorted(set(only) - known)} (known: {', '.join(sorted(known))})",
        )
        check(a.mode == "push" or "layerwise" not in only, "--only layerwise needs --mode push")
        check(a.nixl_threads >= 0, f"--nixl-threads {a.nixl_threads}: give 0 (none) or more threads")
        check(
            "etcd" not in only or etcd_binary() is not None,
            "--only etcd needs an etcd binary: bash scripts/setup.sh installs Debian's etcd-server "
            "(or set AKV_ETCD)",
        )
        # Before anything touches CUDA: the figure programs measure DRAM only, so a figure
        # labelled with a CUDA device would not be one measured there.
        programs = [n for n in only if n in PROGRAMS]
        check(
            not (programs and parse_device(a.device).cuda),
            f"--only {','.join(programs)}: figure programs measure DRAM only; leave them out of "
            f"--device {a.device} (run them with --device cpu)",
        )
        device = device_of(a)  # a one-line error (exit 64) without a usable GPU
        use_gpu_environment(device)
        if a.plot:
            check_plot(a.plot)  # before the run, not after minutes of it
        tty = sys.stderr.isatty()
        started = time.monotonic()
        # an unknown preset is a ConfigError naming the known ones, before anything starts
        if a.preset and a.hf_config:
            raise ConfigError("--preset and --hf-config exclude each other: give one")
        if a.hf_config:
            count = len(preset_workloads(config_name(a.hf_config), a.hf_config)[0])
        else:
            count = len(WORKLOADS) if not a.preset else len(preset_workloads(a.preset)[0])
        singles = len({n for n in only if n in NAMED_ONLY})  # one step each
        if only:
            count = len([n for n in only if n != "layerwise" and n not in NAMED_ONLY])
        steps = (
            2 * count
            + singles
            + (0 if only else 3)
            + (a.mode == "push" and (not only or "layerwise" in only))
        )
        bar = ProgressBar(tty, label="bench", width=24)
        done = [0]

        def progress(step: str) -> None:
            done[0] += 1
            note = f"{time.monotonic() - started:6.1f}s  {step}"
            bar.update(min(done[0], steps), steps, note)
            if not tty:
                print(f"[{done[0]}/{steps}] {note}", file=sys.stderr, flush=True)

        summary = anyio.run(
            run_bench,
            a.quick,
            progress,
            a.preset,
            str(device),
            a.hf_config,
            a.mode,
            a.layer_ms,
            only,
            a.transfer,
            a.nixl_threads,
        )
        bar.close()
        summary["seconds"] = round(time.monotonic() - started, 1)
        if a.json:
            print(json.dumps(summary, separators=(",", ":")), flush=True)
        elif only:
            for w in summary["workloads"]:
                print(json.dumps(w, separators=(",", ":")))
        else:
            print_table(summary)
            sys.stdout.flush()
        if a.plot:
            try:
                plot(summary, a.plot)
            except Exception as exc:  # the figures are printed already; say why there is no plot
                print(f"akv bench: no plot: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 1
        return 0

    p.set_defaults(func=run)
