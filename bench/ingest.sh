#!/usr/bin/env bash
# What compression costs at ingest against moving the same raw chunk, in ONE run
# (docs/benchmarks.md, "Ingest: compression cost per stage" and "When a compressing put is acknowledged"):
#
#   1. kernels_bench BM_PlanDemoChunk: per-stage time of one 256-token SmolLM2-135M chunk
#      (30 layers x 3 KV heads x d 64, bf16, 5.6 MiB raw) for SnapKV, KeyDiff, KVSlimmer,
#      SnapKV + VECTOR and the hybrid (SnapKV + KVSlimmer) at p_c 0.5 / 0.75 / 0.9, 1 and 2
#      threads, and memcpy of the raw chunk;
#   2. kvd (256 MiB arena) with the SmolLM2 layout twice: `smollm2-raw` (no policy) and
#      `smollm2-keydiff` (KeyDiff p_c 0.5: needs no window queries, so kvd-bench can put it):
#      kvd-bench put/get of the raw chunk on the shared-memory path and on the UCX path
#      (--no-shm), memcpy of it (--op memcpy), a compressing put of the same chunk (latency:
#      transfer + compression, acknowledged once the compact chunk is stored), and a flood of
#      compressing puts (8 clients, pool of 2 workers + 4 queued: refused puts retried) for the
#      ingest throughput with the pool full; kvd's compress_us counter;
#   3. storage_bench: RocksDB (disk tier, WAL on) insert time of the raw chunk (5,898,240 B) and
#      of its compact form at p_c 0.5 (2,950,728 B).
# Prints the load average before and after. Raw JSON and logs stay in $KVD_BENCH_OUT if set.
#
#   bench/ingest.sh [BUILD_DIR]     (default build)
#   KVD_BENCH_COUNT      chunks per kvd-bench put/get run (default 20: 118 MiB)
#   KVD_BENCH_MIN_TIME   kernels_bench --benchmark_min_time (seconds, default 0.3)
#   KVD_BENCH_OUT        keep the raw outputs in this folder
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh
bench_build_dir "${1:-}"
COUNT=${KVD_BENCH_COUNT:-20}
MIN_TIME=${KVD_BENCH_MIN_TIME:-0.3}
RAW=5898240      # 256 tokens x 30 layers x 2 (K, V) x 3 heads x 64 x 2 bytes
COMPACT=2950728  # its compact chunk at p_c 0.5 (format v2, docs/chunk-format.md)
bench_binaries ingest kvd kvd-bench kvdctl kernels_bench storage_bench
bench_on_exit() {
  if [[ -n "${KVD_BENCH_OUT:-}" ]]; then mkdir -p "$KVD_BENCH_OUT" && cp -r "$work"/. "$KVD_BENCH_OUT"/; fi
}
bench_scratch bench-ingest

echo "load before: $(uptime)"
# ---- 1. per-stage compression cost ----
"$BIN/kernels_bench" --benchmark_filter='BM_PlanDemoChunk' --benchmark_min_time="$MIN_TIME" \
  --benchmark_out="$work/kernels.json" --benchmark_out_format=json >"$work/kernels.txt" 2>&1

# ---- 2. transfers, compressing puts, the flood ----
layout='{layers: 30, kv_heads: 3, q_heads: 9, head_dim: 64, dtype: bfloat16, rope: {theta: 100000, pairing: interleaved, scaling: none}}'
bench_topology bench-ingest 256 "prefault: false" <<YAML
  - name: smollm2-raw
    layout: $layout
    compression: off
  - name: smollm2-keydiff
    layout: $layout
    compression: {stages: [keydiff], p_c: 0.5, sinks: 4, worker_threads: 2, queue_depth: 4}
YAML
start_kvd --config "$work/kvd.yaml"
sock="$work/kvd.sock"
kb=(--addr "unix:$sock" --tokens 256 --count "$COUNT" --ucx-tls sm,tcp --net-devices lo --json)
"$BIN/kvd-bench" "${kb[@]}" --model smollm2-raw --op both >"$work/shm.json"
"$BIN/kvd-bench" "${kb[@]}" --model smollm2-raw --op both --no-shm >"$work/ucx.json"
"$BIN/kvd-bench" --op memcpy --chunk-bytes "$RAW" --count "$COUNT" --json >"$work/memcpy.json"
"$BIN/kvd-bench" "${kb[@]}" --model smollm2-raw --op put --finite-values >"$work/raw-put.json"
"$BIN/kvd-bench" "${kb[@]}" --model smollm2-keydiff --op put --finite-values >"$work/compress-put.json"
"$BIN/kvd-bench" "${kb[@]}" --model smollm2-keydiff --op put --finite-values --no-shm \
  >"$work/compress-put-ucx.json"
"$BIN/kvd-bench" --addr "unix:$sock" --tokens 256 --count $((2 * COUNT)) --json \
  --model smollm2-keydiff --op put --finite-values --retry-busy --concurrency 8 >"$work/flood.json"
