"""akv inside vLLM: the KV connector ``AkvConnector`` (see docs/vllm.md).

Load it with ``--kv-transfer-config '{"kv_connector": "AkvConnector",
"kv_connector_module_path": "akv.integrations.vllm", "kv_role": "kv_producer"}'`` on the
prefill instance (``kv_consumer`` on the decode instance, ``kv_both`` for either);
``kv_connector_extra_config`` takes akv's options
([`ConnectorOptions`][akv.integrations.vllm.options.ConnectorOptions]).

The connector classes import vLLM when first used (``akv.integrations.vllm.AkvConnector``);
the package's other modules (options, layout, params, launch) do not. Nothing else in akv
imports this package.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AkvConnector", "AkvConnectorMetadata", "AkvConnectorStats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("akv.integrations.vllm.connector"), name)
    raise AttributeError(f"module 'akv.integrations.vllm' has no attribute {name!r}")
