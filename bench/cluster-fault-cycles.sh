#!/usr/bin/env bash
# Randomized fault cycles across three kvds of one cluster (a private etcd on loopback; kvds on
# 127.0.0.2-4, UCX over tcp): each cycle puts a fresh chain on one kvd, fetches it from another
# with a cluster-scope lookup while a random fault lands (a kvd or etcd SIGKILLed, or none),
# restarts what was killed, and counts fetches, misses, wrong bytes and hung calls
# (cluster_faults_e2e_test, RandomizedFaultCyclesServeNoWrongBytesAndNoCallHangs; ctest runs it
# with 50 cycles).
#
#   bench/cluster-fault-cycles.sh [BUILD_DIR]   (default: build)
#   KVD_FAULT_CYCLES   cycles (default 1000; ~0.7 s each)
#   KVD_FAULT_SEED     seed of the random draws (default 1)
#
# Needs: kvd and cluster_faults_e2e_test built; etcd (etcd-server). Exit 0 when no byte was
# wrong and no call hung.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh
bench_build_dir "${1:-}"
bench_binaries fault-cycles kvd cluster_faults_e2e_test
bench_tool fault-cycles etcd etcd-server
KVD_FAULT_CYCLES=${KVD_FAULT_CYCLES:-1000} "$BIN/cluster_faults_e2e_test" \
  --gtest_filter='*RandomizedFaultCycles*'
