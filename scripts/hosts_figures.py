"""GB/s of akv pulls between separate hosts (network namespaces, TCP over veth: tests/hosts.py)
against loopback (one host: UCX picks cma) and loopback with ``UCX_TLS=tcp`` (TCP over lo),
for the same workload, interleaved. Needs root.

Two figures per path: ``akv decode``'s summary ``gbps`` (its clock includes verifying every
byte, which dominates on small machines), and the pulls alone (the same 32 requests x 8
blocks, 8 in flight, no verification, after a warm-up) against ``akv prefill --hold --no-fill``.

    PYTHONPATH=. .venv/bin/python scripts/hosts_figures.py [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ["--kv-heads", "4", "--layers", "8", "--blocks", "256", "--block-size", "16", "--head-dim", "128"]
REQUESTS, BLOCKS, CONCURRENCY, ROUNDS = 32, 8, 8, 4
SECRET = ["--secret", "hosts-figures"]


def _last_json(text: str) -> dict[str, Any]:
    return dict(json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1]))


def _pull_main(endpoint: str) -> None:
    """Inside the decode host: time pulls alone, print one JSON line."""
    import anyio
    import numpy as np

    import akv
    from akv.cli import build_parser
    from akv.cli.args import spec_from_args
    from akv.testing import make_requests

    spec = spec_from_args(build_parser().parse_args(["decode", "--connect", "x", "--tp-size", "1", *MODEL]))
    reqs = make_requests(spec, REQUESTS, BLOCKS, seed=0)
    rng = np.random.default_rng(1)

    async def main() -> dict[str, Any]:
        async with akv.Consumer(
            akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, secret=SECRET[1]
        ) as c:
            s = await c.connect(endpoint)
            moved, spent = 0, 0.0
            for rnd in range(ROUNDS + 1):  # round 0 warms up
                t0 = time.perf_counter()
                for i in range(0, REQUESTS, CONCURRENCY):
                    batch = []
                    for r in reqs[i : i + CONCURRENCY]:
                        local = rng.choice(spec.num_blocks, BLOCKS, replace=False).tolist()
                        batch.append(await s.pull(f"{r.request_id}-{rnd}", local, r.block_ids))
                    for t in batch:
                        res = await t
                        moved += res.bytes if rnd else 0
                if rnd:
                    spent += time.perf_counter() - t0
            return {"bytes": moved, "seconds": round(spent, 3), "gbps": round(moved / spent / 1e9, 3)}

    print(json.dumps(anyio.run(main)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()

    from akv.protocol.messages import RequestInfo
    from akv.testing import make_requests, save_requests
    from tests.hosts import AKV, Lines, Network, akv_env

    env = akv_env()
    envs = {"loopback": env, "loopback UCX_TLS=tcp": akv_env(UCX_TLS="tcp")}
    prefill = [
        *AKV,
        "prefill",
        "--tp-size",
        "1",
        *MODEL,
        "--port",
        "7000",
        *SECRET,
        "--timeout",
        "300",
        "--json",
    ]
    decode = [*AKV, "decode", "--tp-size", "1", *MODEL, *SECRET, "--json"]
    decode_load = ["--requests", str(REQUESTS), "--blocks-per-request", str(BLOCKS)]
    out: dict[str, list[float]] = {}
    with Network(2) as net, tempfile.TemporaryDirectory() as tmp:
        a_host, b_host = net
        from akv.cli import build_parser
        from akv.cli.args import spec_from_args

        spec = spec_from_args(
            build_parser().parse_args(["decode", "--connect", "x", "--tp-size", "1", *MODEL])
        )
        exposed = [
            RequestInfo(request_id=f"{r.request_id}-{rnd}", block_ids=r.block_ids, seed=r.seed)
            for r in make_requests(spec, REQUESTS, BLOCKS, seed=0)
            for rnd in range(ROUNDS + 1)
        ]
        save_requests(f"{tmp}/requests.json", exposed)
        held = ["--requests-file", f"{tmp}/requests.json", "--hold", "--no-fill", "--lease", "600"]

        def start(path: str, argv: list[str]) -> tuple[Any, Lines, str]:
            if path == "hosts":
                p = a_host.popen([*argv, "--host", a_host.ip], env=env, stdout=subprocess.PIPE, text=True)
            else:
                p = subprocess.Popen(
                    [*argv, "--host", "127.0.0.1"], env=env, stdout=subprocess.PIPE, text=True
                )
            lines = Lines(p.stdout)
            return p, lines, str(lines.wait_json("ready")["endpoint"])

        def run(path: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
            if path == "hosts":
                return b_host.run(argv, env=env, timeout=300)
            return subprocess.run(argv, env=envs[path], capture_output=True, text=True, timeout=300)

        for rep in range(a.reps):
            for path in ("hosts", *envs):
                p, _lines, ep = start(path, [*prefill, *decode_load])
                d = _last_json(run(path, [*decode, "--connect", ep]).stdout)
                assert d["verified"] == REQUESTS and p.wait(60) == 0, d
                out.setdefault(f"{path} akv decode", []).append(d["gbps"])
                p, _lines, ep = start(path, [*prefill, *held])
                r = run(path, [sys.executable, os.path.abspath(__file__), "pull", ep])
                p.terminate()
                p.wait(30)
                pulls = _last_json(r.stdout)
                out.setdefault(f"{path} pulls alone", []).append(pulls["gbps"])
                print(f"rep {rep} {path}: decode {d['gbps']} GB/s, pulls alone {pulls}", flush=True)
    for name, v in out.items():
        print(f"{name}: median {statistics.median(v):.3f} GB/s over {v}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["pull"]:
        _pull_main(sys.argv[2])
    else:
        main()
