"""
The table of results/conddepth.md "Fine-tune from a converged dense start (issue 12 item 3)", from the runs of
experiments/conddepth_ft.sh (one JSON per run: experiments/conddepth_eval.py's record, or a dense run's last
metrics line).

  python experiments/conddepth_ft_table.py /work/runs/conddepth_ft [--dense=out/compare/gpt-L6-s1/ckpt.pt]

The dense start's val loss is measured here, on the batches each run was evaluated on (its eval seed, eval_iters,
batch size and context), so every Δ is paired.
"""
import dataclasses
import glob
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402


def dense_val(path, cfg):
    ckpt = common.load_checkpoint(path)
    dcfg = common.Config(**ckpt["config"])
    dcfg = dataclasses.replace(dcfg, **{k: cfg[k] for k in ("eval_iters", "batch_size", "block_size", "seed", "eval_seed")})
    model = common.Model(dcfg)
    model.load_state_dict(ckpt["model"])
    meta = common.load_meta(dcfg.dataset, dcfg.data_dir)
    val = common.load_split(dcfg.dataset, "val", dcfg.data_dir)
    return common.estimate_loss(model, val, meta, dcfg, torch.device("cpu"), "val")["loss"], ckpt["iter"]


def main(argv):
    R = argv[0]
    opts = dict(a[2:].split("=", 1) for a in argv[1:])
    start = opts.get("dense", "out/compare/gpt-L6-s1/ckpt.pt")
    cache = {}
    print("| recipe | iters | lr | val, causal hard (what inference runs) | val, top-k (training mode) "
          "| dense start val | Δ causal vs start | cheap share (causal) | FLOPs saved | command | seed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in sorted(glob.glob(os.path.join(R, "*.json")), key=os.path.getmtime):
        name, rec = os.path.basename(p)[:-5], json.load(open(p))
        if "config" in rec:  # conddepth_eval.py record
            cfg, f = rec["config"], rec["final"]
            causal, topk, cheap, saved = f["causal"], f["topk"], 1 - f["causal_full_ratio"], f["flops_saved_hard"]
            recipe = (f"ρ={cfg['rho']}, {cfg['gate']}, C={cfg['n_controlled']}, r={cfg['cheap_rank']}, "
                      + ("controller-only" if cfg["controller_only"] else "joint (backbone trained too)"))
        else:  # a dense fine-tune: the last eval line of its metrics.jsonl
            cfg = json.load(open(os.path.join(R, name, "config.json")))
            causal, topk, cheap, saved, recipe = rec["val_loss"], None, 0.0, 0.0, "dense GPT, trained on (control)"
        key = tuple(cfg[k] for k in ("eval_iters", "batch_size", "block_size", "seed", "eval_seed"))
        if key not in cache:
            cache[key] = dense_val(start, cfg)
        dval, diter = cache[key]
        fmt = lambda v: "–" if v is None else f"{v:.4f}"
        print(f"| {recipe} | {cfg['max_iters']} | {cfg['learning_rate']:g} | {fmt(causal)} | {fmt(topk)} "
              f"| {dval:.4f} (iter {diter}) | {100 * (causal / dval - 1):+.2f}% | {cheap:.3f} | {saved:.1%} "
              f"| `bash experiments/conddepth_ft.sh {name}` | {cfg['seed']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
