"""
All four routers against dense GPTs of matched inference cost: the tables of results/compare.md.

  OMP_NUM_THREADS=1 python experiments/compare.py --jobs 2    # CPU budget: train what is missing, measure
  python experiments/compare.py --budget gpu --jobs 6 --device cuda   # GPU budget: ~7 minutes on one H100
  python experiments/compare.py --table-only                          # rebuild the CPU table from its records

Each run trains with train.py (2 seeds, --jobs at a time; a finished run is not redone), then is
measured into results/compare<_budget>/<run>-s<seed>.json; the tables come from those files only
(the method: results/compare.md).
"""
import argparse
import dataclasses
import glob
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the model files, not this folder's scripts of the same names

# cpu: 2400 iterations × 8 × 256 ≈ 4.9M tokens. gpu: 2000 × 24 × 256 ≈ 12.3M tokens (what the H100 ran).
# 600it: the first, unconverged budget (1.2M tokens); its records are kept for the table only.
BASE = dict(dataset="shakespeare", n_layer=6, n_head=4, n_embd=128, block_size=256, batch_size=8,
            max_iters=2400, warmup_iters=100, eval_interval=400, eval_iters=20, learning_rate=2e-3)
BUDGETS = {"cpu": BASE, "gpu": {**BASE, "max_iters": 2000, "batch_size": 24},
           "600it": {**BASE, "max_iters": 600, "warmup_iters": 60, "eval_interval": 200}}
REF = "gpt-L6"  # the dense reference every ratio is taken against
FT = {"init_from": "{gpt-L6}", "max_iters": 800, "learning_rate": 1e-3}
RUNS = {  # name -> (model, flags): dense line first, then two operating points per router
    "gpt-L6": ("gpt", {}),
    **{f"gpt-L{n}": ("gpt", {"n_layer": n}) for n in (4, 3, 2)},  # shallower dense GPTs
    "tsa-lam0.01": ("tsa", {"lam": 0.01}),  # the default recipe: the last 250 iterations straight-through
    "tsa-lam0.1": ("tsa", {"lam": 0.1}),
    "dtrnet-lam8e-4": ("dtrnet", {"lam": 8e-4, "layers": "bilayer"}),
    "dtrnet-lam8e-2": ("dtrnet", {"lam": 8e-2, "layers": "bilayer"}),
    "hybrid-bal0.01": ("hybrid", {"pattern": "G R R R R S", "balance": 0.01}),
    "hybrid-bal0.5": ("hybrid", {"pattern": "G R R R R S", "balance": 0.5}),
    # fine-tuned from the trained dense 6-layer run (its final checkpoint), backbone trained too:
    # controller-only cannot end better than its dense start (results/conddepth.md)
    "conddepth-rho0.5": ("conddepth", {"rho": 0.5, **FT, "controller_only": False}),
    "conddepth-rho0.25": ("conddepth", {"rho": 0.25, **FT, "controller_only": False}),
    # the control of both: the same dense checkpoint trained on for the same steps with the same flags
    "gpt-L6-ft": ("gpt", FT),
    # MoD: its paper's point (12.5%, every other block) and DTRNet's baseline (70%, every block);
    # isoflop: gpt-L6's training FLOPs: iters_x = dense / MoD training FLOPs per token (mod.py)
    "mod-c12.5": ("mod", {"capacity": 0.125}),
    "mod-c70-every": ("mod", {"capacity": 0.7, "every": 1}),
    "mod-c12.5-isoflop": ("mod", {"capacity": 0.125, "iters_x": 1.7933}),
}
SEEDS = (1, 2)
QUICK = dict(max_iters=6, eval_interval=6, eval_iters=2, warmup_iters=2)  # --quick: a smoke run of the pipeline


def run_dir(out, name, seed):
    return os.path.join(out, f"{name}-s{seed}")


def parent(name):
    """The run whose final checkpoint this run starts from (None: trained from scratch)."""
    init = RUNS.get(name, ("", {}))[1].get("init_from")
    return init.strip("{}") if init else None


def train(name, seed, out, base, quick=False, device="auto"):
    """Train one run (train_run: a finished one is not redone, a partial one resumes)."""
    model, flags = RUNS[name]
    d = run_dir(out, name, seed)
    flags = {**base, **flags, "seed": seed, "device": device, **(QUICK if quick else {})}
    if "iters_x" in flags:  # a multiple of the budget's steps
        flags["max_iters"] = round(flags["max_iters"] * flags.pop("iters_x"))
    if parent(name):
        flags["init_from"] = os.path.join(run_dir(out, parent(name), seed), "ckpt.pt")
    return train_run(d, [f"--model={model}", *(f"--{k}={v}" for k, v in flags.items())])


