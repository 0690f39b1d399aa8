"""Figure programs of ``akv bench``: the figures the docs quote that are not workloads of the
standard run. Each runs only when named with ``akv bench --only NAME``, in this process (its
helpers in processes of their own), and returns JSON rows, ``{"name": NAME, ...}``. They
measure DRAM, take neither ``--quick``, ``--device`` nor ``--mode``; ``sparse_pulls`` takes
``--transfer``.

This module only names them (`PROGRAMS`, for ``--help`` and the checks of ``--only``);
`run_program` imports one and runs it. Each module's docstring says what it measures.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PROGRAMS", "run_program"]

#: name -> what it measures (one line of ``akv bench --help``); the module is
#: ``akv.bench.figures.NAME``, its coroutine ``figures(transfer)``.
PROGRAMS: dict[str, str] = {
    "groups": "hybrid presets: descriptors per group, connect times",
    "notice_flush": "a small READ after a notice, with a READ behind it or not",
    "sparse_pulls": "small pulls 0.3 s apart from akv prefill (takes --transfer)",
    "scatter": "the scatter of packed pulls alone, NHD and HND",
    "packed_threshold": "direct vs packed pulls of 1-16 blocks (auto's threshold)",
    "nixl_threads": "decode agents with 0, 1 and 2 NIXL worker threads",
    "etcd": "etcd discovery: SIGKILL to key gone, resolving (needs etcd)",
    "scale": "cost as the work grows: prompt length, pulls in flight, engines, readers, etcd fleet",
}


async def run_program(name: str, transfer: str = "direct") -> list[dict[str, Any]]:
    """Run figure program ``name`` (a key of `PROGRAMS`); its rows, each named ``name``."""
    module = importlib.import_module(f"akv.bench.figures.{name}")
    rows: list[dict[str, Any]] = await module.figures(transfer)
    return [{"name": name, **r} for r in rows]
