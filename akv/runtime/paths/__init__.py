"""Transfer paths: how the bytes of one pull move.

A path is chosen per request by the session when it plans the pull; the decode rank's
poller (`akv.runtime.poller`) then drives the path's [`PathOp`][akv.runtime.paths.PathOp]
and settles the pull from what the op reports. A path never reaches back into the session or the
consumer: it gets what it needs (the backend, prepared lists, the check pool, the local
ranks) when it is launched, and reports its outcome as a value.

| path | module | when |
| --- | --- | --- |
| ``"copy"`` | `akv.runtime.paths.copy` | every prefill rank the pull reads from lives in this process |
| ``"push"`` | `akv.runtime.paths.push` | a session in push mode: the prefill ranks WRITE, layer by layer |
| ``"packed"`` | `akv.runtime.paths.packed` | the prefill ranks keep packed copies (``transfer``): one READ per component and rank of the copy, then a scatter into the paged cache |
| ``"read"`` | `akv.runtime.paths.read` | otherwise: NIXL READs of the paged runs |

Every path keeps the guarantees of a pull: it reports success only if, once its bytes were
in place, every block it read was still exposed for the request (the exposure check), and
`PathOp.abort` returns only when nothing it started can still write into the pull's blocks,
or hands what may still land to the backend's reaper with the op as owner (the reaper keeps
the landing slots, staging and exposure-check slots alike, until NIXL reports each transfer
finished). The poller settles a failed pull only once ``reaper.holds(op)`` is False, or
after the consumer destroyed the agent (see `akv.runtime.poller` and `akv.runtime.consumer`):
no write lands after control returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from akv import exposure
from akv.errors import AkvError, UnsafeReadError

__all__ = ["PATHS", "Failed", "PathName", "PathOp", "Pending", "unsafe"]

PathName = Literal["copy", "read", "push", "packed"]
#: Every path, in order of preference.
PATHS: tuple[PathName, ...] = ("copy", "push", "packed", "read")


@dataclass(frozen=True, slots=True)
class Pending:
    """Still running; ``changed`` says whether anything progressed in this poll."""

    changed: bool = False


@dataclass(frozen=True, slots=True)
class Failed:
    """The op failed; ``rank`` names the prefill rank at fault (None: not one rank's).
    ``notify``: prefill ranks to send the "done" notice anyway (the reader is finished with
    their blocks, as a read's notice riding on its check read would tell them)."""

    error: AkvError
    rank: int | None = None
    notify: tuple[int, ...] = ()


#: A poll's answer: ``None`` once every byte is in place and verified, else `Pending` or `Failed`.
Outcome = Pending | Failed | None


def unsafe(
    buckets: Iterable[tuple[int, npt.NDArray[Any] | tuple[int, int, int] | None]],
    request_id: str,
    remote_ids: npt.NDArray[np.int32],
    read_ids: npt.NDArray[np.int32],
    generation: int | Mapping[int, int],
    packed: bool = False,
    token_hash: int | None = None,
    fingerprint: int | None = None,
) -> UnsafeReadError | None:
    """The exposure check of a pull over the buckets read from each prefill rank (``(rank,
    bucket)`` pairs, read once its bytes were in place; a bucket in shared memory is given as
    the request's slot, `akv.exposure.shared_slot`'s answer): None if every one still holds the
    request's exposure, else the first typed error. ``generation``: one for every rank, or
    per rank (a packed read binds to each rank's own); ``packed``, ``token_hash`` and
    ``fingerprint``: see `akv.exposure.verify`."""
    for rank, bucket in buckets:
        gen = generation if isinstance(generation, int) else generation.get(rank, 0)
        error = exposure.verify(
            bucket,
            request_id,
            remote_ids,
            prefill_rank=rank,
            read_ids=read_ids,
            generation=gen,
            packed=packed,
            token_hash=token_hash,
            fingerprint=fingerprint,
        )
        if error is not None:
            return error
    return None


class PathOp(Protocol):
    """One pull's transfer on one path, launched already."""

    path: PathName

    @property
    def ranks(self) -> frozenset[int]:
        """The prefill ranks whose loss fails this op (those it still waits on)."""

    def poll(self) -> Outcome:
        """Make progress: None when done and verified, `Pending`, or `Failed`. Never raises."""

    def take_notified(self) -> frozenset[int]:
        """The prefill ranks the op's NIXL transfers sent the "done" notice to since the last
        call (the consumer flushes behind them: `akv.runtime.paths.read.flush_after_notice`)."""

    def abort(self) -> None:
        """Stop: release what the op holds. When it returns, nothing the op started can write
        into the pull's blocks, or what may still land is held by the backend's reaper, owned
        by this op (never released while NIXL still reports it running)."""
