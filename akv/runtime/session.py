"""A decode rank's session with one prefill engine: it runs the pulls.

Owns a pull from its request to its launch: the plan's reads for the request, the choice of
path (copy, packed, push or read), the path op's start and a failed start's settlement, and
the "done" notice each pull ends with. The session links the engine's ranks through
`akv.runtime.links` (finding, handshaking, re-linking them is that module's job) and hands
each launched pull to the decode rank's poller (`akv.runtime.poller`), which drives it to its
outcome and reaches the session back only as a `PullOwner`; a single read checked in shared
memory whose READs are done at once is settled where it was launched (`_read_inline`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import anyio
import numpy as np
import numpy.typing as npt

from akv import exposure
from akv.backends import XferHandle
from akv.errors import AkvError, ClosedError, ConfigError, TransferError
from akv.geometry.cache import CacheSpec, as_cache
from akv.plan import Prepared, TransferPlan
from akv.protocol.address import EngineAddress
from akv.protocol.messages import Notice, encode_notice
from akv.protocol.push import PushNotice
from akv.runtime.links import EngineLinks, RankLink
from akv.runtime.paths import Failed, Outcome, PathName, PathOp, Pending, packed, unsafe
from akv.runtime.paths.copy import CopyPlan
from akv.runtime.paths.push import PackedPush, PushOp
from akv.runtime.paths.read import NixlRead, RankCheck, ReadPost, SettledRead
from akv.runtime.poller import PullPoller
from akv.runtime.rank import DecodeRank
from akv.runtime.transfer import PullRequest, Transfer, TransferResult
from akv.tracker import TransferState

__all__ = ["PullRequest", "Transfer", "TransferResult", "TransferSession"]


def _ids(ids: Any) -> Any:
    """Block ids as plain lists (flat, or per group) for a push announcement."""
    if isinstance(ids, Mapping):
        return {str(k): [int(b) for b in v] for k, v in ids.items()}
    return [int(b) for b in ids]


def _check_request(request: PullRequest) -> None:
    """Raise [`ConfigError`][akv.errors.ConfigError] for a request id or lease no pull takes."""
    if not isinstance(request.request_id, str) or not request.request_id:
        raise ConfigError(f"request_id must be a non-empty string, got {request.request_id!r}")
    if request.lease_s is not None and not 0 < request.lease_s < float("inf"):
        raise ConfigError(f"lease_s must be a finite number of seconds > 0, got {request.lease_s}")


@dataclass(slots=True)
class _Launch:
    """A pull checked and planned, not yet posted."""

    request: PullRequest
    prepared: Prepared
    fingerprint: int
    notice: bytes
    state: TransferState
    path: PathName
    copier: CopyPlan | None
    token_hash: int  # exposure.request_hash of the request id (the check's bucket and token)
    transfer: Transfer  # its completion, made before anything is posted (op set once started)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class _Posted:
    """A pull's start on its path: its op (`_Refused` if nothing was started), the ranks it
    notifies once done, and the error of a failed start (``unsettled``: what it posted before
    the failure may still land; ``rank``: the prefill rank a push announcement failed to)."""

    op: PathOp
    notify: tuple[int, ...]
    error: AkvError | None
    unsettled: bool = False
    rank: int | None = None
    settled: bool = False  # done and settled already (the inline read): nothing to track


class _Refused:
    """The op of a pull whose start failed before anything was posted (`pull_many`'s failed
    transfers, settled at once and never polled): nothing to hold or stop."""

    ranks: frozenset[int] = frozenset()

    def __init__(self, path: PathName, error: AkvError) -> None:
        self.path = path
        self.error = error

    def poll(self) -> Failed:
        return Failed(self.error)

    def take_notified(self) -> frozenset[int]:
        return frozenset()

    def abort(self) -> None:
        return None


#: The op of a pull's `Transfer` until its start (never seen outside the session).
_NOT_STARTED = _Refused("read", ClosedError("the pull was not started"))


class TransferSession:
    """A decode rank's link to one prefill engine: every prefill rank it needs, handshaken
    concurrently (each rank serves its own control endpoint), metadata loaded, descriptor
    lists prepared.

    Created by [`Consumer.connect`][akv.Consumer.connect] for an engine address, not
    directly. Losing one rank fails only the pulls
    that need it; the next pull that needs it re-handshakes with that rank alone (found
    again through the address: the bootstrap, or etcd), never reusing its old metadata.
    """

    def __init__(self, rank: DecodeRank, poller: PullPoller, address: EngineAddress, log: Any) -> None:
        self.rank = rank
        self.poller = poller
        self.address = address
        self.endpoint = str(address)
        self.log = log.bind(engine_address=self.endpoint)
        self.metrics = rank.metrics
        self.closed = False
        self.transfers: set[Transfer] = set()
        self.remote = EngineLinks(rank, poller, address, self, self._lost, self.log)

    # -- the remote engine, as linked -----------------------------------------------------

    @property
    def agents(self) -> dict[int, str]:
        """The NIXL agent name of each linked prefill rank."""
        return self.remote.agents

    @property
    def broken(self) -> bool:
        """True if some linked prefill rank was lost (the next pull needing it re-handshakes)."""
        return self.remote.broken

    @property
    def plan(self) -> TransferPlan | None:
        """The transfer plan between this decode rank and the engine's ranks (None until linked)."""
        return self.remote.plan

    @property
    def links(self) -> dict[int, RankLink]:
        """What the session holds for each linked prefill rank."""
        return self.remote.links

    @property
    def dlists(self) -> dict[Any, Any]:
        """The prepared descriptor lists by plan-table key (the bench posts raw NIXL with them)."""
        return self.remote.dlists

    @property
    def mode(self) -> str:
        """How this session's pulls move: ``"pull"`` (this rank READs) or ``"push"`` (the
        prefill ranks WRITE); see the consumer's ``mode``."""
        return self.remote.mode

    @property
    def remote_engine_id(self) -> str:
        """The prefill engine's id (empty until the first handshake)."""
        return self.remote.remote_engine_id

    @property
    def remote_spec(self) -> CacheSpec | None:
        """The prefill engine's cache description (None until the first handshake)."""
        return self.remote.remote_spec

    @property
    def lease_s(self) -> float:
        """The prefill engine's default lease (0 until the first handshake)."""
        return self.remote.lease_s

    @property
    def prefill_tp(self) -> int:
        """The prefill engine's TP size (0 until the first handshake)."""
        return self.remote.prefill_tp

    async def handshake(self) -> None:
        """Handshake with every prefill rank this rank needs; shared by concurrent callers."""
        await self.remote.handshake()

    def _lost(self, rank: int, error: AkvError) -> None:
        """A rank's link was reset: fail the pulls in flight that wait on reads from it."""
        for transfer in list(self.transfers):
            if rank in transfer.op.ranks:
                self.poller.fail(transfer, error)

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
        launch = self._begin(plan, request, transfer_timeout)
        posted = self._post(plan, launch, inline=True)
        if posted.error is not None and not isinstance(posted.op, PushOp):
            if posted.unsettled:
                await self.poller.settle(posted.op)  # no write lands after pull raises
            raise posted.error
        transfer = self._track(launch, posted)
        if posted.error is not None:
            await transfer.wait()  # raises, once none of the writers told can still write
        elif isinstance(posted.op, PushOp):
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
        posts: list[_Posted] = []
        transfers: list[Transfer | None] = [None] * len(launches)
        inline = len(launches) == 1  # a batch's pulls are posted together, then polled together
        try:
            for launch in launches:
                posts.append(self._post(plan, launch, inline))
        finally:  # what was posted is the poller's, even if a post raised something unforeseen
            announced = False
            for i, (launch, posted) in enumerate(zip(launches, posts, strict=False)):
                pushed = isinstance(posted.op, PushOp)
                if posted.error is None or pushed:
                    transfers[i] = self._track(launch, posted)
                    announced |= pushed and posted.error is None
            if announced:
                self.poller.pump()  # the announcements go out now
        if None not in transfers:  # every one started
            return cast("list[Transfer]", transfers)
        # The failed starts settle with the caller's cancellation held off: the others run
        # already, and the caller must get their transfers.
        with anyio.CancelScope(shield=True):
            for i, (launch, posted) in enumerate(zip(launches, posts, strict=True)):
                if transfers[i] is None and posted.error is not None:
                    if posted.unsettled:
                        await self.poller.settle(posted.op)  # nothing it posted lands once it reports
                    failed = self._transfer(launch, posted.op, ())
                    failed.finish(posted.error)
                    transfers[i] = failed
        return [t for t in transfers if t is not None]

    def _ready_now(self) -> TransferPlan | None:
        """The plan if a pull may use it at once (linked, nothing to re-link), else None:
        `_ready` then waits for it."""
        remote = self.remote
        plan = remote.plan
        if plan is None or self.closed or self.rank.closed or not remote.ready_now(plan):
            return None
        return plan

    async def _ready(self) -> TransferPlan:
        """The plan, once every rank a pull needs is linked (handshaking first if need be)."""
        if self.closed or self.rank.closed:
            raise ClosedError("the session is closed")
        if self.remote.plan is None:
            await self.remote.handshake()
        plan = self.remote.plan
        if plan is None:  # pragma: no cover - a handshake sets it or raises
            raise ClosedError("the session is closed")
        plan = await self.remote.ready(plan)
        if self.remote.plan is None or self.closed:
            raise ClosedError("the session is closed")
        return plan

    def _begin(self, plan: TransferPlan, request: PullRequest, transfer_timeout: float | None) -> _Launch:
        """A request checked and planned: its reads, notice, deadline and path (nothing posted)."""
        prepared = plan.prepare(
            request.request_id, request.local_block_ids, request.remote_block_ids, request.num_tokens
        )
        fingerprint = exposure.digest(prepared.remote_ids)  # the notice's and the check's
        notice = self.done_notice(request.request_id, prepared.remote_ids, request.generation, fingerprint)
        timeout = self.rank.transfer_timeout if transfer_timeout is None else transfer_timeout
        lease = request.lease_s if request.lease_s else self.remote.lease_s  # the exposure's own lease
        heartbeat = lease / 3 if lease > 0 else 0.0
        state = TransferState(request.request_id, time.monotonic(), timeout, heartbeat)
        path, copier = self._route(prepared)
        token_hash = exposure.request_hash(request.request_id)
        # Made now, before the reads are posted: what runs after them runs cold (the bytes
        # moved through the caches), and a pull's fixed cost is what runs after them.
        transfer = Transfer(
            self, request.request_id, prepared, notice, state, _NOT_STARTED, (), self.poller.fail
        )
        transfer.generation = request.generation
        return _Launch(request, prepared, fingerprint, notice, state, path, copier, token_hash, transfer)

    def _post(self, plan: TransferPlan, launch: _Launch, inline: bool = False) -> _Posted:
        """Start a planned request on its path; a failure comes back in the answer, with
        ``unsettled`` set while what was posted before it may still land. ``inline``: a
        direct read may settle at once (`_read_inline`)."""
        if inline and launch.path == "read" and self.rank.verify_exposure:
            posted = self._read_inline(launch)
            if posted is not None:
                return posted
        if launch.path == "push":
            push = self._launch_push(launch.prepared, launch.request)
            failed = push.start()
            return _Posted(
                push,
                launch.prepared.standalone,
                None if failed is None else failed.error,
                rank=None if failed is None else failed.rank,
            )
        op, notify, error = self._launch(plan, launch)
        if error is None:
            return _Posted(op, notify, None)
        return _Posted(op, notify, error, unsettled=self.poller.reaper.holds(op))

    def _transfer(self, launch: _Launch, op: PathOp, notify: tuple[int, ...]) -> Transfer:
        """The `Transfer` of a launched pull, with its op and the ranks it notifies once done
        (not yet handed to the poller)."""
        transfer = launch.transfer
        transfer.op = op
        transfer.notify = notify
        return transfer

    def _read_inline(self, launch: _Launch) -> _Posted | None:
        """The read path of one pull, settled here when it can be: every prefill rank it
        reads shares its exposure table with this host (`akv.shm`), and every data READ is
        done at its first poll (over shared memory UCX copies while posting). Then the
        request's slots are loaded and verified, the notices queued and the `Transfer`
        settled here, as `NixlRead` and the poller do, without building the op, the
        poller's tracking or their layers around it (docs/performance.md, "A single pull:
        what runs after the copy"). None, with nothing posted, where a check needs a READ.
        A pull that cannot settle here (a READ still running or failed, a post refused, a
        check that does not pass) goes on as the `NixlRead` holding what was posted and what
        its first poll found, so that every outcome but success is the read path's to settle."""
        prepared = launch.prepared
        remote = self.remote
        links, dlists = remote.links, remote.dlists
        posts = []
        for op, li, ri in prepared.posts:
            check = links[op.remote_rank].check
            if check is None or check.words is None or check.released:
                return None
            posts.append((dlists[op.local_table], li, dlists[op.remote_table], ri, op.remote_rank))
        backend, count = self.rank.backend, self.metrics.inc
        poller = self.poller
        reaper = poller.reaper
        started = time.perf_counter()
        handles: dict[XferHandle, int] = {}
        for local, li, remote_list, ri, rank in posts:
            try:
                handle = backend.read(local, li, remote_list, ri, b"")
            except TransferError as exc:
                if handles:
                    count("xfers_data", len(handles))
                return self._read_handover(launch, handles, started, refused=Failed(exc, rank))
            handles[handle] = rank
        count("xfers_data", len(handles))
        # The first poll, as `NixlRead.poll` makes it: what it found goes with a handover.
        pending = dict(handles)
        for handle, rank in handles.items():
            try:
                done = backend.state(handle) == "DONE"
            except TransferError as exc:  # finished, in error: nothing more of it lands
                return self._read_handover(launch, pending, started, Failed(exc, rank), handle)
            if done:
                del pending[handle]
                reaper.drop(handle, done=True)
        if pending:
            return self._read_handover(launch, pending, started, Pending(len(pending) < len(handles)))
        data_done = time.perf_counter()
        # The exposure check, now that the data is in, as `NixlRead._post_checks` and
        # `_verify` make it: every rank's slot loaded (in rank order), then verified.
        request = launch.request
        token_hash, fingerprint = launch.token_hash, launch.fingerprint
        ranks = sorted(set(handles.values()))
        checks = [cast("RankCheck", links[rank].check) for rank in ranks]  # unchanged: nothing awaited
        slots = [check.load(token_hash) for check in checks]
        error = unsafe(
            zip(ranks, slots, strict=True),
            request.request_id,
            prepared.remote_ids,
            prepared.read_ids,
            request.generation,
            token_hash=token_hash,
            fingerprint=fingerprint,
        )
        if ranks:
            count("checks_shared", len(ranks))
        read = frozenset(ranks)
        if error is not None:
            # Not exposed (or not this exposure) on some rank: a notice goes only where every
            # slot is still live (else the ranks release by lease), and the op fails the pull.
            live = all(exposure.live(slot) for slot in slots)
            if live:
                for check in checks:
                    poller.batcher.notify(backend, reaper, check, launch.notice, count)
            notified = read if live else frozenset()
            return self._read_handover(launch, {}, started, Failed(error), notified=notified)
        poller.launched(self, read)  # before the notices are queued, as `track` runs before the poll
        for check in checks:
            poller.batcher.notify(backend, reaper, check, launch.notice, count)
        transfer = launch.transfer
        transfer.op = SettledRead(read, data_done - started, time.perf_counter() - data_done)
        transfer.notify = prepared.standalone
        poller.completed(transfer, read)
        return _Posted(transfer.op, prepared.standalone, None, settled=True)

    def _read_handover(
        self,
        launch: _Launch,
        handles: dict[XferHandle, int],
        started: float,
        first: Outcome = None,
        errored: XferHandle = None,
        *,
        refused: Failed | None = None,
        notified: frozenset[int] | None = None,
    ) -> _Posted:
        """The `NixlRead` of a pull `_read_inline` could not settle, holding the READs it
        posted that are not done (``first``, ``errored``, ``notified``: what it found, see
        `NixlRead.adopt`; ``refused``: posting one failed, the op is aborted as its own
        `start` would). Should building the op fail, the READs go to the reaper first."""
        request = launch.request
        try:
            read = self._direct(
                launch.prepared,
                request.request_id,
                launch.notice,
                request.generation,
                launch.fingerprint,
                launch.token_hash,
            )
        except BaseException:  # pragma: no cover - defensive: nothing posted is left unowned
            for handle in handles:
                self.poller.reaper.drop(handle)
            raise
        read.adopt(handles, started, first, errored, notified)
        if refused is None:
            return _Posted(read, launch.prepared.standalone, None)
        read.abort()
        error = self._started(read, refused)
        return _Posted(read, launch.prepared.standalone, error, unsettled=self.poller.reaper.holds(read))

    def _track(self, launch: _Launch, posted: _Posted) -> Transfer:
        """The launched pull's `Transfer`, handed to the poller (a push whose announcement
        could not be sent: failed there, settled once the writers told stopped)."""
        if posted.settled:  # the inline read settled it
            return launch.transfer
        transfer = self._transfer(launch, posted.op, posted.notify)
        self.transfers.add(transfer)
        self.poller.track(transfer)
        if posted.error is not None:  # an announcement could not be sent: the writers told already stop
            self.remote.mark_broken(posted.error, posted.rank)
            self.poller.fail(transfer, posted.error)
        return transfer

    def path_for(self, prepared: Prepared) -> PathName:
        """The path a prepared request takes: ``"packed"`` where the consumer's ``transfer``
        picks the prefill ranks' packed copies, else ``"copy"`` if every prefill rank it reads
        from lives in this process (and the consumer allows it), else ``"push"`` for a
        session in push mode, else ``"read"`` (a packed pull may still fall back to direct
        reads, when a prefill rank kept no copy of the request)."""
        return self._route(prepared)[0]

    def _route(self, prepared: Prepared) -> tuple[PathName, CopyPlan | None]:
        """`path_for`'s answer, and the copy plan the copy path uses."""
        copier = self._copier_for(prepared)
        if self._packs(prepared, copier):
            return "packed", copier
        if copier is not None:
            return "copy", copier
        return ("push" if self.remote.mode == "push" else "read"), None

    def _packs(self, prepared: Prepared, copier: CopyPlan | None) -> bool:
        c = self.rank
        if c.staging is None or self.remote.mode == "push":
            return False
        packs = {
            r: link.info.pack if link.directory is not None else None for r, link in self.remote.links.items()
        }
        return packed.use_packed(c.transfer, prepared, packs, c.pack_threshold, c.pack_run_bytes) and (
            copier is None or c.transfer == "packed" or any(p and p.early for p in packs.values())
        )

    def _copier_for(self, prepared: Prepared) -> CopyPlan | None:
        copier = self.remote.copier
        if copier is None or self.rank.same_process == "nixl":
            return None
        return copier if copier.covers({op.remote_rank for op, _, _ in prepared.posts}) else None

    def _launch(self, plan: TransferPlan, launch: _Launch) -> tuple[PathOp, tuple[int, ...], AkvError | None]:
        """Start a planned request on its path (`_route`'s answer); returns the op (`_Refused`
        if nothing was started), the ranks to notify once done, and the error of a failed start."""
        prepared, path, request = launch.prepared, launch.path, launch.request
        if path == "packed":
            try:
                op = self._packed_op(prepared, request.request_id, launch.notice, request.generation)
            except AkvError as exc:
                return _Refused(path, exc), (), exc
            return op, prepared.standalone, self._started(op, op.start())
        copier = launch.copier
        if path == "copy" and copier is not None:
            launched = copier.launch(
                prepared,
                request.request_id,
                plan.notify,
                check=self.rank.verify_exposure,
                generation=request.generation,
            )
            if isinstance(launched, Failed):
                self.metrics.inc("transfers_failed")
                return _Refused(path, launched.error), plan.notify, launched.error
            return launched, plan.notify, None
        read = self._direct(
            prepared,
            request.request_id,
            launch.notice,
            request.generation,
            launch.fingerprint,
            launch.token_hash,
        )
        failed = read.start()
        return read, prepared.standalone, None if failed is None else self._started(read, failed)

    def _started(self, op: PathOp, failed: Failed | None) -> AkvError | None:
        """The error of a launch whose start failed (None if it started)."""
        if failed is None:
            return None
        self.remote.mark_broken(failed.error, failed.rank)
        self.poller.reap()
        self.metrics.inc("transfers_failed")
        return failed.error

    def _direct(
        self,
        prepared: Prepared,
        request_id: str,
        notice: bytes,
        generation: int,
        fingerprint: int | None = None,
        token_hash: int | None = None,
    ) -> NixlRead:
        """The read path's op for a prepared request (not started; ``fingerprint`` and
        ``token_hash``: the digest of its prefill block ids and the hash of its id, if computed
        already)."""
        c = self.rank
        dlists, links = self.remote.dlists, self.remote.links
        posts = [
            ReadPost(op.remote_rank, dlists[op.local_table], li, dlists[op.remote_table], ri)
            for op, li, ri in prepared.posts
        ]
        verify = c.verify_exposure
        return NixlRead(
            c.backend,
            self.poller.reaper,
            posts,
            request_id=request_id,
            remote_ids=prepared.remote_ids,
            read_ids=prepared.read_ids,
            notice=notice,
            checks={post.rank: links[post.rank].check for post in posts} if verify else None,
            pool=c.checks if verify else None,
            generation=generation,
            batcher=self.poller.batcher,
            count=self.metrics.inc,
            fingerprint=fingerprint,
            token_hash=token_hash,
        )

    def _packed_op(
        self, prepared: Prepared, request_id: str, notice: bytes, generation: int
    ) -> packed.PackedRead:
        """The packed path's op for a prepared request, not started (see
        `akv.runtime.paths.packed`)."""
        c = self.rank
        if c.staging is None or c.directories is None or self.remote.remote_spec is None:
            raise ClosedError("the consumer keeps no staging area for packed reads")
        ranks = {op.remote_rank for op, _, _ in prepared.posts}
        links = {
            r: packed.PackedLink(r, link.agent, link.info.pack, link.directory)
            for r, link in self.remote.links.items()
            if r in ranks and link.info.pack is not None and link.directory is not None
        }
        early = any(link.pack.early for link in links.values())
        return packed.PackedRead(
            c.backend,
            self.poller.reaper,
            request_id=request_id,
            prepared=prepared,
            generation=generation,
            notice=notice,
            links=links,
            checks={r: self.remote.links[r].check for r in ranks} if c.verify_exposure else None,
            check_pool=c.checks if c.verify_exposure else None,
            dir_pool=c.directories,
            staging=c.staging,
            views=c.pack_views,
            local_spec=c.cache,
            remote_spec=as_cache(self.remote.remote_spec),
            prefill_tp=self.remote.prefill_tp,
            direct=None if early else self._direct(prepared, request_id, notice, generation),
            count=self.metrics.inc,
            notices=self.poller.batcher,
        )

    def _launch_push(self, prepared: Prepared, req: PullRequest) -> PushOp:
        """The grant of this pull's blocks (or, packed, of a staging range) to its writers
        (every prefill rank it reads from); its ``start`` announces it."""
        c = self.rank
        writers = {op.remote_rank: self.remote.links[op.remote_rank].agent for op, _, _ in prepared.posts}
        staging = c.staging
        staged = self._push_staging(prepared, req.request_id)
        announce = PushNotice(
            kind="announce",
            engine_id=c.engine_id,
            decode_rank=c.tp_rank,
            decode_tp=c.tp_size,
            request_id=req.request_id,
            grant=self.poller.new_grant(),
            generation=req.generation,
            local_ids=_ids(req.local_block_ids),
            remote_ids=_ids(req.remote_block_ids),
            num_tokens=req.num_tokens or 0,
            staging=0 if staged is None or staging is None else staging.addr + staged[0],
        )
        self.poller.flush_notices()
        self.metrics.inc("push_announces_sent", len(writers))  # PushOp.start sends one to each
        if staged is None or staging is None:  # staged only with a staging area
            return PushOp(c.backend, writers, announce)
        offset, items, runs = staged
        return PackedPush(
            c.backend,
            writers,
            announce,
            staging=staging,
            offset=offset,
            items=items,
            views=c.pack_views,
            runs=runs,
            direct={op.remote_rank: len(li) for op, li, _ in prepared.posts},
        )

    def _push_staging(
        self, prepared: Prepared, request_id: str
    ) -> tuple[int, list[packed.Item], dict[int, int]] | None:
        """A packed push's staging range, items and write runs, if the consumer's
        ``transfer`` picks the writers' packed copies for this pull (every writer keeps them,
        this rank's Hello named its staging area) and the staging area has room; else None
        (the writers write the blocks)."""
        c = self.rank
        if c.staging is None or self.remote.remote_spec is None or not self.remote.finder.staging_sent:
            return None
        packs = {r: link.info.pack for r, link in self.remote.links.items()}
        if not packed.use_packed(c.transfer, prepared, packs, c.pack_threshold, c.pack_run_bytes):
            return None
        ranks = sorted({op.remote_rank for op, _, _ in prepared.posts})
        if any(packs.get(r) is None for r in ranks):
            return None
        items, runs, _ = packed.plan_runs(
            c.cache, as_cache(self.remote.remote_spec), prepared, self.remote.prefill_tp, ranks, request_id
        )
        offset = c.staging.arena.alloc(max(packed.staged_bytes(items), 1))
        if offset is None:
            self.metrics.inc("pack_fallbacks")
            return None
        return offset, items, {r: int(lengths.size) for r, (_, _, lengths) in runs.items()}

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
        self.remote.mark_broken(error, rank)

    def notify(self, ranks: Sequence[int], notice: bytes) -> None:
        """Send a notice to prefill ranks; a failure only logs (the rank releases by lease)."""
        self.remote.notify(ranks, notice)

    def extend(self, request_ids: Sequence[str]) -> None:
        """Send "extend" notices for ``request_ids`` to every prefill rank this rank notifies."""
        self.remote.extend(request_ids)

    def invalidate(self, ranks: Sequence[int]) -> None:
        """Writers that did not confirm a stop in time: forget their agents (the next pull
        that needs them handshakes again)."""
        self.remote.invalidate(ranks)

    def flush_check(self, rank: int) -> RankCheck | None:
        """The check list to flush notices to ``rank`` behind; none while a pull of this
        session has yet to send its notice (the prefill rank's poller is busy until then, so
        it acknowledges at once; that pull is noticed in turn), and none in push mode (a
        READ there would go over TCP, which akv never asks of UCX: see the consumer's
        ``mode``; the poller progresses the agent until the notices left)."""
        if self.mode == "push" or any(not t.notified for t in self.transfers):
            return None
        return self.remote.flush_check(rank)

    # -- lifetime ------------------------------------------------------------------------

    async def heartbeat(self, request_ids: Sequence[str]) -> None:
        """Extend the prefill leases of ``request_ids``, requests this rank still intends to pull."""
        self.extend(request_ids)

    def fail_running(self, error: AkvError) -> None:
        """Fail every pull of this session still running with ``error``."""
        for transfer in list(self.transfers):
            self.poller.fail(transfer, error)

    async def aclose(self) -> None:
        """Fail this session's running transfers, send the "done" notices still queued, and
        forget the remote agents. Returns once nothing those transfers started can still
        write into their blocks (see the consumer's ``settle_timeout``)."""
        if self.closed:
            return
        self.closed = True
        running = list(self.transfers)
        self.fail_running(ClosedError("the session was closed"))
        for transfer in running:
            with contextlib.suppress(AkvError):
                await transfer.wait()
        await self.poller.settled(self)
        await self.poller.send_notices()  # queued notices use the links unloaded next
        self.remote.say_bye()
        self.remote.unload()

    def reset_links(self, error: AkvError) -> None:
        """The decode rank replaced its agent: fail the pulls in flight with ``error`` and
        forget every handle of the old agent (without calling it); the next pull re-links."""
        self.fail_running(error)
        self.remote.reset()
