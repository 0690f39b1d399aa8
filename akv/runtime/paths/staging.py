"""The decode side's staging area for packed pulls, and the scatter out of it.

A packed read (`akv.runtime.paths.packed`) READs the prefill ranks' packed copies into a
range of the `StagingPool`, and a packed push (`akv.runtime.paths.push`) has the writers
WRITE theirs there; either then scatters the staged bytes into the paged cache, whatever its
layout and block size (`akv.packing.scatter`; on CUDA one kernel launch over the pull's runs,
`akv.packing.scatter_segment`, `akv.kernels`), through one `Scatter`: on the poller's thread,
in the pool's worker thread (a large DRAM pull while other packed pulls are in flight), or
queued on the device, done once the event recorded after it fired (no host synchronization).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from akv import kernels
from akv.backends import mem_type
from akv.errors import ConfigError, TransferError
from akv.kernels import RunCopier
from akv.packing import Arena, CacheViews, scatter, scatter_segment
from akv.runtime.paths import Failed, Outcome, Pending

if TYPE_CHECKING:
    import torch

    from akv.pack_layout import Item

__all__ = ["WORKER_BYTES", "Scatter", "StagingPool", "scatter_items"]

#: DRAM pulls of at least this many bytes are scattered in the staging pool's worker thread
#: (numpy releases the GIL while it copies), smaller ones on the poller's thread: the scatter
#: of a 1 GiB request held the event loop 200 ms there (``akv bench --only scale``), one of
#: 8 MiB about 3 ms, less than the hand-off to the worker costs a small pull.
WORKER_BYTES = 8 << 20


class StagingPool:
    """The decode side's registered staging area for packed reads (on the caches' device)."""

    def __init__(self, size: int, like: torch.Tensor, copy_with: str = "auto") -> None:
        import torch

        if size < 256:
            raise ConfigError(f"pack_staging_bytes must be >= 256, got {size}")
        self.arena = Arena(size)
        self.tensor = torch.empty(self.arena.size, dtype=torch.uint8, device=like.device)
        if not self.tensor.is_cuda:  # every page touched now, not by the first pulls' READs
            self.tensor.fill_(0)
        # the type akv registers the staging tensor as (the same rule as the caches')
        self.mem_type, self.device_id = mem_type([self.tensor])
        self._worker: ThreadPoolExecutor | None = None
        #: called from the worker thread when a scatter there is done (the consumer sets it
        #: to wake its poller, which would otherwise sleep until its next tick)
        self.wake: Callable[[], None] = lambda: None
        self.active = 0  # packed pulls started, not finished and not fallen back
        #: scatters: one kernel launch per pull (CUDA, or CPU tensors under Triton's
        #: interpreter with ``copy_with="torch"``), else torch index copies per span
        #: (``copy_with="torch"`` or CUDA without Triton), else numpy (DRAM)
        self.copier = (
            RunCopier(like.device) if kernels.mode(like.device.type, copy_with) == "kernel" else None
        )
        self.torch_ops = True if copy_with == "torch" else None

    @property
    def addr(self) -> int:
        """Address of the staging area's first byte."""
        return int(self.tensor.data_ptr())

    def worker(self) -> ThreadPoolExecutor:
        """The thread that scatters large DRAM pulls while others are in flight (numpy releases
        the GIL while it copies)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="akv-scatter")
        return self._worker

    def close(self) -> None:
        """Stop the worker once its scatters are done."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def scatter_items(staging: StagingPool, views: CacheViews, items: Sequence[Item], base: int) -> float:
    """Scatter every item staged from ``base`` (in the staging area) into the paged cache (on
    CUDA: queue it); returns the seconds it took."""
    started = time.perf_counter()
    copier = staging.copier
    if copier is not None:  # one kernel launch for the whole pull
        addr = staging.addr + base
        copier.copy_blocks(
            [
                scatter_segment(
                    views,
                    item.group,
                    item.component,
                    item.local_units,
                    addr + item.offset,
                    item.blocks,
                    item.positions,
                )
                for item in items
            ]
        )
        return time.perf_counter() - started
    for item in items:
        staged = staging.tensor[base + item.offset : base + item.offset + item.nbytes]
        scatter(
            views,
            item.group,
            item.component,
            item.local_units,
            staged,
            item.blocks,
            item.positions,
            staging.torch_ops,
        )
    return time.perf_counter() - started


class Scatter:
    """One pull's scatter of the items staged from ``base`` into the paged cache, polled to
    its end: run at the first `poll` (``worker``: in the pool's worker thread, where the
    staging is in DRAM and no kernel copies), on CUDA queued and done once the event recorded
    after it fired. ``seconds``: what it took (on CUDA: to queue)."""

    def __init__(
        self, staging: StagingPool, views: CacheViews, items: Sequence[Item], base: int, request_id: str
    ) -> None:
        self.staging, self.views, self.items, self.base = staging, views, list(items), base
        self.request_id = request_id
        self.seconds = 0.0
        self._ran = False
        self._failure: Failed | None = None
        self._event: Any = None  # recorded after a CUDA scatter: done once it fired
        self._job: concurrent.futures.Future[float] | None = None  # a scatter in the worker

    def poll(self, worker: bool = False) -> Outcome:
        """None once the blocks hold the staged bytes, `Pending`, or `Failed` (a CUDA or copy
        error: this pull fails, the consumer runs on)."""
        if self._failure is not None:
            return self._failure
        if self._event is not None:
            try:
                fired = self._event.query()
            except RuntimeError as exc:
                return self._failed(exc)
            if not fired:
                return Pending()
            self._event = None
            return None
        if self._job is not None:
            if not self._job.done():
                return Pending()
            job, self._job = self._job, None
            try:
                self.seconds = job.result()
            except (RuntimeError, ValueError, IndexError) as exc:
                return self._failed(exc)
            return None
        if self._ran:
            return None
        self._ran = True
        staging = self.staging
        if worker and not staging.tensor.is_cuda and staging.copier is None:
            self._job = job = staging.worker().submit(self._run)
            job.add_done_callback(lambda _: staging.wake())
            return Pending()
        try:
            self.seconds = self._run()
            if staging.tensor.is_cuda and self.items:
                import torch

                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(staging.tensor.device))
                self._event = event
                return Pending(True)
        except (RuntimeError, ValueError, IndexError) as exc:
            return self._failed(exc)
        return None

    def _run(self) -> float:
        return scatter_items(self.staging, self.views, self.items, self.base)

    def _failed(self, exc: BaseException) -> Failed:
        if self.staging.tensor.is_cuda:  # what was queued may still read the staging range
            import torch

            with contextlib.suppress(RuntimeError):
                torch.cuda.current_stream(self.staging.tensor.device).synchronize()
        self._event = None
        self._failure = Failed(TransferError(f"scattering request {self.request_id!r} failed: {exc}"))
        return self._failure

    def wait(self) -> None:
        """Return once nothing of the scatter runs any more (an abort: none writes after it)."""
        if self._job is not None:
            concurrent.futures.wait([self._job])
            self._job = None
        if self._event is not None:
            with contextlib.suppress(RuntimeError):  # a CUDA error: nothing more will run
                self._event.synchronize()
            self._event = None
