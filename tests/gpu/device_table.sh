# Parsing helpers of run_device_checks.sh (sourced; tests/gpu/device_table_test.sh checks them on
# fake logs). Every check appends rows "check<TAB>case<TAB>RESULT<TAB>detail" to $TABLE.
#   RESULT: PASS, FAIL, SKIP (the test said why), MISSING (not built / not written: reported, not
#   counted as a failure), ERROR (the binary crashed or timed out: a failure).

# gtest_rows CHECK LOG RC: one row per test case of a gtest log; an ERROR row when the binary
# exited non-zero without a failing case (crash, timeout) or ran no case at all.
gtest_rows() {
  local check=$1 log=$2 rc=$3
  local rows
  rows=$(awk -v check="$check" '
    /^\[ +OK +\] [A-Za-z0-9_\/]+\.[A-Za-z0-9_\/]+/ { name = $4; res[name] = "PASS"; order[++n] = name; next }
    /^\[ +FAILED +\] [A-Za-z0-9_\/]+\.[A-Za-z0-9_\/]+(,| \()/ {  # "Name, where GetParam() = ..."
      name = $4; sub(/,$/, "", name); res[name] = "FAIL"; order[++n] = name; next }
    /^\[ +SKIPPED +\] [A-Za-z0-9_\/]+\.[A-Za-z0-9_\/]+ \(/ {
      name = $4; res[name] = "SKIP"; order[++n] = name; detail[name] = last_skip; next }
    /Skipped$/ { getline; last_skip = $0; next }
    END {
      for (i = 1; i <= n; i++) {
        name = order[i]
        if (seen[name]++) continue
        printf "%s\t%s\t%s\t%s\n", check, name, res[name], detail[name]
      }
    }' "$log")
  if [[ -n $rows ]]; then printf '%s\n' "$rows" >> "$TABLE"; fi
  if [[ $rc -ne 0 ]] && ! grep -q $'\tFAIL\t' <<< "$rows"; then
    printf '%s\t%s\tERROR\texit status %s (crash or timeout): see %s\n' "$check" "(binary)" "$rc" "$log" >> "$TABLE"
  elif [[ -z $rows ]]; then
    printf '%s\t%s\tERROR\tno test case ran: see %s\n' "$check" "(binary)" "$log" >> "$TABLE"
  fi
}

# missing_row CHECK WHAT WHY
missing_row() { printf '%s\t%s\tMISSING\t%s\n' "$1" "$2" "$3" >> "$TABLE"; }

# print_table: the table, then "passed N, failed N, skipped N, missing N". Returns 1 when a row
# FAILed or ERRORed, or when nothing PASSed at all (a device run that proved nothing).
print_table() {
  awk -F'\t' '
    { printf "%-22s %-58s %-8s %s\n", $1, $2, $3, $4; c[$3]++ }
    END {
      printf "\npassed %d, failed %d, errors %d, skipped %d, missing %d\n",
             c["PASS"], c["FAIL"], c["ERROR"], c["SKIP"], c["MISSING"]
      exit (c["FAIL"] + c["ERROR"] > 0 || c["PASS"] == 0) ? 1 : 0
    }' "$TABLE"
}
