#!/usr/bin/env bash
# Disaggregated serving with two real vLLM processes and kvd between them, on this machine:
# kvd, a vLLM prefill instance (kv_producer), a vLLM decode instance (kv_consumer) and a proxy
# (deploy/vllm/disagg_proxy.py) that sends each request to prefill with max_tokens 1, then to
# decode, as vLLM's own disaggregated examples do. Each is its own process behind vLLM's
# OpenAI-compatible API. Then it measures decode TTFT with kvd against the decode instance
# recomputing the prompt, for prompts of 1k, 2k and 4k tokens (deploy/vllm/disagg_bench.py),
# and prints it with tokens/s and the bytes kvd stored and moved.
#
#   ./deploy/vllm-disagg.sh            measure, print, stop everything
#   ./deploy/vllm-disagg.sh --serve    keep serving after the measurement: the proxy listens on
#                                      127.0.0.1:$KVD_DISAGG_PORT (default 8000); Ctrl-C stops
#
#   KVD_DISAGG_LENGTHS      prompt lengths (default 1024,2048,4096)
#   KVD_DISAGG_REPEATS      fresh prompts per length (default 3)
#   KVD_DISAGG_COMPRESSION  the kvd model's policy (default "{stages: [quantize], quant_key_group:
#                           256}": int8 with one key scale a channel per 256-token chunk, 0.52 of
#                           the bytes, the dense form's default, docs/quality.md; "off" stores the
#                           raw chunks)
#   KVD_DISAGG_JSON         also write every sample there
#   KVD_BUILD_DIR           kvd's build folder (default build; ./deploy/setup.sh makes it)
# Needs ./deploy/setup.sh and ./deploy/setup-vllm.sh to have run. Logs stay in a temp folder,
# printed at the start.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
build=$(realpath "${KVD_BUILD_DIR:-build}")
venv=${KVD_VLLM_VENV:-$repo/.cache/vllm-venv}
model=${KVD_VLLM_MODEL:-$repo/models-cache/SmolLM2-135M-Instruct-hf}
port=${KVD_DISAGG_PORT:-8000}
policy=${KVD_DISAGG_COMPRESSION:-"{stages: [quantize], quant_key_group: 256}"}
serve=0
[[ ${1:-} == --serve ]] && serve=1

for need in "$build/bin/kvd" "$build/bin/kvdctl" "$venv/bin/python" "$model/config.json"; do
  [[ -e $need ]] || { echo "[disagg] missing $need: run ./deploy/setup.sh and ./deploy/setup-vllm.sh" >&2; exit 1; }
done
work=$(mktemp -d /tmp/kvd-disagg-XXXXXX)
echo "[disagg] logs in $work" >&2
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
  wait 2> /dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

healthy() { python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1" 2> /dev/null; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
kvd_port=$(free_port) prefill_port=$(free_port) decode_port=$(free_port)

# kvd: the demo model's layout (deploy/configs/default.yaml), int8 chunks unless asked.
cat > "$work/topology.yaml" << EOF
node: disagg
transport: {backend: ucx, ucx_tls: "sm,tcp", net_devices: lo}
models:
  - name: smollm2-135m
    layout: {layers: 30, kv_heads: 3, q_heads: 9, head_dim: 64, dtype: bfloat16,
             rope: {theta: 100000, pairing: halves, scaling: none}}
    compression: $policy
chunk_tokens: 256
tiers:
  host: {capacity: 2GiB, prefault: false, shared_memory: false}
EOF
"$build/bin/kvd" --config "$work/topology.yaml" --listen "127.0.0.1:$kvd_port" --unix none \
  --ready-file "$work/kvd.ready" > "$work/kvd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -f $work/kvd.ready ]] && break; sleep 0.1; done
[[ -f $work/kvd.ready ]] || { echo "[disagg] kvd did not start:" >&2; cat "$work/kvd.log" >&2; exit 1; }

connector() {  # the kv-transfer-config of one instance
  cat << EOF
{"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.vllm", "kv_role": "$1",
 "kv_load_failure_policy": "recompute",
 "kv_connector_extra_config": {"kvd_address": "127.0.0.1:$kvd_port", "kvd_model": "smollm2-135m",
                               "kvd_ucx_tls": "sm,tcp", "kvd_net_devices": "lo"}}
EOF
}
start_vllm() {  # name port role
  PYTHONPATH="$build/python" VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} \
    HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
    --served-model-name smollm2 --port "$2" --host 127.0.0.1 \
    --dtype bfloat16 --max-model-len 8192 --enforce-eager --no-enable-prefix-caching \
    --kv-transfer-config "$(connector "$3")" > "$work/$1.log" 2>&1 &
  pids+=($!)
  eval "${1}_pid=$!"
}
start_vllm prefill "$prefill_port" kv_producer
start_vllm decode "$decode_port" kv_consumer
echo "[disagg] kvd 127.0.0.1:$kvd_port, vLLM prefill :$prefill_port, decode :$decode_port; starting" >&2
for name_port in "prefill:$prefill_port" "decode:$decode_port"; do
  name=${name_port%%:*} p=${name_port##*:}
  pid_var="${name}_pid"
  for _ in $(seq 600); do
    healthy "http://127.0.0.1:$p/health" && break
    kill -0 "${!pid_var}" 2> /dev/null || break  # it exited: its log says why
    sleep 1
  done
  healthy "http://127.0.0.1:$p/health" || { echo "[disagg] vLLM $name did not start:" >&2; tail -40 "$work/$name.log" >&2; exit 1; }
done
python3 deploy/vllm/disagg_proxy.py --port "$port" --prefill "http://127.0.0.1:$prefill_port" \
  --decode "http://127.0.0.1:$decode_port" 2> "$work/proxy.log" &
pids+=($!)
for _ in $(seq 50); do healthy "http://127.0.0.1:$port/health" && break; sleep 0.1; done

python3 deploy/vllm/disagg_bench.py --prefill "http://127.0.0.1:$prefill_port" \
  --decode "http://127.0.0.1:$decode_port" --proxy "http://127.0.0.1:$port" --model smollm2 \
  --kvdctl "$build/bin/kvdctl" --kvd "127.0.0.1:$kvd_port" \
  --lengths "${KVD_DISAGG_LENGTHS:-1024,2048,4096}" --repeats "${KVD_DISAGG_REPEATS:-3}" \
  ${KVD_DISAGG_JSON:+--json "$KVD_DISAGG_JSON"}
echo "[disagg] kvd policy: $policy; logs: $work" >&2
if ((serve)); then
  echo "[disagg] serving: curl http://127.0.0.1:$port/v1/completions -d '{\"model\": \"smollm2\", \"prompt\": \"...\", \"max_tokens\": 32}'" >&2
  wait
fi
