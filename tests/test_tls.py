"""TLS on the control plane: a throwaway CA made with the openssl CLI, real TCP, real NIXL."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import anyio
import pytest

import akv
from akv.errors import AuthenticationError, ConfigError, HandshakeError
from tests.conftest import decode_engine, make_spec, prefill_engine, verify
from tests.test_cli import SMALL
from tests.test_cli import akv as run_akv

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
             "-days", "1", "-subj", f"/CN={name}")  # fmt: skip
    return cert, key


def _leaf(d: Path, name: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    key, csr, cert, ext = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem", d / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}"
    )
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-out", str(cert), "-days", "1", "-extfile", str(ext))  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    ca, other = _ca(d, "ca"), _ca(d, "other-ca")
    server, client = _leaf(d, "server", ca), _leaf(d, "client", ca)
    return {
        "ca": str(ca[0]),
        "other_ca": str(other[0]),
        "server_cert": str(server[0]),
        "server_key": str(server[1]),
        "client_cert": str(client[0]),
        "client_key": str(client[1]),
    }


def server_tls(pki: dict[str, str], *, client_certs: bool = True) -> akv.TLSConfig:
    return akv.TLSConfig(pki["server_cert"], pki["server_key"], pki["ca"] if client_certs else None)


def client_tls(pki: dict[str, str]) -> akv.TLSConfig:
    return akv.TLSConfig(pki["client_cert"], pki["client_key"], pki["ca"])


@pytest.mark.anyio
async def test_pull_over_tls_with_client_certificates(pki: dict[str, str]) -> None:
    """A decode rank with a certificate the CA signed handshakes over TLS and pulls bit-exact."""
    spec = make_spec()
    async with prefill_engine(spec, 1, tls=server_tls(pki)) as engine:
        engine.fill("r", [1, 2], seed=3)
        async with decode_engine(spec, 1, tls=client_tls(pki), same_process="nixl") as (consumer,):
            session = await consumer.connect(engine.endpoint)
            await (await session.pull("r", [5, 6], [1, 2]))
            assert verify(consumer, [5, 6], 3, range(2))


@pytest.mark.anyio
async def test_untrusted_or_plaintext_clients_are_refused_and_the_server_keeps_serving(
    pki: dict[str, str],
) -> None:
    """A client verifying with another CA, a TLS client without a certificate (client
    certificates required) and a plaintext client each get a typed error at once; a good
    client connects afterwards."""
    spec = make_spec()
    async with prefill_engine(spec, 1, tls=server_tls(pki)) as engine:
        engine.fill("r", [1], seed=1)
        async with decode_engine(spec, 1, tls=akv.TLSConfig(ca=pki["other_ca"]), retries=0) as (c,):
            with pytest.raises(AuthenticationError, match="does not verify"):
                await c.connect(engine.endpoint)
        async with decode_engine(spec, 1, tls=akv.TLSConfig(ca=pki["ca"]), retries=0) as (c,):
            with pytest.raises(HandshakeError, match="client certificate"):
                await c.connect(engine.endpoint)
        async with decode_engine(spec, 1, retries=0, handshake_timeout=30) as (c,):
            with pytest.raises(HandshakeError, match="plaintext client"), anyio.fail_after(5):
                await c.connect(engine.endpoint)
        assert engine.server.metrics.counters["auth_failures"] >= 2
        async with decode_engine(spec, 1, tls=client_tls(pki), same_process="nixl") as (c,):
            await (await (await c.connect(engine.endpoint)).pull("r", [3], [1]))
            assert verify(c, [3], 1, range(1))


@pytest.mark.anyio
async def test_tls_client_against_a_plaintext_server_is_refused(pki: dict[str, str]) -> None:
    """A decode rank configured for TLS against a plaintext server fails with a HandshakeError."""
    spec = make_spec()
    async with (
        prefill_engine(spec, 1) as engine,
        decode_engine(spec, 1, tls=client_tls(pki), retries=0) as (c,),
    ):
        with pytest.raises(HandshakeError, match="TLS"):
            await c.connect(engine.endpoint)


def test_tls_configuration_mistakes_are_config_errors(pki: dict[str, str], tmp_path: Path) -> None:
    """A certificate without its key, a client without a CA, an unreadable file: ConfigError naming it."""
    with pytest.raises(ConfigError, match="together"):
        akv.TLSConfig(cert=pki["server_cert"])
    with pytest.raises(ConfigError, match="CA"):
        akv.TLSConfig(pki["server_cert"], pki["server_key"]).client_context()
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match=r"nope\.pem"):
        akv.ControlServer(tls=akv.TLSConfig(missing, pki["server_key"]))
    with pytest.raises(ConfigError, match=r"nope\.pem"):
        akv.TLSConfig(ca=missing).client_context()


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        pytest.param(["prefill", "--tp-size", "1", "--tls-cert", "c.pem"], "--tls-key", id="cert-no-key"),
        pytest.param(["prefill", "--tp-size", "1", "--tls-ca", "{ca}"], "--tls-cert", id="serve-no-cert"),
        pytest.param(
            ["prefill", "--tp-size", "2", "--tls-cert", "{sc}", "--tls-key", "{sk}"],
            "--tls-ca",
            id="ranks-no-ca",
        ),
        pytest.param(
            [
                "decode",
                "--connect",
                "127.0.0.1:1",
                "--tp-size",
                "1",
                "--tls-cert",
                "{cc}",
                "--tls-key",
                "{ck}",
            ],
            "--tls-ca",
            id="decode-no-ca",
        ),
        pytest.param(
            ["decode", "--connect", "127.0.0.1:1", "--tp-size", "1", "--tls-ca", "missing.pem"],
            "missing.pem",
            id="decode-missing-ca",
        ),
    ],
)
def test_tls_flag_mistakes_exit_64(pki: dict[str, str], argv: list[str], names: str) -> None:
    """Each TLS flag mistake exits 64 with one line on stderr naming what to change."""
    files = {"ca": pki["ca"], "sc": pki["server_cert"], "sk": pki["server_key"]}
    files |= {"cc": pki["client_cert"], "ck": pki["client_key"]}
    proc = run_akv(*[a.format(**files) for a in argv], *SMALL)
    assert proc.returncode == 64, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and names in proc.stderr, proc.stderr


@pytest.mark.slow
def test_demo_over_tls_verifies_every_request(pki: dict[str, str]) -> None:
    """`akv demo --tls-cert --tls-key --tls-ca`: prefill ranks (registering with rank 0 over
    TLS) and decode ranks (with client certificates) in their own processes, every request
    pulled bit-exact."""
    proc = run_akv(
        "demo", "--prefill-tp", "2", "--decode-tp", "1", "--requests", "4", "--json",
        "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"], "--tls-ca", pki["ca"],
        *SMALL, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["verified"] == summary["released"] == 4, summary
