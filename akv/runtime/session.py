"""A decode rank's link to one prefill engine, and the awaitable pulls it launches.

[`TransferSession`][akv.TransferSession] holds what the handshake produced (remote agents, the transfer
plan, prepared descriptor lists) and posts reads; the `Consumer`
polls them. Each pull's progress is a pure `TransferState`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec
import numpy as np
import numpy.typing as npt

from akv import exposure
from akv.errors import AkvError, ClosedError, ConfigError, IncompatiblePeerError, PeerLostError, TransferError
from akv.plan import RankMemory, ReadOp, RequestReads, TransferPlan, request_key
from akv.protocol.address import Endpoint
from akv.protocol.handshake import HandshakeResult
from akv.protocol.messages import Challenge, Hello, Notice, encode_notice
from akv.tracker import Stage, TransferState

if TYPE_CHECKING:
    from akv.runtime.consumer import Consumer

__all__ = ["PullRequest", "Transfer", "TransferResult", "TransferSession"]


class PullRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What to pull: the prefill engine's block ids of a request, and where they go locally.

    Attributes:
        request_id: the request, as the prefill engine exposed it.
        local_block_ids: this decode rank's blocks to fill. With fewer local than remote
            blocks (a partial prefix hit), only the last remote blocks are read, into the
            local blocks in order.
        remote_block_ids: the request's whole exposure on the prefill engine, always: the
            pull checks it against what each prefill rank exposed.
    """

    request_id: str
    local_block_ids: Sequence[int] | npt.NDArray[np.integer[Any]]
    remote_block_ids: Sequence[int] | npt.NDArray[np.integer[Any]]


class TransferResult(msgspec.Struct, frozen=True):
    """A completed pull.

    Attributes:
        request_id: the request.
        bytes: data bytes moved into this rank's cache.
        descriptors: descriptors submitted to NIXL.
        reads: reads posted, one per prefill rank read from.
        seconds: wall time from launch to completion.
    """

    request_id: str
    bytes: int
    descriptors: int
    reads: int
    seconds: float


