"""``kv_connector_extra_config`` of the vLLM connector: akv's options, checked (pure, no vLLM).

Every key is optional. A key akv does not know, or a value of the wrong type or range, is a
[`ConfigError`][akv.errors.ConfigError] naming the key, raised when vLLM builds the
connector, so the engine stops at start-up with that one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from akv.errors import ConfigError

__all__ = ["DEFAULT_PORT", "ConnectorOptions", "parse_options"]

#: rank 0's control port when ``port`` is not given (plus the data-parallel index).
DEFAULT_PORT = 5700


class ConnectorOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """akv's options inside vLLM (``kv_connector_extra_config``).

    Attributes:
        host: the address every rank's control endpoint binds to.
        advertise_host: the address decode instances reach rank 0 at (default: ``host``).
        port: rank 0's control port (the prefill instance's bootstrap; ranks > 0 take free
            ports and register with rank 0). Prefill instances only.
        etcd: etcd endpoint(s), ``"HOST:PORT[,HOST:PORT]"``: every prefill rank registers in
            etcd and decode instances find the engine as ``etcd://HOST:PORT/ENGINE_ID``.
        engine_id: akv's engine id (default: derived from vLLM's engine id).
        secret: the control plane's shared secret (default ``$AKV_SECRET``; required on
            anything but loopback unless ``allow_insecure``).
        allow_insecure: serve a non-loopback address without a secret (trusted networks only).
        tls_cert, tls_key, tls_ca: TLS on the control plane (PEM file paths).
        mode: decode side: ``"pull"`` (decode READs) or ``"push"`` (prefill WRITEs); default:
            akv's (per prefill engine: push where UCX would serve reads over TCP, else pull).
        transfer: ``"direct"``, ``"packed"`` or ``"auto"`` (see akv's packed transfers);
            default: ``"auto"`` on CUDA (vLLM's CUDA layouts post two descriptors per layer
            and block, ~6 us each there), ``"direct"`` on CPU.
        lease: prefill side: seconds an exposed request stays pinned unread.
        transfer_timeout: decode side: seconds a pull may take before it fails.
        connect_timeout, handshake_timeout: decode side: reaching a prefill engine.
        settle_timeout: decode side: how long a timed-out pull's reads may take to stop.
        expose_wait: decode side: seconds a pull retries while its request is not yet exposed
            (the prefill workers expose a finished request one engine step after its
            response left, and any request only once their akv thread took the step's order).
        pack_pool_bytes: prefill side with ``transfer`` packed or auto: the staging pool.
        idle_timeout: decode side: seconds after which a prefill instance no request was
            pulled from is unlinked (its sockets and loaded agents freed; linked again at its
            next request); default: never.
    """

    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = DEFAULT_PORT
    etcd: str | None = None
    engine_id: str | None = None
    secret: str | None = None
    allow_insecure: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    mode: Literal["pull", "push"] | None = None
    transfer: Literal["direct", "packed", "auto"] | None = None
    lease: float = 120.0
    transfer_timeout: float = 30.0
    connect_timeout: float = 5.0
    handshake_timeout: float = 10.0
    settle_timeout: float = 2.0
    expose_wait: float = 5.0
    pack_pool_bytes: int = 256 << 20
    idle_timeout: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        for name in ("lease", "transfer_timeout", "connect_timeout", "handshake_timeout", "settle_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.idle_timeout is not None and self.idle_timeout <= 0:
            raise ConfigError(f"idle_timeout must be > 0, got {self.idle_timeout}")
        if self.expose_wait < 0:
            raise ConfigError(f"expose_wait must be >= 0, got {self.expose_wait}")

    @property
    def tls(self) -> Any:
        """The [`TLSConfig`][akv.TLSConfig] of the tls_* keys, or None."""
        if self.tls_cert is None and self.tls_key is None and self.tls_ca is None:
            return None
        from akv.tls import TLSConfig

        return TLSConfig(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca)


def parse_options(extra: Mapping[str, Any] | None) -> ConnectorOptions:
    """The options of ``kv_connector_extra_config``; [`ConfigError`][akv.errors.ConfigError]
    naming the key that is wrong."""
    try:
        return msgspec.convert(dict(extra or {}), ConnectorOptions, strict=False)
    except (msgspec.ValidationError, ConfigError) as exc:
        hint = ""
        if "unknown field" in str(exc):
            hint = f" (akv's keys: {', '.join(ConnectorOptions.__struct_fields__)})"
        raise ConfigError(f"kv_connector_extra_config: {exc}{hint}") from None
