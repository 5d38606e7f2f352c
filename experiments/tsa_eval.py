"""
Final evaluation of finished runs for results/tsa.md: one JSON line per run appended to --out.

  python experiments/tsa_eval.py out/tsa/dense_s1 out/tsa/lam0.001_s1 ... --out /work/runs/tsa/eval.jsonl

gpt runs: val loss. TSA runs: soft val loss, hard val loss for both eval variants (01 / scaled), soft α
(eq. 6 on the soft pass), hard α (fraction executed), max |sparse − eval| logits on one batch and the sparse
val loss. --eval_seed evaluates on another seed's fixed batches (e.g. 1337, the README's dense GPT run).
Early-exit runs: the threshold sweep (α, val loss). All with --eval_iters fixed batches of the run's batch size.
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import tsa  # noqa: E402


def load(run):
    ckpt = common.load_checkpoint(os.path.join(run, "ckpt.pt"))
    c = ckpt["config"]
    if c["model"] == "gpt":
        cfg = common.Config(**{f.name: c[f.name] for f in dataclasses.fields(common.Config) if f.name in c})
        model = common.Model(cfg)
    else:
        cfg = tsa.Config(**c)
        model = tsa.Model(cfg)
    model.load_state_dict(ckpt["model"])
    return model.eval(), cfg, ckpt["iter"]


@torch.no_grad()
def soft_active(model, val, meta, cfg):
    """Per-router soft mean(1 − p_l) (the terms of eq. 6) on the same fixed val batches as estimate_loss."""
    total = 0
    for k in range(cfg.eval_iters):
        x, _ = common.get_batch(val, meta, cfg.batch_size, cfg.block_size, common.eval_rng(cfg.seed, "val", k))
        total = total + torch.stack([(1 - p).mean() for p in model.trunk(model.embed(x), "soft")[1]])
    return (total / cfg.eval_iters).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--eval_iters", type=int, default=50)
    ap.add_argument("--eval_seed", type=int, default=None)
    a = ap.parse_args()
    dev = torch.device("cpu")
    for run in a.runs:
        model, cfg, it = load(run)
        train_seed = cfg.seed
        cfg = dataclasses.replace(cfg, eval_iters=a.eval_iters, seed=cfg.seed if a.eval_seed is None else a.eval_seed)
        meta = common.load_meta(cfg.dataset, cfg.data_dir)
        val = common.load_split(cfg.dataset, "val", cfg.data_dir)
        rec = {"run": run, "model": cfg.model, "iter": it, "seed": train_seed, "eval_seed": cfg.seed, "dataset": cfg.dataset,
               "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "tokens": it * cfg.batch_size * cfg.block_size}
        if cfg.model == "gpt":
            ev = common.estimate_loss(model, val, meta, cfg, dev)
            rec.update(val_loss=ev["loss"], acc=ev["acc"])
        elif cfg.variant == "early_exit":
            rec.update(variant="early_exit", sweep=tsa.exit_sweep(model, val, meta, cfg, dev))
        else:
            rec.update(variant="tsa", lam=cfg.lam, hard_ft_iters=cfg.hard_ft_iters)
            for hv in ("01", "scaled"):
                model.cfg.hard_variant = hv
                ev = common.estimate_loss(model, val, meta, cfg, dev)
                rec.update({f"hard_loss_{hv}": ev["loss"], f"acc_{hv}": ev["acc"], "soft_loss": ev["soft_loss"],
                            "alpha": ev["soft_alpha"], "tlops_saved": common.tlops_saving(ev["soft_alpha"], cfg.n_layer),
                            "alpha_hard": ev["alpha_hard"], "tlops_saved_hard": ev["tlops_saved_hard"],
                            "active": soft_active(model, val, meta, cfg),
                            "hard_active": [ev[f"hard_r{l}"] for l in range(cfg.n_layer - 1)]})
            model.cfg.hard_variant = cfg.hard_variant
            x, _ = common.get_batch(val, meta, cfg.batch_size, cfg.block_size, common.eval_rng(cfg.seed, "val", 0))
            with torch.no_grad():
                ref = model(x)[0]
                for sq in (False, True):
                    model.cfg.skip_queries = sq
                    rec[f"sparse_maxdiff_{'query' if sq else 'ffn'}"] = (model(x, sparse=True)[0] - ref).abs().max().item()
            rec["sparse_loss"] = common.estimate_loss(model, val, meta, cfg, dev, sparse=True)["loss"]
        print(json.dumps(rec), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
