"""akv's AkvConnector against vLLM's NixlConnector, in one run, on the same model and prompts.

    python examples/vllm/bench.py [--reps 6] [--rounds 2] [--lengths 256,1024,2048] [--concurrency 4] [--json out.json]

Per connector, a prefill and a decode instance (prefill pinned to core 0, decode to core 1):
``akv``, ``nixl-tuned`` (NixlConnector with NIXL's progress thread off and its pinning left
out) and ``nixl`` (NixlConnector as shipped, whose progress thread spins). One pair runs at a
time (two pairs on two cores slow each other), in rounds: each round starts every
connector's pair in turn and sends it the round's share of the requests, the same prompts
for every connector, so drift over the run touches all of them alike. Every request has a fresh random prompt (the prefix cache hides nothing) and is
also computed colocated on the prefill instance (a salted prefix cache) to check the
tokens. Per connector and prompt length it prints the median of:

- ``ttft_ms``: end to end, from the router's prefill request to decode's first streamed token;
- ``decode_ttft_ms``: from the decode request to its first token (pull included);
- ``transfer_ms``: the connector's own pull time (its Prometheus histogram);
- ``tok_s``: decode's output tokens per second after the first;
- ``colocated_ttft_ms``: the same prompt computed by one instance alone;
- ``equal``: requests whose tokens equal the colocated ones;

then, with ``--concurrency N``, N requests of the middle length at once (each round), and the
idle CPU of each instance (percent of one core over ``--idle-s`` seconds, after start-up). Figures go to stdout, one JSON
document to ``--json``.

``--loaded N`` measures under load instead: the pairs of ``akv`` and ``nixl-tuned`` run at
once (both prefills on core 0, both decodes on core 1), and each measured request goes
through one pair while N other streams decode on that pair's decode instance (fresh short
prompts, long outputs). Every prompt goes through both pairs, in alternating order, so the
figures pair up per prompt: besides the medians of ``ttft_ms`` and ``decode_ttft_ms``, the
measured request's inter-token latency (``itl_ms``: median gap between its streamed tokens)
and the load streams' (``load_itl_ms``, while the request transferred and decoded), then
the medians of the per-prompt ratios akv / nixl-tuned (``paired``), and what akv's own
threads (named ``akv-N`` by the connector) cost: CPU and wake-ups per second while nothing is
in flight (over ``--idle-s``), and CPU milliseconds and wake-ups per request under load
(``akv_threads``; the load streams are computed by the decode instance itself and give akv
no work). ``--json`` also keeps every prompt's figures (``per_prompt``), so that several runs
can be pooled.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
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
XFER_METRIC = {
    "akv": "vllm:akv_pull_seconds",
    "nixl": "vllm:nixl_xfer_time_seconds",
    "nixl-tuned": "vllm:nixl_xfer_time_seconds",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants that still run (from /proc)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        found.append(p)
        todo.extend(int(c) for c in children)
    return found


def cpu_ticks(stat: Path) -> float:
    """User + system CPU seconds from a /proc ``stat`` file (of a process or a thread)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants."""
    total = 0.0
    for p in process_tree(pid):
        try:
            total += cpu_ticks(Path(f"/proc/{p}/stat"))
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return total


def akv_threads(pid: int) -> tuple[float, int]:
    """CPU seconds and voluntary context switches (wake-ups) of akv's threads (named ``akv-N``
    by the connector's worker half) in a process and its descendants."""
    cpu, wakeups = 0.0, 0
    for p in process_tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except (FileNotFoundError, ProcessLookupError):
            continue
        for tid in tids:
            task = Path(f"/proc/{p}/task/{tid}")
            try:  # a thread may end between the listing and the reads
                if not task.joinpath("comm").read_text().startswith("akv-"):
                    continue
                seconds = cpu_ticks(task / "stat")
                status = task.joinpath("status").read_text().splitlines()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            cpu += seconds
            wakeups += sum(int(ln.split()[1]) for ln in status if ln.startswith("voluntary_ctxt_switches"))
    return cpu, wakeups


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


