#!/usr/bin/env bash
# kvd in one command: installs and builds (./deploy/setup.sh), starts build/bin/kvd on its
# embedded default topology, runs a put / lookup / get round trip that verifies every byte
# (kvd-roundtrip), prints `kvdctl stats`, stops kvd with SIGTERM and exits 0.
# Any failure stops kvd, prints its log and exits non-zero.
#
#   KVD_BUILD_DIR       build folder (default: build)
#   KVD_QUICKSTART_TLS  UCX_TLS of the client (default sm,tcp, as the embedded default's daemon)
#   KVD_SKIP_SETUP=1    use an existing build (needs kvd, kvdctl, kvd-roundtrip in KVD_BUILD_DIR)
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

echo "[quickstart] put / lookup / get round trip"
"$BIN/kvd-roundtrip" --addr "$addr" --model smollm2-135m --tokens 600 --ucx-tls "$TLS" \
  --net-devices lo

echo "[quickstart] kvdctl stats"
"$BIN/kvdctl" --addr "$addr" stats

echo "[quickstart] stopping kvd (SIGTERM)"
if ! stop_kvd; then
  echo "[quickstart] kvd did not exit cleanly" >&2
  exit 1
fi
echo "[quickstart] done"
