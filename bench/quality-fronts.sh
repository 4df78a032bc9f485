#!/usr/bin/env bash
# Every figure of docs/quality.md's "Fronts" section: quality per stored byte, dense and compact
# fronts in both modes, passkey on the fronts, and kvpress's presses at equal stored bytes.
#
#   bench/quality-fronts.sh [BUILD_DIR]
#
# 1. $BIN/kvd-quality on 8 segments of 1024 + 128 tokens, one-shot and chunk-wise, every method
#    of KVD_FRONTS_METHODS at its own p_c list, the passkey prompts asked of every front row
#    (--passkey-fronts) -> $out/kvd (results.md, results.csv, fronts-<mode>.png, ...).
# 2. With the kvpress venv of bench/quality-peers.sh (installed by it; skipped when it cannot be),
#    kvpress's presses on the first KVD_FRONTS_PRESS_SEGMENTS of the same segments at
#    KVD_FRONTS_PRESS_RATIOS -> $out/kvpress (transformers on the CPU is the slow part), and
#    transformers' quantized KV cache (optimum-quanto, HQQ; KVD_FRONTS_QUANT) in the same call;
#    then bench/kvpress/table.py --equal-bytes -> $out/peers.md: each of these peer rows against
#    kvd's best one-shot row storing at most its bytes, paired on the same segments, then the
#    same against kvd's best chunk-wise row (--kvd-mode chunk-wise), then each quantized-cache
#    row against kvd's best dense row (--form dense).
#
#   KVD_FRONTS_OUT           results folder (default: quality-fronts)
#   KVD_FRONTS_SIZE          "SEGMENTS PREFIX CONTINUATION WINDOW" (default: "8 1024 128 32")
#   KVD_FRONTS_METHODS       kvd-quality --methods (default below; name@p_c:p_c per method)
#   KVD_FRONTS_PASSKEY       "CONTEXT TRIALS MULTIKEY" (default: "1024 4 8"; CONTEXT 0 = none)
#   KVD_FRONTS_PASSKEY_METHODS  rows asked the passkey prompts besides the fronts' (default below)
#   KVD_FRONTS_PRESSES       presses (default: snapkv,streaming_llm,expected_attention,tova,
#                            keydiff,knorm,kvzip)
#   KVD_FRONTS_PRESS_RATIOS  press p_c list (default: 0.9, i.e. 0.10 of the bytes)
#   KVD_FRONTS_PRESS_SEGMENTS  segments for the presses (default: 8; paired on these)
#   KVD_FRONTS_QUANT         run_presses.py --quant rows, group 64, no residual window (default:
#                            quanto:int4,quanto:int2,hqq:int8,hqq:int4,hqq:int2; "" = none)
#   KVD_FRONTS_KVPRESS=0     skip step 2
# Cost (2 cores, --jobs 2 --threads 1): about 1000 s of CPU for step 1 and 480-600 s for step 2
# (docs/quality.md gives the measured figures). CPU-heavy: on a shared machine run it under the
# build lock (flock /tmp/kvd-build.lock ...).
set -euo pipefail
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo_root"
source bench/lib.sh
bench_build_dir "${1:-}"
bench_binaries quality-fronts kvd-quality

