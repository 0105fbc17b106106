#!/usr/bin/env bash
# Fresh machine to a trained model: install, build the CLI alone, then train the default
# preset on the King James Bible (Debian's bible-kjv). The recompute plan is the
# planner's for 60% of the no-recompute peak, unless an ac.* setting or a config file
# given here decides it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh --target remat
plan=(ac.budget=0.6)
for arg in "$@"; do
  case "$arg" in ac.* | --config | --config=*) plan=() ;; esac
done
./build/remat train "${plan[@]}" "$@"
