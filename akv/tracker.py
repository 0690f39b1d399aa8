"""The decode side's transfer tracker (pure, sans-IO): stages and deadlines of pulls.

A pull is running until it is done or failed; what moves its bytes (and tracks its handles)
is its transfer path (`akv.runtime.paths`). The tracker says when the pull has timed out
and when its lease needs a heartbeat.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Stage", "TransferState", "TransferTracker"]


class Stage(enum.Enum):
    """Where a pull is."""

    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False, slots=True)
class TransferState:
    """One pull's progress."""

    request_id: str
    started: float
    timeout_s: float
    heartbeat_s: float = 0.0  # 0: no heartbeats
    stage: Stage = Stage.RUNNING
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
        return self.stage is not Stage.RUNNING

    def fail(self) -> None:
        """Mark failed."""
        self.stage = Stage.FAILED

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
