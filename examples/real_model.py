"""A real model through akv: disaggregated generation equals colocated generation.

A small, randomly initialised model of a real architecture (transformers' own model code,
fixed seed, float32) prefills a prompt of random token ids in this process. Each layer's
KV (and, for state layers, the conv and recurrent state) is copied out of the model's cache
object into akv's paged cache of every prefill TP rank, in the prefill layout and block size
asked for, and exposed. Separate decode processes, one per decode TP rank, pull it with akv
into their own layout and block size (after a partial prefix hit, if asked, whose blocks
they hold already); decode rank 0 assembles the ranks' head slices back into full heads,
rebuilds the model's cache object from them and generates greedily. The tokens must equal
those of the colocated run (prefill and decode in one cache object) exactly.

The cache description comes from the model's own config (`akv.presets.from_hf_config`).

    python examples/real_model.py --arch qwen3-next --prefill-tp 2 --decode-tp 4 \\
        --prompt-tokens 45 --new-tokens 8 --seed 0 --json

The last line is a JSON object with ``match`` (the tokens equal the colocated run's),
``tokens``, ``max_logit_diff`` (over the decode steps) and more. The exit code is 0 only
if the tokens match, the logits differ by at most ``--tolerance`` (0: bit-identical, as on
CPU), replicated heads agree and the prefill released the request; 64 means a flag to
change (one line on stderr). Needs ``pip install -e '.[models]'`` (transformers).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

import akv
from akv.errors import AkvError, ConfigError
from akv.geometry.cache import LAYOUTS, check_peer
from akv.presets import from_hf_config
from akv.testing import ajson_lines, local_counts

if sys.version_info < (3, 11):  # pragma: no cover - anyio brings the backport
    from exceptiongroup import BaseExceptionGroup

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 64
REQUEST = "real-model-0"

# -- architectures: tiny configs of real model classes ---------------------------------------


def _llama() -> tuple[Any, Any, dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    # GQA: 24 query heads over 12 KV heads, so TP 1, 2, 3, 4, 6 and 12 all split the KV heads.
    return LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=96, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=24, num_key_value_heads=12, head_dim=8,
    )  # fmt: skip


def _gemma3() -> tuple[Any, Any, dict[str, Any]]:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # Sliding (window 16) and full layers, 4 KV heads.
    return Gemma3TextConfig, Gemma3ForCausalLM, dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
        num_hidden_layers=4, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip


def _qwen3_next() -> tuple[Any, Any, dict[str, Any]]:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # Gated DeltaNet (4 key heads, 8 value heads) and full attention (2 KV heads: replicated at TP 4).
    return Qwen3NextConfig, Qwen3NextForCausalLM, dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    )  # fmt: skip


def _nemotron_h() -> tuple[Any, Any, dict[str, Any]]:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    # Mamba2 (8 heads of 8, 4 groups, state 8), attention (4 KV heads) and an MLP layer (no cache).
    return NemotronHConfig, NemotronHForCausalLM, dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
        mamba_num_heads=8, mamba_head_dim=8, n_groups=4, ssm_state_size=8, conv_kernel=4,
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
    )  # fmt: skip


ARCHS: dict[str, Callable[[], tuple[Any, Any, dict[str, Any]]]] = {
    "llama": _llama,
    "gemma3": _gemma3,
    "qwen3-next": _qwen3_next,
    "nemotron-h": _nemotron_h,
}
VOCAB = 128


def build_model(arch: str, seed: int, device: str) -> Any:
    """The architecture's model, randomly initialised from ``seed``, float32, in eval mode."""
    config_cls, model_cls, kwargs = ARCHS[arch]()
    torch.manual_seed(seed)
    model = model_cls(config_cls(vocab_size=VOCAB, **kwargs))
    return model.to(device=device, dtype=torch.float32).eval()


