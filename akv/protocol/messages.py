"""Control-plane messages and framing. Pure (sans-IO).

Frames are a 4-byte big-endian length followed by a msgpack-encoded message. Messages are
frozen, tagged msgspec Structs in one union; decoding runs in two phases: a probe reads only
``type`` and ``v`` so a peer speaking another protocol version gets a clear error, then the
whole union is decoded and validated.

Protocol history:

* 1 — first version: Hello / Challenge / MetadataRequest / Metadata / ListRequests /
  Requests / Error; notifications ``done`` and ``extend``. Appended since (fields with
  defaults): exposure tables in RankInfo, digests in notices, the decode agent's name in
  Hello, rank endpoints in Challenge, and Register / Registered (ranks with their bootstrap).
"""

from __future__ import annotations

import struct
from typing import Literal

import msgspec

from akv.errors import FrameError, ProtocolError, VersionMismatchError
from akv.geometry.cache import CacheSpec

__all__ = [
    "DEFAULT_CLIENT_MAX_FRAME",
    "DEFAULT_SERVER_MAX_FRAME",
    "PROTOCOL_VERSION",
    "Challenge",
    "Error",
    "FrameBuffer",
    "Hello",
    "ListRequests",
    "Message",
    "Metadata",
    "MetadataRequest",
    "Notice",
    "RankInfo",
    "Register",
    "Registered",
    "RequestInfo",
    "Requests",
    "decode_message",
    "decode_notice",
    "encode_frame",
    "encode_notice",
]

PROTOCOL_VERSION = 2  # 2: caches are described as groups (CacheSpec)
#: Largest frame a server accepts: client messages are small.
DEFAULT_SERVER_MAX_FRAME = 64 * 1024
#: Largest frame a client accepts: agent metadata can be large.
DEFAULT_CLIENT_MAX_FRAME = 64 * 1024 * 1024
_HEADER = struct.Struct(">I")


