#!/usr/bin/env bash
# libkvd_client keeps the promises of its ABI version (kvd_client.h, KVD_CLIENT_ABI_VERSION):
# its SONAME carries that number, and every C function the version's list names
# (client/abi/kvd_client.so.<N>.symbols) is still exported. A function removed or renamed without
# raising the number fails here; functions added since the list was written are reported (a
# compatible change: add them to the list).
#   c_abi_symbols.sh LIBRARY HEADER ABI_DIR
set -euo pipefail
LIB=$1
HEADER=$2
ABI_DIR=$3
abi=$(sed -n 's/^#define KVD_CLIENT_ABI_VERSION \([0-9][0-9]*\)$/\1/p' "$HEADER")
[[ -n $abi ]] || { echo "$HEADER: no '#define KVD_CLIENT_ABI_VERSION <number>' line"; exit 1; }
soname=$(readelf -d "$LIB" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[[ $soname == "libkvd_client.so.$abi" ]] ||
  { echo "SONAME is '$soname', want libkvd_client.so.$abi (KVD_CLIENT_ABI_VERSION)"; exit 1; }
list=$ABI_DIR/kvd_client.so.$abi.symbols
exported=$(nm -D --defined-only "$LIB" | awk '$2 == "T" && $3 ~ /^kvd_/ {print $3}' | sort)
if [[ ! -f $list ]]; then
  echo "ABI version $abi has no symbol list: write $list with the C functions it exports:"
  echo "  nm -D --defined-only $LIB | awk '\$2 == \"T\" && \$3 ~ /^kvd_/ {print \$3}' | sort"
  exit 1
fi
missing=$(comm -23 <(sort "$list") <(echo "$exported"))
added=$(comm -13 <(sort "$list") <(echo "$exported"))
if [[ -n $added ]]; then
  echo "exported, not yet in $list (compatible additions; add them):"
  echo "$added" | sed 's/^/  /'
fi
if [[ -n $missing ]]; then
  echo "ABI version $abi promises these C functions, and the library no longer exports them:"
  echo "$missing" | sed 's/^/  /'
  echo "Removing or renaming one is an incompatible change: raise KVD_CLIENT_ABI_VERSION in"
  echo "$HEADER (its policy comment) and write the new version's list."
  exit 1
fi
echo "libkvd_client.so.$abi exports the $(wc -l < "$list") C functions of its ABI version"
