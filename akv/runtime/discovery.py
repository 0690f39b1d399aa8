"""etcd discovery: each prefill rank registers its control endpoint under a lease; decode resolves.

Keys are ``{prefix}{engine_id}/ranks/{tp_rank}`` and values the JSON of a :class:`RankRecord`
(nothing secret: agent metadata flows only through the authenticated control plane). Each key
is bound to an etcd lease that its rank keeps alive, so the key of a rank that exits, is
killed or hangs disappears by itself within the lease TTL.

The client speaks etcd's v3 JSON gateway (``/v3/kv/range``, ``/v3/kv/put``,
``/v3/lease/grant``, ``/v3/lease/keepalive``, ``/v3/lease/revoke``; etcd 3.4 and later) over
httpx, which runs under asyncio and trio alike. The async etcd clients on PyPI are built on
grpc.aio or aiohttp and so are asyncio-only.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Annotated, Any

import anyio
import msgspec

from akv._log import get_logger
from akv.errors import ConfigError, EtcdUnavailableError, MissingRanksError
from akv.protocol.address import Endpoint, check_engine_id, parse_endpoint
from akv.protocol.messages import MAX_TP_SIZE, PROTOCOL_VERSION

if TYPE_CHECKING:
    import httpx
    from anyio.abc import TaskStatus

__all__ = ["DEFAULT_PREFIX", "DEFAULT_TTL", "EtcdRegistry", "RankRecord"]

DEFAULT_TTL = 5.0
DEFAULT_PREFIX = "/akv/engines/"

# gRPC status codes the gateway reports in {"code": ...}
_NOT_FOUND = 5
_TRANSIENT = frozenset({1, 4, 8, 13, 14})  # cancelled, deadline, exhausted, internal, unavailable


class RankRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a decode rank needs to choose and reach a prefill rank: nothing secret.

    Attributes:
        engine_id: the prefill engine's name.
        tp_rank: the rank.
        tp_size: the engine's TP size.
        host: the rank's control endpoint host.
        port: its port.
        v: the akv protocol version the rank speaks.
        compat: the spec's compat hash (``KVSpec.compat_hash()``), empty if not given.
    """

    engine_id: Annotated[str, msgspec.Meta(max_length=1024)]
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_SIZE)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]  # bounded before use
    host: Annotated[str, msgspec.Meta(max_length=1024)]
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    v: int = PROTOCOL_VERSION
    compat: Annotated[str, msgspec.Meta(max_length=1024)] = ""

    @property
    def endpoint(self) -> Endpoint:
        """The rank's control endpoint."""
        return Endpoint(self.host, self.port)

    @classmethod
    def create(
        cls,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        endpoint: str | Endpoint | tuple[str, int],
        *,
        compat: str = "",
    ) -> RankRecord:
        """A validated record for rank ``tp_rank`` of ``tp_size`` of engine ``engine_id``
        serving ``endpoint``, with the spec's ``compat`` hash."""
        check_engine_id(engine_id)
        if not 1 <= tp_size <= MAX_TP_SIZE:
            raise ConfigError(f"tp_size {tp_size} is outside [1, {MAX_TP_SIZE}]")
        if not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
        ep = parse_endpoint(endpoint)
        return cls(
            engine_id=engine_id, tp_rank=tp_rank, tp_size=tp_size, host=ep.host, port=ep.port, compat=compat
        )


