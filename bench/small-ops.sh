#!/usr/bin/env bash
# kvd's small operations against one kvd on its unix socket, with redis alongside, in
# interleaved rounds (every measurement runs once per round, so all see the same machine load):
#   put    1280 B, 16 KiB, 64 KiB chunks: one exchange (InlinePut, the default up to 64 KiB)
#          against the three-step put (--inline-put-bytes 0) over shared memory and over UCX
#   lookup chains of 1, 16 and 64 chunks per Lookup call
#   get    16 KiB and 64 KiB chunks at depth 1, 4 and 16 (chunks in flight per GetChunks call)
#   redis  SET / GET of the same sizes, GET pipelined 4 and 16 deep, EXISTS of 1 / 16 / 64 keys
#   floor  a 64-byte ping-pong over a unix socket pair between two processes (kvd-bench --op
#          pingpong; where the scheduler puts them, and pinned to two CPUs) and redis PING: what
#          one exchange costs on this box without kvd's work
# kvd-bench reports the daemon's CPU time, context switches and read/write system calls per
# operation (--ready-file). Prints every measurement, then the medians over rounds.
#
#   bench/small-ops.sh [BUILD_DIR]   (default build; needs kvd and kvd-bench built)
#   KVD_SMALL_ROUNDS    interleaved rounds (default 3)
#   KVD_SMALL_COUNT     operations per measurement (default 1000; lookups 4x that many chunks)
#   KVD_SMALL_RESULTS   keep the raw results (tab-separated) at this path
# redis is optional (Debian redis-server + redis-tools); without it those rows are skipped.
# Memory: kvd's arena is 256 MiB (64 MiB segments); one measurement stores at most 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh
bench_build_dir "${1:-}"
ROUNDS=${KVD_SMALL_ROUNDS:-3}
COUNT=${KVD_SMALL_COUNT:-1000}
bench_binaries small kvd kvd-bench

bench_scratch small
results=${KVD_SMALL_RESULTS:-$work/results.tsv}
: >"$results"

# One layer, one KV head of 64 dims, bf16: 256 bytes a token, so 5 / 64 / 256 tokens make
# 1280 B / 16 KiB / 64 KiB chunks.
bench_model tiny-256b 1 1 1 64 | bench_topology kvd-small 256
start_kvd --config "$work/kvd.yaml"
sleep 2  # past start-up

redis_ok=""
if command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null; then
  redis-server --port 0 --unixsocket "$work/redis.sock" --save '' --appendonly no \
    --maxmemory 512mb --dir "$work" >"$work/redis.log" 2>&1 &
  bench_bg_pids+=($!)
  for _ in $(seq 50); do [[ -S "$work/redis.sock" ]] && break; sleep 0.1; done
  [[ -S "$work/redis.sock" ]] && redis_ok=1
fi
[[ -n "$redis_ok" ]] || echo "[small] redis not available: its rows are skipped" >&2

# bench_kvd NAME PHASE [kvd-bench args...]: one kvd-bench run; records PHASE's figures under NAME.
bench_kvd() {
  local name=$1 phase=$2
  shift 2
  if ! "$BIN/kvd-bench" --addr "unix:$work/kvd.sock" --model tiny-256b --ucx-tls sm,tcp \
    --net-devices lo --ready-file "$work/ready.json" --json "$@" >"$work/out.json" \
    2>"$work/err.txt"; then
    echo "  $name failed: $(tail -1 "$work/err.txt")" >&2
    return 0
  fi
  python3 - "$work/out.json" "$phase" "$name" "$round" >>"$results" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); p = j[sys.argv[2]]
print("\t".join([sys.argv[4], sys.argv[3], "%.1f" % p["p50_us"], "%.1f" % p["p99_us"],
                 "%.0f" % p["ops_per_s"], "%.1f" % p.get("daemon_cpu_us_per_op", -1),
                 "%.2f" % p.get("daemon_ctx_switches_per_op", -1),
                 "%.2f" % p.get("daemon_rw_syscalls_per_op", -1)]))
