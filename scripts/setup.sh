#!/usr/bin/env bash
# Installs every Debian package remat needs to build, test and train. Idempotent:
# packages already present are skipped, and apt is not touched when nothing is missing.
set -euo pipefail

packages=(
  build-essential cmake ccache pkg-config
  libtorch-dev libgloo-dev libopenblas0-pthread libopenblas0-openmp
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libfmt-dev libspdlog-dev
  libsentencepiece-dev libpcre2-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  bible-kjv bible-kjv-text
  gnuplot-nox
  python3-torch
  iproute2
)
# `setup.sh --list` prints the packages above, which build and test remat on any suite
# (scripts/test_libtorch2.sh installs them in its sid root). Those below serve this
# machine's other lanes: clang for the sanitizer and fuzzing builds, clang-format for the
# layout check (its version decides the layout), universal-ctags for the function-size
# check, debootstrap for roots.
if [ "${1:-}" = --list ]; then
  printf '%s\n' "${packages[@]}"
  exit 0
fi
packages+=(clang clang-format libclang-rt-14-dev universal-ctags debootstrap)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
