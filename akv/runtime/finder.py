"""Finding a prefill engine's ranks and handshaking with them (one conversation per endpoint).

Owns discovery (the bootstrap rank's list, a rank-list address, etcd), the concurrent
handshakes, and the identity a session is pinned to: one engine (its id), in its latest
incarnation (its instance id): ranks of another engine are refused, a new incarnation of
the same engine (a restarted pod) is adopted, every rank needed found again in it. It
returns what the ranks answered, as values (`Found`), with each handshake's connection
kept open to watch the rank's process by; linking their agents is `akv.runtime.links`'s.
"""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from anyio.abc import ByteStream

from akv.backends import host_is_here, reads_over_tcp
from akv.errors import (
    AkvError,
    ConfigError,
    EngineChangedError,
    HandshakeError,
    IncompatiblePeerError,
    MissingRanksError,
)
from akv.protocol.address import (
    BootstrapAddress,
    Endpoint,
    EngineAddress,
    EtcdAddress,
    RankListAddress,
    parse_endpoint,
)
from akv.protocol.handshake import HandshakeResult
from akv.protocol.messages import Challenge, Hello, RankInfo
from akv.runtime.rank import DecodeRank, _leaves

if sys.version_info < (3, 11):  # pragma: no cover - anyio brings the backport
    from exceptiongroup import BaseExceptionGroup

__all__ = ["EngineFinder", "Found"]


@dataclass
class Found:
    """What one `EngineFinder.fetch` found: the engine's challenge, the ranks' metadata, each
    handshake's connection kept open (``(endpoint, ranks it served, stream)``: the caller
    watches the ranks' processes with it, and closes it), and whether the engine answered as
    a new incarnation of the one linked before (``restarted``: every rank needed is then in
    ``ranks``, found again in it)."""

    challenge: Challenge
    ranks: dict[int, RankInfo]
    kept: list[tuple[Endpoint, list[int], ByteStream]] = field(default_factory=list)
    restarted: bool = False
    instance: str = ""  # the incarnation that answered ("": it did not say)

    async def aclose(self) -> None:
        """Close the connections kept (what nobody watches)."""
        kept, self.kept = self.kept, []
        with anyio.CancelScope(shield=True):
            for _, _, stream in kept:
                await stream.aclose()


