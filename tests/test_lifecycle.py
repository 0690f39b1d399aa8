"""The multi-process commands as an operator runs them: real processes, real signals, real pipes.

Exit codes tell the truth whichever rank failed, a lost rank stops its engine (and the pulls that
need it) at once, a signal stops every process a command started, and nothing prints a traceback.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from akv.testing import json_lines
from tests.conftest import MODEL, prefill_process, read_json_line

pytestmark = pytest.mark.slow
SMALL = ["--kv-heads", "2", *MODEL]
UNSIZED = [a for i, a in enumerate(SMALL) if "--blocks" not in SMALL[i - 1 : i + 1]]  # pool sized to fit


def start(*argv: str) -> subprocess.Popen[str]:
    """Start ``python -m akv ARGV`` with stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "akv", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def stop(proc: subprocess.Popen[str]) -> None:
    """Kill a process started by `start` if it still runs, reap it, close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def descendants(pid: int) -> list[int]:
    """Every live (not zombie) process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


def wait_for(predicate: object, timeout: float) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield port


def test_decode_engine_exits_1_naming_each_rank_when_nothing_listens(closed_port: int) -> None:
    """`akv decode --tp-size 2` with nothing at --connect exits 1, one stderr line per rank saying why."""
    proc = start("decode", "--connect", f"127.0.0.1:{closed_port}", "--tp-size", "2", *SMALL)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err
    for rank in (0, 1):
        assert f"akv decode: rank {rank} failed (exit 1): HandshakeError: cannot reach" in err
    assert "Traceback" not in err


def test_decode_engine_exits_1_on_a_shape_mismatch() -> None:
    """`akv decode --tp-size 2` whose head dim differs from the prefill engine's exits 1, naming each rank and the field."""
    with prefill_process(1, 2, requests=2) as (_proc, endpoint):
        argv = [*SMALL[: SMALL.index("--head-dim")], "--head-dim", "32", "--dtype", "float16"]
        proc = start("decode", "--connect", endpoint, "--tp-size", "2", *argv, "--json")
        out, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err
    for rank in (0, 1):
        line = next(ln for ln in err.splitlines() if ln.startswith(f"akv decode: rank {rank} failed"))
        assert "IncompatiblePeerError" in line
    summary = list(json_lines(out.splitlines()))[-1]  # UCX may print a warning at exit
    assert summary["failed_ranks"] == [0, 1] and summary["verified"] == 0
    assert "Traceback" not in err


def test_prefill_engine_exits_when_one_rank_is_killed() -> None:
    """kill -9 of one rank of `akv prefill --tp-size 2` (no --timeout) stops the engine in seconds: exit 1, the rank named."""
    proc = start(
        "prefill", "--tp-size", "2", "--requests", "2", "--blocks-per-request", "4", *SMALL, "--json"
    )
    try:
        assert read_json_line(proc)["event"] == "ready"
        ranks = descendants(proc.pid)
        assert len(ranks) == 2
        victim = max(ranks)  # rank 1 starts after rank 0
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        stop(proc)
    assert proc.returncode == 1, err
    assert took < 15, took
    assert "akv prefill: rank 1 was lost (killed by SIGKILL); stopped the other ranks" in err
    assert not alive(ranks)
    assert "Traceback" not in err


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_demo_stops_every_process_it_started(signum: int, code: int) -> None:
    """SIGTERM (SIGINT) to `akv demo` mid-run: every descendant gone and the demo exited 143 (130) within seconds."""
    proc = start(
        "demo", "--prefill-tp", "2", "--decode-tp", "2", "--requests", "3000", "--blocks-per-request", "2",
        "--concurrency", "1", *UNSIZED, "--json",
    )  # fmt: skip
    try:
        started = wait_for(lambda: proc.poll() is not None or len(descendants(proc.pid)) >= 6, 90)
        assert started and proc.poll() is None, "the demo never started its 6 processes"
        tree = descendants(proc.pid)
        proc.send_signal(signum)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
        assert wait_for(lambda: not alive(tree), 10), alive(tree)
    finally:
        stop(proc)
    assert proc.returncode == code, err
    assert took < 10, took
    assert f"akv demo: interrupted by {signal.Signals(signum).name}" in err
    assert "Traceback" not in err


def test_decode_fails_the_rest_at_once_when_a_prefill_rank_dies() -> None:
    """kill -9 of one prefill rank mid-run: decode fails every remaining pull at once, one log line, exit 1 in seconds."""
    requests = ["--requests", "400", "--blocks-per-request", "2"]
    rank0 = start("prefill", "--tp-size", "2", "--tp-rank", "0", *requests, *UNSIZED, "--json")
    rank1 = decode = None
    try:
        boot = str(read_json_line(rank0)["endpoint"])
        rank1 = start(
            "prefill", "--tp-size", "2", "--tp-rank", "1", "--bootstrap", boot, *requests, *UNSIZED, "--json"
        )
        assert read_json_line(rank1)["event"] == "ready"
        decode = start(
            "decode",
            "--connect",
            boot,
            "--tp-size",
            "1",
            "--concurrency",
            "1",
            *UNSIZED,
            "--blocks",
            "8",
            "--json",
        )
        while read_json_line(decode).get("event") != "progress":
            pass
        rank1.kill()
        killed = time.monotonic()
        out, err = decode.communicate(timeout=90)
        took = time.monotonic() - killed
    finally:
        for p in (rank0, rank1, decode):
            if p is not None:
                stop(p)
    assert decode.returncode == 1, err
    assert took < 15, took  # one re-handshake per request took ~1.3 s each before
    summary = list(json_lines(out.splitlines()))[-1]  # UCX may print a warning at exit
    assert 0 < summary["failed"] < 400 and summary["verified"] + summary["failed"] == 400
    lost = [ln for ln in err.splitlines() if "prefill engine lost" in ln]
    assert len(lost) == 1, err
    assert "akv decode: " in err and "requests failed" in err
    assert "Traceback" not in err


def test_plan_into_a_closed_pipe_ends_quietly() -> None:
    """`akv plan ... | head -1`: stdout closed before the plan is printed ends with no output on stderr, exit 141."""
    proc = start("plan", "--preset", "nemotron-h-8b", "--prefill-tp", "8", "--decode-tp", "4")
    assert proc.stdout is not None
    proc.stdout.close()  # the reader went away before akv wrote a line
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err
    assert err == ""
