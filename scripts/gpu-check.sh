#!/usr/bin/env bash
# The GPU check, one command on a lent GPU machine (no package registry, its own PyTorch):
# builds remat against that PyTorch with every core; checks each op's allocations against
# its declared events and the sdpa op's flash kernel against the math op; trains with
# offload and sdpa against `none` for bitwise losses; measures predicted against measured
# peaks and step times of a 1B Llama with sdpa and offload (remat bench), and one step's
# parts in a timeline beside the predicted ones; compares
# tokens/s with PyTorch on the same GPU; records allocation traces where none of this
# device and PyTorch are committed; and runs the suite with the time left. Each step has a
# time cap inside the script's own (CHECK_SECONDS, default 560), so that a lease's one
# call brings back whatever was done.
#
# Prepare here, then carry both to the machine (they are git-ignored):
#   bash scripts/gpu_deps.sh        # .cache/gpu-deps: the C++ dependencies and corpus text, 12 MB
#   ./build/remat prepare           # data/: the tokenized corpus
# On the machine: bash scripts/gpu-check.sh. Everything goes to $WORK (default
# gpu-check-out/); with $OUT set (a lease's folder that comes back, a few files at most),
# summary.txt and all of it as results.tgz are copied there after every step.
# A rehearsal here, without the build, in float32 with llama-demo, the peer and the suite:
#   DEVICE=cpu BUILD=build bash scripts/gpu-check.sh
# STEPS names the steps to run after the build (default: all of them, in this order):
#   tests bitwise bench timeline peers traces suite
# and `titan` (alone: it takes six minutes) times remat against PyTorch as torchtitan runs
# it, the 1B Llama at 2048 tokens in three rounds, and `ranks` (alone, at most 4 minutes)
# trains on two ranks sharing the GPU against one process. A lease's call runs 10 minutes at most:
# STEPS=build builds remat alone, then BUILD=build-gpu STEPS=titan runs the step.
# and ATTENTIONS (default "sdpa math"), POLICIES (;-separated) and BUDGETS narrow the bench's
# entries, for a lease with little time left.
set -uo pipefail
cd "$(dirname "$0")/.."
work=$(realpath -m "${WORK:-gpu-check-out}")
back=${OUT:-}
device=${DEVICE:-cuda}
build=${BUILD:-}
deadline=$((SECONDS + ${CHECK_SECONDS:-560}))
mkdir -p "$work/traces"
: > "$work/summary.txt"
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
# The prepared corpus is checked against its text, which Debian's `bible` prints; a machine
# without it gets that output, which scripts/gpu_deps.sh recorded.
if ! command -v bible > /dev/null && [ -f "$deps/bible-kjv.out" ]; then
  mkdir -p "$work/bin"
  printf '#!/bin/sh\ncat %q\n' "$deps/bible-kjv.out" > "$work/bin/bible"
  chmod +x "$work/bin/bible"
  export PATH=$work/bin:$PATH
fi

steps=" ${STEPS:-tests bitwise bench timeline peers traces suite} "
want() { [[ $steps == *" $1 "* ]]; }
say() { echo "$*" | tee -a "$work/summary.txt"; }
# Copies what exists so far to $OUT: a call stopped at its limit still brings it back.
pack() {
  [ -n "$back" ] || return 0
  cp "$work/summary.txt" "$back/summary.txt"
  tar czf "$back/results.tgz" --exclude=checkpoints --exclude='*.pt' --exclude='*.safetensors' -C "$work" . 2>/dev/null
}
step() {
  pack
  say "== $1 ($(date +%T), $((deadline - SECONDS)) s left)"
}
# cap SECONDS command...: runs the command for at most SECONDS, and never past the deadline.
cap() {
  local s=$1 left=$((deadline - SECONDS - 5))
  shift
  ((left < s)) && s=$left
  ((s > 0)) || { say "skipped for want of time: $*"; return 124; }
  timeout -k 5 "$s" "$@"
}

