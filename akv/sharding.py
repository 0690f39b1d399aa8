"""Tensor-parallel mapping between a prefill (P) and a decode (D) engine, per component. Pure.

A component is one sharded axis of ``units`` (KV heads, an MLA latent, Mamba / GDN
channels or state heads); its ``shard`` mode is ``"heads"`` (split, or replicated when
there are fewer units than ranks), ``"split"`` (always split) or ``"replicate"`` (MLA).
The ``kv_heads`` / ``mla`` functions are the one-component case described below.

Dense models: with ``H`` KV heads and TP size ``T``, rank ``r`` holds heads
``[r*H/T, (r+1)*H/T)`` when ``H >= T`` (``H % T == 0``), else the single head
``floor(r*H/T)``, replicated on ``T/H`` ranks (``T % H == 0``). A decode rank reads each
head it holds exactly once, from one prefill rank holding it; contiguous heads from one
prefill rank form one read. Among prefill replicas the choice rotates with the request key
and the decode rank's replica slot, so no prefill rank becomes the hot spot.

Notification sets never depend on the request: decode rank ``d`` notifies every prefill
rank whose heads overlap its own (read from or not), so each prefill rank expects exactly
as many notifications as there are decode ranks overlapping its heads.

MLA: every rank holds the whole latent cache. Prefill ranks are assigned to decode ranks
(``p -> p*D//P`` when ``P >= D``; ``d -> d*P//D`` otherwise), which covers every prefill
rank. A decode rank reads one full copy from one assigned rank, rotating by request key,
and notifies all of its assigned ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from akv.errors import ConfigError

__all__ = [
    "HeadRead",
    "ReadPlan",
    "check_heads",
    "check_tp",
    "check_units",
    "component_notify",
    "component_period",
    "component_reads",
    "expected_notifications",
    "held_heads",
    "held_units",
    "holders",
    "notify_ranks",
    "plan_reads",
    "read_period",
    "unit_holders",
]


@dataclass(frozen=True, slots=True)
class HeadRead:
    """One read: heads ``remote_heads`` of ``remote_rank`` land in ``local_heads``.

    Both ranges index the owning rank's own head axis (0-based).
    """

    remote_rank: int
    local_heads: range
    remote_heads: range


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """The reads a decode rank issues for one request and the prefill ranks it notifies."""

    reads: tuple[HeadRead, ...]
    notify: tuple[int, ...]


def check_tp(rank: int, tp_size: int) -> None:
    """Raise [`ConfigError`][akv.errors.ConfigError] unless ``0 <= rank < tp_size``."""
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 <= rank < tp_size:
        raise ConfigError(f"tp_rank {rank} is outside [0, {tp_size}) for tp_size {tp_size}")


def check_heads(tp_size: int, kv_heads: int) -> None:
    """Raise [`ConfigError`][akv.errors.ConfigError] unless the heads split evenly or replicate evenly."""
    check_units(tp_size, kv_heads, "heads", "KV heads")


def check_units(tp_size: int, units: int, shard: str, what: str = "units") -> None:
    """Raise [`ConfigError`][akv.errors.ConfigError] unless ``units`` shard over ``tp_size``
    ranks the way ``shard`` says (``"heads"``, ``"split"`` or ``"replicate"``)."""
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
    if units < 1:
        raise ConfigError(f"{what} must be >= 1, got {units}")
    if shard == "split" and units % tp_size:
        raise ConfigError(
            f"{what}: {units} units cannot be split over TP size {tp_size} "
            f"(use a TP size that divides {units})"
        )
    if shard == "heads" and units % tp_size and tp_size % units:
        count = f"{units} {what}" if what == "KV heads" else f"{what}: {units} heads"
        raise ConfigError(
            f"{count} cannot be split over TP size {tp_size}: one must divide "
            f"the other (use a TP size that divides {units} or is a multiple of it)"
        )
    if shard not in ("heads", "split", "replicate"):
        raise ConfigError(f"{what}: unknown shard mode {shard!r} (heads, split or replicate)")


def held_units(rank: int, tp_size: int, units: int, shard: str = "heads", *, what: str = "units") -> range:
    """The global units ``rank`` of a TP group of ``tp_size`` holds: a split share, a
    replicated unit (``"heads"`` with fewer units than ranks), or all (``"replicate"``)."""
    check_units(tp_size, units, shard, what)
    check_tp(rank, tp_size)
    if shard == "replicate":
        return range(units)
    if units >= tp_size:
        per = units // tp_size
        return range(rank * per, rank * per + per)
    unit = rank * units // tp_size
    return range(unit, unit + 1)


def unit_holders(unit: int, tp_size: int, units: int, shard: str = "heads") -> range:
    """The ranks of a TP group of ``tp_size`` that hold global ``unit``."""
    check_units(tp_size, units, shard)
    if not 0 <= unit < units:
        raise ConfigError(f"unit {unit} is outside [0, {units})")
    if shard == "replicate":
        return range(tp_size)
    if units >= tp_size:
        rank = unit // (units // tp_size)
        return range(rank, rank + 1)
    reps = tp_size // units
    return range(unit * reps, unit * reps + reps)


def held_heads(rank: int, tp_size: int, kv_heads: int) -> range:
    """The global KV heads that ``rank`` of a TP group of ``tp_size`` holds, for a model of
    ``kv_heads`` KV heads (replicated over several ranks when ``kv_heads < tp_size``)."""
    return held_units(rank, tp_size, kv_heads, "heads", what="KV heads")


def holders(head: int, tp_size: int, kv_heads: int) -> range:
    """The ranks of a TP group of ``tp_size`` that hold global head ``head``."""
    return unit_holders(head, tp_size, kv_heads, "heads")


def _assigned(decode_rank: int, decode_tp: int, prefill_tp: int) -> range:
    """Replicated components: the prefill ranks assigned to a decode rank (covering all of them)."""
    if prefill_tp >= decode_tp:
        # p is assigned to p*D//P: a contiguous run of prefill ranks per decode rank.
        first = -(-decode_rank * prefill_tp // decode_tp)
        last = -(-(decode_rank + 1) * prefill_tp // decode_tp)
        return range(first, last)
    p = decode_rank * prefill_tp // decode_tp
    return range(p, p + 1)


def _check_pair(decode_rank: int, decode_tp: int, prefill_tp: int, units: int, shard: str) -> None:
    check_tp(decode_rank, decode_tp)
    check_tp(0, prefill_tp)
    check_units(decode_tp, units, shard)
    check_units(prefill_tp, units, shard)


def component_notify(
    decode_rank: int, decode_tp: int, prefill_tp: int, units: int, shard: str
) -> tuple[int, ...]:
    """The prefill ranks ``decode_rank`` notifies for one component (request independent)."""
    _check_pair(decode_rank, decode_tp, prefill_tp, units, shard)
    if shard == "replicate":
        return tuple(_assigned(decode_rank, decode_tp, prefill_tp))
    ranks: set[int] = set()
    for unit in held_units(decode_rank, decode_tp, units, shard):
        ranks.update(unit_holders(unit, prefill_tp, units, shard))
    return tuple(sorted(ranks))


def component_period(decode_rank: int, decode_tp: int, prefill_tp: int, units: int, shard: str) -> int:
    """How many request keys it takes for one component's replica choice to repeat."""
    _check_pair(decode_rank, decode_tp, prefill_tp, units, shard)
    if shard == "replicate":
        return len(_assigned(decode_rank, decode_tp, prefill_tp))
    return max(1, prefill_tp // units) if shard == "heads" else 1


def component_reads(
    decode_rank: int, decode_tp: int, prefill_tp: int, units: int, shard: str, request_key: int = 0
) -> tuple[HeadRead, ...]:
    """The reads of one component: each unit ``decode_rank`` holds, once, from one prefill
    rank holding it; consecutive units from one prefill rank form one read."""
    if shard == "replicate":
        notify = component_notify(decode_rank, decode_tp, prefill_tp, units, shard)
        target = notify[request_key % len(notify)]
        return (HeadRead(target, range(units), range(units)),)
    _check_pair(decode_rank, decode_tp, prefill_tp, units, shard)
    mine = held_units(decode_rank, decode_tp, units, shard)
    chosen: list[tuple[int, int]] = []  # (global unit, prefill rank)
    for unit in mine:
        replicas = unit_holders(unit, prefill_tp, units, shard)
        slot = decode_rank - unit_holders(unit, decode_tp, units, shard).start
        chosen.append((unit, replicas[(request_key + slot) % len(replicas)]))
    reads: list[HeadRead] = []
    start = 0
    for i in range(1, len(chosen) + 1):
        if i < len(chosen) and chosen[i][1] == chosen[start][1]:
            continue
        unit0, rank = chosen[start]
        remote0 = unit0 - held_units(rank, prefill_tp, units, shard).start
        count = i - start
        local0 = unit0 - mine.start
        reads.append(HeadRead(rank, range(local0, local0 + count), range(remote0, remote0 + count)))
        start = i
    return tuple(reads)


def _mode(mla: bool) -> str:
    return "replicate" if mla else "heads"


def notify_ranks(
    *, decode_rank: int, decode_tp: int, prefill_tp: int, kv_heads: int, mla: bool = False
) -> tuple[int, ...]:
    """The prefill ranks ``decode_rank`` notifies for every request (request independent)."""
    return component_notify(decode_rank, decode_tp, prefill_tp, 1 if mla else kv_heads, _mode(mla))


def read_period(
    *, decode_rank: int, decode_tp: int, prefill_tp: int, kv_heads: int, mla: bool = False
) -> int:
    """How many request keys it takes for the replica choice to repeat (1: no choice)."""
    return component_period(decode_rank, decode_tp, prefill_tp, 1 if mla else kv_heads, _mode(mla))


def plan_reads(
    *,
    decode_rank: int,
    decode_tp: int,
    prefill_tp: int,
    kv_heads: int,
    mla: bool = False,
    request_key: int = 0,
) -> ReadPlan:
    """The reads and notifications of one decode rank for one request.

    Args:
        decode_rank: the decode rank, in ``[0, decode_tp)``.
        decode_tp: the decode engine's TP size.
        prefill_tp: the prefill engine's TP size.
        kv_heads: the model's total KV heads (ignored with ``mla``).
        mla: an MLA latent cache (replicated): one prefill rank is read, in turn.
        request_key: picks among replicas, so that requests spread over them.

    Returns:
        a ``ReadPlan``: ``reads`` (``HeadRead``s: ``remote_rank``, and half-open ``local_heads``
        and ``remote_heads`` ranges on each side's own head axis) and ``notify`` (prefill ranks).
    """
    units = 1 if mla else kv_heads
    notify = component_notify(decode_rank, decode_tp, prefill_tp, units, _mode(mla))
    reads = component_reads(decode_rank, decode_tp, prefill_tp, units, _mode(mla), request_key)
    return ReadPlan(reads, notify)


def expected_notifications(
    *, prefill_rank: int, prefill_tp: int, decode_tp: int, kv_heads: int, mla: bool = False
) -> int:
    """How many decode ranks of a ``decode_tp`` engine notify ``prefill_rank`` of a
    ``prefill_tp`` engine for each request, for a model of ``kv_heads`` KV heads (or ``mla``)."""
    check_tp(prefill_rank, prefill_tp)
    check_tp(0, decode_tp)
    units = 1 if mla else kv_heads
    return sum(
        prefill_rank in component_notify(d, decode_tp, prefill_tp, units, _mode(mla))
        for d in range(decode_tp)
    )
