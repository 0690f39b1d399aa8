"""The frame decoder and the handshake state machine under random input (hypothesis)."""

from __future__ import annotations

import contextlib
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.errors import AkvError, FrameError, ProtocolError
from akv.geometry.spec import KVSpec
from akv.protocol.handshake import ServerConversation, Transcript
from akv.protocol.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Error,
    FrameBuffer,
    Hello,
    Metadata,
    MetadataRequest,
    Notice,
    RankInfo,
    decode_message,
    decode_notice,
    encode_body,
    encode_frame,
    encode_notice,
    merge_done_notices,
)

SPEC = KVSpec.create(layers=2, num_blocks=8, block_size=4, kv_heads=4, head_dim=8).to_cache()


class Rank:
    engine_id = "p"
    cache = SPEC
    tp_rank = 0
    tp_size = 1
    lease_s = 1.0

    def __init__(self) -> None:
        self.peers: list[tuple[str, int, int]] = []

    def rank_info(self) -> RankInfo:
        return RankInfo(
            tp_rank=0, agent_name="a", agent_metadata=b"SECRET-METADATA", region_addrs=[1, 2, 3, 4]
        )

    def peer_connected(self, engine_id: str, decode_rank: int, decode_tp: int, agent_name: str) -> None:
        self.peers.append((engine_id, decode_rank, decode_tp))


def hello(**kw: object) -> Hello:
    fields: dict[str, object] = dict(
        engine_id="d", tp_rank=0, tp_size=1, spec=SPEC, compat=SPEC.compat_hash(), nonce=b"n" * 16
    )
    fields.update(kw)
    return Hello(**fields)  # type: ignore[arg-type]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=8))
def test_frame_buffer_never_raises_untyped(chunks: list[bytes]) -> None:
    """Arbitrary bytes give frames, or FrameError/ProtocolError, never another exception."""
    buf = FrameBuffer(256)
    try:
        for chunk in chunks:
            for body in buf.feed(chunk):
                with contextlib.suppress(AkvError):
                    decode_message(body)
    except FrameError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 64))
def test_frames_split_anywhere_reassemble(junk: bytes, cut: int) -> None:
    """A frame fed in two arbitrary pieces decodes to the same message."""
    msg = hello(engine_id=junk.hex())
    data = encode_frame(msg)
    cut = min(cut, len(data))
    buf = FrameBuffer(1 << 16)
    bodies = buf.feed(data[:cut]) + buf.feed(data[cut:])
    assert [decode_message(b) for b in bodies] == [msg] and buf.pending == 0


def test_oversized_frame_rejected_before_buffering() -> None:
    """A length prefix above the limit is a FrameError at once, not a buffer."""
    with pytest.raises(FrameError, match="exceeds"):
        FrameBuffer(1024).feed(struct.pack(">I", 10_000))


any_message = st.one_of(
    st.builds(hello, engine_id=st.text(max_size=5), tp_rank=st.integers(-2, 4), tp_size=st.integers(-1, 4)),
    st.builds(MetadataRequest, ranks=st.lists(st.integers(-1, 3), max_size=3), mac=st.binary(max_size=32)),
    st.builds(Error, code=st.just("protocol"), message=st.text(max_size=5)),
    st.just(msgspec.msgpack.encode({"type": "Hello", "v": PROTOCOL_VERSION})),
    st.binary(max_size=40),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(any_message, max_size=6), st.booleans())
def test_conversation_never_leaks_metadata_without_auth(msgs: list[object], with_secret: bool) -> None:
    """Random message sequences: replies are well formed, and with a secret no Metadata is
    ever sent without a valid MAC."""
    conv = ServerConversation({0: Rank()}, b"k" if with_secret else None)
    for m in msgs:
        if isinstance(m, bytes):
            try:
                m = decode_message(m)
            except AkvError as exc:
                m = exc
        replies, done = conv.receive(m)  # type: ignore[arg-type]
        for r in replies:
            encode_frame(r)  # every reply encodes
            if isinstance(r, Metadata) and with_secret:
                raise AssertionError("metadata without authentication")
        if done:
            assert conv.receive(hello()) == ([], True)
            break


