#!/bin/bash
# conddepth reproduction at CPU scale (arXiv:2604.17228): controller-only runs from a dense GPT.
#   nohup /work/bin/cpujob bash experiments/conddepth.sh > /work/runs/conddepth/all.log 2>&1 &
# One cpujob slot (1 thread) for the whole chain. Results: /work/runs/conddepth/*.json, summarised by
# experiments/conddepth_summary.py into results/conddepth.md tables.
set -e
cd "$(dirname "$0")/.."
R=${R:-/work/runs/conddepth}
mkdir -p $R
[ -f $R/dense.pt ] || cp /work/runs/gpt-default/ckpt.pt $R/dense.pt   # the lead's 6×192 GPT, ctx 128, 2000 iters
SEEDS=${SEEDS:-"42 123"}; LATE_SEEDS=${LATE_SEEDS:-"7"}   # touch $R/STOP to skip every run not yet started
# 300 controller steps of 16 × 64 tokens (paper: 20k steps of 16 × 256); labels from step 20 every 5
COMMON="--init_from=$R/dense.pt --ctx=64 --batch_size=16 --max_iters=300 --warmup_iters=30 --learning_rate=1e-3 \
 --min_lr=1e-5 --weight_decay=0.01 --grad_clip=1.0 --eval_interval=25 --eval_iters=10 --label_start=20 --label_every=5"

run() {  # run NAME [flags...]; skips runs already done
  local name=$1; shift
  [ -f $R/$name.json ] && { echo "skip $name"; return; }
  [ -f $R/STOP ] && { echo "stop: $name not run"; return; }
  echo "== $name $* ($(date -u +%H:%M:%S))"
  python experiments/conddepth_run.py $COMMON "$@" --out_json=$R/$name.json > $R/$name.log 2>&1
  tail -1 $R/$name.log
}

# reference: the dense model itself (ρ = 1: every token full), same val batches
run dense-rho1 --rho=1.0 --max_iters=0 --recipe=A3-G1
# pilots (seed 0, not a main seed): they fix the hit thresholds before the main runs, like the paper's pilot
run pilot-G1 --recipe=G1 --seed=0
run pilot-G3 --recipe=G3 --seed=0
python experiments/conddepth_summary.py --thresholds $R
# priority order (the CPU budget may end the chain early): core matrix + A1/A2 on 2 seeds, A4, then seed 7
for s in $SEEDS; do
  for r in G1 G3 A3-G1 A3-G3 A1 A2; do
    run $r-s$s --recipe=$r --seed=$s
  done
done
for s in ${A4_SEEDS:-42}; do
  for r in A4-0.25 A4-2; do
    run $r-s$s --recipe=$r --seed=$s
  done
done
for s in $LATE_SEEDS; do
  for r in G1 G3 A3-G1 A3-G3 A1 A2; do
    run $r-s$s --recipe=$r --seed=$s
  done
done
# extra 1: 4× longer runs of the 2×2 core matrix (1200 steps, seed 42): do the 300-step orderings hold?
for r in G3 A3-G3 G1 A3-G1; do
  run long-$r-s42 --recipe=$r --seed=42 --max_iters=1200 --eval_interval=100
done
# extra 2: the paper's 25% budget supplement (G1 vs G3, 2 seeds)
for s in 42 123; do
  for r in G1 G3; do
    run rho25-$r-s$s --recipe=$r --seed=$s --rho=0.25
  done
done
[ -f $R/bench.json ] || python bench.py conddepth --ckpt=$R/dense.pt --repeats=5 --json=$R/bench.json | tee $R/bench.log
python experiments/conddepth_summary.py $R > $R/summary.md
echo "all done $(date -u +%H:%M:%S)"
