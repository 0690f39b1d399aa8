"""The separate-hosts harness (tests/hosts.py): namespaces, process trees, faults, and akv across
hosts with UCX moving the data over TCP between nodes, never over shared memory: the prefill
pushes (UCX never serves READs over TCP; a decode asking to pull there is refused)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.conftest import MODEL
from tests.hosts import (
    AKV,
    IFACE,
    Host,
    Lines,
    Network,
    akv_env,
    assert_inter_node_tcp,
    hosts,
    pidns_members,
    proto_tables,
    reset_after_each,
)

two = hosts(2)
ab = reset_after_each("two")  # the two hosts, reset after each test


SECRET = "hosts-test-secret"
REQUESTS = 6


def start_prefill(host: Host, *extra: str, env: dict[str, str] | None = None) -> tuple[Any, Lines, str]:
    """``akv prefill`` on ``host``, bound to its address; returns (process, its stdout, endpoint)."""
    argv = [
        *AKV, "prefill", "--tp-size", "1", "--kv-heads", "4", *MODEL,
        "--requests", str(REQUESTS), "--blocks-per-request", "4",
        "--host", host.ip, "--port", "7000", "--secret", SECRET, "--timeout", "60", "--json", *extra,
    ]  # fmt: skip
    proc = host.popen(argv, env=env or akv_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Lines(proc.stdout)
    ready = out.wait_json("ready", timeout=60)
    return proc, out, str(ready["endpoint"])


def decode_argv(endpoint: str, *extra: str) -> list[str]:
    return [*AKV, "decode", "--tp-size", "1", "--kv-heads", "4", *MODEL, "--connect", endpoint,
            "--secret", SECRET, "--json", *extra]  # fmt: skip


def run_decode(host: Host, endpoint: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """``akv decode`` (default mode) on ``host`` against ``endpoint``; returns (its summary, all
    it printed)."""
    res = host.run(decode_argv(endpoint), env=env or akv_env(), timeout=90)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"decode printed no JSON (exit {res.returncode}): {res.stdout[-2000:]}{res.stderr[-2000:]}"
    summary = dict(json.loads(lines[-1]))
    assert res.returncode == 0, (summary, res.stderr[-2000:])
    return summary, res.stdout + res.stderr


def prefill_summary(proc: Any, out: Lines) -> dict[str, Any]:
    assert proc.wait(30) == 0, out.text(5)[-2000:]
    return out.wait_json("summary", timeout=5)


def assert_all_pushed(decode: dict[str, Any], prefill: dict[str, Any]) -> None:
    """Every request verified, moved by the prefill's WRITEs, and released once as pushed."""
    assert decode["requests"] == REQUESTS
    assert decode["verified"] == REQUESTS and decode["failed"] == 0, decode.get("errors")
    assert decode["paths"] == {"push": REQUESTS}, decode
    assert prefill["released"] == prefill["pushed"] == REQUESTS and prefill["expired"] == 0, prefill
    assert prefill["unreleased"] == prefill["duplicate_releases"] == 0, prefill
    assert prefill["auth_failures"] == 0 and prefill["notifications_invalid"] == 0


# -- the harness itself ---------------------------------------------------------------------


@pytest.mark.slow
def test_hosts_are_separate(ab: Network) -> None:
    """Own hostname, PID namespace, address; hosts reach each other and nothing else."""
    a, b = ab
    probe = 'echo "$(hostname) $(readlink /proc/self/ns/pid) $(ip -4 -o addr show dev {} | cut -d" " -f7)"'
    seen = [h.run(["sh", "-c", probe.format(IFACE)]).stdout.split() for h in (a, b)]
    assert [s[0] for s in seen] == [a.hostname, b.hostname]
    assert seen[0][1] != seen[1][1] != os.readlink("/proc/self/ns/pid")
    assert [s[2] for s in seen] == [f"{a.ip}/24", f"{b.ip}/24"]
    reach = "import socket,sys\ntry: socket.create_connection((sys.argv[1], 9), timeout=3)\nexcept OSError as e: print(type(e).__name__)"
    # Refused means a's stack answered; the root namespace's addresses do not exist for b.
    assert b.run([sys.executable, "-c", reach, a.ip]).stdout.strip() == "ConnectionRefusedError"


