#!/usr/bin/env bash
# Installs kvd's build dependencies (Debian 12 packages only) and builds into build/.
# Idempotent: apt-get update runs once, and only when a package is missing.
#   KVD_BUILD_DIR   build folder (default: build)
#   KVD_BUILD_TYPE  CMake build type (default: RelWithDebInfo)
#   KVD_JOBS        parallel build jobs (default: nproc)
#   KVD_CMAKE_ARGS  extra CMake arguments (e.g. -DKVD_WITH_CUDA=OFF)
#   KVD_UCX         system (default: Debian's UCX 1.13, host memory only) or wheel (UCX 1.22 with
#                   CUDA transports from the libucx-cu13/cu12 wheel, installed under .cache/ucx/)
#   KVD_UCX_WHEEL   auto (default: fetch the wheel when CUDA is present, so test.sh can exercise a
#                   second build against it), 1 (always), 0 (never; KVD_UCX=wheel then needs it)
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(build-essential cmake ninja-build pkg-config ccache git
  libucx-dev ucx-utils librocksdb-dev capnproto libcapnp-dev libboost-dev libyaml-cpp-dev
  nlohmann-json3-dev libzstd-dev liblz4-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev unzip python3
  python3-dev pybind11-dev python3-numpy python3-pytest python3-yaml libcli11-dev
  # etcd 3.4: the store of cluster membership (kvd talks to its HTTP gateway); the cluster tests
  # start a private etcd-server on loopback, and operators inspect it with etcdctl.
  etcd-server etcd-client
  # KV events in vLLM's KVEvents wire format (daemon kv_events:): ZeroMQ PUB/ROUTER sockets and
  # msgpack encoding (header-only msgpack-cxx).
  libzmq3-dev libmsgpack-cxx-dev)

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

# The CUDA-capable UCX, in a project-local prefix (deploy/fetch-ucx-wheel.sh). Not fatal unless
# this build asks for it: a machine without PyPI access still builds against Debian's UCX.
UCX_ARGS=()
want_wheel=${KVD_UCX_WHEEL:-auto}
if [[ $want_wheel == auto ]]; then
  want_wheel=0
  if [[ -x /usr/local/cuda/bin/nvcc ]] || command -v nvcc > /dev/null; then want_wheel=1; fi
fi
[[ ${KVD_UCX:-system} == wheel ]] && want_wheel=1
if [[ $want_wheel == 1 ]]; then
  if ucx_prefix=$(./deploy/fetch-ucx-wheel.sh); then
    [[ ${KVD_UCX:-system} == wheel ]] && UCX_ARGS=(-DKVD_UCX=wheel "-DKVD_UCX_PREFIX=$ucx_prefix")
  elif [[ ${KVD_UCX:-system} == wheel ]]; then
    echo "[setup] KVD_UCX=wheel but the UCX wheel could not be installed (see above)" >&2
    exit 1
  else
    echo "[setup] the CUDA-capable UCX wheel is not available; building against Debian's UCX"
  fi
fi
[[ ${KVD_UCX:-system} == system ]] && UCX_ARGS=(-DKVD_UCX=system)

BUILD_DIR=${KVD_BUILD_DIR:-build}
JOBS=${KVD_JOBS:-$(nproc)}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/kvd-ccache}
# Relative paths in the cache key: a fresh clone in another folder reuses the cache.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${KVD_BUILD_TYPE:-RelWithDebInfo}" \
  "${UCX_ARGS[@]}" ${KVD_CMAKE_ARGS:-}
# KVD_BUILD_TARGETS: build only these targets (e.g. the second UCX build of test.sh).
# shellcheck disable=SC2086
cmake --build "$BUILD_DIR" -j "$JOBS" ${KVD_BUILD_TARGETS:+--target $KVD_BUILD_TARGETS}
echo "[setup] binaries in $BUILD_DIR/bin"
