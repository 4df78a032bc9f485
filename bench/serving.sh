#!/usr/bin/env bash
# The compression serving path end to end (docs/benchmarks.md, "Serving path"): for the raw
# model (no policy) and SnapKV policies at p_c 0.5 / 0.75 / 0.9, starts kvd (embedded default,
# the policy on smollm2-135m), runs `kvd-demo prefill` and `kvd-demo decode --baseline` as
# separate processes on the demo text, and prints one table row per run: put time per chunk
# (raw: transfer; with a policy: transfer + compression in kvd, acknowledged once the compact chunk
# is stored), bytes stored per chunk, get and expand time per chunk, time to first decoded token
# from kvd and with a local prefill, perplexity and top-1 agreement against the full cache.
# Then `kvd-demo local` at each p_c: the compression time per chunk in-process. Window 32 (16 at
# p_c 0.9, where a 256-token chunk keeps 26 tokens), 4 sinks.
#
#   bench/serving.sh [BUILD_DIR]     (default build; needs the model: fetch-models.sh)
#   KVD_BENCH_THREADS   engine threads (default 2)
#   KVD_BENCH_RATIOS    the runs (default "off 0.5 0.75 0.9"; off = no policy)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh
bench_build_dir "${1:-}"
bench_binaries serving kvd kvd-demo
model=$(./deploy/fetch-models.sh)
threads=${KVD_BENCH_THREADS:-2}
bench_scratch bench-serving

demo=(--model-file "$model" --text deploy/demo/text.txt --threads "$threads")
echo "| policy | put ms/chunk | stored B/chunk | get ms/chunk | build/expand ms/chunk | first token from kvd, s | first token with local prefill, s | ppl | top-1 vs full |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
for p_c in ${KVD_BENCH_RATIOS:-off 0.5 0.75 0.9}; do
  if [[ $p_c == off ]]; then policy=off; else
    # A 256-token chunk at p_c 0.9 keeps 26 tokens: room for 4 sinks + a 16-token window only.
    window=32
    [[ $p_c == 0.9 ]] && window=16
    policy="{stages: [snapkv], p_c: $p_c, window: $window, sinks: 4}"
  fi
  "$BIN/kvd" --print-default-config |
    sed "0,/^    compression: {.*/s//    compression: $policy/" >"$work/kvd.yaml"
  start_kvd --config "$work/kvd.yaml"
  addr=$kvd_addr
  conn=(--addr "$addr" --ucx-tls sm,tcp --net-devices lo)
  "$BIN/kvd-demo" prefill "${demo[@]}" "${conn[@]}" >"$work/prefill.txt"
  "$BIN/kvd-demo" decode "${demo[@]}" "${conn[@]}" --baseline >"$work/decode.txt"
  stop_kvd
  put=$(awk '/\[prefill\] chunk/ {for (i = 1; i <= NF; i++) if ($i == "ms," || $i == "ms") {s += $(i-1); n++}} END {printf "%.1f", s / n}' "$work/prefill.txt")
  stored=$(awk '/\[prefill\] chunk/ {s += $NF == "B" ? $(NF-1) : 0; n++} END {printf "%d", s / n}' "$work/prefill.txt")
  getms=$(sed -n 's/.*from kvd: get \([0-9.]*\) ms.*/\1/p' "$work/decode.txt")
  build=$(sed -n 's/.*ms, [a-z]* \([0-9.]*\) ms per chunk.*/\1/p' "$work/decode.txt")
  ttft=$(sed -n 's/.*time to first token: \([0-9.]*\) s from kvd, \([0-9.]*\) s with.*/\1 | \2/p' "$work/decode.txt")
  ppl=$(sed -n 's/^\[demo\] kvd cache: ppl=\([0-9.]*\).*/\1/p' "$work/decode.txt")
  agree=$(sed -n 's/.*top-1 agreement kvd cache vs full cache: \([0-9.]*\).*/\1/p' "$work/decode.txt")
  echo "| $p_c | $put | $stored | $getms | $build | $ttft | $ppl | $agree |"
  grep '^kvd-demo: ' "$work/decode.txt" >&2 || true
done
echo
echo "In-process compression per chunk (kvd-demo local, SnapKV):"
for p_c in 0.5 0.75 0.9; do
  window=32
  [[ $p_c == 0.9 ]] && window=16
  "$BIN/kvd-demo" local "${demo[@]}" --p-c "$p_c" --window "$window" --generate 2 >"$work/local.txt"
  awk -v p="$p_c" '/\] chunk .* compress / {s += $(NF-1); n++} END {printf "p_c %s: %.1f ms per chunk (%d chunks)\n", p, s / n, n}' "$work/local.txt"
done
