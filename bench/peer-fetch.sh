#!/usr/bin/env bash
# Peer fetch between two kvds of one cluster (a private etcd; UCX_TLS=tcp), next to a same-node
# get and ucx_perftest tag_bw, at 2 MiB and 32 MiB chunks, in one run; then the cost of a
# cluster-scope lookup against a local one.
#
#   bench/peer-fetch.sh [--veth] [BUILD_DIR]   (default: build; binaries in BUILD_DIR/bin)
#   KVD_BENCH_ROUNDS   interleaved rounds per size (default 3); medians reported
#
# Loopback (default): kvds on 127.0.0.2-5, UCX on lo. Two pairs: a -> b with kvd's default
# same-host bulk path (transport.cma_threshold_bytes 64 KiB: the receiver copies the bytes with
# process_vm_readv, UCX carries a descriptor), and c -> d with cma_threshold_bytes 0 (every byte
# through UCX's tcp lane, as between two hosts).
#
# --veth (needs root and ip): the serving kvd b runs in a network namespace of its own, joined to
# this one by a veth pair (10.215.X.1 here, 10.215.X.2 there); the fetching kvd a, etcd and
# kvd-bench run here. UCX's tcp lane on the veth ends (net_devices), cma_threshold_bytes 0 on
# both; ucx_perftest's server runs in the namespace too, its client here, over the same pair.
# The namespace, the pair and every process are removed on exit.
#
# Peer fetch: kvd-bench puts the chunks through the writer (--put-addr) and looks the whole chain
# up at the reader with cluster scope (--cluster --lookup-chain COUNT): that one lookup copies
# every chunk from the writer into the reader's host tier; GB/s = bytes fetched / lookup time.
# Same-node get: kvd-bench --op both at the reader over TCP + UCX (its get phase). ucx_perftest:
# tag_bw -e, messages of the chunk size, UCX_TLS=tcp.
#
# Needs: kvd, kvd-bench, kvdctl built; ucx_perftest (ucx-utils); etcd (etcd-server). Exit 0 when
# every measurement ran.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh
VETH=""
if [[ ${1:-} == --veth ]]; then VETH=1; shift; fi
bench_build_dir "${1:-}"
ROUNDS=${KVD_BENCH_ROUNDS:-3}
TLS=tcp

bench_binaries peer-fetch kvd kvd-bench kvdctl
bench_tool peer-fetch ucx_perftest ucx-utils
bench_tool peer-fetch etcd etcd-server
if [[ -n $VETH ]]; then
  bench_tool peer-fetch ip iproute2
  [[ $(id -u) == 0 ]] || { echo "[peer-fetch] --veth needs root (network namespaces)" >&2; exit 1; }
fi
bench_scratch peer-fetch

# ---- --veth: a namespace joined to this one by a veth pair ----
ns=""
# The trap's last step (after bench_cleanup stopped the processes it started): kills what is
# still in the namespace, deletes it (its end of the pair goes with it, and so the pair), then
# the pair by name in case the namespace went first or never got its end.
bench_on_exit() {
  [[ -n $ns ]] || return 0
  local p
  for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
  ip netns del "$ns" 2>/dev/null || true
  ip link del "$veth_here" 2>/dev/null || true
}
if [[ -n $VETH ]]; then
  id=$(($$ % 100000))
  ns=kvdpf$id veth_here=kvdpfh$id veth_ns=kvdpfn$id
  net=10.215.$(($$ % 250))
  here_ip=$net.1 ns_ip=$net.2
  ip netns add "$ns"
  ip link add "$veth_here" type veth peer name "$veth_ns"
  ip link set "$veth_ns" netns "$ns"
  ip addr add "$here_ip/24" dev "$veth_here"
  ip link set "$veth_here" up
  ip -n "$ns" addr add "$ns_ip/24" dev "$veth_ns"
  ip -n "$ns" link set "$veth_ns" up
  ip -n "$ns" link set lo up
  etcd_host=$here_ip dev=$veth_here
  perftest_server_prefix=(ip netns exec "$ns")
  perftest_server_dev=$veth_ns perftest_client_dev=$veth_here perftest_host=$ns_ip
else
  etcd_host=127.0.0.1 dev=lo
fi

bench_etcd "$etcd_host"

# start_node NAME IP CMA_THRESHOLD DEVICE [PREFIX...]: kvd NAME of cluster "bench" listening on
# IP, UCX on DEVICE, run under PREFIX (e.g. ip netns exec NS); sets node_addr.
start_node() {
  local name=$1 ip=$2 cma=$3 device=$4
  shift 4
  bench_model bench 32 8 32 128 | bench_topology "$name" 256 "prefault: false"
  printf 'transport: {ucx_tls: %s, net_devices: %s, cma_threshold_bytes: %s}\ncluster: {etcd: [%s:%s], name: bench, node: %s, token: bench-token}\n' \
    "$TLS" "$device" "$cma" "$etcd_host" "$etcd_port" "$name" >>"$work/kvd.yaml"
  # Beyond loopback only on the pair this script made.
  [[ -n $VETH ]] && printf 'auth: {allow_unauthenticated: true}\n' >>"$work/kvd.yaml"
  mv "$work/kvd.yaml" "$work/$name.yaml"
  bench_cluster_node "$name" "$ip" "$@"
}
# lanes: "NAME READER WRITER" per pair of kvds measured.
if [[ -n $VETH ]]; then
  start_node a "$here_ip" 0 "$veth_here"
  a=$node_addr
  start_node b "$ns_ip" 0 "$veth_ns" ip netns exec "$ns"
  b=$node_addr
  lanes=("veth $a $b")
  where="a here <- b in namespace $ns over veth $veth_here/$veth_ns ($here_ip/$ns_ip, MTU $(cat /sys/class/net/"$veth_here"/mtu)), cma_threshold_bytes 0"
