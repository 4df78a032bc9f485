#!/usr/bin/env bash
# kvpress (NVIDIA, PyPI kvpress 0.5.5) side by side with kvd's compression methods, on the same
# texts, segments and ratios and with perplexity computed the same way (docs/quality.md,
# "kvpress side by side").
#
#   bench/quality-peers.sh [BUILD_DIR]
#
# 1. Installs the pins of bench/kvpress/requirements.txt into the project-local venv
#    .cache/kvpress-venv (a stamp with the pins' sha256 makes a rerun take seconds; without a
#    reachable package index it says so and exits 0).
# 2. Converts the demo GGUF to an HF folder (deploy/vllm/convert-gguf-to-hf.py) if missing.
# 3. Runs $BIN/kvd-quality (kvd's methods) and bench/kvpress/run_presses.py (kvpress's presses)
#    on the same segments and prints one table (bench/kvpress/table.py), paired against kvd's
#    sink_recent, then each press against kvd's best row at no more stored bytes (--equal-bytes;
#    kvd's bytes are the encoded chunks', a press's its kept fraction of tokens).
#
#   KVD_KVPRESS_VENV  venv folder (default: <repo>/.cache/kvpress-venv)
#   KVD_PEERS_OUT     results folder (default: quality-peers)
#   KVD_PEERS_SIZE    "SEGMENTS PREFIX CONTINUATION WINDOW" (default: "4 512 64 32")
#   KVD_PEERS_RATIOS  p_c list (default: 0.5,0.75,0.9)
#   KVD_PEERS_KVD     kvd-quality methods (default below)
#   KVD_PEERS_PRESSES run_presses.py presses (default below)
#   KVD_PEERS_PAIRS   extra paired comparisons across ratios, A@PC,B@PC ... (default below)
#   KVD_PEERS_SETUP_ONLY=1  install and convert, then exit
# CPU-heavy: on a shared machine run it under the build lock (flock /tmp/kvd-build.lock ...).
set -euo pipefail
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo_root"
source bench/lib.sh
bench_build_dir "${1:-}"

readonly REQS="bench/kvpress/requirements.txt"
venv="${KVD_KVPRESS_VENV:-$repo_root/.cache/kvpress-venv}"
py="$venv/bin/python"
models_dir="$repo_root/models-cache"
hf="$models_dir/SmolLM2-135M-Instruct-hf"
gguf="$models_dir/SmolLM2-135M-Instruct.Q4_1.gguf"
out=${KVD_PEERS_OUT:-quality-peers}
read -r segs prefix cont window <<< "${KVD_PEERS_SIZE:-4 512 64 32}"
ratios=${KVD_PEERS_RATIOS:-0.5,0.75,0.9}
kvd_methods=${KVD_PEERS_KVD:-full,sink_recent,snapkv,keydiff,pyramidkv,adakv,kvslimmer_l2,int8,int4,keydiff+int4}
presses=${KVD_PEERS_PRESSES:-streaming_llm,snapkv,keydiff,tova,expected_attention,knorm,kvzip,qfilter}

log() { echo "[quality-peers] $*" >&2; }

want_stamp="$(sha256sum "$REQS" | cut -d' ' -f1)"
stamp="$venv/.kvd-stamp"
if [[ -x $py && -f $stamp && $(cat "$stamp") == "$want_stamp" ]]; then
  log "venv up to date: $venv"
else
  if ! index=$(deploy/pip-index-reachable.sh kvpress); then
    log "the Python package index ($index) is not reachable; cannot install kvpress -- skipped"
    exit 0
  fi
  log "installing $REQS into $venv (~6 GB with torch, a few minutes; the pip cache is shared with deploy/setup-vllm.sh)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$py" -m pip install -q --disable-pip-version-check -r "$REQS"
  "$py" -c "import kvpress, torch, transformers; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'torch', torch.__version__, 'transformers', transformers.__version__)" >&2
  echo "$want_stamp" > "$stamp"
fi

if [[ ! -f $hf/config.json ]]; then
  [[ -f $gguf ]] || gguf=$(./deploy/fetch-models.sh)
  log "converting $gguf to $hf (offline, ~20 s)"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$py" deploy/vllm/convert-gguf-to-hf.py "$gguf" "$hf" >&2
fi
[[ ${KVD_PEERS_SETUP_ONLY:-0} == 1 ]] && { echo "python=$py"; exit 0; }

bench_binaries quality-peers kvd-quality
mkdir -p "$out"
log "kvd-quality: $segs segments of $prefix + $cont, window $window, p_c $ratios"
"$BIN/kvd-quality" --model "$gguf" --out "$out/kvd" --segments "$segs" --prefix "$prefix" \
  --continuation "$cont" --window "$window" --ratios "$ratios" --modes one-shot --passkey 0 \
  --calib-segments 0 --methods "$kvd_methods" --paired-against sink_recent --threads 1 --jobs 2 \
  > "$out/kvd.log" 2>&1 || { tail -20 "$out/kvd.log" >&2; exit 1; }
log "kvpress presses: $presses"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$py" bench/kvpress/run_presses.py --gguf "$gguf" \
  --out "$out/kvpress" --segments "$segs" --prefix "$prefix" --continuation "$cont" \
  --window "$window" --ratios "$ratios" --presses "$presses" --threads 2 | tee "$out/kvpress.log" >&2
# Cross-ratio pairs: kvd at fewer bytes against kvpress's best at 0.10, and kvd's KeyDiff against
# kvpress's (KVD_PEERS_PAIRS, space separated A@PC,B@PC; rows that are absent are an error).
pairs=${KVD_PEERS_PAIRS:-int4@0.75,kvpress:snapkv@0.9 int4@0.5,kvpress:snapkv@0.9 keydiff@0.5,kvpress:keydiff@0.5 keydiff@0.9,kvpress:keydiff@0.9}
pair_args=()
for p in $pairs; do pair_args+=(--pair "$p"); done
"$py" bench/kvpress/table.py "$out/kvd" "$out/kvpress" --against sink_recent "${pair_args[@]}" \
  | tee "$out/table.md"
# At equal stored bytes: each press against kvd's best row storing no more (stored_raw).
echo | tee -a "$out/table.md"
"$py" bench/kvpress/table.py "$out/kvd" "$out/kvpress" --equal-bytes | tee -a "$out/table.md"
