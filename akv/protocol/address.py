"""Control-plane addresses (pure)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from akv.errors import ConfigError

__all__ = ["Endpoint", "is_loopback", "parse_endpoint"]


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
