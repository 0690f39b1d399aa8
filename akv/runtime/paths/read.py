"""The read path: NIXL READs of the paged runs (a long one in slices, `akv.runtime.paths.posts`),
then the exposure check (`akv.runtime.paths.tables`): one small READ per prefill rank read
from, of the exposure-table bucket proving the blocks were still exposed when the data
landed, carrying the "done" notice; or, where the rank shares its table with this host
(`akv.shm`), a load of the request's slot, its notice left to the `CheckBatcher`'s background
READ. The checks of one poller round go out together: per prefill rank one READ, one notice.

`NixlRead.start_now` makes the same pull at once where it can (every rank's table shared, every
data READ done at its first poll: over shared memory UCX copies while posting): verified and
its notices queued where it was launched, a `SettledRead` stands for it; anything else goes on
as the `NixlRead` holding what it posted and what its first poll found.
"""

from __future__ import annotations

import enum
import itertools
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from akv import exposure
from akv.backends import (
    Backend,
    Reaper,
    XferHandle,
    poll_handles,
)
from akv.errors import AkvError, BackPressureError, PeerLostError, TransferError
from akv.metrics import no_count
from akv.runtime.paths import Failed, OpBase, Outcome, PathName, Pending
from akv.runtime.paths.posts import Post, ReadPost
from akv.runtime.paths.tables import (
    CheckBatcher,
    CheckTicket,
    RemoteTable,
    SlotPool,
    flush_after_notice,
    unsafe,
)

__all__ = ["NixlRead", "ReadStage", "SettledRead"]


class ReadStage(enum.Enum):
    """Where a `NixlRead` is: its data READs running, its exposure check under way, or
    aborted (its handles handed to the reaper)."""

    READING = "reading"
    CHECKING = "checking"
    ABORTED = "aborted"


class SettledRead(OpBase):
    """The op of a pull the read path settled where it was launched (`NixlRead.start_now`):
    nothing of it is in flight, so polling, aborting and asking it cost nothing. ``ranks``:
    the prefill ranks read from; ``data_s`` and ``check_s`` as `NixlRead`'s; its "done"
    notices leave with `queue_notices`."""

    __slots__ = ("_notices", "check_s", "data_s", "ranks")
    path: PathName = "read"
    reads = True

    def __init__(
        self,
        ranks: frozenset[int],
        data_s: float,
        check_s: float,
        notices: Callable[[], None] | None = None,
    ) -> None:
        self.ranks, self.data_s, self.check_s = ranks, data_s, check_s
        self._notices = notices

    def queue_notices(self) -> None:
        """Queue the pull's "done" notices in the batcher (once), after the poller learnt of
        the launch (`akv.runtime.poller.PullPoller.launched`): a flush READ due to those
        ranks is then known to be covered by this pull's READs."""
        notices, self._notices = self._notices, None
        if notices is not None:
            notices()

    @property
    def stages(self) -> Mapping[str, float]:
        return {"data": self.data_s, "check": self.check_s}

    def poll(self) -> Outcome:
        return None

    def abort(self) -> None:
        return None


