"""In-process behaviour of sessions, producers and pollers with real NIXL agents (UCX loopback)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import anyio
import pytest

import akv
import akv.backends.nixl
from akv.backends import XferHandle, XferState
from akv.backends.nixl import NixlBackend
from akv.protocol.messages import decode_notice
from tests.conftest import decode_engine, decode_rank, make_spec, prefill_engine, verify, wait_for
from tests.transfers import HeldBackend

pytestmark = pytest.mark.anyio


async def test_concurrent_pulls_verify_and_release_once() -> None:
    """Twenty concurrent pulls over P=2 -> D=2 all verify; each rank releases each request once, by read."""
    spec = make_spec(kv_heads=4, num_blocks=128)
    async with prefill_engine(spec, 2) as engine, decode_engine(spec, 2) as consumers:
        sessions = [await c.connect(engine.endpoint) for c in consumers]
        reqs = [
            (f"r{i}", list(range(i * 4, i * 4 + 4)), list(range(127 - i * 4, 123 - i * 4, -1)))
            for i in range(20)
        ]
        for rid, remote, _ in reqs:
            engine.fill(rid, remote, seed=hash(rid) & 0xFFF)
        transfers = [
            await s.pull(akv.PullRequest(request_id=rid, local_block_ids=local, remote_block_ids=remote))
            for rid, remote, local in reqs
            for s in sessions
        ]
        results = [await t for t in transfers]
        assert all(r.bytes > 0 and r.reads == 1 for r in results)
        for rid, _, local in reqs:
            for c in consumers:
                assert verify(c, local, hash(rid) & 0xFFF, range(4))
        await wait_for(lambda: len(engine.releases) == 40)
        assert sorted((r.request_id, r.reason) for r in engine.releases) == sorted(
            (rid, "read") for rid, _, _ in reqs for _ in range(2)
        )
        snap = consumers[0].metrics.snapshot()
        assert snap.counters["transfers"] == 20 and snap.transfers.count == 20
        # every NIXL handle released but the background flush reads, and those once they end
        assert consumers[0].backend.active_transfers == consumers[0].reaper.background
        await wait_for(lambda: not consumers[0].backend.active_transfers)


@pytest.mark.parametrize("same_process", ["auto", "nixl"])
async def test_pulls_launched_together_verify_and_release_once_and_a_bad_one_posts_nothing(
    same_process: str,
) -> None:
    """`pull_many` launches a batch (through the copy path, or NIXL reads with the check in
    shared memory): every pull verifies and each prefill rank releases each request once; a
    batch holding one bad request raises its error and posts nothing of the others (they stay
    exposed and are pulled afterwards); a request that is not exposed fails alone."""
    spec = make_spec(kv_heads=4, num_blocks=128)
    async with (
        prefill_engine(spec, 2) as engine,
        decode_engine(spec, 1, same_process=same_process) as (consumer,),
    ):
        session = await consumer.connect(engine.endpoint)
        reqs = [
            akv.PullRequest(
                request_id=f"r{i}",
                local_block_ids=list(range(i * 3, i * 3 + 3)),
                remote_block_ids=list(range(127 - i * 3, 124 - i * 3, -1)),
            )
            for i in range(12)
        ]
        for r in reqs:
            engine.fill(r.request_id, list(r.remote_block_ids), seed=hash(r.request_id) & 0xFFF)
        bad = akv.PullRequest(request_id="bad", local_block_ids=[0], remote_block_ids=[999])
        posted = consumer.metrics.counters.get("xfers_data", 0)
        with pytest.raises(akv.BlockIdError, match="999"):
            await session.pull_many([*reqs[:6], bad])
        assert consumer.metrics.counters.get("xfers_data", 0) == posted and not consumer.inflight
        assert not engine.releases
        transfers = await session.pull_many(reqs)
        assert [t.request_id for t in transfers] == [r.request_id for r in reqs]
        results = [await t for t in transfers]
        assert {r.path for r in results} == {"copy" if same_process == "auto" else "read"}
        for r in reqs:
            assert verify(consumer, list(r.local_block_ids), hash(r.request_id) & 0xFFF, range(3))
        await wait_for(lambda: len(engine.releases) == 24)
        assert Counter((r.request_id, r.reason) for r in engine.releases) == Counter(
            {(r.request_id, "read"): 2 for r in reqs}
        )
        engine.fill("late", [1, 2], seed=6)
        unexposed = akv.PullRequest(request_id="never", local_block_ids=[40], remote_block_ids=[3])
        late = akv.PullRequest(request_id="late", local_block_ids=[41, 42], remote_block_ids=[1, 2])
        never, ok = await session.pull_many([unexposed, late])
        with pytest.raises(akv.NotExposedError):
            await never
        await ok
        assert verify(consumer, [41, 42], 6, [0, 1])
        assert await session.pull_many([]) == []
        await wait_for(lambda: not consumer.backend.active_transfers)


async def test_a_pull_whose_reads_cannot_be_posted_fails_alone_in_its_batch() -> None:
    """In a `pull_many` batch, the request whose READ cannot be posted gets a transfer that
    raises the error `pull` raises; the others complete, and the failed one's blocks are
    released by lease, not by a notice."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine:
        backend = HeldBackend("held-many-d0")
        async with decode_rank(spec, backend=backend, same_process="nixl") as consumer:
            session = await consumer.connect(engine.endpoint)
            for i in range(4):
                engine.fill(f"r{i}", [i + 1], seed=i)
            backend.posts, backend.fail_post = 0, 3  # the third request's READ
            reqs = [
                akv.PullRequest(request_id=f"r{i}", local_block_ids=[10 + i], remote_block_ids=[i + 1])
                for i in range(4)
            ]
            transfers = await session.pull_many(reqs)
            with pytest.raises(akv.PeerLostError, match="injected"):
                await transfers[2]
            for i in (0, 1, 3):
                await transfers[i]
                assert verify(consumer, [10 + i], i, range(1))
            await wait_for(lambda: len(engine.releases) == 3)
            assert sorted(r.request_id for r in engine.releases) == ["r0", "r1", "r3"]
            assert engine.producers[0].pending == 1


