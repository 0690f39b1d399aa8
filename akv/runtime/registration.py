"""A prefill rank's presence where decode ranks look for it: its engine's bootstrap, or etcd.

Owns the keep-alive loops a [`Producer`][akv.Producer] starts: registering its control
endpoint with rank 0 (the bootstrap) now and every `REGISTER_EVERY_S`, since a restarted rank
0 forgets, and keeping its record in etcd under a lease. What the bootstrap answers goes back
through the callable the producer hands in.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskStatus

from akv.errors import AuthenticationError, ConfigError, HandshakeError, IncompatiblePeerError, RefusedError
from akv.protocol.address import Endpoint
from akv.protocol.messages import Register, Registered
from akv.runtime.client import register_rank

__all__ = ["REGISTER_EVERY_S", "keep_in_etcd", "keep_registered"]

#: Seconds between a rank's registrations with its engine's bootstrap.
REGISTER_EVERY_S = 2.0


async def keep_in_etcd(registry: Any, record: Any, *, task_status: TaskStatus[bool]) -> None:
    """Keep a rank's record registered; the registry closes after the lease is revoked on exit."""
    async with registry:
        await registry.keep_registered(record, task_status=task_status)


async def keep_registered(
    bootstrap: Endpoint,
    msg: Register,
    secret: bytes | None,
    tls: ssl.SSLContext | None,
    on_registered: Callable[[Registered], None],
    log: Any,
    *,
    task_status: TaskStatus[None],
) -> None:
    """Register ``msg`` with the bootstrap now and every REGISTER_EVERY_S; each reply goes to
    ``on_registered``.

    A refusal at start (another engine, TP size or cache) is a ConfigError; an unreachable
    bootstrap is retried in the background.
    """
    started, warned, delay = False, False, 0.1
    while True:
        try:
            reply = await register_rank(bootstrap, msg, secret=secret, tls=tls)
        except IncompatiblePeerError as exc:  # refusals are told apart by type, never by wording
            if not started:
                raise IncompatiblePeerError(
                    f"rank {msg.tp_rank}: the bootstrap at {bootstrap}: {exc}", exc.fields
                ) from None
            log.warning("the bootstrap refuses this rank", error=str(exc))
            warned = True
        except (RefusedError, AuthenticationError) as exc:
            if not started:
                raise ConfigError(f"rank {msg.tp_rank}: the bootstrap at {bootstrap}: {exc}") from None
            log.warning("the bootstrap refuses this rank", error=str(exc))
            warned = True
        except HandshakeError as exc:  # unreachable, busy, timed out: try again
            if not warned:
                log.warning("cannot register with the bootstrap; retrying", error=str(exc))
            warned = True
        else:
            on_registered(reply)
            if warned:
                log.info("registered with the bootstrap again", bootstrap=str(bootstrap))
            warned, delay = False, REGISTER_EVERY_S
        if not started:
            started = True
            task_status.started()
        await anyio.sleep(delay)
        delay = REGISTER_EVERY_S if delay >= REGISTER_EVERY_S else min(delay * 2, REGISTER_EVERY_S)
