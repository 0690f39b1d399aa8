"""What travels between the two halves of the connector and between the two instances (pure).

- ``kv_transfer_params``: the prefill instance returns them with its response (the router
  copies them verbatim into the decode request). The ``remote_*`` keys are the names vLLM's
  own routers already carry; the ``akv_*`` keys are akv's.
- [`ConnectorMeta`][akv.integrations.vllm.params.ConnectorMeta]: what the scheduler tells its
  workers each step (requests to expose, pulls to start).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from akv.errors import ConfigError

__all__ = ["ExposeJob", "PullJob", "RemoteKV", "groups_of", "strip_null"]


def strip_null(ids: Sequence[int]) -> list[int]:
    """A group's block ids without vLLM's null block (id 0: padding of skipped window blocks)."""
    return [int(b) for b in ids if b != 0]


def groups_of(block_ids: Any) -> list[list[int]]:
    """vLLM's block ids (one list, or one list per KV-cache group) as a list per group."""
    if len(block_ids) and not isinstance(block_ids[0], (list, tuple)):
        return [[int(b) for b in block_ids]]
    return [[int(b) for b in g] for g in block_ids]


@dataclass(frozen=True, slots=True)
class RemoteKV:
    """A prefill instance's KV of one request, as its ``kv_transfer_params`` name it.

    Attributes:
        address: the prefill engine's akv address (``HOST:PORT`` or ``etcd://...``).
        request_id: the request as the prefill instance exposed it.
        block_ids: its blocks, one list per KV-cache group (without null blocks).
        generation: the exposure's generation.
        num_tokens: the prompt tokens whose KV the prefill instance computed.
        block_size: the prefill instance's block size.
        lease: the lease the request was exposed with (seconds).
    """

    address: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    generation: int
    num_tokens: int
    block_size: int
    lease: float

    def to_params(self, engine_id: str, tp_size: int) -> dict[str, Any]:
        """The ``kv_transfer_params`` a prefill response carries."""
        host, _, port = self.address.rpartition(":")
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": [list(g) for g in self.block_ids],
            "remote_host": host,
            "remote_port": int(port) if port.isdigit() else None,
            "remote_num_tokens": self.num_tokens,
            "tp_size": tp_size,
            "akv_address": self.address,
            "akv_generation": self.generation,
            "akv_block_size": self.block_size,
            "akv_lease": self.lease,
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemoteKV:
        """Read them back on the decode side; [`ConfigError`][akv.errors.ConfigError] naming a
        missing or malformed key."""
        try:
            return cls(
                address=str(params["akv_address"]),
                request_id=str(params["remote_request_id"]),
                block_ids=tuple(tuple(int(b) for b in g) for g in groups_of(params["remote_block_ids"])),
                generation=int(params["akv_generation"]),
                num_tokens=int(params["remote_num_tokens"]),
                block_size=int(params["akv_block_size"]),
                lease=float(params.get("akv_lease") or 120.0),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"kv_transfer_params of a prefill instance running akv: bad or missing {exc}"
            ) from None


@dataclass(frozen=True, slots=True)
class ExposeJob:
    """Prefill workers: pin a finished request's blocks (one list per group) under ``generation``."""

    block_ids: tuple[tuple[int, ...], ...]
    generation: int


@dataclass(frozen=True, slots=True)
class PullJob:
    """Decode workers: pull ``remote`` into ``local_block_ids`` (one list per group)."""

    remote: RemoteKV
    local_block_ids: tuple[tuple[int, ...], ...]


@dataclass
class ConnectorMeta:
    """One step's orders from the scheduler to every worker (keyed by vLLM request id).

    Attributes:
        expose: requests whose prompt this step's forward pass completes: handed to akv's
            thread after the pass (on CUDA with an event it records), which exposes them as soon
            as it takes them, usually before the response naming them reaches a decode instance
            (a pull arriving first retries for ``expose_wait``).
        expose_late: requests that finished earlier without being exposed in their last step
            (more than one output token): exposed when the step starts.
        withdraw: exposed requests that did not finish normally (aborted): their lease ends
            now, so they are released as expired and vLLM frees their blocks.
        pull: pulls to start.
    """

    expose: dict[str, ExposeJob] = field(default_factory=dict)
    expose_late: dict[str, ExposeJob] = field(default_factory=dict)
    withdraw: set[str] = field(default_factory=set)
    pull: dict[str, PullJob] = field(default_factory=dict)
