"""The NIXL backend: the only module that imports ``nixl``.

It registers KV tensors, prepares strided descriptor lists, posts prepped READs with
np.int32 indices, reports transfer states and moves notifications. Every NIXL exception
crosses into akv through one table (`ERROR_TABLE`) in `map_exceptions`. It holds
no policy: when to poll, retry or fail is the runtime's business. Close order: transfers,
descriptor lists, remote agents, registrations.

NIXL's Python logger writes INFO lines to stdout when imported ("Initialized NIXL agent
..."), which breaks programs that parse their own stdout. When akv first loads NIXL it moves
that handler to stderr and, unless ``NIXL_LOG_LEVEL`` is set, raises the ``nixl`` logger to
WARNING. ``NIXL_LOG_LEVEL=INFO`` (or ``DEBUG``) brings NIXL's logs back, on stderr.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar

import numpy as np
import numpy.typing as npt

from akv.backends import DlistHandle, XferHandle, XferState, mem_type
from akv.device import cuda_context
from akv.errors import AkvError, BackendError, ConfigError, PeerLostError, TransferError

if TYPE_CHECKING:
    import torch

__all__ = ["ERROR_TABLE", "SPLIT_DESCS", "NixlBackend", "map_exceptions", "nixl_version"]

_nixl_lock = threading.Lock()
_logs_moved = False


def _api() -> Any:
    global _logs_moved
    with _nixl_lock:
        from nixl import _api

        if not _logs_moved:
            _logs_moved = True
            keep_stdout_clean()
        return _api


def keep_stdout_clean() -> None:
    """Move the ``nixl`` logger's stdout handlers to stderr; WARNING unless ``NIXL_LOG_LEVEL`` is set."""
    logger = logging.getLogger("nixl")
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL") and logger.level < logging.WARNING:
        logger.setLevel(logging.WARNING)


