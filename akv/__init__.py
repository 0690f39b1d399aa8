"""akv: move LLM KV-cache blocks from prefill to decode workers over NVIDIA NIXL.

Decode side::

    async with akv.Consumer(kv_caches, spec, tp_rank=r, tp_size=D) as consumer:
        session = await consumer.connect("127.0.0.1:5555")
        transfer = await session.pull(akv.PullRequest(request_id=..., local_block_ids=...,
                                                      remote_block_ids=...))
        result = await transfer

Prefill side::

    async with akv.Producer(kv_caches, spec, tp_rank=r, tp_size=P, on_release=free) as producer:
        producer.expose(request_id, block_ids)
"""

from akv.consumer import Consumer, PullRequest, Transfer, TransferResult, TransferSession
from akv.control import ControlServer, Endpoint
from akv.errors import (
    AkvError,
    AuthenticationError,
    BackendError,
    BlockIdError,
    ClosedError,
    ConfigError,
    FrameError,
    HandshakeError,
    IncompatiblePeerError,
    LayoutError,
    PeerLostError,
    ProtocolError,
    TransferError,
    TransferTimeout,
    UnknownRequestError,
)
from akv.metrics import Metrics, MetricsSnapshot, TransferStats
from akv.producer import Producer, Release
from akv.spec import KVSpec
from akv.tensors import allocate_kv_cache
from akv.tp import expected_notifications, held_heads, plan_reads

__version__ = "0.1.0"

__all__ = [
    "AkvError",
    "AuthenticationError",
    "BackendError",
    "BlockIdError",
    "ClosedError",
    "ConfigError",
    "Consumer",
    "ControlServer",
    "Endpoint",
    "FrameError",
    "HandshakeError",
    "IncompatiblePeerError",
    "KVSpec",
    "LayoutError",
    "Metrics",
    "MetricsSnapshot",
    "PeerLostError",
    "Producer",
    "ProtocolError",
    "PullRequest",
    "Release",
    "Transfer",
    "TransferError",
    "TransferResult",
    "TransferSession",
    "TransferStats",
    "TransferTimeout",
    "UnknownRequestError",
    "__version__",
    "allocate_kv_cache",
    "expected_notifications",
    "held_heads",
    "plan_reads",
]
