#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang + AddressSanitizer + UndefinedBehavior-
# Sanitizer into build-fuzz/ and runs each for SECONDS (default 60).
#
#   tests/fuzz/run.sh [SECONDS] [TARGET...]
#     TARGET: frame control_message compact_chunk vector_calibration gguf config disk_record
#             (default: all, one after the other)
#
# Each target starts from its committed seeds (tests/fuzz/corpus/<target>/) and a working corpus
# that grows across runs (build-fuzz/fuzz/corpus/<target>/). A crash, sanitizer report, leak,
# timeout, out-of-memory or broken invariant is a finding: its reproducer is written to
# build-fuzz/fuzz/findings/<target>/ and the script names it; replay it with
#   build-fuzz/bin/fuzz_<target> <reproducer>
# The full libFuzzer output of a run is in build-fuzz/fuzz/logs/<target>.log.
#
# Environment: KVD_FUZZ_BUILD_DIR (default build-fuzz), KVD_JOBS (build jobs, default nproc),
# KVD_FUZZ_ARGS (extra libFuzzer flags, e.g. "-jobs=2 -workers=2"). clang comes from Debian: it
# is installed with apt when missing.
# Exit: 0 no finding, 1 at least one finding, 2 usage or build error.
set -euo pipefail
cd "$(dirname "$0")/../.."

ALL=(frame control_message compact_chunk vector_calibration gguf config disk_record)
usage() {
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
SECONDS_EACH=60
if (($#)) && [[ $1 =~ ^[0-9]+$ ]]; then
  SECONDS_EACH=$1
  shift
elif (($#)) && [[ $1 == -h || $1 == --help ]]; then
  usage
fi
((SECONDS_EACH > 0)) || { echo "[fuzz] SECONDS must be > 0" >&2; exit 2; }
TARGETS=("$@")
((${#TARGETS[@]})) || TARGETS=("${ALL[@]}")
for t in "${TARGETS[@]}"; do
  [[ " ${ALL[*]} " == *" $t "* ]] || { echo "[fuzz] unknown target '$t' (${ALL[*]})" >&2; exit 2; }
done

# clang, its libFuzzer / sanitizer runtimes (libclang-rt) and llvm-symbolizer for readable stacks.
if ! command -v clang++ > /dev/null || ! command -v llvm-symbolizer > /dev/null; then
  echo "[fuzz] installing clang and llvm (Debian packages)"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends clang llvm
fi

BUILD=${KVD_FUZZ_BUILD_DIR:-build-fuzz}
JOBS=${KVD_JOBS:-$(nproc)}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/kvd-ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVD_FUZZ=ON -DKVD_SANITIZE=address,undefined \
  -DKVD_BUILD_TESTS=OFF -DKVD_BUILD_BENCHMARKS=OFF -DKVD_WITH_CUDA=OFF -DKVD_UCX=system > /dev/null \
  || { echo "[fuzz] configure failed" >&2; exit 2; }
cmake --build "$BUILD" -j "$JOBS" --target kvd_fuzzers || { echo "[fuzz] build failed" >&2; exit 2; }

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
OUT=$BUILD/fuzz
findings=0
summary=()
for t in "${TARGETS[@]}"; do
  work=$OUT/corpus/$t
  found=$OUT/findings/$t
  log=$OUT/logs/$t.log
  mkdir -p "$work" "$found" "$(dirname "$log")"
  seeds=(tests/fuzz/corpus/"$t")
  [[ $t == config ]] && seeds+=(deploy/configs)
  echo "[fuzz] $t: ${SECONDS_EACH}s (log $log)"
  rc=0
  # shellcheck disable=SC2086
  "$BUILD/bin/fuzz_$t" -max_total_time="$SECONDS_EACH" -print_final_stats=1 -rss_limit_mb=2048 \
    -timeout=10 -artifact_prefix="$found/" ${KVD_FUZZ_ARGS:-} "$work" "${seeds[@]}" \
    > "$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1 || true)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1 || true)
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' "$log" | tail -1 || true)
  reproducers=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | sort -u || true)
  line="$t: ${execs:-?} execs in ${SECONDS_EACH}s (${rate:-?}/s), ${cov:-no coverage line}"
  if [[ $rc -ne 0 || -n $reproducers ]]; then
    findings=$((findings + 1))
    line+=", FINDING (exit $rc; the run stopped there)"
    echo "[fuzz] $t: FINDING (exit $rc):" >&2
    grep -m3 -E 'ERROR: |runtime error|fuzz invariant broken|==[0-9]+==' "$log" | sed 's/^/    /' >&2 || true
    for r in $reproducers; do
      echo "    reproducer: $r (replay: $BUILD/bin/fuzz_$t $r)" >&2
      line+=" reproducer $r"
    done
  fi
  summary+=("$line")
done
echo "[fuzz] summary:"
printf '  %s\n' "${summary[@]}"
if ((findings)); then
  echo "[fuzz] $findings target(s) with findings" >&2
  exit 1
fi
echo "[fuzz] no findings"
