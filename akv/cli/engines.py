"""``akv engines --etcd HOST:PORT``: the engines and ranks registered in etcd."""

from __future__ import annotations

import argparse

import anyio

from akv.cli.args import EXIT_OK, emit
from akv.runtime.discovery import DEFAULT_PREFIX, EtcdRegistry, RankRecord

__all__ = ["add_engines_parser", "cmd_engines"]


def add_engines_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("engines", help="list the engines and ranks registered in etcd")
    p.add_argument("--etcd", required=True, metavar="HOST:PORT[,HOST:PORT...]", help="etcd endpoints")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="etcd key prefix of akv engines")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each etcd request")
    p.add_argument("--json", action="store_true", help="one JSON line per rank")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logs on stderr")
    p.set_defaults(func=cmd_engines)


async def _list(a: argparse.Namespace) -> dict[str, dict[int, RankRecord]]:
    async with EtcdRegistry(a.etcd, prefix=a.prefix, request_timeout=a.timeout) as registry:
        return await registry.list_engines()


def cmd_engines(a: argparse.Namespace) -> int:
    engines = anyio.run(_list, a)
    for engine_id, ranks in engines.items():
        if not a.json:
            sizes = sorted({rec.tp_size for rec in ranks.values()})
            print(f"{engine_id}  tp_size={','.join(map(str, sizes))}  ranks={len(ranks)}")
        for rank, rec in ranks.items():
            if a.json:
                emit(
                    {
                        "engine_id": engine_id,
                        "tp_rank": rank,
                        "tp_size": rec.tp_size,
                        "endpoint": str(rec.endpoint),
                        "v": rec.v,
                        "compat": rec.compat,
                    }
                )
            else:
                print(f"  rank {rank}/{rec.tp_size}  {rec.endpoint}  v{rec.v}  {rec.compat}".rstrip())
    if not engines and not a.json:
        print(f"no engine registered under {a.prefix}")
    return EXIT_OK
