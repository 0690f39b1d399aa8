"""Optional TLS on the control plane (handshakes and rank registration), through anyio's TLS
streams. The data plane (NIXL) is not covered: see docs/security.md.

One [`TLSConfig`][akv.TLSConfig] serves both roles of a process: a prefill rank serves with
its certificate and key (and, given a CA, requires client certificates that CA signed); a
decode rank, or a prefill rank registering with its bootstrap, verifies the server's
certificate against the CA (and presents its own certificate when it has one).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import anyio
from anyio.abc import ByteStream
from anyio.streams.tls import TLSStream

from akv.errors import AuthenticationError, ConfigError, HandshakeError

__all__ = ["TLSConfig", "client_wrap", "server_wrap", "tls_failure"]


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """TLS for the control plane: PEM file paths.

    Attributes:
        cert: this side's certificate chain. Required to serve; optional for a client (then
            presented as a client certificate).
        key: the private key of ``cert`` (required with it).
        ca: the certificate authorities to verify the peer with. Required for a client (the
            server's certificate must name the host connected to, as an IP or DNS name). For
            a server: given, every client must present a certificate it signed.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("TLS needs a certificate and its key together (tls cert and tls key)")
        if self.cert is None and self.ca is None:
            raise ConfigError("TLS needs a certificate and key (to serve) or a CA (to verify a server)")

    def server_context(self) -> ssl.SSLContext:
        """The context a control server accepts with."""
        if self.cert is None or self.key is None:
            raise ConfigError("serving TLS needs a certificate and its key (tls cert and tls key)")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_chain(ctx)
        if self.ca is not None:
            self._load_ca(ctx)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """The context a client connects with (verifies the server's certificate and name)."""
        if self.ca is None:
            raise ConfigError(
                "connecting over TLS needs the CA that signed the server's certificate (tls ca)"
            )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_ca(ctx)
        if self.cert is not None:
            self._load_chain(ctx)
        return ctx

    def _load_chain(self, ctx: ssl.SSLContext) -> None:
        try:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load TLS certificate {self.cert} with key {self.key}: {exc}") from None

    def _load_ca(self, ctx: ssl.SSLContext) -> None:
        try:
            ctx.load_verify_locations(cafile=str(self.ca))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load TLS CA {self.ca}: {exc}") from None

    def check(self, *, serve: bool, connect: bool) -> None:
        """Build the contexts a role needs now, so mistakes show at start-up (`ConfigError`)."""
        if serve:
            self.server_context()
        if connect:
            self.client_context()


async def server_wrap(stream: ByteStream, ctx: ssl.SSLContext) -> TLSStream:
    """Run the server side of a TLS handshake on an accepted connection; a failure (a
    plaintext client, an unverified client certificate) raises
    [`AuthenticationError`][akv.errors.AuthenticationError]."""
    try:
        return await TLSStream.wrap(stream, server_side=True, ssl_context=ctx, standard_compatible=False)
    except (ssl.SSLError, anyio.BrokenResourceError, anyio.EndOfStream, OSError) as exc:
        raise AuthenticationError(f"TLS handshake with a client failed: {_why(exc)}") from None


async def client_wrap(stream: ByteStream, ctx: ssl.SSLContext, host: str, endpoint: object) -> TLSStream:
    """Run the client side of a TLS handshake, verifying the server's certificate for
    ``host``. A certificate that does not verify raises
    [`AuthenticationError`][akv.errors.AuthenticationError]; a server that does not speak TLS
    a [`HandshakeError`][akv.errors.HandshakeError]."""
    try:
        return await TLSStream.wrap(stream, hostname=host, ssl_context=ctx, standard_compatible=False)
    except ssl.SSLCertVerificationError as exc:
        raise AuthenticationError(
            f"the TLS certificate of {endpoint} does not verify against the CA: {exc.verify_message}"
        ) from None
    except (ssl.SSLError, anyio.BrokenResourceError, anyio.EndOfStream, OSError) as exc:
        raise tls_failure(exc, endpoint) from None


def tls_failure(exc: BaseException, endpoint: object) -> HandshakeError:
    """The typed error for a TLS failure talking to ``endpoint``: a refused client
    certificate is an [`AuthenticationError`][akv.errors.AuthenticationError] (TLS 1.3 reports
    it on the first read after the handshake), anything else a
    [`HandshakeError`][akv.errors.HandshakeError]."""
    if isinstance(exc, ssl.SSLError) and "CERTIFICATE" in (exc.reason or "").upper():
        return AuthenticationError(f"{endpoint} refused our TLS client certificate: {_why(exc)}")
    return HandshakeError(
        f"TLS with {endpoint} failed (does it serve TLS? does its CA accept our client certificate?): "
        f"{_why(exc)}"
    )


def _why(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    text = str(exc) or (str(cause) if cause is not None else "") or type(exc).__name__
    return text
