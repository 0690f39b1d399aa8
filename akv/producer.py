"""The prefill side: expose blocks, serve handshakes, count readers, release exactly once."""

from __future__ import annotations

import contextlib
import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import anyio
import numpy as np
import numpy.typing as npt
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from akv import tp
from akv._poll import Backoff
from akv._rank import RankBase
from akv.backend import NixlBackend
from akv.control import ControlServer, Endpoint
from akv.errors import AkvError, ClosedError, ConfigError, ProtocolError, UnknownRequestError
from akv.plan import check_block_ids
from akv.spec import KVSpec
from akv.wire import Notice, RankInfo, decode_notice

__all__ = ["Producer", "Release"]


ReleaseReason = Literal["read", "expired", "closed"]


@dataclass(frozen=True, slots=True)
class Release:
    """A request's blocks are free again. Reported exactly once per exposed request.

    ``reason`` is ``"read"`` (every expected decode rank notified), ``"expired"`` (the lease
    ran out first) or ``"closed"`` (the producer shut down first).
    """

    request_id: str
    block_ids: npt.NDArray[np.int32]
    reason: ReleaseReason
    notified: int
    expected: int | None


@dataclass(slots=True)
class _Exposure:
    block_ids: npt.NDArray[np.int32]
    lease_s: float
    deadline: float
    readers: set[int] = field(default_factory=set)
    decode_tp: int | None = None


