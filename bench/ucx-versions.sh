#!/usr/bin/env bash
# Debian's UCX 1.13 against the wheel's UCX 1.22 on one machine, in interleaved rounds (both
# versions run every measurement once per round, so both see the same machine load):
#   1. ucx_perftest tag_bw at 64 KiB, 2 MiB and 32 MiB over loopback, per lane:
#        sm        UCX_TLS=sm,self, no error handling (posix/sysv messages, cma zero-copy bulk)
#        cma,tcp   UCX_TLS=cma,tcp, no error handling (tcp messages, cma zero-copy bulk)
#        tcp       UCX_TLS=tcp with peer error handling (-e): what kvd's endpoints get from
#                  UCX_TLS=sm,tcp, the daemon default
#        sm+eh     UCX_TLS=sm,tcp with peer error handling (-e) and UCX's switches
#                  UCX_{POSIX,SYSV}_ERROR_HANDLING=y UCX_CMA_MEMORY_INVALIDATE=y
#                  UCX_RNDV_SCHEME=get_zcopy (shared-memory lanes despite error handling)
#   2. kvd-bench's UCX path (--no-shm, sm,tcp + kvd's same-host copy path) against a kvd of the
#      build against each version, 64 KiB and 2 MiB chunks, put and get, with the daemon's CPU.
# Which version runs first alternates between rounds. Prints the medians over rounds.
#
#   bench/ucx-versions.sh [BUILD_1_13] [BUILD_1_22]   (default build build-ucx122)
#   KVD_UCXV_ROUNDS   interleaved rounds (default 3)
#   KVD_UCXV_PERFTEST_SIZES   ucx_perftest sizes (default "65536 2097152 33554432"; "" = none)
#   KVD_UCX_PREFIX    the wheel's prefix (default: deploy/fetch-ucx-wheel.sh's)
# Build the second folder with KVD_UCX=wheel KVD_BUILD_DIR=build-ucx122 ./deploy/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
B113=${1:-build}
B122=${2:-build-ucx122}
ROUNDS=${KVD_UCXV_ROUNDS:-3}
PREFIX=${KVD_UCX_PREFIX:-$(./deploy/fetch-ucx-wheel.sh)}
# shellcheck source=bench/lib.sh
source bench/lib.sh
for BIN in "$B113/bin" "$B122/bin"; do bench_binaries ucxv kvd kvd-bench; done
bench_tool ucxv ucx_perftest ucx-utils
BIN=""  # lib.sh's start_kvd runs $BIN/kvd: set per version below
bench_scratch ucxv
results=$work/results.tsv

# perftest VERSION LANE SIZE: one tag_bw run; records GB/s (1e9; perftest's MB/s are MiB/s).
perftest() {
  local version=$1 lane=$2 size=$3 port=$((20000 + RANDOM % 20000)) srv env=() args=()
  local exe=ucx_perftest n
  if (($3 <= 65536)); then n=4000; elif (($3 <= 2097152)); then n=200; else n=16; fi
  case $lane in
    sm) env=(UCX_TLS=sm,self) ;;
    cma,tcp) env=(UCX_TLS=cma,tcp UCX_NET_DEVICES=lo) ;;
    tcp) env=(UCX_TLS=tcp UCX_NET_DEVICES=lo) args=(-e) ;;
    sm+eh) env=(UCX_TLS=sm,tcp UCX_NET_DEVICES=lo UCX_POSIX_ERROR_HANDLING=y
                UCX_SYSV_ERROR_HANDLING=y UCX_CMA_MEMORY_INVALIDATE=y UCX_RNDV_SCHEME=get_zcopy)
           args=(-e) ;;
  esac
  if [[ $version == 1.22 ]]; then env+=("LD_LIBRARY_PATH=$PREFIX/lib"); exe=$PREFIX/bin/ucx_perftest; fi
  env "${env[@]}" "$exe" -t tag_bw -s "$size" -n "$n" -p "$port" "${args[@]}" \
    >"$work/srv.log" 2>&1 &
  srv=$!
  sleep 1
  if env "${env[@]}" timeout 120 "$exe" 127.0.0.1 -t tag_bw -s "$size" -n "$n" -p "$port" \
    "${args[@]}" >"$work/cli.log" 2>&1; then
    awk -v r="$round" -v v="$version" -v l="$lane" -v s="$size" \
      '/Final:/ {printf "%s\tperftest %s %s %s\t%.3f\n", r, v, l, s, $7 * 1048576 / 1e9}' \
      "$work/cli.log" >>"$results"
  else
    echo "  perftest $version $lane $size failed: $(grep -m1 ERROR "$work/cli.log")" >&2
  fi
  kill "$srv" 2>/dev/null || true
  wait "$srv" 2>/dev/null || true
}

