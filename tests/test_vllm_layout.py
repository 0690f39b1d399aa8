"""vLLM's KV tensors as the connector hands them to akv (akv.integrations.vllm.layout and
options; no vLLM process): the CPU backend's and the CUDA backends' layouts, pulled across TP
sizes between two different layouts over real NIXL agents."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest
import torch

import akv
from akv.integrations.vllm.layout import (
    Content,
    LayerGroup,
    content_for_device,
    describe,
    layer_index,
    state_pieces,
)
from akv.integrations.vllm.options import parse_options
from akv.integrations.vllm.params import RemoteKV

NB, BS, HS, HEADS, LAYERS = 8, 16, 8, 4, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
GROUP = LayerGroup("g0", "full", tuple(NAMES), total_kv_heads=HEADS, head_size=HS)
NAMES4 = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


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
        describe(
            {n: torch.zeros(NB, HEADS, BS, 4 * HS)[..., : 2 * HS] for n in NAMES}, [GROUP], content="token"
        )
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
                        akv.PullRequest(
                            request_id="req", local_block_ids=local, remote_block_ids=remote, generation=11
                        )
                    )
                )
                assert result.path == "read"
            for li, t in enumerate(kv.values()):
                for c, view in enumerate(kv_views(t, d_content)):
                    for lb, rb in zip(local, remote, strict=True):
                        want = torch.tensor(
                            [
                                [value(li, c, d * heads + h, tok, rb) for tok in range(BS)]
                                for h in range(heads)
                            ]
                        )
                        assert torch.equal(view[lb, :, :, 0], want), (li, c, lb)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_pull_with_tensors_shared_across_groups() -> None:
    """vLLM's hybrid allocator (Gemma 3: sliding and full layers interleaved) gives one tensor to a
    layer of each group: describe gives each layer its own region (aliasing), and a pull with
    per-group block ids moves every full block and the sliding group's window, over NIXL READs."""
    full = LayerGroup("g0", "full", (NAMES4[1], NAMES4[3]), total_kv_heads=HEADS, head_size=HS)
    sliding = LayerGroup(
        "g1", "sliding", (NAMES4[0], NAMES4[2]), total_kv_heads=HEADS, head_size=HS, window=BS
    )
    n = 3 * BS - 2  # 3 blocks; the window of BS tokens starts in the second block
    remote = {"g0": [1, 2, 3], "g1": [5, 6]}  # one pool: a block is one group's at a time
    local = {"g0": [4, 7, 2], "g1": [1, 3]}

    def caches() -> dict[str, torch.Tensor]:
        shared = [vllm_tensor("LBHNC", HEADS) for _ in range(2)]
        return {name: shared[i // 2] for i, name in enumerate(NAMES4)}  # layers 0+1, 2+3 share

    kv_p, kv_d = caches(), caches()
    for li, name in enumerate(NAMES4):
        ids = remote["g1" if li % 2 == 0 else "g0"]
        for c, view in enumerate(kv_views(kv_p[name], "block")):
            for b in ids:
                view[b] = torch.tensor(
                    [[value(li, c, h, tok, b) for tok in range(BS)] for h in range(HEADS)]
                ).unsqueeze(-1)
    with pytest.raises(akv.ConfigError, match="of group 'g0' share one KV tensor"):
        describe(kv_p, [LayerGroup("g0", "full", tuple(NAMES4[:2]), HEADS, HS)], content="block")
    async with AsyncExitStack() as stack:
        server = akv.ControlServer()
        tg = await stack.enter_async_context(anyio.create_task_group())
        await tg.start(server.serve)
        spec, regions = describe(kv_p, [full, sliding], content="block")
        assert (
            len(regions) == 4 and regions[0].data_ptr() == regions[2].data_ptr()
        )  # g0's layer 1, g1's layer 0
        producer = await stack.enter_async_context(
            akv.Producer(regions, spec, tp_rank=0, tp_size=1, engine_id="vllm-p", server=server)
        )
        producer.expose("req", remote, generation=3)
        spec, regions = describe(kv_d, [full, sliding], content="block")
        async with akv.Consumer(regions, spec, tp_rank=0, tp_size=1, same_process="nixl") as consumer:
            session = await consumer.connect(str(server.endpoint))
            req = akv.PullRequest(
                request_id="req", local_block_ids=local, remote_block_ids=remote, generation=3, num_tokens=n
            )
            assert (await (await session.pull(req))).path == "read"
        tg.cancel_scope.cancel()
    for li, name in enumerate(NAMES4):
        g = "g1" if li % 2 == 0 else "g0"
        first_token = n - BS if g == "g1" else 0
        for c, view in enumerate(kv_views(kv_d[name], "block")):
            for pos, (lb, rb) in enumerate(zip(local[g], remote[g], strict=True)):
                base = (3 - len(local[g]) + pos) * BS
                for tok in range(BS):
                    if not first_token <= base + tok < n:
                        continue  # outside the window, or past the sequence's end
                    want = torch.tensor([value(li, c, h, tok, rb) for h in range(HEADS)])
                    assert torch.equal(view[lb, :, tok, 0], want), (name, c, lb, tok)


def test_scheduler_block_ids_per_group_with_a_sliding_window() -> None:
    """vLLM's hybrid allocator: prefill exposes a sliding group's blocks from token n - W + 1 on
    (what vLLM keeps once the request finished, nulls dropped), decode fills its blocks of
    tokens n - W to n, and computes a request itself when prefill lost the block of n - W."""
    from types import SimpleNamespace

    from akv.integrations.vllm.identity import Identity
    from akv.integrations.vllm.scheduler import SchedulerHalf

    ident = Identity(parse_options({}), "vllm-p", 5700, 1, 128, "block", producer=True, consumer=True)
    half = SchedulerHalf(ident, [0, 64])  # a full group, a sliding group of 64 tokens
    assert half._exposable(([1, 2, 3], [4, 5, 6]), 300) == ((1, 2, 3), (5, 6))  # before vLLM frees
    assert half._exposable(([1, 2, 3], [0, 5, 6]), 300) == ((1, 2, 3), (5, 6))  # after
    assert half._exposable((list(range(1, 9)), [0] * 7 + [9]), 1000) == (tuple(range(1, 9)), (9,))
    assert half._exposable(([1], [4]), 37) == ((1,), (4,))

    def block(i: int, hashed: bool = False) -> SimpleNamespace:
        return SimpleNamespace(block_id=i, block_hash=b"h" if hashed else None, is_null=i == 0)

    def decode(n: int, remote_ids: tuple[tuple[int, ...], ...], blocks: list[list[SimpleNamespace]]) -> Any:
        remote = RemoteKV("10.0.0.1:5700", "req", remote_ids, 7, n, 128, 60.0)
        req = SimpleNamespace(
            request_id="r", prompt_token_ids=[1] * n, kv_transfer_params=remote.to_params("p", 1)
        )
        count, _ = half.get_num_new_matched_tokens(req, 0)
        if count:
            half.update_state_after_alloc(req, SimpleNamespace(blocks=blocks), count)
        return count, half.build_meta(SimpleNamespace(num_scheduled_tokens={})).pull.get("r")

    count, job = decode(
        300, ((1, 2, 3), (5, 6)), [[block(7), block(8), block(9)], [block(1), block(2), block(3)]]
    )
    assert count == 300 and job.local_block_ids == ((7, 8, 9), (2, 3))
    # a local prefix hit of one block: full group reads the rest, the sliding window is all new
    count, job = decode(
        300, ((1, 2, 3), (5, 6)), [[block(7, True), block(8), block(9)], [block(0), block(2), block(3)]]
    )
    assert job.local_block_ids == ((8, 9), (2, 3))
    # 191 tokens: vLLM freed block 0 of the sliding group on prefill, token 127 with it
    assert half._exposable(([1, 2], [4, 5]), 191) == ((1, 2), (5,))
    assert decode(191, ((1, 2), (5,)), []) == (0, None)


# -- hybrid state groups (vLLM's MambaSpec) ----------------------------------------------

#: Per-layer state as vLLM's layers hold it (conv state DS: (dim, taps); then the temporal state):
#: Nemotron-H's tiny Mamba2 (8 heads of 32, 1 group, state 16, kernel 4, float32) and
#: Qwen3-Next's tiny GDN (1 key head, 2 value heads, dims 128, kernel 4, bf16).
MAMBA2_SHAPES = ((8 * 32 + 2 * 16, 3), (8, 32, 16))
GDN_SHAPES = ((2 * 128 + 2 * 128, 3), (2, 128, 128))


def mamba_spec(kind: str, **kw: Any) -> Any:
    """The fields of vLLM's MambaSpec the connector reads, as vLLM fills them for these models."""
    from types import SimpleNamespace

    shapes, dtype = (MAMBA2_SHAPES, torch.float32) if kind == "mamba2" else (GDN_SHAPES, torch.bfloat16)
    fields: dict[str, Any] = dict(
        shapes=shapes,
        dtypes=(dtype, dtype),
        num_speculative_blocks=0,
        mamba_type=SimpleNamespace(name="MAMBA2" if kind == "mamba2" else "GDN_ATTN"),
    )
    fields.update(kw)
    size = torch.empty((), dtype=dtype).element_size()
    fields["page_size_bytes"] = sum(int(torch.tensor(s).prod()) for s in fields["shapes"]) * size
    return SimpleNamespace(**fields)


def state_caches(
    spec: Any, names: list[str], page: int
) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, ...]]]:
    """What vLLM's allocator and the layers' bind_kv_cache make of one int8 buffer (layer-major):
    per layer an int8 [slots, 1, 1, state bytes] view whose slots sit ``page`` bytes apart, and
    the layer's own (conv, temporal) state views into it."""
    content = spec.page_size_bytes
    raw = torch.zeros(len(names) * NB * page, dtype=torch.int8)
    kv, states = {}, []
    for li, name in enumerate(names):
        t = raw.as_strided((NB, 1, 1, content), (page, content, content, 1), li * NB * page)
        kv[name] = t
        pages, off, mine = t.squeeze(dim=(1, 2)), 0, []
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
            n = int(torch.tensor(shape).prod()) * torch.empty((), dtype=dtype).element_size()
            mine.append(pages[:, off : off + n].view(dtype).view(-1, *shape))
            off += n
        states.append(tuple(mine))
    return kv, states


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_state_group_components_are_views_of_vllm_state(kind: str) -> None:
    """A MambaSpec group maps onto akv components that are exactly vLLM's conv sub-projections
    (x / B / C or q / k / v, each head's channels and taps) and temporal state heads, in place."""
    spec = mamba_spec(kind)
    got_kind, pieces = state_pieces(spec, 1, conv_dim_first=True)
    assert got_kind == kind
    names = [f"model.layers.{i}.mixer" for i in (0, 2)]
    kv, states = state_caches(spec, names, page=spec.page_size_bytes + 4096)  # padded page
    for conv, temporal in states:
        conv.copy_(torch.randn_like(conv, dtype=torch.float32))
        temporal.copy_(torch.randn_like(temporal, dtype=torch.float32))
    group = LayerGroup("g1", kind, tuple(names), 0, 0, pieces=pieces)  # type: ignore[arg-type]
    cache, regions = describe(kv, [group], content="block")
    g = cache.groups[0]
    assert g.kind == kind and g.layers == (0, 2) and g.block_size == 1 and g.dtype == "int8"
    assert [c.name for c in g.components] == (
        ["x", "B", "C", "ssm"] if kind == "mamba2" else ["q", "k", "v", "state"]
    )
    views = akv.layer_views(regions, cache, 0, 1)["g1"]
    for li, (conv, temporal) in enumerate(states):
        assert regions[li].data_ptr() == kv[names[li]].data_ptr()
        if kind == "mamba2":  # conv channels: x = 8 heads x 32, then B, C = 1 group x 16
            splits = {"x": (0, 32, 8), "B": (256, 16, 1), "C": (272, 16, 1)}
        else:  # q, k = 1 key head x 128, v = 2 value heads x 128
            splits = {"q": (0, 128, 1), "k": (128, 128, 1), "v": (256, 128, 2)}
        for name, (start, width, units) in splits.items():
            for u in range(units):
                want = conv[:, start + u * width : start + (u + 1) * width, :].contiguous()
                assert torch.equal(views[li][name][:, u].view(conv.dtype).view(NB, width, 3), want), (name, u)
        last = "ssm" if kind == "mamba2" else "state"
        for h in range(spec.shapes[1][0]):
            got = views[li][last][:, h].view(temporal.dtype).view(NB, *spec.shapes[1][1:])
            assert torch.equal(got, temporal[:, h]), (last, h)


