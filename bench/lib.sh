# Shell functions the benchmark scripts share (sourced by every bench/*.sh; not run on
# its own). The sourcing script sets `BIN` (kvd's binaries; bench_build_dir does it from the
# script's first argument), checks what it needs (bench_binaries, bench_tool) and makes its
# scratch folder `work` with the EXIT trap that stops kvd and removes the folder (bench_scratch).

kvd_pid=""
bench_bg_pids=()  # other background processes a script started (ucx_perftest servers, peers)

# bench_build_dir [BUILD_DIR]: sets BUILD_DIR (the argument, else $KVD_BUILD_DIR, else build)
# and BIN ($BUILD_DIR/bin).
bench_build_dir() {
  BUILD_DIR=${1:-${KVD_BUILD_DIR:-build}}
  BIN="$BUILD_DIR/bin"
}

# bench_binaries TAG NAME...: exits 1 naming the first $BIN/NAME that is not built.
bench_binaries() {
  local tag=$1 b
  shift
  for b in "$@"; do
    [[ -x "$BIN/$b" ]] || { echo "[$tag] $BIN/$b not built (run ./deploy/setup.sh)" >&2; exit 1; }
  done
}

# bench_tool TAG COMMAND PACKAGE: exits 1 when COMMAND is not on PATH, naming its Debian package.
bench_tool() {
  command -v "$2" >/dev/null || { echo "[$1] $2 not found (apt-get install $3)" >&2; exit 1; }
}

# bench_scratch NAME: makes the scratch folder $work (/tmp/kvd-NAME.XXXXXX) and sets the
# EXIT/INT/TERM trap bench_exit, so every script cleans up the same way.
bench_scratch() {
  work=$(mktemp -d "/tmp/kvd-$1.XXXXXX")
  trap bench_exit EXIT INT TERM
}

# The trap of bench_scratch: stops kvd and the background processes (bench_cleanup), runs the
# script's own bench_on_exit if it defines one (while $work still exists), removes $work and
# keeps the exit status.
bench_exit() {
  local rc=$?
  bench_cleanup
  if declare -F bench_on_exit > /dev/null; then bench_on_exit; fi
  rm -rf "$work"
  exit $rc
}

# Stops kvd (TERM, then KILL after 5 s) and every process in bench_bg_pids.
bench_cleanup() {
  local p
  for p in "${bench_bg_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${bench_bg_pids[@]}"; do wait "$p" 2>/dev/null || true; done
  bench_bg_pids=()
  stop_kvd
}

# json_field FILE PATH: prints PATH (like put.gbps) of the JSON object in FILE.
json_field() {
  /usr/bin/python3 -c 'import json,sys; v=json.load(open(sys.argv[1]))
for k in sys.argv[2].split("."): v=v[k]
print(v)' "$1" "$2"
}

# median: the median of the numbers on stdin, one a line.
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

# bench_topology NODE CHUNK_TOKENS [HOST_KEYS]: writes $work/kvd.yaml: node NODE, CHUNK_TOKENS
# tokens a chunk, the `models:` entries read from stdin (bench_model and bench_builtin_model
# print them) and the benches' host tier: a 256 MiB arena of 64 MiB segments, plus HOST_KEYS
# (YAML, e.g. "prefault: false"). Every other key keeps kvd's default; start_kvd sets the
# listeners.
bench_topology() {
  {
    printf 'node: %s\nchunk_tokens: %s\nmodels:\n' "$1" "$2"
    cat
    printf 'tiers:\n  host: {capacity: 256MiB, segment: 64MiB%s}\n' "${3:+, $3}"
  } >"$work/kvd.yaml"
}

# bench_model NAME LAYERS KV_HEADS Q_HEADS HEAD_DIM: the `models:` entry of a bfloat16 model with
# interleaved rope (theta 10000), stored raw (compression off).
bench_model() {
  printf '  - name: %s\n    layout: {layers: %s, kv_heads: %s, q_heads: %s, head_dim: %s, %s}\n' \
    "$1" "$2" "$3" "$4" "$5" "dtype: bfloat16, rope: {theta: 10000, pairing: interleaved, scaling: none}"
  printf '    compression: off\n'
}

# bench_builtin_model NAME: the `models:` entry of kvd's built-in model NAME as
# `$BIN/kvd --print-default-config` has it (its comment lines left out).
bench_builtin_model() {
  "$BIN/kvd" --print-default-config |
    awk -v name="$1" '/^  - name: / { on = ($3 == name) } /^[^ #]/ { on = 0 } on && NF && !/^ *#/'
}

# start_kvd [kvd args...]: starts kvd listening on 127.0.0.1:0 and $work/kvd.sock, waits for
# its ready file ($work/ready.json) and sets kvd_pid and kvd_addr (its TCP address).
start_kvd() {
  rm -f "$work/ready.json"
  "$BIN/kvd" --listen 127.0.0.1:0 --unix "$work/kvd.sock" --ready-file "$work/ready.json" "$@" \
    >"$work/kvd.log" 2>&1 &
  kvd_pid=$!
  for _ in $(seq 300); do
    [[ -s "$work/ready.json" ]] && break
    kill -0 "$kvd_pid" 2>/dev/null || { echo "[bench] kvd died:" >&2; cat "$work/kvd.log" >&2; return 1; }
    sleep 0.05
  done
  [[ -s "$work/ready.json" ]] || { echo "[bench] kvd not ready" >&2; cat "$work/kvd.log" >&2; return 1; }
  kvd_addr=$(json_field "$work/ready.json" tcp)
}

