"""
The conddepth reproduction of results/conddepth.md at classroom scale: a dense GPT (`--preset classroom`, 4 × 128,
ctx 64) is the pretrained start; controller-only runs from it (the paper's §3.4 scope) with every gate recipe,
2 controlled layers of 4, r = 16 (d_ff/32), 300 steps, seeds 42, 123, 7; and the backbone trained jointly.

  python experiments/conddepth.py chain    # every run, measured under every inference mode into OUT/<run>.json
  python experiments/conddepth.py table    # the tables, from those records

Every run evaluates on the same 10 validation batches (eval seed 1337), so recipes compare paired;
hit thresholds are fixed from two pilot runs (G1, G3, seed 0) before the main runs (thresholds()).
"""
import dataclasses
import glob
import json
import os

import numpy as np

from compare import ROOT, evals, load, md_table, study_cli, train_run, val_eval

RECIPES = ["G1", "G3", "A1", "A2", "A3-G1", "A3-G3"]
# 300 controller steps of 16 × 64 tokens (paper: 20k steps of 16 × 256); labels from step 20, every 5
COMMON = ("--model=conddepth --n_controlled=2 --cheap_rank=16 --batch_size=16 --max_iters=300 --warmup_iters=30 "
          "--learning_rate=1e-3 --min_lr=1e-5 --weight_decay=0.01 --grad_clip=1.0 --eval_interval=25 --eval_iters=10 "
          "--eval_seed=1337 --label_start=20 --label_every=5 --log_interval=1").split()
DENSE_FT = ("--model=gpt --batch_size=16 --max_iters=300 --warmup_iters=30 --learning_rate=3e-4 --min_lr=3e-6 "
            "--weight_decay=0.01 --eval_interval=25 --eval_iters=10 --eval_seed=1337").split()


def chain(a):
    R, start = a.out, f"--init_from={a.out}/dense/ckpt.pt"
    train_run(f"{R}/dense", ["--model=gpt", "--preset=classroom"], dry=a.dry_run)
    run = lambda name, *flags: train_run(f"{R}/{name}", [*COMMON, start, *flags],  # noqa: E731
                                         lambda d: evaluate(d, d + ".json"), a.dry_run)
    run("dense-rho1", "--rho=1.0", "--max_iters=0", "--recipe=A3-G1")  # the dense start itself, same batches
    for g in ("G1", "G3"):  # pilots (seed 0, not a main seed) fix the hit thresholds, like the paper's pilot
        run(f"pilot-{g}", f"--recipe={g}", "--seed=0")
    if not a.dry_run:
        thresholds(R)
    for s in (42, 123):
        for r in ("G1", "G3", "A3-G1", "A3-G3", "A1"):
            run(f"{r}-s{s}", f"--recipe={r}", f"--seed={s}")
    # can the routed model end as good as its dense start? the backbone trained too, and its control
    train_run(f"{R}/dense-ft", [*DENSE_FT, start], dry=a.dry_run)
    for s in (42, 123):
        run(f"joint-A3-G1-s{s}", "--recipe=A3-G1", "--controller_only=false", "--learning_rate=3e-4", "--min_lr=3e-6",
            f"--seed={s}")
    for r in RECIPES:
        run(f"{r}-s7", f"--recipe={r}", "--seed=7")


def evaluate(run, out):
    """The final val loss under every inference mode (causal thresholds: what inference runs; the
    paper's top-k: the training computation), dense and sparse; the eval curve; mean grad-norm."""
    import common
    import torch
    (model, cfg, _), final = load(run), {}
    for mode in ("causal", "topk"):
        model.mode = mode
        for sparse in (False, True):
            ev = val_eval(model, cfg, sparse=sparse)
            final[mode + ("_sparse" if sparse else "")], final[mode + "_full_ratio"] = ev["loss"], ev["full_ratio"]
            if mode == "causal" and not sparse:
                final.update(soft=ev["soft_loss"], flops_saved_hard=ev["flops_saved_hard"])
    recs = evals(run, kind=None)
    res = {"config": dataclasses.asdict(cfg), "run_dir": run, "final": final, "torch": torch.__version__,
           "evals": [{"step": r["step"], "loss": r["val_loss"], **{k[4:]: v for k, v in r.items() if k[:4] == "val_"}}
                     for r in recs if r["kind"] == "eval"],
           "grad_norm_mean": float(np.mean([r["grad_norm"] for r in recs if r["kind"] == "train"] or [np.nan]))}
    common.atomic_write(out, lambda f: f.write(json.dumps(res, indent=1).encode()))
    print(f"{run}: causal {final['causal']:.4f} (sparse {final['causal_sparse']:.4f}, full "
          f"{final['causal_full_ratio']:.3f}), top-k {final['topk']:.4f} (sparse {final['topk_sparse']:.4f}) -> {out}")


def thresholds(R):
    """S, E = mean pilot step-0 and best val: thresholds E + f·(S − E), f = 0.5 / 0.25 / 0.1."""
    pilots = [json.load(open(os.path.join(ROOT, R, f"pilot-{g}.json"))) for g in ("G1", "G3")]
    S = np.mean([p["evals"][0]["soft_loss"] for p in pilots])
    E = np.mean([min(e["soft_loss"] for e in p["evals"]) for p in pilots])
    th = [round(float(E + f * (S - E)), 4) for f in (0.5, 0.25, 0.1)]
    json.dump({"S": S, "E": E, "thresholds": th}, open(os.path.join(ROOT, R, "thresholds.json"), "w"))


