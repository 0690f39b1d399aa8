"""Why akv flushes behind its notices, with two raw NIXL agents in two processes.

A "prefill" process registers 1 MiB of DRAM and polls its agent every ``--interval``
seconds. A "decode" process repeats ``--rounds`` times: a 64 KiB READ carrying a notice,
then ``--gap`` seconds of nothing, then a 512-byte READ, timed (post to DONE). With
``--flush after``, a small READ is posted right behind the notice (what akv does); with
``--flush before``, another notice follows that READ. Prints one JSON line with the timed
READ's p50, p90 and maximum in milliseconds.

    PYTHONPATH=. .venv/bin/python scripts/notice_flush.py [--interval 0.002] [--gap 0.002]
        [--flush none|after|before]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from akv.backends.nixl import NixlBackend

SIZE = 1 << 20


_KEEP: list[NixlBackend] = []


def agent(name: str) -> tuple[Any, np.ndarray]:
    """A raw NIXL agent (created through akv, which keeps NIXL's logs off stdout) with 1 MiB
    of DRAM registered."""
    _KEEP.append(NixlBackend(name))
    raw = _KEEP[-1].raw
    buf = np.ones(SIZE, np.uint8)
    raw.register_memory(raw.get_reg_descs([(buf.ctypes.data, SIZE, 0, "")], "DRAM"))
    return raw, buf


def prefill(folder: str, interval: float) -> None:
    raw, buf = agent("flush-prefill")
    with open(os.path.join(folder, "meta.tmp"), "wb") as f:
        f.write(raw.get_agent_metadata())
    with open(os.path.join(folder, "addr"), "w") as f:
        f.write(str(buf.ctypes.data))
    os.rename(os.path.join(folder, "meta.tmp"), os.path.join(folder, "meta"))
    while not os.path.exists(os.path.join(folder, "stop")):
        raw.get_new_notifs()
        time.sleep(interval)


def decode(folder: str, gap: float, flush: str, rounds: int) -> dict[str, object]:
    raw, buf = agent("flush-decode")
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
    ms = []
    for _ in range(rounds):
        wait(read(65536, 0, b"done"))
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
        "flush": flush,
        "gap_s": gap,
        "p50_ms": round(ms[len(ms) // 2], 3),
        "p90_ms": round(ms[len(ms) * 9 // 10], 3),
        "max_ms": round(ms[-1], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.002, help="the prefill's seconds between polls")
    parser.add_argument(
        "--gap", type=float, default=0.002, help="seconds between the notice and the timed READ"
    )
    parser.add_argument("--flush", choices=["none", "after", "before"], default="none")
    parser.add_argument(
        "--rounds", type=int, default=0, help="default: 200, or 30 for gaps of 50 ms and more"
    )
    parser.add_argument("--prefill", metavar="FOLDER", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.prefill:
        prefill(a.prefill, a.interval)
        return
    rounds = a.rounds or (30 if a.gap >= 0.05 else 200)
    with tempfile.TemporaryDirectory() as folder:
        argv = [sys.executable, __file__, "--prefill", folder, "--interval", str(a.interval)]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        try:
            result = decode(folder, a.gap, a.flush, rounds)
        finally:
            open(os.path.join(folder, "stop"), "w").close()
            proc.wait(10)
    print(json.dumps({"interval_s": a.interval, **result}))


if __name__ == "__main__":
    main()
