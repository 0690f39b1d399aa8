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

Block ids travel one list per KV-cache group (vLLM's hybrid allocator makes several). A
sliding-window group of ``W`` tokens keeps only the window's blocks: vLLM frees (and nulls)
the blocks before token ``n - W + 1`` of a finished request of ``n`` tokens, so prefill
exposes only the blocks from that one on (also when it exposes before vLLM freed them), and
decode fills the blocks of tokens ``n - W`` to ``n`` (vLLM recomputes token ``n - 1``, whose
window starts at ``n - W``). When ``n - W + 1`` starts a block, the block of token ``n - W``
is freed on prefill: decode then computes the request itself (logged).

A state group (Mamba2, Gated DeltaNet) holds one running state slot per request, the state
after every token computed so far: prefill exposes that one slot, whole, and decode fills the
slot vLLM allocated for the request (a local prefix hit shortens the attention blocks pulled,
never the state). vLLM always computes a prompt's last token on decode, and a state cannot be
rolled back one token, so on a hybrid model prefill drops the prompt's last token (as vLLM's
NixlConnector does): it computes and exposes tokens ``0 .. n - 2``, decode pulls them and
computes token ``n - 1`` itself.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
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

    def __init__(self, ident: Identity, windows: Sequence[int] = (), states: Sequence[bool] = ()) -> None:
        self.ident = ident
        self.windows = tuple(windows)  # per KV-cache group: its sliding window in tokens, 0 for none
        self.states = tuple(states)  # per KV-cache group: a state group (Mamba2, GDN)
        self.hybrid = any(self.states)
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

    def _window(self, group: int) -> int:
        return self.windows[group] if group < len(self.windows) else 0

    def _state(self, group: int) -> bool:
        return self.states[group] if group < len(self.states) else False

    def _covers_windows(self, request: Any, remote: RemoteKV) -> bool:
        """Whether prefill exposed the blocks of every sliding group's window (see the module text)."""
        n = min(remote.num_tokens, len(request.prompt_token_ids or ()))
        bs = remote.block_size  # the prefill instance's blocks
        for i, ids in enumerate(remote.block_ids):
            w = self._window(i)
            if w and len(ids) < -(-n // bs) - max(0, n - w) // bs:
                log.warning(
                    "request %s: prefill kept %d blocks of sliding group %d, short of the window of "
                    "%d tokens (vLLM freed the block of token %d): computed locally",
                    request.request_id,
                    len(ids),
                    i,
                    w,
                    n - w,
                )
                return False
        return True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._remote(request)
        if remote is None or not self._covers_windows(request, remote):
            return 0, False
        prompt = len(request.prompt_token_ids or ())
        if self.hybrid and remote.num_tokens >= prompt:
            # the state holds every prompt token, but vLLM computes the last one here again
            log.warning(
                "request %s: prefill's state covers all %d prompt tokens (its instance runs no akv "
                "hybrid truncation): computed locally",
                request.request_id,
                prompt,
            )
            return 0, False
        count = min(remote.num_tokens, prompt) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        remote = self._remote(request) if num_external_tokens > 0 else None
        params["do_remote_prefill"] = False  # one load per request
        if remote is None:
            return
        # Per group, the blocks vLLM allocated for the tokens to load (not the local prefix
        # hit, not null), last blocks of the sequence; sliding groups: only their window's.
        n = min(remote.num_tokens, len(request.prompt_token_ids or ()))
        bs = self.ident.block_size
        local = []
        for i, group in enumerate(blocks.blocks[: len(remote.block_ids)]):
            if self._state(i):  # the request's running state slot, whole (never trimmed)
                live = [b for b in group[: -(-n // bs)] if not b.is_null][-1:]
                local.append(tuple(b.block_id for b in live if b.block_hash is None))
                continue
            first = max(0, n - w) // bs if (w := self._window(i)) else 0
            local.append(
                tuple(
                    b.block_id for b in group[first : -(-n // bs)] if b.block_hash is None and not b.is_null
                )
            )
        self._meta.pull[request.request_id] = PullJob(remote, tuple(local))

    # prefill side ----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            if self.hybrid:
                self._truncate(request, params)
            self._candidates[request.request_id] = request

    @staticmethod
    def _truncate(request: Any, params: dict[str, Any]) -> None:
        """Hybrid models: prefill stops one token short of the prompt, so the exposed state is
        that of tokens ``0 .. n - 2``; decode computes token ``n - 1`` from it (vLLM always
        computes a prompt's last token itself, and a state cannot be rolled back). The request
        then ends after one output token, as a router's prefill request does."""
        if params.get("_akv_truncated") or request.num_prompt_tokens < 2 or request.prompt_token_ids is None:
            return
        del request.prompt_token_ids[-1:]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_akv_truncated"] = True

    def _next_generation(self) -> int:
        self._generation = self._generation % ((1 << 31) - 1) + 1
        return self._generation

    def _exposable(self, block_ids: Any, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        """Per group, the blocks holding the first ``num_tokens`` tokens that vLLM keeps once
        the request finished (sliding groups: from token ``num_tokens - W + 1``; no null blocks)."""
        bs = self.ident.block_size
        out = []
        for i, g in enumerate(groups_of(block_ids)):
            if self._state(i):  # the running state slot
                out.append(tuple(strip_null(g[: -(-num_tokens // bs)]))[-1:])
                continue
            first = max(0, num_tokens - w + 1) // bs if (w := self._window(i)) else 0
            out.append(tuple(strip_null(g[first : -(-num_tokens // bs)])))
        return tuple(out)

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
            groups = self._exposable(block_ids, min(request.num_computed_tokens, request.num_prompt_tokens))
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
