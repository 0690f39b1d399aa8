"""One pull as its caller sees it: the request, the awaitable `Transfer`, its result.

Owns the values that travel between a [`TransferSession`][akv.TransferSession] (which
launches a pull), the consumer's poller (`akv.runtime.poller`, which drives and settles it)
and the caller (who awaits it), and `PullOwner`, the small interface through which the
poller reaches the session a pull belongs to. Imports neither of them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec
import numpy as np
import numpy.typing as npt

from akv.errors import AkvError, TransferCancelledError, TransferError
from akv.runtime.paths import PathName, PathOp
from akv.tracker import Stage, TransferState

if TYPE_CHECKING:
    from akv.plan import Prepared
    from akv.runtime.paths.tables import RemoteTable

__all__ = ["PullOwner", "PullRequest", "Transfer", "TransferResult"]


class PullOwner(Protocol):
    """What the poller needs of the session a pull belongs to: where its notices go and how a
    failure marks its links. A [`TransferSession`][akv.TransferSession] is one."""

    @property
    def endpoint(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def mark_broken(self, error: AkvError, rank: int | None) -> None:
        """A read from ``rank`` failed with ``error``: the next pull needing it may re-link."""

    def notify(self, ranks: Sequence[int], notice: bytes) -> list[int]:
        """Send ``notice`` to these prefill ranks; returns those it reached over NIXL."""

    def extend(self, request_ids: Sequence[str]) -> list[int]:
        """Renew the leases of these requests on every prefill rank notified; returns the
        ranks reached over NIXL."""

    def invalidate(self, ranks: Sequence[int]) -> None:
        """Forget these prefill ranks' agents (push writers that never confirmed a stop)."""

    def flush_check(self, rank: int) -> RemoteTable | None:
        """The exposure table of ``rank`` to flush notices behind, None if there is none
        to flush (the rank is not linked, or broken, or the session pushes)."""


class PullRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What to pull: the prefill engine's block ids of a request, and where they go locally.

    Block ids are a flat list for a one-group cache, else a mapping ``{group name: ids}``
    (see [`CacheSpec`][akv.CacheSpec]). Each list names the *last* blocks of the sequence.

    Attributes:
        request_id: the request, as the prefill engine exposed it.
        local_block_ids: this decode rank's blocks to fill. With fewer local than remote
            blocks (a partial prefix hit), only the tokens of the local blocks are read, into
            the local blocks in order; each group applies its own hit. State groups: the slot.
        remote_block_ids: the request's whole exposure on the prefill engine, always, as it
            announced it after ``expose()``: the pull checks, after its reads, that the
            request is still exposed with exactly these blocks on each prefill rank it read.
        num_tokens: the request's tokens (> 0). Default: every listed block is full and read
            whole. Give it when the last block is partly filled and the engines' block sizes
            differ, and for sliding-window groups to read only the window's blocks.
        lease_s: the lease the request was exposed with (``RequestInfo.lease_s``, the
            ``lease`` given to ``expose``): while the pull runs, the consumer renews it every
            third of it. Default: the prefill engine's default lease.
        generation: the exposure's generation (``RequestInfo.generation``, what ``expose``
            returned; with several prefill ranks, one the engine passed to every rank's
            ``expose``): the pull is bound to that exposure and fails with
            [`ReexposedError`][akv.errors.ReexposedError] if the request was released and
            exposed again before its reads completed. 0: not bound to a generation.
    """

    request_id: str
    local_block_ids: Sequence[int] | npt.NDArray[np.integer[Any]] | Mapping[str, Sequence[int]]
    remote_block_ids: Sequence[int] | npt.NDArray[np.integer[Any]] | Mapping[str, Sequence[int]]
    num_tokens: int | None = None
    lease_s: float | None = None
    generation: int = 0


class TransferResult(msgspec.Struct, frozen=True):
    """A completed pull.

    Attributes:
        request_id: the request.
        bytes: data bytes moved into this rank's cache.
        descriptors: byte runs moved: descriptors submitted to NIXL on the read path, runs
            copied on the copy path (the same count for the same request), descriptors of the
            packed copies read on the packed path or written by a packed push.
        reads: prefill ranks read from (one read, or one copy, each).
        seconds: wall time from launch to completion.
        path: how the bytes moved: ``"copy"`` (torch, the prefill ranks live in this
            process), ``"read"`` (NIXL READs), ``"packed"`` (NIXL READs of the prefill
            ranks' packed copies, then a scatter into the paged cache) or ``"push"`` (the
            prefill ranks WRITE: the paged blocks, or with ``transfer`` packed their packed
            copies into this rank's staging area, then a scatter).
    """

    request_id: str
    bytes: int
    descriptors: int
    reads: int
    seconds: float
    path: str = "read"


class Transfer:
    """The awaitable completion of one pull.

    ``await transfer`` returns a [`TransferResult`][akv.TransferResult] or raises a [`TransferError`][akv.errors.TransferError]
    (an [`UnsafeReadError`][akv.errors.UnsafeReadError] if the blocks were not exposed for the request when the
    reads completed). Cancelling the awaiting task only stops the wait: the reads run to
    completion (or fail) under the consumer's poller, which releases every NIXL handle.
    """

    def __init__(
        self,
        session: PullOwner,
        request_id: str,
        prepared: Prepared,
        notice: bytes,
        state: TransferState,
        op: PathOp,
        notify: tuple[int, ...],
        fail: Callable[[Transfer, AkvError], None],
    ) -> None:
        self.session = session  # the session that launched it
        self._fail = fail  # the poller's: stops it and settles it once nothing can land
        self.request_id = request_id
        self.prepared = prepared
        self.notice = notice  # the "done" notice
        self.state = state
        self.op = op  # the transfer on its path
        self.notify = notify  # prefill ranks notified once it is done (a read's carry their notice)
        self.generation = 0  # the exposure generation the pull is bound to (0: none)
        self.noticed = False  # its reads' "done" notice went out (it may still scatter)
        self._event: anyio.Event | None = None  # created only if someone waits unfinished
        self._result: TransferResult | None = None
        self._error: AkvError | None = None

    @property
    def started(self) -> float:
        """``time.monotonic()`` when the pull was launched."""
        return self.state.started

    @property
    def bytes(self) -> int:
        """Data bytes this pull moves."""
        return self.prepared.bytes

    @property
    def path(self) -> PathName:
        """The transfer path moving its bytes: ``"copy"``, ``"read"``, ``"packed"`` or ``"push"``."""
        return self.op.path

    async def cancel(self) -> None:
        """Stop the pull; returns once nothing it started can still write into its blocks
        (push mode: every writer confirmed it stopped, or its agent was removed). Then
        ``await transfer`` raises [`TransferCancelledError`][akv.errors.TransferCancelledError]
        (unless it had settled already)."""
        if not self.done() and not self.state.finished:
            self._fail(self, TransferCancelledError(f"transfer {self.request_id!r} was cancelled"))
        with contextlib.suppress(AkvError):
            await self.wait()

    def done(self) -> bool:
        """True once the transfer completed or failed."""
        return self._result is not None or self._error is not None

    def result(self) -> TransferResult:
        """The result; raises the transfer's error, or [`TransferError`][akv.errors.TransferError] if not done yet."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise TransferError(f"transfer {self.request_id!r} is still running")
        return self._result

    def exception(self) -> AkvError | None:
        """The error the transfer failed with, if any."""
        return self._error

    async def wait(self) -> TransferResult:
        """Wait for completion; same as ``await transfer``."""
        if not self.done():
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        return self.result()

    def __await__(self) -> Generator[Any, None, TransferResult]:
        # `wait` without its coroutine: most pulls are done by the time they are awaited
        if not self.done():
            if self._event is None:
                self._event = anyio.Event()
            yield from self._event.wait().__await__()
        return self.result()

    def finish(self, error: AkvError | None = None) -> TransferResult | None:
        """Settle the transfer once (the consumer's poller calls this); returns its result
        if this call settled it with success."""
        if self._result is not None or self._error is not None:
            return None
        op = self.op
        result = None
        if error is None:
            p = self.prepared
            descriptors = op.descriptors  # a packed read's own count (None: the plan's)
            result = self._result = TransferResult(
                self.request_id,
                p.bytes,
                p.descriptors if descriptors is None else descriptors,
                len(p.posts),
                time.monotonic() - self.state.started,
                op.path,
            )
            self.state.stage = Stage.DONE
        else:
            self._error = error
            self.state.stage = Stage.FAILED
        op.finished()  # a packed push frees its staging range
        if self._event is not None:
            self._event.set()
        return result

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "running"
        return f"<Transfer {self.request_id!r} {state}>"
