"""The akv exception hierarchy: every error akv raises derives from :class:`AkvError`."""

from __future__ import annotations

__all__ = [
    "AkvError",
    "AuthenticationError",
    "BackendError",
    "BlockIdError",
    "ClosedError",
    "ConfigError",
    "FrameError",
    "HandshakeError",
    "IncompatiblePeerError",
    "LayoutError",
    "PeerLostError",
    "ProtocolError",
    "TransferError",
    "TransferTimeout",
    "UnknownRequestError",
]


class AkvError(Exception):
    """Root of every error raised by akv."""


class ConfigError(AkvError, ValueError):
    """A configuration (TP sizes, head counts, spec, tensors) is invalid; the message says what to change."""


class LayoutError(ConfigError):
    """Two KV layouts cannot be paired (for example head-sliced reads on an NHD layout)."""


class BlockIdError(AkvError, ValueError):
    """Block ids of one request are out of range, negative, duplicated or of mismatched counts."""


class UnknownRequestError(AkvError, KeyError):
    """A request id is not known to the producer."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ProtocolError(AkvError):
    """A peer broke the control protocol (bad frame, unexpected message, wrong version)."""


class FrameError(ProtocolError):
    """A control frame is malformed, truncated or larger than allowed."""


class HandshakeError(AkvError):
    """The handshake with a remote engine failed (unreachable, timed out, refused)."""


class IncompatiblePeerError(HandshakeError):
    """The remote engine's model shape or protocol version differs; ``fields`` names the differences."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


class AuthenticationError(HandshakeError):
    """The peer did not prove knowledge of the shared secret (or we could not)."""


class BackendError(AkvError):
    """NIXL reported an error outside a transfer (registration, preparation, metadata)."""


class TransferError(AkvError):
    """A transfer failed; the request's local blocks hold undefined data."""


class PeerLostError(TransferError):
    """The remote agent went away during or before a transfer; the session will re-handshake."""


class TransferTimeout(TransferError):
    """A transfer did not complete within its deadline (for example a hung peer)."""


class ClosedError(AkvError):
    """The consumer, producer or session was closed while the operation was pending."""
