"""Does a NIXL agent survive its peer vanishing mid-transfer? Two raw NIXL agents in two processes.

An *initiator* process posts one big transfer (``--op read``: it READs the target's memory,
as a decode pulls; ``--op write``: it WRITEs into the target's memory, as a prefill pushes)
of ``--mib`` MiB in ``--descs`` descriptors; a *target* process only progresses its agent.
``--delay`` seconds after the post, one of them is hit (``--event``):

- ``kill-initiator`` / ``kill-target``: SIGKILL;
- ``stop-target``: the target is SIGSTOPped; once ``--timeout`` passed, the initiator cuts
  its side (``--cut``), then the target is resumed (a decode timing out on a stalled
  prefill and replacing its agent);
- ``stop-initiator``: the initiator is SIGSTOPped; the target cuts (``--cut``), then the
  initiator is resumed (a decode removing a stalled push writer's agent).

``--cut``: ``destroy`` (release the transfer, remove the peer, deregister, destroy the agent:
what akv's agent replacement does), ``remove`` (``remove_remote_agent`` only, the agent
stays), ``exit`` (the process exits), ``invalidate`` (``invalidate_remote_agent`` (where
NIXL has it; else remove), then destroy).

The survivor keeps progressing its agent for ``--watch`` seconds, then exits 0; the run
counts it as crashed if it died of a signal. ``--env KEY=VALUE`` (repeatable) goes to both
processes. One JSON line per run of ``--trials`` trials. ``--bench`` instead times
``--trials`` transfers (GB/s) with no fault.

A diagnostic, not a test (pytest does not collect it): the reproducer of the UCX crash that
docs/operations.md ("Peer death over TCP") describes, kept to check NIXL and UCX releases
against it; ``tests/test_peer_death.py`` checks akv's own behaviour.

    PYTHONPATH=. .venv/bin/python tests/diagnostics/ucx_peer_death.py --event stop-target --trials 5 \\
        --env UCX_TLS=tcp --env UCX_NET_DEVICES=lo
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

EVENTS = ("kill-initiator", "kill-target", "stop-target", "stop-initiator")


def _agent(name: str, params: str = "") -> Any:
    """A NIXL agent with the UCX backend; ``params``: "key=value,..." UCX backend parameters
    (e.g. ``ucx_error_handling_mode=none``)."""
    from nixl._api import nixl_agent, nixl_agent_config

    if not params:
        return nixl_agent(name, nixl_agent_config(enable_prog_thread=False))
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    config = agent.get_plugin_params("UCX")
    config.update(kv.split("=", 1) for kv in params.split(","))  # type: ignore[misc]
    agent.create_backend("UCX", config)
    return agent


def _wait_file(path: str, timeout: float = 30.0) -> bytes:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.005)
    with open(path, "rb") as f:
        return f.read()


def _publish(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.rename(path + ".tmp", path)


def _cut(agent: Any, peer: str | None, handle: Any, reg: Any, how: str) -> None:
    """Cut this side's link to a stalled peer the way ``how`` says."""
    if how == "exit":
        os._exit(0)
    if handle is not None:
        try:
            agent.release_xfer_handle(handle)
        except Exception as exc:  # NIXL may refuse to release a transfer still running
            print(f"release refused: {type(exc).__name__}: {exc}", file=sys.stderr)
    if peer is not None and how == "invalidate" and hasattr(agent, "invalidate_remote_agent"):
        agent.invalidate_remote_agent(peer)
    if peer is not None:
        try:
            agent.remove_remote_agent(peer)
        except Exception as exc:
            print(f"remove refused: {type(exc).__name__}: {exc}", file=sys.stderr)
    if how in ("destroy", "invalidate"):
        agent.deregister_memory(reg)
        del agent  # the agent's UCX worker and endpoints go with it


def _progress_until(agent: Any, path: str, watch: float) -> None:
    """Progress ``agent`` until ``path`` exists, then ``watch`` seconds more."""
    while not os.path.exists(path):
        agent.get_new_notifs()
        time.sleep(0.001)
    end = time.monotonic() + watch
    while time.monotonic() < end:
        agent.get_new_notifs()
        time.sleep(0.001)


