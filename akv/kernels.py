"""One copy kernel per request: a table of byte runs ``(destination, source, bytes)`` moved by
one Triton kernel launch, whatever the layers, blocks, groups, prefill ranks or layouts.

The copy path, the prefill's pack and the decode's scatter describe a request's bytes as
runs of raw addresses, derived on the host (numpy) from tables built once per plan or
layout. `RunCopier.copy` then merges neighbours contiguous on both sides, cuts long runs
into pieces of at most `CHUNK` elements, uploads the table once (from pinned memory,
non-blocking, on CUDA) and launches one kernel over it: a constant number of device
operations per request.

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

import os
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = ["CHUNK", "KERNEL_RANGE", "RunCopier", "interpreting", "merge_runs", "mode", "triton_available"]

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

_kernels: dict[bool, Any] = {}
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

    def copy_runs(dst: Any, src: Any, runs: Any, n: Any, ROWS: tl.constexpr, BLOCK: tl.constexpr) -> None:
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

    kernel = _kernels[interpret] = triton.jit(copy_runs)
    return kernel


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


def _dtype(width: int) -> Any:
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]


class RunCopier:
    """Copies tables of byte runs on one device with one kernel launch each (see the module).

    Keeps what a request must not rebuild: the anchors per element width."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._anchors: dict[int, tuple[Any, int]] = {}

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
        with torch.profiler.record_function(KERNEL_RANGE):
            _kernel(interpreting())[grid](anchor, anchor, runs, rows, ROWS=per, BLOCK=block)
        return rows

    def _upload(self, table: npt.NDArray[np.int64], torch: Any) -> Any:
        """The table on the device: one copy from pinned memory (torch's caching host
        allocator keeps the buffer until the copy is done), non-blocking on CUDA."""
        host = torch.from_numpy(table.reshape(-1))
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
