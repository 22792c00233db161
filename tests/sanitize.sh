#!/usr/bin/env bash
# The sanitizer build: kvlens and every test suite built with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer (-DKVLENS_NATIVE=OFF), the whole suite run under it, then each
# libFuzzer harness of tests/fuzz for a bounded time on its committed seed corpus. Any crash,
# sanitizer report or failed test fails the script. Installs clang's runtimes when missing.
#   tests/sanitize.sh                      build, test, fuzz 60 s per harness
#   KVLENS_FUZZ_SECONDS=10 tests/sanitize.sh
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${KVLENS_FUZZ_SECONDS:-60}

pkgs=(clang libclang-rt-14-dev libomp-14-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B build-asan -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVLENS_NATIVE=OFF -DKVLENS_FUZZ=ON -DKVLENS_GUI=OFF \
  -DKVLENS_CUDA=OFF "${launcher[@]}" >/dev/null
cmake --build build-asan -j"$(nproc 2>/dev/null || echo 2)"

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp  # leaks inside system libraries
echo "== the test suite under ASan + UBSan"
ctest --test-dir build-asan --output-on-failure -j2

echo "== fuzzing, ${secs} s per harness"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
summary=()
for src in tests/fuzz/fuzz_*.cpp; do
  name=$(basename "$src" .cpp)
  mkdir -p "$work/$name"
  # New inputs go to a scratch folder; the committed seeds are read only.
  log="$work/$name.log"
  if ! build-asan/"$name" -max_total_time="$secs" -rss_limit_mb=2048 -max_len=65536 -timeout=20 \
       -print_final_stats=1 -artifact_prefix="$work/$name-" "$work/$name" "tests/fuzz/corpus/$name" >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz: $name failed; the input that broke it is in the log above (artifact $work/$name-*)"
    exit 1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | grep -o '[0-9]*' || echo "?")
  summary+=("$(printf '%-20s %6s s %10s runs  %6s edges' "$name" "$secs" "$runs" "$cov")")
done
echo "== fuzzing summary"
printf '%s\n' "${summary[@]}"
