"""One process per rank: start a command's ranks as child processes and gather their JSON lines.

``akv prefill`` and ``akv decode`` without ``--tp-rank`` run their ranks this way (the
deployment shape: one process per GPU); each child is the same command with ``--tp-rank R``.
The parent forwards SIGTERM/SIGINT to its children and never leaves one behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import Process

from akv.testing import ajson_lines

__all__ = [
    "ChildFailed",
    "Interrupted",
    "RankProcess",
    "child_argv",
    "exit_status",
    "exit_with_parent",
    "rank_processes",
]


class ChildFailed(Exception):
    """A rank's process exited before it was ready; it said why on stderr. ``akv`` exits with
    the child's code and prints nothing more."""

    def __init__(self, code: int) -> None:
        super().__init__(f"a rank exited with {code}")
        self.code = code


class Interrupted(Exception):
    """This command was stopped by SIGTERM or SIGINT (and stopped its children): ``akv`` exits
    128 + the signal's number (143, 130)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def exit_status(code: int | None) -> str:
    """A child's exit code in words: ``exit 1``, ``killed by SIGKILL``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


@dataclass
class RankProcess:
    """One rank's child process and what it printed."""

    rank: int
    proc: Process
    ready: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    started: anyio.Event = field(default_factory=anyio.Event)
    exited: anyio.Event = field(default_factory=anyio.Event)
    code: int | None = None
    stopped: bool = False  # this process asked it to stop (its exit was expected)


def child_argv(argv: Sequence[str], *extra: str) -> list[str]:
    """``python -m akv ARGV EXTRA --json --parent-pid PID`` (later flags override earlier ones)."""
    return [sys.executable, "-m", "akv", *argv, *extra, "--json", "--parent-pid", str(os.getpid())]


def exit_with_parent(parent_pid: int | None) -> None:
    """In a rank process: stop (SIGTERM to itself) once the parent that started it is gone, so
    a killed ``akv prefill``/``akv decode`` leaves no rank behind."""
    if parent_pid is None:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="akv-parent-watch", daemon=True).start()


def _to_stderr(text: str) -> None:
    """A child's non-JSON line (a native library's output, such as ``UCX_PROTO_INFO=y``'s)
    goes to this process's stderr: its stdout stays JSON only."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


async def _watch(
    rp: RankProcess,
    on_line: Callable[[RankProcess, dict[str, Any]], None],
    on_exit: Callable[[RankProcess], None],
) -> None:
    try:
        async for msg in ajson_lines(rp.proc.stdout, _to_stderr):
            event = msg.get("event")
            if event == "ready":
                rp.ready = msg
                rp.started.set()
            elif event == "summary":
                rp.summary = msg
            on_line(rp, msg)
    finally:
        with anyio.CancelScope(shield=True):
            rp.code = await rp.proc.wait()
        rp.started.set()  # ready or not: nobody waits for a dead process
        rp.exited.set()
        on_exit(rp)


async def _stop(procs: Sequence[RankProcess]) -> None:
    """SIGTERM to every child still running, SIGKILL to any still there after a few seconds."""
    with anyio.CancelScope(shield=True):
        for rp in procs:
            rp.stopped = True
            if rp.proc.returncode is None:
                rp.proc.terminate()
        with anyio.move_on_after(5):
            for rp in procs:
                await rp.proc.wait()
        for rp in procs:
            if rp.proc.returncode is None:
                rp.proc.kill()
                await rp.proc.wait()


class rank_processes:
    """Start child commands (one per rank), watch their JSON lines; on exit stop any still running.

    ``start(rank, argv)`` starts one and returns once it printed its ready line (or died);
    ``start(rank, argv, ready=False)`` returns at once (for children that print no ready line).
    ``wait()`` returns once every child exited. SIGTERM/SIGINT to this process stop them all,
    and ``signalled`` then holds the signal's number. ``on_exit(rp)`` runs when a child exited
    (``rp.stopped`` tells whether this process had asked it to).
    """

    def __init__(
        self,
        on_line: Callable[[RankProcess, dict[str, Any]], None] = lambda rp, msg: None,
        on_exit: Callable[[RankProcess], None] = lambda rp: None,
    ) -> None:
        self.on_line = on_line
        self.on_exit = on_exit
        self.procs: list[RankProcess] = []
        self.signalled: int | None = None
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> rank_processes:
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        # On the way out: stop the children, then the watchers (signals stay handled till then).
        self._stack.callback(self._tg.cancel_scope.cancel)
        self._stack.push_async_callback(_stop, self.procs)
        self._tg.start_soon(self._signals)
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        suppress = await self._stack.__aexit__(*exc)
        if self.signalled is not None:  # every child is gone now: say we were interrupted
            raise Interrupted(self.signalled)
        return suppress

    def terminate(self) -> None:
        """Ask every running child to stop (SIGTERM: ranks still print their summaries)."""
        for rp in self.procs:
            rp.stopped = True
            if rp.proc.returncode is None:
                rp.proc.terminate()

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:  # a repeated signal changes nothing: they are stopping
                if self.signalled is None:
                    self.signalled = int(signum)
                    self.terminate()

    async def start(
        self, rank: int, argv: list[str], env: dict[str, str] | None = None, *, ready: bool = True
    ) -> RankProcess:
        proc = await anyio.open_process(argv, env={**os.environ, **(env or {})}, stderr=None)
        rp = RankProcess(rank, proc)
        self.procs.append(rp)
        self._tg.start_soon(_watch, rp, self.on_line, self.on_exit)
        if ready:
            await rp.started.wait()
        return rp

    async def wait(self) -> None:
        """Wait for every child to exit (and its last lines to be read)."""
        for rp in self.procs:
            await rp.exited.wait()