class Producer(RankBase):
    """One prefill rank: registers its KV cache, serves handshakes and tracks exposed blocks.

    Use as an async context manager. :meth:`expose` pins a request's blocks until every
    decode rank that must read or learn of them has notified, or until the lease expires;
    then the release is reported once, via ``on_release`` and :meth:`releases`.

    By default the producer serves its own control endpoint on ``host:port`` (loopback, any
    port); pass ``server=`` to share one :class:`ControlServer` among the ranks of a process.
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        spec: KVSpec,
        *,
        tp_rank: int,
        tp_size: int,
        engine_id: str = "prefill",
        on_release: Callable[[Release], None] | None = None,
        lease: float = 120.0,
        server: ControlServer | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | bytes | None = None,
        allow_insecure: bool = False,
        backend: NixlBackend | None = None,
        progress_thread: bool = False,
        poll_max_s: float = 0.002,
        spin_s: float = 0.002,
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
        if not lease > 0:
            raise ConfigError(f"lease must be > 0 seconds, got {lease}")
        self.lease_s = float(lease)
        self.on_release = on_release
        self._own_server = server is None
        self.server = server or ControlServer(
            host=host, port=port, secret=secret, allow_insecure=allow_insecure, metrics=self.metrics
        )
        self._exposed: dict[str, _Exposure] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._peers: dict[str, int] = {}
        self._expected: dict[int, int] = {}
        self._notifiers: dict[tuple[int, int], bool] = {}
        self._streams: list[MemoryObjectSendStream[Release]] = []
        self._info: RankInfo | None = None
        self._idle: anyio.Event | None = None

    # -- lifetime -----------------------------------------------------------------------

    async def __aenter__(self) -> Producer:
        try:
            tg = await self._start()
            self.server.add(self)
            if self._own_server:
                await tg.start(self.server.serve)
            tg.start_soon(self._poll)
        except BaseException:
            await self._shutdown()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._shutdown()

    async def _shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.server.remove(self)
        await self._stop_tasks()
        for rid in list(self._exposed):
            self._release(rid, "closed")
        for stream in self._streams:
            stream.close()
        if self._backend is not None:
            self._backend.close()

    @property
    def endpoint(self) -> Endpoint:
        """The control endpoint decode ranks connect to."""
        return self.server.endpoint

    # -- handshake hooks (called by the control server) ---------------------------------

    def rank_info(self) -> RankInfo:
        """This rank's agent metadata and region addresses."""
        if self._info is None:
            mem, dev = NixlBackend.mem_type(self.kv_caches)
            self._info = RankInfo(
                tp_rank=self.tp_rank,
                agent_name=self.backend.name,
                agent_metadata=self.backend.metadata(),
                region_addrs=[t.data_ptr() for t in self.kv_caches],
                device_id=dev,
                mem_type=mem,
            )
        return self._info

    def peer_connected(self, engine_id: str, decode_rank: int, decode_tp: int) -> None:
        """Remember a decode engine's TP size (it fixes how many notifications to expect)."""
        self._peers[engine_id] = decode_tp
        self._log.info(
            "decode rank connected",
            peer=engine_id,
            decode_rank=decode_rank,
            decode_tp=decode_tp,
        )

    def expected_notifications(self, decode_tp: int) -> int:
        """How many decode ranks of an engine with ``decode_tp`` notify this rank per request."""
        n = self._expected.get(decode_tp)
        if n is None:
            n = tp.expected_notifications(
                prefill_rank=self.tp_rank,
                prefill_tp=self.tp_size,
                decode_tp=decode_tp,
                kv_heads=self.spec.kv_heads,
                mla=self.spec.kind == "mla",
            )
            self._expected[decode_tp] = n
        return n

    # -- exposing -----------------------------------------------------------------------

    def expose(
        self, request_id: str, block_ids: Sequence[int] | npt.ArrayLike, *, lease: float | None = None
    ) -> None:
        """Pin a request's blocks until read by every expected decode rank or ``lease`` seconds pass.

        Raises :class:`BlockIdError` for bad ids, :class:`ConfigError` for a request id
        already exposed, :class:`ClosedError` when not running.
        """
        if self.closed or self._tg is None:
            raise ClosedError("the producer is not running")
        ids = check_block_ids(block_ids, self.spec.num_blocks, f"request {request_id!r}")
        if request_id in self._exposed:
            raise ConfigError(f"request {request_id!r} is already exposed")
        lease_s = self.lease_s if lease is None else float(lease)
        if not lease_s > 0 or math.isnan(lease_s):
            raise ConfigError(f"lease must be > 0 seconds, got {lease}")
        deadline = time.monotonic() + lease_s
        self._exposed[request_id] = _Exposure(ids, lease_s, deadline)
        heapq.heappush(self._deadlines, (deadline, request_id))
        self.metrics.inc("exposed")
        if self._backoff is not None:
            self._backoff.wake()

    def extend(self, request_id: str, seconds: float | None = None) -> None:
        """Push a request's lease deadline to ``now + seconds`` (default: its lease)."""
        exp = self._exposed.get(request_id)
        if exp is None:
            raise UnknownRequestError(f"request {request_id!r} is not exposed")
        exp.deadline = time.monotonic() + (exp.lease_s if seconds is None else seconds)
        heapq.heappush(self._deadlines, (exp.deadline, request_id))
        self.metrics.inc("lease_extensions")

    @property
    def pending(self) -> int:
        """Requests exposed and not yet released."""
        return len(self._exposed)

    def releases(self) -> MemoryObjectReceiveStream[Release]:
        """A stream of releases from now on (iterate with ``async for``)."""
        send, receive = anyio.create_memory_object_stream[Release](max_buffer_size=math.inf)
        if self.closed:
            send.close()
        else:
            self._streams.append(send)
        return receive

    async def wait_released(self) -> None:
        """Return once no request is pending."""
        while self._exposed:
            if self._idle is None or self._idle.is_set():
                self._idle = anyio.Event()
            await self._idle.wait()

    def _release(self, request_id: str, reason: ReleaseReason) -> None:
        exp = self._exposed.pop(request_id, None)
        if exp is None:
            return
        if not self._exposed and self._idle is not None:
            self._idle.set()
        expected = self.expected_notifications(exp.decode_tp) if exp.decode_tp else None
        release = Release(request_id, exp.block_ids, reason, len(exp.readers), expected)
        self.metrics.inc(f"released_{reason}")
        if reason != "read":
            self._log.info(
                "blocks released",
                request=request_id,
                reason=reason,
                notified=len(exp.readers),
                expected=expected,
            )
        if self.on_release is not None:
            try:
                self.on_release(release)
            except Exception:
                self._log.exception("on_release callback failed", request=request_id)
        for stream in self._streams:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                stream.send_nowait(release)

    # -- polling ------------------------------------------------------------------------

    def _accepts(self, engine_id: str, decode_rank: int, decode_tp: int) -> bool:
        """True if that decode rank handshook with this engine and notifies this rank."""
        if self._peers.get(engine_id) != decode_tp or not 0 <= decode_rank < decode_tp:
            return False
        key = (decode_rank, decode_tp)
        ok = self._notifiers.get(key)
        if ok is None:
            try:
                ranks = tp.notify_ranks(
                    decode_rank=decode_rank,
                    decode_tp=decode_tp,
                    prefill_tp=self.tp_size,
                    kv_heads=self.spec.kv_heads,
                    mla=self.spec.kind == "mla",
                )
            except ConfigError:
                ranks = ()
            ok = self._notifiers[key] = self.tp_rank in ranks
        return ok

    def _on_notice(self, notice: Notice) -> None:
        valid = self._accepts(notice.engine_id, notice.decode_rank, notice.decode_tp)
        if not valid:
            self.metrics.inc("notifications_invalid")
            self._log.warning(
                "notification from an unexpected decode rank ignored",
                peer=notice.engine_id,
                decode_rank=notice.decode_rank,
                decode_tp=notice.decode_tp,
            )
            return
        for rid in notice.request_ids:
            exp = self._exposed.get(rid)
            if exp is None:
                self.metrics.inc("notifications_unknown")
                self._log.debug("notification for an unknown request", request=rid, kind=notice.kind)
                continue
            if notice.kind == "extend":
                self.extend(rid)
                continue
            if exp.decode_tp is None:
                exp.decode_tp = notice.decode_tp
            exp.readers.add(notice.decode_rank)
            if len(exp.readers) >= self.expected_notifications(exp.decode_tp):
                self._release(rid, "read")

    def _drain(self) -> bool:
        notifs = self.backend.notifications()
        for messages in notifs.values():
            for raw in messages:
                self.metrics.inc("notifications_received")
                try:
                    notice = decode_notice(raw)
                except ProtocolError:
                    self.metrics.inc("notifications_invalid")
                    continue
                self._on_notice(notice)
        return bool(notifs)

    def _expire(self, now: float) -> float | None:
        while self._deadlines:
            deadline, rid = self._deadlines[0]
            exp = self._exposed.get(rid)
            if exp is None or exp.deadline != deadline:
                heapq.heappop(self._deadlines)  # released, or superseded by an extension
                continue
            if deadline > now:
                return deadline - now
            heapq.heappop(self._deadlines)
            self._release(rid, "expired")
        return None

    async def _poll(self) -> None:
        backoff = self._backoff or Backoff()
        while True:
            try:
                if self._drain():
                    backoff.progressed()
            except AkvError as exc:
                self._log.warning("draining notifications failed", error=str(exc))
            until = self._expire(time.monotonic())
            await backoff.wait(busy=bool(self._exposed), limit=until)
