#!/usr/bin/env bash
# What a cluster-scope lookup's answer is worth (staleness), next to what a router fed by KV
# events would know, and the memory per chunk of each design, in one run: a private etcd, kvds
# on 127.0.0.2-4 (UCX_TLS=tcp on lo), lease TTL 3 s.
#
#   bench/cluster-staleness.sh [BUILD_DIR]   (default: build; binaries in BUILD_DIR/bin)
#   KVD_BENCH_SAMPLES        staleness samples (default 200)
#   KVD_BENCH_MEMBER_CYCLES  start / kill -9 cycles of a third kvd (default 3)
#   KVD_BENCH_CHUNKS         chunks put for the memory figures (default 1000000; 1-token chunks
#                            of a 1-layer model, 64 bytes of arena each)
#   KVD_BENCH_BASELINE_CHUNKS  chunks put before the memory baseline (default 100000)
#
# 1. Staleness (kvd-cluster-bench --op staleness): chunks put one at a time at kvd a (which also
#    publishes KV events, kv_events.endpoint), looked up with cluster scope at kvd b
#    (cluster.peer_fetch "off": it reports who holds what and copies nothing) from the put's
#    acknowledgement until b's answer lists a holding the chunk; then evicted at a and looked up
#    at b until a answers that it holds none. A ZeroMQ subscriber of a's events times the
#    BlockStored / BlockRemoved events from the same acknowledgements.
# 2. Membership: a third kvd c starts; cluster lookups at b until one lists c (from the start
#    of c's process and from its ready file); then kill -9 of c and lookups at b until none lists
#    it (its lease expiring), KVD_BENCH_MEMBER_CYCLES times.
# 3. Memory per chunk: the private (anonymous) resident memory of a kvd in no cluster and of a
#    cluster member, before and after KVD_BENCH_CHUNKS chunk puts, divided by the chunks their
#    host tiers held more (the arena is shared memory, not counted): the local index every
#    design keeps; then kvd-cluster-bench --op
#    router-index: the index a router keeps of a 3-node cluster fed by events, per chunk.
#
# Needs: kvd, kvd-bench, kvd-cluster-bench, kvdctl built; etcd (etcd-server). Exit 0 when every
# measurement ran.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh
bench_build_dir "${1:-}"
SAMPLES=${KVD_BENCH_SAMPLES:-200}
CYCLES=${KVD_BENCH_MEMBER_CYCLES:-3}
CHUNKS=${KVD_BENCH_CHUNKS:-1000000}
BASELINE_CHUNKS=${KVD_BENCH_BASELINE_CHUNKS:-100000}

bench_binaries cluster-staleness kvd kvd-bench kvd-cluster-bench kvdctl
bench_tool cluster-staleness etcd etcd-server
bench_scratch cluster-staleness
bench_etcd 127.0.0.1
# Below the ephemeral ports (32768 and up here), which any connection may hold, and apart from
# the 20000-40000 bench_etcd draws from.
events_port=$((10000 + RANDOM % 10000))