"$BIN/kvdctl" --addr "unix:$sock" --json stats >"$work/stats.json"
stop_kvd

# ---- 3. RocksDB write of the raw and the compact chunk ----
for bytes in $RAW $COMPACT; do
  "$BIN/storage_bench" --chunk-bytes="$bytes" --iters=40 --disk-dir="$work" >"$work/storage-$bytes.txt"
done
echo "load after: $(uptime)"

python3 - "$work" "$RAW" "$COMPACT" <<'PY'
import json, re, sys
work, raw, compact = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
j = lambda name: json.load(open(f"{work}/{name}"))
kern = j("kernels.json")["benchmarks"]
memcpy = j("memcpy.json")
shm, ucx = j("shm.json"), j("ucx.json")
ms = lambda phase: phase["p50_us"] / 1e3
transfer = {"shm put": ms(shm["put"]), "shm get": ms(shm["get"]),
            "UCX put": ms(ucx["put"]), "UCX get": ms(ucx["get"]),
            "memcpy (fresh dest)": ms(memcpy["memcpy_fresh"]),
            "memcpy (warm dest)": ms(memcpy["memcpy_warm"])}
print(f"\nraw chunk {raw} B; transfer p50 ms: " +
      ", ".join(f"{k} {v:.2f}" for k, v in transfer.items()))
print(f"shared memory granted: {shm['shared_memory']} (shm run), {ucx['shared_memory']} (--no-shm run)")
stages = ["convert", "derotate", "score", "select", "merge", "route", "encode"]
print("\n| plan | p_c | threads | " + " | ".join(stages) +
      " | plan wall ms | plan CPU ms | serialize ms | memcpy ms | plan / shm put | plan / UCX put | stored/raw |")
print("| --- | ---: | ---: | " + " | ".join("---:" for _ in stages) + " | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for b in kern:
    if b.get("error_occurred"):
        print(f"| {b['name']} | error: {b.get('error_message')} |")
        continue
    m = re.match(r"BM_PlanDemoChunk/(\w+)/(\d+)/(\d+)/", b["name"])
    name, threads, pc = m.group(1), int(m.group(2)), int(m.group(3)) / 100
    wall = b["real_time"]  # ms (Unit ms)
    cells = " | ".join(f"{b[s + '_ms']:.2f}" for s in stages)
    # CPU time of the benchmark's thread: the whole plan with 1 thread, only part of it with 2.
    cpu = f"{b['cpu_time']:.2f}" if threads == 1 else "-"
    print(f"| {name} | {pc} | {threads} | {cells} | {wall:.2f} | {cpu} | {b['serialize_ms']:.2f} | "
          f"{b['memcpy_ms']:.2f} | {wall / transfer['shm put']:.1f} | {wall / transfer['UCX put']:.1f} | "
          f"{b['stored_over_raw']:.4f} |")
rp, cp, cpu, fl = j("raw-put.json"), j("compress-put.json"), j("compress-put-ucx.json"), j("flood.json")
print("\nput of the same 5.6 MiB chunk, one client, p50 / p90 ms:")
for label, r in (("raw put (shm)", rp), ("compressing put, KeyDiff p_c 0.5 (shm)", cp),
                 ("compressing put, KeyDiff p_c 0.5 (UCX)", cpu)):
    p = r["put"]
    print(f"  {label}: {p['p50_us'] / 1e3:.1f} / {p['p90_us'] / 1e3:.1f}  ({p['ops_per_s']:.1f} chunks/s)"
          + ("" if r["ok"] else f"  ERROR {r.get('error')}"))
p = fl["put"]
print(f"flood (8 clients, pool 2 workers + 4 queued): {p['ops_per_s']:.1f} chunks/s, "
      f"p50 {p['p50_us'] / 1e3:.1f} ms, p99 {p['p99_us'] / 1e3:.1f} ms, "
      f"{p.get('busy_retries', 0)} refused puts retried" + ("" if fl["ok"] else f"  ERROR {fl.get('error')}"))
st = j("stats.json")
def find(o, key):
    if isinstance(o, dict):
        for k, v in o.items():
            if k == key: return v
            r = find(v, key)
            if r is not None: return r
    return None
cu, cc = find(st, "compress_us"), find(st, "chunks_compressed")
if cu is not None and cc:
    print(f"kvd compress_us / chunks_compressed: {cu} / {cc} = {cu / cc / 1e3:.1f} ms per chunk")
for bytes_ in (raw, compact):
    for line in open(f"{work}/storage-{bytes_}.txt"):
        if "disk Insert (WAL on)" in line or "baseline memcpy into" in line:
            print(f"  {bytes_} B: {line.strip()}")
print(f"\ndisk bytes per chunk: ack the raw chunk first = {raw} (raw write-through) + {compact} "
      f"(compact rewrite) = {raw + compact}; ack after compression = {compact} "
      f"({(raw + compact) / compact:.2f}x less)")
PY
