#!/usr/bin/env bash
# Links object files into one relocatable object whose weak functions are local.
#   localize_weak.sh LD NM OBJCOPY OUTPUT OBJECT...
# For code compiled for another instruction set than the rest of the program (kernels/ with
# -march=native): every inline function and template it instantiates (kvd::Status's factories,
# std::vector<float>'s members, ...) is also emitted by the other libraries, each copy a weak
# symbol in a COMDAT group, and the linker keeps one copy per program. Which one depends on link
# order, so the native copy could run in code outside the kernels, and a baseline one in the
# kernels. Made local here, each side keeps and calls its own copy. Only functions (nm type W)
# are made local: weak data (vtables, typeinfo, static locals of inline functions) stays shared,
# so there is still one of each object; its unique symbols (nm type u), which outside a COMDAT
# group would clash with the other copies, become weak ones.
set -euo pipefail
LD=$1 NM=$2 OBJCOPY=$3 OUT=$4
shift 4
# --force-group-allocation: COMDAT groups are merged as in a final link (one copy of each among
# these objects) and dissolved, so the final link cannot swap the copies kept here for others.
"$LD" -r --force-group-allocation -o "$OUT.linked" "$@"
"$NM" --defined-only "$OUT.linked" | awk '$2 == "W" {print $3}' > "$OUT.functions"
"$NM" --defined-only "$OUT.linked" | awk '$2 == "u" {print $3}' > "$OUT.unique"
"$OBJCOPY" --localize-symbols="$OUT.functions" --weaken-symbols="$OUT.unique" "$OUT.linked" "$OUT"
rm -f "$OUT.linked" "$OUT.functions" "$OUT.unique"
