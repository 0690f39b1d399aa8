"""The handshake, as two sans-IO state machines (no sockets here).

The conversation::

    D -> P  Hello(engine_id, tp_rank, tp_size, spec, compat, nonce_d)
    P -> D  Challenge(engine_id, tp_size, spec, ranks, nonce_p, auth)   | Error
    D -> P  MetadataRequest(ranks, mac_d)                               (| ListRequests later)
    P -> D  Metadata(ranks..., mac_p)                                   | Error

With a shared secret each MAC covers the whole transcript so far: every byte of every
message of both directions (`Transcript`), then the MAC-bearing message itself encoded with
an empty ``mac``::

    mac_d = HMAC(secret, "akv-client" | H(Hello, Challenge, MetadataRequest[mac=""]))
    mac_p = HMAC(secret, "akv-server" | H(Hello, Challenge, MetadataRequest, Metadata[mac=""]))

(and a ``Requests`` reply likewise). So a relay without the secret can neither alter a
message (engine id, ranks, endpoints, agent names, metadata, addresses) nor splice two
conversations: the side that checks a MAC computes it over what it sent and received
itself. MACs are compared in constant time. Without a valid ``mac_d`` the client never sees
agent metadata, which grants read access to the registered KV memory.
"""

from __future__ import annotations

import hmac
import os
import secrets as _secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import sha256
from typing import Any, Protocol

import msgspec

from akv import sharding
from akv.errors import (
    AkvError,
    AuthenticationError,
    ConfigError,
    HandshakeError,
    IncompatiblePeerError,
    ProtocolError,
    RefusedError,
    ServerBusyError,
    VersionMismatchError,
)
from akv.geometry.cache import CacheSpec, check_peer
from akv.metrics import Metrics
from akv.protocol.messages import (
    MAX_TP_SIZE,
    Challenge,
    Error,
    Hello,
    KeepAlive,
    ListRequests,
    Message,
    Metadata,
    MetadataRequest,
    RankInfo,
    Register,
    Registered,
    RequestInfo,
    Requests,
    encode_body,
)

__all__ = [
    "SECRET_ENV",
    "ClientConversation",
    "HandshakeResult",
    "HostedRank",
    "ServerConversation",
    "Transcript",
    "mac",
    "register_mac",
    "resolve_secret",
]

SECRET_ENV = "AKV_SECRET"


def resolve_secret(secret: str | bytes | None) -> bytes | None:
    """The secret to use: the argument, else ``$AKV_SECRET``, else None (no authentication).

    Raises [`ConfigError`][akv.errors.ConfigError] for an empty secret, wherever it comes
    from (an argument, ``--secret ""``, or ``AKV_SECRET=`` in the environment): an empty
    string is a mistake, not a secret, and never means "no authentication".
    """
    source = "the secret argument"
    if secret is None:
        secret = os.environ.get(SECRET_ENV)
        source = f"${SECRET_ENV}"
    if secret is None:
        return None
    if not secret:
        raise ConfigError(
            f"{source} is empty: give a non-empty shared secret, or unset it for no authentication"
        )
    return secret.encode() if isinstance(secret, str) else bytes(secret)


class Transcript:
    """A running hash of every message of one conversation, both directions, in order.

    Each entry is the direction (``c`` client to server, ``s`` server to client), the body's
    length and its bytes, so no two different conversations hash alike.
    """

    def __init__(self) -> None:
        self._hash = sha256()

    def add(self, direction: bytes, body: bytes) -> None:
        """Record one message body."""
        self._hash.update(direction + len(body).to_bytes(4, "big") + body)

    def mac(self, secret: bytes, label: bytes, direction: bytes, unsent: Message) -> bytes:
        """The MAC of the transcript followed by ``unsent`` (a message whose ``mac`` is empty)."""
        h = self._hash.copy()
        body = encode_body(unsent)
        h.update(direction + len(body).to_bytes(4, "big") + body)
        return mac(secret, label, h.digest())


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
    # optional: ``modes``, the transfer modes served ("pull", "push"; absent: pull only)

    def rank_info(self) -> RankInfo: ...

    def peer_connected(self, engine_id: str, decode_rank: int, decode_tp: int, agent_name: str) -> None: ...

    # optional: ``push_peer(hello)``, called for a pushing decode rank once its MAC was checked


