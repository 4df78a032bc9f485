#!/usr/bin/env bash
# Installs the build into a temporary prefix, builds an out-of-tree C++ and C program against
# it twice (CMake's find_package(kvd CONFIG) and pkg-config), and runs all four against a real
# kvd started from the installed prefix.
#   install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD_DIR=$1
SRC_DIR=$2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvd-install-test.XXXXXX")
KVD_PID=""
cleanup() {
  if [[ -n $KVD_PID ]]; then
    kill "$KVD_PID" 2>/dev/null || true
    wait "$KVD_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
PREFIX=$WORK/prefix

# The SONAME's number: kvd_client.h's KVD_CLIENT_ABI_VERSION.
ABI=$(sed -n 's/^#define KVD_CLIENT_ABI_VERSION \([0-9][0-9]*\)$/\1/p' \
  "$SRC_DIR/client/include/kvd/client/kvd_client.h")
[[ -n $ABI ]] || { echo "kvd_client.h has no KVD_CLIENT_ABI_VERSION"; exit 1; }

echo "[install] cmake --install into $PREFIX"
cmake --install "$BUILD_DIR" --prefix "$PREFIX" > "$WORK/install.log"
for f in bin/kvd bin/kvdctl bin/kvd-bench lib/libkvd_client.so "lib/libkvd_client.so.$ABI" \
  include/kvd/client/client.h include/kvd/client/kvd_client.h include/kvd/common/status.h \
  include/kvd/transport/options.h lib/cmake/kvd/kvdConfig.cmake lib/pkgconfig/kvd_client.pc; do
  [[ -e $PREFIX/$f ]] || { echo "missing $f in the installed prefix"; exit 1; }
done
soname=$(readelf -d "$PREFIX/lib/libkvd_client.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[[ $soname == "libkvd_client.so.$ABI" ]] ||
  { echo "SONAME is '$soname', want libkvd_client.so.$ABI"; exit 1; }
# libkvd_client links neither the CUDA runtime nor NCCL; a CUDA build installs its kernels as the
# module it loads on first device use, whose libraries all resolve.
if readelf -d "$PREFIX/lib/libkvd_client.so" | grep -E 'NEEDED.*(cudart|nccl|libcuda)'; then
  echo "the installed libkvd_client links CUDA"; exit 1
fi
if [[ -e $BUILD_DIR/lib/kvd/libkvd_kernels_cuda.so ]]; then
  module=$PREFIX/lib/kvd/libkvd_kernels_cuda.so
  [[ -e $module ]] || { echo "missing lib/kvd/libkvd_kernels_cuda.so in the installed prefix"; exit 1; }
  if ldd "$module" | grep -q "not found"; then
    echo "the installed CUDA kernels module does not resolve:"; ldd "$module"; exit 1
  fi
fi
# The installed tools must run from the prefix (RPATH $ORIGIN/../lib), not from the build tree.
if ldd "$PREFIX/bin/kvdctl" | grep -q "$BUILD_DIR"; then
  echo "installed kvdctl still links the build tree:"; ldd "$PREFIX/bin/kvdctl"; exit 1
fi

echo "[install] consumer with find_package(kvd CONFIG)"
cmake -S "$SRC_DIR/tests/install/consumer" -B "$WORK/consumer-build" -DCMAKE_PREFIX_PATH="$PREFIX" \
  -DCMAKE_BUILD_TYPE=Release > "$WORK/consumer-configure.log" ||
  { cat "$WORK/consumer-configure.log"; exit 1; }
cmake --build "$WORK/consumer-build" > "$WORK/consumer-build.log" ||
  { cat "$WORK/consumer-build.log"; exit 1; }

echo "[install] consumer with pkg-config"
export PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig
PC_FLAGS=$(pkg-config --cflags --libs kvd_client)
[[ $(pkg-config --modversion kvd_client) =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]
mkdir -p "$WORK/pc"
# shellcheck disable=SC2086
${CC:-cc} -o "$WORK/pc/consumer_c" "$SRC_DIR/tests/install/consumer/consumer.c" $PC_FLAGS \
  -Wl,-rpath,"$PREFIX/lib"
# shellcheck disable=SC2086
${CXX:-c++} -std=c++20 -o "$WORK/pc/consumer_cpp" "$SRC_DIR/tests/install/consumer/consumer.cc" \
  $PC_FLAGS -Wl,-rpath,"$PREFIX/lib"

echo "[install] starting the installed kvd"
cat > "$WORK/topology.yaml" <<'YAML'
node: install-test
transport: {backend: ucx, ucx_tls: "sm,tcp", net_devices: lo}
models:
  - name: stories260k
    layout: {layers: 5, kv_heads: 4, q_heads: 8, head_dim: 8, dtype: float32,
             rope: {theta: 10000, pairing: interleaved, scaling: none}}
tiers:
  host: {capacity: 16MiB, prefault: false}
YAML
"$PREFIX/bin/kvd" --config "$WORK/topology.yaml" --listen 127.0.0.1:0 --unix none \
  --ready-file "$WORK/ready.json" > "$WORK/kvd.log" 2>&1 &
KVD_PID=$!
for _ in $(seq 100); do
  [[ -s $WORK/ready.json ]] && break
  kill -0 "$KVD_PID" 2>/dev/null || { echo "kvd exited:"; cat "$WORK/kvd.log"; exit 1; }
  sleep 0.1
done
ADDR=$(sed -n 's/.*"tcp":"\([^"]*\)".*/\1/p' "$WORK/ready.json")
[[ -n $ADDR ]] || { echo "kvd not ready:"; cat "$WORK/kvd.log"; exit 1; }

for exe in "$WORK/consumer-build/consumer_cpp" "$WORK/consumer-build/consumer_c" \
  "$WORK/pc/consumer_cpp" "$WORK/pc/consumer_c"; do
  "$exe" "$ADDR" || { echo "$exe failed; kvd log:"; tail -20 "$WORK/kvd.log"; exit 1; }
done
# The installed kvdctl sees the chunks the consumers stored (two distinct token sequences).
"$PREFIX/bin/kvdctl" --addr "$ADDR" --json ls > "$WORK/ls.json"
grep -q '"total": 2' "$WORK/ls.json" || { echo "kvdctl ls:"; cat "$WORK/ls.json"; exit 1; }
echo "[install] ok"