def metrics(run, th):
    """Curve metrics on the top-k val loss: the causal one's budget drifts while θ is learnt (all
    cheap at step 0), so its "best" would reward moments."""
    ev, last = run["evals"], run["evals"][-1]
    steps, loss = [e["step"] for e in ev], [e["soft_loss"] for e in ev]
    return {"step0": loss[0], "best": min(loss), "end": loss[-1], "avg_all": float(np.mean(loss)),
            "avg_half": float(np.mean([l for s, l in zip(steps, loss) if s <= max(steps) // 2])),
            "hits": [next((s for s, l in zip(steps, loss) if l <= t), None) for t in th],
            "grad": run["grad_norm_mean"], "gate_prob": last["gate_prob"], "full": last["full_ratio"],
            "l2": last.get("qf_qc_l2"), "cos": last.get("qf_qc_cos"), "uvar": last["util_var"], "f": run["final"]}


def ms(xs, fmt="{:.4f}"):
    xs = [x for x in xs if x is not None]
    return "—" if not xs else fmt.format(np.mean(xs)) + (" ± " + fmt.format(np.std(xs)) if len(xs) > 1 else "")


def hit(hs):
    found = [h for h in hs if h is not None]
    part = "" if len(found) == len(hs) else f" ({len(found)}/{len(hs)})"
    return f"{np.mean(found):.0f}{part}" if found else "never"


def table(a):
    R, runs = os.path.join(ROOT, a.out), {}
    if not glob.glob(os.path.join(R, "*-s*.json")):
        raise ValueError(f"no run records in {R}: make them with `python experiments/conddepth.py chain`")
    th = json.load(open(os.path.join(R, "thresholds.json")))["thresholds"]
    for p in glob.glob(os.path.join(R, "*-s*.json")):
        recipe, seed = os.path.basename(p)[:-5].rsplit("-s", 1)
        runs.setdefault(recipe, {})[int(seed)] = json.load(open(p))
    M = {r: {s: metrics(v, th) for s, v in sorted(runs[r].items())} for r in RECIPES + ["joint-A3-G1"] if r in runs}
    dense = json.load(open(os.path.join(R, "dense-rho1.json")))["evals"][0]["loss"]
    print(f"dense start (ρ = 1, every token full) val loss {dense:.4f}; hit thresholds {th} (fixed from the pilots)\n")
    col = lambda r, k, f="{:.4f}": ms([x[k] for x in M[r].values()], f)  # noqa: E731
    print(md_table([[r, ",".join(map(str, M[r])), col(r, "step0"), col(r, "best"), col(r, "end"), col(r, "avg_half"),
                     col(r, "avg_all"), *[hit([x["hits"][i] for x in M[r].values()]) for i in range(len(th))],
                     col(r, "grad", "{:.3g}"), col(r, "gate_prob", "{:.3f}"), col(r, "full", "{:.3f}"), col(r, "l2"),
                     col(r, "cos"), col(r, "uvar", "{:.3g}")] for r in RECIPES if r in M],
                   ["recipe", "seeds", "step-0 val", "best val", "end val", "avg val, 1st half", "avg val, all",
                    *[f"hit {t:.4f}" for t in th], "grad-norm", "gate p", "causal full ratio", "‖q_f−q_c‖₂", "cos",
                    "var(u)"]))
    print("A3 vs standard, per seed (top-k val; negative = A3 better):\n")
    print(md_table([[g, s, f"{M[g][s]['best']:.4f}", f"{M['A3-' + g][s]['best']:.4f}"] +
                    [f"{M['A3-' + g][s][k] - M[g][s][k]:+.4f}" for k in ("best", "end", "avg_all")]
                    for g in ("G1", "G3") if g in M and "A3-" + g in M for s in sorted(set(M[g]) & set(M["A3-" + g]))],
                   ["gate", "seed", "standard best", "A3 best", "Δ best", "Δ end", "Δ avg all"]))
    ft = evals(os.path.join(R, "dense-ft"))
    print(f"Inference modes at the end of training (val loss on the same batches). joint-A3-G1: the backbone trained "
          f"too; the dense GPT trained the same 300 steps alike reaches {ft[-1]['val_loss']:.4f}:\n")
    fin = lambda r, f, fmt="{:.4f}": ms([f(x["f"]) for x in M[r].values()], fmt)  # noqa: E731
    print(md_table([[r] + [fin(r, lambda f, k=k: f[k]) for k in ("causal", "causal_sparse")] +
                    [fin(r, lambda f: f["causal_full_ratio"], "{:.3f}"), fin(r, lambda f: f["topk"]),
                     fin(r, lambda f: f["topk_sparse"]), fin(r, lambda f: f["topk"] - f["causal"], "{:+.4f}"),
                     fin(r, lambda f: f["causal"] - dense, "{:+.4f}")] for r in M],
                   ["recipe", "causal (what inference runs)", "causal, sparse path", "causal full ratio",
                    "top-k (paper)", "top-k, sparse path", "top-k − causal", "causal − dense start"]))


if __name__ == "__main__":
    study_cli(__doc__, {"chain": chain, "table": table}, "out/conddepth")
