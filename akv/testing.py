"""Helpers for tests, examples, demos and benchmarks: deterministic KV contents, filling and
verifying caches, announced requests, and ``akv`` processes with their JSON lines.

Contents: byte ``i`` of the element at (layer, K/V, global head, token of the request, dim)
of request ``seed`` gets a hash of those global indices, so any misplaced head, token,
layer, K/V plane or block shows up when a decode rank compares its cache with
[`expected_blocks`][akv.testing.expected_blocks]. torch is imported only by the functions that touch tensors.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from akv import sharding
from akv.errors import AkvError, ConfigError
from akv.geometry.spec import KVSpec
from akv.protocol.messages import RequestInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "EtcdServer",
    "ProgressBar",
    "ajson_lines",
    "etcd_binary",
    "expected_blocks",
    "fetch_requests",
    "fill_request",
    "json_lines",
    "load_requests",
    "make_requests",
    "save_requests",
    "spawn_prefill",
    "spawn_registrant",
    "spec_argv",
    "verify_request",
]


def expected_blocks(
    spec: KVSpec,
    tp_rank: int,
    tp_size: int,
    region: int,
    seed: int,
    positions: npt.ArrayLike,
) -> npt.NDArray[np.uint8]:
    """The expected bytes of some blocks of one request in one region of one rank.

    Args:
        spec: the cache description.
        tp_rank: the rank, in ``[0, tp_size)``.
        tp_size: its engine's TP size.
        region: the region index (layer-major, K before V).
        seed: the request's seed (its contents differ per seed).
        positions: block indices within the request (0 for its first block).

    Returns:
        an array of shape ``(len(positions), block_bytes)``, in the rank's own layout.
    """
    pos = np.asarray(positions, dtype=np.int64)
    seed &= 0xFFFF
    nbytes = spec.head_dim * spec.element_size
    if spec.kind == "mla":
        layer, kvs, heads = region, np.zeros(1, np.int64), np.zeros(1, np.int64)
    else:
        held = sharding.held_heads(tp_rank, tp_size, spec.kv_heads)
        heads = np.arange(held.start, held.stop, dtype=np.int64)
        if spec.joint_kv:
            layer, kvs = region, np.arange(2, dtype=np.int64)
        else:
            layer, kvs = region // 2, np.array([region % 2], dtype=np.int64)
    tokens = np.arange(spec.block_size, dtype=np.int64)
    byte = np.arange(nbytes, dtype=np.int64)
    # Axes: (pos, kv, head, token, byte); NHD swaps head and token.
    key = (
        (
            ((seed * 1_000_003 + layer) * 2 + kvs[None, :, None, None, None]) * 4096
            + heads[None, None, :, None, None]
        )
        * 65_536
        + pos[:, None, None, None, None] * spec.block_size
        + tokens[None, None, None, :, None]
    ) * 65_536 + byte[None, None, None, None, :]
    mixed = _mix(key)
    out = mixed.astype(np.uint8)
    if spec.layout == "NHD" and spec.kind == "dense":
        out = out.transpose(0, 1, 3, 2, 4)
    if not spec.joint_kv:
        out = out[:, 0]
    return np.ascontiguousarray(out).reshape(len(pos), -1)


def _mix(key: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    x = key.astype(np.uint64)
    x ^= x >> np.uint64(29)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(32)
    out: npt.NDArray[np.uint64] = x >> np.uint64(24)
    return out


# -- filling and verifying caches ---------------------------------------------------------


def _block_view(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    import torch

    return t.view(torch.uint8).view(num_blocks, -1)


def fill_request(
    kv: Sequence[torch.Tensor], spec: KVSpec, rank: int, size: int, block_ids: Sequence[int], seed: int
) -> None:
    """Write request ``seed``'s deterministic contents into ``block_ids`` of one rank's cache:
    ``kv`` of rank ``rank`` of ``size``, described by ``spec``."""
    import torch

    idx = torch.as_tensor(list(block_ids))
    positions = np.arange(len(block_ids))
    for region, t in enumerate(kv):
        _block_view(t, spec.num_blocks)[idx] = torch.from_numpy(
            expected_blocks(spec, rank, size, region, seed, positions)
        )


def verify_request(
    kv: Sequence[torch.Tensor],
    spec: KVSpec,
    rank: int,
    size: int,
    block_ids: Sequence[int],
    seed: int,
    positions: npt.ArrayLike,
) -> bool:
    """True if ``block_ids`` of one rank's cache (``kv`` of rank ``rank`` of ``size``, described
    by ``spec``) hold request ``seed``'s blocks at ``positions`` (block indices within the request)."""
    idx = list(block_ids)
    pos = np.asarray(positions)
    for region, t in enumerate(kv):
        got = _block_view(t, spec.num_blocks)[idx].cpu().numpy()
        if not np.array_equal(got, expected_blocks(spec, rank, size, region, seed, pos)):
            return False
    return True