@pytest.mark.slow
def test_terminate_reaches_the_command_and_kill_ends_the_namespace(ab: Network) -> None:
    a = ab[0]
    handler = (
        "import signal,sys,time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
        "print('up', flush=True)\ntime.sleep(60)"
    )
    p = a.popen([sys.executable, "-c", handler], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    p.terminate()
    assert p.wait(10) == 7  # the command's own exit status, through the INIT shell
    p.stdout.close()

    tree = "sleep 600 & (sleep 600 &); setsid sleep 600 & echo up; sleep 600"
    p = a.popen(["sh", "-c", tree], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    assert p.pidns is not None
    deadline = time.monotonic() + 5
    while len(pidns_members(p.pidns)) < 6 and time.monotonic() < deadline:  # init, sh, 4 sleeps
        time.sleep(0.01)
    assert len(pidns_members(p.pidns)) >= 6
    p.kill()
    assert p.wait(10) == -9
    assert pidns_members(p.pidns) == []  # orphans, setsid'd ones included: all gone
    p.stdout.close()

    # SIGKILL to the unshare process alone (no kill(): a crashed harness) ends it all too.
    p = a.popen(["sh", "-c", tree], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    assert p.pidns is not None and a.network.kill_child
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(10) == -9
    deadline = time.monotonic() + 5
    while pidns_members(p.pidns) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pidns_members(p.pidns) == []
    p.stdout.close()


# -- akv across hosts -----------------------------------------------------------------------


@pytest.mark.slow
def test_prefill_and_decode_on_separate_hosts_push_over_tcp(ab: Network) -> None:
    """The default mode between hosts pushes: every request verifies and is released once as
    pushed, the prefill's UCX wrote the blocks inter-node over TCP on the hosts' link, no side
    read, and no side used an intra-node protocol or a shared-memory transport."""
    a, b = ab
    env = akv_env(UCX_PROTO_INFO="y")
    proc, out, endpoint = start_prefill(a, env=env)
    assert endpoint == f"{a.ip}:7000"
    started = time.monotonic()
    decode, printed = run_decode(b, endpoint, env=env)
    wall = time.monotonic() - started
    prefill = prefill_summary(proc, out)
    assert_all_pushed(decode, prefill)
    print(f"no delay: decode {wall:.2f}s wall, {decode['seconds']:.3f}s transfers")

    tables = {
        side: assert_inter_node_tcp(text, side)
        for side, text in (("decode", printed), ("prefill", out.text(5)))
    }
    for side, ts in tables.items():
        assert not [t for t in ts if t.operation.startswith("remote memory read")], side
    writes = [t for t in tables["prefill"] if t.operation.startswith("remote memory write by ucp_put")]
    assert writes, [t.operation for t in tables["prefill"]]
    assert all(transport == f"tcp/{IFACE}" for t in writes for *_, transport in t.rows), writes


@pytest.mark.slow
def test_decode_mode_pull_between_hosts_is_refused(ab: Network) -> None:
    """`akv decode --mode pull` against a prefill on another host (no RDMA) is refused as a
    configuration mistake: exit 64, nothing on stdout, one line on stderr naming the READs over
    TCP hazard and `--mode push`; the prefill is still running."""
    a, b = ab
    proc, _out, endpoint = start_prefill(a)
    res = b.run(decode_argv(endpoint, "--mode", "pull"), env=akv_env(), timeout=90)
    assert res.returncode == 64, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert res.stdout == "", res.stdout[-2000:]
    (line,) = res.stderr.splitlines()
    assert line.startswith("akv decode: mode='pull'"), line
    assert "READs over TCP" in line and "--mode push" in line, line
    assert proc.poll() is None


@pytest.mark.slow
def test_pushes_verify_with_20ms_delay_on_the_prefill_link(ab: Network, record_property: Any) -> None:
    """With 20 ms each way on the prefill host's link, every request still verifies and is
    pushed, and the transfers took at least one delayed round trip."""
    a, b = ab
    backend = ab.require_faults()
    proc, out, endpoint = start_prefill(a)
    with a.delay(20):  # 20 ms each way: every round trip to the prefill host takes 40 ms more
        started = time.monotonic()
        decode, _ = run_decode(b, endpoint)
        wall = time.monotonic() - started
    prefill = prefill_summary(proc, out)
    assert_all_pushed(decode, prefill)
    record_property("delay_backend", backend)
    record_property("decode_wall_s", round(wall, 3))
    record_property("decode_transfer_s", decode["seconds"])
    print(f"20 ms delay ({backend}): decode {wall:.2f}s wall, {decode['seconds']:.3f}s transfers")
    assert decode["seconds"] >= 0.04  # at least one delayed round trip: the delay was in the path


# -- reading UCX_PROTO_INFO -------------------------------------------------------------------

# Printed by a decode in another network namespace but the same UTS and PID namespaces as its
# prefill (no unshare): UCX calls the peer intra-node and reads over cma, not the network.
INTRA_NODE = """\
[1795247228.622968] [vm:16744:1]   +--------+-------------+-------------------------------------------+
[1795247228.622968] [vm:16744:1]   | decode-7154c150-d0-c627d2cc intra-node cfg#1                     |
[1795247228.622968] [vm:16744:1]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795247228.622968] [vm:16744:1]   +--------+-------------+-------------------------------------------+
[1795247228.622968] [vm:16744:1]   | Range  | Description |                  Config                   |
[1795247228.622968] [vm:16744:1]   +--------+-------------+-------------------------------------------+
[1795247228.622968] [vm:16744:1]   | 0..inf | zero-copy   | cma/memory                                |
[1795247228.622968] [vm:16744:1]   +--------+-------------+-------------------------------------------+
{"event":"progress","done":1,"total":6}
"""

INTER_NODE = """\
[1795247215.710574] [hostB:1    :1]   +--------+--------------------+------------------------------------+
[1795247215.710574] [hostB:1    :1]   | decode-4340d001-d0-498303fa inter-node cfg#1                     |
[1795247215.672733] [hostB:1    :0]   +------------+----------------------+-------------+
[1795247215.672733] [hostB:1    :0]   | decode-4340d001-d0-498303fa self cfg#0          |
[1795247215.710574] [hostB:1    :1]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795247215.672733] [hostB:1    :0]   | active message by ucp_am_send* from host memory |
[1795247215.710574] [hostB:1    :1]   +--------+--------------------+------------------------------------+
[1795247215.710574] [hostB:1    :1]   | Range  |    Description     |               Config               |
[1795247215.710574] [hostB:1    :1]   +--------+--------------------+------------------------------------+
[1795247215.710574] [hostB:1    :1]   | 0..inf | software emulation | tcp/veth2                          |
[1795247215.710574] [hostB:1    :1]   +--------+--------------------+------------------------------------+
[1795247215.672733] [hostB:1    :0]   +------------+----------------------+-------------+
[1795247215.672733] [hostB:1    :0]   |   Range    |     Description      |   Config    |
[1795247215.672733] [hostB:1    :0]   +------------+----------------------+-------------+
[1795247215.672733] [hostB:1    :0]   |          0 | short                | tcp/veth2   |
[1795247215.672733] [hostB:1    :0]   |   1..65528 | zero-copy            | tcp/veth2   |
[1795247215.672733] [hostB:1    :0]   +------------+----------------------+-------------+
"""

# Printed by a prefill pushing to a decode on another host (the WRITEs its agent posts).
WRITE = """\
[1795731187.437228] [h1-akv-10827-0:3    :1]   +--------+-------------+------------------------------------------+
[1795731187.437228] [h1-akv-10827-0:3    :1]   | prefill-p0-dbc12022 inter-node cfg#1                            |
[1795731187.437228] [h1-akv-10827-0:3    :1]   | remote memory write by ucp_put*(multi) from host memory to host |
[1795731187.437228] [h1-akv-10827-0:3    :1]   +--------+-------------+------------------------------------------+
[1795731187.437228] [h1-akv-10827-0:3    :1]   | Range  | Description |                  Config                  |
[1795731187.437228] [h1-akv-10827-0:3    :1]   +--------+-------------+------------------------------------------+
[1795731187.437228] [h1-akv-10827-0:3    :1]   | 0..inf | zero-copy   | tcp/akv0                                 |
[1795731187.437228] [h1-akv-10827-0:3    :1]   +--------+-------------+------------------------------------------+
"""


def test_proto_tables_reads_what_ucx_prints() -> None:
    """`proto_tables` parses UCX_PROTO_INFO's read, write and active-message tables, with the
    tables of two threads interleaved."""
    (intra,) = proto_tables(INTRA_NODE)
    assert (intra.scope, intra.rows) == ("intra-node", [("0..inf", "zero-copy", "cma/memory")])
    assert intra.operation == "remote memory read by ucp_get*(multi) into host memory from host"
    read, am = proto_tables(INTER_NODE)  # two threads' tables, interleaved
    assert (read.ep, read.scope, read.rows) == (
        "decode-4340d001-d0-498303fa",
        "inter-node",
        [("0..inf", "software emulation", "tcp/veth2")],
    )
    assert (am.scope, am.operation) == ("self", "active message by ucp_am_send* from host memory")
    assert am.rows == [("0", "short", "tcp/veth2"), ("1..65528", "zero-copy", "tcp/veth2")]
    (write,) = proto_tables(WRITE)
    assert (write.ep, write.scope, write.rows) == (
        "prefill-p0-dbc12022",
        "inter-node",
        [("0..inf", "zero-copy", "tcp/akv0")],
    )
    assert write.operation == "remote memory write by ucp_put*(multi) from host memory to host"
