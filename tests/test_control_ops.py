"""What a pull costs besides its bytes, counted (issue 39): the NIXL transfers a decode rank
posts by kind and the control messages of push mode, from the ranks' own metrics
(`akv.metrics.CONTROL_OPS`, which ``akv bench`` reports as ``control_ops``). On a GPU each of
these is a round trip that costs more than the bytes of a small pull, so a change that adds
one fails here, on CPU. Real NIXL agents over UCX loopback (DRAM), prefill ranks of this
process read through NIXL.
"""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest

import akv
from akv.metrics import CONTROL_OPS
from akv.testing import fetch_requests, make_requests, stop_prefill, verify_request
from tests.conftest import (
    MODEL,
    cli_spec,
    decode_rank,
    local_ids,
    make_spec,
    prefill_engine,
    prefill_process,
    summary_of,
    verify,
)
from tests.transfers import pull_request

pytestmark = pytest.mark.anyio

SPEC = make_spec(kv_heads=4)
PULLS = 4


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def one_rank_consumer(**kw: Any) -> akv.Consumer:
    """A TP-1 decode rank of `SPEC` that reads even from this process over NIXL."""
    return akv.Consumer(
        akv.allocate_kv_cache(SPEC, 0, 1), SPEC, tp_rank=0, tp_size=1, same_process="nixl", **kw
    )


async def pulls_counted(
    p: int, consumer_kw: dict[str, Any], prefill_kw: dict[str, Any]
) -> tuple[set[str], dict[str, float], list[dict[str, int]]]:
    """`PULLS` requests pulled one after the other by one decode rank from a ``p``-rank engine,
    each checked bit-exact; the paths taken, the decode rank's counters spent per pull (those
    of `CONTROL_OPS` by kind, and ``xfers_data``), and each prefill rank's counters."""
    reqs = make_requests(SPEC, PULLS, 3, seed=9)
    async with prefill_engine(SPEC, p, **prefill_kw) as engine, AsyncExitStack() as stack:
        engine.expose_requests(reqs)
        c = await stack.enter_async_context(one_rank_consumer(**consumer_kw))
        session = await c.connect(engine.endpoint)
        before = dict(c.metrics.snapshot().counters)
        paths = set()
        for n, req in enumerate(reqs):
            local = local_ids(SPEC, n, req.num_tokens)
            result = await (await session.pull(pull_request(req, local)))
            paths.add(result.path)
            assert verify_request(c.kv_caches, SPEC, 0, 1, local, req.seed, num_tokens=req.num_tokens)
        await anyio.sleep(0.1)  # background reads behind the last notices
        after = c.metrics.snapshot().counters
        spent = {k: (after.get(v, 0) - before.get(v, 0)) / PULLS for k, v in CONTROL_OPS.items()}
        spent["data"] = (after["xfers_data"] - before.get("xfers_data", 0)) / PULLS
        spent["shared"] = (after.get("checks_shared", 0) - before.get("checks_shared", 0)) / PULLS
        spent["directories"] = (
            after.get("directories_shared", 0) - before.get("directories_shared", 0)
        ) / PULLS
        prefill = [dict(prod.metrics.snapshot().counters) for prod in engine.producers]
    return paths, spent, prefill


@pytest.mark.parametrize("p", [1, 2])
async def test_a_direct_pull_posts_one_read_and_one_check_per_prefill_rank(p: int) -> None:
    """A checked direct pull from ``p`` prefill ranks, its checks READ (``check_with="read"``),
    posts, per rank, one data READ and one check READ (carrying the "done" notice); pulls back
    to back post no background READ behind their notices (the next pull's READs flush behind
    them), only the last pull does; no standalone notice, no directory, no push message."""
    paths, spent, _ = await pulls_counted(p, {"check_with": "read"}, {})
    assert paths == {"read"}
    assert spent == {
        "data": p,
        "check_reads": p,
        "directory_reads": 0,
        "flush_reads": p / PULLS,
        "notice_reads": 0,
        "notices": 0,
        "push_announces": 0,
        "push_notices": 0,
        "shared": 0,
        "directories": 0,
    }


