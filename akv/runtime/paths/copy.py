"""The copy path: the prefill ranks a pull reads from live in this process, so torch copies
the bytes on the tensors' device (never NIXL loopback, which CUDA IPC refuses within one
process).

The plan's tables are the same as the read path's: each row is one run of ``len`` bytes at
``addr + block * stride``, and a request's descriptor indices name (row, block) pairs on both
sides. In DRAM the runs (neighbours contiguous on both sides merged) are memory moves made
by one worker thread per session, off the event loop. On CUDA every run of the request, from
every prefill rank, row and layer, is copied by one Triton kernel launch (`akv.kernels`):
the rows of each read op's part are a template kept on the device (built on first use), and
a pull uploads only two integers per chunk it reads, so the host's work per pull grows with
the blocks, not with layers or heads (``copy_with="torch"`` forces that path on CPU tensors,
the kernel then running under Triton's interpreter when ``TRITON_INTERPRET=1`` is set).
Without Triton, or across devices, consecutive indices sharing a row pair become one
gather/scatter over a strided view of the region (``[blocks, len]``, in the widest integer
type that the run's offsets allow), or a few slice copies when the blocks are consecutive on
both sides. The copies run on a side stream (ordered after the work already queued on the
device's current stream) and the pull completes when an event recorded after them has
fired: no host synchronization on the pull's path. The exposure check then reads the
prefill rank's table directly, with the same rule as a read: success only if the blocks
were still exposed for the request once the bytes were in place.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import itertools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from akv import exposure, kernels
from akv.errors import TransferError
from akv.kernels import RunCopier, Segment, Template, merge_runs, split_rows
from akv.runtime.paths import Failed, OpBase, Outcome, PathName, Pending
from akv.runtime.paths.tables import unsafe

if TYPE_CHECKING:
    import torch

    from akv.plan import IndexArray, Prepared, ReadOp, TableKey
    from akv.runtime.local import LocalRank

__all__ = ["CopyPlan", "LocalCopy"]

#: DRAM requests up to this many bytes are copied on the event loop's thread at launch (a
#: worker thread would pay for handing the GIL back and forth with the poller); larger ones
#: in the session's copy worker, so the event loop never stalls long.
INLINE_BYTES = 128 << 20

#: Consecutive-block runs up to which a row pair is copied by slices rather than by index.
MAX_SLICES = 8

#: Longest run one row of the copy kernel's templates moves (longer rows are cut, so that
#: every program of the kernel has about as much to copy).
ROW_BYTES = 1 << 16


@dataclass(frozen=True, slots=True)
class _Rows:
    """One strided table, per row: address of block 0, region, offset in it, run bytes, block
    stride, block count, and the descriptor index of its block 0."""

    tensors: tuple[Any, ...]  # the side's regions
    addr: npt.NDArray[np.int64]
    region: npt.NDArray[np.int64]
    offset: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]
    stride: npt.NDArray[np.int64]
    count: npt.NDArray[np.int64]
    start: npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class _Piece:
    """The rows of one read op's part (one pattern) that share their block strides, as one
    template of the copy kernel: chunk ``c`` of the request moves every template row from
    ``c * src_stride`` past the row's source address to ``c * dst_stride`` past its
    destination; ``*_room``: chunks every row holds (larger ids lie outside a row)."""

    template: Template
    dst_stride: int
    src_stride: int
    dst_room: int
    src_room: int


#: (destination, source, length) of byte runs
_Runs = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]


def _rows(table: npt.NDArray[np.int64], tensors: Sequence[torch.Tensor]) -> _Rows:
    bases = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    sizes = np.array([t.numel() * t.element_size() for t in tensors], dtype=np.int64)
    order = np.argsort(bases)
    addr = table[:, 0]
    pos = np.searchsorted(bases[order], addr, side="right") - 1
    region = order[np.clip(pos, 0, None)]
    offset = addr - bases[region]
    count = table[:, 4]
    end = offset + (count - 1) * table[:, 3] + table[:, 1]
    if (pos < 0).any() or (offset < 0).any() or (end > sizes[region]).any():
        raise TransferError("a copy run lies outside the registered regions (the plan and tensors disagree)")
    start = np.zeros(len(table), dtype=np.int64)
    np.cumsum(count[:-1], out=start[1:])
    return _Rows(
        tuple(tensors),
        addr.copy(),
        region,
        offset,
        table[:, 1].copy(),
        table[:, 3].copy(),
        count.copy(),
        start,
    )


class CopyPlan:
    """A session's copy plan for the prefill ranks of this process: row maps of the plan's
    tables and byte views of both sides' regions, built once per transfer plan."""

    def __init__(
        self,
        tables: Mapping[TableKey, npt.NDArray[np.int64]],
        local: Sequence[torch.Tensor],
        remote: Mapping[int, LocalRank],
        inline_bytes: int = INLINE_BYTES,
        engine: str = "auto",
    ) -> None:
        self.remote = dict(remote)
        self.inline_bytes = inline_bytes
        self.rows: dict[TableKey, _Rows] = {}
        for key, table in tables.items():
            if key[0] == "local":
                self.rows[key] = _rows(table, local)
            elif int(key[1]) in self.remote:  # type: ignore[call-overload]
                self.rows[key] = _rows(table, self.remote[int(key[1])].tensors)  # type: ignore[call-overload]
        self._views: dict[tuple[int, int], Any] = {}
        self._streams: dict[Any, Any] = {}
        devices = {t.device for t in local} | {t.device for r in self.remote.values() for t in r.tensors}
        self._cpu = engine != "torch" and all(d.type == "cpu" for d in devices)
        self._kernel: RunCopier | None = None  # one kernel launch per request, on one device
        #: per read op part (its local and remote block-0 columns): the kernel's templates
        self._pieces: dict[tuple[int, int], tuple[Any, Any, list[_Piece]]] = {}
        if not self._cpu and len(devices) == 1:
            device = next(iter(devices))
            if kernels.mode(device.type, engine) == "kernel":
                self._kernel = RunCopier(device)
        self._worker: ThreadPoolExecutor | None = None

    def covers(self, ranks: Sequence[int] | set[int]) -> bool:
        """True if every one of ``ranks`` lives in this process."""
        return all(r in self.remote for r in ranks)

    def launch(
        self, prepared: Prepared, request_id: str, notify: Sequence[int], *, check: bool, generation: int = 0
    ) -> LocalCopy | Failed:
        """Copy a prepared request's runs (on CUDA: queue them); the op completes the pull."""
        import torch

        ranks = sorted({op.remote_rank for op, _, _ in prepared.posts})
        checks = [(r, self.remote[r]) for r in ranks] if check else None
        if self._cpu:
            runs = self._request_runs(prepared, request_id)
            if isinstance(runs, Failed):
                return runs
            if prepared.bytes <= self.inline_bytes:  # no thread hop, no GIL ping-pong with the poller
                _memmove_runs(runs, None)
                return LocalCopy([], None, checks, request_id, prepared, tuple(notify), generation)
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="akv-copy")
            job = self._worker.submit(_memmove_runs, runs, (self.rows, self.remote))
            return LocalCopy([], job, checks, request_id, prepared, tuple(notify), generation)
        if self._kernel is not None:
            return self._launch_kernel(prepared, request_id, notify, checks, generation)
        try:  # everything is checked and viewed before the first copy is queued
            work = [
                item
                for op, li, ri in prepared.posts
                for item in self._segments(self.rows[op.local_table], self.rows[op.remote_table], li, ri)
            ]
        except (RuntimeError, ValueError, IndexError) as exc:
            return Failed(TransferError(f"copying request {request_id!r} failed: {exc}"))
        streams: set[Any] = set()
        try:
            for dst, src, lblk, rblk in work:
                streams |= self._queue(dst, src, lblk, rblk)
            events = []
            for stream in streams:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events.append(event)
        except RuntimeError as exc:  # e.g. out of memory: wait for what was queued, then fail
            devices = {t.device for dst, src, _, _ in work for t in (dst, src) if t.device.type == "cuda"}
            with contextlib.suppress(RuntimeError):
                for device in devices:
                    torch.cuda.synchronize(device)
            return Failed(TransferError(f"copying request {request_id!r} failed: {exc}"))
        return LocalCopy(events, None, checks, request_id, prepared, tuple(notify), generation)

    def _launch_kernel(
        self,
        prepared: Prepared,
        request_id: str,
        notify: Sequence[int],
        checks: list[tuple[int, LocalRank]] | None,
        generation: int,
    ) -> LocalCopy | Failed:
        """Copy every run of the request with one kernel launch (one table upload); on CUDA on
        the side stream, ordered after the work queued so far, completed by an event."""
        import torch

        copier = self._kernel
        if copier is None:  # pragma: no cover - called only with a kernel
            return Failed(TransferError(f"copying request {request_id!r} failed: no copy kernel"))
        try:
            segments = self._request_segments(prepared)
        except ValueError as exc:
            return Failed(TransferError(f"copying request {request_id!r} failed: {exc}"))
        if not segments:
            return LocalCopy([], None, checks, request_id, prepared, tuple(notify), generation)
        events = []
        try:
            if copier.device.type == "cuda":
                stream = self._stream(copier.device)
                stream.wait_stream(torch.cuda.current_stream(copier.device))
                with torch.cuda.stream(stream):
                    copier.copy_blocks(segments)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(stream)
                events.append(event)
            else:  # Triton's interpreter: done when it returns
                copier.copy_blocks(segments)
        except RuntimeError as exc:
            with contextlib.suppress(RuntimeError):
                if copier.device.type == "cuda":
                    torch.cuda.synchronize(copier.device)
            return Failed(TransferError(f"copying request {request_id!r} failed: {exc}"))
        return LocalCopy(events, None, checks, request_id, prepared, tuple(notify), generation)

    def close(self) -> None:
        """Stop the copy worker once its queued copies are done."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    # -- copying ------------------------------------------------------------------------

    def _request_segments(self, prepared: Prepared) -> list[Segment]:
        """Every run of the request as the copy kernel's segments: per read op, group and
        pattern, templates built once per plan (the rows) and per request two integers per
        chunk; host work that grows with the chunks, not with layers, heads or prefill rows.
        ValueError for chunk ids outside their rows."""
        segments: list[Segment] = []
        for op, _, _ in prepared.posts:
            for part in op.parts:
                ch = prepared.chunks[part.group]
                if not ch.size:
                    continue
                if ch.pattern is None:
                    picks = [(part.lcol[0], part.rcol[0], ch.local, ch.remote)]
                else:
                    picks = [
                        (lb, rb, ch.local[mask], ch.remote[mask])
                        for p, (lb, rb) in enumerate(zip(part.lcol, part.rcol, strict=True))
                        if (mask := ch.pattern == p).any()
                    ]
                for lcol, rcol, local, remote in picks:
                    if min(int(local.min()), int(remote.min())) < 0:
                        raise ValueError("a block id lies outside its table")
                    lmax, rmax = int(local.max()), int(remote.max())
                    l64, r64 = local.astype(np.int64), remote.astype(np.int64)
                    for piece in self._templates(op, lcol, rcol):
                        if lmax >= piece.dst_room or rmax >= piece.src_room:
                            raise ValueError("a block id lies outside its table")
                        segments.append(
                            (piece.template, r64 * piece.src_stride, l64 * piece.dst_stride, 0, 0)
                        )
        return segments

    def _templates(self, op: ReadOp, lcol: IndexArray, rcol: IndexArray) -> list[_Piece]:
        """The kernel's templates of one part of a read op (built on first use; the plan
        keeps ``lcol`` and ``rcol`` for the session's life)."""
        key = (id(lcol), id(rcol))
        hit = self._pieces.get(key)
        if hit is not None and hit[0] is lcol and hit[1] is rcol:
            return hit[2]
        lt, rt = self.rows[op.local_table], self.rows[op.remote_table]
        sides = []
        for rows, col in ((lt, lcol), (rt, rcol)):
            first = np.asarray(col, dtype=np.int64).reshape(-1)
            row = np.searchsorted(rows.start, first, side="right") - 1
            if (row < 0).any():
                raise ValueError("a descriptor index lies outside its table")
            skip = first - rows.start[row]  # chunks of the row before the part's chunk 0
            sides.append(
                (row, rows.addr[row] + skip * rows.stride[row], rows.stride[row], rows.count[row] - skip)
            )
        (lrow, lbase, lstride, lroom), (rrow, rbase, rstride, rroom) = sides
        length = lt.length[lrow]
        if not np.array_equal(length, rt.length[rrow]):
            raise ValueError("run lengths differ between the two sides")
        pieces = []
        for ls, rs in sorted(set(zip(lstride.tolist(), rstride.tolist(), strict=True))):
            m = (lstride == ls) & (rstride == rs)
            b_src, b_dst, n = split_rows(rbase[m], lbase[m], length[m], ROW_BYTES)
            zero = np.zeros(len(n), dtype=np.int64)
            pieces.append(
                _Piece(
                    Template(zero, b_src, zero, b_dst, n), ls, rs, int(lroom[m].min()), int(rroom[m].min())
                )
            )
        self._pieces[key] = (lcol, rcol, pieces)
        return pieces

    def _request_runs(self, prepared: Prepared, request_id: str) -> list[_Runs] | Failed:
        """Every run of the request, per prefill rank read (see `_cpu_runs`), or its failure."""
        try:
            return [
                self._cpu_runs(self.rows[op.local_table], self.rows[op.remote_table], li, ri)
                for op, li, ri in prepared.posts
            ]
        except ValueError as exc:
            return Failed(TransferError(f"copying request {request_id!r} failed: {exc}"))

    @staticmethod
    def _cpu_runs(lt: _Rows, rt: _Rows, li: npt.NDArray[np.int32], ri: npt.NDArray[np.int32]) -> _Runs:
        """(destination, source, length) of every run of one prefill rank's read, neighbours
        contiguous on both sides merged: DRAM copies are plain memory moves."""
        lrow, lblk, rrow, rblk = _locate(lt, rt, li, ri)
        length = lt.length[lrow]
        if not np.array_equal(length, rt.length[rrow]):
            raise ValueError("run lengths differ between the two sides")
        dst = lt.addr[lrow] + lblk * lt.stride[lrow]
        src = rt.addr[rrow] + rblk * rt.stride[rrow]
        return merge_runs(dst, src, length)

    def _segments(
        self, lt: _Rows, rt: _Rows, li: npt.NDArray[np.int32], ri: npt.NDArray[np.int32]
    ) -> list[tuple[Any, Any, npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
        """One prefill rank's read as (destination view, source view, blocks, blocks) per row pair."""
        lrow, lblk, rrow, rblk = _locate(lt, rt, li, ri)
        cut = np.flatnonzero((lrow[1:] != lrow[:-1]) | (rrow[1:] != rrow[:-1])) + 1
        bounds = [0, *cut.tolist(), len(li)]
        out = []
        for s, e in itertools.pairwise(bounds):
            dst, src = self._row_views(lt, int(lrow[s]), rt, int(rrow[s]))
            out.append((dst, src, lblk[s:e], rblk[s:e]))
        return out

    def _view(self, tensor: torch.Tensor, width: int) -> torch.Tensor:
        """A 1-D view of a region's bytes in an integer type of ``width`` bytes."""
        import torch

        key = (id(tensor), width)
        view = self._views.get(key)
        if view is None:
            dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
            view = self._views[key] = tensor.reshape(-1).view(torch.uint8).view(dtype)
        return view

    def _stream(self, device: Any) -> Any:
        """The side stream of a CUDA device (ordered after the work queued so far)."""
        import torch

        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def _row_views(self, lt: _Rows, lrow: int, rt: _Rows, rrow: int) -> tuple[Any, Any]:
        """``[blocks, run]`` views of one row on each side, in the widest integer type that the
        run's offsets, stride and length (and the tensors' own starts) allow."""
        import torch

        length = int(lt.length[lrow])
        if length != int(rt.length[rrow]):
            raise ValueError(f"run lengths differ ({length} and {int(rt.length[rrow])} bytes)")
        dst_t, src_t = lt.tensors[int(lt.region[lrow])], rt.tensors[int(rt.region[rrow])]
        parts = (
            int(lt.offset[lrow]),
            int(rt.offset[rrow]),
            length,
            int(lt.stride[lrow]),
            int(rt.stride[rrow]),
            dst_t.numel() * dst_t.element_size(),
            src_t.numel() * src_t.element_size(),
            dst_t.storage_offset() * dst_t.element_size(),
            src_t.storage_offset() * src_t.element_size(),
        )
        width = next(w for w in (8, 4, 2, 1) if all(p % w == 0 for p in parts))
        views = []
        for rows, row, tensor in ((lt, lrow, dst_t), (rt, rrow, src_t)):
            flat = self._view(tensor, width)
            views.append(
                torch.as_strided(
                    flat,
                    (int(rows.count[row]), length // width),
                    (int(rows.stride[row]) // width, 1),
                    flat.storage_offset() + int(rows.offset[row]) // width,  # from the storage's start
                )
            )
        return views[0], views[1]

    def _queue(
        self, dst: Any, src: Any, lblk: npt.NDArray[np.int64], rblk: npt.NDArray[np.int64]
    ) -> set[Any]:
        """Queue one row pair's copies; returns the CUDA streams used."""
        import torch

        if dst.device == src.device and dst.device.type == "cuda":
            stream = self._stream(dst.device)
            stream.wait_stream(torch.cuda.current_stream(dst.device))
            with torch.cuda.stream(stream):
                _gather_scatter(dst, src, lblk, rblk)
            return {stream}
        _gather_scatter(dst, src, lblk, rblk)  # CPU, or across devices: their current streams
        return {torch.cuda.current_stream(d) for d in {dst.device, src.device} if d.type == "cuda"}


def _locate(
    lt: _Rows, rt: _Rows, li: npt.NDArray[np.int32], ri: npt.NDArray[np.int32]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(row, block) on each side of every descriptor index; ValueError for one outside its table."""
    lrow = np.searchsorted(lt.start, li, side="right") - 1
    rrow = np.searchsorted(rt.start, ri, side="right") - 1
    if (lrow < 0).any() or (rrow < 0).any():
        raise ValueError("a descriptor index lies outside its table")
    lblk = li - lt.start[lrow]
    rblk = ri - rt.start[rrow]
    if (lblk >= lt.count[lrow]).any() or (rblk >= rt.count[rrow]).any():
        raise ValueError("a descriptor index lies outside its table")
    return lrow, lblk, rrow, rblk


def _gather_scatter(
    dst: torch.Tensor, src: torch.Tensor, lblk: npt.NDArray[np.int64], rblk: npt.NDArray[np.int64]
) -> None:
    """``dst[lblk] = src[rblk]``: slice copies for a few consecutive runs, else one gather and
    one scatter."""

    breaks = np.flatnonzero((np.diff(lblk) != 1) | (np.diff(rblk) != 1)) + 1
    if len(breaks) < MAX_SLICES:
        bounds = [0, *breaks.tolist(), len(lblk)]
        for s, e in itertools.pairwise(bounds):
            a, b = int(lblk[s]), int(rblk[s])
            dst[a : a + e - s].copy_(src[b : b + e - s], non_blocking=dst.is_cuda)
        return
    ridx, lidx = (_index(ids, t.device) for ids, t in ((rblk, src), (lblk, dst)))
    # non_blocking only towards a GPU: a GPU-to-CPU copy must be complete before the CPU reads it
    dst.index_copy_(0, lidx, src.index_select(0, ridx).to(dst.device, non_blocking=dst.is_cuda))


def _index(ids: npt.NDArray[np.int64], device: Any) -> Any:
    """Block ids as an index tensor on ``device`` (uploaded from pinned memory, asynchronously)."""
    import torch

    host = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _memmove_runs(
    runs: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]], keep: object
) -> None:
    """Move DRAM runs (in the copy worker; ``keep`` holds the tensors alive meanwhile)."""
    move = ctypes.memmove
    for dst, src, length in runs:
        for d, s, n in zip(dst.tolist(), src.tolist(), length.tolist(), strict=True):
            move(d, s, n)
    del keep


class LocalCopy(OpBase):
    """One pull on the copy path: what is still running (CUDA events recorded after its copies,
    or the DRAM copy worker's job), then the exposure check against the prefill ranks' tables."""

    path: PathName = "copy"

    def __init__(
        self,
        events: list[Any],
        job: concurrent.futures.Future[None] | None,
        checks: list[tuple[int, LocalRank]] | None,
        request_id: str,
        prepared: Prepared,
        notify: tuple[int, ...],
        generation: int = 0,
    ) -> None:
        self.events = events
        self.job = job
        self.checks = checks
        self.request_id = request_id
        self.remote_ids = prepared.remote_ids
        self.read_ids = prepared.read_ids
        self.generation = generation
        self.notify = notify  # every prefill rank to notify: a copy carries no notice

    @property
    def ranks(self) -> frozenset[int]:
        """Empty: ranks of this process are not lost mid-copy."""
        return frozenset()

    def poll(self) -> Outcome:
        """None once the copies are done and the blocks were still exposed."""
        if self.job is not None:
            if not self.job.done():
                return Pending()
            error = self.job.exception()
            self.job = None
            if error is not None:
                return Failed(TransferError(f"copying request {self.request_id!r} failed: {error}"))
        if self.events:
            try:
                if not all(e.query() for e in self.events):
                    return Pending()
            except RuntimeError as exc:  # a CUDA error: this pull fails, the consumer runs on
                self.abort()
                return Failed(TransferError(f"copying request {self.request_id!r} failed: {exc}"))
            self.events = []
        if self.checks:
            h = exposure.request_hash(self.request_id)
            buckets = [(rank, local.table[h % local.buckets].copy()) for rank, local in self.checks]
            error = unsafe(buckets, self.request_id, self.remote_ids, self.read_ids, self.generation)
            if error is not None:
                # Every rank hears the pull is over, unless the request is not exposed (yet, or
                # any more) on one of them: an engine then pulls again once the prefill exposes
                # it, and a notice would release that exposure unread (leases release instead).
                live = all(exposure.live(exposure.shared_slot(exposure.words(b), h)) for _, b in buckets)
                return Failed(error, notify=tuple(r for r, _ in self.checks) if live else ())
        return None

    def abort(self) -> None:
        """Wait for the queued copies: none writes after this returns."""
        if self.job is not None:
            concurrent.futures.wait([self.job])
            self.job = None
        for event in self.events:
            with contextlib.suppress(RuntimeError):  # a CUDA error: nothing more will run
                event.synchronize()
        self.events = []