PY
}
# bench_redis NAME [redis-benchmark args...]: one redis-benchmark run (one test), p50/p99 in us.
bench_redis() {
  local name=$1
  shift
  [[ -n "$redis_ok" ]] || return 0
  redis-benchmark -s "$work/redis.sock" -c 1 --csv "$@" >"$work/redis.csv" 2>&1 || return 0
  python3 - "$work/redis.csv" "$name" "$round" >>"$results" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r and r[0] != "test"]
if rows:
    r = rows[-1]  # rps, avg, min, p50, p95, p99, max (ms)
    print("\t".join([sys.argv[3], sys.argv[2], "%.1f" % (float(r[4]) * 1e3),
                     "%.1f" % (float(r[6]) * 1e3), "%.0f" % float(r[1]), "-", "-", "-"]))
PY
}

echo "== $ROUNDS interleaved rounds, $COUNT ops each; $(nproc) cores;" \
     "load average at start $(cut -d' ' -f1-3 /proc/loadavg) =="
keys64=$(for i in $(seq 64); do echo -n "k$i "; done)
for round in $(seq "$ROUNDS"); do
  for size in 1280 16384 65536; do
    # inline at every size, also over shared memory (whose default stops at 32 KiB)
    bench_kvd "put $size inline" put --chunk-bytes "$size" --count "$COUNT" --op put \
      --shm-inline-put-bytes 65536
    bench_kvd "put $size 3-step shm" put --chunk-bytes "$size" --count "$COUNT" --op put \
      --inline-put-bytes 0
    bench_kvd "put $size 3-step ucx" put --chunk-bytes "$size" --count "$COUNT" --op put \
      --inline-put-bytes 0 --no-shm
    bench_redis "redis SET $size" -t set -n "$COUNT" -d "$size"
  done
  # the floor under one exchange on this box: a unix socket pair ping-pong, and redis PING
  bench_kvd "unix ping-pong (reference)" pingpong --op pingpong --count $((COUNT * 4))
  # the same with the two processes pinned to two CPUs, as a client and kvd's io thread are
  # whenever the scheduler places them apart
  if (($(nproc) >= 2)); then
    bench_kvd "unix ping-pong across CPUs (reference)" pingpong_cross_cpu --op pingpong \
      --count $((COUNT * 4))
  fi
  bench_redis "redis PING" -t ping_inline -n "$COUNT"
  for chain in 1 16 64; do
    bench_kvd "lookup chain $chain" lookup --chunk-bytes 1280 --count $((COUNT * 4)) --op get \
      --lookup-chain "$chain"
    # shellcheck disable=SC2086
    bench_redis "redis EXISTS $chain keys" -n "$COUNT" EXISTS $(echo $keys64 | cut -d' ' -f1-"$chain")
  done
  for size in 16384 65536; do
    for depth in 1 4 16; do
      bench_kvd "get $size depth $depth shm" get --chunk-bytes "$size" --count "$COUNT" --op get \
        --depth "$depth"
      bench_kvd "get $size depth $depth ucx" get --chunk-bytes "$size" --count "$COUNT" --op get \
        --depth "$depth" --no-shm
      bench_redis "redis GET $size pipeline $depth" -t set,get -n "$COUNT" -d "$size" -P "$depth"
    done
  done
done
echo "== load average at end $(cut -d' ' -f1-3 /proc/loadavg) =="
python3 - "$results" <<'PY'
import collections, statistics, sys
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    f = line.rstrip("\n").split("\t")
    rows.setdefault(f[1], []).append(f[2:])
def med(vals):
    v = [float(x) for x in vals if x != "-"]
    return "-" if not v else "%.1f" % statistics.median(v)
print("medians over rounds (per call; daemon figures per call from kvd-bench):")
print("%-32s %9s %9s %9s %9s %7s %7s %s" % ("measurement", "p50 us", "p99 us", "ops/s",
      "dCPU us", "ctx sw", "rw sc", "p50 per round"))
for name, rs in rows.items():
    cols = list(zip(*rs))
    print("%-32s %9s %9s %9s %9s %7s %7s %s" % (name, med(cols[0]), med(cols[1]), med(cols[2]),
          med(cols[3]), med(cols[4]), med(cols[5]), ",".join(cols[0])))
PY
