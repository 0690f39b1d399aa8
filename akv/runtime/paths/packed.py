"""The packed path: read a prefill rank's packed copy of the request (`akv.packing`) into a
local staging area with a few descriptors, check the exposure, then scatter (numpy on DRAM,
torch on CUDA).

Stages of one pull:

1. ``locating``: one small READ per prefill rank of its directory bucket: where the
   request's slot is and which exposure (generation) it copies. A rank with no copy (its
   pool was full) makes the whole pull fall back to the read path (``path`` becomes
   ``"read"``), as does a full local staging pool (unless a rank already released the
   paged blocks after packing: then `BackPressureError`).
2. ``reading``: one READ per prefill rank into the staging area: per (group, component)
   one descriptor for the unit range this rank needs, or one per unit and layer after a
   partial prefix hit; then the exposure check of the read path (`NixlRead`, the "done" notice riding on
   it), bound to the generation the directory named: the slot is freed only after its
   exposure was retired, so a passing check proves the bytes read were this request's.
3. ``scattering``: the staged bytes go into the paged cache, whatever its layout and block
   size (`akv.runtime.paths.staging.Scatter`: on the poller's thread, in the staging pool's
   worker thread for a large DRAM pull (`akv.runtime.paths.staging.WORKER_BYTES`), or on CUDA one
   kernel launch, done once its event fired); the staging range is freed exactly once, also
   on failure or abort (then only once NIXL released every read that may still land in it).

Where the pull's copies lie in the staging range is `akv.pack_layout`'s, the same rule a
prefill rank applies when it pushes its packed copy there.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from akv import exposure
from akv.backends import Backend, Reaper, XferHandle, poll_handles
from akv.errors import AkvError, BackPressureError, IncompatiblePeerError, PeerLostError, TransferError
from akv.geometry.cache import CacheSpec
from akv.metrics import no_count
from akv.pack_layout import Item, desc_rows, plan_runs, staged_bytes
from akv.packing import CacheViews, find, find_pending
from akv.protocol.messages import PackInfo
from akv.runtime.paths import Failed, OpBase, Outcome, PathName, Pending
from akv.runtime.paths.posts import DescPost
from akv.runtime.paths.read import NixlRead
from akv.runtime.paths.staging import WORKER_BYTES, Scatter, StagingPool
from akv.runtime.paths.tables import CheckBatcher, RemoteTable, SlotPool, copy_entries

if TYPE_CHECKING:
    from akv.plan import Prepared

__all__ = [
    "AUTO_DESCRIPTORS",
    "AUTO_LONG_DESCRIPTORS",
    "AUTO_LONG_RUN_BYTES",
    "AUTO_RUN_BYTES",
    "DEVICE_AUTO_DESCRIPTORS",
    "DEVICE_AUTO_RUN_BYTES",
    "DescPost",
    "PackedLink",
    "PackedRead",
    "PackedStage",
    "use_packed",
]

#: ``transfer="auto"``: a pull whose direct read would post more descriptors than this, of
#: fewer than `AUTO_RUN_BYTES` bytes on average, reads the packed copy instead (measured with
#: ``akv bench --only packed_threshold`` on DRAM: docs/performance.md#packed-transfers).
AUTO_DESCRIPTORS = 512
#: ... and the mean run below which descriptors cost more than the packed copy's scatter.
AUTO_RUN_BYTES = 2048
#: The same two for device memory (VRAM): a descriptor costs ~6 us on the CUDA-IPC path
#: (docs/gpu.md, one H100), so 32 of them cost more than the directory READ and one scatter
#: kernel, and a run moves at the device's speed through that kernel up to about 1 MiB
#: (derived from the per-descriptor cost, not a crossing measured on the device).
DEVICE_AUTO_DESCRIPTORS = 32
DEVICE_AUTO_RUN_BYTES = 1 << 20
#: ... and, on any memory, a long request: its direct read would post more than this many
#: descriptors of at most `AUTO_LONG_RUN_BYTES` on average. On DRAM, once a prefill engine's
#: first read no longer waited for its transport's set-up (`akv._poll.WIREUP_POLL_S`), the
#: packed copy of a 32-layer per-layer request (4 KiB descriptors) won at 32,768 descriptors
#: (4k tokens from two prefill ranks: 87 against 122 ms) and at 65,536 in three runs of three
#: (16k tokens from one: 118-133 against 151-180 ms), and was no faster at 16,384 in two of
#: three; a head-major layout's descriptors (64 KiB and more) stayed faster read direct at
#: every length (``akv bench --only scale``, docs/performance.md "Scale").
AUTO_LONG_DESCRIPTORS = 30_000
AUTO_LONG_RUN_BYTES = 16 << 10

#: A prefill rank whose directory says the request's packed copy is still being gathered on
#: the device (`akv.packing.PackDirectory.mark_pending`) is looked up again every
#: `PENDING_RETRY_S` for up to `PENDING_WAIT_S` from the pull's start before the pull reads
#: the paged blocks instead: a 64 MiB gather takes well under a millisecond on an H100, the
#: direct read of a fragmented per-layer request there 23 ms (4,096 descriptors, docs/gpu.md).
PENDING_WAIT_S = 0.02
PENDING_RETRY_S = 0.0002


class PackedStage(enum.Enum):
    """Where a `PackedRead` is (see the module)."""

    LOCATING = "locating"
    READING = "reading"
    SCATTERING = "scattering"
    FELL_BACK = "fell back"  # reading the paged blocks instead (``fallback``)
    DONE = "done"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class PackedLink:
    """A prefill rank that packs: its agent, pool and prepared directory."""

    rank: int
    agent: str
    pack: PackInfo
    directory: RemoteTable


def use_packed(
    transfer: str,
    prepared: Prepared,
    packs: Mapping[int, PackInfo | None],
    threshold: int,
    run_bytes: int = AUTO_RUN_BYTES,
) -> bool:
    """Whether a prepared pull reads packed copies: always for ``"packed"``, never for
    ``"direct"``; ``"auto"``: when every rank read from packs and either one of them released
    its blocks after packing or the direct read would post more than ``threshold``
    descriptors of fewer than ``run_bytes`` bytes on average (`AUTO_DESCRIPTORS` and
    `AUTO_RUN_BYTES` on DRAM, `DEVICE_AUTO_DESCRIPTORS` and `DEVICE_AUTO_RUN_BYTES` on
    device memory), or the request is long (`AUTO_LONG_DESCRIPTORS`)."""
    ranks = {op.remote_rank for op, _, _ in prepared.posts}
    if not ranks or transfer == "direct":
        return False
    if transfer == "packed":
        return True
    infos = [packs.get(r) for r in ranks]
    if any(i is None for i in infos):
        return False
    if any(i.early for i in infos if i is not None):
        return True
    n = prepared.descriptors
    if n > AUTO_LONG_DESCRIPTORS and prepared.bytes <= AUTO_LONG_RUN_BYTES * n:
        return True
    return prepared.bytes < run_bytes * n and n > threshold


class PackedRead(OpBase):
    """One pull on the packed path (see the module)."""

    path: PathName = "packed"
    reads = True

    def __init__(
        self,
        backend: Backend,
        reaper: Reaper,
        *,
        request_id: str,
        prepared: Prepared,
        generation: int,
        notice: bytes,
        links: Mapping[int, PackedLink],
        checks: Mapping[int, RemoteTable | None] | None,
        check_pool: SlotPool | None,
        dir_pool: SlotPool,
        staging: StagingPool,
        views: CacheViews,
        local_spec: CacheSpec,
        remote_spec: CacheSpec,
        prefill_tp: int,
        direct: NixlRead | None,
        count: Callable[[str, int], None] = no_count,
        notices: CheckBatcher | None = None,
    ) -> None:
        self.backend = backend
        self.count = count  # the decode rank's counters (`akv.Metrics.inc`)
        self.notices = notices  # where its read's notices of checks in shared memory wait
        self.reaper = reaper
        self.request_id = request_id
        self.prepared = prepared
        self.generation = generation
        self.notice = notice
        self.links = links
        self.checks = checks
        self.check_pool = check_pool
        self.dir_pool = dir_pool
        self.staging = staging
        self.views = views
        self.local_spec = local_spec
        self.remote_spec = remote_spec
        self.prefill_tp = prefill_tp
        self.direct = direct
        if direct is not None:
            direct.owner = self  # a fallback's reads land in the paged blocks: the pull holds them
        self.stage = PackedStage.LOCATING
        self.read: NixlRead | None = None
        self.fallback: NixlRead | None = None
        self._descriptors = 0  # posted to read the packed copies
        #: seconds of each stage, for benchmarks: the directory lookup, the reads with their
        #: exposure check, the scatter
        self.lookup_s = self.read_s = 0.0
        self._since = 0.0  # when the current stage began
        self._ranks = frozenset(op.remote_rank for op, _, _ in prepared.posts)
        self._lookups: dict[XferHandle, int] = {}
        self._dir_slots: dict[int, int] = {}
        self._entries: dict[int, tuple[int, int, int]] = {}  # directory entries found so far
        self._waiting: list[int] = []  # ranks whose copy is still being gathered
        self._retry_at = 0.0  # when to look them up again
        self._hash = 0  # the request's hash (its directory bucket), from `start`
        self._items: list[Item] = []
        self._staged: int | None = None  # offset of the pull's staging range
        self._scatter: Scatter | None = None
        self._landed = False  # the reads into the staging range were released by NIXL
        self._counted = False  # counted in staging.active

    @property
    def descriptors(self) -> int:
        """Descriptors the pull posted: the packed copies' runs, or the direct read's after a
        fallback."""
        return self.prepared.descriptors if self.fallback is not None else self._descriptors

    @property
    def scatter_s(self) -> float:
        """Seconds the scatter took (on CUDA: to queue)."""
        return 0.0 if self._scatter is None else self._scatter.seconds

    @property
    def stages(self) -> Mapping[str, float]:
        if self.fallback is not None:
            return self.fallback.stages
        return {"lookup": self.lookup_s, "read": self.read_s, "scatter": self.scatter_s}

    def take_noticed(self) -> frozenset[int]:
        """Those of its reads (the direct read's after a fallback)."""
        read = self.fallback if self.fallback is not None else self.read
        return read.take_noticed() if read is not None else frozenset()

    @property
    def ranks(self) -> frozenset[int]:
        """The prefill ranks read from (those of the direct read after a fallback)."""
        if self.fallback is not None:
            return self.fallback.ranks
        return self._ranks

    # -- stages ---------------------------------------------------------------------------

    def start(self) -> Failed | None:
        """Look up the request's packed copy on every prefill rank read from (a pull whose
        start fails is no longer counted in ``staging.active``)."""
        self.staging.active += 1
        self._counted = True
        self._since = time.perf_counter()
        try:
            failed = self._start()
        except BaseException:
            self._uncount()
            raise
        if failed is not None:
            self._uncount()
        return failed

    def _start(self) -> Failed | None:
        self._hash = exposure.request_hash(self.request_id)  # its directory bucket on every rank
        for rank in sorted(self._ranks):
            if rank not in self.links:
                return self._fall_back(f"prefill rank {rank} keeps no packed copies")
        for rank in sorted(self._ranks):
            failed = self._look_up(rank)
            if failed is not None:
                return failed
        return None

    def _look_up(self, rank: int) -> Failed | None:
        """Post the READ of ``rank``'s directory bucket (into the rank's directory slot)."""
        link = self.links[rank]
        slot = self._dir_slots.get(rank)
        if slot is None:
            try:
                slot = self.dir_pool.acquire()
            except BackPressureError as exc:
                self.abort()
                return Failed(exc)
            self._dir_slots[rank] = slot
        bucket = self._hash % link.directory.buckets
        if link.directory.table is not None:  # on this host: a memory load, done at once
            if link.directory.released:  # the rank was unlinked since the pull began
                self.abort()
                return Failed(PeerLostError(f"prefill rank {rank} was re-linked during this pull"), rank)
            copy_entries(link.directory.table[bucket], self.dir_pool.array[slot])
            self.count("directories_shared", 1)
            return None
        try:
            handle = self.backend.read(
                self.dir_pool.dlist,
                np.array([slot], dtype=np.int32),
                link.directory.dlist,
                np.array([bucket], dtype=np.int32),
                b"",
            )
        except TransferError as exc:
            self.abort()
            return Failed(exc, rank)
        self.count("xfers_directory", 1)
        self._lookups[handle] = rank
        return None

    def poll(self) -> Outcome:
        """Advance the stage the pull is in; never raises."""
        stage = self.stage
        if stage is PackedStage.FELL_BACK and self.fallback is not None:
            outcome = self.fallback.poll()
            if outcome is None:
                self._forget()
            return outcome
        if stage is PackedStage.LOCATING:
            return self._locate()
        if stage is PackedStage.READING and self.read is not None:
            outcome = self.read.poll()
            if outcome is not None:
                return outcome
            self.read_s = time.perf_counter() - self._since
            self.stage = PackedStage.SCATTERING
            return self._scatter_staged()
        if stage is PackedStage.SCATTERING:
            return self._scatter_staged()
        return None  # done (never polled aborted: the poller forgets a pull it failed)

    def _locate(self) -> Outcome:
        """The directory lookups: once every one landed, plan and post the reads."""
        polled = poll_handles(self.backend, self.reaper, self._lookups)
        if polled.failed is not None:
            _, rank, exc = polled.failed
            return Failed(exc, rank)
        changed = polled.changed
        if self._lookups:
            return Pending(changed)
        if self._waiting:  # copies still being gathered: look again once it is time
            if time.perf_counter() < self._retry_at:
                return Pending(changed)
            waiting, self._waiting = self._waiting, []
            for rank in waiting:
                failed = self._look_up(rank)
                if failed is not None:
                    return failed
            return Pending(True)
        failed = self._post_reads()
        if failed is not None:
            return failed
        return self.poll()

    def _post_reads(self) -> Failed | None:
        """Plan the runs from the directory entries, stage, post the reads (or fall back)."""
        now = time.perf_counter()
        entries = self._entries
        for rank, slot in list(self._dir_slots.items()):
            bucket = self.dir_pool.array[slot]
            entry = find(bucket, self.request_id)
            if entry is not None:
                entries[rank] = entry
                self.dir_pool.release(self._dir_slots.pop(rank))
                continue
            gathering = find_pending(bucket, self.request_id)
            if gathering and now - self._since < PENDING_WAIT_S:
                self._waiting.append(rank)  # look again shortly
                continue
            self._free_dir_slots()
            why = "still being gathered" if gathering else "its pool was full"
            return self._fall_back(f"prefill rank {rank} has no packed copy of it ({why})")
        if self._waiting:
            self._retry_at = now + PENDING_RETRY_S
            return None
        self.lookup_s, self._since = now - self._since, now
        gens: dict[int, int] = {}
        for rank, (gen, _, _) in entries.items():
            if self.generation and gen != self.generation & exposure.GENERATION_MASK:
                gens[rank] = self.generation  # the exposure check names the re-exposure
            else:
                gens[rank] = gen
        try:
            rows = self._plan(entries)
        except TransferError as exc:
            return Failed(exc)
        total = staged_bytes(self._items)  # the span: items start ALIGN-aligned
        offset = self.staging.arena.alloc(total)
        if offset is None:
            if any(self.links[r].pack.early for r in entries):
                return Failed(
                    BackPressureError(
                        f"the packed staging pool has no {total} bytes free for request "
                        f"{self.request_id!r}: pull again later, or raise pack_staging_bytes"
                    )
                )
            return self._fall_back("the packed staging pool is full")
        self._staged = offset
        base = self.staging.addr + offset
        posts = []
        for rank in sorted(entries):
            ltab, rtab = rows[rank]
            if not len(ltab):
                continue
            ltab[:, 0] += base
            self._descriptors += len(ltab)
            link = self.links[rank]
            posts.append(DescPost(rank, link.agent, ltab, self.staging.mem_type, rtab, link.pack.mem_type))
        self.read = NixlRead(
            self.backend,
            self.reaper,
            posts,
            request_id=self.request_id,
            remote_ids=self.prepared.remote_ids,
            read_ids=self.prepared.read_ids,
            notice=self.notice,
            checks=self.checks,
            pool=self.check_pool,
            generation=gens,
            packed=True,
            on_settled=self._on_landed,
            count=self.count,
            notices=self.notices,
        )
        self.read.owner = self  # the consumer asks the reaper whether this pull may still land
        self.stage = PackedStage.READING
        return self.read.start()

    def _plan(
        self, entries: Mapping[int, tuple[int, int, int]]
    ) -> dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
        """Items of the pull and, per prefill rank, its rows: local ``(offset in the staging
        range, len, device)`` and remote ``(addr, len, device)``."""
        items, runs, sizes = plan_runs(
            self.local_spec, self.remote_spec, self.prepared, self.prefill_tp, entries, self.request_id
        )
        for rank, (_, _, nbytes) in entries.items():
            if sizes[rank] != nbytes:
                raise TransferError(
                    f"prefill rank {rank}'s packed copy of {self.request_id!r} has {nbytes} bytes, "
                    f"{sizes[rank]} expected: the engines disagree on the cache"
                )
        self._items = items
        rows = {}
        for rank, (local, remote, lengths) in runs.items():
            pack = self.links[rank].pack
            rows[rank] = (
                desc_rows(local, lengths, self.staging.device_id),
                desc_rows(remote + (pack.pool_addr + entries[rank][1]), lengths, pack.device_id),
            )
        return rows

    def _scatter_staged(self) -> Outcome:
        """Write the verified staged bytes into the paged cache (DRAM pulls of at least
        `WORKER_BYTES`: in the staging pool's worker thread, so the poller runs on; CUDA:
        queued, done once its event fired); free the staging range once done."""
        scatter = self._scatter
        if scatter is None:
            base = self._staged
            if base is None:  # pragma: no cover - the reads were posted into a staging range
                return Failed(TransferError(f"request {self.request_id!r} has no staging range"))
            scatter = self._scatter = Scatter(self.staging, self.views, self._items, base, self.request_id)
        worker = sum(item.nbytes for item in self._items) >= WORKER_BYTES
        outcome = scatter.poll(worker)
        if isinstance(outcome, Pending):
            return outcome
        self._free_staging()
        if outcome is None:
            self.stage = PackedStage.DONE
            self._forget()
        return outcome

    def _forget(self) -> None:
        """Drop the prepared lists it holds (the links' directories, the checks, an unused
        direct read): a finished op must not keep a replaced agent alive."""
        self._uncount()
        self.links = {}
        self.checks = {}
        if self.direct is not None and self.direct is not self.fallback:
            self.direct._forget()
            self.direct = None

    # -- fallback and cleanup ---------------------------------------------------------------

    def _uncount(self) -> None:
        """No longer a packed pull in flight (once)."""
        if self._counted:
            self._counted = False
            self.staging.active -= 1

    def _fall_back(self, why: str) -> Failed | None:
        """Read the paged blocks instead (the read path), if the pull may."""
        if self.direct is None:
            return Failed(TransferError(f"request {self.request_id!r} cannot be read packed: {why}"))
        self.path = "read"
        self.fallback = self.direct
        self.stage = PackedStage.FELL_BACK
        self._uncount()  # it scatters nothing now
        return self.fallback.start()

    def _on_landed(self) -> None:
        self._landed = True
        if self.stage is PackedStage.ABORTED:
            self._free_staging()

    def _free_staging(self) -> None:
        if self._staged is not None:
            self.staging.arena.free(self._staged)
            self._staged = None

    def _free_dir_slots(self) -> None:
        for slot in self._dir_slots.values():
            self.dir_pool.release(slot)
        self._dir_slots.clear()

    def abort(self) -> None:
        """Release every handle; directory and staging ranges go back once nothing can land in them."""
        if self.stage is PackedStage.ABORTED:
            return
        self.stage = PackedStage.ABORTED
        if self._scatter is not None:  # a scatter in flight or queued: none writes after this returns
            self._scatter.wait()
        for handle, rank in list(self._lookups.items()):
            slot = self._dir_slots.pop(rank, None)
            then: Any = None
            if slot is not None:

                def then(slot: int = slot, pool: SlotPool = self.dir_pool) -> None:
                    pool.release(slot)

            self.reaper.drop(handle, then, owner=self)
        self._lookups.clear()
        self._free_dir_slots()
        if self.fallback is not None:
            self.fallback.abort()
        if self.read is not None:
            self.read.abort()  # runs _on_landed once its data reads are released
        if self.read is None or self._landed:
            self._free_staging()
        self._forget()


def error_for(ranks: Sequence[int], engine: str) -> AkvError:
    """The error for ``transfer="packed"`` against prefill ranks that do not pack."""
    return IncompatiblePeerError(
        f"prefill ranks {sorted(ranks)} of engine {engine!r} keep no packed copies: start them with "
        "transfer='packed' (--transfer packed), or pull with transfer='auto' or 'direct'",
        ("transfer",),
    )