async def test_cancelled_waiter_leaves_no_dangling_transfer() -> None:
    """Cancelling the task awaiting a pull only stops the wait; the read completes and is released."""
    spec = make_spec(num_blocks=64, layers=4, block_size=16, head_dim=64)
    async with prefill_engine(spec, 1) as engine, decode_engine(spec, 1) as (consumer,):
        session = await consumer.connect(engine.endpoint)
        engine.fill("r", list(range(32)), seed=3)
        transfer = await session.pull("r", list(range(32, 64)), list(range(32)))
        with anyio.move_on_after(0):
            await transfer
        result = await transfer  # still completes
        assert transfer.done() and result.bytes == 32 * spec.block_bytes(0, 1) * spec.num_regions
        assert verify(consumer, list(range(32, 64)), 3, range(32))
        assert consumer.backend.active_transfers == consumer.reaper.background and not consumer.inflight
        await wait_for(lambda: [r.reason for r in engine.releases] == ["read"])
        await wait_for(lambda: not consumer.backend.active_transfers)


async def test_partial_prefix_hit_and_full_hit() -> None:
    """A prefix hit reads only the tail; a full hit reads nothing but still lets prefill release."""
    spec = make_spec(kv_heads=2)
    async with prefill_engine(spec, 2) as engine, decode_engine(spec, 1) as (consumer,):
        session = await consumer.connect(engine.endpoint)
        engine.fill("tail", [4, 5, 6, 7], seed=9)
        res = await (await session.pull("tail", [20, 21], [4, 5, 6, 7]))
        assert res.bytes == 2 * spec.block_bytes(0, 1) * spec.num_regions
        assert verify(consumer, [20, 21], 9, [2, 3])
        engine.fill("hit", [8, 9], seed=1)
        res = await (await session.pull("hit", [], [8, 9]))
        assert res.bytes == 0 and res.reads == 0
        await wait_for(lambda: len(engine.releases) == 4)
        assert {r.reason for r in engine.releases} == {"read"}


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        ([0, 99], [1, 2], "outside"),
        ([-3], [1], "outside"),
        ([1, 1], [2, 3], "duplicate"),
        ([1, 2, 3], [4, 5], "3 local blocks"),
    ],
)
async def test_bad_block_ids_fail_the_request_only(local: list[int], remote: list[int], match: str) -> None:
    """Bad block ids raise BlockIdError from pull; the session keeps serving good requests."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine, decode_engine(spec, 1) as (consumer,):
        session = await consumer.connect(engine.endpoint)
        with pytest.raises(akv.BlockIdError, match=match):
            await session.pull("bad", local, remote)
        engine.fill("good", [1, 2], seed=5)
        await (await session.pull("good", [3, 4], [1, 2]))
        assert verify(consumer, [3, 4], 5, [0, 1])


async def test_bad_request_ids_and_token_counts_fail_the_request_only() -> None:
    """A request id that is not a string, and a token count of 0 with blocks to fill, are
    typed errors of that pull (nothing is read, nothing is released); good pulls go on."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine, decode_engine(spec, 1) as (consumer,):
        session = await consumer.connect(engine.endpoint)
        engine.fill("good", [1, 2], seed=5)
        with pytest.raises(akv.ConfigError, match="request_id must be a non-empty string"):
            await session.pull(akv.PullRequest(request_id=5, local_block_ids=[3], remote_block_ids=[1]))  # type: ignore[arg-type]
        with pytest.raises(akv.BlockIdError, match="give num_tokens > 0"):
            await session.pull("good", [3, 4], [1, 2], num_tokens=0)
        assert engine.producers[0].pending == 1 and not engine.releases
        await (await session.pull("good", [3, 4], [1, 2]))
        assert verify(consumer, [3, 4], 5, [0, 1])


