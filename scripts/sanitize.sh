#!/usr/bin/env bash
# The unit tests built with AddressSanitizer and UndefinedBehaviorSanitizer, in a
# build-sanitize/ tree of its own, run in one process per core (scripts/gtest_shards.sh).
# Left out: the tests labelled tokenizer
# (cmake/test_labels.cmake), which load the SentencePiece shim, in-process or in the remat
# runs they start: the shim is dlopen'ed with RTLD_DEEPBIND, which the sanitizer runtime
# refuses.
set -euo pipefail
cd "$(dirname "$0")/.."
# -O0 and line tables only: a build a third shorter than the sanitizers' usual -O1 (the
# build is most of this step; the unit tests run in a minute either way), with reports
# that still name file and line. NDEBUG as LibTorch was built: its headers' classes
# (RecordFunction) change layout without it.
cmake -S . -B build-sanitize -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O0 -g1 -DNDEBUG" -DREMAT_SANITIZE=ON \
  >/dev/null
# The line tables would put the clone's directory into ccache's hash: a clean clone
# elsewhere (CI's) could not use what the last one cached.
CCACHE_NOHASHDIR=1 cmake --build build-sanitize -j "$(nproc)" --target remat_tests
# LibTorch is not instrumented: its own containers would read as overflows and its
# process-lifetime registries as leaks.
export ASAN_OPTIONS=detect_container_overflow=0:detect_leaks=0
export UBSAN_OPTIONS=print_stacktrace=1
# The unit tests only: the slow and process ones drive the same code at larger shapes or
# through the CLI, several times longer under the sanitizers.
bash scripts/gtest_shards.sh build-sanitize -L unit -LE tokenizer
