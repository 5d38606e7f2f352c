"""
The one table at GPT-2-small scale on one GPU (results/scale.md): the dense GPT and every router at
--preset gpu, seed 1, equal tokens (1.31B); conddepth's controllers trained on the dense run.

  python experiments/scale.py --device cuda                      # ~4.5 h on one H100 (computed)
  python experiments/scale.py --smoke --device cuda --dataset shakespeare_bpe   # ~3 minutes
  python experiments/scale.py --dry-run                          # the commands; time, memory

A finished run (a `done` file) is skipped, a killed one resumes (train.py --resume); each run's
record is written to results/scale[_smoke]/<run>.json as it finishes. --smoke: the preset's model
(12 × 768, block 1024, micro-batches of 16) for 24 steps of 2 micro-batches, eager, a small eval.
"""
import dataclasses
import json
import os
import statistics
import sys

from compare import ROOT, entry, evals, parser, train_run

RUNS = ("gpt", "tsa", "dtrnet", "hybrid", "conddepth")  # conddepth last: from gpt's checkpoint
SMOKE = dict(max_iters=24, grad_accum=2, warmup_iters=4, eval_interval=24, eval_iters=4,
             log_interval=4, shards=1, compile=False)
MFU = 0.35  # the computed times assume this share of the GPU's bf16 peak (common.GPU's comment)


def flags(model, a, out):
    """train.py's flags of one run."""
    f = {"model": model, "dataset": a.dataset, "preset": "gpu", "seed": 1, "device": a.device,
         "data_dir": a.data_dir, **(SMOKE if a.smoke else {}), **a.override}
    if model == "conddepth":
        f["init_from"] = os.path.join(out, "gpt", "ckpt.pt")
    return [f"--{k}={v}" for k, v in f.items()]


def record(run, model, a):
    """A finished run's line of the table: its final eval, and what its train lines measured
    (the median over the log lines after the first, which holds the warm-up)."""
    cfg = json.load(open(os.path.join(run, "config.json")))
    ev, steps = evals(run)[-1], evals(run, "train")[1:] or evals(run, "train")
    med = lambda k: statistics.median(r[k] for r in steps) if steps[0].get(k) else None  # noqa
    return {"model": model, "device": a.device, "smoke": a.smoke, "val_loss": ev["val_loss"],
            "val_skipped": ev.get("val_skipped"), "flops_saved": ev.get("val_flops_saved_hard"),
            "tokens": cfg["max_iters"] * cfg["batch_size"] * cfg["block_size"] * cfg["grad_accum"],
            "tok_s": med("tok_s"), "mfu": med("mfu"),
            "max_mem_gib": max((r.get("max_mem_gib", 0) for r in steps), default=None) or None,
            "train_seconds": ev["time"], "command": "python experiments/scale.py " + a.argv}


def computed(model, a):
    """The gpu preset's time on one H100/H200 at MFU of 989 TFLOP/s bf16, and its memory by
    train.check_fits' estimate (fp32 activations: an upper bound under bf16): computed."""
    import torch

    import train
    cfg, module, _ = train.parse_args(flags(model, a, "out")[:3])
    cfg = dataclasses.replace(cfg, vocab_size=50257)
    with torch.device("meta"):
        net = train.build(module, cfg)
    params = sum(t.numel() for t in net.state_dict().values())
    tokens = cfg.max_iters * cfg.batch_size * cfg.block_size * cfg.grad_accum
    hours = 3 * net.train_flops_per_token(cfg.block_size) * tokens / (MFU * 989e12) / 3600
    state, act = train.train_memory(cfg, params)
    return f"{model}: computed {hours:.2f} h at {MFU:.0%} MFU, ~{(state + act) / 2**30:.0f} GiB"


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="24 steps a model: the path end to end")
    p.add_argument("--dataset", default="fineweb_edu", help="fineweb_edu, or shakespeare_bpe "
                   "offline (GPT-2 tokens too)")
    p.add_argument("--data_dir", default="data")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", help="the runs' folder (default out/scale or out/scale_smoke)")
    p.add_argument("--results", help="the records' folder (default results/scale[_smoke])")
    p.add_argument("--dry-run", action="store_true", help="print the commands and the computed "
                   "time and memory of each model")
    p.add_argument("--override", type=lambda t: dict(kv.split("=", 1) for kv in t.split(",")), default={},
                   help="k=v,... train.py values over the preset's (a tiny size)")
    a = p.parse_args(argv)
    a.argv = " ".join(sys.argv[1:] if argv is None else argv)
    entry(run, a)


def run(a):
    import common
    name = "scale_smoke" if a.smoke else "scale"
    out = a.out or os.path.join("out", name)
    results = a.results or os.path.join(ROOT, "results", name)
    for model in RUNS:
        if a.dry_run and not a.smoke:
            print(computed(model, a))
        path = os.path.join(results, f"{model}.json")
        if os.path.exists(path):
            print(f"skip {model}: {path}")
            continue
        d = train_run(os.path.join(out, model), flags(model, a, out), dry=a.dry_run)
        if not a.dry_run:
            rec = record(d, model, a)
            common.atomic_write(path, lambda f: f.write(json.dumps(rec, indent=1).encode()))
            print(f"{model}: val {rec['val_loss']:.4f}, {rec['tok_s'] or 0:,.0f} tok/s, "
                  f"MFU {rec['mfu'] or 0:.1%}, wrote {path}", flush=True)


if __name__ == "__main__":
    main()
