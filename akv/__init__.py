"""akv: move LLM KV-cache blocks from prefill to decode workers over NVIDIA NIXL.

Decode side::

    async with akv.Consumer(kv_caches, spec, tp_rank=r, tp_size=D) as consumer:
        session = await consumer.connect(engine_address)
        transfer = await session.pull(akv.PullRequest(request_id=..., local_block_ids=...,
                                                      remote_block_ids=...))
        result = await transfer

Prefill side::

    async with akv.Producer(kv_caches, spec, tp_rank=r, tp_size=P, on_release=free) as producer:
        producer.expose(request_id, block_ids)

``import akv`` is cheap: the names below are loaded on first use, so torch and nixl are
imported only when a Producer, Consumer or tensor helper is actually used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from akv.errors import (
    AkvError,
    AuthenticationError,
    BackendError,
    BackPressureError,
    BlockIdError,
    ClosedError,
    ConfigError,
    DiscoveryError,
    EngineChangedError,
    EtcdUnavailableError,
    FrameError,
    HandshakeError,
    IncompatiblePeerError,
    LayoutError,
    LeaseExpiredError,
    MissingRanksError,
    NotExposedError,
    OutsideExposureError,
    PeerLostError,
    ProtocolError,
    ReexposedError,
    RefusedError,
    ReleasedError,
    ServerBusyError,
    TransferCancelledError,
    TransferError,
    TransferTimeout,
    UnknownRequestError,
    UnsafeReadError,
    VersionMismatchError,
)

if TYPE_CHECKING:
    from akv.geometry.cache import CacheSpec, Component, Group
    from akv.geometry.spec import KVSpec
    from akv.geometry.tensors import allocate_kv_cache, layer_views
    from akv.ledger import EngineRelease, EngineReleases, Release
    from akv.metrics import Metrics, MetricsSnapshot, TransferStats
    from akv.presets import preset
    from akv.protocol.address import Endpoint, EngineAddress, parse_engine_address
    from akv.runtime.consumer import Consumer
    from akv.runtime.control import ControlServer
    from akv.runtime.discovery import EtcdRegistry, RankRecord
    from akv.runtime.producer import Producer
    from akv.runtime.session import TransferSession
    from akv.runtime.transfer import PullRequest, Transfer, TransferResult
    from akv.sharding import expected_notifications, held_heads, plan_reads
    from akv.tls import TLSConfig

__version__ = "0.1.0"

# name -> module that defines it (loaded on first attribute access)
_LAZY: dict[str, str] = {
    "CacheSpec": "akv.geometry.cache",
    "Component": "akv.geometry.cache",
    "Consumer": "akv.runtime.consumer",
    "Group": "akv.geometry.cache",
    "ControlServer": "akv.runtime.control",
    "Endpoint": "akv.protocol.address",
    "EngineAddress": "akv.protocol.address",
    "EtcdRegistry": "akv.runtime.discovery",
    "EngineRelease": "akv.ledger",
    "EngineReleases": "akv.ledger",
    "KVSpec": "akv.geometry.spec",
    "layer_views": "akv.geometry.tensors",
    "preset": "akv.presets",
    "Metrics": "akv.metrics",
    "MetricsSnapshot": "akv.metrics",
    "Producer": "akv.runtime.producer",
    "PullRequest": "akv.runtime.transfer",
    "RankRecord": "akv.runtime.discovery",
    "Release": "akv.ledger",
    "Transfer": "akv.runtime.transfer",
    "TransferResult": "akv.runtime.transfer",
    "TransferSession": "akv.runtime.session",
    "TransferStats": "akv.metrics",
    "TLSConfig": "akv.tls",
    "allocate_kv_cache": "akv.geometry.tensors",
    "expected_notifications": "akv.sharding",
    "parse_engine_address": "akv.protocol.address",
    "held_heads": "akv.sharding",
    "plan_reads": "akv.sharding",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'akv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AkvError",
    "AuthenticationError",
    "BackPressureError",
    "BackendError",
    "BlockIdError",
    "CacheSpec",
    "ClosedError",
    "Component",
    "ConfigError",
    "Consumer",
    "ControlServer",
    "DiscoveryError",
    "Endpoint",
    "EngineAddress",
    "EngineChangedError",
    "EngineRelease",
    "EngineReleases",
    "EtcdRegistry",
    "EtcdUnavailableError",
    "FrameError",
    "Group",
    "HandshakeError",
    "IncompatiblePeerError",
    "KVSpec",
    "LayoutError",
    "LeaseExpiredError",
    "Metrics",
    "MetricsSnapshot",
    "MissingRanksError",
    "NotExposedError",
    "OutsideExposureError",
    "PeerLostError",
    "Producer",
    "ProtocolError",
    "PullRequest",
    "RankRecord",
    "ReexposedError",
    "RefusedError",
    "Release",
    "ReleasedError",
    "ServerBusyError",
    "TLSConfig",
    "Transfer",
    "TransferCancelledError",
    "TransferError",
    "TransferResult",
    "TransferSession",
    "TransferStats",
    "TransferTimeout",
    "UnknownRequestError",
    "UnsafeReadError",
    "VersionMismatchError",
    "__version__",
    "allocate_kv_cache",
    "expected_notifications",
    "held_heads",
    "layer_views",
    "parse_engine_address",
    "plan_reads",
    "preset",
]