else
  start_node a 127.0.0.2 65536 lo
  a=$node_addr
  start_node b 127.0.0.3 65536 lo
  b=$node_addr
  start_node c 127.0.0.4 0 lo
  c=$node_addr
  start_node d 127.0.0.5 0 lo
  lanes=("cma $a $b" "ucx $c $node_addr")
  where="cma = kvd's same-host bulk path (a <- b), ucx = cma_threshold_bytes 0 (c <- d)"
fi
bench_cluster_members bench $((${#lanes[@]} * 2))

bench() { "$BIN/kvd-bench" --model bench --ucx-tls "$TLS" --net-devices "$dev" --json "$@"; }

echo "== same machine, same run: UCX_TLS=$TLS on $dev, $ROUNDS interleaved rounds per size; $where =="
# veth_bytes: bytes the pair has carried so far (both directions, counted at this end).
veth_bytes() { echo $(($(cat /sys/class/net/"$veth_here"/statistics/tx_bytes) + $(cat /sys/class/net/"$veth_here"/statistics/rx_bytes))); }
[[ -n $VETH ]] && veth_start=$(veth_bytes)
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
for size in 2097152 33554432; do
  count=$((size == 2097152 ? 48 : 4))
  perf_count=$((size == 2097152 ? 200 : 32))  # enough messages for a steady ucx_perftest figure
  : >"$work/perf.txt"
  for l in "${lanes[@]}"; do : >"$work/get_${l%% *}.txt"; : >"$work/fetch_${l%% *}.txt"; done
  for round in $(seq "$ROUNDS"); do
    echo "$(perftest_gbps $(run_perftest tag_bw "$size" "$perf_count" "$TLS" -e))" >>"$work/perf.txt"
    line=$(printf "%d MiB round %d: ucx_perftest -e %.3f GB/s" $((size >> 20)) "$round" "$(tail -1 "$work/perf.txt")")
    for l in "${lanes[@]}"; do
      read -r lane reader writer <<<"$l"
      bench --addr "$reader" --chunk-bytes "$size" --count "$count" --op both >"$work/get.json" ||
        { cat "$work/get.json" >&2; exit 1; }
      bench --addr "$reader" --put-addr "$writer" --cluster --lookup-chain "$count" \
        --chunk-bytes "$size" --count "$count" --op both >"$work/fetch.json" ||
        { cat "$work/fetch.json" >&2; exit 1; }
      json_field "$work/get.json" get.gbps >>"$work/get_$lane.txt"
      json_field "$work/fetch.json" lookup.gbps >>"$work/fetch_$lane.txt"
      line+=$(printf " | %s: get %.3f, peer fetch %.3f GB/s" "$lane" "$(tail -1 "$work/get_$lane.txt")" \
        "$(tail -1 "$work/fetch_$lane.txt")")
    done
    echo "$line"
  done
  perf_m=$(median <"$work/perf.txt")
  line=$(printf "%d MiB median (%d chunks per cluster lookup): ucx_perftest tag_bw -e %.3f GB/s" \
    $((size >> 20)) "$count" "$perf_m")
  for l in "${lanes[@]}"; do
    lane=${l%% *}
    get_m=$(median <"$work/get_$lane.txt")
    fetch_m=$(median <"$work/fetch_$lane.txt")
    line+=$(printf "; %s: same-node get %.3f, peer fetch %.3f GB/s (%sx of get, %sx of ucx_perftest)" \
      "$lane" "$get_m" "$fetch_m" "$(ratio "$fetch_m" "$get_m")" "$(ratio "$fetch_m" "$perf_m")")
  done
  echo "$line"
done

[[ -n $VETH ]] && awk -v b=$(($(veth_bytes) - veth_start)) \
  'BEGIN {printf "the veth pair carried %.2f GB during the measurements above\n", b / 1e9}'

# ---- the cost of a lookup's scope: 1-chunk chains stored on a, 2000 lookups each way ----
for scope in local cluster; do
  flags=()
  [[ $scope == cluster ]] && flags=(--cluster)
  bench --addr "$a" --tokens 1 --count 200 --op both --lookups 2000 "${flags[@]}" >"$work/lookup.json" ||
    { cat "$work/lookup.json" >&2; exit 1; }
  printf "%-7s lookup (1-chunk chain, held on a; b asked too when cluster): p50 %.0f us, p99 %.0f us\n" \
    "$scope" "$(json_field "$work/lookup.json" lookup.p50_us)" "$(json_field "$work/lookup.json" lookup.p99_us)"
done
