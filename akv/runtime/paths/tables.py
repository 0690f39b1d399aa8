"""Reads of a prefill rank's tables: the exposure check, and the packed directory's lookup.

A prefill rank publishes two small registered tables, both bucketed by the request's hash
(`akv.exposure`, `akv.packing.PackDirectory`): the *exposure table*, which says which request
and generation pins which blocks, and, where it packs, the *directory* of its packed copies.
A decode rank reads one bucket of a table per request, into a slot of a registered
`SlotPool`, or, where the rank is on this host and shares the table (`akv.shm`), loads the
bucket from memory (`RemoteTable.words`, `RemoteTable.table`).

The exposure check (`unsafe`) is what makes a pull's success safe: the bucket, read once the
pull's data was in place, must still hold the request's exposure on every prefill rank read
from. The bucket READs of the pulls of one poller round go out together (`CheckBatcher`): per
prefill rank one READ of every waiting pull's bucket, carrying one "done" notice that names
them all; checks made in shared memory post no READ, and their notices leave on one
background READ (`flush_after_notice`) that no pull waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from akv import exposure, shm
from akv.backends import Backend, DlistHandle, Reaper, XferHandle
from akv.errors import AkvError, BackPressureError, ConfigError, TransferError, UnsafeReadError
from akv.metrics import no_count
from akv.packing import DIR_WORDS
from akv.protocol.messages import merge_done_notices

if TYPE_CHECKING:
    from akv.protocol.messages import PackInfo, RankInfo

__all__ = [
    "BATCH_MAX",
    "CheckBatch",
    "CheckBatcher",
    "CheckTicket",
    "RemoteTable",
    "SlotPool",
    "copy_bucket",
    "copy_entries",
    "flush_after_notice",
    "unsafe",
]

#: Most pulls one check READ (and its notice) stands for.
BATCH_MAX = 64
#: Bytes of one bucket of a rank's exposure table, and of its packed directory.
EXPOSURE_BUCKET_BYTES = exposure.SLOTS * exposure.SLOT_WORDS * 8
DIR_BUCKET_BYTES = exposure.SLOTS * DIR_WORDS * 8


def unsafe(
    buckets: Iterable[tuple[int, npt.NDArray[Any] | tuple[int, int, int] | None]],
    request_id: str,
    remote_ids: npt.NDArray[np.int32],
    read_ids: npt.NDArray[np.int32],
    generation: int | Mapping[int, int],
    packed: bool = False,
    token_hash: int | None = None,
    fingerprint: int | None = None,
) -> UnsafeReadError | None:
    """The exposure check of a pull over the buckets read from each prefill rank (``(rank,
    bucket)`` pairs, read once its bytes were in place; a bucket in shared memory is given as
    the request's slot, `akv.exposure.shared_slot`'s answer): None if every one still holds the
    request's exposure, else the first typed error. ``generation``: one for every rank, or
    per rank (a packed read binds to each rank's own); ``packed``, ``token_hash`` and
    ``fingerprint``: see `akv.exposure.verify`."""
    for rank, bucket in buckets:
        gen = generation if isinstance(generation, int) else generation.get(rank, 0)
        error = exposure.verify(
            bucket,
            request_id,
            remote_ids,
            prefill_rank=rank,
            read_ids=read_ids,
            generation=gen,
            packed=packed,
            token_hash=token_hash,
            fingerprint=fingerprint,
        )
        if error is not None:
            return error
    return None


class SlotPool:
    """Registered landing slots for the buckets of remote tables (one per bucket READ in
    flight), and one more, ``scratch``, never handed out and never read (in the consumer's
    exposure-check pool, `flush_after_notice` lands there)."""

    def __init__(self, size: int, words: int = exposure.SLOT_WORDS) -> None:
        if size < 1:
            raise ConfigError(f"max_checks must be >= 1, got {size}")
        self.array = np.zeros((size + 1, exposure.SLOTS, words), dtype=np.int64)
        self.scratch = size
        self._free = list(range(size - 1, -1, -1))
        self.dlist: DlistHandle = None

    def table(self) -> npt.NDArray[np.int64]:
        """The strided table of the slots (one descriptor per slot)."""
        size = self.array[0].nbytes
        return np.array([[self.array.ctypes.data, size, 0, size, len(self.array)]], dtype=np.int64)

    def acquire(self) -> int:
        """A free slot; [`BackPressureError`][akv.errors.BackPressureError] if every one is in use."""
        if not self._free:
            raise BackPressureError(
                f"{self.scratch} exposure checks already in flight: pull again later, or raise max_checks"
            )
        slot = self._free.pop()
        self.array[slot, :, 0] = 0
        return slot

    def release(self, slot: int) -> None:
        """Return a slot (only once no read can still land in it)."""
        self._free.append(slot)


@dataclass(slots=True, eq=False)
class RemoteTable:
    """A prefill rank's table (its exposure table, or its packed directory): the prepared
    list of its buckets (one descriptor each) and their count, and ``table``, the table itself
    mapped read-only where the rank is on this host (`akv.shm`: a bucket is then loaded from
    memory instead of READ). ``released``: the list was given back (the link dropped), nothing
    may be posted with it any more."""

    dlist: DlistHandle
    buckets: int
    table: npt.NDArray[np.int64] | None = None
    released: bool = False
    words: memoryview | None = field(init=False, default=None)  # the table's (`exposure.words`)

    def __post_init__(self) -> None:
        if self.table is not None:
            self.words = exposure.words(self.table)

    def load(self, token_hash: int) -> tuple[int, int, int] | None:
        """The request's slot, loaded from the table in shared memory (`exposure.shared_slot`;
        only where ``words`` is set: elsewhere the check READs the bucket)."""
        words = self.words
        if words is None:
            raise TransferError("this prefill rank's exposure table is not in shared memory: READ its bucket")
        return exposure.shared_slot(words, token_hash, (token_hash % self.buckets) * exposure.BUCKET_WORDS)

    @classmethod
    def of_exposures(cls, backend: Backend, agent: str, info: RankInfo, *, shared: bool) -> RemoteTable:
        """The exposure table of the prefill rank ``info`` describes, prepared on its agent
        (and mapped, where ``shared`` and the rank offers it on this host)."""
        rows = np.array(
            [[info.exposure_addr, EXPOSURE_BUCKET_BYTES, 0, EXPOSURE_BUCKET_BYTES, info.exposure_buckets]],
            dtype=np.int64,
        )
        shape = (info.exposure_buckets, exposure.SLOTS, exposure.SLOT_WORDS)
        mapped = shm.open_table(info.exposure_share, shape) if shared else None
        return cls(backend.prep(agent, rows, "DRAM"), info.exposure_buckets, mapped)

    @classmethod
    def of_directory(
        cls, backend: Backend, agent: str, pack: PackInfo, *, shared: bool = True
    ) -> RemoteTable:
        """A prefill rank's packed-copy directory, prepared (and mapped, as `exposure`: lookups
        then copy the bucket with `copy_entries` instead of READing it)."""
        rows = np.array(
            [[pack.directory_addr, DIR_BUCKET_BYTES, 0, DIR_BUCKET_BYTES, pack.directory_buckets]],
            dtype=np.int64,
        )
        shape = (pack.directory_buckets, exposure.SLOTS, DIR_WORDS)
        mapped = shm.open_table(pack.directory_share, shape) if shared else None
        return cls(backend.prep(agent, rows, "DRAM"), pack.directory_buckets, mapped)


def copy_bucket(table_bucket: npt.NDArray[np.int64], slot: npt.NDArray[np.int64]) -> None:
    """Copy a bucket from a prefill rank's table in shared memory into a check slot: every
    slot's token first, then the fingerprints and generations, in that order (x86-64 keeps
    loads in program order, and `akv.shm` maps tables only there). A prefill rank writes a
    slot's token last when it publishes and clears it first, so a token read as EXPOSED comes
    with the fingerprint and generation of that exposure or of a later one, never of an
    earlier one; a copy in one pass could pair a new token with an old generation."""
    slot[:, 0] = table_bucket[:, 0]
    slot[:, 1:] = table_bucket[:, 1:]


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


def flush_after_notice(
    backend: Backend, reaper: Reaper, pool: SlotPool, check: RemoteTable, notice: bytes = b""
) -> XferHandle | None:
    """Right after notices to a prefill rank, READ bucket 0 of its exposure table into the
    pool's scratch slot, in the background (the reaper releases the handle once it is done).

    NIXL ends every transfer with an endpoint flush, and after a notice (an active message on
    UCX's ``tcp`` lane) that flush waits for the prefill process to acknowledge, that is for
    the rank's poller to progress its agent next: up to its sleep between polls. Posted right
    behind the notices, this READ's flush is acknowledged when the rank handles them, so the
    next pull's first READ finds nothing to wait for (``akv bench --only sparse_pulls``: a small pull
    every 0.3 s took 12 ms without, 1 ms with). It must follow the last notice (one posted
    before a notice does not help the reads after it). A failure to post only costs that wait.

    ``notice``: the READ carries it (the "done" notices of checks made in shared memory,
    which post no READ of their own). Returns the READ's handle (held by the reaper until it
    finished: `Reaper.pending`), None if it could not be posted."""
    if check.released:
        return None
    one = np.zeros(1, dtype=np.int32)
    try:
        handle = backend.read(pool.dlist, one + pool.scratch, check.dlist, one, notice)
    except AkvError:
        return None
    reaper.drop_background(handle)
    return handle


class CheckTicket:
    """One pull's exposure check from one prefill rank: its landing slot, the bucket it
    reads and its "done" notice; ``batch`` is the READ it went out with (None: still waiting
    in the `CheckBatcher`)."""

    __slots__ = ("backend", "batch", "bucket", "check", "count", "notice", "reaper", "slot")

    def __init__(
        self,
        backend: Backend,
        reaper: Reaper,
        check: RemoteTable,
        slot: int,
        bucket: int,
        notice: bytes,
        count: Callable[[str, int], None] = no_count,
    ) -> None:
        self.backend, self.reaper, self.check = backend, reaper, check
        self.slot, self.bucket, self.notice = slot, bucket, notice
        self.count = count  # the decode rank's counters (the READ it goes out with counts once)
        self.batch: CheckBatch | None = None

    def poll(self) -> bool | AkvError:
        """True once its bucket landed, an error if the READ failed, else False."""
        return False if self.batch is None else self.batch.poll()


class CheckBatch:
    """One check READ standing for several pulls (see `CheckBatcher`). The READ's handle is
    released once, when NIXL reports it finished; a pull that gives up on it before then
    leaves its slot to the batch, which frees it only once nothing can land there any more."""

    def __init__(
        self, tickets: list[CheckTicket], pool: SlotPool, handle: XferHandle, error: AkvError | None
    ):
        # the pulls still waiting on it, by id: a batch holds no reference to its tickets
        # (each ticket holds its batch), so neither is part of a reference cycle
        self._waiting = {id(ticket) for ticket in tickets}
        self.pool = pool
        self.handle = handle
        self._error = error  # posting failed (nothing in flight), or the READ failed
        self._done = error is not None
        self._orphans: list[int] = []  # slots of pulls that gave up while the READ ran
        first = tickets[0]
        self.backend, self.reaper = first.backend, first.reaper
        for ticket in tickets:
            ticket.batch = self

    def poll(self) -> bool | AkvError:
        """True once the READ is done, its error if it failed, else False."""
        if not self._done:
            try:
                done = self.backend.state(self.handle) == "DONE"
            except TransferError as exc:
                self._error, done = exc, True
            if done:
                self._finished()
        if self._error is not None:
            return self._error
        return self._done

    def _finished(self) -> None:
        self._done = True
        self.reaper.drop(self.handle, done=True)  # DONE or in error: nothing more lands
        for slot in self._orphans:
            self.pool.release(slot)
        self._orphans.clear()

    def leave(self, ticket: CheckTicket) -> None:
        """A pull gives up on its check: its slot is freed now if nothing can land there,
        else once the READ finishes (the last pull to leave hands the READ to the reaper)."""
        self._waiting.discard(id(ticket))
        if self._done:
            self.pool.release(ticket.slot)
            return
        self._orphans.append(ticket.slot)
        if not self._waiting:
            self._done = True  # the reaper owns the handle from here
            orphans, self._orphans = self._orphans, []

            def free() -> None:
                for slot in orphans:
                    self.pool.release(slot)

            self.reaper.drop(self.handle, free, owner=self)


class CheckBatcher:
    """Exposure checks waiting for the end of the poller's round: `post` sends, per prefill
    rank (and agent), one READ of every waiting pull's bucket, each into the pull's own slot,
    carrying one "done" notice naming them all.

    Each pull's check is queued only once its data reads are done, and the prefill rank
    learns of a pull only through the notice that travels behind the READ of its bucket: as
    with one check READ per pull, the bucket each pull verifies was read after its data."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self._waiting: dict[tuple[int, int], list[CheckTicket]] = {}
        # "done" notices of checks made in shared memory, per prefill rank (and agent)
        self._notices: dict[
            tuple[int, int], tuple[Backend, Reaper, RemoteTable, Callable[[str, int], None], list[bytes]]
        ] = {}
        self._count = 0
        #: checks queued since the batcher was made (a poller sees whether a poll queued one)
        self.added = 0
        #: the background READs that carried queued notices, with their reaper (see `sent`)
        self._carriers: list[tuple[Reaper, XferHandle]] = []

    def __len__(self) -> int:
        """Checks waiting to be posted."""
        return self._count

    def add(self, ticket: CheckTicket) -> None:
        """Queue a check for the next `post`."""
        self._waiting.setdefault((id(ticket.backend), id(ticket.check)), []).append(ticket)
        self._count += 1
        self.added += 1

    @property
    def notices(self) -> bool:
        """True while "done" notices wait for the next `post`."""
        return bool(self._notices)

    @property
    def sent(self) -> bool:
        """True once every background READ that carried queued notices finished (their
        notices left: NIXL sends a READ's notice once the READ is done)."""
        self._carriers = [(reaper, h) for reaper, h in self._carriers if reaper.pending(h)]
        return not self._carriers

    def notify(
        self,
        backend: Backend,
        reaper: Reaper,
        check: RemoteTable,
        notice: bytes,
        count: Callable[[str, int], None],
    ) -> None:
        """Queue the "done" notice of a check made in shared memory (its bucket was copied
        already): the next `post` sends it, merged with the others to that rank, on one
        background READ (`flush_after_notice`); no pull waits for it."""
        entry = self._notices.get((id(backend), id(check)))
        if entry is None:
            entry = self._notices[(id(backend), id(check))] = (backend, reaper, check, count, [])
        entry[4].append(notice)

    def withdraw(self, ticket: CheckTicket) -> bool:
        """Take a check back before it is posted; False if it was posted already."""
        tickets = self._waiting.get((id(ticket.backend), id(ticket.check)))
        if tickets is None or ticket not in tickets:
            return False
        tickets.remove(ticket)
        self._count -= 1
        return True

    def post(self) -> None:
        """Post every check waiting (a READ that cannot be posted fails the pulls of that
        batch, through their tickets)."""
        waiting, self._waiting, self._count = self._waiting, {}, 0
        notices, self._notices = self._notices, {}
        for backend, reaper, check, count, queued in notices.values():
            for at in range(0, len(queued), BATCH_MAX):
                chunk = queued[at : at + BATCH_MAX]
                carrier = flush_after_notice(backend, reaper, self.pool, check, merge_done_notices(chunk))
                if carrier is None:  # the rank was unlinked, or the READ failed: released by lease
                    count("notices_dropped", len(chunk))
                    continue
                count("xfers_notice", 1)
                if reaper.pending(carrier):
                    self._carriers.append((reaper, carrier))
        for queue in waiting.values():
            for at in range(0, len(queue), BATCH_MAX):
                tickets = queue[at : at + BATCH_MAX]
                first = tickets[0]
                handle: XferHandle = None
                error: AkvError | None = None
                try:
                    handle = first.backend.read(
                        self.pool.dlist,
                        np.fromiter((t.slot for t in tickets), np.int32, len(tickets)),
                        first.check.dlist,
                        np.fromiter((t.bucket for t in tickets), np.int32, len(tickets)),
                        merge_done_notices([t.notice for t in tickets]),
                    )
                    first.count("xfers_check", 1)
                except AkvError as exc:
                    error = exc
                CheckBatch(tickets, self.pool, handle, error)
