"""Shared fixtures and helpers: anyio backends, a real etcd, the cache of the CLI, a prefill engine
in another process, in-process engines and their ranks."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import akv
from akv.geometry.cache import as_cache
from akv.testing import EtcdServer, etcd_binary, expected_blocks, fill_request, local_counts, spawn_prefill

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


MODEL = ["--layers", "2", "--blocks", "64", "--block-size", "4", "--head-dim", "16", "--dtype", "float16"]


def cli_spec(*model: str) -> akv.KVSpec:
    """The cache a rank of ``akv decode`` builds from these model flags (e.g. ``--kv-heads 4 *MODEL``)."""
    from akv.cli import build_parser  # the CLI (and its logging) only for the tests that ask
    from akv.cli.args import spec_from_args

    return spec_from_args(build_parser().parse_args(["decode", "--connect", "x:1", "--tp-size", "1", *model]))


def _need_etcd() -> None:
    if etcd_binary() is None:
        message = "no etcd binary: bash scripts/setup.sh installs Debian's etcd-server (or set AKV_ETCD)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A real etcd server shared by the session's tests (skipped without an etcd binary;
    failed under ``CI``)."""
    _need_etcd()
    with EtcdServer(str(tmp_path_factory.mktemp("etcd"))) as server:
        yield server


@pytest.fixture
def own_etcd(tmp_path: object) -> Iterator[EtcdServer]:
    """A real etcd server of the test's own, which it may stop and start."""
    _need_etcd()
    with EtcdServer(str(tmp_path)) as server:
        yield server


def read_json_line(proc: subprocess.Popen[str]) -> dict[str, object]:
    """The next JSON line a CLI process prints (UCX may interleave its own log lines)."""
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process exited ({proc.poll()}) before printing a JSON line")
        if line.startswith("{"):
            return dict(json.loads(line))