def test_state_groups_refused_unless_akv_can_read_them() -> None:
    """The (taps, dim) conv layout, Mamba1 state and a state whose conv dim does not split are
    ConfigErrors naming what to change."""
    from types import SimpleNamespace

    spec = mamba_spec("mamba2")
    with pytest.raises(akv.ConfigError, match="VLLM_SSM_CONV_STATE_LAYOUT=DS"):
        state_pieces(spec, 1, conv_dim_first=False)
    with pytest.raises(akv.ConfigError, match="MAMBA1"):
        state_pieces(mamba_spec("mamba2", mamba_type=SimpleNamespace(name="MAMBA1")), 1, True)
    with pytest.raises(akv.ConfigError, match="conv dim"):
        state_pieces(mamba_spec("mamba2", shapes=((300, 3), (8, 32, 16))), 1, True)


async def pull_between(
    kv_p: dict[str, torch.Tensor],
    kv_d: dict[str, torch.Tensor],
    groups: list[LayerGroup],
    remote: dict[str, list[int]],
    local: dict[str, list[int]],
    num_tokens: int | None = None,
) -> None:
    """One TP-1 prefill exposes ``remote`` of its vLLM tensors ``kv_p``; one TP-1 decode pulls
    them into ``local`` of ``kv_d``, over NIXL READs."""
    async with AsyncExitStack() as stack:
        server = akv.ControlServer()
        tg = await stack.enter_async_context(anyio.create_task_group())
        await tg.start(server.serve)
        cache, regions = describe(kv_p, groups, content="block")
        producer = await stack.enter_async_context(
            akv.Producer(regions, cache, tp_rank=0, tp_size=1, engine_id="vllm-p", server=server)
        )
        producer.expose("req", remote, generation=3)
        cache, regions = describe(kv_d, groups, content="block")
        async with akv.Consumer(regions, cache, tp_rank=0, tp_size=1, same_process="nixl") as consumer:
            session = await consumer.connect(str(server.endpoint))
            req = akv.PullRequest(
                request_id="req",
                local_block_ids=local,
                remote_block_ids=remote,
                generation=3,
                num_tokens=num_tokens,
            )
            assert (await (await session.pull(req))).path == "read"
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_pull_state_and_attention_groups_sharing_tensors() -> None:
    """Nemotron-H's groups as vLLM's hybrid allocator lays them out (an attention layer and a
    Mamba2 layer sharing one tensor, the state page padded to the attention page): a pull with
    one state slot and the attention blocks moves the whole slot, over NIXL READs, and leaves
    other slots and the page's padding alone."""
    spec = mamba_spec("mamba2")
    _, pieces = state_pieces(spec, 1, True)
    attn_name, mamba_name = "model.layers.1.mixer.attn", "model.layers.0.mixer"
    tokens = 128  # vLLM raises the attention block until its page holds the state's
    page = HEADS * tokens * 2 * HS * 4  # the float32 attention page
    assert page >= spec.page_size_bytes

    conv_bytes = MAMBA2_SHAPES[0][0] * 3 * 4

    def caches() -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        raw = torch.zeros(NB * page, dtype=torch.int8)  # one tensor, shared by both layers
        attn = raw.view(torch.float32).view(NB, HEADS, tokens, 2 * HS)
        c = spec.page_size_bytes
        mamba = raw.as_strided((NB, 1, 1, c), (page, c, c, 1), 0)
        conv = raw.as_strided((NB, conv_bytes), (page, 1), 0).view(torch.float32).view(NB, *MAMBA2_SHAPES[0])
        ssm = raw.as_strided((NB, c - conv_bytes), (page, 1), conv_bytes).view(torch.float32)
        return {attn_name: attn, mamba_name: mamba}, (conv, ssm.view(NB, *MAMBA2_SHAPES[1]))

    groups = [
        LayerGroup("g0", "full", (attn_name,), HEADS, HS),
        LayerGroup("g1", "mamba2", (mamba_name,), 0, 0, pieces=pieces),
    ]
    kv_p, (conv_p, ssm_p) = caches()
    kv_d, (conv_d, ssm_d) = caches()
    conv_p.copy_(torch.randn_like(conv_p))
    ssm_p.copy_(torch.randn_like(ssm_p))
    kv_p[attn_name][1].copy_(torch.randn(HEADS, tokens, 2 * HS))
    pad = kv_d[mamba_name].as_strided((NB, page), (page, 1))[:, spec.page_size_bytes :]
    pad.fill_(7)
    remote = {"g0": [1], "g1": [3]}
    local = {"g0": [2], "g1": [5]}
    await pull_between(kv_p, kv_d, groups, remote, local)
    assert torch.equal(conv_d[5], conv_p[3]) and torch.equal(ssm_d[5], ssm_p[3])
    assert torch.equal(kv_d[attn_name][2], kv_p[attn_name][1])
    assert not conv_d[4].any() and not ssm_d[6].any() and bool((pad[5] == 7).all())


