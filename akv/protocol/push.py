"""Push-mode notices (pure): what a decode rank and the prefill ranks writing into its
blocks tell each other over NIXL notifications.

Decode -> prefill (sent by the decode rank's agent, accepted only from the agent that
handshook as that decode rank):

* ``announce``: request ``request_id`` of exposure ``generation`` goes into these local
  blocks (``local_ids``, ``remote_ids``, ``num_tokens``: exactly a `PullRequest`'s fields);
  writes are granted under ``grant``, a random id unique to this pull. With ``staging``
  (packed push), a writer that keeps a packed copy of the request writes it there instead,
  at the offsets both sides derive from the pull (`akv.pack_layout.plan_runs`),
  and the decode rank scatters it into the blocks.
* ``stop``: the grant is withdrawn (the pull was cancelled, timed out or lost a writer):
  post nothing more for it and confirm with ``stopped`` once nothing posted can still land.
* ``bye``: the decode rank closed its session: forget its agent.

Prefill -> decode (sent by the writer's agent; the decode rank binds each to the writer it
expects for that grant, request and generation):

* ``pushed``: every byte this writer had to write for the grant has landed (``code``
  ``"packed"``: into the staging range, from its packed copy; ``""``: into the blocks).
* ``stopped``: answers ``stop``: none of this writer's writes for the grant can land any more.
* ``failed``: the writer cannot serve the grant (``message`` says why: lease expired, request
  not exposed, another generation, bad block ids); it posted nothing that can still land.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from akv.errors import ProtocolError
from akv.protocol.messages import MAX_LIST, Name, TpRank, TpSize

__all__ = ["PushNotice", "decode_push", "encode_push", "is_push", "reply"]

_MAGIC = b"akvP"

Ids = Annotated[list[int], msgspec.Meta(max_length=MAX_LIST)]
Kind = Literal["announce", "stop", "bye", "pushed", "stopped", "failed"]


class PushNotice(msgspec.Struct, frozen=True, array_like=True, kw_only=True):
    """One push-mode notice (see the module)."""

    kind: Kind
    engine_id: Name  # the decode engine
    decode_rank: TpRank
    decode_tp: TpSize
    request_id: Name = ""
    grant: int = 0
    generation: int = 0
    prefill_rank: int = -1  # prefill -> decode: the writer's TP rank
    local_ids: Ids | Annotated[dict[Name, Ids], msgspec.Meta(max_length=64)] = []
    remote_ids: Ids | Annotated[dict[Name, Ids], msgspec.Meta(max_length=64)] = []
    num_tokens: int = 0  # 0: every listed block is full
    # "failed": why, for the decode rank's typed error: expired, released, reexposed, outside,
    # not_exposed, blocks, config, transfer, busy
    code: Name = ""
    message: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    # "announce" (appended): where in the decode rank's staging area the writers put their
    # packed copies (0: write the paged blocks); "pushed": code "packed" says the writer did
    staging: int = 0


def reply(
    notice: PushNotice, kind: Kind, *, prefill_rank: int = -1, code: str = "", message: str = ""
) -> PushNotice:
    """A notice of ``kind`` about the grant ``notice`` names: the same decode rank, request,
    grant and generation (a decode rank's ``stop`` of its announcement; a writer's
    ``pushed``, ``stopped`` or ``failed``, with its ``prefill_rank``, ``code`` and
    ``message``, cut to the field's bound)."""
    return PushNotice(
        kind=kind,
        engine_id=notice.engine_id,
        decode_rank=notice.decode_rank,
        decode_tp=notice.decode_tp,
        request_id=notice.request_id,
        grant=notice.grant,
        generation=notice.generation,
        prefill_rank=prefill_rank,
        code=code,
        message=message[:1024],
    )


_decoder = msgspec.msgpack.Decoder(PushNotice)
_encoder = msgspec.msgpack.Encoder()


def is_push(data: bytes) -> bool:
    """True if a notification is a push-mode notice (not an ``akv.protocol.messages.Notice``)."""
    return data.startswith(_MAGIC)


def encode_push(notice: PushNotice) -> bytes:
    """The bytes of a push notice."""
    return _MAGIC + _encoder.encode(notice)


def decode_push(data: bytes) -> PushNotice:
    """Parse a push notice; [`ProtocolError`][akv.errors.ProtocolError] if it is not one."""
    if not data.startswith(_MAGIC):
        raise ProtocolError("not an akv push notice")
    try:
        return _decoder.decode(data[len(_MAGIC) :])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed akv push notice: {exc}") from None
