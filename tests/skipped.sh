#!/usr/bin/env bash
# Lists the tests the last ctest run skipped, each with the reason its GTEST_SKIP gave, and
# their count; exits 1 when a skip gave no reason. Usage: tests/skipped.sh [build dir]
set -euo pipefail
log="${1:-build}/Testing/Temporary/LastTest.log"
[ -f "$log" ] || { echo "skipped.sh: no ctest log at $log" >&2; exit 1; }
awk '
  /^\[ RUN      \] / { name = $4; reason = ""; in_skip = 0; next }
  / Skipped$/ && name != "" { in_skip = 1; next }
  /^\[  SKIPPED \] .*\(/ {
    n++
    if (reason == "") { missing++; reason = "(no reason given)" }
    lines[n] = "  " name ": " reason
    in_skip = 0; name = ""; next
  }
  in_skip { reason = reason (reason == "" ? "" : " ") $0 }
  END {
    printf "%d test(s) skipped%s\n", n, n ? ":" : ""
    for (i = 1; i <= n; i++) print lines[i]
    if (missing) { printf "%d skip(s) without a reason\n", missing; exit 1 }
  }' "$log"
