"""The adaptive wait used by pollers: spin while busy, back off when idle."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import anyio
import anyio.lowlevel

__all__ = ["FLUSH_S", "PUSH_POLL_S", "WIREUP_POLL_S", "Backoff", "from_threads"]

#: Seconds a rank keeps progressing its agent after it sent notices outside a transfer (UCX
#: sends them only while the agent progresses), on either side.
FLUSH_S = 0.5
#: Longest sleep of a poller while push grants may arrive or complete, on either side.
PUSH_POLL_S = 0.0005
#: Longest sleep of a poller for `FLUSH_S` after a peer linked: UCX sets up the transport to a
#: new peer in messages that move only while both agents progress; a prefill rank that slept
#: its quiet 50 ms between them made the first read of a new decode rank wait 135-140 ms
#: against 8-21 ms for the second (``akv bench --only scale``, prompt table).
WIREUP_POLL_S = 0.001


def from_threads(fn: Callable[[], object]) -> Callable[[], None]:
    """A function any thread may call to run ``fn`` soon on the running event loop (asyncio or
    trio; call this from that loop). It never blocks, and does nothing once the loop is gone."""
    import asyncio

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: trio
        import trio

        token = trio.lowlevel.current_trio_token()

        def soon() -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(fn)

        return soon

    def call() -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(fn)

    return call


class Backoff:
    """Yields immediately for ``spin_s`` after the last progress, then sleeps with growing delays:
    up to ``max_sleep_s`` while activity is recent, up to ``quiet_sleep_s`` after ``quiet_s``
    of quiet, and ``idle_sleep_s`` when there is no work at all.

    ``wake()`` (called when new work arrives) ends a sleep early.
    """

    def __init__(
        self,
        *,
        spin_s: float = 0.002,
        max_sleep_s: float = 0.002,
        quiet_s: float = 0.1,
        quiet_sleep_s: float = 0.05,
        idle_sleep_s: float = 0.1,
    ) -> None:
        self.spin_s = spin_s
        self.max_sleep_s = max_sleep_s
        self.quiet_s = quiet_s
        self.quiet_sleep_s = max(quiet_sleep_s, max_sleep_s)
        self.idle_sleep_s = idle_sleep_s
        self._last = time.monotonic()
        self._delay = 0.0
        self._event = anyio.Event()
        self._hurry_until, self._hurry_every = 0.0, math.inf

    def progressed(self) -> None:
        """Record progress: the next waits spin."""
        self._last = time.monotonic()
        self._delay = 0.0

    def wake(self) -> None:
        """New work arrived: end the current sleep and spin again."""
        self.progressed()
        self._event.set()

    def hurry(self, seconds: float, every: float) -> None:
        """For the next ``seconds``, sleep at most ``every`` whatever the work (see
        `WIREUP_POLL_S`)."""
        self._hurry_until, self._hurry_every = time.monotonic() + seconds, every
        self.wake()

    @property
    def hurrying(self) -> bool:
        """Whether a `hurry` still lasts."""
        return time.monotonic() < self._hurry_until

    async def wait(self, busy: bool, limit: float | None = None) -> None:
        """Wait before the next poll; ``busy`` means work is pending, ``limit`` caps the sleep."""
        now = time.monotonic()
        if now < self._hurry_until:
            limit = self._hurry_every if limit is None else min(limit, self._hurry_every)
        if busy and now - self._last < self.spin_s:
            await anyio.lowlevel.checkpoint()
            return
        if busy:
            # Short sleeps right after activity; longer ones once quiet for ``quiet_s``.
            ceiling = self.max_sleep_s if now - self._last < self.quiet_s else self.quiet_sleep_s
            self._delay = min(ceiling, max(self._delay * 2, 0.0005))
        else:
            self._delay = self.idle_sleep_s if limit is None or not math.isinf(limit) else math.inf
        delay = self._delay if limit is None else max(0.0, min(self._delay, limit))
        if self._event.is_set():
            self._event = anyio.Event()
        if math.isinf(delay):  # nothing to poll for: sleep until woken (no timer wakeups)
            await self._event.wait()
            return
        with anyio.move_on_after(delay):
            await self._event.wait()
