#!/usr/bin/env bash
# Runs one vllm test module with the vLLM venv's python (ctest, tests/vllm/CMakeLists.txt):
#   run_pytest.sh VENV_PYTHON MODEL_DIR TEST_FILE [pytest args...]
# Exit 77 (ctest: skipped) with the reason when deploy/setup-vllm.sh did not install the venv or
# convert the model (no PyPI, KVD_VLLM=0, ...).
set -euo pipefail
py=$1 model=$2 file=$3
shift 3
source "$(dirname "$0")/require_vllm.sh"
export KVD_VLLM_MODEL=$model
cd "$(dirname "$0")"
exec "$py" -m pytest -q -p no:cacheprovider -rA --durations=0 "$file" "$@"
