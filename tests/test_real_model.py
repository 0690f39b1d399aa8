"""A real model (transformers' code, tiny random weights) split into prefill and decode
processes through akv generates exactly what it generates colocated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="pip install -e '.[models]' (scripts/setup.sh installs it)")
pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).parent.parent / "examples" / "real_model.py"


def run(*argv: str) -> tuple[int, dict[str, Any], str]:
    """Run the example with ``--json``; its exit code, last JSON line and stderr."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *argv, "--seed", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, json.loads(lines[-1]) if lines else {}, proc.stderr


@pytest.mark.parametrize(
    "argv",
    [
        # GQA, 4 -> 6, prefix hit, head-major prefill against 32-token decode blocks, 77 tokens
        ["--arch", "llama", "--prefill-tp", "4", "--decode-tp", "6", "--prefix-hit", "1",
         "--prefill-layout", "head-major", "--decode-block-size", "32", "--prompt-tokens", "77"],
        # sliding window (16) and full layers, 1 -> 2, prefix hit, NHD 8-token prefill blocks
        ["--arch", "gemma3", "--prefill-tp", "1", "--decode-tp", "2", "--prefix-hit", "1",
         "--prefill-layout", "NHD", "--prefill-block-size", "8", "--prompt-tokens", "45"],
        # Gated DeltaNet state and full attention (2 KV heads: replicated on 4 ranks), cross-layer decode
        ["--arch", "qwen3-next", "--prefill-tp", "2", "--decode-tp", "4", "--decode-layout", "cross-layer",
         "--prompt-tokens", "37"],
        # Mamba2 state, attention and an MLP layer, 4 -> 2, prefix hit of two blocks, head-major decode
        ["--arch", "nemotron-h", "--prefill-tp", "4", "--decode-tp", "2", "--prefix-hit", "2",
         "--decode-layout", "head-major", "--prompt-tokens", "50"],
    ],
    ids=["llama-4to6-hit", "gemma3-1to2-hit", "qwen3next-2to4", "nemotronh-4to2-hit"],
)  # fmt: skip
def test_disaggregated_generation_equals_colocated(argv: list[str]) -> None:
    """Tokens and logits of the decode processes equal the colocated run's exactly; prefill released the request."""
    code, out, err = run(*argv, "--new-tokens", "5")
    assert code == 0, (out, err[-3000:])
    assert out["match"] and out["tokens"] == out["reference_tokens"] and len(out["tokens"]) == 5
    assert out["max_logit_diff"] == 0.0 and out["exact"] and out["replicas_agree"] and out["released"]
    assert out["decode_exit_codes"] == [0] * out["decode_tp"] and out["bytes"] > 0
    assert out["prefix_hit_tokens"] == (int(argv[argv.index("--prefix-hit") + 1]) * (32 if "llama" in argv else 16)
                                        if "--prefix-hit" in argv else 0)  # fmt: skip


def test_a_kv_swap_on_decode_is_caught() -> None:
    """Swapping one layer's K and V after the pull makes the run fail: the logits differ from the colocated run's."""
    code, out, _ = run("--arch", "llama", "--prefill-tp", "1", "--decode-tp", "1", "--new-tokens", "3",
                       "--fault", "swap-kv")  # fmt: skip
    assert code == 1 and out["max_logit_diff"] > 0 and not out["exact"]


def test_heads_that_do_not_divide_are_a_usage_error() -> None:
    """A decode TP the model's KV heads do not divide exits 64 with one line naming the flag."""
    code, _, err = run("--arch", "llama", "--prefill-tp", "2", "--decode-tp", "5")
    assert code == 64 and err.strip().count("\n") == 0 and "--decode-tp 5" in err