log() { echo "[quality-fronts] $*" >&2; }
gguf="$repo_root/models-cache/SmolLM2-135M-Instruct.Q4_1.gguf"
[[ -f $gguf ]] || gguf=$(./deploy/fetch-models.sh)
out=${KVD_FRONTS_OUT:-quality-fronts}
read -r segs prefix cont window <<< "${KVD_FRONTS_SIZE:-8 1024 128 32}"
read -r pk_ctx pk_trials mk_trials <<< "${KVD_FRONTS_PASSKEY:-1024 4 8}"
# Dense candidates at p_c 0 (every token, stored in fewer bits); compact ones: eviction alone,
# and eviction then quantization at the p_c that land near 0.14, 0.10 and 0.05 of the bytes (int4
# stores 0.28 of every token's bytes, int8 0.53). Below int4 on the dense front: the rotated
# forms (3-bit keys over 37 slots, 4-bit keys over the whole 256-slot chunk, each with 2-bit
# values, symmetric ones for int2s), and int8 / int4 with one key group a chunk. Expected attention
# (statistics of the calibration prefixes' window queries) alone, with int8, and fused half and
# half with KeyDiff with its outliers first (ea_keydiff50_out2; with int8, the embedded default),
# beside the eviction rows. At 0.10 of the bytes: eviction at p_c 0.51, then rotated 4-bit keys
# with symmetric 2-bit values (0.199 of a kept token's bytes), after SnapKV, expected attention
# and the default's scorer. With the sequence's 4 sink tokens unquantized (quant_sinks: 4): int4,
# 3-bit keys over 37 slots with symmetric 2-bit values (rotated), and the default's scorer with int4.
# With zero-anchored values (int8z / int4z: a one-byte minimum per group): int8 keys over the chunk,
# and int4 keys over 64 and 96 slots with the sequence's first token unquantized (quant_sinks: 1),
# over 64 also after the Hadamard rotation. The default's scorer with KeyDiff's rank max-pooled
# over 3 tokens (ea_keydiff_pool: 3; with int8, the embedded default; with int4 and exact sinks)
# beside the one without.
methods=${KVD_FRONTS_METHODS:-full,bf16@0,int8@0,int8_kg256@0,int8k_int8zv_kg256@0,fp8@0,int4@0,int4_kg256@0,\
int4_rot_kg256@0,int4k_int2v_rot_kg256@0,int4k_int2sv_rot_kg256@0,int3k_int2v_rot_kg37@0,\
sink_recent@0.5:0.75:0.9,snapkv@0.5:0.75:0.91,keydiff@0.5:0.75:0.91,\
expected_attention@0.5:0.75:0.9,ea_keydiff50_out2@0.5:0.75:0.9,snapkv+int4@0.5:0.66:0.83,\
keydiff+int4@0.5:0.65:0.83,snapkv+int8@0.82,keydiff+int8@0.5:0.82,expected_attention+int8@0.5:0.82,\
ea_keydiff50_out2+int8@0.5:0.73:0.82,ea_keydiff50_out2_pool3@0.5:0.75:0.9,\
ea_keydiff50_out2_pool3+int8@0.5:0.73:0.82,snapkv+int4k_int2sv_rot_kg256@0.51,\
expected_attention+int4k_int2sv_rot_kg256@0.51,ea_keydiff50_out2+int4k_int2sv_rot_kg256@0.51,\
int4_exactsinks@0,int3k_int2sv_rot_kg37_exactsinks@0,ea_keydiff50_out2+int4_exactsinks@0.5,\
ea_keydiff50_out2_pool3+int4_exactsinks@0.5,\
int4k_int4zv_sinks1@0,int4k_int4zv_kg96_sinks1@0,int4k_int4zv_rot_sinks1@0}
# The passkey prompts are asked of these rows too, on a front or not: the full cache and the
# densest rows under 0.53, 0.28 and 0.20 of the bytes.
passkey_methods=${KVD_FRONTS_PASSKEY_METHODS:-full,int8_kg256,int8k_int8zv_kg256,int4_kg256,\
int4_rot_kg256,int4k_int2sv_rot_kg256,int4_exactsinks,int3k_int2sv_rot_kg37_exactsinks,\
int4k_int4zv_sinks1,int4k_int4zv_kg96_sinks1,int4k_int4zv_rot_sinks1}
presses=${KVD_FRONTS_PRESSES:-snapkv,streaming_llm,expected_attention,tova,keydiff,knorm,kvzip}
press_ratios=${KVD_FRONTS_PRESS_RATIOS:-0.9}
press_segs=${KVD_FRONTS_PRESS_SEGMENTS:-8}
quant=${KVD_FRONTS_QUANT-quanto:int4,quanto:int2,hqq:int8,hqq:int4,hqq:int2}
mkdir -p "$out"

log "kvd-quality: $segs segments of $prefix + $cont, window $window, passkey $pk_ctx tokens"
start=$(date +%s)
/usr/bin/time -f "%U %S" -o "$out/kvd.cpu" "$BIN/kvd-quality" --model "$gguf" --out "$out/kvd" \
  --segments "$segs" --prefix "$prefix" --continuation "$cont" --window "$window" --chunk 256 \
  --chunk-window 16 --modes chunk-wise,one-shot --calib-segments 4 --methods "$methods" \
  --paired-against sink_recent,keydiff \
  --passkey "$pk_ctx" --passkey-trials "$pk_trials" --multikey-trials "$mk_trials" \
  --passkey-methods "$passkey_methods" --passkey-fronts --jobs 2 --threads 1 > "$out/kvd.log" 2>&1 \
  || { tail -20 "$out/kvd.log" >&2; exit 1; }
log "kvd-quality: $(( $(date +%s) - start )) s wall, $(awk '{print $1 + $2}' "$out/kvd.cpu") s CPU"

[[ ${KVD_FRONTS_KVPRESS:-1} == 1 ]] || exit 0
py=$(KVD_PEERS_SETUP_ONLY=1 bench/quality-peers.sh "$BUILD_DIR" | sed -n 's/^python=//p')
[[ -n $py ]] || { log "no kvpress venv (bench/quality-peers.sh says why); kvpress skipped"; exit 0; }
log "kvpress presses: $presses at p_c $press_ratios"
start=$(date +%s)
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 /usr/bin/time -f "%U %S" -o "$out/kvpress.cpu" \
  "$py" bench/kvpress/run_presses.py --gguf "$gguf" --out "$out/kvpress" --segments "$press_segs" \
  --prefix "$prefix" --continuation "$cont" --window "$window" --ratios "$press_ratios" \
  --presses "$presses" ${quant:+--quant "$quant" --quant-group 64 --quant-residual 0} \
  --threads 2 > "$out/kvpress.log" 2>&1 \
  || { tail -20 "$out/kvpress.log" >&2; exit 1; }
log "kvpress: $(( $(date +%s) - start )) s wall, $(awk '{print $1 + $2}' "$out/kvpress.cpu") s CPU"
{
  "$py" bench/kvpress/table.py "$out/kvd" "$out/kvpress" --equal-bytes
  echo
  "$py" bench/kvpress/table.py "$out/kvd" "$out/kvpress" --equal-bytes --kvd-mode chunk-wise
  if [[ -n $quant ]]; then
    echo
    "$py" bench/kvpress/table.py "$out/kvd" "$out/kvpress" --equal-bytes --form dense
  fi
} | tee "$out/peers.md"