class EngineFinder:
    """Finds the ranks of the engine at ``address`` and handshakes with them for ``rank``.

    ``needed`` maps the engine's TP size to the ranks this decode rank needs. ``engine_id``
    pins the engine once linked: ranks of another engine are refused with
    [`EngineChangedError`][akv.errors.EngineChangedError]; ``instance`` is the incarnation
    linked last, and one of the same engine answering with another is adopted (`Found`).
    """

    def __init__(
        self, rank: DecodeRank, address: EngineAddress, needed: Callable[[int], set[int]], log: Any
    ) -> None:
        self.rank = rank
        self.log = log
        self.address = address
        self.needed = needed
        self.engine_id = ""  # set by whoever links the ranks found
        self.instance = ""  # the engine's incarnation (Challenge.instance_id), once known
        self._registry: Any = None  # an EtcdRegistry for etcd:// addresses
        #: the session's mode, "pull" or "push": the rank's, or for a rank in "auto", chosen
        #: before the first handshake from where the engine is (see `choose_mode`)
        self.mode: str | None = None if rank.mode == "auto" else rank.mode
        self._auto_push = False  # push chosen by "auto", not confirmed by a handshake yet
        self._tcp_checked = False  # whether pull was checked against READs over TCP
        #: push mode: whether the Hellos sent named this rank's staging area (packed push)
        self.staging_sent = False
        self._retries = rank.retries  # of the fetch under way

    async def choose_mode(self, endpoints: Iterable[Endpoint]) -> None:
        """Decide the session's mode once, before the first handshake (the prefill ranks learn
        it from the hello). UCX never serves this session READs over TCP (a reader dying or
        stalling mid-READ over UCX TCP can kill the prefill process, see
        docs/operations.md#peer-death-over-tcp): where it would (``UCX_TLS`` leaves only TCP,
        or the engine's first endpoints are on another host and UCX may use no RDMA here), a
        rank in mode "auto" pushes, and a rank in mode "pull" is refused with a
        [`ConfigError`][akv.errors.ConfigError]; elsewhere "auto" pulls."""
        if self.mode == "push" or (self.mode is not None and self._tcp_checked):
            return
        here = True
        for host in sorted({ep.host for ep in endpoints}):
            here = False  # a name that does not resolve within connect_timeout: not here
            with anyio.move_on_after(self.rank.connect_timeout):
                here = await anyio.to_thread.run_sync(host_is_here, host, abandon_on_cancel=True)
            if not here:
                break
        tcp = reads_over_tcp(here)
        self._tcp_checked = True
        if self.mode == "pull":
            if tcp:
                raise ConfigError(
                    f"mode='pull' to {self.address}: UCX would serve this rank's READs over TCP, "
                    "where a reader dying or stalling mid-READ can kill the prefill process "
                    "(docs/operations.md#peer-death-over-tcp); use mode='push' or 'auto' "
                    "(--mode push), which writes instead"
                )
            return
        if tcp and self.rank.transfer == "packed":
            self.log.info(
                "transfer='packed' over TCP: the prefill ranks WRITE their packed copies into this "
                "rank's staging area (packed push), since UCX would serve READs of them over TCP",
                engine=str(self.address),
            )
        self.mode = "push" if tcp else "pull"
        self._auto_push = tcp

    def forget(self) -> None:
        """Drop what discovery holds (the session closed)."""
        self._registry = None

    def hello(self) -> Hello:
        """This decode rank's Hello (push mode: with its agent and regions, for the writers)."""
        c = self.rank
        hello = Hello(
            engine_id=c.engine_id,
            tp_rank=c.tp_rank,
            tp_size=c.tp_size,
            spec=c.cache,
            compat=c.cache.compat_hash(),
            nonce=secrets.token_bytes(16),
            agent_name=c.backend.name,
        )
        if self.mode == "push":  # the prefill ranks WRITE: they need our agent and regions
            hello = msgspec.structs.replace(
                hello,
                mode="push",
                agent_metadata=c.agent_metadata,
                region_addrs=list(c.memory.region_addrs),
                mem_type=c.mem_type,
                device_id=c.memory.device_id,
            )
            if c.staging is not None:  # the writers may put packed copies there
                hello = msgspec.structs.replace(
                    hello, staging_addr=c.staging.addr, staging_bytes=c.staging.arena.size
                )
        return hello

    async def _handshake_with(
        self,
        endpoint: Endpoint,
        choose: Callable[[Challenge], Sequence[int]],
        kept: list[tuple[Endpoint, list[int], ByteStream]] | None = None,
    ) -> HandshakeResult:
        from akv.runtime.client import client_handshake

        c = self.rank
        if self.mode == "push" and c.transfer != "direct" and c.staging is None:
            try:  # registered before the Hello: its metadata must hold it
                await c.enable_packing()
            except (AkvError, RuntimeError) as exc:  # e.g. no device memory left for it
                if c.transfer == "packed":
                    raise
                self.log.warning(
                    "no staging area for packed pushes: the prefill ranks write the paged blocks",
                    error=str(exc),
                )
        hello = self.hello()
        self.staging_sent = bool(hello.staging_bytes)
        streams: list[ByteStream] = []
        result = await client_handshake(
            endpoint,
            hello,
            secret=c.secret,
            choose_ranks=choose,
            connect_timeout=c.connect_timeout,
            handshake_timeout=c.handshake_timeout,
            retries=self._retries,
            tls=c.tls_context,
            keep=streams.append if kept is not None else None,
        )
        if kept is not None and streams:
            if result.ranks:
                kept.append((endpoint, sorted(result.ranks), streams[0]))
            else:  # it served none of the ranks needed: nothing of it to watch
                with anyio.CancelScope(shield=True):
                    await streams[0].aclose()
        return result

    async def fetch(self, ranks: set[int] | None, *, retries: int | None = None) -> Found:
        """Find the endpoints of ``ranks`` (None: every rank needed) and handshake with them.

        An engine answering with another incarnation than the one linked before (restarted)
        is handshaken with again for every rank needed, and that is what comes back
        (``restarted``). ``retries``: reconnects to an unreachable endpoint (default: the
        rank's ``retries``; 0 for ranks whose process is known to be gone). Push chosen by mode "auto" (READs would go over TCP) and refused by
        an engine that serves only pull: an
        [`IncompatiblePeerError`][akv.errors.IncompatiblePeerError] naming ``mode``, since
        pulling from it over TCP could kill it."""
        self._retries = self.rank.retries if retries is None else retries
        try:
            found = await self._fetch(ranks)
            if (
                found.restarted
                and ranks is not None
                and set(found.ranks) != self.needed(found.challenge.tp_size)
            ):
                await found.aclose()  # the ranks of the old incarnation are linked anew too
                found = await self._fetch(None)
                found.restarted = True
        except IncompatiblePeerError as exc:
            if not self._auto_push or "mode" not in exc.fields:
                raise
            raise IncompatiblePeerError(
                f"the prefill engine at {self.address} serves only pull, and UCX would serve this "
                "rank's READs over TCP, where a reader dying or stalling mid-READ can kill the prefill "
                "process (docs/operations.md#peer-death-over-tcp): let it serve push (akv prefill "
                f"--mode push, Producer(modes=('pull', 'push'))); {exc}",
                exc.fields,
            ) from exc
        self._auto_push = False  # the engine took the mode: it stays
        return found

    async def _fetch(self, ranks: set[int] | None) -> Found:
        kept: list[tuple[Endpoint, list[int], ByteStream]] = []
        try:
            challenge, infos, instance = await self._fetch_kept(ranks, kept)
        except BaseException:
            await Found(None, {}, kept).aclose()  # type: ignore[arg-type]
            raise
        restarted = bool(self.instance and instance and instance != self.instance)
        return Found(challenge, infos, kept, restarted, instance)

    def adopt(self, found: Found) -> None:
        """The ranks ``found`` were linked: their incarnation is the one this session serves
        from now on (a later fetch answering another is a restart)."""
        self.engine_id = found.challenge.engine_id
        if found.instance:
            self.instance = found.instance

    async def _fetch_kept(
        self, ranks: set[int] | None, kept: list[tuple[Endpoint, list[int], ByteStream]]
    ) -> tuple[Challenge, dict[int, RankInfo], str]:
        addr = self.address
        infos: dict[int, RankInfo] = {}
        challenges: list[Challenge] = []
        if isinstance(addr, BootstrapAddress):
            await self.choose_mode([addr.endpoint])
            tp, endpoints, first = await self._from_bootstrap(addr.endpoint, ranks, kept)
            challenges.append(first.challenge)
            infos.update(first.ranks)
        elif isinstance(addr, RankListAddress):
            tp = len(addr.endpoints)
            endpoints = {r: addr.endpoints[r] for r in (ranks if ranks is not None else self.needed(tp))}
        else:
            tp, endpoints = await self._from_etcd(addr, ranks)
        await self.choose_mode(endpoints.values())
        by_endpoint: dict[Endpoint, list[int]] = {}
        for rank, ep in endpoints.items():
            if rank not in infos:
                by_endpoint.setdefault(ep, []).append(rank)
        results: list[HandshakeResult] = []

        async def one(ep: Endpoint, wanted: list[int]) -> None:
            results.append(await self._handshake_with(ep, lambda ch: sorted(wanted), kept))

        try:
            async with anyio.create_task_group() as tg:
                for ep, wanted in by_endpoint.items():
                    tg.start_soon(one, ep, wanted)
        except BaseExceptionGroup as group:
            leaves = _leaves(group)
            if all(isinstance(e, AkvError) for e in leaves):
                raise leaves[0] from None  # a typed HandshakeError, as documented, not a group
            raise
        for res in results:
            challenges.append(res.challenge)
            infos.update(res.ranks)
        for ch in challenges:
            if ch.tp_size != tp or ch.engine_id != challenges[0].engine_id:
                raise HandshakeError(
                    f"the ranks at {addr} are not one engine: {ch.engine_id!r} of TP size {ch.tp_size} "
                    f"answered where {challenges[0].engine_id!r} of TP size {tp} was expected"
                )
        return challenges[0], infos, self._check_same_engine(challenges)

    def _check_same_engine(self, challenges: list[Challenge]) -> str:
        """Refuse (before adopting any metadata) ranks of another engine than the one this
        session linked to first, and ranks of two incarnations at once; returns the
        incarnation they answered with ("" if none said)."""
        ids = sorted({ch.instance_id for ch in challenges if ch.instance_id})
        engine = challenges[0].engine_id
        if len(ids) > 1:
            raise HandshakeError(f"the ranks at {self.address} are not one engine: instances {ids}")
        if self.engine_id and engine != self.engine_id:
            raise EngineChangedError(
                f"engine {engine!r} now answers at {self.address}, where this session linked to "
                f"{self.engine_id!r}: connect again for a session to it",
                "engine_id",
            )
        return ids[0] if ids else ""

    async def _from_bootstrap(
        self,
        bootstrap: Endpoint,
        ranks: set[int] | None,
        kept: list[tuple[Endpoint, list[int], ByteStream]],
    ) -> tuple[int, dict[int, Endpoint], HandshakeResult]:
        """Ask rank 0 for the engine's rank endpoints (waiting for ranks not registered yet);
        metadata of the needed ranks it serves itself comes in the same conversation."""
        deadline = time.monotonic() + self.rank.handshake_timeout
        delay = 0.05
        while True:
            need: set[int] = set()

            def choose(ch: Challenge, need: set[int] = need) -> list[int]:
                need.update(ranks if ranks is not None else self.needed(ch.tp_size))
                return sorted(r for r in need if r in ch.ranks)

            mine: list[tuple[Endpoint, list[int], ByteStream]] = []
            first = await self._handshake_with(bootstrap, choose, mine)
            ch = first.challenge
            listed = ch.endpoints or [str(bootstrap)] * ch.tp_size
            missing = sorted(r for r in need if r not in first.ranks and not listed[r])
            if not missing:
                kept.extend(mine)
                endpoints = {r: parse_endpoint(listed[r]) for r in need if r not in first.ranks}
                return ch.tp_size, endpoints, first
            await Found(ch, {}, mine).aclose()  # asked again below
            if time.monotonic() + delay > deadline:
                raise MissingRanksError(
                    f"prefill ranks {missing} of engine {ch.engine_id!r} have not registered with its "
                    f"bootstrap {bootstrap} within {self.rank.handshake_timeout}s: start them with "
                    f"--bootstrap {bootstrap} (or Producer(bootstrap=...))",
                    engine_id=ch.engine_id,
                    missing=tuple(missing),
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _from_etcd(self, addr: EtcdAddress, ranks: set[int] | None) -> tuple[int, dict[int, Endpoint]]:
        from akv.runtime.discovery import EtcdRegistry

        if self._registry is None:
            self._registry = EtcdRegistry(addr.etcd)
        timeout = self.rank.handshake_timeout
        try:  # resolution is rare: hold no HTTP connection between resolutions
            records = await self._registry.resolve(addr.engine_id, need=ranks, timeout=timeout)
            tp = next(iter(records.values())).tp_size
            need = ranks if ranks is not None else self.needed(tp)
            if not need <= records.keys():
                records = await self._registry.resolve(
                    addr.engine_id, need=need, tp_size_hint=tp, timeout=timeout
                )
        finally:
            await self._registry.aclose()
        return tp, {r: records[r].endpoint for r in need}
