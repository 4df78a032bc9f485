#!/usr/bin/env bash
# Runs one vllm test module with the vLLM venv's python (ctest, tests/vllm/CMakeLists.txt):
#   run_pytest.sh VENV_PYTHON MODEL_DIR TEST_FILE [pytest args...]
# Exit 77 (ctest: skipped) with the reason when deploy/setup-vllm.sh did not install the venv or
# convert the model (no PyPI, KVD_VLLM=0, ...).
set -euo pipefail
py=$1 model=$2 file=$3
shift 3
if [[ ! -x $py || ! -f $(dirname "$py")/../.kvd-stamp ]]; then
  echo "SKIP: no finished vLLM venv at $py (deploy/setup-vllm.sh installs it; it needs PyPI)"
  exit 77
fi
if [[ ! -f $model/config.json ]]; then
  echo "SKIP: no HF model folder at $model (deploy/setup-vllm.sh converts the demo model)"
  exit 77
fi
export KVD_VLLM_MODEL=$model
cd "$(dirname "$0")"
exec "$py" -m pytest -q -p no:cacheprovider -rA --durations=0 "$file" "$@"
