"""The push path: the prefill ranks WRITE into this decode rank's blocks.

The decode rank *grants* its blocks for one pull: it sends each writer (the prefill ranks
the plan reads from) an ``announce`` notice with a random grant id, then waits for every
writer's ``pushed`` notice. Notices are dispatched here by the poller, bound to the grant,
the writer's agent (the one the handshake linked for that prefill rank), the request and
the generation; anything else is dropped and counted by the poller.

Settling (the decode-centred safety rule): once aborted, the op is *settled* only when every
writer confirmed it can no longer write (``pushed``, ``stopped`` or ``failed``: each is sent
only once none of the writer's WRITEs for the grant can land). Until then the poller does
not hand the pull's blocks back (it does not settle the pull); past its grace period it
removes the silent writers' agents and settles (see docs/concepts.md for what that proves).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from akv.backends import Backend
from akv.errors import (
    AkvError,
    LeaseExpiredError,
    NotExposedError,
    OutsideExposureError,
    ReexposedError,
    ReleasedError,
    TransferError,
)
from akv.protocol.push import PushNotice, encode_push, reply
from akv.runtime.paths import Failed, OpBase, Outcome, PathName, Pending
from akv.runtime.paths.staging import Scatter

if TYPE_CHECKING:
    from akv.pack_layout import Item
    from akv.packing import CacheViews
    from akv.runtime.paths.staging import StagingPool

__all__ = ["PackedPush", "PushOp", "push_error"]

_ERRORS: dict[str, type[TransferError]] = {
    "expired": LeaseExpiredError,
    "released": ReleasedError,
    "reexposed": ReexposedError,
    "outside": OutsideExposureError,
    "not_exposed": NotExposedError,
}


def push_error(notice: PushNotice) -> TransferError:
    """The typed error a writer's ``failed`` notice stands for."""
    cls = _ERRORS.get(notice.code, TransferError)
    return cls(
        f"prefill rank {notice.prefill_rank} cannot push {notice.request_id!r} "
        f"({notice.code or 'failed'}): {notice.message}"
    )


class PushOp(OpBase):
    """One pull on the push path (see the module)."""

    path: PathName = "push"

    def __init__(
        self,
        backend: Backend,
        writers: Mapping[int, str],
        announce: PushNotice,
    ) -> None:
        self.backend = backend
        self.writers = dict(writers)  # prefill rank -> its agent's name
        self.announce = announce
        self.grant = announce.grant
        self.pushed: set[int] = set()
        self.stopped: set[int] = set()  # confirmed: nothing of theirs can land any more
        self.failure: Failed | None = None
        self.gone: set[int] = set()  # writers whose process died (they never confirm)
        self.aborted = False
        self._changed = False

    @property
    def ranks(self) -> frozenset[int]:
        """The writers that have not pushed yet: losing one fails the pull."""
        return frozenset(r for r in self.writers if r not in self.pushed)

    def _send(self, rank: int, notice: PushNotice) -> AkvError | None:
        try:
            self.backend.notify(self.writers[rank], encode_push(notice))
        except AkvError as exc:
            return exc
        return None

    def start(self) -> Failed | None:
        """Announce the grant to every writer."""
        for rank in sorted(self.writers):
            error = self._send(rank, self.announce)
            if error is not None:
                return Failed(error, rank)
        return None

    def on_notice(self, agent: str, notice: PushNotice) -> bool:
        """A writer's notice for this grant; False if it is not bound to this op (another
        agent, request or generation), repeats one already taken, or is a ``stopped`` that no
        stop asked for (the poller drops and counts it)."""
        rank = notice.prefill_rank
        if (
            self.writers.get(rank) != agent
            or notice.request_id != self.announce.request_id
            or notice.generation != self.announce.generation
            or rank in self.stopped
            or rank in self.pushed
        ):
            return False
        if notice.kind == "pushed":
            self.pushed.add(rank)
        elif notice.kind == "stopped" and self.aborted:  # only ever the answer to our stop
            self.stopped.add(rank)
        elif notice.kind == "failed":
            self.stopped.add(rank)
            if self.failure is None and not self.aborted:
                self.failure = Failed(push_error(notice), None)
        else:
            return False
        self._changed = True
        return True

    def poll(self) -> Outcome:
        """None once every writer pushed; `Failed` once one failed; else `Pending`."""
        changed, self._changed = self._changed, False
        if self.failure is not None:
            return self.failure
        if len(self.pushed) == len(self.writers):
            return None
        return Pending(changed)

    def abort(self) -> None:
        """Withdraw the grant: tell every writer that has not confirmed to stop. Returns at
        once; the op is [`settled`][akv.runtime.paths.push.PushOp.settled] once they confirmed."""
        if self.aborted:
            return
        self.aborted = True
        stop = reply(self.announce, "stop")
        for rank in self.unconfirmed:
            self._send(rank, stop)  # a writer we cannot reach is settled by its agent's removal

    @property
    def unconfirmed(self) -> list[int]:
        """Writers that may still write into the pull's blocks."""
        return sorted(r for r in self.writers if r not in self.pushed and r not in self.stopped)

    @property
    def orphaned(self) -> bool:
        """True once every writer still unconfirmed is gone."""
        unconfirmed = self.unconfirmed
        return bool(unconfirmed) and self.gone.issuperset(unconfirmed)

    def writers_gone(self, ranks: Collection[int]) -> None:
        """These writers' processes are gone."""
        self.gone.update(r for r in ranks if r in self.writers)

    @property
    def settled(self) -> bool:
        """True once no writer can still write into the pull's blocks."""
        return not self.unconfirmed

    def finished(self) -> None:
        """The pull was reported (nothing to free: the writers wrote the blocks)."""


