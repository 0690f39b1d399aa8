"""What a Producer and a Consumer share: one TP rank's validated KV cache, its NIXL agent,
and the task group that runs its poller."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from akv import tp
from akv._log import get_logger
from akv._poll import Backoff
from akv.backend import NixlBackend
from akv.errors import ClosedError
from akv.metrics import Metrics
from akv.spec import KVSpec
from akv.tensors import check_kv_cache

__all__ = ["RankBase"]


class RankBase:
    """Validation, agent and poller lifetime common to both sides (not public)."""

    _role = "r"  # agent-name tag: "p" for prefill ranks, "d" for decode ranks

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        spec: KVSpec,
        *,
        tp_rank: int,
        tp_size: int,
        engine_id: str,
        backend: NixlBackend | None,
        progress_thread: bool,
        spin_s: float,
        poll_max_s: float,
    ) -> None:
        spec.validate()
        if spec.kind == "dense":
            tp.held_heads(tp_rank, tp_size, spec.kv_heads)
        else:
            tp.check_tp(tp_rank, tp_size)
        check_kv_cache(kv_caches, spec, tp_rank, tp_size)
        self.kv_caches = list(kv_caches)
        self.spec = spec
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.engine_id = engine_id
        self.metrics = Metrics()
        self.closed = False
        self._log = get_logger(type(self).__module__).bind(engine=engine_id, rank=tp_rank)
        self._backend = backend
        self._progress_thread = progress_thread
        self._spin_s = spin_s
        self._poll_max_s = poll_max_s
        self._tg: Any = None
        self._backoff: Backoff | None = None

    @property
    def backend(self) -> NixlBackend:
        """The NIXL backend (valid inside the context manager)."""
        if self._backend is None or self._backend.closed:
            raise ClosedError(f"the {type(self).__name__.lower()} is not running")
        return self._backend

    async def _start(self) -> Any:
        """Create the agent if needed, register the cache, enter the task group (returned)."""
        if self._backend is None:
            name = f"{self.engine_id}-{self._role}{self.tp_rank}-{uuid.uuid4().hex[:8]}"
            self._backend = NixlBackend(name, progress_thread=self._progress_thread)
        self._backend.register(self.kv_caches)
        self._backoff = Backoff(spin_s=self._spin_s, max_sleep_s=self._poll_max_s)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self._tg

    async def _stop_tasks(self) -> None:
        """Cancel and leave the task group (the poller and anything else started in it)."""
        if self._tg is not None:
            tg, self._tg = self._tg, None
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
