"""One copy kernel per request: a table of byte runs ``(destination, source, bytes)`` moved by
one Triton kernel launch, whatever the layers, blocks, groups, prefill ranks or layouts.

Two forms. `RunCopier.copy` takes any table of runs of raw addresses: it merges neighbours
contiguous on both sides, cuts long runs into pieces of at most `CHUNK` elements, uploads the
table once (from pinned memory, non-blocking, on CUDA) and launches one kernel over it.

The copy path, the prefill's pack and the decode's scatter use the second,
`RunCopier.copy_blocks`: per section (the pack's and the scatter's group and component, the
copy path's read op part) a *template* of the runs of one block (or token), built once and
kept on the device, and per request only one base address pair per block (or token) and six
integers per section. The kernel derives every run from them, so the host's work and the
bytes uploaded per request grow with the blocks, not with layers x units x tokens (a
128-block NHD request of 32 layers: 524,288 runs, which the host used to derive and upload).

Addresses are taken relative to a small *anchor* tensor of the element type (the widest of
8, 4, 2, 1 bytes that every address and length allows), so the kernel reads and writes any
region of the device's address space, as vLLM's block-copy kernels do with a table of layer
pointers.

Which way a request's bytes move (`mode`):

- CUDA tensors: the Triton kernel when ``triton`` imports, else the caller's torch fallback
  (one gather/scatter per table row, the code path of akv before the kernel).
- CPU tensors with ``copy_with="torch"`` (the path CUDA tensors take, forced for counts and
  tests): the same Triton kernel under Triton's interpreter when ``TRITON_INTERPRET=1`` is
  set and ``triton`` imports, else the torch fallback.
- CPU tensors with ``copy_with="auto"``: memory moves (numpy or ``memmove``), never the
  kernel: faster on DRAM.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "CHUNK",
    "KERNEL_RANGE",
    "RunCopier",
    "Segment",
    "Template",
    "expand",
    "interpreting",
    "merge_runs",
    "mode",
    "split_rows",
    "triton_available",
]

#: Longest piece (in elements of the table's width) one kernel row copies.
CHUNK = 1 << 14
#: The profiler range around a launch (what Triton's interpreter runs inside it emulates the
#: device: one launch on a GPU).
KERNEL_RANGE = "akv::copy_runs"
#: Elements one kernel program moves per step: ``rows x block``, ``block`` the power of two
#: covering the longest row (at most `_BLOCK`), ``rows`` the rest.
_TILE = 4096
_BLOCK = 1024

Mode = Literal["kernel", "torch", "host"]

_kernels: dict[Any, Any] = {}
_available: bool | None = None


def triton_available() -> bool:
    """True if ``triton`` imports (it comes with every CUDA build of torch)."""
    global _available
    if _available is None:
        try:
            import triton
            import triton.language  # noqa: F401
        except Exception:
            _available = False
        else:
            _available = True
    return _available


def interpreting() -> bool:
    """True if ``TRITON_INTERPRET=1`` is set: Triton kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def mode(device_type: str, copy_with: str) -> Mode:
    """How bytes on a ``device_type`` device move with ``copy_with`` ("auto" or "torch"):
    ``"kernel"`` (one Triton launch per request), ``"torch"`` (torch ops per table row) or
    ``"host"`` (memory moves, DRAM only)."""
    if device_type == "cpu" and copy_with != "torch":
        return "host"
    if not triton_available():
        return "torch"
    if (device_type == "cuda") != interpreting():  # the interpreter runs on host memory only
        return "kernel"
    return "torch"


