"""The decode side: handshake with prefill engines, pull requests, await completions."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Generator, Sequence
from typing import Any

import anyio
import msgspec
import numpy as np
import numpy.typing as npt
import torch

from akv import tp
from akv._poll import Backoff
from akv._rank import RankBase
from akv.backend import NixlBackend, XferHandle
from akv.control import Endpoint, HandshakeResult, client_handshake, parse_endpoint, resolve_secret
from akv.errors import (
    AkvError,
    BackendError,
    ClosedError,
    ConfigError,
    PeerLostError,
    TransferError,
    TransferTimeout,
)
from akv.plan import RankMemory, ReadOp, RequestReads, TransferPlan, request_key
from akv.spec import KVSpec
from akv.wire import Challenge, Hello, Notice, encode_notice

__all__ = ["Consumer", "PullRequest", "Transfer", "TransferResult", "TransferSession"]


class PullRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What to pull: the prefill engine's block ids of a request, and where they go locally.

    With fewer local than remote blocks (a partial prefix hit), only the last remote blocks
    are read, into the local blocks in order.
    """

    request_id: str
    local_block_ids: Sequence[int] | npt.NDArray[np.integer[Any]]
    remote_block_ids: Sequence[int] | npt.NDArray[np.integer[Any]]


class TransferResult(msgspec.Struct, frozen=True):
    """A completed pull."""

    request_id: str
    bytes: int
    descriptors: int
    reads: int
    seconds: float


class Transfer:
    """The awaitable completion of one pull.

    ``await transfer`` returns a :class:`TransferResult` or raises a :class:`TransferError`.
    Cancelling the awaiting task only stops the wait: the reads run to completion (or fail)
    under the consumer's poller, which releases every NIXL handle.
    """

    def __init__(
        self,
        session: TransferSession,
        request_id: str,
        reads: RequestReads,
        nblocks: int,
        notice: bytes,
        timeout: float,
    ) -> None:
        self.session = session
        self.request_id = request_id
        self._reads = reads
        self._bytes = reads.bytes_per_block * nblocks
        self._descriptors = reads.segments * nblocks
        self._notice = notice  # the "done" notification, sent by the reads and to the other ranks
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.last_heartbeat = self.started
        self._handles: dict[XferHandle, int] = {}
        self._event: anyio.Event | None = None  # created only if someone waits unfinished
        self._done = False
        self._result: TransferResult | None = None
        self._error: AkvError | None = None

    def done(self) -> bool:
        """True once the transfer completed or failed."""
        return self._done

    def result(self) -> TransferResult:
        """The result; raises the transfer's error, or :class:`TransferError` if not done yet."""
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
        if not self._done:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        return self.result()

    def __await__(self) -> Generator[Any, None, TransferResult]:
        return self.wait().__await__()

    def _finish(self, error: AkvError | None = None) -> None:
        if self.done():
            return
        if error is None:
            seconds = time.monotonic() - self.started
            self._result = TransferResult(
                self.request_id, self._bytes, self._descriptors, len(self._reads.ops), seconds
            )
        else:
            self._error = error
        self._done = True
        if self._event is not None:
            self._event.set()

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "running"
        return f"<Transfer {self.request_id!r} {state}>"


