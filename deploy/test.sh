#!/usr/bin/env bash
# Installs what is needed, builds, and runs every test (ctest). GPU tests skip without a GPU.
#   KVD_TEST_ARGS  extra ctest arguments (e.g. "-L e2e" or "-LE quality")
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
BUILD_DIR=${KVD_BUILD_DIR:-build}
if [[ -x deploy/fetch-models.sh ]]; then ./deploy/fetch-models.sh || echo "[test] model fetch failed; model tests will skip"; fi
cd "$BUILD_DIR"
# shellcheck disable=SC2086
ctest --output-on-failure -j "${KVD_TEST_JOBS:-2}" ${KVD_TEST_ARGS:-}
