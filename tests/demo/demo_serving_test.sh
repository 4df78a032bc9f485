#!/usr/bin/env bash
# The disaggregated demo through a real kvd process, on a short prompt (ctest label `serving`):
#   1. kvd-demo prefill (one process) pushes the prompt's full chunks to kvd;
#   2. kvd-demo decode (another process) looks the prompt up, gets the chunks and decodes;
#   3. kvd-demo local builds the same cache in-process from the same inputs;
# checks that decode from the kvd-served cache gives exactly the logits of the in-process cache
# (byte-identical float32 files), and that the `kvd-demo:` line's stored/raw ratio matches p_c.
# Skips (exit 77) without the SmolLM2 model.
#
#   demo_serving_test.sh BIN_DIR REPO_ROOT
set -euo pipefail
bin="$1"
root="$2"
model="${KVD_MODELS_DIR:-$root/models-cache}/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ ! -f "$model" ]]; then
  echo "SKIP: $model not found (run deploy/fetch-models.sh)"
  exit 77
fi
work=$(mktemp -d /tmp/kvd-demo-test.XXXXXX)
kvd_pid=""
cleanup() {
  if [[ -n "$kvd_pid" ]]; then
    kill -TERM "$kvd_pid" 2>/dev/null || true
    wait "$kvd_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# The embedded default with a small arena (the test holds two 5.6 MiB chunks).
"$bin/kvd" --print-default-config |
  sed -e 's/^\(    capacity:\) 1GiB.*/\1 64MiB/' -e 's/^\(    prefault:\) true.*/\1 false/' \
    >"$work/kvd.yaml"
grep -q "capacity: 64MiB" "$work/kvd.yaml" || { echo "FAIL: could not shrink the arena"; exit 1; }
"$bin/kvd" --config "$work/kvd.yaml" --listen 127.0.0.1:0 --unix "$work/kvd.sock" \
  --ready-file "$work/ready.json" >"$work/kvd.log" 2>&1 &
kvd_pid=$!
for _ in $(seq 300); do
  [[ -s "$work/ready.json" ]] && break
  sleep 0.05
done
addr=$(sed -n 's/.*"tcp" *: *"\([^"]*\)".*/\1/p' "$work/ready.json")
[[ -n "$addr" ]] || { echo "FAIL: kvd not ready"; cat "$work/kvd.log"; exit 1; }

common=(--model-file "$model" --text "$root/deploy/demo/text.txt" --prompt-tokens 530
  --heldout 16 --generate 4 --threads 2)
conn=(--addr "$addr" --ucx-tls sm,tcp --net-devices lo)
"$bin/kvd-demo" prefill "${common[@]}" "${conn[@]}" | tee "$work/prefill.txt"
"$bin/kvd-demo" decode "${common[@]}" "${conn[@]}" --logits-out "$work/served.f32" |
  tee "$work/decode.txt"
"$bin/kvd-demo" local "${common[@]}" --p-c 0.5 --logits-out "$work/local_compressed.f32" \
  --full-logits-out "$work/local_full.f32" | tee "$work/local.txt"

# kvd stores the chunks raw (no compression policy in this build): the kvd-served cache must be
# the in-process full cache, bit for bit (same bf16 chunk bytes, same engine code).
cmp "$work/served.f32" "$work/local_full.f32" ||
  { echo "FAIL: logits from the kvd-served cache differ from the in-process cache"; exit 1; }
[[ $(stat -c %s "$work/served.f32") -eq $((16 * 49152 * 4)) ]] ||
  { echo "FAIL: unexpected logits size"; exit 1; }

# The line: stored / raw against 1 - p_c. The compact format adds, per slot, its position (8 B),
# cardinality (4 B) and flags (1 B) to the 2 x 64 bf16 (256 B) of key and value, plus 64-byte
# section padding per head and a header: 5.1% over the KV payload at head_dim 64. The check
# allows 2% on top of that overhead.
line=$(grep '^kvd-demo: ' "$work/local.txt")
echo "$line"
python3 - "$line" <<'PY'
import sys
f = dict(kv.split("=", 1) for kv in sys.argv[1].split()[1:])
p_c, raw, stored = float(f["p_c"]), int(f["raw_bytes"]), int(f["stored_bytes"])
ratio = stored / raw
expected = (1 - p_c) * (256 + 13) / 256
print(f"stored/raw={ratio:.4f} 1-p_c={1 - p_c:.4f} with slot metadata={expected:.4f}")
if abs(ratio - expected) > 0.02 * expected:
    sys.exit("FAIL: stored/raw not within 2% of (1 - p_c) plus the format's slot metadata")
for k in ("ppl_full", "ppl_compressed", "top1_agree"):
    float(f[k])
PY
echo "PASS"