class NixlRead(OpBase):
    """One pull on the read path (see the module). ``checks`` None: no exposure check, the
    data reads carry the notice. ``generation``: one for every rank or per rank; ``packed``:
    the posts read packed copies (`akv.exposure.verify`); ``on_settled``: called once no data
    read can still land (at once, or after an abort, once NIXL released them all); ``batcher``:
    the checks wait there for the poller's round (None: each is posted at once); ``count``:
    the decode rank's counters (`akv.Metrics.inc`: data and check READs posted);
    ``notices``: where the "done" notices of checks made in shared memory wait for the
    poller's round (default ``batcher``; None with no batcher: each is posted at once)."""

    path: PathName = "read"
    reads = True

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
        checks: Mapping[int, RemoteTable | None] | None,
        pool: SlotPool | None,
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
    stage = ReadStage.READING
    _errored: XferHandle = None  # the READ NIXL reported in error (finished: nothing lands)
    _queued: frozenset[int] = frozenset()  # ranks whose notice waits in the batcher
    _noticed: frozenset[int] | None = None  # ranks the notice went to (None: not yet)
    _untaken: frozenset[int] = frozenset()  # of those, the ones `take_noticed` did not return
    _first: Outcome = None  # see adopt
    _backlog: Iterator[Post] = iter(())  # slices of a long read not made yet (see start)
    _next: Post | None = None  # the next slice to post
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

    @property
    def stages(self) -> Mapping[str, float]:
        return {"data": self.data_s, "check": self.check_s}

    # -- at once --------------------------------------------------------------------------

    @classmethod
    def start_now(
        cls,
        backend: Backend,
        reaper: Reaper,
        posts: Sequence[ReadPost],
        tables: Mapping[int, RemoteTable | None],
        *,
        request_id: str,
        remote_ids: npt.NDArray[np.int32],
        read_ids: npt.NDArray[np.int32],
        notice: bytes,
        pool: SlotPool,
        batcher: CheckBatcher,
        generation: int,
        fingerprint: int,
        token_hash: int,
        count: Callable[[str, int], None],
    ) -> tuple[SettledRead | NixlRead, Outcome] | None:
        """Start a checked read, and settle it here if it can be: the op and its first
        outcome. None, with nothing posted, where a check needs a READ (a rank's table is not
        in shared memory). Settled (`SettledRead`, None): every data READ was done at its
        first poll and the check passed; `SettledRead.queue_notices` then queues its notices
        in ``batcher``.
        Anything else is the `NixlRead` holding what was posted and what its first poll
        found, with `Pending` (poll it: its first poll answers what was found) or, where a
        post was refused, the `Failed` of its start (aborted, as `start` leaves it)."""
        if any(post.long for post in posts):  # a long read: sliced, polled
            return None
        checks: list[RemoteTable] = []
        for post in posts:
            table = tables.get(post.rank)
            if table is None or table.words is None or table.released:
                return None
            checks.append(table)
        started = time.perf_counter()
        handles: dict[XferHandle, int] = {}

        def handover(
            pending: dict[XferHandle, int],
            first: Outcome = None,
            errored: XferHandle = None,
            *,
            refused: Failed | None = None,
            noticed: frozenset[int] | None = None,
        ) -> tuple[NixlRead, Outcome]:
            try:
                read = cls(
                    backend,
                    reaper,
                    posts,
                    request_id=request_id,
                    remote_ids=remote_ids,
                    read_ids=read_ids,
                    notice=notice,
                    checks=tables,
                    pool=pool,
                    generation=generation,
                    batcher=batcher,
                    count=count,
                    fingerprint=fingerprint,
                    token_hash=token_hash,
                )
            except BaseException:  # pragma: no cover - defensive: nothing posted is left unowned
                for handle in pending:
                    reaper.drop(handle)
                raise
            read.adopt(pending, started, first, errored, noticed)
            if refused is None:
                return read, Pending()
            read.abort()
            return read, refused

        for post in posts:
            try:
                handle = backend.read(post.local, post.local_idx, post.remote, post.remote_idx, b"")
            except TransferError as exc:
                if handles:
                    count("xfers_data", len(handles))
                return handover(handles, refused=Failed(exc, post.rank))
            handles[handle] = post.rank
        count("xfers_data", len(handles))
        # The first poll, as `poll` makes it: what it found goes with a handover.
        pending = dict(handles)
        polled = poll_handles(backend, reaper, pending)
        if polled.failed is not None:  # finished, in error: nothing more of it lands
            errored, rank, error = polled.failed
            return handover(pending, Failed(error, rank), errored)
        if pending:
            return handover(pending, Pending(len(pending) < len(handles)))
        data_done = time.perf_counter()
        # The exposure check, now that the data is in, as `_post_checks` and `_verify` make
        # it: every rank's slot loaded (in rank order), then verified.
        ranks = sorted(set(handles.values()))
        by_rank = {post.rank: table for post, table in zip(posts, checks, strict=True)}
        ordered = [by_rank[rank] for rank in ranks]
        slots = [table.load(token_hash) for table in ordered]
        unsafe_read = unsafe(
            zip(ranks, slots, strict=True),
            request_id,
            remote_ids,
            read_ids,
            generation,
            token_hash=token_hash,
            fingerprint=fingerprint,
        )
        if ranks:
            count("checks_shared", len(ranks))
        read = frozenset(ranks)
        if unsafe_read is not None:
            # Not exposed (or not this exposure) on some rank: a notice goes only where every
            # slot is still live (else the ranks release by lease), and the op fails the pull.
            live = all(exposure.live(slot) for slot in slots)
            if live:
                for table in ordered:
                    batcher.notify(backend, reaper, table, notice, count)
            return handover({}, Failed(unsafe_read), noticed=read if live else frozenset())

        def notices() -> None:
            for table in ordered:
                batcher.notify(backend, reaper, table, notice, count)

        return SettledRead(read, data_done - started, time.perf_counter() - data_done, notices), None

    def adopt(
        self,
        pending: Mapping[XferHandle, int],
        since: float,
        first: Outcome = None,
        errored: XferHandle = None,
        noticed: frozenset[int] | None = None,
    ) -> None:
        """Take data READs posted already, ``{handle: prefill rank}`` since
        ``time.perf_counter()`` ``since``, as this op's own (instead of `start`, which
        posts them; they were counted when posted): `start_now` hands over a pull it
        cannot settle at once. ``first``: what its poll found, which the next `poll` answers
        without polling again: `Pending` (READs still running), or `Failed` with ``errored``
        the READ in error. ``noticed`` (the data was in and the check made, ``first`` its
        `Failed`): the ranks whose notices it queued."""
        self._pending.update(pending)
        self._since = since
        self._first = first
        if errored is not None:
            self._errored = errored
        if noticed is not None:
            self.stage = ReadStage.CHECKING
            self._notice_went(noticed)

    # -- the notice -----------------------------------------------------------------------

    def take_noticed(self) -> frozenset[int]:
        """The prefill ranks the "done" notice went to since the last call: those of the
        check reads (or, without checks, of the data reads) once they are done."""
        ranks, self._untaken = self._untaken, frozenset()
        return ranks

    def _notice_went(self, ranks: frozenset[int]) -> None:
        """The reads carrying the notice to ``ranks`` are done (once: the op may be polled
        again after that)."""
        if self._noticed is None:
            self._noticed = self._untaken = ranks

    # -- stages ---------------------------------------------------------------------------

    def start(self) -> Failed | None:
        """Post the data reads (a long one: its first slice, the others as it is polled,
        see `akv.backends.SLICE_DESCS`; unchecked reads carry the notice, and are never sliced); on
        failure nothing stays posted."""
        self._since = time.perf_counter()
        if self.checks is not None and any(post.long for post in self.posts):
            self._backlog = itertools.chain.from_iterable(post.slices() for post in self.posts)
            self._next = next(self._backlog, None)
            return self._post_slice()
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

    def _post_slice(self) -> Failed | None:
        """Post the next slice of a long read (see `akv.backends.SLICE_DESCS`)."""
        post = self._next
        if post is None:  # pragma: no cover - called only while one is left
            return None
        self._next = next(self._backlog, None)
        try:
            handle = post.post(self.backend, b"")
        except TransferError as exc:
            self.abort()
            return Failed(exc, post.rank)
        self._pending[handle] = post.rank
        self.count("xfers_data", 1)
        return None

    def poll(self) -> Outcome:
        """Poll the reads in flight; post the checks once the data is in; verify them."""
        if self._first is not None:  # polled already where it was launched (see adopt)
            first, self._first = self._first, None
            return first
        changed = False
        if self._next is not None:  # a long read: one more slice each poll, the loop runs between
            failed = self._post_slice()
            if failed is not None:
                return failed
            changed = True
        if self._pending:
            polled = poll_handles(self.backend, self.reaper, self._pending)
            if polled.failed is not None:
                self._errored, rank, exc = polled.failed  # finished, in error: nothing more lands
                return Failed(exc, rank)
            changed |= polled.changed
            if self._pending or self._next is not None:
                return Pending(changed)
        elif self._next is not None:
            return Pending(changed)
        if self.stage is ReadStage.READING:
            if self.on_settled is not None:
                self._settle()
            if self.checks is None:
                self._notice_went(self._ranks)
                self._forget()
                return None
            self.stage = ReadStage.CHECKING
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
        self._notice_went(frozenset(self._slots).union(self._queued) if self._slots else self._queued)
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
        shared: list[RemoteTable] = []  # checks made in shared memory: notices queued at the end
        live = True
        for rank in self._order:
            table = checks.get(rank)
            if table is None or table.released:  # the rank was re-linked (or lost) since the data reads
                return Failed(PeerLostError(f"prefill rank {rank} was re-linked during this pull"), rank)
            if table.words is not None:  # on this host: memory loads, now that the data is in
                found = self._shared[rank] = table.load(h)
                live = live and exposure.live(found)
                shared.append(table)
                continue
            bucket = h % table.buckets
            try:
                slot = pool.acquire()
            except BackPressureError as exc:
                return Failed(exc)
            self._slots[rank] = slot
            if self.batcher is not None:
                ticket = CheckTicket(self.backend, self.reaper, table, slot, bucket, self.notice, self.count)
                self._tickets[rank] = ticket
                self.batcher.add(ticket)
                continue
            try:
                handle = self.backend.read(
                    pool.dlist,
                    np.array([slot], dtype=np.int32),
                    table.dlist,
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
        self._queued = frozenset(self._shared)
        for table in shared:  # every rank's check is under way: the notices may leave
            if self.notices is not None:
                self.notices.notify(self.backend, self.reaper, table, self.notice, self.count)
            elif flush_after_notice(self.backend, self.reaper, pool, table, self.notice) is not None:
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
        if self.stage is ReadStage.ABORTED:  # a second abort must not settle what the first handed over
            return
        checking = self.stage is ReadStage.CHECKING  # the handles in flight are check READs
        self.stage = ReadStage.ABORTED
        pool = self.pool
        for rank, ticket in self._tickets.items():
            del self._slots[rank]  # the ticket's batch (or the batcher) frees it
            if self.batcher is not None and self.batcher.withdraw(ticket):
                if pool is not None:
                    pool.release(ticket.slot)
            elif ticket.batch is not None:
                ticket.batch.leave(ticket)
        self._tickets.clear()
        self._next, self._backlog = None, iter(())  # never posted: nothing of them lands
        data = [h for h in self._pending] if not checking else []
        left = [len(data)]

        def one_gone() -> None:
            left[0] -= 1
            if not left[0]:
                self._settle()

        for handle, rank in list(self._pending.items()):
            slot = self._slots.pop(rank, None) if checking else None
            then: Any = None
            if slot is not None and pool is not None:

                def then(slot: int = slot, pool: SlotPool = pool) -> None:
                    pool.release(slot)

            elif not checking:
                then = one_gone
            self.reaper.drop(handle, then, owner=self.owner, done=handle is self._errored)
        self._pending.clear()
        self._free_slots()
        self._forget()
        if not data:
            self._settle()
