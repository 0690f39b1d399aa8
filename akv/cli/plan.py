"""``akv plan``: who reads which heads from whom, who notifies whom."""

from __future__ import annotations

import argparse

from akv import sharding
from akv.cli.args import EXIT_OK, check, emit
from akv.errors import ConfigError

__all__ = ["cmd_plan"]


def _heads(r: range) -> str:
    return f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def validate(a: argparse.Namespace) -> None:
    """The flags of ``akv plan`` ([`ConfigError`][akv.errors.ConfigError] naming the flag)."""
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


def cmd_plan(a: argparse.Namespace) -> int:
    validate(a)
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
