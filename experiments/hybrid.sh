#!/bin/bash
# Reproduction at CPU scale of "Adaptive Attention Selection" (hybrid_attn.py): static G G G S vs dynamic
# G R R S (α ∈ {0, 0.01, 0.5}) vs all-softmax S S S S on Tiny Shakespeare (chars), same budget, 2 seeds.
# Scale: 4 layers × 128 wide, 4 heads, ctx 128, batch 8, 400 iters (~0.4M tokens) — far below the paper's
# ~160M params. Each run holds one CPU slot (1 thread) through /work/bin/cpujob; runs are sequential.
#   bash experiments/hybrid.sh            # from /work/main; logs in /work/runs/hybrid, runs in out/hybrid/
#   python experiments/hybrid_summary.py  # the tables in results/hybrid.md
set -u
cd "$(dirname "$0")/.."
LOG=/work/runs/hybrid; mkdir -p "$LOG"
CPUJOB=/work/bin/cpujob; [ -x "$CPUJOB" ] || CPUJOB="env OMP_NUM_THREADS=1"  # one CPU slot, 1 thread
COMMON="--dataset shakespeare --n_layer=4 --n_head=4 --n_embd=128 --block_size=128 --batch_size=8 \
 --max_iters=400 --warmup_iters=40 --learning_rate=2e-3 --eval_interval=50 --eval_iters=10 --log_interval=10"
run() {  # name, seed, extra flags...
  local name=$1 seed=$2; shift 2
  local out=out/hybrid/${name}-s${seed}
  if [ -f "$out/done" ]; then echo "skip $out"; return; fi
  $CPUJOB python train.py --model hybrid $COMMON --seed=$seed --out_dir=$out "$@" \
    > "$LOG/${name}-s${seed}.log" 2>&1 && touch "$out/done"
  echo "$(date -u +%H:%M:%S) finished $name seed $seed (rc $?)"
}
for seed in 1 2; do
  run dyn_a0.01 $seed --pattern="G R R S" --balance=0.01
  run static_GGGS $seed --pattern="G G G S"
  run softmax_SSSS $seed --pattern="S S S S"
  run dyn_a0 $seed --pattern="G R R S" --balance=0
  run dyn_a0.5 $seed --pattern="G R R S" --balance=0.5
done
# Phase 2: the same three models at 3× the steps (1200 iters), to see whether the ranking at 400 iters
# survives once softmax attention leaves its early plateau.
COMMON=${COMMON/--max_iters=400 --warmup_iters=40/--max_iters=1200 --warmup_iters=100}
COMMON=${COMMON/--eval_interval=50/--eval_interval=100}
for seed in 1 2; do
  run long1200_dyn_a0.01 $seed --pattern="G R R S" --balance=0.01
  run long1200_static_GGGS $seed --pattern="G G G S"
  run long1200_softmax_SSSS $seed --pattern="S S S S"
done
