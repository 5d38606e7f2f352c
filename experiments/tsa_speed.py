"""
Sparse TSA forward and cached decoding vs the dense GPT of the same size, on CPU (results/tsa.md §0).

  OMP_NUM_THREADS=1 taskset -c 0 python experiments/tsa_speed.py --batches 1,8,64 --repeats 40,20,6

The paper's model (d=256, L=6, H=8, vocab 65), T=256, random weights, routing forced like bench.py's
bench_tsa: every router still runs, then a fixed random share α of the tokens is declared active. One
thread; times are per-thread CPU time (time.thread_time), so other jobs on the machine do not count as
ours, although they still share caches and memory bandwidth. Every repeat runs each variant once, in an
order that rotates from repeat to repeat; its speed-up is the per-repeat ratio dense time / variant time,
and the table gives the median and the interquartile range of those ratios (and the ratio of the minimum
times), the FLOPs-ideal speed-up (tsa.flops_per_token at the measured hard α) and the fraction of the ideal
gain, (measured − 1)/(ideal − 1), of the median. `--against OLD_TSA.py` times an older tsa.py's sparse paths
in the same process (a before/after comparison). `--compile` adds torch.compile (inductor) variants, each
against the compiled dense GPT (`dense_c`): `c_query`, the whole TSA model compiled (dynamic shapes; dynamo
breaks the graph at each routed block's host sync), and `cffn_query`, eager TSA whose routed blocks' FFN
(ln_2 → MLP, on the gathered active rows) is compiled alone. A warm-up round compiles every variant first.
Decode: prefill(T0 = T/2 tokens) + T/2 steps, TSA (its real routers, biases set so that a share α of the
tokens of a calibration batch is active; the decode's own α is printed) vs the dense GPT's cache
(common.Model.prefill/step), timed the same way.
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import tsa  # noqa: E402


def timed(fns, repeats):
    """Per-repeat times of every fn, the order rotating each repeat; one warm-up round first."""
    ts, names = {k: [] for k in fns}, list(fns)
    with torch.no_grad():
        for i in range(repeats + 1):
            for k in names[i % len(names):] + names[:i % len(names)]:
                t = time.thread_time()
                fns[k]()
                if i:
                    ts[k].append(time.thread_time() - t)
    return ts


def speedups(ts, base, k):
    """median, (q1, q3) of the per-repeat ratios base / k, and the ratio of the minima."""
    r = sorted(b / t for b, t in zip(ts[base], ts[k]))
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    return q[1], (q[0], q[2]), min(ts[base]) / min(ts[k])


def load_tsa(path):
    spec = importlib.util.spec_from_file_location("tsa_against", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(mod, dense, kw):
    m = mod.Model(mod.Config(**kw)).eval()
    m.load_state_dict(dense.state_dict(), strict=False)  # the same GPT weights plus routers
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--repeats", default="40,20,6", help="per batch size (one number: all)")
    ap.add_argument("--alpha", type=float, default=0.73)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--decode", default="1,8", help="batch sizes of the decode rows ('' for none)")
    ap.add_argument("--decode_repeats", type=int, default=10)
    ap.add_argument("--against", default="", help="an older tsa.py to time in the same process")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile variants (forward only)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    T, kw = a.T, dict(n_layer=6, n_head=8, n_embd=256, vocab_size=65, block_size=a.T)
    torch.manual_seed(0)
    dense = common.Model(common.Config(**kw)).eval()
    models = {"": build(tsa, dense, kw)}
    if a.against:
        models["old_"] = build(load_tsa(a.against), dense, kw)
        models["old_"].load_state_dict(models[""].state_dict())  # the same routers too
    if a.compile:
        models["cffn_"] = build(tsa, dense, kw)
        models["cffn_"].load_state_dict(models[""].state_dict())
        for block in models["cffn_"].blocks[1:]:  # only the FFN on the gathered rows: no host sync inside
            block.ffn_delta = torch.compile(block.ffn_delta, dynamic=True)
        dense_c, tsa_c = torch.compile(dense), torch.compile(models[""], dynamic=True)
    cfg = models[""].cfg
    batches = [int(b) for b in a.batches.split(",") if b]
    reps = [int(r) for r in a.repeats.split(",")]
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, 1 thread, α={a.alpha}, T={T}, against={a.against or '-'}")
    for B, R in zip(batches, reps * len(batches) if len(reps) == 1 else reps):
        g = torch.Generator().manual_seed(0)
        keeps = [torch.rand(B, T, 1, generator=g) < a.alpha for _ in range(cfg.n_layer - 1)]
        for m in models.values():  # forced routing: the router runs, a fixed random share α stays active
            for r, keep in zip(m.routers, keeps):
                r.forward = lambda h, r=r, keep=keep: torch.where(keep, 0.25, 0.75) + 0 * type(r).forward(r, h)
        x = torch.randint(0, 65, (B, T), generator=torch.Generator().manual_seed(1))

        def sparse(m, skip):
            getattr(m, "_orig_mod", m).cfg.skip_queries = skip  # (a compiled model wraps the TSA model)
            return m(x, sparse=True)
        fns = {"dense": lambda: dense(x)}
        for pre, m in models.items():
            if pre != "cffn_":
                fns[pre + "ffn"] = lambda m=m: sparse(m, False)
            fns[pre + "query"] = lambda m=m: sparse(m, True)
        if a.compile:
            fns.update(dense_c=lambda: dense_c(x), c_query=lambda: sparse(tsa_c, True))
        ts = timed(fns, R)
        alpha = models[""](x)[2]["alpha_hard"].item()
        for k in fns:
            if k == "dense":
                continue
            if k == "dense_c":  # what compiling buys the dense GPT itself
                med, (q1, q3), _ = speedups(ts, "dense", k)
                print(f"forward B={B:3d} dense GPT compiled  {1e3 * statistics.median(ts[k]):8.1f} ms (dense "
                      f"{1e3 * statistics.median(ts['dense']):8.1f}) speed-up median {med:.3f} "
                      f"IQR {q1:.3f}–{q3:.3f} n={R}")
                continue
            base = "dense_c" if k.startswith("c") else "dense"  # compiled variants against the compiled dense GPT
            ideal = common.dense_flops_per_token(cfg, T) / tsa.flops_per_token(cfg, T, alpha, k.split("_")[-1])
            med, (q1, q3), s_min = speedups(ts, base, k)
            print(f"forward B={B:3d} α={alpha:.3f} sparse_{k:10s} {1e3 * statistics.median(ts[k]):8.1f} ms "
                  f"({base} {1e3 * statistics.median(ts[base]):8.1f}) speed-up median {med:.3f} "
                  f"IQR {q1:.3f}–{q3:.3f} "
                  f"min-ratio {s_min:.3f} ideal {ideal:.3f} frac of ideal gain {(med - 1) / (ideal - 1):.2f} "
                  f"(IQR {(q1 - 1) / (ideal - 1):.2f}–{(q3 - 1) / (ideal - 1):.2f}) n={R}", flush=True)
    for m in models.values():  # decode: the real routers, each bias set so that a share α of x's tokens is active
        for r in m.routers:
            r.__dict__.pop("forward", None)
    x = torch.randint(0, 65, (8, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for rs in zip(*(m.routers for m in models.values())):
            z = []
            hook = rs[0].fc2.register_forward_hook(lambda mod, inp, out: z.append(out.flatten()))
            models[""].trunk(models[""].embed(x), "hard")
            hook.remove()
            for r in rs:
                r.fc2.bias -= z[0].quantile(a.alpha)  # active: p <= 0.5, i.e. logit <= the α-quantile
    for B in [int(b) for b in a.decode.split(",") if b]:
        x = torch.randint(0, 65, (B, T), generator=torch.Generator().manual_seed(1))
        T0 = T // 2

        def decode(m):
            logits, state = m.prefill(x[:, :T0])
            for t in range(T0, T):
                logits, state = m.step(x[:, t:t + 1], state)
        fns = {"dense": lambda: decode(dense)}
        fns.update({pre + "tsa": lambda m=m: decode(m) for pre, m in models.items() if pre != "cffn_"})
        ts = timed(fns, a.decode_repeats)
        with torch.no_grad():
            alpha = models[""](x)[2]["alpha_hard"].item()
        ideal = common.dense_flops_per_token(cfg, T) / tsa.flops_per_token(cfg, T, alpha, "query")
        tok = B * (T - T0)
        for k in fns:
            if k == "dense":
                continue
            med, (q1, q3), s_min = speedups(ts, "dense", k)
            print(f"decode  B={B:3d} α={alpha:.2f} {k:7s} {T - T0} steps after a {T0}-token prefill: "
                  f"{tok / statistics.median(ts[k]):8.1f} tok/s, dense {tok / statistics.median(ts['dense']):8.1f} tok/s "
                  f"(medians), ratio median {med:.3f} IQR {q1:.3f}–{q3:.3f} min-ratio {s_min:.3f}, FLOPs-ideal {ideal:.3f} "
                  f"n={a.decode_repeats}", flush=True)


if __name__ == "__main__":
    main()
