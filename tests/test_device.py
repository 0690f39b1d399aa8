"""Device flags, the CUDA checks and the UCX settings for VRAM: the decisions, without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from akv.device import Device, cuda_context, gpu_environment, parse_device, usable
from akv.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "kind", "index"),
    [("cpu", "cpu", None), ("cuda", "cuda", None), ("cuda:3", "cuda", 3), ("CUDA:0", "cuda", 0)],
)
def test_device_flags_parse(text: str, kind: str, index: int | None) -> None:
    """cpu, cuda and cuda:N parse to the device they name."""
    assert parse_device(text) == Device(kind, index)


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "cpu:0", "cuda:-1", ""])
def test_bad_device_flags_are_config_errors(text: str) -> None:
    """Anything else is a ConfigError saying which forms are accepted."""
    with pytest.raises(ConfigError, match="use cpu, cuda or cuda:N"):
        parse_device(text, "--decode-device")


def test_ranks_spread_over_gpus_unless_one_is_named() -> None:
    """cuda puts rank r on GPU r % count; cuda:N puts every rank on N; cpu stays on the CPU."""
    assert [parse_device("cuda").for_rank(r, 4) for r in range(6)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
        "cuda:0",
        "cuda:1",
    ]
    assert {parse_device("cuda:2").for_rank(r, 4) for r in range(6)} == {"cuda:2"}
    assert parse_device("cpu").for_rank(5, 8) == "cpu"


def test_cuda_without_a_gpu_is_refused_in_one_line() -> None:
    """A CUDA device where CUDA is unusable, or a GPU index past the count, is a one-line ConfigError."""
    usable(parse_device("cpu"), available=False, count=0)
    with pytest.raises(ConfigError, match="no usable CUDA device") as info:
        usable(parse_device("cuda"), available=False, count=0)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="has 2 CUDA device"):
        usable(parse_device("cuda:2"), available=True, count=2)
    usable(parse_device("cuda:1"), available=True, count=2)


def test_gpu_environment_sets_only_what_the_user_did_not() -> None:
    """For VRAM the zero-copy knob is set unless the environment already says; nothing for DRAM."""
    assert gpu_environment({}, cuda=True) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    assert gpu_environment({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}, cuda=True) == {}
    assert gpu_environment({}, cuda=False) == {}


def test_dram_agents_need_no_cuda_context() -> None:
    """NIXL calls of a DRAM agent run without touching CUDA (a no-op context)."""
    with cuda_context(None):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize(
    "argv",
    [
        ["prefill", "--tp-size", "1", "--kv-heads", "4", "--device", "cuda"],
        ["decode", "--connect", "127.0.0.1:9", "--tp-size", "1", "--kv-heads", "4", "--device", "cuda:0"],
        ["demo", "--decode-device", "cuda"],
        ["bench", "--quick", "--device", "cuda"],
        ["demo", "--device", "tpu"],
    ],
)
def test_cli_device_mistakes_exit_64_in_one_line(argv: list[str]) -> None:
    """--device cuda without a usable GPU (or an unknown device) exits 64 with one line, no traceback."""
    out = subprocess.run([sys.executable, "-m", "akv", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 64, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "device" in lines[0] and "Traceback" not in out.stderr
