"""The command line as a user meets it: configuration errors, help, sizing, verbosity, bench checks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import MODEL

SMALL = ["--kv-heads", "2", *MODEL]
PREFILL = ["--requests", "2", "--blocks-per-request", "4", *SMALL]  # fits MODEL's 64-block pool


def akv(
    *argv: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m akv ARGV`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "akv", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port that is bound and listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


CONFIG_ERRORS = [
    pytest.param(
        ["plan", "--prefill-tp", "0", "--decode-tp", "1", "--kv-heads", "2"], "--prefill-tp", id="plan-tp-0"
    ),
    pytest.param(
        ["plan", "--prefill-tp", "4", "--decode-tp", "6", "--kv-heads", "4"], "--decode-tp", id="plan-heads"
    ),
    pytest.param(["plan", "--prefill-tp", "2", "--decode-tp", "1"], "--kv-heads", id="plan-no-heads"),
    pytest.param(["prefill", "--tp-size", "4", "--kv-heads", "6"], "--tp-size 4", id="prefill-tp-heads"),
    pytest.param(["prefill", "--tp-size", "1", "--lease", "0", *PREFILL], "--lease", id="prefill-lease-0"),
    pytest.param(
        ["prefill", "--tp-size", "1", "--port", "99999", *PREFILL], "--port", id="prefill-port-range"
    ),
    pytest.param(
        # TEST-NET-1 (RFC 5737): never an address of this machine
        ["prefill", "--tp-size", "1", "--host", "192.0.2.1", "--allow-insecure", *PREFILL],
        "--host 192.0.2.1",
        id="prefill-unbindable-host",
    ),
    pytest.param(
        ["prefill", "--tp-size", "1", "--host", "0.0.0.0", "--allow-insecure", *PREFILL],
        "--advertise-host",
        id="prefill-wildcard-host",
    ),
    pytest.param(["prefill", "--tp-size", "0", *PREFILL], "--tp-size", id="prefill-tp-0"),
    pytest.param(
        ["prefill", "--tp-size", "1", *PREFILL, "--blocks-per-request", "0"],
        "--blocks-per-request",
        id="prefill-bpr-0",
    ),
    pytest.param(["prefill", "--tp-size", "1", "--requests", "20", *SMALL], "--blocks", id="prefill-pool"),
    pytest.param(
        ["prefill", "--tp-size", "1", "--timeout", "-1", *PREFILL], "--timeout", id="prefill-timeout"
    ),
    pytest.param(
        ["decode", "--connect", "localhost", "--tp-size", "1", *SMALL], "--connect", id="decode-connect"
    ),
    pytest.param(
        ["decode", "--connect", "127.0.0.1:9", "--tp-size", "3", *SMALL], "--tp-size 3", id="decode-tp-heads"
    ),
    pytest.param(
        ["decode", "--connect", "127.0.0.1:9", "--tp-size", "1", "--transfer-timeout", "0", *SMALL],
        "--transfer-timeout",
        id="decode-timeout",
    ),
    pytest.param(["demo", "--head-dim", "0"], "--head-dim", id="demo-head-dim"),
    pytest.param(["demo", "--dtype", "float17"], "--dtype", id="demo-dtype"),
    pytest.param(["demo", "--prefill-tp", "3"], "--prefill-tp 3", id="demo-tp-heads"),
    pytest.param(["demo", "--mla", "--joint-kv"], "--joint-kv", id="demo-mla-joint"),
    pytest.param(["demo", "--concurrency", "0"], "--concurrency", id="demo-concurrency"),
    pytest.param(
        ["prefill", "--tp-size", "1", "--layer-ms", "5", *PREFILL], "--mode push", id="prefill-layer-ms"
    ),
    pytest.param(["demo", "--mode", "push", "--layer-ms", "-1"], "--layer-ms", id="demo-layer-ms"),
    pytest.param(["bench", "--only", "layerwise"], "--mode push", id="bench-layerwise-pull"),
    # figure programs measure DRAM: refused on a GPU before anything touches CUDA
    pytest.param(
        ["bench", "--only", "bulk,scatter", "--device", "cuda"],
        "measure DRAM only",
        id="bench-program-on-cuda",
    ),
    pytest.param(
        ["bench", "--quick", "--only", "notice_flush,groups", "--device", "cuda:0"],
        "notice_flush,groups",
        id="bench-programs-on-cuda-n",
    ),
]


@pytest.mark.parametrize(("argv", "names"), CONFIG_ERRORS)
def test_configuration_error_is_one_line_and_exit_64(argv: list[str], names: str) -> None:
    """Each configuration mistake exits 64 with one line on stderr naming what to change, nothing on stdout."""
    proc = akv(*argv)
    assert proc.returncode == 64, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"akv {argv[0]}: ") and names in lines[0]
    assert proc.stdout == ""


def test_port_in_use_is_a_configuration_error(busy_port: int) -> None:
    """`akv prefill --port P` with P in use exits 64 with one line naming --port."""
    proc = akv("prefill", "--tp-size", "1", "--port", str(busy_port), *PREFILL)
    assert proc.returncode == 64, proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert "--port" in proc.stderr and "in use" in proc.stderr


def test_decode_validates_tp_size_before_connecting() -> None:
    """`akv decode --tp-size 0` exits 64 without opening a connection to the prefill endpoint."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        proc = akv("decode", "--connect", f"127.0.0.1:{port}", "--tp-size", "0", *SMALL)
        assert proc.returncode == 64 and "--tp-size" in proc.stderr
        assert "verified" not in proc.stdout
        with pytest.raises(TimeoutError):
            listener.accept()


