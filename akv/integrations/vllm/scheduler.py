"""The scheduler half of the vLLM connector (vLLM's engine-core process).

Prefill instance: a request with ``do_remote_decode`` and one output token (what a router
sends) is exposed by every worker right after the forward pass that completes its prompt,
under one generation the scheduler picks, so it is exposed before the response naming it
leaves. ``request_finished`` then keeps its blocks (returns True) and returns
``kv_transfer_params`` naming them; a request that did not finish normally has its lease
ended at once. A ``do_remote_decode`` request with more output tokens is exposed one step
after it finished. vLLM frees the blocks once every worker reported the request released
(read, pushed or lease expired).

Decode instance: a request whose ``kv_transfer_params`` name a prefill instance running akv
loads its prompt's KV asynchronously: ``get_num_new_matched_tokens`` claims the tokens not in
the local prefix cache, ``update_state_after_alloc`` records the blocks vLLM allocated for
them, and the next step tells every worker to pull.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from akv.errors import ConfigError
from akv.integrations.vllm.params import ConnectorMeta, ExposeJob, PullJob, RemoteKV, groups_of, strip_null

if TYPE_CHECKING:
    from akv.integrations.vllm.identity import Identity

__all__ = ["SchedulerHalf"]

log = logging.getLogger("akv.vllm")

_FINISHED_OK = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


class SchedulerHalf:
    """Scheduler-side state of one vLLM instance (see the module text)."""

    def __init__(self, ident: Identity) -> None:
        self.ident = ident
        self._generation = secrets.randbelow(1 << 30) + 1  # distinct across restarts of this instance
        self._meta = ConnectorMeta()
        self._candidates: dict[str, Any] = {}  # do_remote_decode requests not yet computed
        self._early: dict[str, ExposeJob] = {}  # exposed at their last forward pass, not finished
        self.kv_cache_manager: Any = None  # bound by vLLM

    # decode side -----------------------------------------------------------------------

    def _remote(self, request: Any) -> RemoteKV | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        if "akv_address" not in params:
            log.warning(
                "request %s: kv_transfer_params name no akv prefill instance: computed locally",
                request.request_id,
            )
            return None
        try:
            remote = RemoteKV.from_params(params)
        except ConfigError as exc:
            log.warning("request %s: %s: computed locally", request.request_id, exc)
            return None
        if remote.block_size != self.ident.block_size and self.ident.content == "block":
            log.warning(
                "request %s: the prefill instance's block size %d differs from ours (%d), which vLLM's CPU "
                "layout cannot mix: computed locally (start both with the same --block-size)",
                request.request_id,
                remote.block_size,
                self.ident.block_size,
            )
            return None
        return remote

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._remote(request)
        if remote is None:
            return 0, False
        count = min(remote.num_tokens, len(request.prompt_token_ids or ())) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        remote = self._remote(request) if num_external_tokens > 0 else None
        params["do_remote_prefill"] = False  # one load per request
        if remote is None:
            return
        local = []
        for group, ids in zip(blocks.blocks, remote.block_ids, strict=False):
            hit = sum(b.block_hash is not None and not b.is_null for b in group)  # local prefix hit
            new = [b.block_id for b in group if b.block_hash is None and not b.is_null]
            local.append(tuple(new[: max(0, len(ids) - hit)]))
        self._meta.pull[request.request_id] = PullJob(remote, tuple(local))

    # prefill side ----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._candidates[request.request_id] = request

    def _next_generation(self) -> int:
        self._generation = self._generation % ((1 << 31) - 1) + 1
        return self._generation

    def _exposable(self, block_ids: Any, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        """Per group, the blocks holding the first ``num_tokens`` tokens (no null blocks)."""
        bs = self.ident.block_size
        return tuple(tuple(strip_null(g[: -(-num_tokens // bs)])) for g in groups_of(block_ids))

    def _expose_early(self, scheduler_output: Any) -> None:
        """Requests whose prompt this step completes, with one output token: exposed after it."""
        scheduled = scheduler_output.num_scheduled_tokens
        for rid, req in list(self._candidates.items()):
            n = scheduled.get(rid, 0)
            if not n or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            del self._candidates[rid]
            if req.max_tokens != 1 or self.kv_cache_manager is None:
                continue  # it keeps running (or no block table to read): exposed once finished
            groups = self._exposable(self.kv_cache_manager.get_block_ids(rid), req.num_prompt_tokens)
            if any(groups):
                job = ExposeJob(groups, self._next_generation())
                self._meta.expose[rid] = self._early[rid] = job

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._candidates.pop(rid, None)
        early = self._early.pop(rid, None)
        params = request.kv_transfer_params
        ok = getattr(request.status, "name", "") in _FINISHED_OK
        if early is not None and not ok:
            self._meta.withdraw.add(rid)  # exposed, then aborted: released as expired, then freed
            return True, None
        if not params or not params.get("do_remote_decode") or not ok:
            return False, None  # nothing exposed: vLLM frees the blocks now
        job = early
        if job is None:
            groups = self._exposable(block_ids, request.num_computed_tokens)
            if not any(groups):
                return False, None
            job = self._meta.expose_late[rid] = ExposeJob(groups, self._next_generation())
        remote = RemoteKV(
            address=self.ident.address,
            request_id=rid,
            block_ids=job.block_ids,
            generation=job.generation,
            num_tokens=min(request.num_computed_tokens, request.num_prompt_tokens),
            block_size=self.ident.block_size,
            lease=self.ident.options.lease,
        )
        return True, remote.to_params(self.ident.engine_id, self.ident.tp_size)

    # both ------------------------------------------------------------------------------

    def build_meta(self, scheduler_output: Any) -> ConnectorMeta:
        if self._candidates:
            self._expose_early(scheduler_output)
        meta, self._meta = self._meta, ConnectorMeta()
        return meta
