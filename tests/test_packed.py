"""Packed transfers: prefill ranks stage each request contiguously, decode ranks read the
staged copy with a few descriptors and scatter it, through real NIXL agents on DRAM."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import akv
from akv.backends import XferHandle, XferState
from akv.backends.nixl import NixlBackend
from akv.geometry.cache import as_cache
from akv.geometry.layout import rank_layout
from akv.packing import CacheViews, find, scatter
from akv.runtime.paths.staging import WORKER_BYTES
from akv.testing import fill_request, json_lines, make_requests, verify_request
from tests.conftest import Engine, decode_rank, make_spec, prefill_engine, prefill_rank, wait_for
from tests.transfers import PULL_PAIRS, pull_every_request

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def pull_all(
    pspec: Any,
    dspec: Any,
    p: int,
    d: int,
    mode: str,
    requests: int = 2,
    consumer_kw: dict[str, Any] | None = None,
    **kw: Any,
) -> tuple[list[akv.TransferResult], Engine]:
    """Pull ``requests`` requests on each of ``d`` decode ranks (the second after a one-block
    prefix hit) with ``transfer=mode``; verify every byte."""
    return await pull_every_request(
        pspec,
        dspec,
        p,
        d,
        lambda r: decode_rank(dspec, r, d, same_process="nixl", transfer=mode, **(consumer_kw or {})),
        requests=requests,
        seed=11,
        **kw,
    )


@pytest.mark.parametrize(("pspec", "dspec", "p", "d"), PULL_PAIRS)
async def test_packed_pulls_are_bit_exact(pspec: Any, dspec: Any, p: int, d: int) -> None:
    """A packed pull fills the decode cache bit-exact (every TP pairing, MLA, hybrid groups,
    mixed layouts and block sizes, a partial prefix hit), moving the bytes a direct one
    moves, with the same releases."""
    packed, engine = await pull_all(pspec, dspec, p, d, "packed", transfer="packed")
    direct, _ = await pull_all(pspec, dspec, p, d, "direct", transfer="packed")
    assert {r.path for r in packed} == {"packed"} and {r.path for r in direct} == {"read"}
    assert [r.bytes for r in packed] == [r.bytes for r in direct]
    assert {why for _, why in engine.reasons} == {"read"} and set(engine.reasons.values()) == {p}


class SlowPackedReads(NixlBackend):
    """The real backend; packed-copy reads report "PROC" until ``go`` is set."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.go = anyio.Event()
        self.held: set[XferHandle] = set()

    def read_descs(self, *args: Any) -> XferHandle:
        handle = super().read_descs(*args)
        self.held.add(handle)
        return handle

    def state(self, handle: XferHandle) -> XferState:
        done = super().state(handle)
        return "PROC" if handle in self.held and not self.go.is_set() else done


def consumer_for(spec: Any, mode: str, **kw: Any) -> akv.Consumer:
    """A one-rank decode engine reading through NIXL with ``transfer=mode``."""
    return decode_rank(spec, same_process="nixl", transfer=mode, **kw)


#: Bytes of a packed copy of a 3-block request of make_spec(kv_heads=4) on one rank: k and v,
#: 4 heads x 12 tokens x 2 layers x 16 bytes.
SLOT = 2 * 4 * 12 * 2 * 16

NHD = make_spec(kv_heads=8, layers=4, block_size=16, head_dim=16, layout="NHD", num_blocks=32)


async def test_head_sliced_nhd_reads_far_fewer_descriptors() -> None:
    """Cross-TP on a head-sliced NHD cache, a packed pull posts at least 20x fewer descriptors
    than a direct one; auto reads packed exactly where the direct read exceeds the threshold."""
    packed, _ = await pull_all(NHD, NHD, 1, 2, "packed", transfer="packed")
    direct, _ = await pull_all(NHD, NHD, 1, 2, "direct", transfer="packed")
    auto, _ = await pull_all(NHD, NHD, 1, 2, "auto", consumer_kw={"pack_threshold": 300}, transfer="packed")
    full = [(a, b) for a, b in zip(packed, direct, strict=True) if b.bytes == max(r.bytes for r in direct)]
    assert full and all(a.descriptors * 20 <= b.descriptors for a, b in full)
    assert [r.path for r in auto] == ["packed" if b.descriptors > 300 else "read" for b in direct]
    assert "packed" in {r.path for r in auto}


