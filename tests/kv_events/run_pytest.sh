#!/usr/bin/env bash
# Runs a test file of this folder with the vLLM venv's python (it decodes with vLLM's own
# classes):  run_pytest.sh VENV_PYTHON TEST_FILE [pytest args...]
# Exit 77 (ctest: skipped) when deploy/setup-vllm.sh did not install the venv.
set -euo pipefail
py=$1
file=$2
shift 2
venv=$(dirname "$(dirname "$py")")
if [[ ! -x $py ]] || ! compgen -G "$venv/lib/python3*/site-packages/vllm/distributed/kv_events.py" \
    >/dev/null; then
  echo "SKIP: no vLLM venv with vllm.distributed.kv_events at $py (deploy/setup-vllm.sh)"
  exit 77
fi
cd "$(dirname "$0")"
exec "$py" -m pytest -q -p no:cacheprovider -rA "$file" "$@"
