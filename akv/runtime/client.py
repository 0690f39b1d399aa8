"""The control plane's client side: a decode rank's handshake with a prefill endpoint, a
prefill rank's registration with its bootstrap, and the watch a decode rank keeps of a
prefill rank's process over its handshake connection.

The conversations themselves are the sans-IO state machines of `akv.protocol.handshake`;
this module only moves their frames over TCP, with limits and timeouts. The server side is
`akv.runtime.control`.
"""

from __future__ import annotations

import hmac
import math
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import msgspec
from anyio.abc import ByteStream

from akv.errors import AkvError, AuthenticationError, FrameError, HandshakeError, ServerBusyError
from akv.protocol.address import Endpoint
from akv.protocol.handshake import (
    ClientConversation,
    HandshakeResult,
    raise_for_error,
    register_mac,
    registered_mac,
)
from akv.protocol.messages import (
    DEFAULT_CLIENT_MAX_FRAME,
    Challenge,
    Error,
    FrameBuffer,
    Hello,
    KeepAlive,
    Message,
    Register,
    Registered,
    decode_message,
    encode_frame,
)
from akv.tls import client_wrap, tls_failure

__all__ = ["WATCH_ACK_MS", "WATCH_EVERY_S", "client_handshake", "register_rank", "watch"]


class _Client:
    """Frames in and out of one client connection."""

    def __init__(self, stream: ByteStream) -> None:
        self.stream = stream
        self.frames = FrameBuffer(DEFAULT_CLIENT_MAX_FRAME)
        self.pending: list[bytes] = []

    async def send(self, msg: Message) -> None:
        await self.stream.send(encode_frame(msg))

    async def receive(self) -> tuple[Message, bytes]:
        """The next message and the bytes it was decoded from."""
        while not self.pending:
            try:
                data = await self.stream.receive(1 << 20)
            except anyio.EndOfStream:
                raise HandshakeError(
                    "the remote engine closed the connection mid-handshake (a TLS server does this to a "
                    "plaintext client, or to one without a client certificate its CA signed)"
                ) from None
            self.pending.extend(self.frames.feed(data))
        body = self.pending.pop(0)
        return decode_message(body), body


async def _converse_client(client: _Client, conv: ClientConversation) -> HandshakeResult:
    out: Message | None = conv.start()
    while out is not None:
        await client.send(out)
        out = conv.receive(*await client.receive())
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
    tls: ssl.SSLContext | None = None,
    keep: Callable[[ByteStream], None] | None = None,
) -> HandshakeResult:
    """Run the client side against one endpoint, retrying unreachable endpoints with backoff.

    A server answering ``busy`` (no room for another connection) is tried again until
    ``connect_timeout`` has passed since the first attempt. Raises
    [`HandshakeError`][akv.errors.HandshakeError] (or a subclass) naming the endpoint; refusals by the
    server (incompatible, auth) are not retried. ``tls``: a client context (see
    [`TLSConfig.client_context`][akv.TLSConfig.client_context]) to talk TLS with. ``keep``:
    takes the connection, authenticated and still open, once the handshake succeeded (to
    `watch` the server's process with; the caller closes it), instead of its being closed.
    """
    last: Exception | None = None
    busy_until = time.monotonic() + connect_timeout
    attempt = 0
    while attempt <= retries:
        if attempt:
            await sleep(backoff * math.pow(2, attempt - 1))
        attempt += 1
        try:
            with anyio.fail_after(connect_timeout):
                stream = await anyio.connect_tcp(endpoint.host, endpoint.port)
        except (OSError, TimeoutError) as exc:
            last = exc
            continue
        kept = False
        try:
            try:
                conv = ClientConversation(hello, secret, choose_ranks, list_requests=list_requests)
                with anyio.fail_after(handshake_timeout):
                    wire = stream if tls is None else await client_wrap(stream, tls, endpoint.host, endpoint)
                    result = await _converse_client(_Client(wire), conv)
                if keep is not None:
                    keep(wire)
                    kept = True
                return result
            except ssl.SSLError as exc:  # after the TLS handshake: e.g. our certificate refused
                raise tls_failure(exc, endpoint) from None
            except TimeoutError:
                raise HandshakeError(
                    f"handshake with {endpoint} timed out after {handshake_timeout}s (hung peer?)"
                ) from None
            except (anyio.BrokenResourceError, OSError) as exc:
                if tls is not None:  # TLS was set up: the server dropped us (our certificate?)
                    raise tls_failure(exc, endpoint) from None
                last = exc
                continue
            except ServerBusyError as exc:
                if time.monotonic() + backoff >= busy_until:
                    raise ServerBusyError(
                        f"{endpoint} stayed busy for the connect timeout ({connect_timeout}s): {exc}"
                    ) from None
                last = exc
                attempt -= 1  # a busy server does not use up a retry, the clock bounds it
                await sleep(backoff)
                continue
            except FrameError as exc:
                raise HandshakeError(f"bad reply from {endpoint}: {exc}") from None
        finally:
            if not kept:
                await stream.aclose()
    raise HandshakeError(f"cannot reach {endpoint} after {retries + 1} attempts: {last}")


