"""The decode side: one decode rank, its agent, its sessions and the poller that runs its pulls.

Owns the rank's configuration, its NIXL agent (and replacing it when reads it cannot cancel
outlive ``settle_timeout``), the registered areas (exposure-check slots, packed staging), the
sessions by engine address, and the lifetime of its `PullPoller` (`akv.runtime.poller`).
Sessions (`akv.runtime.session`) read the rank through `akv.runtime.rank.DecodeRank` and
report to the poller, never to the consumer.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
from anyio.abc import TaskGroup

from akv._poll import from_threads
from akv.backends import Reaper, mem_type
from akv.errors import AkvError, BackendError, ClosedError, ConfigError, PeerLostError
from akv.geometry.cache import CacheSpec
from akv.geometry.layout import rank_layout
from akv.geometry.spec import KVSpec
from akv.packing import DIR_WORDS, CacheViews
from akv.plan import RankMemory
from akv.protocol.address import Endpoint, EngineAddress, check_engine_id, parse_engine_address
from akv.protocol.handshake import resolve_secret
from akv.runtime.packer import check_transfer
from akv.runtime.paths.packed import (
    AUTO_DESCRIPTORS,
    AUTO_RUN_BYTES,
    DEVICE_AUTO_DESCRIPTORS,
    DEVICE_AUTO_RUN_BYTES,
)
from akv.runtime.paths.staging import StagingPool
from akv.runtime.paths.tables import SlotPool
from akv.runtime.poller import PullPoller
from akv.runtime.rank import RankBase, default_engine_id
from akv.runtime.session import TransferSession
from akv.runtime.transfer import PullRequest, Transfer, TransferResult
from akv.tls import TLSConfig

if TYPE_CHECKING:
    import torch

    from akv.backends import Backend

__all__ = ["Consumer", "PullRequest", "Transfer", "TransferResult", "TransferSession"]


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
        copy_with: how the copy path and the packed path's scatter move bytes: ``"auto"``
            (memory moves in DRAM; on GPUs one Triton kernel launch per pull, or torch
            gathers and scatters without Triton) or ``"torch"`` (the GPU code path, also on
            CPU tensors: the kernel under Triton's interpreter when ``TRITON_INTERPRET=1`` is
            set, else torch gathers and scatters; for tests and operation counts). See
            docs/gpu.md#kernels.
        check_with: how the exposure check reads a prefill rank's table, and a packed pull
            its packed-copy directory: ``"auto"`` (from shared memory where the rank is on
            this host and offers it, with a memory load, else a NIXL READ; see
            docs/security.md) or ``"read"`` (always a NIXL READ).
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
            Same API either way; ``TransferResult.path`` says ``"push"``. akv never lets UCX
            serve READs over TCP (a decode rank dying or stalling mid-READ over UCX TCP can
            kill the prefill process, see docs/operations.md#peer-death-over-tcp): UCX would,
            when ``UCX_TLS`` leaves only TCP, or the engine's first endpoints are not
            addresses of this host's network namespace and UCX may use no RDMA here (no
            device in ``/sys/class/infiniband``, or ``UCX_TLS`` names no RDMA transport).
            There, ``"auto"`` (the default, ``None`` too) pushes (packed copies too, see
            ``transfer``), and ``"pull"`` is refused at connect with a
            [`ConfigError`][akv.errors.ConfigError]; elsewhere ``"auto"`` pulls. Each
            session decides before its first handshake; ``TransferSession.mode`` says which.
        stop_grace_s: push mode: seconds a failed or cancelled pull waits for its writers to
            confirm they stopped. Past it, this rank replaces its own NIXL agent (its UCX
            worker, every connection and registration the writes target go with it; other
            pulls in flight fail with [`PeerLostError`][akv.errors.PeerLostError] and may be
            pulled again) and only then reports the pull, so nothing a silent writer still
            sends can land in blocks handed back. With an agent handed in (``backend``),
            which this rank may not replace, the writers' agents are removed instead, which
            does not stop data already queued over TCP (docs/concepts.md#push-mode).
        transfer: which copy of a request to read: ``"direct"`` (the paged blocks), ``"packed"``
            (the prefill ranks' packed copies, see docs/concepts.md#packed-transfers; an
            [`IncompatiblePeerError`][akv.errors.IncompatiblePeerError] naming ``transfer`` at
            connect if a prefill rank keeps none) or ``"auto"`` (packed where every rank read
            from packs and the direct read would post more than ``pack_threshold``
            descriptors, or a rank released its blocks after packing). In push mode the same
            choice makes a *packed push*: the prefill ranks WRITE their packed copies into a
            staging range this rank grants (a few descriptors each), and this rank scatters
            them into the blocks; a writer with no copy of the request writes the blocks
            instead. A push session with a ``transfer`` other than ``"direct"`` registers the
            staging area before its first handshake.
        pack_staging_bytes: the registered staging area packed reads and packed pushes land
            in (a pull that finds it full reads or pushes the blocks directly, or fails with
            [`BackPressureError`][akv.errors.BackPressureError] when it cannot).
        pack_threshold: ``transfer="auto"``'s descriptor count (default: 512 on DRAM,
            measured, see docs/performance.md#packed-transfers; 32 on device memory, where a
            descriptor costs ~6 us and packed runs also when runs average up to 1 MiB, not
            only below 2 KiB: docs/gpu.md).
        idle_timeout: close a session no pull, heartbeat or `connect` used for this many
            seconds (none of its pulls in flight): its control connections, its watch and the
            remote agents it loaded go, so a rank that met thousands of engines holds only
            those it pulls from (docs/performance.md#scale). The next `connect` to that engine
            handshakes again; a session held past it raises
            [`ClosedError`][akv.errors.ClosedError] at its next pull. Default: never.
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
        check_with: str = "auto",
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
        pack_threshold: int | None = None,
        idle_timeout: float | None = None,
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
        if idle_timeout is not None and not 0 < idle_timeout < float("inf"):
            raise ConfigError(
                f"idle_timeout must be a finite number of seconds > 0 (or None), got {idle_timeout}"
            )
        self.idle_timeout = idle_timeout
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
        if check_with not in ("auto", "read"):
            raise ConfigError(f"check_with must be 'auto' or 'read', got {check_with!r}")
        self.check_with = check_with
        if mode is None:
            mode = "auto"
        if mode not in ("pull", "push", "auto"):
            raise ConfigError(f"mode must be 'pull', 'push' or 'auto', got {mode!r}")
        self.mode: str = mode
        if not stop_grace_s > 0:
            raise ConfigError(f"stop_grace_s must be > 0, got {stop_grace_s}")
        self.stop_grace_s = stop_grace_s
        self._metadata: bytes | None = None
        self.mem_type, device = mem_type(self.kv_caches)
        self.memory = RankMemory(tp_rank, tp_size, tuple(t.data_ptr() for t in self.kv_caches), device)
        self.checks = SlotPool(max_checks)
        self.transfer = check_transfer(transfer)
        on_device = self.mem_type != "DRAM"
        if pack_threshold is None:
            pack_threshold = DEVICE_AUTO_DESCRIPTORS if on_device else AUTO_DESCRIPTORS
        if pack_threshold < 0:
            raise ConfigError(f"pack_threshold must be >= 0, got {pack_threshold}")
        self.pack_threshold = pack_threshold
        self.pack_run_bytes = DEVICE_AUTO_RUN_BYTES if on_device else AUTO_RUN_BYTES
        if pack_staging_bytes < 256:
            raise ConfigError(f"pack_staging_bytes must be >= 256, got {pack_staging_bytes}")
        self.pack_staging_bytes = pack_staging_bytes
        self.staging: StagingPool | None = None  # set up with the first prefill rank that packs
        self.directories: SlotPool | None = None
        self.pack_views = CacheViews(self.kv_caches, rank_layout(self.cache, tp_rank, tp_size))
        self._max_checks = max_checks
        self._packing = anyio.Lock()
        self.log = self._log
        self._sessions: dict[str, TransferSession] = {}
        self._connecting: dict[str, anyio.Event] = {}
        self._local_dlists: dict[Any, Any] = {}
        self.agent_epoch = 0  # bumped each time the agent is replaced (see settle_timeout)
        self._poller = PullPoller(
            agent=lambda: self.backend,
            mode=mode,
            checks=self.checks,
            metrics=self.metrics,
            log=self._log,
            backoff=self._backoff,
            settle_timeout=settle_timeout,
            stop_grace_s=stop_grace_s,
            replace_agent=self._replace_agent,
        )

    async def _enter(self, stack: AsyncExitStack, tg: TaskGroup) -> None:
        backend = self.backend
        self._poller.start(may_replace=self._own_backend)  # an agent handed in is never replaced
        if self.mode != "pull":  # sessions may push: the writers need this agent's metadata
            self._metadata = await anyio.to_thread.run_sync(backend.metadata)
            stack.push_async_callback(self._poller.stop_pushes)  # runs before the poller stops
        if self.verify_exposure:
            await anyio.to_thread.run_sync(backend.register_host, self.checks.array)
            self.checks.dlist = await anyio.to_thread.run_sync(backend.prep, "", self.checks.table(), "DRAM")
            stack.push_async_callback(self._poller.send_notices)  # runs before the poller stops
        tg.start_soon(self._poller.run)
        if self.idle_timeout is not None:
            tg.start_soon(self._close_idle, self.idle_timeout)

    async def _close_idle(self, idle_timeout: float) -> None:
        """Close the sessions unused for ``idle_timeout`` seconds (see the parameter)."""
        while True:
            await anyio.sleep(min(idle_timeout / 4, 1.0))
            now = time.monotonic()
            for key, session in list(self._sessions.items()):
                idle = now - session.used
                if session.closed or idle < idle_timeout or self._poller.running(session):
                    continue
                try:
                    await session.aclose()
                except AkvError as exc:  # its links go all the same (its leases release the rest)
                    self._log.warning("closing an idle session failed", engine=key, error=str(exc))
                    session.engine.unload()
                if self._sessions.get(key) is session:
                    del self._sessions[key]
                self.metrics.inc("sessions_closed_idle")
                self._log.info("closed a session idle past idle_timeout", engine=key, idle_s=round(idle, 1))

    async def enable_packing(self) -> None:
        """Allocate and register the staging area of packed reads (once; the first session
        to a prefill engine that packs calls this)."""
        async with self._packing:
            if self.staging is not None or self.transfer == "direct":
                return
            # made (and its pages touched) off the event loop: the first packed pull does not
            # pay for the page faults of the whole area
            staging = await anyio.to_thread.run_sync(
                StagingPool, self.pack_staging_bytes, self.kv_caches[0], self.copy_with
            )
            staging.wake = from_threads(self._backoff.wake)
            directories = SlotPool(self._max_checks, DIR_WORDS)
            backend = self.backend
            await anyio.to_thread.run_sync(backend.register, [staging.tensor])
            await anyio.to_thread.run_sync(backend.register_host, directories.array)
            directories.dlist = await anyio.to_thread.run_sync(backend.prep, "", directories.table(), "DRAM")
            self.staging, self.directories = staging, directories
            self._metadata = None  # push mode: the next Hellos carry the staging registration

    def _teardown(self) -> None:
        try:
            self._settle_all()
        finally:
            self._poller.closed = True  # a pull still settling returns, whatever happened here

    def _close_backend(self) -> None:
        """Close the agent, then drop the prepared lists and handles of it that this rank's
        objects still hold: they keep NIXL's native agent (its UCX workers, sockets and
        registrations) alive, and the rank's objects reference each other, so without this
        the agent would go only when the garbage collector next runs."""
        super()._close_backend()
        self.checks.dlist = None
        if self.directories is not None:
            self.directories.dlist = None
        self._local_dlists.clear()
        self._poller.release_agent()

    def _settle_all(self) -> None:
        backend = self.backend_or_none
        poller = self._poller
        if backend is not None and poller.lingering(time.monotonic()):
            # let UCX send the notices still queued, and retire what it holds for a lost peer
            for _ in range(50):
                try:
                    backend.progress()
                except BackendError:
                    break
                time.sleep(0.002)
        poller.fail_all(ClosedError("the consumer was closed"))
        for session in list(self._sessions.values()):
            session.fail_running(ClosedError("the session was closed"))
        # Push writers asked to stop and not confirmed yet: the agent closes now (their
        # connections go with it); see docs/concepts.md#push-mode for what that guarantees.
        poller.close(backend)
        for session in list(self._sessions.values()):
            session.closed = True
            session.engine.unload()
        self._sessions.clear()
        if self.staging is not None:
            self.staging.close()

    async def aclose(self) -> None:
        """Fail running transfers with [`ClosedError`][akv.errors.ClosedError], release everything. Idempotent."""
        await self.__aexit__(None, None, None)

    @property
    def inflight(self) -> int:
        """Pulls launched and not yet settled."""
        return self._poller.inflight

    @property
    def reaper(self) -> Reaper:
        """Releases transfer handles, now or once NIXL can (valid inside the context manager)."""
        return self._poller.reaper

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

    async def settled(self, session: TransferSession | None = None) -> None:
        """Wait until the failed pulls (of ``session``, or all) have settled: nothing of their
        reads can still land (see ``settle_timeout``), and every push writer confirmed it
        stopped, or was cut off (see ``stop_grace_s``)."""
        await self._poller.settled(session)

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
        for gone in [k for k, s in self._sessions.items() if s.closed]:  # closed by their owners
            del self._sessions[gone]
        while True:
            session = self._sessions.get(key)
            if session is not None and not session.closed:
                session.used = time.monotonic()
                return session
            pending = self._connecting.get(key)
            if pending is None:
                break
            await pending.wait()  # then look again: the other caller succeeded, or we try
        done = self._connecting[key] = anyio.Event()
        try:
            session = TransferSession(self, self._poller, address, self._log)
            await session.handshake()
            self._sessions[key] = session
            return session
        finally:
            if self._connecting.get(key) is done:
                del self._connecting[key]
            done.set()

    async def _replace_agent(self) -> None:
        """Reads NIXL cannot cancel outlived ``settle_timeout``, or push writers stayed silent
        past ``stop_grace_s``: replace this rank's agent. The old one is destroyed (its UCX
        workers, endpoints and registrations with it), so nothing it started, and nothing a
        writer still sends to it, can land; every session re-links with the new one on its
        next pull."""
        self._log.warning(
            "replacing this rank's NIXL agent: reads it cannot cancel, or pushes whose writers "
            "did not confirm a stop, could still land",
            held=len(self._poller.reaper),
            settle_timeout=self.settle_timeout,
            stop_grace_s=self.stop_grace_s,
        )
        async with self._packing:  # staging registered meanwhile would miss the new agent
            await self._swap_agent(self.backend)

    async def _swap_agent(self, old: Backend) -> None:
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
        self._poller.fail_all(error)
        quarantined = self._poller.quarantined()  # theirs may land until the old agent is gone
        self._backend = new
        old_reaper = self._poller.adopt(new)
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
        self._poller.finish_settled(everything=True, among=quarantined)
        self.metrics.inc("agent_resets")
