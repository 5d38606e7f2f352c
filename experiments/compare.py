"""
One table for all four routers, against dense GPTs of matched inference cost (issue #7).

  python experiments/compare.py                  # train what is missing, measure, write results/compare.md
  python experiments/compare.py --table-only     # rebuild the table from the JSON records

Every run trains with train.py on shakespeare at one preset and budget (BASE below), 2 seeds. Finished runs
are not redone (out/compare/<run>/ckpt.pt at max_iters); an interrupted one resumes with --resume. Each run's
measurements are written to results/compare/<run>.json; the table and the picture are built only from those
files. Inference FLOPs ratios use common.py's accounting with the hard routing decisions taken on the val set;
wall-clock ratios time the model's sparse path against the dense reference GPT in the same process.
"""
import argparse
import dataclasses
import glob
import importlib
import json
import math
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# 2400 iterations × 8 × 256 ≈ 4.9M tokens: 4× the first table's budget (results/compare_600it.md), where the
# dense line had not converged (issue 12 item 5).
BASE = dict(dataset="shakespeare", n_layer=6, n_head=4, n_embd=128, block_size=256, batch_size=8,
            max_iters=2400, warmup_iters=100, eval_interval=400, eval_iters=20, learning_rate=2e-3)
REF = "gpt-L6"  # the dense reference every ratio is taken against
RUNS = {  # name -> (model, flags): dense line first, then two operating points per router
    "gpt-L6": ("gpt", {}),
    "gpt-L4": ("gpt", {"n_layer": 4}),
    "gpt-L3": ("gpt", {"n_layer": 3}),
    "gpt-L2": ("gpt", {"n_layer": 2}),
    "tsa-lam0.01": ("tsa", {"lam": 0.01}),  # the default recipe: the last 250 iterations straight-through
    "tsa-lam0.1": ("tsa", {"lam": 0.1}),
    "dtrnet-lam8e-4": ("dtrnet", {"lam": 8e-4, "layers": "bilayer"}),
    "dtrnet-lam8e-2": ("dtrnet", {"lam": 8e-2, "layers": "bilayer"}),
    "hybrid-bal0.01": ("hybrid", {"pattern": "G R R R R S", "balance": 0.01}),
    "hybrid-bal0.5": ("hybrid", {"pattern": "G R R R R S", "balance": 0.5}),
    # fine-tuned from the trained dense 6-layer run (its final checkpoint), so they train last; backbone
    # trained too: controller-only cannot end better than its dense start (results/conddepth.md, issue 12)
    "conddepth-rho0.5": ("conddepth", {"rho": 0.5, "init_from": "{gpt-L6}", "max_iters": 800, "learning_rate": 1e-3,
                                       "controller_only": False}),
    "conddepth-rho0.25": ("conddepth", {"rho": 0.25, "init_from": "{gpt-L6}", "max_iters": 800, "learning_rate": 1e-3,
                                        "controller_only": False}),
}
SEEDS = (1, 2)
QUICK = dict(max_iters=6, eval_interval=6, eval_iters=2, warmup_iters=2)  # --quick: a smoke run of the pipeline


def run_dir(out, name, seed):
    return os.path.join(out, f"{name}-s{seed}")