@contextmanager
def prefill_process(
    tp_size: int, kv_heads: int, *extra: str, requests: int = 6, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Run ``akv prefill`` in another process; yields (process, endpoint)."""
    proc, endpoint = spawn_prefill(
        "--tp-size",
        str(tp_size),
        "--kv-heads",
        str(kv_heads),
        "--requests",
        str(requests),
        "--blocks-per-request",
        "4",
        "--timeout",
        "60",
        *MODEL,
        *extra,
        env=env,
    )
    try:
        yield proc, endpoint
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[str]) -> None:
    """Kill a CLI process if it still runs, reap it and close its stdout pipe."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def summary_of(proc: subprocess.Popen[str], timeout: float = 30) -> dict[str, object]:
    """Wait for a CLI process and return its last JSON line."""
    out, _ = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return dict(json.loads(lines[-1]))


@dataclass
class Engine:
    """In-process prefill ranks sharing one control server; ``releases`` in order, and
    ``reasons`` counting them per ``(request_id, reason)``."""

    spec: Any
    producers: list[akv.Producer]
    server: akv.ControlServer
    releases: list[akv.Release] = field(default_factory=list)
    reasons: Counter[tuple[str, str]] = field(default_factory=Counter)

    def released(self, rel: akv.Release) -> None:
        self.releases.append(rel)
        self.reasons[(rel.request_id, rel.reason)] += 1

    @property
    def endpoint(self) -> str:
        return str(self.server.endpoint)

    def fill(
        self,
        request_id: str,
        block_ids: Sequence[int],
        seed: int,
        lease: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> int:
        """Write a request's blocks on every rank (or on ``ranks``) and expose them; returns
        the first one's generation."""
        generations = []
        for p in self.producers if ranks is None else [self.producers[r] for r in ranks]:
            for region, t in enumerate(p.kv_caches):
                view = t.view(torch.uint8).view(self.spec.num_blocks, -1)
                view[list(block_ids)] = torch.from_numpy(
                    expected_blocks(self.spec, p.tp_rank, p.tp_size, region, seed, np.arange(len(block_ids)))
                )
            generations.append(p.expose(request_id, block_ids, lease=lease))
        return generations[0]

    def expose_requests(self, requests: Sequence[Any], **expose_kw: Any) -> None:
        """Write each of ``requests`` (`akv.testing.make_requests`) on every rank and expose it
        there (``expose_kw``: more `akv.Producer.expose` options, e.g. ``layers_ready``)."""
        for req in requests:
            for p in self.producers:
                fill_request(
                    p.kv_caches, self.spec, p.tp_rank, p.tp_size, req.block_ids, req.seed, req.num_tokens
                )
                p.expose(req.request_id, req.block_ids, **expose_kw)


def local_ids(spec: Any, n: int, num_tokens: int, hit: int = 0) -> Any:
    """Decode block ids for the ``n``-th request of ``num_tokens`` tokens after a prefix hit
    of ``hit`` blocks (8 blocks apart per request; per group for a hybrid cache)."""
    cache = as_cache(spec)
    counts = local_counts(spec, num_tokens, hit=hit)
    ids = {g.name: list(range(n * 8, n * 8 + counts[g.name])) for g in cache.groups}
    return ids[cache.groups[0].name] if len(cache.groups) == 1 else ids


def make_spec(kv_heads: int = 4, mla: bool = False, **kw: object) -> akv.KVSpec:
    fields: dict[str, object] = dict(
        layers=2,
        num_blocks=32,
        block_size=4,
        kv_heads=1 if mla else kv_heads,
        head_dim=8,
        dtype="float16",
        kind="mla" if mla else "dense",
    )
    fields.update(kw)
    return akv.KVSpec.create(**fields)


def prefill_rank(spec: Any, rank: int = 0, size: int = 1, *, device: str = "cpu", **kw: Any) -> akv.Producer:
    """Prefill rank ``rank`` of ``size`` on a fresh cache (``kw``: more `akv.Producer` options);
    enter it with ``async with``."""
    kv = akv.allocate_kv_cache(spec, rank, size, device=device)
    return akv.Producer(kv, spec, tp_rank=rank, tp_size=size, **kw)


@asynccontextmanager
async def prefill_engine(
    spec: Any,
    tp_size: int,
    *,
    secret: str | None = None,
    lease: float = 30.0,
    engine_id: str = "prefill",
    tls: akv.TLSConfig | None = None,
    device: str = "cpu",
    **producer_kw: Any,
) -> AsyncIterator[Engine]:
    """``tp_size`` prefill ranks of this process behind one control server (``producer_kw``:
    more `akv.Producer` options, e.g. ``transfer`` or ``modes``)."""
    async with AsyncExitStack() as stack:
        server = akv.ControlServer(secret=secret, tls=tls)
        tg = await stack.enter_async_context(anyio.create_task_group())
        await tg.start(server.serve)
        engine = Engine(spec, [], server)
        for r in range(tp_size):
            rank = prefill_rank(
                spec,
                r,
                tp_size,
                device=device,
                server=server,
                lease=lease,
                engine_id=engine_id,
                on_release=engine.released,
                **producer_kw,
            )
            engine.producers.append(await stack.enter_async_context(rank))
        try:
            yield engine
        finally:
            tg.cancel_scope.cancel()


def decode_rank(spec: Any, rank: int = 0, size: int = 1, **kw: Any) -> akv.Consumer:
    """Decode rank ``rank`` of ``size`` on a fresh CPU cache (``kw``: more `akv.Consumer` options);
    enter it with ``async with``."""
    return akv.Consumer(akv.allocate_kv_cache(spec, rank, size), spec, tp_rank=rank, tp_size=size, **kw)


@asynccontextmanager
async def decode_engine(spec: Any, tp_size: int, **kw: Any) -> AsyncIterator[list[akv.Consumer]]:
    """``tp_size`` decode ranks of this process (`decode_rank`, each with options ``kw``), open
    together and closed together."""
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(decode_rank(spec, d, tp_size, **kw)) for d in range(tp_size)]


def verify(consumer: akv.Consumer, local: Sequence[int], seed: int, positions: Sequence[int]) -> bool:
    spec = consumer.spec
    for region, t in enumerate(consumer.kv_caches):
        got = t.view(torch.uint8).view(spec.num_blocks, -1)[list(local)].numpy()
        want = expected_blocks(spec, consumer.tp_rank, consumer.tp_size, region, seed, np.asarray(positions))
        if not np.array_equal(got, want):
            return False
    return True


async def wait_for(predicate: object, timeout: float = 5.0) -> None:  # noqa: ASYNC109
    with anyio.fail_after(timeout):
        while not predicate():  # type: ignore[operator]
            await anyio.sleep(0.005)
