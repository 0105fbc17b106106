#!/usr/bin/env bash
# Installs every Debian package remat needs to build, test and train. Idempotent:
# packages already present are skipped, and apt is not touched when nothing is missing.
set -euo pipefail

packages=(
  build-essential cmake ccache pkg-config
  libtorch-dev libgloo-dev libopenblas0-pthread libopenblas0-openmp
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libfmt-dev libspdlog-dev
  libsentencepiece-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev
  bible-kjv bible-kjv-text
  gnuplot-nox
  python3-torch
)

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
