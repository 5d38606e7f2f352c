"""Tables for results/hybrid.md from out/hybrid/<name>-s<seed>/metrics.jsonl (written by experiments/hybrid.sh).
  python experiments/hybrid_summary.py [out/hybrid]"""
import glob
import json
import os
import statistics
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "out/hybrid"
runs = {}
for path in sorted(glob.glob(os.path.join(root, "*", "metrics.jsonl"))):
    name, _, seed = os.path.basename(os.path.dirname(path)).rpartition("-s")
    recs = [json.loads(line) for line in open(path)]
    runs.setdefault(name, {})[int(seed)] = recs


def evals(recs):
    return [r for r in recs if r["kind"] == "eval"]


print("| run | seed | steps | val loss (final) | val acc | L1 GDN % | L2 GDN % | balance | train time s |")
print("|---|---|---|---|---|---|---|---|---|")
for name, seeds in runs.items():
    finals = []
    for seed, recs in sorted(seeds.items()):
        e = evals(recs)[-1]
        finals.append(e["val_loss"])
        fr = lambda k: f"{100 * e[k]:.1f}" if k in e else "–"
        print(f"| {name} | {seed} | {e['step']} | {e['val_loss']:.4f} | {e['val_acc']:.3f} | {fr('val_gdn_frac_l1')} | "
              f"{fr('val_gdn_frac_l2')} | {e.get('val_balance', float('nan')):.3f} | {e['time']:.0f} |")
    if len(finals) > 1:
        print(f"| **{name} mean ± sd** | {len(finals)} seeds | | **{statistics.mean(finals):.4f} ± "
              f"{statistics.stdev(finals):.4f}** | | | | | |")

print("\nGDN fraction over training (eval-mode argmax on the fixed val batches; L1/L2 per run):\n")
routed = {n: s for n, s in runs.items() if "val_gdn_frac_l1" in evals(next(iter(s.values())))[-1]}
for name, seeds in routed.items():
    for seed, recs in sorted(seeds.items()):
        e = evals(recs)
        print(f"- {name} s{seed}: " + ", ".join(
            f"{r['step']}: {100 * r['val_gdn_frac_l1']:.0f}/{100 * r['val_gdn_frac_l2']:.0f}" for r in e))
print("\nTrain-mode (Gumbel-sampled) GDN fraction, mean of the logged steps in each quarter of training (L1/L2):\n")
for name, seeds in routed.items():
    for seed, recs in sorted(seeds.items()):
        tr = [r for r in recs if r["kind"] == "train"]
        n = max(1, len(tr) // 4)
        qs = [tr[i:i + n] for i in range(0, len(tr), n)][:4]
        print(f"- {name} s{seed}: " + ", ".join(
            f"{100 * statistics.mean(r['gdn_frac_l1'] for r in q):.0f}/{100 * statistics.mean(r['gdn_frac_l2'] for r in q):.0f}"
            for q in qs))
