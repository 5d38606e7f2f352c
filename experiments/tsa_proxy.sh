#!/bin/bash
# The paper preset on a CPU: a proxy that keeps the paper's tokens per parameter (issue 12 item 2;
# results/tsa.md, "Paper preset, CPU proxy"). One seed per call, from the repo root, one thread:
#   OMP_NUM_THREADS=1 nohup bash experiments/tsa_proxy.sh 1 > out/tsa_proxy/s1.log 2>&1 &
#   OMP_NUM_THREADS=1 BRANCHES="calibrate" bash experiments/tsa_proxy.sh 2   # only some branches
#   python experiments/tsa_proxy_report.py out/tsa_proxy                        # the table
#
# Paper: 6 × 256 (8 heads), 4.80M non-embedding parameters, 5000 × 64 × 128 = 41.0M tokens = 8.53 tokens per
# parameter. Proxy: 4 × 128 (4 heads of 32 dimensions, as the paper's; three routers), 0.800M
# non-embedding parameters, 833 × 64 × 128 = 6.82M tokens = 8.53 per parameter. Everything else is
# `--preset paper` (dropout 0.1, lr 3e-4 → 3e-5 cosine, no warm-up, β2 0.95, wd 0.1, λ = 1e-3, "01" gates,
# dense attention); evals every 236 iterations (and at the end) on 20 fixed batches.
#
# soft: the paper's recipe, soft training only. Its checkpoint at step S = 708 (the last 125 iterations =
# 15%, as 750 of the paper's 5000) is copied when it is written, and each branch resumes from it (same
# weights, optimizer, RNG and batches) with the last 125 iterations straight-through
# (--hard_ft_iters=125 --hard_ft_routers=B):
#   train:     routers train (the straight-through phase of the default recipe)
#   frozen:    routers frozen: only the backbone adapts to their hard decisions
#   calibrate: frozen, after one shift of each router's bias at the first step so that it halts the share
#              of tokens its soft gate claims (mean p_l)
#   soft:      the control, in softlr_sS: no hard phase, only the preset's lr restart for those iterations
#              (hard_ft_lr), so a gain can be told apart from the extra step size
set -u
cd "$(dirname "$0")/.."
S=${1:?usage: tsa_proxy.sh SEED}
OUT=${OUT-out/tsa_proxy}
BRANCHES=${BRANCHES-"calibrate soft train frozen"}
N=833; AT=708
PROXY="--model tsa --dataset shakespeare --preset paper --n_layer=4 --n_head=4 --n_embd=128 --max_iters=$N
       --eval_interval=236 --eval_iters=20 --log_interval=100 --seed=$S"
mkdir -p "$OUT"
base=$OUT/soft_s$S snap=$OUT/snap${AT}_s$S
if [ ! -f "$base/done" ]; then
  echo "== soft_s$S $(date -u +%T)"
  python train.py $PROXY --hard_ft_iters=0 --out_dir="$base" > "$base.log" 2>&1 &
  pid=$!
  until grep -q "\"kind\": \"eval\", \"step\": $AT," "$base/metrics.jsonl" 2>/dev/null; do sleep 5; done
  sleep 15  # ckpt.pt is written (atomically) right after the eval line; the next one comes 125 iterations later
  rm -rf "$snap" && mkdir -p "$snap" && cp "$base"/{ckpt.pt,best.pt,metrics.jsonl,config.json} "$snap"/
  wait $pid && touch "$base/done"
fi
python -c "import torch, sys; assert torch.load(sys.argv[1], weights_only=True)['iter'] == $AT" "$snap/ckpt.pt" || exit 1
for b in $BRANCHES; do
  d=$OUT/${b}_s$S
  [ "$b" = soft ] && d=$OUT/softlr_s$S
  [ -f "$d/done" ] && continue
  echo "== $(basename "$d") $(date -u +%T)"
  rm -rf "$d" && cp -r "$snap" "$d"
  python train.py $PROXY --hard_ft_iters=$((N - AT)) --hard_ft_routers=$b --out_dir="$d" --resume > "$d.log" 2>&1 &&
    touch "$d/done"
done
echo "all done $(date -u +%T)"
