"""The read path: NIXL READs of the paged runs, then the exposure check.

A pull reads in two stages: ``reading`` (one READ per prefill rank, of the plan's runs) and
``checking`` (one small READ per prefill rank read from, of the exposure-table bucket that
proves the blocks were still exposed when the data reads completed; it carries the "done"
notice, so the prefill rank cannot release before the check was read). Where the rank is on
this host and shares its table (`akv.shm`, `RankCheck.table`), the check loads the request's
slot from memory instead (`akv.exposure.shared_slot`), and its notice waits in the `CheckBatcher` for a background READ
(`flush_after_notice`) that no pull waits for.

Checks wait in the poller's `CheckBatcher` until the end of its round: then each prefill
rank gets one check READ for all the pulls waiting on it, carrying one notice that names them
all (many small pulls in flight post one check each round, not one each).

Once the notice is sent, the consumer's poller posts one more small READ to each rank
notified, in the background (`flush_after_notice`): the next pull's first READ then does
not wait for that rank's poller.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from akv import exposure
from akv.backends import Backend, DlistHandle, Reaper, XferHandle
from akv.errors import AkvError, BackPressureError, ConfigError, PeerLostError, TransferError
from akv.metrics import no_count
from akv.protocol.messages import merge_done_notices
from akv.runtime.paths import Failed, Outcome, PathName, Pending, unsafe

__all__ = [
    "CheckBatch",
    "CheckBatcher",
    "CheckPool",
    "CheckTicket",
    "NixlRead",
    "Post",
    "RankCheck",
    "ReadPost",
    "SettledRead",
    "flush_after_notice",
]

#: Most pulls one check READ (and its notice) stands for.
BATCH_MAX = 64


class CheckPool:
    """Registered landing slots for exposure-table buckets (one per check read in flight),
    and one more, ``scratch``, never handed out and never read (the consumer's check pool:
    `flush_after_notice` lands there)."""

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


def flush_after_notice(
    backend: Backend, reaper: Reaper, pool: CheckPool, check: RankCheck, notice: bytes = b""
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


def copy_bucket(table_bucket: npt.NDArray[np.int64], slot: npt.NDArray[np.int64]) -> None:
    """Copy a bucket from a prefill rank's table in shared memory into a check slot: every
    slot's token first, then the fingerprints and generations, in that order (x86-64 keeps
    loads in program order, and `akv.shm` maps tables only there). A prefill rank writes a
    slot's token last when it publishes and clears it first, so a token read as EXPOSED comes
    with the fingerprint and generation of that exposure or of a later one, never of an
    earlier one; a copy in one pass could pair a new token with an old generation."""
    slot[:, 0] = table_bucket[:, 0]
    slot[:, 1:] = table_bucket[:, 1:]


class CheckTicket:
    """One pull's exposure check from one prefill rank: its landing slot, the bucket it
    reads and its "done" notice; ``batch`` is the READ it went out with (None: still waiting
    in the `CheckBatcher`)."""

    __slots__ = ("backend", "batch", "bucket", "check", "count", "notice", "reaper", "slot")

    def __init__(
        self,
        backend: Backend,
        reaper: Reaper,
        check: RankCheck,
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
        self, tickets: list[CheckTicket], pool: CheckPool, handle: XferHandle, error: AkvError | None
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

    def __init__(self, pool: CheckPool) -> None:
        self.pool = pool
        self._waiting: dict[tuple[int, int], list[CheckTicket]] = {}
        # "done" notices of checks made in shared memory, per prefill rank (and agent)
        self._notices: dict[
            tuple[int, int], tuple[Backend, Reaper, RankCheck, Callable[[str, int], None], list[bytes]]
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
        check: RankCheck,
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


@dataclass(slots=True)
class ReadPost:
    """One READ of a request from one prefill rank: prepared lists and indices."""

    rank: int
    local: DlistHandle
    local_idx: npt.NDArray[np.int32]
    remote: DlistHandle
    remote_idx: npt.NDArray[np.int32]

    def post(self, backend: Backend, notice: bytes) -> XferHandle:
        """Post the READ."""
        return backend.read(self.local, self.local_idx, self.remote, self.remote_idx, notice)


class Post(Protocol):
    """One READ of a request from one prefill rank, ready to post."""

    @property
    def rank(self) -> int: ...

    def post(self, backend: Backend, notice: bytes) -> XferHandle: ...


@dataclass(slots=True, eq=False)
class RankCheck:
    """Where a prefill rank's exposure table is: its prepared list and bucket count, and
    ``table``, the table itself mapped read-only where the rank is on this host (`akv.shm`:
    the check then loads the request's slot instead of READing the bucket). ``released``: the list was given
    back (the link dropped), nothing may be posted with it any more."""

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


class SettledRead:
    """The op of a pull the read path settled where it was launched (the session's inline
    read: every READ done at its first poll, every check a load from a table in shared
    memory): nothing of it is in flight, so polling, aborting and asking it cost nothing.
    ``ranks``: the prefill ranks read from; ``data_s`` and ``check_s`` as `NixlRead`'s."""

    __slots__ = ("check_s", "data_s", "ranks")
    path: PathName = "read"

    def __init__(self, ranks: frozenset[int], data_s: float, check_s: float) -> None:
        self.ranks, self.data_s, self.check_s = ranks, data_s, check_s

    def poll(self) -> Outcome:
        return None

    def take_notified(self) -> frozenset[int]:
        return frozenset()

    def abort(self) -> None:
        return None


class NixlRead:
    """One pull on the read path (see the module). ``checks`` None: no exposure check, the
    data reads carry the notice. ``generation``: one for every rank or per rank; ``packed``:
    the posts read packed copies (`akv.exposure.verify`); ``on_settled``: called once no data
    read can still land (at once, or after an abort, once NIXL released them all); ``batcher``:
    the checks wait there for the poller's round (None: each is posted at once); ``count``:
    the decode rank's counters (`akv.Metrics.inc`: data and check READs posted);
    ``notices``: where the "done" notices of checks made in shared memory wait for the
    poller's round (default ``batcher``; None with no batcher: each is posted at once)."""

    path: PathName = "read"

    def __init__(
        self,
        backend: Backend,
        reaper: Reaper,
        posts: Sequence[Post],
        *,
        request_id: str,
        remote_ids: npt.NDArray[np.int32],
        read_ids: npt.NDArray[np.int32],
        notice: bytes,
        checks: Mapping[int, RankCheck | None] | None,
        pool: CheckPool | None,
        generation: int | Mapping[int, int] = 0,
        packed: bool = False,
        on_settled: Callable[[], None] | None = None,
        batcher: CheckBatcher | None = None,
        count: Callable[[str, int], None] = no_count,
        fingerprint: int | None = None,
        notices: CheckBatcher | None = None,
        token_hash: int | None = None,
    ) -> None:
        self.backend = backend
        self.reaper = reaper
        self.posts = posts
        self.count = count
        self.request_id = request_id
        self.remote_ids = remote_ids
        self.read_ids = read_ids
        self.notice = notice
        self.checks = checks
        self.pool = pool
        self.generation = generation  # the exposure generation the pull is bound to (0: none)
        self.packed = packed
        self.on_settled = on_settled
        self.batcher = batcher
        # where the notices of checks in shared memory wait (a batcher is falsy while empty)
        self.notices = notices if notices is not None else batcher
        self.fingerprint = fingerprint  # exposure.digest(remote_ids), if the caller has it
        self._hash = token_hash  # exposure.request_hash(request_id), if the caller has it
        self._ranks = frozenset([post.rank for post in posts])
        self._order = sorted(self._ranks)  # the ranks, checked in this order
        self._pending: dict[XferHandle, int] = {}
        self._slots: dict[int, int] = {}  # prefill rank -> check slot
        # prefill rank -> its slot read from the table in shared memory (None: not found)
        self._shared: dict[int, tuple[int, int, int] | None] = {}
        self._tickets: dict[int, CheckTicket] = {}  # prefill rank -> its check (batched)

    # Set on the instance once they change (a pull's op is built on every pull: the class
    # holds the starting values).
    _owner: weakref.ref[object] | None = None  # see owner
    checking = False
    _errored: XferHandle = None
    _aborted = False
    _shared_told: frozenset[int] = frozenset()  # the ranks of those whose notice was queued
    _notified: frozenset[int] = frozenset()  # see take_notified
    _told = False  # the notice went out (its reads are done)
    _first: Outcome = None  # see adopt
    #: seconds of its two stages, for benchmarks: from `start` until the data reads were
    #: seen done, and from then until the exposure check was seen verified
    data_s = 0.0
    check_s = 0.0
    _since = 0.0

    @property
    def owner(self) -> object:
        """Whose handles the reaper holds: this read, or the path wrapping it (which sets
        itself). Held as None for this read itself and by weak reference for a wrapping path
        (which holds this read), so that no pull is a reference cycle (freed as soon as it is
        dropped, not by the garbage collector)."""
        owner = None if self._owner is None else self._owner()
        return self if owner is None else owner

    @owner.setter
    def owner(self, owner: object) -> None:
        self._owner = None if owner is self else weakref.ref(owner)

    @property
    def ranks(self) -> frozenset[int]:
        """The prefill ranks read from: until the exposure check is verified, losing any of
        them (or re-linking it) fails the pull."""
        return self._ranks

    def adopt(
        self,
        pending: Mapping[XferHandle, int],
        since: float,
        first: Outcome = None,
        errored: XferHandle = None,
        notified: frozenset[int] | None = None,
    ) -> None:
        """Take data READs posted already, ``{handle: prefill rank}`` since
        ``time.perf_counter()`` ``since``, as this op's own (instead of `start`, which
        posts them; they were counted when posted): the session's inline read hands over a
        pull it cannot settle at once (`akv.runtime.session`). ``first``: what its poll
        found, which the next `poll` answers without polling again: `Pending` (READs still
        running), or `Failed` with ``errored`` the READ in error. ``notified`` (the data was
        in and the check made, ``first`` its `Failed`): the ranks whose notices it queued."""
        self._pending.update(pending)
        self._since = since
        self._first = first
        if errored is not None:
            self._errored = errored
        if notified is not None:
            self.checking = True
            self._sent(notified)

    def take_notified(self) -> frozenset[int]:
        """The prefill ranks the "done" notice went to since the last call: those of the
        check reads (or, without checks, of the data reads) once they are done."""
        ranks, self._notified = self._notified, frozenset()
        return ranks

    def _sent(self, ranks: frozenset[int]) -> None:
        """The reads carrying the notice to ``ranks`` are done (once: the op may be polled
        again after that)."""
        if not self._told:
            self._told = True
            self._notified = ranks

    def start(self) -> Failed | None:
        """Post the data reads; on failure nothing stays posted."""
        self._since = time.perf_counter()
        notice = b"" if self.checks is not None else self.notice
        backend, pending = self.backend, self._pending
        for post in self.posts:
            try:
                handle = post.post(backend, notice)
            except TransferError as exc:
                if pending:
                    self.count("xfers_data", len(pending))
                self.abort()
                return Failed(exc, post.rank)
            pending[handle] = post.rank
        self.count("xfers_data", len(pending))
        return None

    def poll(self) -> Outcome:
        """Poll the reads in flight; post the checks once the data is in; verify them."""
        if self._first is not None:  # polled already where it was launched (see adopt)
            first, self._first = self._first, None
            return first
        changed = False
        pending = self._pending
        if pending:
            xfer_state = self.backend.state
            for handle, rank in list(pending.items()):
                try:
                    done = xfer_state(handle) == "DONE"
                except TransferError as exc:
                    self._errored = handle  # finished, in error: nothing more of it lands
                    return Failed(exc, rank)
                if done:
                    del pending[handle]
                    self.reaper.drop(handle, done=True)
                    changed = True
            if pending:
                return Pending(changed)
        if not self.checking:
            if self.on_settled is not None:
                self._settle()
            if self.checks is None:
                self._sent(self._ranks)
                self._forget()
                return None
            self.checking = True
            now = time.perf_counter()
            self.data_s, self._since = now - self._since, now
            failed = self._post_checks()
            if failed is not None:
                return failed
            if self._pending:  # check READs posted at once (often done already)
                return self.poll()
            if self._tickets:
                return Pending(True)  # every check waits for the batcher's next post
        elif self._tickets:
            landed = True
            for rank, ticket in self._tickets.items():
                state = ticket.poll()
                if isinstance(state, AkvError):
                    return Failed(state, rank)
                landed &= state
            if not landed:
                return Pending(changed)
            self._tickets.clear()  # the batch is done with them: the slots are this op's again
        self._sent(frozenset(self._slots).union(self._shared_told) if self._slots else self._shared_told)
        error = self._verify()
        if error is not None:
            return Failed(error)
        self.check_s = time.perf_counter() - self._since
        if self._slots:
            self._free_slots()
        self._forget()
        return None

    def _forget(self) -> None:
        """Drop the prepared lists (a finished op must not keep a replaced agent alive)."""
        self.posts = ()
        self.checks = {}

    def _post_checks(self) -> Failed | None:
        """Read the request's exposure-table bucket from every rank read from (with the notice)."""
        checks, pool = self.checks, self.pool
        if checks is None or pool is None:  # no exposure check: nothing to post
            return None
        h = self._hash
        if h is None:
            h = self._hash = exposure.request_hash(self.request_id)
        shared: list[RankCheck] = []  # checks made in shared memory: notices queued at the end
        live = True
        for rank in self._order:
            check = checks.get(rank)
            if check is None or check.released:  # the rank was re-linked (or lost) since the data reads
                return Failed(PeerLostError(f"prefill rank {rank} was re-linked during this pull"), rank)
            if check.words is not None:  # on this host: memory loads, now that the data is in
                found = self._shared[rank] = check.load(h)
                live = live and exposure.live(found)
                shared.append(check)
                continue
            bucket = h % check.buckets
            try:
                slot = pool.acquire()
            except BackPressureError as exc:
                return Failed(exc)
            self._slots[rank] = slot
            if self.batcher is not None:
                ticket = CheckTicket(self.backend, self.reaper, check, slot, bucket, self.notice, self.count)
                self._tickets[rank] = ticket
                self.batcher.add(ticket)
                continue
            try:
                handle = self.backend.read(
                    pool.dlist,
                    np.array([slot], dtype=np.int32),
                    check.dlist,
                    np.array([bucket], dtype=np.int32),
                    self.notice,
                )
            except TransferError as exc:
                return Failed(exc, rank)
            self.count("xfers_check", 1)
            self._pending[handle] = rank
        if not shared:
            return None
        self.count("checks_shared", len(shared))
        if not live:
            # Not exposed (yet, or any more) on some rank: the pull fails, and an engine pulls
            # again once the prefill exposes it. A notice reaching a rank after that exposure
            # would release it unread: the ranks release by lease instead.
            return None
        self._shared_told = frozenset(self._shared)
        for check in shared:  # every rank's check is under way: the notices may leave
            if self.notices is not None:
                self.notices.notify(self.backend, self.reaper, check, self.notice, self.count)
            elif flush_after_notice(self.backend, self.reaper, pool, check, self.notice) is not None:
                self.count("xfers_notice", 1)
        return None

    def _verify(self) -> TransferError | None:
        pool = self.pool
        if pool is None:
            return None
        slots = self._slots
        buckets: Any = (
            (*((rank, pool.array[slot]) for rank, slot in slots.items()), *self._shared.items())
            if slots
            else self._shared.items()
        )
        return unsafe(
            buckets,
            self.request_id,
            self.remote_ids,
            self.read_ids,
            self.generation,
            self.packed,
            token_hash=self._hash,
            fingerprint=self.fingerprint,
        )

    def _free_slots(self) -> None:
        if self.pool is not None:
            for slot in self._slots.values():
                self.pool.release(slot)
        self._slots.clear()

    def _settle(self) -> None:
        if self.on_settled is not None:
            settled, self.on_settled = self.on_settled, None
            settled()

    def abort(self) -> None:
        """Hand every handle in flight to the reaper, which holds it (and the check slot it may
        still land in) until NIXL reports it finished; ``reaper.holds(self.owner)`` says whether
        anything of this pull may still land (and ``on_settled`` runs once every data read is
        finished and released)."""
        if self._aborted:  # a second abort must not settle what the first handed to the reaper
            return
        self._aborted = True
        pool = self.pool
        for rank, ticket in self._tickets.items():
            del self._slots[rank]  # the ticket's batch (or the batcher) frees it
            if self.batcher is not None and self.batcher.withdraw(ticket):
                if pool is not None:
                    pool.release(ticket.slot)
            elif ticket.batch is not None:
                ticket.batch.leave(ticket)
        self._tickets.clear()
        data = [h for h in self._pending] if not self.checking else []
        left = [len(data)]

        def one_gone() -> None:
            left[0] -= 1
            if not left[0]:
                self._settle()

        for handle, rank in list(self._pending.items()):
            slot = self._slots.pop(rank, None) if self.checking else None
            then: Any = None
            if slot is not None and pool is not None:

                def then(slot: int = slot, pool: CheckPool = pool) -> None:
                    pool.release(slot)

            elif not self.checking:
                then = one_gone
            self.reaper.drop(handle, then, owner=self.owner, done=handle is self._errored)
        self._pending.clear()
        self._free_slots()
        self._forget()
        if not data:
            self._settle()