def schedule(tasks, deps, work, jobs):
    """work(task) for every task, `jobs` at a time, each after its deps that are in `tasks`; returns
    the tasks in the order they finished. The first failure stops new starts and is raised."""
    pending, running, done = list(tasks), {}, []
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        while pending or running:
            ready = [t for t in pending if all(d in done or d not in tasks for d in deps.get(t, ()))]
            for t in ready[:max(1, jobs) - len(running)]:
                pending.remove(t)
                running[pool.submit(work, t)] = t
            if not running:
                raise ValueError(f"circular dependencies among {pending}")
            for f in wait(running, return_when=FIRST_COMPLETED)[0]:
                t = running.pop(f)
                f.result()
                done.append(t)
    return done


def load(d, block_size=None, device="cpu"):
    """The trained model of run dir d; block_size > trained: positions tiled (for long-context timing)."""
    import common
    from train import model_module
    ckpt = common.load_checkpoint(os.path.join(d, "ckpt.pt"))
    module = model_module(ckpt["config"]["model"])[1]
    cfg, state = module.Config(**ckpt["config"]), ckpt["model"]
    if block_size and block_size > cfg.block_size:
        reps = math.ceil(block_size / cfg.block_size)
        state = {**state, "wpe.weight": state["wpe.weight"].repeat(reps, 1)[:block_size]}
        cfg = dataclasses.replace(cfg, block_size=block_size)
    model = module.Model(cfg)
    model.load_state_dict(state)
    return model.to(device).eval(), cfg, module


def val_eval(model, cfg, device="cpu", **kw):
    """common.estimate_loss on cfg's fixed val batches (kw: sparse=True, the sparse path)."""
    import common
    import torch
    val, meta = common.load_split(cfg.dataset, "val", cfg.data_dir), common.load_meta(cfg.dataset, cfg.data_dir)
    return common.estimate_loss(model, val, meta, cfg, torch.device(device), "val", **kw)


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
    if model_name == "mod":
        rho = [1 - ev[f"skip_l{i}"] for i, c in enumerate(cfg.pattern) if c == "R"]
        return module.flops_per_token(cfg, T, rho)
    raise ValueError(model_name)


def memory_bytes(model_name, cfg, ev, T=1024, bytes_per=4):
    """KV/state bytes held after generating T tokens (B=1), from the measured routing fractions."""
    kv = 2 * T * cfg.n_embd * bytes_per  # one layer caching every token
    if model_name == "dtrnet":
        return sum(kv * (ev[f"frac_l{i}"] if c == "D" else 1.0) for i, c in enumerate(cfg.pattern))
    if model_name == "mod":
        return kv * sum(1 - ev[f"skip_l{i}"] if k == "R" else 1 for i, k in enumerate(cfg.pattern))
    if model_name == "hybrid":
        H, K, V = cfg.n_head, cfg.head_k, cfg.gdn_expand_v * cfg.head_k
        gdn = (H * K * V + 3 * H * (2 * K + V)) * bytes_per  # recurrent state + conv tail (kernel 4)
        return sum(gdn if k == "G" else kv + (gdn if k == "R" else 0) for k in cfg.kinds)
    return cfg.n_layer * kv


def measure(name, d, ref_dir, repeats, device):
    import bench
    import common
    import torch
    model_name = RUNS[name][0]
    model, cfg, module = load(d, device=device)
    ref, ref_cfg, _ = load(ref_dir, device=device)
    val, ev = common.load_split(cfg.dataset, "val", cfg.data_dir), val_eval(model, cfg, device)
    T = cfg.block_size
    rec = {"run": name, "model": model_name, "seed": cfg.seed, "params": model.num_params(),
           "val_loss": ev["loss"], "val_bpc": ev.get("bpc"), "iters": cfg.max_iters,
           "val_soft_loss": ev.get("soft_loss"),  # the training-mode computation (soft / top-k), for routers
           "flops_ratio": inference_flops(model_name, module, cfg, ev, T) / common.dense_flops_per_token(ref_cfg, T),
           "kv_bytes_1024": memory_bytes(model_name, cfg, ev),
           "kv_ratio_1024": memory_bytes(model_name, cfg, ev) / memory_bytes("gpt", ref_cfg, {}),
           "device": device.type, "stats": ev}
    sparse = {} if model_name == "gpt" else {"sparse": True}
    for label, Tm in (("T256", 256), ("T1024", 1024)):
        m, _, _ = load(d, Tm, device) if Tm > T else (model, cfg, None)
        r, _, _ = load(ref_dir, Tm, device) if Tm > T else (ref, ref_cfg, None)
        x = torch.from_numpy(val[:8 * Tm].astype("int64")).view(8, Tm).to(device)
        t = bench.timeit({"model": bench.forward(m, x, **sparse), "ref": bench.forward(r, x)}, device, repeats)
        rec[f"speedup_{label}"] = t["ref"] / t["model"]
    x, y = bench.batch(cfg, 8, T, device)
    model.train(); ref.train()
    t = bench.timeit({"model": bench.train_step(model, x, y, device), "ref": bench.train_step(ref, x, y, device)},
                     device, max(3, repeats // 2))
    rec["train_step_ratio"] = t["model"] / t["ref"]
    return rec


def md_table(rows, cols):
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows]) + "\n"


