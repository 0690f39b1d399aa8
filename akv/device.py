"""Where a rank's KV cache lives: device names, CUDA checks, the UCX settings GPUs want, and
the CUDA context NIXL calls need. Small functions, so the decisions are tested without a GPU.

``--device`` takes ``cpu`` (DRAM), ``cuda`` (rank ``r`` of a command on GPU ``r % count``,
one process per GPU) or ``cuda:N`` (every rank of the command on GPU ``N``).

UCX turns CUDA-IPC get-zcopy off unless it sees NVLink, which leaves NIXL READs of VRAM
between processes on a slow path; ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` turns it back on. The
library never changes the environment: the command line sets it for its own processes
(`gpu_environment`), and docs/gpu.md describes it for applications.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from akv.errors import ConfigError

__all__ = [
    "GPU_UCX_ENV",
    "Device",
    "check_usable",
    "cuda_context",
    "gpu_environment",
    "parse_device",
    "usable",
]

#: What the command line sets for VRAM when the environment does not say otherwise.
GPU_UCX_ENV = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}

_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


@dataclass(frozen=True, slots=True)
class Device:
    """A device flag: ``kind`` "cpu" or "cuda"; ``index`` None for "every rank its own GPU"."""

    kind: str
    index: int | None = None

    @property
    def cuda(self) -> bool:
        """True for a GPU."""
        return self.kind == "cuda"

    def for_rank(self, rank: int, count: int) -> str:
        """The torch device of TP rank ``rank`` given ``count`` visible GPUs."""
        if not self.cuda:
            return "cpu"
        if self.index is not None:
            return f"cuda:{self.index}"
        return f"cuda:{rank % max(count, 1)}"

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def parse_device(text: str, flag: str = "--device") -> Device:
    """``cpu``, ``cuda`` or ``cuda:N``; [`ConfigError`][akv.errors.ConfigError] otherwise."""
    m = _DEVICE.match(text.strip().lower())
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise ConfigError(f"{flag} {text!r}: use cpu, cuda or cuda:N")
    return Device(m.group(1), int(m.group(2)) if m.group(2) is not None else None)


def usable(device: Device, *, available: bool, count: int, flag: str = "--device") -> None:
    """Raise a one-line [`ConfigError`][akv.errors.ConfigError] unless ``device`` can be used
    (``available``/``count``: what ``torch.cuda`` reports)."""
    if not device.cuda:
        return
    if not available or count < 1:
        raise ConfigError(
            f"{flag} {device}: no usable CUDA device here (torch.cuda.is_available() is False: no GPU, "
            "or a CPU build of torch): use --device cpu, or install a CUDA build of torch"
        )
    if device.index is not None and device.index >= count:
        raise ConfigError(
            f"{flag} {device}: this machine has {count} CUDA device(s), cuda:0-cuda:{count - 1}"
        )


def check_usable(device: Device, flag: str = "--device") -> None:
    """`usable`, asking torch (imported only for a CUDA device)."""
    if device.cuda:
        import torch

        available = bool(torch.cuda.is_available())
        usable(device, available=available, count=torch.cuda.device_count() if available else 0, flag=flag)


def gpu_environment(environ: Mapping[str, str], cuda: bool) -> dict[str, str]:
    """The UCX variables a command should set for its own processes: for VRAM, those of
    `GPU_UCX_ENV` the environment does not set already (an explicit value always wins)."""
    if not cuda:
        return {}
    return {k: v for k, v in GPU_UCX_ENV.items() if k not in environ}


_bound = threading.local()  # per thread: the devices whose primary context was made current


@contextlib.contextmanager
def _on(index: int) -> Iterator[None]:
    import torch

    with torch.cuda.device(index):
        done: set[int] = getattr(_bound, "devices", set())
        if index not in done:
            # Selecting a device that is already the thread's current one does not bind its
            # context (a fresh thread reports device 0 with no context): a runtime call does.
            torch.cuda.mem_get_info(index)
            done.add(index)
            _bound.devices = done
        yield


def cuda_context(index: int | None) -> Any:
    """A context manager making CUDA device ``index`` current in this thread, its primary
    context bound, for NIXL calls on an agent that registered VRAM (UCX may not pick
    cuda_ipc for a peer otherwise); a no-op context for None (DRAM)."""
    if index is None:
        return contextlib.nullcontext()
    return _on(index)
