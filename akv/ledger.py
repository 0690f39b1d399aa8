"""The prefill side's release ledger (pure, sans-IO): exposures, readers, leases.

The ledger decides; the :class:`~akv.runtime.producer.Producer` shell feeds it notices and
the clock and delivers the :class:`Release` records it returns. Every exposure is released
exactly once: by read (every decode rank expected to notify did), by lease, or by close.
Its :class:`~akv.exposure.ExposureTable` is updated *before* a release is returned, so a
decode rank reading the blocks afterwards learns they are gone.
"""

from __future__ import annotations

import heapq
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from akv.errors import BlockIdError, ConfigError, UnknownRequestError
from akv.exposure import GENERATION_MASK, ExposureTable, digest
from akv.plan import check_block_ids
from akv.protocol.messages import Notice

__all__ = ["EngineRelease", "EngineReleases", "Release", "ReleaseLedger", "ReleaseReason"]

ReleaseReason = Literal["read", "expired", "closed", "pushed", "packed"]


@dataclass(frozen=True, slots=True)
class Release:
    """A request's blocks are free again on one prefill rank. Reported exactly once per exposure.

    Attributes:
        request_id: the request.
        block_ids: its blocks on this rank, as exposed.
        reason: ``"read"`` (every expected decode rank notified), ``"pushed"`` (the same, and
            this rank wrote the blocks into some decode rank: push mode), ``"expired"`` (the
            lease ran out first), ``"closed"`` (the producer shut down first) or ``"packed"``
            (released right after packing, ``release_after_pack``: the packed copy carries the
            lease).
        notified: the decode ranks that notified.
        expected: how many were expected (None if none notified).
        groups: multi-group caches: ``{group name: ids}`` (``block_ids`` holds them flat, each
            group's ids offset by the groups before it); None for a one-group cache.
    """

    request_id: str
    block_ids: npt.NDArray[np.int32]
    reason: ReleaseReason
    notified: int
    expected: int | None
    groups: Mapping[str, npt.NDArray[np.int32]] | None = None


@dataclass(slots=True)
class _Exposure:
    block_ids: npt.NDArray[np.int32]
    digest: int
    lease_s: float
    deadline: float
    generation: int = 0
    readers: dict[str, set[int]] = field(default_factory=dict)  # decode engine -> ranks
    decode_tp: dict[str, int] = field(default_factory=dict)
    pushed: bool = False  # some decode rank's share was written by this rank (push mode)


