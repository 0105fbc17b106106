#!/usr/bin/env bash
# Usage: scripts/gtest_names.sh BUILD_DIR [ctest selection: -L unit, -LE tokenizer, -R ...]
# The GoogleTest names (Suite.Test, Prefix/Suite.Test/0) of the tests ctest selects in
# BUILD_DIR, one a line: for the scripts that run remat_tests itself (sanitize.sh,
# repeat_tests.sh) on a selection by label (cmake/test_labels.cmake).
set -euo pipefail
build=$1
shift
ctest --test-dir "$build" --show-only=json-v1 "$@" | python3 -c '
import json, sys
for test in json.load(sys.stdin)["tests"]:
    print(next(a for a in test["command"] if a.startswith("--gtest_filter=")).removeprefix("--gtest_filter="))'
