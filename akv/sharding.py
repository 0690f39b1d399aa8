"""Tensor-parallel head mapping between a prefill (P) and a decode (D) engine. Pure.

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
    "expected_notifications",
    "held_heads",
    "holders",
    "notify_ranks",
    "plan_reads",
    "read_period",
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
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
    if kv_heads < 1:
        raise ConfigError(f"kv_heads must be >= 1, got {kv_heads}")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ConfigError(
            f"{kv_heads} KV heads cannot be split over TP size {tp_size}: one must divide "
            f"the other (use a TP size that divides {kv_heads} or is a multiple of it)"
        )


def held_heads(rank: int, tp_size: int, kv_heads: int) -> range:
    """The global KV heads that ``rank`` of a TP group of ``tp_size`` holds, for a model of
    ``kv_heads`` KV heads (replicated over several ranks when ``kv_heads < tp_size``)."""
    check_heads(tp_size, kv_heads)
    check_tp(rank, tp_size)
    if kv_heads >= tp_size:
        per = kv_heads // tp_size
        return range(rank * per, rank * per + per)
    head = rank * kv_heads // tp_size
    return range(head, head + 1)


def holders(head: int, tp_size: int, kv_heads: int) -> range:
    """The ranks of a TP group of ``tp_size`` that hold global head ``head``."""
    check_heads(tp_size, kv_heads)
    if not 0 <= head < kv_heads:
        raise ConfigError(f"head {head} is outside [0, {kv_heads})")
    if kv_heads >= tp_size:
        rank = head // (kv_heads // tp_size)
        return range(rank, rank + 1)
    reps = tp_size // kv_heads
    return range(head * reps, head * reps + reps)


def _mla_assigned(decode_rank: int, decode_tp: int, prefill_tp: int) -> range:
    if prefill_tp >= decode_tp:
        # p is assigned to p*D//P: a contiguous run of prefill ranks per decode rank.
        first = -(-decode_rank * prefill_tp // decode_tp)
        last = -(-(decode_rank + 1) * prefill_tp // decode_tp)
        return range(first, last)
    p = decode_rank * prefill_tp // decode_tp
    return range(p, p + 1)


def _check_pair(decode_rank: int, decode_tp: int, prefill_tp: int, kv_heads: int, mla: bool) -> None:
    check_tp(decode_rank, decode_tp)
    check_tp(0, prefill_tp)
    if not mla:
        check_heads(decode_tp, kv_heads)
        check_heads(prefill_tp, kv_heads)


def notify_ranks(
    *, decode_rank: int, decode_tp: int, prefill_tp: int, kv_heads: int, mla: bool = False
) -> tuple[int, ...]:
    """The prefill ranks ``decode_rank`` notifies for every request (request independent)."""
    _check_pair(decode_rank, decode_tp, prefill_tp, kv_heads, mla)
    if mla:
        return tuple(_mla_assigned(decode_rank, decode_tp, prefill_tp))
    ranks: set[int] = set()
    for head in held_heads(decode_rank, decode_tp, kv_heads):
        ranks.update(holders(head, prefill_tp, kv_heads))
    return tuple(sorted(ranks))


def read_period(
    *, decode_rank: int, decode_tp: int, prefill_tp: int, kv_heads: int, mla: bool = False
) -> int:
    """How many request keys it takes for the replica choice to repeat (1: no choice)."""
    _check_pair(decode_rank, decode_tp, prefill_tp, kv_heads, mla)
    if mla:
        return len(_mla_assigned(decode_rank, decode_tp, prefill_tp))
    return max(1, prefill_tp // kv_heads)


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
    notify = notify_ranks(
        decode_rank=decode_rank,
        decode_tp=decode_tp,
        prefill_tp=prefill_tp,
        kv_heads=kv_heads,
        mla=mla,
    )
    if mla:
        target = notify[request_key % len(notify)]
        return ReadPlan((HeadRead(target, range(0, 1), range(0, 1)),), notify)

    mine = held_heads(decode_rank, decode_tp, kv_heads)
    chosen: list[tuple[int, int]] = []  # (global head, prefill rank)
    for head in mine:
        replicas = holders(head, prefill_tp, kv_heads)
        slot = decode_rank - holders(head, decode_tp, kv_heads).start
        chosen.append((head, replicas[(request_key + slot) % len(replicas)]))

    reads: list[HeadRead] = []
    start = 0
    for i in range(1, len(chosen) + 1):
        if i < len(chosen) and chosen[i][1] == chosen[start][1]:
            continue
        head0, rank = chosen[start]
        remote0 = head0 - held_heads(rank, prefill_tp, kv_heads).start
        count = i - start
        local0 = head0 - mine.start
        reads.append(HeadRead(rank, range(local0, local0 + count), range(remote0, remote0 + count)))
        start = i
    return ReadPlan(tuple(reads), notify)


def expected_notifications(
    *, prefill_rank: int, prefill_tp: int, decode_tp: int, kv_heads: int, mla: bool = False
) -> int:
    """How many decode ranks of a ``decode_tp`` engine notify ``prefill_rank`` of a
    ``prefill_tp`` engine for each request, for a model of ``kv_heads`` KV heads (or ``mla``)."""
    check_tp(prefill_rank, prefill_tp)
    check_tp(0, decode_tp)
    if mla:
        if prefill_tp >= decode_tp:
            return 1
        # decode ranks d with d*P//D == p
        first = -(-prefill_rank * decode_tp // prefill_tp)
        last = -(-(prefill_rank + 1) * decode_tp // prefill_tp)
        return last - first
    check_heads(decode_tp, kv_heads)
    check_heads(prefill_tp, kv_heads)
    ranks: set[int] = set()
    for head in held_heads(prefill_rank, prefill_tp, kv_heads):
        ranks.update(holders(head, decode_tp, kv_heads))
    return len(ranks)
