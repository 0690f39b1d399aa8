"""Every descriptor list akv and its bench prepare carries the memory type of the memory it
describes (issue 39: the bench's per-block lists said "DRAM" whatever the device, and NIXL
refused them on VRAM).

CPU memory cannot be VRAM, so the tests label it: `akv.backends.mem_type` (the one rule by
which akv names the memory of its caches and staging areas) reports CPU tensors as "VRAM",
and `TypedBackend`, the real NIXL agent, records each registered region with the type akv
named it by, checks every prepared list and every unprepared read against the regions of
the agent they describe, and hands NIXL the memory's real type. A list that names its
memory by anything but the rule (a hard-coded "DRAM") then fails on CPU, as it would on a GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

import akv
import akv.backends
import akv.runtime.consumer
import akv.runtime.paths.packed
import akv.runtime.producer
import akv.runtime.pusher
from akv.backends import DlistHandle, XferHandle
from akv.backends.nixl import NixlBackend
from akv.bench.methods import Methods
from akv.bench.workloads import Figures
from akv.plan import expand_table
from akv.testing import make_requests
from tests.conftest import local_ids, make_spec, prefill_engine
from tests.transfers import pull_every_request

pytestmark = pytest.mark.anyio

#: registered regions by agent name: (start, end, memory type akv named them by)
REGIONS: dict[str, list[tuple[int, int, str]]] = {}
#: lists or reads whose declared type is not their memory's, as messages
VIOLATIONS: list[str] = []
#: descriptors checked, by what prepared or posted them
CHECKED: dict[str, int] = {}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def labelled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CPU tensors named "VRAM" by akv's memory-type rule, wherever akv applies it."""
    real = akv.backends.mem_type

    def label(tensors: Sequence[torch.Tensor]) -> tuple[str, int]:
        kind, index = real(tensors)
        return ("VRAM" if kind == "DRAM" else kind), index

    for name, module in list(sys.modules.items()):
        if name.startswith("akv") and getattr(module, "mem_type", None) is real:
            monkeypatch.setattr(module, "mem_type", label)
    REGIONS.clear()
    VIOLATIONS.clear()
    CHECKED.clear()
    yield


class TypedBackend(NixlBackend):
    """The real NIXL agent, checking the memory type of every list against its registrations."""

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        kind = akv.backends.mem_type(tensors)[0]  # the type akv names this memory by
        for t in tensors:
            start = int(t.data_ptr())
            REGIONS.setdefault(self.name, []).append((start, start + t.numel() * t.element_size(), kind))
        super().register(tensors)

    def register_host(self, array: npt.NDArray[Any]) -> None:
        start = int(array.ctypes.data)
        REGIONS.setdefault(self.name, []).append((start, start + int(array.nbytes), "DRAM"))
        super().register_host(array)

    def _check(self, what: str, agent: str, rows: npt.NDArray[np.int64], declared: str) -> None:
        owner = agent or self.name
        regions = REGIONS.get(owner, [])
        for addr, length, _dev in rows.tolist():
            kinds = {k for lo, hi, k in regions if lo <= addr and addr + length <= hi}
            if not kinds:
                VIOLATIONS.append(f"{what}: [{addr:#x}, +{length}) is in no region {owner} registered")
            elif declared not in kinds:
                VIOLATIONS.append(f"{what}: {owner}'s {sorted(kinds)} memory prepared as {declared}")
        CHECKED[what] = CHECKED.get(what, 0) + len(rows)

    def prep(self, agent: str, table: npt.NDArray[np.int64], mem_type: str) -> DlistHandle:
        self._check("prep", agent, expand_table(table), mem_type)
        return super().prep(agent, table, "DRAM")  # what the memory really is on this machine

    def prep_expanded(self, agent: str, table: npt.NDArray[np.int64], mem_type: str) -> DlistHandle:
        self._check("prep_expanded", agent, expand_table(table), mem_type)
        return super().prep_expanded(agent, table, "DRAM")

    def read_descs(
        self,
        agent: str,
        local: npt.NDArray[np.int64],
        local_mem: str,
        remote: npt.NDArray[np.int64],
        remote_mem: str,
        notif: bytes,
    ) -> XferHandle:
        self._check("read_descs", "", np.asarray(local, dtype=np.int64), local_mem)
        self._check("read_descs", agent, np.asarray(remote, dtype=np.int64), remote_mem)
        return super().read_descs(agent, local, "DRAM", remote, "DRAM", notif)


def typed(tag: str) -> TypedBackend:
    return TypedBackend(f"typed-{tag}-{os.getpid()}")


SPEC = make_spec(kv_heads=4)


@pytest.mark.usefixtures("labelled")
async def test_bench_methods_prepare_lists_of_the_memory_they_describe() -> None:
    """The bench's akv, hand-written NIXL and per-block methods prepare every list (theirs and
    the library's) with the type of the memory it describes, and move the bytes."""
    req = make_requests(SPEC, 1, 3, seed=5)[0]
    async with (
        prefill_engine(SPEC, 1, backend=typed("bench-p0")) as engine,
        AsyncExitStack() as stack,
    ):
        engine.expose_requests([req])
        c = await stack.enter_async_context(
            akv.Consumer(
                akv.allocate_kv_cache(SPEC, 0, 1),
                SPEC,
                tp_rank=0,
                tp_size=1,
                same_process="nixl",
                backend=typed("bench-d0"),
            )
        )
        s = await c.connect(engine.endpoint)
        local = local_ids(SPEC, 0, req.num_tokens)
        sample = (req.request_id, np.asarray(local, np.int32), np.asarray(req.block_ids, np.int32))
        methods = Methods([s], [c], SPEC, SPEC, sample, Figures("typed"))
        methods.drive = [p.backend.raw for p in engine.producers]  # the prefill agent is ours too
        for method in ("akv", "nixl", "perblock"):
            moved, _ = await methods.run(method, [sample], record=False)
            assert moved > 0, method
    assert CHECKED.get("prep_expanded", 0) > 0 and CHECKED.get("prep", 0) > 0
    assert VIOLATIONS == []


@pytest.mark.usefixtures("labelled")
@pytest.mark.parametrize(
    ("consumer_kw", "prefill_kw", "path"),
    [
        pytest.param({}, {}, "read", id="direct"),
        pytest.param({"transfer": "packed"}, {"transfer": "packed"}, "packed", id="packed"),
        pytest.param({"mode": "push"}, {}, "push", id="push"),
    ],
)
async def test_pulls_prepare_lists_of_the_memory_they_describe(
    consumer_kw: dict[str, Any], prefill_kw: dict[str, Any], path: str
) -> None:
    """Direct, packed and pushed pulls 1 -> 2 (head-sliced) prepare or post every list on both
    sides with the type of the memory it describes, and land bit-exact."""
    results, _ = await pull_every_request(
        SPEC,
        SPEC,
        1,
        2,
        lambda r: akv.Consumer(
            akv.allocate_kv_cache(SPEC, r, 2),
            SPEC,
            tp_rank=r,
            tp_size=2,
            same_process="nixl",
            backend=typed(f"pull-d{r}"),
            **consumer_kw,
        ),
        requests=2,
        seed=3,
        backend=typed("pull-p0"),
        **prefill_kw,
    )
    assert {r.path for r in results} == {path}
    assert sum(CHECKED.values()) > 0
    assert VIOLATIONS == []
