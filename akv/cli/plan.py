"""``akv plan``: who reads which heads (or, per cache group, which units) from whom, who notifies whom."""

from __future__ import annotations

import argparse
from typing import Any

from akv import sharding
from akv.cli.args import EXIT_OK, described_by, emit
from akv.errors import ConfigError
from akv.geometry.cache import CacheSpec, as_cache
from akv.options import check

__all__ = ["cmd_plan"]


def _heads(r: range) -> str:
    return f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def validate(a: argparse.Namespace) -> None:
    """The flags of ``akv plan`` ([`ConfigError`][akv.errors.ConfigError] naming the flag)."""
    described = described_by(a)
    if described:
        given = [f for f, v in (("--kv-heads", a.kv_heads), ("--mla", a.mla)) if v]
        check(not given, f"{described} describes the model: drop {', '.join(given)}")
        check(a.request_key >= 0, f"--request-key must be >= 0, got {a.request_key}")
        check(not (a.config and a.layers), "--layers scales a --preset: drop it with --config")
        cache = _cache(a)
        for flag, tp in (("--prefill-tp", a.prefill_tp), ("--decode-tp", a.decode_tp)):
            check(tp >= 1, f"{flag} must be >= 1, got {tp}")
            try:
                cache.check_rank(0, tp)
            except ConfigError as exc:
                raise ConfigError(f"{flag} {tp}: {exc}") from None
        return
    check(
        a.kv_heads is not None or a.mla, "--kv-heads is required (the model's total KV heads), unless --mla"
    )
    check(a.prefill_tp >= 1, f"--prefill-tp must be >= 1, got {a.prefill_tp}")
    check(a.decode_tp >= 1, f"--decode-tp must be >= 1, got {a.decode_tp}")
    check(a.request_key >= 0, f"--request-key must be >= 0, got {a.request_key}")
    if not a.mla:
        check(a.kv_heads >= 1, f"--kv-heads must be >= 1, got {a.kv_heads}")
        for flag, tp in (("--prefill-tp", a.prefill_tp), ("--decode-tp", a.decode_tp)):
            try:
                sharding.check_heads(tp, a.kv_heads)
            except ConfigError as exc:
                raise ConfigError(f"{flag} {tp}: {exc}") from None


def _cache(a: argparse.Namespace) -> CacheSpec:
    from akv.cli.args import spec_from_args

    for name in ("blocks", "block_size", "layout", "dtype", "head_dim", "joint_kv"):
        if not hasattr(a, name):
            setattr(a, name, None)
    return as_cache(spec_from_args(a))


def _units(r: range) -> str:
    return f"unit {r.start}" if len(r) == 1 else f"units {r.start}-{r.stop - 1}"


def _groups_plan(a: argparse.Namespace) -> int:
    """Per group and component: which decode rank reads which units from which prefill rank."""
    cache = _cache(a)
    P, D, key = a.prefill_tp, a.decode_tp, a.request_key
    decode: list[dict[str, Any]] = []
    for d in range(D):
        groups = []
        for g in cache.groups:
            comps = []
            for c in g.components:
                reads = []
                for r in sharding.component_reads(d, D, P, c.units, c.shard, key):
                    mine, theirs = c.held(d, D), c.held(r.remote_rank, P)
                    glob = range(theirs.start + r.remote_heads.start, theirs.start + r.remote_heads.stop)
                    reads.append(
                        {
                            "remote_rank": r.remote_rank,
                            "units": [glob.start, glob.stop],
                            "holds": [mine.start, mine.stop],
                        }
                    )
                comps.append({"component": c.name, "shard": c.shard, "reads": reads})
            groups.append({"group": g.name, "kind": g.kind, "layers": len(g.layers), "components": comps})
        decode.append({"rank": d, "groups": groups, "notify": cache.notify_ranks(d, D, P)})
    expected = [cache.expected_notifications(p, P, D) for p in range(P)]
    if a.json:
        emit(
            {
                "prefill_tp": P,
                "decode_tp": D,
                "request_key": key,
                "groups": [g.name for g in cache.groups],
                "ranges": "half-open [start, stop)",
                "decode": decode,
                "expected_notifications": expected,
            }
        )
        return EXIT_OK
    name = a.preset or a.config or a.hf_config
    kinds = ", ".join(f"{g.name} ({g.kind}) x{len(g.layers)}" for g in cache.groups)
    print(f"{name}: {kinds}; prefill TP {P} -> decode TP {D}, request key {key} (unit ranges inclusive)")
    for entry in decode:
        print(f"decode rank {entry['rank']}:")
        for g in entry["groups"]:
            print(f"  group {g['group']} ({g['kind']}, {g['layers']} layers):")
            for c in g["components"]:
                parts = [
                    f"{_units(range(*r['units']))} from prefill rank {r['remote_rank']}" for r in c["reads"]
                ]
                print(f"    {c['component']:6s} ({c['shard']}): {'; '.join(parts)}")
        print(f"  notifies prefill ranks {', '.join(map(str, entry['notify']))}")
    print(
        "notifications each prefill rank expects per request: "
        + ", ".join(f"rank {p}: {n}" for p, n in enumerate(expected))
    )
    return EXIT_OK