def group(records):
    """run name -> list of records (one per seed), in RUNS order where known (dense line first)."""
    out, order = {}, list(RUNS)
    for r in records:
        out.setdefault(r["run"], []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0])))


def mean_sd(xs):
    xs = [x for x in xs if x is not None]
    return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (None, None)


def on_line(name, rs):
    """Dense runs trained from scratch make the dense line (a control has had more training)."""
    return rs[0]["model"] == "gpt" and parent(name) is None


def dense_line(groups):
    return sorted((mean_sd([r["flops_ratio"] for r in rs])[0], mean_sd([r["val_loss"] for r in rs])[0])
                  for name, rs in groups.items() if on_line(name, rs))


def dense_loss_at(line, flops):
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


def control_of(name):
    """The dense run trained on from the same checkpoint for the same steps (None: none, or gpt)."""
    model, flags = RUNS.get(name, ("", {}))
    if model == "gpt" or not parent(name):
        return None
    return next((n for n, (m, f) in RUNS.items() if m == "gpt" and parent(n) == parent(name)
                 and f.get("max_iters") == flags.get("max_iters")), None)


def control_verdict(rs, controls):
    """Paired by seed: the mean ± sd of (run − control) val loss, and what it says (sd: the seed spread)."""
    ctl = {r["seed"]: r["val_loss"] for r in controls}
    diffs = [r["val_loss"] - ctl[r["seed"]] for r in rs if r["seed"] in ctl]
    if not diffs:
        return "control not run"
    d, sd = mean_sd(diffs)
    word = ("better than its control" if d + sd < 0 else "worse than its control" if d - sd > 0
            else "level with its control (within seed spread)")
    return f"{word} ({d:+.3f} ± {sd:.3f})"


def table(records):
    groups, rows = group(records), []
    line = dense_line(groups)
    fmt = lambda m, s, p=3: "–" if m is None else f"{m:.{p}f} ± {s:.{p}f}"
    col = lambda rs, k, p=2: fmt(*mean_sd([r.get(k) for r in rs]), p)
    for name, rs in groups.items():
        loss, sd = mean_sd([r["val_loss"] for r in rs])
        flops = mean_sd([r["flops_ratio"] for r in rs])[0]
        at = dense_loss_at(line, flops)
        vs_line, vs_control = "dense", "–"
        if not on_line(name, rs):
            vs_line = verdict(loss, sd, at) + (f" (with {rs[0]['iters']} more steps)" if parent(name) else "")
            if "iters_x" in RUNS.get(name, ("", {}))[1]:  # isoFLOP: more steps, not on the line
                vs_line += f" ({rs[0]['iters']} steps: {REF}'s training FLOPs)"
            if control_of(name):
                vs_control = control_verdict(rs, groups.get(control_of(name), []))
            elif rs[0]["model"] == "gpt" and parent(name):
                vs_control = "the control"
        rows.append([name, ",".join(str(r["seed"]) for r in rs), f"{rs[0]['params'] / 1e6:.2f}M", fmt(loss, sd),
                     col(rs, "val_soft_loss", 3), col(rs, "val_bpc", 3), col(rs, "flops_ratio"),
                     "–" if at is None or on_line(name, rs) else f"{at:.3f}", vs_line, vs_control,
                     col(rs, "speedup_T256"), col(rs, "speedup_T1024"), col(rs, "kv_ratio_1024"),
                     col(rs, "train_step_ratio")])
    return md_table(rows, ["run", "seeds", "params", "val loss", "training-mode val", "bpc", "FLOPs ratio",
                           "dense line at that FLOPs", "vs dense line", "vs its control (equal training)",
                           "speedup T=256", "speedup T=1024", "KV/state @1024", "train step ratio"])


