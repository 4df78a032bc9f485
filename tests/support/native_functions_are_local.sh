#!/usr/bin/env bash
# A library whose code is compiled with -march=native (kvd_add_native_objects in
# cmake/native_code.cmake: the kernels, the Llama engine) reaches programs as one object,
# <name>_native.o, that defines its functions and no weak function, so no native copy of an
# inline function or template is the one a program keeps for the code outside it. Then, in
# PROGRAM (a shared library or executable linking it): the functions the library has its own local
# copy of (kvd::Status's factories, ...) also have a global copy for everyone else, and no such
# global copy holds VEX/EVEX instructions (AVX and later: compiled for the baseline instruction
# set, as the code calling it).
#   native_functions_are_local.sh NM OBJDUMP LIBRARY PROGRAM    (LIBRARY: .../lib<name>.a)
set -euo pipefail
NM=$1
OBJDUMP=$2
LIB=$3
PROGRAM=$4
member=$(basename "$LIB" .a)
member=${member#lib}_native.o
syms=$("$NM" -A --defined-only "$LIB" 2>/dev/null | grep -F "$member:" || true)
[[ -n $syms ]] || { echo "$LIB has no $member member"; exit 1; }
global=$(awk '$2 == "T"' <<< "$syms" | wc -l)
weak=$(awk '$2 == "W" {print $3}' <<< "$syms")
((global > 0)) || { echo "$member defines no global function"; exit 1; }
if [[ -n $weak ]]; then
  echo "weak functions in $member (the linker keeps one copy per program, maybe this one):"
  c++filt <<< "$weak" | sed 's/^/  /'
  exit 1
fi
echo "$member: $global global functions, no weak one"

# Names defined both locally (t: the library's copy) and globally (T/W) in PROGRAM.
table=$("$NM" -S --defined-only "$PROGRAM")
both=$(comm -12 <(awk '$3 == "t" {print $4}' <<< "$table" | sort -u) \
  <(awk '$3 == "T" || $3 == "W" {print $4}' <<< "$table" | sort -u))
[[ -n $both ]] || { echo "$PROGRAM: no function with a local copy of $member's (nothing checked)"; exit 1; }
count=0
leaked=""
while read -r addr size _ name; do
  start=$((16#$addr))
  stop=$((start + 16#$size))
  vex=$("$OBJDUMP" -d --no-show-raw-insn --start-address=$start --stop-address=$stop "$PROGRAM" |
    awk -F'\t' 'NF >= 2 {print $2}' | grep -cE '^v|%[yz]mm|^k' || true)
  count=$((count + 1))
  ((vex == 0)) || leaked+="  $(c++filt <<< "$name") ($vex VEX/EVEX instructions)"$'\n'
done < <(awk '$3 == "T" || $3 == "W"' <<< "$table" | grep -wFf <(echo "$both"))
if [[ -n $leaked ]]; then
  echo "$PROGRAM: global copies of functions $member also defines hold native instructions:"
  echo -n "$leaked"
  exit 1
fi
echo "$PROGRAM: $count global copies of functions $member also defines, none with native instructions"