async def test_lease_expiry_releases_once_and_late_notice_is_counted() -> None:
    """An unread request is released by lease exactly once; a later pull fails with
    LeaseExpiredError (never success) and the 'done' its check READ carries is counted as
    unknown (a check made in memory sends none: tests/test_shm.py)."""
    spec = make_spec()
    async with (
        prefill_engine(spec, 1, lease=0.2) as engine,
        decode_engine(spec, 1, same_process="nixl", check_with="read") as (consumer,),
    ):
        with engine.producers[0].releases() as stream:
            engine.fill("slow", [1, 2], seed=1)
            await wait_for(lambda: engine.releases)
            assert [(r.request_id, r.reason) for r in engine.releases] == [("slow", "expired")]
            rel = await stream.receive()
        assert rel.reason == "expired" and list(rel.block_ids) == [1, 2]
        session = await consumer.connect(engine.endpoint)
        with pytest.raises(akv.LeaseExpiredError, match="released by lease"):
            await (await session.pull("slow", [3, 4], [1, 2]))
        prod = engine.producers[0]
        await wait_for(lambda: prod.metrics.counters["notifications_unknown"] >= 1)
        assert len(engine.releases) == 1 and prod.metrics.counters["released_expired"] == 1


async def test_heartbeat_keeps_a_request_past_its_lease() -> None:
    """A request heartbeated by decode outlives its lease, then is released by read."""
    spec = make_spec()
    async with prefill_engine(spec, 2, lease=0.3) as engine, decode_engine(spec, 1) as (consumer,):
        session = await consumer.connect(engine.endpoint)
        engine.fill("kept", [1, 2], seed=2)
        for _ in range(8):
            await session.heartbeat(["kept"])
            await anyio.sleep(0.1)
        assert engine.releases == []
        await (await session.pull("kept", [5, 6], [1, 2]))
        await wait_for(lambda: len(engine.releases) == 2)
        assert {r.reason for r in engine.releases} == {"read"}
        assert verify(consumer, [5, 6], 2, [0, 1])


