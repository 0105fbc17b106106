#!/usr/bin/env bash
# The libFuzzer harnesses in fuzz/, one per input parser, built with clang, AddressSanitizer
# and UndefinedBehaviorSanitizer (the tokenizer's without AddressSanitizer, whose runtime
# refuses how the SentencePiece library is loaded) in a build-fuzz/ tree of their own, then each run for
# FUZZ_SECONDS (30 by default) from its seed corpus in fuzz/corpus/<harness>/. FUZZ_ONLY
# names the harnesses to run (all by default). Any crash, sanitizer report, hang (10 s on
# one input), 2 GiB of memory or finding fails the script; libFuzzer saves the input that
# caused it under build-fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${FUZZ_SECONDS:-30}"
read -r -a harnesses <<<"${FUZZ_ONLY:-config policy budget safetensors prepare corpus_meta tokenizer}"
# -O1 and line tables only, and NDEBUG as LibTorch was built, as scripts/sanitize.sh does.
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DREMAT_FUZZ=ON -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g1 -DNDEBUG" >/dev/null
cmake --build build-fuzz -j "$(nproc)"
# LibTorch is not instrumented: its own containers would read as overflows and its
# process-lifetime registries as leaks.
export ASAN_OPTIONS=detect_container_overflow=0:detect_leaks=0
export UBSAN_OPTIONS=print_stacktrace=1
mkdir -p build-fuzz/artifacts build-fuzz/logs
# One harness per core at a time: each is one process on one core, so they run side by
# side for the same seconds each.
fuzz_one() {
  local h=$1
  # New inputs go to the first corpus directory, a scratch one: the seeds in the repository
  # stay as written.
  rm -rf "build-fuzz/corpus/$h"
  mkdir -p "build-fuzz/corpus/$h"
  local dict=()
  [ -f "fuzz/$h.dict" ] && dict=("-dict=fuzz/$h.dict")
  "build-fuzz/fuzz_$h" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="build-fuzz/artifacts/$h-" "${dict[@]}" "build-fuzz/corpus/$h" "fuzz/corpus/$h" \
    >"build-fuzz/logs/$h.log" 2>&1
}
jobs=$(nproc)
for ((first = 0; first < ${#harnesses[@]}; first += jobs)); do
  batch=("${harnesses[@]:first:jobs}")
  pids=()
  for h in "${batch[@]}"; do
    fuzz_one "$h" &
    pids+=($!)
  done
  for i in "${!batch[@]}"; do
    h=${batch[$i]}
    log="build-fuzz/logs/$h.log"
    if ! wait "${pids[$i]}"; then
      tail -n 60 "$log" >&2
      echo "fuzz: $h failed; the input is saved under build-fuzz/artifacts/, the whole log is $log" >&2
      exit 1
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log")
    echo "fuzz: $h: ${runs} inputs in ${seconds} s, 0 crashes (peak RSS ${rss} MB)"
  done
done
