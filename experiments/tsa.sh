#!/bin/bash
# TSA reproduction at CPU scale (results/tsa.md). Every step runs through /work/bin/cpujob (one CPU slot,
# one thread). Run from the repo root:  nohup bash experiments/tsa.sh > /work/runs/tsa/exp.log 2>&1 &
# Scale: 4 layers × d=128 (H=4), ctx 128, batch 16, $ITERS iterations (paper: 6 × 256, batch 64, 5000 its).
set -u
cd "$(dirname "$0")/.."
JOB=${CPUJOB-/work/bin/cpujob}
OUT=${OUT-out/tsa}
LOG=${LOG-/work/runs/tsa}
ITERS=${ITERS-600}
mkdir -p "$OUT" "$LOG"
M="--dataset shakespeare --n_layer=4 --n_head=4 --n_embd=128 --block_size=128 --batch_size=16 --max_iters=$ITERS
   --warmup_iters=100 --learning_rate=2e-3 --min_lr=1e-4 --eval_interval=$ITERS --eval_iters=10 --log_interval=100"
SOFT="--hard_ft_iters=0"  # these runs predate the straight-through phase in tsa.py's default schedule

run() {  # run NAME ARGS...: train, then the final eval (tsa_eval.py, 30 fixed val batches), in one CPU slot
  local name=$1; shift
  if [ -f "$OUT/$name/done" ]; then echo "skip $name"; return; fi
  echo "== $name $(date -u +%T)"
  $JOB bash -c "python train.py $* --out_dir=$OUT/$name > $LOG/$name.log 2>&1 && \
      python experiments/tsa_eval.py $OUT/$name --eval_iters=30 --out $LOG/eval.jsonl >> $LOG/$name.log 2>&1" \
    && touch "$OUT/$name/done"
  grep "done in" "$LOG/$name.log"
}

# Order = priority (the CPU slots are shared): seed 1 core runs first, then the baselines and ablations.
# 1. dense vs TSA (λ = 0.001, the paper's default, and λ = 0.05, its Pareto point), seed 1
run dense_s1    --model gpt $M --seed=1
run lam0.001_s1 --model tsa $M $SOFT --seed=1 --lam=0.001
run lam0.05_s1  --model tsa $M $SOFT --seed=1 --lam=0.05
# 2. early-exit baseline (same backbone and budget); the threshold sweep is in its eval step
run early_exit_s1 --model tsa $M $SOFT --seed=1 --variant=early_exit
# 3. λ sweep ends (seed 1)
for lam in 0 0.1; do run lam${lam}_s1 --model tsa $M $SOFT --seed=1 --lam=$lam; done
# 4. beyond the paper: a short straight-through hard-gate phase from the trained soft model
run hardft_lam0.05_s1 --model tsa --dataset shakespeare --init_from="$OUT/lam0.05_s1/ckpt.pt" --lam=0.05 \
    --batch_size=16 --max_iters=150 --hard_ft_iters=150 --warmup_iters=10 --learning_rate=5e-4 --min_lr=5e-5 \
    --eval_interval=150 --eval_iters=10 --log_interval=50 --seed=1
# 5. second seed of the core comparison, the middle of the λ sweep
run dense_s2    --model gpt $M --seed=2
run lam0.001_s2 --model tsa $M $SOFT --seed=2 --lam=0.001
run lam0.05_s2  --model tsa $M $SOFT --seed=2 --lam=0.05
run lam0.01_s1  --model tsa $M $SOFT --seed=1 --lam=0.01
# 6. copy vs sort (§3.1; the paper's d=128, L=6, H=4; short runs)
T="--n_layer=6 --n_head=4 --n_embd=128 --batch_size=32 --max_iters=600 --warmup_iters=50 --learning_rate=1e-3
   --eval_interval=600 --eval_iters=10 --log_interval=100 --seed=1"
for task in copy sort; do run ${task}_tsa --model tsa --dataset $task $T $SOFT --lam=0.001; done
for task in copy sort; do run ${task}_dense --model gpt --dataset $task $T; done
# 7. the benchmark with trained routers (the routing pictures of results/tsa.md came from the removed
#    `python tsa.py picture`; Model.routing_map replaces it)
[ -f "$LOG/bench_ckpt.json" ] || $JOB python bench.py tsa --repeats 5 --ckpt "$OUT/lam0.05_s1/ckpt.pt" --json "$LOG/bench_ckpt.json" > "$LOG/bench_ckpt.log" 2>&1
echo "all done $(date -u +%T)"
# 8. a longer pair (2.5× the tokens): how α and the dense-vs-TSA gap move with more training
run long_dense_s1    --model gpt $M --seed=1 --max_iters=1500 --eval_interval=500
run long_lam0.001_s1 --model tsa $M $SOFT --seed=1 --lam=0.001 --max_iters=1500 --eval_interval=500
echo "long pair done $(date -u +%T)"
# 9. second seed for the single-seed rows above (λ sweep, early exit, hard-gate phase, copy/sort)
for lam in 0 0.01 0.1; do run lam${lam}_s2 --model tsa $M $SOFT --seed=2 --lam=$lam; done
run early_exit_s2 --model tsa $M $SOFT --seed=2 --variant=early_exit
run hardft_lam0.05_s2 --model tsa --dataset shakespeare --init_from="$OUT/lam0.05_s2/ckpt.pt" --lam=0.05 \
    --batch_size=16 --max_iters=150 --hard_ft_iters=150 --warmup_iters=10 --learning_rate=5e-4 --min_lr=5e-5 \
    --eval_interval=150 --eval_iters=10 --log_interval=50 --seed=2
for task in copy sort; do run ${task}_tsa_s2 --model tsa --dataset $task $T $SOFT --seed=2 --lam=0.001; done
for task in copy sort; do run ${task}_dense_s2 --model gpt --dataset $task $T --seed=2; done
echo "second seed done $(date -u +%T)"
