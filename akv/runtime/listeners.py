"""The readers of a prefill rank's releases: the streams handed out by
[`Producer.releases`][akv.Producer.releases], each bounded, none able to stall the rank."""

from __future__ import annotations

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from akv.ledger import Release
from akv.metrics import Metrics

__all__ = ["Listeners"]


class Listeners:
    """Release streams of one rank; a reader that falls ``max_buffer`` behind misses releases
    (counted as ``releases_dropped``), a reader that went away is pruned."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._streams: list[MemoryObjectSendStream[Release]] = []

    def stream(self, max_buffer: int, *, closed: bool) -> MemoryObjectReceiveStream[Release]:
        """A new reader's stream (already ended if the rank is ``closed``)."""
        send, receive = anyio.create_memory_object_stream[Release](max_buffer_size=max_buffer)
        if closed:
            send.close()
        else:
            self._streams.append(send)
        return receive

    def send(self, release: Release) -> None:
        """Hand ``release`` to every reader, without waiting."""
        for stream in list(self._streams):
            try:
                stream.send_nowait(release)
            except anyio.WouldBlock:
                self.metrics.inc("releases_dropped")
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._streams.remove(stream)  # the reader went away: prune
                stream.close()

    def close(self) -> None:
        """End every stream (the rank closed)."""
        for stream in self._streams:
            stream.close()
        self._streams.clear()