def nixl_version() -> str:
    """The installed NIXL version, or "unknown"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        return "unknown"


#: NIXL's exception classes (by name: they live in ``nixl_cu12`` or ``nixl_cu13``) and the
#: akv error each becomes. Anything else becomes the default of the operation.
ERROR_TABLE: dict[str, type[AkvError]] = {
    "nixlRemoteDisconnectError": PeerLostError,
    "nixlNotFoundError": PeerLostError,  # the remote agent (or its memory) is gone
    "nixlCancelledError": TransferError,
    "nixlMismatchError": TransferError,
    "nixlBackendError": TransferError,
    "nixlInvalidParamError": BackendError,
    "nixlNotAllowedError": BackendError,
    "nixlNotSupportedError": BackendError,
}


#: With worker threads (``num_threads``), the fewest descriptors a transfer or each of its runs
#: has for NIXL to split it across the threads (NIXL's ``split_batch_size``; its own default,
#: 1,024, leaves a per-layer pull of a few dozen large descriptors on one thread).
SPLIT_DESCS = 8

F = TypeVar("F", bound=Callable[..., Any])
#: Agent calls that are no-ops on a closed agent (everything they would undo is gone).
_AFTER_CLOSE = frozenset({"close", "release", "release_dlist", "remove_remote"})


def on_device(method: F) -> F:
    """Run an agent call with the agent's CUDA device current in the calling thread (VRAM
    agents; a no-op for DRAM ones), whichever thread makes it."""

    @functools.wraps(method)
    def wrapper(self: NixlBackend, *args: Any, **kwargs: Any) -> Any:
        if self._agent is None and method.__name__ not in _AFTER_CLOSE:
            raise PeerLostError(f"the NIXL agent {self.name} was closed (replaced or shut down): pull again")
        if self.cuda_device is None:
            return method(self, *args, **kwargs)
        with cuda_context(self.cuda_device):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class map_exceptions:
    """Turn NIXL exceptions raised inside the block into akv errors (see `ERROR_TABLE`).

    Operations outside a transfer keep [`BackendError`][akv.errors.BackendError] whatever NIXL raised; transfer
    operations pass ``default=TransferError`` so a lost peer becomes [`PeerLostError`][akv.errors.PeerLostError].
    (A class, not a generator: it wraps every agent call of every pull, and costs a third as much.)
    """

    __slots__ = ("default", "what")

    def __init__(self, what: str, default: type[AkvError] = BackendError) -> None:
        self.what = what
        self.default = default

    def __enter__(self) -> None:
        return None

    def raise_from(self, exc: Exception) -> NoReturn:
        """Raise what the block would have raised for ``exc`` (for hot calls written as a
        plain ``try``: an akv error as it is, else its mapped error)."""
        if isinstance(exc, AkvError):
            raise exc
        raise self._mapped(exc) from exc

    def _mapped(self, exc: Exception) -> AkvError:
        cls = (
            BackendError
            if self.default is BackendError
            else ERROR_TABLE.get(type(exc).__name__, self.default)
        )
        return cls(f"{self.what}: {_describe(exc)}")

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> Literal[False]:
        if exc is None or isinstance(exc, AkvError) or not isinstance(exc, Exception):
            return False
        raise self._mapped(exc) from exc


class NixlBackend:
    """One NIXL agent (one per TP rank), implementing `akv.backends.Backend`.

    ``progress_thread`` enables UCX's own progress thread; on small machines it costs more
    than it gives, so akv progresses the agent from its poller by default. The agent is
    thread-safe (readers-writer sync), so blocking calls may run in worker threads.

    ``cuda_device``: the GPU whose VRAM this agent registers. Every call on the agent then
    runs with that device current in the calling thread (event loop or worker thread), since
    UCX may not pick cuda_ipc for a peer otherwise. ``num_threads``: the NIXL agent's worker
    threads, each with a UCX worker of its own (0: NIXL's default, none; docs/gpu.md). A
    transfer of at least `SPLIT_DESCS` descriptors is then split across them in equal runs of
    at least `SPLIT_DESCS`: over CUDA IPC each UCX worker copies on its own CUDA stream, so
    the runs' copies overlap instead of queueing on one stream per peer GPU.
    """

    def __init__(
        self,
        name: str,
        *,
        progress_thread: bool = False,
        telemetry: bool = False,
        cuda_device: int | None = None,
        num_threads: int = 0,
    ) -> None:
        if num_threads < 0:
            raise ConfigError(f"nixl_threads must be >= 0, got {num_threads}")
        self.cuda_device = cuda_device
        api = _api()
        with map_exceptions(f"cannot create NIXL agent {name!r}"), cuda_context(cuda_device):
            sync = getattr(getattr(api, "nixl_thread_sync_t", None), "NIXL_THREAD_SYNC_RW", None)
            config = api.nixl_agent_config(
                enable_prog_thread=progress_thread,
                capture_telemetry=telemetry,
                sync_mode=sync,
                backends=[] if num_threads else ["UCX"],
            )
            self._agent = api.nixl_agent(name, config)
            if num_threads:  # the UCX backend with worker threads, splitting from SPLIT_DESCS on
                self._agent.create_backend(
                    "UCX", {"num_threads": str(num_threads), "split_batch_size": str(SPLIT_DESCS)}
                )
        if "UCX" not in self._agent.backends:
            raise BackendError("the NIXL UCX backend is not available in this installation")
        self.name = name
        self._registrations: list[Any] = []
        self._dlists: set[DlistHandle] = set()  # live prepared lists (handles are ints)
        self._xfers: set[XferHandle] = set()
        self._remotes: dict[str, int] = {}  # loaded remote agent -> references (sessions' links)
        self._loaded: dict[bytes, str] = {}  # digest of the metadata loaded -> agent name
        self._closed = False
        self._strided: bool | None = None
        self._native: weakref.ref[Any] | None = None  # the destroyed agent, once closed

    @property
    def raw(self) -> Any:
        """The underlying ``nixl_agent``, for reference implementations (benchmarks)."""
        return self._agent

    mem_type = staticmethod(mem_type)

    # -- memory -------------------------------------------------------------------------

    @on_device
    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register the KV regions with NIXL, each memory range once (regions may alias one
        tensor, as vLLM's hybrid allocator shares one between layers of different groups:
        NIXL takes a range registered twice, but its deregistration then crashes)."""
        unique: dict[tuple[str, int, int], torch.Tensor] = {}
        for t in tensors:
            unique.setdefault((str(t.device), t.data_ptr(), t.numel() * t.element_size()), t)
        with map_exceptions("memory registration failed"):
            self._registrations.append(self._agent.register_memory(list(unique.values())))

    @on_device
    def register_host(self, array: npt.NDArray[Any]) -> None:
        """Register a contiguous host array as DRAM."""
        if not array.flags.c_contiguous:
            raise BackendError("a host array to register must be contiguous")
        with map_exceptions("host memory registration failed"):
            descs = [(int(array.ctypes.data), int(array.nbytes), 0, "")]
            self._registrations.append(self._agent.register_memory(descs, "DRAM"))

    @on_device
    def metadata(self) -> bytes:
        """This agent's metadata: whoever loads it can read our registered memory."""
        return bytes(self._agent.get_agent_metadata())

    @on_device
    def add_remote(self, metadata: bytes) -> str:
        """Load a remote agent's metadata; returns its agent name.

        Reference-counted: loading the same metadata again (two sessions to one engine) takes
        another reference instead of re-registering the agent, which would invalidate the
        lists the other session prepared; each add is undone by one
        [`remove_remote`][akv.backends.nixl.NixlBackend.remove_remote].
        """
        key = hashlib.sha256(metadata).digest()
        name = self._loaded.get(key)
        if name is not None and name in self._remotes:
            self._remotes[name] += 1
            return name
        with map_exceptions("cannot load remote agent metadata"):
            raw = self._agent.add_remote_agent(metadata)
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        # Other metadata under a loaded name: the agent re-registered (NIXL invalidates the old
        # lists itself); its references carry over to the new metadata.
        self._loaded = {k: v for k, v in self._loaded.items() if v != name}
        self._loaded[key] = name
        self._remotes[name] = self._remotes.get(name, 0) + 1
        return name

    @on_device
    def connect(self, name: str) -> None:
        """Set up the transport to a loaded remote agent now, not on the first transfer."""
        with map_exceptions(f"cannot connect to {name}", PeerLostError):
            self._agent.make_connection(name)

    @on_device
    def remove_remote(self, name: str) -> None:
        """Drop one reference to a remote agent; the last one forgets the agent (and
        disconnects from it). Unknown names are ignored."""
        refs = self._remotes.get(name, 0)
        if refs > 1:
            self._remotes[name] = refs - 1
        elif refs == 1:
            del self._remotes[name]
            self._loaded = {k: v for k, v in self._loaded.items() if v != name}
            with contextlib.suppress(Exception):  # already gone: nothing else to undo
                self._agent.remove_remote_agent(name)

    # -- descriptor lists ---------------------------------------------------------------

    @on_device
    def prep(self, agent: str, table: npt.NDArray[np.int64], mem_type: str) -> DlistHandle:
        """Prepare a strided ``(S, 5)`` table for ``agent`` ("" for local memory)."""
        with map_exceptions(f"preparing descriptors for {agent or 'local'} failed"):
            if self._strided is not False:
                try:
                    handle = self._agent.prep_xfer_dlist(agent, table, mem_type)
                    self._strided = True
                except TypeError:
                    self._strided = False  # an older NIXL without strided lists
            if self._strided is False:
                from akv.plan import expand_table

                handle = self._agent.prep_xfer_dlist(agent, expand_table(table), mem_type)
        self._dlists.add(handle)
        return handle

    @on_device
    def prep_expanded(self, agent: str, table: npt.NDArray[np.int64], mem_type: str) -> DlistHandle:
        """Prepare a table as one ``(addr, len, dev)`` row per descriptor (no strided form)."""
        from akv.plan import expand_table

        with map_exceptions("preparing descriptors failed"):
            handle = self._agent.prep_xfer_dlist(agent, expand_table(table), mem_type)
        self._dlists.add(handle)
        return handle

    @on_device
    def release_dlist(self, handle: DlistHandle) -> None:
        """Release a prepared list. Idempotent."""
        if handle in self._dlists:
            self._dlists.discard(handle)
            with contextlib.suppress(Exception):  # already gone: nothing else to undo
                self._agent.release_dlist_handle(handle)

    # -- transfers ----------------------------------------------------------------------

    @on_device
    def read(
        self,
        local: DlistHandle,
        local_idx: npt.NDArray[np.int32],
        remote: DlistHandle,
        remote_idx: npt.NDArray[np.int32],
        notif: bytes,
        *,
        merge: bool = True,
    ) -> XferHandle:
        """Create and post a READ; the target gets ``notif`` (if any) once the read is DONE and polled.

        ``merge=False`` keeps NIXL from merging contiguous descriptors (for comparisons).
        A list released meanwhile (its peer was re-linked) is a PeerLostError, never handed to
        NIXL (which would read freed memory).
        """
        return self._post("READ", local, local_idx, remote, remote_idx, notif, merge)

    @on_device
    def write(
        self,
        local: DlistHandle,
        local_idx: npt.NDArray[np.int32],
        remote: DlistHandle,
        remote_idx: npt.NDArray[np.int32],
        notif: bytes,
        *,
        merge: bool = True,
    ) -> XferHandle:
        """Create and post a WRITE of local descriptors into the remote ones (push mode); as
        [`read`][akv.backends.nixl.NixlBackend.read] otherwise."""
        return self._post("WRITE", local, local_idx, remote, remote_idx, notif, merge)

    def _post(
        self,
        op: str,
        local: DlistHandle,
        local_idx: npt.NDArray[np.int32],
        remote: DlistHandle,
        remote_idx: npt.NDArray[np.int32],
        notif: bytes,
        merge: bool,
    ) -> XferHandle:
        what = op.lower()
        if local not in self._dlists or remote not in self._dlists:
            raise PeerLostError(f"a descriptor list of this {what} was released (its peer was re-linked)")
        try:  # a plain try: map_exceptions' enter and exit cost more, on every pull
            handle = self._agent.make_prepped_xfer(
                op, local, local_idx, remote, remote_idx, notif, skip_desc_merge=not merge
            )
        except Exception as exc:
            map_exceptions(f"creating the {what} failed", TransferError).raise_from(exc)
        return self._submit(handle, what)

    def _submit(self, handle: XferHandle, what: str) -> XferHandle:
        """Post a created transfer (tracked until released); a refused one is released."""
        self._xfers.add(handle)
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self.release(handle)
            map_exceptions(f"posting the {what} failed", TransferError).raise_from(exc)
        if state == "ERR":
            self.release(handle)
            raise TransferError(f"NIXL refused to post the {what}")
        return handle

    @on_device
    def read_descs(
        self,
        agent: str,
        local: npt.NDArray[np.int64],
        local_mem: str,
        remote: npt.NDArray[np.int64],
        remote_mem: str,
        notif: bytes,
    ) -> XferHandle:
        """Create and post a READ of ``(N, 3)`` rows ``(addr, len, device)`` on each side (for
        a few descriptors whose addresses change per transfer: packed copies)."""
        return self._post_descs("READ", agent, local, local_mem, remote, remote_mem, notif)

    @on_device
    def write_descs(
        self,
        agent: str,
        local: npt.NDArray[np.int64],
        local_mem: str,
        remote: npt.NDArray[np.int64],
        remote_mem: str,
        notif: bytes,
    ) -> XferHandle:
        """Create and post a WRITE of ``(N, 3)`` rows ``(addr, len, device)`` on each side
        (packed push: a packed copy into a decode rank's staging area)."""
        return self._post_descs("WRITE", agent, local, local_mem, remote, remote_mem, notif)

    def _post_descs(
        self,
        op: str,
        agent: str,
        local: npt.NDArray[np.int64],
        local_mem: str,
        remote: npt.NDArray[np.int64],
        remote_mem: str,
        notif: bytes,
    ) -> XferHandle:
        what = op.lower()
        if agent not in self._remotes:
            raise PeerLostError(f"agent {agent} was forgotten (its peer was re-linked)")
        with map_exceptions(f"creating the {what} failed", TransferError):
            handle = self._agent.initialize_xfer(
                op,
                self._agent.get_xfer_descs(np.ascontiguousarray(local, dtype=np.int64), local_mem),
                self._agent.get_xfer_descs(np.ascontiguousarray(remote, dtype=np.int64), remote_mem),
                agent,
                notif,
            )
        return self._submit(handle, what)

    @on_device
    def state(self, handle: XferHandle) -> XferState:
        """Poll one transfer: "DONE" or "PROC"; raises [`TransferError`][akv.errors.TransferError] on failure."""
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as exc:
            map_exceptions("transfer failed", TransferError).raise_from(exc)
        if state == "ERR":
            raise TransferError("NIXL reported the transfer in error")
        return "DONE" if state == "DONE" else "PROC"

    def descriptors(self, handle: XferHandle) -> int:
        """Descriptors NIXL used for a transfer after merging (needs telemetry), else -1."""
        try:
            return int(self._agent.get_xfer_telemetry(handle).descCount)
        except Exception:
            return -1

    @property
    def active_transfers(self) -> int:
        """Transfer handles created and not yet released."""
        return len(self._xfers)

    @on_device
    def release(self, handle: XferHandle) -> bool:
        """Release a transfer (NIXL cancels it if still active). False if it could not."""
        if handle not in self._xfers:
            return True
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            return False
        self._xfers.discard(handle)
        return True

    # -- notifications ------------------------------------------------------------------

    @on_device
    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name. Also progresses the agent."""
        with map_exceptions("reading notifications failed"):
            return dict(self._agent.get_new_notifs())

    @on_device
    def progress(self) -> None:
        """Progress the agent (sends queued notifications); notifications received are dropped."""
        with map_exceptions("progressing the agent failed"):
            self._agent.get_new_notifs()

    @on_device
    def notify(self, agent: str, message: bytes) -> None:
        """Send a standalone notification to a remote agent."""
        with map_exceptions(f"notifying {agent} failed", PeerLostError):
            self._agent.send_notif(agent, message)

    # -- lifetime -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once [`close`][akv.backends.nixl.NixlBackend.close] ran."""
        return self._closed

    @on_device
    def close(self) -> None:
        """Release transfers, lists, remote agents and registrations, in that order, then
        destroy the agent (nothing it started can write into local memory afterwards).
        Idempotent; blocking."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._xfers):
            self.release(handle)
        for dlist in list(self._dlists):
            self.release_dlist(dlist)
        for name in list(self._remotes):
            self._remotes[name] = 1
            self.remove_remote(name)
        for reg in self._registrations:
            with contextlib.suppress(Exception):  # already gone: nothing else to undo
                self._agent.deregister_memory(reg)
        self._registrations.clear()
        # Destroy the agent: its UCX workers and endpoints go with it, so no operation it
        # started (a read to a hung peer that NIXL could not cancel) can land afterwards.
        # Handles NIXL refused to release hold the agent too: drop them as well.
        self._xfers.clear()
        self._dlists.clear()
        agent, self._agent = self._agent, None
        self._native = weakref.ref(agent.agent)  # a reference left elsewhere keeps it alive
        del agent

    @property
    def destroyed(self) -> bool:
        """True once the closed agent is gone (no handle or list of it is referenced any more)."""
        return self._native is not None and self._native() is None
