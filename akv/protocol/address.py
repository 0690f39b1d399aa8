"""Control-plane and engine addresses (pure).

An engine is named in one of three forms (:func:`parse_engine_address`):

- ``HOST:PORT``: the bootstrap endpoint (rank 0's control endpoint);
- ``HOST:PORT,HOST:PORT,...``: every rank's control endpoint, in rank order;
- ``etcd://HOST:PORT[,HOST:PORT...]/ENGINE_ID``: the ranks registered in etcd under the engine id.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import TypeAlias

from akv.errors import ConfigError

__all__ = [
    "ENGINE_ID_RE",
    "BootstrapAddress",
    "Endpoint",
    "EngineAddress",
    "EtcdAddress",
    "RankListAddress",
    "check_engine_id",
    "is_loopback",
    "parse_endpoint",
    "parse_engine_address",
]

ENGINE_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
"""An engine id: 1 to 128 letters, digits, ``.``, ``_`` or ``-`` (it is part of etcd keys)."""

ETCD_SCHEME = "etcd://"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A control-plane address; ``str()`` gives ``host:port`` (``[host]:port`` for IPv6).

    Attributes:
        host: host name or IP address.
        port: TCP port.
    """

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(value: str | Endpoint | tuple[str, int]) -> Endpoint:
    """Parse ``"host:port"`` (``"[v6]:port"`` for IPv6); [`ConfigError`][akv.errors.ConfigError] if malformed."""
    if isinstance(value, Endpoint):
        return value
    if isinstance(value, tuple):
        return Endpoint(str(value[0]), int(value[1]))
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"endpoint {value!r} is not HOST:PORT (for example 127.0.0.1:5555)")
    return Endpoint(host.strip("[]"), int(port))


def is_loopback(host: str) -> bool:
    """True for loopback addresses and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_engine_id(engine_id: str) -> str:
    """``engine_id`` itself if it is a valid engine id; :class:`ConfigError` saying what to write if not."""
    if not ENGINE_ID_RE.fullmatch(engine_id):
        raise ConfigError(
            f"engine id {engine_id!r} is not 1-128 letters, digits, '.', '_' or '-' (for example prefill-0)"
        )
    return engine_id


@dataclass(frozen=True, slots=True)
class BootstrapAddress:
    """``HOST:PORT``: rank 0's control endpoint, which knows every rank of its engine."""

    endpoint: Endpoint

    def __str__(self) -> str:
        return str(self.endpoint)


@dataclass(frozen=True, slots=True)
class RankListAddress:
    """``HOST:PORT,HOST:PORT,...``: the control endpoint of every rank, in rank order."""

    endpoints: tuple[Endpoint, ...]

    def __str__(self) -> str:
        return ",".join(map(str, self.endpoints))


@dataclass(frozen=True, slots=True)
class EtcdAddress:
    """``etcd://HOST:PORT[,HOST:PORT...]/ENGINE_ID``: the ranks registered in etcd for ``engine_id``."""

    etcd: tuple[Endpoint, ...]
    engine_id: str

    def __str__(self) -> str:
        return f"{ETCD_SCHEME}{','.join(map(str, self.etcd))}/{self.engine_id}"


EngineAddress: TypeAlias = BootstrapAddress | RankListAddress | EtcdAddress

_FORMS = "HOST:PORT, HOST:PORT,HOST:PORT,... (every rank in rank order) or etcd://HOST:PORT/ENGINE_ID"


def _endpoint_list(text: str, what: str, original: str) -> tuple[Endpoint, ...]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ConfigError(f"engine address {original!r} has an empty {what} in its list; write {_FORMS}")
    try:
        return tuple(parse_endpoint(item) for item in items)
    except ConfigError as exc:
        raise ConfigError(f"engine address {original!r}: {exc}; write {_FORMS}") from None


def parse_engine_address(value: str | EngineAddress | Endpoint | tuple[str, int]) -> EngineAddress:
    """Parse any engine address form; `ConfigError` saying what to write if malformed.

    ``value`` is ``"HOST:PORT"`` (the bootstrap: rank 0's control endpoint),
    ``"HOST:PORT,HOST:PORT,..."`` (every rank's endpoint in rank order) or
    ``"etcd://HOST:PORT[,HOST:PORT...]/ENGINE_ID"``. An `Endpoint` or ``(host, port)``
    tuple is a bootstrap address; a parsed address is returned as it is.
    """
    if isinstance(value, (BootstrapAddress, RankListAddress, EtcdAddress)):
        return value
    if isinstance(value, (Endpoint, tuple)):
        return BootstrapAddress(parse_endpoint(value))
    text = value.strip()
    if "://" in text:
        if not text.lower().startswith(ETCD_SCHEME):
            scheme = text.split("://", 1)[0]
            raise ConfigError(f"engine address {value!r} has an unknown scheme {scheme!r}; write {_FORMS}")
        rest = text[len(ETCD_SCHEME) :]
        hosts, sep, engine_id = rest.partition("/")
        if not sep or not engine_id or not hosts:
            raise ConfigError(
                f"engine address {value!r} is not etcd://HOST:PORT[,HOST:PORT...]/ENGINE_ID "
                "(for example etcd://127.0.0.1:2379/prefill-0)"
            )
        try:
            check_engine_id(engine_id)
        except ConfigError as exc:
            raise ConfigError(f"engine address {value!r}: {exc}") from None
        return EtcdAddress(_endpoint_list(hosts, "etcd endpoint", value), engine_id)
    endpoints = _endpoint_list(text, "endpoint", value)
    if len(endpoints) == 1:
        return BootstrapAddress(endpoints[0])
    if len(set(endpoints)) != len(endpoints):
        raise ConfigError(f"engine address {value!r} names an endpoint twice; list each rank's endpoint once")
    return RankListAddress(endpoints)
