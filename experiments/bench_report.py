"""Markdown tables for results/bench.md from bench.py's --json files (one per suite or one for `all`).

  python experiments/bench_report.py out/bench/cpu_*.json

Prints, per file set: the machine line, the sparse-vs-dense rows of every suite with the FLOPs-ideal
speed-up and the share of its gain measured, the crossover rows, and the decode rows.
"""
import json
import os
import sys

from compare import md_table

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(paths):
    runs = [json.load(open(p)) for p in paths]
    rows = [r for run in runs for r in run["rows"]]
    devs = sorted({f"{r['device']} {r['dtype']}" for r in rows})
    print(f"torch {runs[0]['torch']}, {runs[0]['threads']} thread(s), {', '.join(devs)}; commands: "
          + "; ".join(" ".join(["python", *run["argv"]]) for run in runs) + "\n")
    speed = []
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
        speed.append([r["suite"], r["what"], f"{r['B']} × {r['T']}", setting, f"{s:.3f}", f"{i:.3f}",
                      f"{(s - 1) / (i - 1):.2f}" if i > 1.001 else "–"])
    print(md_table(speed, ["suite", "what", "B × T", "setting", "sparse vs dense", "FLOPs-ideal",
                           "share of the ideal gain"]))
    print(md_table([[r["suite"], ", ".join(f"{k}={r[k]}" for k in ("mode", "rho", "rho_set", "softmax_frac") if k in r),
                     r["B_T"], r["speedups"], r["sparse_faster_from_BT"]] for r in rows if r["what"] == "crossover"],
                   ["suite", "sweep", "B×T measured", "speed-ups", "sparse faster from B·T"]))
    setting = lambda r: ", ".join(f"{k}={r[k]:.2f}" if isinstance(r[k], float) else f"{k}={r[k]}"  # noqa: E731
                                  for k in ("alpha", "rho", "rho_set", "pattern") if k in r) or "–"
    print(md_table([[r["suite"], r["B"], setting(r), f"{r['tokens_per_s']:.1f}", f"{r['dense_tokens_per_s']:.1f}",
                     f"{r['speed_ratio']:.3f}", f"{r['flops_ideal']:.3f}"] for r in rows if r["what"] == "decode"],
                   ["suite", "B", "setting", "routed tok/s", "dense GPT tok/s", "ratio", "FLOPs-ideal"]))


if __name__ == "__main__":
    main(sys.argv[1:])
