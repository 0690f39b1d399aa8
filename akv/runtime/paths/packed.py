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
3. ``scattering``: `akv.packing.scatter` writes the staged bytes into the paged cache,
   whatever its layout and block size (on the poller's thread, or for a large DRAM pull while
   other packed pulls are in flight in the staging pool's worker thread); on CUDA one kernel
   launch over the pull's runs (`akv.packing.scatter_segment`, `akv.kernels`), queued, the pull
   done once the event recorded after it fired (no host synchronization); the staging range is freed (exactly once, also on failure or abort:
   then only once NIXL released every read that may still land in it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from akv import exposure, kernels, shm
from akv.backends import Backend, Reaper, XferHandle, mem_type
from akv.errors import (
    AkvError,
    BackPressureError,
    ConfigError,
    IncompatiblePeerError,
    PeerLostError,
    TransferError,
)
from akv.geometry.cache import CacheSpec
from akv.kernels import RunCopier
from akv.metrics import no_count
from akv.packing import (
    DIR_WORDS,
    Arena,
    CacheViews,
    Section,
    find,
    find_pending,
    scatter,
    scatter_segment,
    sections,
)
from akv.protocol.messages import PackInfo
from akv.runtime.paths import Failed, Outcome, PathName, Pending
from akv.runtime.paths.read import CheckBatcher, CheckPool, NixlRead, RankCheck, copy_bucket

if TYPE_CHECKING:
    import torch

    from akv.plan import Prepared

__all__ = [
    "AUTO_DESCRIPTORS",
    "AUTO_RUN_BYTES",
    "DEVICE_AUTO_DESCRIPTORS",
    "DEVICE_AUTO_RUN_BYTES",
    "DescPost",
    "Item",
    "PackedLink",
    "PackedRead",
    "StagingPool",
    "desc_rows",
    "plan_runs",
    "scatter_items",
    "staged_bytes",
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

#: DRAM pulls of at least this many bytes are scattered in the staging pool's worker thread
#: while other packed pulls are in flight (alone, a pull scatters on the poller's thread: the
#: hand-off costs more than it saves then, 2.0 against 2.4 GB/s on hnd_2->1_frag).
WORKER_BYTES = 32 << 20

#: A prefill rank whose directory says the request's packed copy is still being gathered on
#: the device (`akv.packing.PackDirectory.mark_pending`) is looked up again every
#: `PENDING_RETRY_S` for up to `PENDING_WAIT_S` from the pull's start before the pull reads
#: the paged blocks instead: a 64 MiB gather takes well under a millisecond on an H100, the
#: direct read of a fragmented per-layer request there 23 ms (4,096 descriptors, docs/gpu.md).
PENDING_WAIT_S = 0.02
PENDING_RETRY_S = 0.0002

#: Bytes of one directory bucket.
DIR_BUCKET_BYTES = exposure.SLOTS * DIR_WORDS * 8


class StagingPool:
    """The decode side's registered staging area for packed reads (on the caches' device)."""

    def __init__(self, size: int, like: torch.Tensor, copy_with: str = "auto") -> None:
        import torch

        if size < 256:
            raise ConfigError(f"pack_staging_bytes must be >= 256, got {size}")
        self.arena = Arena(size)
        self.tensor = torch.empty(self.arena.size, dtype=torch.uint8, device=like.device)
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


@dataclass(frozen=True, slots=True)
class PackedLink:
    """A prefill rank that packs: its agent, pool and prepared directory."""

    rank: int
    agent: str
    pack: PackInfo
    directory: RankCheck


@dataclass(frozen=True, slots=True)
class DescPost:
    """One READ of a packed copy from one prefill rank: ``(addr, len, device)`` rows."""

    rank: int
    agent: str
    local: npt.NDArray[np.int64]
    local_mem: str
    remote: npt.NDArray[np.int64]
    remote_mem: str

    def post(self, backend: Backend, notice: bytes) -> XferHandle:
        """Post the READ."""
        return backend.read_descs(
            self.agent, self.local, self.local_mem, self.remote, self.remote_mem, notice
        )


def directory_check(backend: Backend, agent: str, pack: PackInfo, *, shared: bool = True) -> RankCheck:
    """A prefill rank's packed-copy directory, prepared (one descriptor per bucket), and
    mapped read-only where the rank is on this host and offers it (``shared``; `akv.shm`:
    lookups then copy the bucket instead of READing it)."""
    table = np.array(
        [[pack.directory_addr, DIR_BUCKET_BYTES, 0, DIR_BUCKET_BYTES, pack.directory_buckets]], dtype=np.int64
    )
    shape = (pack.directory_buckets, exposure.SLOTS, DIR_WORDS)
    mapped = shm.open_table(pack.directory_share, shape) if shared else None
    return RankCheck(backend.prep(agent, table, "DRAM"), pack.directory_buckets, mapped)


def copy_entries(table_bucket: npt.NDArray[np.int64], slot: npt.NDArray[np.int64], tries: int = 8) -> None:
    """Copy a directory bucket from a prefill rank's directory in shared memory: each row's
    tag word first (`copy_bucket`; the prefill writes it last), then its fields, read again
    until two reads agree (up to ``tries``): fields that did not change between their two
    reads all held those values at one moment between them, so an entry never pairs one
    write's generation with another write's offset. A bucket still changing after that
    reads as empty (the pull then finds no copy there, as when the rank's pool was full)."""
    copy_bucket(table_bucket, slot)
    for _ in range(tries):
        again = table_bucket[:, 1:].copy()
        if np.array_equal(again, slot[:, 1:]):
            return
        slot[:, 1:] = again
    slot[:, 0] = 0


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
    device memory)."""
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
    small = prepared.bytes < run_bytes * prepared.descriptors
    return small and prepared.descriptors > threshold


@dataclass(frozen=True, slots=True)
class Item:
    """One (group, component, prefill rank) share of a pull: where it is staged and where its
    tokens go."""

    group: int
    component: int
    rank: int
    local_units: range
    remote_units: range
    first: int  # first token read, in the packed copy
    tokens: int
    offset: int  # in the pull's staging range
    nbytes: int
    blocks: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]


def plan_runs(
    local_spec: CacheSpec,
    remote_spec: CacheSpec,
    prepared: Prepared,
    prefill_tp: int,
    ranks: Collection[int],
    request_id: str,
) -> tuple[
    list[Item],
    dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]],
    dict[int, int],
]:
    """How a pull's packed copies land in its staging range, the same on both sides (the
    decode rank reads them, or a prefill rank writes its own in push mode): the items to
    scatter, and per prefill rank in ``ranks`` its runs (offset in the pull's staging range,
    offset in the rank's packed copy, bytes) and the size of its packed copy."""
    lc, rc, p = local_spec, remote_spec, prepared
    counts = list(p.remote_counts)
    layout: dict[int, dict[tuple[int, int], Section]] = {}
    sizes: dict[int, int] = {}
    for rank in ranks:
        secs, sizes[rank] = sections(rc, rank, prefill_tp, counts)
        layout[rank] = {(s.group, s.component): s for s in secs}
    gindex = {g.name: i for i, g in enumerate(lc.groups)}
    runs: dict[int, tuple[list[int], list[int], list[int]]] = {r: ([], [], []) for r in ranks}
    items: list[Item] = []
    at = 0
    for read in p.reads.detail:
        gi = gindex[read.group]
        ch = p.chunks[gi]
        if not ch.size or read.remote_rank not in layout:
            continue
        lg, rg = lc.groups[gi], rc.groups[gi]
        ci = next(i for i, c in enumerate(lg.components) if c.name == read.component)
        sec = layout[read.remote_rank][(gi, ci)]
        if lg.tokens:
            bl, br = lg.block_size, rg.block_size
            g = min(bl, br)
            pos0 = (
                ch.pattern.astype(np.int64) * g
                if ch.pattern is not None and bl > br
                else np.zeros(ch.size, np.int64)
            )
        else:
            g, pos0 = 1, np.zeros(ch.size, np.int64)
        tokens = ch.size * g
        blocks = np.repeat(ch.local.astype(np.int64), g)
        positions = np.repeat(pos0, g) + np.tile(np.arange(g, dtype=np.int64), ch.size)
        units = len(read.remote_units)
        nbytes = units * tokens * sec.layers * sec.run
        items.append(
            Item(
                gi,
                ci,
                read.remote_rank,
                read.local_units,
                read.remote_units,
                ch.offset,
                tokens,
                at,
                nbytes,
                blocks,
                positions,
            )
        )
        start = sec.offset + (read.remote_units.start - sec.units.start) * sec.unit_bytes
        if ch.offset + tokens > sec.tokens:
            raise TransferError(f"request {request_id!r}: tokens read lie outside the packed copy")
        local, remote, lengths = runs[read.remote_rank]
        if ch.offset == 0 and tokens == sec.tokens:
            local.append(at)
            remote.append(start)
            lengths.append(nbytes)
        else:  # a suffix of the tokens: one run per unit and layer
            run, layer = tokens * sec.run, sec.tokens * sec.run
            for k in range(units):
                for i in range(sec.layers):
                    local.append(at + (k * sec.layers + i) * run)
                    remote.append(start + k * sec.unit_bytes + i * layer + ch.offset * sec.run)
                    lengths.append(run)
        at += -(-nbytes // 256) * 256
    out = {
        r: (np.array(a, dtype=np.int64), np.array(b, dtype=np.int64), np.array(n, dtype=np.int64))
        for r, (a, b, n) in runs.items()
    }
    return items, out, sizes


def staged_bytes(items: Sequence[Item]) -> int:
    """Bytes of the staging range a pull's items take (each starts 256-aligned)."""
    return items[-1].offset + items[-1].nbytes if items else 0


def desc_rows(
    addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], device: int
) -> npt.NDArray[np.int64]:
    """``(addr, len, device)`` rows."""
    out = np.empty((len(addrs), 3), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2] = addrs, lengths, device
    return out


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


class PackedRead:
    """One pull on the packed path (see the module)."""

    path: PathName = "packed"

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
        checks: Mapping[int, RankCheck | None] | None,
        check_pool: CheckPool | None,
        dir_pool: CheckPool,
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
        self.read: NixlRead | None = None
        self.fallback: NixlRead | None = None
        self._descriptors = 0  # posted to read the packed copies
        #: seconds of each stage, for benchmarks: the directory lookup, the reads with their
        #: exposure check, the scatter
        self.lookup_s = self.read_s = self.scatter_s = 0.0
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
        self._landed = False
        self._aborted = False
        self._job: concurrent.futures.Future[float] | None = None  # a scatter in the worker
        self._active = False  # counted in staging.active
        self._verified = False  # the reads are in and checked: scatter on the next poll
        self._event: Any = None  # recorded after a CUDA scatter: done when it fired

    @property
    def descriptors(self) -> int:
        """Descriptors the pull posted: the packed copies' runs, or the direct read's after a
        fallback."""
        return self.prepared.descriptors if self.fallback is not None else self._descriptors

    def take_notified(self) -> frozenset[int]:
        """Those of its reads (the direct read's after a fallback)."""
        read = self.fallback if self.fallback is not None else self.read
        return read.take_notified() if read is not None else frozenset()

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
        self._active = True
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
        if self.fallback is not None:
            outcome = self.fallback.poll()
            if outcome is None:
                self._forget()
            return outcome
        if self.read is None:
            changed = False
            for handle, rank in list(self._lookups.items()):
                try:
                    done = self.backend.state(handle) == "DONE"
                except TransferError as exc:
                    return Failed(exc, rank)
                if done:
                    del self._lookups[handle]
                    self.reaper.drop(handle)
                    changed = True
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
        outcome = self.read.poll()
        if outcome is not None:
            return outcome
        if not self._verified:
            self._verified = True
            self.read_s = time.perf_counter() - self._since
        return self._scatter()

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
        total = staged_bytes(self._items)  # the span: items start 256-aligned
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

    def _scatter(self) -> Outcome:
        """Write the verified staged bytes into the paged cache (DRAM pulls of at least
        `WORKER_BYTES` while other packed pulls are in flight: in the staging pool's worker
        thread, so the poller runs on; CUDA: queued, done once its event fired); free the
        staging range once done."""
        if self._event is not None:
            try:
                if not self._event.query():
                    return Pending()
            except RuntimeError as exc:  # a CUDA error: this pull fails, the consumer runs on
                return self._scattered(_raise, exc)
            self._event = None
            return self._scattered(lambda: self.scatter_s)
        if self._job is None:
            base = self._staged
            if base is None:  # pragma: no cover - the reads were posted into a staging range
                return Failed(TransferError(f"request {self.request_id!r} has no staging range"))
            total = sum(item.nbytes for item in self._items)
            alone = self.staging.active < 2
            if self.staging.tensor.is_cuda:
                return self._queue_scatter(base)
            if self.staging.copier is not None or total < WORKER_BYTES or alone:
                return self._scattered(self._scatter_all, base)
            self._job = self.staging.worker().submit(self._scatter_all, base)
            self._job.add_done_callback(lambda _: self.staging.wake())
        if not self._job.done():
            return Pending()
        job, self._job = self._job, None
        return self._scattered(job.result)

    def _queue_scatter(self, base: int) -> Outcome:
        """Queue the scatter on the device's current stream and record its event (no wait)."""
        import torch

        try:
            self.scatter_s = self._scatter_all(base)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.staging.tensor.device))
        except (RuntimeError, ValueError, IndexError) as exc:
            with contextlib.suppress(RuntimeError):  # what was queued may still read the staging
                torch.cuda.current_stream(self.staging.tensor.device).synchronize()
            return self._scattered(_raise, exc)
        self._event = event
        return Pending(True)

    def _scattered(self, run: Callable[..., float], *args: Any) -> Outcome:
        """The outcome of the scatter ``run(*args)`` (seconds it took, or an error)."""
        try:
            self.scatter_s = run(*args)
        except (RuntimeError, ValueError, IndexError) as exc:
            self._free_staging()
            return Failed(TransferError(f"scattering request {self.request_id!r} failed: {exc}"))
        self._free_staging()
        self._forget()
        return None

    def _forget(self) -> None:
        """Drop the prepared lists it holds (the links' directories, the checks, an unused
        direct read): a finished op must not keep a replaced agent alive."""
        self._uncount()
        self.links = {}
        self.checks = {}
        if self.direct is not None and self.direct is not self.fallback:
            self.direct._forget()
            self.direct = None

    def _scatter_all(self, base: int) -> float:
        """Scatter every item staged from ``base`` (on CUDA: queue it); returns the seconds
        it took."""
        return scatter_items(self.staging, self.views, self._items, base)

    # -- fallback and cleanup ---------------------------------------------------------------

    def _uncount(self) -> None:
        """No longer a packed pull in flight (once)."""
        if self._active:
            self._active = False
            self.staging.active -= 1

    def _fall_back(self, why: str) -> Failed | None:
        """Read the paged blocks instead (the read path), if the pull may."""
        if self.direct is None:
            return Failed(TransferError(f"request {self.request_id!r} cannot be read packed: {why}"))
        self.path = "read"
        self.fallback = self.direct
        self._uncount()  # it scatters nothing now
        return self.fallback.start()

    def _on_landed(self) -> None:
        self._landed = True
        if self._aborted:
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
        self._aborted = True
        if self._job is not None:  # a scatter in flight: none writes after this returns
            concurrent.futures.wait([self._job])
            self._job = None
        if self._event is not None:  # a CUDA scatter queued: none writes after this returns
            with contextlib.suppress(RuntimeError):
                self._event.synchronize()
            self._event = None
            self._free_staging()
        for handle, rank in list(self._lookups.items()):
            slot = self._dir_slots.pop(rank, None)
            then: Any = None
            if slot is not None:

                def then(slot: int = slot, pool: CheckPool = self.dir_pool) -> None:
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


def _raise(exc: BaseException) -> float:
    raise exc


def error_for(ranks: Sequence[int], engine: str) -> AkvError:
    """The error for ``transfer="packed"`` against prefill ranks that do not pack."""
    return IncompatiblePeerError(
        f"prefill ranks {sorted(ranks)} of engine {engine!r} keep no packed copies: start them with "
        "transfer='packed' (--transfer packed), or pull with transfer='auto' or 'direct'",
        ("transfer",),
    )
