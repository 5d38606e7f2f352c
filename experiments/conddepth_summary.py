"""
Summarise conddepth runs (experiments/conddepth.sh; one JSON per run from experiments/conddepth_eval.py) into
markdown tables. The paper-style curve metrics (best / avg / hit) use the top-k val loss (train.py's
val_soft_loss: the paper's routing at exactly ρ at every eval, = the training computation); the causal hard loss
(train.py's val_loss, what inference runs) is in the inference table: its realised budget drifts while θ is
being learnt (all cheap at step 0), so a "best" of it would reward a moment of extra full tokens.

  python experiments/conddepth_summary.py --thresholds /work/runs/conddepth   # after the pilots: fix thresholds
  python experiments/conddepth_summary.py /work/runs/conddepth > summary.md     # the tables

Hit thresholds are fixed from the two pilot runs (G1, G3, seed 0) before the main runs, by a rule chosen
before any run: S = mean pilot step-0 val loss, E = mean pilot best val loss, thresholds E + f·(S − E) for
f = 0.5 / 0.25 / 0.1 (easy / medium / hard), rounded to 4 decimals.
"""
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conddepth as cd  # noqa: E402

RECIPES = ["G1", "G3", "A1", "A2", "A3-G1", "A3-G3", "A4-0.25", "A4-2"]


def load(R):
    runs = {}
    for p in glob.glob(os.path.join(R, "*-s*.json")):
        name = os.path.basename(p)[:-5]
        recipe, seed = name.rsplit("-s", 1)
        runs.setdefault(recipe, {})[int(seed)] = json.load(open(p))
    return runs


def fix_thresholds(R):
    pilots = [json.load(open(os.path.join(R, f"pilot-{g}.json"))) for g in ("G1", "G3")]
    S = np.mean([p["evals"][0]["soft_loss"] for p in pilots])
    E = np.mean([min(e["soft_loss"] for e in p["evals"]) for p in pilots])
    th = [round(float(E + f * (S - E)), 4) for f in (0.5, 0.25, 0.1)]
    json.dump({"S": S, "E": E, "thresholds": th}, open(os.path.join(R, "thresholds.json"), "w"))
    print("thresholds", th)


def metrics(run, th):
    ev = run["evals"]
    steps = [e["step"] for e in ev]
    loss = [e["soft_loss"] for e in ev]
    half = max(steps) // 2
    hit = [next((s for s, l in zip(steps, loss) if l <= t), None) for t in th]
    last = ev[-1]
    return {"best": min(loss), "end": loss[-1], "avg_half": float(np.mean([l for s, l in zip(steps, loss) if s <= half])),
            "avg_all": float(np.mean(loss)), "hits": hit, "grad": run["grad_norm_mean"],
            "gate_prob": last["gate_prob"], "full": last["full_ratio"], "l2": last.get("qf_qc_l2"),
            "cos": last.get("qf_qc_cos"), "uvar": last["util_var"], "f": run["final"],
            "time": run["train_time_s"], "comp": run["compute_vs_full"], "inf": run["infer_vs_full"]}


def ms(xs, fmt="{:.4f}"):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    return fmt.format(np.mean(xs)) + (" ± " + fmt.format(np.std(xs)) if len(xs) > 1 else "")


def hit_str(hs):
    n = sum(h is not None for h in hs)
    if n == 0:
        return "never"
    v = np.mean([h for h in hs if h is not None])
    return f"{v:.0f}" + ("" if n == len(hs) else f" ({n}/{len(hs)})")


