"""Helpers for tests, examples, demos and benchmarks: deterministic KV contents, filling and
verifying caches, announced requests, and ``akv`` processes with their JSON lines.

Contents: byte ``i`` of the unit at (group, model layer, component, global unit, token of
the request) of request ``seed`` gets a hash of those global indices, so any misplaced
group, layer, component (K/V plane, conv piece, state), unit, token or block shows up when
a decode rank compares its cache with
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
    "local_counts",
    "make_requests",
    "save_requests",
    "spawn_prefill",
    "spawn_registrant",
    "spec_argv",
    "stop_prefill",
    "verify_request",
]


def _seed_base(seed: int, group: int, layer: int, component: int) -> int:
    """A 64-bit base per (request, group, model layer, component); units, tokens and bytes add to it."""
    x = (((seed & 0xFFFF) * 64 + group) * 4096 + layer) * 64 + component
    x = (x * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _segments(
    spec: Any, tp_rank: int, tp_size: int, region: int, seed: int, positions: npt.ArrayLike
) -> tuple[Any, list[tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8], npt.NDArray[np.int64]]]]:
    """One region's expected contents for blocks at ``positions``: the group, and per (component,
    layer) placed there: byte offsets relative to the block's start (add ``block * stride``),
    the bytes ``(len(positions), k)`` and each byte's token position (``-1`` for state groups)."""
    from akv.geometry.cache import as_cache
    from akv.geometry.layout import rank_layout

    cache = as_cache(spec)
    layout = rank_layout(cache, tp_rank, tp_size)
    starts = np.cumsum([0] + [len(x.shapes) for x in layout.groups])
    if not 0 <= region < starts[-1]:
        raise ConfigError(f"region {region} is outside the {len(layout.shapes)} regions of rank {tp_rank}")
    gi = int(np.searchsorted(starts, region, side="right")) - 1
    gl = layout.groups[gi]
    g = gl.group
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    tok = np.arange(g.block_size if g.tokens else 1, dtype=np.int64)
    where = (pos[:, None] * g.block_size + tok[None, :]) if g.tokens else np.full((pos.size, 1), -1, np.int64)
    out = []
    for ci, p in enumerate(gl.placements):
        units = np.arange(p.units.start, p.units.stop, dtype=np.int64)[:, None, None]
        t = tok[None, :, None]
        b = np.arange(p.run, dtype=np.int64)[None, None, :]
        for i, r in enumerate(p.regions):
            if r != region:
                continue
            off = (p.offset + i * p.layer + (units - units[0, 0, 0]) * p.unit + t * p.token + b).reshape(-1)
            key = (
                np.uint64(_seed_base(seed, gi, g.layers[i], ci))
                + (units.astype(np.uint64) << np.uint64(40))
                + (np.maximum(where, 0)[:, None, :, None].astype(np.uint64) << np.uint64(20))
                + b.astype(np.uint64)
            )
            values = _mix(key).astype(np.uint8).reshape(pos.size, -1)
            tokens = np.broadcast_to(where[:, None, :, None], key.shape).reshape(pos.size, -1)
            out.append((off, values, tokens))
    block = next(p.block for p in gl.placements if region in p.regions)
    return (g, block), out


