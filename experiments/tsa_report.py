"""Markdown tables for results/tsa.md from experiments/tsa_eval.py's JSON lines.

  python experiments/tsa_report.py /work/runs/tsa/eval.jsonl         (experiments/tsa.sh)
  python experiments/tsa_report.py out/tsa_budget/eval.jsonl        (experiments/tsa_budget.sh)
"""
import json
import os
import sys


def interp(sweep, alpha):
    """Early-exit val loss at a given α, linear between the two nearest sweep points."""
    pts = sorted((r["alpha"], r["val_loss"]) for r in sweep)
    for (a0, l0), (a1, l1) in zip(pts, pts[1:]):
        if a0 <= alpha <= a1:
            return l0 if a1 == a0 else l0 + (l1 - l0) * (alpha - a0) / (a1 - a0)
    return float("nan")


def mean_sd(xs, n=4):
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else float("nan")
    return f"{m:.{n}f} ± {sd:.{n}f}" if len(xs) > 1 else f"{m:.{n}f}"


def budget(recs):
    """tsa_budget.sh runs: <P|D>_<dense|lamX|hardft|densecont>_s<seed>, P = paper budget, D = default preset."""
    out, f = [], lambda v, n=4: f"{v:.{n}f}"
    for pre, title in (("P", "paper token budget (6×64, 5000 × 64 × 128 = 41M tokens)"),
                       ("D", "default preset (6×192, 2250 × 16 × 128 = 4.6M tokens)")):
        rs = {k: r for k, r in recs.items() if k.startswith(pre + "_")}
        if not rs:
            continue
        dense = {r["seed"]: r["val_loss"] for k, r in rs.items() if "_dense_" in k}
        cont = {r["seed"]: r["val_loss"] for k, r in rs.items() if "_densecont_" in k}
        soft = {(r["lam"], r["seed"]): r for k, r in rs.items() if "_lam" in k and "_hardft_" not in k}
        out += [f"#### Dense vs TSA, {title}", "",
                "| run | seed | dense val | soft val (Δ%) | hard scaled (Δ%) | hard 01 (Δ%) | soft α (TLOps saved) "
                "| hard α (saved) |", "|" + "---|" * 8]
        pct = lambda v, d: f"{f(v)} ({100 * (v / d - 1):+.2f}%)"
        for k, r in sorted(rs.items(), key=lambda kr: ("_hardft_" in kr[0] or "_lam" not in kr[0], kr[0])):
            if "_lam" in k and "_hardft_" not in k:
                d = dense.get(r["seed"], float("nan"))
                out.append(f"| {k} (λ={r['lam']}) | {r['seed']} | {f(d)} | {pct(r['soft_loss'], d)} | "
                           f"{pct(r['hard_loss_scaled'], d)} | {pct(r['hard_loss_01'], d)} | {f(r['alpha'], 3)} "
                           f"({100 * r['tlops_saved']:.1f}%) | {f(r['alpha_hard'], 3)} ({100 * r['tlops_saved_hard']:.1f}%) |")
        for lam in sorted({lam for lam, _ in soft}):
            runs = [r for (l, _), r in soft.items() if l == lam and r["seed"] in dense]
            if len(runs) > 1:
                col = lambda key: mean_sd([r[key] for r in runs])
                rel = mean_sd([100 * (r["soft_loss"] / dense[r["seed"]] - 1) for r in runs], 2)
                relh = mean_sd([100 * (r["hard_loss_scaled"] / dense[r["seed"]] - 1) for r in runs], 2)
                out.append(f"| mean ± sd, λ={lam} ({len(runs)} seeds) | | {mean_sd([dense[r['seed']] for r in runs])} | "
                           f"{col('soft_loss')} ({rel} %) | {col('hard_loss_scaled')} ({relh} %) | {col('hard_loss_01')} | "
                           f"{col('alpha')} (saved {mean_sd([100 * r['tlops_saved'] for r in runs], 1)} %) | "
                           f"{col('alpha_hard')} (saved {mean_sd([100 * r['tlops_saved_hard'] for r in runs], 1)} %) |")
        ft = {k: r for k, r in rs.items() if "_hardft_" in k}
        if ft:
            out += ["", f"Straight-through hard-gate phase, {title}: `hardft_lamX` = the λ=0.001 run continued with "
                    f"hard gates and depth weight λ=X ({next(iter(ft.values()))['iter']} iterations, lr 3e-4→3e-5); "
                    "`densecont` = the dense run continued the same way (control for the extra training).", "",
                    "| run | soft model (λ=0.001): soft val, soft α | hard scaled val (vs soft model's soft) "
                    "| hard 01 val | soft val after | hard α (TLOps saved) | densecont | hard scaled vs densecont |",
                    "|" + "---|" * 8]
            for k, r in sorted(ft.items(), key=lambda kr: (kr[1]["seed"], kr[1]["lam"])):
                s0 = soft.get((0.001, r["seed"]))
                ref = s0["soft_loss"] if s0 else float("nan")
                c = cont.get(r["seed"], float("nan"))
                out.append(f"| {k} | {f(ref)}, {f(s0['alpha'], 3) if s0 else '?'} | {pct(r['hard_loss_scaled'], ref)} | "
                           f"{f(r['hard_loss_01'])} | {f(r['soft_loss'])} | {f(r['alpha_hard'], 3)} "
                           f"({100 * r['tlops_saved_hard']:.1f}%) | {f(c)} | {100 * (r['hard_loss_scaled'] / c - 1):+.2f}% |")
        out.append("")
    return out