@pytest.mark.parametrize("p", [1, 2])
async def test_a_direct_pull_from_this_host_checks_in_shared_memory(p: int) -> None:
    """A checked direct pull from ``p`` prefill ranks of this host (by default) posts, per
    rank, one data READ and no check READ: each check copies its bucket from the rank's table
    in shared memory; the "done" notices go out after the pull, on at most one background
    READ per rank and pull (pulls back to back share one), and every request is released on
    every prefill rank by read, once."""
    paths, spent, prefill = await pulls_counted(p, {}, {})
    assert paths == {"read"}
    assert 0 < spent.pop("notice_reads") <= p
    assert 0 < spent.pop("flush_reads") <= p
    assert spent == {
        "data": p,
        "check_reads": 0,
        "directory_reads": 0,
        "notices": 0,
        "push_announces": 0,
        "push_notices": 0,
        "shared": p,
        "directories": 0,
    }
    for counters in prefill:
        assert counters["released_read"] == PULLS and counters.get("notifications_invalid", 0) == 0


#: the consumer's settings that take each path (a packed pull also needs a packing prefill)
ON_PATH: dict[str, dict[str, Any]] = {"read": {}, "packed": {"transfer": "packed"}, "push": {"mode": "push"}}


@pytest.mark.parametrize("path", list(ON_PATH))
async def test_concurrent_checked_pulls_leave_nothing_for_the_garbage_collector(path: str) -> None:
    """A pull is no reference cycle, on the read, packed and push paths: its op (and the read
    op a packed pull wraps), check tickets and batch are freed as soon as the pull is (by
    reference counting), so a burst of small pulls does not make Python's cyclic collector
    run (each of its passes stops the event loop for all of them)."""
    # checks READ through the batcher (its tickets and batches are what could hold cycles)
    consumer_kw = {**ON_PATH[path], **({"check_with": "read"} if path != "push" else {})}
    reqs = make_requests(SPEC, 4, 2, seed=5)  # 4 at once: the most this pool's blocks hold (see local_ids)
    async with (
        prefill_engine(SPEC, 2, **({"transfer": "packed"} if path == "packed" else {})) as engine,
        AsyncExitStack() as stack,
    ):
        engine.expose_requests(reqs)
        c = await stack.enter_async_context(one_rank_consumer(**consumer_kw))
        session = await c.connect(engine.endpoint)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            transfers = [
                await session.pull(pull_request(req, local_ids(SPEC, n, req.num_tokens)))
                for n, req in enumerate(reqs)
            ]
            results = [await t for t in transfers]
            del transfers
            gc.collect()
            cyclic = sorted(
                {type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("akv.")}
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert [r.path for r in results] == [path] * len(reqs)
        for n, req in enumerate(reqs):
            local = local_ids(SPEC, n, req.num_tokens)
            assert verify_request(c.kv_caches, SPEC, 0, 1, local, req.seed, num_tokens=req.num_tokens)
        if path != "push":  # the checks went through the batcher
            assert c.metrics.snapshot().counters.get("xfers_check", 0) >= 1
        assert cyclic == []


@pytest.mark.parametrize(("p", "check_with"), [(1, "auto"), (2, "auto"), (2, "read")])
async def test_a_packed_pull_adds_only_the_directory_lookup(p: int, check_with: str) -> None:
    """A checked packed pull from ``p`` prefill ranks of this host posts, per rank, one READ
    of the packed copy; by default its directory lookup and its check copy their buckets from
    shared memory, and its notice goes on at most one background READ, with at most one
    background READ behind it (the last pull always: no pull follows it); with
    ``check_with="read"`` the lookup is one directory READ and the check one check READ per
    rank (carrying the notice); nothing else."""
    consumer_kw = {"transfer": "packed", "check_with": check_with}
    paths, spent, _ = await pulls_counted(p, consumer_kw, {"transfer": "packed"})
    assert paths == {"packed"}
    assert p / PULLS <= spent.pop("flush_reads") <= p
    shared = check_with == "auto"
    if shared:
        assert 0 < spent.pop("notice_reads") <= p
    else:
        assert spent.pop("notice_reads") == 0
    assert spent == {
        "data": p,
        "check_reads": 0 if shared else p,
        "shared": p if shared else 0,
        "directory_reads": 0 if shared else p,
        "directories": p if shared else 0,
        "notices": 0,
        "push_announces": 0,
        "push_notices": 0,
    }


@pytest.mark.parametrize("p", [1, 2])
async def test_a_push_costs_one_announcement_and_one_pushed_notice_per_writer(p: int) -> None:
    """A pushed pull from ``p`` writers sends each one announcement and receives one notice
    ("pushed") from each, and posts no READ at all; each writer receives that one announcement,
    posts one WRITE and sends one "pushed" per pull."""
    paths, spent, prefill = await pulls_counted(p, {"mode": "push"}, {})
    assert paths == {"push"}
    assert spent == {
        "data": 0,
        "check_reads": 0,
        "directory_reads": 0,
        "flush_reads": 0,
        "notice_reads": 0,
        "shared": 0,
        "directories": 0,
        "notices": 0,
        "push_announces": p,
        "push_notices": p,
    }
    for counters in prefill:
        assert counters["notifications_received"] == PULLS
        assert counters["push_announcements"] == PULLS
        assert counters["push_writes"] == PULLS
        assert counters["pushes"] == PULLS


@pytest.mark.parametrize("path", ["read", "packed"])
async def test_a_closed_consumer_lets_go_of_its_nixl_agent_at_once(path: str) -> None:
    """Closing a consumer destroys its NIXL agent (its UCX workers, sockets and registrations)
    at once, without a pass of the garbage collector, after checked pulls left prepared lists
    and handles of it around (the check and directory slots, the local lists, the reaper's
    background READs): nothing the closed rank's objects hold keeps it alive."""
    consumer_kw = {**ON_PATH[path], "check_with": "read"}
    reqs = make_requests(SPEC, 2, 2, seed=6)
    async with prefill_engine(SPEC, 2, **({"transfer": "packed"} if path == "packed" else {})) as engine:
        engine.expose_requests(reqs)
        gc.collect()
        gc.disable()
        try:
            async with one_rank_consumer(**consumer_kw) as c:
                backend = c.backend
                session = await c.connect(engine.endpoint)
                for n, req in enumerate(reqs):
                    result = await (await session.pull(pull_request(req, local_ids(SPEC, n, req.num_tokens))))
                    assert result.path == path
            assert backend.closed
            assert backend.destroyed
        finally:
            gc.enable()


def test_bench_reports_control_ops_and_latency_beside_raw_nixl() -> None:
    """`akv bench --only latency --mode push` reports, for one-block pulls, akv's p50 and p99
    beside the hand-written loop's (``nixl_p50_ms``, ``nixl_p99_ms``) and those of its data
    stage, and per pull one data READ, no check READ (the prefill runs on this host: checks are
    memory loads), at most one background READ carrying notices and one behind them
    (``control_ops``: pulls in a row share them), and for pushed pulls one announcement and
    one notice (``push_control_ops``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "akv", "bench", "--quick", "--only", "latency", "--mode", "push", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (w,) = json.loads(proc.stdout.splitlines()[-1])["workloads"]
    assert w["name"] == "latency" and w["tp"] == "1->1" and w["paths"] == {"read": 64}
    assert w["p50_ms"] > 0 and w["nixl_p50_ms"] > 0
    # the tails beside each other, and the data stage's (a part of each pull's time)
    assert w["p99_ms"] >= w["p50_ms"] and w["nixl_p99_ms"] >= w["nixl_p50_ms"]
    assert w["unchecked_p99_ms"] >= w["unchecked_p50_ms"]
    assert 0 < w["data_p50_ms"] <= w["data_p99_ms"] <= w["p99_ms"]
    assert w["data_xfers"] == 1
    zero = dict.fromkeys(CONTROL_OPS, 0)
    ops = w["control_ops"]
    assert 0 < ops["flush_reads"] <= 1 and 0 < ops["notice_reads"] <= 1
    assert {**ops, "flush_reads": 0, "notice_reads": 0} == zero
    assert w["push_control_ops"] == {**zero, "push_announces": 1, "push_notices": 1}


def test_bench_measures_with_the_heap_frozen_and_unfreezes_it_after() -> None:
    """`akv bench` runs a workload's measured batches with every object that existed before them
    frozen, so that a collection scans what the pulls allocate and not the bench's own heap
    (docs/performance.md, "Garbage collection in the bench"); the pulls' objects are not
    frozen, and everything is unfrozen afterwards, also when a batch raises, so that the
    workload's objects can go."""
    from akv.bench.measure import frozen_heap

    assert gc.get_freeze_count() == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the interpreter's, the suite's, this test's
        allocated = [[n] for n in range(100)]
        assert gc.get_freeze_count() == frozen and gc.is_tracked(allocated[0])
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError, match="a batch failed"), frozen_heap():
        raise RuntimeError("a batch failed")
    assert gc.get_freeze_count() == 0


