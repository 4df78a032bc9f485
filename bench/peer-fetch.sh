#!/usr/bin/env bash
# Peer fetch between two kvds of one cluster (a private etcd on loopback; kvds on 127.0.0.2-5;
# UCX_TLS=tcp on lo), next to a same-node get and ucx_perftest tag_bw, at 2 MiB and 32 MiB
# chunks, in one run; then the cost of a cluster-scope lookup against a local one. Two pairs of
# kvds: a -> b with kvd's default same-host bulk path (transport.cma_threshold_bytes 64 KiB: the
# receiver copies the bytes with process_vm_readv, UCX carries a descriptor), and c -> d with
# cma_threshold_bytes 0 (every byte through UCX's tcp lane, as between two hosts).
#
#   bench/peer-fetch.sh [BUILD_DIR]     (default: build; binaries in BUILD_DIR/bin)
#   KVD_BENCH_ROUNDS   interleaved rounds per size (default 3); medians reported
#
# Peer fetch: kvd-bench puts the chunks through b (--put-addr) and looks the whole chain up at a
# with cluster scope (--cluster --lookup-chain COUNT): that one lookup copies every chunk from b
# into a's host tier; GB/s = bytes fetched / lookup time. Same-node get: kvd-bench --op both at a
# over TCP + UCX (its get phase). ucx_perftest: tag_bw, messages of the chunk size, UCX_TLS=tcp.
#
# Needs: kvd, kvd-bench built; ucx_perftest (ucx-utils); etcd (etcd-server). Exit 0 when every
# measurement ran.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh
bench_build_dir "${1:-}"
ROUNDS=${KVD_BENCH_ROUNDS:-3}
TLS=tcp

bench_binaries peer-fetch kvd kvd-bench
bench_tool peer-fetch ucx_perftest ucx-utils
bench_tool peer-fetch etcd etcd-server
bench_scratch peer-fetch

# ---- etcd on loopback ----
etcd_port=$((20000 + RANDOM % 20000))
etcd_url=http://127.0.0.1:$etcd_port
peer_url=http://127.0.0.1:$((etcd_port + 1))
etcd --name=bench --data-dir="$work/etcd" --listen-client-urls="$etcd_url" \
  --advertise-client-urls="$etcd_url" --listen-peer-urls="$peer_url" \
  --initial-advertise-peer-urls="$peer_url" --initial-cluster="bench=$peer_url" \
  --log-level=warn >"$work/etcd.log" 2>&1 &
bench_bg_pids+=($!)

# start_node NAME IP CMA_THRESHOLD: kvd NAME of cluster "bench" listening on IP; sets node_addr.
start_node() {
  bench_model bench 32 8 32 128 | bench_topology "$1" 256 "prefault: false"
  printf 'transport: {ucx_tls: %s, net_devices: lo, cma_threshold_bytes: %s}\ncluster: {etcd: [127.0.0.1:%s], name: bench, node: %s, token: bench-token}\n' \
    "$TLS" "$3" "$etcd_port" "$1" >>"$work/kvd.yaml"
  mv "$work/kvd.yaml" "$work/$1.yaml"
  "$BIN/kvd" --config "$work/$1.yaml" --listen "$2:0" --unix none \
    --ready-file "$work/$1.ready" >"$work/$1.log" 2>&1 &
  bench_bg_pids+=($!)
  for _ in $(seq 300); do
    [[ -s "$work/$1.ready" ]] && break
    sleep 0.05
  done
  [[ -s "$work/$1.ready" ]] || { echo "[peer-fetch] kvd $1 not ready:" >&2; cat "$work/$1.log" >&2; exit 1; }
  node_addr=$(json_field "$work/$1.ready" tcp)
}
start_node a 127.0.0.2 65536
a=$node_addr
start_node b 127.0.0.3 65536
b=$node_addr
start_node c 127.0.0.4 0
c=$node_addr
start_node d 127.0.0.5 0
d=$node_addr
for _ in $(seq 100); do
  n=$("$BIN/kvdctl" --json cluster --etcd "127.0.0.1:$etcd_port" --name bench 2>/dev/null |
    /usr/bin/python3 -c 'import json,sys; print(len(json.load(sys.stdin)["members"]))' 2>/dev/null || echo 0)
  [[ $n == 4 ]] && break
  sleep 0.1
