"""Markdown tables for results/bench.md from bench.py's --json files.

  python experiments/bench_report.py results/gpu_bench.json out/bench/cpu_*.json

Prints, per file: its command, torch, commit and device; a table of the timed rows (the routed
model against the dense GPT of the same size: ms or tokens/s, speedup = dense / routed, and the
FLOPs-ideal speedup); the graph counts per model and path; the rows skipped or failed, and why.
"""
import json

from compare import check_rows, entry, md_table, parser

# the keys each kind of row must have for its table
NEEDS = {"timed": ("suite", "what", "B", "T", "device", "dtype"), "graphs": ("suite", "path", "n_layer"),
         "skipped": ("what", "group"), "failed": ("what", "group")}


def is_timed(r):
    return "speedup" in r or "speed_ratio_ours_vs_plain" in r


def report(path):
    try:  # an unreadable file: entry's OSError line
        run = json.load(open(path))
        if not isinstance(run["rows"], list):
            raise TypeError(f"rows is a {type(run['rows']).__name__}")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a bench.py --json file ({type(e).__name__}: {e})")
    rows = check_rows(path, run["rows"], "row", "a bench.py row", "pass the file bench.py --json wrote",
                      lambda r: NEEDS.get("timed" if is_timed(r) else r.get("what"), ()))
    if not rows:
        return 0
    print(f"{path}: `python {' '.join(run.get('argv', []))}`, torch {run.get('torch')}, commit "
          f"{run.get('commit') or '?'}, {run.get('device_name', '?')}\n")
    f = lambda v: f"{v:.3g}" if isinstance(v, float) else "–" if v is None else str(v)  # noqa: E731
    timed = [r for r in rows if is_timed(r)]
    mode = lambda r: "compiled" if r.get("compiled") else "eager"  # noqa: E731
    print(md_table([[r["suite"], r["what"], mode(r), r.get("size"), f"{r['B']} × {r['T']}",
                     f(r.get("share_set")),
                     f(r.get("routed_ms", r.get("ours_ms", r.get("tokens_per_s")))),
                     f(r.get("dense_ms", r.get("plain_ms", r.get("dense_tokens_per_s")))),
                     f(r.get("speedup", r.get("speed_ratio_ours_vs_plain"))),
                     f(r.get("flops_ideal")), r["device"], r["dtype"]] for r in timed],
                   ["suite", "what", "mode", "size", "B × T", "share", "routed ms (decode: tok/s)",
                    "dense", "speedup", "FLOPs-ideal", "device", "dtype"]))
    graphs = [r for r in rows if r.get("what") == "graphs"]
    if graphs:
        print(md_table([[r["suite"], r["path"], r["n_layer"],
                         f"{r.get('graphs')} / {r.get('breaks')}",
                         r.get("break_sites") or r.get("error", "")] for r in graphs],
                       ["suite", "path", "layers", "graphs / breaks", "where it breaks"]))
    other = [r for r in rows if r.get("what") in ("skipped", "failed")]
    if other:
        print(md_table([[r["what"], r["group"], r.get("why", r.get("error"))] for r in other],
                       ["row", "measurement", "why"]))
    return len(timed) + len(graphs) + len(other)


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("json", nargs="+", help="bench.py --json files")
    paths = p.parse_args(argv).json
    entry(lambda: sum(map(report, paths)) or p.error("no rows to tabulate in " + ", ".join(paths)))


if __name__ == "__main__":
    main()
