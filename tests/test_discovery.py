"""etcd discovery against a real etcd server: registration under leases, resolution, faults."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import anyio
import httpx
import pytest

import akv
from akv.protocol.address import (
    BootstrapAddress,
    Endpoint,
    EtcdAddress,
    RankListAddress,
    parse_engine_address,
)
from akv.protocol.messages import PROTOCOL_VERSION
from akv.runtime.discovery import EtcdRegistry, RankRecord
from akv.testing import EtcdServer, spawn_registrant
from tests.conftest import stop

TTL = 1.0  # etcd's minimum with the test server's election settings
MARGIN = 1.5  # etcd checks expiry every 0.5 s; slack for a loaded 2-core CI machine


# -- engine addresses (pure) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:5555", BootstrapAddress(Endpoint("127.0.0.1", 5555))),
        ("[::1]:5555", BootstrapAddress(Endpoint("::1", 5555))),
        ("a:1, b:2,c:3", RankListAddress((Endpoint("a", 1), Endpoint("b", 2), Endpoint("c", 3)))),
        ("etcd://127.0.0.1:2379/prefill-0", EtcdAddress((Endpoint("127.0.0.1", 2379),), "prefill-0")),
        (
            "etcd://h1:2379,[::1]:2380/my_engine.v2",
            EtcdAddress((Endpoint("h1", 2379), Endpoint("::1", 2380)), "my_engine.v2"),
        ),
    ],
)
def test_engine_address_forms(text: str, want: object) -> None:
    """Each engine address form parses to its dataclass and prints back to a parseable string."""
    got = parse_engine_address(text)
    assert got == want
    assert parse_engine_address(str(got)) == got
    assert parse_engine_address(got) is got


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("", "HOST:PORT"),
        ("host", "HOST:PORT"),
        ("a:1,,b:2", "empty endpoint"),
        ("a:1,a:1", "twice"),
        ("http://a:1/x", "unknown scheme"),
        ("etcd://a:2379", "etcd://HOST:PORT"),
        ("etcd://a:2379/", "etcd://HOST:PORT"),
        ("etcd:///engine", "etcd://HOST:PORT"),
        ("etcd://a:2379/bad/id", "letters, digits"),
        ("etcd://a:2379/bad id", "letters, digits"),
        ("etcd://a:99999/e", "HOST:PORT"),
    ],
)
def test_malformed_engine_address(text: str, hint: str) -> None:
    """A malformed engine address raises ConfigError saying what to write."""
    with pytest.raises(akv.ConfigError, match=hint):
        parse_engine_address(text)


def test_rank_record_validation() -> None:
    """A rank record needs a valid engine id, a rank inside its TP size and a HOST:PORT endpoint."""
    rec = RankRecord.create("p", 1, 2, "10.0.0.1:7000", compat="abc")
    assert rec.endpoint == Endpoint("10.0.0.1", 7000) and rec.v == PROTOCOL_VERSION
    for args in (("bad/id", 0, 1, "a:1"), ("p", 2, 2, "a:1"), ("p", 0, 1, "a")):
        with pytest.raises(akv.ConfigError):
            RankRecord.create(*args)  # type: ignore[arg-type]


# -- a real etcd ---------------------------------------------------------------------------


def engine_name() -> str:
    return f"e-{uuid.uuid4().hex[:10]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def ranks_of(registry: EtcdRegistry, engine: str) -> set[int]:
    return set((await registry.list_engines()).get(engine, {}))


async def seconds_until_gone(registry: EtcdRegistry, engine: str, rank: int, since: float) -> float:
    with anyio.fail_after(TTL + MARGIN + 5):
        while rank in await ranks_of(registry, engine):
            await anyio.sleep(0.01)
    return time.monotonic() - since


async def test_register_resolve_list(etcd: EtcdServer, anyio_backend: str) -> None:
    """Registered ranks resolve with their endpoints, list under their engine, and go on clean exit."""
    engine = engine_name()
    async with EtcdRegistry(etcd.endpoint, ttl=TTL) as reg:
        async with anyio.create_task_group() as tg:
            for r in range(3):
                rec = RankRecord.create(engine, r, 3, f"127.0.0.1:{7000 + r}", compat="c0ffee")
                assert await tg.start(reg.keep_registered, rec) is True
            ranks = await reg.resolve(engine, timeout=5)
            assert {r: str(rec.endpoint) for r, rec in ranks.items()} == {
                r: f"127.0.0.1:{7000 + r}" for r in range(3)
            }
            assert all(rec.tp_size == 3 and rec.compat == "c0ffee" for rec in ranks.values())
            assert (await reg.list_engines())[engine] == ranks
            await anyio.sleep(TTL * 2)  # outlives the TTL: keep-alives hold the keys
            assert await ranks_of(reg, engine) == {0, 1, 2}
            tg.cancel_scope.cancel()
        assert await ranks_of(reg, engine) == set()  # revoked on exit, no TTL wait


async def test_record_holds_nothing_secret(etcd: EtcdServer, anyio_backend: str) -> None:
    """The etcd value of a rank holds only its engine, rank, TP size, endpoint, version and compat hash."""
    engine = engine_name()
    async with EtcdRegistry(etcd.endpoint, ttl=TTL) as reg, anyio.create_task_group() as tg:
        await tg.start(reg.keep_registered, RankRecord.create(engine, 0, 1, "127.0.0.1:7000"))
        async with httpx.AsyncClient(trust_env=False) as http:
            key = f"/akv/engines/{engine}/ranks/0".encode()
            resp = await http.post(f"http://{etcd.endpoint}/v3/kv/range", json={"key": b64(key)})
        (kv,) = resp.json()["kvs"]
        value = json.loads(unb64(kv["value"]))
        assert set(value) == {"engine_id", "tp_rank", "tp_size", "host", "port", "v", "compat"}
        assert int(kv["lease"]) != 0
        tg.cancel_scope.cancel()


def b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    import base64

    return base64.b64decode(text)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
async def test_dead_rank_key_expires(etcd: EtcdServer, anyio_backend: str, sig: signal.Signals) -> None:
    """A killed or hung rank's key vanishes within the lease TTL; a hung rank registers again on resuming."""
    engine = engine_name()
    proc = spawn_registrant(etcd.endpoint, engine, 0, 1, "127.0.0.1:7000", ttl=TTL, backend=anyio_backend)
    try:
        async with EtcdRegistry(etcd.endpoint, ttl=TTL) as reg:
            assert await ranks_of(reg, engine) == {0}
            t0 = time.monotonic()
            os.kill(proc.pid, sig)
            gone = await seconds_until_gone(reg, engine, 0, t0)
            print(f"{sig.name}: key gone {gone:.2f} s after the signal (ttl {TTL} s)")
            assert gone <= TTL + MARGIN
            if sig == signal.SIGSTOP:
                os.kill(proc.pid, signal.SIGCONT)
                assert set(await reg.resolve(engine, need=[0], timeout=5)) == {0}
    finally:
        stop(proc)


