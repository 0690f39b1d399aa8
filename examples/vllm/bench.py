"""akv's AkvConnector against vLLM's NixlConnector, in one run, on the same model and prompts.

    python examples/vllm/bench.py [--reps 5] [--lengths 256,1024,2048] [--concurrency 4] [--json out.json]

Starts a prefill and a decode instance per connector (prefill pinned to core 0, decode to
core 1): ``akv`` and ``nixl-tuned`` (NixlConnector with NIXL's progress thread off and its
pinning left out) run side by side, their requests interleaved; ``nixl`` (NixlConnector as
shipped, whose progress thread spins) runs after them, alone, so its spinning does not slow
the others. Every request has a fresh random prompt (the prefix cache hides nothing) and is
also computed colocated on the prefill instance (a salted prefix cache) to check the
tokens. Per connector and prompt length it prints the median of:

- ``ttft_ms``: end to end, from the router's prefill request to decode's first streamed token;
- ``decode_ttft_ms``: from the decode request to its first token (pull included);
- ``transfer_ms``: the connector's own pull time (its Prometheus histogram);
- ``tok_s``: decode's output tokens per second after the first;
- ``colocated_ttft_ms``: the same prompt computed by one instance alone;
- ``equal``: requests whose tokens equal the colocated ones;

then, with ``--concurrency N``, N requests of the middle length at once, and the idle CPU of
each instance (percent of one core over ``--idle-s`` seconds). Figures go to stdout, one JSON
document to ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from akv.integrations.vllm.launch import Instance, start, wait_ready

HERE = Path(__file__).resolve().parent
XFER_METRIC = {"akv": "vllm:akv_pull_seconds", "nixl": "vllm:nixl_xfer_time_seconds", "nixl-tuned": "vllm:nixl_xfer_time_seconds"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (from /proc)."""
    total = 0.0
    todo = [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        todo.extend(int(c) for c in children)
    return total


async def histogram(client: httpx.AsyncClient, inst: Instance, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram on ``inst``."""
    text = (await client.get(inst.url + "/metrics")).text
    s = c = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum{"):
            s += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count{"):
            c += float(line.rsplit(" ", 1)[1])
    return s, c


class Pair:
    def __init__(self, connector: str, prefill: Instance, decode: Instance) -> None:
        self.connector, self.prefill, self.decode = connector, prefill, decode


async def one(client: httpx.AsyncClient, pair: Pair, model: str, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    """One request through the pair, as a router sends it; times and tokens."""
    body = {"model": model, "prompt": tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    p = await client.post(pair.prefill.url + "/v1/completions",
                          json=dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    p.raise_for_status()
    params = p.json()["kv_transfer_params"]
    t1 = time.perf_counter()
    first = None
    out: list[int] = []
    req = dict(body, max_tokens=max_tokens, stream=True, kv_transfer_params=params)
    async with client.stream("POST", pair.decode.url + "/v1/completions", json=req) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "choices" not in chunk:
                raise RuntimeError(f"decode ({pair.connector}) answered {chunk}")
            ids = chunk["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter()
            out.extend(ids)
    end = time.perf_counter()
    first = first or end
    return {
        "ttft_ms": (first - t0) * 1e3,
        "decode_ttft_ms": (first - t1) * 1e3,
        "tok_s": (len(out) - 1) / (end - first) if len(out) > 1 and end > first else 0.0,
        "tokens": out,
    }


async def colocated(client: httpx.AsyncClient, inst: Instance, model: str, tokens: list[int], max_tokens: int) -> tuple[list[int], float]:
    body = {"model": model, "prompt": tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "max_tokens": max_tokens, "stream": True, "cache_salt": f"colocated-{random.random()}"}
    t0 = time.perf_counter()
    first = None
    out: list[int] = []
    async with client.stream("POST", inst.url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter()
                out.extend(ids)
    return out, ((first or time.perf_counter()) - t0) * 1e3


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 2) if xs else float("nan")


async def measure(pairs: list[Pair], model: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        # warm-up: one request per pair (first handshakes, first forward passes)
        for pair in pairs:
            await one(client, pair, model, [rng.randrange(1, 250) for _ in range(64)], 2)
        for n in args.lengths:
            rows: dict[str, dict[str, list[float]]] = {p.connector: {} for p in pairs}
            for _ in range(args.reps):
                for pair in pairs:  # interleaved: the same conditions for every connector
                    tokens = [rng.randrange(1, 250) for _ in range(n)]
                    want, co_ttft = await colocated(client, pair.prefill, model, tokens, args.max_tokens)
                    before = await histogram(client, pair.decode, XFER_METRIC[pair.connector])
                    got = await one(client, pair, model, tokens, args.max_tokens)
                    await asyncio.sleep(1.2)  # vLLM publishes connector stats on an interval
                    after = await histogram(client, pair.decode, XFER_METRIC[pair.connector])
                    row = rows[pair.connector]
                    for k in ("ttft_ms", "decode_ttft_ms", "tok_s"):
                        row.setdefault(k, []).append(got[k])
                    row.setdefault("colocated_ttft_ms", []).append(co_ttft)
                    if after[1] > before[1]:
                        row.setdefault("transfer_ms", []).append((after[0] - before[0]) / (after[1] - before[1]) * 1e3)
                    row.setdefault("equal", []).append(float(got["tokens"] == want))
            for conn, row in rows.items():
                summary = {k: med(v) for k, v in row.items() if k != "equal"}
                summary["equal"] = f"{int(sum(row['equal']))}/{len(row['equal'])}"
                results.setdefault(conn, {})[str(n)] = summary
                print(f"{conn:>10} {n:>5} tokens: " + "  ".join(f"{k} {v}" for k, v in summary.items()), flush=True)
        if args.concurrency > 1:
            n = args.lengths[len(args.lengths) // 2]
            for pair in pairs:
                prompts = [[rng.randrange(1, 250) for _ in range(n)] for _ in range(args.concurrency)]
                t0 = time.perf_counter()
                got = await asyncio.gather(*(one(client, pair, model, t, args.max_tokens) for t in prompts))
                wall = time.perf_counter() - t0
                want = [await colocated(client, pair.prefill, model, t, args.max_tokens) for t in prompts]
                summary = {
                    "ttft_ms": med([g["ttft_ms"] for g in got]),
                    "decode_ttft_ms": med([g["decode_ttft_ms"] for g in got]),
                    "wall_s": round(wall, 3),
                    "equal": f"{sum(g['tokens'] == w[0] for g, w in zip(got, want))}/{len(got)}",
                }
                results.setdefault(pair.connector, {})[f"{args.concurrency}x{n}"] = summary
                print(f"{pair.connector:>10} {args.concurrency}x{n} concurrent: "
                      + "  ".join(f"{k} {v}" for k, v in summary.items()), flush=True)
    return results


def idle_cpu(pairs: list[Pair], seconds: float) -> dict[str, dict[str, float]]:
    """Percent of one core each instance (its whole process tree) uses while idle."""
    time.sleep(2.0)
    insts = [(p.connector, role, inst) for p in pairs for role, inst in (("prefill", p.prefill), ("decode", p.decode))]
    before = {id(i): cpu_seconds(i.proc.pid) for _, _, i in insts}
    time.sleep(seconds)
    out: dict[str, dict[str, float]] = {}
    for conn, role, inst in insts:
        out.setdefault(conn, {})[role] = round((cpu_seconds(inst.proc.pid) - before[id(inst)]) / seconds * 100, 1)
    for conn, roles in out.items():
        print(f"{conn:>10} idle CPU: prefill {roles['prefill']} %, decode {roles['decode']} % of a core", flush=True)
    return out


def start_pairs(connectors: list[str], model: str, logs: Path, args: argparse.Namespace) -> list[Pair]:
    pairs = []
    for conn in connectors:
        kw: dict[str, Any] = dict(model=model, kv_space_gib=1, vllm_args=args.vllm_args)
        p = start(logs / f"{conn}-prefill.log", connector=conn, role="prefill", http_port=free_port(), core=0,
                  akv_port=free_port(), nixl_port=free_port(), **kw)
        d = start(logs / f"{conn}-decode.log", connector=conn, role="decode", http_port=free_port(), core=1,
                  akv_port=free_port(), nixl_port=free_port(), **kw)
        pairs.append(Pair(conn, p, d))
    try:
        wait_ready([i for pr in pairs for i in (pr.prefill, pr.decode)], timeout=600)
    except BaseException:
        stop_pairs(pairs)
        raise
    return pairs


def stop_pairs(pairs: list[Pair]) -> None:
    for p in pairs:
        p.prefill.stop()
        p.decode.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="AkvConnector against NixlConnector in real vLLM instances")
    ap.add_argument("--model", help="a model directory (default: build the tiny Llama)")
    ap.add_argument("--lengths", default="256,1024,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="requests per length and connector")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent requests of the middle length (1: skip)")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--connectors", default="akv,nixl-tuned,nixl",
                    help="which to run; nixl (as shipped) always runs alone, after the others")
    ap.add_argument("--fast", action="store_true", help="start vLLM with -O0 (no graph compilation)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", type=Path, help="keep the instances' logs in this directory")
    args = ap.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
        if any(n < 2 for n in args.lengths):
            raise ValueError
    except ValueError:
        print(f"bench: --lengths {args.lengths!r}: give prompt lengths >= 2, e.g. 256,1024", file=sys.stderr)
        return 64
    connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    bad = [c for c in connectors if c not in XFER_METRIC]
    if bad or not connectors or args.reps < 1:
        print(f"bench: --connectors {args.connectors!r} / --reps {args.reps}: use akv, nixl-tuned, nixl and reps >= 1",
              file=sys.stderr)
        return 64
    args.vllm_args = ["-O0"] if args.fast else []
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="akv-vllm-bench-") as tmp:
        model = args.model or str(Path(tmp) / "model")
        if args.model is None:
            subprocess.run([sys.executable, str(HERE / "tiny_model.py"), model], check=True, capture_output=True)
        logs = args.logs or Path(tmp) / "logs"
        figures: dict[str, Any] = {"model": "tiny llama (4 layers, hidden 256, 4 KV heads)" if args.model is None else model,
                                   "args": {k: v for k, v in vars(args).items() if k not in ("json", "logs")}}
        groups = [[c for c in connectors if c != "nixl"], [c for c in connectors if c == "nixl"]]
        for group in (g for g in groups if g):
            print(f"starting {', '.join(group)} (prefill on core 0, decode on core 1)", flush=True)
            pairs = start_pairs(group, model, logs, args)
            try:
                figures.setdefault("idle_cpu_pct", {}).update(idle_cpu(pairs, args.idle_s))
                figures.setdefault("results", {}).update(asyncio.run(measure(pairs, model, args, rng)))
            finally:
                stop_pairs(pairs)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    res = figures.get("results", {})
    if "akv" in res and "nixl-tuned" in res:
        for n in map(str, args.lengths):
            a, b = res["akv"][n], res["nixl-tuned"][n]
            print(f"ratio akv / nixl-tuned at {n} tokens: ttft {a['ttft_ms'] / b['ttft_ms']:.2f}, "
                  f"decode_ttft {a['decode_ttft_ms'] / b['decode_ttft_ms']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
