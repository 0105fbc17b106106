#!/usr/bin/env bash
# Flake hunt over the unit tests (cmake/test_labels.cmake) of tests/ops, tests/checkpoint
# and tests/store, on an existing build/:
# 1. every test alone, in a process of its own, REMAT_REPEAT_ALONE times (default 60): a
#    test failing one run in 20 passes 60 runs in a row with probability 0.95^60 = 4.6%,
#    and alone no other test's draws or reseeds can mask it;
# 2. all of them together, shuffled into a new order on each of REMAT_REPEAT_SHUFFLED
#    repeats (default 10), for tests that pass alone but depend on what ran before.
# Extra arguments go to every remat_tests call.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=build/remat_tests
tests=$(bash scripts/gtest_names.sh build -L '^(ops|checkpoint|store)$' -L '^unit$')
alone=${REMAT_REPEAT_ALONE:-60}
shuffled=${REMAT_REPEAT_SHUFFLED:-10}

count=$(wc -l <<<"$tests")
echo "repeating $count tests alone, $alone times each"
# A failing test's name on stdout, its log on stderr.
failed=$(xargs -P "$(nproc)" -I{} sh -c '
  bin=$0 repeat=$1 test=$2; shift 2
  log=$("$bin" --gtest_filter="$test" --gtest_repeat="$repeat" --gtest_brief=1 "$@" 2>&1) ||
    { printf "%s\n" "$log" >&2; echo "$test"; }' "$bin" "$alone" {} "$@" <<<"$tests")
if [ -n "$failed" ]; then
  echo "failed when repeated alone:" >&2
  echo "$failed" >&2
  exit 1
fi
echo "repeating them together shuffled, $shuffled orders"
"$bin" --gtest_filter="$(paste -sd: <<<"$tests")" --gtest_shuffle --gtest_repeat="$shuffled" --gtest_brief=1 "$@"
