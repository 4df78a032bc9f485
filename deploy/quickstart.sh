#!/usr/bin/env bash
# kvd in one command: the disaggregated demo. Installs and builds (./deploy/setup.sh), fetches
# the demo model (./deploy/fetch-models.sh: SmolLM2-135M-Instruct), starts build/bin/kvd on its
# embedded default topology, then runs the reference engine as two separate processes:
#   kvd-demo prefill  runs a real prompt (deploy/demo/text.txt) and pushes its KV to kvd;
#   kvd-demo decode   looks the prompt up in kvd, gets the chunks, continues generating and
#                     scores a held-out continuation (against a local prefill as the baseline);
# then kvd-demo local compresses the same chunks chunk by chunk in-process (SnapKV, p_c 0.5,
# each chunk with only its own K/V and last-32 queries) and compares full and compressed caches.
# Prints `kvdctl stats`, stops kvd with SIGTERM, and ends with the line
#   kvd-demo: model=M p_c=X raw_bytes=N stored_bytes=N ppl_full=F ppl_compressed=F top1_agree=F
# When the model cannot be fetched it says so and runs the raw round trip of random bytes
# (kvd-roundtrip) instead; exit 0 either way. Any failure stops kvd, prints its log and exits
# non-zero.
#
#   KVD_BUILD_DIR       build folder (default: build)
#   KVD_QUICKSTART_TLS  UCX_TLS of the clients (default sm,tcp, as the embedded default's daemon)
#   KVD_DEMO_THREADS    engine threads (default: all cores)
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

# The embedded default, on an ephemeral port and a private unix socket so that a kvd already
# running on 127.0.0.1:7400 does not get in the way.
echo "[quickstart] starting $BIN/kvd (embedded default topology)"
"$BIN/kvd" --listen 127.0.0.1:0 --unix "$work/kvd.sock" --ready-file "$work/ready.json" \
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
if model=$(./deploy/fetch-models.sh); then
  demo=(--model-file "$model" --text deploy/demo/text.txt --threads "${KVD_DEMO_THREADS:-0}")
  echo "[quickstart] prefill process: the prompt's KV to kvd"
  "$BIN/kvd-demo" prefill "${demo[@]}" "${conn[@]}"
  echo "[quickstart] decode process: the prompt's cache from kvd, continue, score"
  "$BIN/kvd-demo" decode "${demo[@]}" "${conn[@]}" --baseline
  echo "[quickstart] full vs compressed cache (chunk-wise compression in-process, p_c 0.5)"
  "$BIN/kvd-demo" local "${demo[@]}" --p-c 0.5 | tee "$work/local.txt"
  demo_line=$(grep '^kvd-demo: ' "$work/local.txt")
else
  echo "[quickstart] the demo model could not be fetched (deploy/fetch-models.sh failed, see" \
    "above): falling back to the raw round trip of random bytes"
  "$BIN/kvd-roundtrip" "${conn[@]}" --model smollm2-135m --tokens 600
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