def _kernel(interpret: bool) -> Any:
    """The Triton kernel (built once per interpreter setting: ``triton.jit`` reads
    ``TRITON_INTERPRET`` when it wraps a function)."""
    hit = _kernels.get(interpret)
    if hit is not None:
        return hit
    import triton
    import triton.language as tl

    # no annotations but tl.constexpr: Triton's compiler resolves them (`Any` is no constexpr)
    def copy_runs(dst, src, runs, n, ROWS: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = rows < n
        d = tl.load(runs + rows * 3, mask=live, other=0)
        s = tl.load(runs + rows * 3 + 1, mask=live, other=0)
        k = tl.load(runs + rows * 3 + 2, mask=live, other=0)
        longest = tl.max(k, axis=0)
        for i in range(0, longest, BLOCK):
            at = i + tl.arange(0, BLOCK)
            m = at[None, :] < k[:, None]
            v = tl.load(src + s[:, None] + at[None, :], mask=m)
            tl.store(dst + d[:, None] + at[None, :], v, mask=m)

    kernel = _kernels[interpret] = _jit(triton, copy_runs)
    return kernel


def _block_kernel(interpret: bool) -> Any:
    """The template kernel of `RunCopier.copy_blocks` (built once per interpreter setting)."""
    key = ("blocks", interpret)
    hit = _kernels.get(key)
    if hit is not None:
        return hit
    import triton
    import triton.language as tl

    def copy_blocks(  # type: ignore[no-untyped-def]
        dst,
        src,
        segs,
        bases,
        tmpl,
        n_segs,
        segs_per_program,
        tiles_per_program,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # pairs (entry, template row) of a segment, ROWS at a time
        s_lo = tl.program_id(1) * segs_per_program
        s_hi = tl.minimum(s_lo + segs_per_program, n_segs)
        for sg in range(s_lo, s_hi):
            first = tl.load(segs + sg * 6)
            start = tl.load(segs + sg * 6 + 2)
            count = tl.load(segs + sg * 6 + 3)
            k_s = tl.load(segs + sg * 6 + 4)
            k_d = tl.load(segs + sg * 6 + 5)
            q_lo = tl.program_id(0) * tiles_per_program * ROWS
            q_hi = tl.minimum(q_lo + tiles_per_program * ROWS, tl.load(segs + sg * 6 + 1) * count)
            for q0 in range(q_lo, q_hi, ROWS):
                q = q0 + tl.arange(0, ROWS)
                live = q < q_hi
                e = (first + q // count) * 2
                r = (start + q % count) * 5
                s = tl.load(bases + e, mask=live, other=0) + tl.load(tmpl + r, mask=live, other=0) * k_s
                s += tl.load(tmpl + r + 1, mask=live, other=0)
                d = (
                    tl.load(bases + e + 1, mask=live, other=0)
                    + tl.load(tmpl + r + 2, mask=live, other=0) * k_d
                )
                d += tl.load(tmpl + r + 3, mask=live, other=0)
                k = tl.load(tmpl + r + 4, mask=live, other=0)
                longest = tl.max(k, axis=0)
                for i in range(0, longest, BLOCK):
                    at = i + tl.arange(0, BLOCK)
                    m = at[None, :] < k[:, None]
                    v = tl.load(src + s[:, None] + at[None, :], mask=m)
                    tl.store(dst + d[:, None] + at[None, :], v, mask=m)

    kernel = _kernels[key] = _jit(triton, copy_blocks)
    return kernel


def _jit(triton: Any, fn: Any) -> Any:
    """``triton.jit(fn)`` compiled once per constexpr set: no variants by the integers' values
    (Triton specializes an int argument on being 1 or a multiple of 16, which would compile the
    kernel again for requests of other sizes) nor by the pointers' alignment (the offsets are
    known only at run time, so it buys nothing)."""
    names = [n for n in fn.__code__.co_varnames[: fn.__code__.co_argcount] if n not in ("ROWS", "BLOCK")]
    ints = [n for n in names if n not in ("dst", "src", "runs", "segs", "bases", "tmpl")]
    try:
        return triton.jit(fn, do_not_specialize=ints, do_not_specialize_on_alignment=names)
    except TypeError:  # a Triton without do_not_specialize_on_alignment
        return triton.jit(fn, do_not_specialize=ints)


class Template:
    """The runs of one block (or token) of a (group, component), one row each: run ``r`` of
    entry ``j`` of a `Segment` copies ``length[r]`` bytes from ``base_src[j] + a_src[r] * k_src
    + b_src[r]`` to ``base_dst[j] + a_dst[r] * k_dst + b_dst[r]`` (``b_*``: addresses or
    offsets in bytes; ``a_*``: multiples of the segment's ``k_*``)."""

    def __init__(
        self,
        a_src: npt.NDArray[np.int64],
        b_src: npt.NDArray[np.int64],
        a_dst: npt.NDArray[np.int64],
        b_dst: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
    ) -> None:
        rows = np.empty((len(length), 5), dtype=np.int64)
        rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4] = a_src, b_src, a_dst, b_dst, length
        self.rows = rows
        self.width = _widest(rows[:, 1], rows[:, 3], rows[:, 4])
        self.longest = int(rows[:, 4].max()) if len(rows) else 0


def split_rows(
    b_src: npt.NDArray[np.int64], b_dst: npt.NDArray[np.int64], length: npt.NDArray[np.int64], limit: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Template rows (``a_*`` all 0) longer than ``limit`` bytes cut into pieces of at most
    ``limit`` (order kept), so that one kernel program never copies a long run alone while
    the others idle; ``limit`` a multiple of 8."""
    pieces = np.maximum(-(-length // limit), 1)
    if (pieces == 1).all():
        return b_src, b_dst, length
    row = np.repeat(np.arange(len(length)), pieces)
    off = (
        np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    ) * limit
    return b_src[row] + off, b_dst[row] + off, np.minimum(length[row] - off, limit)


#: One section of a request for `RunCopier.copy_blocks`: its template, per entry (block or
#: token) the source and destination bases, and the section's ``k_src`` and ``k_dst`` (bytes).
Segment = tuple[Template, npt.NDArray[np.int64], npt.NDArray[np.int64], int, int]


def expand(segment: Segment) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The ``(destination, source, bytes)`` runs a segment stands for, entry by entry, row by
    row (on the host: what the kernel derives on the device; for checks)."""
    t, bsrc, bdst, k_src, k_dst = segment
    a_s, b_s, a_d, b_d, n = (t.rows[:, i] for i in range(5))
    src = np.asarray(bsrc, dtype=np.int64)[:, None] + (a_s * k_src + b_s)[None, :]
    dst = np.asarray(bdst, dtype=np.int64)[:, None] + (a_d * k_dst + b_d)[None, :]
    return dst.reshape(-1), src.reshape(-1), np.tile(n, len(bsrc))


def _widest(*arrays: Any) -> int:
    """The widest of 8, 4, 2, 1 bytes dividing every value of ``arrays`` (arrays or ints)."""
    bits = 0
    for a in arrays:
        if isinstance(a, (int, np.integer)):
            bits |= int(a)
        elif len(a):
            bits |= int(np.bitwise_or.reduce(np.asarray(a, dtype=np.int64)))
    low = bits & -bits  # the lowest bit set (0: every value is 0)
    return 8 if not low else min(8, low)


def merge_runs(
    dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], length: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Runs with neighbours contiguous on both sides joined (order kept)."""
    if len(dst) < 2:
        return dst, src, length
    joined = np.zeros(len(dst), dtype=bool)
    joined[1:] = (dst[1:] == dst[:-1] + length[:-1]) & (src[1:] == src[:-1] + length[:-1])
    if not joined.any():
        return dst, src, length
    starts = np.flatnonzero(~joined)
    return dst[starts], src[starts], np.add.reduceat(length, starts)


def _launch_range(torch: Any) -> Any:
    """The profiler range around a launch (`KERNEL_RANGE`), only while a profiler records:
    entering one costs about 10 us of host time per launch otherwise."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(KERNEL_RANGE)
    return contextlib.nullcontext()


def _dtype(width: int) -> Any:
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]


class RunCopier:
    """Copies tables of byte runs on one device with one kernel launch each (see the module).

    Keeps what a request must not rebuild: the anchors per element width."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._anchors: dict[int, tuple[Any, int]] = {}
        #: templates on the device: (their ids, width) -> (rows, first row of each, the templates)
        self._templates: dict[tuple[tuple[int, ...], int], tuple[Any, list[int], list[Template]]] = {}

    def _anchor(self, width: int) -> tuple[Any, int]:
        hit = self._anchors.get(width)
        if hit is None:
            import torch

            t = torch.empty(64, dtype=torch.uint8, device=self.device)
            ptr = int(t.data_ptr())
            skip = -ptr % 8
            view = t[skip : skip + 8].view(_dtype(width))
            hit = self._anchors[width] = (view, ptr + skip)
        return hit

    def copy(
        self,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        length: npt.NDArray[np.int64],
    ) -> int:
        """Queue the copy of ``length[i]`` bytes from address ``src[i]`` to ``dst[i]`` for
        every ``i`` (on CUDA: on the current stream; the caller records its event); returns
        the rows of the table launched (0: nothing to copy)."""
        import torch

        dst, src, length = merge_runs(
            np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64), np.asarray(length, np.int64)
        )
        keep = length > 0
        if not keep.all():
            dst, src, length = dst[keep], src[keep], length[keep]
        if not len(dst):
            return 0
        width = 8
        for a in (dst, src, length):
            while width > 1 and (a % width).any():
                width //= 2
        anchor, base = self._anchor(width)
        d, s, n = (dst - base) // width, (src - base) // width, length // width
        pieces = -(-n // CHUNK)
        if (pieces > 1).any():  # long runs cut into pieces of CHUNK elements
            first = np.repeat(np.cumsum(pieces) - pieces, pieces)
            part = np.arange(int(pieces.sum()), dtype=np.int64) - first
            row = np.repeat(np.arange(len(n)), pieces)
            off = part * CHUNK
            d, s, n = d[row] + off, s[row] + off, np.minimum(n[row] - off, CHUNK)
        table = np.empty((len(n), 3), dtype=np.int64)
        table[:, 0], table[:, 1], table[:, 2] = d, s, n
        runs = self._upload(table, torch)
        rows = len(n)
        block = min(_BLOCK, 1 << max(int(n.max()) - 1, 0).bit_length())
        per = _TILE // block
        grid = (-(-rows // per),)
        with _launch_range(torch):
            _kernel(interpreting())[grid](anchor, anchor, runs, rows, ROWS=per, BLOCK=block)
        return rows

    def copy_blocks(self, segments: list[Segment], launch: bool = True) -> int:
        """Queue the copy of every run the ``segments`` describe (see `Template`) with one
        kernel launch: the templates go to the device once (kept for the next request with
        the same ones), per request only two integers per entry (block or token) and six
        per segment. Returns the runs launched (0: nothing to copy); ``launch=False`` stops
        before the upload and the launch (the host's share, for measurements)."""
        import torch

        segments = [seg for seg in segments if len(seg[1]) and len(seg[0].rows)]
        if not segments:
            return 0
        width = min(seg[0].width for seg in segments)
        width = min(width, _widest(*(a for seg in segments for a in (seg[1], seg[2], seg[3], seg[4]))))
        anchor, base = self._anchor(width)
        tmpl, starts = self._on_device([seg[0] for seg in segments], width, torch)
        # per segment: first entry, entries, first template row, rows, k_src, k_dst; per
        # entry: its two bases (in elements from the anchor)
        segs = np.empty((len(segments), 6), dtype=np.int64)
        bases = np.empty((sum(len(seg[1]) for seg in segments), 2), dtype=np.int64)
        at = runs = 0
        for i, ((t, bsrc, bdst, k_src, k_dst), start) in enumerate(zip(segments, starts, strict=True)):
            n = len(bsrc)
            bases[at : at + n, 0] = (np.asarray(bsrc, dtype=np.int64) - base) // width
            bases[at : at + n, 1] = (np.asarray(bdst, dtype=np.int64) - base) // width
            segs[i] = (at, n, start, len(t.rows), k_src // width, k_dst // width)
            at += n
            runs += n * len(t.rows)
        if not launch:
            return runs
        table = self._upload(np.concatenate([segs.reshape(-1), bases.reshape(-1)]), torch)
        longest = max(seg[0].longest for seg in segments) // width
        block = min(_BLOCK, 1 << max(longest - 1, 0).bit_length())
        per = _TILE // block
        tiles = int((-(-(segs[:, 1] * segs[:, 3]) // per)).max())
        if interpreting():  # one program loops over everything: the interpreter pays per program
            grid, segs_per_program, tiles_per_program = (1, 1), len(segs), tiles
        else:  # one program per tile of a segment's (entry, template row) pairs (tiles on the
            # grid's first axis: it takes 2**31 - 1, the others 65,535)
            grid, segs_per_program, tiles_per_program = (tiles, len(segs)), 1, 1
        with _launch_range(torch):
            _block_kernel(interpreting())[grid](
                anchor,
                anchor,
                table,
                table[segs.size :],
                tmpl,
                len(segs),
                segs_per_program,
                tiles_per_program,
                ROWS=per,
                BLOCK=block,
            )
        return runs

    def _on_device(self, templates: list[Template], width: int, torch: Any) -> tuple[Any, list[int]]:
        """The rows of ``templates`` on the device in elements of ``width`` bytes (uploaded
        once per set of templates and width), and the first row of each."""
        key = (tuple(id(t) for t in templates), width)
        hit = self._templates.get(key)
        if hit is None:
            unique: dict[int, Template] = {id(t): t for t in templates}
            first: dict[int, int] = {}
            parts = []
            at = 0
            for tid, t in unique.items():
                rows = t.rows.copy()
                rows[:, 1] //= width
                rows[:, 3] //= width
                rows[:, 4] //= width
                parts.append(rows)
                first[tid] = at
                at += len(rows)
            table = torch.from_numpy(np.concatenate(parts).reshape(-1)).to(self.device)
            hit = self._templates[key] = (table, [first[id(t)] for t in templates], templates)
        return hit[0], hit[1]

    def _upload(self, table: npt.NDArray[np.int64], torch: Any) -> Any:
        """The table on the device: one copy from pinned memory (torch's caching host
        allocator keeps the buffer until the copy is done), non-blocking on CUDA."""
        host = torch.from_numpy(table.reshape(-1))
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
