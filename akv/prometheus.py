"""Export akv metrics to Prometheus (optional: ``pip install 'akv[prometheus]'``).

```python
from akv.prometheus import PrometheusExporter
PrometheusExporter(consumer.metrics, engine="decode-0")   # registers on the default registry
```
"""

from __future__ import annotations

from typing import Any

from akv.metrics import COUNTERS, Metrics

__all__ = ["PrometheusExporter"]

_SECONDS_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(12, 34, 2))
_DESC_BUCKETS = (1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0)
_HISTOGRAMS = (
    ("transfer_seconds", "Duration of completed pulls", _SECONDS_BUCKETS),
    ("transfer_bytes", "Bytes moved by completed pulls", _BYTES_BUCKETS),
    ("transfer_descriptors", "Descriptors submitted per completed pull", _DESC_BUCKETS),
)


class PrometheusExporter:
    """Mirrors one component's [`Metrics`][akv.Metrics] into Prometheus collectors.

    Transfer duration, bytes and descriptor counts become histograms; every akv counter
    (failures, expiries, notifications, ...) becomes ``akv_<name>_total``. Collectors are
    shared per registry, labelled by ``engine``. Needs ``pip install 'akv[prometheus]'``.

    ```python
    from akv.prometheus import PrometheusExporter
    PrometheusExporter(consumer.metrics, engine="decode-0")   # registers on the default registry
    ```

    Args:
        metrics: the component's metrics (``producer.metrics``, ``consumer.metrics``).
        engine: the value of the ``engine`` label.
        registry: a ``prometheus_client.CollectorRegistry`` (default: the global ``REGISTRY``).
    """

    _collectors: dict[int, dict[str, Any]] = {}

    def __init__(self, metrics: Metrics, *, engine: str, registry: Any = None) -> None:
        try:
            import prometheus_client as prom
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError(
                "PrometheusExporter needs prometheus_client: pip install 'akv[prometheus]'"
            ) from None
        registry = registry if registry is not None else prom.REGISTRY
        shared = self._collectors.setdefault(id(registry), {})
        if not shared:
            for name, doc, buckets in _HISTOGRAMS:
                shared[name] = prom.Histogram(
                    f"akv_{name}", doc, ["engine"], buckets=buckets, registry=registry
                )
            for name in COUNTERS:
                shared[name] = prom.Counter(
                    f"akv_{name}", f"akv counter {name}", ["engine"], registry=registry
                )
        self._children = {name: c.labels(engine=engine) for name, c in shared.items()}
        self._histograms = {name for name, _, _ in _HISTOGRAMS}
        for name, value in metrics.counters.items():  # what happened before the exporter existed
            if value and name in self._children and name not in self._histograms:
                self._children[name].inc(value)
        metrics.listeners.append(self._on_event)

    def _on_event(self, name: str, value: float) -> None:
        child = self._children.get(name)
        if child is None:
            return
        if name in self._histograms:
            child.observe(value)
        else:
            child.inc(value)
