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
* 2 — caches are described as groups (CacheSpec).
* 3 — the MACs cover the whole transcript (`akv.protocol.handshake.Transcript`), not only
  the nonces; Challenge carries the engine's ``instance_id``; Register carries the rank's
  cache and ``Registered`` a MAC and the instance id; Requests a MAC. Sizes a peer supplies
  are bounded (``MAX_TP_SIZE``, ``MAX_LIST``, ``MAX_REGIONS``). Appended since: push mode
  (Hello ``mode``, ``agent_metadata``, ``region_addrs``, ``mem_type``, ``device_id``;
  Challenge ``modes``; push notices in `akv.protocol.push`); ``KeepAlive``, which a decode
  rank sends on its authenticated handshake connection to keep it as a watch of the prefill
  rank's life (`akv.runtime.client.watch`).
"""

from __future__ import annotations

import struct
from typing import Annotated, Literal

import msgspec

from akv.errors import FrameError, ProtocolError, VersionMismatchError
from akv.geometry.cache import CacheSpec
from akv.shm import TableShare

__all__ = [
    "DEFAULT_CLIENT_MAX_FRAME",
    "DEFAULT_SERVER_MAX_FRAME",
    "MAX_BUCKETS",
    "MAX_LIST",
    "MAX_METADATA",
    "MAX_REGIONS",
    "MAX_TP_SIZE",
    "PROTOCOL_VERSION",
    "Challenge",
    "Error",
    "FrameBuffer",
    "Hello",
    "KeepAlive",
    "ListRequests",
    "Message",
    "Metadata",
    "MetadataRequest",
    "Notice",
    "PackInfo",
    "RankInfo",
    "Register",
    "Registered",
    "RequestInfo",
    "Requests",
    "decode_message",
    "decode_notice",
    "encode_body",
    "encode_frame",
    "encode_notice",
    "merge_done_notices",
]

PROTOCOL_VERSION = 3  # 3: transcript-bound MACs, engine instance ids (see the history above)
#: Largest TP size a peer or discovery record may state.
MAX_TP_SIZE = 1024
#: Longest list (requests, ranks, ids) a peer may send in one message.
MAX_LIST = 65536
#: Most regions (addresses) one prefill rank may describe.
MAX_REGIONS = 65536
#: Most exposure-table buckets a prefill rank may state.
MAX_BUCKETS = 1 << 24
#: Largest agent metadata a decode rank may send (push mode's Hello carries it).
MAX_METADATA = 1 << 20
#: Largest frame a server accepts: client messages are small (a pushing decode rank's Hello
#: carries its agent metadata).
DEFAULT_SERVER_MAX_FRAME = 64 * 1024 + MAX_METADATA
#: Largest frame a client accepts: agent metadata can be large.
DEFAULT_CLIENT_MAX_FRAME = 64 * 1024 * 1024
_HEADER = struct.Struct(">I")

# Bounded sizes: msgspec refuses a value outside them while decoding, with an error naming
# the field and the bound (``Expected `int` <= 1024 - at `$.tp_size```).
TpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
TpRank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_SIZE)]
Ranks = Annotated[list[TpRank], msgspec.Meta(max_length=MAX_TP_SIZE)]
Name = Annotated[str, msgspec.Meta(max_length=1024)]


class _Msg(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    v: int = PROTOCOL_VERSION


class Hello(_Msg, frozen=True, tag=True, kw_only=True):
    """Client → server: who the decode rank is and what cache it holds."""

    engine_id: Name
    tp_rank: TpRank
    tp_size: TpSize
    spec: CacheSpec
    compat: Name
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)]
    agent_name: Name = ""  # the decode rank's NIXL agent: its notices are bound to it
    # push mode (appended): what the decode rank asks for, and what a prefill rank needs to
    # WRITE into its blocks (its agent metadata and regions), all under the transcript MAC
    mode: Literal["pull", "push"] = "pull"
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_METADATA)] = b""
    region_addrs: Annotated[list[int], msgspec.Meta(max_length=MAX_REGIONS)] = []
    mem_type: Name = "DRAM"
    device_id: int = 0
    # packed push (appended): the registered staging area packed copies may be written into
    # (0 bytes: none; the writers then write only the paged blocks)
    staging_addr: int = 0
    staging_bytes: int = 0


class Challenge(_Msg, frozen=True, tag=True, kw_only=True):
    """Server → client: the prefill engine's shape and a nonce to authenticate against."""

    engine_id: Name
    tp_size: TpSize
    spec: CacheSpec
    ranks: Ranks
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)]
    auth: bool
    lease_s: float = 0.0
    # every rank's control endpoint in rank order, "" if unknown yet
    endpoints: Annotated[list[Name], msgspec.Meta(max_length=MAX_TP_SIZE)] = []
    instance_id: Name = ""  # this incarnation of the engine ("" if this rank does not know it)
    # the transfer modes the engine serves (appended; empty: an older engine, pull only)
    modes: Annotated[list[Literal["pull", "push"]], msgspec.Meta(max_length=4)] = []