def write_section(md, key, text):
    """Replace (or append) the page's section <!-- key --> ... <!-- /key -->, keeping the rest."""
    import common
    start, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    page = open(md).read() if os.path.exists(md) else "# All four routers vs dense GPTs of matched cost\n"
    head, found, rest = page.partition(start)
    block = f"{start}\n{text.rstrip()}\n{end}\n"
    page = head + block + rest.split(end, 1)[1].lstrip("\n") if found else page.rstrip("\n") + "\n\n" + block
    common.atomic_write(md, lambda f: f.write(page.encode()))


def section(budget, records, rec_dir):
    base = BUDGETS[budget]
    tokens = base["max_iters"] * base["batch_size"] * base["block_size"]
    done = {(r["run"], r["seed"]) for r in records}
    missing = [f"{n} seed {sd}" for sd in SEEDS for n in RUNS if (n, sd) not in done]
    flag = "" if budget == "cpu" else f" --budget {budget}"
    return (f"## `--budget {budget}`: {base['max_iters']} × {base['batch_size']} × {base['block_size']} tokens "
            f"({tokens / 1e6:.1f}M) per run\n\n"
            f"From {len(records)} JSON records in results/{os.path.basename(rec_dir)}/; preset {json.dumps(base)}; "
            f"seeds {sorted({r['seed'] for r in records})}; mean ± sd over seeds (± 0.000: one seed). "
            f"Not run: {', '.join(missing) or 'none'}.\n\n"
            f"`python experiments/compare.py{flag} --table-only`\n\n" + table(records))


def train_run(out_dir, flags, after=None, dry=False):
    """python train.py FLAGS --out_dir=OUT_DIR (log: OUT_DIR.log), after(out_dir), a `done` file; a
    rerun skips, finishes or resumes each run: a study goes on where it stopped. dry: print only."""
    path = os.path.join(ROOT, out_dir)
    if os.path.exists(os.path.join(path, "done")):
        print(f"skip {out_dir}")
    elif dry:
        print("python train.py " + shlex.join([*flags, f"--out_dir={out_dir}"]))
    else:
        import common
        ckpt, cfg = os.path.join(path, "ckpt.pt"), os.path.join(path, "config.json")
        if not (os.path.exists(ckpt) and os.path.exists(cfg)
                and common.load_checkpoint(ckpt)["iter"] >= json.load(open(cfg))["max_iters"]):
            mode = [] if "--resume" in flags else ["--resume" if os.path.exists(ckpt) else "--overwrite"]
            argv = [*flags, f"--out_dir={out_dir}", *mode]
            print("python train.py " + shlex.join(argv), flush=True)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".log", "a") as f:
                subprocess.run([sys.executable, "train.py", *argv], check=True, cwd=ROOT, stdout=f,
                               stderr=subprocess.STDOUT)
        if after:
            after(path)
        open(os.path.join(path, "done"), "w").close()
    return path


def parser(doc):
    """argparse with the script's docstring as its --help, and a bad value as one `error:` line, exit 2."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: sys.exit(print(f"error: {message}", file=sys.stderr) or 2)
    return p


def csv(cast=str, choices=(), keep=False):
    """An argparse type: 'a,b' -> [cast(a), cast(b)] (keep: the checked texts, '0.70' stays)."""
    def parse(text):
        try:
            items = [(cast(x), x)[keep] for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {cast.__name__}s, got {text!r}")
        bad = [str(x) for x in items if choices and x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(choices)}")
        return items
    return parse


def entry(main, *args):
    """Run a script's command; bad input or a failed train.py run: one `error:` line, exit 2."""
    from common import NanorouteError  # here: --help and argparse's errors need no torch
    try:
        return main(*args)
    except (NanorouteError, OSError, ValueError, subprocess.CalledProcessError) as e:
        if isinstance(e, subprocess.CalledProcessError):
            e = f"{shlex.join(e.cmd[1:])} failed (exit {e.returncode}); see the run's .log"
        elif isinstance(e, OSError) and e.filename:
            e = f"{e.filename}: {e.strerror}"
        sys.exit(print(f"error: {e}", file=sys.stderr) or 2)


def finished(root, hint, models=None):
    """(root, the names of its runs that finished, with a `done` file); none is a one-line error saying how. Rule: a
    run folder handed to a study is validated before use: a train.py run of one of models, with an eval line."""
    root = os.path.join(ROOT, root)
    runs = sorted(d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "done"))) \
        if os.path.isdir(root) else []
    if not runs:
        raise ValueError(f"no finished runs in {root}: {hint}")
    for run in [os.path.join(root, d) for d in runs] if models else ():
        try:
            model, last = json.load(open(os.path.join(run, "config.json")))["model"], evals(run)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{run} is not a train.py run ({type(e).__name__}: {e}); {hint}")
        if model not in models:
            raise ValueError(f"{run} is a --model {model} run; this study's runs are "
                             f"{', '.join(sorted(models))}: pass the --out it trained into, or {hint}")
        if not last:
            raise ValueError(f"{run}/metrics.jsonl has no eval line: the run did not finish; {hint}")
    return root, runs


