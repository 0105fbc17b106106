#!/usr/bin/env bash
# Usage: scripts/gtest_names.sh BUILD_DIR [ctest selection: -L unit, -LE tokenizer, -R ...]
# The GoogleTest names (Suite.Test, Prefix/Suite.Test/0) of the tests ctest selects in
# BUILD_DIR, one a line: for running a selection by label (cmake/test_labels.cmake) in
# remat_tests itself, as scripts/sanitize.sh and scripts/repeat_tests.sh do.
set -euo pipefail
build=$1
shift
ctest --test-dir "$build" --show-only=json-v1 "$@" | python3 -c '
import json, sys
names = [arg.removeprefix("--gtest_filter=") for test in json.load(sys.stdin)["tests"]
         for arg in test["command"] if arg.startswith("--gtest_filter=")]
if not names:
    sys.exit(f"gtest_names: ctest selects no test of remat_tests in {sys.argv[1]} (is it built?)")
print("\n".join(names))' "$build"
