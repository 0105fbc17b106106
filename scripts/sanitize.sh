#!/usr/bin/env bash
# The test suite built with AddressSanitizer and UndefinedBehaviorSanitizer, in a
# build-sanitize/ tree of its own. Left out: the tests labelled tokenizer
# (cmake/test_labels.cmake), which load the SentencePiece shim, in-process or in the remat
# runs they start: the shim is dlopen'ed with RTLD_DEEPBIND, which the sanitizer runtime
# refuses.
set -euo pipefail
cd "$(dirname "$0")/.."
# -O1 and line tables only: the sanitizers' usual setting, and a faster build than
# -O2 with full debug information, for reports that still name file and line. NDEBUG as
# LibTorch was built: its headers' classes (RecordFunction) change layout without it.
cmake -S . -B build-sanitize -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g1 -DNDEBUG" -DREMAT_SANITIZE=ON \
  >/dev/null
cmake --build build-sanitize -j "$(nproc)" --target remat_tests
# LibTorch is not instrumented: its own containers would read as overflows and its
# process-lifetime registries as leaks.
export ASAN_OPTIONS=detect_container_overflow=0:detect_leaks=0
export UBSAN_OPTIONS=print_stacktrace=1
# One shard of the tests per core, run side by side (as ctest runs the main build's): the
# tests already run concurrently there, and one sanitized process used one core.
shards=$(nproc)
filter=$(bash scripts/gtest_names.sh build-sanitize -LE tokenizer | paste -sd:)
pids=()
for ((i = 0; i < shards; i++)); do
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i build-sanitize/remat_tests --gtest_brief=1 \
    --gtest_filter="$filter" \
    >"build-sanitize/shard-$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for ((i = 0; i < shards; i++)); do
  status=0
  wait "${pids[$i]}" || status=$?
  cat "build-sanitize/shard-$i.log"
  if [ "$status" -ne 0 ]; then
    echo "sanitize: shard $i of $shards failed (exit $status); its log is build-sanitize/shard-$i.log" >&2
    failed=1
  fi
done
exit "$failed"