class _Msg(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    v: int = PROTOCOL_VERSION


class Hello(_Msg, frozen=True, tag=True, kw_only=True):
    """Client → server: who the decode rank is and what cache it holds."""

    engine_id: str
    tp_rank: int
    tp_size: int
    spec: CacheSpec
    compat: str
    nonce: bytes
    agent_name: str = ""  # the decode rank's NIXL agent: its notices are bound to it


class Challenge(_Msg, frozen=True, tag=True, kw_only=True):
    """Server → client: the prefill engine's shape and a nonce to authenticate against."""

    engine_id: str
    tp_size: int
    spec: CacheSpec
    ranks: list[int]
    nonce: bytes
    auth: bool
    lease_s: float = 0.0
    endpoints: list[str] = []  # every rank's control endpoint in rank order, "" if unknown yet


class Register(_Msg, frozen=True, tag=True, kw_only=True):
    """Prefill rank -> its engine's bootstrap (rank 0): "rank ``tp_rank`` serves ``endpoint``".

    ``mac = HMAC(secret, "akv-register" | engine_id | tp_rank | tp_size | endpoint | compat)``
    when the engines share a secret.
    """

    engine_id: str
    tp_rank: int
    tp_size: int
    endpoint: str
    compat: str
    mac: bytes = b""


class Registered(_Msg, frozen=True, tag=True, kw_only=True):
    """Bootstrap -> rank: registered; ``engine_id`` is the engine's name."""

    engine_id: str


class MetadataRequest(_Msg, frozen=True, tag=True, kw_only=True):
    """Client → server: the prefill ranks whose metadata the client needs, with its MAC."""

    ranks: list[int]
    mac: bytes = b""


class RankInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One prefill rank: its NIXL agent and where its regions live."""

    tp_rank: int
    agent_name: str
    agent_metadata: bytes
    region_addrs: list[int]
    device_id: int = 0
    mem_type: str = "DRAM"
    exposure_addr: int = 0  # the rank's exposure table (akv.exposure), registered as DRAM
    exposure_buckets: int = 0
    process: str = ""  # names the rank's process (akv.runtime.local): a peer there copies instead


class Metadata(_Msg, frozen=True, tag=True, kw_only=True):
    """Server → client: the requested ranks, and the server's proof of the secret."""

    ranks: list[RankInfo]
    mac: bytes = b""


class RequestInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A request announced by a prefill engine (a router would carry this)."""

    request_id: str
    block_ids: list[int] | dict[str, list[int]]  # flat for a one-group cache, else per group
    seed: int = 0
    num_tokens: int = 0  # 0: the blocks are full


class ListRequests(_Msg, frozen=True, tag=True, kw_only=True):
    """Client → server (after authentication): which requests are exposed."""


class Requests(_Msg, frozen=True, tag=True, kw_only=True):
    """Server → client: the announced requests."""

    items: list[RequestInfo]


class Error(_Msg, frozen=True, tag=True, kw_only=True):
    """Either side: why the exchange stops. ``code`` is machine readable."""

    code: Literal["version", "incompatible", "auth", "protocol", "busy", "config", "unknown_rank", "register"]
    message: str
    fields: list[str] = msgspec.field(default_factory=list)


Message = (
    Hello | Challenge | MetadataRequest | Metadata | ListRequests | Requests | Error | Register | Registered
)


class _Probe(msgspec.Struct):
    type: str = ""
    v: int = -1


_probe = msgspec.msgpack.Decoder(_Probe)
_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


def encode_frame(message: Message) -> bytes:
    """One length-prefixed frame."""
    body = _encoder.encode(message)
    return _HEADER.pack(len(body)) + body


def decode_message(body: bytes) -> Message:
    """Decode one frame body; [`VersionMismatchError`][akv.errors.VersionMismatchError] for another version, [`FrameError`][akv.errors.FrameError]
    for a bad message."""
    try:
        probe = _probe.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"undecodable frame: {exc}") from None
    if probe.v != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"peer speaks akv protocol version {probe.v}, this side speaks {PROTOCOL_VERSION}: "
            "run the same akv release on both engines"
        )
    try:
        msg: Message = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"invalid {probe.type or 'untyped'} message: {exc}") from None
    return msg


class FrameBuffer:
    """Incremental frame splitter with a size limit (sans-IO)."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; returns the complete frame bodies. Raises [`FrameError`][akv.errors.FrameError]."""
        self._buf += data
        frames = []
        while len(self._buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf)
            if size > self.max_frame:
                raise FrameError(f"frame of {size} bytes exceeds the {self.max_frame}-byte limit")
            end = _HEADER.size + size
            if len(self._buf) < end:
                break
            frames.append(bytes(self._buf[_HEADER.size : end]))
            del self._buf[:end]
        return frames

    @property
    def pending(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)


# -- NIXL notification payloads ---------------------------------------------------------

_NOTICE_MAGIC = b"akv1"


class Notice(msgspec.Struct, frozen=True, array_like=True):
    """A decode rank tells a prefill rank it is done with (or still wants) some requests."""

    kind: Literal["done", "extend"]
    engine_id: str
    decode_rank: int
    decode_tp: int
    request_ids: list[str]
    digests: list[int] = []  # "done": the digest of each request's block ids (akv.exposure.digest)


_notice_decoder = msgspec.msgpack.Decoder(Notice)


def encode_notice(notice: Notice) -> bytes:
    """The bytes of a notification."""
    return _NOTICE_MAGIC + _encoder.encode(notice)


def decode_notice(data: bytes) -> Notice:
    """Parse a notification; [`ProtocolError`][akv.errors.ProtocolError] if it is not an akv notice."""
    if not data.startswith(_NOTICE_MAGIC):
        raise ProtocolError("not an akv notification")
    try:
        return _notice_decoder.decode(data[len(_NOTICE_MAGIC) :])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed akv notification: {exc}") from None