# kvdbench VERSION BUILD SIZE: kvd-bench --no-shm against a fresh kvd of BUILD.
kvdbench() {
  local version=$1 size=$2 n
  BIN="$3/bin"
  if (($2 <= 65536)); then n=400; else n=100; fi
  start_kvd --config "$work/kvd.yaml"
  if "$BIN/kvd-bench" --addr "unix:$work/kvd.sock" --model one-layer-4k --chunk-bytes "$size" \
    --count "$n" --op both --no-shm --inline-put-bytes 0 --ucx-tls sm,tcp --net-devices lo \
    --ready-file "$work/ready.json" --json >"$work/out.json" 2>"$work/err.txt"; then
    python3 - "$work/out.json" "$round" "$version" "$size" >>"$results" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
for ph in ("put", "get"):
    p = j[ph]
    print("%s\tkvd-bench %s %s %s gbps\t%.3f" % (sys.argv[2], sys.argv[3], ph, sys.argv[4], p["gbps"]))
    print("%s\tkvd-bench %s %s %s p50_us\t%.1f" % (sys.argv[2], sys.argv[3], ph, sys.argv[4], p["p50_us"]))
    print("%s\tkvd-bench %s %s %s daemon_cpu_us\t%.1f" % (sys.argv[2], sys.argv[3], ph, sys.argv[4],
          p.get("daemon_cpu_us_per_op", -1)))
PY
  else
    echo "  kvd-bench $version $size failed: $(tail -1 "$work/err.txt")" >&2
  fi
  stop_kvd
}

bench_model one-layer-4k 1 8 8 128 | bench_topology kvd-ucxv 512

echo "== $ROUNDS rounds; $(nproc) cores; load average at start $(cut -d' ' -f1-3 /proc/loadavg) =="
ucx_version() { sed -n 's/^# \(Library version:\|Version\) //p' | head -n1; }
echo "== UCX $(ucx_info -v | ucx_version) vs" \
     "$(LD_LIBRARY_PATH=$PREFIX/lib "$PREFIX/bin/ucx_info" -v | ucx_version) =="
for round in $(seq "$ROUNDS"); do
  order=(1.13 1.22)
  ((round % 2)) || order=(1.22 1.13)  # which version goes first alternates between rounds
  for size in ${KVD_UCXV_PERFTEST_SIZES-65536 2097152 33554432}; do
    for lane in sm cma,tcp tcp sm+eh; do
      for version in "${order[@]}"; do perftest "$version" "$lane" "$size"; done
    done
  done
  for size in 65536 2097152; do
    for version in "${order[@]}"; do
      if [[ $version == 1.13 ]]; then kvdbench 1.13 "$size" "$B113"; else kvdbench 1.22 "$size" "$B122"; fi
    done
  done
  echo "-- round $round done; load average $(cut -d' ' -f1-3 /proc/loadavg)"
done
echo "== load average at end $(cut -d' ' -f1-3 /proc/loadavg) =="
python3 - "$results" <<'PY'
import collections, statistics, sys
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    r, name, v = line.rstrip("\n").split("\t")
    rows.setdefault(name, []).append(float(v))
for name, vs in rows.items():
    print("%-48s median %10.3f   rounds %s" % (name, statistics.median(vs),
          ", ".join("%.3f" % v for v in vs)))
PY
