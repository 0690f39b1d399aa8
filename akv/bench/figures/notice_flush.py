"""``akv bench --only notice_flush``: why akv flushes behind its notices, with two raw NIXL
agents in two processes.

A "prefill" process registers 1 MiB of DRAM and polls its agent every ``interval_s``. This
process repeats: a 64 KiB READ carrying a notice, then ``gap_s`` of nothing, then a 512-byte
READ, timed (post to DONE). ``flush`` "after": a small READ is posted right behind the notice
(what akv does); "before": another notice follows that READ; "none": neither. One row per
case (`CASES`), with the timed READ's p50, p90 and maximum in milliseconds, over 200 rounds
(30 for gaps of 50 ms and more). Each round also times the 64 KiB READ carrying the notice
(``notice_read_p50_ms``: its endpoint flush follows the notice, so it too waits for the
prefill's next poll) beside a 64 KiB READ without one, posted just before
(``plain_read_p50_ms``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import anyio
import numpy as np

from akv.backends.nixl import NixlBackend

__all__ = ["CASES", "figures", "prefill"]

SIZE = 1 << 20

#: (interval_s, gap_s, flush): the prefill polling every 2 ms and the READ 2 ms after the
#: notice, then every 50 ms and 100 ms after.
CASES = (
    (0.002, 0.002, "none"),
    (0.002, 0.002, "after"),
    (0.002, 0.002, "before"),
    (0.05, 0.1, "none"),
    (0.05, 0.1, "after"),
)

_KEEP: list[NixlBackend] = []


def _agent(name: str) -> tuple[Any, np.ndarray]:
    """A raw NIXL agent (created through akv, which keeps NIXL's logs off stdout) with 1 MiB
    of DRAM registered."""
    _KEEP.append(NixlBackend(name))
    raw = _KEEP[-1].raw
    buf = np.ones(SIZE, np.uint8)
    raw.register_memory(raw.get_reg_descs([(buf.ctypes.data, SIZE, 0, "")], "DRAM"))
    return raw, buf


def prefill(folder: str, interval: float) -> None:
    """The prefill process: publish the agent's metadata in ``folder``, poll until told to stop."""
    raw, buf = _agent("flush-prefill")
    with open(os.path.join(folder, "meta.tmp"), "wb") as f:
        f.write(raw.get_agent_metadata())
    with open(os.path.join(folder, "addr"), "w") as f:
        f.write(str(buf.ctypes.data))
    os.rename(os.path.join(folder, "meta.tmp"), os.path.join(folder, "meta"))
    while not os.path.exists(os.path.join(folder, "stop")):
        raw.get_new_notifs()
        time.sleep(interval)


def _decode(folder: str, gap: float, flush: str, rounds: int) -> dict[str, Any]:
    raw, buf = _agent(f"flush-decode-{flush}-{gap:g}")
    meta = os.path.join(folder, "meta")
    while not os.path.exists(meta):
        time.sleep(0.01)
    with open(meta, "rb") as fb:
        peer = raw.add_remote_agent(fb.read())
    with open(os.path.join(folder, "addr")) as ft:
        remote = int(ft.read())

    def read(nbytes: int, offset: int, notice: bytes = b"") -> Any:
        local = raw.get_xfer_descs([(buf.ctypes.data + offset, nbytes, 0)], "DRAM")
        far = raw.get_xfer_descs([(remote + offset, nbytes, 0)], "DRAM")
        handle = raw.initialize_xfer("READ", local, far, peer, notice)
        raw.transfer(handle)
        return handle

    def wait(handle: Any) -> None:
        while raw.check_xfer_state(handle) != "DONE":
            pass
        raw.release_xfer_handle(handle)

    for _ in range(500):  # the first READ connects (the peer's metadata may still be loading)
        try:
            wait(read(64, 0))
            break
        except Exception:
            time.sleep(0.01)
    ms, plain, carrying = [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        wait(read(65536, 0))
        plain.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        wait(read(65536, 0, b"done"))
        carrying.append((time.perf_counter() - started) * 1e3)
        behind = read(8, 4096) if flush != "none" else None
        if flush == "before":
            wait(read(65536, 0, b"done again"))
        time.sleep(gap)
        started = time.perf_counter()
        wait(read(512, 8192))
        ms.append((time.perf_counter() - started) * 1e3)
        if behind is not None:
            wait(behind)
    ms.sort()
    return {
        "p50_ms": round(ms[len(ms) // 2], 3),
        "p90_ms": round(ms[len(ms) * 9 // 10], 3),
        "max_ms": round(ms[-1], 3),
        "notice_read_p50_ms": round(sorted(carrying)[len(carrying) // 2], 3),
        "plain_read_p50_ms": round(sorted(plain)[len(plain) // 2], 3),
    }


def case(interval: float, gap: float, flush: str) -> dict[str, Any]:
    """One case: a prefill process polling every ``interval`` s, the timed READ ``gap`` s
    after the notice."""
    rounds = 30 if gap >= 0.05 else 200
    with tempfile.TemporaryDirectory() as folder:
        code = f"from akv.bench.figures.notice_flush import prefill; prefill({folder!r}, {interval!r})"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
        try:
            result = _decode(folder, gap, flush, rounds)
        finally:
            open(os.path.join(folder, "stop"), "w").close()
            proc.wait(10)
    return {"interval_s": interval, "gap_s": gap, "flush": flush, "rounds": rounds, **result}


async def figures(transfer: str = "direct") -> list[dict[str, Any]]:
    """Every case of `CASES` (``transfer`` is not used)."""
    return [await anyio.to_thread.run_sync(case, *c) for c in CASES]
