#!/usr/bin/env bash
# Every GPU check of kvd in one run on a GPU machine (budget: < 8 min on one GPU, 16 cores), one
# table at the end, exit status 1 when any check failed (or nothing passed).
#
#   tests/gpu/run_device_checks.sh            # from the repository root
#   KVD_GPU_BUILD_DIR=build-gpu  (default)    build folder (Release, CUDA on)
#   KVD_GPU_JOBS=16              (default)    parallel build jobs
#   KVD_GPU_BENCH_MIN_TIME=0.2   (default)    --benchmark_min_time per kernel benchmark (seconds)
#   KVD_GPU_OUT=$OUT             (optional)   where to copy the logs and the table
#   KVD_CUDA_ARCHS=90            (default)    CMAKE_CUDA_ARCHITECTURES
#
# Checks (rows of the table):
#   kernels        every CPU-vs-CUDA kernel test (*Cuda*, including the device xxh3 checksum
#                  against Checksum64 and QuantizeCuda: the quantize stage's codes, scales and
#                  dequantized values against the CPU kernel bit for bit, every format (int8,
#                  int4, int3, int2, their zero-anchored and symmetric forms, fp8) with and without
#                  the Hadamard rotation), then the whole kernel suite
#   plan           the device-resident plan against the CPU plan on the same chunks (DevicePlan*)
#   gpu-tier       GpuTier over CUDA device memory (storage_gpu_tier_test GpuTierCuda*), and a
#                  kvd process with tiers.gpu: compressed puts land there, stats, gets
#                  (gpu_tier_e2e_test)
#   ingest         a kvd whose policy says `compression.device: cuda`: its ingest compresses on
#                  the GPU and stores what the CPU plan stores (serving_e2e_test, CudaIngest*)
#   ucx-cuda       CUDA memory through UCX 1.22 (cuda_ipc/cuda_copy: send/recv, RMA), when the
#                  libucx wheel is in .cache/ucx (carry it: deploy/fetch-ucx-wheel.sh, ~46 MB)
#   nccl           the nccl backend: bootstrap, device-to-device send/recv (NcclCuda*)
#   client         the client's device side (gpu_client_test): expansion into device buffers vs
#                  the CPU expansion bit for bit, put/get of cudaMalloc'd buffers through a real
#                  kvd over shared memory and over the transport (staged through host memory)
#   kernels-bench  the kernel benchmarks: the device plan per chunk against cudaMemcpy D2D and the
#                  CPU plan (x_d2d_convert, x_d2d_plan, x_cpu), then the stages (x_memcpy = stage
#                  bytes/s over host memcpy bytes/s)
#   kvd-nccl       put/get of cudaMalloc'd buffers through a real kvd over its NCCL link
#                  (ClientOptions::nccl): byte-exact with two GPUs (kvd on device 0, with and
#                  without a GPU tier, which must then hold the puts; the client on device 1;
#                  SKIP naming the device count on one GPU, where NCCL refuses the pair), and on
#                  one GPU a bounded failure after which kvd serves on
#   lazy-cuda      libkvd_client, _kvd and kvd link no CUDA library (readelf); on the GPU the first
#                  device use loads the CUDA runtime and the kernels module, and they work
#                  (client_cuda_load_test: a host-only client maps none of them, the device
#                  checksum through them equals the host's)
#   MISSING rows   what is not written yet (kvd put/get of device memory over cuda_ipc between
#                  processes)
#
# The whole project is configured when its Debian dependencies are present; otherwise a
# kernels-only project (only the kernel rows run, the others are MISSING with the reason).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BUILD=${KVD_GPU_BUILD_DIR:-build-gpu}
JOBS=${KVD_GPU_JOBS:-16}
MIN_TIME=${KVD_GPU_BENCH_MIN_TIME:-0.2}
LOG=$BUILD/device-checks
mkdir -p "$LOG"
TABLE=$LOG/table.tsv
: > "$TABLE"
# shellcheck source=tests/gpu/device_table.sh
source "$ROOT/tests/gpu/device_table.sh"
start=$(date +%s)
say() { echo "[device-checks $(($(date +%s) - start))s] $*"; }