def _region_pattern(
    spec: Any, tp_rank: int, tp_size: int, region: int, seed: int, positions: npt.ArrayLike
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Expected bytes of some blocks of one region laid out block by block, and the token
    position of each byte (``-1`` for state groups), both ``(len(positions), block_bytes)``.
    Only for layouts whose blocks are contiguous (not an axis order with blocks inside)."""
    (group, block), segs = _segments(spec, tp_rank, tp_size, region, seed, positions)
    if any(int(off.max()) >= block for off, _, _ in segs):
        raise ConfigError(
            f"group {group.name!r} (layout {group.layout!r}) does not keep each block contiguous: "
            "use fill_request / verify_request, which address bytes directly"
        )
    n = np.asarray(positions).size
    values = np.zeros((n, block), dtype=np.uint8)
    tokens = np.full((n, block), -1, dtype=np.int64)
    for off, v, t in segs:
        values[:, off] = v
        tokens[:, off] = t
    return values, tokens


def expected_blocks(
    spec: Any,
    tp_rank: int,
    tp_size: int,
    region: int,
    seed: int,
    positions: npt.ArrayLike,
) -> npt.NDArray[np.uint8]:
    """The expected bytes of some blocks of one request in one region of one rank.

    Args:
        spec: the cache description ([`KVSpec`][akv.KVSpec] or [`CacheSpec`][akv.CacheSpec]).
        tp_rank: the rank, in ``[0, tp_size)``.
        tp_size: its engine's TP size.
        region: the region index, as [`allocate_kv_cache`][akv.allocate_kv_cache] orders them.
        seed: the request's seed (its contents differ per seed).
        positions: block indices within the request's sequence (0 for its first block).

    Returns:
        an array of shape ``(len(positions), block_bytes)``, in the rank's own layout.
    """
    return _region_pattern(spec, tp_rank, tp_size, region, seed, positions)[0]


def _mix(key: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = key.astype(np.uint64)
    x ^= x >> np.uint64(29)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(32)
    out: npt.NDArray[np.uint64] = x >> np.uint64(24)
    return out


# -- filling and verifying caches ---------------------------------------------------------


def _groups(spec: Any, block_ids: Any) -> list[tuple[int, Any, list[int], Any]]:
    """(group index, group, its ids, its region indices) for every group given ids."""
    from akv.geometry.cache import as_cache
    from akv.geometry.layout import group_layout

    cache = as_cache(spec)
    per = cache.per_group(block_ids, "block_ids")
    out, first = [], 0
    for gi, (g, ids) in enumerate(zip(cache.groups, per, strict=True)):
        n = len(group_layout(g, 0, 1).shapes)  # region count: the same on every rank
        out.append((gi, g, ids.tolist(), range(first, first + n)))
        first += n
    return out


def _positions(group: Any, count: int, num_tokens: int | None) -> npt.NDArray[np.int64]:
    """Sequence block positions of a group's ``count`` ids (the last blocks of the sequence)."""
    if not group.tokens:
        return np.zeros(count, dtype=np.int64)
    total = -(-num_tokens // group.block_size) if num_tokens else count
    return np.arange(total - count, total, dtype=np.int64)


def _placed(
    tensor: torch.Tensor, ids: list[int], spec: Any, rank: int, size: int, region: int, seed: int, pos: Any
) -> Iterator[tuple[torch.Tensor, torch.Tensor, npt.NDArray[np.uint8], npt.NDArray[np.int64]]]:
    """Per (component, layer) in one region: its bytes (flat), the byte indices of blocks ``ids``,
    and the expected bytes and their token positions (see `_segments`)."""
    import torch

    flat = tensor.view(torch.uint8).reshape(-1)
    (_, block), segs = _segments(spec, rank, size, region, seed, pos)
    for off, values, tok in segs:
        idx = np.asarray(ids, dtype=np.int64)[:, None] * block + off[None, :]
        yield flat, torch.from_numpy(idx.ravel()).to(flat.device), values, tok


def fill_request(
    kv: Sequence[torch.Tensor],
    spec: Any,
    rank: int,
    size: int,
    block_ids: Any,
    seed: int,
    num_tokens: int | None = None,
) -> None:
    """Write request ``seed``'s deterministic contents into ``block_ids`` of one rank's cache:
    ``kv`` of rank ``rank`` of ``size``, described by ``spec``.

    ``block_ids``: flat for a one-group cache, else ``{group: ids}``; each list names the last
    blocks of a sequence of ``num_tokens`` tokens (default: the ids fill whole blocks).
    """
    import torch

    for _, g, ids, regions in _groups(spec, block_ids):
        if not ids:
            continue
        pos = _positions(g, len(ids), num_tokens)
        for region in regions:
            for flat, idx, values, _tok in _placed(kv[region], ids, spec, rank, size, region, seed, pos):
                flat[idx] = torch.from_numpy(values.ravel()).to(flat.device)


def verify_request(
    kv: Sequence[torch.Tensor],
    spec: Any,
    rank: int,
    size: int,
    block_ids: Any,
    seed: int,
    positions: npt.ArrayLike | None = None,
    *,
    num_tokens: int | None = None,
) -> bool:
    """True if one decode rank's cache (`kv` of rank `rank` of `size`, described by `spec`)
    holds what a pull of request ``seed`` had to read.

    With ``positions`` (one-group caches): the whole blocks ``block_ids`` hold the request's
    blocks at ``positions``. Without: ``block_ids`` (flat or ``{group: ids}``) name the last
    blocks of a ``num_tokens``-token sequence, and every token a pull reads (each group's own
    prefix hit; sliding groups: only the window; state groups: the slot) must match.
    """

    for _, g, ids, regions in _groups(spec, block_ids):
        if not ids:
            continue
        if positions is not None:
            pos = np.asarray(positions, dtype=np.int64)
            start, n = -1, None
        else:
            pos = _positions(g, len(ids), num_tokens)
            n = num_tokens if num_tokens else len(ids) * g.block_size
            start = int(pos[0]) * g.block_size
            if g.kind == "sliding" and num_tokens:  # the window applies when the end is known
                start = max(start, n - g.window)
        for region in regions:
            for flat, idx, values, tok in _placed(kv[region], ids, spec, rank, size, region, seed, pos):
                got = flat[idx].cpu().numpy().reshape(values.shape)
                mask = (tok < 0) | ((tok >= start) & (tok < n)) if n is not None else np.ones(tok.shape, bool)
                if not np.array_equal(got[mask], values[mask]):
                    return False
    return True


def make_requests(
    spec: Any, count: int, per_request: int, seed: int, *, tokens: int | None = None
) -> list[RequestInfo]:
    """``count`` deterministic requests over distinct, shuffled (fragmented) blocks of each
    group's pool of `spec`; ``seed`` picks the ids and blocks. Full and MLA groups get ``per_request``
    blocks each (or the blocks holding ``tokens`` tokens), sliding groups the blocks of their
    window, state groups one slot; a one-group cache gets flat id lists.

    Raises [`ConfigError`][akv.errors.ConfigError] if a pool is too small.
    """
    from akv.geometry.cache import as_cache

    cache = as_cache(spec)
    rng = np.random.default_rng(seed)
    tokens_group = next((g for g in cache.groups if g.kind in ("full", "mla")), cache.groups[0])
    num_tokens = per_request * tokens_group.block_size if tokens_group.tokens else 0
    if tokens is not None:
        num_tokens = tokens
    ids: dict[str, list[list[int]]] = {}
    for g in cache.groups:
        if not g.tokens:
            need = 1
        elif g.kind == "sliding":
            total = -(-num_tokens // g.block_size)
            need = min(total, -(-g.window // g.block_size) + 1)
        else:
            need = -(-num_tokens // g.block_size) if num_tokens else per_request
        if count * need > g.num_blocks:
            raise ConfigError(
                f"{count} requests x {need} blocks exceed the {g.num_blocks}-block pool of group {g.name!r}: "
                "raise --blocks or lower --requests/--blocks-per-request"
            )
        order = rng.permutation(g.num_blocks)
        ids[g.name] = [order[i * need : (i + 1) * need].tolist() for i in range(count)]
    single = len(cache.groups) == 1
    return [
        RequestInfo(
            request_id=f"req-{seed}-{i}",
            block_ids=ids[cache.groups[0].name][i] if single else {n: v[i] for n, v in ids.items()},
            seed=i + 1,
            num_tokens=num_tokens,
        )
        for i in range(count)
    ]


def local_counts(spec: Any, num_tokens: int, hit: int = 0) -> dict[str, int]:
    """How many blocks a decode rank of cache ``spec`` fills per group for a request of
    ``num_tokens`` tokens after a prefix hit of ``hit`` blocks of its full groups: full and
    MLA groups every block but the hit ones, sliding groups the blocks of their window,
    state groups one slot."""
    from akv.geometry.cache import as_cache

    out: dict[str, int] = {}
    for g in as_cache(spec).groups:
        total = -(-num_tokens // g.block_size)
        if not g.tokens:
            out[g.name] = 1
        elif g.kind == "sliding":
            out[g.name] = total - max(0, num_tokens - g.window) // g.block_size
        else:
            out[g.name] = max(1, total - hit) if total else 0
    return out


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


def stop_prefill(proc: subprocess.Popen[str], timeout: float = 10.0) -> dict[str, Any] | None:
    """Stop an ``akv prefill`` process started by `spawn_prefill` (SIGTERM) and return its
    summary (None if it printed none).

    Its stdout is read to the end meanwhile: the summary is one JSON line that lists request
    ids, which outgrows a pipe's buffer once a few thousand requests were released, and a
    process writing it would block until someone reads.

    Args:
        proc: the process, as `spawn_prefill` returned it.
        timeout: seconds it may take to exit; then it is killed.
    """
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    summary = None
    for msg in json_lines((out or "").splitlines()):
        if msg.get("event") == "summary":
            summary = msg
    return summary


async def fetch_requests(
    endpoint: str, spec: Any, secret: str | None, engine_id: str, tls: Any = None
) -> list[RequestInfo]:
    """Ask the prefill engine at ``endpoint`` (any engine address: its rank 0 answers) which
    requests it exposed (the demo's stand-in for a router), as decode engine ``engine_id``
    with the model ``spec`` and ``secret`` (over TLS with an [`akv.TLSConfig`][akv.TLSConfig]
    ``tls``)."""
    from akv.geometry.cache import as_cache
    from akv.protocol.address import BootstrapAddress, EtcdAddress, parse_engine_address
    from akv.protocol.handshake import resolve_secret
    from akv.protocol.messages import Hello
    from akv.runtime.client import client_handshake

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
        spec=as_cache(spec),
        compat=spec.compat_hash(),
        nonce=secrets.token_bytes(16),
    )
    result = await client_handshake(
        rank0,
        hello,
        secret=resolve_secret(secret),
        choose_ranks=lambda ch: [],
        list_requests=True,
        tls=tls.client_context() if tls is not None else None,
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
