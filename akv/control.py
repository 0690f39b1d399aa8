"""The handshake control plane: a server on the prefill side, a client on the decode side.

The conversation (see :class:`ServerConversation`, sans-IO) is::

    D -> P  Hello(engine_id, tp_rank, tp_size, spec, compat, nonce_d)
    P -> D  Challenge(engine_id, tp_size, spec, ranks, nonce_p, auth)   | Error
    D -> P  MetadataRequest(ranks, mac_d)                               (| ListRequests later)
    P -> D  Metadata(ranks..., mac_p)                                   | Error

With a shared secret, ``mac_d = HMAC(secret, "akv-client" | nonce_p | nonce_d | engine_id)``
and ``mac_p = HMAC(secret, "akv-server" | nonce_d | nonce_p)``; both are compared in
constant time. Without a valid ``mac_d`` the client never sees agent metadata, which grants
read access to the registered KV memory.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import os
import secrets as _secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from hashlib import sha256
from typing import Any, Protocol

import anyio
from anyio.abc import SocketStream, TaskStatus

from akv import tp
from akv._log import get_logger
from akv.errors import (
    AkvError,
    AuthenticationError,
    ConfigError,
    FrameError,
    HandshakeError,
    IncompatiblePeerError,
    ProtocolError,
)
from akv.metrics import Metrics
from akv.spec import KVSpec
from akv.wire import (
    DEFAULT_CLIENT_MAX_FRAME,
    DEFAULT_SERVER_MAX_FRAME,
    Challenge,
    Error,
    FrameBuffer,
    Hello,
    ListRequests,
    Message,
    Metadata,
    MetadataRequest,
    RankInfo,
    RequestInfo,
    Requests,
    decode_message,
    encode_frame,
)

__all__ = [
    "ControlServer",
    "Endpoint",
    "HandshakeResult",
    "HostedRank",
    "ServerConversation",
    "client_handshake",
    "parse_endpoint",
    "resolve_secret",
]

log = get_logger("akv.control")

SECRET_ENV = "AKV_SECRET"


def resolve_secret(secret: str | bytes | None) -> bytes | None:
    """The secret to use: the argument, else ``$AKV_SECRET``, else None (no authentication)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), sha256).digest()


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A control-plane address."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(value: str | Endpoint | tuple[str, int]) -> Endpoint:
    """Parse ``"host:port"`` (``"[v6]:port"`` for IPv6); :class:`ConfigError` if malformed."""
    if isinstance(value, Endpoint):
        return value
    if isinstance(value, tuple):
        return Endpoint(str(value[0]), int(value[1]))
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"endpoint {value!r} is not HOST:PORT")
    return Endpoint(host.strip("[]"), int(port))