async def test_concurrent_connects_share_one_handshake() -> None:
    """Concurrent connect() calls to one endpoint share one handshake and one session."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine, decode_engine(spec, 1) as (consumer,):
        sessions: list[akv.TransferSession] = []

        async def go() -> None:
            sessions.append(await consumer.connect(engine.endpoint))

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(go)
        assert len({id(s) for s in sessions}) == 1
        assert consumer.metrics.counters["handshakes"] == 1


async def test_secret_required_and_checked() -> None:
    """Wrong or missing secrets get AuthenticationError; the right one works; no metadata leaks."""
    spec = make_spec()
    async with prefill_engine(spec, 1, secret="s3cret") as engine:
        for secret in (None, "wrong"):
            async with decode_engine(spec, 1, secret=secret, retries=0) as (consumer,):
                with pytest.raises(akv.AuthenticationError):
                    await consumer.connect(engine.endpoint)
        assert engine.server.metrics.counters["auth_failures"] == 1  # counted by the shared server
        async with decode_engine(spec, 1, secret="s3cret") as (consumer,):
            engine.fill("r", [1], seed=4)
            session = await consumer.connect(engine.endpoint)
            await (await session.pull("r", [2], [1]))
            assert verify(consumer, [2], 4, [0])


async def test_incompatible_peer_names_fields_and_server_keeps_serving() -> None:
    """A decode engine with another model shape is refused naming the fields; others still connect."""
    spec = make_spec(block_size=4)
    other = make_spec(block_size=8, head_dim=16, layers=3)
    async with prefill_engine(spec, 1) as engine:
        async with decode_engine(other, 1, retries=0) as (consumer,):
            with pytest.raises(akv.IncompatiblePeerError) as info:
                await consumer.connect(engine.endpoint)
            # block sizes that divide each other are fine; structure is compared per field
            assert set(info.value.fields) == {"kv.layers", "kv.k.unit_elems", "kv.v.unit_elems"}
            assert "group 'kv' component 'k' unit_elems: decode=16 prefill=8" in str(info.value)
        odd = make_spec(block_size=6)
        async with decode_engine(odd, 1, retries=0) as (consumer,):
            with pytest.raises(akv.IncompatiblePeerError, match="multiples of each other") as info:
                await consumer.connect(engine.endpoint)
            assert info.value.fields == ("kv.block_size",)
        async with decode_engine(spec, 1) as (consumer,):
            assert await consumer.connect(engine.endpoint)


async def test_expose_rejects_bad_input() -> None:
    """expose() raises typed errors for bad block ids and repeated request ids; extend() for unknown ids."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine:
        prod = engine.producers[0]
        with pytest.raises(akv.BlockIdError):
            prod.expose("x", [0, spec.num_blocks])
        prod.expose("x", [0, 1])
        with pytest.raises(akv.ConfigError, match="already exposed"):
            prod.expose("x", [2])
        with pytest.raises(akv.UnknownRequestError):
            prod.extend("nope")
        assert prod.pending == 1


async def test_unreachable_endpoint_is_a_handshake_error() -> None:
    """Connecting to a port nobody listens on fails with HandshakeError after the retries."""
    spec = make_spec()
    with anyio.fail_after(10):
        async with decode_engine(spec, 1, retries=1, connect_timeout=1.0) as (consumer,):
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
            port = listener.extra(anyio.abc.SocketAttribute.local_port)
            await listener.aclose()
            with pytest.raises(akv.HandshakeError, match="cannot reach"):
                await consumer.connect(f"127.0.0.1:{port}")


async def test_two_sessions_to_one_engine_share_its_agent_safely() -> None:
    """Two sessions of one consumer to one engine (two addresses of it) load one remote agent;
    closing one leaves the other pulling bit-exact."""
    spec = make_spec()
    async with prefill_engine(spec, 1) as engine, decode_engine(spec, 1, transfer_timeout=5) as (consumer,):
        for i, rid in enumerate(("r1", "r2", "r3")):
            engine.fill(rid, [2 * i + 1, 2 * i + 2], seed=i)
        first = await consumer.connect(engine.endpoint)
        second = await consumer.connect(engine.endpoint.replace("127.0.0.1", "localhost"))
        assert first is not second and first.agents == second.agents
        await (await first.pull("r1", [0, 1], [1, 2]))
        await (await second.pull("r2", [2, 3], [3, 4]))
        await first.aclose()
        await (await second.pull("r3", [4, 5], [5, 6]))
        assert verify(consumer, [4, 5], 2, range(2)) and verify(consumer, [2, 3], 1, range(2))


