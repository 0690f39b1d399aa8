"""The control plane's I/O: the handshake server of a prefill rank, the client of a decode rank.

The conversations themselves are the sans-IO state machines of `akv.protocol.handshake`;
this module only moves their frames over TCP, with limits and timeouts.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio
import msgspec
from anyio.abc import SocketStream, TaskStatus

from akv._log import get_logger
from akv.errors import AkvError, ConfigError, FrameError, HandshakeError
from akv.metrics import Metrics
from akv.protocol.address import Endpoint, is_loopback, parse_endpoint
from akv.protocol.handshake import (
    SECRET_ENV,
    ClientConversation,
    HandshakeResult,
    HostedRank,
    ServerConversation,
    raise_for_error,
    register_mac,
    resolve_secret,
)
from akv.protocol.messages import (
    DEFAULT_CLIENT_MAX_FRAME,
    DEFAULT_SERVER_MAX_FRAME,
    Challenge,
    Error,
    FrameBuffer,
    Hello,
    Message,
    Register,
    Registered,
    RequestInfo,
    decode_message,
    encode_frame,
)

__all__ = [
    "ControlServer",
    "Endpoint",
    "HandshakeResult",
    "client_handshake",
    "parse_endpoint",
    "register_rank",
    "resolve_secret",
]

log = get_logger("akv.control")


@dataclass(slots=True)
class _Conn:
    scope: anyio.CancelScope
    greeted: bool = False


class ControlServer:
    """The control endpoint of a prefill engine: serves handshakes for its ranks.

    The ranks of one engine in one process share one server (pass it as ``server=`` to each
    [`Producer`][akv.Producer]); start it with ``endpoint = await tg.start(server.serve)``.
    Binding an address other than loopback requires a secret unless ``allow_insecure``.

    Args:
        host: the address to bind (default loopback).
        port: the port to bind (0 picks a free one: see [`endpoint`][akv.ControlServer.endpoint]).
        secret: shared secret that decode engines must prove (default ``$AKV_SECRET``).
        allow_insecure: serve a non-loopback address without a secret (trusted networks only).
        max_connections: connections at once; at the cap, the oldest connection that has not
            sent a valid Hello is dropped (if every one has, the newcomer gets a ``busy`` error).
        read_timeout: seconds each read of a connection may take.
        max_frame: bytes a client frame may have.
        directory: returns the requests to announce to clients that ask (demos and tests).
        metrics: where to count handshakes (default: a new [`Metrics`][akv.Metrics]).
        advertise_host: the address other ranks and decode engines reach this server at
            (default ``host``; give it when binding ``0.0.0.0`` or ``::``).

    Raises:
        ConfigError: a non-loopback ``host`` without a secret or ``allow_insecure``.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | bytes | None = None,
        allow_insecure: bool = False,
        max_connections: int = 64,
        read_timeout: float = 5.0,
        max_frame: int = DEFAULT_SERVER_MAX_FRAME,
        directory: Callable[[], Sequence[RequestInfo]] | None = None,
        metrics: Metrics | None = None,
        advertise_host: str | None = None,
    ) -> None:
        self.secret = resolve_secret(secret)
        if not is_loopback(host) and self.secret is None and not allow_insecure:
            raise ConfigError(
                f"refusing to serve KV metadata on non-loopback address {host!r} without a secret: "
                f"set {SECRET_ENV} (or secret=...), or pass allow_insecure=True if the network is trusted"
            )
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self.max_frame = max_frame
        self.directory = directory
        self.metrics = metrics or Metrics()
        # What other ranks are told: give the reachable address when binding 0.0.0.0 or ::.
        self.advertise_host = advertise_host or host
        self.ranks: dict[int, HostedRank] = {}
        self.registered: dict[int, str] = {}  # as a bootstrap: rank -> control endpoint
        self._conns: dict[int, _Conn] = {}
        self._endpoint: Endpoint | None = None

    @property
    def active(self) -> int:
        """Connections being served now."""
        return len(self._conns)

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

    def register(self, msg: Register) -> str:
        """Accept a rank's registration (this server hosts rank 0); returns the engine id."""
        first = self.ranks.get(0)
        if first is None:
            raise ConfigError("this endpoint does not serve rank 0, so it is no engine's bootstrap")
        if msg.engine_id and msg.engine_id != first.engine_id:
            raise ConfigError(
                f"rank {msg.tp_rank} belongs to engine {msg.engine_id!r}, this bootstrap to {first.engine_id!r}"
            )
        if msg.tp_size != first.tp_size or not 0 < msg.tp_rank < first.tp_size:
            raise ConfigError(
                f"rank {msg.tp_rank} of TP size {msg.tp_size} does not fit this engine of TP size {first.tp_size}"
            )
        if msg.compat != first.cache.compat_hash():
            raise ConfigError(
                f"rank {msg.tp_rank} describes another KV cache than rank 0 (compat hash differs)"
            )
        parse_endpoint(msg.endpoint)
        if self.registered.get(msg.tp_rank) != msg.endpoint:
            log.info("rank registered", engine=first.engine_id, rank=msg.tp_rank, endpoint=msg.endpoint)
        self.registered[msg.tp_rank] = msg.endpoint
        return first.engine_id

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

    async def _handle(self, stream: SocketStream) -> None:
        async with stream:
            if len(self._conns) >= self.max_connections:
                # Make room by dropping the oldest connection that never sent a valid Hello, so
                # idle or garbage connections cannot lock real handshakes out.
                victim = next((c for c in self._conns.values() if not c.greeted), None)
                if victim is None:
                    self.metrics.inc("connections_refused")
                    with anyio.move_on_after(1):
                        await stream.send(encode_frame(Error(code="busy", message="too many connections")))
                    return
                victim.scope.cancel()
                del self._conns[id(victim)]
                self.metrics.inc("connections_evicted")
            conn = _Conn(anyio.CancelScope())
            self._conns[id(conn)] = conn
            try:
                with conn.scope:
                    await self._converse(stream, conn)
            except (anyio.BrokenResourceError, anyio.EndOfStream, anyio.ClosedResourceError, OSError):
                pass
            except AkvError as exc:  # never let one connection take the listener down
                log.warning("control connection failed", error=str(exc))
            finally:
                self._conns.pop(id(conn), None)

    async def _converse(self, stream: SocketStream, conn: _Conn) -> None:
        conv = ServerConversation(
            self.ranks,
            self.secret,
            self.directory,
            self.metrics,
            endpoints=self.rank_endpoints,
            register=self.register,
        )
        frames = FrameBuffer(self.max_frame)
        while True:
            msgs: list[Message | AkvError] = []
            with anyio.move_on_after(self.read_timeout) as scope:
                try:
                    data = await stream.receive(65536)
                except anyio.EndOfStream:
                    return
            if scope.cancelled_caught:
                self.metrics.inc("connections_timed_out")
                return
            try:
                bodies = frames.feed(data)
            except FrameError as exc:
                msgs.append(exc)
                bodies = []
            for body in bodies:
                try:
                    msgs.append(decode_message(body))
                except AkvError as exc:
                    msgs.append(exc)
            for msg in msgs:
                replies, done = conv.receive(msg)
                conn.greeted = conv.state not in ("hello", "closed")
                for reply in replies:
                    with anyio.fail_after(self.read_timeout):
                        await stream.send(encode_frame(reply))
                if done:
                    if isinstance(msg, AkvError):
                        log.info("control connection rejected", reason=str(msg))
                    return


