"""The path ops of one session's pulls: which path a prepared request takes, and its op, started.

Owns the choice of path (`Routes.route`: packed where the consumer's ``transfer`` picks the
prefill ranks' packed copies, else copy where every prefill rank read lives in this process,
else push for a session in push mode, else read) and the one place each path's op is built,
one constructor call per branch (`Routes.start`), with a failed start's bookkeeping (the
broken rank, the reaper, the count). It reads the session's linked ranks (`EngineLinks`),
the decode rank (`DecodeRank`) and the poller's shared pieces (the check batcher, the reaper,
grant ids); running the pull afterwards is the poller's, launching it the session's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from akv.errors import AkvError, ClosedError
from akv.geometry.cache import as_cache
from akv.pack_layout import plan_runs, staged_bytes
from akv.plan import Prepared, TransferPlan
from akv.protocol.push import PushNotice
from akv.runtime.paths import Failed, OpBase, PathName, PathOp
from akv.runtime.paths.copy import CopyPlan
from akv.runtime.paths.packed import PackedLink, PackedRead, use_packed
from akv.runtime.paths.posts import ReadPost
from akv.runtime.paths.push import PackedPush, PushOp
from akv.runtime.paths.read import NixlRead, SettledRead
from akv.runtime.transfer import PullRequest, Transfer
from akv.tracker import TransferState

if TYPE_CHECKING:
    from akv.pack_layout import Item
    from akv.runtime.links import EngineLinks
    from akv.runtime.poller import PullPoller
    from akv.runtime.rank import DecodeRank
    from akv.runtime.transfer import PullOwner

__all__ = ["Launch", "Refused", "Routes", "Started"]


@dataclass(slots=True)
class Launch:
    """A pull checked and planned, not yet posted."""

    request: PullRequest
    plan: TransferPlan  # the plan it was prepared with
    prepared: Prepared
    fingerprint: int  # exposure.digest of its prefill block ids (the notice's and the check's)
    notice: bytes
    state: TransferState
    path: PathName
    copier: CopyPlan | None
    token_hash: int  # exposure.request_hash of the request id (the check's bucket and token)
    transfer: Transfer  # its completion, made before anything is posted (op set once started)


@dataclass(slots=True)
class Started:
    """A pull's start on its path: its op (`Refused` if nothing was started), the ranks it
    notifies once done, and the error of a failed start (``unsettled``: what it posted before
    the failure may still land; ``rank``: the prefill rank a push announcement failed to)."""

    op: PathOp
    notify: tuple[int, ...]
    error: AkvError | None
    unsettled: bool = False
    rank: int | None = None
    settled: bool = False  # done and settled already (a read made at once): nothing to track


class Refused(OpBase):
    """The op of a pull whose start failed before anything was posted (`pull_many`'s failed
    transfers, settled at once and never polled): nothing to hold or stop."""

    __slots__ = ("error", "path")
    ranks: frozenset[int] = frozenset()

    def __init__(self, path: PathName, error: AkvError) -> None:
        self.path = path
        self.error = error

    def poll(self) -> Failed:
        return Failed(self.error)

    def abort(self) -> None:
        return None


def _ids(ids: Any) -> Any:
    """Block ids as plain lists (flat, or per group) for a push announcement."""
    if isinstance(ids, Mapping):
        return {str(k): [int(b) for b in v] for k, v in ids.items()}
    return [int(b) for b in ids]


class Routes:
    """Builds and starts the path op of each pull of the session ``owner`` (see the module)."""

    def __init__(self, rank: DecodeRank, engine: EngineLinks, poller: PullPoller, owner: PullOwner) -> None:
        self.rank = rank
        self.engine = engine
        self.poller = poller
        self.owner = owner

    # -- which path -----------------------------------------------------------------------

    def route(self, prepared: Prepared) -> tuple[PathName, CopyPlan | None]:
        """The path a prepared request takes, and the copy plan the copy path uses."""
        copier = self._copier_for(prepared)
        if self._packs(prepared, copier):
            return "packed", copier
        if copier is not None:
            return "copy", copier
        return ("push" if self.engine.mode == "push" else "read"), None

    def _packs(self, prepared: Prepared, copier: CopyPlan | None) -> bool:
        c = self.rank
        if c.staging is None or self.engine.mode == "push":
            return False
        packs = {
            r: link.info.pack if link.directory is not None else None for r, link in self.engine.links.items()
        }
        return use_packed(c.transfer, prepared, packs, c.pack_threshold, c.pack_run_bytes) and (
            copier is None or c.transfer == "packed" or any(p and p.early for p in packs.values())
        )

    def _copier_for(self, prepared: Prepared) -> CopyPlan | None:
        copier = self.engine.copier
        if copier is None or self.rank.same_process == "nixl":
            return None
        return copier if copier.covers({op.remote_rank for op, _, _ in prepared.posts}) else None

    # -- the op, started ----------------------------------------------------------------

    def start(self, launch: Launch, inline: bool = False) -> Started:
        """Build the op of a planned request's path and start it; a failure comes back in the
        answer, with ``unsettled`` set while what was posted before it may still land.
        ``inline``: a checked read may settle at once (`NixlRead.start_now`)."""
        prepared, path = launch.prepared, launch.path
        if path == "push":
            push = self._push_op(launch)
            failed = push.start()
            if failed is None:
                return Started(push, prepared.standalone, None)
            return Started(push, prepared.standalone, failed.error, rank=failed.rank)
        if path == "copy" and launch.copier is not None:
            request = launch.request
            notify = launch.plan.notify
            copied = launch.copier.launch(
                prepared,
                request.request_id,
                notify,
                check=self.rank.verify_exposure,
                generation=request.generation,
            )
            if isinstance(copied, Failed):
                self.rank.metrics.inc("transfers_failed")
                return Started(Refused(path, copied.error), notify, copied.error)
            return Started(copied, notify, None)
        op: PackedRead | NixlRead
        if path == "packed":
            try:
                op = self._packed_op(launch)
            except AkvError as exc:
                return Started(Refused(path, exc), (), exc)
            return self._started(op, op.start(), prepared.standalone)
        if inline and self.rank.verify_exposure:
            now = self._read_now(launch)
            if now is not None:
                return now
        op = self._read_op(launch)
        return self._started(op, op.start(), prepared.standalone)

    def _started(self, op: PathOp, failed: Failed | None, notify: tuple[int, ...]) -> Started:
        """The answer for a started op (``failed``: its start failed, its rank is marked)."""
        if failed is None:
            return Started(op, notify, None)
        self.engine.mark_broken(failed.error, failed.rank)
        self.poller.reap()
        self.rank.metrics.inc("transfers_failed")
        return Started(op, notify, failed.error, unsettled=self.poller.reaper.holds(op))

    def _read_now(self, launch: Launch) -> Started | None:
        """A checked read made at once where it can be (`NixlRead.start_now`); settled here
        when it passed, else the read to keep polling. None: nothing posted."""
        request, prepared = launch.request, launch.prepared
        poller, links = self.poller, self.engine.links
        made = NixlRead.start_now(
            self.rank.backend,
            poller.reaper,
            self._posts(prepared),
            {op.remote_rank: links[op.remote_rank].check for op, _, _ in prepared.posts},
            request_id=request.request_id,
            remote_ids=prepared.remote_ids,
            read_ids=prepared.read_ids,
            notice=launch.notice,
            pool=self.rank.checks,
            batcher=poller.batcher,
            generation=request.generation,
            fingerprint=launch.fingerprint,
            token_hash=launch.token_hash,
            count=self.rank.metrics.inc,
        )
        if made is None:
            return None
        op, outcome = made
        if isinstance(outcome, Failed):
            return self._started(op, outcome, prepared.standalone)
        if outcome is not None:  # to keep polling
            return Started(op, prepared.standalone, None)
        settled = cast("SettledRead", op)  # what a read settled at once stands as
        poller.launched(self.owner, settled.ranks)  # what tracking a launch tells the poller, first
        settled.queue_notices()
        transfer = launch.transfer
        transfer.op, transfer.notify = settled, prepared.standalone
        poller.completed(transfer, settled.ranks)
        return Started(op, prepared.standalone, None, settled=True)

    def _posts(self, prepared: Prepared) -> list[ReadPost]:
        dlists = self.engine.dlists
        run = prepared.bytes // max(prepared.descriptors, 1)  # the mean run: how a long read is sliced
        return [
            ReadPost(op.remote_rank, dlists[op.local_table], li, dlists[op.remote_table], ri, run)
            for op, li, ri in prepared.posts
        ]

    def _read_op(self, launch: Launch) -> NixlRead:
        """The read path's op for a planned request (not started)."""
        c, request, prepared = self.rank, launch.request, launch.prepared
        posts = self._posts(prepared)
        verify = c.verify_exposure
        links = self.engine.links
        return NixlRead(
            c.backend,
            self.poller.reaper,
            posts,
            request_id=request.request_id,
            remote_ids=prepared.remote_ids,
            read_ids=prepared.read_ids,
            notice=launch.notice,
            checks={post.rank: links[post.rank].check for post in posts} if verify else None,
            pool=c.checks if verify else None,
            generation=request.generation,
            batcher=self.poller.batcher,
            count=c.metrics.inc,
            fingerprint=launch.fingerprint,
            token_hash=launch.token_hash,
        )

    def _packed_op(self, launch: Launch) -> PackedRead:
        """The packed path's op for a planned request, not started (see
        `akv.runtime.paths.packed`)."""
        c, engine, prepared, request = self.rank, self.engine, launch.prepared, launch.request
        if c.staging is None or c.directories is None or engine.remote_spec is None:
            raise ClosedError("the consumer keeps no staging area for packed reads")
        ranks = {op.remote_rank for op, _, _ in prepared.posts}
        links = {
            r: PackedLink(r, link.agent, link.info.pack, link.directory)
            for r, link in engine.links.items()
            if r in ranks and link.info.pack is not None and link.directory is not None
        }
        early = any(link.pack.early for link in links.values())
        return PackedRead(
            c.backend,
            self.poller.reaper,
            request_id=request.request_id,
            prepared=prepared,
            generation=request.generation,
            notice=launch.notice,
            links=links,
            checks={r: engine.links[r].check for r in ranks} if c.verify_exposure else None,
            check_pool=c.checks if c.verify_exposure else None,
            dir_pool=c.directories,
            staging=c.staging,
            views=c.pack_views,
            local_spec=c.cache,
            remote_spec=as_cache(engine.remote_spec),
            prefill_tp=engine.prefill_tp,
            direct=None if early else self._read_op(launch),
            count=c.metrics.inc,
            notices=self.poller.batcher,
        )

    def _push_op(self, launch: Launch) -> PushOp:
        """The grant of this pull's blocks (or, packed, of a staging range) to its writers
        (every prefill rank it reads from); its ``start`` announces it."""
        c, prepared, req = self.rank, launch.prepared, launch.request
        writers = {op.remote_rank: self.engine.links[op.remote_rank].agent for op, _, _ in prepared.posts}
        staging = c.staging
        staged = self._push_staging(prepared, req.request_id)
        announce = PushNotice(
            kind="announce",
            engine_id=c.engine_id,
            decode_rank=c.tp_rank,
            decode_tp=c.tp_size,
            request_id=req.request_id,
            grant=self.poller.new_grant(),
            generation=req.generation,
            local_ids=_ids(req.local_block_ids),
            remote_ids=_ids(req.remote_block_ids),
            num_tokens=req.num_tokens or 0,
            staging=0 if staged is None or staging is None else staging.addr + staged[0],
        )
        self.poller.flush_notices()
        c.metrics.inc("push_announces_sent", len(writers))  # PushOp.start sends one to each
        if staged is None or staging is None:  # staged only with a staging area
            return PushOp(c.backend, writers, announce)
        offset, items, runs = staged
        return PackedPush(
            c.backend,
            writers,
            announce,
            staging=staging,
            offset=offset,
            items=items,
            views=c.pack_views,
            runs=runs,
            direct={op.remote_rank: len(li) for op, li, _ in prepared.posts},
        )

    def _push_staging(
        self, prepared: Prepared, request_id: str
    ) -> tuple[int, list[Item], dict[int, int]] | None:
        """A packed push's staging range, items and write runs, if the consumer's
        ``transfer`` picks the writers' packed copies for this pull (every writer keeps them,
        this rank's Hello named its staging area) and the staging area has room; else None
        (the writers write the blocks)."""
        c, engine = self.rank, self.engine
        if c.staging is None or engine.remote_spec is None or not engine.staging_sent:
            return None
        packs = {r: link.info.pack for r, link in engine.links.items()}
        if not use_packed(c.transfer, prepared, packs, c.pack_threshold, c.pack_run_bytes):
            return None
        ranks = sorted({op.remote_rank for op, _, _ in prepared.posts})
        if any(packs.get(r) is None for r in ranks):
            return None
        items, runs, _ = plan_runs(
            c.cache, as_cache(engine.remote_spec), prepared, engine.prefill_tp, ranks, request_id
        )
        offset = c.staging.arena.alloc(max(staged_bytes(items), 1))
        if offset is None:
            c.metrics.inc("pack_fallbacks")
            return None
        return offset, items, {r: int(lengths.size) for r, (_, _, lengths) in runs.items()}
