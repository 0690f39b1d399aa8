"""The public API: explicit ``__all__``, docstrings on every public name, typed package."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import akv


def test_all_names_exist_and_are_documented() -> None:
    """Every name in akv.__all__ exists and (classes, functions) has a docstring stating its contract."""
    assert len(akv.__all__) == len(set(akv.__all__))
    for name in akv.__all__:
        obj = getattr(akv, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"akv.{name} lost its docstring"


def test_public_methods_are_documented() -> None:
    """Public methods and properties of the main classes have docstrings."""
    for cls in (akv.Consumer, akv.TransferSession, akv.Transfer, akv.Producer, akv.ControlServer, akv.KVSpec):
        for name, member in vars(cls).items():
            if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                continue
            assert inspect.getdoc(member), f"{cls.__name__}.{name} has no docstring"


def test_public_classes_are_exported() -> None:
    """Classes and functions the top-level package imports are listed in __all__."""
    exported = set(akv.__all__)
    for name, obj in vars(akv).items():
        if name.startswith("_") or inspect.ismodule(obj):
            continue
        if getattr(obj, "__module__", "").startswith("akv"):
            assert name in exported, f"akv.{name} is public but missing from __all__"


def test_every_error_is_an_akv_error() -> None:
    """All exception classes akv exports derive from AkvError."""
    for name in akv.__all__:
        obj = getattr(akv, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            assert issubclass(obj, akv.AkvError), name


def test_package_is_typed() -> None:
    """py.typed ships with the package."""
    assert (Path(akv.__file__).parent / "py.typed").exists()


def test_prometheus_exporter_mirrors_metrics() -> None:
    """Counters and transfer observations reach Prometheus collectors, labelled by engine."""
    prom = pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
    from akv.prometheus import PrometheusExporter

    registry = prom.CollectorRegistry()
    metrics = akv.Metrics()
    metrics.inc("transfers_failed")
    PrometheusExporter(metrics, engine="d0", registry=registry)
    metrics.inc("released_expired", 2)
    metrics.observe_transfer(4096, 8, 0.002)
    get = registry.get_sample_value
    assert get("akv_transfers_failed_total", {"engine": "d0"}) == 1
    assert get("akv_released_expired_total", {"engine": "d0"}) == 2
    assert get("akv_transfer_seconds_count", {"engine": "d0"}) == 1
    assert get("akv_transfer_bytes_sum", {"engine": "d0"}) == 4096
