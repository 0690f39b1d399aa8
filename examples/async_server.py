"""A decode-side HTTP service: POST /pull pulls a request's KV and returns the transfer stats.

The service is a plain ASGI app served by uvicorn; the akv ``Consumer`` lives in the app's
lifespan, inside the server's own event loop. Run with no arguments: it starts an
``akv prefill`` peer, serves on a free port, POSTs every announced request with httpx and
prints the answers. ``create_app`` is importable for tests and real deployments.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

import akv
from akv.testing import spawn_prefill

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

SPEC = akv.KVSpec.create(layers=2, num_blocks=256, block_size=16, kv_heads=8, head_dim=64, dtype="bfloat16")
MODEL_ARGS = [
    "--kv-heads",
    "8",
    "--layers",
    "2",
    "--blocks",
    "256",
    "--block-size",
    "16",
    "--head-dim",
    "64",
    "--dtype",
    "bfloat16",
]


def create_app(spec: akv.KVSpec, prefill_endpoint: str, tp_rank: int = 0, tp_size: int = 1) -> Any:
    """An ASGI app holding one decode rank; POST /pull {"request_id", "remote_block_ids"}."""
    state: dict[str, Any] = {}

    async def respond(send: Send, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": data})

    async def lifespan(receive: Receive, send: Send) -> None:
        await receive()  # startup
        cache = akv.allocate_kv_cache(spec, tp_rank, tp_size)
        async with akv.Consumer(cache, spec, tp_rank=tp_rank, tp_size=tp_size) as consumer:
            state["session"] = await consumer.connect(prefill_endpoint)
            state["free"] = list(range(spec.num_blocks))
            await send({"type": "lifespan.startup.complete"})
            await receive()  # shutdown
        await send({"type": "lifespan.shutdown.complete"})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http" or scope["path"] != "/pull" or scope["method"] != "POST":
            await respond(send, 404, {"error": "POST /pull"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        try:
            req = json.loads(body)
            remote = [int(b) for b in req["remote_block_ids"]]
            free = state["free"]
            if len(remote) > len(free):
                await respond(send, 503, {"error": "no free blocks"})
                return
            local, state["free"] = free[: len(remote)], free[len(remote) :]
            try:
                transfer = await state["session"].pull(
                    akv.PullRequest(
                        request_id=str(req["request_id"]), local_block_ids=local, remote_block_ids=remote
                    )
                )
                result = await transfer
            finally:
                state["free"].extend(local)  # a real engine keeps them until decoding ends
        except akv.AkvError as exc:  # typed errors become 4xx/5xx answers; the service keeps running
            status = 400 if isinstance(exc, ValueError) else 502
            await respond(send, status, {"error": f"{type(exc).__name__}: {exc}"})
            return
        except (KeyError, ValueError, TypeError) as exc:
            await respond(send, 400, {"error": f"bad request: {exc}"})
            return
        await respond(
            send,
            200,
            {
                "request_id": result.request_id,
                "bytes": result.bytes,
                "descriptors": result.descriptors,
                "seconds": result.seconds,
            },
        )

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_prefill() -> tuple[subprocess.Popen[str], str]:
    """Start an ``akv prefill`` peer (TP 2, six requests); returns it and its endpoint."""
    return spawn_prefill("--tp-size", "2", "--requests", "6", "--timeout", "120", *MODEL_ARGS)


async def main(endpoint: str) -> int:
    import httpx
    import uvicorn

    from akv.testing import fetch_requests

    requests = await fetch_requests(endpoint, SPEC, None, "router")
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(SPEC, endpoint), host="127.0.0.1", port=port, lifespan="on", log_level="warning"
        )
    )
    ok = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        while not server.started:  # noqa: ASYNC110 - uvicorn offers no "started" event
            await anyio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for req in requests:
                r = await client.post(
                    "/pull", json={"request_id": req.request_id, "remote_block_ids": req.block_ids}
                )
                print(r.status_code, r.json())
                ok += r.status_code == 200
            r = await client.post("/pull", json={"request_id": "bad", "remote_block_ids": [10_000]})
            print(r.status_code, r.json())  # a typed error; the service keeps serving
        server.should_exit = True
    return 0 if ok == len(requests) and r.status_code == 400 else 1


if __name__ == "__main__":
    peer, prefill_endpoint = start_prefill()
    try:
        sys.exit(anyio.run(main, prefill_endpoint))
    finally:
        peer.kill()
        peer.wait()
