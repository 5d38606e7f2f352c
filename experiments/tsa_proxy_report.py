"""
The table of results/tsa.md's "Paper preset, CPU proxy" section from experiments/tsa_proxy.sh's runs.

  python experiments/tsa_proxy_report.py out/tsa_proxy

Per run (metrics.jsonl of train.py): the best and the last val loss (hard = what sparse inference runs,
the preset's "01" gates), the soft pass on the same batches, hard − soft, hard against the soft-only run of
the same seed (the paper's model), hard against the control of the same seed (softlr_sS: soft training with
the same lr schedule as the branches, hard_ft_lr's restart included), and the share of token-layers really
skipped (hard, per routed layer).
"""
import json
import os
import sys

MECHANISM = {"soft": "paper: soft training only", "train": "last 15% straight-through, routers train",
             "frozen": "last 15% straight-through, routers frozen",
             "calibrate": "last 15% straight-through, routers calibrated to the soft share, then frozen",
             "softlr": "control: soft training only, with the branches' lr schedule"}


def evals(run):
    return [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if r["kind"] == "eval"]


def main(root):
    runs = sorted(d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "done")))
    soft_ref, control = {}, {}
    for d in runs:
        for prefix, ref in (("soft_", soft_ref), ("softlr_", control)):
            if d.startswith(prefix):
                ref[d.split("_")[-1]] = evals(os.path.join(root, d))[-1]["val_soft_loss"]
    print("| run | mechanism | best val (hard), step | last val (hard) | last soft val | hard − soft | "
          "hard vs soft-only run's soft | hard vs the control's soft | token-layers skipped (per layer) | iterations |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in runs:
        ev = evals(os.path.join(root, d))
        best, last = min(ev, key=lambda r: r["val_loss"]), ev[-1]
        kind, seed = d.rsplit("_", 1)
        skips = sorted((k, v) for k, v in last.items() if k.startswith("val_skip_l"))
        rel = [f"{last['val_loss'] / r[seed] - 1:+.2%}" if seed in r else "–" for r in (soft_ref, control)]
        print(f"| {d} | {MECHANISM.get(kind, kind)} | {best['val_loss']:.4f} @ {best['step']} | {last['val_loss']:.4f} | "
              f"{last['val_soft_loss']:.4f} | {last['val_loss'] / last['val_soft_loss'] - 1:+.2%} | {' | '.join(rel)}"
              + f" | {last['val_skipped']:.1%} ({' / '.join(f'{v:.0%}' for _, v in skips)}) | {last['step']} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/tsa_proxy")
