"""A hybrid model (Qwen3-Next: full attention and Gated DeltaNet state) between engines that
lay their caches out differently.

Prefill: TP 2, head-major layout, 16-token blocks. Decode: TP 1, per-layer HND, 32-token
blocks. Both write and read their caches only through `akv.layer_views` (the per-layer,
per-component views attention kernels and state updates would use), keep one block pool per
cache group, and pass block ids per group. Prefill's pools get their blocks back from
`Release.groups`. Run: ``python examples/hybrid_model.py``.
"""

from __future__ import annotations

import sys
from typing import Any

import anyio
import torch

import akv
from akv.testing import local_counts

LAYERS, TOKENS, REQUESTS = 4, 80, 3  # 80 tokens: the last decode block is partly filled
PREFILL = akv.preset("qwen3-next-80b", layers=LAYERS, blocks=32, dtype="float32", layout="head-major")
DECODE = akv.preset("qwen3-next-80b", layers=LAYERS, blocks=32, dtype="float32", block_size=32)


def content(layer: int, comp: int, units: range, tokens: int | None, elems: int, seed: int) -> torch.Tensor:
    """What a model would have computed: distinct per request, layer, component, unit, token."""
    u = torch.arange(units.start, units.stop, dtype=torch.float32)[:, None, None]
    t = torch.arange(tokens or 1, dtype=torch.float32)[None, :, None]
    e = torch.arange(elems, dtype=torch.float32)[None, None, :] / 4096
    out = seed * 1000 + layer * 100 + comp * 10 + u + t / 256 + e
    return out if tokens else out[:, 0]


def views(consumer_or_producer: Any, spec: akv.CacheSpec) -> dict[str, list[dict[str, torch.Tensor]]]:
    p = consumer_or_producer
    return akv.layer_views(p.kv_caches, spec, p.tp_rank, p.tp_size)


def write(prod: akv.Producer, ids: dict[str, list[int]], seed: int) -> None:
    """Prefill "computes" a request: every layer of every group, through the layer views."""
    for group in PREFILL.groups:
        for i, layer_views in enumerate(views(prod, PREFILL)[group.name]):
            for c, comp in enumerate(group.components):
                held = comp.held(prod.tp_rank, prod.tp_size)
                if group.tokens:  # ids name consecutive blocks of the sequence
                    for b, block in enumerate(ids[group.name]):
                        whole = content(i, c, held, (b + 1) * group.block_size, comp.unit_elems, seed)
                        layer_views[comp.name][block] = whole[:, b * group.block_size :]
                else:
                    layer_views[comp.name][ids[group.name][0]] = content(
                        i, c, held, None, comp.unit_elems, seed
                    )


def check(cons: akv.Consumer, ids: dict[str, list[int]], seed: int) -> bool:
    """Decode finds every token of the request in its own blocks and layout."""
    ok = True
    for group in DECODE.groups:
        for i, layer_views in enumerate(views(cons, DECODE)[group.name]):
            for c, comp in enumerate(group.components):
                want = content(i, c, comp.held(0, 1), TOKENS if group.tokens else None, comp.unit_elems, seed)
                got = layer_views[comp.name][ids[group.name]]
                if group.tokens:  # blocks -> one sequence of tokens, cut at the request's end
                    got = got.permute(1, 0, 2, 3).reshape(got.shape[1], -1, got.shape[3])[:, :TOKENS]
                else:
                    got = got[0]
                ok &= torch.equal(got, want)
    return ok


async def main() -> int:
    free = {g.name: list(range(g.num_blocks)) for g in PREFILL.groups}
    returned: list[str] = []
    all_returned = anyio.Event()

    def on_release(release: akv.EngineRelease) -> None:
        for name, blocks in (release.groups or {}).items():
            free[name].extend(blocks.tolist())
        returned.append(release.request_id)
        if len(returned) == REQUESTS:
            all_returned.set()

    releases = akv.EngineReleases(2, on_release)
    async with anyio.create_task_group() as tg:
        server = akv.ControlServer()
        endpoint = await tg.start(server.serve)
        async with (
            akv.Producer(
                akv.allocate_kv_cache(PREFILL, 0, 2), PREFILL, tp_rank=0, tp_size=2,
                server=server, on_release=releases.rank(0),
            ) as p0,
            akv.Producer(
                akv.allocate_kv_cache(PREFILL, 1, 2), PREFILL, tp_rank=1, tp_size=2,
                server=server, on_release=releases.rank(1),
            ) as p1,
            akv.Consumer(akv.allocate_kv_cache(DECODE, 0, 1), DECODE, tp_rank=0, tp_size=1) as consumer,
        ):  # fmt: skip
            session = await consumer.connect(endpoint)
            ok = True
            for seed in range(1, REQUESTS + 1):
                rid = f"req-{seed}"
                need = local_counts(PREFILL, TOKENS)
                remote = {name: [free[name].pop(0) for _ in range(n)] for name, n in need.items()}
                for prod in (p0, p1):
                    write(prod, remote, seed)
                    prod.expose(rid, remote)
                local = {name: list(range(n)) for name, n in local_counts(DECODE, TOKENS).items()}
                result = await (await session.pull(rid, local, remote, num_tokens=TOKENS))
                good = check(consumer, local, seed)
                ok &= good
                print(
                    f"{rid}: {result.bytes} bytes in {result.descriptors} descriptors, {'OK' if good else 'MISMATCH'}"
                )
            with anyio.fail_after(10):
                await all_returned.wait()
            print(f"released on both prefill ranks: {len(returned)}; prefill pools whole again: "
                  f"{all(len(v) == PREFILL.group(k).num_blocks for k, v in free.items())}")  # fmt: skip
        tg.cancel_scope.cancel()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))