def make_requests(spec: KVSpec, count: int, per_request: int, seed: int) -> list[RequestInfo]:
    """``count`` deterministic requests of ``per_request`` blocks each, over distinct, shuffled
    (fragmented) blocks of ``spec``'s pool; ``seed`` picks the ids and blocks.

    Raises [`ConfigError`][akv.errors.ConfigError] if the pool is too small.
    """
    if count * per_request > spec.num_blocks:
        raise ConfigError(
            f"{count} requests x {per_request} blocks exceed the {spec.num_blocks}-block pool: "
            "raise --blocks or lower --requests/--blocks-per-request"
        )
    order = np.random.default_rng(seed).permutation(spec.num_blocks)
    return [
        RequestInfo(
            request_id=f"req-{seed}-{i}",
            block_ids=order[i * per_request : (i + 1) * per_request].tolist(),
            seed=i + 1,
        )
        for i in range(count)
    ]


def load_requests(path: str) -> list[RequestInfo]:
    """Requests from a JSON file (a list of RequestInfo objects); ConfigError if unreadable.

    Args:
        path: the JSON file (as written by `save_requests`).
    """
    import msgspec

    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=list[RequestInfo])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"cannot read requests from {path!r}: {exc}") from None


def save_requests(path: str, requests: Sequence[RequestInfo]) -> None:
    """Write requests for `load_requests`.

    Args:
        path: the JSON file to write.
        requests: the requests.
    """
    import msgspec

    with open(path, "wb") as f:
        f.write(msgspec.json.encode(list(requests)))


# -- processes and their JSON lines -------------------------------------------------------


def spec_argv(spec: KVSpec) -> list[str]:
    """The ``akv`` model flags that describe ``spec``."""
    argv = [
        "--kv-heads", str(spec.kv_heads),
        "--layers", str(spec.layers),
        "--blocks", str(spec.num_blocks),
        "--block-size", str(spec.block_size),
        "--head-dim", str(spec.head_dim),
        "--dtype", spec.dtype,
        "--layout", spec.layout,
    ]  # fmt: skip
    if spec.kind == "mla":
        argv.append("--mla")
    if spec.joint_kv:
        argv.append("--joint-kv")
    return argv