async def test_auto_reads_directly_below_the_threshold() -> None:
    """With a descriptor threshold above the pull's count, auto reads the paged blocks directly."""
    spec = make_spec(kv_heads=4, layout="head-major")
    reqs = make_requests(spec, 1, 3, seed=3)
    async with (
        prefill_engine(spec, 1, transfer="packed") as engine,
        consumer_for(spec, "auto", pack_threshold=10_000) as consumer,
    ):
        engine.expose_requests(reqs)
        session = await consumer.connect(engine.endpoint)
        result = await (await session.pull(reqs[0].request_id, [0, 1, 2], reqs[0].block_ids))
        assert result.path == "read"
        assert verify_request(consumer.kv_caches, spec, 0, 1, [0, 1, 2], reqs[0].seed)


async def test_a_full_pool_falls_back_to_direct_reads_and_frees_slots() -> None:
    """A request that finds the prefill pool full is read directly (counted), bit-exact; its
    slot-holding neighbour's slot is freed once with its release, so the pool serves again;
    a full decode staging area also falls back to direct reads."""
    spec = make_spec(kv_heads=4)
    reqs = make_requests(spec, 3, 3, seed=5)
    async with prefill_engine(spec, 1, transfer="packed", pack_pool_bytes=SLOT) as engine:
        engine.expose_requests(reqs[:2])
        producer = engine.producers[0]
        assert producer.metrics.counters["packed"] == 1 and producer.metrics.counters["pack_fallbacks"] == 1
        async with consumer_for(spec, "packed") as consumer:
            session = await consumer.connect(engine.endpoint)
            results = []
            for n, req in enumerate(reqs[:2]):
                local = [3 * n, 3 * n + 1, 3 * n + 2]
                results.append(await (await session.pull(req.request_id, local, req.block_ids)))
                assert verify_request(consumer.kv_caches, spec, 0, 1, local, req.seed)
            assert [r.path for r in results] == ["packed", "read"]
            assert results[0].descriptors == 2 < results[1].descriptors  # k and v; the direct read's runs
        await wait_for(lambda: len(engine.reasons) == 2)
        engine.expose_requests(reqs[2:])
        assert producer.metrics.counters["packed"] == 2  # the freed slot took the next request
        async with consumer_for(spec, "packed", pack_staging_bytes=256) as consumer:
            session = await consumer.connect(engine.endpoint)
            result = await (await session.pull(reqs[2].request_id, [0, 1, 2], reqs[2].block_ids))
            assert result.path == "read"
            assert verify_request(consumer.kv_caches, spec, 0, 1, [0, 1, 2], reqs[2].seed)


