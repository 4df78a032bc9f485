#!/usr/bin/env bash
# Measures kvd put/get bandwidth for 2 MiB chunks over shared memory next to ucx_perftest tag
# bandwidth for 2 MiB messages, in the same run on the same machine, and prints the ratio.
# Also reports lookup latency p50/p99 on loopback.
#
#   deploy/bench-transport.sh [BUILD_DIR]      (default: build; binaries in BUILD_DIR/bin)
#   KVD_BENCH_COUNT        chunks / messages per measurement (default 200)
#   KVD_BENCH_TLS          UCX_TLS for both (default sm,tcp: shared memory carries the bytes)
#   KVD_BENCH_DEPTHS       kvd-bench --depth values to try (default "1 8")
#   KVD_BENCH_CONCURRENCY  kvd-bench --concurrency (default 1)
#
# Needs: kvd, kvd-bench built; ucx_perftest (Debian ucx-utils). Exit 0 when every measurement ran.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-${KVD_BUILD_DIR:-build}}
BIN="$BUILD_DIR/bin"
COUNT=${KVD_BENCH_COUNT:-200}
TLS=${KVD_BENCH_TLS:-sm,tcp}
DEPTHS=${KVD_BENCH_DEPTHS:-1 8}
CONC=${KVD_BENCH_CONCURRENCY:-1}
SIZE=2097152

for b in kvd kvd-bench; do
  [[ -x "$BIN/$b" ]] || { echo "[bench] $BIN/$b not built (run ./deploy/setup.sh)" >&2; exit 1; }
done
command -v ucx_perftest >/dev/null || { echo "[bench] ucx_perftest not found (apt-get install ucx-utils)" >&2; exit 1; }

work=$(mktemp -d /tmp/kvd-bench.XXXXXX)
kvd_pid=""
perf_pid=""
cleanup() {
  local rc=$?
  [[ -n "$perf_pid" ]] && kill "$perf_pid" 2>/dev/null || true
  if [[ -n "$kvd_pid" ]] && kill -0 "$kvd_pid" 2>/dev/null; then
    kill -TERM "$kvd_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$kvd_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$kvd_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
  exit $rc
}
trap cleanup EXIT INT TERM

json_field() {  # json_field FILE PATH  (PATH like put.gbps)
  /usr/bin/python3 -c 'import json,sys; v=json.load(open(sys.argv[1]))
for k in sys.argv[2].split("."): v=v[k]
print(v)' "$1" "$2"
}

# ---- ucx_perftest: tag bandwidth, 2 MiB messages, same TLS, loopback ----
port=$((20000 + RANDOM % 20000))
UCX_TLS=$TLS UCX_NET_DEVICES=lo ucx_perftest -t tag_bw -s $SIZE -n "$COUNT" -p "$port" \
  >"$work/perf-server.log" 2>&1 &
perf_pid=$!
sleep 1
UCX_TLS=$TLS UCX_NET_DEVICES=lo ucx_perftest 127.0.0.1 -t tag_bw -s $SIZE -n "$COUNT" -p "$port" \
  >"$work/perf-client.log" 2>&1 || { cat "$work/perf-client.log" >&2; exit 1; }
wait "$perf_pid" || true
perf_pid=""
# "Final: iters  lat50 lat_avg lat_overall  bw_avg bw_overall  rate_avg rate_overall" (MB = MiB)
perf_mibs=$(awk '/Final:/ {print $7}' "$work/perf-client.log")
[[ -n "$perf_mibs" ]] || { cat "$work/perf-client.log" >&2; exit 1; }
perf_gbps=$(awk -v m="$perf_mibs" 'BEGIN {printf "%.3f", m * 1048576 / 1e9}')

# ---- kvd on its embedded default (llama-3.1-8b: 16 tokens = 2 MiB raw chunk) ----
"$BIN/kvd" --listen 127.0.0.1:0 --unix "$work/kvd.sock" --ready-file "$work/ready.json" \
  >"$work/kvd.log" 2>&1 &
kvd_pid=$!
for _ in $(seq 300); do
  [[ -s "$work/ready.json" ]] && break
  kill -0 "$kvd_pid" 2>/dev/null || { echo "[bench] kvd died:" >&2; cat "$work/kvd.log" >&2; exit 1; }
  sleep 0.05
done
[[ -s "$work/ready.json" ]] || { echo "[bench] kvd not ready" >&2; cat "$work/kvd.log" >&2; exit 1; }
addr=$(json_field "$work/ready.json" tcp)

echo "== same machine, same run: 2 MiB messages, UCX_TLS=$TLS, loopback, count $COUNT =="
printf "%-44s %10s\n" "measurement" "GB/s"
printf "%-44s %10s\n" "ucx_perftest tag_bw (one stream)" "$perf_gbps"
best_put=0; best_get=0
for d in $DEPTHS; do
  "$BIN/kvd-bench" --addr "$addr" --model llama-3.1-8b --chunk-bytes $SIZE --count "$COUNT" \
    --concurrency "$CONC" --depth "$d" --op both --ucx-tls "$TLS" --net-devices lo --json \
    >"$work/bench-$d.json" || { cat "$work/bench-$d.json" >&2; cat "$work/kvd.log" | tail -20 >&2; exit 1; }
  put=$(json_field "$work/bench-$d.json" put.gbps)
  get=$(json_field "$work/bench-$d.json" get.gbps)
  printf "%-44s %10.3f\n" "kvd put (concurrency $CONC, depth $d)" "$put"
  printf "%-44s %10.3f\n" "kvd get (concurrency $CONC, depth $d)" "$get"
  best_put=$(awk -v a="$best_put" -v b="$put" 'BEGIN {print (b > a) ? b : a}')
  best_get=$(awk -v a="$best_get" -v b="$get" 'BEGIN {print (b > a) ? b : a}')
  lookup_p50=$(json_field "$work/bench-$d.json" lookup.p50_us)
  lookup_p99=$(json_field "$work/bench-$d.json" lookup.p99_us)
  put_p50=$(json_field "$work/bench-$d.json" put.p50_us)
  get_p50=$(json_field "$work/bench-$d.json" get.p50_us)
  printf "  latency (us): put p50 %.0f, get p50 %.0f (per call of %d chunks); lookup p50 %.1f p99 %.1f\n" \
    "$put_p50" "$get_p50" "$d" "$lookup_p50" "$lookup_p99"
done
echo "ratio put/perftest: $(awk -v a="$best_put" -v b="$perf_gbps" 'BEGIN {printf "%.2f", a / b}')x" \
     " get/perftest: $(awk -v a="$best_get" -v b="$perf_gbps" 'BEGIN {printf "%.2f", a / b}')x (goal >= 0.8x)"
