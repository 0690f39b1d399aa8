"""The prefill side: expose blocks, serve handshakes, count readers, release exactly once.

A thin shell: the `ReleaseLedger` decides what is released when; this
module feeds it NIXL notices and the clock and delivers its releases.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Literal

import anyio
import anyio.to_thread
import numpy.typing as npt
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream

from akv._poll import FLUSH_S, PUSH_POLL_S, WIREUP_POLL_S, from_threads
from akv.backends import mem_type
from akv.errors import (
    AkvError,
    ClosedError,
    ConfigError,
    ProtocolError,
    UnknownRequestError,
)
from akv.exposure import ExposureTable
from akv.geometry.cache import CacheSpec
from akv.geometry.spec import KVSpec
from akv.ledger import Release, ReleaseLedger, check_lease
from akv.protocol.address import Endpoint, check_engine_id, parse_endpoint
from akv.protocol.messages import Hello, Notice, RankInfo, Register, Registered, decode_notice
from akv.protocol.push import decode_push, is_push
from akv.runtime import local, registration
from akv.runtime.control import ControlServer
from akv.runtime.listeners import Listeners
from akv.runtime.packer import Packer, PackLifecycle, check_transfer, fragmented
from akv.runtime.push_state import PackedCopy
from akv.runtime.pusher import Pusher
from akv.runtime.rank import RankBase, default_engine_id
from akv.tls import TLSConfig

if TYPE_CHECKING:
    import torch

    from akv.backends import Backend

__all__ = ["Producer", "Release"]

#: Releases kept for a [`Producer.releases`][akv.Producer.releases] reader that is not keeping up.
RELEASE_BUFFER = 4096


class Producer(RankBase):
    """One prefill rank: registers its KV cache, serves handshakes and tracks exposed blocks.

    Use as an async context manager. [`expose`][akv.Producer.expose] pins a request's
    blocks until every decode rank that must read or learn of them has notified, or until
    the lease expires; then the release is reported exactly once *for this rank*, via
    ``on_release`` and [`releases`][akv.Producer.releases]. An engine of P ranks gets P
    releases per request, one from each rank: [`EngineReleases`][akv.EngineReleases] turns
    them into one per request, once every rank released it.

    Args:
        kv_caches: this rank's regions (see [`KVSpec.region_shape`][akv.KVSpec.region_shape]),
            CPU or CUDA tensors.
        spec: the cache description (equal on every rank of the engine).
        tp_rank: this rank's index in ``[0, tp_size)``.
        tp_size: the engine's tensor-parallel size.
        engine_id: the engine's name, the same on every rank. Default: a name unique to this
            process (so ranks in one process are one engine); a rank with ``bootstrap``
            takes rank 0's.
        on_release: called with a [`Release`][akv.Release] exactly once per exposure, when
            its blocks are free again on this rank (read by every expected decode rank, lease
            expired, or producer closed). Exceptions it raises are logged, not propagated.
        lease: seconds an exposure stays pinned without being read (heartbeats extend it).
        server: a [`ControlServer`][akv.ControlServer] shared by the engine's ranks in this
            process (default: the producer serves its own, for an engine of one rank).
        host: address the own control server binds (loopback by default).
        port: its port (0 picks a free one).
        secret: shared secret for the control plane (default ``$AKV_SECRET``).
        allow_insecure: serve a non-loopback address without a secret (trusted networks only).
        advertise_host: the address decode ranks reach this rank's server at (default: ``host``;
            needed when binding ``0.0.0.0``).
        bootstrap: rank 0's control endpoint, for ranks > 0: they register their endpoint
            there (and again every few seconds, so a restarted rank 0 learns them), so the
            whole engine is reachable through rank 0's address.
        etcd: etcd endpoint(s) (``"HOST:PORT"``, comma-separated or a list): register this
            rank under ``engine_id`` with a lease kept alive (needs an explicit ``engine_id``).
        etcd_ttl: seconds a dead or hung rank's etcd key outlives it.
        max_exposed: requests exposed at once that the exposure table is sized for.
        backend: a transport backend to use instead of creating a NIXL agent.
        progress_thread: let UCX run its own progress thread.
        nixl_threads: worker threads of the NIXL agent, for posting large transfers in
            parallel (0: none, NIXL's default; see docs/gpu.md).
        poll_max_s: longest sleep of the notification poller while requests are pending.
        spin_s: how long the poller spins after progress before sleeping.
        tls: serve the control plane over TLS (when this producer creates its server) and,
            for a rank > 0, register with the bootstrap over TLS (the CA is then required);
            see [`TLSConfig`][akv.TLSConfig].
        modes: the transfer modes this rank serves: ``"pull"`` (decode ranks READ) and
            ``"push"`` (this rank WRITEs into decode ranks that announce requests, layer by
            layer: see [`layers_ready`][akv.Producer.layers_ready]). A decode rank asking for
            another mode gets an [`IncompatiblePeerError`][akv.errors.IncompatiblePeerError]
            naming ``mode``. Default: both, or only ``"pull"`` with ``release_after_pack``
            (whose blocks go back before a push could write them).
        transfer: ``"direct"`` (default): decode ranks read the paged blocks; ``"packed"``:
            each exposure is also copied, at ``expose()``, into a slot of a registered pool in
            request-major order, so a decode rank reads it with one descriptor per component
            (see docs/concepts.md#packed-transfers); ``"auto"``: pack only when one unit of
            one block is more than one contiguous run on this rank's layout. A request that
            finds the pool full is not packed: it is read directly (``pack_fallbacks``). The
            gather starts inside ``expose()``, so call it once the request's KV is complete
            (on CUDA: queued on the current stream); on CUDA it runs on a side stream ordered
            after the current stream's work and ``expose()`` returns without waiting: the copy
            becomes readable (its directory entry published) once the gather's event fired,
            and until then decode ranks read the request directly (with
            ``release_after_pack``, which leaves them nothing to read directly, ``expose()``
            waits for the gather).
        pack_pool_bytes: the staging pool's size, allocated on the caches' device.
        release_after_pack: hand a packed request's blocks back at once (a
            [`Release`][akv.Release] with reason ``"packed"``); its packed copy then carries
            the lease, and only packed reads of it succeed.
        copy_with: how packing moves bytes: ``"auto"`` (on CUDA one Triton kernel launch per
            request when ``triton`` imports, else torch gathers; in DRAM torch gathers) or
            ``"torch"`` (on CPU tensors too, the code path CUDA tensors take: the kernel under
            Triton's interpreter when ``TRITON_INTERPRET=1`` is set, else torch gathers; for
            tests and operation counts). See docs/gpu.md#kernels.
    """

    _role = "p"

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        spec: KVSpec | CacheSpec,
        *,
        tp_rank: int,
        tp_size: int,
        engine_id: str | None = None,
        on_release: Callable[[Release], None] | None = None,
        lease: float = 120.0,
        server: ControlServer | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | bytes | None = None,
        allow_insecure: bool = False,
        advertise_host: str | None = None,
        bootstrap: str | Endpoint | None = None,
        etcd: str | Sequence[str] | None = None,
        etcd_ttl: float = 5.0,
        max_exposed: int = 16384,
        backend: Backend | None = None,
        progress_thread: bool = False,
        poll_max_s: float = 0.002,
        spin_s: float = 0.002,
        nixl_threads: int = 0,
        tls: TLSConfig | None = None,
        modes: Sequence[str] | None = None,
        transfer: str = "direct",
        pack_pool_bytes: int = 256 << 20,
        release_after_pack: bool = False,
        copy_with: str = "auto",
    ) -> None:
        if etcd is not None and engine_id is None:
            raise ConfigError("registering in etcd needs an explicit engine_id, the same on every rank")
        self._named = engine_id is not None
        super().__init__(
            kv_caches,
            spec,
            tp_rank=tp_rank,
            tp_size=tp_size,
            engine_id=check_engine_id(engine_id) if engine_id else default_engine_id("prefill"),
            backend=backend,
            progress_thread=progress_thread,
            spin_s=spin_s,
            poll_max_s=poll_max_s,
            nixl_threads=nixl_threads,
        )
        self.lease_s = check_lease(lease)
        if modes is None:
            modes = ("pull",) if release_after_pack else ("pull", "push")
        elif release_after_pack and "push" in modes:
            raise ConfigError(
                "release_after_pack hands the paged blocks back before a push could write them: "
                "serve modes=('pull',) with it, or leave release_after_pack off"
            )
        if not modes or any(m not in ("pull", "push") for m in modes):
            raise ConfigError(f"modes must name 'pull' and/or 'push', got {list(modes)}")
        self.modes: tuple[str, ...] = tuple(m for m in ("pull", "push") if m in modes)
        if max_exposed < 1:
            raise ConfigError(f"max_exposed must be >= 1, got {max_exposed}")
        self.on_release = on_release
        self._own_server = server is None
        self.server = server or ControlServer(
            host=host,
            port=port,
            secret=secret,
            allow_insecure=allow_insecure,
            metrics=self.metrics,
            advertise_host=advertise_host,
            tls=tls,
        )
        tls = tls if tls is not None else self.server.tls
        # A rank > 0 registers with its bootstrap over TLS when it serves TLS (it needs the CA).
        self._tls_client = tls.client_context() if tls is not None and bootstrap is not None else None
        self.bootstrap = parse_endpoint(bootstrap) if bootstrap is not None else None
        if self.bootstrap is not None and tp_rank == 0:
            raise ConfigError("rank 0 is the engine's bootstrap: give --bootstrap to ranks > 0 only")
        self.etcd = etcd
        self.etcd_ttl = etcd_ttl
        self._expected: dict[int, int] = {}
        self._notifiers: dict[tuple[int, int], bool] = {}
        self._peers: dict[str, int] = {}
        self._warned: set[tuple[str, int]] = set()
        self._senders: dict[str, tuple[str, int, int]] = {}  # decode agent -> (engine, rank, tp)
        self.ledger = ReleaseLedger(
            self.cache.total_blocks,
            lease_s=self.lease_s,
            expected=self.expected_notifications,
            accepts=self._accepts,
            table=ExposureTable(buckets=max(1, -(-max_exposed // 4)), shared=True),
            count=self.metrics.inc,
            split=self.cache.split if len(self.cache.groups) > 1 else None,
        )
        self._listeners = Listeners(self.metrics)
        self._info: RankInfo | None = None
        self._idle: anyio.Event | None = None
        self._inbox: deque[tuple[str, bytes]] = deque()  # notices from decode ranks of this process
        self._loop_thread = 0
        if copy_with not in ("auto", "torch"):
            raise ConfigError(f"copy_with must be 'auto' or 'torch', got {copy_with!r}")
        self.copy_with = copy_with
        self.transfer = check_transfer(transfer)
        self.release_after_pack = bool(release_after_pack)
        self.packer: Packer | None = None
        if self.transfer == "packed" or (
            self.transfer == "auto" and fragmented(self.cache, tp_rank, tp_size)
        ):
            self.packer = Packer(
                self.kv_caches,
                self.cache,
                tp_rank,
                tp_size,
                pack_pool_bytes,
                self.ledger.table.buckets,
                self.release_after_pack,
                copy_with,
            )
        self.pusher = Pusher(self, self._deliver, self._log)
        self.packing: PackLifecycle | None = None
        if self.packer is not None:
            self.packing = PackLifecycle(
                self.packer,
                ledger=self.ledger,
                metrics=self.metrics,
                log=self._log,
                ready=self.pusher.packed_ready,
                deliver=lambda releases: self._deliver(releases, pack=False),
            )

    # -- lifetime -----------------------------------------------------------------------

    async def _enter(self, stack: AsyncExitStack, tg: TaskGroup) -> None:
        await anyio.to_thread.run_sync(self.backend.register_host, self.ledger.table.array)
        stack.callback(self.ledger.table.close)
        if self.packer is not None:
            self.packer.wake = from_threads(self._backoff.wake)  # its thread's gathers are done
            stack.callback(self.packer.close)
            await anyio.to_thread.run_sync(self.packer.touch)
            await anyio.to_thread.run_sync(self.backend.register, [self.packer.pool])
            await anyio.to_thread.run_sync(self.backend.register_host, self.packer.directory.array)
            stack.callback(self.packer.directory.close)
        hosted = next(iter(self.server.ranks.values()), None)
        if hosted is not None and not self._named:
            self.engine_id = hosted.engine_id  # ranks sharing a server are one engine
        self.server.add(self)
        stack.callback(self.server.remove, self)
        self._loop_thread = threading.get_ident()
        local.publish(self.backend.name, self.kv_caches, self.ledger.table.array, self._local_notice)
        stack.callback(local.withdraw, self.backend.name)
        if self._own_server:
            await tg.start(self.server.serve)
        tg.start_soon(self._poll)
        if self.bootstrap is not None:
            msg = Register(
                engine_id=self.engine_id if self._named else "",
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                endpoint=str(self.endpoint),
                compat=self.cache.compat_hash(),
                spec=self.cache,
            )
            keep = registration.keep_registered
            await tg.start(
                keep, self.bootstrap, msg, self.server.secret, self._tls_client, self._registered, self._log
            )
        if self.etcd is not None:
            from akv.runtime.discovery import EtcdRegistry, RankRecord

            record = RankRecord.create(
                self.engine_id, self.tp_rank, self.tp_size, self.endpoint, compat=self.cache.compat_hash()
            )
            await tg.start(registration.keep_in_etcd, EtcdRegistry(self.etcd, ttl=self.etcd_ttl), record)

    def _registered(self, reply: Registered) -> None:
        """The bootstrap took this rank: adopt the engine's name (unless named) and incarnation."""
        if not self._named:
            self.engine_id = reply.engine_id
        self.server.learned_instance = reply.instance_id

    def _teardown(self) -> None:
        self.pusher.close()
        self._deliver(self.ledger.close())
        self._listeners.close()
        if self._idle is not None:
            self._idle.set()

    @property
    def endpoint(self) -> Endpoint:
        """The control endpoint decode ranks connect to."""
        return self.server.endpoint

    # -- handshake hooks (called by the control server) ---------------------------------

    def rank_info(self) -> RankInfo:
        """This rank's agent metadata, region addresses and exposure table."""
        if self._info is None:
            mem, dev = mem_type(self.kv_caches)
            table = self.ledger.table
            self._info = RankInfo(
                tp_rank=self.tp_rank,
                agent_name=self.backend.name,
                agent_metadata=self.backend.metadata(),
                region_addrs=[t.data_ptr() for t in self.kv_caches],
                device_id=dev,
                mem_type=mem,
                exposure_addr=int(table.array.ctypes.data),
                exposure_buckets=table.buckets,
                process=local.PROCESS_TOKEN,
                pack=self.packer.info(mem, dev) if self.packer is not None else None,
                exposure_share=table.share(),
            )
        return self._info

    def packed_copy(self, request_id: str) -> PackedCopy | Literal["pending"] | None:
        """Push mode: where this rank's packed copy of an exposed request is (``"pending"``
        while its gather is queued on the device; None: it has none, its blocks are written)."""
        return None if self.packing is None else self.packing.copy_of(request_id, self.rank_info().pack)

    def peer_connected(self, engine_id: str, decode_rank: int, decode_tp: int, agent_name: str) -> None:
        """Remember a decode rank: its engine's TP size (it fixes how many notifications to
        expect) and its NIXL agent (notices only from it count; it wires up to ours now)."""
        self._peers[engine_id], self._senders[agent_name] = decode_tp, (engine_id, decode_rank, decode_tp)
        self._backoff.hurry(FLUSH_S, WIREUP_POLL_S)
        self._log.info("decode rank connected", peer=engine_id, decode_rank=decode_rank, decode_tp=decode_tp)

    def push_peer(self, hello: Hello) -> None:
        """A decode rank that proved the secret asks to be pushed to: load its agent."""
        if not self.running:
            raise ClosedError("the producer is not running")
        self.pusher.add_peer(hello)

    def expected_notifications(self, decode_tp: int) -> int:
        """How many decode ranks of an engine with ``decode_tp`` notify this rank per request."""
        n = self._expected.get(decode_tp)
        if n is None:
            n = self._expected[decode_tp] = self.cache.expected_notifications(
                self.tp_rank, self.tp_size, decode_tp
            )
        return n

    # -- exposing -----------------------------------------------------------------------

    def expose(
        self,
        request_id: str,
        block_ids: Sequence[int] | npt.ArrayLike | Mapping[str, Sequence[int]],
        *,
        lease: float | None = None,
        generation: int | None = None,
        layers_ready: int | None = None,
    ) -> int:
        """Pin a request's blocks until read by every expected decode rank or the lease ends;
        returns the exposure's generation.

        The generation tells this exposure apart from any other of the same request id (one
        after a release or a lease expiry, one by a restarted rank): a pull given it
        (``PullRequest.generation``) fails with [`ReexposedError`][akv.errors.ReexposedError]
        if the request was exposed again before its reads completed, and its notice does not
        count as a read of the new exposure.

        Args:
            request_id: the request's id, unique among this rank's exposed requests.
            block_ids: the blocks holding its KV on this rank (at least one): a flat list for
                a one-group cache, else ``{group name: ids}`` (state groups: one slot).
            lease: seconds it stays pinned without being read (default: the producer's).
            generation: the generation to use, in ``[1, 2**31)``, for an engine that announces
                one generation for all its ranks (default: this rank's next).
            layers_ready: push mode: how many model layers (from layer 0) are computed so far
                (default: all); decode ranks that announced the request get those layers
                written now, the rest as [`layers_ready`][akv.Producer.layers_ready] reports
                them. Pulling readers are not held back: expose with fewer layers only for
                decode engines in push mode.

        Raises:
            BlockIdError: bad block ids, or none: a request with nothing to pull needs no
                exposure (and gets no release).
            ConfigError: the request id is already exposed, or the lease is not > 0.
            ClosedError: the producer is not running.
        """
        if not self.running:
            raise ClosedError("the producer is not running")
        per_group = self.cache.per_group(block_ids, f"request {request_id!r}")
        ids = self.cache.flatten(per_group)
        if layers_ready is not None and not 0 <= layers_ready <= self.pusher.layers:
            raise ConfigError(f"layers_ready must be in [0, {self.pusher.layers}], got {layers_ready}")
        generation = self.ledger.expose(request_id, ids, time.monotonic(), lease, generation)
        if self.packing is not None:  # packed once every layer is computed (until then, read directly)
            complete = layers_ready is None or layers_ready >= self.pusher.layers
            self.packing.exposed(request_id, per_group, ids, generation, complete)
        self.pusher.exposed(request_id, layers_ready)
        self._backoff.wake()
        return generation

    def layers_ready(self, request_id: str, n: int) -> None:
        """Push mode: the first ``n`` model layers of an exposed request are computed (``n``
        only grows; the number of layers or more: all). Decode ranks that announced it get
        the bytes of those layers written now.

        Args:
            request_id: the exposed request.
            n: how many model layers, from layer 0, are computed.

        Raises:
            UnknownRequestError: the request is not exposed.
            ConfigError: ``n`` is negative.
        """
        if request_id not in self.ledger:
            raise UnknownRequestError(f"request {request_id!r} is not exposed")
        if n < 0:
            raise ConfigError(f"layers_ready needs n >= 0, got {n}")
        self.pusher.layers_ready(request_id, min(n, self.pusher.layers))
        if n >= self.pusher.layers and self.packing is not None:
            self.packing.computed(request_id)
        self._backoff.wake()

    def extend(self, request_id: str, seconds: float | None = None) -> None:
        """Push the lease deadline of ``request_id`` to now + ``seconds`` (default: its lease)."""
        self.ledger.extend(request_id, time.monotonic(), seconds)

    @property
    def pending(self) -> int:
        """Requests exposed and not yet released."""
        return len(self.ledger)

    def releases(self, max_buffer: int = RELEASE_BUFFER) -> MemoryObjectReceiveStream[Release]:
        """A stream of this rank's releases from now on (iterate with ``async for``).

        Holds up to ``max_buffer`` releases for a slow reader; past that, further releases
        are dropped for that reader and counted as ``releases_dropped`` (``on_release`` never
        misses one). Close the stream when done.
        """
        return self._listeners.stream(max_buffer, closed=self.closed)

    async def wait_released(self) -> None:
        """Return once no request is pending."""
        while len(self.ledger) and not self.closed:
            if self._idle is None or self._idle.is_set():
                self._idle = anyio.Event()
            await self._idle.wait()

    def _deliver(self, releases: list[Release], pack: bool = True) -> None:
        settled = bool(releases)
        if releases:
            self.pusher.released(releases)
        if self.packing is not None:  # ``pack``: the exposure is retired: free its slot (once)
            releases = self.packing.released(releases, retire=pack)
        for release in releases:
            if release.reason not in ("read", "pushed"):
                self._log.info(
                    "blocks released",
                    request=release.request_id,
                    reason=release.reason,
                    notified=release.notified,
                    expected=release.expected,
                )
            if self.on_release is not None:
                try:
                    self.on_release(release)
                except Exception:
                    self._log.exception("on_release callback failed", request=release.request_id)
            self._listeners.send(release)
        if settled and not len(self.ledger) and self._idle is not None:
            self._idle.set()

    # -- polling ------------------------------------------------------------------------

    def _accepts(self, notice: Notice) -> bool:
        """True if that decode rank handshook with this engine and notifies this rank."""
        decode_rank, decode_tp = notice.decode_rank, notice.decode_tp
        if self._peers.get(notice.engine_id) != decode_tp or not 0 <= decode_rank < decode_tp:
            return False
        key = (decode_rank, decode_tp)
        ok = self._notifiers.get(key)
        if ok is None:
            try:
                ranks = self.cache.notify_ranks(decode_rank, decode_tp, self.tp_size)
            except ConfigError:
                ranks = ()
            ok = self._notifiers[key] = self.tp_rank in ranks
        return ok

    def _on_notice(self, notice: Notice) -> None:
        invalid = self.ledger.counters.get("notifications_invalid", 0)
        self._deliver(self.ledger.on_notice(notice, time.monotonic()))
        if self.ledger.counters.get("notifications_invalid", 0) > invalid:
            # Warn once per decode rank (a buggy or hostile peer must not flood the logs).
            peer = (notice.engine_id, notice.decode_rank)
            log = self._log.debug if peer in self._warned else self._log.warning
            self._warned.add(peer)
            log(
                "notification ignored (unexpected decode rank, or blocks other than the exposed ones)",
                peer=notice.engine_id,
                decode_rank=notice.decode_rank,
                decode_tp=notice.decode_tp,
            )

    def _local_notice(self, agent: str, message: bytes) -> None:
        """A notice from a decode rank of this process (its agent's name), handed over directly:
        checked exactly as one that came through NIXL from that agent. Thread-safe."""
        self._inbox.append((agent, message))
        if threading.get_ident() == self._loop_thread:
            self._backoff.wake()

    def _drain(self) -> bool:
        notifs = self.backend.notifications()
        while self._inbox:
            agent, message = self._inbox.popleft()
            notifs.setdefault(agent, []).append(message)
        now = time.monotonic()
        for agent, messages in notifs.items():
            sender = self._senders.get(agent)
            for raw in messages:
                self.metrics.inc("notifications_received")
                if is_push(raw):
                    try:
                        push = decode_push(raw)
                    except ProtocolError:
                        self.metrics.inc("notifications_invalid")
                        continue
                    self.pusher.on_notice(agent, push, now)
                    continue
                if sender is None:  # an agent that never handshook with this rank
                    self.metrics.inc("notifications_unbound")
                    continue
                try:
                    notice = decode_notice(raw)
                except ProtocolError:
                    self.metrics.inc("notifications_invalid")
                    continue
                if (notice.engine_id, notice.decode_rank, notice.decode_tp) != sender:
                    self.metrics.inc("notifications_invalid")  # claims to be another decode rank
                    continue
                self._on_notice(notice)
        return bool(notifs)

    async def _poll(self) -> None:
        backoff = self._backoff
        pusher = self.pusher
        while True:
            try:
                if self._drain():
                    backoff.progressed()
            except AkvError as exc:
                self._log.warning("draining notifications failed", error=str(exc))
            now = time.monotonic()
            if pusher.grants or pusher.busy:
                try:
                    if pusher.poll(now):
                        backoff.progressed()
                        self._drain()  # progress the agent now: a notice just queued goes out
                    elif pusher.writing:
                        backoff.progressed()  # spin until the writes complete
                except AkvError as exc:  # pragma: no cover - defensive: keep polling
                    self._log.warning("push progress failed", error=str(exc))
            if self.packing is not None and self.packing.busy:
                self.packing.settle()
                if self.packer is not None and self.packer.spinning:  # device gathers: microseconds
                    backoff.progressed()  # spin until the gathers are done (microseconds)
            expired, until = self.ledger.expire(now)
            self._deliver(expired)
            if pusher.targets and len(self.ledger):  # announcements may come: look often
                until = min(until if until is not None else math.inf, PUSH_POLL_S)
            await backoff.wait(busy=bool(len(self.ledger)) or pusher.busy, limit=until)
