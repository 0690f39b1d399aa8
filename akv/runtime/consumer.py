"""The decode side: connect to prefill engines, run the poller that completes pulls."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
from anyio.abc import TaskGroup

from akv import exposure
from akv.backends import DlistHandle, XferHandle, mem_type
from akv.errors import (
    AkvError,
    BackendError,
    BackPressureError,
    ClosedError,
    ConfigError,
    PeerLostError,
    TransferError,
    TransferTimeout,
)
from akv.geometry.cache import CacheSpec
from akv.geometry.spec import KVSpec
from akv.plan import RankMemory
from akv.protocol.address import Endpoint, EngineAddress, check_engine_id, parse_engine_address
from akv.protocol.handshake import resolve_secret
from akv.runtime.rank import RankBase, default_engine_id
from akv.runtime.session import PullRequest, Transfer, TransferResult, TransferSession
from akv.tracker import Stage, TransferTracker

if TYPE_CHECKING:
    import torch

    from akv.backends import Backend

__all__ = ["Consumer", "PullRequest", "Transfer", "TransferResult", "TransferSession"]

#: Seconds the poller keeps progressing the agent after standalone notices were sent.
FLUSH_S = 0.5
#: Seconds after a timed-out pull during which the idle poller still progresses the agent
#: (every REAP_EVERY_S), so UCX frees the operations to a hung peer once it dies or resumes.
REAP_S, REAP_EVERY_S = 120.0, 0.25


class CheckPool:
    """Registered landing slots for exposure-table buckets (one per check read in flight)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ConfigError(f"max_checks must be >= 1, got {size}")
        self.array = np.zeros((size, exposure.SLOTS, exposure.SLOT_WORDS), dtype=np.int64)
        self._free = list(range(size - 1, -1, -1))
        self.dlist: DlistHandle = None

    def table(self) -> npt.NDArray[np.int64]:
        """The strided table of the slots (one descriptor per slot)."""
        size = self.array[0].nbytes
        return np.array([[self.array.ctypes.data, size, 0, size, len(self.array)]], dtype=np.int64)

    def acquire(self) -> int:
        """A free slot; [`BackPressureError`][akv.errors.BackPressureError] if every one is in use."""
        if not self._free:
            raise BackPressureError(
                f"{len(self.array)} exposure checks already in flight: pull again later, or raise max_checks"
            )
        slot = self._free.pop()
        self.array[slot, :, 0] = 0
        return slot

    def release(self, slot: int) -> None:
        """Return a slot (only once no read can still land in it)."""
        self._free.append(slot)


