"""Trust on the control plane: a transcript-bound handshake, bounded unauthenticated peers,
bounded sizes, checked rank geometry, empty secrets refused."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import pytest
from anyio.abc import SocketStream

import akv
from akv.protocol.messages import PROTOCOL_VERSION, Hello, encode_frame
from akv.testing import fetch_requests
from tests.conftest import MODEL, cli_spec, make_spec, prefill_engine, prefill_process, verify

pytestmark = pytest.mark.anyio

Mutate = Callable[[str, int, dict[str, Any]], dict[str, Any] | None]


class Relay:
    """A TCP relay between real sockets that can rewrite one handshake message in flight
    (what a man in the middle without the secret can do)."""

    def __init__(self, target: str, mutate: Mutate) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.mutate = mutate
        self.altered = 0

    async def _pump(self, src: SocketStream, dst: SocketStream, direction: str) -> None:
        buf, index = b"", 0
        try:
            while True:
                buf += await src.receive()
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
                    size = struct.unpack(">I", buf[:4])[0]
                    body, buf = buf[4 : 4 + size], buf[4 + size :]
                    changed = self.mutate(direction, index, msgspec.msgpack.decode(body))
                    if changed is not None:
                        body = msgspec.msgpack.encode(changed)
                        self.altered += 1
                    index += 1
                    await dst.send(struct.pack(">I", len(body)) + body)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            await dst.aclose()

    async def _handle(self, client: SocketStream) -> None:
        server = await anyio.connect_tcp(self.host, self.port)
        async with client, server, anyio.create_task_group() as tg:
            tg.start_soon(self._pump, client, server, "c")
            tg.start_soon(self._pump, server, client, "s")

    async def serve(self, *, task_status: Any) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener:
            task_status.started(f"127.0.0.1:{port}")
            await listener.serve(self._handle)


def rewrite(direction: str, index: int, change: Callable[[dict[str, Any]], None]) -> Mutate:
    def mutate(d: str, i: int, msg: dict[str, Any]) -> dict[str, Any] | None:
        if (d, i) != (direction, index):
            return None
        change(msg)
        return msg

    return mutate


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda m: m.__setitem__(key, value)


ALTERATIONS = {
    "hello-agent-name": rewrite("c", 0, _set("agent_name", "rogue-agent")),
    "hello-engine-id": rewrite("c", 0, _set("engine_id", "someone-else")),
    "challenge-engine-id": rewrite("s", 0, _set("engine_id", "forged-engine")),
    "challenge-lease": rewrite("s", 0, _set("lease_s", 9999.0)),
    "metadata-request-ranks": rewrite("c", 1, lambda m: m.__setitem__("ranks", m["ranks"] * 2)),
    "metadata-agent": rewrite("s", 1, lambda m: m["ranks"][0].__setitem__("agent_name", "rogue")),
    "metadata-addresses": rewrite(
        "s",
        1,
        lambda m: m["ranks"][0].__setitem__("region_addrs", [a + 64 for a in m["ranks"][0]["region_addrs"]]),
    ),
}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_relay_altering_any_handshake_message_is_refused(anyio_backend: str) -> None:
    """A relay without the secret, between a real ``akv prefill`` process and a real decode,
    that rewrites any one field of any handshake message (Hello, Challenge, MetadataRequest,
    Metadata) makes the handshake fail with AuthenticationError; the untouched relay works."""
    with prefill_process(1, 4, "--secret", "k", requests=2) as (_proc, endpoint):
        spec = cli_spec("--kv-heads", "4", *MODEL)
        reqs = await fetch_requests(endpoint, spec, "k", "d-relay")
        async with (
            akv.Consumer(
                akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, secret="k", retries=0
            ) as consumer,
            anyio.create_task_group() as tg,
        ):
            for name, mutate in ALTERATIONS.items():
                relay = Relay(endpoint, mutate)
                via = await tg.start(relay.serve)
                with pytest.raises(akv.AuthenticationError):
                    await consumer.connect(via)
                assert relay.altered == 1, name
            relay = Relay(endpoint, lambda d, i, m: None)
            session = await consumer.connect(await tg.start(relay.serve))
            r = reqs[0]
            await (await session.pull(r.request_id, [0, 1, 2, 3], r.block_ids))
            assert verify(consumer, [0, 1, 2, 3], r.seed, range(4))
            tg.cancel_scope.cancel()


def test_empty_secret_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty secret is refused the same from ``ControlServer(secret="")``, ``AKV_SECRET=``
    and ``--secret ""`` (exit 64, one line naming the flag), never read as "no secret"."""
    monkeypatch.delenv("AKV_SECRET", raising=False)
    with pytest.raises(akv.ConfigError, match="empty"):
        akv.ControlServer(secret="")
    with pytest.raises(akv.ConfigError, match="empty"):
        akv.ControlServer(host="0.0.0.0", secret=b"")
    monkeypatch.setenv("AKV_SECRET", "")
    with pytest.raises(akv.ConfigError, match="AKV_SECRET is empty"):
        akv.ControlServer()
    env = {k: v for k, v in os.environ.items() if k != "AKV_SECRET"}
    for host in ("127.0.0.1", "0.0.0.0"):
        argv = ["prefill", "--tp-size", "1", "--kv-heads", "2", "--host", host, "--secret", ""]
        proc = subprocess.run(
            [sys.executable, "-m", "akv", *argv], capture_output=True, text=True, timeout=60, env=env
        )
        assert proc.returncode == 64 and "--secret is empty" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def hello_of(**overrides: object) -> Hello:
    """A Hello from rank 0 of 1 of engine "intruder" on `make_spec`'s cache, with ``overrides``."""
    spec = make_spec()
    fields: dict[str, object] = dict(
        engine_id="intruder",
        tp_rank=0,
        tp_size=1,
        spec=spec.to_cache(),
        compat=spec.compat_hash(),
        nonce=b"n" * 16,
    )
    fields.update(overrides)
    return Hello(**fields)  # type: ignore[arg-type]