async def one(
    client: httpx.AsyncClient, pair: Pair, model: str, tokens: list[int], max_tokens: int
) -> dict[str, Any]:
    """One request through the pair, as a router sends it; times and tokens."""
    body = {"model": model, "prompt": tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    p = await client.post(
        pair.prefill.url + "/v1/completions",
        json=dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
    )
    p.raise_for_status()
    params = p.json()["kv_transfer_params"]
    t1 = time.perf_counter()
    first = None
    out: list[int] = []
    stamps: list[float] = []
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
            if ids:
                stamps.append(time.perf_counter())
                if first is None:
                    first = stamps[-1]
            out.extend(ids)
    end = time.perf_counter()
    first = first or end
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]
    return {
        "ttft_ms": (first - t0) * 1e3,
        "decode_ttft_ms": (first - t1) * 1e3,
        "tok_s": (len(out) - 1) / (end - first) if len(out) > 1 and end > first else 0.0,
        "itl_ms": statistics.median(gaps) if gaps else float("nan"),
        "tokens": out,
    }


async def load_stream(
    client: httpx.AsyncClient,
    inst: Instance,
    model: str,
    tokens: list[int],
    max_tokens: int,
    stop: asyncio.Event,
    gaps: list[float],
) -> None:
    """One decoding stream on ``inst`` (its own prompt, computed there): the gaps between its
    tokens go into ``gaps`` until ``stop`` is set, when the stream is dropped (vLLM aborts it)."""
    body = {
        "model": model,
        "prompt": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "max_tokens": max_tokens,
        "stream": True,
        "cache_salt": f"load-{random.random()}",
    }
    last = None
    async with client.stream("POST", inst.url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if stop.is_set():
                return
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now - last) * 1e3)
                last = now


async def measure_loaded(
    pairs: dict[str, Pair], model: str, args: argparse.Namespace, prompts: list[list[int]], rng: random.Random
) -> dict[str, Any]:
    """Each prompt through every pair (alternating order) while ``args.loaded`` streams decode
    on that pair's decode instance; per-connector medians and per-prompt ratios."""
    rows: dict[str, dict[str, list[float]]] = {c: {} for c in pairs}
    threads: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        for pair in pairs.values():
            await one(client, pair, model, [rng.randrange(1, 250) for _ in range(64)], 2)  # handshakes
        if "akv" in pairs:  # akv's threads while nothing is in flight: CPU and wake-ups per second
            insts = {"prefill": pairs["akv"].prefill, "decode": pairs["akv"].decode}
            await asyncio.sleep(1.0)
            before = {role: akv_threads(i.proc.pid) for role, i in insts.items()}
            await asyncio.sleep(args.idle_s)
            for role, i in insts.items():
                cpu, wake = akv_threads(i.proc.pid)
                threads[f"{role}_idle_cpu_pct"] = round((cpu - before[role][0]) / args.idle_s * 100, 2)
                threads[f"{role}_idle_wakeups_per_s"] = round((wake - before[role][1]) / args.idle_s, 1)
            loaded_from = {role: akv_threads(i.proc.pid) for role, i in insts.items()}
        for i, tokens in enumerate(prompts):
            order = list(pairs) if i % 2 == 0 else list(reversed(pairs))
            for conn in order:
                pair = pairs[conn]
                want, _ = await colocated(client, pair.prefill, model, tokens, args.max_tokens)
                stop, gaps = asyncio.Event(), []
                load = [
                    asyncio.create_task(
                        load_stream(
                            client,
                            pair.decode,
                            model,
                            [rng.randrange(1, 250) for _ in range(32)],
                            args.load_tokens,
                            stop,
                            gaps,
                        )
                    )
                    for _ in range(args.loaded)
                ]
                await asyncio.sleep(0.5)  # the load streams are decoding
                gaps.clear()
                got = await one(client, pair, model, tokens, args.max_tokens)
                stop.set()
                await asyncio.gather(*load)
                row = rows[conn]
                for k in ("ttft_ms", "decode_ttft_ms", "itl_ms"):
                    row.setdefault(k, []).append(got[k])
                row.setdefault("load_itl_ms", []).append(statistics.median(gaps) if gaps else float("nan"))
                row.setdefault("equal", []).append(float(got["tokens"] == want))
            print(f"loaded: prompt {i + 1}/{len(prompts)} ({len(tokens)} tokens) done", flush=True)
        if "akv" in pairs:  # akv's threads over the loaded phase, per request through the akv pair
            for role, i in insts.items():
                cpu, wake = akv_threads(i.proc.pid)
                threads[f"{role}_cpu_ms_per_request"] = round(
                    (cpu - loaded_from[role][0]) * 1e3 / len(prompts), 2
                )
                threads[f"{role}_wakeups_per_request"] = round(
                    (wake - loaded_from[role][1]) / len(prompts), 1
                )
    out: dict[str, Any] = {c: summarize({"loaded": rows[c]})["loaded"] for c in pairs}
    if threads:
        out["akv_threads"] = threads
    if "akv" in rows and "nixl-tuned" in rows:
        a, b = rows["akv"], rows["nixl-tuned"]
        out["paired"] = {
            k: med([x / y for x, y in zip(a[k], b[k], strict=True) if y > 0 and not math.isnan(x)])
            for k in ("ttft_ms", "decode_ttft_ms", "itl_ms", "load_itl_ms")
        }
    out["per_prompt"] = rows  # per connector, per figure, one value per prompt (pool runs with these)
    return out