class Register(_Msg, frozen=True, tag=True, kw_only=True):
    """Prefill rank -> its engine's bootstrap (rank 0): "rank ``tp_rank`` serves ``endpoint``".

    ``mac = HMAC(secret, "akv-register" | the message encoded with an empty mac)`` when the
    engines share a secret. ``spec`` is the rank's cache, checked field by field against the
    bootstrap's (layout, block size, groups, dtype...).
    """

    engine_id: Name
    tp_rank: TpRank
    tp_size: TpSize
    endpoint: Name
    compat: Name
    mac: bytes = b""
    spec: CacheSpec | None = None


class Registered(_Msg, frozen=True, tag=True, kw_only=True):
    """Bootstrap -> rank: registered; ``engine_id`` is the engine's name, ``instance_id`` its
    incarnation (rank 0's), ``mac`` binds the reply to the Register it answers."""

    engine_id: Name
    instance_id: Name = ""
    mac: bytes = b""


class MetadataRequest(_Msg, frozen=True, tag=True, kw_only=True):
    """Client → server: the prefill ranks whose metadata the client needs, with its MAC."""

    ranks: Ranks
    mac: bytes = b""


class PackInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill rank that packs exposed requests (akv.packing): its staging pool and directory."""

    pool_addr: int
    pool_bytes: Annotated[int, msgspec.Meta(ge=0)]
    mem_type: Name = "DRAM"
    device_id: int = 0
    directory_addr: int = 0  # registered as DRAM
    directory_buckets: Annotated[int, msgspec.Meta(ge=1, le=MAX_BUCKETS)] = 1
    early: bool = False  # release_after_pack: blocks go back after packing, only the copy may be read
    directory_share: TableShare | None = None  # the directory, for decode ranks of its host (akv.shm)


class RankInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One prefill rank: its NIXL agent and where its regions live."""

    tp_rank: TpRank
    agent_name: Name
    agent_metadata: bytes
    region_addrs: Annotated[list[int], msgspec.Meta(max_length=MAX_REGIONS)]
    device_id: int = 0
    mem_type: Name = "DRAM"
    exposure_addr: int = 0  # the rank's exposure table (akv.exposure), registered as DRAM
    exposure_buckets: Annotated[int, msgspec.Meta(ge=0, le=MAX_BUCKETS)] = 0
    process: Name = ""  # names the rank's process (akv.runtime.local): a peer there copies instead
    pack: PackInfo | None = None  # set if the rank keeps packed copies of its exposures
    exposure_share: TableShare | None = None  # its exposure table, for decode ranks of its host (akv.shm)


class Metadata(_Msg, frozen=True, tag=True, kw_only=True):
    """Server → client: the requested ranks, and the server's proof of the secret."""

    ranks: Annotated[list[RankInfo], msgspec.Meta(max_length=MAX_TP_SIZE)]
    mac: bytes = b""


class RequestInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A request announced by a prefill engine (a router would carry this)."""

    request_id: Name
    # flat for a one-group cache, else per group
    block_ids: (
        Annotated[list[int], msgspec.Meta(max_length=MAX_LIST)]
        | Annotated[
            dict[str, Annotated[list[int], msgspec.Meta(max_length=MAX_LIST)]], msgspec.Meta(max_length=64)
        ]
    )
    seed: int = 0
    num_tokens: int = 0  # 0: the blocks are full
    lease_s: float = 0.0  # the lease it was exposed with (0: the engine's default)
    generation: int = 0  # the exposure's generation (Producer.expose's return; 0: unknown)


class ListRequests(_Msg, frozen=True, tag=True, kw_only=True):
    """Client → server (after authentication): which requests are exposed."""


class KeepAlive(_Msg, frozen=True, tag=True, kw_only=True):
    """Client → server (after authentication): the connection stays open as a watch of the
    server's process; the server answers nothing (TCP's acknowledgements are the answer)."""


class Requests(_Msg, frozen=True, tag=True, kw_only=True):
    """Server → client: the announced requests, with the server's MAC over the transcript."""

    items: Annotated[list[RequestInfo], msgspec.Meta(max_length=MAX_LIST)]
    mac: bytes = b""


class Error(_Msg, frozen=True, tag=True, kw_only=True):
    """Either side: why the exchange stops. ``code`` is machine readable."""

    code: Literal["version", "incompatible", "auth", "protocol", "busy", "config", "unknown_rank", "register"]
    message: Annotated[str, msgspec.Meta(max_length=4096)]
    fields: Annotated[list[Name], msgspec.Meta(max_length=256)] = msgspec.field(default_factory=list)


Message = (
    Hello
    | Challenge
    | MetadataRequest
    | Metadata
    | ListRequests
    | Requests
    | Error
    | Register
    | Registered
    | KeepAlive
)


class _Probe(msgspec.Struct):
    type: str = ""
    v: int = -1


_probe = msgspec.msgpack.Decoder(_Probe)
_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


def encode_body(message: Message) -> bytes:
    """The msgpack body of a message (what a frame carries, and what a transcript records)."""
    return _encoder.encode(message)


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
    decode_rank: TpRank
    decode_tp: TpSize
    request_ids: Annotated[list[Name], msgspec.Meta(max_length=MAX_LIST)]
    # "done": the digest of each request's block ids (akv.exposure.digest)
    digests: Annotated[list[int], msgspec.Meta(max_length=MAX_LIST)] = []
    # "done": the exposure generation each reader started under (0: not bound to one)
    generations: Annotated[list[int], msgspec.Meta(max_length=MAX_LIST)] = []


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


def merge_done_notices(notices: list[bytes]) -> bytes:
    """One "done" notice naming every request of ``notices`` (all "done" notices of one
    decode rank, as `akv.runtime.session.TransferSession.done_notice` makes them), in order:
    a prefill rank applies it as it would apply each of them."""
    if len(notices) == 1:
        return notices[0]
    parts = [decode_notice(raw) for raw in notices]
    first = parts[0]
    for part in parts:
        if (part.kind, part.engine_id, part.decode_rank, part.decode_tp) != (
            "done",
            first.engine_id,
            first.decode_rank,
            first.decode_tp,
        ) or not len(part.request_ids) == len(part.digests) == len(part.generations or part.digests):
            raise ProtocolError("only the done notices of one decode rank merge")
    bound = any(part.generations for part in parts)
    return encode_notice(
        Notice(
            "done",
            first.engine_id,
            first.decode_rank,
            first.decode_tp,
            [rid for part in parts for rid in part.request_ids],
            [d for part in parts for d in part.digests],
            [g for part in parts for g in (part.generations or [0] * len(part.request_ids))] if bound else [],
        )
    )
