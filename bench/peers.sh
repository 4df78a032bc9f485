#!/usr/bin/env bash
# kvd's same-node data path next to its peers, in interleaved rounds on one machine (every peer
# runs once per round, so all see the same machine load): kvd over its shared-memory path and
# over UCX (kvd-bench on kvd's unix socket, without and with --no-shm; and "kvd-shm-inplace",
# kvd-bench --in-place: the zero-copy ReservePut/CommitPut and ReadInPlace calls), ucx_perftest
# (tag_bw and tag_lat; and tag_bw -e, with peer error handling as kvd's endpoints have), Mooncake
# Store (in-process client, and a client in a second process), redis-server
# (redis-benchmark SET/GET over a unix socket) and memcpy (kvd-bench --op memcpy, into fresh and
# warm buffers, from as many distinct sources as kvd holds chunks, and into as many distinct
# destinations as kvd's arena holds values: memcpy_scatter, what a put writes), at 64 KiB, 2 MiB and
# 32 MiB values, 1 and 4 clients. Prints each measurement,
# then the medians over rounds and the same-node goals with their per-round ratios and medians
# (docs/benchmarks.md, "Data path and its peers"). Also the idle daemon's CPU.
#
# Lookups: every kvd-bench run makes 400 Lookup calls (--lookups 400, going round the run's
# chunks: a p99 from 400 samples at every size, not from the 6 chunks of a 32 MiB run), and the
# kvd-shm run measures the floor under one unix-socket exchange right before its lookups
# (--pingpong-floor 400: a socket pair ping-pong between two processes, phase "pingpong"), so
# each lookup p99 stands next to what the machine gave any exchange at that moment.
#
#   bench/peers.sh [BUILD_DIR]     (default build; needs kvd and kvd-bench built)
#   KVD_PEERS_ROUNDS    interleaved rounds (default 3)
#   KVD_PEERS_SIZES     value sizes in bytes (default "65536 2097152 33554432")
#   KVD_PEERS_CLIENTS   client counts (default "1 4")
#   KVD_PEERS_SKIP      peers not to run, e.g. "mooncake redis" (names: kvd-shm kvd-shm-inplace
#                       kvd-ucx memcpy ucx_perftest mooncake redis)
#   KVD_PEERS_RESULTS   keep the raw results (tab-separated) at this path
#   KVD_PEERS_WARMUP    1 (default): kvd-bench --warmup as below; 0: none
#
# kvd is measured warm, like the long-lived engine it serves and like the peers' warm buffers:
# every kvd-bench run first puts and gets about the arena's size of chunks of its own per client
# (kvd-bench --warmup, ARENA / value size rounds per client thread: 4096 x 64 KiB, 128 x 2 MiB,
# 8 x 32 MiB), so the first use of each slot's pages (segment maps, page-table fills) is paid
# before the timed phases. That cost is reported as kvd's "warmup" rows (latency per put + get
# round). KVD_PEERS_WARMUP=0 measures kvd cold instead.
#
# Peers that are not installed are reported and skipped, never fatal:
#   ucx_perftest   Debian ucx-utils (apt-get install ucx-utils)
#   redis          Debian redis-server and redis-tools (optional step:
#                  apt-get install redis-server redis-tools); no service is started: the script
#                  runs its own redis-server on a unix socket in its scratch folder, no persistence
#   Mooncake       the PyPI wheel mooncake-transfer-engine-non-cuda, installed by this script into
#                  BUILD_DIR/peers-venv on first use (needs PyPI; KVD_PEERS_NO_PIP=1 skips that)
#
# Memory: kvd's arena is 256 MiB (64 MiB segments), Mooncake's segment 256 MiB; the peers run
# one after the other, so at most ~512 MiB of arenas plus the clients' buffers (4 clients x 32 MiB
# x 2, memcpy's spread sources: 192 MiB, or its scatter destinations: 256 MiB) exist at once. The script checks MemAvailable and
# /dev/shm first, and every measurement moves at most 192 MiB (64 KiB x 400, 2 MiB x 48, 32 MiB
# x 6) plus kvd's warmup (256 MiB per client, put and read back). Runs ~6-10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh
bench_build_dir "${1:-}"
ROUNDS=${KVD_PEERS_ROUNDS:-3}
SIZES=${KVD_PEERS_SIZES:-"65536 2097152 33554432"}
CLIENTS=${KVD_PEERS_CLIENTS:-"1 4"}
SKIP=" ${KVD_PEERS_SKIP:-} "
WARMUP=${KVD_PEERS_WARMUP:-1}
ARENA_BYTES=$((256 << 20))  # kvd's tiers.host.capacity below
LOOKUPS=400                 # Lookup calls per kvd-bench run, and ping-pong exchanges before them
TLS=sm,tcp
REPORT=bench/peers-report.py

