"""
The hybrid GDN/softmax reproduction of results/hybrid.md: static `G G G S` vs dynamic `G R R S` (balance
α ∈ {0, 0.01, 0.5}) vs all-softmax `S S S S` on Tiny Shakespeare (chars), 4 layers × 128, ctx 128, batch 8,
400 iterations, seeds 1 and 2; then static, dynamic α = 0.01 and all-softmax at 1200 iterations.

  python experiments/hybrid.py train              # every run (a finished one, with a `done` file, is skipped)
  python experiments/hybrid.py table              # final val loss and GDN shares, and the GDN shares over training
"""
import os
import statistics

from compare import evals, finished, mean_sd, md_table, study_cli, train_run

FLAGS = ("--model=hybrid --dataset=shakespeare --n_layer=4 --n_head=4 --n_embd=128 --block_size=128 --batch_size=8 "
         "--learning_rate=2e-3 --eval_iters=10 --log_interval=10").split()
SHORT = ["--max_iters=400", "--warmup_iters=40", "--eval_interval=50"]
LONG = ["--max_iters=1200", "--warmup_iters=100", "--eval_interval=100"]  # 3× the steps
RUNS = {"dyn_a0.01": ["--pattern=G R R S", "--balance=0.01"], "static_GGGS": ["--pattern=G G G S"],
        "softmax_SSSS": ["--pattern=S S S S"], "dyn_a0": ["--pattern=G R R S", "--balance=0"],
        "dyn_a0.5": ["--pattern=G R R S", "--balance=0.5"]}


def train(a):
    for prefix, budget, names in (("", SHORT, RUNS), ("long1200_", LONG, ["dyn_a0.01", "static_GGGS", "softmax_SSSS"])):
        for seed in (1, 2):
            for name in names:
                out = os.path.join(a.out, f"{prefix}{name}-s{seed}")
                train_run(out, [*FLAGS, *budget, *RUNS[name], f"--seed={seed}"], dry=a.dry_run)


def table(a):
    hint = "train them with `python experiments/hybrid.py train`"
    (root, names), runs, rows = finished(a.out, hint, {"hybrid"}), {}, []
    for d in names:
        name, _, seed = d.rpartition("-s")
        runs.setdefault(name, {})[int(seed)] = evals(os.path.join(root, d), kind=None)
    for name, seeds in runs.items():
        finals = [[r for r in recs if r["kind"] == "eval"][-1] for _, recs in sorted(seeds.items())]
        for seed, e in zip(sorted(seeds), finals):
            fr = lambda k: f"{100 * e[k]:.1f}" if k in e else "–"  # noqa: E731
            rows.append([name, seed, e["step"], f"{e['val_loss']:.4f}", f"{e['val_acc']:.3f}", fr("val_gdn_frac_l1"),
                         fr("val_gdn_frac_l2"), f"{e.get('val_balance', float('nan')):.3f}", f"{e['time']:.0f}"])
        if len(finals) > 1:
            m, sd = mean_sd([e["val_loss"] for e in finals])
            rows.append([f"**{name} mean ± sd**", f"{len(finals)} seeds", "", f"**{m:.4f} ± {sd:.4f}**", *[""] * 5])
    print(md_table(rows, ["run", "seed", "steps", "val loss (final)", "val acc", "L1 GDN %", "L2 GDN %", "balance",
                          "train time s"]))
    print("\nGDN share over training (eval-mode argmax on the fixed val batches, `step: L1/L2` in %):\n")
    routed = {n: s for n, s in runs.items() if "val_gdn_frac_l1" in evals(os.path.join(root, f"{n}-s{min(s)}"))[-1]}
    for name, seeds in routed.items():
        for seed, recs in sorted(seeds.items()):
            print(f"- {name} s{seed}: " + ", ".join(f"{r['step']}: {100 * r['val_gdn_frac_l1']:.0f}/"
                  f"{100 * r['val_gdn_frac_l2']:.0f}" for r in recs if r["kind"] == "eval"))
    print("\nTrain-mode (Gumbel-sampled) GDN share, mean of the logged steps in each quarter of training (L1/L2):\n")
    for name, seeds in routed.items():
        for seed, recs in sorted(seeds.items()):
            tr = [r for r in recs if r["kind"] == "train"]
            n = max(1, len(tr) // 4)
            share = lambda q, k: f"{100 * statistics.mean(r[k] for r in q):.0f}"  # noqa: E731
            print(f"- {name} s{seed}: " + ", ".join(f"{share(q, 'gdn_frac_l1')}/{share(q, 'gdn_frac_l2')}"
                                                   for q in [tr[i:i + n] for i in range(0, len(tr), n)][:4]))


if __name__ == "__main__":
    study_cli(__doc__, {"train": train, "table": table}, "out/hybrid")
