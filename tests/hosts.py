"""Separate hosts on one machine, for tests: network namespaces on a private bridge.

Each host is a network namespace with loopback and one veth link (``akv0``, 10.77.0.i/24)
whose peer hangs on a bridge in a namespace of its own, so the root namespace is never
touched. Commands run as ``ip netns exec NS unshare --uts --pid --fork --kill-child
--mount-proc sh -c INIT ...``: a distinct hostname and PID namespace make UCX treat the peer
as another node and move data over TCP (inter-node), never cma or shared memory. The INIT
shell is pid 1 of the host's PID namespace; the command is its child::

    two = hosts(2)                      # a module-scoped fixture (scope="session" also works)

    def test_x(two):
        a, b = two
        p = a.popen([sys.executable, "-m", "akv", "prefill", ..., "--host", a.ip], env=env,
                    stdout=subprocess.PIPE, text=True)
        with b.delay(20):               # 20 ms each way on b's link; restored on exit
            ...
        p.terminate()                   # SIGTERM reaches the command (pid 1 would ignore it)
        p.kill()                        # SIGKILL: the whole PID namespace dies with it

Faults (``delay``, ``loss``, ``outage``) use ``tc netem`` on both ends of the host's link,
or, where the kernel lacks netem, iptables rules in the host's namespace (drops, and delay
through an NFQUEUE whose packets a small process releases after the delay). Faults persist for
the fixture's scope: use them as context managers or call ``restore()``.

Missing capabilities (not root, no ``ip netns``, ``unshare`` failing, neither netem nor
iptables) skip the test with a message naming them, or fail it where ``CI=true``. Namespaces are named
``akv-PID-K-...``; teardown kills every process started here and deletes the namespaces,
and a later session deletes those whose creating process is dead.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, overload

import pytest

__all__ = [
    "AKV",
    "IFACE",
    "SUBNET",
    "Host",
    "HostProcess",
    "HostsUnavailable",
    "Lines",
    "Network",
    "ProtoTable",
    "akv_env",
    "assert_inter_node_tcp",
    "create",
    "hosts",
    "missing_capability",
    "pidns_members",
    "proto_tables",
    "reap_stale",
    "reset_after_each",
    "unavailable",
]

SUBNET = "10.77.0"
IFACE = "akv0"  # the host side of each link, inside the host's namespace
_PREFIX = "akv-"
_NAME = re.compile(r"^akv-(\d+)-\d+-(?:br|h\d+)$")
_counter = itertools.count()
_live: set[Network] = set()

# The pid 1 of each host's PID namespace: names the host, runs the command as its child
# (stdin kept: an asynchronous list would get /dev/null), forwards catchable signals to it
# (the kernel drops those a namespace's init has no handler for) and exits with its status
# (a wait cut short by a forwarded signal says 128+N; the shell may reap the command meanwhile,
# so its status is asked once more: 127 means it was reported already).
_INIT = r"""hostname "$0" || exit 125
c=
for s in TERM INT HUP QUIT USR1 USR2; do trap "[ -n \"\$c\" ] && kill -$s \$c 2>/dev/null" $s; done
exec 3<&0
"$@" <&3 3<&- &
c=$!
exec 3<&-
while :; do wait $c 2>/dev/null; rc=$?; kill -0 $c 2>/dev/null || break; done
wait $c 2>/dev/null; r=$?; [ "$r" -ne 127 ] && rc=$r
exit $rc
"""


class HostsUnavailable(RuntimeError):
    """This machine cannot run the harness (the message names the missing capability)."""


def unavailable(reason: str) -> NoReturn:
    """Skip the test for a missing capability; under ``CI=true`` fail it instead."""
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"CI=true, and {reason}", pytrace=False)
    pytest.skip(reason)


def _run(
    argv: Sequence[str], *, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(argv), capture_output=True, text=True, input=input, timeout=30)
    if check and res.returncode != 0:
        raise HostsUnavailable(f"`{' '.join(argv)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def missing_capability() -> str | None:
    """What stops this machine from creating hosts, or None (cheap checks; creation tells the rest)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN"
    if not shutil.which("ip"):
        return "no `ip` command (apt-get install iproute2)"
    if not shutil.which("unshare"):
        return "no `unshare` command (util-linux)"
    res = _run(["ip", "netns", "list"], check=False)
    if res.returncode != 0:
        return f"`ip netns list` failed: {res.stderr.strip()}"
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _netns_list() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_netns(name: str) -> None:
    """Kill what still runs in namespace ``name`` (all started by this harness), then delete it."""
    for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run(["ip", "netns", "del", name], check=False)


