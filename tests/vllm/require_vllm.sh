# Sourced by the vllm ctest wrappers with $py (the venv's python) and $model (the HF folder):
# exits 77 (ctest: skipped) with the reason where deploy/setup-vllm.sh did not install the venv
# or convert the model (no PyPI, KVD_VLLM=0, ...).
if [[ ! -x $py || ! -f $(dirname "$py")/../.kvd-stamp ]]; then
  echo "SKIP: no finished vLLM venv at $py (deploy/setup-vllm.sh installs it; it needs PyPI)"
  exit 77
fi
if [[ ! -f $model/config.json ]]; then
  echo "SKIP: no HF model folder at $model (deploy/setup-vllm.sh converts the demo model)"
  exit 77
fi
