#!/usr/bin/env bash
# Usage: scripts/gtest_shards.sh BUILD_DIR [ctest selection: -L unit, -LE tokenizer, ...]
# Runs the tests ctest selects in BUILD_DIR inside BUILD_DIR/remat_tests itself, one
# GoogleTest shard per core side by side: a process per shard rather than per test, since a
# process's start (loading LibTorch) costs about what a unit test does. Each shard's log is
# BUILD_DIR/shard-N.log, printed at the end; a shard still running after
# REMAT_SHARD_SECONDS (default 1800) is stopped and fails, as ctest's timeout fails a test.
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
shift
filter=$(bash scripts/gtest_names.sh "$build" "$@" | paste -sd:)
shards=$(nproc)
pids=()
for ((i = 0; i < shards; i++)); do
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "${REMAT_SHARD_SECONDS:-1800}" "$build/remat_tests" \
    --gtest_brief=1 --gtest_filter="$filter" >"$build/shard-$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for ((i = 0; i < shards; i++)); do
  status=0
  wait "${pids[$i]}" || status=$?
  cat "$build/shard-$i.log"
  if [ "$status" -ne 0 ]; then
    echo "gtest_shards: shard $i of $shards failed (exit $status$([ "$status" -eq 124 ] && echo ', out of time')); its log is $build/shard-$i.log" >&2
    failed=1
  fi
done
exit "$failed"