async def test_exhausted_check_slots_are_back_pressure_not_a_broken_link() -> None:
    """With one exposure-check slot and eight pulls at once, the pulls that find no slot fail
    with BackPressureError; no rank is marked broken, and the next pulls succeed without a
    new handshake."""
    spec = make_spec()
    # check slots belong to the NIXL read path: same_process="nixl" reads even from this process
    async with (
        prefill_engine(spec, 1) as engine,
        decode_engine(spec, 1, max_checks=1, same_process="nixl", check_with="read") as (consumer,),
    ):
        for i in range(10):
            engine.fill(f"r{i}", [i + 1], seed=i)
        session = await consumer.connect(engine.endpoint)
        transfers = [await session.pull(f"r{i}", [i], [i + 1]) for i in range(8)]
        outcomes = []
        for t in transfers:
            try:
                await t
                outcomes.append("ok")
            except akv.TransferError as exc:
                outcomes.append(type(exc).__name__)
        assert "BackPressureError" in outcomes and set(outcomes) <= {"ok", "BackPressureError"}, outcomes
        assert not session.broken
        for i in (8, 9):
            await (await session.pull(f"r{i}", [i], [i + 1]))
            assert verify(consumer, [i], i, range(1))
        assert consumer.metrics.counters["handshakes"] == 1


async def test_heartbeats_renew_with_the_exposures_own_lease() -> None:
    """A request exposed with a 0.4 s lease (the engine's default: 30 s) whose pull takes
    1.5 s stays pinned: the consumer heartbeats every third of the exposure's own lease, the
    pull verifies and the request is released by read, not by lease."""
    spec = make_spec()
    async with prefill_engine(spec, 1, lease=30) as engine:
        backend = HeldBackend("held-d0")  # the read is held in NIXL's hands
        async with decode_rank(spec, backend=backend, same_process="nixl") as consumer:
            session = await consumer.connect(engine.endpoint)
            engine.fill("r", [1, 2], seed=4, lease=0.4)
            backend.hold_until = time.monotonic() + 1.5
            request = akv.PullRequest(
                request_id="r", local_block_ids=[0, 1], remote_block_ids=[1, 2], lease_s=0.4
            )
            await (await session.pull(request))
            assert verify(consumer, [0, 1], 4, range(2))
            await wait_for(lambda: engine.releases)
            assert [r.reason for r in engine.releases] == ["read"]
            with pytest.raises(akv.ConfigError, match="lease_s"):
                await session.pull(
                    akv.PullRequest(request_id="r", local_block_ids=[0], remote_block_ids=[1], lease_s=0)
                )


async def test_a_pull_is_bound_to_the_exposure_it_started_under() -> None:
    """A pull started under an exposure with a short lease, which expired and was exposed
    again on the same blocks with new contents before the reads completed, fails with
    ReexposedError; its notice does not release the new exposure, which a pull bound to the
    new generation then reads bit-exact."""
    spec = make_spec()
    async with prefill_engine(spec, 1, lease=30) as engine:
        backend = HeldBackend("held-gen-d0")  # the read is held in NIXL's hands
        async with decode_rank(spec, backend=backend, same_process="nixl") as consumer:
            session = await consumer.connect(engine.endpoint)
            old = engine.fill("r", [1, 2], seed=1, lease=0.2)
            backend.hold_until = time.monotonic() + 1.0
            ids = {"local_block_ids": [0, 1], "remote_block_ids": [1, 2]}
            stale = await session.pull(akv.PullRequest(request_id="r", generation=old, **ids))
            await wait_for(lambda: [r.reason for r in engine.releases] == ["expired"])
            new = engine.fill("r", [1, 2], seed=2)  # the same id and blocks, other contents
            assert new != old
            with pytest.raises(akv.ReexposedError):
                await stale
            await anyio.sleep(0.2)  # the stale reader's notice has arrived by now
            assert [r.reason for r in engine.releases] == ["expired"]
            assert engine.producers[0].metrics.counters["notifications_invalid"] >= 1
            await (await session.pull(akv.PullRequest(request_id="r", generation=new, **ids)))
            assert verify(consumer, [0, 1], 2, range(2))
            await wait_for(lambda: [r.reason for r in engine.releases] == ["expired", "read"])