def dirty_heap(mib: int) -> None:
    """Leave ``mib`` MiB of freed, non-zero heap behind (as a long-running engine has): memory
    UCX allocates afterwards starts out holding these bytes, not zeros."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(64 << 10) for _ in range(mib * 16)]  # below the mmap threshold
    for c in chunks:
        ctypes.memset(c, 0xA5, 64 << 10)
    for c in chunks:
        libc.free(c)


def target(folder: str, mib: int, cut: str, watch: float, params: str, dirty: int) -> None:
    if dirty:
        dirty_heap(dirty)
    agent = _agent("peer-death-target", params)
    buf = np.zeros(mib << 20, np.uint8)
    reg = agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    _publish(os.path.join(folder, "target.meta"), agent.get_agent_metadata())
    _publish(os.path.join(folder, "target.addr"), str(buf.ctypes.data).encode())
    peer = None
    if os.path.exists(os.path.join(folder, "write")):  # the initiator writes: know it, as a push target
        peer = agent.add_remote_agent(_wait_file(os.path.join(folder, "initiator.meta")))
        peer = peer.decode() if isinstance(peer, bytes) else peer
    cut_file = os.path.join(folder, "cut-target")
    while not os.path.exists(cut_file) and not os.path.exists(os.path.join(folder, "done")):
        agent.get_new_notifs()
        time.sleep(0.001)
    if os.path.exists(cut_file):
        _cut(agent, peer, None, reg, cut)
        _publish(os.path.join(folder, "target.cut"), b"")
        if cut in ("destroy", "invalidate"):
            agent = _agent("peer-death-target-2", params)  # a fresh agent keeps the process "serving"
    _progress_until(agent, os.path.join(folder, "done"), watch)


def initiator(
    folder: str,
    mib: int,
    descs: int,
    op: str,
    timeout: float,
    cut: str,
    watch: float,
    warmup: int,
    params: str,
) -> None:
    agent = _agent("peer-death-initiator", params)
    buf = np.full(mib << 20, 7, np.uint8)
    reg = agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    _publish(os.path.join(folder, "initiator.meta"), agent.get_agent_metadata())
    peer = agent.add_remote_agent(_wait_file(os.path.join(folder, "target.meta")))
    peer = peer.decode() if isinstance(peer, bytes) else peer
    remote = int(_wait_file(os.path.join(folder, "target.addr")))
    size = buf.nbytes // descs
    offsets = np.arange(descs, dtype=np.int64) * size
    rows = lambda base: np.stack([base + offsets, np.full(descs, size), np.zeros(descs, np.int64)], 1)  # noqa: E731
    local = agent.get_xfer_descs(rows(buf.ctypes.data), "DRAM")
    far = agent.get_xfer_descs(rows(remote), "DRAM")
    handle = None
    for _ in range(2000):  # the first transfer connects; the peer may still be loading
        try:
            handle = agent.initialize_xfer(op.upper(), local, far, peer, b"")
            break
        except Exception:
            time.sleep(0.005)
    assert handle is not None
    for _ in range(warmup):  # whole transfers first: the target's request pool is recycled
        agent.transfer(handle)
        while agent.check_xfer_state(handle) == "PROC":
            time.sleep(0.0005)
    start = time.monotonic()
    agent.transfer(handle)
    _publish(os.path.join(folder, "posted"), b"")
    state = "PROC"
    while time.monotonic() - start < timeout and not os.path.exists(os.path.join(folder, "cut-initiator")):
        try:
            state = agent.check_xfer_state(handle)
        except Exception as exc:  # the peer died: NIXL reports the transfer failed
            state = f"error {type(exc).__name__}"
        if state != "PROC":
            break
        time.sleep(0.0005)
    elapsed = time.monotonic() - start
    _publish(os.path.join(folder, "initiator.state"), f"{state} {elapsed:.4f}".encode())
    if state == "PROC" and os.path.exists(os.path.join(folder, "stalled")):
        _cut(agent, peer, handle, reg, cut)
        _publish(os.path.join(folder, "initiator.cut"), b"")
        if cut in ("destroy", "invalidate"):
            agent = _agent("peer-death-initiator-2", params)
    _progress_until(agent, os.path.join(folder, "done"), watch)


def _spawn(role: str, folder: str, args: argparse.Namespace, env: dict[str, str]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, os.path.abspath(__file__), "--role", role, "--folder", folder]
    for key in ("mib", "descs", "op", "timeout", "cut", "watch", "warmup", "params", "dirty_heap"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def trial(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """One trial: returns the survivor's exit code and what the initiator saw."""
    with tempfile.TemporaryDirectory(prefix="peer-death-") as folder:
        if args.op == "write":
            _publish(os.path.join(folder, "write"), b"")
        tgt = _spawn("target", folder, args, env)
        ini = _spawn("initiator", folder, args, env)
        procs = {"target": tgt, "initiator": ini}
        try:
            _wait_file(os.path.join(folder, "posted"), 60)
            time.sleep(args.delay)
            event = args.event
            victim = "initiator" if event.endswith("initiator") else "target"
            survivor = "target" if victim == "initiator" else "initiator"
            if event.startswith("kill"):
                procs[victim].kill()
                procs[victim].wait()
            else:
                os.kill(procs[victim].pid, signal.SIGSTOP)
                _publish(os.path.join(folder, "stalled"), b"")
                if victim == "initiator":  # the target cuts the stalled writer/reader
                    time.sleep(args.timeout)
                    _publish(os.path.join(folder, "cut-target"), b"")
                    _wait_file(os.path.join(folder, "target.cut"), 30) if args.cut != "exit" else tgt.wait(30)
                else:  # the initiator times out and cuts
                    seen = _wait_file(os.path.join(folder, "initiator.state"), args.timeout + 30)
                    if not seen.startswith(b"PROC"):
                        pass  # finished (or failed) before the stop: nothing to cut
                    elif args.cut == "exit":
                        ini.wait(30)
                    else:
                        _wait_file(os.path.join(folder, "initiator.cut"), 30)
                os.kill(procs[victim].pid, signal.SIGCONT)
            time.sleep(0.05)
            _publish(os.path.join(folder, "done"), b"")
            # a stalled process resumed must survive too (unless it was the one that exited)
            watched = [survivor] if event.startswith("kill") else [victim, survivor]
            codes = {name: procs[name].wait(args.watch + 60) for name in watched}
            state_file = os.path.join(folder, "initiator.state")
            seen = Path(state_file).read_text() if os.path.exists(state_file) else ""
            crashed = [name for name, code in codes.items() if code is not None and code < 0]
            err = b"".join(procs[n].stderr.read() for n in crashed if procs[n].stderr is not None)
            return {
                "codes": codes,
                "crashed": crashed,
                "initiator": seen,
                "stderr": err.decode(errors="replace")[-6000:],
            }
        finally:
            for p in procs.values():
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                p.wait()
                if p.stderr:
                    p.stderr.close()


