"""The worker half of the vLLM connector: one per TP rank, in vLLM's worker process.

The rank's [`Producer`][akv.Producer] (prefill) or [`Consumer`][akv.Consumer] (decode), or
both (``kv_both``), wrap vLLM's own KV tensors (no copy) and live on an anyio event loop in a
thread of their own; vLLM's step only hands work over and collects outcomes, so it never
waits on the network, nor on akv's thread: each step's orders (withdraw, expose, pull) go
into one queue with a wake-up of the loop that returns at once (`loop.call_soon_threadsafe`,
not a portal call, which waits until the loop thread ran it), and one task of the loop
carries them out in order. On CUDA, the step records an event after its forward pass
instead of synchronizing the device: the request is exposed once that event fired, so no
reader sees KV the forward pass is still writing. Outcomes cross threads through one lock:

- prefill: each rank's releases (read, pushed, expired) become ``finished_sending``;
- decode: each pull's end becomes ``finished_recving``, and a failed one also
  ``failed_recving`` (vLLM then recomputes or fails the request by its
  ``kv_load_failure_policy``): the blocks of a failed pull are never used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from akv.errors import AkvError, EngineChangedError, NotExposedError, UnknownRequestError
from akv.integrations.vllm.layout import LayerGroup, describe
from akv.integrations.vllm.params import ConnectorMeta, ExposeJob, PullJob

if TYPE_CHECKING:
    from akv.runtime.transfer import PullRequest, Transfer

__all__ = ["Outcomes", "WorkerHalf"]

log = logging.getLogger("akv.vllm")


@dataclass
class Outcomes:
    """What the loop thread hands to vLLM's step (guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    # figures since the last stats call
    pulls_ms: list[float] = field(default_factory=list)
    pull_bytes: list[int] = field(default_factory=list)
    failures: int = 0
    releases: dict[str, int] = field(default_factory=dict)

    def take(self) -> tuple[set[str], set[str], set[str]]:
        with self.lock:
            out = self.sent, self.received | self.failed, self.failed
            self.sent, self.received, self.failed = set(), set(), set()
        return out

    def take_stats(self) -> dict[str, Any]:
        with self.lock:
            data = {
                "transfer_ms": self.pulls_ms,
                "bytes": self.pull_bytes,
                "failures": self.failures,
                "releases": self.releases,
            }
            self.pulls_ms, self.pull_bytes, self.failures, self.releases = [], [], 0, {}
        return data


