#!/usr/bin/env bash
# The CUDA lane: compiles and links remat against Debian trixie's libtorch-cuda-dev
# (LibTorch 2.6 built with CUDA 12.4, cuDNN and NCCL), and compiles the tests with CUDA
# paths, so that the CUDA configuration (REMAT_WITH_CUDA) is built on every CI run without
# a GPU; the other tests, which the other lanes build and run, are left out (a change to a
# widely included header costs a CI run less). Nothing is run:
# that needs a GPU (docs/install.md, "The CUDA configuration without a GPU"). The root is
# made by scripts/root.sh once per machine, as the LibTorch 2.x lane's; this tree is
# mounted at /src and built into build-cuda/. Needs root. Extra arguments go to CMake's
# configure step.
set -euo pipefail
cd "$(dirname "$0")/.."

# The packages scripts/setup.sh lists under trixie's CUDA names: libtorch-cuda-dev and the
# Gloo built for it in place of the CPU ones (they conflict), NVIDIA's toolkit and NCCL
# from non-free and contrib, libabsl-dev for SentencePiece 0.2's headers (as in sid). What
# only running needs (the corpus, gnuplot, PyTorch for the comparisons) is left out.
packages=()
while read -r p; do
  case "$p" in
    libtorch-dev) packages+=(libtorch-cuda-dev) ;;
    libgloo-dev) packages+=(libgloo-cuda-dev) ;;
    python3-torch | bible-kjv | bible-kjv-text | gnuplot-nox | iproute2) ;;
    *) packages+=("$p") ;;
  esac
done < <(bash scripts/setup.sh --list)
packages+=(libabsl-dev nvidia-cuda-toolkit libnccl-dev)

# libtorch-cuda-2.6 depends on nvidia-cudnn, which is not cuDNN but an installer that
# downloads it from NVIDIA at install time, outside the Debian registry: here it fails. An
# empty package of that name (built with dpkg-deb, which the bare root has) stands in for
# it and is held, so apt never replaces it. cuDNN itself is needed only when a binary runs.
bash scripts/root.sh make cuda trixie main,contrib,non-free >/dev/null
bash scripts/root.sh run cuda -- sh -c 'set -e
  exec 8>/var/lib/remat-cudnn.lock
  flock 8
  dpkg-query -W -f="\${Status}" nvidia-cudnn 2>/dev/null | grep -q " ok installed$" && exit 0
  d=$(mktemp -d)
  mkdir "$d/DEBIAN"
  cat >"$d/DEBIAN/control" <<CONTROL
Package: nvidia-cudnn
Version: 9.0.0.312~cuda12+remat1
Architecture: all
Maintainer: remat <remat@localhost>
Provides: libcudnn.so, libcudnn.so.9, libcudnn-dev
Description: empty stand-in for the cuDNN installer (remat scripts/build_cuda.sh)
 Satisfies libtorch-cuda-2.6 without downloading cuDNN: compile and link only.
CONTROL
  dpkg-deb --build --root-owner-group "$d" "$d.deb" >/dev/null
  dpkg -i "$d.deb" >/dev/null
  apt-mark hold nvidia-cudnn >/dev/null
  rm -rf "$d" "$d.deb"
  echo "root: nvidia-cudnn stand-in installed" >&2'
bash scripts/root.sh make cuda trixie main,contrib,non-free "${packages[@]}" >/dev/null

# libtorch_cuda.so needs libcudnn.so.9, which the stand-in does not ship: executables are
# linked leaving undefined the symbols of shared libraries that are not there (cuDNN's),
# and would load real cuDNN where they run. libcuda.so.1 is the driver's (libcuda1, a
# registry package), present. Nothing built here runs, so it is built unoptimised and
# without debug information: half the compile time of RelWithDebInfo, the same errors.
# ccache's files stay in the root, as in the sid lane.
bash scripts/root.sh run cuda --bind "$PWD:/src" -- \
  env CCACHE_BASEDIR=/src CCACHE_MAXSIZE=5G \
  CCACHE_SLOPPINESS=include_file_ctime,include_file_mtime,pch_defines,time_macros \
  bash -c 'set -e
    cd /src
    # The CMake files of LibTorch 2.6 warn on every configure (no kineto library, a Python
    # call for an NVRTC hash that never runs): the log is shown only when configuring fails.
    mkdir -p build-cuda
    cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS=-O0 \
      -DCMAKE_EXE_LINKER_FLAGS=-Wl,--unresolved-symbols=ignore-in-shared-libs "$@" >build-cuda/configure.log 2>&1 ||
      { cat build-cuda/configure.log; exit 1; }
    grep "^-- remat:" build-cuda/configure.log
    grep -q "CUDA support: ON" build-cuda/configure.log ||
      { echo "build_cuda: LibTorch was found without CUDA" >&2; exit 1; }
    grep -q "NCCL: ON" build-cuda/configure.log ||
      { echo "build_cuda: NCCL (nccl.h or c10d'"'"'s ProcessGroupNCCL.hpp) was not found" >&2; exit 1; }
    cmake --build build-cuda -j "$(nproc)" --target remat
    # The tests run in the other lanes; here only those with CUDA paths are compiled.
    mapfile -t objects < <(grep -rl REMAT_WITH_CUDA tests | sed "s/\$/.o/")
    cmake --build build-cuda -j "$(nproc)" --target "${objects[@]}"' bash "$@"