def reap_stale() -> list[str]:
    """Delete this harness's namespaces left by sessions that died; returns their names."""
    stale = [n for n in _netns_list() if (m := _NAME.match(n)) and not _alive(int(m.group(1)))]
    for name in stale:
        _delete_netns(name)
    return stale


# -- processes inside a host ---------------------------------------------------------------


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


class HostProcess(subprocess.Popen[Any]):
    """A command inside a host. ``pid`` is the ``unshare`` process; ``init_pid`` the namespace's
    pid 1 (the INIT shell), ``terminate``/``send_signal`` reach the command through it, ``kill``
    SIGKILLs the whole PID namespace, and ``wait`` returns only once every process in it is gone.
    ``returncode``: the command's status, 128+N where it died of signal N, -9 after ``kill``.
    """

    init_pid: int | None = None
    pidns: str | None = None  # the PID namespace, as /proc/PID/ns/pid reads

    def _find_init(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.init_pid is None and self.poll() is None and time.monotonic() < deadline:
            kids = _children(self.pid)
            try:
                exe = os.readlink(f"/proc/{self.pid}/exe")
            except OSError:
                exe = ""
            if kids and os.path.basename(exe) == "unshare":
                self.init_pid = kids[0]
                with contextlib.suppress(OSError):
                    self.pidns = os.readlink(f"/proc/{kids[0]}/ns/pid")
                return
            time.sleep(0.002)

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self.kill()
            return
        if self.init_pid is None:
            self._find_init()
        if self.init_pid is not None and self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.init_pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.init_pid is None and self.poll() is None:
            self._find_init(timeout=1.0)
        if self.init_pid is not None:  # init's death kills every process of its namespace
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.init_pid, signal.SIGKILL)
        if self.poll() is None:  # and unshare --kill-child would SIGKILL init anyway
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pidns is not None and self.init_pid is not None:
            try:  # once init is a zombie or gone, the kernel has reaped the whole namespace
                with open(f"/proc/{self.init_pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                same = os.readlink(f"/proc/{self.init_pid}/ns/pid") == self.pidns
            except OSError:
                break
            if state in ("Z", "X") or not same:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.005)
        return code


def pidns_members(pidns: str) -> list[int]:
    """Live (non-zombie) processes, as root-namespace pids, in the PID namespace ``pidns``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != pidns:
                continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
        except OSError:
            continue
        out.append(int(entry))
    return out


# -- hosts and their links -------------------------------------------------------------------


@dataclass
class _Faults:
    delay_ms: float = 0.0
    loss: float = 0.0
    blackhole: bool = False

    def any(self) -> bool:
        return bool(self.delay_ms or self.loss or self.blackhole)


class _Restore:
    """What a fault method returns: already applied; leaving a ``with`` block restores the link."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def __enter__(self) -> Host:
        return self.host

    def __exit__(self, *exc: object) -> None:
        self.host.restore()


