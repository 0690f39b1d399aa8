"""The handshake, as two sans-IO state machines (no sockets here).

The conversation::

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
import os
import secrets as _secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import sha256
from typing import Any, Protocol

from akv import sharding
from akv.errors import (
    AkvError,
    AuthenticationError,
    ConfigError,
    HandshakeError,
    IncompatiblePeerError,
    ProtocolError,
    VersionMismatchError,
)
from akv.geometry.cache import CacheSpec, check_peer
from akv.metrics import Metrics
from akv.protocol.messages import (
    Challenge,
    Error,
    Hello,
    ListRequests,
    Message,
    Metadata,
    MetadataRequest,
    RankInfo,
    Register,
    Registered,
    RequestInfo,
    Requests,
)

__all__ = [
    "SECRET_ENV",
    "ClientConversation",
    "HandshakeResult",
    "HostedRank",
    "ServerConversation",
    "mac",
    "register_mac",
    "resolve_secret",
]

SECRET_ENV = "AKV_SECRET"


def resolve_secret(secret: str | bytes | None) -> bytes | None:
    """The secret to use: the argument, else ``$AKV_SECRET``, else None (no authentication)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def mac(secret: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over the parts joined by ``|``."""
    return hmac.new(secret, b"|".join(parts), sha256).digest()


class HostedRank(Protocol):
    """What a prefill rank offers to the control server (implemented by Producer)."""

    engine_id: str
    cache: CacheSpec
    tp_rank: int
    tp_size: int
    lease_s: float

    def rank_info(self) -> RankInfo: ...

    def peer_connected(self, engine_id: str, decode_rank: int, decode_tp: int, agent_name: str) -> None: ...


def register_mac(secret: bytes, msg: Register) -> bytes:
    """The MAC a rank's registration with its bootstrap carries."""
    return mac(
        secret,
        b"akv-register",
        msg.engine_id.encode(),
        str(msg.tp_rank).encode(),
        str(msg.tp_size).encode(),
        msg.endpoint.encode(),
        msg.compat.encode(),
    )


class ServerConversation:
    """The server side of one connection's handshake.

    `receive` takes one decoded message (or the [`AkvError`][akv.errors.AkvError] decoding raised) and
    returns ``(replies, done)``; after ``done`` the connection is closed.
    """

    def __init__(
        self,
        ranks: dict[int, HostedRank],
        secret: bytes | None,
        directory: Callable[[], Sequence[RequestInfo]] | None = None,
        metrics: Metrics | None = None,
        endpoints: Callable[[], list[str]] | None = None,
        register: Callable[[Register], str] | None = None,
    ) -> None:
        self.ranks = ranks
        self.secret = secret
        self.directory = directory
        self.metrics = metrics or Metrics()
        self.endpoints = endpoints
        self.register = register
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
        if isinstance(msg, VersionMismatchError):
            return self._fail("version", str(msg))
        if isinstance(msg, AkvError):
            return self._fail("protocol", str(msg))
        if self.state == "hello" and isinstance(msg, Register):
            return self._on_register(msg)
        if self.state == "hello":
            return self._on_hello(msg)
        if isinstance(msg, MetadataRequest):
            return self._on_metadata_request(msg)
        if isinstance(msg, ListRequests) and self.state == "authed":
            items = list(self.directory()) if self.directory else []
            return [Requests(items=items)], False
        return self._fail("protocol", f"unexpected {type(msg).__name__} in state {self.state}")

    def _on_register(self, msg: Register) -> tuple[list[Message], bool]:
        if self.register is None:
            return self._fail("register", "this endpoint is not an engine's bootstrap (rank 0)")
        if self.secret is not None and not hmac.compare_digest(register_mac(self.secret, msg), msg.mac):
            self.metrics.inc("auth_failures")
            return self._fail("auth", "registration refused: wrong or missing shared secret")
        try:
            engine_id = self.register(msg)
        except ConfigError as exc:
            return self._fail("register", str(exc))
        self.state = "closed"
        return [Registered(engine_id=engine_id)], True

    def _on_hello(self, msg: Message) -> tuple[list[Message], bool]:
        if not isinstance(msg, Hello):
            return self._fail("protocol", f"expected Hello, got {type(msg).__name__}")
        if not self.ranks:
            return self._fail("config", "this server hosts no prefill ranks yet")
        first = next(iter(self.ranks.values()))
        try:
            sharding.check_tp(msg.tp_rank, msg.tp_size)
            msg.spec.validate()
        except ConfigError as exc:
            return self._fail("config", f"decode rank: {exc}")
        try:
            check_peer(msg.spec, first.cache)
        except IncompatiblePeerError as exc:
            return self._fail("incompatible", str(exc), list(exc.fields))
        if msg.compat != first.cache.compat_hash():
            return self._fail("incompatible", "KV caches differ (compat hash)", ["compat"])
        try:
            msg.spec.check_rank(msg.tp_rank, msg.tp_size)
        except ConfigError as exc:
            return self._fail("config", f"decode TP: {exc}")
        self.hello = msg
        self.state = "challenged"
        return [
            Challenge(
                engine_id=first.engine_id,
                tp_size=first.tp_size,
                spec=first.cache,
                ranks=sorted(self.ranks),
                nonce=self.nonce,
                auth=self.secret is not None,
                lease_s=first.lease_s,
                endpoints=self.endpoints() if self.endpoints else [],
            )
        ], False

    def _on_metadata_request(self, msg: MetadataRequest) -> tuple[list[Message], bool]:
        hello = self.hello
        if hello is None:
            return self._fail("protocol", "MetadataRequest before Hello")
        proof = b""
        if self.secret is not None:
            want = mac(self.secret, b"akv-client", self.nonce, hello.nonce, hello.engine_id.encode())
            if not hmac.compare_digest(want, msg.mac):
                self.metrics.inc("auth_failures")
                return self._fail("auth", "authentication failed: wrong or missing shared secret")
            proof = mac(self.secret, b"akv-server", hello.nonce, self.nonce)
        unknown = sorted(set(msg.ranks) - set(self.ranks))
        if unknown:
            return self._fail("unknown_rank", f"prefill ranks {unknown} are not served here")
        infos = []
        try:
            for rank in sorted(set(msg.ranks)):
                hosted = self.ranks[rank]
                hosted.peer_connected(hello.engine_id, hello.tp_rank, hello.tp_size, hello.agent_name)
                infos.append(hosted.rank_info())
        except AkvError as exc:  # e.g. a rank shutting down: fail this handshake, keep serving
            return self._fail("config", f"prefill rank unavailable: {exc}")
        self.state = "authed"
        self.metrics.inc("handshakes_served")
        return [Metadata(ranks=infos, mac=proof)], False


@dataclass(frozen=True, slots=True)
class HandshakeResult:
    """What a decode rank learned from one prefill engine."""

    challenge: Challenge
    ranks: dict[int, RankInfo]
    requests: list[RequestInfo] | None = None


def raise_for_error(err: Error) -> None:
    """Raise the typed error an ``Error`` reply stands for."""
    prefix = "remote engine refused the handshake"
    if err.code == "incompatible":
        raise IncompatiblePeerError(f"{prefix}: {err.message}", tuple(err.fields))
    if err.code == "auth":
        raise AuthenticationError(f"{prefix}: {err.message}")
    if err.code == "version":
        raise IncompatiblePeerError(f"{prefix}: {err.message}", ("version",))
    raise HandshakeError(f"{prefix} ({err.code}): {err.message}")


class ClientConversation:
    """The decode side of one handshake.

    `start` gives the first message to send; `receive` takes each reply and
    returns the next message to send, or None once [`result`][akv.Transfer.result] is set. Refusals and
    protocol violations raise typed errors.
    """

    def __init__(
        self,
        hello: Hello,
        secret: bytes | None,
        choose_ranks: Callable[[Challenge], Sequence[int]],
        *,
        list_requests: bool = False,
    ) -> None:
        self.hello = hello
        self.secret = secret
        self.choose_ranks = choose_ranks
        self.list_requests = list_requests
        self.state = "start"
        self.challenge: Challenge | None = None
        self.ranks: dict[int, RankInfo] = {}
        self.result: HandshakeResult | None = None
        self._asked: list[int] = []

    def start(self) -> Message:
        """The opening Hello."""
        self.state = "hello"
        return self.hello

    def receive(self, msg: Message) -> Message | None:
        """Advance by one reply; returns the next message to send, or None when done."""
        if isinstance(msg, Error):
            raise_for_error(msg)
        if self.state == "hello":
            return self._on_challenge(msg)
        if self.state == "metadata":
            return self._on_metadata(msg)
        if self.state == "requests":
            if not isinstance(msg, Requests):
                raise ProtocolError(f"expected Requests, got {type(msg).__name__}")
            self._finish(msg.items)
            return None
        raise ProtocolError(f"unexpected {type(msg).__name__} in state {self.state}")

    def _on_challenge(self, msg: Message) -> Message:
        if not isinstance(msg, Challenge):
            raise ProtocolError(f"expected Challenge, got {type(msg).__name__}")
        if msg.auth and self.secret is None:
            raise AuthenticationError(
                f"remote engine {msg.engine_id} requires a shared secret: set {SECRET_ENV} or pass secret="
            )
        proof = b""
        if self.secret is not None:
            proof = mac(
                self.secret, b"akv-client", msg.nonce, self.hello.nonce, self.hello.engine_id.encode()
            )
        self.challenge = msg
        self._asked = list(self.choose_ranks(msg))
        self.state = "metadata"
        return MetadataRequest(ranks=self._asked, mac=proof)

    def _on_metadata(self, msg: Message) -> Message | None:
        if not isinstance(msg, Metadata) or self.challenge is None:
            raise ProtocolError(f"expected Metadata, got {type(msg).__name__}")
        if self.secret is not None:
            want = mac(self.secret, b"akv-server", self.hello.nonce, self.challenge.nonce)
            if not self.challenge.auth or not hmac.compare_digest(want, msg.mac):
                raise AuthenticationError("the remote engine could not prove it knows the shared secret")
        got = {info.tp_rank: info for info in msg.ranks}
        if set(got) != set(self._asked):
            raise ProtocolError(f"asked for prefill ranks {sorted(self._asked)}, got {sorted(got)}")
        self.ranks = got
        if self.list_requests:
            self.state = "requests"
            return ListRequests()
        self._finish(None)
        return None

    def _finish(self, requests: list[RequestInfo] | None) -> None:
        if self.challenge is None:  # pragma: no cover - guarded by the states above
            raise ProtocolError("no challenge received")
        self.result = HandshakeResult(self.challenge, self.ranks, requests)
        self.state = "done"
        return None
