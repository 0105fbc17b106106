#!/usr/bin/env bash
# The GPU check, one command on a lent GPU machine (no package registry, its own PyTorch):
# builds remat against that PyTorch with every core, records allocation traces, replays
# them through the caching allocator's model, measures predicted against measured
# allocated and reserved peaks for 15 plans of three models (remat bench), and runs the
# suite. Everything goes to $OUT (default gpu-check-out/); summary.txt is printed last.
#
# Prepare here, then carry both to the machine (they are git-ignored):
#   bash scripts/gpu_deps.sh        # .cache/gpu-deps: the C++ dependencies, about 8 MB
#   ./build/remat prepare           # data/: the tokenized corpus
# On the machine: bash scripts/gpu-check.sh (about 8 minutes on 16 cores and an H100).
# A rehearsal here, without the build and the 1B model: DEVICE=cpu BUILD=build bash scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${OUT:-gpu-check-out}")
device=${DEVICE:-cuda}
build=${BUILD:-}
mkdir -p "$out/traces"
deps=$PWD/.cache/gpu-deps
for need in "$deps" data; do
  [ -d "$need" ] || { echo "gpu-check: $need is missing; make it on the development machine and carry it" >&2; exit 1; }
done
export PKG_CONFIG_PATH=$deps/usr/lib/x86_64-linux-gnu/pkgconfig:$deps/usr/share/pkgconfig
export PKG_CONFIG_SYSROOT_DIR=$deps
# Searched after every -I and -isystem path, so LibTorch's own fmt stays first; it
# supplies Gloo's headers, which LibTorch's ProcessGroupGloo.hpp includes.
export CPLUS_INCLUDE_PATH=$deps/usr/include
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
step() { echo "== $1 ($(date +%T))" | tee -a "$out/summary.txt"; }

step machine
{ [ "$device" = cpu ] || nvidia-smi; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'; } \
  > "$out/machine.txt" 2>&1
tail -1 "$out/machine.txt" | tee -a "$out/summary.txt"

if [ -z "$build" ]; then
  step build
  build=build-gpu
  torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  if ! { cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$torch_prefix;$deps/usr" &&
    cmake --build $build -j "$(nproc)"; } > "$out/build.log" 2>&1; then
    grep -m 20 -E "error|Error" "$out/build.log" | tee -a "$out/summary.txt"
    exit 1
  fi
fi
remat=$build/remat
common=(run.device=$device run.progress=false data.dir=data run.out_dir="$out/runs")

step "allocation traces, replayed by the model"
for expandable in false true; do
  for preset in gpt2-demo llama-demo; do
    name=$preset-expandable-$expandable
    "$remat" train model.preset=$preset train.steps=2 run.sample_tokens=0 run.expandable_segments=$expandable \
      run.record_allocations="$out/traces/$name.txt" "${common[@]}" > "$out/train-$name.log" 2>&1 ||
      echo "train $name failed: $(tail -1 "$out/train-$name.log")" | tee -a "$out/summary.txt"
  done
done
mkdir -p tests/memory/traces && cp "$out"/traces/*.txt tests/memory/traces/ 2>/dev/null
$build/remat_tests --gtest_filter='CachingAllocatorModel.ReplaysEvery*' > "$out/replay.log" 2>&1
grep -E "first the model|OK \]|FAILED \]" "$out/replay.log" | head -8 | tee -a "$out/summary.txt"
rm -rf tests/memory/traces  # they come back in $OUT/traces, to be committed there

step "peaks: the allocator's model against the allocator (remat bench)"
policies='none;full;every:2;uniform:2;modules:[core_attn];full+offload:[input];modules:[core_attn]+offload:[input,mlp]'
llama_1b=(model.preset=llama3-8b model.n_layer=16 model.d_model=2048 model.n_head=32 model.n_kv_head=8
  model.d_ff=8192 model.max_seq=1024 train.seq=1024 train.batch=4 run.dtype=bfloat16)
models=(gpt2-demo llama-demo)
[ "$device" = cpu ] || models+=(llama-1b)
for model in "${models[@]}"; do
  if [ $model = llama-1b ]; then args=("${llama_1b[@]}"); else args=(model.preset=$model); fi
  "$remat" bench --policies "$policies" --steps 3 --warmup 1 --out "$out/bench-$model" "${args[@]}" "${common[@]}" \
    > "$out/bench-$model.log" 2>&1 || echo "bench $model failed: $(tail -1 "$out/bench-$model.log")"
  grep " on CUDA: " "$out/bench-$model.log" | sed "s/^/$model /" | tee -a "$out/summary.txt"
done

step suite
[ "$device" = cpu ] && { step done; exit 0; }  # the rehearsal's suite is CI's
(cd $build && ctest -j "$(nproc)" --timeout 300 > "$out/ctest.log" 2>&1)
grep -E "tests passed|tests failed" "$out/ctest.log" | tee -a "$out/summary.txt"
grep -E "\*\*\*(Failed|Timeout)|Exception" "$out/ctest.log" | head -10 | tee -a "$out/summary.txt"
step done
