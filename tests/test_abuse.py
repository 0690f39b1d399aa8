"""An abused control port: a running ``akv prefill`` keeps serving real handshakes promptly."""

from __future__ import annotations

import os
import socket
import struct
import time

import msgspec
import pytest

from akv.protocol.messages import PROTOCOL_VERSION
from akv.testing import fetch_requests
from tests.conftest import MODEL, cli_spec, prefill_process

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def connect(endpoint: str) -> socket.socket:
    host, port = endpoint.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    s.settimeout(5)
    return s


def poke(endpoint: str, payload: bytes) -> bytes:
    """Send raw bytes, return whatever the server answers before closing."""
    with connect(endpoint) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        return b"".join(chunks)


def frame(obj: object) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(body)) + body


ABUSE = {
    "random-bytes": os.urandom(4096),
    "oversized-length": struct.pack(">I", 2**31) + b"x" * 100,
    "truncated-frame": struct.pack(">I", 1000) + b"y" * 10,
    "wrong-type": frame({"type": "Metadata", "v": PROTOCOL_VERSION, "ranks": []}),
    "wrong-version": frame({"type": "Hello", "v": 99}),
    "bad-fields": frame({"type": "Hello", "v": PROTOCOL_VERSION, "engine_id": 5}),
    "not-a-map": frame([1, 2, 3]),
    "request-before-hello": frame({"type": "MetadataRequest", "v": PROTOCOL_VERSION, "ranks": [0]}),
    "list-before-auth": frame({"type": "ListRequests", "v": PROTOCOL_VERSION}),
    "empty-frame": struct.pack(">I", 0),
}


async def test_abuse_leaves_prefill_serving_with_bounded_memory() -> None:
    """Garbage, oversized and truncated frames, wrong messages, a flood and idle connections
    held open: real handshakes keep succeeding promptly and memory stays bounded."""
    with prefill_process(1, 4, "--secret", "k", requests=2) as (proc, endpoint):
        spec = cli_spec("--kv-heads", "4", *MODEL)

        async def real_handshake() -> float:
            started = time.monotonic()
            reqs = await fetch_requests(endpoint, spec, "k", "probe")
            assert len(reqs) == 2
            return time.monotonic() - started

        await real_handshake()
        base = rss_kib(proc.pid)
        for name, payload in ABUSE.items():
            reply = poke(endpoint, payload)
            assert b"agent_metadata" not in reply, name  # never any agent metadata
            assert await real_handshake() < 2.0, name
        # a flood of short connections
        for _ in range(300):
            poke(endpoint, os.urandom(64))
        assert await real_handshake() < 2.0
        # more idle connections than the server's cap, held open
        idle = [connect(endpoint) for _ in range(150)]
        try:
            assert await real_handshake() < 2.0
        finally:
            for s in idle:
                s.close()
        assert rss_kib(proc.pid) - base < 64 * 1024, "memory grew by more than 64 MiB"
        assert proc.poll() is None, "the prefill process died"


async def test_wrong_secret_gets_no_metadata() -> None:
    """A client with the wrong secret is refused and never receives agent metadata."""
    with prefill_process(1, 4, "--secret", "right", requests=1) as (_proc, endpoint):
        spec = cli_spec("--kv-heads", "4", *MODEL)
        import akv

        with pytest.raises(akv.AuthenticationError):
            await fetch_requests(endpoint, spec, "wrong", "intruder")
        assert len(await fetch_requests(endpoint, spec, "right", "friend")) == 1
