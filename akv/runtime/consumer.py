"""The decode side: connect to prefill engines, run the poller that completes pulls."""

from __future__ import annotations

import contextlib
import gc
import math
import secrets
import time
from collections.abc import Collection, Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
from anyio.abc import TaskGroup

from akv._poll import from_threads
from akv.backends import Reaper, mem_type, ucx_tcp_only
from akv.errors import (
    AkvError,
    BackendError,
    ClosedError,
    ConfigError,
    PeerLostError,
    ProtocolError,
    TransferTimeout,
    UnsafeReadError,
)
from akv.geometry.cache import CacheSpec
from akv.geometry.layout import rank_layout
from akv.geometry.spec import KVSpec
from akv.packing import DIR_WORDS, CacheViews
from akv.plan import RankMemory
from akv.protocol.address import Endpoint, EngineAddress, check_engine_id, parse_engine_address
from akv.protocol.handshake import resolve_secret
from akv.protocol.push import decode_push
from akv.runtime.packer import check_transfer
from akv.runtime.paths import Failed, Pending
from akv.runtime.paths.packed import AUTO_DESCRIPTORS, StagingPool
from akv.runtime.paths.push import PushOp
from akv.runtime.paths.read import CheckPool, flush_after_notice
from akv.runtime.rank import RankBase, default_engine_id
from akv.runtime.session import PullRequest, Transfer, TransferResult, TransferSession
from akv.tls import TLSConfig
from akv.tracker import TransferTracker

if TYPE_CHECKING:
    import torch

    from akv.backends import Backend

__all__ = ["Consumer", "PullRequest", "Transfer", "TransferResult", "TransferSession"]

