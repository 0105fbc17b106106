#!/usr/bin/env bash
# Packs what a GPU machine without a package registry lacks to build remat against its own
# PyTorch (CLI11, toml++, nlohmann-json, fmt's headers, GoogleTest, SentencePiece, Gloo's
# headers, and the libraries they link) and the text of the default corpus from this
# machine's Debian packages into .cache/gpu-deps/, a prefix to carry there (about 12 MB).
# Run scripts/setup.sh first. scripts/gpu-check.sh uses it.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.cache/gpu-deps
rm -rf "$out"
mkdir -p "$out"
for p in libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libfmt-dev libgtest-dev libgloo-dev \
  libsentencepiece-dev libsentencepiece0 libtomlplusplus3 libfmt9; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    { echo "gpu_deps: $p is not installed; run scripts/setup.sh first" >&2; exit 1; }
  # Regular files and symbolic links, paths kept (usr/include/..., usr/lib/<arch>/...).
  dpkg -L "$p" | while read -r f; do
    if [ -f "$f" ] || [ -L "$f" ]; then
      case "$f" in /usr/share/doc/* | /usr/share/man/*) continue ;; esac
      mkdir -p "$out$(dirname "$f")"
      cp -a "$f" "$out$f"
    fi
  done
done
# What Debian's `bible` prints, which the default corpus is checked against (gpu-check.sh
# puts it on a machine that lacks the program).
bible -l 100000 gen1:1-rev22:21 > "$out/bible-kjv.out"
du -sh "$out"
