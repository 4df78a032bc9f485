#!/usr/bin/env bash
# The kernels compiled with -march=native reach programs as one object, kvd_kernels_native.o
# (kernels/localize_weak.sh), that defines the kernels' functions and no weak function, so no
# native copy of an inline function or template is the one a program keeps for the code outside
# the kernels. Then, in PROGRAM (a shared library or executable linking the kernels): the
# functions the kernels have their own local copy of (kvd::Status's factories, ...) also have a
# global copy for everyone else, and no such global copy holds VEX/EVEX instructions (AVX and
# later: compiled for the baseline instruction set, as the code calling it).
#   native_functions_are_local.sh NM OBJDUMP LIBRARY PROGRAM
set -euo pipefail
NM=$1
OBJDUMP=$2
LIB=$3
PROGRAM=$4
syms=$("$NM" -A --defined-only "$LIB" 2>/dev/null | grep 'kvd_kernels_native\.o:' || true)
[[ -n $syms ]] || { echo "$LIB has no kvd_kernels_native.o member"; exit 1; }
global=$(awk '$2 == "T"' <<< "$syms" | wc -l)
weak=$(awk '$2 == "W" {print $3}' <<< "$syms")
((global > 0)) || { echo "kvd_kernels_native.o defines no global function"; exit 1; }
if [[ -n $weak ]]; then
  echo "weak functions in the native kernels (the linker keeps one copy per program, maybe this one):"
  c++filt <<< "$weak" | sed 's/^/  /'
  exit 1
fi
echo "kvd_kernels_native.o: $global global functions, no weak one"

# Names defined both locally (t: the kernels' copy) and globally (T/W) in PROGRAM.
table=$("$NM" -S --defined-only "$PROGRAM")
both=$(comm -12 <(awk '$3 == "t" {print $4}' <<< "$table" | sort -u) \
  <(awk '$3 == "T" || $3 == "W" {print $4}' <<< "$table" | sort -u))
[[ -n $both ]] || { echo "$PROGRAM: no function with a kernels' local copy (nothing checked)"; exit 1; }
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
  echo "$PROGRAM: global copies of functions the kernels also define hold native instructions:"
  echo -n "$leaked"
  exit 1
fi
echo "$PROGRAM: $count global copies of the kernels' shared functions, none with native instructions"