done
[[ $n == 4 ]] || { echo "[peer-fetch] the four kvds did not all register" >&2; exit 1; }

bench() { "$BIN/kvd-bench" --model bench --ucx-tls "$TLS" --net-devices lo --json "$@"; }

echo "== same machine, same run: UCX_TLS=$TLS on lo, $ROUNDS interleaved rounds per size;" \
  "cma = kvd's same-host bulk path (a <- b), ucx = cma_threshold_bytes 0 (c <- d) =="
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
for size in 2097152 33554432; do
  count=$((size == 2097152 ? 48 : 4))
  perf_count=$((size == 2097152 ? 200 : 32))  # enough messages for a steady ucx_perftest figure
  for f in perf get_cma fetch_cma get_ucx fetch_ucx; do : >"$work/$f.txt"; done
  for round in $(seq "$ROUNDS"); do
    echo "$(perftest_gbps $(run_perftest tag_bw "$size" "$perf_count" "$TLS" -e))" >>"$work/perf.txt"
    for lane in cma ucx; do
      if [[ $lane == cma ]]; then reader=$a writer=$b; else reader=$c writer=$d; fi
      bench --addr "$reader" --chunk-bytes "$size" --count "$count" --op both >"$work/get.json" ||
        { cat "$work/get.json" >&2; exit 1; }
      bench --addr "$reader" --put-addr "$writer" --cluster --lookup-chain "$count" \
        --chunk-bytes "$size" --count "$count" --op both >"$work/fetch.json" ||
        { cat "$work/fetch.json" >&2; exit 1; }
      json_field "$work/get.json" get.gbps >>"$work/get_$lane.txt"
      json_field "$work/fetch.json" lookup.gbps >>"$work/fetch_$lane.txt"
    done
    printf "%d MiB round %d: ucx_perftest -e %.3f GB/s | cma: get %.3f, peer fetch %.3f GB/s | ucx: get %.3f, peer fetch %.3f GB/s\n" \
      $((size >> 20)) "$round" "$(tail -1 "$work/perf.txt")" "$(tail -1 "$work/get_cma.txt")" \
      "$(tail -1 "$work/fetch_cma.txt")" "$(tail -1 "$work/get_ucx.txt")" "$(tail -1 "$work/fetch_ucx.txt")"
  done
  for f in perf get_cma fetch_cma get_ucx fetch_ucx; do eval "${f}_m=$(median <"$work/$f.txt")"; done
  printf "%d MiB median (%d chunks per cluster lookup): ucx_perftest tag_bw -e %.3f GB/s; cma: same-node get %.3f, peer fetch %.3f GB/s (%sx of get); ucx: same-node get %.3f, peer fetch %.3f GB/s (%sx of get, %sx of ucx_perftest)\n" \
    $((size >> 20)) "$count" "$perf_m" "$get_cma_m" "$fetch_cma_m" "$(ratio "$fetch_cma_m" "$get_cma_m")" \
    "$get_ucx_m" "$fetch_ucx_m" "$(ratio "$fetch_ucx_m" "$get_ucx_m")" "$(ratio "$fetch_ucx_m" "$perf_m")"
done

# ---- the cost of a lookup's scope: 1-chunk chains stored on a, 2000 lookups each way ----
for scope in local cluster; do
  flags=()
  [[ $scope == cluster ]] && flags=(--cluster)
  bench --addr "$a" --tokens 1 --count 200 --op both --lookups 2000 "${flags[@]}" >"$work/lookup.json" ||
    { cat "$work/lookup.json" >&2; exit 1; }
  printf "%-7s lookup (1-chunk chain, held on a; b asked too when cluster): p50 %.0f us, p99 %.0f us\n" \
    "$scope" "$(json_field "$work/lookup.json" lookup.p50_us)" "$(json_field "$work/lookup.json" lookup.p99_us)"
done
