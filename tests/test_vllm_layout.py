"""vLLM's KV tensors as the connector hands them to akv (akv.integrations.vllm.layout and
options; no vLLM process): the CPU backend's and the CUDA backends' layouts, pulled across TP
sizes between two different layouts over real NIXL agents."""

from __future__ import annotations

from contextlib import AsyncExitStack

import anyio
import pytest
import torch

import akv
from akv.integrations.vllm.layout import Content, LayerGroup, content_for_device, describe, layer_index
from akv.integrations.vllm.options import parse_options
from akv.integrations.vllm.params import RemoteKV

NB, BS, HS, HEADS, LAYERS = 8, 16, 8, 4, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
GROUP = LayerGroup("g0", "full", tuple(NAMES), total_kv_heads=HEADS, head_size=HS)


def vllm_tensor(layout: str, heads: int) -> torch.Tensor:
    """One layer's tensor as vLLM allocates it: logical [blocks, heads, tokens, 2 * head size],
    physically LBHNC (heads before tokens) or LBNHC (tokens before heads)."""
    if layout == "LBHNC":
        return torch.zeros(NB, heads, BS, 2 * HS)
    return torch.zeros(NB, BS, heads, 2 * HS).permute(0, 2, 1, 3)


def kv_views(t: torch.Tensor, content: Content) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as vLLM's attention backends read them, each [blocks, heads, tokens, head size]."""
    nb, h, bs, _ = t.shape
    if content == "block":  # the CPU backend: [blocks, heads, 2 * tokens, head size], chunked
        k, v = t.view(nb, h, 2 * bs, HS).chunk(2, dim=2)
        return k, v
    k, v = t.transpose(1, 2).split(HS, dim=-1)  # CUDA backends: K then V per token
    return k.transpose(1, 2), v.transpose(1, 2)


def value(layer: int, comp: int, head: int, token: int, block: int) -> float:
    return float((((layer * 2 + comp) * HEADS + head) * BS + token) * 16 + block)


def test_layer_index_and_content() -> None:
    """Layer indices come from vLLM's layer names; CPU tensors hold K/V per block and head."""
    assert layer_index("model.layers.17.self_attn.attn") == 17
    assert layer_index("language_model.model.layers.3.attn") == 3
    assert content_for_device("cpu") == "block" and content_for_device("cuda") == "token"
    with pytest.raises(akv.ConfigError, match="layer index"):
        layer_index("lm_head")


@pytest.mark.parametrize(("layout", "content"), [("LBHNC", "block"), ("LBHNC", "token"), ("LBNHC", "token")])
def test_regions_are_views_of_vllm_tensors(layout: str, content: Content) -> None:
    """akv's per-layer views of the regions are exactly the K and V vLLM's kernels use, sharing memory."""
    kv = {n: vllm_tensor(layout, HEADS) for n in NAMES}
    for t in kv.values():
        t.copy_(torch.randn_like(t))
    spec, regions = describe(kv, [GROUP], content=content)
    views = akv.layer_views(regions, spec, 0, 1)
    for i, t in enumerate(kv.values()):
        k, v = kv_views(t, content)
        assert torch.equal(views["g0"][i]["k"], k) and torch.equal(views["g0"][i]["v"], v)
        assert regions[i].data_ptr() == t.data_ptr()


def test_tensors_akv_cannot_read_in_place_are_refused() -> None:
    """Shared layer tensors, a wrong K/V width and strided (non-dense) tensors are ConfigErrors naming the cause."""
    t = vllm_tensor("LBHNC", HEADS)
    with pytest.raises(akv.ConfigError, match="share one KV tensor"):
        describe(dict.fromkeys(NAMES, t), [GROUP], content="block")
    with pytest.raises(akv.ConfigError, match="K and V"):
        describe({n: torch.zeros(NB, HEADS, BS, HS) for n in NAMES}, [GROUP], content="block")
    with pytest.raises(akv.ConfigError, match="not a permutation"):
        describe({n: torch.zeros(NB, HEADS, BS, 4 * HS)[..., : 2 * HS] for n in NAMES}, [GROUP], content="token")
    with pytest.raises(akv.ConfigError, match="no KV tensor"):
        describe({NAMES[0]: t}, [GROUP], content="block")


