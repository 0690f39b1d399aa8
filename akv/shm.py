"""Exposure tables (and packed-copy directories) a decode rank on the same host reads from
memory (Linux).

A prefill rank keeps its exposure table (`akv.exposure`) in a memfd it maps, registers with
NIXL as before, and offers in its handshake as a `TableShare`: its host, process id, file
descriptor and a random token written at the file's head. A decode rank on the same host
(same boot, network namespace and process namespace, x86-64) opens ``/proc/PID/fd/FD``
read-only (which needs ptrace read access to the prefill process: the same user, or
privileges), checks that it is the sealed file of the announced size with the token at its
head, and maps it; then its
exposure check copies the request's bucket with a memory load after the data reads
completed, instead of posting a READ and waiting for it. Anything else (another host, a
peer that offers no share, a file that cannot be opened, a token that differs) returns None,
and the check READs the table through NIXL as before.

The argument for soundness is the READ check's: the bucket is read after every data read
completed, and a prefill rank writes a request's release into its table before its blocks
go back to the engine; a memory load sees that write no later than a READ posted at the
same moment would. The check loads every slot's token before the matching slot's fingerprint
and generation, then that token again (`akv.exposure.shared_slot`; a packed pull's
directory entry likewise,
`akv.runtime.paths.tables.copy_bucket`), so it never pairs a token with an older exposure's
fields.

A rank that packs (`akv.packing`) shares its packed-copy directory the same way
(`akv.protocol.messages.PackInfo.directory_share`): a packed pull from a rank of this host
copies the request's directory bucket (each row's tag word first, which the prefill writes
last) instead of READing it. The directory only says where the copy is; the exposure check
after the copy's READ is what proves its bytes were the request's, as on the READ path.
"""

from __future__ import annotations

import fcntl
import functools
import mmap
import os
import platform
import secrets
import stat
import weakref
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = ["HEADER", "OfferedTable", "SharedTable", "TableShare", "host_key", "open_table"]

#: Bytes before the table in the file: the token, then padding to a cache line.
HEADER = 64
_TOKEN = 16
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if hasattr(fcntl, "F_SEAL_SHRINK") else 0


class TableShare(msgspec.Struct, frozen=True, kw_only=True):
    """Where a decode rank on the prefill rank's host finds its exposure table."""

    host: Annotated[str, msgspec.Meta(max_length=256)]  # `host_key` of the prefill rank's process
    pid: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
    fd: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
    token: Annotated[bytes, msgspec.Meta(max_length=64)]


@functools.cache
def host_key() -> str:
    """This process's host for table sharing: its kernel's boot id and its network and
    process namespaces ("" where they cannot be read, or off x86-64: nothing is shared; the
    check relies on x86-64 keeping loads in order, see `akv.exposure.shared_slot`)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        net = os.stat("/proc/self/ns/net").st_ino
        pid = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{net}/{pid}"


class SharedTable:
    """An int64 array of ``words`` in a memfd, for the prefill rank that writes it."""

    def __init__(self, words: int, name: str = "akv-exposure") -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, HEADER + words * 8)
            # its size is fixed for good: a map of it never faults past its end
            fcntl.fcntl(
                self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            )
            self._map = mmap.mmap(self.fd, HEADER + words * 8)
        except BaseException:
            os.close(self.fd)
            raise
        self._closer = weakref.finalize(self, os.close, self.fd)  # closed with the table, at the latest
        self.token = secrets.token_bytes(_TOKEN)
        self._map[:_TOKEN] = self.token
        self.array: npt.NDArray[np.int64] = np.frombuffer(
            self._map, dtype=np.int64, offset=HEADER, count=words
        )

    def share(self) -> TableShare | None:
        """What the handshake offers (None while the file is closed)."""
        if self.fd < 0 or not host_key():
            return None
        return TableShare(host=host_key(), pid=os.getpid(), fd=self.fd, token=self.token)

    def close(self) -> None:
        """Stop offering the table (maps already made stay valid). Idempotent."""
        self._closer()
        self.fd = -1


class OfferedTable:
    """A prefill rank's zeroed int64 ``array`` of ``shape`` that decode ranks of its host may
    map: in a `SharedTable` (memfd ``name``) where ``shared`` and the system has memfds,
    else private."""

    def __init__(self, shape: tuple[int, ...], *, shared: bool, name: str) -> None:
        self._shared: SharedTable | None = None
        self.array: npt.NDArray[np.int64]
        if shared and hasattr(os, "memfd_create"):
            self._shared = SharedTable(int(np.prod(shape)), name=name)
            self.array = self._shared.array.reshape(shape)
        else:
            self.array = np.zeros(shape, dtype=np.int64)

    def share(self) -> TableShare | None:
        """What a handshake offers decode ranks of this host (None: the table is private)."""
        return None if self._shared is None else self._shared.share()

    def close(self) -> None:
        """Stop offering the table to decode ranks that have not mapped it yet."""
        if self._shared is not None:
            self._shared.close()


def open_table(share: TableShare | None, shape: tuple[int, ...]) -> npt.NDArray[np.int64] | None:
    """A read-only view of the table ``share`` offers, of ``shape`` int64 words, if this
    process is on its host and may open it; else None."""
    if share is None or not share.host or share.host != host_key():
        return None
    size = HEADER + int(np.prod(shape)) * 8
    try:
        # non-blocking: a peer naming a FIFO must not hang the open; only a regular file maps
        fd = os.open(f"/proc/{int(share.pid)}/fd/{int(share.fd)}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return None
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SIZE_SEALS != _SIZE_SEALS:
                return None  # a file that may shrink under the map
            view = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
    except (OSError, ValueError, OverflowError):
        return None
    if view[:_TOKEN] != share.token:
        view.close()
        return None
    return np.frombuffer(view, dtype=np.int64, offset=HEADER).reshape(shape)
