"""The akv exception hierarchy: every error akv raises derives from [`AkvError`][akv.errors.AkvError]."""

from __future__ import annotations

__all__ = [
    "AkvError",
    "AuthenticationError",
    "BackPressureError",
    "BackendError",
    "BlockIdError",
    "ClosedError",
    "ConfigError",
    "DiscoveryError",
    "EngineChangedError",
    "EtcdUnavailableError",
    "FrameError",
    "HandshakeError",
    "IncompatiblePeerError",
    "LayoutError",
    "LeaseExpiredError",
    "MissingRanksError",
    "NotExposedError",
    "OutsideExposureError",
    "PeerLostError",
    "ProtocolError",
    "ReexposedError",
    "RefusedError",
    "ReleasedError",
    "ServerBusyError",
    "TransferCancelledError",
    "TransferError",
    "TransferTimeout",
    "UnknownRequestError",
    "UnsafeReadError",
    "VersionMismatchError",
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


class VersionMismatchError(ProtocolError):
    """The peer speaks another akv protocol version; run the same akv release on both engines."""


class HandshakeError(AkvError):
    """The handshake with a remote engine failed (unreachable, timed out, refused)."""


class IncompatiblePeerError(HandshakeError):
    """The remote engine's model shape or protocol version differs; ``fields`` names the differences."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


class AuthenticationError(HandshakeError):
    """The peer did not prove knowledge of the shared secret (or we could not)."""


class RefusedError(HandshakeError):
    """The remote engine answered with a refusal (another engine, a registration it will not
    take, a rank it does not serve...): trying again will not help."""


class ServerBusyError(HandshakeError):
    """The remote control server has no room for another connection now (retried within the
    connect timeout before it is raised)."""


class EngineChangedError(HandshakeError):
    """A session re-linking to its engine found another engine (another engine id) at the
    same address: its metadata is not adopted (``field`` names what differs, ``engine_id``);
    connect again for a session to the new engine. A new incarnation of the same engine (a
    restarted one) is no such error: the session links it by itself."""

    def __init__(self, message: str, field: str = "engine_id") -> None:
        super().__init__(message)
        self.field = field


class DiscoveryError(HandshakeError):
    """The ranks of a remote engine could not be found (etcd discovery)."""


class EtcdUnavailableError(DiscoveryError):
    """No etcd endpoint answered after bounded retries; ``endpoints`` names those tried."""

    def __init__(self, message: str, endpoints: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.endpoints = endpoints


class MissingRanksError(DiscoveryError, TimeoutError):
    """Some ranks of an engine were not registered in etcd before the timeout; ``missing`` names them."""

    def __init__(self, message: str, *, engine_id: str = "", missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.engine_id = engine_id
        self.missing = missing


class BackendError(AkvError):
    """NIXL reported an error outside a transfer (registration, preparation, metadata)."""


class TransferError(AkvError):
    """A transfer failed; the request's local blocks hold undefined data."""


class PeerLostError(TransferError):
    """The remote agent went away during or before a transfer; the session will re-handshake."""


class BackPressureError(TransferError):
    """A local resource of the consumer ran out for this pull (every exposure-check slot is in
    use): only this pull failed, the links to the prefill engine are fine; pull again later,
    or raise ``max_checks``."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not complete within its deadline (for example a hung peer)."""


class TransferCancelledError(TransferError):
    """The pull was cancelled ([`Transfer.cancel`][akv.Transfer.cancel]); its blocks hold undefined data."""


class UnsafeReadError(TransferError):
    """The reads completed, but the remote blocks were not (all) exposed for this request when
    they did: the bytes may belong to another request, so the pull is not a success.

    ``prefill_rank`` names the rank whose blocks failed the check and ``block_ids`` the
    remote block ids concerned.
    """

    def __init__(self, message: str, *, prefill_rank: int = -1, block_ids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.prefill_rank = prefill_rank
        self.block_ids = block_ids


class NotExposedError(UnsafeReadError):
    """None of the blocks read is exposed for this request (never exposed there, or other blocks)."""


class OutsideExposureError(UnsafeReadError):
    """Some blocks read are exposed for this request and others are not: block ids outside its exposure."""


class LeaseExpiredError(UnsafeReadError):
    """The request's lease ran out and its blocks were released before the reads completed."""


class ReexposedError(UnsafeReadError):
    """The request was released and exposed again (another generation) since the pull
    started: the bytes read may belong to the new exposure."""


class ReleasedError(UnsafeReadError):
    """The request was released (read by every reader, or the producer closed) before the reads completed."""


class ClosedError(AkvError):
    """The consumer, producer or session was closed while the operation was pending."""
