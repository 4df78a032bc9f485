#!/usr/bin/env bash
# Installs kvd's build dependencies (Debian 12 packages only) and builds into build/.
# Idempotent: apt-get update runs once, and only when a package is missing.
#   KVD_BUILD_DIR   build folder (default: build)
#   KVD_BUILD_TYPE  CMake build type (default: RelWithDebInfo)
#   KVD_JOBS        parallel build jobs (default: nproc)
#   KVD_CMAKE_ARGS  extra CMake arguments (e.g. -DKVD_WITH_CUDA=OFF)
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(build-essential cmake ninja-build pkg-config ccache git
  libucx-dev ucx-utils librocksdb-dev capnproto libcapnp-dev libboost-dev libyaml-cpp-dev
  nlohmann-json3-dev libzstd-dev liblz4-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev unzip python3
  python3-dev pybind11-dev python3-numpy python3-pytest python3-yaml)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] installing: ${missing[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "[setup] all ${#PACKAGES[@]} packages present"
fi

BUILD_DIR=${KVD_BUILD_DIR:-build}
JOBS=${KVD_JOBS:-$(nproc)}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/kvd-ccache}
# Relative paths in the cache key: a fresh clone in another folder reuses the cache.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${KVD_BUILD_TYPE:-RelWithDebInfo}" \
  ${KVD_CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "[setup] binaries in $BUILD_DIR/bin"
