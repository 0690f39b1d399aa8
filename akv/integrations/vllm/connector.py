"""``AkvConnector``: vLLM's KV-connector interface on akv (vLLM calls it; it calls akv).

vLLM builds it once with role SCHEDULER in the engine-core process
([`SchedulerHalf`][akv.integrations.vllm.scheduler.SchedulerHalf]) and once per worker
process ([`WorkerHalf`][akv.integrations.vllm.worker.WorkerHalf]); this class only routes.
Both halves derive the same [`Identity`][akv.integrations.vllm.identity.Identity] from vLLM's
configuration: the engine id, rank 0's address, the block size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from akv.errors import ConfigError
from akv.integrations.vllm.identity import Identity
from akv.integrations.vllm.layout import LayerGroup, state_pieces
from akv.integrations.vllm.params import ConnectorMeta
from akv.integrations.vllm.scheduler import SchedulerHalf
from akv.integrations.vllm.worker import WorkerHalf

if TYPE_CHECKING:
    import torch

__all__ = ["AkvConnector", "AkvConnectorMetadata", "AkvConnectorStats", "Identity"]


class AkvConnectorMetadata(ConnectorMeta, KVConnectorMetadata):
    """One step's orders to the workers (see [`ConnectorMeta`][akv.integrations.vllm.params.ConnectorMeta])."""


