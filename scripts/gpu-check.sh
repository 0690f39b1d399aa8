#!/usr/bin/env bash
# The GPU checks in one device call (docs/gpu.md#one-command-on-a-gpu-machine):
#
#     bash scripts/gpu-check.sh OUTDIR
#
# installs what the machine lacks from ./wheels (if there: `pip download` them beside the
# repository, see docs/gpu.md), runs tests/test_gpu.py and `akv bench --quick --device cuda
# --json` in pull mode, on the large workloads, in push and in packed mode, each step bounded so the
# whole run ends within 8 minutes, and writes at most 8 files into OUTDIR: env.json,
# test_gpu.json, pull.json, large.json, push.json, packed.json (a step's bench JSON, or its exit
# code and stderr tail if it failed), ucx_protocols.txt (the protocols UCX chose for one pull,
# printed under UCX_PROTO_INFO=y) and summary.md (one table). Without a usable CUDA device it
# exits 64 at once, with one line, having installed and written nothing.
#
# AKV_PYTHON: the interpreter (default python3). AKV_GPU_CHECK_BUDGET: seconds for the whole
# run (default 470). AKV_GPU_CHECK_STEPS: the steps to run, comma-separated (default all:
# test_gpu,ucx,pull,large,push,packed), e.g. to rerun a failed one within a short device call.
set -uo pipefail

usage="usage: bash scripts/gpu-check.sh OUTDIR"
if [ "$#" -ne 1 ] || [ -z "$1" ] || [ "${1#-}" != "$1" ]; then
    echo "gpu-check: $usage" >&2
    exit 64
fi
cd "$(dirname "$0")/.." || exit 1
root=$PWD
out=$1
py=${AKV_PYTHON:-python3}
budget=${AKV_GPU_CHECK_BUDGET:-470}  # seconds: 8 minutes, less the summary's
steps=",${AKV_GPU_CHECK_STEPS:-test_gpu,ucx,pull,large,push,packed},"
for s in ${steps//,/ }; do
    case $s in
    test_gpu | ucx | pull | large | push | packed) ;;
    *)
        echo "gpu-check: unknown step '$s' in AKV_GPU_CHECK_STEPS: name some of test_gpu,ucx,pull,large,push,packed" >&2
        exit 64
        ;;
    esac
done
start=$SECONDS

if ! command -v "$py" >/dev/null 2>&1; then
    echo "gpu-check: no $py here: set AKV_PYTHON to a Python with torch" >&2
    exit 64
fi
# Before anything is installed or written: is there a GPU torch can use?
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "gpu-check: no usable CUDA device here (torch.cuda.is_available() is False, or no torch in $py): run it on the GPU machine" >&2
    exit 64
fi

