#!/usr/bin/env bash
# Configures and builds remat into build/ (Release with debug info, all cores).
# `--target NAME` (repeatable) builds only those targets; other arguments go to CMake's
# configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
configure=()
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --target) targets+=(--target "$2"); shift 2 ;;
    *) configure+=("$1"); shift ;;
  esac
done
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo "${configure[@]}" >/dev/null
cmake --build build -j "$(nproc)" "${targets[@]}"
