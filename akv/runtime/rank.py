"""What a Producer and a Consumer share: one TP rank's validated KV cache, its NIXL agent,
and the task group that runs its poller, entered and left through one exit stack; and
`DecodeRank`, what a decode rank's sessions may read of it."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from akv._log import get_logger
from akv._poll import Backoff
from akv.errors import AkvError, ClosedError, ConfigError
from akv.geometry.cache import CacheSpec, as_cache
from akv.geometry.spec import KVSpec
from akv.metrics import Metrics

if sys.version_info < (3, 11):  # pragma: no cover - anyio brings the backport
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    import ssl

    import numpy as np
    import numpy.typing as npt
    import torch

    from akv.backends import Backend
    from akv.packing import CacheViews
    from akv.plan import RankMemory
    from akv.runtime.paths.staging import StagingPool
    from akv.runtime.paths.tables import SlotPool

__all__ = ["DecodeRank", "RankBase", "default_engine_id"]

_PROCESS_TAG = uuid.uuid4().hex[:8]


def default_engine_id(role: str) -> str:
    """An engine id unique to this process (the same for every rank it runs)."""
    return f"{role}-{_PROCESS_TAG}"


class RankBase:
    """Validation, agent and poller lifetime common to both sides (not public).

    Subclasses implement `_enter` (start what they need on the exit stack) and
    `_teardown` (synchronous, after the tasks stopped and before the agent closes, so
    cancellation cannot interrupt it). Leaving the context forwards the body's exception to
    the task group; whatever was entered is closed, in reverse order, even if a step fails.
    """

    _role = "r"  # agent-name tag: "p" for prefill ranks, "d" for decode ranks

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        spec: KVSpec | CacheSpec,
        *,
        tp_rank: int,
        tp_size: int,
        engine_id: str,
        backend: Backend | None,
        progress_thread: bool,
        spin_s: float,
        poll_max_s: float,
        nixl_threads: int = 0,
    ) -> None:
        from akv.geometry.tensors import check_kv_cache

        cache = as_cache(spec)
        cache.validate()
        cache.check_rank(tp_rank, tp_size)
        check_kv_cache(kv_caches, cache, tp_rank, tp_size)
        self.kv_caches = list(kv_caches)
        self.spec = spec  # as given
        self.cache: CacheSpec = cache  # a KVSpec as its one-group CacheSpec
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.engine_id = engine_id
        self.metrics = Metrics()
        self.closed = False
        self._log = get_logger(type(self).__module__).bind(engine=engine_id, rank=tp_rank)
        self._backend = backend
        self._own_backend = False  # True once this rank created its agent (it may then replace it)
        self._progress_thread = progress_thread
        if nixl_threads < 0:
            raise ConfigError(f"nixl_threads must be >= 0, got {nixl_threads}")
        self._nixl_threads = nixl_threads
        self._backoff = Backoff(spin_s=spin_s, max_sleep_s=poll_max_s)
        self._tg: TaskGroup | None = None
        self._stack: AsyncExitStack | None = None

    @property
    def backend(self) -> Backend:
        """The transport backend (valid inside the context manager)."""
        if self._backend is None or self._backend.closed:
            raise ClosedError(f"the {type(self).__name__.lower()} is not running")
        return self._backend

    @property
    def running(self) -> bool:
        """True between entering and leaving the context."""
        return self._tg is not None and not self.closed

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> bool:
        """Run ``fn(*args)`` as a task of this rank (cancelled when the rank closes); False,
        and nothing started, once it is not running."""
        if self._tg is None or self.closed:
            return False
        self._tg.start_soon(fn, *args)
        return True

    async def __aenter__(self) -> Any:
        if self._stack is not None or self.closed:
            raise ClosedError(f"a {type(self).__name__} can be entered once")
        try:
            await self._open()
        except BaseExceptionGroup as group:
            leaves = _leaves(group)
            if len(leaves) == 1 and isinstance(leaves[0], AkvError):
                raise leaves[0] from None  # a start-up error, as is (not wrapped by the task group)
            raise
        return self

    async def _open(self) -> None:
        async with AsyncExitStack() as stack:  # unwinds whatever started if a step fails
            if self._backend is None:
                self._own_backend = True
                self._backend = await anyio.to_thread.run_sync(self._new_backend)
            backend = self._backend
            stack.callback(self._close_backend)  # the one in use then (a consumer may replace it)
            stack.callback(self._close)
            await anyio.to_thread.run_sync(backend.register, self.kv_caches)
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)  # runs first on exit: stop the pollers
            self._tg = tg
            await self._enter(stack, tg)
            self._stack = stack.pop_all()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        stack, self._stack = self._stack, None
        if stack is None:
            return None
        try:
            return await stack.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # The task group wraps the body's own exception: give it back to the caller as is.
            if exc is not None and _only(group, exc):
                raise exc from None
            raise

    def _new_backend(self) -> Backend:
        """A fresh NIXL agent for this rank, with a name of its own (*blocking*)."""
        from akv.backends import mem_type
        from akv.backends.nixl import NixlBackend

        name = f"{self.engine_id}-{self._role}{self.tp_rank}-{uuid.uuid4().hex[:8]}"
        kind, index = mem_type(self.kv_caches)
        return NixlBackend(
            name,
            progress_thread=self._progress_thread,
            cuda_device=index if kind == "VRAM" else None,
            num_threads=self._nixl_threads,
        )

    def _close_backend(self) -> None:
        if self._backend is not None:
            self._backend.close()

    def _close(self) -> None:
        self.closed = True
        self._tg = None
        self._teardown()

    async def _enter(self, stack: AsyncExitStack, tg: TaskGroup) -> None:
        """Start the subclass's tasks and resources."""
        raise NotImplementedError

    def _teardown(self) -> None:
        """Release what the subclass holds (tasks are stopped, the agent still open)."""


