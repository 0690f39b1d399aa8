"""Counters and transfer statistics, with a snapshot API and listeners (e.g. Prometheus)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec
import numpy as np

__all__ = ["CONTROL_OPS", "COUNTERS", "Metrics", "MetricsSnapshot", "TransferStats", "no_count"]

#: Counter names akv maintains (others may be added by callers).
COUNTERS: tuple[str, ...] = (
    "handshakes",
    "handshakes_failed",
    "handshakes_served",
    "auth_failures",
    "connections_refused",
    "connections_timed_out",
    "connections_evicted",
    "transfers",
    "transfers_failed",
    "transfers_timed_out",
    "notifications_sent",
    "notifications_received",
    "notifications_unknown",
    "notifications_invalid",
    "notifications_unbound",
    "exposed",
    "released_read",
    "released_expired",
    "released_closed",
    "released_pushed",
    "releases_dropped",
    "lease_extensions",
    "unsafe_reads",
    "agent_resets",
    "sessions_closed_idle",
    # push mode
    "push_announcements",
    "push_writes",
    "pushes",
    "packed_pushes",
    "push_failures",
    "push_notices_dropped",
    "push_stops_unconfirmed",
    "packed",
    "pack_fallbacks",
    # NIXL transfers a decode rank posts, by what they are for (akv bench's control_ops)
    "xfers_data",
    "xfers_check",
    "xfers_directory",
    "xfers_flush",
    "xfers_notice",
    "checks_shared",
    "directories_shared",
    "notices_dropped",
    # push control messages through a decode rank
    "push_announces_sent",
    "push_notices_received",
)


#: The operations of a pull besides its data, by kind: the decode rank's counter of each.
#: ``check_reads``: exposure-check READs; ``directory_reads``: packed-copy directory READs;
#: ``flush_reads``: background READs behind notices; ``notice_reads``: background READs
#: carrying the "done" notices of checks made in shared memory (`akv.shm`), many pulls' each;
#: ``notices``: standalone notices sent;
#: ``push_announces``: push grants announced to writers; ``push_notices``: writers' notices
#: received (``pushed``, ``stopped``, ``failed``).
CONTROL_OPS: dict[str, str] = {
    "check_reads": "xfers_check",
    "directory_reads": "xfers_directory",
    "flush_reads": "xfers_flush",
    "notice_reads": "xfers_notice",
    "notices": "notifications_sent",
    "push_announces": "push_announces_sent",
    "push_notices": "push_notices_received",
}


def no_count(name: str, n: int = 1) -> None:
    """A counter that counts nothing (where no metrics are kept)."""


class TransferStats(msgspec.Struct, frozen=True):
    """Aggregates over completed transfers.

    Attributes:
        count: transfers completed.
        bytes: data bytes they moved.
        descriptors: descriptors they submitted.
        seconds_p50: median duration over the last ``window`` transfers (see [`Metrics`][akv.Metrics]).
        seconds_p99: 99th percentile of the same.
    """

    count: int
    bytes: int
    descriptors: int
    seconds_p50: float
    seconds_p99: float


class MetricsSnapshot(msgspec.Struct, frozen=True):
    """A point-in-time copy of a component's metrics.

    Attributes:
        counters: every counter by name (``COUNTERS`` lists akv's own).
        transfers: aggregates over completed transfers.
    """

    counters: dict[str, int]
    transfers: TransferStats


Listener = Callable[[str, float], None]


class Metrics:
    """Mutable metrics of one component (``Producer.metrics``, ``Consumer.metrics``).

    Cheap to update; [`snapshot`][akv.Metrics.snapshot] copies. ``listeners`` are called with
    ``(name, value)`` on every update (the Prometheus exporter is one).

    Args:
        window: completed transfers kept for the duration percentiles.
    """

    def __init__(self, window: int = 4096) -> None:
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._durations: deque[float] = deque(maxlen=window)
        self._bytes = 0
        self._descriptors = 0
        self._count = 0
        self.listeners: list[Listener] = []

    def inc(self, name: str, n: int = 1) -> None:
        """Add ``n`` to a counter."""
        self.counters[name] = self.counters.get(name, 0) + n
        for listener in self.listeners:
            listener(name, n)

    def observe_transfer(self, nbytes: int, descriptors: int, seconds: float) -> None:
        """Record one completed transfer."""
        self._count += 1
        self._bytes += nbytes
        self._descriptors += descriptors
        self._durations.append(seconds)
        for listener in self.listeners:
            listener("transfer_seconds", seconds)
            listener("transfer_bytes", nbytes)
            listener("transfer_descriptors", descriptors)

    def snapshot(self) -> MetricsSnapshot:
        """A copy of the counters and transfer aggregates."""
        if self._durations:
            p50, p99 = np.percentile(np.fromiter(self._durations, float), [50, 99])
        else:
            p50 = p99 = 0.0
        stats = TransferStats(self._count, self._bytes, self._descriptors, float(p50), float(p99))
        return MetricsSnapshot(dict(self.counters), stats)
