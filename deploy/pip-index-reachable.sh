#!/usr/bin/env bash
# Checks that the Python package index pip would use serves PACKAGE, before a venv is built
# (without one pip retries for minutes before failing).
#
#   deploy/pip-index-reachable.sh PACKAGE
#
# Prints the index URL on stdout; exit status 0 when PACKAGE's index page answers within 15 s,
# 1 otherwise. The index: $PIP_INDEX_URL, else pip's global.index-url, else PyPI.
set -euo pipefail
index=${PIP_INDEX_URL:-$(python3 -m pip config get global.index-url 2> /dev/null || true)}
index=${index:-https://pypi.org/simple/}
echo "$index"
KVD_INDEX=$index KVD_PACKAGE=$1 python3 - <<'PY' 2> /dev/null
import os, sys, urllib.request
try:
    url = os.environ["KVD_INDEX"].rstrip("/") + "/" + os.environ["KVD_PACKAGE"] + "/"
    urllib.request.urlopen(url, timeout=15).read(1)
except Exception as e:
    sys.exit(str(e))
PY