class Recording(NixlBackend):
    """The real backend, recording in order the READs posted (remote agent, notice, local
    indices) and the notices sent."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.agent_of: dict[object, str] = {}
        self.ops: list[tuple[str, str, bytes, list[int]]] = []

    def prep(self, agent: str, table: Any, mem_type: str) -> Any:
        handle = super().prep(agent, table, mem_type)
        self.agent_of[handle] = agent
        return handle

    def read(self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, notif: bytes, **kw: Any) -> Any:
        self.ops.append(("read", self.agent_of.get(remote, "?"), notif, [int(i) for i in local_idx]))
        return super().read(local, local_idx, remote, remote_idx, notif, **kw)

    def notify(self, agent: str, message: bytes) -> None:
        self.ops.append(("notify", agent, message, []))
        super().notify(agent, message)

    def ops_to(self, agent: str) -> list[tuple[str, str, bytes, list[int]]]:
        return [op for op in self.ops if op[1] == agent]


@pytest.mark.parametrize("kind", ["dense", "mla", "packed"])
async def test_every_notice_is_followed_by_a_read_that_flushes_behind_it(kind: str) -> None:
    """Each "done" notice to a prefill rank, carried by the exposure check READ (of direct or
    packed reads; ``check_with="read"``) or sent alone (MLA: to the rank not read from), is
    followed by a READ without a notice to that rank, so that no later pull's first READ
    waits for the rank to acknowledge the notice: the next pull's own first READ where it
    follows at once, else a small READ into the check pool's scratch slot, which always
    follows the last pull's notices; the flush reads end on their own, and later pulls still
    verify."""
    spec = make_spec(kv_heads=4, mla=kind == "mla")
    backend = Recording(f"recording-{kind}-{id(spec)}")
    transfer = "packed" if kind == "packed" else "direct"
    async with (
        prefill_engine(spec, 2, transfer=transfer) as engine,
        decode_engine(
            spec, 1, same_process="nixl", check_with="read", backend=backend, transfer=transfer
        ) as (consumer,),
    ):
        session = await consumer.connect(engine.endpoint)
        for i in range(3):
            engine.fill(f"r{i}", [i], seed=i)
            result = await (await session.pull(f"r{i}", [i + 4], [i]))
            assert result.path == ("packed" if kind == "packed" else "read")
            assert verify(consumer, [i + 4], i, range(1))
        scratch = consumer.checks.scratch
        agents = {op[1] for op in backend.ops if op[2]}
        await wait_for(lambda: all(backend.ops_to(a)[-1][2:] == (b"", [scratch]) for a in agents))
        noticed: Counter[str] = Counter()
        for agent in agents:
            ops = backend.ops_to(agent)
            for k, (what, _, notice, _) in enumerate(ops):
                if notice:
                    noticed[what] += 1
                    assert any(op[0] == "read" and op[2] == b"" for op in ops[k + 1 :]), ops[k:]
        assert noticed == ({"read": 3, "notify": 3} if kind == "mla" else {"read": 6})
        await wait_for(lambda: not backend.active_transfers)


class Spaced(Recording):
    """The real backend, recording; the exposure checks (READs carrying a notice) finish one
    notice at a time, 20 ms apart, once ``gate`` is set, so that each completes in a poller
    round of its own."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.checks: dict[object, bytes] = {}
        self.finishing = b""  # the notice of the pull whose checks may finish now
        self.at = 0.0
        self.gate = False  # no check finishes until it is set

    def read(self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, notif: bytes, **kw: Any) -> Any:
        handle = super().read(local, local_idx, remote, remote_idx, notif, **kw)
        if notif:
            self.checks[handle] = notif
        return handle

    def state(self, handle: XferHandle) -> XferState:
        done = super().state(handle)
        notice = self.checks.get(handle)
        if notice is None or done != "DONE":
            return done
        if not self.gate:
            return "PROC"
        if notice != self.finishing:
            if time.monotonic() - self.at < 0.02:
                return "PROC"
            self.finishing, self.at = notice, time.monotonic()
        return done