#: Seconds the poller keeps progressing the agent after standalone notices were sent.
FLUSH_S = 0.5
#: Longest sleep of the poller while push pulls are in flight.
PUSH_POLL_S = 0.0005
#: Seconds after a timed-out pull during which the idle poller still progresses the agent
#: (every REAP_EVERY_S), so UCX frees the operations to a hung peer once it dies or resumes.
REAP_S, REAP_EVERY_S = 120.0, 0.25


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
        same_process: prefill ranks living in this process: ``"auto"`` copies from them with
            torch (on their device) and reads the others through NIXL; ``"copy"`` requires
            every prefill rank to live here (an [`IncompatiblePeerError`][akv.errors.IncompatiblePeerError]
            at connect otherwise); ``"nixl"`` always reads through NIXL.
        copy_inline_bytes: DRAM pulls on the copy path up to this size are copied at launch,
            on the event loop's thread (fastest: no thread hand-off); larger ones in a worker
            thread, so the loop never stalls for long. CUDA copies are always asynchronous.
        copy_with: how the copy path moves bytes: ``"auto"`` (memory moves in DRAM, torch
            gathers and scatters on GPUs) or ``"torch"`` (torch everywhere: the GPU code path,
            also on CPU tensors).
        max_checks: exposure checks in flight at once.
        settle_timeout: seconds a failed, timed-out or closed pull waits for NIXL to report
            reads it started finished (UCX cannot cancel a read in flight) before this rank
            destroys its NIXL agent, so that nothing of them can land, and starts a fresh one
            (sessions re-link on their next pull). A pull never reports its outcome while a
            read it started may still write into its blocks.
        tls: handshake over TLS, verifying the prefill ranks' certificates against its CA
            (and presenting its certificate, if any); see [`TLSConfig`][akv.TLSConfig].
        backend: a transport backend to use instead of creating a NIXL agent.
        progress_thread: let UCX run its own progress thread.
        nixl_threads: worker threads of the NIXL agent, for posting large transfers in
            parallel (0: none, NIXL's default; see docs/gpu.md).
        spin_s: how long the poller spins after progress before sleeping.
        poll_max_s: longest sleep of the poller while pulls are in flight.
        mode: ``"pull"`` (this rank READs) or ``"push"`` (the prefill ranks WRITE into the
            blocks each pull grants them, layer by layer as prefill computes them; the
            prefill engine must serve push, else connecting raises
            [`IncompatiblePeerError`][akv.errors.IncompatiblePeerError] naming ``mode``).
            Same API either way; ``TransferResult.path`` says ``"push"``. ``None`` (the
            default): ``"push"`` when ``UCX_TLS`` leaves TCP as the only transport (a decode
            rank dying mid-READ over UCX TCP can crash the prefill process, see
            docs/operations.md#peer-death-over-tcp) and ``transfer`` is not ``"packed"``,
            else ``"pull"``.
        stop_grace_s: push mode: seconds a failed or cancelled pull waits for its writers to
            confirm they stopped before it removes their agents and settles anyway.
        transfer: which copy of a request to read: ``"direct"`` (the paged blocks), ``"packed"``
            (the prefill ranks' packed copies, see docs/concepts.md#packed-transfers; an
            [`IncompatiblePeerError`][akv.errors.IncompatiblePeerError] naming ``transfer`` at
            connect if a prefill rank keeps none) or ``"auto"`` (packed where every rank read
            from packs and the direct read would post more than ``pack_threshold``
            descriptors, or a rank released its blocks after packing). Pull mode only:
            ``mode="push"`` with ``transfer="packed"`` is a
            [`ConfigError`][akv.errors.ConfigError] (pushes write the paged blocks).
        pack_staging_bytes: the registered staging area packed reads land in (a pull that
            finds it full reads directly, or fails with
            [`BackPressureError`][akv.errors.BackPressureError] when it cannot).
        pack_threshold: ``transfer="auto"``'s descriptor count (default: measured, see
            docs/performance.md#packed-transfers).
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
        same_process: str = "auto",
        copy_inline_bytes: int = 128 << 20,
        copy_with: str = "auto",
        max_checks: int = 1024,
        backend: Backend | None = None,
        progress_thread: bool = False,
        spin_s: float = 0.002,
        poll_max_s: float = 0.002,
        nixl_threads: int = 0,
        settle_timeout: float = 2.0,
        tls: TLSConfig | None = None,
        mode: str | None = None,
        stop_grace_s: float = 5.0,
        transfer: str = "auto",
        pack_staging_bytes: int = 64 << 20,
        pack_threshold: int = AUTO_DESCRIPTORS,
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
            nixl_threads=nixl_threads,
        )
        if not transfer_timeout > 0:
            raise ConfigError(f"transfer_timeout must be > 0, got {transfer_timeout}")
        if not 0 < settle_timeout < float("inf"):
            raise ConfigError(f"settle_timeout must be a finite number of seconds > 0, got {settle_timeout}")
        self.settle_timeout = settle_timeout
        self.tls_context = tls.client_context() if tls is not None else None
        self.secret = resolve_secret(secret)
        self.connect_timeout = connect_timeout
        self.handshake_timeout = handshake_timeout
        self.transfer_timeout = transfer_timeout
        self.retries = retries
        self.verify_exposure = verify_exposure
        if same_process not in ("auto", "copy", "nixl"):
            raise ConfigError(f"same_process must be 'auto', 'copy' or 'nixl', got {same_process!r}")
        self.same_process = same_process
        if copy_inline_bytes < 0:
            raise ConfigError(f"copy_inline_bytes must be >= 0, got {copy_inline_bytes}")
        self.copy_inline_bytes = copy_inline_bytes
        if copy_with not in ("auto", "torch"):
            raise ConfigError(f"copy_with must be 'auto' or 'torch', got {copy_with!r}")
        self.copy_with = copy_with
        if mode is None:
            mode = "push" if ucx_tcp_only() and transfer != "packed" else "pull"
        if mode not in ("pull", "push"):
            raise ConfigError(f"mode must be 'pull' or 'push', got {mode!r}")
        if mode == "pull" and backend is None and ucx_tcp_only():
            self._log.warning(
                "pull mode over UCX TCP: a decode rank dying mid-read can crash the prefill "
                "process (UCX 1.23); push mode avoids it (docs/operations.md#peer-death-over-tcp)"
            )
        self.mode: str = mode
        if not stop_grace_s > 0:
            raise ConfigError(f"stop_grace_s must be > 0, got {stop_grace_s}")
        self.stop_grace_s = stop_grace_s
        self._grants: dict[int, Transfer] = {}  # push: grant id -> its pull, until settled
        self._stopping: dict[Transfer, tuple[AkvError, float]] = {}  # failed pushes, writers not stopped yet
        self._metadata: bytes | None = None
        self.mem_type, device = mem_type(self.kv_caches)
        self.memory = RankMemory(tp_rank, tp_size, tuple(t.data_ptr() for t in self.kv_caches), device)
        self.checks = CheckPool(max_checks)
        self.transfer = check_transfer(transfer)
        if self.transfer == "packed" and self.mode == "push":
            raise ConfigError(
                "transfer='packed' picks which copy a pull reads; push mode writes into the paged "
                "blocks: use mode='pull' with it, or transfer='auto' / 'direct'"
            )
        if pack_threshold < 0:
            raise ConfigError(f"pack_threshold must be >= 0, got {pack_threshold}")
        self.pack_threshold = pack_threshold
        if pack_staging_bytes < 256:
            raise ConfigError(f"pack_staging_bytes must be >= 256, got {pack_staging_bytes}")
        self.pack_staging_bytes = pack_staging_bytes
        self.staging: StagingPool | None = None  # set up with the first prefill rank that packs
        self.directories: CheckPool | None = None
        self.pack_views = CacheViews(self.kv_caches, rank_layout(self.cache, tp_rank, tp_size))
        self._max_checks = max_checks
        self._packing = anyio.Lock()
        self.log = self._log
        self._sessions: dict[str, TransferSession] = {}
        self._connecting: dict[str, anyio.Event] = {}
        self._local_dlists: dict[Any, Any] = {}
        self._tracker = TransferTracker()
        self._reaper: Reaper | None = None
        self._flush_until = 0.0
        self._reap_until = 0.0
        # prefill ranks sent notices since the poller last flushed behind them
        self._unflushed: set[tuple[TransferSession, int]] = set()
        self._settling: dict[Transfer, AkvError] = {}  # failed pulls whose reads may still land
        self.agent_epoch = 0  # bumped each time the agent is replaced (see settle_timeout)
        self._resetting: anyio.Event | None = None  # set while the agent is being replaced
        self._retry_reset_at = 0.0

    async def _enter(self, stack: AsyncExitStack, tg: TaskGroup) -> None:
        backend = self.backend
        self._reaper = Reaper(backend)
        if self.mode == "push":
            self._metadata = await anyio.to_thread.run_sync(backend.metadata)
            stack.push_async_callback(self._stop_pushes)  # runs before the poller stops
        if self.verify_exposure:
            await anyio.to_thread.run_sync(backend.register_host, self.checks.array)
            self.checks.dlist = await anyio.to_thread.run_sync(backend.prep, "", self.checks.table(), "DRAM")
        tg.start_soon(self._poll)

    async def _stop_pushes(self) -> None:
        """Closing: fail the push pulls in flight and wait (up to ``stop_grace_s``) until
        their writers stopped, while the poller still runs."""
        with anyio.CancelScope(shield=True):
            for _state, transfer in list(self._tracker):
                self.fail(transfer, ClosedError("the consumer was closed"))
            with anyio.move_on_after(self.stop_grace_s + 1):
                await self.settled()

    async def enable_packing(self) -> None:
        """Allocate and register the staging area of packed reads (once; the first session
        to a prefill engine that packs calls this)."""
        async with self._packing:
            if self.staging is not None or self.transfer == "direct":
                return
            staging = StagingPool(self.pack_staging_bytes, self.kv_caches[0])
            staging.wake = from_threads(self._backoff.wake)
            directories = CheckPool(self._max_checks, DIR_WORDS)
            backend = self.backend
            await anyio.to_thread.run_sync(backend.register, [staging.tensor])
            await anyio.to_thread.run_sync(backend.register_host, directories.array)
            directories.dlist = await anyio.to_thread.run_sync(backend.prep, "", directories.table(), "DRAM")
            self.staging, self.directories = staging, directories

    def _teardown(self) -> None:
        backend = self.backend_or_none
        now = time.monotonic()
        if backend is not None and (now < self._reap_until or now < self._flush_until):
            # let UCX send the notices still queued, and retire what it holds for a lost peer
            for _ in range(50):
                try:
                    backend.progress()
                except BackendError:
                    break
                time.sleep(0.002)
        for _state, transfer in self._tracker:
            self.fail(transfer, ClosedError("the consumer was closed"))
        for session in list(self._sessions.values()):
            for transfer in list(session.transfers):
                self.fail(transfer, ClosedError("the session was closed"))
        # Push writers asked to stop and not confirmed yet: the agent closes now (their
        # connections go with it); see docs/concepts.md#push-mode for what that guarantees.
        for transfer, (error, _) in list(self._stopping.items()):
            self.metrics.inc("push_stops_unconfirmed")
            transfer.finish(error)
        self._stopping.clear()
        self._grants.clear()
        if (self._settling or (self._reaper is not None and len(self._reaper))) and backend is not None:
            backend.close()  # nothing of the failed pulls can land once the agent is destroyed
            if self._reaper is not None:
                self._reaper.abandon()  # drops their handles: the agent goes with the last one
        self._finish_settled(everything=True)
        for session in list(self._sessions.values()):
            session.closed = True
            session._unload()
        self._sessions.clear()
        if self.staging is not None:
            self.staging.close()

    async def aclose(self) -> None:
        """Fail running transfers with [`ClosedError`][akv.errors.ClosedError], release everything. Idempotent."""
        await self.__aexit__(None, None, None)

    @property
    def inflight(self) -> int:
        """Pulls launched and not yet settled."""
        return len(self._tracker)

    @property
    def reaper(self) -> Reaper:
        """Releases transfer handles, now or once NIXL can (valid inside the context manager)."""
        if self._reaper is None:
            raise ClosedError("the consumer is not running")
        return self._reaper

    @property
    def backend_or_none(self) -> Backend | None:
        """The backend if it is still open."""
        return None if self._backend is None or self._backend.closed else self._backend

    @property
    def agent_metadata(self) -> bytes:
        """This rank's agent metadata (push mode: the prefill ranks load it to write)."""
        if self._metadata is None:
            self._metadata = self.backend.metadata()
        return self._metadata

    def new_grant(self) -> int:
        """A fresh push grant id (random, never 0, not in use)."""
        while True:
            grant = secrets.randbits(62) + 1
            if grant not in self._grants:
                return grant

    async def settled(self, session: TransferSession | None = None) -> None:
        """Wait until the failed pulls (of ``session``, or all) have settled: nothing of their
        reads can still land (see ``settle_timeout``), and every push writer confirmed it
        stopped, or was cut off (see ``stop_grace_s``)."""
        while waiting := [
            t for t in (*self._stopping, *self._settling) if session is None or t.session is session
        ]:
            running = [t for t in waiting if not t.done()]
            if not running:  # reported, not forgotten yet: look again shortly
                await anyio.sleep(0.005)
                continue
            with contextlib.suppress(AkvError):
                await running[0].wait()

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
        if isinstance(transfer.op, PushOp):
            self._grants[transfer.op.grant] = transfer
        self._check(transfer, time.monotonic())
        if self._unflushed:  # it finished at once: flush before the caller's next pull
            self._flush_noticed()
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

    def noticed(self, session: TransferSession, ranks: Collection[int]) -> None:
        """Notices went to these prefill ranks over NIXL: the poller flushes behind them at the
        end of its round, one background READ per rank however many notices it got (see
        `akv.runtime.paths.read.flush_after_notice`)."""
        self._unflushed.update((session, rank) for rank in ranks)
        self._backoff.wake()

    def _flush_noticed(self) -> None:
        """One background READ behind the notices to each rank noticed, unless a pull of its
        session has yet to send its notice (the prefill rank's poller is busy until then, so
        it acknowledges at once; that pull is noticed in turn); a rank not linked any more,
        or failing, gets none."""
        unflushed, self._unflushed = self._unflushed, set()
        for session, rank in unflushed:
            if session.closed or any(not t.notified for t in session.transfers):
                continue
            link = session.links.get(rank)
            if link is not None and link.check is not None and not link.broken:
                flush_after_notice(self.backend, self.reaper, self.checks, link.check)

    def fail(self, transfer: Transfer, error: AkvError) -> None:
        """Fail a pull: stop its transfer and settle it with ``error`` once nothing it started
        can still write into its blocks: at once, unless NIXL still reports reads running (see
        ``settle_timeout``) or push writers have not confirmed they stopped (see
        ``stop_grace_s`` and `_settle_pushes`)."""
        if transfer in self._settling:
            return
        transfer.op.abort()
        was_done = transfer.done() or transfer.state.finished
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
        if not was_done and self._reaper is not None and self._reaper.holds(transfer.op):
            self._settling[transfer] = error  # settled by the poller (see settle_timeout)
            self._backoff.wake()
            return
        if isinstance(transfer.op, PushOp) and not transfer.op.settled:
            if transfer not in self._stopping:
                self._stopping[transfer] = (error, time.monotonic() + self.stop_grace_s)
            self._backoff.wake()
            return
        self._forget_grant(transfer)
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

    def _finish_settled(self, everything: bool = False, among: Collection[Transfer] | None = None) -> None:
        """Report the failed pulls nothing of which can land any more (``everything``: all of
        them, or all ``among`` these, whose agent is gone)."""
        reaper = self._reaper
        for transfer, error in list(self._settling.items()):
            if among is not None and transfer not in among:
                continue
            if everything or reaper is None or not reaper.holds(transfer.op):
                del self._settling[transfer]
                transfer.finish(error)

    async def _reset_agent(self) -> None:
        """Reads NIXL cannot cancel outlived ``settle_timeout``: replace this rank's agent.
        The old one is destroyed (its UCX workers and endpoints with it), so nothing it
        started can land; every session re-links with the new one on its next pull."""
        old, old_reaper = self.backend, self.reaper
        self._resetting = resetting = anyio.Event()
        try:
            await self._replace_agent(old, old_reaper)
        finally:
            self._resetting = None
            resetting.set()

    async def _replace_agent(self, old: Backend, old_reaper: Reaper) -> None:
        self._log.warning(
            "reads that NIXL cannot cancel are still in flight: replacing this rank's NIXL agent",
            held=len(old_reaper),
            settle_timeout=self.settle_timeout,
        )
        async with self._packing:  # staging registered meanwhile would miss the new agent
            await self._swap_agent(old, old_reaper)

    async def _swap_agent(self, old: Backend, old_reaper: Reaper) -> None:
        new = await anyio.to_thread.run_sync(self._new_backend)
        try:
            await anyio.to_thread.run_sync(new.register, self.kv_caches)
            dlist = None
            if self.verify_exposure:
                await anyio.to_thread.run_sync(new.register_host, self.checks.array)
                dlist = await anyio.to_thread.run_sync(new.prep, "", self.checks.table(), "DRAM")
            staging, directories = self.staging, self.directories
            dir_dlist = None
            if staging is not None and directories is not None:  # packed reads land there
                await anyio.to_thread.run_sync(new.register, [staging.tensor])
                await anyio.to_thread.run_sync(new.register_host, directories.array)
                dir_dlist = await anyio.to_thread.run_sync(new.prep, "", directories.table(), "DRAM")
        except BaseException:
            await anyio.to_thread.run_sync(new.close)
            raise
        error = PeerLostError(
            "this decode rank replaced its NIXL agent (reads to a hung or slow peer could not be "
            "cancelled): pull again"
        )
        for session in list(self._sessions.values()):
            session.reset_links(error)
        for _state, transfer in list(self._tracker):
            self.fail(transfer, error)
        quarantined = set(self._settling)  # theirs may land until the old agent is gone
        self._backend, self._reaper = new, Reaper(new)
        self._metadata = None  # push mode: the next handshakes carry the new agent's metadata
        self.checks.dlist = dlist
        if directories is not None:
            directories.dlist = dir_dlist
        self._local_dlists.clear()
        self.agent_epoch += 1
        await anyio.to_thread.run_sync(old.close)
        old_reaper.abandon()  # drops its handles: the old agent is destroyed now
        del old_reaper
        if not old.destroyed:
            gc.collect()
        if not old.destroyed:  # pragma: no cover - a list or handle of it is still referenced
            self._log.error("the replaced NIXL agent is still referenced: its reads may still land")
        self._finish_settled(everything=True, among=quarantined)
        self.metrics.inc("agent_resets")

    def _forget_grant(self, transfer: Transfer) -> None:
        if isinstance(transfer.op, PushOp) and self._grants.get(transfer.op.grant) is transfer:
            del self._grants[transfer.op.grant]

    def _settle_pushes(self, now: float) -> None:
        """Settle failed push pulls whose writers all stopped; past the grace period, remove
        the agents of writers that did not confirm (they can no longer reach this rank through
        them) and settle anyway."""
        for transfer, (error, deadline) in list(self._stopping.items()):
            op = transfer.op
            if isinstance(op, PushOp) and not op.settled:
                if now < deadline:
                    continue
                silent = op.unconfirmed
                self.metrics.inc("push_stops_unconfirmed")
                self._log.warning(
                    "push writers did not confirm they stopped: their agents are removed",
                    request=transfer.request_id,
                    prefill_ranks=silent,
                )
                transfer.session.invalidate(silent)
            del self._stopping[transfer]
            self._forget_grant(transfer)
            transfer.finish(error)

    def pump(self) -> None:
        """Push mode: progress the agent now (a notice just queued goes out), dispatching
        what arrived."""
        try:
            self._drain()
        except BackendError as exc:  # pragma: no cover - defensive: the poller tries again
            self._log.warning("draining notifications failed", error=str(exc))

    def _drain(self) -> bool:
        """Push mode: take the writers' notices, each to the pull it is bound to; anything
        else (late, unknown, repeated, from another agent) is dropped and counted."""
        notifs = self.backend.notifications()
        for agent, messages in notifs.items():
            for raw in messages:
                try:
                    notice = decode_push(raw)
                except ProtocolError:
                    self.metrics.inc("push_notices_dropped")
                    continue
                transfer = self._grants.get(notice.grant)
                op = transfer.op if transfer is not None else None
                if not isinstance(op, PushOp) or not op.on_notice(agent, notice):
                    self.metrics.inc("push_notices_dropped")
        return bool(notifs)

    def _complete(self, transfer: Transfer) -> None:
        session = transfer.session
        self._tracker.discard(transfer.state)
        session.transfers.discard(transfer)
        self._forget_grant(transfer)
        # Reads carry their own notification; the other ranks (all, if nothing was read) get one now.
        if transfer.notify:
            session.notify(transfer.notify, transfer.notice)
        transfer.finish()
        result = transfer.result()
        self.metrics.inc("transfers")
        self.metrics.observe_transfer(result.bytes, result.descriptors, result.seconds)

    def _check(self, transfer: Transfer, now: float) -> bool:
        """Poll one transfer; True if anything changed."""
        state = transfer.state
        if state.finished:
            return False
        outcome = transfer.op.poll()
        notified = transfer.op.take_notified()
        if notified:
            transfer.notified = True
            self.noticed(transfer.session, notified)
        if outcome is None:
            self._complete(transfer)
            return True
        if isinstance(outcome, Failed):
            if isinstance(outcome.error, UnsafeReadError):
                self.metrics.inc("unsafe_reads")
            transfer.session.mark_broken(outcome.error, outcome.rank)
            self.fail(transfer, outcome.error)
            if outcome.notify:
                transfer.session.notify(outcome.notify, transfer.notice)
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
        return isinstance(outcome, Pending) and outcome.changed

    async def _poll(self) -> None:
        backoff = self._backoff
        while True:
            now = time.monotonic()
            progressed = False
            pushing = self.mode == "push"
            if pushing:
                try:
                    progressed |= self._drain()
                except BackendError as exc:  # pragma: no cover - defensive: keep polling
                    self._log.warning("draining notifications failed", error=str(exc))
            for _state, transfer in self._tracker:
                try:
                    progressed |= self._check(transfer, now)
                except BackendError as exc:  # pragma: no cover - defensive: keep polling
                    self.fail(transfer, exc)
            if self._unflushed:
                self._flush_noticed()
            if self._stopping:
                self._settle_pushes(now)
            reaper = self.reaper
            if len(reaper) or reaper.background:
                reaper.retry()
            if self._settling:
                self._finish_settled()
            oldest = reaper.oldest()
            if (
                self._own_backend
                and oldest is not None
                and now - oldest > self.settle_timeout
                and now >= self._retry_reset_at
            ):
                try:
                    await self._reset_agent()
                except AkvError as exc:  # no new agent: the failed pulls stay quarantined
                    self._retry_reset_at = now + self.settle_timeout
                    self._log.error("replacing the NIXL agent failed; trying again later", error=str(exc))
                continue
            backend = self.backend
            if progressed:
                backoff.progressed()
            flushing = now < self._flush_until
            reaping = now < self._reap_until
            if (flushing or reaping) and not pushing:
                try:
                    backend.progress()
                except BackendError as exc:  # pragma: no cover - defensive: keep polling
                    self._log.warning("progressing the agent failed", error=str(exc))
            if len(self._tracker) or flushing or self._settling or self._stopping:
                # push: the writers' notices are the completion; look for them often
                await backoff.wait(busy=True, limit=PUSH_POLL_S if pushing and self._grants else None)
            else:
                # background reads: released within REAP_EVERY_S of their end
                limit = 0.01 if len(reaper) else REAP_EVERY_S if reaping or reaper.background else math.inf
                await backoff.wait(busy=False, limit=limit)