bench_binaries peers kvd kvd-bench

# ---- resources first: every arena here is small, but the machine may be shared ----
avail_mib=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo)
shm_mib=$(df -Pm /dev/shm | awk 'NR == 2 {print $4}')
if ((avail_mib < 2048)); then
  echo "[peers] only ${avail_mib} MiB of memory available; this run needs ~1.5 GiB: not run" >&2
  exit 1
fi
if ((shm_mib < 768)); then
  echo "[peers] only ${shm_mib} MiB free in /dev/shm; kvd's and Mooncake's arenas need ~512 MiB: not run" >&2
  exit 1
fi
shm_before=$(ls /dev/shm | sort)

# What a peer of this run left in /dev/shm (kvd's memfds leave nothing there; UCX and Mooncake
# may). Runs after bench_cleanup stopped this script's processes, so a name created during the
# run that no live process still has open or mapped is one of theirs, left behind. A name that
# some live process holds (say the short-lived UCX files of tests running beside this script) is
# not touched, nor one owned by another user.
shm_held() {
  local d
  for d in /proc/[0-9]*; do  # processes come and go meanwhile: never a failure
    find "$d/fd" -maxdepth 1 -lname '/dev/shm/*' -printf '%l\n' 2>/dev/null || true
    grep -ho ' /dev/shm/[^ ]*' "$d/maps" 2>/dev/null || true
  done | sed -e 's|^ *||' -e 's| (deleted)$||' -e 's|^/dev/shm/||' | sort -u
}
bench_on_exit() {
  local held f
  held=$(shm_held)
  comm -13 <(echo "$shm_before") <(ls /dev/shm | sort) | while read -r f; do
    [[ -n "$f" && -O "/dev/shm/$f" ]] || continue
    grep -qxF -- "$f" <<<"$held" || rm -f "/dev/shm/$f"
  done
}
bench_scratch peers
results=${KVD_PEERS_RESULTS:-$work/results.tsv}
: >"$results"

skipped() { [[ "$SKIP" == *" $1 "* ]]; }
count_for() {  # values per measurement: <= 192 MiB moved, enough ops for a p99 at small sizes
  if (($1 <= 65536)); then echo 400; elif (($1 <= 2097152)); then echo 48; else echo 6; fi
}
warmup_for() {  # kvd-bench --warmup rounds per client: the arena's size in values of $1 bytes
  if [[ "$WARMUP" == 0 ]]; then echo 0; else echo $(((ARENA_BYTES + $1 - 1) / $1)); fi
}

# ---- kvd: a small arena; llama-3.1-8b for 2 / 32 MiB chunks (128 KiB a token), a one-layer
# model for 64 KiB (4 KiB a token) ----
{ bench_builtin_model llama-3.1-8b; bench_model one-layer-4k 1 8 8 128; } |
  bench_topology kvd-peers 256
model_for() { if (($1 < 131072)); then echo one-layer-4k; else echo llama-3.1-8b; fi; }