class DecodeRank(Protocol):
    """What a session reads of the decode rank it belongs to (a [`Consumer`][akv.Consumer]
    is one): its settings, its agent and what is registered with it. Sessions read these and
    ask for two resources (`local_dlist`, `enable_packing`); they never report to it."""

    @property
    def engine_id(self) -> str: ...

    @property
    def tp_rank(self) -> int: ...

    @property
    def tp_size(self) -> int: ...

    @property
    def cache(self) -> CacheSpec: ...

    @property
    def kv_caches(self) -> list[torch.Tensor]: ...

    @property
    def mode(self) -> str: ...

    @property
    def transfer(self) -> str: ...

    @property
    def same_process(self) -> str: ...

    @property
    def verify_exposure(self) -> bool: ...

    @property
    def secret(self) -> bytes | None: ...

    @property
    def connect_timeout(self) -> float: ...

    @property
    def handshake_timeout(self) -> float: ...

    @property
    def transfer_timeout(self) -> float: ...

    @property
    def retries(self) -> int: ...

    @property
    def tls_context(self) -> ssl.SSLContext | None: ...

    @property
    def copy_inline_bytes(self) -> int: ...

    @property
    def copy_with(self) -> str: ...

    @property
    def check_with(self) -> str: ...

    @property
    def pack_threshold(self) -> int: ...

    @property
    def pack_run_bytes(self) -> int: ...

    @property
    def memory(self) -> RankMemory: ...

    @property
    def mem_type(self) -> str: ...

    @property
    def agent_epoch(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def checks(self) -> SlotPool: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def staging(self) -> StagingPool | None: ...

    @property
    def directories(self) -> SlotPool | None: ...

    @property
    def pack_views(self) -> CacheViews: ...

    @property
    def backend(self) -> Backend: ...

    @property
    def backend_or_none(self) -> Backend | None: ...

    @property
    def agent_metadata(self) -> bytes: ...

    def local_dlist(self, key: Any, table: npt.NDArray[np.int64]) -> Any:
        """The prepared local list of a plan table (shared by every session)."""

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> bool:
        """Run ``fn(*args)`` as a task of the rank; False once it is not running."""

    async def enable_packing(self) -> None:
        """Set up the staging area of packed reads (once)."""


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions in a (nested) group."""
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def _only(group: BaseExceptionGroup[BaseException], exc: BaseException) -> bool:
    """True if every leaf of ``group`` is ``exc`` itself."""
    return all(_only(e, exc) if isinstance(e, BaseExceptionGroup) else e is exc for e in group.exceptions)
