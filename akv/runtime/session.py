"""A decode rank's link to one prefill engine, and the awaitable pulls it launches.

[`TransferSession`][akv.TransferSession] holds what the handshake produced (remote agents, the transfer
plan, prepared descriptor lists) and posts reads; the `Consumer`
polls them. Each pull's progress is a pure `TransferState`.
"""

from __future__ import annotations

import contextlib
import secrets
import sys
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec
import numpy as np
import numpy.typing as npt

from akv import exposure
from akv.errors import (
    AkvError,
    BackPressureError,
    ClosedError,
    ConfigError,
    EngineChangedError,
    HandshakeError,
    IncompatiblePeerError,
    MissingRanksError,
    PeerLostError,
    TransferCancelledError,
    TransferError,
    TransferTimeout,
    UnsafeReadError,
)
from akv.geometry.cache import CacheSpec, as_cache
from akv.plan import Prepared, RankMemory, TransferPlan
from akv.protocol.address import (
    BootstrapAddress,
    Endpoint,
    EngineAddress,
    EtcdAddress,
    RankListAddress,
    parse_endpoint,
)
from akv.protocol.handshake import HandshakeResult
from akv.protocol.messages import Challenge, Hello, Notice, RankInfo, encode_notice
from akv.protocol.push import PushNotice, encode_push
from akv.runtime import local
from akv.runtime.local import LocalRank
from akv.runtime.paths import Failed, PathName, PathOp, packed
from akv.runtime.paths.copy import CopyPlan
from akv.runtime.paths.push import PushOp
from akv.runtime.paths.read import NixlRead, RankCheck, ReadPost
from akv.runtime.rank import _leaves
from akv.tracker import Stage, TransferState

if sys.version_info < (3, 11):  # pragma: no cover - anyio brings the backport
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    from akv.runtime.consumer import Consumer

__all__ = ["PullRequest", "Transfer", "TransferResult", "TransferSession"]


def _ids(ids: Any) -> Any:
    """Block ids as plain lists (flat, or per group) for a push announcement."""
    if isinstance(ids, Mapping):
        return {str(k): [int(b) for b in v] for k, v in ids.items()}
    return [int(b) for b in ids]


class PullRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What to pull: the prefill engine's block ids of a request, and where they go locally.

    Block ids are a flat list for a one-group cache, else a mapping ``{group name: ids}``
    (see [`CacheSpec`][akv.CacheSpec]). Each list names the *last* blocks of the sequence.

    Attributes:
        request_id: the request, as the prefill engine exposed it.
        local_block_ids: this decode rank's blocks to fill. With fewer local than remote
            blocks (a partial prefix hit), only the tokens of the local blocks are read, into
            the local blocks in order; each group applies its own hit. State groups: the slot.
        remote_block_ids: the request's whole exposure on the prefill engine, always, as it
            announced it after ``expose()``: the pull checks, after its reads, that the
            request is still exposed with exactly these blocks on each prefill rank it read.
        num_tokens: the request's tokens (> 0). Default: every listed block is full and read
            whole. Give it when the last block is partly filled and the engines' block sizes
            differ, and for sliding-window groups to read only the window's blocks.
        lease_s: the lease the request was exposed with (``RequestInfo.lease_s``, the
            ``lease`` given to ``expose``): while the pull runs, the consumer renews it every
            third of it. Default: the prefill engine's default lease.
        generation: the exposure's generation (``RequestInfo.generation``, what ``expose``
            returned; with several prefill ranks, one the engine passed to every rank's
            ``expose``): the pull is bound to that exposure and fails with
            [`ReexposedError`][akv.errors.ReexposedError] if the request was released and
            exposed again before its reads completed. 0: not bound to a generation.
    """

    request_id: str
    local_block_ids: Sequence[int] | npt.NDArray[np.integer[Any]] | Mapping[str, Sequence[int]]
    remote_block_ids: Sequence[int] | npt.NDArray[np.integer[Any]] | Mapping[str, Sequence[int]]
    num_tokens: int | None = None
    lease_s: float | None = None
    generation: int = 0


class TransferResult(msgspec.Struct, frozen=True):
    """A completed pull.

    Attributes:
        request_id: the request.
        bytes: data bytes moved into this rank's cache.
        descriptors: byte runs moved: descriptors submitted to NIXL on the read path, runs
            copied on the copy path (the same count for the same request), descriptors of the
            packed copies read on the packed path.
        reads: prefill ranks read from (one read, or one copy, each).
        seconds: wall time from launch to completion.
        path: how the bytes moved: ``"copy"`` (torch, the prefill ranks live in this
            process), ``"read"`` (NIXL READs), ``"packed"`` (NIXL READs of the prefill
            ranks' packed copies, then a scatter into the paged cache) or ``"push"`` (the prefill ranks WRITE).
    """

    request_id: str
    bytes: int
    descriptors: int
    reads: int
    seconds: float
    path: str = "read"


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
        prepared: Prepared,
        notice: bytes,
        state: TransferState,
        op: PathOp,
        notify: tuple[int, ...],
    ) -> None:
        self.session = session
        self.request_id = request_id
        self.prepared = prepared
        self.notice = notice  # the "done" notice
        self.state = state
        self.op = op  # the transfer on its path
        self.notify = notify  # prefill ranks notified once it is done (a read's carry their notice)
        self.generation = 0  # the exposure generation the pull is bound to (0: none)
        self.notified = False  # its reads' "done" notice went out (it may still scatter)
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
        return self.prepared.bytes

    @property
    def path(self) -> PathName:
        """The transfer path moving its bytes: ``"copy"``, ``"read"``, ``"packed"`` or ``"push"``."""
        return self.op.path

    async def cancel(self) -> None:
        """Stop the pull; returns once nothing it started can still write into its blocks
        (push mode: every writer confirmed it stopped, or its agent was removed). Then
        ``await transfer`` raises [`TransferCancelledError`][akv.errors.TransferCancelledError]
        (unless it had settled already)."""
        if not self.done() and not self.state.finished:
            self.session.consumer.fail(
                self, TransferCancelledError(f"transfer {self.request_id!r} was cancelled")
            )
        with contextlib.suppress(AkvError):
            await self.wait()

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
            p = self.prepared
            descriptors = getattr(self.op, "descriptors", None)  # a packed read's own count
            self._result = TransferResult(
                self.request_id,
                p.bytes,
                p.descriptors if descriptors is None else descriptors,
                len(p.posts),
                time.monotonic() - self.state.started,
                self.op.path,
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


@dataclass(eq=False)
class RankLink:
    """What a session holds for one prefill rank: its agent, memory and exposure table."""

    rank: int
    info: RankInfo
    agent: str
    check: RankCheck | None = None  # its exposure table, prepared
    local: LocalRank | None = None  # the rank itself, if it lives in this process
    broken: bool = False
    loading: anyio.Event | None = None
    dropped: bool = False  # its reference to the remote agent was given back
    directory: RankCheck | None = None  # its packed-copy directory, prepared (akv.packing)


class _Unsettled(Exception):
    """A launch failed while reads it posted may still land (internal)."""

    def __init__(self, error: AkvError, op: object) -> None:
        super().__init__(str(error))
        self.error = error
        self.op = op


class TransferSession:
    """A decode rank's link to one prefill engine: every prefill rank it needs, handshaken
    concurrently (each rank serves its own control endpoint), metadata loaded, descriptor
    lists prepared.

    Created by [`Consumer.connect`][akv.Consumer.connect] for an engine address, not
    directly. Losing one rank fails only the pulls
    that need it; the next pull that needs it re-handshakes with that rank alone (found
    again through the address: the bootstrap, or etcd), never reusing its old metadata.
    """

    def __init__(self, consumer: Consumer, address: EngineAddress) -> None:
        self.consumer = consumer
        self.address = address
        self.endpoint = str(address)
        self.log = consumer.log.bind(engine_address=self.endpoint)
        self.remote_engine_id = ""
        self.remote_instance = ""  # the engine's incarnation (Challenge.instance_id), once known
        self.remote_spec: CacheSpec | None = None
        self.prefill_tp = 0
        self.lease_s = 0.0
        self.plan: TransferPlan | None = None
        self.links: dict[int, RankLink] = {}
        self.dlists: dict[Any, Any] = {}
        self.copier: CopyPlan | None = None  # the copy path's plan, if ranks live in this process
        self.closed = False
        self.transfers: set[Transfer] = set()
        self._loading: anyio.Event | None = None
        self._installing = anyio.Lock()  # one plan rebuild at a time
        self._relink_failed: dict[int, tuple[anyio.Event, AkvError]] = {}  # rank -> failed attempt
        self._registry: Any = None  # an EtcdRegistry for etcd:// addresses

    @property
    def agents(self) -> dict[int, str]:
        """The NIXL agent name of each linked prefill rank."""
        return {r: link.agent for r, link in self.links.items()}

    @property
    def broken(self) -> bool:
        """True if some linked prefill rank was lost (the next pull needing it re-handshakes)."""
        return any(link.broken for link in self.links.values())

    # -- setup ---------------------------------------------------------------------------

    def _hello(self) -> Hello:
        c = self.consumer
        hello = Hello(
            engine_id=c.engine_id,
            tp_rank=c.tp_rank,
            tp_size=c.tp_size,
            spec=c.cache,
            compat=c.cache.compat_hash(),
            nonce=secrets.token_bytes(16),
            agent_name=c.backend.name,
        )
        if c.mode == "push":  # the prefill ranks WRITE: they need our agent and regions
            hello = msgspec.structs.replace(
                hello,
                mode="push",
                agent_metadata=c.agent_metadata,
                region_addrs=list(c.memory.region_addrs),
                mem_type=c.mem_type,
                device_id=c.memory.device_id,
            )
        return hello

    def needed(self, prefill_tp: int) -> set[int]:
        """The prefill ranks this decode rank reads from or notifies."""
        c = self.consumer
        return set(c.cache.notify_ranks(c.tp_rank, c.tp_size, prefill_tp))

    async def handshake(self) -> None:
        """Handshake with every prefill rank this rank needs; shared by concurrent callers."""
        while self._loading is not None:
            await self._loading.wait()
            if self.plan is not None:
                return
        self._loading = done = anyio.Event()
        c = self.consumer
        try:
            challenge, infos = await self._fetch(None)
            await self._install(challenge, infos)
        except BaseException:
            c.metrics.inc("handshakes_failed")
            raise
        finally:
            self._loading = None
            done.set()
        c.metrics.inc("handshakes")
        self.log.info(
            "handshake done", remote=self.remote_engine_id, prefill_tp=self.prefill_tp, ranks=sorted(infos)
        )

    async def _handshake_with(
        self, endpoint: Endpoint, choose: Callable[[Challenge], Sequence[int]]
    ) -> HandshakeResult:
        from akv.runtime.control import client_handshake

        c = self.consumer
        return await client_handshake(
            endpoint,
            self._hello(),
            secret=c.secret,
            choose_ranks=choose,
            connect_timeout=c.connect_timeout,
            handshake_timeout=c.handshake_timeout,
            retries=c.retries,
            tls=c.tls_context,
        )

    async def _fetch(self, ranks: set[int] | None) -> tuple[Challenge, dict[int, RankInfo]]:
        """Find the endpoints of ``ranks`` (None: every rank needed) and handshake with them."""
        addr = self.address
        infos: dict[int, RankInfo] = {}
        challenges: list[Challenge] = []
        if isinstance(addr, BootstrapAddress):
            tp, endpoints, first = await self._from_bootstrap(addr.endpoint, ranks)
            challenges.append(first.challenge)
            infos.update(first.ranks)
        elif isinstance(addr, RankListAddress):
            tp = len(addr.endpoints)
            endpoints = {r: addr.endpoints[r] for r in (ranks if ranks is not None else self.needed(tp))}
        else:
            tp, endpoints = await self._from_etcd(addr, ranks)
        by_endpoint: dict[Endpoint, list[int]] = {}
        for rank, ep in endpoints.items():
            if rank not in infos:
                by_endpoint.setdefault(ep, []).append(rank)
        results: list[HandshakeResult] = []

        async def one(ep: Endpoint, wanted: list[int]) -> None:
            results.append(await self._handshake_with(ep, lambda ch: sorted(wanted)))

        try:
            async with anyio.create_task_group() as tg:
                for ep, wanted in by_endpoint.items():
                    tg.start_soon(one, ep, wanted)
        except BaseExceptionGroup as group:
            leaves = _leaves(group)
            if all(isinstance(e, AkvError) for e in leaves):
                raise leaves[0] from None  # a typed HandshakeError, as documented, not a group
            raise
        for res in results:
            challenges.append(res.challenge)
            infos.update(res.ranks)
        for ch in challenges:
            if ch.tp_size != tp or ch.engine_id != challenges[0].engine_id:
                raise HandshakeError(
                    f"the ranks at {addr} are not one engine: {ch.engine_id!r} of TP size {ch.tp_size} "
                    f"answered where {challenges[0].engine_id!r} of TP size {tp} was expected"
                )
        self._check_same_engine(challenges)
        return challenges[0], infos

    def _check_same_engine(self, challenges: list[Challenge]) -> None:
        """Refuse (before adopting any metadata) ranks of another engine, or of another
        incarnation of it, than the one this session linked to first."""
        ids = sorted({ch.instance_id for ch in challenges if ch.instance_id})
        engine = challenges[0].engine_id
        if len(ids) > 1:
            raise HandshakeError(f"the ranks at {self.address} are not one engine: instances {ids}")
        if self.remote_engine_id and engine != self.remote_engine_id:
            raise EngineChangedError(
                f"engine {engine!r} now answers at {self.address}, where this session linked to "
                f"{self.remote_engine_id!r}: connect again for a session to it",
                "engine_id",
            )
        if self.remote_instance and ids and ids[0] != self.remote_instance:
            raise EngineChangedError(
                f"engine {engine!r} at {self.address} was restarted (instance {ids[0]}, this session "
                f"linked to instance {self.remote_instance}): connect again for a session to it",
                "instance_id",
            )
        if ids:
            self.remote_instance = ids[0]

    async def _from_bootstrap(
        self, bootstrap: Endpoint, ranks: set[int] | None
    ) -> tuple[int, dict[int, Endpoint], HandshakeResult]:
        """Ask rank 0 for the engine's rank endpoints (waiting for ranks not registered yet);
        metadata of the needed ranks it serves itself comes in the same conversation."""
        deadline = time.monotonic() + self.consumer.handshake_timeout
        delay = 0.05
        while True:
            need: set[int] = set()

            def choose(ch: Challenge, need: set[int] = need) -> list[int]:
                need.update(ranks if ranks is not None else self.needed(ch.tp_size))
                return sorted(r for r in need if r in ch.ranks)

            first = await self._handshake_with(bootstrap, choose)
            ch = first.challenge
            listed = ch.endpoints or [str(bootstrap)] * ch.tp_size
            missing = sorted(r for r in need if r not in first.ranks and not listed[r])
            if not missing:
                endpoints = {r: parse_endpoint(listed[r]) for r in need if r not in first.ranks}
                return ch.tp_size, endpoints, first
            if time.monotonic() + delay > deadline:
                raise MissingRanksError(
                    f"prefill ranks {missing} of engine {ch.engine_id!r} have not registered with its "
                    f"bootstrap {bootstrap} within {self.consumer.handshake_timeout}s: start them with "
                    f"--bootstrap {bootstrap} (or Producer(bootstrap=...))",
                    engine_id=ch.engine_id,
                    missing=tuple(missing),
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _from_etcd(self, addr: EtcdAddress, ranks: set[int] | None) -> tuple[int, dict[int, Endpoint]]:
        from akv.runtime.discovery import EtcdRegistry

        if self._registry is None:
            self._registry = EtcdRegistry(addr.etcd)
        timeout = self.consumer.handshake_timeout
        try:  # resolution is rare: hold no HTTP connection between resolutions
            records = await self._registry.resolve(addr.engine_id, need=ranks, timeout=timeout)
            tp = next(iter(records.values())).tp_size
            need = ranks if ranks is not None else self.needed(tp)
            if not need <= records.keys():
                records = await self._registry.resolve(
                    addr.engine_id, need=need, tp_size_hint=tp, timeout=timeout
                )
        finally:
            await self._registry.aclose()
        return tp, {r: records[r].endpoint for r in need}

    async def _install(self, ch: Challenge, infos: dict[int, RankInfo]) -> None:
        """Load the agents of ``infos`` (replacing older links of those ranks), rebuild the plan,
        prepare what changed. NIXL calls run in a worker thread; one install at a time."""
        async with self._installing:
            await self._install_locked(ch, infos)

    async def _install_locked(self, ch: Challenge, infos: dict[int, RankInfo]) -> None:
        c = self.consumer
        if c.same_process == "copy":
            elsewhere = sorted(r for r, i in infos.items() if local.find(i) is None)
            if elsewhere:
                raise IncompatiblePeerError(
                    f"prefill ranks {elsewhere} of engine {ch.engine_id!r} do not live in this process: "
                    "same_process='copy' needs every one here (use 'auto' to copy only when they are)",
                    ("same_process",),
                )
        if c.transfer == "packed" and (plain := sorted(r for r, i in infos.items() if i.pack is None)):
            raise packed.error_for(plain, ch.engine_id)
        if c.verify_exposure:
            missing = sorted(r for r, i in infos.items() if not i.exposure_buckets)
            if missing:
                raise IncompatiblePeerError(
                    f"prefill ranks {missing} publish no exposure table: run the same akv release on both "
                    "engines (or pass verify_exposure=False to trust it blindly)",
                    ("exposure",),
                )
        if c.transfer != "direct" and c.mode != "push" and any(i.pack is not None for i in infos.values()):
            await c.enable_packing()
        for r in infos:  # a rank linked before (lost, or restarted): forget its old agent first
            link = self.links.get(r)
            if link is not None:
                self._fail_rank(r, PeerLostError(f"the link to prefill rank {r} was reset"))
                self._drop(link)
                link.broken = True
        epoch = c.agent_epoch
        fresh = await anyio.to_thread.run_sync(self._link_blocking, infos)
        before = {r: self.links[r] for r in fresh if r in self.links}
        installed = anyio.Event()
        for link in fresh.values():
            link.loading = installed  # pulls wait until its lists are prepared too
        self.links.update(fresh)
        try:
            memory = {
                r: RankMemory(r, ch.tp_size, tuple(link.info.region_addrs), link.info.device_id)
                for r, link in self.links.items()
            }
            plan = TransferPlan(local_spec=c.cache, local=c.memory, remote_spec=ch.spec, remote=memory)
            await anyio.to_thread.run_sync(self._prep_blocking, plan)
            if c.agent_epoch != epoch:  # the agent was replaced meanwhile: these links are dead
                raise PeerLostError(
                    "this decode rank replaced its NIXL agent during the handshake: pull again"
                )
        except BaseException:
            for r, link in fresh.items():
                self._drop(link)
                if r in before:
                    self.links[r] = before[r]  # still broken: the next pull tries again
                else:
                    del self.links[r]
            raise
        finally:
            for link in fresh.values():
                link.loading = None
            installed.set()
        here = {r: link.local for r, link in self.links.items() if link.local is not None and not link.broken}
        if self.copier is not None:
            self.copier.close()
        self.copier = None
        if here:
            try:
                self.copier = CopyPlan(plan.tables, c.kv_caches, here, c.copy_inline_bytes, c.copy_with)
            except TransferError as exc:  # the tensors do not match what was announced: read instead
                self.log.warning("prefill ranks of this process are read through NIXL", error=str(exc))
        self.remote_engine_id = ch.engine_id
        self.remote_spec = ch.spec
        self.prefill_tp = ch.tp_size
        self.lease_s = ch.lease_s
        self.plan = plan

    def _link_blocking(self, infos: dict[int, RankInfo]) -> dict[int, RankLink]:
        backend = self.consumer.backend
        bucket_bytes = exposure.SLOTS * exposure.SLOT_WORDS * 8
        out: dict[int, RankLink] = {}
        try:
            for rank, info in infos.items():
                link = out[rank] = RankLink(rank, info, backend.add_remote(info.agent_metadata))
                if self.consumer.same_process != "nixl":
                    link.local = local.find(info)
                backend.connect(link.agent)  # so the first pull does not pay for wire-up
                if self.consumer.verify_exposure:
                    table = np.array(
                        [[info.exposure_addr, bucket_bytes, 0, bucket_bytes, info.exposure_buckets]],
                        dtype=np.int64,
                    )
                    link.check = RankCheck(backend.prep(link.agent, table, "DRAM"), info.exposure_buckets)
                if info.pack is not None and self.consumer.staging is not None:
                    link.directory = packed.directory_check(backend, link.agent, info.pack)
        except BaseException:
            for link in out.values():
                self._drop(link)
            raise
        return out

    def _prep_blocking(self, plan: TransferPlan) -> None:
        """Prepare the plan's tables not prepared yet (a relinked rank's remote ones)."""
        c = self.consumer
        for key, table in plan.tables.items():
            if key in self.dlists:
                continue
            if key[0] == "local":
                self.dlists[key] = c.local_dlist(key, table)
                continue
            link = self.links[int(key[1])]  # type: ignore[call-overload]
            if not link.broken:  # a lost rank's lists are prepared when it is linked again
                self.dlists[key] = c.backend.prep(link.agent, table, link.info.mem_type)

    def _drop(self, link: RankLink) -> None:
        """Release a rank's remote lists and forget its agent."""
        backend = self.consumer.backend_or_none
        for key in [k for k in self.dlists if k[0] == "remote" and k[1] == link.rank]:
            handle = self.dlists.pop(key)
            if backend is not None:
                backend.release_dlist(handle)
        if backend is not None:
            if link.check is not None:
                backend.release_dlist(link.check.dlist)
            if link.directory is not None:
                backend.release_dlist(link.directory.dlist)
            if not link.dropped:  # one reference per link: the agent may serve other sessions
                backend.remove_remote(link.agent)
        link.dropped = True
        link.check = None
        link.directory = None
        link.local = None
        link.broken = True
        if self.copier is not None:
            self.copier.remote.pop(link.rank, None)

    def _fail_rank(self, rank: int, error: AkvError) -> None:
        """Fail the pulls in flight that wait on reads from ``rank``."""
        for transfer in list(self.transfers):
            if rank in transfer.op.ranks:
                self.consumer.fail(transfer, error)

    def _unload(self) -> None:
        for link in self.links.values():
            self._drop(link)
        self.links.clear()
        self.dlists.clear()
        self.plan = None
        if self.copier is not None:
            self.copier.close()
        self.copier = None
        self._registry = None

    async def relink(self, ranks: Sequence[int]) -> None:
        """Re-handshake with lost prefill ranks only (shared by concurrent callers)."""
        waiting = [self.links[r].loading for r in ranks if r in self.links and self.links[r].loading]
        todo = [
            r for r in ranks if r in self.links and self.links[r].loading is None and self.links[r].broken
        ]
        if todo:
            done = anyio.Event()
            for r in todo:
                self.links[r].loading = done
            try:
                challenge, infos = await self._fetch(set(todo))
                await self._install(challenge, infos)
                self.consumer.metrics.inc("handshakes")
                self.log.info("prefill ranks re-linked", ranks=todo)
            except BaseException as exc:
                self.consumer.metrics.inc("handshakes_failed")
                for r in todo:
                    if r in self.links:
                        self.links[r].loading = None
                if isinstance(exc, AkvError):
                    self.log.warning(
                        "prefill ranks lost: the pulls needing them fail", ranks=todo, error=str(exc)
                    )
                    failure = (done, exc)
                    for r in todo:
                        self._relink_failed[r] = failure
                raise
            finally:
                done.set()
        for event in waiting:
            if event is not None:
                await event.wait()
        lost = [r for r in ranks if r in self.links and self.links[r].broken]
        for r in lost:  # the attempt we waited for failed: fail with it, at once, not one by one
            failed = self._relink_failed.get(r)
            if failed is not None and failed[0] in waiting:
                raise PeerLostError(f"prefill rank {r} is lost: linking it again failed: {failed[1]}")
        if lost and not todo:
            await self.relink(lost)  # no attempt of another caller said why: try ourselves

    def mark_broken(self, error: AkvError, rank: int | None) -> None:
        """Note a failed read: the next pull needing that rank re-handshakes with it (nothing
        clears that but a successful handshake). A rank that went away does not always show
        as PeerLostError (NIXL may just report the transfer in error), so any transfer error
        counts, except a timeout (the peer may only be slow, and a handshake with a hung peer
        would just time out too), a failed exposure check and back-pressure (the link is fine),
        and a failure that is no rank's (``rank`` None)."""
        if rank is None or not isinstance(error, TransferError):
            return
        if isinstance(error, (TransferTimeout, UnsafeReadError, BackPressureError)):
            return
        link = self.links.get(rank)
        if link is not None:
            link.broken = True

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
        c = self.consumer
        if not isinstance(request.request_id, str) or not request.request_id:
            raise ConfigError(f"request_id must be a non-empty string, got {request.request_id!r}")
        if request.lease_s is not None and not 0 < request.lease_s < float("inf"):
            raise ConfigError(f"lease_s must be a finite number of seconds > 0, got {request.lease_s}")
        if self.closed or c.closed:
            raise ClosedError("the session is closed")
        if self.plan is None:
            await self.handshake()
        plan = self.plan
        if plan is None:  # pragma: no cover - a handshake sets it or raises
            raise ClosedError("the session is closed")
        for r in plan.notify:  # a rank of this process that closed: link again (it may have restarted)
            here = self.links[r].local
            if here is not None and not local.alive(here):
                self._fail_rank(r, PeerLostError(f"prefill rank {r} of this process closed"))
                self.links[r].broken = True
        while lost := [r for r in plan.notify if self.links[r].broken or self.links[r].loading]:
            await self.relink(lost)  # other ranks may be re-linking meanwhile: look again after
            plan = self.plan
            if plan is None or self.closed:
                raise ClosedError("the session is closed")
        prepared = plan.prepare(
            request.request_id, request.local_block_ids, request.remote_block_ids, request.num_tokens
        )
        notice = self.done_notice(request.request_id, prepared.remote_ids, request.generation)
        timeout = c.transfer_timeout if transfer_timeout is None else transfer_timeout
        lease = request.lease_s if request.lease_s else self.lease_s  # the exposure's own lease
        heartbeat = lease / 3 if lease > 0 else 0.0
        state = TransferState(request.request_id, time.monotonic(), timeout, heartbeat)
        op: PathOp
        failed: Failed | None = None
        if self.path_for(prepared) == "push":
            push = op = self._launch_push(prepared, request)
            notify = prepared.standalone
            failed = push.start()
        else:
            try:
                op, notify = self._launch(plan, prepared, request.request_id, notice, request.generation)
            except _Unsettled as unsettled:
                await c.settle(unsettled.op)  # no write lands after pull raises
                raise unsettled.error from None
        transfer = Transfer(self, request.request_id, prepared, notice, state, op, notify)
        transfer.generation = request.generation
        self.transfers.add(transfer)
        c.track(transfer)
        if failed is not None:  # an announcement could not be sent: the writers told already stop
            self.mark_broken(failed.error, failed.rank)
            c.fail(transfer, failed.error)
            await transfer.wait()  # raises, once none of them can still write
        elif isinstance(op, PushOp):
            c.pump()  # the announcements go out now
        return transfer

    def path_for(self, prepared: Prepared) -> PathName:
        """The path a prepared request takes: ``"packed"`` where the consumer's ``transfer``
        picks the prefill ranks' packed copies, else ``"copy"`` if every prefill rank it reads
        from lives in this process (and the consumer allows it), else ``"push"`` for a
        consumer in push mode, else ``"read"`` (a packed pull may still fall back to direct
        reads, when a prefill rank kept no copy of the request)."""
        copier = self._copier_for(prepared)
        if self._packs(prepared, copier):
            return "packed"
        if copier is not None:
            return "copy"
        return "push" if self.consumer.mode == "push" else "read"

    def _packs(self, prepared: Prepared, copier: CopyPlan | None) -> bool:
        c = self.consumer
        if c.staging is None or c.mode == "push":
            return False
        packs = {r: link.info.pack if link.directory is not None else None for r, link in self.links.items()}
        return packed.use_packed(c.transfer, prepared, packs, c.pack_threshold) and (
            copier is None or c.transfer == "packed" or any(p and p.early for p in packs.values())
        )

    def _copier_for(self, prepared: Prepared) -> CopyPlan | None:
        copier = self.copier
        if copier is None or self.consumer.same_process == "nixl":
            return None
        return copier if copier.covers({op.remote_rank for op, _, _ in prepared.posts}) else None

    def _launch(
        self, plan: TransferPlan, prepared: Prepared, request_id: str, notice: bytes, generation: int
    ) -> tuple[PathOp, tuple[int, ...]]:
        """Start a prepared request on its path; returns the op and the ranks to notify once done."""
        c = self.consumer
        copier = self._copier_for(prepared)
        if self._packs(prepared, copier):
            return self._launch_packed(prepared, request_id, notice, generation)
        if copier is not None:
            launched = copier.launch(
                prepared, request_id, plan.notify, check=c.verify_exposure, generation=generation
            )
            if isinstance(launched, Failed):
                c.metrics.inc("transfers_failed")
                raise launched.error
            return launched, plan.notify
        read = self._direct(prepared, request_id, notice, generation)
        self._started(read, read.start())
        return read, prepared.standalone

    def _started(self, op: PathOp, failed: Failed | None) -> None:
        """Raise the error of a launch whose start failed (`_Unsettled` while reads it posted
        may still land)."""
        if failed is None:
            return
        c = self.consumer
        self.mark_broken(failed.error, failed.rank)
        c.reap()
        c.metrics.inc("transfers_failed")
        if c.reaper.holds(op):  # reads posted before the failure may still land
            raise _Unsettled(failed.error, op)
        raise failed.error

    def _direct(self, prepared: Prepared, request_id: str, notice: bytes, generation: int) -> NixlRead:
        """The read path's op for a prepared request (not started)."""
        c = self.consumer
        posts = [
            ReadPost(op.remote_rank, self.dlists[op.local_table], li, self.dlists[op.remote_table], ri)
            for op, li, ri in prepared.posts
        ]
        checks = {post.rank: self.links[post.rank].check for post in posts} if c.verify_exposure else None
        return NixlRead(
            c.backend,
            c.reaper,
            posts,
            request_id=request_id,
            remote_ids=prepared.remote_ids,
            read_ids=prepared.read_ids,
            notice=notice,
            checks=checks,
            pool=c.checks if c.verify_exposure else None,
            generation=generation,
        )

    def _launch_packed(
        self, prepared: Prepared, request_id: str, notice: bytes, generation: int
    ) -> tuple[PathOp, tuple[int, ...]]:
        """Start a prepared request on the packed path (see `akv.runtime.paths.packed`)."""
        c = self.consumer
        if c.staging is None or c.directories is None or self.remote_spec is None:
            raise ClosedError("the consumer keeps no staging area for packed reads")
        ranks = {op.remote_rank for op, _, _ in prepared.posts}
        links = {
            r: packed.PackedLink(r, link.agent, link.info.pack, link.directory)
            for r, link in self.links.items()
            if r in ranks and link.info.pack is not None and link.directory is not None
        }
        early = any(link.pack.early for link in links.values())
        op = packed.PackedRead(
            c.backend,
            c.reaper,
            request_id=request_id,
            prepared=prepared,
            generation=generation,
            notice=notice,
            links=links,
            checks={r: self.links[r].check for r in ranks} if c.verify_exposure else None,
            check_pool=c.checks if c.verify_exposure else None,
            dir_pool=c.directories,
            staging=c.staging,
            views=c.pack_views,
            local_spec=c.cache,
            remote_spec=as_cache(self.remote_spec),
            prefill_tp=self.prefill_tp,
            direct=None if early else self._direct(prepared, request_id, notice, generation),
        )
        self._started(op, op.start())
        return op, prepared.standalone

    def _launch_push(self, prepared: Prepared, req: PullRequest) -> PushOp:
        """The grant of this pull's blocks to its writers (every prefill rank it reads from);
        its ``start`` announces it."""
        c = self.consumer
        writers = {op.remote_rank: self.links[op.remote_rank].agent for op, _, _ in prepared.posts}
        announce = PushNotice(
            kind="announce",
            engine_id=c.engine_id,
            decode_rank=c.tp_rank,
            decode_tp=c.tp_size,
            request_id=req.request_id,
            grant=c.new_grant(),
            generation=req.generation,
            local_ids=_ids(req.local_block_ids),
            remote_ids=_ids(req.remote_block_ids),
            num_tokens=req.num_tokens or 0,
        )
        c.flush_notices()
        return PushOp(c.backend, writers, announce)

    def invalidate(self, ranks: Sequence[int]) -> None:
        """Writers that did not confirm a stop in time: forget their agents (the next pull
        that needs them handshakes again)."""
        for rank in ranks:
            link = self.links.get(rank)
            if link is not None:
                self._drop(link)

    def done_notice(self, request_id: str, remote_all: npt.NDArray[np.int32], generation: int = 0) -> bytes:
        """The "done" notice of a request, with the digest of its prefill block ids (and the
        exposure generation the pull is bound to)."""
        c = self.consumer
        digest, gens = [exposure.digest(remote_all)], [generation] if generation else []
        return encode_notice(Notice("done", c.engine_id, c.tp_rank, c.tp_size, [request_id], digest, gens))

    def notify(self, ranks: Sequence[int], notice: bytes) -> None:
        """Send a notice to prefill ranks (handed over directly to ranks of this process); a
        failure only logs (the rank releases by lease)."""
        sent_nixl = False
        for rank in ranks:
            try:
                link = self.links[rank]
                here = link.local
                if here is not None and local.alive(here):
                    here.deliver(self.consumer.backend.name, notice)
                else:
                    self.consumer.backend.notify(link.agent, notice)
                    self.consumer.noticed(self, [rank])
                    sent_nixl = True
                self.consumer.metrics.inc("notifications_sent")
            except (AkvError, KeyError) as exc:
                self.log.warning(
                    "notifying a prefill rank failed; it will release by lease",
                    prefill_rank=rank,
                    error=str(exc),
                )
        if sent_nixl:
            self.consumer.flush_notices()

    def say_bye(self) -> None:
        """Push mode: tell the prefill ranks to forget this decode rank's agent."""
        c = self.consumer
        if c.mode != "push" or c.backend_or_none is None:
            return
        bye = encode_push(
            PushNotice(kind="bye", engine_id=c.engine_id, decode_rank=c.tp_rank, decode_tp=c.tp_size)
        )
        for link in self.links.values():
            if not link.dropped:
                with contextlib.suppress(AkvError):
                    c.backend.notify(link.agent, bye)
        c.flush_notices()

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
        """Fail this session's running transfers and forget the remote agents. Returns once
        nothing those transfers started can still write into their blocks (see the
        consumer's ``settle_timeout``)."""
        if self.closed:
            return
        self.closed = True
        running = list(self.transfers)
        for transfer in running:
            self.consumer.fail(transfer, ClosedError("the session was closed"))
        for transfer in running:
            with contextlib.suppress(AkvError):
                await transfer.wait()
        await self.consumer.settled(self)
        self.say_bye()
        self._unload()
        self.consumer.forget(self)

    def reset_links(self, error: AkvError) -> None:
        """The consumer replaced its agent: fail the pulls in flight with ``error`` and forget
        every handle of the old agent (without calling it); the next pull re-links."""
        for transfer in list(self.transfers):
            self.consumer.fail(transfer, error)
        for link in self.links.values():
            link.dropped = True  # its reference died with the old agent
            link.check = None
            link.directory = None  # a prepared list of the old agent (packed copies)
            link.broken = True
        self.dlists.clear()