async def test_concurrent_pulls_share_the_flush_behind_the_last_notice() -> None:
    """Eight pulls in flight, finishing one per poller round: while some have yet to send their
    notice no flush read is posted (the prefill rank is busy answering them); once the last
    one's notice went out, each prefill rank gets one flush read, after everything else."""
    spec = make_spec(kv_heads=4, num_blocks=64)
    backend = Spaced(f"spaced-{id(spec)}")
    async with (
        prefill_engine(spec, 2) as engine,
        decode_engine(spec, 1, same_process="nixl", check_with="read", backend=backend) as (consumer,),
    ):
        session = await consumer.connect(engine.endpoint)
        for i in range(8):
            engine.fill(f"r{i}", [i], seed=i)
        transfers = []
        for i in range(8):  # each pull's checks go out in a poller round of their own
            transfers.append(await session.pull(f"r{i}", [i + 16], [i]))
            await wait_for(lambda i=i: len(backend.checks) == 2 * (i + 1))
        backend.gate = True
        for i, t in enumerate(transfers):
            await t
            assert verify(consumer, [i + 16], i, range(1))
        scratch = consumer.checks.scratch
        agents = {op[1] for op in backend.ops}
        assert len(agents) == 2
        await wait_for(lambda: all(backend.ops_to(a)[-1][3] == [scratch] for a in agents))
        for agent in agents:
            ops = backend.ops_to(agent)
            assert sum(bool(op[2]) for op in ops) == 8  # a notice per pull
            assert sum(op[3] == [scratch] for op in ops) == 1, ops


class HeldSpaced(HeldBackend, Spaced):
    """The spaced backend, reporting every transfer running until ``hold_until``."""


async def test_a_shared_check_read_keeps_its_slots_until_it_ends_though_its_pulls_timed_out() -> None:
    """Two pulls whose shared exposure-check READ does not finish time out; while that READ
    may still land, its two check slots (all there are) stay taken, so a third pull is turned
    away with BackPressureError; once it ends, pulls get the slots again and verify."""
    spec = make_spec(kv_heads=4, num_blocks=64)
    backend = HeldSpaced(f"spaced-timeout-{id(spec)}")
    async with (
        prefill_engine(spec, 1) as engine,
        decode_engine(spec, 1, same_process="nixl", check_with="read", backend=backend, max_checks=2) as (
            consumer,
        ),
    ):
        session = await consumer.connect(engine.endpoint)
        for i in range(5):
            engine.fill(f"r{i}", [i], seed=i)
        backend.hold_until = time.monotonic() + 0.1  # both data reads complete in one round
        transfers = [await session.pull(f"r{i}", [i + 16], [i], transfer_timeout=0.4) for i in range(2)]
        for t in transfers:
            with pytest.raises(akv.TransferTimeout):
                await t
        assert len(backend.checks) == 1  # one READ stood for both
        with pytest.raises(akv.BackPressureError):
            await (await session.pull("r2", [18], [2]))
        backend.gate = True
        await wait_for(lambda: not len(consumer.reaper))
        for i in (3, 4):
            await (await session.pull(f"r{i}", [i + 16], [i]))
            assert verify(consumer, [i + 16], i, range(1))


class HeldRecording(HeldBackend, Recording):
    """The recording backend, reporting every transfer running until ``hold_until``."""


