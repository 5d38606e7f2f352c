"""Summarise experiments/dtrnet.sh: final val loss, routed fractions per D layer, FLOPs ratio; and re-evaluate
each DTRNet checkpoint with the sparse path (must equal the dense-masked eval).
  python experiments/dtrnet_summary.py out/dtrnet_exp96"""
import glob
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import dtrnet  # noqa: E402


def last_eval(run):
    rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    return [r for r in rows if r["kind"] == "eval"][-1]


def main(out):
    runs = sorted(d for d in glob.glob(os.path.join(out, "*_s*")) if os.path.exists(os.path.join(d, "done")))
    by = {}
    print("| run | seed | val loss | val acc | routed frac (mean D) | per-D-layer routed frac | FLOPs ratio @256 "
          "| sparse-path val loss |")
    print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        name, seed = os.path.basename(run).rsplit("_s", 1)
        ev = last_eval(run)
        cfg = json.load(open(os.path.join(run, "config.json")))
        sparse = ""
        if cfg["model"] == "dtrnet":  # the real sparse path on the trained model, same fixed val batches
            ck = common.load_checkpoint(os.path.join(run, "ckpt.pt"))
            c = dtrnet.Config(**{k: v for k, v in ck["config"].items() if k in dtrnet.Config.__dataclass_fields__})
            m = dtrnet.Model(c)
            m.load_state_dict(ck["model"])
            data = common.load_split(c.dataset, "val", c.data_dir)
            meta = common.load_meta(c.dataset, c.data_dir)
            sp = common.estimate_loss(m, data, meta, c, torch.device("cpu"), "val", sparse=True)
            sparse = f"{sp['loss']:.4f}"
        layers = " ".join(f"L{k[len('val_frac_l'):]}={v:.3f}" for k, v in sorted(ev.items())
                          if k.startswith("val_frac_l"))
        frac = ev.get("val_frac_attn", 1.0)
        flops = ev.get("val_flops_ratio", 1.0)
        print(f"| {name} | {seed} | {ev['val_loss']:.4f} | {ev['val_acc']:.4f} | {frac:.3f} | {layers or '-'} "
              f"| {flops:.3f} | {sparse or '-'} |")
        by.setdefault(name, []).append((ev["val_loss"], frac, flops))
    print()
    dense = statistics.mean(v[0] for v in by.get("dense", [(float("nan"),)]))
    print("| run | seeds | mean val loss | Δ vs dense | mean routed frac | mean FLOPs ratio @256 |")
    print("|---|---|---|---|---|---|")
    for name, vals in by.items():
        loss = statistics.mean(v[0] for v in vals)
        spread = f" ± {statistics.stdev(v[0] for v in vals):.4f}" if len(vals) > 1 else ""
        print(f"| {name} | {len(vals)} | {loss:.4f}{spread} | {100 * (loss / dense - 1):+.2f}% "
              f"| {statistics.mean(v[1] for v in vals):.3f} | {statistics.mean(v[2] for v in vals):.3f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/dtrnet_exp96")
