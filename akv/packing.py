"""Packed copies of requests: the staging order, the pool they live in, their directory, and
the torch gathers and scatters between a paged cache and a packed copy.

A prefill rank that packs copies an exposed request's bytes, at ``expose()``, into one
*slot* of a registered pool, in request-major order::

    [group][component][unit][layer][token][run bytes]

(``unit``: the component's units this rank holds; ``token``: every token of the exposed
blocks, in sequence order; a state group has one "token", its slot). Each component's
*section* starts on an `ALIGN` boundary. Any unit range of a component is then one
contiguous run of the section for every decode TP size; after a partial prefix hit (decode
reads a suffix of the tokens) one run per unit and layer. Tokens innermost keep a block's
tokens of one unit and layer together, as per-layer HND caches and head-major ones hold
them: the gathers and scatters then copy whole token runs.

The *directory* is a small registered array, bucketed like the exposure table
(`akv.exposure`), telling a reader where a request's slot is: ``(token, generation, offset,
nbytes)`` per entry, ``token = hash47(request_id) << 16 | 1`` (0: empty). A reader reads its
bucket first, then the runs, then the exposure table's bucket: the slot is freed only after
the request's exposure was retired, so a successful exposure check (bound to the
generation the directory named) proves the slot still held this request's copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from akv import exposure
from akv.errors import ConfigError
from akv.geometry.cache import CacheSpec
from akv.geometry.layout import RankLayout
from akv.kernels import Segment, Template
from akv.shm import OfferedTable

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGN",
    "DIR_WORDS",
    "Arena",
    "CacheViews",
    "PackDirectory",
    "Section",
    "find",
    "find_pending",
    "gather",
    "gather_runs",
    "gather_segment",
    "scatter",
    "scatter_runs",
    "scatter_segment",
    "sections",
]

#: Byte alignment of slots and sections.
ALIGN = 256
#: int64 words per directory entry: token, generation, offset, nbytes.
DIR_WORDS = 4
#: The low bits of a directory row's first word: a published copy (1), a copy being gathered (2).
_PUBLISHED, _PENDING = 1, 2


@dataclass(frozen=True, slots=True)
class Section:
    """One component of one group in a packed copy: ``[units][layers][tokens][run]`` bytes
    from ``offset`` (relative to the slot's start)."""

    group: int
    component: int
    offset: int
    units: range  # the global units the packing rank holds
    tokens: int
    layers: int
    run: int

    @property
    def unit_bytes(self) -> int:
        """Bytes of one unit (every token, every layer)."""
        return self.tokens * self.layers * self.run

    @property
    def nbytes(self) -> int:
        """Bytes of the section."""
        return len(self.units) * self.unit_bytes


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def sections(cache: CacheSpec, rank: int, tp_size: int, counts: Sequence[int]) -> tuple[list[Section], int]:
    """The sections of a packed copy on ``rank`` of ``tp_size`` for a request exposing
    ``counts[g]`` blocks of group ``g``, and the slot's size in bytes."""
    out: list[Section] = []
    offset = 0
    for gi, g in enumerate(cache.groups):
        m = counts[gi]
        if not m:
            continue
        tokens = m * g.block_size if g.tokens else m
        for ci, c in enumerate(g.components):
            s = Section(
                gi, ci, offset, c.held(rank, tp_size), tokens, len(g.layers), c.unit_elems * g.element_size
            )
            out.append(s)
            offset = _align(offset + s.nbytes)
    return out, offset


def _width(*parts: int) -> int:
    return next(w for w in (8, 4, 2, 1) if all(p % w == 0 for p in parts))


def _dtype(width: int) -> Any:
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]


