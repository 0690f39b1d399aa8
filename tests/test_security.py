"""Security rules: loopback by default, no non-loopback bind without a secret, nothing secret logged."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import akv
from tests.conftest import decode_engine, make_spec, prefill_engine

pytestmark = pytest.mark.anyio


def test_non_loopback_bind_needs_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Binding a non-loopback address without a secret is refused unless explicitly insecure."""
    monkeypatch.delenv("AKV_SECRET", raising=False)
    with pytest.raises(akv.ConfigError, match="AKV_SECRET"):
        akv.ControlServer(host="0.0.0.0")
    assert akv.ControlServer(host="0.0.0.0", secret="x").secret == b"x"
    assert akv.ControlServer(host="0.0.0.0", allow_insecure=True).secret is None
    monkeypatch.setenv("AKV_SECRET", "from-env")
    assert akv.ControlServer(host="0.0.0.0").secret == b"from-env"
    assert akv.ControlServer().host == "127.0.0.1"


def test_cli_refuses_insecure_bind() -> None:
    """`akv prefill --host 0.0.0.0` without a secret exits 64 with a message saying what to do."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "akv",
            "prefill",
            "--tp-size",
            "1",
            "--kv-heads",
            "2",
            "--host",
            "0.0.0.0",
            "--requests",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in __import__("os").environ.items() if k != "AKV_SECRET"},
    )
    assert proc.returncode == 64
    assert "AKV_SECRET" in proc.stderr and "allow-insecure" in proc.stderr.replace("_", "-")


async def test_secrets_and_metadata_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    """At DEBUG, a full authenticated handshake and pull log neither the secret nor agent metadata."""
    caplog.set_level(logging.DEBUG, logger="akv")
    spec = make_spec()
    async with prefill_engine(spec, 1, secret="hunter2-secret") as engine:
        metadata = engine.producers[0].rank_info().agent_metadata
        engine.fill("r", [1], seed=1)
        async with decode_engine(spec, 1, secret="hunter2-secret") as (consumer,):
            session = await consumer.connect(engine.endpoint)
            await (await session.pull("r", [2], [1]))
        async with decode_engine(spec, 1, secret="wrong-secret", retries=0) as (consumer,):
            with pytest.raises(akv.AuthenticationError):
                await consumer.connect(engine.endpoint)
    text = "\n".join(str(r.msg) + repr(r.args) for r in caplog.records)
    assert caplog.records, "expected some akv log records at DEBUG"
    assert "hunter2" not in text and "wrong-secret" not in text
    assert metadata[:32].hex() not in text and repr(metadata[:32]) not in text
