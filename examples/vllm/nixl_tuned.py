"""vLLM's NixlConnector with NIXL's progress thread off and its CPU pinning left out.

Loaded by vLLM through ``"kv_connector": "TunedNixlConnector", "kv_connector_module_path":
"nixl_tuned"`` (``examples/vllm`` on ``PYTHONPATH``); the benchmark compares akv against it and
against NixlConnector as shipped. As shipped, NixlConnector creates its NIXL agent with UCX's
progress thread, which spins on a core even when idle, and on CPU machines pins the worker
process to the last core of each NUMA node. Both cost a 2-core machine most of a core.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

_agent_config = base_worker.nixl_agent_config


def _without_progress_thread(*args: Any, **kwargs: Any) -> Any:
    kwargs["enable_prog_thread"] = False
    return _agent_config(*args, **kwargs)


if _agent_config is not None:
    base_worker.nixl_agent_config = _without_progress_thread


class TunedNixlConnector(NixlConnector):
    """NixlConnector, minus the progress thread and the pinning (see the module text)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pin = os.sched_setaffinity
        os.sched_setaffinity = lambda pid, cpus: None  # keep the core the launcher chose
        try:
            super().__init__(*args, **kwargs)
        finally:
            os.sched_setaffinity = pin