async def colocated(
    client: httpx.AsyncClient, inst: Instance, model: str, tokens: list[int], max_tokens: int
) -> tuple[list[int], float]:
    body = {
        "model": model,
        "prompt": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "max_tokens": max_tokens,
        "stream": True,
        "cache_salt": f"colocated-{random.random()}",
    }
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
    xs = [x for x in xs if not math.isnan(x)]  # a stream of one token has no gap
    return round(statistics.median(xs), 2) if xs else float("nan")


async def measure(
    pair: Pair,
    model: str,
    args: argparse.Namespace,
    prompts: dict[str, list[list[int]]],
    rows: dict[str, dict[str, list[float]]],
) -> None:
    """Send ``prompts`` (per length, and ``"concurrent"``) through one pair; append to ``rows``."""
    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, pair, model, prompts["warmup"][0], 2)  # first handshake, first forward passes
        for n in args.lengths:
            row = rows.setdefault(str(n), {})
            for tokens in prompts[str(n)]:
                want, co_ttft = await colocated(client, pair.prefill, model, tokens, args.max_tokens)
                before = await histogram(client, pair.decode, XFER_METRIC[pair.connector])
                got = await one(client, pair, model, tokens, args.max_tokens)
                await asyncio.sleep(1.2)  # vLLM publishes connector stats on an interval
                after = await histogram(client, pair.decode, XFER_METRIC[pair.connector])
                for k in ("ttft_ms", "decode_ttft_ms", "tok_s"):
                    row.setdefault(k, []).append(got[k])
                row.setdefault("colocated_ttft_ms", []).append(co_ttft)
                if after[1] > before[1]:
                    row.setdefault("transfer_ms", []).append(
                        (after[0] - before[0]) / (after[1] - before[1]) * 1e3
                    )
                row.setdefault("equal", []).append(float(got["tokens"] == want))
        if prompts.get("concurrent"):
            row = rows.setdefault("concurrent", {})
            t0 = time.perf_counter()
            got = await asyncio.gather(
                *(one(client, pair, model, t, args.max_tokens) for t in prompts["concurrent"])
            )
            row.setdefault("wall_s", []).append(time.perf_counter() - t0)
            for g, t in zip(got, prompts["concurrent"], strict=True):
                want, _ = await colocated(client, pair.prefill, model, t, args.max_tokens)
                row.setdefault("ttft_ms", []).append(g["ttft_ms"])
                row.setdefault("decode_ttft_ms", []).append(g["decode_ttft_ms"])
                row.setdefault("equal", []).append(float(g["tokens"] == want))


