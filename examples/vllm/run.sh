#!/usr/bin/env bash
# Disaggregated serving with vLLM and akv on one machine: a prefill and a decode vLLM instance
# joined by AkvConnector, and a router in front, on a tiny model built here (nothing is
# downloaded). On a 2-core machine each instance gets its own core.
#
#   bash examples/vllm/run.sh            # start everything, send a few requests, stop
#   KEEP=1 bash examples/vllm/run.sh     # ... and keep serving on http://127.0.0.1:8000 until Ctrl-C
#   ARCH=nemotron_h bash examples/vllm/run.sh   # a state-space hybrid (also qwen3_next; docs/vllm.md)
#
# Set-up first: bash scripts/setup.sh (installs vLLM's CPU build, or its CUDA build on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
WORK=$(mktemp -d -t akv-vllm-XXXXXX)
MODEL=${MODEL:-$WORK/model}
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

ARCH=${ARCH:-llama}
EXTRA=()  # vLLM's CPU Mamba2 kernel needs prefix caching off on long prompts (docs/vllm.md)
[ "$ARCH" = nemotron_h ] && EXTRA=(-- --no-enable-prefix-caching)
[ -d "$MODEL" ] || "$PY" examples/vllm/tiny_model.py "$MODEL" --arch "$ARCH" >/dev/null

# The prefill instance (kv_producer, akv's bootstrap on port 5700) and the decode instance
# (kv_consumer): the launcher prints nothing itself (it sets VLLM_SSM_CONV_STATE_LAYOUT=DS,
# which akv needs on both instances of a Mamba / GDN hybrid); it runs
#   python -m vllm.entrypoints.openai.api_server --model DIR --kv-transfer-config '{"kv_connector":
#   "AkvConnector", "kv_connector_module_path": "akv.integrations.vllm", "kv_role": ..., ...}'
setsid "$PY" -m akv.integrations.vllm.launch --model "$MODEL" --role prefill --http-port 8100 --akv-port 5700 --core 0 \
    "${EXTRA[@]}" >"$WORK/prefill.log" 2>&1 &
pids+=($!)
setsid "$PY" -m akv.integrations.vllm.launch --model "$MODEL" --role decode --http-port 8200 --core 1 \
    --failure-policy recompute "${EXTRA[@]}" >"$WORK/decode.log" 2>&1 &
pids+=($!)
setsid "$PY" examples/vllm/proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000 \
    >"$WORK/proxy.log" 2>&1 &
pids+=($!)

echo "starting vLLM (prefill on core 0, decode on core 1; about a minute)..." >&2
for _ in $(seq 1 300); do
    if curl -sf http://127.0.0.1:8000/health >/dev/null 2>&1; then break; fi
    for pid in "${pids[@]}"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "an instance exited; its log:" >&2
            tail -n 30 "$WORK"/*.log >&2
            exit 1
        fi
    done
    sleep 1
done
curl -sf http://127.0.0.1:8000/health >/dev/null || { echo "not ready after 300 s" >&2; tail -n 30 "$WORK"/*.log >&2; exit 1; }

echo "--- /v1/completions through prefill -> akv -> decode" >&2
curl -s http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"The quick brown fox\", \"max_tokens\": 16, \"temperature\": 0}"
echo
echo "--- /v1/chat/completions, streaming" >&2
curl -sN http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \
    -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"hello\"}], \"max_tokens\": 8, \"temperature\": 0, \"stream\": true}" \
    | head -c 2000
echo
echo "--- decode's prompt tokens by source (external_kv_transfer: pulled by akv)" >&2
curl -s http://127.0.0.1:8200/metrics | grep -E '^vllm:(prompt_tokens_by_source_total|akv_pull_bytes_total)' || true
echo "--- prefill's releases" >&2
curl -s http://127.0.0.1:8100/metrics | grep -E '^vllm:akv_releases_total' || true

if [ -n "${KEEP:-}" ]; then
    echo "serving on http://127.0.0.1:8000 (Ctrl-C stops)" >&2
    wait
fi
