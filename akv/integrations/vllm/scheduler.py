"""The scheduler half of the vLLM connector (vLLM's engine-core process).

Prefill instance: a request that finished with ``do_remote_decode`` keeps its blocks
(``request_finished`` returns True); the next step tells every worker to expose them under
one generation, and the response carries ``kv_transfer_params`` naming them. vLLM frees the
blocks once every worker reported the request released (read, pushed or lease expired).

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
    from akv.integrations.vllm.connector import Identity

__all__ = ["SchedulerHalf"]

log = logging.getLogger("akv.vllm")

_FINISHED_OK = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


class SchedulerHalf:
    """Scheduler-side state of one vLLM instance (see the module text)."""

    def __init__(self, ident: Identity) -> None:
        self.ident = ident
        self._generation = secrets.randbelow(1 << 30) + 1  # distinct across restarts of this instance
        self._expose: dict[str, ExposeJob] = {}
        self._pull: dict[str, PullJob] = {}

    # decode side -----------------------------------------------------------------------

    def _remote(self, request: Any) -> RemoteKV | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        if "akv_address" not in params:
            log.warning("request %s: kv_transfer_params name no akv prefill instance: computed locally", request.request_id)
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
                request.request_id, remote.block_size, self.ident.block_size,
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
        self._pull[request.request_id] = PullJob(remote, tuple(local))

    # prefill side ----------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if getattr(request.status, "name", "") not in _FINISHED_OK:
            return False, None  # aborted or failed: nothing is exposed, vLLM frees the blocks
        groups = tuple(tuple(strip_null(g)) for g in groups_of(block_ids))
        if not any(groups):
            return False, None
        self._generation = self._generation % ((1 << 31) - 1) + 1
        self._expose[request.request_id] = ExposeJob(groups, self._generation)
        remote = RemoteKV(
            address=self.ident.address,
            request_id=request.request_id,
            block_ids=groups,
            generation=self._generation,
            num_tokens=request.num_computed_tokens,
            block_size=self.ident.block_size,
            lease=self.ident.options.lease,
        )
        return True, remote.to_params(self.ident.engine_id, self.ident.tp_size)

    # both ------------------------------------------------------------------------------

    def build_meta(self) -> ConnectorMeta:
        meta = ConnectorMeta(expose=self._expose, pull=self._pull)
        self._expose, self._pull = {}, {}
        return meta
