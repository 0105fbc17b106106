#!/usr/bin/env bash
# The LibTorch 2.x lane: builds remat and runs its unit, slow and brute-force tests
# against Debian sid's libtorch-dev (a current LibTorch and GCC), in a root that
# scripts/root.sh makes once per machine, with this tree mounted at /src and built into
# build-libtorch2/, after checking that Hugging Face's `tokenizers` still gives the
# goldens the tokenizer tests hold remat to (tests/data/hf_tokenizers/), and that
# `transformers` gives the logits the model tests hold remat to and loads remat's export of
# them with remat's logits (tests/data/hf_models/). Needs root. Left
# to the main lane (scripts/test.sh): the process tests, which drive the same library
# through the CLI and `remat launch` (the ranks' collectives run here in the dist tests,
# as threads). Extra arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."

# sid's names for what scripts/setup.sh installs here; its libsentencepiece-dev includes
# absl headers without depending on libabsl-dev.
mapfile -t packages < <(bash scripts/setup.sh --list)
packages+=(libabsl-dev python3-tokenizers python3-transformers)
bash scripts/root.sh make sid sid main "${packages[@]}" >/dev/null

# ccache's files stay in the root (/root/.cache/ccache), its compiler being the root's;
# the sloppiness lets it cache the precompiled header's users, as on this machine.
bash scripts/root.sh run sid --bind "$PWD:/src" -- \
  env CCACHE_BASEDIR=/src CCACHE_MAXSIZE=5G \
  CCACHE_SLOPPINESS=include_file_ctime,include_file_mtime,pch_defines,time_macros \
  bash -c 'set -e
    cd /src
    python3 tests/data/hf_tokenizers/make_goldens.py check
    python3 tests/data/hf_models/make_fixtures.py check
    bash scripts/build.sh --dir build-libtorch2
    (cd build-libtorch2 && ctest --output-on-failure -j "$(nproc)" -L "^(slow|brute_force)$" "$@")
    rm -rf build-libtorch2/hf_export
    REMAT_HF_EXPORT=/src/build-libtorch2/hf_export bash scripts/gtest_shards.sh build-libtorch2 -L unit
    python3 tests/data/hf_models/make_fixtures.py check build-libtorch2/hf_export' bash "$@"