step machine
{ [ "$device" = cpu ] || nvidia-smi; nproc; free -g; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'; } \
  > "$work/machine.txt" 2>&1
tail -1 "$work/machine.txt" | tee -a "$work/summary.txt"
# Names the traces: the device and the PyTorch that recorded them.
tag=$(python3 -c 'import re, torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
print(re.sub("[^a-z0-9.]+", "-", f"{name} torch{torch.__version__.split(chr(43))[0]}".lower()))' 2>/dev/null || echo cpu)

if [ -z "$build" ]; then
  step build
  build=build-gpu
  torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  generator=Ninja
  # The test binary only where a step runs it.
  targets=(--target remat)
  { want tests || want suite; } && targets=()
  command -v ninja > /dev/null || generator="Unix Makefiles"
  # -O2 without debug information: the build is most of the lease.
  if ! { cmake -S . -B $build -G "$generator" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$deps/usr" && cap 330 cmake --build $build -j "$(nproc)" "${targets[@]}"; } \
    > "$work/build.log" 2>&1; then
    grep -m 20 -E "error|Error" "$work/build.log" | tee -a "$work/summary.txt"
    tail -5 "$work/build.log" >> "$work/summary.txt"
    pack
    exit 1
  fi
fi
remat=$build/remat
common=(run.device=$device run.progress=false data.dir=data run.out_dir="$work/runs")

if want tests; then
  step "each op's allocations on the GPU against its declared events, and the sdpa op's flash kernel"
  # One process each, so that one that dies leaves the others' results.
  : > "$work/gpu-tests.log"
  for t in OpMemory.OnAGpuDeclaredEventsEqualTheBytesRequested OpMemory.OnAGpuTheFlashKernelsEventsAreExact \
    OpMemory.OnAGpuModelShapesAreExact 'SdpaAttentionOp.*' 'HostPool.*' 'GpuRanks.*'; do
    cap 60 $build/remat_tests --gtest_filter="$t" >> "$work/gpu-tests.log" 2>&1 || say "$t: failed or died ($?)"
  done
  grep -E "OK \]|FAILED \]" "$work/gpu-tests.log" | sort -u | head -20 | tee -a "$work/summary.txt"
  say "$(grep -c "Failure" "$work/gpu-tests.log") mismatches, by case:"
  grep -E -A1 "^Google Test trace:" "$work/gpu-tests.log" | grep -vE "^Google Test trace:|^--" | sort | uniq -c |
    head -30 | tee -a "$work/summary.txt"
fi

if want bitwise; then
step "bitwise on CUDA: offload and sdpa against none, the losses of 4 steps"
# Each group against its first run; the second `none` shows whether the GPU's kernels
# repeat themselves bit for bit at all.
gpt2=(model.preset=gpt2-demo)
llama=(model.preset=llama-demo run.dtype=bfloat16 model.attention=sdpa model.dropout=0)
# The CPU's rehearsal: float32, and an op every LibTorch has.
[ "$device" = cpu ] && llama=(model.preset=llama-demo model.attention=tiled model.dropout=0)
for run in "gpt2 none none" "gpt2 none-again none" "gpt2 full full" "gpt2 full-again full" "gpt2 offload-input full+offload:[input]" \
  "gpt2 offload-mlp modules:[core_attn]+offload:[input,mlp]" "llama none none" "llama none-again none" \
  "llama full full" "llama offload-input full+offload:[input]"; do
  read -r arch name policy <<< "$run"
  if [ $arch = gpt2 ]; then args=("${gpt2[@]}"); else args=("${llama[@]}"); fi
  cap 40 "$remat" train "${args[@]}" ac.policy="$policy" train.steps=4 train.eval_every=0 run.sample_tokens=0 \
    ac.profile=false "${common[@]}" run.out_dir="$work/bitwise/$arch-$name" > "$work/bitwise-$arch-$name.log" 2>&1 ||
    say "train $arch-$name failed: $(tail -1 "$work/bitwise-$arch-$name.log")"
  grep -h "host memory of the offloaded" "$work/bitwise-$arch-$name.log" | sed "s/^/$arch-$name: /" | tee -a "$work/summary.txt"
done
python3 - "$work/bitwise" << 'PY' | tee -a "$work/summary.txt"
import glob, json, os, sys
runs = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/*/**/metrics.jsonl", recursive=True)):
    name = os.path.relpath(f, sys.argv[1]).split("/")[0]
    runs[name] = [json.loads(l)["loss"] for l in open(f) if '"loss"' in l]
for arch in ("gpt2", "llama"):
    ref = runs.get(f"{arch}-none")
    for name, losses in runs.items():
        if name.startswith(arch + "-") and name != f"{arch}-none" and ref:
            same = losses == ref
            diff = max((abs(a - b) for a, b in zip(losses, ref)), default=float("nan"))
            print(f"{name}: {'bitwise equal to none' if same else f'differs from none, at most {diff:.3g}'} ({len(losses)} steps)")
PY
fi

llama_1b=(model.preset=llama3-8b model.n_layer=16 model.d_model=2048 model.n_head=32 model.n_kv_head=8
  model.d_ff=8192 model.max_seq=1024 train.seq=1024 train.batch=4 run.dtype=bfloat16)
attentions=${ATTENTIONS:-sdpa math}
[ "$device" = cpu ] && llama_1b=(model.preset=llama-demo) attentions="tiled math"

# Each entry of the bench in $1: its predicted copies and the part the compute waits for,
# beside its measured and predicted step, each line after $2.
copies() {
  [ -f "$1/bench.json" ] && python3 - "$1/bench.json" <<'PY' | sed "s/^/$2 /" | tee -a "$work/summary.txt"
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"{r['entry']}: step {1e3 * r['median_step_seconds']:.1f} ms, predicted {1e3 * r['predicted_step_seconds']:.1f} ms; "
          f"copies {1e3 * r['predicted_copy_seconds']:.1f} ms, waited {1e3 * r['predicted_copy_wait_seconds']:.1f} ms, "
          f"slowed {1e3 * r['predicted_copy_slowdown_seconds']:.1f} ms predicted")
PY
}

if want bench; then
step "peaks and step times: the sdpa op, offload to page-locked memory (remat bench)"
for attention in $attentions; do
  # modules:[core_attn]+offload:[input]'s copies are predicted to hide behind the layer's
  # compute, full+offload:[input]'s copies back not (the recompute reads the input first).
  policies=${POLICIES:-'none;full;modules:[core_attn];full+offload:[input];modules:[core_attn]+offload:[input];modules:[core_attn]+offload:[input,mlp]'}
  [ $attention = math ] && policies=${POLICIES:-'none;full'}
  cap 130 "$remat" bench --policies "$policies" --budgets "${BUDGETS:-0.9}" --steps 3 --warmup 1 \
    --out "$work/bench-llama-1b-$attention" "${llama_1b[@]}" model.attention=$attention "${common[@]}" \
    > "$work/bench-llama-1b-$attention.log" 2>&1 || say "bench llama-1b $attention failed: $(tail -1 "$work/bench-llama-1b-$attention.log")"
  grep " on CUDA: " "$work/bench-llama-1b-$attention.log" | sed "s/^/llama-1b $attention /" | tee -a "$work/summary.txt"
  copies "$work/bench-llama-1b-$attention" "llama-1b $attention"
  [ $attention = math ] && continue
  # The MLP offload again, each layer's copies back started with the backward above it.
  out="$work/bench-llama-1b-$attention-prefetch"
  cap 60 "$remat" bench --policies 'modules:[core_attn]+offload:[input,mlp]' --steps 3 --warmup 1 --out "$out" \
    "${llama_1b[@]}" model.attention=$attention ac.offload_prefetch=true "${common[@]}" > "$out.log" 2>&1 ||
    say "bench llama-1b $attention prefetch failed: $(tail -1 "$out.log")"
  grep " on CUDA: " "$out.log" | sed "s/^/llama-1b $attention prefetch /" | tee -a "$work/summary.txt"
  copies "$out" "llama-1b $attention prefetch"
done
# GPT-2's biased products: whether cuBLASLt's 1 MiB workspace, made by the first product
# with a bias and left out of the model, is what its allocated peak lacks.
cap 40 "$remat" bench --policies 'none;full' --steps 2 --warmup 1 --out "$work/bench-gpt2-demo" model.preset=gpt2-demo \
  "${common[@]}" > "$work/bench-gpt2-demo.log" 2>&1 || say "bench gpt2-demo failed: $(tail -1 "$work/bench-gpt2-demo.log")"
grep " on CUDA: " "$work/bench-gpt2-demo.log" | sed "s/^/gpt2-demo /" | tee -a "$work/summary.txt"
fi

if want timeline; then
step "one step's timeline beside its predicted parts: the 1B Llama, none"
# The trace waits for the device at every slice boundary, so its slices are the kernels'
# times: the step's parts outside the passes, against the profile's base and update.
attention=${attentions%% *}
cap 90 "$remat" train "${llama_1b[@]}" model.attention=$attention ac.policy=none train.steps=3 train.eval_every=0 \
  run.sample_tokens=0 run.trace="$work/timeline-llama-1b.json" "${common[@]}" run.out_dir="$work/timeline" \
  > "$work/timeline.log" 2>&1 || say "the timeline run failed: $(tail -1 "$work/timeline.log")"
grep -h "predicted step time" "$work/timeline.log" | tee -a "$work/summary.txt"
[ -f "$work/timeline-llama-1b.json" ] && python3 - "$work/timeline-llama-1b.json" <<'PY' | tee -a "$work/summary.txt"
import collections, json, re, sys
events = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X"]
total = collections.Counter()
for e in events:
    if e["cat"] in ("step", "layer"):
        total[re.sub(r"^layer \d+ ", "layer ", e["name"])] += e["dur"] / 1e3
for name, ms in total.most_common(14):
    print(f"timeline: {name}: {ms:.1f} ms")
PY
fi

if want ranks; then
step "two ranks sharing the GPU (data, tensor with sp, pipeline, ZeRO-1) against one process, 4 steps"
# Gloo on CUDA tensors (parallel.backend = auto chooses it for ranks sharing a GPU), then
# NCCL asked for: its multi-rank mode, where this NCCL has it, else its refusal.
ranks_args=(model.preset=gpt2-demo model.dropout=0 train.steps=4 train.batch=8 train.grad_accum=2 train.eval_every=0
  run.sample_tokens=0 ac.profile=false "${common[@]}")
for run in "one 1" "dp 2" "tp 2 parallel.tp=2 parallel.sp=true" "pp 2 parallel.pp=2" "zero 2 parallel.zero=1" \
  "dp-nccl 2 parallel.backend=nccl"; do
  read -r name n extra <<< "$run"
  launcher=("$remat")
  ((n > 1)) && launcher=("$remat" launch --nproc "$n")
  NCCL_MULTI_RANK_GPU_ENABLE=1 cap 35 "${launcher[@]}" train "${ranks_args[@]}" $extra run.out_dir="$work/ranks/$name" \
    > "$work/ranks-$name.log" 2>&1 || say "ranks $name failed: $(grep -m1 -i error "$work/ranks-$name.log")"
  grep -h -E "ranks over|memory peak per rank" "$work/ranks-$name.log" | sed "s/^/ranks $name: /" |
    tee -a "$work/summary.txt"
done
python3 - "$work/ranks" << 'PY' | tee -a "$work/summary.txt"
import glob, json, os, sys
runs = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/*/**/metrics.jsonl", recursive=True)):
    runs[os.path.relpath(f, sys.argv[1]).split("/")[0]] = [json.loads(l)["loss"] for l in open(f) if '"loss"' in l]
ref = runs.get("one")
for name, losses in runs.items():
    if name != "one" and ref:
        diff = max((abs(a - b) for a, b in zip(losses, ref)), default=float("nan"))
        print(f"ranks {name}: {'bitwise equal to one process' if losses == ref else f'at most {diff:.3g} from one process'} ({len(losses)} steps)")
PY
fi

[ "$device" = cpu ] && { step done; exit 0; }  # the rehearsal's peer and suite are CI's

if want peers; then
step "PyTorch on the same GPU (bench/peers/compare.py)"
# Both sides at fused attention: PyTorch's SDPA and remat's sdpa op (the same flash
# kernel); no dropout, which fused kernels draw their own way. The 1B Llama in bfloat16.
peer=(--device "$device" --remat "$remat" --python python3 --rounds 1 --steps 5 --warmup 2 --timeout 100
  --pt-attention sdpa --remat-override model.attention=sdpa --remat-override ac.profile=true --dropout-gpt2 0)
cap 150 python3 bench/peers/compare.py "${peer[@]}" --archs llama --policies none,full,sac --dtype bfloat16 --layers 16 \
  --d-model 2048 --heads 32 --kv-heads 8 --d-ff-llama 8192 --seq 1024 --batch 4 --out "$work/peers-llama-1b" \
  > "$work/peers-llama-1b.log" 2>&1 || say "compare.py llama-1b stopped: $(tail -1 "$work/peers-llama-1b.log")"
tail -12 "$work/peers-llama-1b.log" >> "$work/summary.txt"
pack
fi

if want titan; then
step "remat against PyTorch as torchtitan runs it: the 1B Llama at 2048 tokens, three rounds"
# PyTorch eager without recompute, torchtitan's per-op selective checkpointing, full
# checkpointing per block and torch.compile (fused AdamW where torch has it), each against
# remat's pairing, alternating in three rounds; then tokens/s and MFU by torchtitan's count.
titan=(--device "$device" --remat "$remat" --python python3 --rounds 3 --steps 4 --warmup 2 --timeout 90
  --pt-attention sdpa --remat-override model.attention=sdpa --remat-override ac.profile=true --archs llama
  --policies none,full,sac,compile --dtype bfloat16 --layers 16 --d-model 2048 --heads 32 --kv-heads 8
  --d-ff-llama 8192 --seq 2048 --batch 2)
cap 360 python3 bench/peers/compare.py "${titan[@]}" --out "$work/titan" > "$work/titan.log" 2>&1 ||
  say "compare.py titan stopped: $(tail -1 "$work/titan.log")"
tail -12 "$work/titan.log" >> "$work/summary.txt"
[ -f "$work/titan/rows.jsonl" ] && python3 - "$work/titan/rows.jsonl" <<'PY' | tee -a "$work/summary.txt"
import collections, json, os, statistics, sys
# torchtitan's count: 6 FLOPs per parameter but the embedding's, plus 12 * layers * d_model
# * seq for attention; 989 TFLOP/s is the H100's and H200's dense bfloat16 peak.
L, d, kv_share, ff, vocab, seq, batch = 16, 2048, 8 / 32, 8192, 8192, 2048, 2
params = L * (2 * d * d + 2 * d * d * kv_share + 3 * d * ff) + vocab * d
flops = 6 * params + 12 * L * d * seq
def predicted(r):
    """The step remat predicted for its row: its bench's own record, in the run's --out."""
    c = r.get("command", [])
    try:
        rows = json.load(open(os.path.join(c[c.index("--out") + 1], "bench.json")))["rows"]
    except (ValueError, IndexError, OSError, KeyError):
        return None
    return next((x["predicted_step_seconds"] for x in rows if x.get("predicted_step_seconds")), None)
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    if not r.get("error"):
        runs[(r["tool"], r["policy"])].append(r)
for (tool, policy), rs in sorted(runs.items()):
    s = statistics.median(r["median_step_seconds"] for r in rs)
    tps = batch * seq / s
    peak = max((r.get("peak_bytes") or 0) for r in rs) / 2 ** 30
    pred = [p for p in map(predicted, rs) if p]
    said = f", predicted {1e3 * statistics.median(pred):.1f} ms" if pred else ""
    print(f"titan {tool} {policy}: {1e3 * s:.1f} ms{said}, {tps:,.0f} tokens/s, MFU {tps * flops / 989e12:.1%}, "
          f"peak {peak:.2f} GiB, {len(rs)} rounds")
PY
pack
fi

if want traces; then
step "allocation traces, replayed by the model"
# Fixed policies, so that a trace can be set beside the cost model's allocations of the
# same plan (cost::step_allocations), and a budget plan under expandable segments, whose
# reserved peak the budget holds. Recorded once per device and PyTorch.
if ls tests/memory/traces/$tag-* > /dev/null 2>&1; then
  say "traces of $tag are committed already"
else
  for run in "gpt2-demo none false" "gpt2-demo full false" "llama-demo none false" "llama-demo full false" \
    "gpt2-demo budget0.8 true" "llama-demo budget0.8 true"; do
    read -r preset policy expandable <<< "$run"
    name=$tag-$preset-$policy-expandable-$expandable
    args=(model.preset=$preset train.steps=2 run.sample_tokens=0 run.expandable_segments=$expandable)
    if [ $policy = budget0.8 ]; then args+=(ac.budget=0.8); else args+=(ac.policy=$policy); fi
    cap 40 "$remat" train "${args[@]}" ac.profile=false run.record_allocations="$work/traces/$name.txt" "${common[@]}" \
      > "$work/train-$name.log" 2>&1 || say "train $name failed: $(tail -1 "$work/train-$name.log")"
  done
fi
fi

want suite || { step done; exit 0; }
step suite
cap $((deadline - SECONDS)) ctest --test-dir $build -j "$(nproc)" --timeout 60 --output-on-failure > "$work/ctest.log" 2>&1
grep -E "tests passed|tests failed" "$work/ctest.log" | tee -a "$work/summary.txt"
grep -E "\*\*\*(Failed|Timeout)|Exception|Failure|Expected|Which is" "$work/ctest.log" | head -40 | tee -a "$work/summary.txt"
step done
pack