def test_extra_config_errors_name_the_key() -> None:
    """kv_connector_extra_config: unknown keys, bad values and bad types are ConfigErrors naming the key."""
    assert parse_options({"mode": "push", "port": "5701"}).port == 5701
    with pytest.raises(akv.ConfigError, match=r"unknown field `prot`.*port"):
        parse_options({"prot": 1})
    with pytest.raises(akv.ConfigError, match="mode"):
        parse_options({"mode": "pul"})
    with pytest.raises(akv.ConfigError, match="lease must be > 0"):
        parse_options({"lease": 0})


def test_transfer_params_round_trip() -> None:
    """What a prefill response carries reads back on decode; a missing key is a ConfigError."""
    remote = RemoteKV("10.0.0.1:5700", "req-1", ((1, 2, 3),), 7, 300, 128, 60.0)
    params = remote.to_params("vllm-p", 2)
    assert params["remote_host"] == "10.0.0.1" and params["remote_port"] == 5700
    assert RemoteKV.from_params(params) == remote
    del params["akv_generation"]
    with pytest.raises(akv.ConfigError, match="akv_generation"):
        RemoteKV.from_params(params)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("prefill", "decode"),
    [(("block", "LBHNC", 2), ("token", "LBNHC", 1)), (("token", "LBNHC", 1), ("block", "LBHNC", 2))],
    ids=["cpu-tp2-to-cuda-nhd-tp1", "cuda-nhd-tp1-to-cpu-tp2"],
)
async def test_pull_between_vllm_layouts_across_tp(
    prefill: tuple[Content, str, int], decode: tuple[Content, str, int]
) -> None:
    """Prefill ranks with one vLLM layout, decode ranks with another and another TP size: every
    head of every layer lands where the decode backend reads it, over NIXL READs."""
    p_content, p_layout, P = prefill
    d_content, d_layout, D = decode
    remote, local = [1, 2, 3], [5, 6, 7]
    async with AsyncExitStack() as stack:
        server = akv.ControlServer()
        tg = await stack.enter_async_context(anyio.create_task_group())
        await tg.start(server.serve)
        for r in range(P):
            heads = HEADS // P
            kv = {n: vllm_tensor(p_layout, heads) for n in NAMES}
            for li, t in enumerate(kv.values()):
                for c, view in enumerate(kv_views(t, p_content)):
                    for b in remote:
                        for h in range(heads):
                            for tok in range(BS):
                                view[b, h, tok] = value(li, c, r * heads + h, tok, b)
            spec, regions = describe(kv, [GROUP], content=p_content)
            producer = await stack.enter_async_context(
                akv.Producer(regions, spec, tp_rank=r, tp_size=P, engine_id="vllm-p", server=server)
            )
            producer.expose("req", remote, generation=11)
        for d in range(D):
            heads = HEADS // D
            kv = {n: vllm_tensor(d_layout, heads) for n in NAMES}
            spec, regions = describe(kv, [GROUP], content=d_content)
            async with akv.Consumer(regions, spec, tp_rank=d, tp_size=D, same_process="nixl") as consumer:
                session = await consumer.connect(str(server.endpoint))
                result = await (
                    await session.pull(
                        akv.PullRequest(request_id="req", local_block_ids=local, remote_block_ids=remote, generation=11)
                    )
                )
                assert result.path == "read"
            for li, t in enumerate(kv.values()):
                for c, view in enumerate(kv_views(t, d_content)):
                    for lb, rb in zip(local, remote, strict=True):
                        want = torch.tensor(
                            [[value(li, c, d * heads + h, tok, rb) for tok in range(BS)] for h in range(heads)]
                        )
                        assert torch.equal(view[lb, :, :, 0], want), (li, c, lb)
        tg.cancel_scope.cancel()