class PackedPush(PushOp):
    """A pull on the push path whose writers put their packed copies into a staging range
    this rank granted (``announce.staging``); once every writer pushed, the ranks that wrote
    packed (``pushed`` with code ``"packed"``) are scattered into the blocks (the others
    wrote the blocks themselves). The staging range is freed once the op is finished and no
    writer can still write into it."""

    def __init__(
        self,
        backend: Backend,
        writers: Mapping[int, str],
        announce: PushNotice,
        *,
        staging: StagingPool,
        offset: int,
        items: Sequence[Item],
        views: CacheViews,
        runs: Mapping[int, int],
        direct: Mapping[int, int],
    ) -> None:
        super().__init__(backend, writers, announce)
        self.staging = staging
        self._offset: int | None = offset
        self.items = list(items)
        self.views = views
        self._runs = dict(runs)  # writer -> runs of its packed copy written
        self._direct = dict(direct)  # writer -> descriptors of the blocks, if it writes them
        self.packed_ranks: set[int] = set()  # writers that wrote their packed copy
        self._scatter: Scatter | None = None

    @property
    def descriptors(self) -> int:
        """Descriptors the writers posted: their packed copies' runs, or the blocks' of a
        writer that had no copy."""
        return sum(self._runs[r] if r in self.packed_ranks else self._direct.get(r, 0) for r in self.writers)

    @property
    def scatter_s(self) -> float:
        """Seconds the scatter took (on CUDA: to queue)."""
        return 0.0 if self._scatter is None else self._scatter.seconds

    def on_notice(self, agent: str, notice: PushNotice) -> bool:
        """As `PushOp.on_notice`; a ``pushed`` coded ``"packed"`` marks its writer's items
        for the scatter."""
        taken = super().on_notice(agent, notice)
        if taken and notice.kind == "pushed" and notice.code == "packed":
            self.packed_ranks.add(notice.prefill_rank)
        return taken

    def poll(self) -> Outcome:
        """`PushOp.poll`; once every writer pushed, the scatter of the packed writers' items
        (CUDA: queued, done once its event fired); None once the blocks hold the request."""
        outcome = super().poll()
        if outcome is not None:
            return outcome
        if self._scatter is None:
            if self._offset is None:  # pragma: no cover - freed only once finished
                return Failed(TransferError(f"request {self.announce.request_id!r} has no staging range"))
            items = [item for item in self.items if item.rank in self.packed_ranks]
            self._scatter = Scatter(self.staging, self.views, items, self._offset, self.announce.request_id)
        return self._scatter.poll()

    def abort(self) -> None:
        """As `PushOp.abort`; a queued scatter is waited for (none writes after this returns)."""
        if self._scatter is not None:
            self._scatter.wait()
        super().abort()

    def finished(self) -> None:
        """The pull is reported: free the staging range if no writer can still write into it
        (every writer confirmed, or this rank's agent they wrote to is gone). A writer that
        stayed silent toward an agent still open keeps the range out of use for good."""
        if self._offset is None:
            return
        if self.settled or self.backend.closed:
            self.staging.arena.free(self._offset)
        self._offset = None
