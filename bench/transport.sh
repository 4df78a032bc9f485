#!/usr/bin/env bash
# Measures kvd put/get bandwidth for 2 MiB chunks over shared memory next to ucx_perftest tag
# bandwidth for 2 MiB messages, in the same run on the same machine, and prints the ratio.
# Also reports lookup latency p50/p99 on loopback.
#
#   bench/transport.sh [BUILD_DIR]      (default: build; binaries in BUILD_DIR/bin)
#   KVD_BENCH_COUNT        chunks / messages per measurement (default 200)
#   KVD_BENCH_TLS          UCX_TLS for both (default sm,tcp: shared memory carries the bytes)
#   KVD_BENCH_DEPTH        kvd-bench --depth: chunks in flight per client (default 1)
#   KVD_BENCH_ROUNDS       interleaved rounds of (ucx_perftest, kvd-bench); medians reported
#                          (default 3); interleaving makes both see the same machine load
#   KVD_BENCH_CONCURRENCY  kvd-bench --concurrency (default 1)
#
# Needs: kvd, kvd-bench built; ucx_perftest (Debian ucx-utils). Exit 0 when every measurement ran.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh
bench_build_dir "${1:-}"
COUNT=${KVD_BENCH_COUNT:-200}
TLS=${KVD_BENCH_TLS:-sm,tcp}
DEPTH=${KVD_BENCH_DEPTH:-1}
ROUNDS=${KVD_BENCH_ROUNDS:-3}
CONC=${KVD_BENCH_CONCURRENCY:-1}
SIZE=2097152

bench_binaries bench kvd kvd-bench
bench_tool bench ucx_perftest ucx-utils

bench_scratch bench

# ---- kvd on its embedded default (llama-3.1-8b: 16 tokens = 2 MiB raw chunk) ----
start_kvd
addr=$kvd_addr

echo "== same machine, same run: 2 MiB messages, UCX_TLS=$TLS, loopback, count $COUNT," \
     "$ROUNDS interleaved rounds, load average $(cut -d' ' -f1 /proc/loadavg) =="
: >"$work/perf.txt"; : >"$work/put.txt"; : >"$work/get.txt"
: >"$work/lookup50.txt"; : >"$work/lookup99.txt"
for round in $(seq "$ROUNDS"); do
  fields=$(run_perftest tag_bw $SIZE "$COUNT" "$TLS")
  perf=$(perftest_gbps $fields)
  echo "$perf" >>"$work/perf.txt"
  "$BIN/kvd-bench" --addr "$addr" --model llama-3.1-8b --chunk-bytes $SIZE --count "$COUNT" \
    --concurrency "$CONC" --depth "$DEPTH" --op both --ucx-tls "$TLS" --net-devices lo --json \
    >"$work/bench.json" || { cat "$work/bench.json" >&2; tail -20 "$work/kvd.log" >&2; exit 1; }
  put=$(json_field "$work/bench.json" put.gbps)
  get=$(json_field "$work/bench.json" get.gbps)
  echo "$put" >>"$work/put.txt"
  echo "$get" >>"$work/get.txt"
  json_field "$work/bench.json" lookup.p50_us >>"$work/lookup50.txt"
  json_field "$work/bench.json" lookup.p99_us >>"$work/lookup99.txt"
  printf "round %d: ucx_perftest %.3f GB/s  kvd put %.3f GB/s  kvd get %.3f GB/s  (put p50 %.0f us, get p50 %.0f us per %d chunks; wall incl. kvd-bench's own data generation: put %.3f, get %.3f GB/s)\n" \
    "$round" "$perf" "$put" "$get" "$(json_field "$work/bench.json" put.p50_us)" \
    "$(json_field "$work/bench.json" get.p50_us)" "$DEPTH" \
    "$(json_field "$work/bench.json" put.gbps_wall)" "$(json_field "$work/bench.json" get.gbps_wall)"
done
perf_m=$(median <"$work/perf.txt"); put_m=$(median <"$work/put.txt"); get_m=$(median <"$work/get.txt")
printf "median: ucx_perftest tag_bw %.3f GB/s; kvd put %.3f GB/s (%.2fx); kvd get %.3f GB/s (%.2fx); goal >= 0.8x\n" \
  "$perf_m" "$put_m" "$(awk -v a="$put_m" -v b="$perf_m" 'BEGIN {print a / b}')" \
  "$get_m" "$(awk -v a="$get_m" -v b="$perf_m" 'BEGIN {print a / b}')"
printf "lookup latency (1-chunk chain, loopback TCP control): median p50 %.1f us, median p99 %.1f us\n" \
  "$(median <"$work/lookup50.txt")" "$(median <"$work/lookup99.txt")"
