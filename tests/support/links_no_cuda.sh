#!/usr/bin/env bash
# links_no_cuda.sh FILE...: fails when a FILE names the CUDA runtime, NCCL or the CUDA driver
# among its NEEDED entries (readelf -d), or is not a dynamic ELF file.
set -uo pipefail
status=0
for f in "$@"; do
  if ! dyn=$(readelf -d "$f" 2>&1) || ! grep -q NEEDED <<< "$dyn"; then
    echo "$f: not a dynamic ELF file: $dyn"
    status=1
    continue
  fi
  if cuda=$(grep -E 'NEEDED.*\[(libcudart|libnccl|libcuda)\.' <<< "$dyn"); then
    echo "$f links CUDA:"
    echo "$cuda"
    status=1
  else
    echo "$f: no CUDA library among $(grep -c NEEDED <<< "$dyn") NEEDED entries"
  fi
done
exit $status
