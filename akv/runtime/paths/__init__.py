"""Transfer paths: how the bytes of one pull move.

A path is chosen per request by the session when it plans the pull; the session then drives
the path's [`PathOp`][akv.runtime.paths.PathOp] (through the consumer's poller) and settles
the pull from what the op reports. A path never reaches back into the session or the
consumer: it gets what it needs (the backend, prepared lists, the check pool, the local
ranks) when it is launched, and reports its outcome as a value.

| path | module | when |
| --- | --- | --- |
| ``"copy"`` | `akv.runtime.paths.copy` | every prefill rank the pull reads from lives in this process |
| ``"read"`` | `akv.runtime.paths.read` | otherwise: NIXL READs of the paged runs |

Every path keeps the guarantees of a pull: it reports success only if, once its bytes were
in place, every block it read was still exposed for the request (the exposure check), and
`PathOp.abort` returns only when nothing it started can still write into the pull's blocks
(or hands what may still land to the backend's reaper, which keeps the landing slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from akv.errors import AkvError

__all__ = ["PATHS", "Failed", "PathName", "PathOp", "Pending"]

PathName = Literal["copy", "read"]
#: Every path, in order of preference.
PATHS: tuple[PathName, ...] = ("copy", "read")


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


class PathOp(Protocol):
    """One pull's transfer on one path, launched already."""

    path: PathName

    @property
    def ranks(self) -> frozenset[int]:
        """The prefill ranks whose loss fails this op (those it still waits on)."""

    def poll(self) -> Outcome:
        """Make progress: None when done and verified, `Pending`, or `Failed`. Never raises."""

    def abort(self) -> None:
        """Stop: release what the op holds. When it returns, nothing the op started can write
        into the pull's blocks, or what may still land is held by the backend's reaper."""