say "nvidia-smi: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[[ -x $NVCC ]] || { say "no nvcc found"; exit 1; }
GEN=()
command -v ninja > /dev/null && GEN=(-G Ninja)
UCX_PREFIX=$(ls -d "$ROOT"/.cache/ucx/libucx-cu*-* 2> /dev/null | sort -r | head -1)
UCX_ARGS=(-DKVD_UCX=system)
[[ -n $UCX_PREFIX ]] && UCX_ARGS=(-DKVD_UCX=wheel "-DKVD_UCX_PREFIX=$UCX_PREFIX")
COMMON=(-DCMAKE_BUILD_TYPE=Release -DKVD_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC"
  -DCMAKE_CUDA_ARCHITECTURES="${KVD_CUDA_ARCHS:-90}")

configure_full() {
  cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" "${COMMON[@]}" "${UCX_ARGS[@]}" > "$LOG/configure.log" 2>&1
}
configure_kernels_only() {
  local shim=$BUILD/kernels-only-src
  mkdir -p "$shim"
  # The top-level CMakeLists.txt with only common/ and kernels/, and only the kernel tests.
  sed -e 's/^foreach(dir common proto kernels transport storage daemon client)/foreach(dir common kernels)/' \
    -e "s#if(EXISTS \${CMAKE_CURRENT_SOURCE_DIR}/\${dir}/CMakeLists.txt)#if(EXISTS $ROOT/\${dir}/CMakeLists.txt)#" \
    -e "s#    add_subdirectory(\${dir})#    add_subdirectory($ROOT/\${dir} \${dir})#" \
    -e '/^# UCX: Debian/,/^message(STATUS "kvd: UCX/d' \
    -e '/^find_package(RocksDB/d; /^find_package(zstd/d' \
    -e '/^find_package(CapnProto/d; /^find_package(Boost/d; /^find_package(yaml-cpp/d' \
    -e '/^find_package(nlohmann_json/d' \
    -e '/^if(KVD_BUILD_TESTS AND EXISTS/,$d' "$ROOT/CMakeLists.txt" > "$shim/CMakeLists.txt"
  cat >> "$shim/CMakeLists.txt" << EOF
include(GoogleTest)
function(kvd_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS" \${ARGN})
  add_executable(\${T_NAME} \${T_SOURCES})
  target_link_libraries(\${T_NAME} PRIVATE \${T_LIBS} GTest::gtest GTest::gtest_main GTest::gmock)
endfunction()
add_subdirectory($ROOT/tests/kernels tests/kernels)
add_subdirectory($ROOT/tests/bench tests/bench)
EOF
  cmake -S "$shim" -B "$BUILD" "${GEN[@]}" "${COMMON[@]}" > "$LOG/configure-kernels-only.log" 2>&1
}

FULL=1
if [[ -f $BUILD/CMakeCache.txt ]]; then
  say "reusing $BUILD"
  grep -q kernels-only-src "$BUILD/CMakeCache.txt" && FULL=0
elif configure_full; then
  say "configured the full project (UCX: ${UCX_PREFIX:-Debian system UCX})"
else
  say "full configure failed (see $LOG/configure.log); trying kernels-only"
  rm -rf "$BUILD/CMakeCache.txt" "$BUILD/CMakeFiles"
  configure_kernels_only || {
    say "configure failed: $LOG/configure-kernels-only.log"
    tail -20 "$LOG/configure-kernels-only.log"
    exit 1
  }
  FULL=0
  say "configured kernels-only"
fi

TARGETS=(kernels_test kernels_bench)
((FULL)) && TARGETS+=(storage_gpu_tier_test transport_ucx_cuda_memory_test transport_nccl_test
  kvd kvdctl gpu_tier_e2e_test gpu_client_test serving_e2e_test client_cuda_load_test)
if ! cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" > "$LOG/build.log" 2>&1; then
  say "build FAILED"
  grep -E "error|Error" "$LOG/build.log" | head -30
  exit 1
fi
say "built ${TARGETS[*]}"
BIN=$BUILD/bin

# run CHECK LOGNAME TIMEOUT BINARY ARGS...: runs a gtest binary and adds its rows.
run() {
  local check=$1 name=$2 limit=$3
  shift 3
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  gtest_rows "$check" "$LOG/$name.log" "$rc"
  say "$check: rc=$rc"
}

run kernels cuda_kernels 150 "$BIN/kernels_test" --gtest_filter='*Cuda*:-DevicePlanCuda*'
run plan device_plan 180 "$BIN/kernels_test" --gtest_filter='DevicePlan*'
run kernels all_kernels 120 "$BIN/kernels_test" --gtest_brief=1
if ((FULL)); then
  run gpu-tier gpu_tier 60 "$BIN/storage_gpu_tier_test" --gtest_filter='GpuTierCuda*'
  run gpu-tier gpu_tier_kvd 90 "$BIN/gpu_tier_e2e_test"
  run ingest cuda_ingest 90 "$BIN/serving_e2e_test" --gtest_filter='*CudaIngest*:*WithoutADevice*'
  run ucx-cuda ucx_cuda 60 "$BIN/transport_ucx_cuda_memory_test"
  [[ -z $UCX_PREFIX ]] && missing_row ucx-cuda "UCX with CUDA" \
    "no .cache/ucx/libucx-cu*: built against Debian's UCX (no CUDA); carry the wheel's prefix"
  run nccl nccl 90 "$BIN/transport_nccl_test"
  run client gpu_client 120 "$BIN/gpu_client_test" --gtest_filter='-DeviceClientNccl*'
  run kvd-nccl gpu_client_nccl 150 "$BIN/gpu_client_test" --gtest_filter='DeviceClientNccl*'
  run lazy-cuda cuda_load 60 "$BIN/client_cuda_load_test"
  links=()
  for f in "$BUILD"/lib/libkvd_client.so "$BIN/kvd" "$BUILD"/python/kvd/_kvd*.so; do
    [[ -e $f ]] && links+=("$f")
  done
  if bash "$ROOT/tests/support/links_no_cuda.sh" "${links[@]}" > "$LOG/links_no_cuda.log" 2>&1; then
    printf 'lazy-cuda\tlinks no CUDA (%s files)\tPASS\treadelf -d\n' "${#links[@]}" >> "$TABLE"
  else
    printf 'lazy-cuda\tlinks no CUDA\tFAIL\t%s\n' "$(tr '\n' ' ' < "$LOG/links_no_cuda.log")" >> "$TABLE"
  fi
else
  for c in gpu-tier ingest ucx-cuda nccl client kvd-nccl lazy-cuda; do missing_row "$c" "(all)" "kernels-only build: $LOG/configure.log"; done
fi
missing_row kvd "GPU-tier put/get over UCX cuda_ipc, 2 processes" "not written: the daemon serves host memory only"

# The device rows first (the plan against D2D and the CPU plan), then the CPU/CUDA-twin rows.
timeout 150 "$BIN/kernels_bench" --benchmark_filter='D2D|DevicePlan' --benchmark_min_time="$MIN_TIME" \
  --benchmark_format=console > "$LOG/bench-device.log" 2>&1
device_bench_rc=$?
timeout 150 "$BIN/kernels_bench" --benchmark_filter='-D2D|DevicePlan' --benchmark_min_time="$MIN_TIME" \
  --benchmark_format=console > "$LOG/bench.log" 2>&1
bench_rc=$?
say "kernels-bench rc=$device_bench_rc (device plan), $bench_rc (stages)"
# Rows: time and the ratio counters (x_memcpy, x_d2d_*, x_cpu; GBps of the D2D limit).
cat "$LOG/bench-device.log" "$LOG/bench.log" | grep -E '^BM_' | awk '{
  xm = ""
  for (i = 1; i <= NF; i++) if ($i ~ /^(x_[a-z0-9_]+|GBps|d2d_GBps|plan_ms|cpu_plan_ms)=/) xm = xm " " $i
  if ($0 ~ /ERROR/) printf "kernels-bench\t%s\tSKIP\t%s\n", $1, $0
  else printf "kernels-bench\t%s\tPASS\t%s %s%s\n", $1, $2, $3, xm
}' >> "$TABLE"
[[ $device_bench_rc -ne 0 ]] && printf 'kernels-bench\t(device plan)\tERROR\texit status %s\n' "$device_bench_rc" >> "$TABLE"
[[ $bench_rc -ne 0 ]] && printf 'kernels-bench\t(binary)\tERROR\texit status %s\n' "$bench_rc" >> "$TABLE"

echo
echo "==== device checks: $(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1), $(($(date +%s) - start)) s ===="
print_table | tee "$LOG/table.txt"
status=${PIPESTATUS[0]}
[[ -n ${KVD_GPU_OUT:-} ]] && cp -r "$LOG" "$KVD_GPU_OUT/" 2> /dev/null
exit "$status"
