"""One copy kernel per request (`akv.kernels`): the Triton kernel run by Triton's interpreter
on CPU tensors (``copy_with="torch"`` with ``TRITON_INTERPRET=1``: the code path CUDA tensors
take) moves exactly the right bytes on every pairing, and the copy path, the pack and the
packed scatter cost a constant number of torch operations per request, none syncing the host."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import akv
from akv import kernels
from akv.errors import ConfigError
from tests.conftest import make_spec
from tests.opcounts import HOST_SYNCS, KERNEL_RANGE, PATHS
from tests.transfers import PAIRINGS, pairs, pull_every_request, pull_everything

PAIRS = [pytest.param(*v, id=k) for k, v in PAIRINGS.items()]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Triton's interpreter on: the kernel runs on CPU tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_modes_keep_memory_moves_on_dram(interpret: None) -> None:
    """DRAM with copy_with="auto" never takes the kernel; "torch" takes it under the
    interpreter, and falls back to torch operations without it."""
    assert kernels.mode("cpu", "auto") == "host"
    assert kernels.mode("cpu", "torch") == "kernel"
    assert kernels.mode("cuda", "auto") == "torch"  # the interpreter cannot reach device memory


def test_torch_fallback_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TRITON_INTERPRET, copy_with="torch" on CPU tensors takes torch operations."""
    # Triton fixes at its first import whether its library functions (tl.max, ...) run under
    # its interpreter: import it with the interpreter on, as the tests after this one need
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.triton_available()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels.mode("cpu", "torch") == "torch"
    assert kernels.mode("cuda", "auto") == "kernel"


#: Compiles both kernels for sm_90 with every anchor width; run in a fresh interpreter.
COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from akv import kernels

for width in (8, 4, 2, 1):
    ptr = {8: "*i64", 4: "*i32", 2: "*i16", 1: "*u8"}[width]
    signatures = {
        kernels._kernel(False): dict(dst=ptr, src=ptr, runs="*i64", n="i32"),
        kernels._block_kernel(False): dict(
            dst=ptr, src=ptr, segs="*i64", bases="*i64", tmpl="*i64",
            n_segs="i32", segs_per_program="i32", tiles_per_program="i32",
        ),
    }
    for fn, sig in signatures.items():
        src = ASTSource(
            fn, {**sig, "ROWS": "constexpr", "BLOCK": "constexpr"}, constexprs={"ROWS": 4, "BLOCK": 1024}
        )
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        if not compiled.asm.get("cubin"):
            sys.exit(f"no cubin: {fn} width {width}")
        print("compiled", fn.__name__, width)