#: UCX's keepalive off, for the test below and its prefill process (see its docstring).
NO_KEEPALIVE = {"UCX_KEEPALIVE_INTERVAL": "inf"}


@pytest.mark.parametrize("transfer", ["direct", "packed"])
async def test_a_checked_pull_completes_while_the_prefill_process_cannot_run(
    transfer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checked pull (direct, or packed with its directory lookup) needs nothing from the
    prefill rank's poller on its way to completion: its bytes, directory and exposure check
    are one-sided READs or memory loads (`akv.shm`), and its "done" notice rides a READ, so it completes,
    bit-exact, while the prefill process is stopped; once it runs again it gets the notice and
    releases the request once, by read. (A hop through the prefill's poller would be a sleep
    of that poller on every pull's critical path.)

    UCX's keepalive is off here (``UCX_KEEPALIVE_INTERVAL=inf``): its first round sends a
    check message over the TCP lane at a moment of its own choosing after the link is made
    (then one every 20 s), and over TCP the READ after any message waits for the peer to
    acknowledge it (docs/performance.md, "UCX's keepalive"); with it on, 5 of 120 second
    pulls waited for the stopped prefill (tests/diagnostics/ucx_keepalive_stall.py)."""
    for key, value in NO_KEEPALIVE.items():
        monkeypatch.setenv(key, value)  # the decode agent below reads it when it is made
    extra = ["--transfer", "packed"] if transfer == "packed" else []
    with prefill_process(1, 4, "--lease", "30", *extra, requests=2, env=NO_KEEPALIVE) as (proc, endpoint):
        spec = cli_spec("--kv-heads", "4", *MODEL)
        reqs = await fetch_requests(endpoint, spec, None, "t")
        kw: dict[str, Any] = {"transfer": "packed"} if transfer == "packed" else {}
        async with decode_rank(spec, transfer_timeout=20.0, **kw) as consumer:
            session = await consumer.connect(endpoint)
            first, second = reqs
            await (await session.pull(first.request_id, [0, 1, 2, 3], first.block_ids))  # links the rank
            # wait until the READ behind the first notice was posted and is done, that is until
            # the prefill rank acknowledged the notice (rather than for a fixed pause)
            flush_reads = CONTROL_OPS["flush_reads"]
            with anyio.fail_after(10):
                while (
                    consumer.metrics.snapshot().counters.get(flush_reads, 0) < 1 or consumer.reaper.background
                ):
                    await anyio.sleep(0.02)
            before = dict(consumer.metrics.snapshot().counters)
            proc.send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                try:
                    with anyio.fail_after(10):
                        result = await (await session.pull(second.request_id, [4, 5, 6, 7], second.block_ids))
                except TimeoutError:  # say what the pull did meanwhile (which step waited)
                    after = consumer.metrics.snapshot().counters
                    spent = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
                    raise AssertionError(
                        f"the pull waited on the stopped prefill; counters moved: {spent}"
                    ) from None
                took = time.monotonic() - started
                assert result.path == ("packed" if transfer == "packed" else "read")
                assert verify(consumer, [4, 5, 6, 7], second.seed, range(4))
            finally:
                proc.send_signal(signal.SIGCONT)
            # the event loop keeps running meanwhile: a notice may still be queued for the poller
            summary = await anyio.to_thread.run_sync(summary_of, proc)
    assert took < 5, took
    assert summary["released"] == 2 and summary["expired"] == 0, summary
    assert summary["duplicate_releases"] == 0 and summary["unreleased"] == 0, summary


async def test_a_single_checked_pull_from_a_prefill_process_on_this_host_settles_at_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a first pull made the link (and the READ behind its notice is done), a checked
    pull from a prefill rank in another process on this host (its exposure table mapped, its
    READ done while posted) is done when `pull` returns: bit-exact, one data READ, one check
    made in shared memory, no check READ, one transfer; its notice releases the request once,
    by read. A pull of a request whose lease expired fails typed (`LeaseExpiredError`),
    counted as one check and one unsafe read, and sends no notice. (UCX's keepalive is off,
    as in the test above: its check message would make a READ wait for the prefill.)"""
    for key, value in NO_KEEPALIVE.items():
        monkeypatch.setenv(key, value)
    with prefill_process(1, 4, "--lease", "3", "--hold", requests=3, env=NO_KEEPALIVE) as (proc, endpoint):
        spec = cli_spec("--kv-heads", "4", *MODEL)
        first, fresh, stale = await fetch_requests(endpoint, spec, None, "t")
        async with decode_rank(spec) as consumer:
            session = await consumer.connect(endpoint)
            counters = consumer.metrics.counters
            await (await session.pull(first.request_id, [8, 9, 10, 11], first.block_ids))  # links the rank
            with anyio.fail_after(10):  # until the READ behind its notice is done
                while counters.get(CONTROL_OPS["flush_reads"], 0) < 1 or consumer.reaper.background:
                    await anyio.sleep(0.02)
            before = dict(counters)
            transfer = await session.pull(fresh.request_id, [0, 1, 2, 3], fresh.block_ids)
            assert transfer.done()
            assert (await transfer).path == "read"
            assert verify(consumer, [0, 1, 2, 3], fresh.seed, range(4))
            kinds = ("xfers_data", "checks_shared", "xfers_check", "transfers")
            assert {k: counters.get(k, 0) - before.get(k, 0) for k in kinds} == dict(
                zip(kinds, (1, 1, 0, 1), strict=True)
            )
            await anyio.sleep(3.5)  # the last request's lease runs out
            before = dict(counters)
            with pytest.raises(akv.LeaseExpiredError):
                await (await session.pull(stale.request_id, [4, 5, 6, 7], stale.block_ids))
            await anyio.sleep(0.3)  # a notice would have gone out on a background READ by now
            kinds = ("checks_shared", "unsafe_reads", "xfers_notice")
            assert {k: counters.get(k, 0) - before.get(k, 0) for k in kinds} == dict(
                zip(kinds, (1, 1, 0), strict=True)
            )
        summary = await anyio.to_thread.run_sync(stop_prefill, proc)  # held: it runs until stopped
    assert summary is not None
    assert summary["released_ids"] == [first.request_id, fresh.request_id], summary  # by read
    assert summary["expired_ids"] == [stale.request_id], summary
    assert summary["duplicate_releases"] == 0, summary
