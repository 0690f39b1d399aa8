"""Backends: the transport behind a small interface. `akv.backends.nixl` is the only
module of akv that imports ``nixl``; it is loaded only when a rank starts."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

    from akv.errors import TransferError

__all__ = [
    "SLICE_BYTES",
    "SLICE_DESCS",
    "Backend",
    "DlistHandle",
    "Reaper",
    "XferHandle",
    "XferState",
    "host_is_here",
    "mem_type",
    "poll_handles",
    "rdma_devices",
    "reads_over_tcp",
    "slice_bounds",
    "ucx_tcp_only",
]

XferState = Literal["DONE", "PROC"]

#: A transfer of more descriptors than this, or of more bytes than `SLICE_BYTES`, is posted
#: as transfers of at most that much, one at a time between the poller's other work, on
#: both sides: UCX copies while a transfer over shared memory is posted, so one READ of a
#: long request (262,144 descriptors, 1 GiB, for 64k tokens of a 32-layer per-layer layout)
#: held the event loop for the whole transfer (1.5 s); a slice holds it a few milliseconds
#: (docs/performance.md, "Scale").
SLICE_DESCS = 1024
SLICE_BYTES = 4 << 20


def slice_bounds(count: int, run_bytes: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the slices of ``count`` descriptors of ``run_bytes`` bytes each on
    average (0: unknown): at most `SLICE_DESCS` and about `SLICE_BYTES` a slice."""
    per = SLICE_DESCS if run_bytes <= 0 else max(1, min(SLICE_DESCS, SLICE_BYTES // run_bytes))
    return [(a, min(a + per, count)) for a in range(0, count, per)]


def cut_rows(rows: npt.NDArray[np.int64], most: int) -> npt.NDArray[np.int64]:
    """``(addr, len, device)`` rows with every run longer than ``most`` cut into runs of
    ``most`` bytes (and a last shorter one), in order: the same cut on both sides of a
    transfer, whose rows pair runs of equal lengths."""
    lengths = rows[:, 1]
    pieces = -(-lengths // most)
    if int(pieces.max(initial=1)) <= 1:
        return rows
    idx = np.repeat(np.arange(len(rows)), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(len(idx)) - np.repeat(first, pieces)  # piece number within its run
    out: npt.NDArray[np.int64] = rows[idx].copy()
    out[:, 0] += k * most
    out[:, 1] = np.minimum(most, lengths[idx] - k * most)
    return out


def row_slices(
    local: npt.NDArray[np.int64], remote: npt.NDArray[np.int64]
) -> list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    """A transfer of paired ``(addr, len, device)`` rows as transfers of at most
    `SLICE_DESCS` rows and `SLICE_BYTES` bytes (a longer run cut in pieces); one if it is small."""
    if len(local) <= SLICE_DESCS and int(local[:, 1].sum()) <= SLICE_BYTES:
        return [(local, remote)]
    local, remote = cut_rows(local, SLICE_BYTES), cut_rows(remote, SLICE_BYTES)
    out, at, n = [], 0, len(local)
    while at < n:
        sizes = np.cumsum(local[at : at + SLICE_DESCS, 1])
        stop = at + max(1, int(np.searchsorted(sizes, SLICE_BYTES, side="right")))
        out.append((local[at:stop], remote[at:stop]))
        at = stop
    return out


DlistHandle = Any
XferHandle = Any


def mem_type(tensors: Sequence[torch.Tensor]) -> tuple[str, int]:
    """``("DRAM", 0)`` for CPU tensors, ``("VRAM", device index)`` for CUDA ones."""
    from akv.errors import BackendError

    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise BackendError(f"all KV tensors of a rank must share one device, got {devices}")
    device = devices.pop()
    if device.type == "cpu":
        return "DRAM", 0
    if device.type == "cuda":
        return "VRAM", int(device.index or 0)
    raise BackendError(f"unsupported device {device}: use CPU (DRAM) or CUDA (VRAM) tensors")


#: UCX transports that move no bytes between processes (loopback within one, local copies).
_LOCAL_TLS = frozenset({"self", "cuda_copy", "rocm_copy", "ze_copy"})


def ucx_tcp_only(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``UCX_TLS`` leaves TCP as the only transport between processes.

    Over TCP, UCX has no one-sided READ: the *target* of a READ answers it from its own
    worker, queueing one reply request per read. If the reader vanishes (killed, or its
    agent destroyed to cut a hung read) while replies are still queued, UCX 1.23 (bundled
    with NIXL 1.5.1) purges them through a path that reads fields it never set, and the
    target process dies with SIGSEGV (docs/operations.md#peer-death-over-tcp). WRITEs over
    TCP leave the target nothing queued, so a consumer's sessions push there by default
    (see `reads_over_tcp`).
    """
    env = os.environ if environ is None else environ
    tls = [t.strip() for t in env.get("UCX_TLS", "").split(",") if t.strip()]
    if not tls or tls[0].startswith("^"):
        return False
    return "tcp" in tls and all(t == "tcp" or t in _LOCAL_TLS for t in tls)


#: UCX transports that read one-sidedly over RDMA (UCX_TLS names).
_RDMA_TLS = ("rc", "ud", "dc", "ib", "rc_x", "rc_v", "ud_x", "ud_v", "dc_x", "rc_mlx5", "ud_mlx5", "dc_mlx5")


def rdma_devices(sysfs: str = "/sys/class/infiniband") -> list[str]:
    """The RDMA devices of this host (InfiniBand or RoCE), as the kernel lists them."""
    path = Path(sysfs)
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


def host_is_here(host: str) -> bool:
    """True when ``host`` (an IP address or name) is an address of this host's network
    namespace: a socket can be bound to it. Another namespace on the same machine counts as
    another host, as it does for UCX (it moves data between them over TCP). *Blocking*: a
    name is resolved."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def reads_over_tcp(
    here: bool, environ: Mapping[str, str] | None = None, devices: Sequence[str] | None = None
) -> bool:
    """True when UCX would serve READs to a peer over TCP: ``UCX_TLS`` leaves only TCP, or
    the peer is on another host (``here`` False) and UCX may use no RDMA transport (this host
    has no RDMA device, or ``UCX_TLS`` names none). See `ucx_tcp_only` for why it matters."""
    env = os.environ if environ is None else environ
    if ucx_tcp_only(env):
        return True
    if here:
        return False
    tls = [t.strip() for t in env.get("UCX_TLS", "").split(",") if t.strip()]
    listed = tls and not tls[0].startswith("^") and "all" not in tls  # else nothing is ruled out
    if listed and not any(t.startswith(_RDMA_TLS) for t in tls):
        return True
    return not (rdma_devices() if devices is None else devices)


class Backend(Protocol):
    """What the runtime needs from a transport: one agent per TP rank.

    Calls marked *blocking* may take milliseconds and are run off the event loop by the
    runtime (``anyio.to_thread``); the others are cheap and run on it.
    """

    name: str

    @property
    def closed(self) -> bool: ...

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register KV tensors (*blocking*)."""

    def register_host(self, array: npt.NDArray[Any]) -> None:
        """Register a host (DRAM) array, e.g. a rank's exposure tokens (*blocking*)."""

    def metadata(self) -> bytes: ...

    def add_remote(self, metadata: bytes) -> str:
        """Load a remote agent's metadata (*blocking*); returns its name."""

    def connect(self, name: str) -> None:
        """Wire up the transport to a loaded remote agent (*blocking*)."""

    def remove_remote(self, name: str) -> None:
        """Undo one `add_remote` (references are counted: the last one forgets the agent)."""

    def prep(self, agent: str, table: npt.NDArray[np.int64], mem_type: str) -> DlistHandle:
        """Prepare a strided descriptor table (*blocking*)."""

    def release_dlist(self, handle: DlistHandle) -> None: ...

    def read(
        self,
        local: DlistHandle,
        local_idx: npt.NDArray[np.int32],
        remote: DlistHandle,
        remote_idx: npt.NDArray[np.int32],
        notif: bytes,
        *,
        merge: bool = True,
    ) -> XferHandle: ...

    def write(
        self,
        local: DlistHandle,
        local_idx: npt.NDArray[np.int32],
        remote: DlistHandle,
        remote_idx: npt.NDArray[np.int32],
        notif: bytes,
        *,
        merge: bool = True,
    ) -> XferHandle: ...

    def read_descs(
        self,
        agent: str,
        local: npt.NDArray[np.int64],
        local_mem: str,
        remote: npt.NDArray[np.int64],
        remote_mem: str,
        notif: bytes,
    ) -> XferHandle:
        """Create and post a READ of a few ``(addr, len, device)`` rows (no prepared lists)."""

    def write_descs(
        self,
        agent: str,
        local: npt.NDArray[np.int64],
        local_mem: str,
        remote: npt.NDArray[np.int64],
        remote_mem: str,
        notif: bytes,
    ) -> XferHandle:
        """Create and post a WRITE of a few ``(addr, len, device)`` rows (no prepared lists)."""

    def state(self, handle: XferHandle) -> XferState: ...

    def release(self, handle: XferHandle) -> bool: ...

    def notifications(self) -> dict[str, list[bytes]]: ...

    def progress(self) -> None:
        """Make transport progress (standalone notices go out only while the sender progresses)."""

    def notify(self, agent: str, message: bytes) -> None: ...

    def close(self) -> None:
        """Release everything and destroy the agent (*blocking*)."""

    @property
    def destroyed(self) -> bool:
        """True once the closed agent is gone: nothing it started can write any more."""


class Reaper:
    """Holds transfer handles that were given up on (a failed, timed-out or closed pull) until
    nothing of them can still land: NIXL reported the transfer DONE or in error (UCX completed
    its operations), then the handle is released and its ``then`` runs (e.g. freeing the
    landing slot it may still write). Releasing a handle NIXL still reports running would
    not do: UCX cannot cancel an RMA read, so its bytes may land later.

    Handles are held per ``owner`` (the op that posted them), so the runtime can tell whether
    an op settled (`holds`), and how long the oldest one waits (`oldest`); once the backend is
    closed (its agent destroyed, so nothing it started can land), everything held is settled.
    Background handles (`drop_background`: reads no pull waits for, landing where nothing
    reads) are only released, by `retry` too: they count in neither ``len``, `holds` nor
    `oldest`.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._held: dict[XferHandle, tuple[Callable[[], None] | None, object, float]] = {}
        self._background: set[XferHandle] = set()

    def __len__(self) -> int:
        return len(self._held)

    def _dead(self, handle: XferHandle) -> bool:
        from akv.errors import AkvError

        try:
            return self.backend.state(handle) == "DONE"
        except AkvError:  # completed in error: UCX is done with its operations
            return True

    def drop(
        self,
        handle: XferHandle,
        then: Callable[[], None] | None = None,
        owner: object = None,
        *,
        done: bool = False,
    ) -> None:
        """Release ``handle`` now if NIXL says it is finished (``done``: the caller just saw it
        DONE), else hold it (see `retry`)."""
        if self.backend.closed or ((done or self._dead(handle)) and self.backend.release(handle)):
            if then is not None:
                then()
        else:
            self._held[handle] = (then, owner, time.monotonic())

    def retry(self) -> None:
        """Poll the handles held; release those finished."""
        if self.backend.closed:
            self.abandon()
            return
        for handle, (then, _owner, _since) in list(self._held.items()):
            if self._dead(handle) and self.backend.release(handle):
                del self._held[handle]
                if then is not None:
                    then()
        for handle in list(self._background):
            if self._dead(handle) and self.backend.release(handle):
                self._background.discard(handle)

    def drop_background(self, handle: XferHandle) -> None:
        """Release ``handle`` now if NIXL says it is finished, else hold it in the background
        (see the class)."""
        if not self.backend.closed and not (self._dead(handle) and self.backend.release(handle)):
            self._background.add(handle)

    @property
    def background(self) -> int:
        """Background handles held."""
        return len(self._background)

    def pending(self, handle: XferHandle) -> bool:
        """True while ``handle``, dropped in the background, is still held (not finished)."""
        return handle in self._background

    def holds(self, owner: object) -> bool:
        """True while a handle of ``owner`` may still land."""
        return any(held[1] is owner for held in self._held.values())

    def oldest(self) -> float | None:
        """``time.monotonic()`` when the oldest handle held was dropped, None if none is."""
        return min((held[2] for held in self._held.values()), default=None)

    def abandon(self) -> None:
        """The backend was closed (its agent destroyed: nothing it started can land): settle
        everything held."""
        held, self._held = self._held, {}
        self._background.clear()
        for then, _owner, _since in held.values():
            if then is not None:
                then()


K = TypeVar("K")


class Polled(NamedTuple):
    """What one `poll_handles` found: whether any handle finished, and the first one NIXL
    reported in error (``(handle, its key, the error)``), None if none was."""

    changed: bool
    failed: tuple[XferHandle, Any, TransferError] | None = None


def poll_handles(backend: Backend, reaper: Reaper, pending: dict[XferHandle, K]) -> Polled:
    """Poll each transfer of ``pending`` (handle -> its key, e.g. the prefill rank) once: those
    DONE are released (``reaper.drop(..., done=True)``: NIXL is not asked again) and taken
    out; the first in error stops the poll and stays in ``pending`` (its owner hands it to the
    reaper, finished: nothing more of it lands)."""
    from akv.errors import TransferError

    changed = False
    state = backend.state
    for handle, key in list(pending.items()):
        try:
            done = state(handle) == "DONE"
        except TransferError as exc:
            return Polled(changed, (handle, key, exc))
        if done:
            del pending[handle]
            reaper.drop(handle, done=True)
            changed = True
    return Polled(changed)
