#!/usr/bin/env bash
# Builds kvd with sanitizers and runs the test suite (or a part of it) under them.
#
#   tests/sanitizers/run.sh asan [CTEST ARGS...]   AddressSanitizer + UndefinedBehaviorSanitizer, build-asan/
#   tests/sanitizers/run.sh tsan [CTEST ARGS...]   ThreadSanitizer, build-tsan/
#
# CTEST ARGS go to ctest unchanged, e.g. a label subset: -L e2e, -LE 'model|quality|chaos'
# (default: the whole suite). Every process a test starts (kvd daemons of the e2e tests too)
# runs instrumented; a sanitizer report makes that process, and so the test, fail. Every report
# is also written to BUILD/sanitizer-logs/ (one file per reporting process, emptied at each
# run), so a report in a daemon that a test kills or whose exit status it does not check still
# counts: the script lists those files and exits 1 when there is one, whatever ctest said.
# Leave out the `model` and `quality` labels under tsan (-LE 'model|quality'): they run the
# reference engine on a model, minutes of instrumented inference each, past their time-outs.
#
# Environment: KVD_JOBS (build jobs, default nproc), KVD_CTEST_JOBS (default 2),
# KVD_BUILD_TARGETS (build only these targets), KVD_CMAKE_ARGS (extra CMake arguments),
# KVD_SANITIZE_NO_BUILD=1 (run the tests on what BUILD already holds: no configure, no build).
# Suppressions of reports inside uninstrumented system libraries are in tests/sanitizers/.
set -euo pipefail
cd "$(dirname "$0")/../.."

mode=${1:-}
case $mode in
  asan) sanitize=address,undefined ;;
  tsan) sanitize=thread ;;
  *)
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
shift
BUILD=build-$mode
SUPP=$PWD/tests/sanitizers

# UCX's memory-event hooks (ucm: it patches mmap/munmap/brk in the process) clash with ThreadSani-
# tizer's own interceptors: every process that opens a UCX worker died with SIGSEGV and no report
# (the build's gtest test discovery runs the test binaries too, so this is set before it).
# Off under TSan only (UCX then does without its registration cache; kvd does not depend on it).
[[ $mode == tsan ]] && export UCX_MEM_EVENTS=${UCX_MEM_EVENTS:-no}
if [[ ${KVD_SANITIZE_NO_BUILD:-0} != 1 ]]; then
  KVD_BUILD_DIR=$BUILD KVD_UCX_WHEEL=0 KVD_UCX=system \
    KVD_CMAKE_ARGS="-DKVD_SANITIZE=$sanitize -DKVD_WITH_CUDA=OFF -DKVD_BUILD_BENCHMARKS=OFF ${KVD_CMAKE_ARGS:-}" \
    ./deploy/setup.sh
fi

# Reports abort the process (exit code != 0) with a full stack; UBSan never recovers (build flag).
# log_path: the reports go to LOGS/<sanitizer>.<pid> instead of stderr (children inherit it).
LOGS=$PWD/$BUILD/sanitizer-logs
rm -rf "$LOGS"
mkdir -p "$LOGS"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1:log_path=$LOGS/asan}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$SUPP/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:log_path=$LOGS/ubsan}
# ignore_noninstrumented_modules: system libraries built without TSan (RocksDB, UCX, Cap'n Proto,
# libstdc++) synchronise out of its sight; why, in tests/sanitizers/tsan.supp.
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$SUPP/tsan.supp:log_path=$LOGS/tsan}
cd "$BUILD"
rc=0
ctest -j "${KVD_CTEST_JOBS:-2}" --output-on-failure "$@" || rc=$?
mapfile -t reports < <(grep -lE 'WARNING: ThreadSanitizer|ERROR: (Address|Leak|Thread)Sanitizer|runtime error' "$LOGS"/* 2> /dev/null || true)
if ((${#reports[@]})); then
  echo "[sanitize] ${#reports[@]} process(es) wrote sanitizer reports:" >&2
  for r in "${reports[@]}"; do
    echo "  $r: $(grep -m1 -E 'WARNING: ThreadSanitizer|ERROR: |runtime error' "$r")" >&2
  done
  exit 1
fi
echo "[sanitize] no sanitizer report in $LOGS"
exit "$rc"
