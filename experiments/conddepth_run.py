"""
One controller-only conddepth run from a dense GPT checkpoint, with what train.py does not log: the training
grad-norm (before clipping) every step, and at the end val loss under top-k, sparse top-k and the causal
calibrated-threshold mode. Same optimiser, schedule, batches and eval batches as train.py.

  python experiments/conddepth_run.py --init_from=/work/runs/conddepth/dense.pt --recipe=G3 --seed=42 \
      --out_json=/work/runs/conddepth/G3-s42.json [--ctx=64] [--any conddepth Config flag]

--ctx=N trains and evaluates on N-token windows (N <= the checkpoint's block_size), to fit the CPU budget.
"""
import dataclasses
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import train  # noqa: E402


def main(argv):
    own = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith(("--out_json=", "--ctx="))}
    argv = [a for a in argv if not a.startswith(("--out_json=", "--ctx="))]
    out_json = own["--out_json"]
    cfg, module, _ = train.parse_args(["--model=conddepth", *argv])
    device = common.pick_device(cfg.device)
    meta = common.prepare(cfg.dataset, cfg.data_dir)
    init = common.load_checkpoint(cfg.init_from)
    cfg = dataclasses.replace(cfg, **{k: init["config"][k] for k in common.ARCH_FIELDS})
    cfg = train.resolve(cfg, meta)
    tr, va = common.load_split(cfg.dataset, "train", cfg.data_dir), common.load_split(cfg.dataset, "val", cfg.data_dir)
    torch.manual_seed(cfg.seed)
    model = module.Model(cfg).to(device)
    missing, unexpected = model.load_state_dict(init["model"], strict=False)
    assert not unexpected, unexpected
    if "--ctx" in own:  # train/evaluate on shorter windows than the checkpoint's block_size (CPU budget)
        cfg = dataclasses.replace(cfg, block_size=int(own["--ctx"]))
    opt = common.make_optimizer(model, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    evals, gnorms, train_stats, t0 = [], [], [], time.time()

    ev_cfg = dataclasses.replace(cfg, seed=1337)  # the same val batches for every seed and recipe (paired)

    def evaluate(it):
        ev = common.estimate_loss(model, va, meta, ev_cfg, device, "val")
        evals.append({"step": it, **ev})
        print(f"step {it}: val {ev['loss']:.4f} full {ev['full_ratio']:.3f} p {ev['gate_prob']:.3f} "
              f"l2 {ev.get('qf_qc_l2', float('nan')):.4f} ({time.time() - t0:.0f}s)", flush=True)

    for it in range(cfg.max_iters + 1):
        if it % cfg.eval_interval == 0 or it == cfg.max_iters:
            evaluate(it)
        if it == cfg.max_iters:
            break
        model.on_step(it)
        lr = common.lr_at(it, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = common.get_batch(tr, meta, cfg.batch_size, cfg.block_size, np.random.default_rng([cfg.seed, 0, it, 0]), device)
        _, loss, stats = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorms.append(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf")).item())
        opt.step()
        train_stats.append({k: v.item() for k, v in stats.items()})
    train_time = time.time() - t0

    # inference modes at the end: top-k (non-causal, the paper), its sparse execution, causal thresholds
    final = {"topk": evals[-1]["loss"]}
    final["topk_sparse"] = common.estimate_loss(model, va, meta, ev_cfg, device, "val", sparse=True)["loss"]
    calib = [common.get_batch(tr, meta, cfg.batch_size, cfg.block_size, np.random.default_rng([cfg.seed, 7, k]), device)[0]
             for k in range(10)]
    thr = model.calibrate_thresholds(calib)
    model.mode = "causal"
    ev = common.estimate_loss(model, va, meta, ev_cfg, device, "val")
    final.update(causal=ev["loss"], causal_full_ratio=ev["full_ratio"], thresholds=thr.tolist())
    model.mode = "topk"
    mean = lambda k: float(np.mean([s[k] for s in train_stats if k in s])) if any(k in s for s in train_stats) else None
    label = [s for s in train_stats if s.get("label_step")]
    res = {"config": dataclasses.asdict(cfg), "argv": argv, "evals": evals, "final": final,
           "grad_norm_mean": float(np.mean(gnorms)) if gnorms else None, "grad_norm": gnorms[::10],
           "train_means": {k: mean(k) for k in (train_stats[0] if train_stats else {})},
           "util_on_label_steps": float(np.mean([s["util"] for s in label])) if label else None,
           "rank_on_label_steps": float(np.mean([s["rank"] for s in label])) if label else None,
           "train_time_s": train_time, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "compute_vs_full": module.compute_vs_full(cfg), "infer_vs_full": module.infer_vs_full(cfg)}
    os.makedirs(os.path.dirname(out_json) or ".", exist_ok=True)
    with open(out_json + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(out_json + ".tmp", out_json)
    print(f"done: {out_json} topk {final['topk']:.4f} sparse {final['topk_sparse']:.4f} causal {final['causal']:.4f} "
          f"grad {res['grad_norm_mean']} time {train_time:.0f}s", flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except common.NanorouteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