start_kvd --config "$work/kvd.yaml"
sleep 2  # past start-up (arena prefault)
t0=$(cpu_ticks "$kvd_pid")
sleep 5
idle_pct=$(awk -v a="$t0" -v b="$(cpu_ticks "$kvd_pid")" -v hz="$(getconf CLK_TCK)" \
  'BEGIN {printf "%.2f", (b - a) / hz / 5 * 100}')
echo "== kvd idle (no client, 5 s after start-up): ${idle_pct} % of a core =="

# ---- Mooncake Store: venv under the build folder, a master on 127.0.0.1 ----
mooncake_ok=""
if ! skipped mooncake; then
  venv="$(cd "$BUILD_DIR" && pwd)/peers-venv"
  if [[ ! -x "$venv/bin/mooncake_master" && -z "${KVD_PEERS_NO_PIP:-}" ]]; then
    echo "[peers] installing mooncake-transfer-engine-non-cuda into $venv" >&2
    { python3 -m venv "$venv" && "$venv/bin/pip" install -q mooncake-transfer-engine-non-cuda; } \
      >"$work/pip.log" 2>&1 || { echo "[peers] Mooncake: pip install failed (skipped):" >&2; tail -5 "$work/pip.log" >&2; }
  fi
  if [[ -x "$venv/bin/mooncake_master" ]]; then
    mc_port=$((30000 + RANDOM % 10000))
    mc_http=$((mc_port + 1))
    (cd "$work" && exec "$venv/bin/mooncake_master" --rpc_port "$mc_port" \
      --enable_http_metadata_server=true --http_metadata_server_host 127.0.0.1 \
      --http_metadata_server_port "$mc_http" --metrics_port $((mc_port + 2)) \
      >"$work/mooncake-master.log" 2>&1) &
    bench_bg_pids+=($!)
    sleep 2
    if kill -0 "${bench_bg_pids[-1]}" 2>/dev/null; then
      mooncake_ok=1
    else
      echo "[peers] Mooncake: mooncake_master did not start (skipped):" >&2
      tail -5 "$work/mooncake-master.log" >&2
    fi
  else
    echo "[peers] Mooncake: not installed (skipped)" >&2
  fi
fi

# ---- redis: its own server on a unix socket, no persistence ----
redis_ok=""
if ! skipped redis; then
  if command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null; then
    redis-server --port 0 --unixsocket "$work/redis.sock" --save '' --appendonly no \
      --maxmemory 512mb --dir "$work" >"$work/redis.log" 2>&1 &
    bench_bg_pids+=($!)
    for _ in $(seq 50); do [[ -S "$work/redis.sock" ]] && break; sleep 0.1; done
    if [[ -S "$work/redis.sock" ]]; then redis_ok=1; else
      echo "[peers] redis: redis-server did not start (skipped):" >&2; tail -5 "$work/redis.log" >&2
    fi
  else
    echo "[peers] redis: redis-server / redis-benchmark not installed (skipped; optional step:" \
      "apt-get install redis-server redis-tools)" >&2
  fi
fi
perftest_ok=""
if ! skipped ucx_perftest; then
  if command -v ucx_perftest >/dev/null; then perftest_ok=1; else
    echo "[peers] ucx_perftest: not installed (skipped; apt-get install ucx-utils)" >&2
  fi
fi

ingest() { python3 "$REPORT" ingest "$results" "$@" || true; }

echo "== $ROUNDS interleaved rounds; sizes $SIZES; clients $CLIENTS; $(nproc) cores;" \
     "load average at start $(cut -d' ' -f1-3 /proc/loadavg) =="
