"""The examples run to completion on their defaults; the HTTP service is driven by a real client."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from akv.testing import fetch_requests
from tests.conftest import prefill_process

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))


@pytest.mark.parametrize(
    "name",
    ["disaggregated_pair.py", "async_server.py", "trio_consumer.py", "hybrid_model.py", "engine_loop.py"],
)
def test_example_runs_on_defaults(name: str) -> None:
    """Each example starts its own peers, verifies its data and exits 0."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "MISMATCH" not in proc.stdout


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_async_server_over_real_http(anyio_backend: str) -> None:
    """POST /pull returns the transfer's stats; bad block ids get a 400 and the service keeps serving."""
    import httpx
    import uvicorn
    from async_server import MODEL_ARGS, SPEC, create_app, free_port

    with prefill_process(2, 8, *MODEL_ARGS[2:], requests=3) as (_proc, endpoint):
        requests = await fetch_requests(endpoint, SPEC, None, "router")
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(SPEC, endpoint), host="127.0.0.1", port=port, lifespan="on", log_level="warning"
            )
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            with anyio.fail_after(20):
                while not server.started:
                    await anyio.sleep(0.05)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as client:
                bad = await client.post("/pull", json={"request_id": "x", "remote_block_ids": [-1]})
                assert bad.status_code == 400 and "BlockIdError" in bad.json()["error"]
                assert (await client.post("/pull", content=b"not json")).status_code == 400
                for req in requests:
                    r = await client.post(
                        "/pull", json={"request_id": req.request_id, "remote_block_ids": req.block_ids}
                    )
                    assert r.status_code == 200, r.text
                    body = r.json()
                    assert body["request_id"] == req.request_id and body["bytes"] > 0 and body["seconds"] > 0
            server.should_exit = True
