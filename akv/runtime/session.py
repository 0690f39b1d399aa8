"""A decode rank's session with one prefill engine: it runs the pulls.

Owns a pull from its request to its launch: the request checked and planned (the plan's
reads for it, its "done" notice, deadline and path), its op built and started through
`akv.runtime.routes`, and a failed start's settlement; the launched pull goes to the decode
rank's poller (`akv.runtime.poller`), which drives it to its outcome and reaches the session
back only as a `PullOwner`. The engine's ranks are linked by `akv.runtime.links` (finding,
handshaking, re-linking them is that module's job); the session reads them from there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

import anyio
import numpy as np
import numpy.typing as npt

from akv import exposure
from akv.errors import AkvError, ClosedError, ConfigError
from akv.plan import Prepared, TransferPlan
from akv.protocol.address import EngineAddress
from akv.protocol.messages import Notice, encode_notice
from akv.runtime.links import EngineLinks, RankLink
from akv.runtime.paths import PathName
from akv.runtime.poller import PullPoller
from akv.runtime.rank import DecodeRank
from akv.runtime.routes import Launch, Refused, Routes, Started
from akv.runtime.transfer import PullRequest, Transfer, TransferResult
from akv.tracker import TransferState

if TYPE_CHECKING:
    from akv.geometry.cache import CacheSpec
    from akv.runtime.paths.tables import RemoteTable

__all__ = ["PullRequest", "Transfer", "TransferResult", "TransferSession"]

T = TypeVar("T")


class _Linked(Generic[T]):
    """A read-only attribute of a session that is its `EngineLinks`' attribute of that name
    (what the session knows of the remote engine is what its links hold)."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, session: None, owner: type) -> _Linked[T]: ...
    @overload
    def __get__(self, session: TransferSession, owner: type) -> T: ...
    def __get__(self, session: TransferSession | None, owner: type) -> T | _Linked[T]:
        if session is None:
            return self
        return cast("T", getattr(session.engine, self.name))


def _check_request(request: PullRequest) -> None:
    """Raise [`ConfigError`][akv.errors.ConfigError] for a request id or lease no pull takes."""
    if not isinstance(request.request_id, str) or not request.request_id:
        raise ConfigError(f"request_id must be a non-empty string, got {request.request_id!r}")
    if request.lease_s is not None and not 0 < request.lease_s < float("inf"):
        raise ConfigError(f"lease_s must be a finite number of seconds > 0, got {request.lease_s}")


#: A request of more local blocks than this is planned in a worker thread (`pull`): planning
#: the 4,096 blocks of 64k tokens of a 32-layer per-layer layout (262,144 descriptors) held
#: the event loop 16 ms.
PLAN_INLINE_BLOCKS = 512


def _blocks(request: PullRequest) -> int:
    """The local blocks a request names (over every group)."""
    ids = request.local_block_ids
    return sum(len(v) for v in ids.values()) if isinstance(ids, Mapping) else len(ids)


def _prepare(plan: TransferPlan, request: PullRequest) -> Prepared:
    return plan.prepare(
        request.request_id, request.local_block_ids, request.remote_block_ids, request.num_tokens
    )


#: The op of a pull's `Transfer` until its start (never seen outside the session).
_NOT_STARTED = Refused("read", ClosedError("the pull was not started"))


