"""`scripts/gpu-check.sh`, the GPU checks in one device call (docs/gpu.md), as far as a machine
without a GPU can run it: it parses, and it refuses cleanly, before installing or writing
anything, when it gets no output folder or finds no usable CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AKV_PYTHON": sys.executable, **env},
    )


def test_the_script_parses() -> None:
    """`bash -n` accepts the script."""
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_no_output_folder_is_a_usage_error() -> None:
    """Without OUTDIR (or with a flag in its place) the script exits 64 with one usage line."""
    for args in ((), ("--help",)):
        proc = run(*args)
        assert proc.returncode == 64, proc.stderr
        assert proc.stderr.splitlines() == ["gpu-check: usage: bash scripts/gpu-check.sh OUTDIR"]
        assert proc.stdout == ""


def test_without_cuda_it_refuses_before_installing_or_writing(tmp_path: Path) -> None:
    """With no CUDA device visible, the script exits 64 with one line saying so, and creates
    no output folder (nothing was installed, run or written)."""
    out = tmp_path / "out"
    proc = run(str(out), CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 64, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("gpu-check: no usable CUDA device here") and "GPU machine" in line
    assert proc.stdout == ""
    assert not out.exists()