def train(name, seed, out, quick=False):
    """Train one run unless its checkpoint already reached max_iters; resume a partial one."""
    model, flags = RUNS[name]
    d = run_dir(out, name, seed)
    flags = {**BASE, **flags, "seed": seed, "out_dir": d, **(QUICK if quick else {})}
    if "init_from" in flags:
        flags["init_from"] = os.path.join(run_dir(out, flags["init_from"].strip("{}"), seed), "ckpt.pt")
    ckpt = os.path.join(d, "ckpt.pt")
    if os.path.exists(ckpt):
        import common
        if common.load_checkpoint(ckpt)["iter"] >= flags["max_iters"]:
            return d
    argv = [sys.executable, os.path.join(ROOT, "train.py"), f"--model={model}"]
    argv += [f"--{k}={v}" for k, v in flags.items()] + (["--resume"] if os.path.exists(ckpt) else [])
    print(" ".join(argv[1:]), flush=True)
    with open(os.path.join(out, f"{name}-s{seed}.log"), "a") as log:
        subprocess.run(argv, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return d


# ----------------------------------------------------------------------------------------------------
# measurements of one trained run

def load(d, block_size=None):
    """The trained model of run dir d; block_size > trained: positions tiled (for long-context timing)."""
    import common
    import torch
    ckpt = common.load_checkpoint(os.path.join(d, "ckpt.pt"))
    module = importlib.import_module({"gpt": "common", "hybrid": "hybrid_attn"}.get(ckpt["config"]["model"],
                                                                                    ckpt["config"]["model"]))
    cfg = module.Config(**ckpt["config"])
    state = ckpt["model"]
    if block_size and block_size > cfg.block_size:
        reps = math.ceil(block_size / cfg.block_size)
        state = {**state, "wpe.weight": state["wpe.weight"].repeat(reps, 1)[:block_size]}
        cfg = dataclasses.replace(cfg, block_size=block_size)
    model = module.Model(cfg)
    model.load_state_dict(state)
    return model.eval(), cfg, module


def inference_flops(model_name, module, cfg, ev, T):
    """Forward FLOPs per token of the model's sparse inference path, hard decisions measured on val."""
    import common
    if model_name == "gpt":
        return common.dense_flops_per_token(cfg, T)
    if model_name == "tsa":
        return module.flops_per_token(cfg, T, ev["alpha_hard"], mode="query")
    if model_name == "dtrnet":
        rho = [ev[f"frac_l{i}"] for i, c in enumerate(cfg.pattern) if c == "D"]
        return module.flops_per_token(cfg, T, rho)
    if model_name == "conddepth":
        ffn = common.flops_ffn(cfg.n_embd, 4 * cfg.n_embd)
        per_layer = module.infer_vs_full(dataclasses.replace(cfg, rho=ev["full_ratio"])) * ffn
        return common.dense_flops_per_token(cfg, T) + cfg.n_controlled * (per_layer - ffn)
    if model_name == "hybrid":
        routed = [k for k in ev if k.startswith("gdn_frac_l")]
        soft = 1 - statistics.mean(ev[k] for k in routed) if routed else 0.0
        return module.flops_per_token(cfg, T, soft, sparse=True)
    raise ValueError(model_name)


def memory_bytes(model_name, cfg, ev, T=1024, bytes_per=4):
    """KV/state bytes held after generating T tokens (B=1), from the measured routing fractions."""
    kv = 2 * T * cfg.n_embd * bytes_per  # one layer caching every token
    if model_name == "dtrnet":
        return sum(kv * (ev[f"frac_l{i}"] if c == "D" else 1.0) for i, c in enumerate(cfg.pattern))
    if model_name == "hybrid":
        H, K = cfg.n_head, cfg.head_k
        V = cfg.gdn_expand_v * K
        gdn = (H * K * V + 3 * H * (2 * K + V)) * bytes_per  # recurrent state + conv tail (kernel 4)
        return sum(gdn if k == "G" else kv + (gdn if k == "R" else 0) for k in cfg.kinds)
    return cfg.n_layer * kv


def measure(name, d, ref_dir, repeats):
    import bench
    import common
    import torch
    model_name = RUNS[name][0]
    model, cfg, module = load(d)
    ref, ref_cfg, _ = load(ref_dir)
    meta = common.load_meta(cfg.dataset, cfg.data_dir)
    val = common.load_split(cfg.dataset, "val", cfg.data_dir)
    ev = common.estimate_loss(model, val, meta, cfg, torch.device("cpu"), "val")
    T = cfg.block_size
    rec = {"run": name, "model": model_name, "seed": cfg.seed, "params": model.num_params(),
           "val_loss": ev["loss"], "val_bpc": ev.get("bpc"), "iters": cfg.max_iters,
           "val_soft_loss": ev.get("soft_loss"),  # the training-mode computation (soft / top-k), for routers
           "flops_ratio": inference_flops(model_name, module, cfg, ev, T) / common.dense_flops_per_token(ref_cfg, T),
           "kv_bytes_1024": memory_bytes(model_name, cfg, ev),
           "kv_ratio_1024": memory_bytes(model_name, cfg, ev) / memory_bytes("gpt", ref_cfg, {}),
           "stats": ev}
    cpu = torch.device("cpu")
    sparse = {} if model_name == "gpt" else {"sparse": True}
    for label, Tm in (("T256", 256), ("T1024", 1024)):
        m, _, _ = load(d, Tm) if Tm > T else (model, cfg, None)
        r, _, _ = load(ref_dir, Tm) if Tm > T else (ref, ref_cfg, None)
        x = torch.from_numpy(val[:8 * Tm].astype("int64")).view(8, Tm) if len(val) >= 8 * Tm else None
        t = bench.timeit({"model": bench.forward(m, x, **sparse), "ref": bench.forward(r, x)}, cpu, repeats)
        rec[f"speedup_{label}"] = t["ref"] / t["model"]
    x, y = bench.batch(cfg, 8, T, cpu)
    model.train(); ref.train()
    t = bench.timeit({"model": bench.train_step(model, x, y, cpu), "ref": bench.train_step(ref, x, y, cpu)},
                     cpu, max(3, repeats // 2))
    rec["train_step_ratio"] = t["model"] / t["ref"]
    return rec


# ----------------------------------------------------------------------------------------------------
# the table (pure functions of the records: tested in tests/test_compare.py)

def group(records):
    """run name -> list of records (one per seed), dense runs first, in RUNS order where known."""
    out = {}
    for r in records:
        out.setdefault(r["run"], []).append(r)
    order = list(RUNS)
    return dict(sorted(out.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0])))


def mean_sd(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def dense_line(groups):
    """(flops_ratio, val_loss) of the dense runs' means, sorted by FLOPs: the matched-cost reference."""
    pts = [(mean_sd([r["flops_ratio"] for r in rs])[0], mean_sd([r["val_loss"] for r in rs])[0])
           for rs in groups.values() if rs[0]["model"] == "gpt"]
    return sorted(pts)


def dense_loss_at(line, flops):
    """Val loss of the dense line at a FLOPs ratio (linear interpolation; outside the range: None)."""
    for (f0, l0), (f1, l1) in zip(line, line[1:]):
        if f0 <= flops <= f1:
            return l0 + (l1 - l0) * (flops - f0) / (f1 - f0) if f1 > f0 else min(l0, l1)
    return None


def verdict(loss, sd, line_loss):
    if line_loss is None:
        return "outside the dense range"
    if loss + sd < line_loss:
        return "beats the dense line"
    if loss - sd > line_loss:
        return "worse than the dense line"
    return "on the dense line (within seed spread)"


def table(records):
    groups = group(records)
    line = dense_line(groups)
    cols = ["run", "seeds", "params", "val loss", "training-mode val", "bpc", "FLOPs ratio", "dense line at that FLOPs",
            "verdict", "speedup T=256", "speedup T=1024", "KV/state @1024", "train step ratio"]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    fmt = lambda m, s, p=3: "–" if m is None else f"{m:.{p}f} ± {s:.{p}f}"
    for name, rs in groups.items():
        loss, sd = mean_sd([r["val_loss"] for r in rs])
        flops = mean_sd([r["flops_ratio"] for r in rs])
        at = dense_loss_at(line, flops[0])
        dense = rs[0]["model"] == "gpt"
        rows.append("| " + " | ".join([
            name, ",".join(str(r["seed"]) for r in rs), f"{rs[0]['params'] / 1e6:.2f}M", fmt(loss, sd),
            fmt(*mean_sd([r.get("val_soft_loss") for r in rs])), fmt(*mean_sd([r.get("val_bpc") for r in rs])), fmt(*flops, 2),
            "–" if at is None or dense else f"{at:.3f}", "dense" if dense else verdict(loss, sd, at),
            fmt(*mean_sd([r["speedup_T256"] for r in rs]), 2), fmt(*mean_sd([r["speedup_T1024"] for r in rs]), 2),
            fmt(*mean_sd([r["kv_ratio_1024"] for r in rs]), 2), fmt(*mean_sd([r["train_step_ratio"] for r in rs]), 2),
        ]) + " |")
    return "\n".join(rows) + "\n"


def plot(records, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: table only")
        return None
    groups = group(records)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    line = dense_line(groups)
    ax.plot([f for f, _ in line], [l for _, l in line], "k-o", label="dense GPTs (matched cost)")
    for name, rs in groups.items():
        if rs[0]["model"] != "gpt":
            ax.scatter([r["flops_ratio"] for r in rs], [r["val_loss"] for r in rs], label=name)
    ax.set_xlabel("inference FLOPs / dense 6-layer GPT")
    ax.set_ylabel("val loss (shakespeare, chars)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "compare"))
    p.add_argument("--results", default=os.path.join(ROOT, "results"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--runs", default="", help="comma-separated subset of run names")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="e.g. 1 or 2: one process per seed fills both cores")
    p.add_argument("--quick", action="store_true", help="a few iterations per run: checks the pipeline only")
    args = p.parse_args(argv)
    rec_dir = os.path.join(args.results, "compare")
    os.makedirs(rec_dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    names = args.runs.split(",") if args.runs else list(RUNS)
    if not args.table_only:
        for seed in map(int, args.seeds.split(",")):
            train(REF, seed, args.out, args.quick)
            for name in names:
                path = os.path.join(rec_dir, f"{name}-s{seed}.json")
                if os.path.exists(path):
                    continue  # finished and measured: not redone
                d = train(name, seed, args.out, args.quick)
                rec = measure(name, d, run_dir(args.out, REF, seed), args.repeats)
                rec["command"] = f"python experiments/compare.py (run {name}, seed {seed})"
                with open(path + ".tmp", "w") as f:
                    json.dump(rec, f, indent=1)
                os.replace(path + ".tmp", path)
                print(f"{name} seed {seed}: val {rec['val_loss']:.4f}, FLOPs ratio {rec['flops_ratio']:.3f}", flush=True)
    records = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(rec_dir, "*.json")))]
    done = {(r["run"], r["seed"]) for r in records}
    missing = [f"{n} seed {sd}" for sd in SEEDS for n in RUNS if (n, sd) not in done]
    md = os.path.join(args.results, "compare.md")
    png = plot(records, os.path.join(args.results, "compare.png"))
    with open(md + ".tmp", "w") as f:
        f.write("# All four routers vs dense GPTs of matched cost\n\n"
                f"Built by `python experiments/compare.py` from {len(records)} JSON records in results/compare/. "
                f"Preset: {json.dumps(BASE)}; seeds {sorted({r['seed'] for r in records})}; values are mean ± sd "
                f"over seeds (± 0.000: one seed). Not run: {', '.join(missing) or 'none'}.\n\n")
        f.write(table(records))
        if png:
            f.write("\n![val loss vs inference FLOPs](compare.png)\n")
    os.replace(md + ".tmp", md)
    print(open(md).read())


if __name__ == "__main__":
    main()
