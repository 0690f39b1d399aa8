"""How often does a checked pull wait for a stopped prefill process because of UCX's keepalive?

Each trial runs an ``akv prefill`` process (one rank, two requests, ``TRANSFER``)
and a decode rank in this process; the decode pulls the first request (which makes the link),
waits until the READ behind its "done" notice finished, optionally sleeps (``DELAYS``, one
picked at random per trial), stops the prefill with SIGSTOP and pulls the second request with
a timeout (``STOPPED_TIMEOUT``). A pull that does not finish in time *waited*: something on its way needed the
prefill's UCX worker to run. The prefill is resumed and killed after each trial.

``KEEPALIVE=off`` sets ``UCX_KEEPALIVE_INTERVAL=inf`` for both processes (UCX then sends no
keepalive check at all); ``on`` leaves UCX's default (a first round soon after the link is
made, then one every 20 s). Over a TCP lane for UCX's active messages (what UCX picks between
processes on one host here), UCX marks the endpoint after any message, keepalive checks
included, and the flush NIXL puts behind every READ then waits for the peer's acknowledgement.

A diagnostic, not part of the suite (pytest collects only ``test_*.py`` files from
``tests``): run it by its path, under pytest (the waits showed under pytest's runner; the same trials
in a plain ``anyio.run`` script waited in 0 of 80). Settings come from the
environment: ``KEEPALIVE`` (``on``, ``off``), ``TRANSFER`` (``packed``, ``direct``),
``TRIALS``, ``STOPPED_TIMEOUT`` (seconds), ``DELAYS`` (comma-separated seconds), ``SEED``.
One JSON line per run:

    KEEPALIVE=on TRIALS=40 .venv/bin/python -m pytest -q -s -p no:cacheprovider \\
        tests/diagnostics/ucx_keepalive_stall.py
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import anyio
import pytest

from akv.metrics import CONTROL_OPS
from akv.testing import fetch_requests
from tests.conftest import MODEL, cli_spec, decode_rank, prefill_process


async def trial(transfer: str, delay: float, stopped_s: float, env: dict[str, str]) -> bool:
    """One trial; True if the second pull finished while the prefill was stopped."""
    extra = ["--transfer", transfer]
    with prefill_process(1, 4, "--lease", "30", *extra, requests=2, env=env) as (proc, endpoint):
        spec = cli_spec("--kv-heads", "4", *MODEL)
        first, second = await fetch_requests(endpoint, spec, None, "t")
        async with decode_rank(spec, transfer_timeout=20.0, transfer=transfer) as consumer:
            session = await consumer.connect(endpoint)
            await (await session.pull(first.request_id, [0, 1, 2, 3], first.block_ids))
            flush_reads = CONTROL_OPS["flush_reads"]
            with anyio.fail_after(10):
                while (
                    consumer.metrics.snapshot().counters.get(flush_reads, 0) < 1 or consumer.reaper.background
                ):
                    await anyio.sleep(0.02)
            await anyio.sleep(delay)
            proc.send_signal(signal.SIGSTOP)
            try:
                with anyio.move_on_after(stopped_s) as scope:
                    await (await session.pull(second.request_id, [4, 5, 6, 7], second.block_ids))
            finally:
                proc.send_signal(signal.SIGCONT)
            return not scope.cancelled_caught


@pytest.fixture
def anyio_backend() -> str:
    """asyncio only (where the waits were measured)."""
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.timeout(3600)  # the trials take about 4 s each
async def test_stopped_prefill_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the trials (settings from the environment, see the module) and print one JSON line;
    with the keepalive off, no pull may wait (what `tests/test_control_ops.py` relies on)."""
    keepalive = os.environ.get("KEEPALIVE", "on")
    transfer = os.environ.get("TRANSFER", "packed")
    trials = int(os.environ.get("TRIALS", "20"))
    stopped_s = float(os.environ.get("STOPPED_TIMEOUT", "4"))
    delays = [float(d) for d in os.environ.get("DELAYS", "0,0,0.001,0.01,0.05,0.2,0.5,1,2").split(",")]
    rng = random.Random(int(os.environ.get("SEED", "1")))
    env = {"UCX_KEEPALIVE_INTERVAL": "inf"} if keepalive == "off" else {}
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the decode agents in this process read it when they are made
    started = time.monotonic()
    waited = 0
    for _ in range(trials):
        waited += not await trial(transfer, rng.choice(delays), stopped_s, env)
    summary = {"keepalive": keepalive, "transfer": transfer, "trials": trials, "waited": waited}
    print(json.dumps({**summary, "seconds": round(time.monotonic() - started, 1)}))
    if keepalive == "off":
        assert waited == 0, summary
