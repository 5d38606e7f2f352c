"""
The TSA reproductions of results/tsa.md. Training commands run train.py per run (a run with a `done` file is
skipped; --dry-run prints the commands); table commands read the runs' records.

  python experiments/tsa.py study | budget --seed S   # 4×128 λ sweep, early exit, copy/sort | the paper's token budget
  python experiments/tsa.py table results/tsa_small.jsonl     # their tables, from the `eval` records
  python experiments/tsa.py eval RUN... --out F.jsonl         # one record per run: soft/hard losses, α, sparse check
  python experiments/tsa.py proxy --seed S | proxy-table      # --preset paper at a proxy with its tokens per parameter
  python experiments/tsa.py curve --seeds 1 | curve-table --png F # the proxy's calibrated phase per exec_share
  python experiments/tsa.py grid --model gpt|tsa --dropouts D --lrs LR  # dense GPT / TSA settings at the proxy
"""
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tsa.py, not this script
import compare  # noqa: E402
from compare import ROOT, csv, evals, md_table, train_run  # noqa: E402

SOFT = "--hard_ft_iters=0"  # the soft-only recipe (the paper's): these studies predate the default ST phase
SMALL = ("--dataset=shakespeare --n_layer=4 --n_head=4 --n_embd=128 --block_size=128 --batch_size=16 "
         "--warmup_iters=100 --learning_rate=2e-3 --min_lr=1e-4 --eval_iters=10 --log_interval=100").split()
TASK = ("--n_layer=6 --n_head=4 --n_embd=128 --batch_size=32 --max_iters=600 --warmup_iters=50 "
        "--learning_rate=1e-3 --eval_interval=600 --eval_iters=10 --log_interval=100").split()
PAPER_BUDGET = ("--dataset=shakespeare --n_layer=6 --n_head=4 --n_embd=64 --block_size=128 --batch_size=64 "
                "--max_iters=5000 --warmup_iters=100 --learning_rate=1e-3 --min_lr=1e-4 --beta2=0.95 "
                "--weight_decay=0.1 --eval_interval=1000 --eval_iters=20 --log_interval=250").split()
# the paper preset at a proxy keeping its 8.53 tokens per parameter: 4 × 128, 833 × 64 × 128 tokens; the last
# 125 iterations (15%, as 750 of 5000) branch from the step-708 checkpoint
N, AT = 833, 708
PROXY = (f"--model=tsa --dataset=shakespeare --preset=paper --n_layer=4 --n_head=4 --n_embd=128 --max_iters={N} "
         "--eval_interval=236 --eval_iters=20 --log_interval=100").split()
DENSE = (f"--model=gpt --dataset=shakespeare --n_layer=4 --n_head=4 --n_embd=128 --max_iters={N} --batch_size=64 "
         "--block_size=128 --warmup_iters=0 --beta2=0.95 --weight_decay=0.1 --eval_interval=236 --eval_iters=20 "
         "--log_interval=100").split()  # the proxy's size, budget, optimiser and evals, as a dense GPT
# the tables: the `study` / `budget` settings by run-name prefix, the proxy's runs by kind
GROUPS = {"P_": "paper token budget (6×64, 5000 × 64 × 128 = 41M tokens)",
          "D_": "default preset (6×192, 2250 × 16 × 128 = 4.6M tokens)",
          "": "Shakespeare char, 4×128, 600 × 16 × 128 = 1.2M tokens",
          "long_": "Shakespeare char, 4×128, 1500 × 16 × 128 = 3.1M tokens"}
MECHANISM = {"soft": "paper: soft training only", "train": "last 15% ST, routers train",
             "frozen": "last 15% ST, routers frozen", "calibrate": "last 15% ST, routers calibrated, then frozen",
             "softlr": "control: soft training, the branches' lr schedule"}
# the keys the tables read from an `eval` record, per kind (evaluate writes them)
RECORD_KEYS = {"gpt": ("run", "seed", "val_loss"), "early_exit": ("run", "seed", "sweep"),
               "tsa": ("run", "seed", "lam", "soft_loss", "alpha", "tlops_saved", "alpha_hard", "tlops_saved_hard",
                       "hard_loss_01", "hard_loss_scaled", "active", "hard_active", "sparse_maxdiff_ffn",
                       "sparse_maxdiff_query", "sparse_loss")}
