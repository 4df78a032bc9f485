#!/usr/bin/env bash
# The disaggregated demo through a real kvd process, on a short prompt (ctest label `serving`).
# kvd runs the embedded default with its expected-attention (KeyDiff share 0.5) p_c 0.5 + int8
# policy for smollm2-135m (as the quickstart). The test puts 2 chunks of 16 window queries, fewer
# than the 256 per layer expected attention waits for, so kvd scores them by KeyDiff, as the
# policy says; `kvd-demo local --score keydiff` is that plan:
#   1. kvd-demo prefill (one process) puts the prompt's full chunks with their window queries;
#      kvd compresses them at ingest;
#   2. kvd-demo decode (another process) looks the prompt up, gets the compact chunks, expands
#      them with the client library (expand.h) and decodes; prints the `kvd-demo:` line;
#   3. kvd-demo local compresses the same chunks in-process (kernels' Compress on the same
#      inputs) and decodes from that cache;
# checks that decode from the kvd-served cache gives exactly the logits of the in-process
# compressed cache (byte-identical float32 files), and that kvd stored exactly the bytes of the
# in-process compact chunks.
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

# The embedded default (smollm2-135m: expected attention + KeyDiff, p_c 0.5, window 16, sinks 4,
# int8) with a small arena
# (the test holds two compact chunks).
"$bin/kvd" --print-default-config |
  sed -e 's/^\(    capacity:\) 1GiB.*/\1 64MiB/' -e 's/^\(    prefault:\) true.*/\1 false/' \
    >"$work/kvd.yaml"
grep -q "capacity: 64MiB" "$work/kvd.yaml" || { echo "FAIL: could not shrink the arena"; exit 1; }
grep -qF "compression: {stages: [expected_attention, quantize], p_c: 0.5, window: 16, sinks: 4, ea_keydiff_share: 0.5, ea_keydiff_outlier_z: 2, ea_keydiff_pool: 3}" "$work/kvd.yaml" ||
  { echo "FAIL: the embedded default lost the demo policy"; exit 1; }
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
"$bin/kvd-demo" decode "${common[@]}" "${conn[@]}" --baseline --logits-out "$work/served.f32" |
  tee "$work/decode.txt"
"$bin/kvd-demo" local "${common[@]}" --p-c 0.5 --window 16 --score keydiff --quant int8 \
  --logits-out "$work/local_compressed.f32" --full-logits-out "$work/local_full.f32" |
  tee "$work/local.txt"

grep -q "(compact)" "$work/decode.txt" || { echo "FAIL: kvd did not serve compact chunks"; exit 1; }
# kvd compressed the chunks as kernels' Compress does in-process, the client library expanded
# them as the kernels' serving code does: the same floats, bit for bit.
cmp "$work/served.f32" "$work/local_compressed.f32" ||
  { echo "FAIL: logits from the kvd-served cache differ from the in-process compressed cache"; exit 1; }
[[ $(stat -c %s "$work/served.f32") -eq $((16 * 49152 * 4)) ]] ||
  { echo "FAIL: unexpected logits size"; exit 1; }

# The lines: kvd stored exactly the bytes of the in-process compact chunks (the kernels' encode of
# the same plan), and int8 after evicting half stores about a quarter of the raw chunk (keys and
# values 1 byte instead of 2 for half the tokens, plus scales and slot metadata: 0.266 measured).
line=$(grep '^kvd-demo: ' "$work/decode.txt")
local_line=$(grep '^kvd-demo: ' "$work/local.txt")
echo "$line"
python3 - "$line" "$local_line" <<'PY'
import sys
f, local = (dict(kv.split("=", 1) for kv in a.split()[1:]) for a in sys.argv[1:3])
raw, stored = int(f["raw_bytes"]), int(f["stored_bytes"])
print(f"stored/raw={stored / raw:.4f} in-process stored={local['stored_bytes']}")
if stored != int(local["stored_bytes"]) or raw != int(local["raw_bytes"]):
    sys.exit("FAIL: kvd stored other bytes than the in-process compact chunks")
if not 0.25 < stored / raw < 0.28:
    sys.exit("FAIL: stored/raw outside (0.25, 0.28) for KeyDiff p_c 0.5 + int8")
for k in ("ppl_full", "ppl_compressed", "top1_agree"):
    float(f[k])
PY
echo "PASS"
