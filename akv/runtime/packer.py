"""The prefill side of packed transfers: a bounded staging pool registered once, filled at
``expose()`` with a request-major copy of the request (see `akv.packing`).

Pool full (or the request's directory bucket full): the request is not packed, it is read
directly from the paged blocks (counted as ``pack_fallbacks``, logged); a decode rank that
looks it up in the directory falls back to direct reads for it. A slot is freed exactly once:
when its exposure is released (read, lease expiry, close), after the exposure was retired.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from akv import kernels
from akv.errors import ConfigError
from akv.geometry.cache import CacheSpec
from akv.geometry.layout import rank_layout
from akv.kernels import RunCopier
from akv.packing import Arena, CacheViews, PackDirectory, gather, gather_segment, sections
from akv.protocol.messages import PackInfo

if TYPE_CHECKING:
    import torch

__all__ = ["TRANSFERS", "Packer", "TransferMode", "check_transfer", "fragmented"]

TransferMode = Literal["auto", "direct", "packed"]
TRANSFERS: tuple[TransferMode, ...] = ("auto", "direct", "packed")


def check_transfer(transfer: str) -> TransferMode:
    """A valid ``transfer`` option, or ConfigError."""
    for known in TRANSFERS:
        if transfer == known:
            return known
    raise ConfigError(f"transfer must be 'auto', 'direct' or 'packed', got {transfer!r}")


def fragmented(cache: CacheSpec, rank: int, tp_size: int) -> bool:
    """True if one unit of one block (every layer, component and token) is more than one
    contiguous run on this rank's layout: what ``transfer="auto"`` packs."""
    layout = rank_layout(cache, rank, tp_size)
    for gl in layout.groups:
        g = gl.group
        bs = g.block_size if g.tokens else 1
        atoms = []
        for p in gl.placements:
            for i, region in enumerate(p.regions):
                for t in range(bs):
                    atoms.append((region, p.offset + i * p.layer + t * p.token, p.run))
        atoms.sort()
        runs = 1 + sum(1 for a, b in itertools.pairwise(atoms) if a[0] != b[0] or a[1] + a[2] != b[1])
        if runs > 1:
            return True
    return False