#: Seconds between a decode rank's keep-alives on a watch (`watch`).
WATCH_EVERY_S = 0.25
#: Milliseconds a watch's keep-alive may stay unacknowledged by the server's host before the
#: connection counts as dead (``TCP_USER_TIMEOUT``): a host that is down, or unreachable.
WATCH_ACK_MS = 1000


async def watch(
    stream: ByteStream, *, every: float = WATCH_EVERY_S, ack_ms: int = WATCH_ACK_MS
) -> str | None:
    """Watch the process serving ``stream`` (an authenticated handshake connection, kept):
    send a `KeepAlive` every ``every`` seconds and return once the connection ends, with why
    the process is taken for gone: the connection closed or reset (the process died: its
    kernel closes every socket it held), or a keep-alive stayed unacknowledged for
    ``ack_ms`` (its host is down or cut off). A process that is only stopped or slow keeps
    its kernel's acknowledgements coming: it is not gone, and this keeps waiting. None: the
    server ended the watch on purpose (``busy``: too many watches). Closes ``stream``."""
    import socket

    from anyio.abc import SocketAttribute

    with_timeout = getattr(socket, "TCP_USER_TIMEOUT", 18 if hasattr(socket, "TCP_KEEPIDLE") else None)
    try:
        sock = stream.extra(SocketAttribute.raw_socket)
        if with_timeout is not None:
            sock.setsockopt(socket.IPPROTO_TCP, with_timeout, ack_ms)
    except (anyio.TypedAttributeLookupError, OSError):
        pass
    frame = encode_frame(KeepAlive())
    gone: list[str | None] = []

    async def read(tg: Any) -> None:
        frames = FrameBuffer(DEFAULT_CLIENT_MAX_FRAME)
        try:
            while True:
                for body in frames.feed(await stream.receive(65536)):
                    try:
                        msg = decode_message(body)
                    except AkvError:
                        continue
                    if isinstance(msg, Error):  # the server ends the watch (too many): not gone
                        gone.append(None)
                        tg.cancel_scope.cancel()
                        return
        except anyio.EndOfStream:
            gone.append("its control connection was closed (the process is gone)")
        except (anyio.BrokenResourceError, OSError) as exc:
            gone.append(f"its control connection broke ({exc or type(exc).__name__})")
        tg.cancel_scope.cancel()

    async def write(tg: Any) -> None:
        try:
            while True:
                await stream.send(frame)
                await anyio.sleep(every)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            gone.append(f"its control connection broke ({exc or type(exc).__name__})")
        tg.cancel_scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read, tg)
            tg.start_soon(write, tg)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
    return gone[0] if gone else None


async def register_rank(
    bootstrap: Endpoint,
    msg: Register,
    *,
    secret: bytes | None,
    timeout: float = 5.0,  # noqa: ASYNC109 (one deadline for connect, send and reply)
    tls: ssl.SSLContext | None = None,
) -> Registered:
    """Register a rank's endpoint with its engine's bootstrap; returns its reply (the engine
    id and instance id), whose MAC is checked when there is a secret.

    Raises :class:`HandshakeError` if the bootstrap cannot be reached or refuses
    ([`IncompatiblePeerError`][akv.errors.IncompatiblePeerError] naming the field where
    the rank's geometry differs from rank 0's).
    """
    if secret is not None:
        msg = msgspec.structs.replace(msg, mac=register_mac(secret, msg))
    try:
        with anyio.fail_after(timeout):
            async with await anyio.connect_tcp(bootstrap.host, bootstrap.port) as stream:
                wire = stream if tls is None else await client_wrap(stream, tls, bootstrap.host, bootstrap)
                client = _Client(wire)
                await client.send(msg)
                reply, _ = await client.receive()
    except ssl.SSLError as exc:
        raise tls_failure(exc, bootstrap) from None
    except (OSError, TimeoutError, anyio.BrokenResourceError) as exc:
        raise HandshakeError(f"cannot register with the bootstrap at {bootstrap}: {exc}") from None
    if isinstance(reply, Error):
        raise_for_error(reply)
    if not isinstance(reply, Registered):
        raise HandshakeError(f"the bootstrap at {bootstrap} answered {type(reply).__name__}, not Registered")
    if secret is not None and not hmac.compare_digest(registered_mac(secret, msg, reply), reply.mac):
        raise AuthenticationError(f"the bootstrap at {bootstrap} could not prove it knows the shared secret")
    return reply
