"""A disaggregating router for two vLLM instances: prefill first, then decode.

    python examples/vllm/proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

For each OpenAI-style ``POST /v1/completions`` or ``/v1/chat/completions`` (streaming too):

1. the prefill instance gets the request with one output token, no streaming, and
   ``kv_transfer_params: {"do_remote_decode": true}``;
2. the decode instance gets the original request with the ``kv_transfer_params`` the prefill
   response returned, verbatim, and its answer (or stream) goes back to the client.

The router knows nothing of the connector: it works the same for akv's ``AkvConnector`` and
vLLM's ``NixlConnector``. Several prefill or decode instances are taken in turn (repeat the
flag). ``GET /health`` answers once every instance does.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def build_app(prefill: list[str], decode: list[str]) -> Starlette:
    """The router's ASGI app over the given instance base URLs."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0))
    next_prefill, next_decode = itertools.cycle(prefill), itertools.cycle(decode)

    async def route(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        path = request.url.path
        first = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        p = await client.post(next(next_prefill) + path, json=first)
        if p.status_code != 200:
            return Response(p.content, status_code=p.status_code, media_type="application/json")
        second = dict(body, kv_transfer_params=p.json().get("kv_transfer_params"))
        target = next(next_decode) + path
        if not body.get("stream"):
            d = await client.post(target, json=second)
            return Response(d.content, status_code=d.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            async with client.stream("POST", target, json=second) as d:
                async for chunk in d.aiter_raw():
                    yield chunk

        return StreamingResponse(relay(), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        for base in [*prefill, *decode]:
            try:
                r = await client.get(base + "/health")
            except httpx.HTTPError:
                return JSONResponse({"down": base}, status_code=503)
            if r.status_code != 200:
                return JSONResponse({"down": base}, status_code=503)
        return JSONResponse({"ok": True})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with client:
            yield

    return Starlette(
        routes=[
            Route("/v1/completions", route, methods=["POST"]),
            Route("/v1/chat/completions", route, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="route OpenAI-style requests through a prefill and a decode vLLM instance"
    )
    ap.add_argument(
        "--prefill", action="append", required=True, help="prefill instance base URL (repeatable)"
    )
    ap.add_argument("--decode", action="append", required=True, help="decode instance base URL (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    for url in [*args.prefill, *args.decode]:
        if not url.startswith(("http://", "https://")):
            print(f"proxy: {url!r} is not a base URL: write http://HOST:PORT", file=sys.stderr)
            return 64
    app = build_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode])
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