class ReleaseLedger:
    """Exposed requests of one prefill rank and who still has to read them.

    ``expected(decode_tp)`` says how many ranks of a decode engine of that TP size notify
    this rank per request; ``accepts(notice)`` says whether a notice comes from a decode
    rank that may notify this rank at all.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        lease_s: float,
        expected: Callable[[int], int],
        accepts: Callable[[Notice], bool],
        table: ExposureTable | None = None,
        count: Callable[[str], None] | None = None,
        split: Callable[[npt.NDArray[np.int32]], Mapping[str, npt.NDArray[np.int32]]] | None = None,
    ) -> None:
        check_lease(lease_s)
        self.num_blocks = num_blocks
        self.lease_s = float(lease_s)
        self.expected = expected
        self.accepts = accepts
        self.table = table or ExposureTable()
        self._exposed: dict[str, _Exposure] = {}
        self._deadlines: list[tuple[float, str]] = []
        self.counters: dict[str, int] = {}
        self._on_count = count
        self._split = split
        # Generations start at a random point, so a restarted rank does not repeat them.
        self._generation = secrets.randbelow(GENERATION_MASK)

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1
        if self._on_count is not None:
            self._on_count(name)

    def __len__(self) -> int:
        return len(self._exposed)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._exposed

    # -- exposing -------------------------------------------------------------------------

    def expose(
        self,
        request_id: str,
        block_ids: Sequence[int] | npt.ArrayLike,
        now: float,
        lease: float | None = None,
        generation: int | None = None,
    ) -> int:
        """Pin a request's blocks until read or ``now + lease``; returns the exposure's
        generation (``generation`` if given, e.g. one an engine uses on all its ranks, else
        the next of this ledger's).

        Raises :class:`BlockIdError` for bad or no ids, :class:`ConfigError` for a request
        already exposed, a bad lease or a generation outside ``[1, 2**31)``.
        """
        ids = check_block_ids(block_ids, self.num_blocks, f"request {request_id!r}")
        if ids.size == 0:
            raise BlockIdError(f"request {request_id!r}: no block ids to expose (nothing to pull)")
        if request_id in self._exposed:
            raise ConfigError(f"request {request_id!r} is already exposed")
        lease_s = self.lease_s if lease is None else check_lease(lease)
        if generation is None:
            self._generation = self._generation % GENERATION_MASK + 1
            generation = self._generation
        elif not 0 < generation <= GENERATION_MASK:
            raise ConfigError(f"generation must be in [1, 2**31), got {generation}")
        self.table.publish(request_id, ids, generation)
        deadline = now + lease_s
        self._exposed[request_id] = _Exposure(ids, digest(ids), lease_s, deadline, generation)
        heapq.heappush(self._deadlines, (deadline, request_id))
        self._count("exposed")
        return generation

    def extend(self, request_id: str, now: float, seconds: float | None = None) -> None:
        """Push a request's deadline to ``now + seconds`` (default: its lease)."""
        exp = self._exposed.get(request_id)
        if exp is None:
            raise UnknownRequestError(f"request {request_id!r} is not exposed")
        exp.deadline = now + (exp.lease_s if seconds is None else seconds)
        heapq.heappush(self._deadlines, (exp.deadline, request_id))
        self._count("lease_extensions")

    # -- releasing ------------------------------------------------------------------------

    def release(self, request_id: str, reason: ReleaseReason) -> Release | None:
        """Release one exposure now (None if it is not exposed)."""
        exp = self._exposed.pop(request_id, None)
        if exp is None:
            return None
        self.table.retire(request_id, reason)  # before the blocks are handed back
        notified = sum(len(r) for r in exp.readers.values())
        engine = max(exp.readers, key=lambda e: len(exp.readers[e]), default=None)
        expected = self.expected(exp.decode_tp[engine]) if engine is not None else None
        self._count(f"released_{reason}")
        groups = self._split(exp.block_ids) if self._split is not None else None
        return Release(request_id, exp.block_ids, reason, notified, expected, groups)

    def generation(self, request_id: str) -> int | None:
        """The generation of a request's exposure (None: not exposed)."""
        exp = self._exposed.get(request_id)
        return None if exp is None else exp.generation

    def exposed_ids(self, request_id: str) -> npt.NDArray[np.int32] | None:
        """A request's exposed blocks, flat (None: not exposed)."""
        exp = self._exposed.get(request_id)
        return None if exp is None else exp.block_ids

    def on_notice(self, notice: Notice, now: float, *, pushed: bool = False) -> list[Release]:
        """Apply one decode rank's notice; returns the releases it completes. ``pushed``: the
        notice stands for writes this rank completed into that decode rank (push mode)."""
        if not self.accepts(notice):
            self._count("notifications_invalid")
            return []
        out: list[Release] = []
        digests, generations = notice.digests, notice.generations
        for i, rid in enumerate(notice.request_ids):
            exp = self._exposed.get(rid)
            if exp is None:
                self._count("notifications_unknown")
                continue
            if notice.kind == "extend":
                self.extend(rid, now)
                continue
            if i < len(generations) and generations[i] and generations[i] != exp.generation:
                # A reader of an earlier exposure of this request id: it does not count here.
                self._count("notifications_invalid")
                continue
            if i >= len(digests) or digests[i] != exp.digest:
                # Blocks other than the exposed ones were read: this reader does not count.
                self._count("notifications_invalid")
                continue
            readers = exp.readers.setdefault(notice.engine_id, set())
            readers.add(notice.decode_rank)
            exp.pushed |= pushed
            exp.decode_tp.setdefault(notice.engine_id, notice.decode_tp)
            if len(readers) >= self.expected(exp.decode_tp[notice.engine_id]):
                rel = self.release(rid, "pushed" if exp.pushed else "read")
                if rel is not None:
                    out.append(rel)
        return out

    def expire(self, now: float) -> tuple[list[Release], float | None]:
        """Release what is past its deadline; returns the releases and the seconds to the next one."""
        out: list[Release] = []
        while self._deadlines:
            deadline, rid = self._deadlines[0]
            exp = self._exposed.get(rid)
            if exp is None or exp.deadline != deadline:
                heapq.heappop(self._deadlines)  # released, or superseded by an extension
                continue
            if deadline > now:
                return out, deadline - now
            heapq.heappop(self._deadlines)
            rel = self.release(rid, "expired")
            if rel is not None:
                out.append(rel)
        return out, None

    def close(self) -> list[Release]:
        """Release everything still exposed (reason ``closed``)."""
        out = [self.release(rid, "closed") for rid in list(self._exposed)]
        return [r for r in out if r is not None]


def check_lease(lease: float) -> float:
    """A valid lease in seconds, or :class:`ConfigError`."""
    value = float(lease)
    if not value > 0 or math.isnan(value) or math.isinf(value):
        raise ConfigError(f"lease must be a finite number of seconds > 0, got {lease}")
    return value


@dataclass(frozen=True, slots=True)
class EngineRelease:
    """A request released on every rank of a prefill engine (see [`EngineReleases`][akv.EngineReleases]).

    Attributes:
        request_id: the request.
        ranks: each rank's [`Release`][akv.Release], indexed by TP rank.
    """

    request_id: str
    ranks: tuple[Release, ...]

    @property
    def reason(self) -> ReleaseReason:
        """``"read"`` if every rank released by read, else the first other reason in rank order."""
        return next((r.reason for r in self.ranks if r.reason != "read"), "read")

    @property
    def block_ids(self) -> npt.NDArray[np.int32]:
        """The blocks now free on every rank (sorted; ranks usually share one block table);
        flat ids (group offset + id) for a multi-group cache, see `groups`."""
        return np.unique(np.concatenate([r.block_ids for r in self.ranks])).astype(np.int32)

    @property
    def groups(self) -> dict[str, npt.NDArray[np.int32]] | None:
        """Multi-group caches: ``{group name: ids}`` now free on every rank (None for one group)."""
        if self.ranks[0].groups is None:
            return None
        names = list(self.ranks[0].groups)
        return {
            n: np.unique(np.concatenate([r.groups[n] for r in self.ranks if r.groups])).astype(np.int32)
            for n in names
        }


class EngineReleases:
    """The engine-level view of releases, for a scheduler that frees a request's blocks once.

    A [`Producer`][akv.Producer] reports a release per rank: an engine of P ranks gets P
    [`Release`][akv.Release] records per exposed request, one from each rank. This collects
    them and reports an [`EngineRelease`][akv.EngineRelease] once, when the last of the
    engine's ``tp_size`` ranks has released the request.

    Ranks in this process: pass ``releases.rank(r)`` as rank ``r``'s ``on_release``. Ranks in
    other processes: forward each rank's releases to this process and call
    [`add`][akv.EngineReleases.add].

    Args:
        tp_size: the prefill engine's tensor-parallel size.
        on_release: called once per request when every rank has released it.
    """

    def __init__(self, tp_size: int, on_release: Callable[[EngineRelease], None] | None = None) -> None:
        if tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self.on_release = on_release
        self._partial: dict[str, list[Release | None]] = {}

    def rank(self, tp_rank: int) -> Callable[[Release], None]:
        """An ``on_release`` callback for rank ``tp_rank``'s producer."""
        self._check_rank(tp_rank)

        def on_release(release: Release) -> None:
            self.add(tp_rank, release)

        return on_release

    def add(self, tp_rank: int, release: Release) -> EngineRelease | None:
        """Record the ``release`` of rank ``tp_rank``; returns the engine release (after
        ``on_release``) once every rank released the request, else None.

        Raises [`ConfigError`][akv.errors.ConfigError] for a rank outside ``[0, tp_size)``
        or a rank releasing a request twice before every rank did (request ids must be unique
        among an engine's exposures until they are released).
        """
        self._check_rank(tp_rank)
        slots = self._partial.setdefault(release.request_id, [None] * self.tp_size)
        if slots[tp_rank] is not None:
            raise ConfigError(
                f"rank {tp_rank} released {release.request_id!r} twice before every rank did: "
                "reuse a request id only once the engine released it"
            )
        slots[tp_rank] = release
        if any(r is None for r in slots):
            return None
        del self._partial[release.request_id]
        done = EngineRelease(release.request_id, tuple(r for r in slots if r is not None))
        if self.on_release is not None:
            self.on_release(done)
        return done

    @property
    def pending(self) -> int:
        """Requests released by some ranks of the engine and not yet by all."""
        return len(self._partial)

    def _check_rank(self, tp_rank: int) -> None:
        if not 0 <= tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {tp_rank} is outside [0, {self.tp_size})")