def raw_hello(**overrides: object) -> bytes:
    return encode_frame(hello_of(**overrides))


def unbounded_hello(tp_size: int) -> bytes:
    msg = msgspec.msgpack.decode(raw_hello()[4:])
    msg["tp_size"] = tp_size
    body = msgspec.msgpack.encode(msg)
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_slow_loris_cannot_lock_out_a_real_decode(anyio_backend: str) -> None:
    """100 connections that sent a valid Hello (no secret needed) and then stay idle, and 20
    that trickle a byte every 0.4 s: a real decode still handshakes and pulls during the
    attack, and a trickling connection is cut at the handshake deadline, not kept alive."""
    with prefill_process(1, 4, "--secret", "k", requests=2) as (proc, endpoint):
        spec = cli_spec("--kv-heads", "4", *MODEL)
        host, port = endpoint.rsplit(":", 1)
        hello = raw_hello()
        idle: list[socket.socket] = []
        for _ in range(100):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(hello)
            idle.append(s)
        tricklers = [socket.create_connection((host, int(port)), timeout=5) for _ in range(20)]
        started = time.monotonic()
        try:
            async with anyio.create_task_group() as tg:

                async def trickle() -> None:
                    for i in range(40):  # 16 s of one byte at a time: longer than any deadline
                        alive = 0
                        for s in tricklers:
                            try:
                                s.send(hello[i : i + 1])
                                alive += 1
                            except OSError:
                                pass
                        if not alive:
                            return
                        await anyio.sleep(0.4)

                tg.start_soon(trickle)
                await anyio.sleep(0.5)
                with anyio.fail_after(10):
                    reqs = await fetch_requests(endpoint, spec, "k", "legit")
                    async with akv.Consumer(
                        akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, secret="k"
                    ) as consumer:
                        session = await consumer.connect(endpoint)
                        r = reqs[1]
                        await (await session.pull(r.request_id, [4, 5, 6, 7], r.block_ids))
                        assert verify(consumer, [4, 5, 6, 7], r.seed, range(4))
                # the last trickler still open is closed by the server at its handshake deadline
                assert await anyio.to_thread.run_sync(closed_by_server, tricklers[-1])
                assert time.monotonic() - started < 10
                tg.cancel_scope.cancel()
        finally:
            for s in idle + tricklers:
                s.close()
        assert proc.poll() is None


def closed_by_server(s: socket.socket) -> bool:
    """Wait (up to 12 s) for the server to close ``s``: an orderly close or a reset."""
    s.settimeout(12)
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