def _name_thread(name: str) -> None:
    """Name the calling OS thread (Linux: ``/proc/PID/task/TID/comm``), so that tools such as
    ``top -H`` and ``examples/vllm/bench.py --loaded`` tell akv's thread from vLLM's."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: nothing to name
        pass


def _served(future: Any) -> None:
    """The serving task ended: say so if it failed (the steps' orders would wait forever)."""
    if not future.cancelled() and future.exception() is not None:
        log.error("akv: the worker's serving task failed: %r", future.exception())


def _allow_amx() -> None:
    """Ask Linux for this process's use of AMX tiles (``arch_prctl(ARCH_REQ_XCOMP_PERM)``,
    through torch), where the CPU has them. vLLM 0.32.0's CPU attention runs AMX kernels for
    bf16 caches in blocks of 32 tokens without asking, so on such a CPU the first decode step
    of an instance whose process had not yet asked (its matmuls were too small for oneDNN's
    AMX kernels, which ask) died of SIGILL in ``cpu_attention_with_kv_cache``. Asking twice,
    or where there is no AMX, does nothing."""
    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None and torch.cpu._is_amx_tile_supported():
        init()


class WorkerHalf:
    """One TP rank's akv side (see the module text).

    Args:
        ident: the instance's identity and options (shared with the scheduler half).
        groups: vLLM's KV-cache groups as akv sees them.
        tp_rank, tp_size: this rank.
    """

    def __init__(self, ident: Any, groups: Sequence[LayerGroup], tp_rank: int, tp_size: int) -> None:
        self.ident = ident
        self.groups = groups
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.out = Outcomes()
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._ranks: list[AbstractContextManager[Any]] = []
        self.producer: Any = None
        self.consumer: Any = None
        self._names = [g.name for g in groups]
        self._device = torch.device("cpu")
        # the steps' orders for the loop's `_serve` task: exposures and withdrawals (in order:
        # the forward pass's CUDA event or None, exposures, withdrawals), pulls
        self._orders: deque[tuple[Any, Mapping[str, ExposeJob], Iterable[str]]] = deque()
        self._pulls: deque[Mapping[str, PullJob]] = deque()
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: anyio.Event | None = None
        self._serving: Any = None  # the future of `_serve`

    # set-up ----------------------------------------------------------------------------

    def start(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Describe vLLM's tensors, start the loop thread and this rank's Producer / Consumer."""
        import akv

        spec, regions = describe(kv_caches, self.groups, content=self.ident.content)
        self._device = regions[0].device
        if self._device.type == "cpu":
            _allow_amx()
        o = self.ident.options
        transfer = o.transfer or ("auto" if self._device.type == "cuda" else "direct")
        self._portal_cm = start_blocking_portal("asyncio")
        self._portal = self._portal_cm.__enter__()
        self._loop = self._portal.call(asyncio.get_running_loop)
        self._portal.call(_name_thread, f"akv-{self.tp_rank}")  # its CPU time is findable in /proc
        if self._device.type == "cuda":  # events and kernels of akv's thread on this rank's device
            self._portal.call(torch.cuda.set_device, self._device)
        common: dict[str, Any] = dict(
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            engine_id=self.ident.engine_id,
            secret=o.secret,
            tls=o.tls,
        )
        try:
            if self.ident.producer:
                first = self.tp_rank == 0
                self.producer = self._enter(
                    akv.Producer(
                        regions,
                        spec,
                        on_release=self._released,
                        lease=o.lease,
                        host=o.host,
                        port=self.ident.port if first else 0,
                        advertise_host=o.advertise_host,
                        allow_insecure=o.allow_insecure,
                        bootstrap=None if first or o.etcd else self.ident.bootstrap,
                        etcd=o.etcd,
                        transfer=transfer,
                        pack_pool_bytes=o.pack_pool_bytes,
                        # no spinning after progress, and polls up to 20 ms apart while requests
                        # wait for their readers: a pull needs nothing from this poller (it
                        # handles "done" notices and leases; push announcements keep their own
                        # 0.5 ms cadence), and each wake-up takes the GIL and the core from
                        # vLLM's own steps
                        spin_s=0.0,
                        poll_max_s=0.02,
                        **common,
                    )
                )
            if self.ident.consumer:
                self.consumer = self._enter(
                    akv.Consumer(
                        regions,
                        spec,
                        mode=o.mode,
                        transfer=transfer,
                        transfer_timeout=o.transfer_timeout,
                        connect_timeout=o.connect_timeout,
                        handshake_timeout=o.handshake_timeout,
                        settle_timeout=o.settle_timeout,
                        idle_timeout=o.idle_timeout,
                        # no spinning after progress either: vLLM reads completions once per
                        # step, so a spin only buys microseconds nobody waits for, at the price
                        # of the core vLLM's forward passes run on (polls stay 0.5-2 ms apart
                        # while pulls are in flight)
                        spin_s=0.0,
                        **common,
                    )
                )
            self._serving = self._portal.start_task_soon(self._serve)
            self._serving.add_done_callback(_served)
        except BaseException:
            self.shutdown()
            raise
        log.info(
            "akv rank %d/%d ready: %s, groups %s, address %s",
            self.tp_rank,
            self.tp_size,
            "+".join(r for r, on in (("prefill", self.producer), ("decode", self.consumer)) if on),
            [(g.name, g.layout) for g in spec.groups],
            self.ident.address,
        )

    def _enter(self, rank: Any) -> Any:
        if self._portal is None:  # pragma: no cover - start() opens the portal first
            raise RuntimeError("no event loop")
        cm = self._portal.wrap_async_context_manager(rank)
        value = cm.__enter__()
        self._ranks.append(cm)
        return value

    def shutdown(self) -> None:
        """Close this rank's Producer / Consumer (their pulls fail, exposures close) and the loop
        (orders not carried out yet are dropped: the ranks close)."""
        if self._serving is not None:
            self._stop = True  # the serving task ends once its pulls did (the ranks close below)
            self._wake_loop()
        while self._ranks:
            cm = self._ranks.pop()
            try:
                cm.__exit__(None, None, None)
            except Exception as exc:  # shutting down: say it, go on closing the rest
                log.warning("akv: closing a rank failed: %s", exc)
        if self._portal_cm is not None:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = self._portal = None
        self._serving = self._loop = None

    # each step -------------------------------------------------------------------------

    def _ids(self, groups: tuple[tuple[int, ...], ...]) -> Any:
        if len(self._names) == 1:
            return list(groups[0])
        return {n: list(g) for n, g in zip(self._names, groups, strict=True)}

    def step(self, meta: ConnectorMeta) -> None:
        """At the start of a step: hand over late exposures, withdrawn leases and pulls (returns
        at once; akv's loop carries them out in order)."""
        if self._serving is None:
            return
        if self.producer is not None and (meta.expose_late or meta.withdraw):
            self._orders.append((None, meta.expose_late, meta.withdraw))
            self._wake_loop()
        if self.consumer is not None and meta.pull:
            self._pulls.append(meta.pull)
            self._wake_loop()

    def after_forward(self, meta: ConnectorMeta) -> None:
        """After the step's forward pass: hand over the requests whose prompt it completed, to
        be exposed once the pass's writes are done (a CUDA event; returns at once)."""
        if self._serving is None or self.producer is None or not meta.expose:
            return
        event = None
        if self._device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self._device))  # the KV is written before it is read
        self._orders.append((event, meta.expose, ()))
        self._wake_loop()

    def _wake_loop(self) -> None:
        """Wake the serving task for the orders just queued, without waiting for akv's thread."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed (shutting down)
                loop.call_soon_threadsafe(self._woken)

    def _woken(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _serve(self) -> None:
        """The task of akv's loop that carries out the steps' orders: exposures and withdrawals
        one after the other (a withdrawal never overtakes the exposure it ends), each exposure
        once its forward pass's event fired; pulls at once, as tasks of their own."""
        async with anyio.create_task_group() as tg:
            while not self._stop:
                self._wake = wake = anyio.Event()
                if not self._orders and not self._pulls:
                    await wake.wait()
                self._start_pulls(tg)
                while self._orders and not self._stop:
                    event, jobs, withdraw = self._orders.popleft()
                    try:
                        delay = 0.0001
                        # the forward pass may still write: a CUDA event has nothing to await
                        while event is not None and not event.query() and not self._stop:
                            await anyio.sleep(delay)
                            delay = min(delay * 2, 0.002)
                            self._start_pulls(tg)  # pulls wait for no exposure
                    except Exception:  # the device failed: nothing of these requests is exposed
                        log.exception(
                            "akv: waiting for the forward pass of %s failed: blocks freed", list(jobs)
                        )
                        with self.out.lock:
                            self.out.sent.update(jobs)
                        continue
                    if self._stop:  # closing: the ranks close, and their exposures with them
                        break
                    self._expose_all(jobs, withdraw)
                    self._start_pulls(tg)

    def _start_pulls(self, tg: Any) -> None:
        while self._pulls:
            by_source: dict[str, dict[str, PullJob]] = {}
            for rid, job in self._pulls.popleft().items():
                by_source.setdefault(job.remote.address, {})[rid] = job
            for jobs in by_source.values():
                if len(jobs) == 1:
                    tg.start_soon(self._pull, *next(iter(jobs.items())))
                else:
                    tg.start_soon(self._pull_together, tg, jobs)

    async def _pull_together(self, tg: Any, jobs: Mapping[str, PullJob]) -> None:
        """A step's pulls from one prefill instance, launched together (`pull_many`); each is
        then awaited on its own, as `_pull` does. If the batch cannot be launched (a bad
        request in it, the instance unreachable), each pull goes its own way and reports its
        own outcome."""
        t0 = time.perf_counter()
        try:
            reqs = [self._request(job) for job in jobs.values()]
            session = await self.consumer.connect(next(iter(jobs.values())).remote.address)
            transfers = await session.pull_many(reqs)
        except Exception:
            for rid, job in jobs.items():
                tg.start_soon(self._pull, rid, job)
            return
        for (rid, job), transfer in zip(jobs.items(), transfers, strict=True):
            tg.start_soon(self._pull, rid, job, transfer, t0)

    def _request(self, job: PullJob) -> PullRequest:
        import akv

        remote = job.remote
        return akv.PullRequest(
            request_id=remote.request_id,
            local_block_ids=self._ids(job.local_block_ids),
            remote_block_ids=self._ids(remote.block_ids),
            generation=remote.generation,
            num_tokens=remote.num_tokens if any(g.kind == "sliding" for g in self.groups) else None,
            lease_s=remote.lease,
        )

    def _expose_all(self, jobs: Mapping[str, ExposeJob], withdraw: Iterable[str]) -> None:
        for rid in withdraw:
            try:
                self.producer.extend(rid, 0.0)  # released as expired on the poller's next pass
            except UnknownRequestError:  # never exposed here (it failed): nothing holds the blocks
                with self.out.lock:
                    self.out.sent.add(rid)
            except Exception:  # its lease runs out in time: released (and reported) then
                log.exception("akv: ending the lease of request %s failed", rid)
        for rid, job in jobs.items():
            try:
                self.producer.expose(rid, self._ids(job.block_ids), generation=job.generation)
            except AkvError as exc:  # never strand the blocks: vLLM frees them now
                log.error("akv: exposing request %s failed (%s): its blocks are freed unread", rid, exc)
                with self.out.lock:
                    self.out.sent.add(rid)
            except Exception:
                self._unexpected(rid)

    def _unexpected(self, rid: str) -> None:
        """``expose`` failed in a way akv does not foresee: if the request is exposed after all,
        its lease ends now (released, and reported, as expired), else vLLM frees its blocks."""
        log.exception("akv: exposing request %s failed", rid)
        try:
            self.producer.extend(rid, 0.0)
        except UnknownRequestError:
            with self.out.lock:
                self.out.sent.add(rid)
        except Exception:  # pragma: no cover - its lease, if any, runs out in time
            log.exception("akv: ending the lease of request %s failed", rid)

    def _released(self, release: Any) -> None:
        with self.out.lock:
            self.out.sent.add(release.request_id)
            self.out.releases[release.reason] = self.out.releases.get(release.reason, 0) + 1

    async def _pull(
        self, rid: str, job: PullJob, launched: Transfer | None = None, t0: float | None = None
    ) -> None:
        """Pull one request (``launched``: its transfer, launched with its step's others at
        ``t0``), trying again while the prefill instance has not exposed it yet."""
        t0 = time.perf_counter() if t0 is None else t0
        deadline = time.monotonic() + self.ident.options.expose_wait
        remote = job.remote
        try:
            req = self._request(job)
            changed = False
            while True:
                try:
                    if launched is not None:
                        transfer, launched = launched, None
                    else:
                        session = await self.consumer.connect(remote.address)
                        transfer = await session.pull(req)
                    result = await transfer
                    break
                except EngineChangedError:
                    # another engine id answers at the address: a prefill instance restarted
                    # without a fixed engine_id (vLLM draws one at each start). The request came
                    # from whoever answers there now: a session to it, once.
                    if changed:
                        raise
                    changed = True
                    await (await self.consumer.connect(remote.address)).aclose()
                except NotExposedError:
                    # the prefill workers expose a request one engine step after it finished
                    if time.monotonic() >= deadline:
                        raise
                    await anyio.sleep(0.002)
        except Exception as exc:  # any failure: vLLM must never compute on these blocks
            log.warning(
                "akv: pull of request %s (prefill %s) failed: %s: %s",
                rid,
                remote.address,
                type(exc).__name__,
                exc,
            )
            with self.out.lock:
                self.out.failed.add(rid)
                self.out.failures += 1
            return
        with self.out.lock:
            self.out.received.add(rid)
            self.out.pulls_ms.append((time.perf_counter() - t0) * 1e3)
            self.out.pull_bytes.append(result.bytes)