@pytest.mark.anyio
async def test_pull_full_sliding_and_state_groups_sharing_tensors() -> None:
    """A model with full attention, sliding-window attention and Mamba2 layers, as vLLM's
    hybrid allocator lays them out (one tensor shared by a layer of each group, a block id one
    group's at a time): one pull moves the full group's blocks, the sliding group's window and
    the state slot whole, and leaves the rest of the pool alone (a sliding block before the
    window is not read; blocks move whole)."""
    spec = mamba_spec("mamba2")
    _, pieces = state_pieces(spec, 1, True)
    full, sliding, mamba = "model.layers.0.attn", "model.layers.1.attn", "model.layers.2.mixer"
    tokens, window = 128, 100
    page = HEADS * tokens * 2 * HS * 4  # the float32 attention page (holds the state page)
    n = 2 * tokens - 5  # the window (tokens 151 to 250) lies in the sequence's second block

    def caches() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        raw = torch.zeros(NB * page, dtype=torch.int8)
        attn = raw.view(torch.float32).view(NB, HEADS, tokens, 2 * HS)
        c = spec.page_size_bytes
        return {full: attn, sliding: attn, mamba: raw.as_strided((NB, 1, 1, c), (page, c, c, 1), 0)}, raw

    groups = [
        LayerGroup("g0", "full", (full,), HEADS, HS),
        LayerGroup("g1", "sliding", (sliding,), HEADS, HS, window=window),
        LayerGroup("g2", "mamba2", (mamba,), 0, 0, pieces=pieces),
    ]
    remote = {"g0": [1, 2], "g1": [0, 4], "g2": [6]}
    local = {"g0": [3, 7], "g1": [1, 0], "g2": [5]}
    kv_p, raw_p = caches()
    kv_d, raw_d = caches()
    pages_p = raw_p.view(NB, page)
    for b in (0, 1, 2, 4):
        kv_p[full][b].copy_(torch.randn(HEADS, tokens, 2 * HS))
    pages_p[6, : spec.page_size_bytes].copy_(torch.randn(spec.page_size_bytes // 4).view(torch.int8))
    pages_d = raw_d.view(NB, page)
    pages_d.fill_(7)  # what decode's blocks held before: left alone outside what the pull fills
    await pull_between(kv_p, kv_d, groups, remote, local, num_tokens=n)
    attn_p, attn_d = kv_p[full], kv_d[full]
    for lb, rb in ((3, 1), (7, 2), (0, 4)):  # the full group's blocks, the window's block
        assert torch.equal(attn_d[lb], attn_p[rb]), lb
    c = spec.page_size_bytes
    assert torch.equal(pages_d[5, :c], pages_p[6, :c])  # the state slot whole, padding left alone
    assert bool((pages_d[5, c:] == 7).all())
    for b in (1, 2, 4, 6):  # the sliding block before the window, and blocks not in the pull
        assert bool((pages_d[b] == 7).all()), b


@pytest.mark.anyio
@pytest.mark.parametrize("groups", [1, 2], ids=["one-group-replicated", "two-groups-split"])
@pytest.mark.parametrize(("P", "D"), [(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
async def test_mamba2_state_across_tp_with_groups_replicated_or_split(P: int, D: int, groups: int) -> None:
    """A Mamba2 state slot pulled across TP sizes, each rank's conv state and SSM state shaped as
    vLLM shapes them at its TP size: with one group (vLLM gives every rank of TP 2 a copy of its
    B and C channels) and with two (each rank one group). Every decode rank ends with its own
    heads' x channels and SSM state and its groups' B and C, byte for byte."""
    H, HD, ST, TAPS = 8, 32, 16, 3
    g = torch.Generator().manual_seed(P * 10 + groups)
    x = torch.randn(H, HD, TAPS, generator=g)  # per head: head_dim channels x taps
    bc = torch.randn(2, groups, ST, TAPS, generator=g)  # B, C per group
    ssm = torch.randn(H, HD, ST, generator=g)

    def rank_state(r: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
        heads = slice(r * H // tp, (r + 1) * H // tp)
        mine = bc if groups < tp else bc[:, r * groups // tp : (r + 1) * groups // tp]
        conv = torch.cat([x[heads].reshape(-1, TAPS), mine[0].reshape(-1, TAPS), mine[1].reshape(-1, TAPS)])
        return conv, ssm[heads]

    def rank_spec(tp: int) -> Any:
        per_rank_groups = max(groups // tp, 1)
        return mamba_spec(
            "mamba2", shapes=((H // tp * HD + 2 * per_rank_groups * ST, TAPS), (H // tp, HD, ST))
        )

    name = "model.layers.0.mixer"
    remote, local = {"g1": [3]}, {"g1": [5]}
    async with AsyncExitStack() as stack:
        server = akv.ControlServer()
        tg = await stack.enter_async_context(anyio.create_task_group())
        await tg.start(server.serve)
        for r in range(P):
            spec = rank_spec(P)
            _, pieces = state_pieces(spec, P, True, n_groups=groups)
            kv, states = state_caches(spec, [name], page=spec.page_size_bytes)
            conv, temporal = rank_state(r, P)
            states[0][0][3].copy_(conv)
            states[0][1][3].copy_(temporal)
            cache, regions = describe(
                kv, [LayerGroup("g1", "mamba2", (name,), 0, 0, pieces=pieces)], content="block"
            )
            producer = await stack.enter_async_context(
                akv.Producer(regions, cache, tp_rank=r, tp_size=P, engine_id="vllm-p", server=server)
            )
            producer.expose("req", remote, generation=4)
        for d in range(D):
            spec = rank_spec(D)
            _, pieces = state_pieces(spec, D, True, n_groups=groups)
            kv, states = state_caches(spec, [name], page=spec.page_size_bytes)
            cache, regions = describe(
                kv, [LayerGroup("g1", "mamba2", (name,), 0, 0, pieces=pieces)], content="block"
            )
            async with akv.Consumer(regions, cache, tp_rank=d, tp_size=D, same_process="nixl") as consumer:
                session = await consumer.connect(str(server.endpoint))
                req = akv.PullRequest(
                    request_id="req", local_block_ids=local, remote_block_ids=remote, generation=4
                )
                assert (await (await session.pull(req))).path == "read"
            conv, temporal = rank_state(d, D)
            assert torch.equal(states[0][0][5], conv), d
            assert torch.equal(states[0][1][5], temporal), d
            assert not states[0][0][4].any() and not states[0][1][6].any()
        tg.cancel_scope.cancel()


def test_mamba2_group_count_is_read_where_one_group_per_rank_is_ambiguous() -> None:
    """One Mamba2 group per rank at TP 2 is either two groups split or one replicated: without
    the model's n_groups that is a ConfigError naming the config key; a count that is neither is
    refused too; at TP 1 or with several groups per rank no count is needed."""
    spec = mamba_spec("mamba2")  # one group per rank
    with pytest.raises(akv.ConfigError, match="n_groups"):
        state_pieces(spec, 2, True)
    with pytest.raises(akv.ConfigError, match="split evenly"):
        state_pieces(spec, 2, True, n_groups=4)
    two_per_rank = mamba_spec("mamba2", shapes=((8 * 32 + 2 * 2 * 16, 3), (8, 32, 16)))
    with pytest.raises(akv.ConfigError, match="split evenly"):
        state_pieces(two_per_rank, 2, True, n_groups=1)
    by_name = {p.name: p.units for p in state_pieces(spec, 2, True, n_groups=1)[1]}
    assert by_name == {"x": 16, "B": 1, "C": 1, "ssm": 16}
    assert {p.name: p.units for p in state_pieces(spec, 2, True, n_groups=2)[1]}["B"] == 2
    assert {p.name: p.units for p in state_pieces(spec, 1, True)[1]}["B"] == 1


def test_scheduler_hybrid_state_slot_and_truncation() -> None:
    """A hybrid model: prefill drops the prompt's last token and ends after one output token;
    it exposes the request's running state slot (the last live one) beside its attention
    blocks; decode fills the state slot vLLM allocated, whole, also with a local prefix hit,
    and computes a request itself whose prefill state holds every prompt token."""
    from types import SimpleNamespace

    from akv.integrations.vllm.identity import Identity
    from akv.integrations.vllm.scheduler import SchedulerHalf

    ident = Identity(parse_options({}), "vllm-p", 5700, 1, 128, "block", producer=True, consumer=True)
    half = SchedulerHalf(ident, [0, 0], [False, True])  # attention, then a Mamba2 group
    tokens = list(range(300))
    params: dict[str, Any] = {"do_remote_decode": True}
    req = SimpleNamespace(
        request_id="p",
        prompt_token_ids=tokens,
        _all_token_ids=list(tokens),
        num_prompt_tokens=300,
        max_tokens=16,
        kv_transfer_params=params,
    )
    half.on_new_request(req)
    half.on_new_request(req)  # once only
    assert req.num_prompt_tokens == 299 and len(req.prompt_token_ids) == 299 and req.max_tokens == 1
    # vLLM's 'align' mode keeps a state per block position, nulling the old ones; 'none' one slot
    assert half._exposable(([1, 2, 3], [0, 8, 9]), 299) == ((1, 2, 3), (9,))
    assert half._exposable(([1, 2, 3], [7]), 299) == ((1, 2, 3), (7,))

    def block(i: int, hashed: bool = False) -> SimpleNamespace:
        return SimpleNamespace(block_id=i, block_hash=b"h" if hashed else None, is_null=i == 0)

    def decode(n: int, prompt: int, blocks: list[list[SimpleNamespace]], computed: int = 0) -> Any:
        remote = RemoteKV("10.0.0.1:5700", "req", ((1, 2, 3), (9,)), 7, n, 128, 60.0)
        r = SimpleNamespace(
            request_id="r", prompt_token_ids=[1] * prompt, kv_transfer_params=remote.to_params("p", 1)
        )
        count, _ = half.get_num_new_matched_tokens(r, computed)
        if count:
            half.update_state_after_alloc(r, SimpleNamespace(blocks=blocks), count)
        return count, half.build_meta(SimpleNamespace(num_scheduled_tokens={})).pull.get("r")

    count, job = decode(299, 300, [[block(4), block(5), block(6)], [block(11)]])
    assert count == 299 and job.local_block_ids == ((4, 5, 6), (11,))
    # a local prefix hit of one block: attention pulls the rest, the state slot is pulled whole
    count, job = decode(
        299, 300, [[block(4, True), block(5), block(6)], [block(0), block(12), block(13)]], 128
    )
    assert count == 171 and job.local_block_ids == ((5, 6), (13,))
    assert decode(300, 300, []) == (0, None)  # prefill's state already holds the last token


def test_state_tensors_akv_cannot_read_in_place_are_refused() -> None:
    """A state view that is not int8 pages, pages closer than their bytes, or pages spaced past
    the allocation (blocks outside layers) are ConfigErrors naming the group."""
    spec = mamba_spec("mamba2")
    _, pieces = state_pieces(spec, 1, True)
    group = LayerGroup("g1", "mamba2", ("model.layers.0.mixer",), 0, 0, pieces=pieces)
    c = spec.page_size_bytes
    raw = torch.zeros(NB * 2 * c, dtype=torch.int8)
    for bad, match in (
        (torch.zeros(NB, 1, 1, c // 4), "int8"),
        (raw.as_strided((NB, 1, 1, c), (c // 2, c, c, 1)), "apart"),
        (
            torch.zeros((NB - 1) * 4 * c + c, dtype=torch.int8).as_strided((NB, 1, 1, c), (4 * c, c, c, 1)),
            "past the KV allocation",
        ),
    ):
        with pytest.raises(akv.ConfigError, match=match):
            describe({"model.layers.0.mixer": bad}, [group], content="block")


# -- the worker half in vLLM's step thread ------------------------------------------------


def test_worker_steps_hand_over_without_waiting_for_akvs_thread() -> None:
    """vLLM's step thread never waits on akv's thread: with the event loops of a prefill and a
    decode worker both busy for 3 s, the prefill step's exposure and the decode step's pull are
    each handed over in well under that; akv then carries them out in order: the pull lands
    bit-exact and the prefill worker reports the request sent."""
    worker_hand_over("cpu", "block", "LBHNC")


def worker_hand_over(device: str, content: Content, layout: str) -> None:
    """The test above on ``device`` with vLLM's ``content`` and ``layout`` (test_gpu.py runs it
    on CUDA tensors shaped as vLLM's CUDA backends shape them)."""
    import socket
    import time

    from akv.integrations.vllm.identity import Identity
    from akv.integrations.vllm.params import ConnectorMeta, ExposeJob, PullJob
    from akv.integrations.vllm.worker import WorkerHalf

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = parse_options({"port": port, "expose_wait": 20.0})
    prefill = WorkerHalf(Identity(options, "vllm-p", port, 1, BS, content, True, False), [GROUP], 0, 1)
    decode = WorkerHalf(Identity(options, "vllm-d", 0, 1, BS, content, False, True), [GROUP], 0, 1)
    kv_p = {n: vllm_tensor(layout, HEADS).to(device) for n in NAMES}
    kv_d = {n: vllm_tensor(layout, HEADS).to(device) for n in NAMES}
    for li, t in enumerate(kv_p.values()):
        for c, view in enumerate(kv_views(t, content)):
            for b in (1, 2, 3):
                for h in range(HEADS):
                    view[b, h] = torch.tensor([value(li, c, h, tok, b) for tok in range(BS)])[:, None].to(
                        device
                    )
    prefill.start(kv_p)
    decode.start(kv_d)
    try:

        async def busy() -> None:
            time.sleep(3.0)  # akv's loop of that worker does nothing else meanwhile

        for worker in (prefill, decode):
            assert worker._portal is not None
            worker._portal.start_task_soon(busy)
        started = time.monotonic()
        prefill.after_forward(ConnectorMeta(expose={"r1": ExposeJob(((1, 2, 3),), 11)}))
        remote = RemoteKV(f"127.0.0.1:{port}", "r1", ((1, 2, 3),), 11, 3 * BS, BS, 60.0)
        decode.step(ConnectorMeta(pull={"r1": PullJob(remote, ((5, 6, 7),))}))
        handed = time.monotonic() - started
        assert handed < 1.5, handed
        received: set[str] = set()
        sent: set[str] = set()
        deadline = time.monotonic() + 60
        while (not received or not sent) and time.monotonic() < deadline:
            time.sleep(0.05)
            _, done, failed = decode.out.take()
            assert not failed
            received |= done
            sent |= prefill.out.take()[0]
        assert received == {"r1"} and sent == {"r1"}
        for li, t in enumerate(kv_d.values()):
            for c, view in enumerate(kv_views(t, content)):
                for lb, rb in zip((5, 6, 7), (1, 2, 3), strict=True):
                    want = torch.tensor(
                        [[value(li, c, h, tok, rb) for tok in range(BS)] for h in range(HEADS)]
                    )
                    assert torch.equal(view[lb, :, :, 0].cpu(), want), (li, c, lb)
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_a_steps_pulls_from_one_instance_land_together_and_each_fails_alone() -> None:
    """A decode step with several pulls from one prefill instance launches them together:
    each lands bit-exact, one the prefill exposes only later lands once it is exposed, and
    one with a block id outside the decode cache fails alone."""
    import socket
    import time

    from akv.integrations.vllm.identity import Identity
    from akv.integrations.vllm.params import ConnectorMeta, ExposeJob, PullJob
    from akv.integrations.vllm.worker import WorkerHalf

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = parse_options({"port": port, "expose_wait": 20.0})
    prefill = WorkerHalf(Identity(options, "vllm-p", port, 1, BS, "block", True, False), [GROUP], 0, 1)
    decode = WorkerHalf(Identity(options, "vllm-d", 0, 1, BS, "block", False, True), [GROUP], 0, 1)
    kv_p = {n: vllm_tensor("LBHNC", HEADS) for n in NAMES}
    kv_d = {n: vllm_tensor("LBHNC", HEADS) for n in NAMES}
    for li, t in enumerate(kv_p.values()):
        for c, view in enumerate(kv_views(t, "block")):
            for b in range(1, 7):
                for h in range(HEADS):
                    view[b, h] = torch.tensor([value(li, c, h, tok, b) for tok in range(BS)])[:, None]
    prefill.start(kv_p)
    decode.start(kv_d)
    try:
        source = {"a": (1, 2), "b": (3,), "late": (4, 5), "bad": (6,)}
        target = {"a": (7, 1), "b": (2,), "late": (4, 5), "bad": (NB,)}  # NB: past the decode cache
        prefill.after_forward(
            ConnectorMeta(expose={r: ExposeJob((source[r],), 11) for r in ("a", "b", "bad")})
        )
        pulls = {
            r: PullJob(
                RemoteKV(f"127.0.0.1:{port}", r, (source[r],), 11, len(source[r]) * BS, BS, 60.0),
                (target[r],),
            )
            for r in source
        }
        decode.step(ConnectorMeta(pull=pulls))
        time.sleep(0.3)
        prefill.after_forward(ConnectorMeta(expose={"late": ExposeJob((source["late"],), 11)}))
        finished: set[str] = set()  # pulls done, failed or not
        failed: set[str] = set()
        deadline = time.monotonic() + 60
        while finished != set(source) and time.monotonic() < deadline:
            time.sleep(0.05)
            _, done, bad = decode.out.take()
            finished |= done
            failed |= bad
        assert finished == set(source) and failed == {"bad"}
        for li, t in enumerate(kv_d.values()):
            for c, view in enumerate(kv_views(t, "block")):
                for r in ("a", "b", "late"):
                    for lb, rb in zip(target[r], source[r], strict=True):
                        want = torch.tensor(
                            [[value(li, c, h, tok, rb) for tok in range(BS)] for h in range(HEADS)]
                        )
                        assert torch.equal(view[lb, :, :, 0], want), (r, li, c, lb)
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_the_launcher_runs_tp_1_in_the_engine_core_process_only_when_asked() -> None:
    """``executor="uni"`` asks vLLM for its one-process executor and sets the switch vLLM's CPU
    build needs to keep it; by default neither is set; TP 2 with ``uni``, and the command
    line's ``--executor uni --tp 2``, are refused with what to change."""
    import os
    import subprocess
    import sys

    from akv.integrations.vllm.launch import instance_command

    cmd, env = instance_command("m", role="decode", http_port=1, executor="uni")
    at = cmd.index("--distributed-executor-backend")
    assert cmd[at + 1] == "uni" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    cmd, env = instance_command("m", role="decode", http_port=1)
    assert "--distributed-executor-backend" not in cmd
    assert env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    with pytest.raises(ValueError, match="use mp for TP 2"):
        instance_command("m", role="decode", http_port=1, executor="uni", tp=2)
    argv = ["--model", ".", "--role", "decode", "--tp", "2", "--executor", "uni"]
    out = subprocess.run(
        [sys.executable, "-m", "akv.integrations.vllm.launch", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 64 and out.stderr.count("\n") == 1 and "--executor mp" in out.stderr