def register_mac(secret: bytes, msg: Register) -> bytes:
    """The MAC a rank's registration with its bootstrap carries: over the whole message."""
    return mac(secret, b"akv-register", encode_body(_unmac(msg)))


def registered_mac(secret: bytes, request: Register, reply: Registered) -> bytes:
    """The MAC of a bootstrap's reply: over the registration it answers and the reply."""
    return mac(secret, b"akv-registered", encode_body(request), encode_body(_unmac(reply)))


def _unmac(msg: Any) -> Any:
    return msgspec.structs.replace(msg, mac=b"")


class ServerConversation:
    """The server side of one connection's handshake.

    `receive` takes one decoded message (or the [`AkvError`][akv.errors.AkvError] decoding
    raised) with the bytes it was decoded from, and returns ``(replies, done)``; after
    ``done`` the connection is closed. Every message in and out enters the transcript.
    """

    def __init__(
        self,
        ranks: dict[int, HostedRank],
        secret: bytes | None,
        directory: Callable[[], Sequence[RequestInfo]] | None = None,
        metrics: Metrics | None = None,
        endpoints: Callable[[], list[str]] | None = None,
        register: Callable[[Register], Registered] | None = None,
        instance_id: Callable[[], str] | None = None,
    ) -> None:
        self.ranks = ranks
        self.secret = secret
        self.directory = directory
        self.metrics = metrics or Metrics()
        self.endpoints = endpoints
        self.register = register
        self.instance_id = instance_id
        self.state = "hello"
        self.nonce = _secrets.token_bytes(16)
        self.hello: Hello | None = None
        self.transcript = Transcript()
        #: the client keeps the connection as a watch of this process (`KeepAlive`)
        self.watching = False

    @property
    def authenticated(self) -> bool:
        """True once the client proved the secret (or none is needed) and got its metadata."""
        return self.state == "authed"

    def _fail(self, code: Any, message: str, fields: Sequence[str] = ()) -> tuple[list[Message], bool]:
        self.metrics.inc("handshakes_failed")
        self.state = "closed"
        return [Error(code=code, message=message, fields=list(fields))], True

    def _send(self, msg: Message) -> Message:
        self.transcript.add(b"s", encode_body(msg))
        return msg

    def receive(self, msg: Message | AkvError, raw: bytes | None = None) -> tuple[list[Message], bool]:
        """Advance the conversation by one incoming message (``raw``: its bytes as received)."""
        if self.state == "closed":
            return [], True
        if isinstance(msg, VersionMismatchError):
            return self._fail("version", str(msg))
        if isinstance(msg, AkvError):
            return self._fail("protocol", str(msg))
        if isinstance(msg, KeepAlive) and self.state == "authed":  # outside the transcript: no MAC follows
            self.watching = True
            return [], False
        body = raw if raw is not None else encode_body(msg)
        if isinstance(msg, MetadataRequest) and self.state == "challenged":
            return self._on_metadata_request(msg, body)  # checks its MAC before recording it
        self.transcript.add(b"c", body)
        if self.state == "hello" and isinstance(msg, Register):
            return self._on_register(msg)
        if self.state == "hello":
            return self._on_hello(msg)
        if isinstance(msg, ListRequests) and self.state == "authed":
            items = list(self.directory()) if self.directory else []
            reply = Requests(items=items)
            if self.secret is not None:
                reply = msgspec.structs.replace(
                    reply, mac=self.transcript.mac(self.secret, b"akv-server-requests", b"s", reply)
                )
            return [self._send(reply)], False
        return self._fail("protocol", f"unexpected {type(msg).__name__} in state {self.state}")

    def _on_register(self, msg: Register) -> tuple[list[Message], bool]:
        if self.register is None:
            return self._fail("register", "this endpoint is not an engine's bootstrap (rank 0)")
        if self.secret is not None and not hmac.compare_digest(register_mac(self.secret, msg), msg.mac):
            self.metrics.inc("auth_failures")
            return self._fail("auth", "registration refused: wrong or missing shared secret")
        try:
            reply = self.register(msg)
        except IncompatiblePeerError as exc:
            return self._fail("incompatible", str(exc), list(exc.fields))
        except ConfigError as exc:
            return self._fail("register", str(exc))
        if self.secret is not None:
            reply = msgspec.structs.replace(reply, mac=registered_mac(self.secret, msg, reply))
        self.state = "closed"
        return [reply], True

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
        modes: tuple[str, ...] = getattr(first, "modes", ("pull",))
        if msg.mode == "push" and not msg.agent_metadata:
            return self._fail("config", "push mode needs the decode rank's agent metadata in its Hello")
        try:
            msg.spec.check_rank(msg.tp_rank, msg.tp_size)
        except ConfigError as exc:
            return self._fail("config", f"decode TP: {exc}")
        self.hello = msg
        self.state = "challenged"
        challenge = Challenge(
            engine_id=first.engine_id,
            tp_size=first.tp_size,
            spec=first.cache,
            ranks=sorted(self.ranks),
            nonce=self.nonce,
            auth=self.secret is not None,
            lease_s=first.lease_s,
            endpoints=self.endpoints() if self.endpoints else [],
            instance_id=self.instance_id() if self.instance_id else "",
            modes=[m for m in ("pull", "push") if m in modes],
        )
        return [self._send(challenge)], False

    def _on_metadata_request(self, msg: MetadataRequest, body: bytes) -> tuple[list[Message], bool]:
        hello = self.hello
        if hello is None:  # pragma: no cover - the state says a Hello came
            return self._fail("protocol", "MetadataRequest before Hello")
        if self.secret is not None:
            want = self.transcript.mac(
                self.secret, b"akv-client", b"c", msgspec.structs.replace(msg, mac=b"")
            )
            if not hmac.compare_digest(want, msg.mac):
                self.metrics.inc("auth_failures")
                return self._fail(
                    "auth",
                    "authentication failed: wrong or missing shared secret, or the handshake was altered in transit",
                )
        self.transcript.add(b"c", body)
        unknown = sorted(set(msg.ranks) - set(self.ranks))
        if unknown:
            return self._fail("unknown_rank", f"prefill ranks {unknown} are not served here")
        modes: tuple[str, ...] = getattr(self.ranks[msg.ranks[0]], "modes", ("pull",)) if msg.ranks else ()
        if msg.ranks and hello.mode not in modes:  # (listing requests needs no mode)
            return self._fail(
                "incompatible",
                f"the decode rank asks for mode {hello.mode!r}, this engine serves {list(modes)}: "
                "give both engines the same --mode",
                ["mode"],
            )
        infos = []
        try:
            for rank in sorted(set(msg.ranks)):
                hosted = self.ranks[rank]
                hosted.peer_connected(hello.engine_id, hello.tp_rank, hello.tp_size, hello.agent_name)
                if hello.mode == "push":  # only now: the MAC over the Hello was checked
                    hosted.push_peer(hello)  # type: ignore[attr-defined]
                infos.append(hosted.rank_info())
        except AkvError as exc:  # e.g. a rank shutting down: fail this handshake, keep serving
            return self._fail("config", f"prefill rank unavailable: {exc}")
        reply = Metadata(ranks=infos)
        if self.secret is not None:
            proof = self.transcript.mac(self.secret, b"akv-server", b"s", reply)
            reply = msgspec.structs.replace(reply, mac=proof)
        self.state = "authed"
        self.metrics.inc("handshakes_served")
        return [self._send(reply)], False


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
    if err.code == "busy":
        raise ServerBusyError(f"{prefix}: {err.message}")
    raise RefusedError(f"{prefix} ({err.code}): {err.message}")


