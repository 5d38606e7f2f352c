#!/bin/bash
# conddepth reproduction at CPU scale (arXiv:2604.17228), every run through train.py:
#   mkdir -p /work/runs/conddepth && bash experiments/conddepth.sh > /work/runs/conddepth/all.log 2>&1
# 1. a dense GPT (`--preset classroom`: 4 × 128, ctx 64, 1500 iters) is the pretrained start;
# 2. controller-only runs from it (the paper's §3.4 scope), 2 controlled layers of 4, r = 16 (= d_ff/32);
# 3. experiments/conddepth_eval.py measures each checkpoint (causal / top-k, dense / sparse) into $R/NAME.json,
#    experiments/conddepth_summary.py makes the tables of results/conddepth.md.
# A finished run (its JSON exists) is skipped, so rerunning continues; touch $R/STOP to stop before the next run.
set -e
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per run: on a shared 2-core machine two threads thrash (10x slower)
cd "$(dirname "$0")/.."
R=${R:-/work/runs/conddepth}
mkdir -p $R
[ -f $R/dense/ckpt.pt ] || python train.py --model gpt --preset classroom $DENSE_EXTRA --out_dir=$R/dense > $R/dense.log 2>&1
# 300 controller steps of 16 × 64 tokens (paper: 20k steps of 16 × 256); labels from step 20, every 5; every
# run evaluates on the same 10 validation batches (eval_seed 1337), so recipes compare paired
COMMON="--init_from=$R/dense/ckpt.pt --n_controlled=2 --cheap_rank=16 --batch_size=16 --max_iters=300 \
 --warmup_iters=30 --learning_rate=1e-3 --min_lr=1e-5 --weight_decay=0.01 --grad_clip=1.0 --eval_interval=25 \
 --eval_iters=10 --eval_seed=1337 --label_start=20 --label_every=5 --log_interval=1 $EXTRA"

run() {  # run NAME [flags...]
  local name=$1; shift
  [ -f $R/$name.json ] && { echo "skip $name"; return; }
  [ -f $R/STOP ] && { echo "stop: $name not run"; return; }
  echo "== $name $* ($(date -u +%H:%M:%S))"
  python train.py --model conddepth $COMMON --out_dir=$R/$name "$@" > $R/$name.log 2>&1
  python experiments/conddepth_eval.py $R/$name --out_json=$R/$name.json | tail -1
}

# reference: the dense model itself (ρ = 1: every token full), same val batches
run dense-rho1 --rho=1.0 --max_iters=0 --recipe=A3-G1
# pilots (seed 0, not a main seed) fix the hit thresholds before the main runs, like the paper's pilot
run pilot-G1 --recipe=G1 --seed=0
run pilot-G3 --recipe=G3 --seed=0
python experiments/conddepth_summary.py --thresholds $R
for s in ${SEEDS:-42 123}; do
  for r in G1 G3 A3-G1 A3-G3 A1; do
    run $r-s$s --recipe=$r --seed=$s
  done
done
# issue 12: can the routed model end as good as its dense start? the backbone trained jointly (lower lr)
[ -f $R/dense-ft/ckpt.pt ] || python train.py --model gpt --init_from=$R/dense/ckpt.pt --batch_size=16 \
  --max_iters=300 --warmup_iters=30 --learning_rate=3e-4 --min_lr=3e-6 --weight_decay=0.01 --eval_interval=25 \
  --eval_iters=10 --eval_seed=1337 --out_dir=$R/dense-ft > $R/dense-ft.log 2>&1   # the dense start, trained on alike
for s in ${SEEDS:-42 123}; do
  run joint-A3-G1-s$s --recipe=A3-G1 --controller_only=false --learning_rate=3e-4 --min_lr=3e-6 --seed=$s
done
for s in ${LATE_SEEDS:-7}; do
  for r in G1 G3 A3-G1 A3-G3 A1 A2; do
    run $r-s$s --recipe=$r --seed=$s
  done
done
python experiments/conddepth_summary.py $R > $R/summary.md
echo "all done $(date -u +%H:%M:%S)"
