"""Cross-process pulls: a real ``akv prefill`` process, decode ranks in this process, real NIXL."""

from __future__ import annotations

import argparse

import pytest

from akv.cli.decode import run_decode
from tests.conftest import MODEL, prefill_process, summary_of

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

RELATIONS = [
    pytest.param(2, 2, 4, (), id="homogeneous"),
    pytest.param(1, 4, 4, (), id="decode>prefill"),
    pytest.param(4, 2, 8, (), id="prefill>decode"),
    pytest.param(4, 6, 12, (), id="non-multiple-4-6"),
    pytest.param(4, 1, 2, (), id="gqa-replicas-on-prefill"),
    pytest.param(1, 4, 2, (), id="gqa-replicas-on-decode"),
    pytest.param(4, 2, 1, ("--mla",), id="mla-prefill>decode"),
    pytest.param(2, 4, 1, ("--mla",), id="mla-decode>prefill"),
    pytest.param(2, 4, 4, ("--joint-kv",), id="joint-kv-hetero"),
]


def decode_args(endpoint: str, tp_size: int, kv_heads: int, extra: tuple[str, ...]) -> argparse.Namespace:
    from akv.cli import build_parser

    return build_parser().parse_args(
        [
            "decode",
            "--connect",
            endpoint,
            "--tp-size",
            str(tp_size),
            "--kv-heads",
            str(kv_heads),
            *MODEL,
            *extra,
        ]
    )


@pytest.fixture
def anyio_backend() -> str:
    """The relations run under asyncio; the same processes and wire under trio once below
    (each relation under both cost the suite a minute and a half)."""
    return "asyncio"


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_cross_process_pull_bit_exact_under_trio(anyio_backend: str) -> None:
    """The decode ranks of one relation (prefill>decode) under trio: every request verifies
    bit-exact, and prefill releases each by read."""
    await test_cross_process_pull_bit_exact(4, 2, 8, ())


@pytest.mark.parametrize(("p", "d", "h", "extra"), RELATIONS)
async def test_cross_process_pull_bit_exact(p: int, d: int, h: int, extra: tuple[str, ...]) -> None:
    """Every TP relation: all requests verify bit-exact, and prefill releases each by read."""
    with prefill_process(p, h, *extra) as (proc, endpoint):
        summary = await run_decode(decode_args(endpoint, d, h, extra))
        assert summary["requests"] == 6
        assert summary["verified"] == 6, summary.get("errors")
        assert summary["failed"] == 0
        prefill = summary_of(proc)
    assert prefill["released"] == 6 and prefill["expired"] == 0
    assert prefill["notifications_invalid"] == 0 and prefill["notifications_unknown"] == 0