class ClientConversation:
    """The decode side of one handshake.

    `start` gives the first message to send; `receive` takes each reply (with the bytes it
    was decoded from) and returns the next message to send, or None once ``result`` is set.
    Refusals, protocol violations and MACs that do not match the transcript raise typed errors.
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
        self.transcript = Transcript()

    def _send(self, msg: Message) -> Message:
        self.transcript.add(b"c", encode_body(msg))
        return msg

    def start(self) -> Message:
        """The opening Hello."""
        self.state = "hello"
        return self._send(self.hello)

    def receive(self, msg: Message, raw: bytes | None = None) -> Message | None:
        """Advance by one reply (``raw``: its bytes as received); returns the next message to
        send, or None when done."""
        if isinstance(msg, Error):
            raise_for_error(msg)
        body = raw if raw is not None else encode_body(msg)
        if self.state == "hello":
            self.transcript.add(b"s", body)
            return self._on_challenge(msg)
        if self.state == "metadata":
            return self._on_metadata(msg, body)
        if self.state == "requests":
            if not isinstance(msg, Requests):
                raise ProtocolError(f"expected Requests, got {type(msg).__name__}")
            self._check_mac(msg, b"akv-server-requests")
            self._finish(msg.items)
            return None
        raise ProtocolError(f"unexpected {type(msg).__name__} in state {self.state}")

    def _check_mac(self, msg: Metadata | Requests, label: bytes) -> None:
        if self.secret is None:
            return
        want = self.transcript.mac(self.secret, label, b"s", msgspec.structs.replace(msg, mac=b""))
        if self.challenge is None or not self.challenge.auth or not hmac.compare_digest(want, msg.mac):
            raise AuthenticationError(
                "the remote engine could not prove it knows the shared secret over this handshake "
                "(wrong secret, or a message was altered in transit)"
            )

    def _on_challenge(self, msg: Message) -> Message:
        if not isinstance(msg, Challenge):
            raise ProtocolError(f"expected Challenge, got {type(msg).__name__}")
        if msg.auth and self.secret is None:
            raise AuthenticationError(
                f"remote engine {msg.engine_id} requires a shared secret: set {SECRET_ENV} or pass secret="
            )
        try:
            msg.spec.validate()
        except ConfigError as exc:
            raise HandshakeError(f"the remote engine describes an invalid cache: {exc}") from None
        if any(not 0 <= r < msg.tp_size for r in msg.ranks) or len(msg.endpoints) not in (0, msg.tp_size):
            raise ProtocolError(
                f"the remote engine's ranks {msg.ranks[:8]} or {len(msg.endpoints)} endpoints do not fit "
                f"its TP size {msg.tp_size} (at most {MAX_TP_SIZE})"
            )
        self.challenge = msg
        self._asked = list(self.choose_ranks(msg))
        if self._asked and self.hello.mode not in (msg.modes or ["pull"]):
            raise IncompatiblePeerError(
                f"remote engine {msg.engine_id} serves modes {list(msg.modes or ['pull'])}, this decode "
                f"rank asks for {self.hello.mode!r}: give both engines the same --mode",
                ("mode",),
            )
        self.state = "metadata"
        request = MetadataRequest(ranks=self._asked)
        if self.secret is not None:
            request = msgspec.structs.replace(
                request, mac=self.transcript.mac(self.secret, b"akv-client", b"c", request)
            )
        return self._send(request)

    def _on_metadata(self, msg: Message, body: bytes) -> Message | None:
        if not isinstance(msg, Metadata) or self.challenge is None:
            raise ProtocolError(f"expected Metadata, got {type(msg).__name__}")
        self._check_mac(msg, b"akv-server")
        self.transcript.add(b"s", body)
        got = {info.tp_rank: info for info in msg.ranks}
        if set(got) != set(self._asked) or len(msg.ranks) != len(got):
            raise ProtocolError(f"asked for prefill ranks {sorted(self._asked)}, got {sorted(got)}")
        self.ranks = got
        if self.list_requests:
            self.state = "requests"
            return self._send(ListRequests())
        self._finish(None)
        return None

    def _finish(self, requests: list[RequestInfo] | None) -> None:
        if self.challenge is None:  # pragma: no cover - guarded by the states above
            raise ProtocolError("no challenge received")
        self.result = HandshakeResult(self.challenge, self.ranks, requests)
        self.state = "done"
        return None
