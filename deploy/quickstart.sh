#!/usr/bin/env bash
# kvd in one command: the disaggregated demo. Installs and builds (./deploy/setup.sh), fetches
# the demo model (./deploy/fetch-models.sh: SmolLM2-135M-Instruct), starts build/bin/kvd on its
# embedded default topology, whose smollm2-135m entry has a compression policy (expected
# attention with half the evicted choice by KeyDiff, p_c 0.5, window 16, sinks 4, then int8
# quantization; KeyDiff alone until kvd has seen 16 puts' window queries), then runs the
# reference engine as two separate processes:
#   kvd-demo prefill  runs a real prompt (deploy/demo/text.txt) one chunk per forward pass and
#                     puts each full chunk's raw K/V plus its last 16 post-RoPE queries to kvd,
#                     which compresses the chunk before acknowledging it;
#   kvd-demo decode   looks the prompt up, gets the compact chunks, expands them (bias form),
#                     continues generating and scores a held-out continuation, against a local
#                     prefill with the full cache;
# prints `kvdctl stats`, stops kvd with SIGTERM, and ends with the line
#   kvd-demo: model=M p_c=X raw_bytes=N stored_bytes=N ppl_full=F ppl_compressed=F top1_agree=F
# When the model cannot be fetched it says so and runs the raw round trip of random bytes
# (kvd-roundtrip with stories260k, a raw model of the embedded default) instead; exit 0 either way. Any failure
# stops kvd, prints its log and exits non-zero.
#
#   KVD_BUILD_DIR       build folder (default: build)
#   KVD_QUICKSTART_TLS  UCX_TLS of the clients (default sm,tcp, as the embedded default's daemon)
#   KVD_DEMO_THREADS    engine threads (default: all cores)
#   KVD_DEMO_POLICY     another compression policy for smollm2-135m (YAML flow map)
#   KVD_SKIP_SETUP=1    use an existing build (needs kvd, kvdctl, kvd-roundtrip, kvd-demo)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${KVD_SKIP_SETUP:-0}" != 1 ]]; then
  ./deploy/setup.sh
fi
BIN="${KVD_BUILD_DIR:-build}/bin"
TLS=${KVD_QUICKSTART_TLS:-sm,tcp}

work=$(mktemp -d /tmp/kvd-quickstart.XXXXXX)
kvd_pid=""
stop_kvd() {  # SIGTERM, wait up to 10 s; prints kvd's exit code
  local rc=0
  kill -TERM "$kvd_pid" 2>/dev/null || return 0
  for _ in $(seq 100); do kill -0 "$kvd_pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$kvd_pid" 2>/dev/null; then
    echo "[quickstart] kvd did not stop within 10 s; killing it" >&2
    kill -KILL "$kvd_pid" 2>/dev/null || true
  fi
  wait "$kvd_pid" 2>/dev/null || rc=$?
  kvd_pid=""
  return $rc
}
cleanup() {
  local rc=$?
  if [[ -n "$kvd_pid" ]]; then
    stop_kvd || true
    if [[ $rc -ne 0 ]]; then
      echo "[quickstart] kvd log (last 40 lines):" >&2
      tail -n 40 "$work/kvd.log" >&2 || true
    fi
  fi
  rm -rf "$work"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

model=""
if ! model=$(./deploy/fetch-models.sh); then
  model=""
  echo "[quickstart] the demo model could not be fetched (deploy/fetch-models.sh failed, see" \
    "above): falling back to the raw round trip of random bytes"
fi
# The embedded default (its smollm2-135m entry carries the demo's compression policy), on an
# ephemeral port and a private unix socket so that a kvd already running on 127.0.0.1:7400 does
# not get in the way. KVD_DEMO_POLICY replaces that policy.
config=()
if [[ -n "$model" && -n "${KVD_DEMO_POLICY:-}" ]]; then
  "$BIN/kvd" --print-default-config |
    sed "0,/^    compression: {.*/s//    compression: $KVD_DEMO_POLICY/" >"$work/kvd.yaml"
  grep -qF "compression: $KVD_DEMO_POLICY" "$work/kvd.yaml" ||
    { echo "[quickstart] could not set the policy in the topology" >&2; exit 1; }
  config=(--config "$work/kvd.yaml")
fi
if [[ -n "$model" ]]; then
  echo "[quickstart] smollm2-135m compression policy:" \
    "${KVD_DEMO_POLICY:-$("$BIN/kvd" --print-default-config | sed -n 's/^    compression: \({.*\)/\1/p' | head -n 1)}"
fi
"$BIN/kvd" "${config[@]}" --listen 127.0.0.1:0 --unix "$work/kvd.sock" --ready-file "$work/ready.json" \
  >"$work/kvd.log" 2>&1 &
kvd_pid=$!
for _ in $(seq 300); do
  [[ -s "$work/ready.json" ]] && break
  if ! kill -0 "$kvd_pid" 2>/dev/null; then
    echo "[quickstart] kvd exited before it was ready" >&2
    exit 1
  fi
  sleep 0.05
done
[[ -s "$work/ready.json" ]] || { echo "[quickstart] kvd not ready after 15 s" >&2; exit 1; }
addr=$(sed -n 's/.*"tcp" *: *"\([^"]*\)".*/\1/p' "$work/ready.json")
[[ -n "$addr" ]] || { echo "[quickstart] no tcp address in $(cat "$work/ready.json")" >&2; exit 1; }
echo "[quickstart] kvd ready on $addr (pid $kvd_pid)"

conn=(--addr "$addr" --ucx-tls "$TLS" --net-devices lo)
demo_line=""
if [[ -n "$model" ]]; then
  demo=(--model-file "$model" --text deploy/demo/text.txt --threads "${KVD_DEMO_THREADS:-0}")
  echo "[quickstart] prefill process: the prompt's KV and window queries to kvd"
  "$BIN/kvd-demo" prefill "${demo[@]}" "${conn[@]}"
  echo "[quickstart] decode process: the compressed cache from kvd, continue, score"
  "$BIN/kvd-demo" decode "${demo[@]}" "${conn[@]}" --baseline | tee "$work/decode.txt"
  demo_line=$(grep '^kvd-demo: ' "$work/decode.txt")
else
  "$BIN/kvd-roundtrip" "${conn[@]}" --model stories260k --tokens 600
fi

echo "[quickstart] kvdctl stats"
"$BIN/kvdctl" --addr "$addr" stats

echo "[quickstart] stopping kvd (SIGTERM)"
if ! stop_kvd; then
  echo "[quickstart] kvd did not exit cleanly" >&2
  exit 1
fi
echo "[quickstart] done"
if [[ -n "$demo_line" ]]; then echo "$demo_line"; fi