for round in $(seq "$ROUNDS"); do
  for size in $SIZES; do
    n=$(count_for "$size")
    for c in $CLIENTS; do
      kb=(--addr "unix:$work/kvd.sock" --model "$(model_for "$size")" --chunk-bytes "$size"
          --count "$n" --concurrency "$c" --op both --ucx-tls "$TLS" --net-devices lo
          --warmup "$(warmup_for "$size")" --ready-file "$work/ready.json" --json
          --lookups "$LOOKUPS")
      if ! skipped kvd-shm; then
        "$BIN/kvd-bench" "${kb[@]}" --pingpong-floor "$LOOKUPS" >"$work/out.json" 2>"$work/err.txt" ||
          { echo "  kvd-shm failed: $(tail -1 "$work/err.txt")" >&2; }
        ingest "$round" kvd-shm "$size" "$c" kvdbench "$work/out.json"
      fi
      if ! skipped kvd-shm-inplace; then
        "$BIN/kvd-bench" "${kb[@]}" --in-place >"$work/out.json" 2>"$work/err.txt" ||
          { echo "  kvd-shm-inplace failed: $(tail -1 "$work/err.txt")" >&2; }
        ingest "$round" kvd-shm-inplace "$size" "$c" kvdbench "$work/out.json"
      fi
      if ! skipped kvd-ucx; then
        "$BIN/kvd-bench" "${kb[@]}" --no-shm >"$work/out.json" 2>"$work/err.txt" ||
          { echo "  kvd-ucx failed: $(tail -1 "$work/err.txt")" >&2; }
        ingest "$round" kvd-ucx "$size" "$c" kvdbench "$work/out.json"
      fi
      if ! skipped memcpy; then
        "$BIN/kvd-bench" --op memcpy --chunk-bytes "$size" --count "$n" --concurrency "$c" \
          --scatter-bytes "$ARENA_BYTES" --json >"$work/out.json" 2>"$work/err.txt" || true
        ingest "$round" memcpy "$size" "$c" kvdbench "$work/out.json"
      fi
      if [[ -n "$mooncake_ok" ]]; then
        modes=(inproc)
        ((c == 1)) && modes+=(remote)  # the second-process client: 1 client (slow over tcp)
        for mode in "${modes[@]}"; do
          timeout 120 "$venv/bin/python" bench/peers-mooncake.py \
            --master "127.0.0.1:$mc_port" --metadata "http://127.0.0.1:$mc_http/metadata" \
            --size "$size" --count "$n" --clients "$c" --mode "$mode" \
            >"$work/out.json" 2>"$work/mooncake-$mode.log" || true
          ingest "$round" "mooncake-$mode" "$size" "$c" mooncake "$work/out.json"
        done
      fi
      # redis SET of 32 MiB values runs at < 1 op/s here (redis-benchmark builds each command):
      # redis is measured up to 2 MiB.
      if [[ -n "$redis_ok" ]] && ((size <= 2097152)); then
        redis-benchmark -s "$work/redis.sock" -t set,get -n "$n" -d "$size" -c "$c" --csv \
          >"$work/redis.csv" 2>&1 || true
        ingest "$round" redis "$size" "$c" redis "$work/redis.csv"
      fi
      if [[ -n "$perftest_ok" ]] && ((c == 1)); then  # one pair of processes
        if run_perftest tag_bw "$size" "$n" "$TLS" >"$work/perf.txt"; then
          ingest "$round" ucx_perftest "$size" 1 perftest_bw "$work/perf.txt"
        fi
        # kvd's endpoints always use peer error handling, under which UCX 1.13 selects no
        # shared-memory lane (transport/README.md): the same lanes, for a fair second reference.
        if run_perftest tag_bw "$size" "$n" "$TLS" -e >"$work/perf.txt"; then
          ingest "$round" ucx_perftest-e "$size" 1 perftest_bw "$work/perf.txt"
        fi
        if run_perftest tag_lat "$size" "$n" "$TLS" >"$work/perf.txt"; then
          ingest "$round" ucx_perftest "$size" 1 perftest_lat "$work/perf.txt"
        fi
      fi
    done
  done
done
echo "== load average at end $(cut -d' ' -f1-3 /proc/loadavg) =="
python3 "$REPORT" report "$results" "$idle_pct"
