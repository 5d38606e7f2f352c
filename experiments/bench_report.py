"""Markdown tables for results/bench.md from bench.py's --json files (one per suite or one for `all`).

  python experiments/bench_report.py out/bench/cpu_*.json

Prints, per file set: the machine line, the sparse-vs-dense rows of every suite with the FLOPs-ideal
speed-up and the share of its gain measured, the crossover rows, and the decode rows.
"""
import json
import sys


def gain(measured, ideal):
    return f"{(measured - 1) / (ideal - 1):.2f}" if ideal > 1.001 else "–"


def main(paths):
    runs = [json.load(open(p)) for p in paths]
    rows = [r for run in runs for r in run["rows"]]
    devs = sorted({f"{r['device']} {r['dtype']}" for r in rows})
    print(f"torch {runs[0]['torch']}, {runs[0]['threads']} thread(s), {', '.join(devs)}; commands: "
          + "; ".join(" ".join(["python", *run["argv"]]) for run in runs) + "\n")

    print("| suite | what | B × T | setting | sparse vs dense | FLOPs-ideal | share of the ideal gain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["what"] in ("infer_batch_scaling", "infer_alpha_sweep") and r["mode"].startswith("sparse"):
            s, i, setting = r["speedup_vs_dense"], r["ideal_speedup"], f"{r['mode']}, α={r['alpha']:.2f}"
        elif r["what"] == "forward_forced":
            s, i, setting = r["speedup_measured"], r["speedup_flops_ideal"], f"ρ={r['rho']:.2f}"
        elif r["what"] == "model_forward":
            s, i, setting = r["speedup"], r["ideal_speedup"], f"ρ={r['rho']} (vs dense-hard)"
        elif r["what"] == "sparse_vs_dense_hard":
            s, i, setting = r["speedup"], r["flops_ideal"], f"softmax {r['softmax_frac']} (vs dense-hard)"
        else:
            continue
        print(f"| {r['suite']} | {r['what']} | {r['B']} × {r['T']} | {setting} | {s:.3f} | {i:.3f} | {gain(s, i)} |")

    print("\n| suite | sweep | B×T measured | speed-ups | sparse faster from B·T |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["what"] == "crossover":
            setting = ", ".join(f"{k}={r[k]}" for k in ("mode", "rho", "rho_set", "softmax_frac") if k in r)
            print(f"| {r['suite']} | {setting} | {r['B_T']} | {r['speedups']} | {r['sparse_faster_from_BT']} |")

    print("\n| suite | B | setting | routed tok/s | dense GPT tok/s | ratio | FLOPs-ideal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["what"] == "decode":
            setting = ", ".join(f"{k}={r[k]:.2f}" if isinstance(r[k], float) else f"{k}={r[k]}"
                                for k in ("alpha", "rho", "rho_set", "pattern") if k in r)
            print(f"| {r['suite']} | {r['B']} | {setting or '–'} | {r['tokens_per_s']:.1f} | "
                  f"{r['dense_tokens_per_s']:.1f} | {r['speed_ratio']:.3f} | {r['flops_ideal']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
