"""The decode rank's poller: drives every pull in flight to its one outcome.

Owns the pulls between launch and settlement: it polls each one's path op, completes it
(sending its "done" notices through the session that launched it), fails it, and settles a
failed pull only once nothing it started can still write into its blocks (reads NIXL still
reports, push writers not confirmed stopped). It knows a pull's session only through
`akv.runtime.transfer.PullOwner`, and the consumer only through what the consumer hands in:
a getter of the current agent and the coroutine that replaces a stuck agent.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Any

import anyio

from akv._poll import FLUSH_S, PUSH_POLL_S, WIREUP_POLL_S
from akv.backends import Reaper
from akv.errors import (
    AkvError,
    BackendError,
    ClosedError,
    PeerLostError,
    TransferTimeout,
    UnsafeReadError,
)
from akv.runtime.grants import Grants
from akv.runtime.paths import Failed, Pending
from akv.runtime.paths.tables import CheckBatcher, SlotPool, flush_after_notice
from akv.runtime.transfer import PullOwner, Transfer
from akv.tracker import TransferTracker

if TYPE_CHECKING:
    from akv._poll import Backoff
    from akv.backends import Backend
    from akv.metrics import Metrics

__all__ = ["FLUSH_DELAY_S", "NOTICE_GRACE_S", "REAP_EVERY_S", "REAP_S", "PullPoller"]

#: Seconds a closing decode rank waits for the background READs carrying its last notices.
NOTICE_GRACE_S = 1.0
#: Seconds a notice waits for its flush READ (see `PullPoller.noticed`): a direct read posted
#: to the same rank meanwhile flushes behind it instead, and the flush is not posted.
FLUSH_DELAY_S = 0.001
#: Seconds a due flush READ is put off while a READ carrying notices is still running.
FLUSH_RETRY_S = 0.0005
#: Seconds after a timed-out pull during which the idle poller still progresses the agent
#: (every REAP_EVERY_S), so UCX frees the operations to a hung peer once it dies or resumes.
REAP_S, REAP_EVERY_S = 120.0, 0.25


class PullPoller:
    """Every pull of one decode rank from launch to settlement (see the module text).

    Args:
        agent: returns the rank's agent now (it changes when the agent is replaced).
        mode: the rank's mode, ``"pull"``, ``"push"`` or ``"auto"`` (the writers' notices are
            drained while push pulls are in flight).
        checks: the exposure-check pool (notices are flushed behind with one of its slots).
        metrics, log, backoff: the rank's.
        settle_timeout: seconds reads NIXL cannot cancel may hold a failed pull before
            ``replace_agent`` is awaited.
        stop_grace_s: push mode: seconds writers have to confirm a stop.
        replace_agent: destroys the rank's agent and starts a fresh one (None, or ``start``
            with ``may_replace=False``: the agent is never replaced).
    """

    def __init__(
        self,
        *,
        agent: Callable[[], Backend],
        mode: str,
        checks: SlotPool,
        metrics: Metrics,
        log: Any,
        backoff: Backoff,
        settle_timeout: float,
        stop_grace_s: float,
        replace_agent: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self._agent = agent
        self.mode = mode
        self.checks = checks
        self.batcher = CheckBatcher(checks)  # the read path's checks wait here for the round's end
        self.metrics = metrics
        self.log = log
        self._backoff = backoff
        self.settle_timeout = settle_timeout
        self.stop_grace_s = stop_grace_s
        self._replace_agent = replace_agent
        self.closed = False
        self.grants = Grants(
            agent=agent, metrics=metrics, log=log, stop_grace_s=stop_grace_s, wake=backoff.wake
        )
        self._closing = False  # the rank is closing: its agent goes with it, none is replaced
        self._tracker = TransferTracker()
        self._running: dict[PullOwner, set[Transfer]] = {}  # the pulls tracked, by session
        self._reaper: Reaper | None = None
        self._flush_until = 0.0
        self._reap_until = 0.0
        # prefill ranks sent notices since the poller last flushed behind them: when
        self._unflushed: dict[tuple[PullOwner, int], float] = {}
        self._settling: dict[Transfer, AkvError] = {}  # failed pulls whose reads may still land
        self._resetting: anyio.Event | None = None  # set while the agent is being replaced
        self._retry_reset_at = 0.0
        self._batched: list[Transfer] = []  # pulls whose checks wait in the batcher
        # Pulls launched since the poller's last round: one at a time, a launch posts its
        # checks itself (over shared memory the whole pull is then done when `pull` returns);
        # several, the checks wait for the round's end and go out together.
        self._launched = 0
        self._inline = True

    # -- lifetime ---------------------------------------------------------------------------

    def start(self, *, may_replace: bool) -> None:
        """Begin with the current agent (before the first pull); ``may_replace``: False for an
        agent the rank did not create (it is never replaced)."""
        self._reaper = Reaper(self._agent())
        if not may_replace:
            self._replace_agent = None

    def adopt(self, backend: Backend) -> Reaper:
        """The agent was replaced by ``backend``: hold its transfers from now on; returns the
        old agent's reaper (whose handles die with the old agent)."""
        old, self._reaper = self.reaper, Reaper(backend)
        return old

    def fail_all(self, error: AkvError) -> None:
        """Fail every pull tracked."""
        for _state, transfer in list(self._tracker):
            self.fail(transfer, error)

    def quarantined(self) -> set[Transfer]:
        """The failed pulls whose reads or pushes may still land (until the agent is gone)."""
        return set(self._settling) | set(self.grants.stopping)

    def lingering(self, now: float) -> bool:
        """True while notices are still to leave, or operations to a lost peer to be retired."""
        return now < self._reap_until or now < self._flush_until

    def close(self, backend: Backend | None) -> None:
        """The rank closes (its tasks stopped, its agent ``backend`` still open): settle
        everything. Push writers not confirmed yet are cut when the agent closes; failed pulls
        whose reads may still land settle only once ``backend`` is closed here."""
        self.closed = True
        held = self._settling or self.grants.stopping or (self._reaper is not None and len(self._reaper))
        if held and backend is not None:
            backend.close()  # nothing of the failed pulls can land once the agent is destroyed
            if self._reaper is not None:
                self._reaper.abandon()  # drops their handles: the agent goes with the last one
        self.grants.finish(unconfirmed=True)  # reported once the agent is gone
        self.grants.by_id.clear()
        self.finish_settled(everything=True)

    def release_agent(self) -> None:
        """The rank's agent was closed (nothing it started can land): drop the handles of it
        still held, so that nothing here keeps it alive."""
        if self._reaper is not None:
            self._reaper.abandon()

    async def send_notices(self) -> None:
        """Closing (the rank, or a session before it unlinks): post the "done" notices still
        queued (of checks made in shared memory, which no pull waited for) and wait, up to
        `NOTICE_GRACE_S`, until the background READs carrying them finished, while the poller
        still runs: the prefill ranks learn of every pull that completed before the close
        instead of releasing by lease."""
        with anyio.CancelScope(shield=True):
            if self.batcher.notices:
                self.batcher.post()
            with anyio.move_on_after(NOTICE_GRACE_S):
                while not self.batcher.sent:
                    if self._reaper is not None:  # polls them (a READ's notice leaves once it is
                        self._reaper.retry()  # seen done), whether or not the poller still runs
                    await anyio.sleep(0.001)

    async def stop_pushes(self) -> None:
        """Closing: fail the push pulls in flight and wait (up to ``stop_grace_s``) until
        their writers stopped, while the poller still runs. Reads are left to the close (it
        destroys the agent), so no agent is replaced on the way out."""
        self._closing = True  # writers still silent are cut by the close (it destroys the agent)
        pushes = [t for _state, t in self._tracker if t.op.grant]
        pushes += [t for t in self.grants.stopping if t not in pushes]
        if not pushes:
            return
        with anyio.CancelScope(shield=True):
            error = ClosedError("the consumer was closed")
            for transfer in pushes:
                self.fail(transfer, error)
            with anyio.move_on_after(self.stop_grace_s + 1):
                for transfer in pushes:
                    with contextlib.suppress(AkvError):
                        await transfer.wait()

    # -- what sessions use ------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        """Pulls launched and not yet settled."""
        return len(self._tracker)

    def running(self, owner: PullOwner) -> list[Transfer]:
        """The pulls of ``owner`` launched and not yet reported (failed ones still settling
        are not among them)."""
        return list(self._running.get(owner, ()))

    def _untrack(self, transfer: Transfer) -> None:
        self._tracker.discard(transfer.state)
        running = self._running.get(transfer.session)
        if running is not None:
            running.discard(transfer)
            if not running:
                del self._running[transfer.session]

    @property
    def reaper(self) -> Reaper:
        """Releases transfer handles, now or once NIXL can (valid while the rank runs)."""
        if self._reaper is None:
            raise ClosedError("the consumer is not running")
        return self._reaper

    def new_grant(self) -> int:
        """A fresh push grant id (random, never 0, not in use)."""
        return self.grants.new_id()

    def track(self, transfer: Transfer) -> None:
        """Take a launched pull (polled once right away: shared-memory reads are often done
        by the time they are posted)."""
        op = transfer.op
        self._tracker.add(transfer.state, transfer)
        self._running.setdefault(transfer.session, set()).add(transfer)
        self.grants.add(transfer)
        now = time.monotonic()
        self._launched += 1
        if self._unflushed and op.reads:
            self._flushed_behind(transfer.session, op.ranks)
        self._poll_transfer(transfer, now)
        if self._batched and self._inline:
            self._post_checks(now)
        if not transfer.done():
            self._backoff.wake()

    def _flushed_behind(self, owner: PullOwner, ranks: Collection[int]) -> None:
        """A pull of ``owner`` just posted its first READs to ``ranks``: they went out behind
        the notices to those ranks and flush behind them, so those need no flush READ (not
        behind notices still queued for a background READ, which goes out later, nor behind
        one whose READ is still running: NIXL sends that notice once it is done)."""
        if not self.batcher.notices and self.batcher.sent:
            for rank in ranks:
                self._unflushed.pop((owner, rank), None)

    def launched(self, owner: PullOwner, read: Collection[int]) -> None:
        """A read pull of ``owner`` that settles where it was launched (the session's inline
        read) posted its READs to prefill ranks ``read``; what `track` does for a launch."""
        self._launched += 1
        if self._unflushed:
            self._flushed_behind(owner, read)

    def completed(self, transfer: Transfer, notified: Collection[int]) -> None:
        """Settle a read pull that finished where it was launched, never tracked (after
        `launched`): its "done" notice went to ``notified`` (queued in the batcher already);
        the rest as `_poll_transfer` and `_complete` do for a tracked pull."""
        if notified:
            transfer.noticed = True
            self.noticed(transfer.session, notified)
        self._complete(transfer)
        if self._batched and self._inline:
            self._post_checks(time.monotonic())

    def reap(self) -> None:
        """A peer was lost or hung: keep progressing the agent for a while (see REAP_S)."""
        self._reap_until = time.monotonic() + REAP_S
        self._backoff.wake()

    def flush_notices(self) -> None:
        """Standalone notices leave only while the agent progresses: keep at it briefly."""
        self._flush_until = time.monotonic() + FLUSH_S
        self._backoff.wake()

    def linked(self) -> None:
        """Prefill ranks were linked: progress the agent often while their transports wire up."""
        self._backoff.hurry(FLUSH_S, WIREUP_POLL_S)

    def sent(self, owner: PullOwner, ranks: Collection[int]) -> None:
        """Notices of ``owner`` reached these prefill ranks over NIXL outside a transfer
        (what `PullOwner.notify` and `PullOwner.extend` return): flush behind them, and keep
        progressing the agent while they leave."""
        if ranks:
            self.noticed(owner, ranks)
            self.flush_notices()

    def noticed(self, owner: PullOwner, ranks: Collection[int]) -> None:
        """Notices went to these prefill ranks over NIXL: the poller flushes behind them, one
        background READ per rank however many notices it got (see
        `akv.runtime.paths.tables.flush_after_notice`), once `FLUSH_DELAY_S` passed without a
        direct or packed pull of ``owner`` reading from the rank (whose first READs flush behind
        them as well: pulls back to back post no flush READ)."""
        now = time.monotonic()
        for rank in ranks:
            self._unflushed[(owner, rank)] = now
        self._backoff.wake()

    def pump(self) -> None:
        """Push mode: progress the agent now (a notice just queued goes out), dispatching
        what arrived."""
        try:
            self.grants.drain()
        except BackendError as exc:  # pragma: no cover - defensive: the poller tries again
            self.log.warning("draining notifications failed", error=str(exc))

    def lost(self, owner: PullOwner, rank: int, error: AkvError, gone: bool) -> None:
        """A prefill rank of ``owner``'s engine was lost: fail with ``error`` the pulls in
        flight that wait on it. ``gone``: its process died, so as a push writer it will never
        confirm a stop: its failed pushes are not kept waiting for that (`Grants.settle`)."""
        for transfer in list(self._running.get(owner, ())):
            if rank in transfer.op.ranks:
                if gone:
                    transfer.op.writers_gone((rank,))
                self.fail(transfer, error)
        if gone:
            for transfer in self.grants.stopping:
                if transfer.session is owner:
                    transfer.op.writers_gone((rank,))
            self._backoff.wake()

    def fail(self, transfer: Transfer, error: AkvError) -> None:
        """Fail a pull: stop its transfer and settle it with ``error`` once nothing it started
        can still write into its blocks: at once, unless NIXL still reports reads running (see
        ``settle_timeout``) or push writers have not confirmed they stopped (see
        ``stop_grace_s`` and `Grants.settle`)."""
        if transfer in self._settling:
            return
        transfer.op.abort()
        was_done = transfer.done() or transfer.state.finished
        transfer.state.fail()
        self._untrack(transfer)
        if isinstance(error, (TransferTimeout, PeerLostError)):
            # Operations to a hung or lost peer stay pending in UCX (releasing a handle does not
            # cancel them) until the peer dies or resumes *and* this agent progresses: keep reaping.
            self.reap()
        if not was_done:
            self.metrics.inc(
                "transfers_timed_out" if isinstance(error, TransferTimeout) else "transfers_failed"
            )
            self.log.info("transfer failed", request=transfer.request_id, error=str(error))
        if not was_done and self._reaper is not None and self._reaper.holds(transfer.op):
            self._settling[transfer] = error  # settled by the poller (see settle_timeout)
            self._backoff.wake()
            return
        if not transfer.op.settled:
            self.grants.hold(transfer, error, time.monotonic())
            return
        self.grants.forget(transfer)
        transfer.finish(error)

    async def settle(self, op: object) -> None:
        """Wait until nothing ``op`` started can still land (bounded by ``settle_timeout``
        and an agent reset, for an agent this rank created)."""
        while not self.closed:
            if self._resetting is not None:  # the old agent is being destroyed
                await self._resetting.wait()
            elif self._reaper is not None and self._reaper.holds(op):
                self._backoff.wake()
                await anyio.sleep(0.005)
            else:
                return

    async def settled(self, owner: PullOwner | None = None) -> None:
        """Wait until the failed pulls (of ``owner``, or all) have settled: nothing of their
        reads can still land (see ``settle_timeout``), and every push writer confirmed it
        stopped, or was cut off (see ``stop_grace_s``)."""
        while waiting := [
            t for t in (*self.grants.stopping, *self._settling) if owner is None or t.session is owner
        ]:
            running = [t for t in waiting if not t.done()]
            if not running:  # reported, not forgotten yet: look again shortly
                await anyio.sleep(0.005)
                continue
            with contextlib.suppress(AkvError):
                await running[0].wait()

    def finish_settled(self, everything: bool = False, among: Collection[Transfer] | None = None) -> None:
        """Report the failed pulls nothing of which can land any more (``everything``: all of
        them, or all ``among`` these, whose agent is gone: failed pushes too)."""
        if everything:
            self.grants.finish(among)
        reaper = self._reaper
        for transfer, error in list(self._settling.items()):
            if among is not None and transfer not in among:
                continue
            if everything or reaper is None or not reaper.holds(transfer.op):
                del self._settling[transfer]
                transfer.finish(error)

    # -- the loop ---------------------------------------------------------------------------

    def _flush_noticed(self, now: float) -> None:
        """One background READ behind the notices to each rank noticed at least
        `FLUSH_DELAY_S` ago (see `PullOwner.flush_check` for the ranks that get none).

        Not before every READ carrying queued notices finished: NIXL sends the notice of a READ
        still running when posted only once a poll sees it done, and a flush posted before
        that send would not cover the notice (the next pull's READ would then wait for the
        prefill rank's poller). Until they finished the flushes are put off for a moment."""
        due = [key for key, when in self._unflushed.items() if now - when >= FLUSH_DELAY_S]
        if not due:
            return
        if not self.batcher.sent:
            self.reaper.retry()  # a carrier seen done now sends its notice
            if not self.batcher.sent:
                for key in due:  # due again shortly
                    self._unflushed[key] = now - FLUSH_DELAY_S + FLUSH_RETRY_S
                return
        for key in due:
            del self._unflushed[key]
        for owner, rank in due:
            # none while a pull of the session has yet to send its notice: the prefill rank's
            # poller is busy until then, so it acknowledges at once; that pull is noticed in turn
            if owner.closed or any(not t.noticed for t in self._running.get(owner, ())):
                continue
            check = owner.flush_check(rank)
            if check is not None:
                flush_after_notice(self._agent(), self.reaper, self.checks, check)
                self.metrics.inc("xfers_flush")

    def _post_checks(self, now: float, poll: bool = True) -> None:
        """Post the exposure checks that waited for this round (one READ per prefill rank),
        and poll their pulls at once (shared-memory reads are often done when posted), unless
        the round's sweep is about to (``poll`` False)."""
        batched, self._batched = self._batched, []
        self.batcher.post()
        if not poll:
            return
        for transfer in batched:
            try:
                self._poll_transfer(transfer, now)
            except BackendError as exc:  # pragma: no cover - defensive: keep polling
                self.fail(transfer, exc)

    def _complete(self, transfer: Transfer) -> None:
        session = transfer.session
        self._untrack(transfer)
        if self.grants.by_id:
            self.grants.forget(transfer)
        # Reads carry their own notification; the other ranks (all, if nothing was read) get one now.
        if transfer.notify:
            self.sent(session, session.notify(transfer.notify, transfer.notice))
        result = transfer.finish()
        if result is not None:
            metrics = self.metrics
            metrics.inc("transfers")
            metrics.observe_transfer(result.bytes, result.descriptors, result.seconds)

    def _poll_transfer(self, transfer: Transfer, now: float) -> bool:
        """Poll one transfer's op and act on its outcome; True if anything changed."""
        state = transfer.state
        if state.finished:
            return False
        queued = self.batcher.added
        outcome = transfer.op.poll()
        if self.batcher.added != queued:
            self._batched.append(transfer)
        noticed = transfer.op.take_noticed()
        if noticed:
            transfer.noticed = True
            self.noticed(transfer.session, noticed)
        if outcome is None:
            self._complete(transfer)
            return True
        if isinstance(outcome, Failed):
            if isinstance(outcome.error, UnsafeReadError):
                self.metrics.inc("unsafe_reads")
            transfer.session.mark_broken(outcome.error, outcome.rank)
            self.fail(transfer, outcome.error)
            if outcome.notify:
                self.sent(transfer.session, transfer.session.notify(outcome.notify, transfer.notice))
            return True
        if state.timed_out(now):
            self.fail(
                transfer,
                TransferTimeout(
                    f"transfer {transfer.request_id!r} from {transfer.session.endpoint} did not finish "
                    f"within {state.timeout_s:.1f}s (hung peer?)"
                ),
            )
            return True
        if state.heartbeat_due(now):
            self.sent(transfer.session, transfer.session.extend([transfer.request_id]))
        return isinstance(outcome, Pending) and outcome.changed

    async def _reset_agent(self) -> None:
        """Reads NIXL cannot cancel outlived ``settle_timeout``: have the agent replaced
        (settling waits until it is)."""
        replace = self._replace_agent
        if replace is None:  # run() calls this only for an agent the rank may replace
            return
        self._resetting = resetting = anyio.Event()
        try:
            await replace()
        finally:
            self._resetting = None
            resetting.set()

    async def run(self) -> None:
        """The poller's loop (a task of the rank's task group)."""
        backoff = self._backoff
        while True:
            now = time.monotonic()
            progressed = False
            if self._launched:  # see _launched: launches come one at a time, or in bursts
                self._inline, self._launched = self._launched == 1, 0
            pushing = self.mode == "push" or bool(self.grants.by_id)
            if pushing:
                try:
                    progressed |= self.grants.drain()
                except BackendError as exc:  # pragma: no cover - defensive: keep polling
                    self.log.warning("draining notifications failed", error=str(exc))
            if self._batched or self.batcher.notices:  # checks and notices queued at launch: out
                self._post_checks(now, poll=False)  # before the sweep polls their pulls
                progressed = True
            for _state, transfer in self._tracker:
                try:
                    progressed |= self._poll_transfer(transfer, now)
                except BackendError as exc:  # pragma: no cover - defensive: keep polling
                    self.fail(transfer, exc)
            if self._batched or self.batcher.notices:
                self._post_checks(now)
                progressed = True
            if self._unflushed:
                self._flush_noticed(time.monotonic())
            if self.grants.stopping:
                self.grants.settle(
                    now,
                    closing=self._closing,
                    may_replace=self._replace_agent is not None,
                    others=bool(len(self._tracker)),
                )
            reaper = self.reaper
            if len(reaper) or reaper.background:
                reaper.retry()
            if self._settling:
                self.finish_settled()
            oldest = reaper.oldest()
            stuck = (oldest is not None and now - oldest > self.settle_timeout) or bool(self.grants.cut)
            if (
                self._replace_agent is not None
                and stuck
                and not self._closing
                and now >= self._retry_reset_at
            ):
                try:
                    await self._reset_agent()
                except AkvError as exc:  # no new agent: the failed pulls stay quarantined
                    self._retry_reset_at = now + self.settle_timeout
                    self.log.error("replacing the NIXL agent failed; trying again later", error=str(exc))
                continue
            if progressed:
                backoff.progressed()
            flushing = now < self._flush_until
            reaping = now < self._reap_until
            wiring = backoff.hurrying
            if (flushing or reaping or wiring) and not pushing:
                try:
                    self._agent().progress()
                except BackendError as exc:  # pragma: no cover - defensive: keep polling
                    self.log.warning("progressing the agent failed", error=str(exc))
            if self._unflushed and not (
                len(self._tracker) or flushing or self._settling or self.grants.stopping
            ):
                # only flush READs to come: sleep until the first falls due
                due = min(self._unflushed.values()) + FLUSH_DELAY_S - time.monotonic()
                await backoff.wait(busy=False, limit=max(due, 0.0))
            elif len(self._tracker) or flushing or self._settling or self.grants.stopping:
                # push: the writers' notices are the completion; look for them often
                await backoff.wait(busy=True, limit=PUSH_POLL_S if pushing and self.grants.by_id else None)
            else:
                # background reads: released within REAP_EVERY_S of their end
                limit = 0.01 if len(reaper) else REAP_EVERY_S if reaping or reaper.background else math.inf
                await backoff.wait(busy=False, limit=limit)
