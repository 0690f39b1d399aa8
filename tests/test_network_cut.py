"""A network cut between two hosts never kills either side (issue 33): an ``akv prefill`` on
host A, a decode process on host B pulling 64 MiB requests over TCP between the namespaces
(``UCX_TLS`` unset); mid-transfer A's link drops every packet for longer than the decode's
transfer timeout, then comes back. Both processes still run, the pull failed typed in time,
a pull after the restore verifies bit-exact, and every exposure is released once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.hosts import AKV, Host, Lines, Network, akv_env, hosts, reset_after_each

pytestmark = pytest.mark.slow

two = hosts(2)
ab = reset_after_each("two")  # the two hosts, reset after each test

SECRET = "cut-test-secret"
PER_REQUEST = 256  # 256 KiB blocks: 64 MiB requests
GEOMETRY = ["--layers", "4", "--kv-heads", "8", "--block-size", "16", "--head-dim", "128", "--dtype", "bfloat16"]  # fmt: skip
TIMEOUT = 3.0  # the decode's transfer_timeout
GRACE = 2.0  # its stop_grace_s: the writer cannot confirm a stop through the cut
CUT = 6.0  # seconds the link drops everything: longer than TIMEOUT + GRACE (heals after the deadline)
#: percent of packets A's link drops while the cut pull runs, before the cut: TCP crawls, so the
#: cut (0.2 s after the post) lands with the pull's requests delivered and its data on the wire
LOSS = 50.0
LEASE = 25.0  # the cut request's exposure expires this long after its last heartbeat

# On host B: fetch the three announced requests, pull #2 clean; once told (a line on stdin),
# post #0 and report its outcome; once told the link is back, pull #1 and verify it.
DECODE = """
import json, sys, time, anyio, torch, akv
from akv.cli import build_parser
from akv.cli.args import spec_from_args
from akv.testing import fetch_requests, verify_request
endpoint, secret, mode, timeout, grace = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
spec = spec_from_args(build_parser().parse_args(sys.argv[6:]))
def emit(event, **kw):
    print(json.dumps({"event": event, "at": time.monotonic(), **kw}), flush=True)
async def main():
    reqs = await fetch_requests(endpoint, spec, secret, "cut")
    kv = akv.allocate_kv_cache(spec, 0, 1)
    async with akv.Consumer(kv, spec, tp_rank=0, tp_size=1, secret=secret, transfer_timeout=timeout,
                            stop_grace_s=grace, mode=None if mode == "default" else mode) as c, \
               anyio.create_task_group() as tg:
        session = await c.connect(endpoint)
        local = list(range(len(reqs[0].block_ids)))
        with anyio.fail_after(60):
            r = await (await session.pull(reqs[2].request_id, local, reqs[2].block_ids))
        emit("clean", seconds=r.seconds, path=r.path, mode=session.mode, ok=verify_request(kv, spec, 0, 1, local, reqs[2].seed))
        async def heartbeat():  # keep #1 exposed until it is pulled (a queue's job)
            while True:
                await session.heartbeat([reqs[1].request_id])
                await anyio.sleep(1.0)
        tg.start_soon(heartbeat)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        t = await session.pull(reqs[0].request_id, local, reqs[0].block_ids)
        emit("posted")
        try:
            r = await t
            emit("outcome", result="done", seconds=r.seconds)
        except akv.AkvError as exc:
            for region in kv:  # the engine reuses the blocks at once
                region.view(torch.uint8)[local] = 0x5A
            emit("outcome", result="failed", error=type(exc).__name__, message=str(exc)[:300])
        await anyio.to_thread.run_sync(sys.stdin.readline)  # the poller keeps progressing meanwhile
        intact = all(bool((region.view(torch.uint8)[local] == 0x5A).all()) for region in kv)
        with anyio.fail_after(60):
            r = await (await session.pull(reqs[1].request_id, local, reqs[1].block_ids))
        emit("after", seconds=r.seconds, path=r.path, intact=intact, ok=verify_request(kv, spec, 0, 1, local, reqs[1].seed))
        tg.cancel_scope.cancel()
