"""A decode rank's push grants: its pulls on the push path, by grant id, until settled.

Owns what the poller needs of push mode alone: fresh grant ids, the writers' notices
dispatched to the pull each is bound to (anything else dropped and counted), and the failed
pushes held until every writer confirmed it stopped, or past ``stop_grace_s`` until this
rank's agent is replaced (its writers' WRITEs then cannot land) or, for an agent handed in,
the silent writers' agents were removed. It knows a pull only through its `Transfer` and op
(`akv.runtime.paths.PathOp`'s grant, settled and notice hooks).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from akv.errors import AkvError, ProtocolError
from akv.protocol.push import decode_push

if TYPE_CHECKING:
    from akv.backends import Backend
    from akv.metrics import Metrics
    from akv.runtime.transfer import Transfer

__all__ = ["Grants"]


class Grants:
    """The push pulls of one decode rank (see the module). ``agent`` returns the rank's agent
    now; ``wake`` ends the poller's sleep."""

    def __init__(
        self,
        *,
        agent: Callable[[], Backend],
        metrics: Metrics,
        log: Any,
        stop_grace_s: float,
        wake: Callable[[], None],
    ) -> None:
        self._agent = agent
        self.metrics = metrics
        self.log = log
        self.stop_grace_s = stop_grace_s
        self._wake = wake
        self.by_id: dict[int, Transfer] = {}  # grant id -> its pull, until settled
        #: failed pushes whose writers have not all stopped: their error and grace deadline
        self.stopping: dict[Transfer, tuple[AkvError, float]] = {}
        #: failed pushes past their grace whose writers stay silent: settled by the agent's replacement
        self.cut: set[Transfer] = set()

    def new_id(self) -> int:
        """A fresh push grant id (random, never 0, not in use)."""
        while True:
            grant = secrets.randbits(62) + 1
            if grant not in self.by_id:
                return grant

    def add(self, transfer: Transfer) -> None:
        """A pull was launched: bind its grant (if it has one) to it."""
        if transfer.op.grant:
            self.by_id[transfer.op.grant] = transfer

    def forget(self, transfer: Transfer) -> None:
        """The pull is settled: its grant's notices are dropped from now on."""
        grant = transfer.op.grant
        if grant and self.by_id.get(grant) is transfer:
            del self.by_id[grant]

    def drain(self) -> bool:
        """Take the writers' notices, each to the pull it is bound to; anything else (late,
        unknown, repeated, from another agent) is dropped and counted. True if any came."""
        notifs = self._agent().notifications()
        for agent, messages in notifs.items():
            for raw in messages:
                try:
                    notice = decode_push(raw)
                except ProtocolError:
                    self.metrics.inc("push_notices_dropped")
                    continue
                self.metrics.inc("push_notices_received")
                transfer = self.by_id.get(notice.grant)
                if transfer is None or not transfer.op.on_notice(agent, notice):
                    self.metrics.inc("push_notices_dropped")
        return bool(notifs)

    def hold(self, transfer: Transfer, error: AkvError, now: float) -> None:
        """A failed push whose writers were asked to stop: settled once they all confirmed
        (`settle`), ``error`` then reported."""
        if transfer not in self.stopping:
            self.stopping[transfer] = (error, now + self.stop_grace_s)
        self._wake()

    def settle(self, now: float, *, closing: bool, may_replace: bool, others: bool) -> None:
        """Report the failed pushes whose writers all stopped. Past the grace period, a writer
        that did not confirm may still send WRITEs (over TCP, removing its agent does not stop
        data it already queued): with ``may_replace`` the pull waits in `cut` until this
        rank's agent, whose worker and registrations those WRITEs target, is replaced (then
        `finish`); an agent this rank may not replace (handed in): the silent writers' agents
        are removed and the pull is reported. A push whose silent writers are all gone (their
        processes died) is not kept waiting for the grace, they will never answer, unless
        ``others`` (other pulls of the rank are in flight: replacing the agent would fail them
        too): then it waits for them to end, at most until its grace ran out. ``closing``: the close destroys the agent
        before it reports them."""
        for transfer, (error, deadline) in list(self.stopping.items()):
            op = transfer.op
            if not op.settled:
                # past the grace, or every silent writer is gone (none of them will answer) and
                # no other pull would be failed by the agent's replacement
                waiting = now < deadline and not (op.orphaned and not others)
                if waiting or transfer in self.cut or closing:
                    continue
                silent = list(op.unconfirmed)
                self.metrics.inc("push_stops_unconfirmed")
                if may_replace:
                    self.log.warning(
                        "push writers did not confirm they stopped: replacing this rank's NIXL agent "
                        "before the pull is reported, so nothing they still send can land",
                        request=transfer.request_id,
                        prefill_ranks=silent,
                    )
                    self.cut.add(transfer)
                    self._wake()
                    continue
                self.log.warning(
                    "push writers did not confirm they stopped, and this rank's NIXL agent was handed "
                    "in (it is never replaced): their agents are removed; over TCP, WRITEs they already "
                    "queued may still land",
                    request=transfer.request_id,
                    prefill_ranks=silent,
                )
                transfer.session.invalidate(silent)
            self._report(transfer, error)

    def finish(self, among: Collection[Transfer] | None = None, *, unconfirmed: bool = False) -> None:
        """The agent their writers wrote to is gone: report the failed pushes held (all, or
        those ``among`` these); ``unconfirmed``: count each as a stop never confirmed."""
        for transfer, (error, _) in list(self.stopping.items()):
            if among is None or transfer in among:
                if unconfirmed:
                    self.metrics.inc("push_stops_unconfirmed")
                self._report(transfer, error)

    def _report(self, transfer: Transfer, error: AkvError) -> None:
        del self.stopping[transfer]
        self.cut.discard(transfer)
        self.forget(transfer)
        transfer.finish(error)
