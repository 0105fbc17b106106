#!/usr/bin/env bash
# Fresh machine to a tested build: install, build, run every test, then repeat the op,
# checkpoint and store suites to catch flaky tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Under CI (CI=true) a compiler warning fails the build.
bash scripts/build.sh -DREMAT_WERROR="${CI:+ON}"
# The unit tests in one process per core (a process per test would double their time), the
# others through ctest, a process each.
(cd build && ctest --output-on-failure -j "$(nproc)" -LE unit "$@")
bash scripts/gtest_shards.sh build -L unit
bash scripts/repeat_tests.sh
