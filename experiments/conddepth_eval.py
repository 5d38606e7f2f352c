"""
Evaluate one conddepth run that train.py wrote, and gather what its metrics.jsonl logged, into one JSON record
for experiments/conddepth_summary.py.

  python experiments/conddepth_eval.py out/conddepth-G3-s42 --out_json=/work/runs/conddepth/G3-s42.json \
      [--ckpt=ckpt.pt] [--eval_iters=N]

At the end of training (ckpt.pt) it measures val loss on the run's fixed evaluation batches (its eval_seed)
under every inference mode: causal thresholds (what inference runs; train.py's val_loss), the same with the
sparse path, and the paper's non-causal top-k (= the training computation, train.py's val_soft_loss) dense and
sparse. From metrics.jsonl: the eval curve and the training means (pre-clipping grad-norm, util/rank on label
steps); train.py must log every step (--log_interval=1) for the grad-norm mean to cover every step.
"""
import dataclasses
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import conddepth as cd  # noqa: E402


def main(argv):
    run_dir = argv[0]
    opts = dict(a[2:].split("=", 1) for a in argv[1:])
    ckpt = common.load_checkpoint(os.path.join(run_dir, opts.get("ckpt", "ckpt.pt")))
    cfg = cd.Config(**ckpt["config"])
    if "eval_iters" in opts:
        cfg = dataclasses.replace(cfg, eval_iters=int(opts["eval_iters"]))
    device = common.pick_device(opts.get("device", "cpu"))
    model = cd.Model(cfg).to(device)
    model.load_state_dict(ckpt["model"])
    meta = common.load_meta(cfg.dataset, cfg.data_dir)
    val = common.load_split(cfg.dataset, "val", cfg.data_dir)
    final = {}
    for mode in ("causal", "topk"):
        model.mode = mode
        for sparse in (False, True):
            ev = common.estimate_loss(model, val, meta, cfg, device, "val", sparse=sparse)
            final[mode + ("_sparse" if sparse else "")] = ev["loss"]
            final[mode + "_full_ratio"] = ev["full_ratio"]
            if mode == "causal" and not sparse:
                final["soft"] = ev["soft_loss"]
                final["flops_saved_hard"] = ev["flops_saved_hard"]
    final["thresholds"] = model.thresholds.tolist()
    recs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    evals = [{"step": r["step"], "loss": r["val_loss"], **{k[4:]: v for k, v in r.items() if k.startswith("val_")}}
             for r in recs if r["kind"] == "eval"]
    steps = [r for r in recs if r["kind"] == "train"]
    label = [r for r in steps if r.get("label_step")]
    mean = lambda rows, k: float(np.mean([r[k] for r in rows])) if rows and k in rows[0] else None
    res = {"config": dataclasses.asdict(cfg), "run_dir": run_dir, "evals": evals, "final": final,
           "grad_norm_mean": mean(steps, "grad_norm"), "train_steps_logged": len(steps),
           "util_on_label_steps": mean(label, "util"), "rank_on_label_steps": mean(label, "rank"),
           "train_time_s": next((r["time"] for r in reversed(recs) if r["kind"] == "eval"), None),
           "torch": torch.__version__, "compute_vs_full": cd.compute_vs_full(cfg), "infer_vs_full": cd.infer_vs_full(cfg)}
    out = opts.get("out_json", os.path.join(run_dir, "conddepth_eval.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(out + ".tmp", out)
    print(f"{run_dir}: causal {final['causal']:.4f} (sparse {final['causal_sparse']:.4f}, full {final['causal_full_ratio']:.3f})"
          f", top-k {final['topk']:.4f} (sparse {final['topk_sparse']:.4f}); grad-norm {res['grad_norm_mean']} -> {out}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except common.NanorouteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
