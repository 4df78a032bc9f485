#!/usr/bin/env bash
# kvd's reference engine (kvd-quality, full cache) and transformers in the kvpress venv
# (bench/kvpress/run_presses.py, full cache) give the same perplexity on the same tokens.
#
#   kvpress_fullcache_test.sh KVD_QUALITY VENV_PYTHON MODELS_DIR
#
# Exit 77 (skip) with the reason when the venv (bench/quality-peers.sh) or the model is missing.
#
# Tolerance 1e-4 relative. Both engines run the same dequantized Q4_1 weights in float32 (the
# runner loads the GGUF itself); what differs is the order of float32 accumulation (kvd's kernels
# vs torch's BLAS and SDPA): ~1e-6 relative per dot product of 576-1536 terms, reaching the
# logits as ~1e-5 after 30 layers (the reference engine agreed with an independent one to 2e-5 in
# logits). A logit error e moves each token's NLL by at most 2e, so the perplexity by ~2e =
# 2e-5 to 4e-5 relative; measured: 9e-8 to 7e-7. The HF folder's bfloat16-rounded weights (2^-9
# relative) move it by 8e-4 to 9e-4, so 1e-4 fails on them, as on a token off by one or a wrong RoPE
# position.
set -euo pipefail
kvd_quality=$1 py=$2 models=$3
src="$(cd "$(dirname "$0")/../.." && pwd)"
gguf="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
hf="$models/SmolLM2-135M-Instruct-hf"
[[ -x $py ]] || { echo "SKIP: no kvpress venv at $py (run bench/quality-peers.sh)"; exit 77; }
[[ -f $gguf ]] || { echo "SKIP: no model $gguf (deploy/fetch-models.sh)"; exit 77; }
[[ -f $hf/config.json ]] || { echo "SKIP: no HF folder $hf (bench/quality-peers.sh)"; exit 77; }
work=$(mktemp -d /tmp/kvd-kvpress-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
size=(--segments 2 --prefix 128 --continuation 32)
"$kvd_quality" --model "$gguf" --out "$work/kvd" "${size[@]}" --window 16 --modes one-shot \
  --passkey 0 --calib-segments 0 --methods full --ratios 0.5 --threads 1 --jobs 1 > "$work/kvd.log" 2>&1 \
  || { cat "$work/kvd.log"; exit 1; }
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$py" "$src/bench/kvpress/run_presses.py" --gguf "$gguf" \
  --model "$hf" --out "$work/kvp" "${size[@]}" --presses "" --threads 1 > "$work/kvp.log" 2>&1 \
  || { cat "$work/kvp.log"; exit 1; }
"$py" - "$work/kvd/results.csv" "$work/kvp/results.csv" <<'PY'
import csv, sys
kvd = next(r for r in csv.DictReader(open(sys.argv[1])) if r["method"] == "engine")
hf = next(r for r in csv.DictReader(open(sys.argv[2])) if r["method"] == "full")
a, b = float(kvd["perplexity"]), float(hf["perplexity"])
rel = abs(a - b) / a
print(f"full-cache perplexity: kvd {a:.6f} ({kvd['scored_tokens']} tokens), "
      f"transformers {b:.6f} ({hf['scored_tokens']} tokens), relative difference {rel:.2e}")
ok = kvd["scored_tokens"] == hf["scored_tokens"] and rel < 1e-4
sys.exit(0 if ok else 1)
PY
