#!/bin/bash
# issue 12 item 3: conddepth fine-tuned from experiments/compare.py's converged dense start (gpt-L6, seed 1:
# 6 × 128, 4 heads, ctx 256, batch 8, 2400 iters), at compare.py's budget and preset, one run at a time:
#   bash experiments/conddepth_ft.sh                 # every run below, in the order they were done
#   bash experiments/conddepth_ft.sh joint-lr3e-4    # one of them
#   python experiments/conddepth_ft_table.py /work/runs/conddepth_ft   # the table of results/conddepth.md
# Each run evaluates on compare.py's val batches (eval_iters 20 × 8 × 256, eval seed = run seed = 1): the dense
# start's own final val batches, so every Δ is paired. experiments/conddepth_eval.py measures each checkpoint
# under every inference mode into $R/NAME.json. A run whose JSON exists is skipped. EXTRA: flags appended to every run.
set -e
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$(dirname "$0")/.."
R=${R:-/work/runs/conddepth_ft}
DENSE=${DENSE:-out/compare/gpt-L6-s1/ckpt.pt}
mkdir -p $R
# compare.py's BASE (eval every 200 instead of 400: the curve; evaluation does not touch the training RNG)
BASE="--dataset=shakespeare --n_layer=6 --n_head=4 --n_embd=128 --block_size=256 --batch_size=8 --warmup_iters=100
 --eval_interval=200 --eval_iters=20 --seed=1 --init_from=$DENSE"

flags() {  # the flags of one run (conddepth defaults otherwise: G3, C = 2, r = 24, min_lr 1e-5, wd 0.01)
  case $1 in
    ctrl-lr1e-3)         echo "--rho=0.5 --max_iters=800 --learning_rate=1e-3" ;;       # compare.py's RUNS today
    joint-lr3e-4)        echo "--rho=0.5 --max_iters=800 --learning_rate=3e-4 --controller_only=false" ;;
    joint-lr1e-3)        echo "--rho=0.5 --max_iters=800 --learning_rate=1e-3 --controller_only=false" ;;
    joint-lr1e-3-rho0.25) echo "--rho=0.25 --max_iters=800 --learning_rate=1e-3 --controller_only=false" ;;  # not run yet
    ctrl-lr2e-4)         echo "--rho=0.5 --max_iters=800 --learning_rate=2e-4" ;;       # the paper's lr
    joint-lr3e-4-rho0.25) echo "--rho=0.25 --max_iters=800 --learning_rate=3e-4 --controller_only=false" ;;
    dense-ft-lr3e-4)     echo "--max_iters=800 --learning_rate=3e-4 --min_lr=1e-5 --weight_decay=0.01" ;;  # gpt
    *) echo "unknown run $1" >&2; exit 2 ;;
  esac
}

run() {
  local name=$1 model=conddepth
  [ -f $R/$name.json ] && { echo "skip $name"; return; }
  [[ $name == dense-* ]] && model=gpt
  echo "== $name: $(flags $name) ($(date -u +%H:%M:%S))"
  python train.py --model $model $BASE $(flags $name) $EXTRA --out_dir=$R/$name > $R/$name.log 2>&1
  if [ $model = gpt ]; then tail -1 $R/$name/metrics.jsonl > $R/$name.json
  else python experiments/conddepth_eval.py $R/$name --out_json=$R/$name.json | tail -1; fi
}

for name in ${@:-joint-lr3e-4 ctrl-lr1e-3 joint-lr3e-4-rho0.25 dense-ft-lr3e-4 joint-lr1e-3}; do
  run $name
done
echo "done $(date -u +%H:%M:%S)"