# the tables' number formats: a value, its change against d, an α with the TLOps it saves
f4 = lambda v, n=4: f"{v:.{n}f}"  # noqa: E731
pct = lambda v, d: f"{f4(v)} ({100 * (v / d - 1):+.2f}%)"  # noqa: E731
saved = lambda r, k: f"{f4(r['alpha' + k], 3)} ({100 * r['tlops_saved' + k]:.1f}%)"  # noqa: E731
# the early-exit val loss at α, linear between the two nearest points of its threshold sweep
interp = lambda sweep, alpha: compare.dense_loss_at(  # noqa: E731
    sorted((r["alpha"], r["val_loss"]) for r in sweep), alpha) or float("nan")


def run(out, name, flags, a):
    """One run of a study; its final evaluation (30 fixed val batches) is appended to OUT/eval.jsonl."""
    train_run(os.path.join(out, name), flags, lambda d: record(d, os.path.join(ROOT, out, "eval.jsonl"), 30), a.dry_run)


def study(a):
    """results/tsa.md, "A small-scale study": dense vs TSA at 4×128, seeds 1, 2, and variants."""
    M = SMALL + ["--max_iters=600", "--eval_interval=600"]
    for s in (1, 2):
        run(a.out, f"dense_s{s}", ["--model=gpt", *M, f"--seed={s}"], a)
        for lam in (0.001, 0.05, 0, 0.1, 0.01):
            run(a.out, f"lam{lam}_s{s}", ["--model=tsa", *M, SOFT, f"--seed={s}", f"--lam={lam}"], a)
        run(a.out, f"early_exit_s{s}", ["--model=tsa", *M, SOFT, f"--seed={s}", "--variant=early_exit"], a)
        run(a.out, f"hardft_lam0.05_s{s}", [
            "--model=tsa", "--dataset=shakespeare", f"--init_from={a.out}/lam0.05_s{s}/ckpt.pt", "--lam=0.05",
            "--batch_size=16", "--max_iters=150", "--hard_ft_iters=150", "--warmup_iters=10", "--learning_rate=5e-4",
            "--min_lr=5e-5", "--eval_interval=150", "--eval_iters=10", "--log_interval=50", f"--seed={s}"], a)
        for task in ("copy", "sort"):  # §3.1: [BOS] src [SEP] tgt [EOS]
            tail = "" if s == 1 else f"_s{s}"
            run(a.out, f"{task}_tsa{tail}", ["--model=tsa", f"--dataset={task}", *TASK, SOFT, f"--seed={s}",
                                             "--lam=0.001"], a)
            run(a.out, f"{task}_dense{tail}", ["--model=gpt", f"--dataset={task}", *TASK, f"--seed={s}"], a)
    longer = SMALL + ["--max_iters=1500", "--eval_interval=500", "--seed=1"]  # 2.5× the tokens
    run(a.out, "long_dense_s1", ["--model=gpt", *longer], a)
    run(a.out, "long_lam0.001_s1", ["--model=tsa", *longer, SOFT, "--lam=0.001"], a)


def budget(a):
    """results/tsa.md, "At the paper's token budget": P (6 × 64), D (default), their ST phases."""
    s, D = a.seed, ["--dataset=shakespeare"]

    def ft(name, start, iters, model, *flags):
        run(a.out, f"{name}_s{s}", [f"--model={model}", "--dataset=shakespeare", f"--seed={s}",
                                    f"--init_from={a.out}/{start}_s{s}/ckpt.pt", f"--max_iters={iters}",
                                    "--warmup_iters=20", "--learning_rate=3e-4", "--min_lr=3e-5",
                                    f"--eval_interval={iters}", "--eval_iters=20", "--log_interval=100", *flags], a)
    for pre, flags in (("P", PAPER_BUDGET), ("D", D)):
        run(a.out, f"{pre}_dense_s{s}", ["--model=gpt", *flags, f"--seed={s}"], a)
        run(a.out, f"{pre}_lam0.001_s{s}", ["--model=tsa", *flags, SOFT, "--lam=0.001", f"--seed={s}"], a)
    for lam in (0.001, 0.01, 0.05):
        ft(f"P_hardft_lam{lam}", "P_lam0.001", 500, "tsa", "--batch_size=64", f"--lam={lam}", "--hard_ft_iters=500")
    ft("P_densecont", "P_dense", 500, "gpt", "--batch_size=64")
    for lam in (0.001, 0.01):
        ft(f"D_hardft_lam{lam}", "D_lam0.001", 250, "tsa", f"--lam={lam}", "--hard_ft_iters=250")
    ft("D_densecont", "D_dense", 250, "gpt")
    run(a.out, f"D_lam0_s{s}", ["--model=tsa", *D, SOFT, "--lam=0", f"--seed={s}"], a)
    run(a.out, f"P_lam0.05_s{s}", ["--model=tsa", *PAPER_BUDGET, SOFT, "--lam=0.05", f"--seed={s}"], a)