mkdir -p "$out" || exit 1
out=$(cd "$out" && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# akv sets it for its own commands on VRAM; the tests' processes need it too
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=${UCX_CUDA_IPC_ENABLE_GET_ZCOPY:-y}
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT

# Seconds left for a step that may take up to $1: the smaller of the two, 0 when under 15.
left() {
    local rest=$((budget - (SECONDS - start)))
    local want=$1
    [ "$rest" -lt "$want" ] && want=$rest
    [ "$want" -lt 15 ] && want=0
    echo "$want"
}

# step NAME SECONDS COMMAND...: run it bounded; stdout to $log/NAME.out, stderr to $log/NAME.err,
# "NAME RC SECONDS" appended to $log/steps.
step() {
    local name=$1 limit
    if [ "$name" != install ] && [ "${steps#*,"$name",}" = "$steps" ]; then
        return  # not asked for (AKV_GPU_CHECK_STEPS)
    fi
    limit=$(left "$2")
    shift 2
    if [ "$limit" -eq 0 ]; then
        echo "$name skipped 0" >>"$log/steps"
        echo "gpu-check: $name skipped: out of time" >&2
        return
    fi
    echo "gpu-check: $name (up to ${limit}s)" >&2
    local t0=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" >"$log/$name.out" 2>"$log/$name.err" || rc=$?
    echo "$name $rc $((SECONDS - t0))" >>"$log/steps"
    echo "gpu-check: $name exited $rc after $((SECONDS - t0))s" >&2
}

# 1. What the machine lacks, from ./wheels: each wheel whose distribution is not installed.
if compgen -G "$root/wheels/*.whl" >/dev/null; then
    missing=$("$py" - "$root/wheels" <<'EOF'
import os, re, sys
from importlib.metadata import PackageNotFoundError, version
for name in sorted(os.listdir(sys.argv[1])):
    if not name.endswith(".whl"):
        continue
    dist = re.sub(r"[-_.]+", "-", name.split("-")[0]).lower()
    try:
        version(dist)
    except PackageNotFoundError:
        print(os.path.join(sys.argv[1], name))
EOF
)
    if [ -n "$missing" ]; then
        # into a folder of this run (on PYTHONPATH), not the machine's Python: nothing to undo,
        # and no "externally managed" refusal
        mkdir -p "$log/site"
        # shellcheck disable=SC2086  # one path a line, no spaces (wheel names)
        step install 120 "$py" -m pip install -q --no-deps --no-index --target "$log/site" $missing
        export PYTHONPATH="$PYTHONPATH:$log/site"
    fi
fi

# 2. The environment, for the figures' record.
"$py" - "$out/env.json" <<'EOF' 2>>"$log/env.err"
import json, subprocess, sys
info = {}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
except Exception as exc:
    info["torch_error"] = repr(exc)
try:
    from importlib.metadata import version
    info["nixl"] = version("nixl")
except Exception as exc:
    info["nixl_error"] = repr(exc)
try:
    info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    pass
with open(sys.argv[1], "w") as f:
    json.dump(info, f)
EOF

# 3. The GPU tests (12 in about 70 s on one H100).
step test_gpu 120 "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py

# 4. The bench on the device, in order of what the figures are for: nine standard workloads
# in pull mode (with the same-process one); the large ones; push mode on
# the workloads its targets name (with layerwise); packed mode where packing matters (packed
# reads, and packed pushes beside them). A step
# gets what is left of the budget if less than its own bound.
names() {
    "$py" -c "from akv.bench.workloads import WORKLOADS; print(','.join(w.name for w in WORKLOADS if $1))"
}
bench=("$py" -m akv bench --quick --device cuda --json)
# 4a. Which transports UCX picks for a pull's reads of VRAM (the data) and of host memory (the
# exposure check, the packed directory): a read of host memory over tcp needs the prefill's
# poller to progress, a round trip through a sleeping poller on every pull.
UCX_PROTO_INFO=y step ucx 40 "${bench[@]}" --only latency
# (the workloads the figures are quoted for: all twenty did not finish within 130 s on an H100)
step pull 120 "${bench[@]}" --only \
    "bulk,fragmented,prefill_tp>decode_tp,mla_prefill>decode,small_concurrent,latency,hnd_2->1_frag,headmajor_2->1_frag,same_process"
step large 60 "${bench[@]}" --only "$(names "w.name.startswith('large')")"
step push 80 "${bench[@]}" --mode push \
    --only "bulk,mla_prefill>decode,small_concurrent,latency,headmajor_1->2_frag,headmajor_2->1_frag,layerwise"
step packed 80 "${bench[@]}" --transfer packed --mode push \
    --only "bulk,small_concurrent,latency,hnd_1->2_frag,hnd_2->1_frag,head_sliced_nhd"

# 5. The step files and the summary table.
"$py" - "$log" "$out" <<'EOF'
import json, os, sys
log, out = sys.argv[1], sys.argv[2]
steps = []
if os.path.exists(f"{log}/steps"):
    for line in open(f"{log}/steps"):
        name, rc, seconds = line.split()
        steps.append((name, rc, int(seconds)))
def tail(path, n=30):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""
rows, notes = [], []
for name, rc, seconds in steps:
    if name == "install":
        continue
    if name == "ucx":  # the protocol tables only: UCX prints them as lines of a table
        import re
        text = tail(f"{log}/ucx.out", 10**6) + tail(f"{log}/ucx.err", 10**6)
        table = [ln for ln in text.splitlines() if re.match(r"^\[[\d.]+\] \[[^\]]+\]\s+[|+]", ln.strip())]
        with open(f"{out}/ucx_protocols.txt", "w") as f:
            f.write("\n".join(table[:2000]) + "\n")
        tables = {}  # one table per time stamp: its cells, line by line
        for ln in table:
            stamp, _, body = ln.strip().partition("]")
            tables.setdefault(stamp, []).append([c.strip() for c in body.split("]", 1)[-1].strip().strip("|+").split("|")])
        reads = set()
        for cells in tables.values():
            what = next((c[0] for c in cells if len(c) == 1 and c[0].startswith("remote memory read")), None)
            if what:
                where = what.split(" into ", 1)[-1]
                transports = sorted({c[2] for c in cells if len(c) >= 3 and c[0] != "Range" and "/" in c[2]})
                reads.add(f"{where}: {' '.join(transports)}")
        notes.append(f"- ucx: exit {rc}, {len(table)} protocol table lines (ucx_protocols.txt); remote reads: {'; '.join(sorted(reads)) or 'none found'}")
        continue
    text = tail(f"{log}/{name}.out", 10**6).strip()
    if name == "test_gpu":
        result = {"rc": rc, "seconds": seconds, "stdout_tail": tail(f"{log}/{name}.out", 40), "stderr_tail": tail(f"{log}/{name}.err")}
        with open(f"{out}/test_gpu.json", "w") as f:
            json.dump(result, f)
        last = text.splitlines()[-1] if text else "(no output)"
        notes.append(f"- test_gpu: exit {rc} in {seconds} s: {last}")
        continue
    summary = None
    if rc == "0" and text:
        try:
            summary = json.loads(text.splitlines()[-1])
        except ValueError:
            summary = None
    if summary is None:
        with open(f"{out}/{name}.json", "w") as f:
            json.dump({"step": name, "rc": rc, "seconds": seconds, "stderr_tail": tail(f"{log}/{name}.err")}, f)
        notes.append(f"- {name}: exit {rc} after {seconds} s (stderr tail in {name}.json)")
        continue
    with open(f"{out}/{name}.json", "w") as f:
        json.dump(summary, f)
    notes.append(f"- {name}: {seconds} s")
    for w in summary.get("workloads", []):
        ops = " ".join(f"{k}={v:g}" for k, v in (w.get("control_ops") or {}).items() if v)
        push_ops = " ".join(f"{k}={v:g}" for k, v in (w.get("push_control_ops") or {}).items() if v)
        ops += f"; push: {push_ops}" if push_ops else ""
        stages = " ".join(f"{k[:-3]}={w[k]:g}" for k in ("pack_ms", "lookup_ms", "read_ms", "unpack_ms", "data_ms", "data_p50_ms", "data_p99_ms", "check_ms") if isinstance(w.get(k), (int, float)))
        paths = " ".join(f"{k}={v}" for k, v in (w.get("paths") or {}).items())
        rows.append([name, w.get("name", ""), w.get("tp", ""), f"{w.get('bytes', 0) / (1 << 20):.1f}",
                     w.get("akv_gbps", ""), w.get("unchecked_gbps", ""), w.get("nixl_gbps", ""),
                     w.get("nixl_write_gbps", ""), w.get("push_gbps", ""), w.get("p50_ms", ""),
                     w.get("nixl_p50_ms", ""), w.get("p99_ms", ""), w.get("unchecked_p99_ms", ""),
                     w.get("nixl_p99_ms", ""), ops, stages, paths])
head = ["step", "workload", "tp", "MiB", "akv GB/s", "unchecked", "NIXL READ", "NIXL WRITE", "push", "p50 ms", "NIXL p50 ms", "p99 ms", "unchecked p99 ms", "NIXL p99 ms", "control ops per pull", "stages, ms per pull", "pulls by path"]
lines = ["# akv GPU check", ""]
try:
    env = json.load(open(f"{out}/env.json"))
    lines += [f"torch {env.get('torch')} (CUDA {env.get('cuda')}), NIXL {env.get('nixl')}, {', '.join(env.get('gpus', []))}, akv {env.get('commit')}", ""]
except (OSError, ValueError):
    pass
lines += notes + ["", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
with open(f"{out}/summary.md", "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
echo "gpu-check: done in $((SECONDS - start))s; files in $out" >&2
# a run that did not do its job exits non-zero
failed=$(awk '$1 != "install" && $2 != "0" {n++} END {print n + 0}' "$log/steps" 2>/dev/null || echo 1)
[ "$failed" -eq 0 ]