class TransferSession:
    """A decode rank's link to one prefill engine: metadata loaded, descriptor lists prepared.

    Created by :meth:`Consumer.connect`. After a peer is lost the session re-handshakes on the
    next :meth:`pull`, never reusing the old agents' metadata.
    """

    def __init__(self, consumer: Consumer, endpoint: Endpoint) -> None:
        self.consumer = consumer
        self.endpoint = endpoint
        self._log = consumer._log.bind(endpoint=str(endpoint))
        self.remote_engine_id = ""
        self.prefill_tp = 0
        self.lease_s = 0.0
        self.plan: TransferPlan | None = None
        self._agents: dict[int, str] = {}
        self._dlists: dict[Any, Any] = {}
        self._done_notice: dict[str, bytes] = {}
        self.broken = False
        self.closed = False
        self.transfers: set[Transfer] = set()

    # -- setup ---------------------------------------------------------------------------

    async def _handshake(self) -> None:
        c = self.consumer
        hello = Hello(
            engine_id=c.engine_id,
            tp_rank=c.tp_rank,
            tp_size=c.tp_size,
            spec=c.spec,
            compat=c.spec.compat_hash(),
            nonce=secrets.token_bytes(16),
        )

        def choose(ch: Challenge) -> list[int]:
            ranks = tp.notify_ranks(
                decode_rank=c.tp_rank,
                decode_tp=c.tp_size,
                prefill_tp=ch.tp_size,
                kv_heads=c.spec.kv_heads,
                mla=c.spec.kind == "mla",
            )
            return list(ranks)

        try:
            result = await client_handshake(
                self.endpoint,
                hello,
                secret=c.secret,
                choose_ranks=choose,
                connect_timeout=c.connect_timeout,
                handshake_timeout=c.handshake_timeout,
                retries=c.retries,
            )
        except AkvError:
            c.metrics.inc("handshakes_failed")
            raise
        try:
            self._load(result)
        except BaseException:
            self._unload()
            c.metrics.inc("handshakes_failed")
            raise
        c.metrics.inc("handshakes")
        self._log.info("handshake done", remote=self.remote_engine_id, prefill_tp=self.prefill_tp)

    def _load(self, result: HandshakeResult) -> None:
        c = self.consumer
        ch = result.challenge
        self.remote_engine_id = ch.engine_id
        self.prefill_tp = ch.tp_size
        self.lease_s = ch.lease_s
        remote = {
            r: RankMemory(r, ch.tp_size, tuple(i.region_addrs), i.device_id) for r, i in result.ranks.items()
        }
        plan = TransferPlan(local_spec=c.spec, local=c.memory, remote_spec=ch.spec, remote=remote)
        for rank, info in result.ranks.items():
            self._agents[rank] = c.backend.add_remote(info.agent_metadata)
            c.backend.connect(self._agents[rank])  # so the first pull does not pay for wire-up
        for key, table in plan.tables.items():
            if key[0] == "local":
                self._dlists[key] = c.local_dlist(key, table)
            else:
                info = result.ranks[int(key[1])]  # type: ignore[call-overload]
                self._dlists[key] = c.backend.prep(self._agents[info.tp_rank], table, info.mem_type)
        self.plan = plan
        self.broken = False

    def _unload(self) -> None:
        backend = self.consumer._backend
        if backend is None:
            return
        for key, handle in list(self._dlists.items()):
            if key[0] == "remote":
                backend.release_dlist(handle)
        self._dlists.clear()
        for name in self._agents.values():
            backend.remove_remote(name)
        self._agents.clear()
        self.plan = None

    async def _rehandshake(self) -> None:
        for transfer in list(self.transfers):
            self.consumer._fail(transfer, PeerLostError(f"session to {self.endpoint} was reset"))
        self._unload()
        await self._handshake()

    # -- pulling -------------------------------------------------------------------------

    async def pull(
        self,
        request: PullRequest | str,
        local_block_ids: Sequence[int] | None = None,
        remote_block_ids: Sequence[int] | None = None,
        *,
        transfer_timeout: float | None = None,
    ) -> Transfer:
        """Launch the reads of one request and return its awaitable :class:`Transfer`.

        Accepts a :class:`PullRequest` or ``(request_id, local_block_ids, remote_block_ids)``.
        Raises :class:`BlockIdError` for bad block ids, :class:`HandshakeError` if a needed
        re-handshake fails, :class:`PeerLostError` if the reads cannot be posted.
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
        if plan is None:  # pragma: no cover - _rehandshake sets it or raises
            raise ClosedError("the session is closed")
        local, remote = plan.block_ids(request.local_block_ids, request.remote_block_ids)
        reads = plan.reads(request_key(request.request_id))
        notice = encode_notice(Notice("done", c.engine_id, c.tp_rank, c.tp_size, [request.request_id]))
        nblocks = int(local.size)
        transfer = Transfer(
            self,
            request.request_id,
            reads,
            nblocks,
            notice,
            c.transfer_timeout if transfer_timeout is None else transfer_timeout,
        )
        if nblocks:
            self._post(transfer, reads.ops, local, remote, notice)
        self.transfers.add(transfer)
        c._track(transfer)
        return transfer

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
                    self._dlists[op.local_table], lidx, self._dlists[op.remote_table], ridx, notice
                )
            except TransferError:
                self.broken = True
                for posted in list(transfer._handles):
                    self.consumer._drop_handle(posted)
                transfer._handles.clear()
                self.consumer.metrics.inc("transfers_failed")
                raise
            transfer._handles[handle] = op.remote_rank

    def _notify(self, ranks: Sequence[int], notice: bytes) -> None:
        for rank in ranks:
            try:
                self.consumer.backend.notify(self._agents[rank], notice)
                self.consumer.metrics.inc("notifications_sent")
            except (AkvError, KeyError) as exc:
                self._log.warning(
                    "notifying a prefill rank failed; it will release by lease",
                    prefill_rank=rank,
                    error=str(exc),
                )

    async def heartbeat(self, request_ids: Sequence[str]) -> None:
        """Extend the prefill leases of requests this rank still intends to pull."""
        if not request_ids or self.plan is None:
            return
        c = self.consumer
        notice = encode_notice(Notice("extend", c.engine_id, c.tp_rank, c.tp_size, list(request_ids)))
        self._notify(self.plan.notify, notice)

    async def aclose(self) -> None:
        """Fail this session's running transfers and forget the remote agents."""
        if self.closed:
            return
        self.closed = True
        for transfer in list(self.transfers):
            self.consumer._fail(transfer, ClosedError("the session was closed"))
        self._unload()
        self.consumer._sessions.pop(str(self.endpoint), None)