class CacheViews:
    """Strided views of one rank's paged regions, per (group, component): a list of
    ``(first layer, layers, view)`` with view shape ``[blocks, tokens, layers, units, run/w]``
    in the widest integer type ``w`` that every offset and stride allows (one view for all
    layers when they share a region, else one per layer)."""

    def __init__(self, tensors: Sequence[torch.Tensor], layout: RankLayout) -> None:
        self.tensors = list(tensors)
        self.layout = layout
        self._views: dict[tuple[int, int], tuple[int, list[tuple[int, int, Any]]]] = {}
        self._host: dict[tuple[int, int], list[tuple[int, int, Any]]] = {}
        self._starts: dict[tuple[int, int], tuple[npt.NDArray[np.int64], int, int]] = {}
        self._templates: dict[tuple[int, ...], tuple[Template, int]] = {}

    def get(self, gi: int, ci: int) -> tuple[int, list[tuple[int, int, Any]]]:
        """``(width, views)`` of component ``ci`` of group ``gi``."""
        hit = self._views.get((gi, ci))
        if hit is None:
            hit = self._views[(gi, ci)] = self._build(gi, ci)
        return hit

    def host(self, gi: int, ci: int) -> list[tuple[int, int, npt.NDArray[Any]]]:
        """The views of `get` as numpy arrays (DRAM caches only)."""
        hit = self._host.get((gi, ci))
        if hit is None:
            hit = self._host[(gi, ci)] = [(l0, lk, v.numpy()) for l0, lk, v in self.get(gi, ci)[1]]
        return hit

    def starts(self, gi: int, ci: int) -> tuple[npt.NDArray[np.int64], int, int]:
        """``(addr, block, run)`` of component ``ci`` of group ``gi``: ``addr[u, l, t]`` the
        address of held unit ``u``'s run of layer ``l`` and token ``t`` in block 0, ``block``
        the block stride, ``run`` the bytes of one run (built once: the table a copy kernel's
        runs are derived from)."""
        hit = self._starts.get((gi, ci))
        if hit is None:
            gl = self.layout.groups[gi]
            g, p = gl.group, gl.placements[ci]
            nl = len(g.layers)
            bs = g.block_size if g.tokens else 1
            bases = np.array([int(self.tensors[p.regions[i]].data_ptr()) for i in range(nl)], dtype=np.int64)
            layer = bases + p.offset + np.arange(nl, dtype=np.int64) * p.layer
            unit = np.arange(len(p.units), dtype=np.int64) * p.unit
            token = np.arange(bs, dtype=np.int64) * p.token
            addr = unit[:, None, None] + layer[None, :, None] + token[None, None, :]
            hit = self._starts[(gi, ci)] = (addr, p.block, p.run)
        return hit

    def gather_template(self, gi: int, ci: int) -> tuple[Template, int]:
        """The runs of one block of component ``ci`` of group ``gi`` into a packed copy, and
        the bytes a block takes there per unit and layer (built once; see `gather_segment`)."""
        hit = self._templates.get((0, gi, ci))
        if hit is None:
            addr, _, run = self.starts(gi, ci)
            if addr.shape[2] > 1 and int(addr[0, 0, 1] - addr[0, 0, 0]) == run:  # a block's tokens: one run
                addr, run = addr[:, :, :1], run * addr.shape[2]
            units, layers, tokens = addr.shape
            t = Template(
                np.zeros(addr.size, dtype=np.int64),
                addr.reshape(-1),
                np.repeat(np.arange(units * layers, dtype=np.int64), tokens),
                np.tile(np.arange(tokens, dtype=np.int64) * run, units * layers),
                np.full(addr.size, run, dtype=np.int64),
            )
            hit = self._templates[(0, gi, ci)] = (t, tokens * run)
        return hit

    def scatter_template(self, gi: int, ci: int, u0: int, units: int, tokens: int) -> Template:
        """The runs of ``tokens`` tokens (1, or a whole block when its tokens are one run) of
        held units ``u0 .. u0 + units`` of component ``ci`` of group ``gi`` out of staged
        bytes (built once; see `scatter_segment`)."""
        hit = self._templates.get((1, gi, ci, u0, units, tokens))
        if hit is None:
            addr, _, run = self.starts(gi, ci)
            held = addr[u0 : u0 + units, :, 0].reshape(-1)
            t = Template(
                np.arange(len(held), dtype=np.int64),
                np.zeros(len(held), dtype=np.int64),
                np.zeros(len(held), dtype=np.int64),
                held,
                np.full(len(held), run * tokens, dtype=np.int64),
            )
            hit = self._templates[(1, gi, ci, u0, units, tokens)] = (t, 0)
        return hit[0]

    def _build(self, gi: int, ci: int) -> tuple[int, list[tuple[int, int, Any]]]:
        import torch

        gl = self.layout.groups[gi]
        g, p = gl.group, gl.placements[ci]
        nl = len(g.layers)
        bs = g.block_size if g.tokens else 1
        tensors = [self.tensors[r] for r in set(p.regions)]
        w = _width(
            p.offset,
            p.block,
            p.layer,
            p.unit,
            p.token,
            p.run,
            *(int(t.storage_offset()) * t.element_size() for t in tensors),
            *(int(t.numel()) * t.element_size() for t in tensors),
        )
        dtype = _dtype(w)
        shared = len(set(p.regions)) == 1 and (nl == 1 or p.layer != 0)
        spans = [(0, nl)] if shared else [(i, 1) for i in range(nl)]
        views = []
        for l0, lk in spans:
            tensor = self.tensors[p.regions[l0]]
            flat = tensor.reshape(-1).view(torch.uint8).view(dtype)
            views.append(
                (
                    l0,
                    lk,
                    torch.as_strided(
                        flat,
                        (g.num_blocks, bs, lk, len(p.units), p.run // w),
                        (p.block // w, p.token // w, p.layer // w, p.unit // w, 1),
                        flat.storage_offset() + (p.offset + l0 * p.layer) // w,
                    ),
                )
            )
        return w, views


def _index(ids: npt.NDArray[Any], device: Any) -> Any:
    import torch

    host = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    return host if device.type != "cuda" else host.to(device, non_blocking=False)


Runs = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]


def gather_runs(
    views: CacheViews, section: Section, block_ids: npt.NDArray[np.int32], slot_addr: int
) -> Runs:
    """`gather` as ``(destination, source, bytes)`` runs of raw addresses (for
    `akv.kernels.RunCopier`), ``slot_addr`` the slot's first byte."""
    addr, block, run = views.starts(section.group, section.component)
    if addr.shape[2] > 1 and int(addr[0, 0, 1] - addr[0, 0, 0]) == run:  # a block's tokens: one run
        addr, run = addr[:, :, :1], run * addr.shape[2]
    src = addr[:, :, None, :] + (np.asarray(block_ids, dtype=np.int64) * block)[None, None, :, None]
    src = src.reshape(-1)
    dst = slot_addr + section.offset + np.arange(len(src), dtype=np.int64) * run
    return dst, src, np.full(len(src), run, dtype=np.int64)


def scatter_runs(
    views: CacheViews,
    gi: int,
    ci: int,
    local_units: range,
    staged_addr: int,
    blocks: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
) -> Runs:
    """`scatter` as ``(destination, source, bytes)`` runs of raw addresses (for
    `akv.kernels.RunCopier`), ``staged_addr`` the staged bytes' first byte."""
    addr, block, run = views.starts(gi, ci)
    u0 = local_units.start - views.layout.groups[gi].placements[ci].units.start
    held = addr[u0 : u0 + len(local_units)]  # [units, layers, tokens of a block]
    dst = held[:, :, positions] + (blocks * block)[None, None, :]
    dst = dst.reshape(-1)
    src = staged_addr + np.arange(len(dst), dtype=np.int64) * run
    return dst, src, np.full(len(dst), run, dtype=np.int64)


def gather_segment(
    views: CacheViews, section: Section, block_ids: npt.NDArray[np.int32], slot_addr: int
) -> Segment:
    """`gather` as a `akv.kernels.Segment`: the section's template (built once) and one base
    pair per block (the runs of `gather_runs`, in the same order)."""
    template, per_block = views.gather_template(section.group, section.component)
    _, block, _ = views.starts(section.group, section.component)
    ids = np.asarray(block_ids, dtype=np.int64)
    dst = slot_addr + section.offset + np.arange(len(ids), dtype=np.int64) * per_block
    return template, ids * block, dst, 0, len(ids) * per_block


def scatter_segment(
    views: CacheViews,
    gi: int,
    ci: int,
    local_units: range,
    staged_addr: int,
    blocks: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
) -> Segment:
    """`scatter` as a `akv.kernels.Segment`: a template of the held units' runs (built once)
    and one base pair per token, or per block for whole blocks whose tokens are one run."""
    addr, block, run = views.starts(gi, ci)
    bs = addr.shape[2]
    token = int(addr[0, 0, 1] - addr[0, 0, 0]) if bs > 1 else 0
    u0 = local_units.start - views.layout.groups[gi].placements[ci].units.start
    n = len(blocks)
    blocks = np.asarray(blocks, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    whole = (
        bs > 1
        and token == run
        and n % bs == 0
        and bool((positions.reshape(-1, bs) == np.arange(bs)).all())
        and bool((blocks.reshape(-1, bs) == blocks[::bs, None]).all())
    )
    tokens = bs if whole else 1
    template = views.scatter_template(gi, ci, u0, len(local_units), tokens)
    dst = blocks[::bs] * block if whole else blocks * block + positions * token
    src = staged_addr + np.arange(len(dst), dtype=np.int64) * (run * tokens)
    return template, src, dst, n * run, 0


def gather(views: CacheViews, section: Section, block_ids: npt.NDArray[np.int32], slot: Any) -> None:
    """Copy ``block_ids`` (the group's exposed blocks, in order) of one component into its
    section of ``slot`` (a uint8 tensor of the slot's bytes)."""
    w, spans = views.get(section.group, section.component)
    g = views.layout.groups[section.group].group
    bs = g.block_size if g.tokens else 1
    out = slot[section.offset : section.offset + section.nbytes].view(_dtype(w))
    units, m = len(section.units), len(block_ids)
    out = out.view(units, section.layers, m, bs, section.run // w)
    idx = _index(block_ids, out.device)
    for l0, lk, view in spans:  # [m, bs, lk, U, r] gathered, written unit-major
        out[:, l0 : l0 + lk].permute(2, 3, 1, 0, 4).copy_(view.index_select(0, idx))


def scatter(
    views: CacheViews,
    gi: int,
    ci: int,
    local_units: range,
    staged: Any,
    blocks: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
    torch_ops: bool | None = None,
) -> None:
    """Write ``staged`` (uint8 bytes ``[units][layers][tokens][run]``) into the paged cache:
    token ``k`` goes to block ``blocks[k]``, position ``positions[k]``; ``local_units`` are
    global units this rank holds.

    ``torch_ops`` None: numpy fancy-index assignments on DRAM (views built once; 2-2.5x
    torch's index copies on these transposes: 11.3 against 4.6 GB/s on NHD,
    ``akv bench --only scatter``), torch index copies on CUDA (on the current stream); True or
    False picks torch or numpy (numpy needs DRAM)."""
    w, spans = views.get(gi, ci)
    gl = views.layout.groups[gi]
    p = gl.placements[ci]
    units, nl, rw = len(local_units), len(gl.group.layers), p.run // w
    src = staged.view(_dtype(w)).view(units, nl, len(blocks), rw)
    u0, u1 = local_units.start - p.units.start, local_units.stop - p.units.start
    bs = gl.group.block_size if gl.group.tokens else 1
    whole = (
        len(blocks) % bs == 0
        and bool((positions.reshape(-1, bs) == np.arange(bs)).all())
        and bool((blocks.reshape(-1, bs) == blocks[::bs, None]).all())
    )
    if not (staged.is_cuda if torch_ops is None else torch_ops):  # one assignment per span
        host = src.numpy()
        if whole:
            bl = blocks[::bs]
            values = host.reshape(units, nl, len(bl), bs, rw).transpose(2, 3, 1, 0, 4)
            for l0, lk, view in views.host(gi, ci):
                view[bl, :, :, u0:u1] = values[:, :, l0 : l0 + lk]
        else:
            values = host.transpose(2, 1, 0, 3)
            for l0, lk, view in views.host(gi, ci):
                view[blocks, positions, :, u0:u1] = values[:, l0 : l0 + lk]
        return
    device = staged.device
    if whole:  # whole blocks: one index copy along the block axis per span
        bi = _index(blocks[::bs], device)
        for l0, lk, view in spans:
            values = src[:, l0 : l0 + lk].reshape(units, lk, len(bi), bs, rw).permute(2, 3, 1, 0, 4)
            view[:, :, :, u0:u1].index_copy_(0, bi, values)
        return
    bi, pi = _index(blocks, device), _index(positions, device)
    for l0, lk, view in spans:
        view[:, :, :, u0:u1].index_put_((bi, pi), src[:, l0 : l0 + lk].permute(2, 1, 0, 3))


class Arena:
    """A first-fit allocator of `ALIGN`-aligned byte ranges in ``[0, size)``."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ConfigError(f"a pool size must be >= 0 bytes, got {size}")
        self.size = size - size % ALIGN
        self._free: list[tuple[int, int]] = [(0, self.size)] if self.size else []
        self._used: dict[int, int] = {}

    @property
    def used(self) -> int:
        """Bytes allocated."""
        return sum(self._used.values())

    @property
    def allocations(self) -> int:
        """Ranges allocated and not freed."""
        return len(self._used)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free range of ``nbytes`` (rounded up to `ALIGN`), or None if none is."""
        n = _align(max(nbytes, 1))
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                self._used[start] = n
                return start
        return None

    def free(self, offset: int) -> None:
        """Return a range (exactly once: a second free of one offset raises ConfigError)."""
        n = self._used.pop(offset, None)
        if n is None:
            raise ConfigError(f"pool range at {offset} is not allocated")
        self._free.append((offset, n))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged


class PackDirectory(OfferedTable):
    """Where each packed request's slot is (the array is registered with NIXL). ``shared``:
    kept in shared memory that decode ranks on this host may map (`akv.shm`, as the exposure
    table: they then copy a bucket instead of READing it; Linux only)."""

    def __init__(self, buckets: int, *, shared: bool = False) -> None:
        if buckets < 1:
            raise ConfigError(f"directory buckets must be >= 1, got {buckets}")
        self.buckets = buckets
        super().__init__((buckets, exposure.SLOTS, DIR_WORDS), shared=shared, name="akv-directory")

    def publish(self, request_id: str, generation: int, offset: int, nbytes: int) -> bool:
        """Record a packed copy; False if the request's bucket is full (the request is not packed)."""
        return self._write(request_id, _PUBLISHED, generation, offset, nbytes)

    def mark_pending(self, request_id: str) -> bool:
        """Record that a request's packed copy is being gathered (on the device): readers
        that find the mark wait for the copy a little instead of reading the paged blocks
        (`find_pending`). False if the request's bucket is full (readers then find nothing
        and read directly). Decoders that predate the mark ignore it."""
        return self._write(request_id, _PENDING, 0, 0, 0)

    def _write(self, request_id: str, state: int, generation: int, offset: int, nbytes: int) -> bool:
        """Write the request's row (its own, or a free one of its bucket): the first word last,
        so that a reader never takes a half-written row for the request's."""
        h = exposure.request_hash(request_id)
        rows = self.array[h % self.buckets]
        free = np.flatnonzero(((rows[:, 0] >> 16) == h) | (rows[:, 0] == 0))
        if not free.size:
            return False
        row = rows[free[0]]
        row[0] = 0
        row[1], row[2], row[3] = generation, offset, nbytes
        row[0] = h << 16 | state
        return True

    def retire(self, request_id: str) -> None:
        """Forget a request's packed copy or its pending mark (before its slot is freed)."""
        h = exposure.request_hash(request_id)
        rows = self.array[h % self.buckets]
        rows[(rows[:, 0] >> 16) == h] = 0


def find_pending(bucket: npt.NDArray[np.int64], request_id: str) -> bool:
    """True if a directory bucket read from a prefill rank says the request's packed copy is
    being gathered (`PackDirectory.mark_pending`)."""
    rows = np.asarray(bucket, dtype=np.int64).reshape(exposure.SLOTS, DIR_WORDS)
    return bool((rows[:, 0] == (exposure.request_hash(request_id) << 16 | _PENDING)).any())


def find(bucket: npt.NDArray[np.int64], request_id: str) -> tuple[int, int, int] | None:
    """``(generation, offset, nbytes)`` of a request's packed copy in a directory bucket read
    from a prefill rank, or None if it has none."""
    rows = np.asarray(bucket, dtype=np.int64).reshape(exposure.SLOTS, DIR_WORDS)
    mine = rows[rows[:, 0] == (exposure.request_hash(request_id) << 16 | _PUBLISHED)]
    if not mine.size:
        return None
    return int(mine[0, 1]), int(mine[0, 2]), int(mine[0, 3])