@pytest.mark.slow
def test_demo_sizes_the_pool_and_passes_verbosity_on() -> None:
    """`akv demo --requests N` beyond the default pool sizes it; -v reaches both child processes;
    the summary counts requests per transfer path and the descriptors posted."""
    proc = akv(
        "demo",
        "--prefill-tp", "1", "--decode-tp", "1", "--kv-heads", "2",
        "--layers", "2", "--block-size", "4", "--head-dim", "16", "--dtype", "float16",
        "--requests", "40", "--json", "-v",
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["verified"] == summary["released"] == 40
    # prefill and decode are separate processes: every request was read through NIXL
    assert summary["paths"] == {"read": 40} and summary["descriptors"] >= 40
    assert "control server listening" in proc.stderr  # prefill's INFO log, shown only with -v
    assert "decode rank connected" in proc.stderr
    assert "request verified" not in proc.stderr  # a debug event: -vv only


@pytest.mark.slow
def test_demo_push_mode_streams_layers() -> None:
    """`akv demo --mode push --layer-ms` verifies every request pushed, each released once, and
    its summary's paths say push."""
    proc = akv(
        "demo", "--prefill-tp", "1", "--decode-tp", "1", *SMALL, "--requests", "4", "--json",
        "--mode", "push", "--layer-ms", "10",
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["verified"] == summary["released"] == 4 and summary["expired"] == 0
    assert summary["paths"] == {"push": 4}


def test_demo_vv_logs_each_request() -> None:
    """`akv demo -vv` logs more than -v: each request verified by decode and released by prefill."""
    proc = akv(
        "demo", "--prefill-tp", "1", "--decode-tp", "1", *SMALL, "--requests", "3", "--json", "-vv",
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(ln) for ln in proc.stderr.splitlines() if ln.startswith("{")]
    verified = {e["request"] for e in events if e.get("event") == "request verified"}
    released = {e["request"] for e in events if e.get("event") == "request released"}
    assert len(verified) == len(released) == 3


def test_mla_needs_no_kv_heads() -> None:
    """`--mla` works without `--kv-heads`."""
    proc = akv("plan", "--prefill-tp", "2", "--decode-tp", "1", "--mla")
    assert proc.returncode == 0, proc.stderr
    assert "latent cache" in proc.stdout


def test_plan_json_says_its_ranges_are_half_open() -> None:
    """`akv plan --json` labels its ranges half-open; the text labels its ranges inclusive."""
    args = ["plan", "--prefill-tp", "2", "--decode-tp", "4", "--kv-heads", "8"]
    out = json.loads(akv(*args, "--json").stdout)
    assert out["ranges"] == "half-open [start, stop)"
    assert out["decode"][1]["reads"][0]["local_heads"] == [0, 2]
    text = akv(*args).stdout
    assert "inclusive" in text.splitlines()[0] and "global heads 2-3" in text


@pytest.mark.parametrize("command", ["plan", "prefill", "decode", "demo", "bench"])
def test_every_option_has_help(command: str) -> None:
    """`akv COMMAND --help` describes every option, and states each non-trivial default."""
    from akv.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parser = sub.choices[command]  # type: ignore[index]
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{command} {action.option_strings} has no help"
        if action.default not in (None, False, 0) and not action.required:
            assert "default" in action.help, f"{command} {action.option_strings} hides its default"
    assert akv(command, "--help").returncode == 0


BLOCK_MATPLOTLIB = """
import sys
class NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoMatplotlib())
from akv.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_bench_plot_without_matplotlib_fails_before_running(tmp_path: object) -> None:
    """`akv bench --plot F` without matplotlib exits 64 at once (one line), before any workload runs."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_MATPLOTLIB, "bench", "--quick", "--plot", f"{tmp_path}/bench.png"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 64, proc.stderr
    assert proc.stderr.splitlines() == [
        "akv bench: --plot needs matplotlib: pip install 'akv[bench]' (or leave out --plot)"
    ]
    assert time.monotonic() - started < 20  # no workload ran (the quick bench takes longer)
    assert proc.stdout == ""


def test_a_prefill_summary_longer_than_a_pipe_holds_is_read_when_the_prefill_is_stopped(
    tmp_path: Path,
) -> None:
    """`stop_prefill` (what `akv bench` stops its prefill with) reads the summary while the
    process writes it: with 1,200 long request ids released (here by lease) the summary line
    is over 64 KiB, more than a pipe holds, and a prefill writing it into a pipe no one read
    blocked until `akv bench` gave up waiting for it."""
    from akv.protocol.messages import RequestInfo
    from akv.testing import json_lines, save_requests, spawn_prefill, stop_prefill

    n = 1200
    ids = [f"a-request-whose-id-is-long-enough-to-fill-a-pipe-{i:05d}" for i in range(n)]
    save_requests(
        str(tmp_path / "requests.json"), [RequestInfo(request_id=r, block_ids=[i]) for i, r in enumerate(ids)]
    )
    model = ["--layers", "1", "--blocks", str(n), "--block-size", "1", "--head-dim", "8", "--kv-heads", "1"]
    proc, _ = spawn_prefill(
        *("--requests-file", str(tmp_path / "requests.json"), "--tp-size", "1"),
        *("--requests", "1", "--blocks-per-request", "1", "--hold", "--no-fill"),
        *("--lease", "0.5", "--timeout", "60", "--dtype", "float16", *model),
    )
    assert proc.stdout is not None
    for msg in json_lines(proc.stdout):  # every request released by lease: the rank holds on
        if msg.get("event") == "released":
            break
    started = time.monotonic()
    summary = stop_prefill(proc, timeout=30)
    assert proc.returncode is not None and time.monotonic() - started < 25
    assert summary is not None and summary["expired"] == n
    assert sorted(summary["expired_ids"]) == sorted(ids)
    assert len(json.dumps(summary, separators=(",", ":"))) > 64 << 10
