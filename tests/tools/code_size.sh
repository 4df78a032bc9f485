#!/usr/bin/env bash
# The longest functions and the largest files under the folders given (default: the whole tree's
# C++ sources), for reviews of a reshaping: "is anything still too long?".
#
#   tests/tools/code_size.sh [-n N] [folder...]
#
# Functions: universal-ctags (line .. end), lines from the signature to the closing brace,
# lambdas counted within their function. Files: wc -l over *.h *.cc *.cu.
set -eu  # no pipefail: `sort | head` ends sort with SIGPIPE, which is not an error here
n=15
if [[ "${1:-}" == "-n" ]]; then n=$2; shift 2; fi
folders=("$@")
[[ ${#folders[@]} -eq 0 ]] && folders=(common daemon client storage transport kernels proto llama)
command -v ctags >/dev/null || { echo "code_size.sh: needs universal-ctags" >&2; exit 2; }
mapfile -t files < <(find "${folders[@]}" -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' \) | sort)
[[ ${#files[@]} -eq 0 ]] && { echo "code_size.sh: no sources under ${folders[*]}" >&2; exit 2; }
echo "== $n longest functions (lines) =="
ctags --languages=C++ --map-C++=+.cu --c++-kinds=f --fields=+neK -o - "${files[@]}" 2>/dev/null |
  awk -F'\t' '{
      line = 0; end = 0; scope = "";
      for (i = 4; i <= NF; i++) {
        if ($i ~ /^line:/) line = substr($i, 6);
        else if ($i ~ /^end:/) end = substr($i, 5);
        else if ($i ~ /^(class|struct|namespace):/) { scope = $i; sub(/^[a-z]+:/, "", scope) }
      }
      if (end > 0) {
        name = $1; s = scope; sub(/.*::/, "", s); if (s != "" && s !~ /^__anon/) name = s "::" $1
        printf "%5d  %s  %s:%d\n", end - line + 1, name, $2, line
      }
    }' | sort -rn | head -n "$n"
echo "== $n largest files (lines) =="
wc -l "${files[@]}" | grep -v ' total$' | sort -rn | head -n "$n"
