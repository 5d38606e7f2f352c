#!/usr/bin/env bash
# Issue #7: every router vs dense GPTs of matched cost, 2 seeds, one process per seed (one core each).
# Resumable: finished runs (a JSON record in results/compare/) are skipped, partial ones resume.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
python experiments/compare.py --seeds 1 "$@" > out/compare-s1.log 2>&1 &
python experiments/compare.py --seeds 2 "$@" > out/compare-s2.log 2>&1 &
wait
python experiments/compare.py --table-only "$@"
