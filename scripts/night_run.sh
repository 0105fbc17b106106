#!/usr/bin/env bash
# A night's unattended run in small: a two-rank data-parallel job under
# `remat launch --max-restarts`, one of its ranks SIGKILLed KILLS times (default 3) at
# random moments, against the same job never killed. Passes when the killed job ends by
# itself with the weights and every logged loss, bitwise, of the other.
#
#   STEPS       steps of both jobs (default 20000; raise it until the reference job takes
#               the night you want to test, its time is printed)
#   KILLS       SIGKILLs of one rank, each at a moment drawn uniformly over the reference
#               job's duration (default 3)
#   SEED        the draws' seed (default 1)
#   OUT         where the runs and logs go (default a new directory under /tmp)
#   EXTRA       more key=value settings for both jobs
# Needs a built build/remat; the reference runs first, so the whole takes about twice the
# reference job's time.
set -euo pipefail
cd "$(dirname "$0")/.."
remat=$PWD/build/remat
steps=${STEPS:-20000}
kills=${KILLS:-3}
seed=${SEED:-1}
out=${OUT:-$(mktemp -d /tmp/remat-night.XXXXXX)}
mkdir -p "$out"
RANDOM=$seed
settings="model.preset=tiny-gpt2 model.vocab_size=0 model.dropout=0.1 train.batch=8 train.seq=32 train.steps=$steps \
train.checkpoint_every=50 train.eval_every=1000 run.sample_tokens=0 run.progress=false run.threads=1 \
run.out_dir=$out/runs ${EXTRA:-}"

echo "night run: $steps steps, $kills kills, seed $seed, in $out"
start=$SECONDS
"$remat" launch --nproc 2 train $settings run.name=reference >"$out/reference.log" 2>&1 ||
  { echo "night run: FAILED, the reference job failed; see $out/reference.log" >&2; exit 1; }
reference=$((SECONDS - start))
echo "the reference job took $reference s"

# The kill moments, sorted, over the reference's duration (a restarted job takes longer),
# drawn here in this shell so that SEED repeats them.
draws=()
for ((i = 0; i < kills; i++)); do draws+=($((1 + (RANDOM * 32768 + RANDOM) % (reference > 2 ? reference - 1 : 1)))); done
mapfile -t moments < <(printf '%s\n' "${draws[@]}" | sort -n)
start=$SECONDS
"$remat" launch --nproc 2 --max-restarts $((kills + 2)) train $settings run.name=night >"$out/night.log" 2>&1 &
launcher=$!
killed=0
for at in "${moments[@]}"; do
  while ((SECONDS - start < at)) && kill -0 "$launcher" 2>/dev/null; do sleep 1; done
  # Both ranks of the start under way (a restart may be starting them).
  ranks=()
  while ((${#ranks[@]} < 2)) && kill -0 "$launcher" 2>/dev/null; do
    mapfile -t ranks < <(pgrep -P "$launcher" || true)
    sleep 0.2
  done
  if ((${#ranks[@]} < 2)); then break; fi
  victim=${ranks[$((RANDOM % ${#ranks[@]}))]}
  echo "at $((SECONDS - start)) s: SIGKILL to rank pid $victim"
  kill -KILL "$victim" && killed=$((killed + 1))
done
status=0
wait "$launcher" || status=$?
echo "the killed job took $((SECONDS - start)) s and exited $status after $killed kills"
losses() { grep '"kind":"train"' "$1" | sed 's/.*"loss":\([^,}]*\).*/\1/'; }
if [ "$status" -ne 0 ]; then
  echo "night run: FAILED, the job did not finish by itself; see $out/night.log" >&2
  exit 1
fi
# A start killed before the job's first checkpoint starts it again in a new directory
# (night-2, ...): the job's run is the one that finished.
night=""
for dir in "$out"/runs/night*; do [ -f "$dir/model.safetensors" ] && night=$dir; done
if [ -z "$night" ]; then
  echo "night run: FAILED, no run of the killed job finished" >&2
  exit 1
fi
if ! cmp -s "$out/runs/reference/model.safetensors" "$night/model.safetensors"; then
  echo "night run: FAILED, the weights differ from the reference's" >&2
  exit 1
fi
if ! diff -q <(losses "$out/runs/reference/metrics.jsonl") <(losses "$night/metrics.jsonl") >/dev/null; then
  echo "night run: FAILED, the logged losses differ from the reference's" >&2
  exit 1
fi
echo "night run: passed: $killed kills, $(grep -c 'starting the job again' "$out/night.log") restarts, weights and \
$(losses "$night/metrics.jsonl" | wc -l) losses bitwise the reference's"
