#!/usr/bin/env bash
# Checks the parsing of run_device_checks.sh on fake gtest logs (no GPU needed): passes, failures,
# skips with their reason, a crash after some cases, a binary that ran nothing, the exit status.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
TABLE=$tmp/table.tsv
: > "$TABLE"
# shellcheck source=tests/gpu/device_table.sh
source "$here/device_table.sh"
fails=0
expect() {  # expect WHAT GREP-PATTERN FILE
  if ! grep -qP -- "$2" "$3"; then
    echo "FAIL: $1: no line matching '$2' in:"
    cat "$3"
    fails=$((fails + 1))
  fi
}

cat > "$tmp/ok.log" << 'EOF2'
[==========] Running 3 tests from 2 test suites.
[ RUN      ] RopeTest.CudaMatchesCpu
[       OK ] RopeTest.CudaMatchesCpu (12 ms)
[ RUN      ] GpuTierCudaTest.RoundTripsThroughCudaDeviceMemory
/src/tests/storage/gpu_tier_test.cc:236: Skipped
no CUDA device (cudaGetDeviceCount: cudaErrorInsufficientDriver)
[  SKIPPED ] GpuTierCudaTest.RoundTripsThroughCudaDeviceMemory (0 ms)
[ RUN      ] Backends/TransportContractTest.SendRecv/ucx_sm
/src/x.cc:10: Failure
[  FAILED  ] Backends/TransportContractTest.SendRecv/ucx_sm, where GetParam() = "ucx-sm" (5 ms)
[==========] 3 tests from 2 test suites ran. (17 ms total)
[  PASSED  ] 1 test.
[  SKIPPED ] 1 test, listed below:
[  SKIPPED ] GpuTierCudaTest.RoundTripsThroughCudaDeviceMemory
[  FAILED  ] 1 test, listed below:
[  FAILED  ] Backends/TransportContractTest.SendRecv/ucx_sm, where GetParam() = "ucx-sm"
EOF2
gtest_rows kernels "$tmp/ok.log" 1
expect "pass row" $'^kernels\tRopeTest.CudaMatchesCpu\tPASS\t$' "$TABLE"
expect "skip row with its reason" $'^kernels\tGpuTierCudaTest.RoundTripsThroughCudaDeviceMemory\tSKIP\tno CUDA device \\(cudaGetDeviceCount' "$TABLE"
expect "fail row of a parameterized case" $'^kernels\tBackends/TransportContractTest.SendRecv/ucx_sm\tFAIL' "$TABLE"
[[ $(grep -c . "$TABLE") -eq 3 ]] || { echo "FAIL: summary lines became rows"; cat "$TABLE"; fails=$((fails + 1)); }
[[ $(grep -c ERROR "$TABLE") -eq 0 ]] || { echo "FAIL: rc 1 with a FAIL row is not an ERROR"; fails=$((fails + 1)); }

cat > "$tmp/crash.log" << 'EOF2'
[ RUN      ] NcclCudaTest.A
[       OK ] NcclCudaTest.A (3 ms)
[ RUN      ] NcclCudaTest.B
Segmentation fault (core dumped)
EOF2
gtest_rows nccl "$tmp/crash.log" 139
expect "crash after a passing case" $'^nccl\t\\(binary\\)\tERROR\texit status 139' "$TABLE"
: > "$tmp/empty.log"
gtest_rows ucx-cuda "$tmp/empty.log" 0
expect "nothing ran" $'^ucx-cuda\t\\(binary\\)\tERROR\tno test case ran' "$TABLE"
missing_row plan "device plan" "not written"
expect "missing row" $'^plan\tdevice plan\tMISSING\tnot written' "$TABLE"

print_table > "$tmp/out.txt"
rc=$?
expect "summary" '^passed 2, failed 1, errors 2, skipped 1, missing 1$' "$tmp/out.txt"
[[ $rc -eq 1 ]] || { echo "FAIL: a table with failures exits $rc"; fails=$((fails + 1)); }
# Only passes, skips and missing rows: exit 0; nothing passed: exit 1.
: > "$TABLE"
gtest_rows kernels <(grep -v -e FAILED -e Failure "$tmp/ok.log") 0
missing_row plan "device plan" "not written"
print_table > /dev/null || { echo "FAIL: a clean table exits non-zero"; fails=$((fails + 1)); }
: > "$TABLE"
missing_row plan "device plan" "not written"
print_table > /dev/null && { echo "FAIL: a table where nothing passed exits 0"; fails=$((fails + 1)); }

((fails == 0)) && echo "device table parsing: all checks passed"
exit $((fails > 0))
