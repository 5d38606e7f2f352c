"""
The DTRNet reproduction of results/dtrnet.md: dense GPT vs DTRNet bilayer vs trilayer vs skip on Tiny Shakespeare
(chars), the same budget (600 iterations × 12 × 256 tokens), seeds 1 and 2, at 7 layers × 96 wide, ctx 256.

  python experiments/dtrnet.py train              # the 8 runs (a finished one, with a `done` file, is skipped)
  python experiments/dtrnet.py table              # final val loss, routed fractions, FLOPs ratio; sparse-path check
"""
import json
import os

from compare import evals, finished, load, mean_sd, md_table, study_cli, train_run, val_eval

FLAGS = ("--dataset=shakespeare --n_layer=7 --n_head=4 --n_embd=96 --block_size=256 --batch_size=12 --max_iters=600 "
         "--warmup_iters=50 --learning_rate=2e-3 --min_lr=1e-4 --eval_interval=600 --eval_iters=20 "
         "--log_interval=50").split()
RUNS = {"bilayer": ["--model=dtrnet", "--layers=bilayer"],       # T D T D T D T, λ = 8e-4
        "dense": ["--model=gpt"],
        "skip": ["--model=dtrnet", "--layers=bilayer", "--variant=skip"],  # paper A3: D layers never attend
        "trilayer": ["--model=dtrnet", "--layers=trilayer"],     # T D D T D D T
        # MoD at bilayer's inference FLOPs (0.911): C = 0.8 every other block is 0.903 (mod.py)
        "mod-c80": ["--model=mod", "--capacity=0.8"]}


def train(a):
    for seed in (1, 2):
        for name, flags in RUNS.items():
            train_run(os.path.join(a.out, f"{name}_s{seed}"), [*FLAGS, *flags, f"--seed={seed}"], dry=a.dry_run)


def table(a):
    hint = "train them with `python experiments/dtrnet.py train`"
    (root, names), rows, by = finished(a.out, hint, {"dtrnet", "gpt", "mod"}), [], {}
    for run, (name, _, seed) in [(os.path.join(root, d), d.rpartition("_s")) for d in names]:
        if name not in RUNS or not seed.isdigit():
            raise ValueError(f"{run} is not one of this study's runs ({', '.join(RUNS)}, each _s<seed>); {hint}")
        ev, model = evals(run)[-1], json.load(open(os.path.join(run, "config.json")))["model"]
        layers = " ".join(f"L{k[10:]}={v:.3f}" for k, v in sorted(ev.items()) if k.startswith("val_frac_l"))
        frac = ev.get("val_frac_attn", 1 - ev.get("val_skipped", 0.0))  # MoD: the share run
        flops = ev.get("val_flops_ratio", 1.0)
        rows.append([name, seed, f"{ev['val_loss']:.4f}", f"{ev['val_acc']:.4f}", f"{frac:.3f}", layers or "-",
                     f"{flops:.3f}", "-" if model not in ("dtrnet", "mod")  # the real sparse path's val loss:
                     else f"{val_eval(*load(run)[:2], sparse=True)['loss']:.4f}"])
        by.setdefault(name, []).append((ev["val_loss"], frac, flops))
    print(md_table(rows, ["run", "seed", "val loss", "val acc", "routed frac (mean D)", "per-D-layer routed frac",
                          "FLOPs ratio @256", "sparse-path val loss"]))
    dense, rows = mean_sd([v[0] for v in by.get("dense", [(float("nan"),)])])[0], []
    for name, vals in by.items():
        (loss, sd), frac, flops = [mean_sd(list(v)) for v in zip(*vals)]
        spread = f" ± {sd:.4f}" if len(vals) > 1 else ""
        rows.append([name, len(vals), f"{loss:.4f}{spread}", f"{100 * (loss / dense - 1):+.2f}%",
                     f"{frac[0]:.3f}", f"{flops[0]:.3f}"])
    print(md_table(rows, ["run", "seeds", "mean val loss", "Δ vs dense", "mean routed frac", "mean FLOPs ratio @256"]))


if __name__ == "__main__":
    study_cli(__doc__, {"train": train, "table": table}, "out/dtrnet_exp96")