async def test_a_lease_expiring_mid_read_of_a_packed_copy_fails_the_pull() -> None:
    """A packed copy whose lease runs out while it is being read fails the pull with
    LeaseExpiredError, never a success; its slot and its staging range go back to their pools."""
    spec = make_spec(kv_heads=4)
    reqs = make_requests(spec, 2, 3, seed=9)
    backend = SlowPackedReads(f"slow-{id(reqs)}")
    async with (
        prefill_engine(spec, 1, transfer="packed", pack_pool_bytes=SLOT) as engine,
        consumer_for(spec, "packed", backend=backend, pack_staging_bytes=SLOT) as consumer,
    ):
        session = await consumer.connect(engine.endpoint)
        producer = engine.producers[0]
        req = reqs[0]
        fill_request(producer.kv_caches, spec, 0, 1, req.block_ids, req.seed)
        producer.expose(req.request_id, req.block_ids, lease=0.3)
        transfer = await session.pull(req.request_id, [0, 1, 2], req.block_ids)
        await wait_for(lambda: (req.request_id, "expired") in engine.reasons)
        backend.go.set()
        with pytest.raises(akv.LeaseExpiredError):
            await transfer
        engine.expose_requests(reqs[1:])
        result = await (await session.pull(reqs[1].request_id, [3, 4, 5], reqs[1].block_ids))
        assert result.path == "packed" and consumer.metrics.counters["unsafe_reads"] == 1


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_release_after_pack_hands_blocks_back_before_the_read() -> None:
    """With release_after_pack, the blocks are released (reason "packed") at expose, before
    any read; the engine may reuse them, yet a packed pull is bit-exact, a direct one fails
    typed, and no second release follows the reads."""
    spec = make_spec(kv_heads=4)
    reqs = make_requests(spec, 2, 3, seed=13)
    async with prefill_engine(spec, 2, transfer="packed", release_after_pack=True) as engine:
        engine.expose_requests(reqs)
        assert engine.reasons == Counter({(r.request_id, "packed"): 2 for r in reqs})
        for prod in engine.producers:  # the engine reuses the blocks for other requests
            for req in reqs:
                fill_request(prod.kv_caches, spec, prod.tp_rank, 2, req.block_ids, req.seed + 1)
        async with consumer_for(spec, "direct") as consumer:
            session = await consumer.connect(engine.endpoint)
            with pytest.raises(akv.errors.ReleasedError, match="packed"):
                await (await session.pull(reqs[0].request_id, [0, 1, 2], reqs[0].block_ids))
        async with consumer_for(spec, "auto") as consumer:
            session = await consumer.connect(engine.endpoint)
            result = await (await session.pull(reqs[1].request_id, [0, 1, 2], reqs[1].block_ids))
            assert result.path == "packed"
            assert verify_request(consumer.kv_caches, spec, 0, 1, [0, 1, 2], reqs[1].seed)
        await wait_for(lambda: all(not p.pending for p in engine.producers))
        assert engine.reasons == Counter({(r.request_id, "packed"): 2 for r in reqs})


async def test_packed_from_an_engine_that_does_not_pack_is_a_typed_error() -> None:
    """transfer='packed' against prefill ranks keeping no packed copies fails at connect with
    IncompatiblePeerError naming the option."""
    spec = make_spec(kv_heads=4)
    async with prefill_engine(spec, 1) as engine, consumer_for(spec, "packed") as consumer:
        with pytest.raises(akv.IncompatiblePeerError, match="transfer") as info:
            await consumer.connect(engine.endpoint)
        assert info.value.fields == ("transfer",)


