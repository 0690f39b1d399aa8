"""The transfers a read posts: one READ of a request from one prefill rank, ready to post
(`ReadPost`: of the paged runs, by prepared lists and indices; `DescPost`: of a packed copy,
by ``(addr, len, device)`` rows), and its slices: a long READ is posted as READs of bounded
size, one each time its op is polled (`akv.backends.SLICE_DESCS`), so that the event loop
runs between two.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import numpy.typing as npt

from akv.backends import SLICE_BYTES, SLICE_DESCS, Backend, DlistHandle, XferHandle, row_slices, slice_bounds

__all__ = ["DescPost", "Post", "ReadPost"]


@dataclass(slots=True)
class ReadPost:
    """One READ of a request from one prefill rank: prepared lists and indices (``run_bytes``:
    its descriptors' mean size, 0 if unknown)."""

    rank: int
    local: DlistHandle
    local_idx: npt.NDArray[np.int32]
    remote: DlistHandle
    remote_idx: npt.NDArray[np.int32]
    run_bytes: int = 0

    def post(self, backend: Backend, notice: bytes) -> XferHandle:
        """Post the READ."""
        return backend.read(self.local, self.local_idx, self.remote, self.remote_idx, notice)

    @property
    def long(self) -> bool:
        """True if it is posted in slices (see `akv.backends.SLICE_DESCS`)."""
        n = len(self.local_idx)
        return n > SLICE_DESCS or (n > 1 and n * self.run_bytes > SLICE_BYTES)

    def slices(self) -> Iterator[ReadPost]:
        """This READ as READs of bounded size (`akv.backends.SLICE_DESCS`,
        `akv.backends.SLICE_BYTES`), made as they are taken; itself if it is small."""
        if not self.long:
            yield self
            return
        li, ri = self.local_idx, self.remote_idx
        for a, b in slice_bounds(len(li), self.run_bytes):
            yield ReadPost(self.rank, self.local, li[a:b], self.remote, ri[a:b], self.run_bytes)


class Post(Protocol):
    """One READ of a request from one prefill rank, ready to post."""

    @property
    def rank(self) -> int: ...

    def post(self, backend: Backend, notice: bytes) -> XferHandle: ...

    @property
    def long(self) -> bool:
        """True if it is posted in slices."""

    def slices(self) -> Iterator[Post]:
        """The READ as READs of bounded size (see `akv.backends.SLICE_DESCS`), in order."""


@dataclass(frozen=True, slots=True)
class DescPost:
    """One READ of a packed copy from one prefill rank: ``(addr, len, device)`` rows."""

    rank: int
    agent: str
    local: npt.NDArray[np.int64]
    local_mem: str
    remote: npt.NDArray[np.int64]
    remote_mem: str

    def post(self, backend: Backend, notice: bytes) -> XferHandle:
        """Post the READ."""
        return backend.read_descs(
            self.agent, self.local, self.local_mem, self.remote, self.remote_mem, notice
        )

    @property
    def long(self) -> bool:
        """True if it is posted in slices (`akv.backends.SLICE_DESCS`)."""
        return len(self.local) > SLICE_DESCS or int(self.local[:, 1].sum()) > SLICE_BYTES

    def slices(self) -> Iterator[DescPost]:
        """This READ as READs of bounded size (`akv.backends.row_slices`); itself if it is small."""
        for a, b in row_slices(self.local, self.remote):
            yield replace(self, local=a, remote=b)
