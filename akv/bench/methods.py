"""The methods ``akv bench`` compares, each moving one batch of a workload's requests
(`Methods`). Every method moves the same bytes for the same block ids:

* ``akv``: [`TransferSession.pull`][akv.TransferSession.pull] and ``await``;
* ``akv_unchecked``: the same without the exposure check (``verify_exposure=False``);
* ``nixl``: a hand-written hot loop on the raw ``nixl_agent`` posting exactly akv's
  descriptors (indices from [`TransferPlan.prepare`][akv.plan.TransferPlan.prepare], computed
  on the clock, as any connector validates a request's ids and computes its indices, with
  akv's "done" notice on each READ) on the same strided prepped lists: ``make_prepped_xfer``,
  ``transfer``, spin on ``check_xfer_state``;
* ``perblock``: the same reads on the plan's tables prepared unstrided (one descriptor per
  region, and plane, per block, as per-block connectors post them; one per block and run
  where block sizes differ) and posted with merging off;
* ``memcpy``: torch gathers of the same bytes inside one process (the machine's limit);
* ``nixl_write`` (``--device cuda``): the hand-written loop's descriptors written the other
  way; ``akv_push`` (``--mode push``): akv in push mode.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from akv.bench.workloads import Figures
from akv.runtime.transfer import PullRequest

__all__ = ["Methods", "cuda_count", "cuda_index", "torch_index"]


class Methods:
    """The four ways of moving one batch of requests; each returns (bytes, seconds)."""

    def __init__(
        self,
        sessions: list[Any],
        consumers: list[Any],
        spec: Any,
        prefill_spec: Any,
        sample: tuple[str, Any, Any],
        fig: Figures,
        device: str = "cpu",
    ) -> None:
        import torch

        from akv.device import parse_device

        dev = parse_device(device).for_rank(0, cuda_count())
        self.sessions, self.consumers, self.fig = sessions, consumers, fig
        self.unchecked: list[Any] = []
        self.pushing: list[Any] = []  # sessions of consumers in push mode (akv bench --mode push)
        self.drive: list[Any] = []  # raw agents of this process to progress while spinning
        # perblock: every table of the plan as one (addr, len, dev) row per descriptor; a
        # descriptor keeps its index (row base + block), so akv's indices address them too.
        self.expanded: dict[Any, Any] = {}
        # Each list carries the memory type of the memory it describes: the consumer's own
        # (VRAM on a GPU) for local tables, the prefill rank's (its handshake says) for remote ones.
        for s, c in zip(sessions, consumers, strict=True):
            for tkey, table in s.plan.tables.items():
                if tkey[0] == "local":
                    agent, mem = "", c.mem_type
                else:
                    link = s.links[int(tkey[1])]
                    agent, mem = link.agent, link.info.mem_type
                self.expanded[(id(c), tkey)] = c.backend.prep_expanded(agent, table, mem)
        # One thread: torch's OpenMP workers spin after each copy and would steal this
        # machine's cores from whichever method runs next.
        torch.set_num_threads(1)
        # bytes one decode block receives on all decode ranks (the same for every replica choice)
        rid, local, remote = sample
        moved = sum(s.plan.prepare(rid, local, remote).bytes for s in sessions)
        if isinstance(local, dict):  # hybrid caches: one contiguous copy of a request's bytes
            self.width = 0
            self.src = torch.zeros(moved, dtype=torch.uint8, device=dev)
            self.dst = torch.zeros(moved, dtype=torch.uint8, device=dev)
            return
        self.width = moved // len(local)
        self.src = torch.zeros((prefill_spec.num_blocks, self.width), dtype=torch.uint8, device=dev)
        self.dst = torch.zeros((spec.num_blocks, self.width), dtype=torch.uint8, device=dev)

    async def run(self, method: str, batch: list[tuple[str, Any, Any]], record: bool) -> tuple[int, float]:
        if method == "akv":
            return await self._akv(batch, record, self.sessions, self.fig.latency_ms)
        if method == "akv_unchecked":
            return await self._akv(batch, record, self.unchecked, self.fig.latency_unchecked_ms, "-u")
        if method == "akv_push":
            return await self._akv(batch, record, self.pushing, [], "-p")
        if method == "memcpy":
            return self._memcpy(batch)
        if method == "nixl_write":
            return self._raw(batch, merge=True, record=False, op="WRITE")
        return self._raw(batch, merge=method == "nixl", record=record)

    async def _akv(
        self,
        batch: list[tuple[str, Any, Any]],
        record: bool,
        sessions: list[Any],
        latency: list[float],
        suffix: str = "",
    ) -> tuple[int, float]:
        total = 0
        t0 = time.perf_counter()
        transfers = []
        checked = sessions is self.sessions
        # The batch's pulls are launched together, as an engine launches a step's
        # (`pull_many`); the launch time of one is the batch's divided among them.
        for s in sessions:
            tl = time.perf_counter()
            transfers += await s.pull_many(
                [
                    PullRequest(request_id=f"{rid}{suffix}", local_block_ids=local, remote_block_ids=remote)
                    for rid, local, remote in batch
                ]
            )
            if record and checked:
                self.fig.launch_akv_us.extend([(time.perf_counter() - tl) * 1e6 / len(batch)] * len(batch))
        for t in transfers:
            res = await t
            total += res.bytes
            if record and checked:
                self.fig.descriptors_submitted += res.descriptors
                self.fig.paths[res.path] = self.fig.paths.get(res.path, 0) + 1
                stages = t.op.stages
                if res.path == "packed":
                    self.fig.lookup_s += stages["lookup"]
                    self.fig.read_s += stages["read"]
                    self.fig.unpack_s += stages["scatter"]
                elif res.path == "read" and "data" in stages:  # a direct read, or a packed pull's fallback
                    self.fig.data_ms.append(stages["data"] * 1e3)
                    self.fig.check_s += stages["check"]
        seconds = time.perf_counter() - t0
        if record:
            latency.extend([seconds * 1e3] * len(batch))
        return total, seconds

    def _raw(
        self, batch: list[tuple[str, Any, Any]], *, merge: bool, record: bool, op: str = "READ"
    ) -> tuple[int, float]:
        """The same reads and notifications, written directly against nixl_agent (``op``
        "WRITE": the same descriptors written the other way, as push transfers would)."""
        # On the clock, as in any connector: validating the ids and computing the indices
        # (exactly those akv posts), then posting, spinning and notifying.
        t0 = time.perf_counter()
        work = []
        for rid, local, remote in batch:
            for s, c in zip(self.sessions, self.consumers, strict=True):
                p = s.plan.prepare(rid, local, remote)
                # akv's notice, for a request id the prefill never exposed: it counts the notice
                # unknown and keeps the request exposed for akv's checked pull (they interleave).
                msg = s.done_notice(f"{rid}-n", p.remote_ids)
                if merge:
                    posts = [
                        (s.dlists[op.local_table], li, s.dlists[op.remote_table], ri)
                        for op, li, ri in p.posts
                    ]
                else:
                    e = self.expanded
                    posts = [
                        (e[(id(c), op.local_table)], li, e[(id(c), op.remote_table)], ri)
                        for op, li, ri in p.posts
                    ]
                notify = [s.agents[r] for r in p.standalone]
                if merge and record:
                    self.fig.nixl_submitted += sum(li.size for _, li, _ in p.posts)
                work.append((c.backend.raw, posts, notify, msg, p.bytes))
        total = 0
        ndesc = 0
        handles: list[tuple[Any, Any]] = []
        notices: list[tuple[Any, str, bytes]] = []
        for agent, posts, notify, msg, nbytes in work:
            for dl, lidx, dr, ridx in posts:
                tl = time.perf_counter()
                h = agent.make_prepped_xfer(op, dl, lidx, dr, ridx, msg, skip_desc_merge=not merge)
                agent.transfer(h)
                if merge and record:
                    self.fig.launch_nixl_us.append((time.perf_counter() - tl) * 1e6)
                handles.append((agent, h))
            total += nbytes
            notices.extend((agent, name, msg) for name in notify)
        for agent, h in handles:
            while agent.check_xfer_state(h) == "PROC":
                for other in self.drive:  # agents of this process: progress both sides
                    other.get_new_notifs()
            if record:
                ndesc += int(agent.get_xfer_telemetry(h).descCount)
            agent.release_xfer_handle(h)
        for agent, name, msg in notices:
            agent.send_notif(name, msg)
        seconds = time.perf_counter() - t0
        if record:
            if merge:
                if op == "READ":
                    self.fig.latency_nixl_ms.extend([seconds * 1e3] * len(batch))
                self.fig.descriptors += ndesc
            else:
                self.fig.perblock_descriptors += ndesc
        return total, seconds

    def _memcpy(self, batch: list[tuple[str, Any, Any]]) -> tuple[int, float]:
        """Torch row copies of the same number of bytes for the same block ids, in-process."""
        total = 0
        t0 = time.perf_counter()
        width = self.width
        if not width:
            for _ in batch:
                self.dst.copy_(self.src)
                total += self.dst.numel()
            _sync(self.dst)
            return total, time.perf_counter() - t0
        for _, local, remote in batch:
            # one prefill block per decode block (the first it covers where block sizes differ)
            firsts = remote[np.arange(len(local)) * len(remote) // len(local)]
            if self.dst.is_cuda:  # one gather per request on a GPU (a loop would time launches)
                idx = torch_index(local, self.dst.device), torch_index(firsts, self.src.device)
                self.dst.index_copy_(0, idx[0], self.src.index_select(0, idx[1]))
            else:
                for lb, rb in zip(local.tolist(), firsts.tolist(), strict=True):
                    self.dst[lb, :width].copy_(self.src[rb, :width])
            total += width * len(local)
        _sync(self.dst)
        return total, time.perf_counter() - t0


def cuda_count() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def cuda_index(dev: str) -> int | None:
    """The GPU index of a torch device string (``cuda:N``), None for the CPU."""
    return int(dev.split(":")[1]) if dev.startswith("cuda") else None


def _sync(t: Any) -> None:
    """Wait for a CUDA tensor's queued work (timings of device copies)."""
    if t.is_cuda:
        import torch

        torch.cuda.synchronize(t.device)


def torch_index(ids: Any, device: Any) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(device)
