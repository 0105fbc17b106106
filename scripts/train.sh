#!/usr/bin/env bash
# Fresh machine to a trained model: install, build, then train the default preset on
# the King James Bible (Debian's bible-kjv) with a budget-free default plan.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
./build/remat train "$@"