async def test_pulls_done_in_one_round_share_one_check_read_and_a_stale_one_fails_alone() -> None:
    """Eight pulls from P=2 whose data reads finish in the same poller round send each prefill
    rank one READ carrying one "done" notice that names all eight (the ranks are of this
    host: the checks copy their buckets from the tables in shared memory, and a background
    READ carries the notice); the pull bound to an exposure that was replaced meanwhile fails with
    ReexposedError alone (its name in the shared notice releases nothing), and the seven
    others verify and release by read."""
    spec = make_spec(kv_heads=4, num_blocks=64)
    backend = HeldRecording(f"held-recording-{id(spec)}")
    async with (
        prefill_engine(spec, 2) as engine,
        decode_rank(spec, backend=backend, same_process="nixl") as consumer,
    ):
        session = await consumer.connect(engine.endpoint)
        stale = engine.fill("r3", [3], seed=3, lease=0.2)
        await wait_for(lambda: [r.reason for r in engine.releases] == ["expired"] * 2)
        for i in range(8):
            engine.fill(f"r{i}", [i], seed=i)
        backend.hold_until = time.monotonic() + 0.3  # every data read completes in one round
        transfers = [
            await session.pull(
                akv.PullRequest(
                    request_id=f"r{i}",
                    local_block_ids=[i + 16],
                    remote_block_ids=[i],
                    generation=stale if i == 3 else 0,
                )
            )
            for i in range(8)
        ]
        for i, t in enumerate(transfers):
            if i == 3:
                with pytest.raises(akv.ReexposedError):
                    await t
            else:
                await t
                assert verify(consumer, [i + 16], i, range(1))
        counters = consumer.metrics.snapshot().counters
        assert counters["checks_shared"] == 16 and counters.get("xfers_check", 0) == 0
        agents = {op[1] for op in backend.ops}
        assert len(agents) == 2
        for agent in agents:
            noticed = [op for op in backend.ops_to(agent) if op[2]]
            assert len(noticed) == 1, noticed
            assert sorted(decode_notice(noticed[0][2]).request_ids) == [f"r{i}" for i in range(8)]
        want = [("r3", "expired")] * 2 + [(f"r{i}", "read") for i in range(8) if i != 3] * 2
        await wait_for(lambda: sorted((r.request_id, r.reason) for r in engine.releases) == sorted(want))
        assert all(p.metrics.counters["notifications_invalid"] == 1 for p in engine.producers)
        assert [p.pending for p in engine.producers] == [1, 1]  # r3's new exposure stays


class FlushesHang(NixlBackend):
    """The real backend; the flush reads (those landing in the ``scratch`` slot) report
    "PROC" while ``hang`` is set, as they would from a prefill process that stopped polling."""

    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.scratch, self.hang = -1, True
        self.flushes: set[object] = set()

    def read(self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, notif: bytes, **kw: Any) -> Any:
        handle = super().read(local, local_idx, remote, remote_idx, notif, **kw)
        if list(local_idx) == [self.scratch]:
            self.flushes.add(handle)
        return handle

    def state(self, handle: XferHandle) -> XferState:
        done = super().state(handle)
        return "PROC" if self.hang and handle in self.flushes else done


async def test_a_flush_read_that_never_ends_does_not_replace_the_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Flush reads still running long past ``settle_timeout`` are background work: the rank
    does not replace its agent for them (as it does for a failed pull's reads), pulls keep
    completing on it without a new handshake, and the handles are released once they end."""
    spec = make_spec(kv_heads=4)
    async with prefill_engine(spec, 1) as engine:
        monkeypatch.setattr(akv.backends.nixl, "NixlBackend", FlushesHang)  # the agent the rank creates
        async with decode_engine(spec, 1, same_process="nixl", check_with="read", settle_timeout=0.2) as (
            consumer,
        ):
            backend = consumer.backend
            assert isinstance(backend, FlushesHang)
            backend.scratch = consumer.checks.scratch
            session = await consumer.connect(engine.endpoint)
            for i in range(3):
                engine.fill(f"r{i}", [i], seed=i)
                await (await session.pull(f"r{i}", [i + 4], [i]))
                assert verify(consumer, [i + 4], i, range(1))
                await anyio.sleep(0.3)  # past settle_timeout, with the flush reads still "running"
            assert len(backend.flushes) == 3 and backend.active_transfers == consumer.reaper.background == 3
            assert consumer.backend is backend and consumer.metrics.counters["agent_resets"] == 0
            assert consumer.metrics.counters["handshakes"] == 1
            backend.hang = False
            await wait_for(lambda: not backend.active_transfers)
