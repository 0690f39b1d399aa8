"""Transfer paths: how the bytes of one pull move.

A path is chosen per request when the pull is planned (`akv.runtime.routes`); the decode
rank's poller (`akv.runtime.poller`) then drives the path's [`PathOp`][akv.runtime.paths.PathOp]
and settles the pull from what the op reports, through this protocol alone: it never asks
which path an op is on. A path never reaches back into the session or the consumer: it gets
what it needs (the backend, prepared lists, the check pool, the local ranks) when it is
built, and reports its outcome as a value.

| path | module | when |
| --- | --- | --- |
| ``"copy"`` | `akv.runtime.paths.copy` | every prefill rank the pull reads from lives in this process |
| ``"push"`` | `akv.runtime.paths.push` | a session in push mode: the prefill ranks WRITE, layer by layer |
| ``"packed"`` | `akv.runtime.paths.packed` | the prefill ranks keep packed copies (``transfer``): one READ per component and rank of the copy, then a scatter into the paged cache (`akv.runtime.paths.staging`) |
| ``"read"`` | `akv.runtime.paths.read` | otherwise: NIXL READs of the paged runs |

Every path keeps the guarantees of a pull: it reports success only if, once its bytes were
in place, every block it read was still exposed for the request (the exposure check,
`akv.runtime.paths.tables`), and `PathOp.abort` returns only when nothing it started can
still write into the pull's blocks, or hands what may still land to the backend's reaper
with the op as owner (the reaper keeps the landing slots, staging and exposure-check slots
alike, until NIXL reports each transfer finished), or, for a push, asks its writers to stop
(`PathOp.settled` is then False until each confirmed). The poller settles a failed pull
only once ``reaper.holds(op)`` is False and the op is settled, or after the consumer
destroyed the agent (see `akv.runtime.poller` and `akv.runtime.consumer`): no write lands
after control returns.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from akv.errors import AkvError

if TYPE_CHECKING:
    from akv.protocol.push import PushNotice

__all__ = ["PATHS", "Failed", "OpBase", "Outcome", "PathName", "PathOp", "Pending"]

PathName = Literal["copy", "read", "push", "packed"]
#: Every path, in the order `akv.runtime.routes` tries them.
PATHS: tuple[PathName, ...] = ("packed", "copy", "push", "read")


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
    """One pull's transfer on one path, built (and started) by `akv.runtime.routes`."""

    path: PathName

    @property
    def ranks(self) -> frozenset[int]:
        """The prefill ranks whose loss fails this op (those it still waits on)."""

    @property
    def descriptors(self) -> int | None:
        """Descriptors (byte runs) the op moved, where they are not the plan's count (a
        packed read's, a packed push's); None: the plan's."""

    @property
    def reads(self) -> bool:
        """True if the op posts READs to its ranks when it starts (they flush behind the
        notices sent to those ranks before: see `akv.runtime.poller`)."""

    @property
    def grant(self) -> int:
        """Push: the grant id its writers' notices carry (0: the op is no push)."""

    @property
    def settled(self) -> bool:
        """True once no writer can still write into the pull's blocks (always for an op
        whose transfers the reaper holds instead)."""

    @property
    def unconfirmed(self) -> Sequence[int]:
        """Push: the writers that may still write (asked to stop, not confirmed)."""

    @property
    def orphaned(self) -> bool:
        """Push: True once every writer still unconfirmed is gone (its process died: it will
        never confirm, so waiting out the grace for it is pointless)."""

    @property
    def stages(self) -> Mapping[str, float]:
        """Seconds of its stages so far, for benchmarks (``data`` and ``check`` of a read,
        ``lookup``, ``read`` and ``scatter`` of a packed read)."""

    def poll(self) -> Outcome:
        """Make progress: None when done and verified, `Pending`, or `Failed`. Never raises."""

    def take_noticed(self) -> frozenset[int]:
        """The prefill ranks the op's NIXL transfers sent the "done" notice to since the last
        call (the consumer flushes behind them: `akv.runtime.paths.tables.flush_after_notice`)."""

    def on_notice(self, agent: str, notice: PushNotice) -> bool:
        """Push: a writer's notice for its grant; False if the op does not take it (the
        poller drops and counts it)."""

    def writers_gone(self, ranks: Collection[int]) -> None:
        """Push: these prefill ranks' processes are gone (see `orphaned`)."""

    def abort(self) -> None:
        """Stop: release what the op holds. When it returns, nothing the op started can write
        into the pull's blocks, or what may still land is held by the backend's reaper, owned
        by this op (never released while NIXL still reports it running), or (a push) its
        writers were asked to stop and `settled` turns True once they confirmed."""

    def finished(self) -> None:
        """The pull was reported (its result or error is out): free what outlived it (a
        packed push's staging range)."""


class OpBase:
    """What a `PathOp` answers where its path has nothing to say: no own descriptor count,
    no READs flushing behind notices, no grant, settled, nothing noticed, no stages."""

    __slots__ = ()

    path: PathName
    reads = False
    grant = 0

    @property
    def descriptors(self) -> int | None:
        return None

    @property
    def settled(self) -> bool:
        return True

    @property
    def unconfirmed(self) -> Sequence[int]:
        return ()

    @property
    def orphaned(self) -> bool:
        return False

    @property
    def stages(self) -> Mapping[str, float]:
        return {}

    def take_noticed(self) -> frozenset[int]:
        return frozenset()

    def on_notice(self, agent: str, notice: PushNotice) -> bool:
        return False

    def writers_gone(self, ranks: Collection[int]) -> None:
        return None

    def finished(self) -> None:
        return None