def json_lines(stream: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects in ``stream``, the lines a CLI process prints (other lines are skipped)."""
    for line in stream:
        if line.startswith("{"):
            yield dict(json.loads(line))


async def ajson_lines(
    stream: Any, other: Callable[[str], None] | None = None
) -> AsyncIterator[dict[str, Any]]:
    """[`json_lines`][akv.testing.json_lines] for ``stream``, an anyio byte stream (a process's
    stdout); ``other`` gets every other non-empty line (a native library's output)."""
    import anyio
    from anyio.streams.buffered import BufferedByteReceiveStream

    buf = BufferedByteReceiveStream(stream)
    while True:
        try:
            line = await buf.receive_until(b"\n", 1 << 20)
        except (anyio.IncompleteRead, anyio.EndOfStream):
            return
        text = line.decode(errors="replace").strip()
        if text.startswith("{"):
            yield dict(json.loads(text))
        elif text and other is not None:
            other(text)


def spawn_prefill(*argv: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """Start ``akv prefill ARGV --json`` in another process; returns it and its endpoint.

    ``argv`` are ``akv prefill`` flags; ``env`` adds to this process's environment.

    Raises [`AkvError`][akv.errors.AkvError] if the process exits before printing its ``ready`` line.
    """
    cmd = [sys.executable, "-m", "akv", "prefill", *argv, "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    for msg in json_lines(proc.stdout or iter(())):
        if msg.get("event") == "ready":
            return proc, str(msg["endpoint"])
    code = proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    raise AkvError(f"akv prefill exited ({code}) before it was ready: {' '.join(cmd)}")


async def fetch_requests(
    endpoint: str, spec: KVSpec, secret: str | None, engine_id: str
) -> list[RequestInfo]:
    """Ask the prefill engine at ``endpoint`` (any engine address: its rank 0 answers) which
    requests it exposed (the demo's stand-in for a router), as decode engine ``engine_id``
    with the model ``spec`` and ``secret``."""
    from akv.protocol.address import BootstrapAddress, EtcdAddress, parse_engine_address
    from akv.protocol.handshake import resolve_secret
    from akv.protocol.messages import Hello
    from akv.runtime.control import client_handshake

    address = parse_engine_address(endpoint)
    if isinstance(address, BootstrapAddress):
        rank0 = address.endpoint
    elif isinstance(address, EtcdAddress):
        from akv.runtime.discovery import EtcdRegistry

        async with EtcdRegistry(address.etcd) as registry:
            rank0 = (await registry.resolve(address.engine_id, need=[0]))[0].endpoint
    else:
        rank0 = address.endpoints[0]

    hello = Hello(
        engine_id=engine_id,
        tp_rank=0,
        tp_size=1,
        spec=spec,
        compat=spec.compat_hash(),
        nonce=secrets.token_bytes(16),
    )
    result = await client_handshake(
        rank0,
        hello,
        secret=resolve_secret(secret),
        choose_ranks=lambda ch: [],
        list_requests=True,
    )
    return list(result.requests or [])


class ProgressBar:
    """A one-line progress bar on stderr, drawn only where ``enabled``: its ``label``, then a
    bar ``width`` characters wide."""

    def __init__(self, enabled: bool, label: str = "pulling", width: int = 30) -> None:
        self.enabled = enabled
        self.label = label
        self.width = width

    def update(self, done: int, total: int, note: str = "") -> None:
        """Redraw with ``done`` of ``total``."""
        if not self.enabled or total <= 0:
            return
        filled = self.width * done // total
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r\033[K  {self.label} [{bar}] {done}/{total} {note}".rstrip() + " ")
        sys.stderr.flush()

    def close(self) -> None:
        """End the line."""
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def etcd_binary() -> str | None:
    """The etcd server binary: ``$AKV_ETCD``, else ``etcd`` on PATH (Debian's etcd-server), else None."""
    import shutil

    found = os.environ.get("AKV_ETCD") or shutil.which("etcd") or shutil.which("etcd", path="/usr/bin")
    return found if found and os.access(found, os.X_OK) else None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """A single-node etcd on free loopback ports with its own data dir (tests, benchmarks).

    Short heartbeat and election settings make etcd's minimum lease TTL 1 s. The ports stay
    the same across `stop` and `start`, so clients see the same endpoint come back.

    Args:
        data_dir: etcd's data directory.
        binary: the etcd executable (default: `etcd_binary()`).
    """

    def __init__(self, data_dir: str, *, binary: str | None = None) -> None:
        found = binary or etcd_binary()
        if found is None:
            raise ConfigError("no etcd binary: install etcd-server (bash scripts/setup.sh) or set AKV_ETCD")
        self.binary = found
        self.data_dir = data_dir
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """The client endpoint, ``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 15.0) -> None:
        """Start etcd (keeping its data) and wait until it serves requests."""
        import time
        import urllib.request

        if self.proc is not None and self.proc.poll() is None:
            return
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        os.makedirs(self.data_dir, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        with open(os.path.join(self.data_dir, "etcd.log"), "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--name=akv-test",
                    f"--data-dir={os.path.join(self.data_dir, 'member-data')}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=akv-test={peer}",
                    "--heartbeat-interval=50",
                    "--election-timeout=500",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AkvError(f"etcd exited ({self.proc.returncode}); see {self.data_dir}/etcd.log")
            try:
                with opener.open(f"{client}/health", timeout=1) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise AkvError(f"etcd did not become healthy within {timeout} s")

    def stop(self, *, wipe: bool = False) -> None:
        """Stop etcd (SIGTERM, then SIGKILL); ``wipe`` also deletes its data (a lost cluster)."""
        import shutil

        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if wipe:
            shutil.rmtree(os.path.join(self.data_dir, "member-data"), ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_REGISTRANT = """
import sys, anyio
from akv.runtime.discovery import EtcdRegistry, RankRecord
etcd, ttl, engine, rank, size, endpoint, backend = sys.argv[1:8]
async def main():
    async with EtcdRegistry(etcd, ttl=float(ttl)) as registry, anyio.create_task_group() as tg:
        record = RankRecord.create(engine, int(rank), int(size), endpoint)
        ok = await tg.start(registry.keep_registered, record)
        print("registered" if ok else "pending", flush=True)
anyio.run(main, backend=backend)
"""


def spawn_registrant(
    etcd: str,
    engine_id: str,
    tp_rank: int,
    tp_size: int,
    endpoint: str,
    *,
    ttl: float,
    backend: str = "asyncio",
) -> subprocess.Popen[str]:
    """A process that keeps one rank registered in etcd (a stand-in for a prefill rank to kill).

    Returns once the rank is registered; raises `AkvError` if its first try failed.

    Args:
        etcd: the etcd endpoint(s).
        engine_id: the engine to register under.
        tp_rank: the rank.
        tp_size: the engine's TP size.
        endpoint: the control endpoint to register.
        ttl: the lease TTL in seconds.
        backend: the anyio backend the process runs on.
    """
    import akv

    root = os.path.dirname(os.path.dirname(os.path.abspath(akv.__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    args = [etcd, str(ttl), engine_id, str(tp_rank), str(tp_size), endpoint, backend]
    proc = subprocess.Popen(
        [sys.executable, "-c", _REGISTRANT, *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    if proc.stdout is None:  # pragma: no cover - Popen with stdout=PIPE always has one
        raise AkvError("the registrant process has no stdout")
    line = proc.stdout.readline().strip()
    if line != "registered":
        proc.kill()
        raise AkvError(f"registrant did not register ({line!r}, exit {proc.wait()})")
    return proc