def summarize(rows: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, row in rows.items():
        summary: dict[str, Any] = {k: med(v) for k, v in row.items() if k != "equal"}
        summary["equal"] = f"{int(sum(row['equal']))}/{len(row['equal'])}"
        out[key] = summary
    return out


def idle_cpu(pair: Pair, seconds: float) -> dict[str, float]:
    """Percent of one core each instance of ``pair`` (its whole process tree) uses while idle."""
    time.sleep(2.0)
    insts = {"prefill": pair.prefill, "decode": pair.decode}
    before = {role: cpu_seconds(i.proc.pid) for role, i in insts.items()}
    time.sleep(seconds)
    return {
        role: round((cpu_seconds(i.proc.pid) - before[role]) / seconds * 100, 1) for role, i in insts.items()
    }


def start_pair(conn: str, model: str, logs: Path, args: argparse.Namespace) -> Pair:
    kw: dict[str, Any] = dict(model=model, kv_space_gib=1, vllm_args=args.vllm_args)
    p = start(
        logs / f"{conn}-prefill.log",
        connector=conn,
        role="prefill",
        http_port=free_port(),
        core=0,
        akv_port=free_port(),
        nixl_port=free_port(),
        **kw,
    )
    d = start(
        logs / f"{conn}-decode.log",
        connector=conn,
        role="decode",
        http_port=free_port(),
        core=1,
        akv_port=free_port(),
        nixl_port=free_port(),
        **kw,
    )
    try:
        wait_ready([p, d], timeout=600)
    except BaseException:
        p.stop()
        d.stop()
        raise
    return Pair(conn, p, d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="AkvConnector against NixlConnector in real vLLM instances")
    ap.add_argument("--model", help="a model directory (default: build the tiny Llama)")
    ap.add_argument("--lengths", default="256,1024,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=6, help="requests per length and connector")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--concurrency", type=int, default=4, help="concurrent requests of the middle length (1: skip)"
    )
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument(
        "--connectors", default="akv,nixl-tuned,nixl", help="which to run, in this order each round"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds; each starts every connector's pair in turn, alone, and sends it its share of the requests",
    )
    ap.add_argument("--fast", action="store_true", help="start vLLM with -O0 (no graph compilation)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", type=Path, help="keep the instances' logs in this directory")
    ap.add_argument(
        "--loaded",
        type=int,
        default=0,
        metavar="N",
        help="measure under load: both pairs at once, N streams decoding beside each request (0: off)",
    )
    ap.add_argument("--load-tokens", type=int, default=512, help="output tokens of each load stream")
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
    if bad or not connectors or args.reps < 1 or not 1 <= args.rounds <= args.reps:
        print(
            f"bench: --connectors {args.connectors!r} / --reps {args.reps}: use akv, nixl-tuned, nixl; 1 <= rounds <= reps",
            file=sys.stderr,
        )
        return 64
    if args.loaded < 0 or (args.loaded and sorted(connectors) != ["akv", "nixl-tuned"]):
        print(
            f"bench: --loaded {args.loaded} --connectors {args.connectors!r}: --loaded N >= 0 runs with "
            "--connectors akv,nixl-tuned",
            file=sys.stderr,
        )
        return 64
    args.vllm_args = ["-O0"] if args.fast else []
    if args.loaded:
        return run_loaded(args, connectors)
    with tempfile.TemporaryDirectory(prefix="akv-vllm-bench-") as tmp:
        model = args.model or str(Path(tmp) / "model")
        if args.model is None:
            subprocess.run(
                [sys.executable, str(HERE / "tiny_model.py"), model], check=True, capture_output=True
            )
        logs = args.logs or Path(tmp) / "logs"
        figures: dict[str, Any] = {
            "model": "tiny llama (4 layers, hidden 256, 4 KV heads)" if args.model is None else model,
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "logs")},
        }
        rng = random.Random(args.seed)
        per_round = [args.reps // args.rounds + (r < args.reps % args.rounds) for r in range(args.rounds)]
        rounds = [
            {
                "warmup": [[rng.randrange(1, 250) for _ in range(64)]],
                **{
                    str(n): [[rng.randrange(1, 250) for _ in range(n)] for _ in range(k)]
                    for n in args.lengths
                },
                "concurrent": [
                    [rng.randrange(1, 250) for _ in range(args.lengths[len(args.lengths) // 2])]
                    for _ in range(args.concurrency if args.concurrency > 1 else 0)
                ],
            }
            for k in per_round
        ]
        rows: dict[str, dict[str, dict[str, list[float]]]] = {c: {} for c in connectors}
        idle: dict[str, dict[str, list[float]]] = {c: {} for c in connectors}
        for r, prompts in enumerate(rounds):
            for conn in connectors:  # one pair at a time, the same prompts, rounds interleaved
                print(
                    f"round {r + 1}/{args.rounds}: {conn} (prefill on core 0, decode on core 1)", flush=True
                )
                pair = start_pair(conn, model, logs / f"round{r}", args)
                try:
                    for role, pct in idle_cpu(pair, args.idle_s).items():
                        idle[conn].setdefault(role, []).append(pct)
                    asyncio.run(measure(pair, model, args, prompts, rows[conn]))
                finally:
                    pair.prefill.stop()
                    pair.decode.stop()
        figures["idle_cpu_pct"] = {c: {role: med(v) for role, v in idle[c].items()} for c in connectors}
        figures["results"] = {c: summarize(rows[c]) for c in connectors}
        for conn in connectors:
            i = figures["idle_cpu_pct"][conn]
            print(f"{conn:>10} idle CPU: prefill {i['prefill']} %, decode {i['decode']} % of a core")
            for key, summary in figures["results"][conn].items():
                label = (
                    f"{args.concurrency}x{args.lengths[len(args.lengths) // 2]} concurrent"
                    if key == "concurrent"
                    else f"{key} tokens"
                )
                print(f"{conn:>10} {label}: " + "  ".join(f"{k} {v}" for k, v in summary.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    res = figures.get("results", {})
    if "akv" in res and "nixl-tuned" in res:
        for n in map(str, args.lengths):
            a, b = res["akv"][n], res["nixl-tuned"][n]
            print(
                f"ratio akv / nixl-tuned at {n} tokens: ttft {a['ttft_ms'] / b['ttft_ms']:.2f}, "
                f"decode_ttft {a['decode_ttft_ms'] / b['decode_ttft_ms']:.2f}",
                flush=True,
            )
    return 0


def run_loaded(args: argparse.Namespace, connectors: list[str]) -> int:
    """``--loaded N``: both pairs at once, every prompt through each under load (see the module)."""
    with tempfile.TemporaryDirectory(prefix="akv-vllm-bench-") as tmp:
        model = args.model or str(Path(tmp) / "model")
        if args.model is None:
            subprocess.run(
                [sys.executable, str(HERE / "tiny_model.py"), model], check=True, capture_output=True
            )
        logs = args.logs or Path(tmp) / "logs"
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(1, 250) for _ in range(n)] for n in args.lengths for _ in range(args.reps)]
        rng.shuffle(prompts)
        print(
            f"loaded: {' and '.join(connectors)} pairs at once (prefills on core 0, decodes on core 1), "
            f"{args.loaded} load streams per request",
            flush=True,
        )
        pairs: dict[str, Pair] = {}
        try:
            for conn in connectors:
                pairs[conn] = start_pair(conn, model, logs, args)
            figures = {
                "model": "tiny llama (4 layers, hidden 256, 4 KV heads)" if args.model is None else model,
                "args": {k: v for k, v in vars(args).items() if k not in ("json", "logs")},
                "loaded": asyncio.run(measure_loaded(pairs, model, args, prompts, rng)),
            }
        finally:
            for pair in pairs.values():
                pair.prefill.stop()
                pair.decode.stop()
    for key, summary in figures["loaded"].items():
        if key != "per_prompt":
            print(f"{key:>10} under load: " + "  ".join(f"{k} {v}" for k, v in summary.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