def is_loopback(host: str) -> bool:
    """True for loopback addresses and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HostedRank(Protocol):
    """What a prefill rank offers to the control server (implemented by Producer)."""

    engine_id: str
    spec: KVSpec
    tp_rank: int
    tp_size: int
    lease_s: float

    def rank_info(self) -> RankInfo: ...

    def peer_connected(self, engine_id: str, decode_rank: int, decode_tp: int) -> None: ...


class ServerConversation:
    """The server side of one connection's handshake, as a sans-IO state machine.

    :meth:`receive` takes one decoded message (or the :class:`AkvError` decoding raised) and
    returns ``(replies, done)``; after ``done`` the connection is closed.
    """

    def __init__(
        self,
        ranks: dict[int, HostedRank],
        secret: bytes | None,
        directory: Callable[[], Sequence[RequestInfo]] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.ranks = ranks
        self.secret = secret
        self.directory = directory
        self.metrics = metrics or Metrics()
        self.state = "hello"
        self.nonce = _secrets.token_bytes(16)
        self.hello: Hello | None = None

    def _fail(self, code: Any, message: str, fields: Sequence[str] = ()) -> tuple[list[Message], bool]:
        self.metrics.inc("handshakes_failed")
        self.state = "closed"
        return [Error(code=code, message=message, fields=list(fields))], True

    def receive(self, msg: Message | AkvError) -> tuple[list[Message], bool]:
        """Advance the conversation by one incoming message."""
        if self.state == "closed":
            return [], True
        if isinstance(msg, ProtocolError) and not isinstance(msg, FrameError):
            return self._fail("version", str(msg))
        if isinstance(msg, AkvError):
            return self._fail("protocol", str(msg))
        if self.state == "hello":
            return self._on_hello(msg)
        if isinstance(msg, MetadataRequest):
            return self._on_metadata_request(msg)
        if isinstance(msg, ListRequests) and self.state == "authed":
            items = list(self.directory()) if self.directory else []
            return [Requests(items=items)], False
        return self._fail("protocol", f"unexpected {type(msg).__name__} in state {self.state}")

    def _on_hello(self, msg: Message) -> tuple[list[Message], bool]:
        if not isinstance(msg, Hello):
            return self._fail("protocol", f"expected Hello, got {type(msg).__name__}")
        if not self.ranks:
            return self._fail("config", "this server hosts no prefill ranks yet")
        first = next(iter(self.ranks.values()))
        try:
            tp.check_tp(msg.tp_rank, msg.tp_size)
        except ConfigError as exc:
            return self._fail("config", f"decode rank: {exc}")
        differ = first.spec.diff(msg.spec)
        if differ or msg.compat != first.spec.compat_hash():
            detail = ", ".join(
                f"{f}: prefill={getattr(first.spec, f)!r} decode={getattr(msg.spec, f)!r}" for f in differ
            )
            return self._fail("incompatible", f"KV cache shapes differ ({detail or 'compat hash'})", differ)
        if first.spec.kind == "dense":
            try:
                tp.check_heads(msg.tp_size, first.spec.kv_heads)
            except ConfigError as exc:
                return self._fail("config", f"decode TP: {exc}")
        self.hello = msg
        self.state = "challenged"
        return [
            Challenge(
                engine_id=first.engine_id,
                tp_size=first.tp_size,
                spec=first.spec,
                ranks=sorted(self.ranks),
                nonce=self.nonce,
                auth=self.secret is not None,
                lease_s=first.lease_s,
            )
        ], False

    def _on_metadata_request(self, msg: MetadataRequest) -> tuple[list[Message], bool]:
        hello = self.hello
        if hello is None:
            return self._fail("protocol", "MetadataRequest before Hello")
        mac = b""
        if self.secret is not None:
            want = _mac(self.secret, b"akv-client", self.nonce, hello.nonce, hello.engine_id.encode())
            if not hmac.compare_digest(want, msg.mac):
                self.metrics.inc("auth_failures")
                return self._fail("auth", "authentication failed: wrong or missing shared secret")
            mac = _mac(self.secret, b"akv-server", hello.nonce, self.nonce)
        unknown = sorted(set(msg.ranks) - set(self.ranks))
        if unknown:
            return self._fail("unknown_rank", f"prefill ranks {unknown} are not served here")
        infos = []
        try:
            for rank in sorted(set(msg.ranks)):
                hosted = self.ranks[rank]
                hosted.peer_connected(hello.engine_id, hello.tp_rank, hello.tp_size)
                infos.append(hosted.rank_info())
        except AkvError as exc:  # e.g. a rank shutting down: fail this handshake, keep serving
            return self._fail("config", f"prefill rank unavailable: {exc}")
        self.state = "authed"
        self.metrics.inc("handshakes_served")
        return [Metadata(ranks=infos, mac=mac)], False


@dataclass(slots=True)
class _Conn:
    scope: anyio.CancelScope
    greeted: bool = False


class ControlServer:
    """Serves handshakes for the prefill ranks added to it.

    Binds ``127.0.0.1`` by default; binding any other address requires a secret unless
    ``allow_insecure`` is set. Limits: ``max_connections`` at once (at the cap, the oldest
    connection that has not sent a valid Hello is dropped; if every one has, the newcomer
    gets a ``busy`` error), ``read_timeout`` per read and ``max_frame`` bytes per client frame.
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
        self.ranks: dict[int, HostedRank] = {}
        self._conns: dict[int, _Conn] = {}
        self._endpoint: Endpoint | None = None

    @property
    def active(self) -> int:
        """Connections being served now."""
        return len(self._conns)

    def add(self, rank: HostedRank) -> None:
        """Host a prefill rank; all ranks of one server belong to one engine."""
        for other in self.ranks.values():
            if (other.engine_id, other.tp_size, other.spec) != (rank.engine_id, rank.tp_size, rank.spec):
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
        """The bound address (valid once serving)."""
        if self._endpoint is None:
            raise ConfigError("the control server is not listening yet")
        return self._endpoint

    async def serve(self, *, task_status: TaskStatus[Endpoint] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; reports the bound endpoint via ``task_status``."""
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        from anyio.abc import SocketAttribute

        port = listener.extra(SocketAttribute.local_port)
        self._endpoint = Endpoint(self.host, port)
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
        conv = ServerConversation(self.ranks, self.secret, self.directory, self.metrics)
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


@dataclass(frozen=True, slots=True)
class HandshakeResult:
    """What a decode rank learned from one prefill engine."""

    challenge: Challenge
    ranks: dict[int, RankInfo]
    requests: list[RequestInfo] | None = None


def _raise_error(err: Error) -> None:
    if err.code == "incompatible":
        raise IncompatiblePeerError(f"remote engine refused the handshake: {err.message}", tuple(err.fields))
    if err.code == "auth":
        raise AuthenticationError(f"remote engine refused the handshake: {err.message}")
    if err.code == "version":
        raise IncompatiblePeerError(f"remote engine refused the handshake: {err.message}", ("version",))
    raise HandshakeError(f"remote engine refused the handshake ({err.code}): {err.message}")


class _Client:
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
        msg = decode_message(self.pending.pop(0))
        if isinstance(msg, Error):
            _raise_error(msg)
        return msg


async def _converse_client(
    client: _Client,
    hello: Hello,
    secret: bytes | None,
    choose_ranks: Callable[[Challenge], Sequence[int]],
    list_requests: bool,
) -> HandshakeResult:
    await client.send(hello)
    challenge = await client.receive()
    if not isinstance(challenge, Challenge):
        raise ProtocolError(f"expected Challenge, got {type(challenge).__name__}")
    if challenge.auth and secret is None:
        raise AuthenticationError(
            f"remote engine {challenge.engine_id} requires a shared secret: set {SECRET_ENV} or pass secret="
        )
    mac = b""
    if secret is not None:
        mac = _mac(secret, b"akv-client", challenge.nonce, hello.nonce, hello.engine_id.encode())
    ranks = list(choose_ranks(challenge))
    await client.send(MetadataRequest(ranks=ranks, mac=mac))
    meta = await client.receive()
    if not isinstance(meta, Metadata):
        raise ProtocolError(f"expected Metadata, got {type(meta).__name__}")
    if secret is not None:
        want = _mac(secret, b"akv-server", hello.nonce, challenge.nonce)
        if not challenge.auth or not hmac.compare_digest(want, meta.mac):
            raise AuthenticationError("the remote engine could not prove it knows the shared secret")
    got = {info.tp_rank: info for info in meta.ranks}
    if set(got) != set(ranks):
        raise ProtocolError(f"asked for prefill ranks {sorted(ranks)}, got {sorted(got)}")
    requests = None
    if list_requests:
        await client.send(ListRequests())
        reply = await client.receive()
        if not isinstance(reply, Requests):
            raise ProtocolError(f"expected Requests, got {type(reply).__name__}")
        requests = reply.items
    return HandshakeResult(challenge, got, requests)


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

    Raises :class:`HandshakeError` (or a subclass) naming the endpoint; refusals by the
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
                with anyio.fail_after(handshake_timeout):
                    return await _converse_client(_Client(stream), hello, secret, choose_ranks, list_requests)
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
