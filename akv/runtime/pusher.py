"""The prefill side of push mode: WRITE a request's blocks into the decode ranks that
announced it, layer by layer as they become ready.

A decode rank in push mode sends its agent metadata and regions in its Hello (under the
handshake's MAC); the [`Producer`][akv.Producer] hands that Hello to this module, which loads
the agent and, on the first announcement, builds the decode rank's own transfer plan (the
same deterministic plan the decode rank built: same specs, same addresses, same request
key), so an announcement carries only block ids, never addresses. For each announcement
(a *grant*) this rank posts WRITEs of the descriptors whose layers are ready, more as
[`Producer.layers_ready`][akv.Producer.layers_ready] says so, and once the last layer's
writes are DONE and the exposure still holds (same generation), it tells the decode rank
``pushed`` and counts that decode rank as a reader (release reason ``"pushed"``).

Safety (decode-centred, see docs/concepts.md): a grant is served only for the agent that
announced it; ``stop`` ends it, answered by ``stopped`` once every WRITE posted for it was
DONE or released by NIXL (the Reaper); an exposure released under a grant (lease, close)
fails the grant, answered ``failed`` under the same condition.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from akv import exposure
from akv._poll import FLUSH_S
from akv.backends import DlistHandle, Reaper, mem_type, poll_handles, row_slices, slice_bounds
from akv.errors import AkvError, BlockIdError, ConfigError, PeerLostError, TransferError
from akv.pack_layout import desc_rows, plan_runs, staged_bytes
from akv.plan import RankMemory, TransferPlan
from akv.protocol.messages import Hello, Notice
from akv.protocol.push import Kind, PushNotice, encode_push, reply
from akv.runtime.push_state import GrantState, PackedCopy, PushRank, _Grant, _Target

if TYPE_CHECKING:
    from akv.ledger import Release
    from akv.plan import Prepared

__all__ = ["MAX_GRANTS", "RETIRED", "Pusher"]

#: Grants (announcements not finished) held at once per decode rank.
MAX_GRANTS = 4096
#: Released request ids remembered, so a late announcement is answered at once.
RETIRED = 65536


class Pusher:
    """Push-mode state of one prefill rank (driven by its Producer's poller)."""

    def __init__(self, producer: PushRank, deliver: Callable[[list[Release]], None], log: Any) -> None:
        self.producer = producer
        self.deliver = deliver  # hands releases to the producer's listeners
        self.log = log
        self.metrics = producer.metrics
        self.targets: dict[str, _Target] = {}
        self.grants: dict[tuple[str, int], _Grant] = {}
        self.by_request: dict[str, set[_Grant]] = {}
        self.ready: dict[str, int] = {}  # request -> layers ready (absent: all)
        self.retired: OrderedDict[str, tuple[int, str]] = OrderedDict()  # request -> (generation, reason)
        self.layers = 1 + max(layer for g in producer.cache.groups for layer in g.layers)
        self.flush_until = 0.0
        self._reaper: Reaper | None = None
        self._mem: tuple[str, int] | None = None

    @property
    def reaper(self) -> Reaper:
        if self._reaper is None:
            self._reaper = Reaper(self.producer.backend)
        return self._reaper

    @property
    def writing(self) -> bool:
        """True while WRITEs are in flight (the poller spins then: their completion is the
        decode rank's latency)."""
        return any(g.pending for g in self.grants.values())

    @property
    def busy(self) -> bool:
        """True while writes are in flight, handles wait for release or notices for the wire."""
        return (
            bool(self.grants)
            or bool(self._reaper and len(self._reaper))
            or time.monotonic() < self.flush_until
        )

    # -- peers ----------------------------------------------------------------------------

    def add_peer(self, hello: Hello) -> None:
        """Load a pushing decode rank's agent (its Hello passed the MAC check). A decode rank
        handshaking again replaces its old link; its grants end without an answer."""
        backend = self.producer.backend
        name = backend.add_remote(hello.agent_metadata)
        if name != hello.agent_name:
            backend.remove_remote(name)
            raise ConfigError(
                f"the decode rank's agent metadata names agent {name!r}, its Hello {hello.agent_name!r}"
            )
        old = self.targets.pop(name, None)
        if old is not None:
            self._forget(old)
            backend.remove_remote(name)  # the reference the new load took replaces the old one
        self.targets[name] = _Target(name, hello)
        self.log.info("pushing decode rank connected", peer=hello.engine_id, decode_rank=hello.tp_rank)

    def remove_peer(self, agent: str) -> None:
        """A decode rank said goodbye: end its grants, forget its agent."""
        target = self.targets.pop(agent, None)
        if target is not None:
            self._forget(target)
            self.producer.backend.remove_remote(agent)

    def _forget(self, target: _Target) -> None:
        """End a target's grants without an answer. A grant whose WRITEs NIXL has not
        released yet stays (ending) until it has: a ``stop`` for it meanwhile is answered
        only then, so nothing can land after ``stopped``."""
        for grant in [g for g in self.grants.values() if g.target is target]:
            self._end(grant, None)
            if not grant.pending and not grant.reaping:
                self._drop(grant)
        backend = self.producer.backend
        for handle in target.lists.values():
            backend.release_dlist(handle)
        target.lists.clear()

    # -- notices --------------------------------------------------------------------------

    def on_notice(self, agent: str, notice: PushNotice, now: float) -> None:
        """A push notice from a decode agent (bound to the decode rank that handshook with it)."""
        target = self.targets.get(agent)
        if target is None or (notice.engine_id, notice.decode_rank, notice.decode_tp) != target.identity:
            self.metrics.inc("notifications_unbound")
            return
        if notice.kind == "announce":
            self._announce(target, notice, now)
        elif notice.kind == "stop":
            self._stop(target, notice)
        elif notice.kind == "bye":
            self.remove_peer(agent)
        else:
            self.metrics.inc("notifications_invalid")

    def _announce(self, target: _Target, notice: PushNotice, now: float) -> None:
        key = (target.agent, notice.grant)
        if key in self.grants or not notice.grant or not notice.request_id:
            self.metrics.inc("notifications_invalid")  # a duplicate, or no grant at all
            return
        grant = _Grant(target, notice, now)
        if sum(g.target is target for g in self.grants.values()) >= MAX_GRANTS:
            self._reply(grant, "failed", "busy", f"{MAX_GRANTS} grants of this decode rank in flight")
            return
        self.grants[key] = grant
        self.by_request.setdefault(notice.request_id, set()).add(grant)
        self.metrics.inc("push_announcements")
        self._start(grant)

    def _stop(self, target: _Target, notice: PushNotice) -> None:
        grant = self.grants.get((target.agent, notice.grant))
        if grant is None:  # never announced here, or finished: nothing of it can land
            self._send_notice(target, reply(notice, "stopped", prefill_rank=self.producer.tp_rank))
            return
        if grant.state is GrantState.ENDING and grant.answer is None:  # ended unanswered (its link reset)
            grant.target = target
            grant.answer = self._notice(grant, "stopped")  # sent once its WRITEs are released
            return
        self._end(grant, self._notice(grant, "stopped"))

    # -- exposures (from the producer) ------------------------------------------------------

    def exposed(self, request_id: str, layers_ready: int | None) -> None:
        """A request was exposed (``layers_ready`` of its layers computed; None: all)."""
        self.retired.pop(request_id, None)
        if layers_ready is None or layers_ready >= self.layers:
            self.ready.pop(request_id, None)
        else:
            self.ready[request_id] = layers_ready
        for grant in list(self.by_request.get(request_id, ())):
            if grant.state is GrantState.WAITING:
                self._start(grant)

    def layers_ready(self, request_id: str, n: int) -> None:
        """``n`` layers of a request are computed: write what they hold."""
        if request_id not in self.ready:  # every layer was ready already
            return
        if n >= self.layers:
            del self.ready[request_id]
        else:
            self.ready[request_id] = max(n, self.ready[request_id])
        for grant in list(self.by_request.get(request_id, ())):
            if grant.state is GrantState.WRITING:
                self._advance(grant)

    def packed_ready(self, request_id: str) -> None:
        """A request's packed copy was published (or found no room): packed pushes waiting
        for it start."""
        for grant in list(self.by_request.get(request_id, ())):
            if grant.state is GrantState.WAITING:
                self._start(grant)

    def released(self, releases: list[Release]) -> None:
        """Releases delivered: grants of a request released under them fail (once their writes
        can no longer land: the bytes they read may be another request's now)."""
        for rel in releases:
            rid = rel.request_id
            self.ready.pop(rid, None)
            gen = next((g.generation for g in self.by_request.get(rid, ()) if g.generation), 0)
            self.retired[rid] = (gen, rel.reason)
            self.retired.move_to_end(rid)
            while len(self.retired) > RETIRED:
                self.retired.popitem(last=False)
            for grant in list(self.by_request.get(rid, ())):
                if grant.state is GrantState.WRITING:
                    code = "expired" if rel.reason == "expired" else "released"
                    self._end(
                        grant, self._notice(grant, "failed", code, f"released ({rel.reason}) while writing")
                    )
                elif grant.state is GrantState.WAITING:  # e.g. for a gather still queued: fails as released
                    self._start(grant)

    # -- writing --------------------------------------------------------------------------

    def _start(self, grant: _Grant) -> None:
        p = self.producer
        n = grant.notice
        rid = n.request_id
        gen = p.ledger.generation(rid)
        if gen is None:
            retired = self.retired.get(rid)
            if retired is not None:
                code = "expired" if retired[1] == "expired" else "released"
                self._fail_now(
                    grant, code, f"request {rid!r} was released ({retired[1]}) before it was announced"
                )
            return  # not exposed yet: wait for expose() (or the decode rank's stop)
        if n.generation and n.generation != gen:
            self._fail_now(
                grant, "reexposed", f"request {rid!r} is exposed as generation {gen}, not {n.generation}"
            )
            return
        try:
            plan = self._plan(grant.target)
            prepared = plan.prepare(rid, n.local_ids, n.remote_ids, n.num_tokens or None)
            exposed = p.ledger.exposed_ids(rid)
            if exposed is None or not np.array_equal(prepared.remote_ids, exposed):
                self._fail_now(grant, "outside", f"the announced blocks of {rid!r} are not its exposure here")
                return
            mine = [post for post in prepared.posts if post[0].remote_rank == p.tp_rank]
            if not mine:
                self._fail_now(
                    grant, "config", f"prefill rank {p.tp_rank} writes nothing of {rid!r} to this rank"
                )
                return
            if n.staging:
                copy = p.packed_copy(rid)
                if copy == "pending":
                    return  # its gather is queued on the device: started once published
                if copy is not None and copy.generation == gen & exposure.GENERATION_MASK:
                    self._start_packed(grant, plan, prepared, copy, gen, exposed)
                    return
                # no packed copy of it here (pool full, or layers still to compute): the
                # paged blocks are written, and "pushed" says so
            op, li, ri = mine[0]
            grant.local = self._list(
                grant.target, ("l", op.remote_table), "", plan.tables[op.remote_table], self._mem_type()
            )
            grant.remote = self._list(
                grant.target,
                ("r", op.local_table),
                grant.target.agent,
                plan.tables[op.local_table],
                grant.target.hello.mem_type,
            )
        except BlockIdError as exc:
            self._fail_now(grant, "blocks", str(exc))
            return
        except AkvError as exc:
            self._fail_now(grant, "config", str(exc))
            return
        rows = plan.tables[op.remote_table]
        ends = np.cumsum(rows[:, 4])
        grant.layers = plan.layers[op.remote_table][np.searchsorted(ends, ri, side="right")]
        grant.ri, grant.li = ri, li
        grant.sent = np.zeros(ri.size, dtype=bool)
        grant.run_bytes = prepared.bytes // max(prepared.descriptors, 1)
        grant.generation, grant.digest = gen, exposure.digest(exposed)
        grant.state = GrantState.WRITING
        self._advance(grant)

    def _start_packed(
        self,
        grant: _Grant,
        plan: TransferPlan,
        prepared: Prepared,
        copy: PackedCopy,
        generation: int,
        exposed: npt.NDArray[np.int32],
    ) -> None:
        """Write this rank's packed copy of the request into the staging range the decode
        rank granted (one WRITE of a few runs; the decode rank scatters it)."""
        p, n, hello = self.producer, grant.notice, grant.target.hello
        ranks = sorted({op.remote_rank for op, _, _ in prepared.posts})
        try:
            items, runs, sizes = plan_runs(hello.spec, p.cache, prepared, p.tp_size, ranks, n.request_id)
        except TransferError as exc:
            self._fail_now(grant, "config", str(exc))
            return
        if sizes[p.tp_rank] != copy.nbytes:
            self._fail_now(
                grant,
                "config",
                f"the packed copy of {n.request_id!r} has {copy.nbytes} bytes here, the decode rank "
                f"expects {sizes[p.tp_rank]}: the engines disagree on the cache",
            )
            return
        span = staged_bytes(items)
        if not (
            hello.staging_bytes
            and hello.staging_addr <= n.staging
            and n.staging + span <= hello.staging_addr + hello.staging_bytes
        ):
            self._fail_now(
                grant,
                "config",
                f"the staging range granted for {n.request_id!r} ({span} bytes at {n.staging:#x}) lies "
                "outside the staging area the decode rank registered",
            )
            return
        into, src, lengths = runs[p.tp_rank]
        grant.packed = True
        grant.generation, grant.digest = generation, exposure.digest(exposed)
        grant.sent = np.ones(1, dtype=bool)
        grant.state = GrantState.WRITING
        if not lengths.size:  # nothing of it lies on this rank: done at the next poll
            return
        local = desc_rows(copy.addr + src, lengths, copy.device_id)
        remote = desc_rows(n.staging + into, lengths, hello.device_id)
        grant.rows = deque(row_slices(local, remote))  # a long copy: a slice a poll
        grant.mem = (copy.mem_type, hello.mem_type)
        self.metrics.inc("packed_pushes")
        self._advance_packed(grant)

    def _advance_packed(self, grant: _Grant) -> None:
        """Post the next slice of a packed push's WRITE."""
        if grant.state is not GrantState.WRITING or not grant.rows:
            return
        local, remote = grant.rows.popleft()
        try:
            handle = self.producer.backend.write_descs(
                grant.target.agent, local, grant.mem[0], remote, grant.mem[1], b""
            )
        except TransferError as exc:
            self._end(grant, self._notice(grant, "failed", "transfer", str(exc)))
            return
        grant.pending[handle] = None
        self.metrics.inc("push_writes")

    def _advance(self, grant: _Grant) -> None:
        """Post a WRITE of the descriptors whose layers are ready and not written yet."""
        if grant.state is not GrantState.WRITING or grant.sent is None or grant.layers is None:
            return
        if grant.ri is None or grant.li is None:  # pragma: no cover - set together when started
            return
        ready = self.ready.get(grant.notice.request_id, self.layers)
        idx = np.flatnonzero(~grant.sent & (grant.layers < ready))
        if not idx.size:
            grant.more = False
            return
        bounds = slice_bounds(idx.size, grant.run_bytes)  # a long write: a slice a poll
        grant.more = len(bounds) > 1
        idx = idx[: bounds[0][1]]
        try:
            handle = self.producer.backend.write(grant.local, grant.ri[idx], grant.remote, grant.li[idx], b"")
        except TransferError as exc:
            self._end(grant, self._notice(grant, "failed", "transfer", str(exc)))
            return
        grant.sent[idx] = True
        grant.pending[handle] = None
        self.metrics.inc("push_writes")

    def poll(self, now: float) -> bool:
        """Progress every grant; True if anything changed."""
        changed = False
        backend = self.producer.backend
        for grant in list(self.grants.values()):
            if grant.more:  # the next slice of a long write
                self._advance(grant)
                changed = True
            elif grant.rows:
                self._advance_packed(grant)
                changed = True
            if grant.pending:
                polled = poll_handles(backend, self.reaper, grant.pending)
                changed |= polled.changed
                if polled.failed is not None:
                    self._end(grant, self._notice(grant, "failed", "transfer", str(polled.failed[2])))
                    changed = True
            if (
                grant.state is GrantState.WRITING
                and not grant.pending
                and not grant.rows
                and grant.sent is not None
                and grant.sent.all()
            ):
                self._complete(grant, now)
                changed = True
            elif grant.state is GrantState.ENDING and not grant.pending and not grant.reaping:
                if grant.answer is not None:
                    self._send_notice(grant.target, grant.answer)
                self._drop(grant)
                changed = True
            elif grant.state is GrantState.WAITING and now - grant.received > self.producer.lease_s:
                self._fail_now(
                    grant, "not_exposed", f"request {grant.notice.request_id!r} was not exposed in time"
                )
                changed = True
        if self._reaper is not None and len(self._reaper):
            self._reaper.retry()
        return changed

    def _complete(self, grant: _Grant, now: float) -> None:
        p = self.producer
        rid = grant.notice.request_id
        gen = p.ledger.generation(rid)
        if gen != grant.generation:  # released (or re-exposed) under the writes: not to be trusted
            self._end(grant, self._notice(grant, "failed", "released", f"{rid!r} was released while writing"))
            return
        self._send_notice(grant.target, self._notice(grant, "pushed", "packed" if grant.packed else ""))
        self._drop(grant)
        self.metrics.inc("pushes")
        engine, rank, tp = grant.target.identity
        done = Notice("done", engine, rank, tp, [rid], [grant.digest], [grant.generation])
        self.deliver(p.ledger.on_notice(done, now, pushed=True))

    def _end(self, grant: _Grant, answer: PushNotice | None) -> None:
        """Stop a grant: post nothing more; hand its writes to the reaper; ``answer`` goes out
        once none of them can land any more (None: no answer)."""
        if grant.state in (GrantState.ENDING, GrantState.DONE):
            return
        grant.state = GrantState.ENDING
        grant.answer = answer
        for handle in list(grant.pending):
            del grant.pending[handle]
            grant.reaping += 1

            def then(grant: _Grant = grant) -> None:
                grant.reaping -= 1

            self.reaper.drop(handle, then)

    def _fail_now(self, grant: _Grant, code: str, message: str) -> None:
        """Fail a grant that posted nothing."""
        self._end(grant, self._notice(grant, "failed", code, message))

    def _drop(self, grant: _Grant) -> None:
        grant.state = GrantState.DONE
        self.grants.pop(grant.key, None)
        peers = self.by_request.get(grant.notice.request_id)
        if peers is not None:
            peers.discard(grant)
            if not peers:
                del self.by_request[grant.notice.request_id]

    # -- helpers --------------------------------------------------------------------------

    def _mem_type(self) -> str:
        if self._mem is None:
            self._mem = mem_type(self.producer.kv_caches)
        return self._mem[0]

    def _plan(self, target: _Target) -> TransferPlan:
        """The decode rank's own plan of its reads from this engine (built once per target)."""
        if target.plan is None:
            p, h = self.producer, target.hello
            mine = tuple(t.data_ptr() for t in p.kv_caches)
            dev = self._mem[1] if self._mem else mem_type(p.kv_caches)[1]
            ranks = h.spec.notify_ranks(h.tp_rank, h.tp_size, p.tp_size)
            # Only this rank's rows are ever used: the others get this rank's addresses.
            remote = {r: RankMemory(r, p.tp_size, mine, dev) for r in ranks}
            local = RankMemory(h.tp_rank, h.tp_size, tuple(h.region_addrs), h.device_id)
            target.plan = TransferPlan(local_spec=h.spec, local=local, remote_spec=p.cache, remote=remote)
        return target.plan

    def _list(
        self, target: _Target, key: tuple[str, Any], agent: str, table: npt.NDArray[np.int64], mem: str
    ) -> DlistHandle:
        handle = target.lists.get(key)
        if handle is None:
            handle = target.lists[key] = self.producer.backend.prep(agent, table, mem)
        return handle

    def _notice(self, grant: _Grant, kind: Kind, code: str = "", message: str = "") -> PushNotice:
        return reply(grant.notice, kind, prefill_rank=self.producer.tp_rank, code=code, message=message)

    def _reply(self, grant: _Grant, kind: Kind, code: str, message: str) -> None:
        self._send_notice(grant.target, self._notice(grant, kind, code, message))

    def _send_notice(self, target: _Target, notice: PushNotice) -> None:
        try:
            self.producer.backend.notify(target.agent, encode_push(notice))
        except AkvError as exc:  # the decode rank is gone: forget it (its pulls time out there)
            self.log.warning("a push notice could not be sent", kind=notice.kind, error=str(exc))
            if isinstance(exc, PeerLostError) and target.agent in self.targets:
                self.remove_peer(target.agent)
            return
        if notice.kind == "failed":
            self.metrics.inc("push_failures")
        self.flush_until = time.monotonic() + FLUSH_S

    def close(self) -> None:
        """End every grant (the producer is closing; its agent goes with it)."""
        for target in list(self.targets.values()):
            self._forget(target)
        if self._reaper is not None:
            self._reaper.retry()
