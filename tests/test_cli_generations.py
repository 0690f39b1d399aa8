"""`akv prefill` announces exposure generations, the same on every rank, and pulls bind to them."""

from __future__ import annotations

import pytest

import akv
from akv.testing import fetch_requests, spawn_prefill
from tests.conftest import cli_spec, stop
from tests.test_cli import SMALL

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_cli_prefill_announces_generations_every_rank_honours() -> None:
    """Requests announced by a 2-rank `akv prefill` carry non-zero generations; a 2 -> 1 pull
    bound to one (reading from both ranks) verifies, and one bound to another generation
    fails with ReexposedError."""
    proc, endpoint = spawn_prefill(
        "--tp-size", "2", "--requests", "2", "--blocks-per-request", "4", "--timeout", "60", *SMALL
    )
    try:
        s = cli_spec(*SMALL)
        reqs = await fetch_requests(endpoint, s, None, "g")
        assert all(r.generation for r in reqs) and len({r.generation for r in reqs}) == 2
        async with akv.Consumer(akv.allocate_kv_cache(s, 0, 1), s, tp_rank=0, tp_size=1) as consumer:
            session = await consumer.connect(endpoint)
            good, bad = reqs
            wrong = akv.PullRequest(
                request_id=bad.request_id, local_block_ids=[0, 1, 2, 3], remote_block_ids=bad.block_ids,
                generation=good.generation,
            )  # fmt: skip
            with pytest.raises(akv.ReexposedError):
                await (await session.pull(wrong))
            ok = akv.PullRequest(
                request_id=good.request_id, local_block_ids=[4, 5, 6, 7], remote_block_ids=good.block_ids,
                generation=good.generation,
            )  # fmt: skip
            result = await (await session.pull(ok))
            assert result.reads == 2
    finally:
        stop(proc)
