"""What the prefill side of push mode holds (`akv.runtime.pusher`): the decode ranks it
writes for (their agents, plans and prepared lists), the grants they announced and how far
each got, and what it reads of its own rank (`PushRank`).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from akv.backends import DlistHandle, XferHandle
from akv.plan import TransferPlan
from akv.protocol.messages import Hello
from akv.protocol.push import PushNotice

if TYPE_CHECKING:
    import torch

    from akv.backends import Backend
    from akv.geometry.cache import CacheSpec
    from akv.ledger import ReleaseLedger
    from akv.metrics import Metrics

__all__ = ["GrantState", "PackedCopy", "PushRank"]


class GrantState(enum.Enum):
    """Where a grant is: waiting for its request (exposed, or its packed copy gathered),
    writing, ending (its answer goes out once none of its WRITEs can land), done."""

    WAITING = "waiting"
    WRITING = "writing"
    ENDING = "ending"
    DONE = "done"


class PushRank(Protocol):
    """What a `Pusher` reads of the prefill rank it writes for (a [`Producer`][akv.Producer]
    is one): its agent, cache, ledger and lease. The pusher never calls back into it; releases
    go out through the ``deliver`` callable it is handed."""

    @property
    def backend(self) -> Backend: ...
    @property
    def cache(self) -> CacheSpec: ...
    @property
    def kv_caches(self) -> list[torch.Tensor]: ...
    @property
    def ledger(self) -> ReleaseLedger: ...
    @property
    def lease_s(self) -> float: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    def packed_copy(self, request_id: str) -> PackedCopy | Literal["pending"] | None: ...


@dataclass(frozen=True, slots=True)
class PackedCopy:
    """Where a prefill rank's packed copy of a request is (registered memory)."""

    addr: int
    nbytes: int
    generation: int
    mem_type: str
    device_id: int


@dataclass(eq=False)
class _Target:
    """A decode rank pushed to: its agent, plan and the lists prepared for it."""

    agent: str
    hello: Hello
    plan: TransferPlan | None = None
    lists: dict[tuple[str, Any], DlistHandle] = field(default_factory=dict)

    @property
    def identity(self) -> tuple[str, int, int]:
        return self.hello.engine_id, self.hello.tp_rank, self.hello.tp_size


@dataclass(eq=False)
class _Grant:
    """One announcement: what to write where, and how far it got."""

    target: _Target
    notice: PushNotice
    received: float
    state: GrantState = GrantState.WAITING
    generation: int = 0  # the exposure it writes (known once started)
    digest: int = 0
    local: DlistHandle = None
    remote: DlistHandle = None
    ri: npt.NDArray[np.int32] | None = None  # this rank's descriptors
    li: npt.NDArray[np.int32] | None = None  # the decode rank's
    layers: npt.NDArray[np.int64] | None = None  # last model layer of each descriptor
    sent: npt.NDArray[np.bool_] | None = None
    pending: dict[XferHandle, None] = field(default_factory=dict)  # WRITEs in flight
    reaping: int = 0  # handles handed to the reaper, not released yet
    answer: PushNotice | None = None  # what to send once nothing can land ("stopped"/"failed")
    packed: bool = False  # writes the packed copy into the decode rank's staging area
    run_bytes: int = 0  # the mean descriptor of its WRITEs (how a long one is sliced)
    more: bool = False  # ready descriptors left for the next slice
    rows: deque[Any] = field(default_factory=deque)  # a packed push's slices not posted yet
    mem: tuple[str, str] = ("DRAM", "DRAM")  # a packed push's memory types, both sides

    @property
    def key(self) -> tuple[str, int]:
        return self.target.agent, self.notice.grant
