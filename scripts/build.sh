#!/usr/bin/env bash
# Configures and builds remat into build/ (-O2, all cores).
# `--target NAME` (repeatable) builds only those targets; `--dir DIR` builds into DIR
# instead (the LibTorch 2.x lane's build-libtorch2); other arguments go to CMake's
# configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build
configure=()
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --target) targets+=(--target "$2"); shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    *) configure+=("$1"); shift ;;
  esac
done
# -O2 without debug information: a sixth less compile time and a far shorter link than
# RelWithDebInfo, the same code (-DCMAKE_BUILD_TYPE=RelWithDebInfo, given, brings it back).
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" "${configure[@]}" >/dev/null
cmake --build "$dir" -j "$(nproc)" "${targets[@]}"