class Packer:
    """One prefill rank's packing: pool, directory, views of the paged cache."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        cache: CacheSpec,
        rank: int,
        tp_size: int,
        pool_bytes: int,
        buckets: int,
        early: bool,
        copy_with: str = "auto",
    ) -> None:
        import torch

        if pool_bytes < 1:
            raise ConfigError(f"pack_pool_bytes must be > 0, got {pool_bytes}")
        self.cache = cache
        self.rank = rank
        self.tp_size = tp_size
        self.early = early
        self.arena = Arena(pool_bytes)
        if not self.arena.size:
            raise ConfigError(f"pack_pool_bytes must be at least 256, got {pool_bytes}")
        device = kv_caches[0].device
        self.pool = torch.empty(self.arena.size, dtype=torch.uint8, device=device)
        self.directory = PackDirectory(buckets, shared=True)
        self.views = CacheViews(kv_caches, rank_layout(cache, rank, tp_size))
        self._stream: Any = None  # the CUDA side stream of the gathers
        self.slots: dict[str, int] = {}  # request -> slot offset
        self.published: dict[str, tuple[int, int, int]] = {}  # request -> (generation, offset, size)
        self.packed_bytes = 0
        #: one kernel launch per request (CUDA, or CPU tensors under Triton's interpreter
        #: with ``copy_with="torch"``); None: torch gathers per section and layer
        self.copier = RunCopier(device) if kernels.mode(device.type, copy_with) == "kernel" else None
        #: gathers queued on the device, not yet known done: request -> (event, offset, size,
        #: generation); published by `settle` once their event fired
        self.pending: dict[str, tuple[Any, int, int, int]] = {}
        self.freeing: list[tuple[Any, int]] = []  # dropped while gathering: freed once done

    def info(self, mem_type: str, device_id: int) -> PackInfo:
        """What the handshake tells decode ranks."""
        return PackInfo(
            pool_addr=int(self.pool.data_ptr()),
            pool_bytes=self.arena.size,
            mem_type=mem_type,
            device_id=device_id,
            directory_addr=int(self.directory.array.ctypes.data),
            directory_buckets=self.directory.buckets,
            early=self.early,
            directory_share=self.directory.share(),
        )

    def pack(self, request_id: str, per_group: Sequence[npt.NDArray[np.int32]], generation: int) -> bool:
        """Copy an exposed request into a slot and publish it; False if there was no room.

        On CUDA the gather is queued (on a side stream ordered after the work queued on the
        current one) and the request is in `pending` until `settle` sees its event fired and
        publishes it: no reader can find a half-packed copy, and the host never waits (with
        ``early``, release_after_pack, it waits for the gather: readers then have no direct
        read to fall back on while it runs)."""
        import torch

        secs, size = sections(self.cache, self.rank, self.tp_size, [len(ids) for ids in per_group])
        offset = self.arena.alloc(size)
        if offset is None:
            return False
        slot = self.pool[offset : offset + size]
        stream: Any = None
        if slot.is_cuda:  # one side stream, ordered after the work queued on the current one
            if self._stream is None:
                self._stream = torch.cuda.Stream(slot.device)  # type: ignore[no-untyped-call]
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(slot.device))
        event: Any = None
        try:
            with torch.cuda.stream(stream) if stream is not None else _null():
                if self.copier is not None:
                    base = int(self.pool.data_ptr()) + offset
                    self.copier.copy_blocks(
                        [gather_segment(self.views, s, per_group[s.group], base) for s in secs]
                    )
                else:
                    for s in secs:
                        gather(self.views, s, per_group[s.group], slot)
                if stream is not None:
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(stream)
        except Exception:
            if stream is not None:  # what was queued may still write the slot
                stream.synchronize()
            self.arena.free(offset)
            raise
        self.slots[request_id] = offset
        if event is not None and not self.early:
            self.pending[request_id] = (event, offset, size, generation)
            self.directory.mark_pending(request_id)  # readers wait for it rather than read blocks
            return True
        if event is not None:  # release_after_pack: the packed copy is the only one readers get
            event.synchronize()
        return self._publish(request_id, generation, offset, size)

    def _publish(self, request_id: str, generation: int, offset: int, size: int) -> bool:
        """Publish a packed copy; False (slot freed) if its directory bucket is full."""
        if not self.directory.publish(request_id, generation, offset, size):
            del self.slots[request_id]
            self.arena.free(offset)
            return False
        self.packed_bytes += size
        self.published[request_id] = (generation, offset, size)
        return True

    def settle(self) -> list[tuple[str, bool]]:
        """Publish the pending copies whose gather is done; returns ``(request, published)``
        for each (False: its directory bucket was full, the request is read directly)."""
        if self.freeing:
            still = []
            for event, offset in self.freeing:
                if event.query():
                    self.arena.free(offset)
                else:
                    still.append((event, offset))
            self.freeing = still
        done = []
        for request_id, (event, offset, size, generation) in list(self.pending.items()):
            if event.query():
                del self.pending[request_id]
                done.append((request_id, self._publish(request_id, generation, offset, size)))
        return done

    def copy_of(self, request_id: str) -> tuple[int, int, int] | Literal["pending"] | None:
        """``(generation, offset, nbytes)`` of a request's published copy; ``"pending"`` while
        its gather is queued on the device; None if it has none."""
        if request_id in self.pending:
            return "pending"
        return self.published.get(request_id)

    def drop(self, request_id: str) -> bool:
        """Retire a request's copy and free its slot (once: later calls do nothing); True if
        it had one."""
        offset = self.slots.pop(request_id, None)
        self.published.pop(request_id, None)
        if offset is None:
            return False
        pending = self.pending.pop(request_id, None)
        if pending is not None:  # never published; the gather may still write the slot
            self.directory.retire(request_id)  # its pending mark
            self.freeing.append((pending[0], offset))
            return True
        self.directory.retire(request_id)
        self.arena.free(offset)
        return True


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