class Consumer(RankBase):
    """One decode rank: registers its KV cache, connects to prefill engines, runs the poller.

    Use as an async context manager; :meth:`connect` returns a cached
    :class:`TransferSession` per endpoint (concurrent callers share one handshake).
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        spec: KVSpec,
        *,
        tp_rank: int,
        tp_size: int,
        engine_id: str = "decode",
        secret: str | bytes | None = None,
        connect_timeout: float = 5.0,
        handshake_timeout: float = 10.0,
        transfer_timeout: float = 30.0,
        retries: int = 3,
        backend: NixlBackend | None = None,
        progress_thread: bool = False,
        spin_s: float = 0.002,
        poll_max_s: float = 0.002,
    ) -> None:
        super().__init__(
            kv_caches,
            spec,
            tp_rank=tp_rank,
            tp_size=tp_size,
            engine_id=engine_id,
            backend=backend,
            progress_thread=progress_thread,
            spin_s=spin_s,
            poll_max_s=poll_max_s,
        )
        if not transfer_timeout > 0:
            raise ConfigError(f"transfer_timeout must be > 0, got {transfer_timeout}")
        self.secret = resolve_secret(secret)
        self.connect_timeout = connect_timeout
        self.handshake_timeout = handshake_timeout
        self.transfer_timeout = transfer_timeout
        self.retries = retries
        self.mem_type, device = NixlBackend.mem_type(self.kv_caches)
        self.memory = RankMemory(tp_rank, tp_size, tuple(t.data_ptr() for t in self.kv_caches), device)
        self._sessions: dict[str, TransferSession] = {}
        self._connecting: dict[str, anyio.Event] = {}
        self._local_dlists: dict[Any, Any] = {}
        self._inflight: set[Transfer] = set()
        self._zombies: set[XferHandle] = set()

    async def __aenter__(self) -> Consumer:
        try:
            tg = await self._start()
            tg.start_soon(self._poll)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Fail running transfers with :class:`ClosedError`, release everything. Idempotent."""
        if self.closed:
            return
        self.closed = True
        await self._stop_tasks()
        for transfer in list(self._inflight):
            self._fail(transfer, ClosedError("the consumer was closed"))
        for session in list(self._sessions.values()):
            await session.aclose()
        if self._backend is not None:
            self._backend.close()

    def local_dlist(self, key: Any, table: npt.NDArray[np.int64]) -> Any:
        """The prepared local list for a table key (shared by every session)."""
        handle = self._local_dlists.get(key)
        if handle is None:
            handle = self.backend.prep("", table, self.mem_type)
            self._local_dlists[key] = handle
        return handle

    async def connect(self, endpoint: str | Endpoint | tuple[str, int]) -> TransferSession:
        """The session to the prefill engine at ``endpoint``, handshaking once if needed.

        Raises :class:`HandshakeError` (or :class:`IncompatiblePeerError`,
        :class:`AuthenticationError`) if the handshake fails.
        """
        if self.closed or self._tg is None:
            raise ClosedError("the consumer is not running")
        ep = parse_endpoint(endpoint)
        key = str(ep)
        while True:
            session = self._sessions.get(key)
            if session is not None and not session.closed:
                return session
            pending = self._connecting.get(key)
            if pending is None:
                break
            await pending.wait()
            if key not in self._sessions:
                break  # the other caller failed: try ourselves
        done = anyio.Event()
        self._connecting[key] = done
        try:
            session = TransferSession(self, ep)
            await session._handshake()
            self._sessions[key] = session
            return session
        finally:
            del self._connecting[key]
            done.set()

    # -- poller --------------------------------------------------------------------------

    def _track(self, transfer: Transfer) -> None:
        if not transfer._handles:
            self._complete(transfer)
            return
        # Reads over shared memory are often done by the time they are posted: poll once now
        # (which also lets NIXL send the notification) before handing them to the poller.
        self._check(transfer, time.monotonic())
        if not transfer.done():
            self._inflight.add(transfer)
            if self._backoff is not None:
                self._backoff.wake()

    def _drop_handle(self, handle: XferHandle) -> None:
        if self._backend is not None and not self._backend.release(handle):
            self._zombies.add(handle)  # still active: retry the release on the next polls

    def _fail(self, transfer: Transfer, error: AkvError) -> None:
        for handle in list(transfer._handles):
            self._drop_handle(handle)
        transfer._handles.clear()
        self._inflight.discard(transfer)
        transfer.session.transfers.discard(transfer)
        if not transfer.done():
            self.metrics.inc(
                "transfers_timed_out" if isinstance(error, TransferTimeout) else "transfers_failed"
            )
            self._log.info(
                "transfer failed",
                request=transfer.request_id,
                error=str(error),
            )
        transfer._finish(error)

    def _complete(self, transfer: Transfer) -> None:
        self._inflight.discard(transfer)
        session = transfer.session
        session.transfers.discard(transfer)
        # Reads carry their own notification; the other ranks (all, if nothing was read) get one now.
        if transfer._bytes:
            ranks: Sequence[int] = transfer._reads.standalone_notify
        else:
            ranks = session.plan.notify if session.plan else ()
        if ranks:
            session._notify(ranks, transfer._notice)
        transfer._finish()
        if transfer._result is not None:
            r = transfer._result
            self.metrics.inc("transfers")
            self.metrics.observe_transfer(r.bytes, r.descriptors, r.seconds)

    def _check(self, transfer: Transfer, now: float) -> bool:
        """Poll one transfer's handles; True if anything changed."""
        backend = self.backend
        changed = False
        for handle in list(transfer._handles):
            try:
                state = backend.state(handle)
            except TransferError as exc:
                transfer.session.broken = isinstance(exc, PeerLostError)
                self._fail(transfer, exc)
                return True
            if state == "DONE":
                backend.release(handle)
                del transfer._handles[handle]
                changed = True
        if not transfer._handles:
            self._complete(transfer)
            return True
        if now > transfer.deadline:
            self._fail(
                transfer,
                TransferTimeout(
                    f"transfer {transfer.request_id!r} from {transfer.session.endpoint} did not finish "
                    f"within {transfer.deadline - transfer.started:.1f}s (hung peer?)"
                ),
            )
            return True
        lease = transfer.session.lease_s
        if lease > 0 and now - transfer.last_heartbeat > lease / 3:
            transfer.last_heartbeat = now
            session = transfer.session
            if session.plan is not None:
                notice = encode_notice(
                    Notice("extend", self.engine_id, self.tp_rank, self.tp_size, [transfer.request_id])
                )
                session._notify(session.plan.notify, notice)
        return changed

    async def _poll(self) -> None:
        backoff = self._backoff or Backoff()
        while True:
            now = time.monotonic()
            progressed = False
            for transfer in list(self._inflight):
                try:
                    progressed |= self._check(transfer, now)
                except BackendError as exc:  # pragma: no cover - defensive: keep polling
                    self._fail(transfer, exc)
            for handle in list(self._zombies):
                if self.backend.release(handle):
                    self._zombies.discard(handle)
            if progressed:
                backoff.progressed()
            if self._inflight:
                await backoff.wait(busy=True)
            else:
                await backoff.wait(busy=False, limit=math.inf if not self._zombies else 0.01)