async def test_resolve_waits_for_late_rank(etcd: EtcdServer, anyio_backend: str) -> None:
    """resolve waits until every rank of the engine's TP size is registered."""
    engine = engine_name()
    async with EtcdRegistry(etcd.endpoint, ttl=TTL) as reg, anyio.create_task_group() as tg:
        await tg.start(reg.keep_registered, RankRecord.create(engine, 0, 2, "127.0.0.1:7000"))

        async def late() -> None:
            await anyio.sleep(0.4)
            await tg.start(reg.keep_registered, RankRecord.create(engine, 1, 2, "127.0.0.1:7001"))

        tg.start_soon(late)
        t0 = time.monotonic()
        ranks = await reg.resolve(engine, timeout=5)
        assert set(ranks) == {0, 1} and time.monotonic() - t0 >= 0.35
        assert set(await reg.resolve(engine, need=[1], timeout=1)) == {0, 1}
        tg.cancel_scope.cancel()


async def test_resolve_timeout_names_missing_ranks(etcd: EtcdServer, anyio_backend: str) -> None:
    """resolve raises MissingRanksError naming the missing ranks and the etcd endpoint after its timeout."""
    engine = engine_name()
    async with EtcdRegistry(etcd.endpoint, ttl=TTL) as reg, anyio.create_task_group() as tg:
        await tg.start(reg.keep_registered, RankRecord.create(engine, 0, 3, "127.0.0.1:7000"))
        t0 = time.monotonic()
        with pytest.raises(akv.MissingRanksError, match=r"ranks \[1, 2\]") as info:
            await reg.resolve(engine, timeout=0.5)
        assert 0.5 <= time.monotonic() - t0 < 2
        assert info.value.missing == (1, 2) and etcd.endpoint in str(info.value)
        assert isinstance(info.value, akv.DiscoveryError) and isinstance(info.value, akv.HandshakeError)
        with pytest.raises(akv.MissingRanksError, match="no rank"):
            await reg.resolve(engine_name(), timeout=0.2)
        tg.cancel_scope.cancel()


