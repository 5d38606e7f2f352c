#!/bin/bash
# TSA at the paper's token budget and at the default preset, one seed per call (results/tsa.md §1).
# Run one process per seed, one thread each, in parallel on a 2-core machine, from the repo root
# (after `mkdir -p out/tsa_budget`):
#   OMP_NUM_THREADS=1 nohup bash experiments/tsa_budget.sh 1 > out/tsa_budget/s1.log 2>&1 &
#   OMP_NUM_THREADS=1 nohup bash experiments/tsa_budget.sh 2 > out/tsa_budget/s2.log 2>&1 &
# then  python experiments/tsa_report.py out/tsa_budget/eval.jsonl  for the tables. Resumable: a finished
# run (its `done` file) is skipped.
#
# P (paper budget): the paper's 5000 steps × batch 64 × ctx 128 = 41M tokens and its optimiser (lr 1e-3,
#   β2 0.95, wd 0.1), but a 6 × 64 model (H=4) instead of 6 × 256 so that one run takes ~27 single-core
#   minutes; L=6 keeps the paper's five routers.
# D (default preset): `python train.py --model tsa --dataset shakespeare` (6 × 192, batch 16, 2250 iters).
# Then, for each TSA run, a short straight-through hard-gate phase (--hard_ft_iters) from its checkpoint,
# and the same continuation of the dense run as the control for the extra training.
set -u
cd "$(dirname "$0")/.."
S=${1:?usage: tsa_budget.sh SEED}
OUT=${OUT-out/tsa_budget}
mkdir -p "$OUT"
P="--dataset shakespeare --n_layer=6 --n_head=4 --n_embd=64 --block_size=128 --batch_size=64 --max_iters=5000
   --warmup_iters=100 --learning_rate=1e-3 --min_lr=1e-4 --beta2=0.95 --weight_decay=0.1
   --eval_interval=1000 --eval_iters=20 --log_interval=250"
D="--dataset shakespeare"
SOFT="--hard_ft_iters=0"  # these runs predate the straight-through phase in tsa.py's default schedule

run() {  # run NAME ARGS...: train, then the final eval (tsa_eval.py, 30 fixed val batches)
  local name=$1; shift
  if [ -f "$OUT/$name/done" ]; then echo "skip $name"; return; fi
  echo "== $name $(date -u +%T)"
  python train.py "$@" --seed="$S" --out_dir="$OUT/$name" > "$OUT/$name.log" 2>&1 &&
    python experiments/tsa_eval.py "$OUT/$name" --eval_iters=30 --out "$OUT/eval.jsonl" >> "$OUT/$name.log" 2>&1 &&
    touch "$OUT/$name/done"
  grep "done in" "$OUT/$name.log"
}
ft() {  # ft NAME FROM ITERS MODEL [ARGS...]: continue FROM for ITERS iterations at a low learning rate
  local name=$1 from=$2 iters=$3 model=$4; shift 4
  run "$name" --model "$model" --dataset shakespeare --init_from="$OUT/$from/ckpt.pt" --max_iters="$iters" \
    --warmup_iters=20 --learning_rate=3e-4 --min_lr=3e-5 --eval_interval="$iters" --eval_iters=20 \
    --log_interval=100 "$@"
}

run P_dense_s$S   --model gpt $P
run P_lam0.001_s$S --model tsa $P $SOFT --lam=0.001
run D_dense_s$S   --model gpt $D
run D_lam0.001_s$S --model tsa $D $SOFT --lam=0.001
# hard-gate phases: λ=0.001 as trained, and larger λ to push p over 0.5 (the soft routers at λ=0.001 scale
# tokens by ~1 − p ≈ 0.7–0.8 but hardly ever halt one)
for lam in 0.001 0.01 0.05; do
  ft P_hardft_lam${lam}_s$S P_lam0.001_s$S 500 tsa --batch_size=64 --lam=$lam --hard_ft_iters=500
done
ft P_densecont_s$S P_dense_s$S    500 gpt --batch_size=64
for lam in 0.001 0.01; do
  ft D_hardft_lam${lam}_s$S D_lam0.001_s$S 250 tsa --lam=$lam --hard_ft_iters=250
done
ft D_densecont_s$S D_dense_s$S    250 gpt
run D_lam0_s$S     --model tsa $D $SOFT --lam=0
echo "all done $(date -u +%T)"
# added last: does a larger λ make the routers halt at the paper's budget? (paper: λ=0.05 → α=0.395)
run P_lam0.05_s$S  --model tsa $P $SOFT --lam=0.05
echo "lam0.05 done $(date -u +%T)"