class _Client:
    """Frames in and out of one client connection."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.frames = FrameBuffer(DEFAULT_CLIENT_MAX_FRAME)
        self.pending: list[bytes] = []

    async def send(self, msg: Message) -> None:
        await self.stream.send(encode_frame(msg))

    async def receive(self) -> Message:
        while not self.pending:
            try:
                data = await self.stream.receive(1 << 20)
            except anyio.EndOfStream:
                raise HandshakeError("the remote engine closed the connection mid-handshake") from None
            self.pending.extend(self.frames.feed(data))
        return decode_message(self.pending.pop(0))


async def _converse_client(client: _Client, conv: ClientConversation) -> HandshakeResult:
    out: Message | None = conv.start()
    while out is not None:
        await client.send(out)
        out = conv.receive(await client.receive())
    if conv.result is None:  # pragma: no cover - the conversation sets it when done
        raise HandshakeError("handshake ended without a result")
    return conv.result


async def client_handshake(
    endpoint: Endpoint,
    hello: Hello,
    *,
    secret: bytes | None,
    choose_ranks: Callable[[Challenge], Sequence[int]],
    connect_timeout: float = 5.0,
    handshake_timeout: float = 10.0,
    retries: int = 3,
    backoff: float = 0.2,
    list_requests: bool = False,
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
) -> HandshakeResult:
    """Run the client side against one endpoint, retrying unreachable endpoints with backoff.

    Raises [`HandshakeError`][akv.errors.HandshakeError] (or a subclass) naming the endpoint; refusals by the
    server (incompatible, auth) are not retried.
    """
    last: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            await sleep(backoff * math.pow(2, attempt - 1))
        try:
            with anyio.fail_after(connect_timeout):
                stream = await anyio.connect_tcp(endpoint.host, endpoint.port)
        except (OSError, TimeoutError) as exc:
            last = exc
            continue
        async with stream:
            try:
                conv = ClientConversation(hello, secret, choose_ranks, list_requests=list_requests)
                with anyio.fail_after(handshake_timeout):
                    return await _converse_client(_Client(stream), conv)
            except TimeoutError:
                raise HandshakeError(
                    f"handshake with {endpoint} timed out after {handshake_timeout}s (hung peer?)"
                ) from None
            except (anyio.BrokenResourceError, OSError) as exc:
                last = exc
                continue
            except FrameError as exc:
                raise HandshakeError(f"bad reply from {endpoint}: {exc}") from None
    raise HandshakeError(f"cannot reach {endpoint} after {retries + 1} attempts: {last}")


async def register_rank(
    bootstrap: Endpoint,
    msg: Register,
    *,
    secret: bytes | None,
    timeout: float = 5.0,  # noqa: ASYNC109 (one deadline for connect, send and reply)
) -> str:
    """Register a rank's endpoint with its engine's bootstrap; returns the engine id.

    Raises :class:`HandshakeError` if the bootstrap cannot be reached or refuses.
    """
    if secret is not None:
        msg = msgspec.structs.replace(msg, mac=register_mac(secret, msg))
    try:
        with anyio.fail_after(timeout):
            async with await anyio.connect_tcp(bootstrap.host, bootstrap.port) as stream:
                client = _Client(stream)
                await client.send(msg)
                reply = await client.receive()
    except (OSError, TimeoutError, anyio.BrokenResourceError) as exc:
        raise HandshakeError(f"cannot register with the bootstrap at {bootstrap}: {exc}") from None
    if isinstance(reply, Error):
        raise_for_error(reply)
    if not isinstance(reply, Registered):
        raise HandshakeError(f"the bootstrap at {bootstrap} answered {type(reply).__name__}, not Registered")
    return reply.engine_id
