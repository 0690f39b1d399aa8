"""What both halves of one vLLM instance's connector agree on (vLLM's configuration, read once).

The scheduler half and every worker half derive the same `Identity` from vLLM's config: the
engine id, rank 0's control address, the TP size, the block size and the content layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from akv.errors import ConfigError
from akv.integrations.vllm.layout import Content, content_for_device
from akv.integrations.vllm.options import ConnectorOptions, parse_options

__all__ = ["Identity"]


@dataclass(frozen=True, slots=True)
class Identity:
    """What both halves of one instance agree on, derived from vLLM's configuration."""

    options: ConnectorOptions
    engine_id: str
    port: int
    tp_size: int
    block_size: int
    content: Content
    producer: bool
    consumer: bool

    @property
    def bootstrap(self) -> str:
        """Rank 0's control endpoint as this host reaches it."""
        o = self.options
        return f"{o.advertise_host or o.host}:{self.port}"

    @property
    def address(self) -> str:
        """The prefill engine's akv address, as decode instances reach it."""
        o = self.options
        if o.etcd:
            return f"etcd://{o.etcd.split(',')[0].strip()}/{self.engine_id}"
        return self.bootstrap

    @classmethod
    def of(cls, vllm_config: Any) -> Identity:
        from vllm.platforms import current_platform

        ktc = vllm_config.kv_transfer_config
        options = parse_options(ktc.kv_connector_extra_config)
        role = ktc.kv_role
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ConfigError(f"AkvConnector: kv_role {role!r}: use kv_producer, kv_consumer or kv_both")
        if role != "kv_consumer" and not options.port and not options.etcd:
            raise ConfigError(
                "AkvConnector: a prefill instance needs a fixed 'port' (rank 0's control port, which its "
                "responses name) or 'etcd' in kv_connector_extra_config"
            )
        engine_id = options.engine_id or "vllm-" + re.sub(r"[^A-Za-z0-9._-]", "-", str(ktc.engine_id))[:120]
        pc = vllm_config.parallel_config
        return cls(
            options=options,
            engine_id=engine_id,
            port=options.port + pc.data_parallel_index if options.port else 0,
            tp_size=pc.tensor_parallel_size,
            block_size=vllm_config.cache_config.block_size,
            content=content_for_device(current_platform.device_type),
            producer=role in ("kv_producer", "kv_both"),
            consumer=role in ("kv_consumer", "kv_both"),
        )