stop_kvd() {
  if [[ -n "$kvd_pid" ]] && kill -0 "$kvd_pid" 2>/dev/null; then
    kill -TERM "$kvd_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$kvd_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$kvd_pid" 2>/dev/null || true
  fi
  [[ -n "$kvd_pid" ]] && { wait "$kvd_pid" 2>/dev/null || true; }
  kvd_pid=""
}

# cpu_ticks PID: utime + stime of PID (clock ticks, all threads) from /proc/PID/stat.
cpu_ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'; }

# Where run_perftest's two ends run. Defaults: both on loopback (UCX_NET_DEVICES=lo), the client
# dialing 127.0.0.1. A script may set the server's command prefix (e.g. ip netns exec NS), each
# end's UCX_NET_DEVICES and the address the client dials.
perftest_server_prefix=()
perftest_server_dev=lo
perftest_client_dev=lo
perftest_host=127.0.0.1

# run_perftest TEST SIZE COUNT TLS [FLAG...]: one ucx_perftest TEST (tag_bw, tag_lat, ...) of
# SIZE-byte messages between a server and a client (placed as the perftest_* variables above
# say), both given the FLAGs (e.g. -e: endpoints with peer error handling, as kvd's are); prints
# the client's "Final:" line fields
# "iters lat50_us lat_avg_us lat_overall_us bw_avg_MiBs bw_overall_MiBs rate_avg rate_overall".
run_perftest() {
  local test=$1 size=$2 count=$3 tls=$4 port=$((20000 + RANDOM % 20000)) srv line
  local flags=("${@:5}")
  "${perftest_server_prefix[@]}" env UCX_TLS="$tls" UCX_NET_DEVICES="$perftest_server_dev" \
    ucx_perftest -t "$test" -s "$size" -n "$count" -p "$port" \
    "${flags[@]}" >"$work/perf-server.log" 2>&1 &
  srv=$!
  sleep 1
  if ! UCX_TLS=$tls UCX_NET_DEVICES=$perftest_client_dev ucx_perftest "$perftest_host" -t "$test" \
    -s "$size" -n "$count" -p "$port" "${flags[@]}" >"$work/perf-client.log" 2>&1; then
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
    cat "$work/perf-client.log" >&2
    return 1
  fi
  wait "$srv" 2>/dev/null || true
  line=$(awk '/Final:/ {$1 = ""; print}' "$work/perf-client.log")
  [[ -n "$line" ]] || { cat "$work/perf-client.log" >&2; return 1; }
  echo $line
}

# perftest_gbps FIELDS: GB/s (1e9) from run_perftest's bw_overall (ucx_perftest's MB are MiB).
perftest_gbps() { awk -v m="$6" 'BEGIN {printf "%.3f", m * 1048576 / 1e9}'; }

# bench_etcd HOST: starts a private etcd-server on HOST at a random port (its data in
# $work/etcd, its log $work/etcd.log; stopped with the other background processes) and sets
# etcd_host and etcd_port.
bench_etcd() {
  etcd_host=$1
  etcd_port=$((20000 + RANDOM % 20000))
  local url=http://$etcd_host:$etcd_port peer=http://$etcd_host:$((etcd_port + 1))
  etcd --name=bench --data-dir="$work/etcd" --listen-client-urls="$url" \
    --advertise-client-urls="$url" --listen-peer-urls="$peer" \
    --initial-advertise-peer-urls="$peer" --initial-cluster="bench=$peer" \
    --log-level=warn >"$work/etcd.log" 2>&1 &
  bench_bg_pids+=($!)
}

# bench_cluster_node NAME IP [PREFIX...]: starts kvd NAME with the topology $work/NAME.yaml
# (the script wrote it), listening on IP:0 without a unix socket, run under PREFIX (e.g. ip
# netns exec NS); waits for its ready file ($work/NAME.ready) and sets node_addr (its TCP
# address) and node_pid (also added to bench_bg_pids). Exits 1 naming the log when it is not
# ready within 15 s.
bench_cluster_node() {
  local name=$1 ip=$2
  shift 2
  rm -f "$work/$name.ready"
  "$@" "$BIN/kvd" --config "$work/$name.yaml" --listen "$ip:0" --unix none \
    --ready-file "$work/$name.ready" >"$work/$name.log" 2>&1 &
  node_pid=$!
  bench_bg_pids+=($node_pid)
  for _ in $(seq 300); do
    [[ -s "$work/$name.ready" ]] && break
    sleep 0.05
  done
  [[ -s "$work/$name.ready" ]] || { echo "[bench] kvd $name not ready:" >&2; cat "$work/$name.log" >&2; exit 1; }
  node_addr=$(json_field "$work/$name.ready" tcp)
}

# bench_cluster_members CLUSTER N: waits (up to 10 s) until cluster CLUSTER on bench_etcd's
# etcd lists N members; exits 1 when it does not.
bench_cluster_members() {
  local n=0
  for _ in $(seq 100); do
    n=$("$BIN/kvdctl" --json cluster --etcd "$etcd_host:$etcd_port" --name "$1" 2>/dev/null |
      /usr/bin/python3 -c 'import json,sys; print(len(json.load(sys.stdin)["members"]))' 2>/dev/null || echo 0)
    [[ $n == "$2" ]] && return 0
    sleep 0.1
  done
  echo "[bench] cluster $1 lists $n members, not $2" >&2
  exit 1
}