def test_conversation_happy_path_and_mac_check() -> None:
    """Hello, Challenge, MetadataRequest with the right MAC gives Metadata; a wrong MAC an auth error."""
    rank = Rank()
    conv = ServerConversation({0: rank}, b"k")
    (challenge,), done = conv.receive(hello())
    assert isinstance(challenge, Challenge) and challenge.auth and not done
    (err,), done = conv.receive(MetadataRequest(ranks=[0], mac=b"x" * 32))
    assert isinstance(err, Error) and err.code == "auth" and done
    conv = ServerConversation({0: rank}, b"k")
    transcript = Transcript()
    transcript.add(b"c", encode_body(hello()))
    (challenge,), _ = conv.receive(hello())
    transcript.add(b"s", encode_body(challenge))
    mac = transcript.mac(b"k", b"akv-client", b"c", MetadataRequest(ranks=[0]))
    (meta,), done = conv.receive(MetadataRequest(ranks=[0], mac=mac))
    assert isinstance(meta, Metadata) and meta.ranks[0].agent_metadata == b"SECRET-METADATA" and not done
    assert rank.peers == [("d", 0, 1)]


def test_failing_rank_fails_only_that_handshake() -> None:
    """A hosted rank that raises while describing itself ends that handshake with an Error."""
    from akv.errors import ClosedError

    class Closing(Rank):
        def rank_info(self) -> RankInfo:
            raise ClosedError("the producer is not running")

    conv = ServerConversation({0: Closing()}, None)
    conv.receive(hello())
    (err,), done = conv.receive(MetadataRequest(ranks=[0]))
    assert isinstance(err, Error) and err.code == "config" and "not running" in err.message and done


def test_incompatible_hello_names_fields() -> None:
    """A Hello with another model shape is refused naming the differing fields."""
    other = KVSpec.create(layers=3, num_blocks=8, block_size=4, kv_heads=4, head_dim=8, dtype="float16")
    (err,), _done = ServerConversation({0: Rank()}, None).receive(
        hello(spec=other.to_cache(), compat=other.compat_hash())
    )
    assert (
        isinstance(err, Error) and err.code == "incompatible" and set(err.fields) == {"kv.layers", "kv.dtype"}
    )
    assert "group 'kv' layers: decode=[0, 1, 2] prefill=[0, 1]" in err.message


def test_wrong_version_is_reported_as_such() -> None:
    """A frame of another protocol version decodes to a ProtocolError naming both versions."""
    body = msgspec.msgpack.encode({"type": "Hello", "v": 7})
    with pytest.raises(AkvError, match="version 7"):
        decode_message(body)
    (err,), _ = ServerConversation({0: Rank()}, None).receive(AkvError("x"))
    assert isinstance(err, Error)


@given(st.binary(max_size=80))
def test_notice_decoder_rejects_garbage_typed(data: bytes) -> None:
    """Garbage notifications raise ProtocolError; real ones round-trip."""
    with contextlib.suppress(AkvError):
        decode_notice(data)
    n = Notice("done", "e", 1, 2, ["a", "b"])
    assert decode_notice(encode_notice(n)) == n


def test_merged_done_notices_keep_each_requests_digest_and_generation() -> None:
    """Done notices of one decode rank merge into one that names every request, in order,
    each with its own digest and generation (0 for a pull bound to none); notices of other
    ranks or kinds do not merge."""
    a = Notice("done", "d", 0, 1, ["a"], [11])
    b = Notice("done", "d", 0, 1, ["b"], [22], [5])
    c = Notice("done", "d", 0, 1, ["c"], [33])
    merged = decode_notice(merge_done_notices([encode_notice(n) for n in (a, b, c)]))
    assert merged == Notice("done", "d", 0, 1, ["a", "b", "c"], [11, 22, 33], [0, 5, 0])
    unbound = decode_notice(merge_done_notices([encode_notice(a), encode_notice(c)]))
    assert unbound == Notice("done", "d", 0, 1, ["a", "c"], [11, 33])
    assert merge_done_notices([encode_notice(a)]) == encode_notice(a)
    for other in (Notice("done", "d", 1, 2, ["x"], [1]), Notice("extend", "d", 0, 1, ["x"])):
        with pytest.raises(ProtocolError, match="merge"):
            merge_done_notices([encode_notice(a), encode_notice(other)])


def test_hello_with_an_invalid_cache_is_refused_not_fatal() -> None:
    """A Hello whose cache description was never validated (block size 0, which would divide
    by zero; a negative block size) gets a ``config`` Error, before any secret is involved,
    and the conversation ends normally instead of raising."""
    import msgspec

    for block_size in (0, -16):
        bad = msgspec.structs.replace(
            SPEC, groups=tuple(msgspec.structs.replace(g, block_size=block_size) for g in SPEC.groups)
        )
        (err,), done = ServerConversation({0: Rank()}, "s3cret").receive(hello(spec=bad))
        assert isinstance(err, Error) and err.code == "config" and done
        assert "block_size" in err.message
