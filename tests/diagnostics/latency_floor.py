"""How much of a one-block pull's time is akv's own, beyond the work its safety needs?

Runs the bench's ``latency`` workload (`akv.bench.measure.bench_workload`: a real ``akv
prefill`` process, one block of 8 layers a pull, every method interleaved) with the
``akv_unchecked`` slot replaced by a *floor*: the steps a checked pull cannot skip, called one
after the other on the checked decode rank's agent, with none of akv's objects around them
(no `Transfer`, op, poller or counters):

  validate and plan the ids (``plan.prepare``), digest them, encode the "done" notice, hash
  the request id, post the READs (`NixlBackend.read`), poll each until DONE and release it,
  load the request's slot from the prefill's table in shared memory and verify it
  (`akv.exposure.shared_slot`, `akv.exposure.verify`: a floor pull that would be unsafe fails
  the run).

It prints one JSON line: the p50 and mean in microseconds of akv's checked pull, of the floor
and of the hand-written NIXL loop, and the loop's p50 over akv's and over the floor's (the
loop's READ carries its notice; a checked pull's and the floor's carry none). The gap between
akv and the floor is what akv's layers around those steps cost.

A diagnostic, not part of the suite (pytest collects only ``test_*.py`` files from ``tests``):

    .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/diagnostics/latency_floor.py
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

from akv import exposure
from akv.bench import measure
from akv.bench.measure import bench_workload
from akv.bench.methods import Methods
from akv.bench.workloads import WORKLOADS
from akv.protocol.messages import RequestInfo


def _floor(methods: Methods, batch: list[tuple[str, Any, Any]], record: bool) -> tuple[int, float]:
    started = time.perf_counter()
    total = 0
    for session, consumer in zip(methods.sessions, methods.consumers, strict=True):
        backend, dlists, links = consumer.backend, session.engine.dlists, session.engine.links
        for rid, local, remote in batch:
            request_id = f"{rid}-u"
            p = session.plan.prepare(request_id, local, remote)
            fingerprint = exposure.digest(p.remote_ids)
            session.done_notice(request_id, p.remote_ids, 0, fingerprint)  # encoded, as a pull does
            token_hash = exposure.request_hash(request_id)
            posted = [
                (backend.read(dlists[op.local_table], li, dlists[op.remote_table], ri, b""), op.remote_rank)
                for op, li, ri in p.posts
            ]
            for handle, _ in posted:
                while backend.state(handle) != "DONE":
                    pass
                backend.release(handle)
            for _, rank in posted:
                check = links[rank].check
                slot = exposure.shared_slot(
                    check.words, token_hash, (token_hash % check.buckets) * exposure.BUCKET_WORDS
                )
                error = exposure.verify(
                    slot,
                    request_id,
                    p.remote_ids,
                    prefill_rank=rank,
                    read_ids=p.read_ids,
                    token_hash=token_hash,
                    fingerprint=fingerprint,
                )
                assert error is None, error
            total += p.bytes
    seconds = time.perf_counter() - started
    if record:
        methods.fig.latency_unchecked_ms.extend([seconds * 1e3] * len(batch))
    return total, seconds


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_latency_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    run = Methods.run

    async def with_floor(self: Methods, method: str, batch: Any, record: bool) -> tuple[int, float]:
        if method == "akv_unchecked":
            return _floor(self, batch, record)
        return await run(self, method, batch, record)

    save = measure.save_requests

    def save_with_floor(path: str, requests: list[RequestInfo]) -> None:
        # the floor verifies its own exposures: ``-u`` beside each one akv pulls
        extra = [RequestInfo(request_id=f"{r.request_id}-u", block_ids=r.block_ids) for r in requests]
        save(path, [*requests, *extra])

    monkeypatch.setattr(Methods, "run", with_floor)
    monkeypatch.setattr(measure, "save_requests", save_with_floor)
    workload = next(w for w in WORKLOADS if w.name == "latency")
    fig = await bench_workload(workload, 8, lambda _: None)
    us = {
        name: np.asarray(values) * 1e3
        for name, values in (
            ("akv", fig.latency_ms),
            ("floor", fig.latency_unchecked_ms),
            ("nixl", fig.latency_nixl_ms),
        )
    }
    out: dict[str, float] = {}
    for name, values in us.items():
        out[f"{name}_p50_us"] = round(float(np.median(values)), 1)
        out[f"{name}_mean_us"] = round(float(values.mean()), 1)
    out["akv_vs_nixl_p50"] = round(out["nixl_p50_us"] / out["akv_p50_us"], 3)
    out["floor_vs_nixl_p50"] = round(out["nixl_p50_us"] / out["floor_p50_us"], 3)
    print(json.dumps(out))