def check_rows(path, rows, where, what, fix, needs):
    """Rule: a file read from outside is validated before use: each of its rows (JSON values) is an object with
    the keys needs(row) names (what its tables read), else one line naming the file, the row and the fix."""
    for i, r in enumerate(rows, 1):
        missing = [k for k in needs(r) if k not in r] if isinstance(r, dict) else None
        if missing != []:
            why = f"no {', '.join(missing)}" if missing else "not an object"
            raise ValueError(f"{path} {where} {i} is not {what} ({why}); {fix}")
    return rows


def study_cli(doc, commands, out, argv=None):
    """A study script's command line, CMD [--out DIR] [--dry-run]; runs CMD."""
    p = parser(doc)
    p.add_argument("cmd", choices=list(commands))
    p.add_argument("--out", default=out, help="the runs' folder")
    p.add_argument("--dry-run", action="store_true", help="print the train.py commands only")
    a = p.parse_args(argv)
    entry(commands[a.cmd], a)


def evals(run, kind="eval"):
    """The `kind` lines of a train.py run's metrics.jsonl (the last eval line: the final model)."""
    return [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if r["kind"] == kind or not kind]


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--budget", default="cpu", choices=BUDGETS, help="tokens per run: cpu 4.9M, gpu 12.3M, 600it 1.2M")
    p.add_argument("--jobs", type=int, default=1, help="training processes at a time (CPU: one per core with "
                   "OMP_NUM_THREADS=1; one H100 ran 6)")
    p.add_argument("--device", default="auto", help="passed to train.py and used for the measurements")
    p.add_argument("--out", help="run dirs (default out/compare<_budget>)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--runs", type=csv(str, RUNS), default=list(RUNS), help="comma-separated subset of run names")
    p.add_argument("--seeds", type=csv(int), default=list(SEEDS), help="e.g. 1 or 1,2")
    p.add_argument("--quick", action="store_true", help="a few iterations per run; records and table under --out")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.repeats < 1:
        p.error("--jobs and --repeats must be >= 1")
    entry(run, args)


def run(args):
    suffix = "" if args.budget == "cpu" else f"_{args.budget}"
    out = args.out or os.path.join(ROOT, "out", "compare" + suffix + ("_quick" if args.quick else ""))
    results = os.path.join(out, "results") if args.quick else os.path.join(ROOT, "results")
    rec_dir = os.path.join(results, "compare" + suffix)
    record = lambda n, s: os.path.join(rec_dir, f"{n}-s{s}.json")  # noqa: E731
    if not args.table_only:
        import bench
        import common
        device = common.pick_device(args.device)
        if args.quick:
            bench.MIN_SECONDS, args.repeats = 0.0, 1
        todo = [(n, s) for s in args.seeds for n in args.runs if not os.path.exists(record(n, s))]
        tasks = {(REF, s) for _, s in todo}  # every measurement needs the reference; every run its parent
        for n, s in todo:
            while n:
                tasks.add((n, s))
                n = parent(n)
        tasks = sorted(tasks, key=lambda t: (t[1], list(RUNS).index(t[0])))
        deps = {(n, s): [(parent(n), s)] for n, s in tasks if parent(n)}
        os.makedirs(rec_dir, exist_ok=True)
        schedule(tasks, deps, lambda t: train(*t, out, BUDGETS[args.budget], args.quick, str(device)), args.jobs)
        for name, seed in todo:  # measured one at a time, after every training has ended
            rec = measure(name, run_dir(out, name, seed), run_dir(out, REF, seed), args.repeats, device)
            rec["command"] = f"python experiments/compare.py --budget {args.budget} (run {name}, seed {seed})"
            common.atomic_write(record(name, seed), lambda f: f.write(json.dumps(rec, indent=1).encode()))
            print(f"{name} seed {seed}: val {rec['val_loss']:.4f}, FLOPs ratio {rec['flops_ratio']:.3f}", flush=True)
    records = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(rec_dir, "*.json")))]
    if not records:  # e.g. the GPU section, copied from the H100's files until its records exist
        raise ValueError(f"no records in {rec_dir}: nothing to tabulate, results/compare.md left as it is")
    text = section(args.budget, records, rec_dir)
    write_section(os.path.join(results, "compare.md"), args.budget, text)
    print(text)


if __name__ == "__main__":
    main()