anyio.run(main)
"""


def env() -> dict[str, str]:
    """No ``UCX_TLS``: UCX picks TCP between the hosts by itself, as across real hosts."""
    e = akv_env(**({"UCX_HANDLE_ERRORS": "bt"} if os.environ.get("AKV_CUT_BT") else {}))
    for key in ("UCX_TLS", "UCX_NET_DEVICES"):
        e.pop(key, None)
    return e


def start_prefill(host: Host) -> tuple[Any, Lines, Lines, str]:
    argv = [
        *AKV, "prefill", "--tp-size", "1", "--tp-rank", "0", *GEOMETRY, "--blocks", str(3 * PER_REQUEST),
        "--requests", "3", "--blocks-per-request", str(PER_REQUEST), "--lease", str(LEASE), "--hold",
        "--host", host.ip, "--port", "7000", "--secret", SECRET, "--timeout", "120", "--json",
    ]  # fmt: skip
    proc = host.popen(
        argv, env=env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out = Lines(proc.stdout)
    return proc, out, Lines(proc.stderr), str(out.wait_json("ready", timeout=60)["endpoint"])


def start_decode(host: Host, endpoint: str, mode: str) -> tuple[Any, Lines, Lines]:
    argv = ["decode", "--connect", "x:1", "--tp-size", "1", "--blocks", str(PER_REQUEST), *GEOMETRY]
    cmd = [sys.executable, "-c", DECODE, endpoint, SECRET, mode, str(TIMEOUT), str(GRACE), *argv]
    proc = host.popen(
        cmd, env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return proc, Lines(proc.stdout), Lines(proc.stderr)


#: default: the consumer's own choice, which must be push between the two hosts (UCX moves data
#: over TCP between namespaces and there is no RDMA device). pull is refused there (READs over
#: TCP can kill the prefill: docs/operations.md#peer-death-over-tcp), and push is what
#: default picks: one case.
MODES = ["default"]


@pytest.mark.parametrize("mode", MODES)
def test_cut_link_mid_pull_leaves_both_sides_serving(ab: Network, mode: str) -> None:
    """The prefill host's link lossy, then blackholed 6 s mid-push (decode transfer timeout 3 s,
    stop grace 2 s), then restored: neither process dies, the pull fails typed within timeout +
    grace + 5 s, the blocks refilled right after it failed are still intact 8 s after the link
    healed, a pull after the restore verifies bit-exact, and every exposure is released once."""
    a, b = ab
    ab.require_faults()
    prefill, pout, perr, endpoint = start_prefill(a)
    decode, dout, derr = start_decode(b, endpoint, mode)

    def alive(when: str) -> None:
        assert prefill.poll() is None, (
            f"{when}: the prefill died ({prefill.returncode}):\n{perr.text(5)[-12000:]}"
        )
        assert decode.poll() is None, (
            f"{when}: the decode died ({decode.returncode}):\n{derr.text(5)[-3000:]}"
        )

    clean = dout.wait_json("clean", timeout=60)
    assert clean["ok"] and clean["mode"] == ("push" if mode == "default" else mode), clean
    assert clean["path"] == clean["mode"].replace("pull", "read"), clean
    assert decode.stdin is not None
    with a.loss(LOSS):
        decode.stdin.write("post\n")
        decode.stdin.flush()
        dout.wait_json("posted", timeout=30)
        posted = time.monotonic()
        time.sleep(0.2)
        with a.outage("blackhole"):
            cut = time.monotonic()
            try:
                outcome = dout.wait_json("outcome", timeout=CUT)
            except TimeoutError:
                outcome = None
            time.sleep(max(0.0, cut + CUT - time.monotonic()))
            alive("end of the cut")
    restored = time.monotonic()
    if outcome is None:
        outcome = dout.wait_json("outcome", timeout=TIMEOUT + GRACE + 5 - (restored - cut))
    print(
        f"mode {mode}: cut {cut - posted:.3f}s after the post, outcome {outcome['at'] - cut:.2f}s after the cut, clean {clean['seconds']:.2f}s ({clean['path']}), outcome {outcome}"
    )
    assert outcome["result"] == "failed", outcome  # the cut landed mid-transfer
    assert outcome["at"] - cut < TIMEOUT + GRACE + 5, outcome
    time.sleep(8.0)  # let the restored link deliver what it held: resets, retransmits
    alive("after the restore")

    decode.stdin.write("go\n")
    decode.stdin.flush()
    try:
        after = dout.wait_json("after", timeout=70)
    except EOFError:
        raise AssertionError(f"the decode ended ({decode.wait(10)}):\n{derr.text(5)[-6000:]}") from None
    assert after["intact"], f"bytes of the failed push landed in blocks handed back: {after}"
    assert after["ok"], after
    assert decode.wait(30) == 0, derr.text(5)[-3000:]
    assert prefill.poll() is None, f"the prefill died ({prefill.returncode}):\n{perr.text(5)[-12000:]}"

    pout.wait_json("released", timeout=LEASE + 15)  # the cut request: released by its lease
    prefill.send_signal(signal.SIGTERM)
    assert prefill.wait(30) in (0, 3), perr.text(5)[-12000:]  # 3: some request expired (EXIT_EXPIRED)
    summary = pout.wait_json("summary", timeout=5)
    print(f"mode {mode}: prefill summary {summary}")
    assert summary["duplicate_releases"] == 0 and summary["unreleased"] == 0, summary
    assert summary["released"] + summary["expired"] == 3, summary
    assert len(summary["released_ids"]) >= 2, summary  # the clean pull and the one after the restore
