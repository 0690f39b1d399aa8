"""The prefill side of packed transfers: a bounded staging pool registered once, filled at
``expose()`` with a request-major copy of the request (see `akv.packing`), and each copy's
life from exposure to release (`PackLifecycle`).

Pool full (or the request's directory bucket full): the request is not packed, it is read
directly from the paged blocks (counted as ``pack_fallbacks``, logged); a decode rank that
looks it up in the directory falls back to direct reads for it. A slot is freed exactly once:
when its exposure is released (read, lease expiry, close), after the exposure was retired.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from akv import kernels
from akv.errors import ConfigError
from akv.geometry.cache import CacheSpec
from akv.geometry.layout import rank_layout
from akv.kernels import RunCopier
from akv.ledger import Release
from akv.packing import Arena, CacheViews, PackDirectory, gather, gather_segment, sections
from akv.protocol.messages import PackInfo
from akv.runtime.push_state import PackedCopy

if TYPE_CHECKING:
    import torch

    from akv.ledger import ReleaseLedger
    from akv.metrics import Metrics

__all__ = ["TRANSFERS", "PackLifecycle", "Packer", "TransferMode", "check_transfer", "fragmented"]

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
        self._threads: ThreadPoolExecutor | None = None  # gathers of long requests (DRAM)
        #: called from that thread when a gather is done (the producer wakes its poller)
        self.wake: Callable[[], None] = lambda: None

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
        if stream is None and self.copier is None and size >= THREAD_BYTES and not self.early:
            # a long request's gather: in the packer's thread (torch releases the GIL while it
            # copies), published as a device gather is, once done; readers meanwhile wait
            # for it or read the paged blocks
            event = _Job(self._worker().submit(self._gather_all, secs, per_group, slot), self.wake)
            self.slots[request_id] = offset
            self.pending[request_id] = (event, offset, size, generation)
            self.directory.mark_pending(request_id)
            return True
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

    def touch(self) -> None:
        """Touch every page of the pool (DRAM), so that the first gathers do not pay for the
        page faults of the whole pool (*blocking*)."""
        if not self.pool.is_cuda:
            self.pool.fill_(0)

    def _gather_all(self, secs: Sequence[Any], per_group: Sequence[npt.NDArray[np.int32]], slot: Any) -> None:
        for s in secs:
            gather(self.views, s, per_group[s.group], slot)

    def _worker(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(1, thread_name_prefix="akv-pack")
        return self._threads

    def close(self) -> None:
        """Stop the gathering thread once its gathers are done."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None

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
                if isinstance(event, _Job) and event.failed:  # no copy: the request is read directly
                    del self.slots[request_id]
                    self.directory.retire(request_id)  # its pending mark
                    self.arena.free(offset)
                    done.append((request_id, False))
                    continue
                done.append((request_id, self._publish(request_id, generation, offset, size)))
        return done

    @property
    def spinning(self) -> bool:
        """True while a device gather is pending (settled by polling its event: the poller
        spins); a gather in the packer's thread wakes the poller itself."""
        return any(not isinstance(e, _Job) for e, *_ in (*self.pending.values(), *self.freeing))

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


#: DRAM requests of at least this many bytes are gathered in the packer's thread, not in
#: ``expose()`` on the event loop: a 1 GiB one held the prefill rank's loop for the whole copy.
THREAD_BYTES = 8 << 20


