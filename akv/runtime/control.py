"""The control plane's server side: a prefill rank's handshake server (and, on rank 0, its
engine's bootstrap, where the other ranks register).

The conversations themselves are the sans-IO state machines of `akv.protocol.handshake`;
this module only moves their frames over TCP, with limits and timeouts. The client side (a
decode rank's handshakes and watches, a rank's registration) is `akv.runtime.client`.
"""

from __future__ import annotations

import secrets as _secrets
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import ByteStream, SocketStream, TaskStatus

from akv._log import get_logger
from akv.errors import (
    AkvError,
    AuthenticationError,
    ConfigError,
    FrameError,
    IncompatiblePeerError,
)
from akv.metrics import Metrics
from akv.protocol.address import Endpoint, is_loopback, parse_endpoint
from akv.protocol.handshake import (
    SECRET_ENV,
    HostedRank,
    ServerConversation,
    resolve_secret,
)
from akv.protocol.messages import (
    DEFAULT_SERVER_MAX_FRAME,
    Error,
    FrameBuffer,
    Message,
    Register,
    Registered,
    RequestInfo,
    decode_message,
    encode_frame,
)
from akv.tls import TLSConfig, server_wrap

__all__ = ["WATCH_IDLE_S", "ControlServer", "Endpoint", "parse_endpoint", "resolve_secret"]

log = get_logger("akv.control")

#: Seconds a watch (`watch`) may stay silent before the server ends it (saying so): its
#: decode rank sends a keep-alive every `WATCH_EVERY_S`, unless its event loop stalls.
WATCH_IDLE_S = 30.0


@dataclass(slots=True)
class _Conn:
    scope: anyio.CancelScope
    source: str
    started: float = field(default_factory=time.monotonic)
    authenticated: bool = False  # only then is it protected from eviction
    watching: bool = False  # kept open by its client as a watch of this process (KeepAlive)


