"""Decode ranks whose NIXL agents have worker threads (``nixl_threads``): NIXL then splits a
read of `akv.backends.nixl.SPLIT_DESCS` or more descriptors into runs posted by different
threads, each on a UCX worker of its own. The pulls still land bit-exact, each prefill rank
releases each request exactly once (one "done" notice per read, not one per run), and
bad settings are refused with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

import akv
from akv.backends.nixl import SPLIT_DESCS
from akv.errors import ConfigError
from tests.conftest import make_spec
from tests.transfers import pull_every_request

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1)])
async def test_reads_split_across_worker_threads_land_and_release_once(p: int, d: int) -> None:
    """Head-sliced reads of 4 layers (24 or more descriptors each, split into runs) by decode
    agents with 2 worker threads land bit-exact, and every prefill rank releases every
    request once, because it was read (its "done" notice came)."""
    spec = make_spec(layers=4)
    results, engine = await pull_every_request(
        spec,
        spec,
        p,
        d,
        lambda r: akv.Consumer(
            akv.allocate_kv_cache(spec, r, d),
            spec,
            tp_rank=r,
            tp_size=d,
            same_process="nixl",  # NIXL reads, not the in-process copy
            nixl_threads=2,
        ),
        requests=3,
        seed=11,
    )
    assert {r.path for r in results} == {"read"}
    assert max(r.descriptors for r in results) >= 2 * SPLIT_DESCS  # split into two runs or more
    # each request released once by each prefill rank, all of them because it was read
    assert engine.reasons == {(f"req-11-{n}", "read"): p for n in range(3)}, engine.reasons


def test_negative_worker_threads_are_refused() -> None:
    """``nixl_threads=-1`` is a ConfigError naming the setting, and ``akv bench
    --nixl-threads -1`` exits 64 with one line saying what to give."""
    spec = make_spec()
    with pytest.raises(ConfigError, match="nixl_threads"):
        akv.Consumer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, nixl_threads=-1)
    proc = subprocess.run(
        [sys.executable, "-m", "akv", "bench", "--only", "latency", "--nixl-threads", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 64, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert "--nixl-threads -1" in line and "0" in line
