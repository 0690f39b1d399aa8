"""The public API: explicit ``__all__``, docstrings on every public name, typed package."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import akv
from tests.conftest import decode_engine, make_spec, prefill_engine, wait_for


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


PRODUCER_PRINTS_JSON = """
import json
import anyio
import akv

spec = akv.KVSpec.create(layers=2, num_blocks=8, block_size=4, kv_heads=2, head_dim=8, dtype="float16")

async def main() -> None:
    async with akv.Producer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1) as producer:
        print(json.dumps({"endpoint": str(producer.endpoint)}))

anyio.run(main)
"""


@pytest.mark.parametrize("level", [None, "INFO"])
def test_nixl_logs_stay_off_stdout_in_library_use(level: str | None) -> None:
    """A program creating a Producer prints only its own JSON; NIXL_LOG_LEVEL=INFO brings NIXL's logs back on stderr."""
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    if level:
        env["NIXL_LOG_LEVEL"] = level
    proc = subprocess.run(
        [sys.executable, "-c", PRODUCER_PRINTS_JSON], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "endpoint" in json.loads(lines[-1])
    if level is None:
        assert len(lines) == 1, proc.stdout  # nothing but the program's own line
        assert "Initialized NIXL agent" not in proc.stderr
    else:
        assert not any("Initialized NIXL agent" in line for line in lines)
        assert "Initialized NIXL agent" in proc.stderr


async def _collect(producer: akv.Producer, rank: int, releases: akv.EngineReleases) -> None:
    async with producer.releases() as stream:
        async for release in stream:
            releases.add(rank, release)


@pytest.mark.anyio
async def test_engine_releases_report_a_request_once_when_every_rank_released() -> None:
    """EngineReleases reports each request once, after all P ranks released it, with the engine-level reason."""
    spec = make_spec(kv_heads=4)
    got: list[akv.EngineRelease] = []
    releases = akv.EngineReleases(2, on_release=got.append)
    async with (
        prefill_engine(spec, 2) as engine,
        decode_engine(spec, 1) as (consumer,),
        anyio.create_task_group() as tg,
    ):
        for rank, producer in enumerate(engine.producers):
            tg.start_soon(_collect, producer, rank, releases)
        engine.fill("read", [1, 2, 3], seed=1)
        engine.fill("unread", [4, 5], seed=2, lease=0.3)
        session = await consumer.connect(engine.endpoint)
        await (await session.pull("read", [10, 11, 12], [1, 2, 3]))
        await wait_for(lambda: len(got) == 2)
        tg.cancel_scope.cancel()
    assert [(r.request_id, r.reason, r.block_ids.tolist()) for r in got] == [
        ("read", "read", [1, 2, 3]),
        ("unread", "expired", [4, 5]),
    ]
    assert [len(r.ranks) for r in got] == [2, 2] and len(engine.releases) == 4  # per rank: 2 x 2
    assert releases.pending == 0
    with pytest.raises(akv.ConfigError):
        releases.add(2, engine.releases[0])  # rank outside the engine


def _api_page_objects() -> list[tuple[str, object]]:
    """(label, callable) for every object and member that docs/api.md renders."""
    import importlib
    import re

    page = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    out: list[tuple[str, object]] = []
    for path, options in re.findall(r"^::: (\S+)\n((?:    .*\n)*)", page, re.M):
        module, _, name = path.rpartition(".")
        try:
            obj = importlib.import_module(path)
        except ImportError:
            obj = getattr(importlib.import_module(module), name)
        if inspect.ismodule(obj):
            out += [(f"{path}.{n}", getattr(obj, n)) for n in obj.__all__]
            continue
        out.append((path, obj))
        listed = re.search(r"members: \[(.*)\]", options)
        if inspect.isclass(obj):
            names = (
                [m.strip() for m in listed.group(1).split(",")]
                if listed
                else [m for m in vars(obj) if not m.startswith("_")]
            )
            out += [(f"{path}.{m}", getattr(obj, m)) for m in names]
    return out


def test_every_public_parameter_is_documented() -> None:
    """Each parameter of every object on the API page is described in its docstring (Args or backticked)."""
    import re

    undocumented = []
    for label, obj in _api_page_objects():
        if label in ("akv.TransferSession", "akv.Transfer"):  # made by connect() and pull(), not by users
            continue
        if not callable(obj) or (inspect.isclass(obj) and issubclass(obj, BaseException)):
            continue
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            continue
        doc = inspect.getdoc(obj) or ""
        for p in params:
            if p in ("self", "cls", "task_status"):
                continue
            if not (re.search(rf"^\s*{p}( \(.*\))?:", doc, re.M) or f"`{p}`" in doc):
                undocumented.append(f"{label}({p})")
    assert not undocumented