def main(path):
    recs = {os.path.basename(r["run"]): r for r in map(json.loads, open(path))}
    f = lambda v, n=4: f"{v:.{n}f}"
    out = budget(recs)
    dense = {r["seed"]: r["val_loss"] for k, r in recs.items() if k.startswith("dense_")}
    out += ["### Dense vs TSA (Shakespeare char, 4×128)", "",
            "| run | seed | tokens | val loss dense | soft val (Δ%) | hard 01 val (Δ%) | hard scaled val (Δ%) "
            "| soft α | TLOps saved (soft) | hard α | TLOps saved (hard) |", "|" + "---|" * 11]
    for k, r in recs.items():
        if k.startswith("dense_"):
            out.append(f"| {k} | {r['seed']} | {r['tokens']:,} | {f(r['val_loss'])} | | | | 1 | 0 | 1 | 0 |")
    for k, r in recs.items():
        if r.get("variant") == "tsa" and r["dataset"] == "shakespeare" and k.startswith("lam"):
            d = dense.get(r["seed"], float("nan"))
            pct = lambda v: f"{f(v)} ({100 * (v / d - 1):+.2f}%)"
            out.append(f"| {k} (λ={r['lam']}) | {r['seed']} | {r['tokens']:,} | {f(d)} | {pct(r['soft_loss'])} | "
                       f"{pct(r['hard_loss_01'])} | {pct(r['hard_loss_scaled'])} | {f(r['alpha'], 3)} | "
                       f"{100 * r['tlops_saved']:.1f}% | {f(r['alpha_hard'], 3)} | {100 * r['tlops_saved_hard']:.1f}% |")
    n = max(len(r.get("active", [])) for r in recs.values())
    out += ["", "### Per-router active fraction (soft mean 1 − p_l / hard fraction executed)", "",
            "| run | " + " | ".join(f"r{l}" for l in range(n)) + " |", "|---" * (n + 1) + "|"]
    for k, r in recs.items():
        if r.get("variant") == "tsa":
            out.append(f"| {k} | " + " | ".join(f"{a:.3f} / {h:.3f}" for a, h in zip(r["active"], r["hard_active"])) + " |")
    out += ["", "### Straight-through hard-gate phase (from the soft model)", "",
            "| run | soft val | hard 01 val | hard scaled val | soft α | hard α | TLOps saved (hard) |", "|---|---|---|---|---|---|---|"]
    for k, r in recs.items():
        if r.get("variant") == "tsa" and (k.startswith("hardft_") or k.replace("hardft_", "") in
                                          [q.replace("hardft_", "") for q in recs if q.startswith("hardft_")]):
            out.append(f"| {k} | {f(r['soft_loss'])} | {f(r['hard_loss_01'])} | {f(r['hard_loss_scaled'])} | "
                       f"{f(r['alpha'], 3)} | {f(r['alpha_hard'], 3)} | {100 * r['tlops_saved_hard']:.1f}% |")
    out += ["", "### Sparse path check on trained routers", "",
            "| run | max abs logit diff sparse(FFN) vs eval | sparse(FFN+query) vs eval | sparse val loss | eval val loss |",
            "|---|---|---|---|---|"]
    for k, r in recs.items():
        if r.get("variant") == "tsa":
            hv = "hard_loss_scaled"
            out.append(f"| {k} | {r['sparse_maxdiff_ffn']:.2e} | {r['sparse_maxdiff_query']:.2e} | {f(r['sparse_loss'])} | {f(r[hv])} (scaled) |")
    for k, r in recs.items():
        if r.get("variant") == "early_exit":
            out += ["", f"### Early exit ({k}): threshold sweep", "", "| threshold | α | TLOps saved | val loss |",
                    "|---|---|---|---|"]
            out += [f"| {s['threshold']} | {f(s['alpha'], 3)} | {100 * s['tlops_saved']:.1f}% | {f(s['val_loss'])} |"
                    for s in r["sweep"]]
            out += ["", "TSA vs early exit at matched α (early-exit loss interpolated between sweep points; same seed):", "",
                    "| TSA run | TSA hard α | TSA hard val (best variant) | early exit val at that α | TSA soft α | TSA soft val | early exit val at soft α |",
                    "|---|---|---|---|---|---|---|"]
            for q, t in recs.items():
                if t.get("variant") == "tsa" and t["seed"] == r["seed"] and t["dataset"] == "shakespeare":
                    hb = min(t["hard_loss_01"], t["hard_loss_scaled"])
                    out.append(f"| {q} | {f(t['alpha_hard'], 3)} | {f(hb)} | {f(interp(r['sweep'], t['alpha_hard']))} | "
                               f"{f(t['alpha'], 3)} | {f(t['soft_loss'])} | {f(interp(r['sweep'], t['alpha']))} |")
    out += ["", "### copy vs sort (§3.1)", "", "| task | model | token acc (hard scaled / dense) | soft α | TLOps saved (soft) | hard α |",
            "|---|---|---|---|---|---|"]
    for k, r in recs.items():
        if r["dataset"] in ("copy", "sort"):
            if r["model"] == "gpt":
                out.append(f"| {r['dataset']} | dense | {f(r['acc'])} | 1 | 0 | 1 |")
            else:
                out.append(f"| {r['dataset']} | TSA λ={r['lam']} | {f(r['acc_scaled'])} | {f(r['alpha'], 3)} | "
                           f"{100 * r['tlops_saved']:.1f}% | {f(r['alpha_hard'], 3)} |")
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1])
