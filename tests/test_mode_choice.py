"""A consumer in its default mode pushes where UCX would serve its READs over TCP (a READ
target can crash when its reader vanishes there: docs/operations.md#peer-death-over-tcp) and
pulls elsewhere; the choice is made per prefill engine, and pull is never done over TCP. The hosts case (two network
namespaces, push chosen) is tests/test_network_cut.py's suite case."""

from __future__ import annotations

import pytest

import akv
from akv.backends import host_is_here, reads_over_tcp
from tests.conftest import make_spec

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "here,env,devices,expected",
    [
        (True, {}, [], False),  # this host: shared memory
        (True, {"UCX_TLS": "tcp"}, [], True),  # only TCP, even here
        (True, {"UCX_TLS": "tcp,self"}, ["mlx5_0"], True),
        (False, {}, [], True),  # another host, no RDMA device
        (False, {}, ["mlx5_0"], False),  # another host over RDMA
        (False, {"UCX_TLS": "rc,tcp"}, ["mlx5_0"], False),
        (False, {"UCX_TLS": "tcp,cma"}, ["mlx5_0"], True),  # UCX may use no RDMA transport
        (False, {"UCX_TLS": "^tcp"}, ["mlx5_0"], False),  # an exclusion list keeps RDMA
        (False, {"UCX_TLS": "all"}, ["mlx5_0"], False),
        (False, {"UCX_TLS": "all"}, [], True),
    ],
)
def test_reads_over_tcp(here: bool, env: dict[str, str], devices: list[str], expected: bool) -> None:
    """The rule, case by case: TCP-only UCX_TLS, or another host without an RDMA transport."""
    assert reads_over_tcp(here, env, devices) is expected


def test_host_is_here() -> None:
    """Loopback and this host's names are here; an address of no interface here and a name
    that does not resolve are not."""
    assert host_is_here("127.0.0.1") and host_is_here("localhost")
    assert not host_is_here("198.51.100.77")  # TEST-NET-2: on no interface of this machine
    assert not host_is_here("no-such-host.invalid")


async def test_default_mode_pulls_from_an_engine_on_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """With UCX_TLS unset, a default consumer's session to a prefill rank on loopback pulls
    (data by shared memory), and its pulls take the read path."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    spec = make_spec(num_blocks=8)
    async with (
        akv.Producer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1) as producer,
        akv.Consumer(
            akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, same_process="nixl"
        ) as consumer,
    ):
        assert consumer.mode == "auto"
        producer.expose("r", [1, 2])
        session = await consumer.connect(str(producer.endpoint))
        assert session.mode == "pull"
        result = await (await session.pull("r", [3, 4], [1, 2]))
        assert result.path == "read"


async def test_packed_transfers_push_where_reads_would_go_over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """transfer="packed" with the default mode: a session whose READs UCX would serve over TCP
    pushes instead, the prefill rank writing its packed copy (bit for bit), and never reads; a
    bad mode is a ConfigError."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    spec = make_spec(num_blocks=8)
    kv = akv.allocate_kv_cache(spec, 0, 1)
    with pytest.raises(akv.ConfigError, match="'pull', 'push' or 'auto'"):
        akv.Consumer(kv, spec, tp_rank=0, tp_size=1, mode="sideways")
    async with (
        akv.Producer(
            akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, transfer="packed"
        ) as producer,
        akv.Consumer(kv, spec, tp_rank=0, tp_size=1, same_process="nixl", transfer="packed") as consumer,
    ):
        producer.kv_caches[0][1].fill_(5)
        producer.expose("r", [1])
        session = await consumer.connect(str(producer.endpoint))
        assert session.mode == "push"
        result = await (await session.pull("r", [2], [1]))
        assert result.path == "push"
        assert bool((consumer.kv_caches[0][2] == 5).all())
        assert producer.metrics.snapshot().counters.get("packed_pushes") == 1


async def test_pull_mode_is_refused_where_reads_would_go_over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """mode="pull" to an engine whose READs UCX would serve over TCP (UCX_TLS=tcp here; another
    host without RDMA alike) is refused at connect with a ConfigError naming the hazard and
    the alternative; the same consumer pulls once TCP is no longer the only transport."""
    import akv.runtime.finder

    monkeypatch.setenv("UCX_TLS", "tcp")
    spec = make_spec(num_blocks=8)
    async with (
        akv.Producer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1) as producer,
        akv.Consumer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, mode="pull") as consumer,
    ):
        producer.expose("r", [1])
        with pytest.raises(akv.ConfigError, match=r"over TCP.*kill the prefill.*mode='push'"):
            await consumer.connect(str(producer.endpoint))
        monkeypatch.setattr(akv.runtime.finder, "host_is_here", lambda host: False)
        monkeypatch.delenv("UCX_TLS")
        with pytest.raises(akv.ConfigError, match="over TCP"):  # another host, no RDMA device here
            await consumer.connect(str(producer.endpoint))
        monkeypatch.setattr(akv.runtime.finder, "host_is_here", lambda host: True)
        session = await consumer.connect(str(producer.endpoint))
        assert session.mode == "pull"
        assert (await (await session.pull("r", [2], [1]))).path in ("read", "copy")


@pytest.mark.parametrize("modes", [("pull", "push"), ("pull",)])
async def test_default_mode_pushes_to_another_host_and_refuses_an_engine_serving_only_pull(
    monkeypatch: pytest.MonkeyPatch, modes: tuple[str, ...]
) -> None:
    """With the engine taken for another host (no RDMA device here: this machine has none),
    the default session pushes, and its pulls take the push path bit for bit; an engine that
    serves only pull is refused (IncompatiblePeerError naming mode and the hazard), never read
    over TCP."""
    import akv.runtime.finder

    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.setattr(akv.runtime.finder, "host_is_here", lambda host: False)
    spec = make_spec(num_blocks=8)
    async with (
        akv.Producer(akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, modes=modes) as producer,
        akv.Consumer(
            akv.allocate_kv_cache(spec, 0, 1), spec, tp_rank=0, tp_size=1, same_process="nixl"
        ) as consumer,
    ):
        producer.kv_caches[0][1].fill_(7)
        producer.expose("r", [1])
        if modes == ("pull",):
            with pytest.raises(akv.IncompatiblePeerError, match=r"serves only pull.*over TCP") as info:
                await consumer.connect(str(producer.endpoint))
            assert "mode" in info.value.fields
            return
        session = await consumer.connect(str(producer.endpoint))
        assert session.mode == "push"
        result = await (await session.pull("r", [2], [1]))
        assert result.path == "push"
        assert bool((consumer.kv_caches[0][2] == 7).all())