def record(run, out, eval_iters, eval_seed=None):
    """A run's final evaluation on eval_iters fixed val batches (seed: eval_seed), added to out."""
    import common
    import torch
    import tsa
    dev, (model, cfg, _) = torch.device("cpu"), compare.load(run)
    it = evals(run)[-1]["step"]  # the final checkpoint's iteration
    cfg = dataclasses.replace(cfg, eval_iters=eval_iters, seed=cfg.seed if eval_seed is None else eval_seed)
    meta, val = common.load_meta(cfg.dataset, cfg.data_dir), common.load_split(cfg.dataset, "val", cfg.data_dir)
    rec = {"run": run, "model": cfg.model, "iter": it, "seed": model.cfg.seed,  # model.cfg: the run's, cfg: the eval's
           "eval_seed": cfg.seed, "dataset": cfg.dataset, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
           "tokens": it * cfg.batch_size * cfg.block_size}
    if cfg.model == "gpt":
        ev = common.estimate_loss(model, val, meta, cfg, dev)
        rec.update(val_loss=ev["loss"], acc=ev["acc"])
    elif cfg.variant == "early_exit":
        rec.update(variant="early_exit", sweep=tsa.exit_sweep(model, val, meta, cfg, dev))
    else:
        rec.update(variant="tsa", lam=cfg.lam, hard_ft_iters=cfg.hard_ft_iters)
        batches = [common.get_batch(val, meta, cfg.batch_size, cfg.block_size, common.eval_rng(cfg.seed, "val", k))[0]
                   for k in range(cfg.eval_iters)]
        with torch.no_grad():  # per-router soft mean(1 − p_l), the terms of eq. 6
            active = sum(torch.stack([(1 - p).mean() for p in model.trunk(model.embed(x), "soft")[1]]) for x in batches)
        for hv in ("01", "scaled"):
            model.cfg.hard_variant = hv
            ev = common.estimate_loss(model, val, meta, cfg, dev)
            rec.update({f"hard_loss_{hv}": ev["loss"], f"acc_{hv}": ev["acc"], "soft_loss": ev["soft_loss"],
                        "alpha": ev["soft_alpha"], "tlops_saved": common.tlops_saving(ev["soft_alpha"], cfg.n_layer),
                        "alpha_hard": ev["alpha_hard"], "tlops_saved_hard": ev["tlops_saved_hard"],
                        "active": (active / cfg.eval_iters).tolist(),
                        "hard_active": [ev[f"hard_r{l}"] for l in range(cfg.n_layer - 1)]})
        model.cfg.hard_variant = cfg.hard_variant
        with torch.no_grad():
            ref = model(batches[0])[0]
            for sq in (False, True):
                model.cfg.skip_queries = sq
                diff = (model(batches[0], sparse=True)[0] - ref).abs().max().item()
                rec[f"sparse_maxdiff_{'query' if sq else 'ffn'}"] = diff
        rec["sparse_loss"] = common.estimate_loss(model, val, meta, cfg, dev, sparse=True)["loss"]
    print(json.dumps(rec), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")


def mean_sd(xs, n=4, sign=""):
    m, sd = compare.mean_sd(xs)
    return f"{m:{sign}.{n}f} ± {sd:.{n}f}" if len(xs) > 1 else f"{m:{sign}.{n}f}"


def vs_dense(recs, pre, title):
    """Dense vs TSA of one setting (runs <pre>dense_sS, <pre>lamX_sS) and, with 2 seeds, the mean ± sd per λ."""
    dense = {r["seed"]: r["val_loss"] for k, r in recs.items() if k.startswith(pre + "dense_")}
    tsa = sorted((k, r) for k, r in recs.items() if k.startswith(pre + "lam"))
    d = lambda r: dense.get(r["seed"], float("nan"))  # noqa: E731
    rows = [[f"{k} (λ={r['lam']})", r["seed"], f4(d(r)), *[pct(r[c], d(r)) for c in ("soft_loss", "hard_loss_scaled",
             "hard_loss_01")], saved(r, ""), saved(r, "_hard")] for k, r in tsa]
    for lam in sorted({r["lam"] for _, r in tsa}):
        runs = [r for _, r in tsa if r["lam"] == lam and r["seed"] in dense]
        col = lambda key: mean_sd([r[key] for r in runs])  # noqa: E731
        rel = lambda key: mean_sd([100 * (r[key] / dense[r["seed"]] - 1) for r in runs], 2)  # noqa: E731
        if len(runs) > 1:
            pc = lambda key: mean_sd([100 * r[key] for r in runs], 1)  # noqa: E731
            rows.append([f"mean ± sd, λ={lam} ({len(runs)} seeds)", "", mean_sd([dense[r["seed"]] for r in runs]),
                         *[f"{col(k)} ({rel(k)} %)" for k in ("soft_loss", "hard_loss_scaled")], col("hard_loss_01"),
                         f"{col('alpha')} (saved {pc('tlops_saved')} %)",
                         f"{col('alpha_hard')} (saved {pc('tlops_saved_hard')} %)"])
    return [f"#### Dense vs TSA, {title}", "", md_table(rows, [
        "run", "seed", "dense val", "soft val (Δ%)", "hard scaled (Δ%)", "hard 01 (Δ%)", "soft α (TLOps saved)",
        "hard α (saved)"])] if tsa else []


def parse(line):
    """A records file's line to check: not JSON, no object; a run that is not a path, no run."""
    try:
        r = json.loads(line)
    except ValueError:
        return None
    return {k: v for k, v in r.items() if k != "run" or isinstance(v, str)} if isinstance(r, dict) else r


def table(a):
    """The tables of results/tsa.md's `study` and `budget` sections from `eval` records (JSON lines)."""
    rows = compare.check_rows(a.root, [parse(l) for l in open(a.root)], "line", "an `eval` record",
                              "write them with `python experiments/tsa.py eval`",
                              lambda r: RECORD_KEYS.get(r.get("variant", r.get("model")), ("model",)))
    recs = {os.path.basename(r["run"]): r for r in rows}
    if not recs:
        raise ValueError(f"no records in {a.root}: write them with `python experiments/tsa.py eval`")
    tsa = {k: r for k, r in recs.items() if r.get("variant") == "tsa"}
    out = [line for pre, title in GROUPS.items() for line in vs_dense(recs, pre, title)]
    for pre, start in (("P_", "lam0.001"), ("D_", "lam0.001"), ("", "lam0.05")):  # continued straight-through
        cont = {r["seed"]: r["val_loss"] for k, r in recs.items() if k.startswith(pre + "densecont_")}
        rows = []
        for k, r in sorted(((k, r) for k, r in tsa.items() if k.startswith(pre + "hardft_")),
                           key=lambda kr: (kr[1]["seed"], kr[1]["lam"])):
            s0, c = recs[f"{pre}{start}_s{r['seed']}"], cont.get(r["seed"], float("nan"))
            rows.append([k, f"{f4(s0['soft_loss'])}, {f4(s0['alpha'], 3)}", pct(r["hard_loss_scaled"], s0["soft_loss"]),
                         f4(r["hard_loss_01"]), f4(r["soft_loss"]), saved(r, "_hard"), *([f4(c),
                         f"{100 * (r['hard_loss_scaled'] / c - 1):+.2f}%"] if c == c else ["–", "–"])])
        out += [f"#### Straight-through hard-gate phase from {pre}{start}, {GROUPS[pre]}", "", md_table(rows, [
            "run", "soft model: soft val, soft α", "hard scaled val (vs soft model's soft)", "hard 01 val",
            "soft val after", "hard α (TLOps saved)", "densecont", "hard scaled vs densecont"])] if rows else []
    out += [] if not tsa else ["#### Per-router active fraction (soft mean 1 − p_l / hard fraction executed)", "", md_table(
        [[k] + [f"{s:.3f} / {h:.3f}" for s, h in zip(r["active"], r["hard_active"])] for k, r in tsa.items()],
        ["run"] + [f"r{l}" for l in range(max(len(r["active"]) for r in tsa.values()))]),
        "#### Sparse path check on trained routers", "", md_table(
        [[k, f"{r['sparse_maxdiff_ffn']:.2e}", f"{r['sparse_maxdiff_query']:.2e}", f4(r["sparse_loss"]),
          f"{f4(r['hard_loss_scaled'])} (scaled)"] for k, r in tsa.items()],
        ["run", "max abs logit diff sparse(FFN) vs eval", "sparse(FFN+query) vs eval", "sparse val loss",
         "eval val loss"])]
    for k, r in [(k, r) for k, r in recs.items() if r.get("variant") == "early_exit"]:
        out += [f"#### Early exit ({k}): threshold sweep", "", md_table(
            [[s["threshold"], f4(s["alpha"], 3), f"{100 * s['tlops_saved']:.1f}%", f4(s["val_loss"])]
             for s in r["sweep"]], ["threshold", "α", "TLOps saved", "val loss"]),
            "TSA vs early exit at matched α (early-exit loss interpolated between sweep points; same seed):", "",
            md_table([[q, f4(t["alpha_hard"], 3), f4(min(t["hard_loss_01"], t["hard_loss_scaled"])),
                       f4(interp(r["sweep"], t["alpha_hard"])), f4(t["alpha"], 3), f4(t["soft_loss"]),
                       f4(interp(r["sweep"], t["alpha"]))]
                      for q, t in tsa.items() if t["seed"] == r["seed"] and t["dataset"] == "shakespeare"],
                     ["TSA run", "TSA hard α", "TSA hard val (best variant)", "early exit val at that α",
                      "TSA soft α", "TSA soft val", "early exit val at soft α"])]
    tasks = [r for r in recs.values() if r["dataset"] in ("copy", "sort")]
    rows = [[r["dataset"], "dense", f4(r["acc"]), 1, 0, 1] if r["model"] == "gpt" else
            [r["dataset"], f"TSA λ={r['lam']}", f4(r["acc_scaled"]), f4(r["alpha"], 3),
             f"{100 * r['tlops_saved']:.1f}%", f4(r["alpha_hard"], 3)] for r in tasks]
    out += ["#### copy vs sort (§3.1)", "", md_table(rows, [
        "task", "model", "token acc (hard scaled / dense)", "soft α", "TLOps saved (soft)", "hard α"])] if rows else []
    print("\n".join(out))


def snapshot(a, s):
    """The soft recipe to N iterations (soft_sS); its step-AT checkpoint copied to snap708_sS."""
    base, snap = os.path.join(ROOT, a.out, f"soft_s{s}"), os.path.join(ROOT, a.out, f"snap{AT}_s{s}")
    flags, ckpt = [*PROXY, f"--seed={s}", SOFT], os.path.join(base, "ckpt.pt")
    if a.dry_run:
        return train_run(f"{a.out}/soft_s{s}", flags, dry=True)
    if os.path.exists(os.path.join(base, "done")) and os.path.exists(os.path.join(snap, "ckpt.pt")):
        return
    import common
    import train
    os.makedirs(base, exist_ok=True)
    resume = os.path.exists(ckpt) and common.load_checkpoint(ckpt)["iter"] < AT  # past AT without its snapshot: anew
    flags += [f"--out_dir={a.out}/soft_s{s}", "--resume" if resume else "--overwrite"]
    with open(base + ".log", "a") as log:
        p = subprocess.Popen([sys.executable, "train.py", *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    while not (os.path.exists(ckpt) and common.load_checkpoint(ckpt)["iter"] >= AT):  # written atomically
        if p.poll() not in (None, 0):
            raise common.NanorouteError(f"soft_s{s} failed: see {base}.log")
        time.sleep(1)
    if common.load_checkpoint(ckpt)["iter"] != AT:
        raise common.NanorouteError(f"soft_s{s} went past step {AT} before its checkpoint was copied")
    shutil.rmtree(snap, ignore_errors=True)
    shutil.copytree(base, snap, ignore=lambda d, names: set(names) - set(train.RUN_FILES))
    if p.wait():
        raise common.NanorouteError(f"soft_s{s} failed: see {base}.log")
    open(os.path.join(base, "done"), "w").close()


def branch(a, s, name, flags):
    """The last N − AT iterations from the snapshot (same weights, optimizer, RNG and batches) with `flags`."""
    snapshot(a, s)
    d = os.path.join(ROOT, a.out, name)
    if not a.dry_run and not os.path.exists(os.path.join(d, "done")):
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(os.path.join(ROOT, a.out, f"snap{AT}_s{s}"), d)
    train_run(os.path.join(a.out, name), [*PROXY, f"--seed={s}", f"--hard_ft_iters={N - AT}", *flags, "--resume"],
              dry=a.dry_run)


def proxy(a):
    """results/tsa.md, "Paper preset, CPU proxy": soft_sS, then each branch of its last 15%."""
    for b in a.branches:
        branch(a, a.seed, f"{'softlr' if b == 'soft' else b}_s{a.seed}", [f"--hard_ft_routers={b}"])


def finals(root, names):
    """name -> (kind, seed, its eval lines) of each finished run <kind>_s<seed>."""
    return {d: (*d.rpartition("_s")[::2], evals(os.path.join(root, d))) for d in names}


def references(runs):
    """seed -> final soft val of the paper's soft-only run (soft_sS) and of the control (softlr_sS)."""
    return {k: {s: ev[-1]["val_soft_loss"] for kind, s, ev in runs.values() if kind == k} for k in ("soft", "softlr")}


def proxy_table(a):
    """Per proxy run: best and last val (hard "01" gates), soft val, hard vs the references."""
    runs, rows = finals(*compare.finished(a.root, "train them with `python experiments/tsa.py proxy --seed S`")), []
    for d, (kind, seed, ev) in runs.items():
        if kind not in MECHANISM:
            continue
        best, last = min(ev, key=lambda r: r["val_loss"]), ev[-1]
        skips = " / ".join(f"{v:.0%}" for k, v in sorted(last.items()) if k.startswith("val_skip_l"))
        rel = [f"{last['val_loss'] / r[seed] - 1:+.2%}" if seed in r else "–" for r in references(runs).values()]
        rows.append([d, MECHANISM[kind], f"{best['val_loss']:.4f} @ {best['step']}", f4(last["val_loss"]),
                     f4(last["val_soft_loss"]), f"{last['val_loss'] / last['val_soft_loss'] - 1:+.2%}", *rel,
                     f"{last['val_skipped']:.1%} ({skips})", last["step"]])
    print(md_table(rows, ["run", "mechanism", "best val (hard), step", "last val (hard)", "last soft val",
                          "hard − soft", "hard vs soft-only run's soft", "hard vs the control's soft",
                          "token-layers skipped (per layer)", "iterations"]))


def curve(a):
    """Per seed and share S, the branch calibrated to exec_share S, into share<S>_s<seed>."""
    for s, share in itertools.product(a.seeds, a.shares):
        branch(a, s, f"share{share}_s{s}", ["--hard_ft_routers=calibrate", f"--exec_share={share}"])


def setting(run):
    """A run's (dropout, peak lr), from its config.json."""
    return tuple(json.load(open(os.path.join(run, "config.json")))[k] for k in ("dropout", "learning_rate"))


def curve_table(a):
    """One row per share (mean ± sd over seeds), the dense GPTs, TSA's grid runs; --png: a plot."""
    root, names = compare.finished(a.root, "train them with `python experiments/tsa.py curve` and `grid`")
    ran, by, dense = finals(root, names), {}, {}  # share -> [(seed, final eval)]; (dropout, lr) -> {seed: val}
    for d, (kind, seed, ev) in ran.items():
        if kind.startswith("share"):
            by.setdefault(float(kind[5:]), []).append((seed, ev[-1]))
        elif kind.startswith("dense_"):  # grid --model gpt
            dense.setdefault(setting(os.path.join(root, d)), {})[seed] = ev[-1]["val_loss"]
    best = min(dense, key=lambda k: compare.mean_sd(list(dense[k].values()))[0]) if dense else None
    refs = {**references(ran), "dense": dense.get(best, {})}
    rows, pc = [], lambda xs, n=2, sign="+": mean_sd([100 * x for x in xs], n, sign) + "%"
    for share, runs in sorted(by.items()):
        seeds, v = [s for s, _ in runs], lambda k: [e[k] for _, e in runs]
        rel = lambda ref: pc([e["val_loss"] / ref[s] - 1 for s, e in runs]) if set(seeds) <= set(ref) else "–"
        rows.append([share, ",".join(sorted(seeds)), mean_sd(v("val_loss")), mean_sd(v("val_soft_loss")),
                     pc([e["val_loss"] / e["val_soft_loss"] - 1 for _, e in runs]), rel(refs["soft"]),
                     rel(refs["softlr"]), rel(refs["dense"]), *[pc(v(k), 1, "") for k in (
                         "val_skipped", "val_tlops_saved_hard", "val_flops_saved_hard")]])
    print(md_table(rows, ["exec_share", "seeds", "hard val", "soft val", "hard − soft", "vs paper's soft model",
                          "vs the control (softlr)", "vs the best dense GPT", "token-layers skipped",
                          "TLOps saved (hard)", "FLOPs saved (hard)"]))
    print(md_table([[f"dropout {do}, lr {lr:g}", ",".join(sorted(v)), mean_sd(list(v.values()))]
                    for (do, lr), v in sorted(dense.items())], ["dense GPT", "seeds", "final val"]))
    print(f"best dense GPT: dropout {best[0]}, lr {best[1]:g}\n" if best else "")
    rows, points = [], []  # TSA's whole recipe at other settings (`grid --model tsa`)
    for d in [d for d in names if d.startswith("tsa_")]:
        (_, seed, ev), (do, lr) = ran[d], setting(os.path.join(root, d))
        e, same = ev[-1], dense.get((do, lr), {})
        points.append((f"TSA's whole recipe at dropout {do}, lr {lr:g}", 100 * e["val_tlops_saved_hard"], e["val_loss"]))
        rows.append([d, f"dropout {do}, lr {lr:g}", f4(e["val_loss"]), f4(e["val_soft_loss"]),
                     f"{e['val_tlops_saved_hard']:.1%}", f"{e['val_loss'] / same[seed] - 1:+.2%}" if seed in same else "–",
                     f"{e['val_loss'] / refs['dense'][seed] - 1:+.2%}" if seed in refs["dense"] else "–"])
    print(md_table(rows, ["TSA run", "setting", "hard val", "soft val", "TLOps saved (hard)",
                          "vs the dense GPT of the same setting", "vs the best dense GPT"]) if rows else "")
    if a.png:
        plot_curve(by, refs, points, a.png)


def plot_curve(by, refs, points, path):
    import matplotlib  # optional: only --png needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for seed in sorted({s for runs in by.values() for s, _ in runs}):
        ax.plot(*zip(*sorted((100 * e["val_tlops_saved_hard"], e["val_loss"]) for runs in by.values()
                             for s, e in runs if s == seed)), "o-", label=f"TSA, hard (sparse inference), seed {seed}")
    for i, label in enumerate(dict.fromkeys(p[0] for p in points)):  # one colour and legend entry per setting
        ax.plot(*zip(*[(x, y) for q, x, y in points if q == label]), "s", c=f"C{i + 2}", label=label)
    for name, style, label in (("dense", "-", "best dense GPT"), ("softlr", ":", "control (softlr)")):
        for seed, v in sorted(refs[name].items()):
            ax.axhline(v, c="k", ls=style, lw=1, label=f"{label}, seed {seed}")
    ax.set(xlabel="TLOps saved by hard routing (%)", ylabel="val loss (TSA: hard)",
           title="TSA's paper preset at the CPU proxy (4 × 128, 6.8M tokens)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes: no point hidden
    fig.savefig(path + ".tmp.png", dpi=120, bbox_inches="tight")
    os.replace(path + ".tmp.png", path)


def grid(a):
    """At the proxy, per dropout × peak lr (min_lr = lr/10) and seed: the dense GPT (dense_do<D>_lr<LR>_sS) or
    TSA's recipe per exec_share, its ST phase at that lr (tsa_do<D>_lr<LR>_share<S>_sS)."""
    shares = a.shares if a.model == "tsa" else [""]
    for do, lr, s, S in itertools.product(a.dropouts, a.lrs, a.seeds, shares):
        flags = [f"--dropout={do}", f"--learning_rate={lr}", f"--min_lr={float(lr) / 10:g}", f"--seed={s}"]
        if a.model == "gpt":
            train_run(os.path.join(a.out, f"dense_do{do}_lr{lr}_s{s}"), [*DENSE, *flags], dry=a.dry_run)
        else:
            train_run(os.path.join(a.out, f"tsa_do{do}_lr{lr}_share{S}_s{s}"), [
                *PROXY, *flags, f"--hard_ft_lr={lr}", f"--hard_ft_iters={N - AT}", f"--exec_share={S}"], dry=a.dry_run)


COMMANDS = {"study": study, "budget": budget, "table": table,
            "eval": lambda a: [record(run, a.out, a.eval_iters, a.eval_seed) for run in a.paths],
            "proxy": proxy, "proxy-table": proxy_table, "curve": curve, "curve-table": curve_table, "grid": grid}


def main(argv=None):
    p = compare.parser(__doc__)
    p.add_argument("cmd", choices=list(COMMANDS))
    p.add_argument("paths", nargs="*", help="table: the records file; eval: run dirs; *-table: the runs' dir")
    p.add_argument("--out", help="where the runs go (eval: the records file); default out/tsa, out/tsa_budget, "
                   "out/tsa_proxy")
    p.add_argument("--dry-run", action="store_true", help="print the train.py commands only")
    p.add_argument("--seed", type=int, help="budget, proxy: the seed")
    p.add_argument("--seeds", type=csv(int), default=[1, 2, 3], help="curve, grid")
    p.add_argument("--model", choices=["gpt", "tsa"], default="gpt", help="grid")
    p.add_argument("--branches", type=csv(str, ("calibrate", "soft", "train", "frozen")),
                   default=["calibrate", "soft", "train", "frozen"], help="proxy")
    p.add_argument("--shares", type=csv(float, keep=True), default="0.87,0.73,0.7,0.6,0.4,0.25".split(","),
                   help="curve: exec_share values (TLOps saved, measured: 8.6-40.4%%)")
    p.add_argument("--dropouts", type=csv(float, keep=True), default=["0.0", "0.1", "0.2"], help="grid")
    p.add_argument("--lrs", type=csv(float, keep=True), default=["3e-4", "1e-3"], help="grid")
    p.add_argument("--eval_iters", type=int, default=30, help="eval")
    p.add_argument("--eval_seed", type=int, help="eval: another seed's fixed val batches (default the run's)")
    p.add_argument("--png", help="curve-table: also draw the curve into this PNG (needs matplotlib)")
    a = p.parse_args(argv)
    a.out = a.out or {"study": "out/tsa", "budget": "out/tsa_budget"}.get(a.cmd, "out/tsa_proxy")
    a.root = a.paths[0] if a.paths else "out/tsa_proxy"
    needs = {"budget": "--seed", "proxy": "--seed", "table": "a records file, e.g. results/tsa_small.jsonl",
             "eval": "run dirs and --out F.jsonl"}.get(a.cmd)
    if needs and not (a.paths if a.cmd in ("table", "eval") else a.seed is not None):
        p.error(f"{a.cmd} needs {needs}")
    if a.cmd == "eval" and not a.out.endswith(".jsonl"):
        p.error("eval writes its records to --out F.jsonl")
    compare.entry(COMMANDS[a.cmd], a)


if __name__ == "__main__":
    main()
