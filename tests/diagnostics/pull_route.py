"""The route of one pull through akv's runtime modules, from `TransferSession.pull` to the
prefill's release: which module calls which, in order.

Every rank lives in this process (``--prefill-tp`` prefill ranks, one decode rank; NIXL over
UCX loopback, the read path with its exposure check; ``--mla``: one rank read, the others
told by a notice of their own). A profiler (``sys.setprofile``) records every
call from one module of ``akv.runtime`` (paths included) into another while the pull runs,
from the call of ``session.pull`` until the prefill's ``on_release`` fires; a coroutine that
resumes is not a call, and calls from a module into itself or out of the runtime (the core,
the backends) are not hops. It prints one JSON line:

- ``hops``: the distinct cross-module calls the pull made (caller function -> callee
  function), in the order first made;
- ``modules``: each runtime module the route enters, with how many of those hops enter it,
  and ``route``: the modules in the order the hops enter them (consecutive repeats merged);
- ``entries``: how many times the route enters each module (its appearances in ``route``);
- ``loops``: the call stacks on which a module is entered again through another one (a
  module calling up into one that called it: A -> B -> A), each once.

A diagnostic, not part of the suite (pytest collects only ``test_*.py`` files from ``tests``):

    .venv/bin/python tests/diagnostics/pull_route.py [--prefill-tp 2 --mla]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from types import FrameType
from typing import Any

import anyio

import akv

RUNTIME = Path(akv.__file__).resolve().parent / "runtime"


def _module(frame: FrameType) -> str | None:
    path = Path(frame.f_code.co_filename)
    try:
        rel = path.resolve().relative_to(RUNTIME)
    except ValueError:
        return None
    return "akv.runtime." + ".".join(rel.with_suffix("").parts).removesuffix(".__init__")


class Route:
    """Cross-module calls within the runtime, in the order first made."""

    def __init__(self) -> None:
        self.hops: list[tuple[str, str]] = []
        self._seen: set[tuple[str, str]] = set()
        self.loops: list[list[str]] = []  # call stacks on which a module comes back
        self._loops: set[tuple[str, ...]] = set()
        self.on = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call" or frame.f_lasti >= 10:  # a resumed coroutine is no call
            return
        callee = _module(frame)
        caller_frame = frame.f_back
        if callee is None or caller_frame is None:
            return
        caller = _module(caller_frame)
        if caller is None or caller == callee:
            return
        hop = (f"{caller}.{caller_frame.f_code.co_qualname}", f"{callee}.{frame.f_code.co_qualname}")
        if hop not in self._seen:
            self._seen.add(hop)
            self.hops.append(hop)
        stack = [callee]
        back: FrameType | None = caller_frame
        while back is not None:
            m = _module(back)
            if m is not None and m != stack[-1]:
                stack.append(m)
            back = back.f_back
        if callee in stack[1:]:  # the call comes back into a module through another one
            key = tuple(reversed(stack))
            if key not in self._loops:
                self._loops.add(key)
                self.loops.append(list(key))

    def report(self) -> dict[str, Any]:
        def mod(name: str) -> str:
            return next(m for m in sorted(_MODULES, key=len, reverse=True) if name.startswith(m + "."))

        entered = Counter(mod(callee) for _, callee in self.hops)
        route: list[str] = []
        for caller, callee in self.hops:
            for m in (mod(caller), mod(callee)):
                if not route or route[-1] != m:
                    route.append(m)
        return {
            "hops": len(self.hops),
            "modules": len(set(route)),
            "entries": dict(Counter(route)),
            "entered_by_hops": dict(entered),
            "route": route,
            "calls": [f"{a} -> {b}" for a, b in self.hops],
            "loops": [" -> ".join(loop) for loop in self.loops],
        }


_MODULES = sorted(
    "akv.runtime." + ".".join(p.relative_to(RUNTIME).with_suffix("").parts).removesuffix(".__init__")
    for p in RUNTIME.rglob("*.py")
)


async def main(prefill_tp: int, mla: bool) -> dict[str, Any]:
    heads, kind = (1, "mla") if mla else (4, "dense")
    spec = akv.KVSpec.create(
        layers=4, num_blocks=32, block_size=16, kv_heads=heads, head_dim=64, dtype="bfloat16", kind=kind
    )
    route = Route()
    released: list[str] = []
    done = anyio.Event()

    def on_release(release: akv.Release) -> None:
        released.append(release.request_id)
        if released.count("traced") == prefill_tp:  # every prefill rank released it
            route.on = False
            done.set()

    async with AsyncExitStack() as stack:
        server = akv.ControlServer(secret="s")
        tg = await stack.enter_async_context(anyio.create_task_group())
        await tg.start(server.serve)
        ranks = []
        for r in range(prefill_tp):
            kv = akv.allocate_kv_cache(spec, r, prefill_tp)
            rank = akv.Producer(kv, spec, tp_rank=r, tp_size=prefill_tp, server=server, on_release=on_release)
            ranks.append(await stack.enter_async_context(rank))
        decode = await stack.enter_async_context(
            akv.Consumer(
                akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, secret="s", same_process="nixl"
            )
        )
        session = await decode.connect(server.endpoint)

        def expose(rid: str, blocks: list[int]) -> int:
            generations = [p.expose(rid, blocks, generation=7) for p in ranks]
            return generations[0]

        for i in range(3):  # warm: the route traced is a pull's in steady state
            expose(f"warm{i}", [i])
            await (await session.pull(f"warm{i}", [i], [i]))
        generation = expose("traced", [5, 6])
        sys.setprofile(route)
        threading.setprofile(route)
        route.on = True
        request = akv.PullRequest(
            request_id="traced", local_block_ids=[7, 8], remote_block_ids=[5, 6], generation=generation
        )
        result = await (await session.pull(request))
        with anyio.fail_after(10):
            await done.wait()
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        assert result.bytes > 0
        tg.cancel_scope.cancel()
    return route.report()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-tp", type=int, default=1, help="prefill ranks (default 1)")
    parser.add_argument("--mla", action="store_true", help="an MLA cache: one rank read, the others notified")
    args = parser.parse_args()
    print(json.dumps(anyio.run(main, args.prefill_tp, args.mla)))