def main(R):
    th = json.load(open(os.path.join(R, "thresholds.json")))["thresholds"]
    runs = load(R)
    dense = json.load(open(os.path.join(R, "dense-rho1.json")))["evals"][0]["loss"]
    print(f"dense GPT (ρ = 1, every token full) val loss: {dense:.4f}; hit thresholds {th} (fixed from the pilots)\n")
    print("Curve metrics on the top-k val loss (the paper's routing, exactly ρ); grad-norm = mean pre-clipping norm "
          "over all steps; the last four columns at the end of training.\n")
    M = {}
    for title, names in (("", RECIPES), ("\n4× longer runs (1200 steps; same schedule shape, eval every 100):\n",
                                          ["long-" + r for r in ("G1", "G3", "A3-G1", "A3-G3")]),
                         ("\n25% budget (ρ = 0.25), the paper's §5.6 supplement:\n", ["rho25-G1", "rho25-G3"])):
        names = [r for r in names if r in runs]
        if not names:
            continue
        print(title)
        print("| recipe | seeds | step-0 val | best val | end val | avg val, 1st half | avg val, all | hit "
              + " | hit ".join(f"{t:.4f}" for t in th) + " | grad-norm | gate p | causal full ratio | ‖q_f−q_c‖₂ | cos | var(u) |")
        print("|" + "---|" * (13 + len(th)))
        for r in names:
            seeds = sorted(runs[r])
            M[r] = {s: metrics(runs[r][s], th) for s in seeds}
            m = list(M[r].values())
            step0 = [runs[r][s]["evals"][0]["soft_loss"] for s in seeds]
            print(f"| {r} | {','.join(map(str, seeds))} | {ms(step0)} | {ms([x['best'] for x in m])} | "
                  f"{ms([x['end'] for x in m])} | {ms([x['avg_half'] for x in m])} | {ms([x['avg_all'] for x in m])} | "
                  + " | ".join(hit_str([x["hits"][i] for x in m]) for i in range(len(th)))
                  + f" | {ms([x['grad'] for x in m], '{:.3g}')} | {ms([x['gate_prob'] for x in m], '{:.3f}')} | "
                  f"{ms([x['full'] for x in m], '{:.3f}')} | {ms([x['l2'] for x in m], '{:.4f}')} | "
                  f"{ms([x['cos'] for x in m], '{:.4f}')} | {ms([x['uvar'] for x in m], '{:.3g}')} |")
    print("\nA3 vs standard, per seed (top-k val; negative = A3 better):\n")
    print("| gate | seed | standard best | A3 best | Δ best | Δ end | Δ avg all |")
    print("|---|---|---|---|---|---|---|")
    for g in ("G1", "G3", "long-G1", "long-G3"):
        a3 = g.replace(g.split("-")[-1], "A3-" + g.split("-")[-1])
        for s in sorted(set(M.get(g, {})) & set(M.get(a3, {}))):
            a, b = M[g][s], M[a3][s]
            print(f"| {g} | {s} | {a['best']:.4f} | {b['best']:.4f} | {b['best'] - a['best']:+.4f} | "
                  f"{b['end'] - a['end']:+.4f} | {b['avg_all'] - a['avg_all']:+.4f} |")
    print("\nInference mode at the end of training (val loss on the same batches; causal = the per-layer thresholds "
          "θ learnt during training, what inference runs; top-k = the paper's, non-causal, = the training computation):\n")
    print("| recipe | causal | causal sparse | causal full ratio | top-k | top-k sparse | top-k − causal |")
    print("|---|---|---|---|---|---|---|")
    for r, mm in M.items():
        f = [x["f"] for x in mm.values()]
        print(f"| {r} | {ms([x['causal'] for x in f])} | {ms([x['causal_sparse'] for x in f])} | "
              f"{ms([x['causal_full_ratio'] for x in f], '{:.3f}')} | {ms([x['topk'] for x in f])} | "
              f"{ms([x['topk_sparse'] for x in f])} | {ms([x['topk'] - x['causal'] for x in f], '{:+.4f}')} |")
    joint = [r for r in runs if r.startswith("joint-")]
    ft = os.path.join(R, "dense-ft", "metrics.jsonl")
    if joint and os.path.exists(ft):
        ft = [json.loads(line) for line in open(ft) if '"eval"' in line]
        print(f"\nRouted fine-tune vs its dense start (val loss, same batches): dense start {dense:.4f}; the dense GPT "
              f"trained 300 more steps alike {ft[-1]['val_loss']:.4f} (best {min(e['val_loss'] for e in ft):.4f}):\n")
        print("| run | seeds | causal end | top-k end | top-k best | causal full ratio | causal end − dense start |")
        print("|---|---|---|---|---|---|---|")
        for r in joint:
            m = [metrics(v, th) for v in runs[r].values()]
            print(f"| {r} | {','.join(map(str, sorted(runs[r])))} | {ms([x['f']['causal'] for x in m])} | "
                  f"{ms([x['f']['topk'] for x in m])} | {ms([x['best'] for x in m])} | "
                  f"{ms([x['f']['causal_full_ratio'] for x in m], '{:.3f}')} | "
                  f"{ms([x['f']['causal'] - dense for x in m], '{:+.4f}')} |")
    print("\nCompute proxies (FFN-equivalent token-layers of the controlled layers) and measured training time:\n")
    print("| recipe | compute_vs_full (ours, 300 steps) | infer_vs_full (ours) | compute_vs_full (paper dims) | "
          "infer_vs_full (paper dims) | wall s incl. evals, shared machine (mean) |")
    print("|---|---|---|---|---|---|")
    for r, mm in M.items():
        if r not in RECIPES:
            continue
        if r.startswith(("A4", "A2")) and r not in runs:
            continue
        m = list(mm.values())
        pc = cd.Config(**cd.PRESETS["paper"], recipe=r)
        print(f"| {r} | {m[0]['comp']:.3f} | {m[0]['inf']:.3f} | {cd.compute_vs_full(pc):.3f} | "
              f"{cd.infer_vs_full(pc):.3f} | {np.mean([x['time'] for x in m]):.0f} |")


if __name__ == "__main__":
    if sys.argv[1] == "--thresholds":
        fix_thresholds(sys.argv[2])
    else:
        main(sys.argv[1])
