#!/usr/bin/env bash
# Builds and runs every CUDA kernel test and the kernel benchmarks on a GPU machine, in < 5 min,
# and prints a short table last.
#
#   tests/gpu/run_device_checks.sh            # from the repository root
#   KVD_GPU_BUILD_DIR=build-gpu  (default)    build folder
#   KVD_GPU_JOBS=16              (default)    parallel build jobs
#   KVD_GPU_BENCH_MIN_TIME=0.2   (default)    --benchmark_min_time per benchmark (seconds)
#   KVD_GPU_OUT=$OUT             (optional)   where to copy the logs (e.g. the device tool's $OUT)
#
# Configures the whole project (Release) when every dependency is present; when the machine lacks
# some (UCX, RocksDB, ...: the kernels need none of them) it configures a kernels-only project
# with the same kernels/ and tests/ CMake files. Exit status: 0 when the build and every CUDA
# test passed (and at least one CUDA test really ran), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BUILD=${KVD_GPU_BUILD_DIR:-build-gpu}
JOBS=${KVD_GPU_JOBS:-16}
MIN_TIME=${KVD_GPU_BENCH_MIN_TIME:-0.2}
LOG=$BUILD/device-checks
mkdir -p "$LOG"
start=$(date +%s)
say() { echo "[device-checks $(( $(date +%s) - start ))s] $*"; }

say "nvidia-smi: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[[ -x $NVCC ]] || { say "no nvcc found"; exit 1; }
GEN=(); command -v ninja > /dev/null && GEN=(-G Ninja)

configure_full() {
  cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DKVD_WITH_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="${KVD_CUDA_ARCHS:-90}" \
    > "$LOG/configure.log" 2>&1
}
configure_kernels_only() {
  local shim=$BUILD/kernels-only-src
  mkdir -p "$shim"
  # The top-level CMakeLists.txt with only common/ and kernels/, and only the kernel tests.
  sed -e 's/^foreach(dir common proto kernels transport storage daemon client)/foreach(dir common kernels)/' \
      -e "s#if(EXISTS \${CMAKE_CURRENT_SOURCE_DIR}/\${dir}/CMakeLists.txt)#if(EXISTS $ROOT/\${dir}/CMakeLists.txt)#" \
      -e "s#    add_subdirectory(\${dir})#    add_subdirectory($ROOT/\${dir} \${dir})#" \
      -e '/^find_package(ucx/d; /^find_package(RocksDB/d; /^find_package(zstd/d' \
      -e '/^find_package(CapnProto/d; /^find_package(Boost/d; /^find_package(yaml-cpp/d' \
      -e '/^find_package(nlohmann_json/d' \
      -e '/^if(KVD_BUILD_TESTS AND EXISTS/,$d' "$ROOT/CMakeLists.txt" > "$shim/CMakeLists.txt"
  cat >> "$shim/CMakeLists.txt" <<EOF
include(GoogleTest)
function(kvd_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS" \${ARGN})
  add_executable(\${T_NAME} \${T_SOURCES})
  target_link_libraries(\${T_NAME} PRIVATE \${T_LIBS} GTest::gtest GTest::gtest_main GTest::gmock)
endfunction()
add_subdirectory($ROOT/tests/kernels tests/kernels)
add_subdirectory($ROOT/tests/bench tests/bench)
EOF
  cmake -S "$shim" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DKVD_WITH_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="${KVD_CUDA_ARCHS:-90}" \
    > "$LOG/configure-kernels-only.log" 2>&1
}

if [[ -f $BUILD/CMakeCache.txt ]]; then
  say "reusing $BUILD"
elif configure_full; then
  say "configured the full project"
else
  say "full configure failed (see $LOG/configure.log); trying kernels-only"
  rm -rf "$BUILD/CMakeCache.txt" "$BUILD/CMakeFiles"
  configure_kernels_only || { say "configure failed: $LOG/configure-kernels-only.log"; tail -20 "$LOG/configure-kernels-only.log"; exit 1; }
  say "configured kernels-only"
fi
grep -q "CUDA kernels ON" "$LOG"/configure*.log 2> /dev/null || say "warning: configure did not report 'CUDA kernels ON'"

if ! cmake --build "$BUILD" -j "$JOBS" --target kernels_test kernels_bench > "$LOG/build.log" 2>&1; then
  say "build FAILED"; grep -E "error|Error" "$LOG/build.log" | head -30; exit 1
fi
say "built kernels_test and kernels_bench"
BIN=$BUILD/bin

# 1. Every CUDA test (CPU vs CUDA on the same inputs), then the whole kernel suite once.
timeout 150 "$BIN/kernels_test" --gtest_filter='*Cuda*' --gtest_brief=0 > "$LOG/cuda_tests.log" 2>&1
cuda_rc=$?
timeout 120 "$BIN/kernels_test" --gtest_brief=1 > "$LOG/all_tests.log" 2>&1
all_rc=$?
say "CUDA tests rc=$cuda_rc, all kernel tests rc=$all_rc"

# 2. Benchmarks: the CPU stages on one core and the CUDA twins.
timeout 120 "$BIN/kernels_bench" --benchmark_min_time="$MIN_TIME" \
  --benchmark_format=console > "$LOG/bench.log" 2>&1
bench_rc=$?
say "bench rc=$bench_rc"
[[ -n ${KVD_GPU_OUT:-} ]] && cp -r "$LOG" "$KVD_GPU_OUT/" 2> /dev/null

# 3. The table.
echo
echo "==== device checks: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) ===="
printf "%-46s %s\n" "CUDA test" "result"
grep -E '^\[ +(OK|FAILED|SKIPPED) +\] [A-Za-z0-9_]+\.[A-Za-z0-9_]+' "$LOG/cuda_tests.log" |
  sed -E 's/^\[ *([A-Z]+) *\] ([^ ]+).*/\2 \1/' | sort -u > "$LOG/cuda_table.txt"
awk '{ printf "%-46s %s\n", $1, $2 }' "$LOG/cuda_table.txt"
ran=$(grep -c 'MatchesCpu OK$' "$LOG/cuda_table.txt")  # CPU-vs-CUDA comparisons that really ran
echo
printf "%-40s %14s %10s %10s\n" "benchmark" "time/iter" "x_memcpy" "x_sgemm"
grep -E '^BM_' "$LOG/bench.log" | awk '{
  xm = "-"; xs = "-";
  for (i = 1; i <= NF; i++) {
    if ($i ~ /^x_memcpy=/) { split($i, a, "="); xm = a[2]; sub("/s", "", xm) }
    if ($i ~ /^x_sgemm=/) { split($i, a, "="); xs = a[2]; sub("/s", "", xs) }
  }
  if ($0 ~ /ERROR/) { printf "%-40s %14s\n", $1, "skipped" } else { printf "%-40s %11s %s %10s %10s\n", $1, $2, $3, xm, xs }
}'
echo
echo "CUDA tests passed: $ran; failed: $(grep -c ' FAILED$' "$LOG/cuda_table.txt"); elapsed $(( $(date +%s) - start )) s"
[[ $cuda_rc -eq 0 && $all_rc -eq 0 && $ran -gt 0 ]] && exit 0
exit 1