def cache_spec(model: Any, a: argparse.Namespace, side: str) -> akv.CacheSpec:
    """akv's description of the model's cache, from the model's own config, on one side."""
    return from_hf_config(
        model.config.to_dict(),
        blocks=a.blocks,
        block_size=getattr(a, f"{side}_block_size") or a.block_size,
        dtype="float32",
        layout=getattr(a, f"{side}_layout") or a.layout,
    )


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.no_grad()
def step(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """One forward over ``ids`` (1, T) with ``cache``; the logits of the last position."""
    # transformers 5 names the argument `cache` (`past_key_values` before it)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True, **{key: cache})
    return out.logits[0, -1].float()


def greedy(model: Any, first: int, cache: Any, steps: int) -> tuple[list[int], torch.Tensor]:
    """``steps`` greedy tokens after ``first`` (already generated) with ``cache``; the tokens
    (``first`` included) and each step's logits."""
    tokens, logits = [first], []
    device = next(model.parameters()).device
    for _ in range(steps):
        row = step(model, torch.tensor([[tokens[-1]]], device=device), cache)
        logits.append(row.cpu())
        tokens.append(int(row.argmax()))
    return tokens, torch.stack(logits) if logits else torch.empty(0, VOCAB)


# -- the model's cache object <-> akv's units -------------------------------------------------
#
# A "units" tensor holds one component of one layer in akv's terms: (units, tokens, elems) for
# token groups, (units, elems) for state groups, every unit of the model (full heads).


def _conv_parts(group: akv.Group, taps: int) -> tuple[list[akv.Component], list[int], akv.Component]:
    """A state group's conv components with their channel counts (each channel holds ``taps``
    elements), and its recurrent-state component."""
    conv = [c for c in group.components if c.tensor == "conv"]
    state = next(c for c in group.components if not c.tensor)
    return conv, [c.units * c.unit_elems // taps for c in conv], state


def extract(cache: Any, spec: akv.CacheSpec, num_tokens: int) -> dict[tuple[int, str], torch.Tensor]:
    """Every cached layer's components, in akv's units, out of the model's cache object.
    Sliding layers keep only their last tokens: the older ones are NaN."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    for group in spec.groups:
        for layer in group.layers:
            hf = cache.layers[layer]
            if group.tokens:
                for name, t in (("k", hf.keys), ("v", hf.values)):
                    kept = t[0].float().cpu()  # (heads, kept tokens, dim), copied just below
                    seq = torch.full((kept.shape[0], num_tokens, kept.shape[2]), float("nan"))
                    seq[:, num_tokens - kept.shape[1] :] = kept
                    out[layer, name] = seq
                continue
            # copies: the model updates its state tensors in place on every step
            conv_state = hf.conv_states[0][0].float().cpu().clone()  # (channels, kernel)
            taps = conv_state.shape[-1] - 1  # the next step reads only the last kernel - 1 taps
            conv, channels, state = _conv_parts(group, taps)
            for comp, piece in zip(conv, torch.split(conv_state[:, -taps:], channels), strict=True):
                out[layer, comp.name] = piece.reshape(comp.units, -1)
            out[layer, state.name] = hf.recurrent_states[0][0].float().cpu().clone().reshape(state.units, -1)
    return out


def rebuild(model: Any, spec: akv.CacheSpec, units: dict[tuple[int, str], torch.Tensor]) -> Any:
    """The model's cache object, rebuilt from full-head units through its public update calls.
    The state tensors' shapes are the model's own (from a cache after a one-token step)."""
    shapes = step_cache(model)
    cache = new_cache(model)
    device = next(model.parameters()).device
    for group in spec.groups:
        for layer in group.layers:
            if group.tokens:
                k, v = (units[layer, c].to(device)[None] for c in ("k", "v"))
                cache.update(k, v, layer)  # a sliding layer keeps its last window - 1 tokens
                continue
            kernel = shapes.layers[layer].conv_states[0].shape[-1]  # (1, channels, kernel)
            conv, _, state = _conv_parts(group, kernel - 1)
            taps = torch.cat([units[layer, c.name].reshape(-1, kernel - 1) for c in conv])
            first = torch.zeros(taps.shape[0], 1)  # the oldest tap of the kernel-wide state: never read
            conv_state = torch.cat([first, taps], 1).to(device)[None]
            cache.update_conv_state(conv_state, layer, conv_kernel_size=kernel)
            rec = units[layer, state.name].reshape(shapes.layers[layer].recurrent_states[0].shape)
            cache.update_recurrent_state(rec.to(device), layer)
    return cache


def step_cache(model: Any) -> Any:
    """A cache object after a one-token step (its state layers have the model's shapes)."""
    cache = new_cache(model)
    device = next(model.parameters()).device
    step(model, torch.zeros((1, 1), dtype=torch.long, device=device), cache)
    return cache


# -- akv's paged cache: write and read one rank's slice -----------------------------------------


def positions(group: akv.Group, count: int, num_tokens: int) -> list[int]:
    """Sequence positions of a request's last ``count`` blocks of ``group``."""
    total = -(-num_tokens // group.block_size)
    return list(range(total - count, total))


def write_rank(
    views: dict[str, list[dict[str, torch.Tensor]]],
    spec: akv.CacheSpec,
    rank: int,
    size: int,
    ids: dict[str, list[int]],
    units: dict[tuple[int, str], torch.Tensor],
    num_tokens: int,
) -> None:
    """Copy this rank's units of every layer into its blocks ``ids`` (the last blocks of the
    sequence, per group), through akv's per-layer views."""
    for group in spec.groups:
        if group.name not in ids:
            continue
        for i, layer in enumerate(group.layers):
            for comp in group.components:
                held = comp.held(rank, size)
                src = units[layer, comp.name][held.start : held.stop]
                view = views[group.name][i][comp.name]
                if not group.tokens:
                    view[ids[group.name][0]] = src.to(view.device)
                    continue
                bs = group.block_size
                for block, pos in zip(ids[group.name], positions(group, len(ids[group.name]), num_tokens),
                                      strict=True):  # fmt: skip
                    part = src[:, pos * bs : min((pos + 1) * bs, num_tokens)]
                    view[block, :, : part.shape[1]] = part.to(view.device)


def read_rank(
    views: dict[str, list[dict[str, torch.Tensor]]],
    spec: akv.CacheSpec,
    ids: dict[str, list[int]],
    num_tokens: int,
) -> dict[tuple[int, str], torch.Tensor]:
    """This rank's units of every layer out of its blocks ``ids`` (token groups: tokens of
    blocks not listed are NaN)."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    for group in spec.groups:
        for i, layer in enumerate(group.layers):
            for comp in group.components:
                view = views[group.name][i][comp.name]
                if not group.tokens:
                    out[layer, comp.name] = view[ids[group.name][0]].cpu().clone()
                    continue
                bs, n = group.block_size, len(ids[group.name])
                seq = torch.full((view.shape[1], num_tokens, view.shape[3]), float("nan"))
                for block, pos in zip(ids[group.name], positions(group, n, num_tokens), strict=True):
                    stop = min((pos + 1) * bs, num_tokens)
                    seq[:, pos * bs : stop] = view[block, :, : stop - pos * bs].cpu()
                out[layer, comp.name] = seq
    return out


def assemble(
    spec: akv.CacheSpec, size: int, dumps: list[dict[tuple[int, str], torch.Tensor]]
) -> tuple[dict[tuple[int, str], torch.Tensor], bool]:
    """Full-head units from every decode rank's slice; and whether replicas (a unit held by
    several ranks) agree bit for bit."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    agree = True
    for group in spec.groups:
        for layer in group.layers:
            for comp in group.components:
                parts: dict[int, torch.Tensor] = {}
                for rank, dump in enumerate(dumps):
                    held = comp.held(rank, size)
                    for j, unit in enumerate(held):
                        got = dump[layer, comp.name][j]
                        if unit in parts:
                            agree &= torch.equal(parts[unit].view(torch.int32), got.view(torch.int32))
                        else:
                            parts[unit] = got
                out[layer, comp.name] = torch.stack([parts[u] for u in range(comp.units)])
    return out, agree


def pick(pool: int, count: int, rng: np.random.Generator) -> list[int]:
    """``count`` distinct blocks of a ``pool``, shuffled (a fragmented allocator)."""
    return [int(x) for x in rng.permutation(pool)[:count]]


def transfer_options(a: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for Producer and Consumer from the transfer flags.

    Hook: the transfer-path flags (``--transfer``, ``--mode``) of the ``akv`` command line
    go here once the library has them; every flag of this script reaches the decode
    processes unchanged (see `decode_argv`).
    """
    return {}


# -- prefill: this process ---------------------------------------------------------------------


async def prefill(a: argparse.Namespace) -> int:
    """The prefill engine; the decode engine's ranks start first and wait for the request."""
    results: dict[int, dict[str, Any]] = {}
    async with anyio.create_task_group() as tg:
        decoded = await tg.start(run_decode_ranks, a, results)
        return await serve_prefill(a, results, decoded)
    raise AssertionError("unreachable")  # pragma: no cover


async def serve_prefill(
    a: argparse.Namespace, results: dict[int, dict[str, Any]], decoded: anyio.Event
) -> int:
    started = time.monotonic()
    model = build_model(a.arch, a.seed, a.device)
    spec = cache_spec(model, a, "prefill")
    dspec = cache_spec(model, a, "decode")
    for side, s, tp in (("--prefill-tp", spec, a.prefill_tp), ("--decode-tp", dspec, a.decode_tp)):
        try:
            s.check_rank(0, tp)
        except ConfigError as exc:
            raise ConfigError(f"{side} {tp}: {exc}") from None
    check_peer(dspec, spec)
    n = a.prompt_tokens
    gen = torch.Generator().manual_seed(a.seed + 1)
    prompt = torch.randint(0, VOCAB, (1, n), generator=gen).to(a.device)

    cache = new_cache(model)
    first = int(step(model, prompt, cache).argmax())  # the prefill's first token
    units = extract(cache, spec, n)  # copied out before decode steps change the cache object
    # Colocated: the same cache object decodes on.
    ref_tokens, ref_logits = greedy(model, first, cache, a.new_tokens - 1)

    work = Path(a.workdir)
    work.joinpath("decode-spec.json").write_bytes(dspec.to_json())
    full = next((g for g in dspec.groups if g.kind == "full"), None)
    hit_tokens = 0
    if a.prefix_hit:  # an earlier request with the same prefix left its KV in decode's cache
        if full is None:
            raise ConfigError(f"--prefix-hit: {a.arch} has no full-attention group to hit")
        hit_tokens = a.prefix_hit * full.block_size
        if hit_tokens >= n:
            raise ConfigError(
                f"--prefix-hit {a.prefix_hit} blocks of {full.block_size} tokens cover the whole "
                f"{n}-token prompt: a hit must leave tokens to pull"
            )
        pcache = new_cache(model)
        step(model, prompt[:, :hit_tokens], pcache)
        pre = extract(pcache, dspec, hit_tokens)
        torch.save({k: v for k, v in pre.items() if k[0] in full.layers}, work / "prefix.pt")
    torch.save({"tokens": ref_tokens, "logits": ref_logits}, work / "reference.pt")

    rng = np.random.default_rng(a.seed)
    need = local_counts(spec, n)
    remote = {g.name: pick(g.num_blocks, need[g.name], rng) for g in spec.groups}
    released = anyio.Event()
    count = {"released": 0}

    def on_release(release: akv.EngineRelease) -> None:
        count["released"] += 1
        released.set()

    releases = akv.EngineReleases(a.prefill_tp, on_release)
    engine = f"prefill-{os.getpid()}"
    async with AsyncExitStack() as stack:
        producers: list[akv.Producer] = []
        for r in range(a.prefill_tp):
            kv = akv.allocate_kv_cache(spec, r, a.prefill_tp, device=a.device)
            write_rank(akv.layer_views(kv, spec, r, a.prefill_tp), spec, r, a.prefill_tp, remote, units, n)
            producers.append(await stack.enter_async_context(akv.Producer(
                kv, spec, tp_rank=r, tp_size=a.prefill_tp, engine_id=engine,
                bootstrap=producers[0].endpoint if r else None, on_release=releases.rank(r),
                **transfer_options(a),
            )))  # fmt: skip
        for producer in producers:
            producer.expose(REQUEST, remote)
        announce = {
            "request_id": REQUEST,
            "engine": str(producers[0].endpoint),
            "remote": remote,
            "num_tokens": n,
            "first_token": first,
        }
        (work / "request.json").write_text(json.dumps(announce))
        with anyio.move_on_after(a.timeout):
            await decoded.wait()
        if not decoded.is_set():
            results[0] = {"error": f"decode did not finish within --timeout {a.timeout} s"}
        with anyio.move_on_after(a.timeout):
            await released.wait()
    result = results.get(0, {})
    tokens = result.get("tokens", [])
    summary = {
        "event": "summary",
        "arch": a.arch,
        "match": bool(result.get("match")),
        "exact": result.get("max_logit_diff") is not None and result["max_logit_diff"] <= a.tolerance,
        "tokens": tokens,
        "reference_tokens": ref_tokens,
        "max_logit_diff": result.get("max_logit_diff"),
        "replicas_agree": result.get("replicas_agree"),
        "prefill_tp": a.prefill_tp,
        "decode_tp": a.decode_tp,
        "prompt_tokens": n,
        "new_tokens": a.new_tokens,
        "prefix_hit_tokens": hit_tokens,
        "groups": {g.name: g.kind for g in spec.groups},
        "prefill_layout": spec.groups[0].layout,
        "decode_layout": dspec.groups[0].layout,
        "prefill_block_size": spec.groups[0].block_size,
        "decode_block_size": dspec.groups[0].block_size,
        "bytes": sum(r.get("bytes", 0) for r in results.values()),
        "released": count["released"] == 1,
        "decode_exit_codes": [results.get(d, {}).get("code") for d in range(a.decode_tp)],
        "seconds": round(time.monotonic() - started, 3),
    }
    errors = [r["error"] for r in results.values() if r.get("error")]
    if errors:
        summary["errors"] = errors
    report(a, summary)
    ok = summary["match"] and summary["exact"] and summary["released"] and summary["replicas_agree"]
    return EXIT_OK if ok else EXIT_FAILED


def decode_argv(a: argparse.Namespace, rank: int) -> list[str]:
    """This script's command line for decode rank ``rank`` (every flag of the user's passes on)."""
    return [sys.executable, os.path.abspath(__file__), *a.argv, "--role", "decode", "--tp-rank", str(rank),
            "--workdir", a.workdir]  # fmt: skip


async def run_decode_ranks(
    a: argparse.Namespace, results: dict[int, dict[str, Any]], *, task_status: Any = anyio.TASK_STATUS_IGNORED
) -> None:
    """Start every decode rank as its own process (reports an Event set once all exited);
    collect each one's last JSON line and exit code into ``results``."""
    done = anyio.Event()
    procs = [await anyio.open_process(decode_argv(a, rank), stderr=None) for rank in range(a.decode_tp)]
    task_status.started(done)

    async def one(rank: int, proc: Any) -> None:
        async with proc:
            async for msg in ajson_lines(proc.stdout, lambda line: print(line, file=sys.stderr)):
                results[rank] = msg
            code = await proc.wait()
        results.setdefault(rank, {})["code"] = code
        if code and not results[rank].get("error"):
            results[rank]["error"] = f"decode rank {rank} exited with {code}"

    async with anyio.create_task_group() as tg:
        for rank, proc in enumerate(procs):
            tg.start_soon(one, rank, proc)
    done.set()


# -- decode: one process per rank ----------------------------------------------------------------


async def decode(a: argparse.Namespace) -> int:
    try:
        return await _decode(a)
    except (AkvError, TimeoutError) as exc:
        error = f"decode rank {a.tp_rank}: {type(exc).__name__}: {exc}"
        print(
            json.dumps({"event": "result", "tp_rank": a.tp_rank, "match": False, "error": error}), flush=True
        )
        return EXIT_FAILED


async def _decode(a: argparse.Namespace) -> int:
    work = Path(a.workdir)
    rank, size = a.tp_rank, a.decode_tp
    # Rank 0 runs the model: build it while the prefill engine computes.
    model = build_model(a.arch, a.seed, a.device) if rank == 0 else None
    parent = os.getppid()
    with anyio.fail_after(a.timeout):  # the request's announcement (a router's job)
        while not (work / "request.json").exists():
            if os.getppid() != parent:
                raise ConfigError("the prefill process is gone")
            await anyio.sleep(0.05)
    announce = json.loads((work / "request.json").read_text())
    n = int(announce["num_tokens"])
    # The cache description only: decode ranks other than 0 never build the model.
    spec = akv.CacheSpec.from_json((work / "decode-spec.json").read_bytes())
    kv = akv.allocate_kv_cache(spec, rank, size, device=a.device)
    views = akv.layer_views(kv, spec, rank, size)
    rng = np.random.default_rng(1000 + rank)
    full = next((g for g in spec.groups if g.kind == "full"), None)
    hit = a.prefix_hit if full is not None else 0
    counts = local_counts(spec, n)  # every block the request has on this side
    local = {g.name: pick(g.num_blocks, counts[g.name], rng) for g in spec.groups}
    pulled = dict(local)
    if hit and full is not None:
        # The first `hit` blocks of the full group hold the prefix already: fill them from the
        # prefix cache, and pull only the rest.
        prefix = torch.load(work / "prefix.pt")
        cached = {full.name: local[full.name][:hit]}
        write_rank(views, spec, rank, size, cached, prefix, hit * full.block_size)
        pulled[full.name] = local[full.name][hit:]
    async with akv.Consumer(kv, spec, tp_rank=rank, tp_size=size, engine_id=a.engine_id,
                            **transfer_options(a)) as consumer:  # fmt: skip
        session = await consumer.connect(announce["engine"])
        transfer = await session.pull(REQUEST, pulled, announce["remote"], num_tokens=n)
        result = await transfer
    mine = read_rank(views, spec, local, n)
    torch.save(mine, work / f"rank{rank}.pt.tmp")
    os.replace(work / f"rank{rank}.pt.tmp", work / f"rank{rank}.pt")
    line: dict[str, Any] = {"event": "pulled", "tp_rank": rank, "bytes": result.bytes, "reads": result.reads}
    if rank:
        print(json.dumps(line), flush=True)
        return EXIT_OK
    # Rank 0 runs the model: gather every rank's slice (a stand-in for the TP all-gather).
    with anyio.fail_after(a.timeout):  # files written by other processes: poll
        while not all((work / f"rank{d}.pt").exists() for d in range(size)):  # noqa: ASYNC110
            await anyio.sleep(0.05)
    dumps = [mine] + [torch.load(work / f"rank{d}.pt") for d in range(1, size)]
    units, agree = assemble(spec, size, dumps)
    if a.fault == "swap-kv":  # tests: a K/V swap must not pass
        layer = next(g for g in spec.groups if g.tokens).layers[0]
        units[layer, "k"], units[layer, "v"] = units[layer, "v"], units[layer, "k"]
    assert model is not None
    cache = rebuild(model, spec, units)
    tokens, logits = greedy(model, int(announce["first_token"]), cache, a.new_tokens - 1)
    ref = torch.load(work / "reference.pt")
    diff = float((logits - ref["logits"]).abs().max()) if logits.numel() else 0.0
    line.update(
        event="result",
        tokens=tokens,
        match=tokens == ref["tokens"] and agree,
        max_logit_diff=diff,
        replicas_agree=agree,
    )
    print(json.dumps(line), flush=True)
    return EXIT_OK if line["match"] else EXIT_FAILED


# -- command line --------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--arch", choices=list(ARCHS), default="llama", help="architecture (default: %(default)s)")
    p.add_argument("--prefill-tp", type=int, default=2, metavar="P", help="prefill TP size (default: 2)")
    p.add_argument("--decode-tp", type=int, default=1, metavar="D", help="decode TP size (default: 1)")
    p.add_argument("--prompt-tokens", type=int, default=45, metavar="N", help="prompt length (default: 45)")
    p.add_argument("--new-tokens", type=int, default=8, metavar="M", help="tokens to generate (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompt (default: 0)")
    p.add_argument(
        "--prefix-hit",
        type=int,
        default=0,
        metavar="B",
        help="decode holds the first B blocks of the full-attention group already (default: 0)",
    )
    p.add_argument("--layout", choices=list(LAYOUTS), default="HND",
                   help="both sides' layout (default: %(default)s)")  # fmt: skip
    p.add_argument("--prefill-layout", choices=list(LAYOUTS), help="prefill's layout")
    p.add_argument("--decode-layout", choices=list(LAYOUTS), help="decode's layout")
    p.add_argument("--block-size", type=int, default=16, help="both sides' tokens per block (default: 16)")
    p.add_argument("--prefill-block-size", type=int, help="prefill's tokens per block")
    p.add_argument("--decode-block-size", type=int, help="decode's tokens per block")
    p.add_argument("--blocks", type=int, default=32, help="blocks per group pool (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device of the model and both caches (default: cpu)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="largest logit difference from the colocated run that still passes (default: 0, bit-identical "
        "on CPU; raise it where kernels are not reproducible across processes)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up (default: 120)")
    p.add_argument("--json", action="store_true", help="the summary as one JSON line, last")
    p.add_argument("--role", choices=("prefill", "decode"), default="prefill", help=argparse.SUPPRESS)
    p.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--engine-id", help=argparse.SUPPRESS)
    p.add_argument("--fault", choices=("swap-kv",), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.argv = [x for x in argv]
    return a


def validate(a: argparse.Namespace) -> None:
    """Flags that need no model ([`ConfigError`][akv.errors.ConfigError] naming the flag)."""
    for flag in ("prefill_tp", "decode_tp", "prompt_tokens", "new_tokens", "block_size", "blocks"):
        if getattr(a, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    for flag in ("prefill_block_size", "decode_block_size"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if not a.tolerance >= 0:
        raise ConfigError(f"--tolerance must be >= 0, got {a.tolerance}")
    if a.prefix_hit < 0:
        raise ConfigError(f"--prefix-hit must be >= 0, got {a.prefix_hit}")
    if a.device != "cpu" and not (a.device.startswith("cuda") and torch.cuda.is_available()):
        raise ConfigError(f"--device {a.device}: use cpu, or cuda[:N] on a machine with CUDA")


def report(a: argparse.Namespace, summary: dict[str, Any]) -> None:
    if a.json:
        print(json.dumps(summary), flush=True)
        return
    status = "MATCH" if summary["match"] else "MISMATCH"
    print(
        f"{summary['arch']}: prefill TP {summary['prefill_tp']} ({summary['prefill_layout']}, "
        f"{summary['prefill_block_size']}-token blocks) -> decode TP {summary['decode_tp']} "
        f"({summary['decode_layout']}, {summary['decode_block_size']}-token blocks), "
        f"{summary['prompt_tokens']}-token prompt, prefix hit {summary['prefix_hit_tokens']} tokens"
    )
    print(f"  colocated:      {summary['reference_tokens']}")
    print(f"  disaggregated:  {summary['tokens']}")
    print(f"  {status}, max logit difference {summary['max_logit_diff']} (tolerance {a.tolerance}), "
          f"{summary['bytes']} bytes pulled")  # fmt: skip
    for error in summary.get("errors", []):
        print(f"  error: {error}")


def main(argv: list[str]) -> int:
    a = parse(argv)
    # One thread in every process: a float sum then runs in the same order in the prefill and
    # the decode process (thread counts change how CPU kernels split reductions).
    torch.set_num_threads(1)
    try:
        validate(a)
        if a.role == "decode":
            return anyio.run(decode, a)
        with tempfile.TemporaryDirectory(prefix="akv-real-model-") as work:
            a.workdir = work
            a.engine_id = f"decode-{secrets.token_hex(4)}"
            a.argv = [*a.argv, "--engine-id", a.engine_id]
            return anyio.run(prefill, a)
    except (ConfigError, BaseExceptionGroup) as exc:
        config = first_config_error(exc)
        if config is None:
            raise
        print(f"real_model.py: {config}", file=sys.stderr)
        return EXIT_USAGE


def first_config_error(exc: BaseException) -> ConfigError | None:
    """The ConfigError in ``exc``, looking inside (nested) exception groups."""
    if isinstance(exc, ConfigError):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = first_config_error(inner)
        if found is not None:
            return found
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