@dataclass(eq=False)
class Host:
    """One host: namespace ``ns``, hostname ``hostname``, address ``ip`` on link ``iface``."""

    network: Network
    index: int  # 1-based
    ns: str
    hostname: str
    ip: str
    iface: str = IFACE
    port: str = ""  # the bridge side of the link, in the bridge namespace
    _faults: _Faults = field(default_factory=_Faults)
    _link_down: bool = False
    _delayer: subprocess.Popen[str] | None = None

    def argv(self, argv: Sequence[str]) -> list[str]:
        """The full command line that runs ``argv`` inside this host."""
        kill = ["--kill-child"] if self.network.kill_child else []
        return [
            "ip", "netns", "exec", self.ns,
            "unshare", "--uts", "--pid", "--fork", *kill, "--mount-proc",
            "sh", "-c", _INIT, self.hostname, *argv,
        ]  # fmt: skip

    def popen(self, argv: Sequence[str], **kwargs: Any) -> HostProcess:
        """Start ``argv`` in this host; ``kwargs`` go to :class:`subprocess.Popen` (``env``
        replaces the environment, as there). Teardown kills it if it still runs."""
        proc = HostProcess(self.argv(argv), **kwargs)
        self.network._procs.append(proc)
        proc._find_init()
        return proc

    def run(
        self, argv: Sequence[str], timeout: float = 60, input: str | None = None, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` to completion in this host (stdout and stderr captured as text)."""
        if input is not None:
            kwargs["stdin"] = subprocess.PIPE
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        with self.popen(argv, **kwargs) as proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def exec_ns(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a network command (``tc``, ``nft``, ...) in this host's namespace, no PID namespace."""
        return _run(["ip", "netns", "exec", self.ns, *argv], check=check)

    # -- link faults

    def delay(self, ms: float) -> _Restore:
        """Delay every packet ``ms`` milliseconds in each direction of this host's link
        (round trips to it grow by 2*ms); 0 removes the delay."""
        self._faults.delay_ms = float(ms)
        self._apply()
        return _Restore(self)

    def loss(self, percent: float) -> _Restore:
        """Drop ``percent`` % of the packets in each direction of this host's link; 0 removes it."""
        self._faults.loss = float(percent)
        self._apply()
        return _Restore(self)

    def outage(self, mode: str = "blackhole") -> _Restore:
        """Cut this host's link. ``blackhole``: every packet silently dropped (a pulled cable on
        the far side: TCP retransmits, then times out); ``down``: the interface goes down (the
        host's own sends fail at once: ENETUNREACH)."""
        if mode == "blackhole":
            self._faults.blackhole = True
            self._apply()
        elif mode == "down":
            self.exec_ns("ip", "link", "set", "dev", self.iface, "down")
            self._link_down = True
        else:
            raise ValueError(f"outage mode {mode!r}: 'blackhole' or 'down'")
        return _Restore(self)

    def restore(self) -> None:
        """Remove every fault from this host's link."""
        if self._link_down:
            self.exec_ns("ip", "link", "set", "dev", self.iface, "up")
            self._link_down = False
        if self._faults.any() or self._delayer is not None:
            self._faults = _Faults()
            self._apply()

    def _apply(self) -> None:
        backend = self.network.fault_backend()
        if backend == "netem":
            self._apply_netem()
        else:
            self._apply_iptables()

    def _apply_netem(self) -> None:
        f = self._faults
        for ns, dev in ((self.ns, self.iface), (self.network.bridge_ns, self.port)):
            if not f.any():
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
                continue
            args = ["limit", "1000000"]
            if f.delay_ms:
                args += ["delay", f"{f.delay_ms:g}ms"]
            if f.blackhole or f.loss:
                args += ["loss", "100%" if f.blackhole else f"{f.loss:g}%"]
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem", *args])

    def _apply_iptables(self) -> None:
        f = self._faults
        want = f.delay_ms if f.delay_ms and not f.blackhole else 0.0
        # Queue rules go after the delayer is ready (an unbound queue drops) and before it stops.
        if self._delayer is not None and getattr(self._delayer, "delay_ms", None) != want:
            self._iptables(f, queue=False)
            self._stop_delayer()
        if want and self._delayer is None:
            self._start_delayer(want)
        self._iptables(f, queue=self._delayer is not None)

    def _iptables(self, f: _Faults, queue: bool) -> None:
        rules = []
        if f.blackhole:
            rules.append("-j DROP")
        elif f.loss:
            rules.append(f"-m statistic --mode random --probability {f.loss / 100:.6f} -j DROP")
        if queue:
            rules.append("-j NFQUEUE --queue-num 0")
        script = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]"]
        script += [f"-A OUTPUT -o {self.iface} {r}" for r in rules]
        script += [f"-A INPUT -i {self.iface} {r}" for r in rules]
        script.append("COMMIT\n")
        _run(["ip", "netns", "exec", self.ns, "iptables-restore"], input="\n".join(script))

    def _start_delayer(self, ms: float) -> None:
        argv = ["ip", "netns", "exec", self.ns, sys.executable, __file__, "nfqueue-delay", "0", f"{ms:g}"]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            proc.kill()
            proc.wait()
            raise HostsUnavailable(f"the NFQUEUE delayer did not start in {self.ns}: {line.strip()!r}")
        proc.delay_ms = ms  # type: ignore[attr-defined]
        self._delayer = proc

    def _stop_delayer(self) -> None:
        proc, self._delayer = self._delayer, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin:
                proc.stdin.close()  # EOF: release what is queued, then exit
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


class Network(Sequence[Host]):
    """``n`` hosts on one bridge; a sequence of :class:`Host` (``a, b = network``)."""

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 250:
            raise ValueError("1 to 250 hosts")
        self.prefix = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        self.bridge_ns = f"{self.prefix}-br"
        self.hosts: list[Host] = []
        self._procs: list[HostProcess] = []
        self._backend: str | None = None
        self._created: list[str] = []
        self.kill_child = "--kill-child" in _run(["unshare", "--help"], check=False).stdout
        _live.add(self)
        try:
            self._create(n)
        except BaseException:
            self.close()
            raise

    def _create(self, n: int) -> None:
        br = self.bridge_ns
        _run(["ip", "netns", "add", br])
        self._created.append(br)
        _run(["ip", "-n", br, "link", "set", "lo", "up"])
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        for i in range(1, n + 1):
            ns = f"{self.prefix}-h{i}"
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
            port = f"h{i}"
            host = Host(self, i, ns, f"h{i}-{self.prefix}", f"{SUBNET}.{i}", port=port)
            _run(["ip", "link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", br])
            _run(["ip", "-n", br, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", br, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{host.ip}/24", "dev", IFACE])
            _run(["ip", "-n", ns, "link", "set", IFACE, "up"])
            self.hosts.append(host)
        probe = self.hosts[0].run(
            ["sh", "-c", 'echo "$(hostname) $(readlink /proc/self/ns/pid)"'], timeout=30
        )
        got = probe.stdout.split()
        ours = os.readlink("/proc/self/ns/pid")
        if probe.returncode != 0 or len(got) != 2 or got[0] != self.hosts[0].hostname or got[1] == ours:
            raise HostsUnavailable(
                "`unshare --uts --pid --fork --mount-proc` does not give a host its own hostname and "
                f"PID namespace (got {probe.stdout.strip()!r}, exit {probe.returncode}: {probe.stderr.strip()})"
            )

    @overload
    def __getitem__(self, i: int) -> Host: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Host]: ...
    def __getitem__(self, i: int | slice) -> Host | Sequence[Host]:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def fault_backend(self) -> str:
        """``netem`` or ``iptables``: what the fault helpers use here; HostsUnavailable if neither."""
        if self._backend is None:
            br = self.bridge_ns
            probe = ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
            if shutil.which("tc") and _run(["ip", "netns", "exec", br, *probe], check=False).returncode == 0:
                _run(["ip", "netns", "exec", br, "tc", "qdisc", "del", "dev", "lo", "root"], check=False)
                self._backend = "netem"
            elif (
                shutil.which("iptables-restore")
                and _run(["ip", "netns", "exec", br, "iptables", "-S"], check=False).returncode == 0
            ):
                self._backend = "iptables"
            else:
                raise HostsUnavailable(
                    "no link faults: this kernel has no tc netem (CONFIG_NET_SCH_NETEM) and there is no "
                    "usable `iptables` for the NFQUEUE fallback (apt-get install iptables)"
                )
        return self._backend

    def require_faults(self) -> str:
        """The fault backend, or skip (fail under CI=true) naming what is missing."""
        try:
            return self.fault_backend()
        except HostsUnavailable as exc:
            unavailable(str(exc))

    def restore(self) -> None:
        """Remove every fault from every link."""
        for h in self.hosts:
            h.restore()

    def kill_all(self) -> None:
        """SIGKILL every process started on these hosts (and wait until they are gone)."""
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream:
                    with contextlib.suppress(OSError):
                        stream.close()

    def reset(self) -> None:
        """Back to a fresh network between tests: no processes, no faults."""
        self.kill_all()
        self.restore()

    def close(self) -> None:
        """Kill every process started here, stop delayers, delete the namespaces. Idempotent."""
        self.kill_all()
        for h in self.hosts:
            with contextlib.suppress(Exception):
                h._stop_delayer()
        for ns in reversed(self._created):
            _delete_netns(ns)
        self._created.clear()
        _live.discard(self)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for net in list(_live):
        net.close()


_stale_lock = threading.Lock()
_stale_done = False


def create(n: int) -> Network:
    """A network of ``n`` hosts, or skip (fail under CI=true) naming what this machine lacks."""
    global _stale_done
    reason = missing_capability()
    if reason:
        unavailable(reason)
    with _stale_lock:
        if not _stale_done:
            reap_stale()
            _stale_done = True
    try:
        return Network(n)
    except HostsUnavailable as exc:
        unavailable(str(exc))


def hosts(n: int, *, scope: str = "module") -> Any:
    """A pytest fixture of ``n`` hosts (a :class:`Network`), created once per ``scope``::

    two = hosts(2)  # at module level; tests then take ``two`` as an argument

    Processes and faults outlive a test unless it (or a wrapping fixture) calls ``reset()``.
    """

    @pytest.fixture(scope=scope)  # type: ignore[call-overload]
    def _hosts() -> Iterator[Network]:
        net = create(n)
        try:
            yield net
        finally:
            net.close()

    return _hosts


def reset_after_each(network: str) -> Any:
    """A pytest fixture yielding the `hosts` fixture named ``network`` to one test, and resetting
    it after the test: no process left running, no fault left on a link::

        two = hosts(2)
        ab = reset_after_each("two")  # tests take ``ab``
    """

    @pytest.fixture
    def _reset(request: pytest.FixtureRequest) -> Iterator[Network]:
        net: Network = request.getfixturevalue(network)
        try:
            yield net
        finally:
            net.reset()

    return _reset


# -- akv processes on hosts -----------------------------------------------------------------

AKV = [sys.executable, "-m", "akv"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def akv_env(**extra: str) -> dict[str, str]:
    """This environment for ``akv`` inside a host: this checkout first on PYTHONPATH, NIXL quiet."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.update(extra)
    return env


class Lines:
    """Reads a text stream in a thread (so a chatty process never blocks on a full pipe)."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.closed = False
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        with stream:  # closed at EOF: a finished process leaves no open pipe behind
            for line in stream:
                with self._cond:
                    self.lines.append(line)
                    self._cond.notify_all()
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def json(self) -> list[dict[str, Any]]:
        """The JSON lines read so far."""
        with self._cond:
            return [json.loads(x) for x in self.lines if x.startswith("{")]

    def wait_json(self, event: str, timeout: float = 60) -> dict[str, Any]:
        """The first JSON line with this ``event``; TimeoutError, or EOFError if the stream ends."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for msg in self.json():  # the condition's lock is reentrant
                    if msg.get("event") == event:
                        return msg
                if self.closed:
                    raise EOFError(f"stream ended before a {event!r} line: {''.join(self.lines)[-2000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {event!r} line in {timeout}s: {''.join(self.lines)[-2000:]}")
                self._cond.wait(left)

    def text(self, timeout: float | None = None) -> str:
        """Everything read; with ``timeout``, first wait that long for the stream to end."""
        self._thread.join(timeout)
        with self._cond:
            return "".join(self.lines)


# -- what UCX_PROTO_INFO=y prints ------------------------------------------------------------

_PROTO_LINE = re.compile(r"^(\[[\d.]+\] \[[^\]]+\])\s+([|+].*)$")
_PROTO_TITLE = re.compile(r"^(?P<ep>.*\S) (?P<scope>self|intra-node|inter-node|\S+) cfg#(?P<cfg>\d+)$")


@dataclass
class ProtoTable:
    """One table of ``UCX_PROTO_INFO=y``: the endpoint, its scope (``self``, ``intra-node``,
    ``inter-node``), the operation, and rows of (message size range, protocol, transport)."""

    ep: str
    scope: str
    operation: str
    rows: list[tuple[str, str, str]]


def proto_tables(text: str) -> list[ProtoTable]:
    """The protocol tables UCX printed in ``text`` (stdout or stderr of a process)."""
    lines: dict[str, list[str]] = {}
    for raw in text.splitlines():
        m = _PROTO_LINE.match(raw.strip())
        if m:
            lines.setdefault(m.group(1), []).append(m.group(2))
    tables = []
    for body in lines.values():  # one table per timestamp and thread
        cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in body if ln.startswith("|")]
        i = 0
        while i < len(cells):
            title = _PROTO_TITLE.match(cells[i][0]) if len(cells[i]) == 1 else None
            if not title or i + 1 >= len(cells):
                i += 1
                continue
            table = ProtoTable(title["ep"], title["scope"], cells[i + 1][0], [])
            i += 2
            if i < len(cells) and cells[i][:1] == ["Range"]:
                i += 1
            while i < len(cells) and len(cells[i]) >= 3:
                table.rows.append((cells[i][0], cells[i][1], " ".join(cells[i][2:])))
                i += 1
            tables.append(table)
    return tables


SHARED_MEMORY = ("cma", "sysv", "posix", "xpmem", "knem")


def assert_inter_node_tcp(text: str, side: str = "") -> list[ProtoTable]:
    """Assert that the UCX protocol tables in ``text`` (printed under ``UCX_PROTO_INFO=y``) are all
    inter-node over TCP on the hosts' link, apart from an agent's own ``self`` endpoint: no
    intra-node protocol, no shared-memory transport, and remote reads by ``tcp/akv0`` alone.
    Returns those tables."""
    tables = [t for t in proto_tables(text) if t.scope != "self"]
    assert tables, f"{side}: UCX_PROTO_INFO printed no protocol table:\n{text[-3000:]}"
    assert {t.scope for t in tables} == {"inter-node"}, (side, {(t.scope, t.operation) for t in tables})
    for t in tables:
        assert t.rows, (side, t)
        for _size, _proto, transport in t.rows:
            assert f"tcp/{IFACE}" in transport, (side, t)
            assert not any(shm in transport for shm in SHARED_MEMORY), (side, t)
    return tables


# -- the NFQUEUE delayer (``python hosts.py nfqueue-delay QUEUE MS``, in a host's namespace) --

_NFNL_SUBSYS_QUEUE = 3
_MSG_PACKET, _MSG_VERDICT_BATCH, _MSG_CONFIG = 0, 3, 2
_NLM_F_REQUEST, _NLM_F_ACK = 1, 4
_NLMSG_ERROR = 2


def _nla(kind: int, data: bytes) -> bytes:
    size = 4 + len(data)
    return struct.pack("=HH", size, kind) + data + b"\0" * (-size % 4)


def _nfq_msg(msg: int, queue: int, attrs: Sequence[bytes], flags: int, seq: int) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + b"".join(attrs)
    return struct.pack("=IHHII", 16 + len(body), (_NFNL_SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body


def _nl_messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    off = 0
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if length < 16:
            return
        yield kind, data[off + 16 : off + length]
        off += (length + 3) & ~3


def _nfqueue_delay(queue: int, delay_ms: float) -> int:
    """Hold each packet of NFQUEUE ``queue`` for ``delay_ms``, then accept it (FIFO, batched)."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
    s.bind((0, 0))
    seq = itertools.count(1)

    def config(*attrs: bytes) -> None:
        s.send(_nfq_msg(_MSG_CONFIG, queue, attrs, _NLM_F_REQUEST | _NLM_F_ACK, next(seq)))
        for kind, payload in _nl_messages(s.recv(65536)):
            if kind == _NLMSG_ERROR and struct.unpack_from("=i", payload)[0] != 0:
                raise OSError(-struct.unpack_from("=i", payload)[0], "nfqueue config refused")

    config(_nla(1, struct.pack("!BxH", 1, 0)))  # NFQA_CFG_CMD: BIND
    config(_nla(2, struct.pack("!IB", 0, 1)))  # NFQA_CFG_PARAMS: copy metadata only
    config(_nla(3, struct.pack("!I", 1 << 20)))  # NFQA_CFG_QUEUE_MAXLEN
    config(_nla(4, struct.pack("!I", 4)), _nla(5, struct.pack("!I", 4)))  # MASK, FLAGS: GSO
    print("ready", flush=True)
    delay = delay_ms / 1000
    pending: deque[tuple[float, int]] = deque()

    def accept_upto(packet_id: int) -> None:
        verdict = _nla(2, struct.pack("!II", 1, packet_id))  # NFQA_VERDICT_HDR: NF_ACCEPT
        s.send(_nfq_msg(_MSG_VERDICT_BATCH, queue, [verdict], _NLM_F_REQUEST, next(seq)))

    def receive(block: bool) -> None:
        while True:
            try:
                data = s.recv(1 << 20, 0 if block else socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            now = time.monotonic()
            for kind, payload in _nl_messages(data):
                if kind == (_NFNL_SUBSYS_QUEUE << 8) | _MSG_PACKET:
                    off = 4
                    while off + 4 <= len(payload):
                        size, attr = struct.unpack_from("=HH", payload, off)
                        if attr & 0x3FFF == 1:  # NFQA_PACKET_HDR
                            pending.append((now + delay, struct.unpack_from("!I", payload, off + 4)[0]))
                            break
                        off += (size + 3) & ~3
            block = False

    stdin = sys.stdin.fileno()
    while True:
        timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else None
        ready, _, _ = select.select([s, stdin], [], [], timeout)
        if s in ready:
            receive(block=False)
        if stdin in ready and not os.read(stdin, 4096):  # EOF: release everything and go
            receive(block=False)
            if pending:
                accept_upto(pending[-1][1])
            return 0
        now, last = time.monotonic(), None
        while pending and pending[0][0] <= now:
            last = pending.popleft()[1]
        if last is not None:
            accept_upto(last)


if __name__ == "__main__" and sys.argv[1:2] == ["nfqueue-delay"]:
    sys.exit(_nfqueue_delay(int(sys.argv[2]), float(sys.argv[3])))
