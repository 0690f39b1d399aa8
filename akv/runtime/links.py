"""A decode rank's links to one prefill engine: find its ranks, handshake, keep them linked.

Owns everything about the remote engine's ranks that a pull needs in place before it can
launch: discovery (the bootstrap, a rank list, etcd), the handshakes and the identity checks
(one engine, one incarnation), loading each rank's agent and exposure table, the transfer plan
and its prepared lists, re-linking a lost rank alone, and the notices a rank gets outside a
pull (done, extend, bye). Running pulls is `akv.runtime.session`'s; this module reaches its
decode rank only through `DecodeRank`, and tells the
session about a rank it lost through the ``on_lost`` callable it is handed; the notices it
sends report the ranks they reached, for the caller to hand to the poller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from anyio.abc import ByteStream

from akv.errors import (
    AkvError,
    BackPressureError,
    ClosedError,
    HandshakeError,
    IncompatiblePeerError,
    PeerLostError,
    TransferError,
    TransferTimeout,
    UnsafeReadError,
)
from akv.geometry.cache import CacheSpec
from akv.plan import RankMemory, TransferPlan
from akv.protocol.address import Endpoint, EngineAddress
from akv.protocol.messages import Challenge, Notice, RankInfo, encode_notice
from akv.protocol.push import PushNotice, encode_push
from akv.runtime import local
from akv.runtime.client import watch
from akv.runtime.finder import EngineFinder, Found
from akv.runtime.local import LocalRank
from akv.runtime.paths import packed
from akv.runtime.paths.copy import CopyPlan
from akv.runtime.paths.tables import RemoteTable
from akv.runtime.rank import DecodeRank

if TYPE_CHECKING:
    from akv.metrics import Metrics

__all__ = ["EngineLinks", "RankLink"]


@dataclass(eq=False)
class RankLink:
    """What a session holds for one prefill rank: its agent, memory and exposure table."""

    rank: int
    info: RankInfo
    agent: str
    check: RemoteTable | None = None  # its exposure table, prepared
    local: LocalRank | None = None  # the rank itself, if it lives in this process
    broken: bool = False
    loading: anyio.Event | None = None
    dropped: bool = False  # its reference to the remote agent was given back
    gone: bool = False  # its process died (its control connection ended: see EngineLinks._watch)
    directory: RemoteTable | None = None  # its packed-copy directory, prepared (akv.packing)


class EngineLinks:
    """The ranks of one prefill engine that a decode rank reads from or notifies, linked.

    Args:
        rank: the decode rank.
        address: the engine's address.
        on_lost: called with a rank, the error and whether its process is gone when a rank's
            link is reset: the pulls waiting on it fail with that error.
        log: the session's logger.
    """

    def __init__(
        self,
        rank: DecodeRank,
        address: EngineAddress,
        on_lost: Callable[[int, AkvError, bool], None],
        log: Any,
    ) -> None:
        self.rank = rank
        self._on_lost = on_lost
        self.metrics: Metrics = rank.metrics
        self.log = log
        self.address = address
        self.finder = EngineFinder(rank, address, self.needed, log)
        self.closed = False  # unloaded: nothing is linked again
        self.remote_spec: CacheSpec | None = None
        self.prefill_tp = 0
        self.lease_s = 0.0
        self.plan: TransferPlan | None = None
        self.links: dict[int, RankLink] = {}
        self.dlists: dict[Any, Any] = {}
        self.copier: CopyPlan | None = None  # the copy path's plan, if ranks live in this process
        self._loading: anyio.Event | None = None
        self._installing = anyio.Lock()  # one plan rebuild at a time
        self._relink_failed: dict[int, tuple[anyio.Event, AkvError]] = {}  # rank -> failed attempt
        self._watches: dict[Endpoint, anyio.CancelScope] = {}  # endpoint -> its watch (see _watch)

    @property
    def agents(self) -> dict[int, str]:
        """The NIXL agent name of each linked prefill rank."""
        return {r: link.agent for r, link in self.links.items()}

    @property
    def mode(self) -> str:
        """``"pull"`` or ``"push"`` (for a rank in ``"auto"``, ``"pull"`` until chosen at the first handshake)."""
        return self.finder.mode or "pull"

    @property
    def staging_sent(self) -> bool:
        """Push mode: whether the Hellos sent named this rank's staging area (packed push)."""
        return self.finder.staging_sent

    @property
    def remote_engine_id(self) -> str:
        """The engine linked to (empty until the first handshake)."""
        return self.finder.engine_id

    def needed(self, prefill_tp: int) -> set[int]:
        """The prefill ranks this decode rank reads from or notifies."""
        c = self.rank
        return set(c.cache.notify_ranks(c.tp_rank, c.tp_size, prefill_tp))

    @property
    def broken(self) -> bool:
        """True if some linked prefill rank was lost (the next pull needing it re-handshakes)."""
        return any(link.broken for link in self.links.values())

    async def handshake(self) -> None:
        """Handshake with every prefill rank this rank needs; shared by concurrent callers."""
        while self._loading is not None:
            await self._loading.wait()
            if self.plan is not None:
                return
        self._loading = done = anyio.Event()
        try:
            found = await self.finder.fetch(None)
            await self._install(found)
        except BaseException:
            self.metrics.inc("handshakes_failed")
            raise
        finally:
            self._loading = None
            done.set()
        self.metrics.inc("handshakes")
        self.log.info(
            "handshake done",
            remote=self.remote_engine_id,
            prefill_tp=self.prefill_tp,
            ranks=sorted(found.ranks),
            mode=self.mode,
        )

    async def _install(self, found: Found) -> None:
        """Load the agents of the ranks ``found`` (replacing older links of those ranks),
        rebuild the plan, prepare what changed, watch their processes; then their engine's
        incarnation is the session's. NIXL calls run in a worker thread; one install at a time."""
        try:
            async with self._installing:
                await self._install_locked(found.challenge, found.ranks, found.restarted)
        except BaseException:
            await found.aclose()
            raise
        self.finder.adopt(found)
        if found.restarted:
            self.metrics.inc("engine_restarts")
            self.log.warning(
                "the prefill engine restarted: its new incarnation is linked, pulls of what only "
                "the old one exposed fail",
                remote=found.challenge.engine_id,
                instance=found.instance,
            )
        await self._watch_all(found)

    async def _watch_all(self, found: Found) -> None:
        """Watch the processes of the ranks ``found`` through their handshake connections."""
        kept, found.kept = found.kept, []
        for endpoint, ranks, stream in kept:
            old = self._watches.pop(endpoint, None)
            if old is not None:
                old.cancel()
            scope = anyio.CancelScope()
            links = {r: self.links[r] for r in ranks if r in self.links}
            if self.closed or not self.rank.spawn(self._watch, endpoint, links, stream, scope):
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                continue
            self._watches[endpoint] = scope

    async def _watch(
        self, endpoint: Endpoint, links: dict[int, RankLink], stream: ByteStream, scope: anyio.CancelScope
    ) -> None:
        """One endpoint's watch (`akv.runtime.client.watch`): once its ranks' process is gone,
        their links are lost (the pulls waiting on them fail at once, the next pull needing
        them links them again)."""
        why = None
        with scope:
            why = await watch(stream)
        if self._watches.get(endpoint) is scope:
            del self._watches[endpoint]
        if why is None or scope.cancel_called:
            return
        for rank, link in links.items():
            if self.links.get(rank) is not link or link.dropped or link.broken:
                continue  # linked again since, or known lost already
            link.broken = link.gone = True
            self.metrics.inc("peers_lost")
            self.log.warning("prefill rank lost: the pulls needing it fail", prefill_rank=rank, reason=why)
            self._on_lost(rank, PeerLostError(f"prefill rank {rank} at {endpoint} is gone: {why}"), True)

    async def _install_locked(self, ch: Challenge, infos: dict[int, RankInfo], restarted: bool) -> None:
        if self.closed:
            raise ClosedError("the session is closed")
        c = self.rank
        if c.same_process == "copy":
            elsewhere = sorted(r for r, i in infos.items() if local.find(i) is None)
            if elsewhere:
                raise IncompatiblePeerError(
                    f"prefill ranks {elsewhere} of engine {ch.engine_id!r} do not live in this process: "
                    "same_process='copy' needs every one here (use 'auto' to copy only when they are)",
                    ("same_process",),
                )
        if c.transfer == "packed" and (plain := sorted(r for r, i in infos.items() if i.pack is None)):
            raise packed.error_for(plain, ch.engine_id)
        if c.verify_exposure:
            missing = sorted(r for r, i in infos.items() if not i.exposure_buckets)
            if missing:
                raise IncompatiblePeerError(
                    f"prefill ranks {missing} publish no exposure table: run the same akv release on both "
                    "engines (or pass verify_exposure=False to trust it blindly)",
                    ("exposure",),
                )
        if c.transfer != "direct" and self.mode != "push" and any(i.pack is not None for i in infos.values()):
            await c.enable_packing()
        for r in infos:  # a rank linked before (lost, or restarted): forget its old agent first
            link = self.links.get(r)
            if link is not None:
                why = (
                    f"engine {ch.engine_id!r} was restarted"
                    if restarted
                    else f"the link to prefill rank {r} was reset"
                )
                self._on_lost(r, PeerLostError(why), False)
                self._drop(link)
                link.broken = True
        epoch = c.agent_epoch
        fresh = await anyio.to_thread.run_sync(self._link_blocking, infos)
        before = {r: self.links[r] for r in fresh if r in self.links}
        installed = anyio.Event()
        for link in fresh.values():
            link.loading = installed  # pulls wait until its lists are prepared too
        self.links.update(fresh)
        try:
            memory = {
                r: RankMemory(r, ch.tp_size, tuple(link.info.region_addrs), link.info.device_id)
                for r, link in self.links.items()
            }
            plan = TransferPlan(local_spec=c.cache, local=c.memory, remote_spec=ch.spec, remote=memory)
            await anyio.to_thread.run_sync(self._prep_blocking, plan)
            if c.agent_epoch != epoch:  # the agent was replaced meanwhile: these links are dead
                raise PeerLostError(
                    "this decode rank replaced its NIXL agent during the handshake: pull again"
                )
        except BaseException:
            for r, link in fresh.items():
                self._drop(link)
                if r in before:
                    self.links[r] = before[r]  # still broken: the next pull tries again
                else:
                    del self.links[r]
            raise
        finally:
            for link in fresh.values():
                link.loading = None
            installed.set()
        here = {r: link.local for r, link in self.links.items() if link.local is not None and not link.broken}
        if self.copier is not None:
            self.copier.close()
        self.copier = None
        if here:
            try:
                self.copier = CopyPlan(plan.tables, c.kv_caches, here, c.copy_inline_bytes, c.copy_with)
            except TransferError as exc:  # the tensors do not match what was announced: read instead
                self.log.warning("prefill ranks of this process are read through NIXL", error=str(exc))
        self.remote_spec = ch.spec
        self.prefill_tp = ch.tp_size
        self.lease_s = ch.lease_s
        self.plan = plan

    def _link_blocking(self, infos: dict[int, RankInfo]) -> dict[int, RankLink]:
        backend = self.rank.backend
        shared = self.rank.check_with == "auto"
        out: dict[int, RankLink] = {}
        try:
            for rank, info in infos.items():
                link = out[rank] = RankLink(rank, info, backend.add_remote(info.agent_metadata))
                if self.rank.same_process != "nixl":
                    link.local = local.find(info)
                backend.connect(link.agent)  # so the first pull does not pay for wire-up
                if self.rank.verify_exposure:
                    link.check = RemoteTable.of_exposures(backend, link.agent, info, shared=shared)
                if info.pack is not None and self.rank.staging is not None and self.mode != "push":
                    link.directory = RemoteTable.of_directory(backend, link.agent, info.pack, shared=shared)
        except BaseException:
            for link in out.values():
                self._drop(link)
            raise
        return out

    def _prep_blocking(self, plan: TransferPlan) -> None:
        """Prepare the plan's tables not prepared yet (a relinked rank's remote ones)."""
        c = self.rank
        for key, table in plan.tables.items():
            if key in self.dlists:
                continue
            if key[0] == "local":
                self.dlists[key] = c.local_dlist(key, table)
                continue
            link = self.links[int(key[1])]  # type: ignore[call-overload]
            if not link.broken:  # a lost rank's lists are prepared when it is linked again
                self.dlists[key] = c.backend.prep(link.agent, table, link.info.mem_type)

    def _drop(self, link: RankLink) -> None:
        """Release a rank's remote lists and forget its agent."""
        backend = self.rank.backend_or_none
        for key in [k for k in self.dlists if k[0] == "remote" and k[1] == link.rank]:
            handle = self.dlists.pop(key)
            if backend is not None:
                backend.release_dlist(handle)
        if link.check is not None:
            link.check.released = True  # notices queued behind it are dropped (see CheckBatcher)
        if link.directory is not None:
            link.directory.released = True  # packed pulls looking it up fail instead
        if backend is not None:
            if link.check is not None:
                backend.release_dlist(link.check.dlist)
            if link.directory is not None:
                backend.release_dlist(link.directory.dlist)
            if not link.dropped:  # one reference per link: the agent may serve other sessions
                backend.remove_remote(link.agent)
        link.dropped = True
        link.check = None
        link.directory = None
        link.local = None
        link.broken = True
        if self.copier is not None:
            self.copier.remote.pop(link.rank, None)

    def unload(self) -> None:
        """Forget every link and the plan (the session closed); nothing is linked again."""
        self.closed = True
        self.finder.forget()
        for scope in self._watches.values():
            scope.cancel()
        self._watches.clear()
        for link in self.links.values():
            self._drop(link)
        self.links.clear()
        self.dlists.clear()
        self.plan = None
        if self.copier is not None:
            self.copier.close()
        self.copier = None

    async def relink(self, ranks: Sequence[int]) -> None:
        """Re-handshake with lost prefill ranks only (shared by concurrent callers)."""
        waiting = [self.links[r].loading for r in ranks if r in self.links and self.links[r].loading]
        todo = [
            r for r in ranks if r in self.links and self.links[r].loading is None and self.links[r].broken
        ]
        if todo:
            done = anyio.Event()
            for r in todo:
                self.links[r].loading = done
            gone = all(self.links[r].gone for r in todo)  # no reconnects to what is known dead
            try:
                await self._install(await self.finder.fetch(set(todo), retries=0 if gone else None))
                self.metrics.inc("handshakes")
                self.log.info("prefill ranks re-linked", ranks=todo)
            except BaseException as exc:
                self.metrics.inc("handshakes_failed")
                for r in todo:
                    if r in self.links:
                        self.links[r].loading = None
                if isinstance(exc, AkvError):
                    self.log.warning(
                        "prefill ranks lost: the pulls needing them fail", ranks=todo, error=str(exc)
                    )
                    failure = (done, exc)
                    for r in todo:
                        self._relink_failed[r] = failure
                    if gone and type(exc) is HandshakeError:  # unreachable, and known dead: gone for now
                        raise PeerLostError(
                            f"prefill ranks {todo} are lost, and linking them again failed: {exc}"
                        ) from exc
                raise
            finally:
                done.set()
        for event in waiting:
            if event is not None:
                await event.wait()
        lost = [r for r in ranks if r in self.links and self.links[r].broken]
        for r in lost:  # the attempt we waited for failed: fail with it, at once, not one by one
            failed = self._relink_failed.get(r)
            if failed is not None and failed[0] in waiting:
                raise PeerLostError(f"prefill rank {r} is lost: linking it again failed: {failed[1]}")
        if lost and not todo:
            await self.relink(lost)  # no attempt of another caller said why: try ourselves

    def mark_broken(self, error: AkvError, rank: int | None) -> None:
        """Note a failed read: the next pull needing that rank re-handshakes with it (nothing
        clears that but a successful handshake). A rank that went away does not always show
        as PeerLostError (NIXL may just report the transfer in error), so any transfer error
        counts, except a timeout (the peer may only be slow, and a handshake with a hung peer
        would just time out too), a failed exposure check and back-pressure (the link is fine),
        and a failure that is no rank's (``rank`` None)."""
        if rank is None or not isinstance(error, TransferError):
            return
        if isinstance(error, (TransferTimeout, UnsafeReadError, BackPressureError)):
            return
        link = self.links.get(rank)
        if link is not None:
            link.broken = True
            link.gone |= isinstance(error, PeerLostError)  # NIXL saw its endpoint fail: dead

    def invalidate(self, ranks: Sequence[int]) -> None:
        """Writers that did not confirm a stop in time: forget their agents (the next pull
        that needs them handshakes again)."""
        for rank in ranks:
            link = self.links.get(rank)
            if link is not None:
                self._drop(link)

    def notify(self, ranks: Sequence[int], notice: bytes) -> list[int]:
        """Send a notice to prefill ranks (handed over directly to ranks of this process); a
        failure only logs (the rank releases by lease). Returns the ranks it reached over
        NIXL (the poller flushes behind them, and progresses the agent while they leave)."""
        reached: list[int] = []
        for rank in ranks:
            try:
                link = self.links[rank]
                here = link.local
                if here is not None and local.alive(here):
                    here.deliver(self.rank.backend.name, notice)
                else:
                    self.rank.backend.notify(link.agent, notice)
                    reached.append(rank)
                self.metrics.inc("notifications_sent")
            except (AkvError, KeyError) as exc:
                self.log.warning(
                    "notifying a prefill rank failed; it will release by lease",
                    prefill_rank=rank,
                    error=str(exc),
                )
        return reached

    def say_bye(self) -> bool:
        """Push mode: tell the prefill ranks to forget this decode rank's agent; True if a
        notice went out (it leaves while the agent progresses)."""
        c = self.rank
        if self.mode != "push" or c.backend_or_none is None:
            return False
        bye = encode_push(
            PushNotice(kind="bye", engine_id=c.engine_id, decode_rank=c.tp_rank, decode_tp=c.tp_size)
        )
        for link in self.links.values():
            if not link.dropped:
                with contextlib.suppress(AkvError):
                    c.backend.notify(link.agent, bye)
        return True

    def extend(self, request_ids: Sequence[str]) -> list[int]:
        """Send "extend" notices for ``request_ids`` to every prefill rank this rank notifies;
        returns the ranks reached over NIXL."""
        if not request_ids or self.plan is None:
            return []
        c = self.rank
        return self.notify(
            self.plan.notify,
            encode_notice(Notice("extend", c.engine_id, c.tp_rank, c.tp_size, list(request_ids))),
        )

    def ready_now(self, plan: TransferPlan) -> bool:
        """True if every rank ``plan`` notifies is linked and needs nothing before a pull (what
        `ready` would return at once)."""
        links = self.links
        for r in plan.notify:
            link = links[r]
            if link.broken or link.loading or (link.local is not None and not local.alive(link.local)):
                return False
        return True

    async def ready(self, plan: TransferPlan) -> TransferPlan:
        """The plan once every rank it notifies is linked: ranks of this process that closed,
        or lost ones, are linked again first. Raises what re-linking raises."""
        for r in plan.notify:  # a rank of this process that closed: link again (it may have restarted)
            here = self.links[r].local
            if here is not None and not local.alive(here):
                self._on_lost(r, PeerLostError(f"prefill rank {r} of this process closed"), True)
                self.links[r].broken = True
        while lost := [r for r in plan.notify if self.links[r].broken or self.links[r].loading]:
            await self.relink(lost)  # other ranks may be re-linking meanwhile: look again after
            if self.plan is None or self.closed:
                raise ClosedError("the session is closed")
            plan = self.plan
        return plan

    def flush_check(self, rank: int) -> RemoteTable | None:
        """The exposure-check list of ``rank`` to flush notices behind (None: not linked, or broken)."""
        link = self.links.get(rank)
        if link is None or link.check is None or link.broken:
            return None
        return link.check

    def reset(self) -> None:
        """The decode rank replaced its agent: forget every handle of the old one (without
        calling it); the next pull re-links."""
        for link in self.links.values():
            link.dropped = True  # its reference died with the old agent
            if link.check is not None:
                link.check.released = True
            link.check = None
            link.directory = None  # a prepared list of the old agent (packed copies)
            link.broken = True
        self.dlists.clear()