def test_demo_with_packed_transfers_says_packed() -> None:
    """`akv demo --transfer packed` pulls every request packed across processes and TP sizes
    (its JSON `paths` says so); a zero staging pool is one line and exit 64."""
    small = [
        "--kv-heads",
        "4",
        "--layers",
        "2",
        "--block-size",
        "4",
        "--head-dim",
        "16",
        "--dtype",
        "float16",
    ]
    run = [sys.executable, "-m", "akv", "demo", "--prefill-tp", "2", "--decode-tp", "1", *small]
    proc = subprocess.run(
        [*run, "--requests", "3", "--transfer", "packed", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["paths"] == {"packed": 3} and summary["verified"] == summary["released"] == 3
    bad = subprocess.run([*run, "--pack-pool-mib", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 64
    assert bad.stderr.strip().splitlines() == ["akv demo: --pack-pool-mib must be >= 1, got 0"]


def test_bench_reports_a_packed_pulls_stages() -> None:
    """`akv bench --transfer packed` reads every request of `head_sliced_nhd` packed, with a
    few descriptors where the direct read posts one per token, layer and plane, and reports
    each stage of a packed pull: lookup, read and scatter all took time, and together no
    longer than the slowest request (each of the two decode ranks pulls once per request)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "akv",
            "bench",
            "--quick",
            "--transfer",
            "packed",
            "--only",
            "head_sliced_nhd",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (w,) = list(json_lines(proc.stdout.splitlines()))[-1]["workloads"]
    assert w["transfer"] == "packed" and w["paths"] == {"packed": 16}  # 8 requests x 2 decode ranks
    assert w["descriptors"] * 20 <= w["nixl_descriptors_submitted"]
    stages = [w["lookup_ms"], w["read_ms"], w["unpack_ms"]]
    assert all(ms > 0 for ms in stages) and w["pack_ms"] > 0
    assert sum(stages) <= w["p99_ms"]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_concurrent_large_packed_pulls_scatter_off_the_event_loop_bit_exact() -> None:
    """Packed pulls of more than WORKER_BYTES staged at once (scattered in the staging pool's
    worker thread, which wakes the poller when done, on asyncio and trio) fill the cache
    bit-exact, after a partial prefix hit too."""
    spec = make_spec(kv_heads=8, head_dim=128, layers=16, block_size=16, num_blocks=80, layout="NHD")
    reqs = make_requests(spec, 2, 36, seed=17)
    async with (
        prefill_engine(spec, 1, transfer="packed") as engine,
        consumer_for(spec, "packed", pack_staging_bytes=96 << 20) as consumer,
    ):
        engine.expose_requests(reqs)
        session = await consumer.connect(engine.endpoint)
        pulls = []
        for n, (req, hit) in enumerate(zip(reqs, (0, 4), strict=True)):
            local = list(range(40 * n, 40 * n + 36 - hit))
            pulls.append(
                (
                    req,
                    local,
                    await session.pull(req.request_id, local, req.block_ids, num_tokens=req.num_tokens),
                )
            )
        with anyio.fail_after(30):
            for req, local, transfer in pulls:
                result = await transfer
                assert result.path == "packed" and result.bytes >= WORKER_BYTES
                assert verify_request(
                    consumer.kv_caches, spec, 0, 1, local, req.seed, num_tokens=req.num_tokens
                )
        assert any(t.name.startswith("akv-scatter") for t in threading.enumerate())  # the worker ran
        assert consumer.staging is not None and consumer.staging.active == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_timed_out_packed_pull_frees_its_staging_once() -> None:
    """A packed pull that times out mid-read fails with TransferTimeout only once NIXL reports
    its read finished (a consumer with its own backend cannot replace the agent), its staging
    range goes back then, and the next pull gets it."""
    spec = make_spec(kv_heads=4)
    reqs = make_requests(spec, 2, 3, seed=19)
    backend = SlowPackedReads(f"stuck-{id(reqs)}")
    async with (
        prefill_engine(spec, 1, transfer="packed") as engine,
        consumer_for(
            spec, "packed", backend=backend, pack_staging_bytes=SLOT, transfer_timeout=0.3
        ) as consumer,
    ):
        engine.expose_requests(reqs)
        session = await consumer.connect(engine.endpoint)

        async def finish_reads() -> None:
            await anyio.sleep(0.8)  # well past the transfer timeout
            backend.go.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(finish_reads)
            with pytest.raises(akv.TransferTimeout):
                await (await session.pull(reqs[0].request_id, [0, 1, 2], reqs[0].block_ids))
            assert backend.go.is_set()  # not reported while its read could still land
        result = await (await session.pull(reqs[1].request_id, [3, 4, 5], reqs[1].block_ids))
        assert result.path == "packed"
        assert verify_request(consumer.kv_caches, spec, 0, 1, [3, 4, 5], reqs[1].seed)
        assert consumer.staging is not None and consumer.staging.active == 0


class HeldThenRefused(NixlBackend):
    """The real backend; the first packed-copy read reports "PROC" until ``go`` is set, the
    second one is refused when posted (as a lost peer's would be)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.go = anyio.Event()
        self.held: XferHandle = None
        self.refused = 0

    def read_descs(self, *args: Any) -> XferHandle:
        if self.held is not None and not self.refused:
            self.refused += 1
            raise akv.TransferError("posting the read failed (injected)")
        handle = super().read_descs(*args)
        self.held = self.held if self.held is not None else handle
        return handle

    def state(self, handle: XferHandle) -> XferState:
        done = super().state(handle)
        return "PROC" if handle is self.held and not self.go.is_set() else done


async def test_a_packed_pull_failing_mid_post_keeps_its_staging_until_its_reads_finish() -> None:
    """A packed pull whose read from one prefill rank is posted and whose read from the other
    is refused fails only once the posted read finished; until then its staging range stays
    taken (a pull meanwhile reads direct, bit-exact), and afterwards the next pull reads packed."""
    spec = make_spec(kv_heads=4)
    reqs = make_requests(spec, 3, 3, seed=29)
    backend = HeldThenRefused(f"refused-{id(reqs)}")
    slot = SLOT // 2  # one rank's half of a request: two ranks' halves fill the staging area
    async with (
        prefill_engine(spec, 2, transfer="packed") as engine,
        consumer_for(spec, "packed", backend=backend, pack_staging_bytes=2 * slot) as consumer,
    ):
        engine.expose_requests(reqs)
        session = await consumer.connect(engine.endpoint)
        failing = await session.pull(reqs[0].request_id, [0, 1, 2], reqs[0].block_ids)
        await wait_for(lambda: backend.refused == 1)
        meanwhile = await (await session.pull(reqs[1].request_id, [3, 4, 5], reqs[1].block_ids))
        assert meanwhile.path == "read"  # the staging range may still be written
        assert verify_request(consumer.kv_caches, spec, 0, 1, [3, 4, 5], reqs[1].seed)
        assert not failing.done()
        backend.go.set()
        with anyio.fail_after(10), pytest.raises(akv.TransferError, match="injected"):
            await failing
        after = await (await session.pull(reqs[2].request_id, [6, 7, 8], reqs[2].block_ids))
        assert after.path == "packed"
        assert verify_request(consumer.kv_caches, spec, 0, 1, [6, 7, 8], reqs[2].seed)
        assert consumer.staging is not None and consumer.staging.active == 0


@pytest.mark.parametrize(("layout", "packs"), [("HND", True), ("head-major", False)])
async def test_a_prefill_engine_on_auto_packs_only_fragmented_layouts(layout: str, packs: bool) -> None:
    """Producer(transfer="auto") keeps packed copies on a per-layer HND cache (many runs per
    head and block) and none on head-major (one run): a packed pull works on the first and is
    refused, naming the option, on the second."""
    spec = make_spec(kv_heads=4, layout=layout)
    req = make_requests(spec, 1, 3, seed=23)[0]
    async with prefill_engine(spec, 1, transfer="auto") as engine, consumer_for(spec, "packed") as consumer:
        engine.expose_requests([req])
        if not packs:
            with pytest.raises(akv.IncompatiblePeerError, match="transfer"):
                await consumer.connect(engine.endpoint)
            return
        session = await consumer.connect(engine.endpoint)
        result = await (await session.pull(req.request_id, [0, 1, 2], req.block_ids))
        assert result.path == "packed"
        assert verify_request(consumer.kv_caches, spec, 0, 1, [0, 1, 2], req.seed)


async def test_a_request_exposed_before_its_layers_are_computed_is_packed_once_they_are() -> None:
    """A packing prefill rank that exposes a request with layers still to compute (push-style
    streaming) packs it only once ``layers_ready`` reports the last layer: a packed pull then
    reads the computed bytes, not what the blocks held at expose()."""
    spec = make_spec(kv_heads=4)
    req = make_requests(spec, 1, 3, seed=29)[0]
    async with prefill_engine(spec, 1, transfer="packed") as engine, consumer_for(spec, "packed") as consumer:
        producer = engine.producers[0]
        producer.expose(req.request_id, req.block_ids, layers_ready=0)  # nothing computed yet
        assert producer.metrics.counters.get("packed", 0) == 0
        fill_request(producer.kv_caches, spec, 0, 1, req.block_ids, req.seed, req.num_tokens)  # "compute"
        producer.layers_ready(req.request_id, spec.layers)
        assert producer.metrics.counters["packed"] == 1
        session = await consumer.connect(engine.endpoint)
        result = await (await session.pull(req.request_id, [0, 1, 2], req.block_ids))
        assert result.path == "packed"
        assert verify_request(consumer.kv_caches, spec, 0, 1, [0, 1, 2], req.seed)


def test_release_after_pack_serves_pull_only() -> None:
    """Producer(release_after_pack=True, modes=["push"]) is a ConfigError naming what to
    change (its blocks go back before a push could write them); alone it serves pull only."""
    spec = make_spec(kv_heads=4)
    with pytest.raises(akv.ConfigError, match="release_after_pack"):
        prefill_rank(spec, transfer="packed", release_after_pack=True, modes=["pull", "push"])
    producer = prefill_rank(spec, transfer="packed", release_after_pack=True)
    assert producer.modes == ("pull",)


def test_the_demo_pushes_packed_copies_in_fewer_descriptors() -> None:
    """``akv demo --mode push --transfer packed``: every request verified and released, in
    fewer descriptors than ``--transfer direct`` pushes (the packed copies' runs)."""
    run = [sys.executable, "-m", "akv", "demo", "--prefill-tp", "2", "--decode-tp", "1", "--kv-heads", "4"]
    run += ["--layout", "NHD", "--requests", "2", "--mode", "push", "--json"]
    summaries = {}
    for transfer in ("packed", "direct"):
        proc = subprocess.run([*run, "--transfer", transfer], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        summaries[transfer] = json.loads(proc.stdout.splitlines()[-1])
        assert summaries[transfer]["paths"] == {"push": 2} and summaries[transfer]["verified"] == 2
    assert summaries["packed"]["bytes"] == summaries["direct"]["bytes"]
    assert summaries["packed"]["descriptors"] < summaries["direct"]["descriptors"]


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(make_spec(kv_heads=8, layout="NHD", block_size=4, num_blocks=16), id="nhd"),
        pytest.param(make_spec(kv_heads=8, layout="HND", block_size=4, num_blocks=16), id="hnd"),
        pytest.param(
            make_spec(kv_heads=8, layout="head-major", block_size=4, num_blocks=16), id="head-major"
        ),
        pytest.param(make_spec(mla=True, block_size=4, num_blocks=16), id="mla"),
        pytest.param(
            akv.preset("qwen3-next-80b", layers=4, blocks=16, dtype="float32", layout="head-major"),
            id="hybrid",
        ),
    ],
)
@pytest.mark.parametrize("partial", [False, True], ids=["whole-blocks", "some-positions"])
def test_the_numpy_and_torch_scatters_write_the_same_bytes(spec: Any, partial: bool) -> None:
    """The DRAM scatter (numpy) and the one CUDA pulls use (torch index copies), run on the
    same staged bytes of every group and component of a decode rank of TP 2 (each half of its
    units apart, where it holds more than one), whole blocks or
    some positions of each block (mixed block sizes), write identical caches (the pulls above
    check the numpy one bit-exact end to end)."""
    cache = as_cache(spec)
    layout = rank_layout(cache, 0, 2)
    caches = {kind: akv.allocate_kv_cache(spec, 0, 2) for kind in ("numpy", "torch")}
    views = {kind: CacheViews(kv, layout) for kind, kv in caches.items()}
    rng = np.random.default_rng(31)
    for gi, gl in enumerate(layout.groups):
        g = gl.group
        bs = g.block_size if g.tokens else 1
        chosen = rng.permutation(g.num_blocks)[:3].astype(np.int64)
        keep = np.arange(0, bs, 2) if partial and bs > 1 else np.arange(bs)
        blocks, positions = np.repeat(chosen, len(keep)), np.tile(keep, len(chosen))
        for ci, placement in enumerate(gl.placements):
            held = placement.units  # in halves (as from two prefill ranks), where it can be
            cut = held.start + max(1, len(held) // 2)
            for units in (range(held.start, cut), range(cut, held.stop)):
                if not units:
                    continue
                nbytes = len(units) * len(g.layers) * len(blocks) * placement.run
                staged = torch.from_numpy(rng.integers(1, 255, nbytes, dtype=np.uint8))
                for kind in ("numpy", "torch"):
                    scatter(views[kind], gi, ci, units, staged, blocks, positions, torch_ops=kind == "torch")
    for a, b in zip(caches["numpy"], caches["torch"], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bytes: random ones make NaNs
    assert any(bool(t.view(torch.uint8).any()) for t in caches["numpy"])


def test_auto_weighs_descriptors_by_the_memory_they_move() -> None:
    """``transfer="auto"`` on device memory reads packed where 64 descriptors of 64 KiB would
    cost more than the packed copy's scatter (~6 us a descriptor there), and on DRAM reads
    such a request directly (its runs move faster than a second copy); with fewer than the
    device threshold's descriptors, or runs above its mean, it reads directly on both."""
    from types import SimpleNamespace

    from akv.runtime.paths.packed import (
        AUTO_DESCRIPTORS,
        AUTO_RUN_BYTES,
        DEVICE_AUTO_DESCRIPTORS,
        DEVICE_AUTO_RUN_BYTES,
        use_packed,
    )

    def prepared(descriptors: int, run: int) -> Any:
        post = (SimpleNamespace(remote_rank=0), None, None)
        return SimpleNamespace(posts=(post,), bytes=descriptors * run, descriptors=descriptors)

    packs: Any = {0: SimpleNamespace(early=False)}
    device = (DEVICE_AUTO_DESCRIPTORS, DEVICE_AUTO_RUN_BYTES)
    dram = (AUTO_DESCRIPTORS, AUTO_RUN_BYTES)
    assert use_packed("auto", prepared(64, 64 << 10), packs, *device)
    assert not use_packed("auto", prepared(64, 64 << 10), packs, *dram)
    assert not use_packed("auto", prepared(16, 64 << 10), packs, *device)
    assert not use_packed("auto", prepared(64, 4 << 20), packs, *device)
    assert use_packed("auto", prepared(1024, 1024), packs, *dram)
    assert not use_packed("auto", prepared(64, 64 << 10), {0: None}, *device)  # the rank keeps no packed copy
    spec = make_spec(kv_heads=4)
    consumer = akv.Consumer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1)
    assert (consumer.pack_threshold, consumer.pack_run_bytes) == dram  # DRAM: the measured defaults


@pytest.mark.parametrize("published", [True, False])
async def test_a_copy_still_being_gathered_is_waited_for_not_read_around(
    published: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill rank's directory that says the request's copy is still being gathered (a
    device gather queued, not yet done) makes the packed pull look again rather than read the
    paged blocks: once the copy is published, the pull reads it packed (a few descriptors);
    a copy that stays pending past the wait is read directly. Both bit-exact."""
    from akv.runtime.paths import packed as packed_path

    # the gather "finishes" once the decode has looked twice: wait up to 5 s for it; the copy
    # that never finishes is given up on after 50 ms
    monkeypatch.setattr(packed_path, "PENDING_WAIT_S", 5.0 if published else 0.05)
    spec = make_spec(kv_heads=4)
    req = make_requests(spec, 1, 3, seed=31)[0]
    async with prefill_engine(spec, 1, transfer="packed") as engine, consumer_for(spec, "packed") as consumer:
        engine.expose_requests([req])
        directory = engine.producers[0].packer.directory
        h = akv.exposure.request_hash(req.request_id)
        entry = find(directory.array[h % directory.buckets], req.request_id)
        assert entry is not None
        assert directory.mark_pending(req.request_id)  # as a queued device gather leaves it
        session = await consumer.connect(engine.endpoint)

        def lookups() -> int:  # READs of the directory, or copies of its bucket (this host)
            counters = consumer.metrics.counters
            return counters.get("xfers_directory", 0) + counters.get("directories_shared", 0)

        before = lookups()
        async with anyio.create_task_group() as tg:
            if published:

                async def gathered() -> None:
                    await wait_for(lambda: lookups() >= before + 2)
                    assert directory.publish(req.request_id, *entry)

                tg.start_soon(gathered)
            result = await (await session.pull(req.request_id, [0, 1, 2], req.block_ids))
        assert verify_request(consumer.kv_caches, spec, 0, 1, [0, 1, 2], req.seed)
        if published:
            assert result.path == "packed" and result.descriptors == 2  # k and v
        else:
            assert result.path == "read" and result.descriptors > 2
            assert lookups() - before > 2  # it looked again
