#!/usr/bin/env bash
# Tag bandwidth of kvd's transport next to ucx_perftest, same machine, same run.
#   tests/transport/bench_vs_perftest.sh [BIN_DIR] [ROUNDS]
# For each case, alternates ucx_perftest and kvd-transport-bench ROUNDS times (2 MiB messages,
# 200 per measurement) and prints the medians (MiB/s) and the ratio kvd / perftest.
set -euo pipefail
BIN=${1:-build/bin}
ROUNDS=${2:-3}
SIZE=2097152
ITERS=200
PORT=${KVD_PERFTEST_PORT:-13377}

perftest() {  # TLS [extra flags] -> overall MiB/s
  local tls=$1; shift
  UCX_TLS=$tls UCX_NET_DEVICES=lo ucx_perftest -t tag_bw -s $SIZE -n $ITERS -w 20 -p $PORT "$@" \
    >/dev/null 2>&1 &
  local server=$!
  sleep 0.5
  local out
  out=$(UCX_TLS=$tls UCX_NET_DEVICES=lo ucx_perftest 127.0.0.1 -t tag_bw -s $SIZE -n $ITERS -w 20 \
        -p $PORT -f "$@" 2>/dev/null | tail -1)
  wait $server || true
  echo "$out" | awk '{print $6}'
}

kvd() {  # CONFIG -> median MiB/s
  "$BIN/kvd-transport-bench" --config "$1" --size $SIZE --iters $ITERS --reps 3 |
    sed -n 's/.*median_MiBps=\([0-9.]*\).*/\1/p'
}

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

run_case() {  # NAME PERFTEST_TLS PERFTEST_FLAGS KVD_CONFIG
  local name=$1 tls=$2 flags=$3 config=$4 p=() k=()
  for ((r = 0; r < ROUNDS; r++)); do
    # shellcheck disable=SC2086
    p+=("$(perftest "$tls" $flags)")
    k+=("$(kvd "$config")")
  done
  local pm km
  pm=$(printf '%s\n' "${p[@]}" | median)
  km=$(printf '%s\n' "${k[@]}" | median)
  printf '%-44s perftest %9.1f MiB/s  kvd %9.1f MiB/s  ratio %.2f\n' "$name" "$pm" "$km" \
    "$(echo "$km / $pm" | bc -l)"
}

echo "2 MiB tag messages, $ITERS per measurement, median of $ROUNDS rounds ($(nproc) cores," \
     "load $(cut -d' ' -f1 /proc/loadavg))"
run_case "shm: perftest UCX_TLS=sm vs kvd ucx-sm" sm "" ucx-sm
run_case "shm, both with peer error handling (-e)" sm,tcp "-e" ucx-sm
run_case "shm, neither with error handling" sm "" ucx-shm-trusted
run_case "tcp: perftest UCX_TLS=tcp vs kvd ucx-tcp" tcp "" ucx-tcp