class _StatusError(Exception):
    """etcd answered with a definite error (for example an unknown lease)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"etcd error {code}: {message}")
        self.code = code


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def _endpoints(value: str | Endpoint | Iterable[str | Endpoint]) -> tuple[Endpoint, ...]:
    if isinstance(value, str):
        items: list[str | Endpoint] = [v.strip() for v in value.split(",")]
    elif isinstance(value, Endpoint):
        items = [value]
    else:
        items = list(value)
    if not items or any(item == "" for item in items):
        raise ConfigError(
            f"etcd endpoints {value!r} are not HOST:PORT[,HOST:PORT...] (for example 127.0.0.1:2379)"
        )
    return tuple(parse_endpoint(item) for item in items)


class EtcdRegistry:
    """An etcd client for rank registration and engine discovery (asyncio and trio).

    ``endpoints``: ``"HOST:PORT[,HOST:PORT...]"`` or a sequence; they are tried in order and
    the one that last answered is tried first. ``ttl``: seconds a rank's key outlives its last
    keep-alive (whole seconds, at least etcd's minimum, 2 s with default election settings).
    Each request waits at most ``request_timeout`` seconds, and a call tries every endpoint up
    to ``attempts`` times before raising `EtcdUnavailableError`. Keys live under ``prefix``
    (``{prefix}{engine_id}/ranks/{rank}``).

    Use it as an async context manager, or call :meth:`aclose` when done.
    """

    def __init__(
        self,
        endpoints: str | Endpoint | Iterable[str | Endpoint],
        *,
        ttl: float = DEFAULT_TTL,
        prefix: str = DEFAULT_PREFIX,
        request_timeout: float = 2.0,
        attempts: int = 3,
    ) -> None:
        if not ttl >= 1:
            raise ConfigError(f"etcd lease ttl {ttl} is below 1 s; give a ttl of a few seconds")
        if not prefix.startswith("/") or not prefix.endswith("/"):
            raise ConfigError(
                f"etcd prefix {prefix!r} must start and end with '/' (for example /akv/engines/)"
            )
        if attempts < 1 or request_timeout <= 0:
            raise ConfigError("etcd attempts must be >= 1 and request_timeout > 0")
        self.endpoints = _endpoints(endpoints)
        self.ttl = float(ttl)
        self.prefix = prefix
        self.request_timeout = request_timeout
        self.attempts = attempts
        self._preferred = 0
        self._http: httpx.AsyncClient | None = None
        self._log = get_logger(__name__).bind(etcd=self.etcd_text)

    @property
    def etcd_text(self) -> str:
        """The endpoints as ``HOST:PORT,HOST:PORT``."""
        return ",".join(map(str, self.endpoints))

    def rank_key(self, engine_id: str, tp_rank: int) -> str:
        """The etcd key under which rank ``tp_rank`` of ``engine_id`` registers."""
        return f"{self.prefix}{engine_id}/ranks/{tp_rank}"

    async def __aenter__(self) -> EtcdRegistry:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP connections (the registry can be used again afterwards)."""
        http, self._http = self._http, None
        if http is not None:
            with anyio.CancelScope(shield=True):
                await http.aclose()

    # -- transport -------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            import httpx

            # trust_env=False: proxy variables must not redirect etcd traffic
            self._http = httpx.AsyncClient(trust_env=False, timeout=self.request_timeout)
        return self._http

    async def _call(
        self, path: str, body: Mapping[str, Any], *, attempts: int | None = None, per_try: float | None = None
    ) -> dict[str, Any]:
        """POST ``body`` to ``path``, failing over between endpoints with bounded retries."""
        import httpx

        client = self._client()
        tries = self.attempts if attempts is None else attempts
        n = len(self.endpoints)
        last = ""
        for attempt in range(tries):
            if attempt:
                await anyio.sleep(min(0.1 * 2 ** (attempt - 1), 1.0))
            for i in range(n):
                index = (self._preferred + i) % n
                ep = self.endpoints[index]
                try:
                    resp = await client.post(
                        f"http://{ep}{path}", json=body, timeout=per_try or self.request_timeout
                    )
                    data = self._decode(resp.text)
                except (httpx.HTTPError, ValueError) as exc:
                    last = f"{ep}: {type(exc).__name__}: {exc}".rstrip(": ")
                    continue
                error = data.get("error")
                if resp.status_code == 200 and error is None:
                    self._preferred = index
                    result = data.get("result", data)  # keepalive streams {"result": {...}}
                    return result if isinstance(result, dict) else {}
                code, message = self._error_of(data, resp.status_code)
                if code in _TRANSIENT or (code < 0 and resp.status_code >= 500):
                    last = f"{ep}: {message}"
                    continue
                self._preferred = index
                raise _StatusError(code, message)
        raise EtcdUnavailableError(
            f"no etcd endpoint of {self.etcd_text} answered {path} after {tries} tries (last: {last})",
            tuple(map(str, self.endpoints)),
        )

    @staticmethod
    def _decode(text: str) -> dict[str, Any]:
        line = next((ln for ln in text.splitlines() if ln.strip()), "")
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("not an etcd gateway answer")
        return data

    @staticmethod
    def _error_of(data: dict[str, Any], status: int) -> tuple[int, str]:
        error = data.get("error")
        if isinstance(error, dict):  # streaming form
            return int(error.get("grpc_code", -1)), str(error.get("message", error))
        code = data.get("code")
        return (int(code) if isinstance(code, int) else -1), str(
            data.get("message") or error or f"HTTP {status}"
        )

    async def _grant(self, *, attempts: int | None = None, per_try: float | None = None) -> tuple[int, int]:
        data = await self._call(
            "/v3/lease/grant", {"TTL": math.ceil(self.ttl)}, attempts=attempts, per_try=per_try
        )
        if "ID" not in data:
            raise _StatusError(-1, f"lease grant answered without a lease id: {data}")
        return int(data["ID"]), int(data.get("TTL", 0))

    async def _keepalive(
        self, lease: int, *, attempts: int | None = None, per_try: float | None = None
    ) -> bool:
        """Refresh ``lease``; False if etcd no longer knows it."""
        data = await self._call("/v3/lease/keepalive", {"ID": str(lease)}, attempts=attempts, per_try=per_try)
        return int(data.get("TTL", 0)) > 0

    async def _revoke(self, lease: int) -> None:
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)}, attempts=1)
        except _StatusError as exc:
            if exc.code != _NOT_FOUND:
                raise

    async def _range(self, prefix: str) -> list[tuple[str, bytes, int]]:
        """Every (key, value, mod_revision) under ``prefix``."""
        raw = prefix.encode()
        data = await self._call("/v3/kv/range", {"key": _b64(raw), "range_end": _b64(_prefix_end(raw))})
        return [
            (
                base64.b64decode(kv["key"]).decode(errors="replace"),
                base64.b64decode(kv.get("value", "")),
                int(kv.get("mod_revision", 0)),
            )
            for kv in data.get("kvs", [])
        ]

    # -- registration ----------------------------------------------------------------------

    async def keep_registered(
        self, record: RankRecord, *, task_status: TaskStatus[bool] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Register ``record`` under a lease and keep it alive until cancelled.

        Start it with ``registered = await tg.start(registry.keep_registered, record)``: that
        returns after the first attempt, True if the rank is registered, False if etcd did not
        answer (the task goes on trying). etcd unreachable or the lease lost: retries with
        bounded backoff and registers again when etcd returns; it never raises for etcd
        trouble. On cancellation it revokes the lease (shielded), so the key goes at once.
        """
        check_engine_id(record.engine_id)
        key = self.rank_key(record.engine_id, record.tp_rank)
        value = msgspec.json.encode(record)
        log = self._log.bind(engine=record.engine_id, rank=record.tp_rank)
        period = self.ttl / 3
        per_try = min(self.request_timeout, period)  # a refresh must not outlast the lease
        lease: int | None = None
        started = False
        failures = 0
        try:
            while True:
                try:
                    if lease is None:
                        new, granted = await self._grant(attempts=1, per_try=per_try)
                        await self._call(
                            "/v3/kv/put",
                            {"key": _b64(key.encode()), "value": _b64(value), "lease": str(new)},
                            attempts=1,
                            per_try=per_try,
                        )
                        lease = new
                        log.info("registered in etcd", key=key, ttl=granted, endpoint=str(record.endpoint))
                    elif not await self._keepalive(lease, attempts=1, per_try=per_try):
                        log.warning("etcd lease lost; registering again", key=key)
                        lease = None
                        continue
                    if failures:
                        log.info("etcd answers again", key=key, failures=failures)
                    failures = 0
                    if not started:
                        started = True
                        task_status.started(True)
                    await anyio.sleep(period)
                except (EtcdUnavailableError, _StatusError) as exc:
                    if isinstance(exc, _StatusError) and exc.code == _NOT_FOUND:
                        lease = None
                    failures += 1
                    delay = min(0.1 * 2 ** (failures - 1), period)
                    # warn once per outage, then quietly keep trying
                    (log.warning if failures == 1 else log.debug)(
                        "etcd registration failed; retrying", key=key, error=str(exc), retry_in=delay
                    )
                    if not started:
                        started = True
                        task_status.started(False)
                    await anyio.sleep(delay)
        finally:
            if lease is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.request_timeout):
                    try:
                        await self._revoke(lease)
                        log.info("unregistered from etcd", key=key)
                    except (EtcdUnavailableError, _StatusError) as exc:
                        log.warning("etcd lease not revoked; the key goes when it expires", error=str(exc))

    # -- discovery -------------------------------------------------------------------------

    def _records(
        self, rows: Iterable[tuple[str, bytes, int]]
    ) -> dict[str, dict[int, tuple[RankRecord, int]]]:
        """Valid records by engine and rank; malformed keys or values are skipped (logged)."""
        out: dict[str, dict[int, tuple[RankRecord, int]]] = {}
        for key, value, revision in rows:
            engine_id, sep, rank = key[len(self.prefix) :].partition("/ranks/")
            try:
                if not sep or not rank.isdigit():
                    raise ValueError("not a rank key")
                record = msgspec.json.decode(value, type=RankRecord)
                if (record.engine_id, record.tp_rank) != (engine_id, int(rank)):
                    raise ValueError("record does not match its key")
                if not 0 <= record.tp_rank < record.tp_size:
                    raise ValueError("tp_rank outside tp_size")
            except (ValueError, msgspec.ValidationError) as exc:
                self._log.warning("skipping a malformed etcd entry", key=key, error=str(exc))
                continue
            out.setdefault(engine_id, {})[record.tp_rank] = (record, revision)
        return out

    @staticmethod
    def _current(
        ranks: Mapping[int, tuple[RankRecord, int]], tp_size_hint: int | None
    ) -> dict[int, RankRecord]:
        """The ranks of the engine's current incarnation: ``tp_size_hint`` if given, else the
        TP size of the newest registration (stale keys of an earlier size expire by themselves)."""
        if not ranks:
            return {}
        tp = tp_size_hint
        if tp is None:
            tp = max(ranks.values(), key=lambda rr: rr[1])[0].tp_size
        return {r: rec for r, (rec, _) in sorted(ranks.items()) if rec.tp_size == tp}

    async def list_engines(self) -> dict[str, dict[int, RankRecord]]:
        """Every registered engine and its ranks (by engine id, then rank)."""
        found = self._records(await self._range(self.prefix))
        return {engine: self._current(ranks, None) for engine, ranks in sorted(found.items())}

    async def resolve(
        self,
        engine_id: str,
        *,
        need: Collection[int] | None = None,
        tp_size_hint: int | None = None,
        timeout: float = 10.0,  # noqa: ASYNC109 (a deadline for the whole wait, raising a typed error)
    ) -> dict[int, RankRecord]:
        """The registered ranks of ``engine_id``, waiting until every rank in ``need`` is there.

        ``need`` defaults to every rank of the engine's TP size (``tp_size_hint`` if given,
        else the size its ranks registered with). Returns every registered rank of that size,
        a superset of ``need``. Polls with backoff; raises :class:`MissingRanksError` naming
        the missing ranks after ``timeout`` seconds, :class:`EtcdUnavailableError` if no etcd
        endpoint answers. Call it again after losing a rank to find it at its new address.
        """
        check_engine_id(engine_id)
        if need is not None and any(not 0 <= r < (tp_size_hint or r + 1) for r in need):
            raise ConfigError(f"ranks {sorted(need)} are not all in [0, tp_size={tp_size_hint or '?'})")
        prefix = f"{self.prefix}{engine_id}/ranks/"
        current: dict[int, RankRecord] = {}
        wanted: set[int] | None = None
        answered = False
        delay = 0.02
        with anyio.move_on_after(timeout):
            while True:
                rows = await self._range(prefix)
                answered = True
                current = self._current(self._records(rows).get(engine_id, {}), tp_size_hint)
                tp = tp_size_hint or next((rec.tp_size for rec in current.values()), None)
                wanted = set(need) if need is not None else (set(range(tp)) if tp is not None else None)
                if wanted is not None and wanted <= current.keys():
                    return current
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.5)
        if not answered:
            raise EtcdUnavailableError(
                f"no etcd endpoint of {self.etcd_text} answered within {timeout} s",
                tuple(map(str, self.endpoints)),
            )
        missing = tuple(sorted(wanted - current.keys())) if wanted is not None else ()
        what = f"ranks {list(missing)}" if wanted is not None else "no rank"
        sizes = {rec.tp_size for rec in current.values()}
        raise MissingRanksError(
            f"engine {engine_id!r}: {what} registered in etcd at {self.etcd_text} after {timeout} s "
            f"(registered: {sorted(current)}{f', tp_size {sizes.pop()}' if sizes else ''}); "
            "check the prefill ranks are running with this etcd and engine id",
            engine_id=engine_id,
            missing=missing,
        )