def mamba_groups(model_config: Any) -> int | None:
    """The model's Mamba2 group count from its config (the names vLLM's Mamba2 models read),
    or None where it names none."""
    cfg = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    for key in ("n_groups", "mamba_n_groups", "mamba_ngroups"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def layer_groups(vllm_config: Any, kv_cache_config: Any) -> list[LayerGroup]:
    """vLLM's KV-cache groups as akv groups (full, sliding window or MLA attention; Mamba2
    and Gated DeltaNet state)."""
    mc = vllm_config.model_config
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        if kind == "MambaSpec":
            from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

            tp = int(vllm_config.parallel_config.tensor_parallel_size)
            skind, pieces = state_pieces(spec, tp, is_conv_state_dim_first(), mamba_groups(mc))
            out.append(LayerGroup(f"g{i}", skind, tuple(g.layer_names), 0, 0, pieces=pieces))
            continue
        # A FullAttentionSpec may carry a sliding_window (vLLM without its hybrid allocator keeps
        # every block of such layers): only a SlidingWindowSpec group holds just its window.
        window = int(getattr(spec, "sliding_window", 0) or 0) if kind == "SlidingWindowSpec" else 0
        if "MLA" in kind:
            out.append(LayerGroup(f"g{i}", "mla", tuple(g.layer_names), 1, int(spec.head_size)))
        elif kind in ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec"):
            out.append(
                LayerGroup(
                    f"g{i}",
                    "sliding" if window else "full",
                    tuple(g.layer_names),
                    mc.get_total_num_kv_heads(),
                    int(spec.head_size),
                    window,
                )
            )
        else:
            raise ConfigError(
                f"AkvConnector: KV-cache group {i} is {kind}: akv moves attention groups (full, sliding, MLA) "
                "and Mamba2 / Gated DeltaNet state groups"
            )
    return out


class AkvConnectorStats(KVConnectorStats):
    """akv's transfer figures of one interval, carried from the workers to vLLM's loggers."""

    def reset(self) -> None:
        self.data = {"transfer_ms": [], "bytes": [], "failures": 0, "releases": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not self.data:
            self.reset()
        o = other.data
        self.data["transfer_ms"] = [*self.data.get("transfer_ms", []), *o.get("transfer_ms", [])]
        self.data["bytes"] = [*self.data.get("bytes", []), *o.get("bytes", [])]
        self.data["failures"] = self.data.get("failures", 0) + o.get("failures", 0)
        rel = dict(self.data.get("releases", {}))
        for k, v in o.get("releases", {}).items():
            rel[k] = rel.get(k, 0) + v
        self.data["releases"] = rel
        return self

    def reduce(self) -> dict[str, int | float]:
        ms = sorted(self.data.get("transfer_ms", []))
        nbytes = sum(self.data.get("bytes", []))
        out: dict[str, int | float] = {
            "akv pulls": len(ms),
            "akv pulls failed": self.data.get("failures", 0),
            "akv MB pulled": round(nbytes / 1e6, 3),
        }
        if ms:
            out["akv pull ms p50"] = round(ms[len(ms) // 2], 3)
            out["akv pull ms max"] = round(ms[-1], 3)
            out["akv GB/s"] = round(nbytes / 1e6 / sum(ms), 3) if sum(ms) else 0.0
        for reason, n in sorted(self.data.get("releases", {}).items()):
            out[f"akv released {reason}"] = n
        return out

    def is_empty(self) -> bool:
        d = self.data
        return not (d.get("transfer_ms") or d.get("failures") or d.get("releases"))


class AkvPromMetrics(KVConnectorPromMetrics):
    """akv's figures in vLLM's Prometheus output (``vllm:akv_*``)."""

    def __init__(
        self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        histogram: Any = self._histogram_cls
        counter: Any = self._counter_cls
        self._seconds: Any = histogram(
            name="vllm:akv_pull_seconds",
            documentation="Time of each akv pull, from its launch on a decode worker to its end.",
            buckets=[0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0],
            labelnames=labelnames,
        )
        self._bytes: Any = counter(
            name="vllm:akv_pull_bytes",
            documentation="Bytes akv pulled into this instance.",
            labelnames=labelnames,
        )
        self._failed: Any = counter(
            name="vllm:akv_pulls_failed",
            documentation="akv pulls that failed (their requests are recomputed or failed).",
            labelnames=labelnames,
        )
        self._released: Any = counter(
            name="vllm:akv_releases",
            documentation="Exposed requests akv released, by reason.",
            labelnames=[*labelnames, "reason"],
        )
        self._engines = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self._engines[engine_idx]
        for ms in transfer_stats_data.get("transfer_ms", []):
            self._seconds.labels(*labels).observe(ms / 1e3)
        if total := sum(transfer_stats_data.get("bytes", [])):
            self._bytes.labels(*labels).inc(total)
        if n := transfer_stats_data.get("failures", 0):
            self._failed.labels(*labels).inc(n)
        for reason, n in transfer_stats_data.get("releases", {}).items():
            self._released.labels(*labels, reason).inc(n)


class AkvConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector on akv: load it with ``"kv_connector": "AkvConnector",
    "kv_connector_module_path": "akv.integrations.vllm"`` (see docs/vllm.md)."""

    _cache_hit_source = CacheHitSource.P2P  # prompt tokens pulled from a prefill instance

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.ident = Identity.of(vllm_config)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            groups = layer_groups(vllm_config, kv_cache_config) if kv_cache_config is not None else []
            self._scheduler = SchedulerHalf(self.ident, [g.window for g in groups], [g.state for g in groups])
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerHalf(
                self.ident,
                layer_groups(vllm_config, kv_cache_config),
                get_tensor_model_parallel_rank(),
                self.ident.tp_size,
            )

    # class-level hooks -------------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # one tensor per layer, blocks outermost inside it: akv reads head slices in place
        mc = getattr(vllm_config, "model_config", None)
        return None if mc is None or mc.use_mla else "LBHNC"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return AkvConnectorStats(data=data) if data is not None else AkvConnectorStats(data={})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ) -> KVConnectorPromMetrics | None:
        return AkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # scheduler side ----------------------------------------------------------------------

    def _sched(self) -> SchedulerHalf:
        if self._scheduler is None:
            raise RuntimeError("AkvConnector: a scheduler method was called on a worker")
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = self._kv_cache_manager

    def on_new_request(self, request: Any) -> None:
        self._sched().on_new_request(request)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        m = self._sched().build_meta(scheduler_output)
        return AkvConnectorMetadata(
            expose=m.expose, expose_late=m.expose_late, withdraw=m.withdraw, pull=m.pull
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # worker side -------------------------------------------------------------------------

    def _work(self) -> WorkerHalf:
        if self._worker is None:
            raise RuntimeError("AkvConnector: a worker method was called on the scheduler")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().start(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, ConnectorMeta):
            self._work().step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs only once its pull finished

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # prefill's blocks are read in place once exposed

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, ConnectorMeta) and meta.expose:
            self._work().after_forward(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self._work().out.take()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=received, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        stats = AkvConnectorStats(data=self._worker.out.take_stats())
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