class Consumer(RankBase):
    """One decode rank: registers its KV cache, connects to prefill engines, runs the poller.

    Use as an async context manager; [`connect`][akv.Consumer.connect] returns a cached
    [`TransferSession`][akv.TransferSession] per endpoint (concurrent callers share one handshake).

    Args:
        kv_caches: this rank's regions (see [`KVSpec.region_shape`][akv.KVSpec.region_shape]), CPU or CUDA tensors.
        spec: the cache description (the same model as the prefill engine's).
        tp_rank: this rank's index in ``[0, tp_size)``.
        tp_size: the decode engine's tensor-parallel size.
        engine_id: the decode engine's name, the same on every rank (prefill ranks count
            readers per decode engine and rank). Default: a name unique to this process (the
            same for its ranks), right for an engine whose ranks all live in it; give every
            rank of a multi-process engine the same explicit name.
        secret: shared secret for the control plane (default ``$AKV_SECRET``).
        connect_timeout: seconds to open a control connection.
        handshake_timeout: seconds for one handshake.
        transfer_timeout: default seconds a pull may take before it fails.
        retries: reconnect attempts for an unreachable endpoint.
        verify_exposure: check after the reads that the blocks were still exposed for the
            request (one small extra read per prefill rank); turn off only to measure it.
        max_checks: exposure checks in flight at once.
        backend: a transport backend to use instead of creating a NIXL agent.
        progress_thread: let UCX run its own progress thread.
        spin_s: how long the poller spins after progress before sleeping.
        poll_max_s: longest sleep of the poller while pulls are in flight.
    """

    _role = "d"

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        spec: KVSpec | CacheSpec,
        *,
        tp_rank: int,
        tp_size: int,
        engine_id: str | None = None,
        secret: str | bytes | None = None,
        connect_timeout: float = 5.0,
        handshake_timeout: float = 10.0,
        transfer_timeout: float = 30.0,
        retries: int = 3,
        verify_exposure: bool = True,
        max_checks: int = 1024,
        backend: Backend | None = None,
        progress_thread: bool = False,
        spin_s: float = 0.002,
        poll_max_s: float = 0.002,
    ) -> None:
        super().__init__(
            kv_caches,
            spec,
            tp_rank=tp_rank,
            tp_size=tp_size,
            engine_id=check_engine_id(engine_id) if engine_id else default_engine_id("decode"),
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
        self.verify_exposure = verify_exposure
        self.mem_type, device = mem_type(self.kv_caches)
        self.memory = RankMemory(tp_rank, tp_size, tuple(t.data_ptr() for t in self.kv_caches), device)
        self.checks = CheckPool(max_checks)
        self.log = self._log
        self._sessions: dict[str, TransferSession] = {}
        self._connecting: dict[str, anyio.Event] = {}
        self._local_dlists: dict[Any, Any] = {}
        self._tracker = TransferTracker()
        self._zombies: dict[XferHandle, int | None] = {}  # handle -> check slot it may still write
        self._flush_until = 0.0
        self._reap_until = 0.0

    async def _enter(self, stack: AsyncExitStack, tg: TaskGroup) -> None:
        backend = self.backend
        if self.verify_exposure:
            await anyio.to_thread.run_sync(backend.register_host, self.checks.array)
            self.checks.dlist = await anyio.to_thread.run_sync(backend.prep, "", self.checks.table(), "DRAM")
        tg.start_soon(self._poll)

    def _teardown(self) -> None:
        backend = self.backend_or_none
        if backend is not None and time.monotonic() < self._reap_until:
            for _ in range(50):  # let UCX retire what it still holds for a lost peer before closing
                try:
                    backend.progress()
                except BackendError:
                    break
                time.sleep(0.002)
        for _state, transfer in self._tracker:
            self.fail(transfer, ClosedError("the consumer was closed"))
        for session in list(self._sessions.values()):
            session.closed = True
            for transfer in list(session.transfers):
                self.fail(transfer, ClosedError("the session was closed"))
            session._unload()
        self._sessions.clear()

    async def aclose(self) -> None:
        """Fail running transfers with [`ClosedError`][akv.errors.ClosedError], release everything. Idempotent."""
        await self.__aexit__(None, None, None)

    @property
    def inflight(self) -> int:
        """Pulls launched and not yet settled."""
        return len(self._tracker)

    @property
    def backend_or_none(self) -> Backend | None:
        """The backend if it is still open."""
        return None if self._backend is None or self._backend.closed else self._backend

    def local_dlist(self, key: Any, table: npt.NDArray[np.int64]) -> Any:
        """The prepared local list for a table key (shared by every session)."""
        handle = self._local_dlists.get(key)
        if handle is None:
            handle = self._local_dlists[key] = self.backend.prep("", table, self.mem_type)
        return handle

    async def connect(self, endpoint: str | EngineAddress | Endpoint | tuple[str, int]) -> TransferSession:
        """The session to the prefill engine at ``endpoint`` (an engine address), handshaking
        once if needed.

        Address forms: ``"HOST:PORT"`` (the engine's bootstrap, rank 0's control endpoint; a
        TP-1 engine's own endpoint), ``"HOST:PORT,HOST:PORT,..."`` (every rank's endpoint in
        rank order) and ``"etcd://HOST:PORT[,HOST:PORT...]/ENGINE_ID"`` (ranks registered in
        etcd). The session handshakes with every prefill rank this rank needs, concurrently.

        Concurrent callers share one handshake; if it fails, each waiter tries again in turn.
        Raises [`HandshakeError`][akv.errors.HandshakeError] (or [`IncompatiblePeerError`][akv.errors.IncompatiblePeerError],
        [`AuthenticationError`][akv.errors.AuthenticationError]) if the handshake fails.
        """
        if not self.running:
            raise ClosedError("the consumer is not running")
        address = parse_engine_address(endpoint)
        key = str(address)
        while True:
            session = self._sessions.get(key)
            if session is not None and not session.closed:
                return session
            pending = self._connecting.get(key)
            if pending is None:
                break
            await pending.wait()  # then look again: the other caller succeeded, or we try
        done = self._connecting[key] = anyio.Event()
        try:
            session = TransferSession(self, address)
            await session.handshake()
            self._sessions[key] = session
            return session
        finally:
            if self._connecting.get(key) is done:
                del self._connecting[key]
            done.set()

    def forget(self, session: TransferSession) -> None:
        """Drop a closed session from the cache."""
        if self._sessions.get(str(session.endpoint)) is session:
            del self._sessions[str(session.endpoint)]

    # -- poller --------------------------------------------------------------------------

    def track(self, transfer: Transfer) -> None:
        """Hand a launched pull to the poller (polled once right away: shared-memory reads are
        often done by the time they are posted)."""
        self._tracker.add(transfer.state, transfer)
        self._check(transfer, time.monotonic())
        if not transfer.done():
            self._backoff.wake()

    def reap(self) -> None:
        """A peer was lost or hung: keep progressing the agent for a while (see REAP_S)."""
        self._reap_until = time.monotonic() + REAP_S
        self._backoff.wake()

    def flush_notices(self) -> None:
        """Standalone notices leave only while the agent progresses: keep the poller at it briefly."""
        self._flush_until = time.monotonic() + FLUSH_S
        self._backoff.wake()

    def drop_handle(self, handle: XferHandle, slot: int | None = None) -> None:
        """Release a handle; if NIXL cannot yet, keep retrying (and keep its check slot)."""
        backend = self.backend_or_none
        if backend is not None and not backend.release(handle):
            self._zombies[handle] = slot
        elif slot is not None:
            self.checks.release(slot)

    def fail(self, transfer: Transfer, error: AkvError) -> None:
        """Fail a pull: release its handles and settle it with ``error``."""
        slots = {rank: slot for rank, slot in transfer.check_slots.items()}
        pending = transfer.state.pending
        for handle, rank in list(pending.items()):
            self.drop_handle(
                handle, slots.pop(rank, None) if transfer.state.stage is Stage.CHECKING else None
            )
        for slot in slots.values():
            self.checks.release(slot)
        transfer.check_slots.clear()
        was_done = transfer.done()
        transfer.state.fail()
        self._tracker.discard(transfer.state)
        transfer.session.transfers.discard(transfer)
        if isinstance(error, (TransferTimeout, PeerLostError)):
            # Operations to a hung or lost peer stay pending in UCX (releasing a handle does not
            # cancel them) until the peer dies or resumes *and* this agent progresses: keep reaping.
            self.reap()
        if not was_done:
            self.metrics.inc(
                "transfers_timed_out" if isinstance(error, TransferTimeout) else "transfers_failed"
            )
            self._log.info("transfer failed", request=transfer.request_id, error=str(error))
        transfer.finish(error)

    def _complete(self, transfer: Transfer) -> None:
        session = transfer.session
        error = session.verify(transfer) if transfer.check_slots else None
        if error is not None:
            self.metrics.inc("unsafe_reads")
            self.fail(transfer, error)
            return
        for slot in transfer.check_slots.values():
            self.checks.release(slot)
        transfer.check_slots.clear()
        self._tracker.discard(transfer.state)
        session.transfers.discard(transfer)
        # Reads carry their own notification; the other ranks (all, if nothing was read) get one now.
        ranks = transfer.prepared.standalone
        if ranks:
            session.notify(ranks, transfer.notice)
        transfer.finish()
        result = transfer.result()
        self.metrics.inc("transfers")
        self.metrics.observe_transfer(result.bytes, result.descriptors, result.seconds)

    def _stage_over(self, transfer: Transfer) -> None:
        checking = self.verify_exposure and bool(transfer.prepared.posts)
        if transfer.state.advance(checking) is Stage.CHECKING:
            try:
                transfer.session.post_checks(transfer)
            except TransferError as exc:
                transfer.session.mark_broken(exc, getattr(exc, "prefill_rank", None))
                self.fail(transfer, exc)
                return
            self._check(transfer, time.monotonic())
            return
        self._complete(transfer)

    def _check(self, transfer: Transfer, now: float) -> bool:
        """Poll one transfer's handles; True if anything changed."""
        state = transfer.state
        if state.finished:
            return False
        backend = self.backend
        changed = False
        for handle in list(state.pending):
            try:
                done = backend.state(handle) == "DONE"
            except TransferError as exc:
                transfer.session.mark_broken(exc, state.pending.get(handle))
                self.fail(transfer, exc)
                return True
            if done:
                backend.release(handle)
                changed = True
                if state.completed(handle):
                    self._stage_over(transfer)
                    return True
        if not state.pending:
            self._stage_over(transfer)
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
            transfer.session.extend([transfer.request_id])
        return changed

    async def _poll(self) -> None:
        backoff = self._backoff
        while True:
            now = time.monotonic()
            progressed = False
            for _state, transfer in self._tracker:
                try:
                    progressed |= self._check(transfer, now)
                except BackendError as exc:  # pragma: no cover - defensive: keep polling
                    self.fail(transfer, exc)
            backend = self.backend
            for handle, slot in list(self._zombies.items()):
                if backend.release(handle):
                    del self._zombies[handle]
                    if slot is not None:
                        self.checks.release(slot)
            if progressed:
                backoff.progressed()
            flushing = now < self._flush_until
            reaping = now < self._reap_until
            if flushing or reaping:
                try:
                    backend.progress()
                except BackendError as exc:  # pragma: no cover - defensive: keep polling
                    self._log.warning("progressing the agent failed", error=str(exc))
            if len(self._tracker) or flushing:
                await backoff.wait(busy=True)
            else:
                limit = 0.01 if self._zombies else REAP_EVERY_S if reaping else math.inf
                await backoff.wait(busy=False, limit=limit)
