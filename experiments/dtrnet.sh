#!/bin/bash
# DTRNet at CPU scale: dense GPT vs DTRNet bilayer vs trilayer vs skip on Tiny Shakespeare (chars),
# same budget (600 iters × 12 × 256 tokens = 1.8M tokens), 2 seeds. Model: 7 layers × 96 wide, 4 heads,
# context 256 (bilayer = TDTDTDT, trilayer = TDDTDDT). ~0.8M parameters: far below the paper's 360M / 1.3B.
# (A first pilot at 7 × 128, 400 iters × 8 × 256 stopped on the bigram plateau at val loss ~2.4 for dense
# too, where attention does not matter yet; see results/dtrnet.md.)
# Each run holds one CPU slot (1 thread) through /work/bin/cpujob; runs are sequential.
#   bash experiments/dtrnet.sh            # all runs, then the summary table
set -e
cd "$(dirname "$0")/.."
OUT=${OUT:-out/dtrnet_exp96}
LOGS=${LOGS:-/work/runs/dtrnet}
mkdir -p "$OUT" "$LOGS"
COMMON="--dataset shakespeare --n_layer=7 --n_head=4 --n_embd=96 --block_size=256 --batch_size=12
        --max_iters=600 --warmup_iters=50 --learning_rate=2e-3 --min_lr=1e-4 --eval_interval=600
        --eval_iters=20 --log_interval=50"
run() {  # name seed args...
  local name=$1 seed=$2; shift 2
  if [ -f "$OUT/${name}_s$seed/done" ]; then return; fi
  /work/bin/cpujob python train.py $COMMON --seed=$seed --out_dir="$OUT/${name}_s$seed" "$@" \
      > "$LOGS/${name}_s$seed.log" 2>&1
  touch "$OUT/${name}_s$seed/done"
}
for seed in 1 2; do
  run bilayer  $seed --model dtrnet --layers=bilayer
  run dense    $seed --model gpt
  run skip     $seed --model dtrnet --layers=bilayer --variant=skip
  run trilayer $seed --model dtrnet --layers=trilayer
done
/work/bin/cpujob python experiments/dtrnet_summary.py "$OUT" > "$LOGS/summary.md" 2>&1