# write_node NAME [YAML...]: $work/NAME.yaml, kvd NAME of a 1-layer model "bench" (chunks of 16
# tokens, 32 bytes a token) with bench_topology's 256 MiB arena, each YAML line appended (e.g. a
# cluster: line). No shared-memory path (every client here is on TCP), so the arena's slots keep
# the 64-byte alignment (a shared-memory arena's are page aligned: 4 KiB a chunk).
write_node() {
  local name=$1
  shift
  bench_model bench 1 1 1 8 | bench_topology "$name" 16 "prefault: false, shared_memory: false"
  printf 'transport: {ucx_tls: tcp, net_devices: lo}\n' >>"$work/kvd.yaml"
  local line
  for line in "$@"; do printf '%s\n' "$line" >>"$work/kvd.yaml"; done
  mv "$work/kvd.yaml" "$work/$name.yaml"
}
member() {
  echo "cluster: {etcd: [$etcd_host:$etcd_port], name: bench, node: $1, token: bench-token, lease_ttl_s: 3${2:-}}"
}
cbench() { "$BIN/kvd-cluster-bench" --model bench --ucx-tls tcp --net-devices lo --json "$@"; }
# now_ns: the wall clock in ns since the epoch; mtime_ns FILE: FILE's modification time, same.
now_ns() { date +%s%N; }
mtime_ns() { stat -c %.9Y "$1" | tr -d .; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", (a - b) / 1e6}'; }
# figures FIELD: p50, p99, max and min of JSON object FIELD of $work/staleness.json, in us.
figures() {
  local f=$work/staleness.json
  printf "p50 %7.1f us, p99 %7.1f us, max %7.1f us, min %6.1f us" "$(json_field "$f" "$1.p50_us")" \
    "$(json_field "$f" "$1.p99_us")" "$(json_field "$f" "$1.max_us")" "$(json_field "$f" "$1.min_us")"
}

write_node a "$(member a)" "kv_events: {endpoint: \"tcp://127.0.0.2:$events_port\", topic: kvd}"
bench_cluster_node a 127.0.0.2
a=$node_addr
write_node b "$(member b ', peer_fetch: "off"')"
bench_cluster_node b 127.0.0.3
b=$node_addr b_pid=$node_pid
bench_cluster_members bench 2

echo "== staleness: $SAMPLES chunks put at a, cluster lookups at b (UCX_TLS=tcp on lo) =="
cbench --op staleness --addr "$b" --put-addr "$a" --holder a --count "$SAMPLES" \
  --events "tcp://127.0.0.2:$events_port" >"$work/staleness.json" ||
  { cat "$work/staleness.json" >&2; exit 1; }
echo "commit -> b's cluster lookup lists a:      $(figures commit_to_visible) (lookups needed: at most $(json_field "$work/staleness.json" max_lookups_to_visible))"
echo "commit -> a's BlockStored at a subscriber: $(figures commit_to_event)"
echo "evict  -> b's cluster lookup no longer:    $(figures evict_to_invisible) (lookups needed: at most $(json_field "$work/staleness.json" max_lookups_to_invisible))"
echo "evict  -> a's BlockRemoved at a subscriber: $(figures evict_to_event)"
echo "(a negative time: the event arrived before the acknowledgement reached the client)"
echo "(for scale: a put took $(figures put); an evict $(figures evict))"

echo "== membership: kvd c started and killed (kill -9) $CYCLES times; lease TTL 3 s =="
: >"$work/join.txt"
: >"$work/leave.txt"
for cycle in $(seq "$CYCLES"); do
  write_node c "$(member c)"
  cbench --op member --addr "$b" --node c --wait-ms 20000 >"$work/join.json" &
  watcher=$!
  bench_bg_pids+=("$watcher")
  sleep 0.5  # the watcher is connected and polling
  spawned=$(now_ns)
  bench_cluster_node c 127.0.0.4
  wait "$watcher" || { cat "$work/join.json" >&2; exit 1; }
  seen=$(json_field "$work/join.json" seen_unix_ns)
  echo "$(ms "$seen" "$spawned") $(ms "$seen" "$(mtime_ns "$work/c.ready")")" | tee -a "$work/join.txt" >"$work/join.txt.last"
  cbench --op member --addr "$b" --node c --absent --wait-ms 30000 >"$work/leave.json" &
  watcher=$!
  bench_bg_pids+=("$watcher")
  sleep 0.5
  killed=$(now_ns)
  kill -KILL "$node_pid"
  { wait "$node_pid"; } 2>/dev/null || true  # (no "Killed" notice from the shell)
  wait "$watcher" || { cat "$work/leave.json" >&2; exit 1; }
  seen=$(json_field "$work/leave.json" seen_unix_ns)
  { ms "$seen" "$killed"; echo; } >>"$work/leave.txt"
  read -r from_start from_ready <"$work/join.txt.last"
  printf "cycle %d: c started -> listed at b %s ms (%s ms after its ready file); kill -9 -> gone at b %s ms\n" \
    "$cycle" "$from_start" "$from_ready" "$(tail -1 "$work/leave.txt")"
done
printf "started -> listed: median %s ms (max %s); ready -> listed: median %s ms; kill -9 -> gone: median %s ms (min %s, max %s)\n" \
  "$(cut -d' ' -f1 "$work/join.txt" | median)" "$(cut -d' ' -f1 "$work/join.txt" | sort -g | tail -1)" \
  "$(cut -d' ' -f2 "$work/join.txt" | median)" "$(median <"$work/leave.txt")" \
  "$(sort -g "$work/leave.txt" | head -1)" "$(sort -g "$work/leave.txt" | tail -1)"

echo "== memory per chunk: $CHUNKS chunk puts (1 token, 32 bytes each) =="
# rss_anon PID: private resident memory of PID in bytes (the arena is shared memory, RssShmem).
rss_anon() { awk '/^RssAnon:/ {print $2 * 1024}' "/proc/$1/status"; }
# held ADDR: chunks the host tier of the kvd at ADDR holds.
held() {
  "$BIN/kvdctl" --addr "$1" --json stats |
    /usr/bin/python3 -c 'import json,sys; print(sum(t["chunks"] for t in json.load(sys.stdin)["tiers"] if t["name"] == "host"))'
}
puts() {  # puts ADDR COUNT: COUNT 1-token chunks put at ADDR, two clients
  "$BIN/kvd-bench" --addr "$1" --model bench --ucx-tls tcp --net-devices lo --tokens 1 \
    --count "$2" --concurrency 2 --op put --json >"$work/fill.json" || { cat "$work/fill.json" >&2; exit 1; }
}
# fill ADDR PID LABEL: private memory and chunks held before and after CHUNKS puts, per chunk
# added. The baseline comes after BASELINE_CHUNKS puts, so that what kvd keeps up to a fixed
# bound (the ids of the last 65536 finished reservations, buffers, first use of every path) is in
# it.
fill() {
  puts "$1" "$BASELINE_CHUNKS"
  local before after held_before held_after
  before=$(rss_anon "$2") held_before=$(held "$1")
  puts "$1" "$CHUNKS"
  after=$(rss_anon "$2") held_after=$(held "$1")
  printf "%-26s private memory %6.1f MiB -> %6.1f MiB, %d -> %d chunks held: %5.1f bytes per chunk (%.1f MiB per million chunks)\n" \
    "$3" "$(awk -v b="$before" 'BEGIN {print b / 1048576}')" "$(awk -v b="$after" 'BEGIN {print b / 1048576}')" \
    "$held_before" "$held_after" \
    "$(awk -v a="$after" -v b="$before" -v n=$((held_after - held_before)) 'BEGIN {print (a - b) / n}')" \
    "$(awk -v a="$after" -v b="$before" -v n=$((held_after - held_before)) 'BEGIN {print (a - b) / n * 1e6 / 1048576}')"
}
write_node solo
bench_cluster_node solo 127.0.0.5
fill "$node_addr" "$node_pid" "kvd in no cluster:"
fill "$b" "$b_pid" "kvd b, a cluster member:"
for holders in 1 3; do
  cbench --op router-index --count "$CHUNKS" --nodes 3 --holders-per-chunk "$holders" >"$work/index.json"
  for s in bitmask entries prefix_tree; do
    printf "router index, 3 nodes, %d holding each chunk, %-11s %6.1f bytes per chunk (%.1f MiB per million chunks)\n" \
      "$holders" "$s:" "$(json_field "$work/index.json" "$s.heap_bytes_per_chunk")" \
      "$(json_field "$work/index.json" "$s.heap_mib_per_million_chunks")"
  done
done