class TransferSession:
    """A decode rank's link to one prefill engine: every prefill rank it needs, handshaken
    concurrently (each rank serves its own control endpoint), metadata loaded, descriptor
    lists prepared.

    Created by [`Consumer.connect`][akv.Consumer.connect] for an engine address, not
    directly. Losing one rank fails only the pulls
    that need it; the next pull that needs it re-handshakes with that rank alone (found
    again through the address: the bootstrap, or etcd), never reusing its old metadata.
    """

    agents: _Linked[dict[int, str]] = _Linked("The NIXL agent name of each linked prefill rank.")
    broken: _Linked[bool] = _Linked(
        "True if some linked prefill rank was lost (the next pull needing it re-handshakes)."
    )
    plan: _Linked[TransferPlan | None] = _Linked(
        "The transfer plan between this decode rank and the engine's ranks (None until linked)."
    )
    links: _Linked[dict[int, RankLink]] = _Linked("What the session holds for each linked prefill rank.")
    dlists: _Linked[dict[Any, Any]] = _Linked(
        "The prepared descriptor lists by plan-table key (the bench posts raw NIXL with them)."
    )
    mode: _Linked[str] = _Linked(
        'How this session\'s pulls move: ``"pull"`` (this rank READs) or ``"push"`` (the prefill '
        "ranks WRITE); see the consumer's ``mode``."
    )
    remote_engine_id: _Linked[str] = _Linked("The prefill engine's id (empty until the first handshake).")
    remote_spec: _Linked[CacheSpec | None] = _Linked(
        "The prefill engine's cache description (None until the first handshake)."
    )
    lease_s: _Linked[float] = _Linked("The prefill engine's default lease (0 until the first handshake).")
    prefill_tp: _Linked[int] = _Linked("The prefill engine's TP size (0 until the first handshake).")

    def __init__(self, rank: DecodeRank, poller: PullPoller, address: EngineAddress, log: Any) -> None:
        self.rank = rank
        self.poller = poller
        self.address = address
        self.endpoint = str(address)
        self.log = log.bind(engine_address=self.endpoint)
        self.metrics = rank.metrics
        self.closed = False
        self.used = time.monotonic()  # the last pull, heartbeat or connect (see idle_timeout)
        #: the remote engine's ranks, as linked (`akv.runtime.links`)
        self.engine = EngineLinks(rank, address, self._lost, self.log)
        self.routes = Routes(rank, self.engine, poller, self)

    async def handshake(self) -> None:
        """Handshake with every prefill rank this rank needs; shared by concurrent callers."""
        await self.engine.handshake()
        self.poller.linked()

    def _lost(self, rank: int, error: AkvError, gone: bool) -> None:
        """A rank's link was reset (``gone``: its process died): fail the pulls in flight
        that wait on it."""
        self.poller.lost(self, rank, error, gone)

    def path_for(self, prepared: Prepared) -> PathName:
        """The path a prepared request takes: ``"packed"`` where the consumer's ``transfer``
        picks the prefill ranks' packed copies, else ``"copy"`` if every prefill rank it reads
        from lives in this process (and the consumer allows it), else ``"push"`` for a
        session in push mode, else ``"read"`` (a packed pull may still fall back to direct
        reads, when a prefill rank kept no copy of the request)."""
        return self.routes.route(prepared)[0]

    # -- pulling -------------------------------------------------------------------------

    async def pull(
        self,
        request: PullRequest | str,
        local_block_ids: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
        remote_block_ids: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
        *,
        num_tokens: int | None = None,
        transfer_timeout: float | None = None,
    ) -> Transfer:
        """Launch the reads of one request and return its awaitable [`Transfer`][akv.Transfer].

        Args:
            request: a [`PullRequest`][akv.PullRequest], or its ``request_id`` followed by
                the two block id lists.
            local_block_ids: with a request id: this rank's blocks to fill.
            remote_block_ids: with a request id: the request's whole exposure.
            num_tokens: with a request id: its tokens (see [`PullRequest`][akv.PullRequest]).
            transfer_timeout: seconds the pull may take (default: the consumer's).

        Raises:
            BlockIdError: bad block ids.
            HandshakeError: a needed re-handshake failed.
            TransferError: the reads could not be posted.
        """
        if isinstance(request, str):
            if local_block_ids is None or remote_block_ids is None:
                raise ConfigError("pull(request_id, local_block_ids, remote_block_ids) needs both id lists")
            request = PullRequest(
                request_id=request,
                local_block_ids=local_block_ids,
                remote_block_ids=remote_block_ids,
                num_tokens=num_tokens,
            )
        _check_request(request)
        plan = await self._ready()
        prepared = None
        if _blocks(request) > PLAN_INLINE_BLOCKS:  # a long request is planned off the event loop
            prepared = await anyio.to_thread.run_sync(_prepare, plan, request)
            ready = await self._ready()
            if ready is not plan:  # re-linked meanwhile: planned again, on the new links
                plan, prepared = ready, None
        launch = self._begin(plan, request, transfer_timeout, prepared)
        started = self.routes.start(launch, inline=True)
        if started.error is not None and not started.op.grant:
            if started.unsettled:
                await self.poller.settle(started.op)  # no write lands after pull raises
            raise started.error
        transfer = self._track(launch, started)
        if started.error is not None:
            await transfer.wait()  # raises, once none of the writers told can still write
        elif started.op.grant:
            self.poller.pump()  # the announcements go out now
        return transfer

    async def pull_many(
        self, requests: Sequence[PullRequest], *, transfer_timeout: float | None = None
    ) -> list[Transfer]:
        """Launch the reads of several requests together (an engine step's) and return their
        awaitable [`Transfer`][akv.Transfer]s, in order.

        The same as `pull` for each request, in three passes: every request is checked and
        planned, then every transfer is posted, then every one is polled once (over shared
        memory most are done by then). Each pass runs one piece of code over the whole
        batch, so a step's pulls cost less than the same pulls launched one by one.

        A bad request raises what `pull` raises for it before anything of the batch is
        posted. A request whose transfer could not be posted gets a `Transfer` that raises
        the error `pull` would have raised (once nothing it posted can still land); the
        others run.

        Args:
            requests: the [`PullRequest`][akv.PullRequest]s.
            transfer_timeout: seconds each pull may take (default: the consumer's).

        Raises:
            BlockIdError: bad block ids.
            ConfigError: a request that is no `PullRequest`, or a bad request id or lease.
            HandshakeError: a needed re-handshake failed.
            ClosedError: the session or its consumer is closed.
        """
        requests = list(requests)
        for request in requests:
            if not isinstance(request, PullRequest):
                raise ConfigError(f"pull_many takes PullRequests, got {type(request).__name__}")
            _check_request(request)
        if not requests:
            return []
        plan = self._ready_now() or await self._ready()
        launches = [self._begin(plan, request, transfer_timeout) for request in requests]
        starts: list[Started] = []
        transfers: list[Transfer | None] = [None] * len(launches)
        inline = len(launches) == 1  # a batch's pulls are posted together, then polled together
        try:
            for launch in launches:
                starts.append(self.routes.start(launch, inline))
        finally:  # what was posted is the poller's, even if a post raised something unforeseen
            announced = False
            for i, (launch, started) in enumerate(zip(launches, starts, strict=False)):
                pushed = bool(started.op.grant)
                if started.error is None or pushed:
                    transfers[i] = self._track(launch, started)
                    announced |= pushed and started.error is None
            if announced:
                self.poller.pump()  # the announcements go out now
        if None not in transfers:  # every one started
            return cast("list[Transfer]", transfers)
        # The failed starts settle with the caller's cancellation held off: the others run
        # already, and the caller must get their transfers.
        with anyio.CancelScope(shield=True):
            for i, (launch, started) in enumerate(zip(launches, starts, strict=True)):
                if transfers[i] is None and started.error is not None:
                    if started.unsettled:
                        await self.poller.settle(started.op)  # nothing it posted lands once it reports
                    failed = launch.transfer
                    failed.op, failed.notify = started.op, ()
                    failed.finish(started.error)
                    transfers[i] = failed
        return [t for t in transfers if t is not None]

    def _ready_now(self) -> TransferPlan | None:
        """The plan if a pull may use it at once (linked, nothing to re-link), else None:
        `_ready` then waits for it."""
        engine = self.engine
        plan = engine.plan
        if plan is None or self.closed or self.rank.closed or not engine.ready_now(plan):
            return None
        return plan

    async def _ready(self) -> TransferPlan:
        """The plan, once every rank a pull needs is linked (handshaking first if need be)."""
        if self.closed or self.rank.closed:
            raise ClosedError("the session is closed")
        self.used = time.monotonic()
        if self.engine.plan is None:
            await self.handshake()
        plan = self.engine.plan
        if plan is None:  # pragma: no cover - a handshake sets it or raises
            raise ClosedError("the session is closed")
        plan = await self.engine.ready(plan)
        if self.engine.plan is None or self.closed:
            raise ClosedError("the session is closed")
        return plan

    def _begin(
        self,
        plan: TransferPlan,
        request: PullRequest,
        transfer_timeout: float | None,
        prepared: Prepared | None = None,
    ) -> Launch:
        """A request checked and planned (``prepared``: planned already, on ``plan``): its reads,
        notice, deadline and path (nothing posted)."""
        if prepared is None:
            prepared = _prepare(plan, request)
        fingerprint = exposure.digest(prepared.remote_ids)  # the notice's and the check's
        notice = self.done_notice(request.request_id, prepared.remote_ids, request.generation, fingerprint)
        timeout = self.rank.transfer_timeout if transfer_timeout is None else transfer_timeout
        lease = request.lease_s if request.lease_s else self.engine.lease_s  # the exposure's own lease
        heartbeat = lease / 3 if lease > 0 else 0.0
        state = TransferState(request.request_id, time.monotonic(), timeout, heartbeat)
        path, copier = self.routes.route(prepared)
        token_hash = exposure.request_hash(request.request_id)
        # Made now, before the reads are posted: what runs after them runs cold (the bytes
        # moved through the caches), and a pull's fixed cost is what runs after them.
        transfer = Transfer(
            self, request.request_id, prepared, notice, state, _NOT_STARTED, (), self.poller.fail
        )
        transfer.generation = request.generation
        return Launch(request, plan, prepared, fingerprint, notice, state, path, copier, token_hash, transfer)

    def _track(self, launch: Launch, started: Started) -> Transfer:
        """The launched pull's `Transfer`, handed to the poller (a push whose announcement
        could not be sent: failed there, settled once the writers told stopped)."""
        transfer = launch.transfer
        if started.settled:  # made at once: settled already
            return transfer
        transfer.op, transfer.notify = started.op, started.notify
        self.poller.track(transfer)
        if started.error is not None:  # an announcement could not be sent: the writers told already stop
            self.engine.mark_broken(started.error, started.rank)
            self.poller.fail(transfer, started.error)
        return transfer

    def done_notice(
        self,
        request_id: str,
        remote_all: npt.NDArray[np.int32],
        generation: int = 0,
        fingerprint: int | None = None,
    ) -> bytes:
        """The "done" notice of a request, with the digest of its prefill block ids
        (``fingerprint``, if computed already) and the exposure generation the pull is bound to."""
        c = self.rank
        digest = [exposure.digest(remote_all) if fingerprint is None else fingerprint]
        gens = [generation] if generation else []
        return encode_notice(Notice("done", c.engine_id, c.tp_rank, c.tp_size, [request_id], digest, gens))

    # -- what the poller asks (PullOwner) ------------------------------------------------

    def mark_broken(self, error: AkvError, rank: int | None) -> None:
        """See [`EngineLinks.mark_broken`][akv.runtime.links.EngineLinks.mark_broken]."""
        self.engine.mark_broken(error, rank)

    def notify(self, ranks: Sequence[int], notice: bytes) -> list[int]:
        """Send a notice to prefill ranks; a failure only logs (the rank releases by lease).
        Returns the ranks it reached over NIXL (the poller flushes behind them)."""
        return self.engine.notify(ranks, notice)

    def extend(self, request_ids: Sequence[str]) -> list[int]:
        """Send "extend" notices for ``request_ids`` to every prefill rank this rank notifies;
        returns the ranks reached over NIXL."""
        return self.engine.extend(request_ids)

    def invalidate(self, ranks: Sequence[int]) -> None:
        """Writers that did not confirm a stop in time: forget their agents (the next pull
        that needs them handshakes again)."""
        self.engine.invalidate(ranks)

    def flush_check(self, rank: int) -> RemoteTable | None:
        """The exposure table of ``rank`` to flush notices behind; none in push mode (a READ
        there would go over TCP, which akv never asks of UCX: see the consumer's ``mode``;
        the poller progresses the agent until the notices left)."""
        if self.engine.mode == "push":
            return None
        return self.engine.flush_check(rank)

    # -- lifetime ------------------------------------------------------------------------

    async def heartbeat(self, request_ids: Sequence[str]) -> None:
        """Extend the prefill leases of ``request_ids``, requests this rank still intends to pull."""
        self.used = time.monotonic()
        self.poller.sent(self, self.extend(request_ids))

    def fail_running(self, error: AkvError) -> None:
        """Fail every pull of this session still running with ``error``."""
        for transfer in self.poller.running(self):
            self.poller.fail(transfer, error)

    async def aclose(self) -> None:
        """Fail this session's running transfers, send the "done" notices still queued, and
        forget the remote agents. Returns once nothing those transfers started can still
        write into their blocks (see the consumer's ``settle_timeout``)."""
        if self.closed:
            return
        self.closed = True
        running = self.poller.running(self)
        self.fail_running(ClosedError("the session was closed"))
        for transfer in running:
            with contextlib.suppress(AkvError):
                await transfer.wait()
        await self.poller.settled(self)
        await self.poller.send_notices()  # queued notices use the links unloaded next
        if self.engine.say_bye():  # the notices leave while the agent progresses
            self.poller.flush_notices()
        self.engine.unload()

    def reset_links(self, error: AkvError) -> None:
        """The decode rank replaced its agent: fail the pulls in flight with ``error`` and
        forget every handle of the old agent (without calling it); the next pull re-links."""
        self.fail_running(error)
        self.engine.reset()