async def test_stale_and_malformed_entries(etcd: EtcdServer, anyio_backend: str) -> None:
    """Malformed values are skipped and ranks of an older TP size do not mix with the newest one."""
    engine = engine_name()
    async with httpx.AsyncClient(trust_env=False) as http:
        base = f"http://{etcd.endpoint}/v3/kv/put"
        old = RankRecord.create(engine, 3, 4, "127.0.0.1:6003")
        import msgspec

        for key, value in [
            (f"/akv/engines/{engine}/ranks/3", msgspec.json.encode(old)),
            (f"/akv/engines/{engine}/ranks/9", b"not json"),
            (f"/akv/engines/{engine}/other", b"{}"),
        ]:
            (await http.post(base, json={"key": b64(key.encode()), "value": b64(value)})).raise_for_status()
    async with EtcdRegistry(etcd.endpoint, ttl=TTL) as reg, anyio.create_task_group() as tg:
        for r in range(2):
            await tg.start(reg.keep_registered, RankRecord.create(engine, r, 2, f"127.0.0.1:{7000 + r}"))
        assert set(await reg.resolve(engine, timeout=2)) == {0, 1}
        assert set((await reg.list_engines())[engine]) == {0, 1}
        assert set(await reg.resolve(engine, tp_size_hint=4, need=[3], timeout=1)) == {3}
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("wipe", [False, True], ids=["restarted", "data-lost"])
async def test_etcd_restart(own_etcd: EtcdServer, anyio_backend: str, wipe: bool) -> None:
    """etcd stopped mid-run: typed errors while down, the rank keeps running and is found again once etcd returns."""
    engine = engine_name()
    async with EtcdRegistry(own_etcd.endpoint, ttl=TTL) as reg, anyio.create_task_group() as tg:
        await tg.start(reg.keep_registered, RankRecord.create(engine, 0, 1, "127.0.0.1:7000"))
        own_etcd.stop(wipe=wipe)
        with anyio.fail_after(3), pytest.raises(akv.EtcdUnavailableError, match=own_etcd.endpoint):
            await reg.resolve(engine, timeout=5)
        await anyio.sleep(TTL * 2)  # keep-alives fail meanwhile; the lease may lapse
        own_etcd.start()
        t0 = time.monotonic()
        assert set(await reg.resolve(engine, timeout=10)) == {0}
        print(f"wipe={wipe}: resolved {time.monotonic() - t0:.2f} s after etcd returned")
        tg.cancel_scope.cancel()


async def test_unreachable_etcd(anyio_backend: str) -> None:
    """No etcd answering: resolve and list fail fast with EtcdUnavailableError; registration keeps trying."""
    dead = f"127.0.0.1:{free_port()}"
    async with EtcdRegistry(dead, ttl=TTL) as reg:
        t0 = time.monotonic()
        with pytest.raises(akv.EtcdUnavailableError, match=dead) as info:
            await reg.resolve("e", timeout=10)
        assert time.monotonic() - t0 < 2 and info.value.endpoints == (dead,)
        with pytest.raises(akv.EtcdUnavailableError):
            await reg.list_engines()
        async with anyio.create_task_group() as tg:
            assert (
                await tg.start(reg.keep_registered, RankRecord.create("e", 0, 1, "127.0.0.1:7000")) is False
            )
            await anyio.sleep(0.5)  # still retrying, not crashed
            tg.cancel_scope.cancel()


async def test_endpoint_failover(etcd: EtcdServer, anyio_backend: str) -> None:
    """With several etcd endpoints, a dead one is skipped for the next."""
    engine = engine_name()
    endpoints = f"127.0.0.1:{free_port()},{etcd.endpoint}"
    address = parse_engine_address(f"etcd://{endpoints}/{engine}")
    assert isinstance(address, EtcdAddress)
    async with EtcdRegistry(address.etcd, ttl=TTL) as reg, anyio.create_task_group() as tg:
        assert await tg.start(reg.keep_registered, RankRecord.create(engine, 0, 1, "127.0.0.1:7000"))
        assert set(await reg.resolve(address.engine_id, timeout=2)) == {0}
        tg.cancel_scope.cancel()


def test_engines_command(etcd: EtcdServer) -> None:
    """``akv engines --etcd`` prints every registered engine and its ranks."""
    engine = engine_name()
    proc = spawn_registrant(etcd.endpoint, engine, 0, 1, "127.0.0.1:7000", ttl=TTL)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "akv", "engines", "--etcd", etcd.endpoint, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        mine = [row for row in rows if row.get("engine_id") == engine]
        assert mine == [
            {
                "engine_id": engine,
                "tp_rank": 0,
                "tp_size": 1,
                "endpoint": "127.0.0.1:7000",
                "v": PROTOCOL_VERSION,
                "compat": "",
            }
        ]
    finally:
        stop(proc)
