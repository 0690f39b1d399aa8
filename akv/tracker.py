"""The decode side's transfer tracker (pure, sans-IO): stages, handles and deadlines of pulls.

A pull goes through up to two stages: ``reading`` (the data reads) and ``checking`` (one
small read per prefill rank read from, of the bucket of the exposure table that proves the
blocks were still exposed; see :mod:`akv.exposure`). The runtime posts the reads, polls
them and reports completions here; the tracker says when a stage is over, when the pull
has timed out and when its lease needs a heartbeat.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Stage", "TransferState", "TransferTracker"]


class Stage(enum.Enum):
    """Where a pull is."""

    READING = "reading"
    CHECKING = "checking"
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False, slots=True)
class TransferState:
    """One pull's progress. ``pending`` maps posted handles to the prefill rank they read from."""

    request_id: str
    started: float
    timeout_s: float
    heartbeat_s: float = 0.0  # 0: no heartbeats
    stage: Stage = Stage.READING
    pending: dict[Any, int] = field(default_factory=dict)
    last_heartbeat: float = 0.0

    def __post_init__(self) -> None:
        self.last_heartbeat = self.started

    @property
    def deadline(self) -> float:
        """When the pull times out."""
        return self.started + self.timeout_s

    @property
    def finished(self) -> bool:
        """True once done or failed."""
        return self.stage in (Stage.DONE, Stage.FAILED)

    def post(self, handle: Any, rank: int) -> None:
        """Record a read posted in the current stage."""
        self.pending[handle] = rank

    def completed(self, handle: Any) -> bool:
        """A read reported DONE; True if that was the stage's last one."""
        self.pending.pop(handle, None)
        return not self.pending

    def advance(self, checking: bool) -> Stage:
        """End the current stage: to ``checking`` (if asked and still reading) or ``done``."""
        self.stage = Stage.CHECKING if checking and self.stage is Stage.READING else Stage.DONE
        return self.stage

    def fail(self) -> list[Any]:
        """Mark failed; returns the handles still posted (to release)."""
        self.stage = Stage.FAILED
        handles = list(self.pending)
        self.pending.clear()
        return handles

    def timed_out(self, now: float) -> bool:
        """True if the deadline passed."""
        return now > self.deadline

    def heartbeat_due(self, now: float) -> bool:
        """True (and re-armed) when the prefill lease should be extended."""
        if self.heartbeat_s <= 0 or now - self.last_heartbeat <= self.heartbeat_s:
            return False
        self.last_heartbeat = now
        return True


class TransferTracker:
    """The in-flight pulls of one decode rank, with the objects the runtime attaches to them."""

    def __init__(self) -> None:
        self._inflight: dict[TransferState, Any] = {}

    def add(self, state: TransferState, owner: Any) -> None:
        """Track a pull (``owner`` is the runtime's object for it)."""
        self._inflight[state] = owner

    def discard(self, state: TransferState) -> None:
        """Stop tracking a pull."""
        self._inflight.pop(state, None)

    def __len__(self) -> int:
        return len(self._inflight)

    def __iter__(self) -> Iterator[tuple[TransferState, Any]]:
        return iter(list(self._inflight.items()))