def bench(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """Time ``--trials`` fault-free transfers in one initiator/target pair (GB/s each)."""
    with tempfile.TemporaryDirectory(prefix="peer-death-") as folder:
        if args.op == "write":
            _publish(os.path.join(folder, "write"), b"")
        tgt = _spawn("target", folder, args, env)
        rates = []
        try:
            for _ in range(args.trials):
                for name in ("posted", "initiator.state"):
                    if os.path.exists(os.path.join(folder, name)):
                        os.remove(os.path.join(folder, name))
                ini = _spawn("initiator", folder, args, env)
                state = _wait_file(os.path.join(folder, "initiator.state"), 120).decode().split()
                rates.append(
                    round((args.mib << 20) / float(state[-1]) / 1e9, 3) if state[0] == "DONE" else 0.0
                )
                os.kill(ini.pid, signal.SIGKILL)  # no "done" file yet: the target must live on
                ini.wait()
                if ini.stderr:
                    ini.stderr.close()
                os.remove(os.path.join(folder, "initiator.meta"))
        finally:
            _publish(os.path.join(folder, "done"), b"")
            tgt.kill()
            tgt.wait()
            if tgt.stderr:
                tgt.stderr.close()
        return {"gbps": rates, "median_gbps": float(np.median(rates))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("run", "target", "initiator"), default="run")
    p.add_argument("--folder", default="")
    p.add_argument("--event", choices=EVENTS, default="stop-target")
    p.add_argument("--op", choices=("read", "write"), default="read")
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--descs", type=int, default=512)
    p.add_argument("--delay", type=float, default=0.02, help="seconds from the post to the event")
    p.add_argument("--timeout", type=float, default=2.0, help="stop-*: seconds before the cut")
    p.add_argument("--cut", choices=("destroy", "remove", "exit", "invalidate"), default="destroy")
    p.add_argument("--watch", type=float, default=3.0)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for both processes")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--dirty-heap", type=int, default=0, help="target: MiB of freed non-zero heap first")
    p.add_argument("--warmup", type=int, default=0, help="whole transfers before the one hit")
    p.add_argument("--params", default="", help="UCX backend parameters for both agents: k=v,k=v")
    args = p.parse_args()
    if args.role == "target":
        target(args.folder, args.mib, args.cut, args.watch, args.params, args.dirty_heap)
        return
    if args.role == "initiator":
        initiator(
            args.folder,
            args.mib,
            args.descs,
            args.op,
            args.timeout,
            args.cut,
            args.watch,
            args.warmup,
            args.params,
        )
        return
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in args.env)  # type: ignore[misc]
    settings = dict(kv.split("=", 1) for kv in args.env)
    if args.bench:
        print(
            json.dumps(
                {"op": args.op, "mib": args.mib, "descs": args.descs, "env": settings, **bench(args, env)}
            )
        )
        return
    results = [trial(args, env) for _ in range(args.trials)]
    crashes = [r for r in results if r["crashed"]]
    out = {"event": args.event, "op": args.op, "cut": args.cut, "delay": args.delay, "mib": args.mib}
    out.update(
        descs=args.descs, warmup=args.warmup, dirty_heap=args.dirty_heap, env=settings, params=args.params
    )
    out.update(trials=len(results), crashes=len(crashes), codes=[r["codes"] for r in results])
    out["initiator"] = [r["initiator"] for r in results]
    print(json.dumps(out), flush=True)
    for r in crashes[:1]:
        print(r["stderr"], file=sys.stderr)


if __name__ == "__main__":
    main()
