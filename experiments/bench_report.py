"""Markdown tables for results/bench.md from bench.py's --json files.

  python experiments/bench_report.py results/gpu_bench.json out/bench/cpu_*.json

Prints, per file: its command, torch, commit and device; a table of the timed rows (the routed
model against the dense GPT of the same size: ms or tokens/s, speedup = dense / routed, and the
FLOPs-ideal speedup); the graph counts per model and path; the rows skipped or failed, and why.
"""
import argparse
import json
import sys

from compare import md_table


def report(path):
    try:
        run = json.load(open(path))
        rows = run["rows"]
    except OSError as e:
        raise SystemExit(f"error: {path}: {e.strerror}")
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {path}: not a bench.py --json file ({type(e).__name__}: {e})")
    if not rows:
        return 0
    print(f"{path}: `python {' '.join(run.get('argv', []))}`, torch {run.get('torch')}, commit "
          f"{run.get('commit') or '?'}, {run.get('device_name', '?')}\n")
    f = lambda v: f"{v:.3g}" if isinstance(v, float) else "–" if v is None else str(v)  # noqa: E731
    timed = [r for r in rows if "speedup" in r or "speed_ratio_ours_vs_plain" in r]
    mode = lambda r: "compiled" if r.get("compiled") else "eager"  # noqa: E731
    print(md_table([[r["suite"], r["what"], mode(r), r.get("size"),
                     f"{r['B']} × {r['T']}", f(r.get("share_set")),
                     f(r.get("routed_ms", r.get("ours_ms", r.get("tokens_per_s")))),
                     f(r.get("dense_ms", r.get("plain_ms", r.get("dense_tokens_per_s")))),
                     f(r.get("speedup", r.get("speed_ratio_ours_vs_plain"))),
                     f(r.get("flops_ideal")),
                     r["device"], r["dtype"]] for r in timed],
                   ["suite", "what", "mode", "size", "B × T", "share", "routed ms (decode: tok/s)",
                    "dense", "speedup", "FLOPs-ideal", "device", "dtype"]))
    graphs = [r for r in rows if r["what"] == "graphs"]
    if graphs:
        print(md_table([[r["suite"], r["path"], r["n_layer"],
                         f"{r.get('graphs')} / {r.get('breaks')}",
                         r.get("break_sites") or r.get("error", "")] for r in graphs],
                       ["suite", "path", "layers", "graphs / breaks", "where it breaks"]))
    other = [r for r in rows if r["what"] in ("skipped", "failed")]
    if other:
        print(md_table([[r["what"], r["group"], r.get("why", r.get("error"))] for r in other],
                       ["row", "measurement", "why"]))
    return len(timed) + len(graphs) + len(other)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise SystemExit(f"error: {message} (see --help)")


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="bench.py --json files")
    args = p.parse_args(argv)
    if not sum(report(path) for path in args.json):
        raise SystemExit("error: no rows to tabulate in " + ", ".join(args.json))


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:  # one line and exit 2 for what a user gave wrong
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            sys.exit(2)
        raise