class Transfer:
    """The awaitable completion of one pull.

    ``await transfer`` returns a [`TransferResult`][akv.TransferResult] or raises a [`TransferError`][akv.errors.TransferError]
    (an [`UnsafeReadError`][akv.errors.UnsafeReadError] if the blocks were not exposed for the request when the
    reads completed). Cancelling the awaiting task only stops the wait: the reads run to
    completion (or fail) under the consumer's poller, which releases every NIXL handle.
    """

    def __init__(
        self,
        session: TransferSession,
        request_id: str,
        reads: RequestReads,
        remote_ids: npt.NDArray[np.int32],
        read_ids: npt.NDArray[np.int32],
        notice: bytes,
        state: TransferState,
    ) -> None:
        self.session = session
        self.request_id = request_id
        self.reads = reads
        self.remote_ids = remote_ids  # the whole exposure, as given
        self.read_ids = read_ids  # the remote blocks actually read (the tail on a prefix hit)
        self.notice = notice  # the "done" notice
        self.state = state
        self.check_slots: dict[int, int] = {}  # prefill rank -> slot of the check pool
        self._event: anyio.Event | None = None  # created only if someone waits unfinished
        self._result: TransferResult | None = None
        self._error: AkvError | None = None

    @property
    def started(self) -> float:
        """``time.monotonic()`` when the pull was launched."""
        return self.state.started

    @property
    def bytes(self) -> int:
        """Data bytes this pull moves."""
        return self.reads.bytes_per_block * int(self.read_ids.size)

    def done(self) -> bool:
        """True once the transfer completed or failed."""
        return self._result is not None or self._error is not None

    def result(self) -> TransferResult:
        """The result; raises the transfer's error, or [`TransferError`][akv.errors.TransferError] if not done yet."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise TransferError(f"transfer {self.request_id!r} is still running")
        return self._result

    def exception(self) -> AkvError | None:
        """The error the transfer failed with, if any."""
        return self._error

    async def wait(self) -> TransferResult:
        """Wait for completion; same as ``await transfer``."""
        if not self.done():
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        return self.result()

    def __await__(self) -> Generator[Any, None, TransferResult]:
        return self.wait().__await__()

    def finish(self, error: AkvError | None = None) -> None:
        """Settle the transfer once (the consumer's poller calls this)."""
        if self.done():
            return
        if error is None:
            n = int(self.read_ids.size)
            self._result = TransferResult(
                self.request_id,
                self.reads.bytes_per_block * n,
                self.reads.segments * n,
                len(self.reads.ops) if n else 0,
                time.monotonic() - self.state.started,
            )
            self.state.stage = Stage.DONE
        else:
            self._error = error
            self.state.stage = Stage.FAILED
        if self._event is not None:
            self._event.set()

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "running"
        return f"<Transfer {self.request_id!r} {state}>"


class TransferSession:
    """A decode rank's link to one prefill engine: metadata loaded, descriptor lists prepared.

    Created by [`Consumer.connect`][akv.Consumer.connect], not directly. After a peer is
    lost the session re-handshakes on the next [`pull`][akv.TransferSession.pull] (once,
    however many pulls wait for it), never reusing the old agents' metadata.
    """

    def __init__(self, consumer: Consumer, endpoint: Endpoint) -> None:
        self.consumer = consumer
        self.endpoint = endpoint
        self.log = consumer.log.bind(endpoint=str(endpoint))
        self.remote_engine_id = ""
        self.prefill_tp = 0
        self.lease_s = 0.0
        self.plan: TransferPlan | None = None
        self.agents: dict[int, str] = {}
        self.dlists: dict[Any, Any] = {}
        self.check_dlists: dict[int, tuple[Any, int]] = {}  # rank -> (prepared table, buckets)
        self.broken = False
        self.closed = False
        self.transfers: set[Transfer] = set()
        self._loading: anyio.Event | None = None

    # -- setup ---------------------------------------------------------------------------

    def _hello(self) -> Hello:
        c = self.consumer
        return Hello(
            engine_id=c.engine_id,
            tp_rank=c.tp_rank,
            tp_size=c.tp_size,
            spec=c.spec,
            compat=c.spec.compat_hash(),
            nonce=secrets.token_bytes(16),
        )

    def _choose(self, ch: Challenge) -> list[int]:
        c = self.consumer
        return list(c.spec.notify_ranks(c.tp_rank, c.tp_size, ch.tp_size))

    async def handshake(self) -> None:
        """Handshake with the engine and load what it returned; shared by concurrent callers."""
        while self._loading is not None:
            await self._loading.wait()
            if self.plan is not None and not self.broken:
                return
        self._loading = done = anyio.Event()
        try:
            await self._handshake()
        finally:
            self._loading = None
            done.set()

    async def _handshake(self) -> None:
        from akv.runtime.control import client_handshake

        c = self.consumer
        try:
            result = await client_handshake(
                self.endpoint,
                self._hello(),
                secret=c.secret,
                choose_ranks=self._choose,
                connect_timeout=c.connect_timeout,
                handshake_timeout=c.handshake_timeout,
                retries=c.retries,
            )
            await self._load(result)
        except BaseException:
            c.metrics.inc("handshakes_failed")
            raise
        c.metrics.inc("handshakes")
        self.log.info("handshake done", remote=self.remote_engine_id, prefill_tp=self.prefill_tp)

    async def _load(self, result: HandshakeResult) -> None:
        c = self.consumer
        ch = result.challenge
        remote = {
            r: RankMemory(r, ch.tp_size, tuple(i.region_addrs), i.device_id) for r, i in result.ranks.items()
        }
        plan = TransferPlan(local_spec=c.spec, local=c.memory, remote_spec=ch.spec, remote=remote)
        if c.verify_exposure:
            missing = sorted(r for r, i in result.ranks.items() if not i.exposure_buckets)
            if missing:
                raise IncompatiblePeerError(
                    f"prefill ranks {missing} publish no exposure table: run the same akv release on both "
                    "engines (or pass verify_exposure=False to trust it blindly)",
                    ("exposure",),
                )
        try:
            await anyio.to_thread.run_sync(self._load_blocking, result, plan)
        except BaseException:
            self._unload()
            raise
        self.remote_engine_id = ch.engine_id
        self.prefill_tp = ch.tp_size
        self.lease_s = ch.lease_s
        self.plan = plan
        self.broken = False

    def _load_blocking(self, result: HandshakeResult, plan: TransferPlan) -> None:
        """Load agents, connect, prepare lists (NIXL calls that may block: run in a thread)."""
        c = self.consumer
        backend = c.backend
        bucket_bytes = exposure.SLOTS * exposure.SLOT_WORDS * 8
        for rank, info in result.ranks.items():
            self.agents[rank] = backend.add_remote(info.agent_metadata)
            backend.connect(self.agents[rank])  # so the first pull does not pay for wire-up
            if c.verify_exposure:
                table = np.array(
                    [[info.exposure_addr, bucket_bytes, 0, bucket_bytes, info.exposure_buckets]],
                    dtype=np.int64,
                )
                self.check_dlists[rank] = (
                    backend.prep(self.agents[rank], table, "DRAM"),
                    info.exposure_buckets,
                )
        for key, table in plan.tables.items():
            if key[0] == "local":
                self.dlists[key] = c.local_dlist(key, table)
            else:
                info = result.ranks[int(key[1])]  # type: ignore[call-overload]
                self.dlists[key] = backend.prep(self.agents[info.tp_rank], table, info.mem_type)

    def _unload(self) -> None:
        backend = self.consumer.backend_or_none
        if backend is not None:
            for key, handle in self.dlists.items():
                if key[0] == "remote":
                    backend.release_dlist(handle)
            for handle, _ in self.check_dlists.values():
                backend.release_dlist(handle)
            for name in self.agents.values():
                backend.remove_remote(name)
        self.dlists.clear()
        self.check_dlists.clear()
        self.agents.clear()
        self.plan = None

    async def _rehandshake(self) -> None:
        if self._loading is None:  # the first caller resets; later ones wait for its handshake
            for transfer in list(self.transfers):
                self.consumer.fail(transfer, PeerLostError(f"session to {self.endpoint} was reset"))
            self._unload()
        await self.handshake()

    def mark_broken(self, error: AkvError) -> None:
        """Note a failure; a lost peer makes the next pull re-handshake (nothing clears that but one)."""
        self.broken = self.broken or isinstance(error, PeerLostError)

    # -- pulling -------------------------------------------------------------------------

    async def pull(
        self,
        request: PullRequest | str,
        local_block_ids: Sequence[int] | None = None,
        remote_block_ids: Sequence[int] | None = None,
        *,
        transfer_timeout: float | None = None,
    ) -> Transfer:
        """Launch the reads of one request and return its awaitable [`Transfer`][akv.Transfer].

        Args:
            request: a [`PullRequest`][akv.PullRequest], or its ``request_id`` followed by
                the two block id lists.
            local_block_ids: with a request id: this rank's blocks to fill.
            remote_block_ids: with a request id: the request's whole exposure.
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
                request_id=request, local_block_ids=local_block_ids, remote_block_ids=remote_block_ids
            )
        c = self.consumer
        if self.closed or c.closed:
            raise ClosedError("the session is closed")
        if self.broken or self.plan is None:
            await self._rehandshake()
        plan = self.plan
        if plan is None:  # pragma: no cover - a handshake sets it or raises
            raise ClosedError("the session is closed")
        local, remote_all = plan.block_ids(request.local_block_ids, request.remote_block_ids, tail=False)
        remote = remote_all[remote_all.size - local.size :]
        reads = plan.reads(request_key(request.request_id))
        notice = self.done_notice(request.request_id, remote_all)
        timeout = c.transfer_timeout if transfer_timeout is None else transfer_timeout
        heartbeat = self.lease_s / 3 if self.lease_s > 0 else 0.0
        state = TransferState(request.request_id, time.monotonic(), timeout, heartbeat)
        transfer = Transfer(self, request.request_id, reads, remote_all, remote, notice, state)
        if local.size:
            # With the exposure check, the notice rides on the check read (after the data).
            self._post(transfer, reads.ops, local, remote, b"" if c.verify_exposure else notice)
        self.transfers.add(transfer)
        c.track(transfer)
        return transfer

    def done_notice(self, request_id: str, remote_all: npt.NDArray[np.int32]) -> bytes:
        """The "done" notice of a request, with the digest of its prefill block ids."""
        c = self.consumer
        return encode_notice(
            Notice("done", c.engine_id, c.tp_rank, c.tp_size, [request_id], [exposure.digest(remote_all)])
        )

    def _post(
        self,
        transfer: Transfer,
        ops: Sequence[ReadOp],
        local: npt.NDArray[np.int32],
        remote: npt.NDArray[np.int32],
        notice: bytes,
    ) -> None:
        backend = self.consumer.backend
        for op in ops:
            lidx, ridx = TransferPlan.indices(op, local, remote)
            try:
                handle = backend.read(
                    self.dlists[op.local_table], lidx, self.dlists[op.remote_table], ridx, notice
                )
            except TransferError as exc:
                self.mark_broken(exc)
                for posted in transfer.state.fail():
                    self.consumer.drop_handle(posted)
                self.consumer.metrics.inc("transfers_failed")
                raise
            transfer.state.post(handle, op.remote_rank)

    def post_checks(self, transfer: Transfer) -> None:
        """Read the exposure-table bucket of the request from every rank read from (with the notice)."""
        c = self.consumer
        h = exposure.request_hash(transfer.request_id)
        for rank in {op.remote_rank for op in transfer.reads.ops}:
            dlist, buckets = self.check_dlists[rank]
            slot = c.checks.acquire()
            transfer.check_slots[rank] = slot
            handle = c.backend.read(
                c.checks.dlist,
                np.array([slot], dtype=np.int32),
                dlist,
                np.array([h % buckets], dtype=np.int32),
                transfer.notice,
            )
            transfer.state.post(handle, rank)

    def verify(self, transfer: Transfer) -> AkvError | None:
        """Check the buckets read by `post_checks`; None if every block was still exposed."""
        checks = self.consumer.checks
        for rank, slot in transfer.check_slots.items():
            error = exposure.verify(
                checks.array[slot],
                transfer.request_id,
                transfer.remote_ids,
                prefill_rank=rank,
                read_ids=transfer.read_ids.tolist(),
            )
            if error is not None:
                return error
        return None

    def notify(self, ranks: Sequence[int], notice: bytes) -> None:
        """Send a notice to prefill ranks; a failure only logs (the rank releases by lease)."""
        for rank in ranks:
            try:
                self.consumer.backend.notify(self.agents[rank], notice)
                self.consumer.metrics.inc("notifications_sent")
            except (AkvError, KeyError) as exc:
                self.log.warning(
                    "notifying a prefill rank failed; it will release by lease",
                    prefill_rank=rank,
                    error=str(exc),
                )
        self.consumer.flush_notices()

    def extend(self, request_ids: Sequence[str]) -> None:
        """Send "extend" notices for ``request_ids`` to every prefill rank this rank notifies."""
        if not request_ids or self.plan is None:
            return
        c = self.consumer
        self.notify(
            self.plan.notify,
            encode_notice(Notice("extend", c.engine_id, c.tp_rank, c.tp_size, list(request_ids))),
        )

    async def heartbeat(self, request_ids: Sequence[str]) -> None:
        """Extend the prefill leases of ``request_ids``, requests this rank still intends to pull."""
        self.extend(request_ids)

    async def aclose(self) -> None:
        """Fail this session's running transfers and forget the remote agents."""
        if self.closed:
            return
        self.closed = True
        for transfer in list(self.transfers):
            self.consumer.fail(transfer, ClosedError("the session was closed"))
        self._unload()
        self.consumer.forget(self)