async def authenticate_and_hold(ep: akv.Endpoint, hello: Hello, secret: bytes) -> SocketStream:
    """Run a whole authenticated handshake over a raw connection and keep it open."""
    from akv.protocol.handshake import ClientConversation
    from akv.protocol.messages import FrameBuffer, decode_message

    stream = await anyio.connect_tcp(ep.host, ep.port)
    frames, pending = FrameBuffer(1 << 26), []
    conv = ClientConversation(hello, secret, lambda ch: [0])
    out = conv.start()
    while out is not None:
        await stream.send(encode_frame(out))
        while not pending:
            pending.extend(frames.feed(await stream.receive()))
        body = pending.pop(0)
        out = conv.receive(decode_message(body), body)
    return stream


async def test_busy_server_is_retried_within_connect_timeout() -> None:
    """A server whose every connection slot is taken by authenticated peers answers ``busy``;
    a decode retries within its connect timeout and succeeds once a slot frees, and fails
    with ServerBusyError when none does."""
    spec = make_spec()
    async with anyio.create_task_group() as tg:
        server = akv.ControlServer(secret="s", max_connections=1)
        await tg.start(server.serve)
        async with akv.Producer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, server=server):
            from akv.runtime.client import client_handshake

            ep = server.endpoint
            hello = hello_of(engine_id="holder", nonce=b"h" * 16)
            holder = await authenticate_and_hold(ep, hello, b"s")
            assert server.active == 1 and server.unauthenticated == 0
            hello2 = msgspec.structs.replace(hello, engine_id="waiter")
            with pytest.raises(akv.ServerBusyError):
                await client_handshake(
                    ep, hello2, secret=b"s", choose_ranks=lambda ch: [0], connect_timeout=0.5
                )

            async def free_later() -> None:
                await anyio.sleep(0.3)
                await holder.aclose()

            tg.start_soon(free_later)
            result = await client_handshake(
                ep, hello2, secret=b"s", choose_ranks=lambda ch: [0], connect_timeout=3, backoff=0.05
            )
            assert 0 in result.ranks
        tg.cancel_scope.cancel()


async def test_peer_sizes_are_bounded_naming_field_and_bound() -> None:
    """A Hello stating TP size 2e7 gets an Error naming ``tp_size`` and the bound, at once and
    with nothing allocated; an etcd record with such a TP size is refused the same way."""
    from akv.runtime.discovery import RankRecord

    async with prefill_engine(make_spec(), 1) as engine:
        ep = engine.server.endpoint
        async with await anyio.connect_tcp(ep.host, ep.port) as s:
            started = time.monotonic()
            await s.send(unbounded_hello(20_000_000))
            reply = await s.receive()
        assert time.monotonic() - started < 1
        err = msgspec.msgpack.decode(reply[4:])
        assert err["type"] == "Error" and err["code"] == "protocol"
        assert "tp_size" in err["message"] and "1024" in err["message"], err["message"]
    record = b'{"engine_id":"e","tp_rank":0,"tp_size":20000000,"host":"h","port":1,"v":%d}' % PROTOCOL_VERSION
    with pytest.raises(msgspec.ValidationError, match=r"1024.*tp_size"):
        msgspec.json.decode(record, type=RankRecord)
    with pytest.raises(akv.ConfigError, match="tp_size 20000000 is outside"):
        RankRecord.create("e", 0, 20_000_000, "h:1")


@pytest.mark.parametrize(
    "change,field",
    [
        ({"block_size": 8}, "kv.block_size"),
        ({"layout": "NHD"}, "kv.layout"),
        ({"dtype": "bfloat16"}, "kv.dtype"),
    ],
)
async def test_rank_with_other_geometry_is_refused_by_its_bootstrap(
    change: dict[str, object], field: str
) -> None:
    """A rank whose block size, layout or dtype differs from rank 0's is refused when it
    registers, with IncompatiblePeerError naming the field; nothing of it is registered."""
    spec = make_spec(kv_heads=4)
    other = make_spec(kv_heads=4, **change)
    async with akv.Producer(akv.allocate_kv_cache(spec, 0, 2), spec, tp_rank=0, tp_size=2) as rank0:
        bootstrap = str(rank0.endpoint)
        with pytest.raises(akv.IncompatiblePeerError) as info:
            async with akv.Producer(
                akv.allocate_kv_cache(other, 1, 2), other, tp_rank=1, tp_size=2, bootstrap=bootstrap
            ):
                pass
        assert field in info.value.fields and field in str(info.value)
        assert rank0.server.registered == {}
