"""Prefill ranks living in this process, for the same-process copy path.

A `Producer` publishes its rank here while it runs, and its handshake says which process it
lives in (`PROCESS_TOKEN`, random per process). A decode rank whose handshake names this
process, and whose named agent is published here with the very region and exposure-table
addresses the handshake announced, copies from that rank's tensors instead of reading
through NIXL.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

    from akv.protocol.messages import RankInfo

__all__ = ["PROCESS_TOKEN", "LocalRank", "alive", "find", "publish", "withdraw"]

#: Names this process in handshakes (random, so no other process can claim to be this one).
PROCESS_TOKEN = secrets.token_hex(16)

_lock = threading.Lock()
_ranks: dict[str, LocalRank] = {}


@dataclass(frozen=True, eq=False)
class LocalRank:
    """A prefill rank of this process: its KV regions and its exposure table."""

    agent_name: str
    tensors: tuple[torch.Tensor, ...]
    table: npt.NDArray[np.int64]  # (buckets, SLOTS, SLOT_WORDS)
    deliver: Callable[[str, bytes], None]  # a notice from a decode agent of this process

    @property
    def buckets(self) -> int:
        """Buckets of the exposure table."""
        return int(self.table.shape[0])


def publish(
    agent_name: str,
    tensors: Sequence[torch.Tensor],
    table: npt.NDArray[np.int64],
    deliver: Callable[[str, bytes], None],
) -> None:
    """Make a running prefill rank findable by decode ranks of this process; ``deliver``
    takes the notices they send it (sender agent name, notice), without NIXL."""
    with _lock:
        _ranks[agent_name] = LocalRank(agent_name, tuple(tensors), table, deliver)


def withdraw(agent_name: str) -> None:
    """Forget a prefill rank (it is closing). Idempotent."""
    with _lock:
        _ranks.pop(agent_name, None)  # agent names carry a random suffix: never reused


def find(info: RankInfo) -> LocalRank | None:
    """The rank a handshake described, if it lives in this process (else None)."""
    if getattr(info, "process", "") != PROCESS_TOKEN:
        return None
    with _lock:
        rank = _ranks.get(info.agent_name)
    if rank is None:
        return None
    same: Any = [t.data_ptr() for t in rank.tensors] == list(info.region_addrs)
    if not same or int(rank.table.ctypes.data) != info.exposure_addr:
        return None
    return rank


def alive(rank: LocalRank) -> bool:
    """True while ``rank`` is still published (its producer runs)."""
    with _lock:
        return _ranks.get(rank.agent_name) is rank
