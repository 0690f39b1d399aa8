"""The NIXL backend: the only module that imports ``nixl``.

It registers KV tensors, prepares strided descriptor lists, posts prepped READs with
np.int32 indices, reports transfer states, moves notifications, and translates every NIXL
exception into an akv error. It holds no policy: when to poll, retry or fail is the
session's business. Close order: transfers, descriptor lists, remote agents, registrations.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from akv.errors import BackendError, PeerLostError, TransferError

if TYPE_CHECKING:
    import torch

__all__ = ["DlistHandle", "NixlBackend", "XferHandle", "XferState", "nixl_version"]

XferState = Literal["DONE", "PROC"]
DlistHandle = Any
XferHandle = Any

_nixl_lock = threading.Lock()


def _api() -> Any:
    with _nixl_lock:
        from nixl import _api

        return _api


def nixl_version() -> str:
    """The installed NIXL version, or "unknown"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        return "unknown"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class NixlBackend:
    """One NIXL agent (one per TP rank), with akv's error translation.

    ``progress_thread`` enables UCX's own progress thread; on small machines it costs more
    than it gives, so akv progresses the agent from its poller by default.
    """

    def __init__(self, name: str, *, progress_thread: bool = False, telemetry: bool = False) -> None:
        api = _api()
        try:
            config = api.nixl_agent_config(enable_prog_thread=progress_thread, capture_telemetry=telemetry)
            self._agent = api.nixl_agent(name, config)
        except Exception as exc:
            raise BackendError(f"cannot create NIXL agent {name!r}: {_describe(exc)}") from exc
        if "UCX" not in self._agent.backends:
            raise BackendError("the NIXL UCX backend is not available in this installation")
        self.name = name
        self._registrations: list[Any] = []
        self._dlists: list[DlistHandle] = []
        self._xfers: set[XferHandle] = set()
        self._remotes: set[str] = set()
        self._closed = False
        self._strided: bool | None = None

    @property
    def raw(self) -> Any:
        """The underlying ``nixl_agent``, for reference implementations (benchmarks)."""
        return self._agent

    # -- memory -------------------------------------------------------------------------

    @staticmethod
    def mem_type(tensors: Sequence[torch.Tensor]) -> tuple[str, int]:
        """``("DRAM", 0)`` for CPU tensors, ``("VRAM", device index)`` for CUDA ones."""
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise BackendError(f"all KV tensors of a rank must share one device, got {devices}")
        device = devices.pop()
        if device.type == "cpu":
            return "DRAM", 0
        if device.type == "cuda":
            return "VRAM", int(device.index or 0)
        raise BackendError(f"unsupported device {device}: use CPU (DRAM) or CUDA (VRAM) tensors")

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register the KV regions with NIXL."""
        try:
            self._registrations.append(self._agent.register_memory(list(tensors)))
        except Exception as exc:
            raise BackendError(f"memory registration failed: {_describe(exc)}") from exc

    def metadata(self) -> bytes:
        """This agent's metadata: whoever loads it can read our registered memory."""
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Load a remote agent's metadata; returns its agent name."""
        try:
            raw = self._agent.add_remote_agent(metadata)
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
        except Exception as exc:
            raise BackendError(f"cannot load remote agent metadata: {_describe(exc)}") from exc
        self._remotes.add(name)
        return name

    def connect(self, name: str) -> None:
        """Set up the transport to a loaded remote agent now, not on the first transfer."""
        try:
            self._agent.make_connection(name)
        except Exception as exc:
            raise PeerLostError(f"cannot connect to {name}: {_describe(exc)}") from exc

    def remove_remote(self, name: str) -> None:
        """Forget a remote agent (and disconnect from it). Idempotent."""
        if name in self._remotes:
            self._remotes.discard(name)
            with contextlib.suppress(Exception):  # already gone: nothing else to undo
                self._agent.remove_remote_agent(name)

    # -- descriptor lists ---------------------------------------------------------------

    def prep(self, agent: str, table: npt.NDArray[np.int64], mem_type: str) -> DlistHandle:
        """Prepare a strided ``(S, 5)`` table for ``agent`` ("" for local memory)."""
        from akv.plan import expand_table

        try:
            if self._strided is not False:
                try:
                    handle = self._agent.prep_xfer_dlist(agent, table, mem_type)
                    self._strided = True
                except TypeError:
                    self._strided = False  # an older NIXL without strided lists
            if self._strided is False:
                handle = self._agent.prep_xfer_dlist(agent, expand_table(table), mem_type)
        except Exception as exc:
            raise BackendError(
                f"preparing descriptors for {agent or 'local'} failed: {_describe(exc)}"
            ) from exc
        self._dlists.append(handle)
        return handle

    def prep_expanded(self, agent: str, table: npt.NDArray[np.int64], mem_type: str) -> DlistHandle:
        """Prepare a table as one ``(addr, len, dev)`` row per descriptor (no strided form)."""
        from akv.plan import expand_table

        try:
            handle = self._agent.prep_xfer_dlist(agent, expand_table(table), mem_type)
        except Exception as exc:
            raise BackendError(f"preparing descriptors failed: {_describe(exc)}") from exc
        self._dlists.append(handle)
        return handle

    def release_dlist(self, handle: DlistHandle) -> None:
        """Release a prepared list. Idempotent."""
        if handle in self._dlists:
            self._dlists.remove(handle)
            with contextlib.suppress(Exception):  # already gone: nothing else to undo
                self._agent.release_dlist_handle(handle)

    # -- transfers ----------------------------------------------------------------------

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
        """Create and post a READ; the target gets ``notif`` once the read is DONE and polled.

        ``merge=False`` keeps NIXL from merging contiguous descriptors (for comparisons).
        """
        try:
            handle = self._agent.make_prepped_xfer(
                "READ", local, local_idx, remote, remote_idx, notif, skip_desc_merge=not merge
            )
        except Exception as exc:
            raise PeerLostError(f"creating the read failed: {_describe(exc)}") from exc
        self._xfers.add(handle)
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self.release(handle)
            raise PeerLostError(f"posting the read failed: {_describe(exc)}") from exc
        if state == "ERR":
            self.release(handle)
            raise TransferError("NIXL refused to post the read")
        return handle

    def state(self, handle: XferHandle) -> XferState:
        """Poll one transfer: "DONE" or "PROC"; raises :class:`TransferError` on failure."""
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as exc:
            raise PeerLostError(f"transfer failed: {_describe(exc)}") from exc
        if state == "ERR":
            raise TransferError("NIXL reported the transfer in error")
        return "DONE" if state == "DONE" else "PROC"

    def descriptors(self, handle: XferHandle) -> int:
        """Descriptors NIXL used for a transfer after merging (needs telemetry), else -1."""
        try:
            return int(self._agent.get_xfer_telemetry(handle).descCount)
        except Exception:
            return -1

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

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name. Also progresses the agent."""
        try:
            return dict(self._agent.get_new_notifs())
        except Exception as exc:
            raise BackendError(f"reading notifications failed: {_describe(exc)}") from exc

    def notify(self, agent: str, message: bytes) -> None:
        """Send a standalone notification to a remote agent."""
        try:
            self._agent.send_notif(agent, message)
        except Exception as exc:
            raise PeerLostError(f"notifying {agent} failed: {_describe(exc)}") from exc

    # -- lifetime -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def close(self) -> None:
        """Release transfers, lists, remote agents and registrations, in that order. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._xfers):
            self.release(handle)
        for dlist in list(self._dlists):
            self.release_dlist(dlist)
        for name in list(self._remotes):
            self.remove_remote(name)
        for reg in self._registrations:
            with contextlib.suppress(Exception):  # already gone: nothing else to undo
                self._agent.deregister_memory(reg)
        self._registrations.clear()