class _Job:
    """A gather in the packer's thread, seen as a device gather's event is (`query`,
    `synchronize`)."""

    def __init__(self, future: concurrent.futures.Future[None], wake: Callable[[], None]) -> None:
        self.future = future
        future.add_done_callback(lambda _: wake())

    def query(self) -> bool:
        return self.future.done()

    @property
    def failed(self) -> bool:
        """True once done in error (the request is read directly)."""
        return self.future.done() and self.future.exception() is not None

    def synchronize(self) -> None:
        concurrent.futures.wait([self.future])


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class PackLifecycle:
    """An exposed request's packed copy from ``expose()`` to its release, on one prefill rank:
    packed at once, or once its last layer is computed (push mode); published once its
    device gather is done; with ``release_after_pack`` its paged blocks handed back as soon as
    it is published; its slot freed exactly once, when its exposure is retired.

    ``ledger``: the rank's (the requests still exposed); ``ready``: called with a request
    whose copy was published or found no room (packed pushes waiting for it go on);
    ``deliver``: hands releases to the engine (an early ``"packed"`` one here)."""

    def __init__(
        self,
        packer: Packer,
        *,
        ledger: ReleaseLedger,
        metrics: Metrics,
        log: Any,
        ready: Callable[[str], None],
        deliver: Callable[[list[Release]], None],
    ) -> None:
        self.packer = packer
        self.ledger = ledger
        self.metrics = metrics
        self.log = log
        self._ready = ready
        self._deliver = deliver
        self._early: set[str] = set()  # released to the engine after packing, still exposed
        self._gathering: dict[str, npt.NDArray[np.int32]] = {}  # packs queued on the device
        # exposed with layers still to compute: packed once the last one is ready
        self._later: dict[str, tuple[Sequence[npt.NDArray[np.int32]], npt.NDArray[np.int32], int]] = {}

    @property
    def busy(self) -> bool:
        """True while gathers are queued on the device or run in the packer's thread."""
        return bool(self.packer.pending or self.packer.freeing)

    def exposed(
        self,
        request_id: str,
        per_group: Sequence[npt.NDArray[np.int32]],
        ids: npt.NDArray[np.int32],
        generation: int,
        complete: bool,
    ) -> None:
        """A request was exposed: pack it now if every layer is computed (``complete``),
        else once `computed` says so (until then it is read directly)."""
        if complete:
            self._pack(request_id, per_group, ids, generation)
        else:
            self._later[request_id] = (per_group, ids, generation)

    def computed(self, request_id: str) -> None:
        """Every layer of an exposed request is computed: pack it if it waited for that."""
        later = self._later.pop(request_id, None)
        if later is not None:
            self._pack(request_id, *later)

    def _pack(
        self,
        request_id: str,
        per_group: Sequence[npt.NDArray[np.int32]],
        ids: npt.NDArray[np.int32],
        generation: int,
    ) -> None:
        """Pack an exposed request (fall back to direct reads when the pool is full)."""
        packer = self.packer
        try:
            packed = packer.pack(request_id, per_group, generation)
        except Exception as exc:  # e.g. out of device memory: this request is read directly
            self.log.warning(
                "packing failed: the request is read directly", request=request_id, error=str(exc)
            )
            packed = False
        if not packed:
            self._packed(request_id, ids, False)
        elif request_id in packer.pending:  # published once its gather is done (settle)
            self._gathering[request_id] = ids
        else:
            self._packed(request_id, ids, True)

    def _packed(self, request_id: str, ids: npt.NDArray[np.int32], packed: bool) -> None:
        """A request's packed copy is published (or it has none); with
        ``release_after_pack``, hand its blocks back now."""
        self._ready(request_id)  # packed pushes waiting for the copy go on
        if not packed:
            self.metrics.inc("pack_fallbacks")
            self.log.info("no packed copy (pool full): the request is read directly", request=request_id)
            return
        self.metrics.inc("packed")
        if self.packer.early:
            self.ledger.table.mark_packed(request_id)  # before the blocks go back: direct reads now fail
            self._early.add(request_id)
            cache = self.packer.cache
            groups = cache.split(ids) if len(cache.groups) > 1 else None
            self._deliver([Release(request_id, ids, "packed", 0, None, groups)])

    def settle(self) -> bool:
        """Publish the packed copies whose gather finished on the device; True if any did."""
        if not self.busy:
            return False
        done = self.packer.settle()
        for request_id, published in done:
            ids = self._gathering.pop(request_id, None)
            if ids is not None and request_id in self.ledger:
                self._packed(request_id, ids, published)
        return bool(done)

    def copy_of(self, request_id: str, info: PackInfo | None) -> PackedCopy | Literal["pending"] | None:
        """Where the published copy of a request is in registered memory (``info``: this
        rank's pool as its handshake announces it); ``"pending"`` while its gather is queued
        on the device; None if it has none."""
        found = self.packer.copy_of(request_id)
        if found is None or found == "pending":
            return found
        if info is None:  # pragma: no cover - a rank with a packer announces its pool
            return None
        generation, offset, nbytes = found
        return PackedCopy(info.pool_addr + offset, nbytes, generation, info.mem_type, info.device_id)

    def released(self, releases: list[Release], retire: bool) -> list[Release]:
        """Releases about to be delivered: nothing waits to be packed for them any more;
        ``retire`` (their exposure is retired): free their slots (once), and keep back the
        releases of requests whose blocks went back early (counted instead)."""
        for release in releases:
            self._later.pop(release.request_id, None)
        if not retire:
            return releases
        kept = []
        for release in releases:
            rid = release.request_id
            self.packer.drop(rid)
            self._gathering.pop(rid, None)
            if rid in self._early:  # its blocks went back after packing
                self._early.discard(rid)
                self.metrics.inc(f"pack_released_{release.reason}")
                continue
            kept.append(release)
        return kept