"""


def test_kernels_compile_for_the_gpu() -> None:
    """Both kernels compile to GPU code (sm_90, Hopper; the interpreter runs Python and
    accepts what the compiler refuses), with every anchor width the launchers pass. In a
    process of its own: Triton decides when it is first imported whether its library functions
    (``tl.max``, ...) run under the interpreter, and these compile without it."""
    if importlib.util.find_spec("triton") is None:  # not imported here (see above)
        if os.environ.get("CI"):
            raise AssertionError("Triton is not installed: scripts/setup.sh installs it with torch")
        pytest.skip("Triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"  # no floating point here; silences 3.9's notice
    out = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("compiled") == 8, out.stdout


#: Runs of any alignment and length (longer than a kernel row's chunk too) within 300,000
#: bytes: destination starts, source starts, lengths.
RUNS = (
    [0, 10, 40, 300, 1000, 6000, 80_000, 100_000],
    [7, 100, 2, 999, 150_000, 10, 77_777, 199_999],
    [1, 3, 17, 256, 4096, 70_000, 5, 100_000],
)


def test_kernel_copies_runs_bit_exact(interpret: None) -> None:
    """Runs of any alignment and length (longer than a kernel row's chunk too) land bit-exact,
    and neighbours contiguous on both sides are merged into one row."""
    rng = np.random.default_rng(3)
    src = torch.from_numpy(rng.integers(0, 256, 300_000, dtype=np.uint8))
    dst = torch.zeros(300_000, dtype=torch.uint8)
    want = dst.clone()
    starts_d, starts_s, lengths = RUNS
    for d, s, n in zip(starts_d, starts_s, lengths, strict=True):
        want[d : d + n] = src[s : s + n]
    copier = kernels.RunCopier(torch.device("cpu"))
    rows = copier.copy(
        dst.data_ptr() + np.array(starts_d, dtype=np.int64),
        src.data_ptr() + np.array(starts_s, dtype=np.int64),
        np.array(lengths, dtype=np.int64),
    )
    assert torch.equal(dst, want)
    assert rows >= len(lengths)  # the long runs cut into pieces
    x = torch.arange(1024, dtype=torch.int64)
    y = torch.zeros(1024, dtype=torch.int64)
    at = np.arange(0, 1024 * 8, 64, dtype=np.int64)
    assert copier.copy(y.data_ptr() + at, x.data_ptr() + at, np.full(len(at), 64)) == 1
    assert torch.equal(x, y)


def _sorted_merged(runs: Any) -> tuple[Any, ...]:
    dst, src, length = (np.asarray(a, dtype=np.int64) for a in runs)
    order = np.argsort(dst, kind="stable")
    return tuple(a.tolist() for a in kernels.merge_runs(dst[order], src[order], length[order]))


@pytest.mark.parametrize("layout", ["NHD", "HND", "head-major", "cross-layer"])
def test_templates_stand_for_the_runs_of_each_request(layout: str) -> None:
    """A pack's and a scatter's segments (a template built once, bases per block or token)
    stand for exactly the runs derived run by run on the host: every byte from and to the
    same addresses, for head-sliced ranks, fragmented blocks, whole blocks, a unit subset and
    token positions that are not whole blocks."""
    from akv.geometry.cache import as_cache
    from akv.geometry.layout import rank_layout
    from akv.packing import CacheViews, gather_runs, gather_segment, scatter_runs, scatter_segment, sections

    spec = make_spec(kv_heads=4, layers=3, block_size=4, head_dim=8, layout=layout, num_blocks=16)
    cache = as_cache(spec)
    views = CacheViews(akv.allocate_kv_cache(spec, 0, 2), rank_layout(cache, 0, 2))
    ids = np.array([7, 2, 11], dtype=np.int32)
    secs, _ = sections(cache, 0, 2, [len(ids)])
    for sec in secs:
        got = kernels.expand(gather_segment(views, sec, ids, 1 << 40))
        assert _sorted_merged(got) == _sorted_merged(gather_runs(views, sec, ids, 1 << 40))
    placement = views.layout.groups[0].placements[0]
    bs = 4
    whole_blocks = np.repeat(np.array([5, 1], dtype=np.int64), bs)
    whole_positions = np.tile(np.arange(bs, dtype=np.int64), 2)
    cases = [
        (placement.units, whole_blocks, whole_positions),
        (range(placement.units.start + 1, placement.units.stop), whole_blocks, whole_positions),
        (placement.units, np.array([3, 3, 9], dtype=np.int64), np.array([1, 2, 0], dtype=np.int64)),
    ]
    for units, blocks, positions in cases:
        for ci in range(len(secs)):
            args = (views, 0, ci, units, 1 << 41, blocks, positions)
            got = kernels.expand(scatter_segment(*args))
            assert _sorted_merged(got) == _sorted_merged(scatter_runs(*args))


@pytest.mark.anyio
@pytest.mark.parametrize(("pspec", "dspec", "p", "d"), PAIRS)
async def test_copy_kernel_bit_exact_on_every_pairing(
    interpret: None, pspec: Any, dspec: Any, p: int, d: int
) -> None:
    """The copy path's kernel, under the interpreter, fills every decode rank bit-exact on
    every pairing (TP kinds, MLA, hybrid groups, sliding windows, mixed layouts and block sizes,
    prefix hits)."""
    results, engine = await pull_everything(pspec, dspec, p, d, "auto", copy_with="torch")
    assert {r.path for r in results} == {"copy"}
    assert set(engine.reasons.values()) == {p}


async def packed_under_the_interpreter(
    pspec: Any, dspec: Any, p: int, d: int, requests: int, **consumer_kw: Any
) -> tuple[list[akv.TransferResult], Any]:
    """`pull_every_request` with the pack and the scatter forced onto the kernel's path."""
    return await pull_every_request(
        pspec,
        dspec,
        p,
        d,
        lambda r: akv.Consumer(
            akv.allocate_kv_cache(dspec, r, d),
            dspec,
            tp_rank=r,
            tp_size=d,
            same_process="nixl",
            transfer="packed",
            copy_with="torch",
            **consumer_kw,
        ),
        requests=requests,
        seed=11,
        transfer="packed",
        copy_with="torch",
    )


@pytest.mark.anyio
@pytest.mark.parametrize(("pspec", "dspec", "p", "d"), PAIRS)
async def test_pack_and_scatter_kernels_bit_exact_on_every_pairing(
    interpret: None, pspec: Any, dspec: Any, p: int, d: int
) -> None:
    """The pack's and the packed scatter's kernels, under the interpreter, fill every decode
    rank bit-exact on every pairing."""
    results, engine = await packed_under_the_interpreter(pspec, dspec, p, d, 3)
    assert {r.path for r in results} == {"packed"}
    assert all(p.metrics.counters.get("packed", 0) == 3 for p in engine.producers)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("pspec", "dspec", "p", "d"), pairs("dense-2to1", "mla-2to3", "headmajor8-to-nhd4", "gemma3-sliding")
)
async def test_packed_push_scatter_kernel_bit_exact(
    interpret: None, pspec: Any, dspec: Any, p: int, d: int
) -> None:
    """Packed pushes scattered by the kernel under the interpreter (the prefill packing with
    it too) fill every decode rank bit-exact."""
    results, engine = await packed_under_the_interpreter(pspec, dspec, p, d, 2, mode="push")
    assert {r.path for r in results} == {"push"}
    assert sum(p.metrics.counters.get("packed_pushes", 0) for p in engine.producers) == sum(
        r.reads for r in results
    )


@pytest.mark.parametrize("path", sorted(PATHS))
def test_torch_ops_per_request_do_not_grow(interpret: None, path: str) -> None:
    """One request's torch operations on the copy path, the pack, the packed scatter and a
    packed push's scatter are the same for 4, 16 and 32 layers and 16 and 128 blocks, at most
    8, one kernel launch, and none of them syncs the host."""
    counts = {
        (layers, blocks): PATHS[path](layers, blocks, "torch")
        for layers in (4, 16, 32)
        for blocks in (16, 128)
    }
    totals = {key: sum(ops.values()) for key, ops in counts.items()}
    assert len(set(totals.values())) == 1, totals
    assert next(iter(totals.values())) <= 8, counts
    for ops in counts.values():
        assert ops[KERNEL_RANGE] == 1
        assert not any(ops[name] for name in HOST_SYNCS), ops


def test_producer_rejects_unknown_copy_with() -> None:
    """Producer(copy_with=...) other than "auto" or "torch" is a ConfigError."""
    spec = akv.KVSpec.create(layers=1, num_blocks=4, block_size=4, kv_heads=1, head_dim=8, dtype="float16")
    with pytest.raises(ConfigError, match="copy_with"):
        akv.Producer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, copy_with="numpy")
