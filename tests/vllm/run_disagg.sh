#!/usr/bin/env bash
# ctest vllm_disagg: deploy/vllm-disagg.sh on one short length (kvd, two vLLM API servers, the
# proxy), which fails unless the decode instance loaded every chunk the prefill instance put and
# the proxy answered. Figures are not checked (docs/benchmarks.md has a full run).
#   run_disagg.sh VENV_PYTHON MODEL_DIR BUILD_DIR
# Exit 77 (skipped) with the reason where deploy/setup-vllm.sh did not install the venv or model.
set -euo pipefail
py=$1 model=$2 build=$3
source "$(dirname "$0")/require_vllm.sh"
cd "$(dirname "$0")/../.."
KVD_BUILD_DIR=$build KVD_VLLM_VENV=$(dirname "$(dirname "$py")") KVD_VLLM_MODEL=$model \
  KVD_DISAGG_LENGTHS=${KVD_DISAGG_LENGTHS:-600} KVD_DISAGG_REPEATS=1 \
  KVD_DISAGG_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])') \
  exec ./deploy/vllm-disagg.sh