class ControlServer:
    """The control endpoint of a prefill engine: serves handshakes for its ranks.

    The ranks of one engine in one process share one server (pass it as ``server=`` to each
    [`Producer`][akv.Producer]); start it with ``endpoint = await tg.start(server.serve)``.
    Binding an address other than loopback requires a secret unless ``allow_insecure``.

    Connections that have not authenticated yet (not received their metadata) get nothing
    for free: one deadline for the whole handshake, a cap per source address and a cap in
    all; at a cap the oldest unauthenticated connection (of that source, else of any) is
    dropped for the newcomer. Authenticated connections are never dropped for a newcomer.

    Args:
        host: the address to bind (default loopback).
        port: the port to bind (0 picks a free one: see [`endpoint`][akv.ControlServer.endpoint]).
        secret: shared secret that decode engines must prove (default ``$AKV_SECRET``; an
            empty one is a `ConfigError`).
        allow_insecure: serve a non-loopback address without a secret (trusted networks only).
        max_connections: connections at once, authenticated or not; when every one is
            authenticated the newcomer gets a ``busy`` error.
        max_unauthenticated: connections at once that have not authenticated.
        max_unauthenticated_per_source: of those, from one source address.
        handshake_timeout: seconds a connection has from accept to authentication, however
            slowly it trickles its bytes.
        read_timeout: seconds each read may take (after authentication, and within the deadline).
        max_frame: bytes a client frame may have.
        max_watches: authenticated connections their decode ranks keep open as watches of
            this process (`watch`); they do not count against ``max_connections``. A watch
            past the cap is answered ``busy`` and closed (that decode rank then learns of
            this process's death only from NIXL, or from its deadlines).
        directory: returns the requests to announce to clients that ask (demos and tests).
        metrics: where to count handshakes (default: a new [`Metrics`][akv.Metrics]).
        advertise_host: the address other ranks and decode engines reach this server at
            (default ``host``; give it when binding ``0.0.0.0`` or ``::``).
        tls: serve over TLS with this certificate and key (and, with a CA, require client
            certificates it signed); see [`TLSConfig`][akv.TLSConfig]. The TLS handshake
            counts against the handshake deadline and the unauthenticated caps.

    Raises:
        ConfigError: a non-loopback ``host`` without a secret or ``allow_insecure``; an empty secret.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | bytes | None = None,
        allow_insecure: bool = False,
        max_connections: int = 64,
        max_unauthenticated: int = 32,
        max_unauthenticated_per_source: int = 8,
        handshake_timeout: float = 5.0,
        read_timeout: float = 5.0,
        max_frame: int = DEFAULT_SERVER_MAX_FRAME,
        max_watches: int = 4096,
        directory: Callable[[], Sequence[RequestInfo]] | None = None,
        metrics: Metrics | None = None,
        advertise_host: str | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.secret = resolve_secret(secret)
        self.tls = tls
        self._tls_context: ssl.SSLContext | None = tls.server_context() if tls is not None else None
        if not is_loopback(host) and self.secret is None and not allow_insecure:
            raise ConfigError(
                f"refusing to serve KV metadata on non-loopback address {host!r} without a secret: "
                f"set {SECRET_ENV} (or secret=...), or pass allow_insecure=True if the network is trusted"
            )
        if min(max_connections, max_unauthenticated, max_unauthenticated_per_source) < 1:
            raise ConfigError("connection caps must be >= 1")
        if not handshake_timeout > 0 or not read_timeout > 0:
            raise ConfigError("handshake_timeout and read_timeout must be > 0")
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.max_unauthenticated = min(max_unauthenticated, max_connections)
        self.max_unauthenticated_per_source = max_unauthenticated_per_source
        self.handshake_timeout = handshake_timeout
        self.read_timeout = read_timeout
        self.max_frame = max_frame
        self.max_watches = max_watches
        self.directory = directory
        self.metrics = metrics or Metrics()
        # What other ranks are told: give the reachable address when binding 0.0.0.0 or ::.
        self.advertise_host = advertise_host or host
        self.ranks: dict[int, HostedRank] = {}
        self.registered: dict[int, str] = {}  # as a bootstrap: rank -> control endpoint
        #: This engine's incarnation as rank 0 tells it (random per server); ranks > 0 learn
        #: their bootstrap's through registration (`learned_instance`).
        self.own_instance = _secrets.token_hex(8)
        self.learned_instance = ""
        self._conns: dict[int, _Conn] = {}
        self._endpoint: Endpoint | None = None

    @property
    def active(self) -> int:
        """Connections being served now."""
        return len(self._conns)

    @property
    def watches(self) -> int:
        """Connections kept open as watches of this process."""
        return sum(c.watching for c in self._conns.values())

    @property
    def unauthenticated(self) -> int:
        """Connections that have not authenticated yet."""
        return sum(not c.authenticated for c in self._conns.values())

    def instance_id(self) -> str:
        """The engine incarnation this server reports: its own while it hosts rank 0, else the
        one learned from the bootstrap, else "" (unknown)."""
        return self.own_instance if 0 in self.ranks else self.learned_instance

    def add(self, rank: HostedRank) -> None:
        """Host a prefill rank; all ranks of one server belong to one engine."""
        for other in self.ranks.values():
            if (other.engine_id, other.tp_size, other.cache) != (rank.engine_id, rank.tp_size, rank.cache):
                raise ConfigError("all ranks of one control server must share engine_id, tp_size and spec")
        if rank.tp_rank in self.ranks:
            raise ConfigError(f"prefill rank {rank.tp_rank} is already served here")
        self.ranks[rank.tp_rank] = rank

    def remove(self, rank: HostedRank) -> None:
        """Stop hosting a rank."""
        if self.ranks.get(rank.tp_rank) is rank:
            del self.ranks[rank.tp_rank]

    @property
    def endpoint(self) -> Endpoint:
        """The address this server is reached at (valid once serving)."""
        if self._endpoint is None:
            raise ConfigError("the control server is not listening yet")
        return self._endpoint

    def rank_endpoints(self) -> list[str]:
        """Every rank's control endpoint in rank order ("" where unknown): hosted ranks, and
        ranks registered with this server as their engine's bootstrap."""
        if not self.ranks:
            return []
        size = next(iter(self.ranks.values())).tp_size
        out = [self.registered.get(r, "") for r in range(size)]
        if self._endpoint is not None:
            for r in self.ranks:
                out[r] = str(self._endpoint)
        return out

    def register(self, msg: Register) -> Registered:
        """Accept a rank's registration (this server hosts rank 0).

        Raises [`IncompatiblePeerError`][akv.errors.IncompatiblePeerError] naming the field
        where the rank's geometry (TP size, layout, block size, groups, dtype...) differs from
        rank 0's, and `ConfigError` for another engine or a rank outside the TP size.
        """
        first = self.ranks.get(0)
        if first is None:
            raise ConfigError("this endpoint does not serve rank 0, so it is no engine's bootstrap")
        if msg.engine_id and msg.engine_id != first.engine_id:
            raise ConfigError(
                f"rank {msg.tp_rank} belongs to engine {msg.engine_id!r}, this bootstrap to {first.engine_id!r}"
            )
        if msg.tp_size != first.tp_size:
            raise IncompatiblePeerError(
                f"rank {msg.tp_rank} has tp_size {msg.tp_size}, this engine's rank 0 {first.tp_size}",
                ("tp_size",),
            )
        if not 0 < msg.tp_rank < first.tp_size:
            raise ConfigError(f"rank {msg.tp_rank} is not a rank > 0 of an engine of TP size {first.tp_size}")
        if msg.spec is None:
            raise IncompatiblePeerError(
                f"rank {msg.tp_rank} did not describe its cache: run the same akv release on every rank",
                ("spec",),
            )
        if msg.spec != first.cache:
            diffs = _geometry_differences(first.cache, msg.spec)
            raise IncompatiblePeerError(
                f"rank {msg.tp_rank}'s KV cache differs from rank 0's: "
                + "; ".join(f"{f}: rank 0={a} rank {msg.tp_rank}={b}" for f, a, b in diffs),
                tuple(f for f, _, _ in diffs),
            )
        if msg.compat != first.cache.compat_hash():
            raise IncompatiblePeerError(
                f"rank {msg.tp_rank} describes another KV cache than rank 0 (compat hash differs)",
                ("compat",),
            )
        parse_endpoint(msg.endpoint)
        if self.registered.get(msg.tp_rank) != msg.endpoint:
            log.info("rank registered", engine=first.engine_id, rank=msg.tp_rank, endpoint=msg.endpoint)
        self.registered[msg.tp_rank] = msg.endpoint
        return Registered(engine_id=first.engine_id, instance_id=self.own_instance)

    async def serve(self, *, task_status: TaskStatus[Endpoint] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; reports the bound endpoint via ``task_status``.

        Raises ``OSError`` if the address cannot be bound (port in use, not an address of this machine).
        """
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        from anyio.abc import SocketAttribute

        port = listener.extra(SocketAttribute.local_port)
        self._endpoint = Endpoint(self.advertise_host, port)
        log.info("control server listening", endpoint=str(self._endpoint), auth=self.secret is not None)
        async with listener:
            task_status.started(self._endpoint)
            await listener.serve(self._handle)

    def _admit(self, source: str) -> bool:
        """Make room for a new unauthenticated connection from ``source``; False if there is none."""
        pending = [c for c in self._conns.values() if not c.authenticated]  # oldest first
        mine = [c for c in pending if c.source == source]
        served = len(self._conns) - self.watches  # watches hold no handshake slot
        victim = None
        if len(mine) >= self.max_unauthenticated_per_source:
            victim = mine[0]
        elif len(pending) >= self.max_unauthenticated or served >= self.max_connections:
            victim = pending[0] if pending else None
            if victim is None:
                return False
        if victim is not None:
            victim.scope.cancel()
            del self._conns[id(victim)]
            self.metrics.inc("connections_evicted")
        return True

    async def _handle(self, stream: SocketStream) -> None:
        from anyio.abc import SocketAttribute

        async with stream:
            try:
                source = str(stream.extra(SocketAttribute.remote_address)[0])
            except (IndexError, TypeError, anyio.TypedAttributeLookupError):
                source = "?"
            if not self._admit(source):
                self.metrics.inc("connections_refused")
                with anyio.move_on_after(1):
                    await stream.send(encode_frame(Error(code="busy", message="too many connections")))
                return
            conn = _Conn(anyio.CancelScope(), source)
            self._conns[id(conn)] = conn
            try:
                with conn.scope:
                    await self._converse(await self._secure(stream, conn), conn)
            except (anyio.BrokenResourceError, anyio.EndOfStream, anyio.ClosedResourceError, OSError):
                pass
            except AuthenticationError as exc:
                self.metrics.inc("auth_failures")
                log.info("control connection refused", reason=str(exc), source=source)
            except AkvError as exc:  # never let one connection take the listener down
                log.warning("control connection failed", error=str(exc))
            finally:
                self._conns.pop(id(conn), None)

    async def _secure(self, stream: SocketStream, conn: _Conn) -> ByteStream:
        """The connection as the conversation uses it: TLS-wrapped within the handshake
        deadline when the server serves TLS."""
        if self._tls_context is None:
            return stream
        with anyio.fail_after(max(conn.started + self.handshake_timeout - time.monotonic(), 0.001)):
            return await server_wrap(stream, self._tls_context)

    async def _converse(self, stream: ByteStream, conn: _Conn) -> None:
        conv = ServerConversation(
            self.ranks,
            self.secret,
            self.directory,
            self.metrics,
            endpoints=self.rank_endpoints,
            register=self.register,
            instance_id=self.instance_id,
        )
        frames = FrameBuffer(self.max_frame)
        deadline = conn.started + self.handshake_timeout
        while True:
            msgs: list[tuple[Message | AkvError, bytes | None]] = []
            limit = self.read_timeout
            if conn.watching:  # a decode rank whose loop stalls a while is no reason to end it
                limit = max(limit, WATCH_IDLE_S)
            elif not conn.authenticated:  # one deadline for the whole handshake, not per read
                limit = min(limit, deadline - time.monotonic())
            with anyio.move_on_after(max(limit, 0)) as scope:
                try:
                    data = await stream.receive(65536)
                except anyio.EndOfStream:
                    return
            if scope.cancelled_caught:
                self.metrics.inc("connections_timed_out")
                if conn.watching:  # said, so that the decode rank does not take this process for dead
                    with anyio.move_on_after(1):
                        await stream.send(encode_frame(Error(code="busy", message="the watch was idle")))
                return
            try:
                bodies = frames.feed(data)
            except FrameError as exc:
                msgs.append((exc, None))
                bodies = []
            for body in bodies:
                try:
                    msgs.append((decode_message(body), body))
                except AkvError as exc:
                    msgs.append((exc, None))
            for msg, raw in msgs:
                replies, done = conv.receive(msg, raw)
                conn.authenticated = conv.authenticated
                if conv.watching and not conn.watching:
                    conn.watching = True
                    if self.watches > self.max_watches:
                        conn.watching = False
                        self.metrics.inc("watches_refused")
                        with anyio.move_on_after(1):
                            await stream.send(encode_frame(Error(code="busy", message="too many watches")))
                        return
                for reply in replies:
                    with anyio.fail_after(self.read_timeout):
                        await stream.send(encode_frame(reply))
                if done:
                    if isinstance(msg, AkvError):
                        log.info("control connection rejected", reason=str(msg))
                    return


def _geometry_differences(ours: Any, theirs: Any) -> list[tuple[str, str, str]]:
    """``(field, ours, theirs)`` for each group field where two caches differ."""
    out: list[tuple[str, str, str]] = []
    if [g.name for g in ours.groups] != [g.name for g in theirs.groups]:
        return [("groups", str([g.name for g in ours.groups]), str([g.name for g in theirs.groups]))]
    for a, b in zip(ours.groups, theirs.groups, strict=True):
        for name in a.__struct_fields__:
            x, y = getattr(a, name), getattr(b, name)
            if x != y:
                out.append((f"{a.name}.{name}", str(x), str(y)))
    return out or [("spec", "?", "?")]