def cmd_plan(a: argparse.Namespace) -> int:
    validate(a)
    if described_by(a):
        return _groups_plan(a)
    P, D, H, mla = a.prefill_tp, a.decode_tp, (1 if a.mla else a.kv_heads), a.mla
    ranks = []
    for d in range(D):
        plan = sharding.plan_reads(
            decode_rank=d, decode_tp=D, prefill_tp=P, kv_heads=H, mla=mla, request_key=a.request_key
        )
        ranks.append((d, plan))
    expected = [
        sharding.expected_notifications(prefill_rank=p, prefill_tp=P, decode_tp=D, kv_heads=H, mla=mla)
        for p in range(P)
    ]
    if a.json:
        emit(
            {
                "prefill_tp": P,
                "decode_tp": D,
                "kv_heads": H,
                "mla": mla,
                "request_key": a.request_key,
                "ranges": "half-open [start, stop)",  # the text output's ranges are inclusive
                "decode": [
                    {
                        "rank": d,
                        "reads": [
                            {
                                "remote_rank": r.remote_rank,
                                "local_heads": [r.local_heads.start, r.local_heads.stop],
                                "remote_heads": [r.remote_heads.start, r.remote_heads.stop],
                            }
                            for r in plan.reads
                        ],
                        "notify": list(plan.notify),
                    }
                    for d, plan in ranks
                ],
                "expected_notifications": expected,
            }
        )
        return EXIT_OK
    kind = "MLA (latent cache replicated on every rank)" if mla else f"{H} KV heads"
    print(f"prefill TP {P} -> decode TP {D}, {kind}, request key {a.request_key} (head ranges inclusive)")
    if not mla:
        for p in range(P):
            g = sharding.held_heads(p, P, H)
            print(f"  prefill rank {p} holds head{'s' if len(g) > 1 else ''} {_heads(g)}")
    for d, plan in ranks:
        mine = "" if mla else f" (heads {_heads(sharding.held_heads(d, D, H))})"
        print(f"decode rank {d}{mine}:")
        for r in plan.reads:
            if mla:
                print(f"  reads the whole latent cache from prefill rank {r.remote_rank}")
            else:
                g = sharding.held_heads(r.remote_rank, P, H)
                glob = range(g.start + r.remote_heads.start, g.start + r.remote_heads.stop)
                print(
                    f"  reads global head{'s' if len(glob) > 1 else ''} {_heads(glob)} from prefill rank {r.remote_rank} "
                    f"(its heads {_heads(r.remote_heads)}) into local heads {_heads(r.local_heads)}"
                )
        print(f"  notifies prefill ranks {', '.join(map(str, plan.notify))}")
    print(
        "notifications each prefill rank expects per request: "
        + ", ".join(f"rank {p}: {n}" for p, n in enumerate(expected))
    )
    return EXIT_OK
