"""
Sparse TSA forward and cached decoding vs the dense GPT of the same size, on CPU (results/tsa.md §2).

  OMP_NUM_THREADS=1 python experiments/tsa_speed.py --batches 1,8,64 --repeats 10

The paper's model (d=256, L=6, H=8, vocab 65), T=256, random weights, routing forced like bench.py's
bench_tsa: every router still runs, then a fixed random share α of the tokens is declared active. All
variants are interleaved in one process, one thread; times are per-thread CPU time (time.thread_time), so
a shared machine's other jobs do not count as ours, although they still share caches and memory
bandwidth. Reported: min and median over the repeats, the speed-up vs dense, the FLOPs-ideal speed-up
(tsa.flops_per_token at the measured hard α) and the fraction of the ideal gain, (measured − 1)/(ideal − 1).
Decode: tokens/s of prefill(T0) + steps, TSA (its real routers, biases set so that a share α of the tokens
of a calibration batch is active; the decode's own α is printed) vs the dense GPT's cache
(common.Model.prefill/step).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import tsa  # noqa: E402


def timed(fns, repeats):
    ts = {k: [] for k in fns}
    with torch.no_grad():
        for i in range(repeats + 1):  # the first round warms up
            for k, f in fns.items():
                t = time.thread_time()
                f()
                if i:
                    ts[k].append(time.thread_time() - t)
    return ts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.73)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--decode", default="1,8", help="batch sizes of the decode rows ('' for none)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    T, kw = a.T, dict(n_layer=6, n_head=8, n_embd=256, vocab_size=65, block_size=a.T)
    torch.manual_seed(0)
    dense = common.Model(common.Config(**kw)).eval()
    model = tsa.Model(tsa.Config(**kw)).eval()
    model.load_state_dict(dense.state_dict(), strict=False)  # the same GPT weights plus routers
    cfg = model.cfg
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, 1 thread, α={a.alpha}, T={T}")
    for B in [int(b) for b in a.batches.split(",") if b]:
        g = torch.Generator().manual_seed(0)
        for r in model.routers:  # forced routing: the router runs, a fixed random share α stays active
            keep = torch.rand(B, T, 1, generator=g) < a.alpha
            r.forward = lambda h, r=r, keep=keep: torch.where(keep, 0.25, 0.75) + 0 * tsa.Router.forward(r, h)
        x = torch.randint(0, 65, (B, T), generator=torch.Generator().manual_seed(1))

        def sparse(skip):
            model.cfg.skip_queries = skip
            return model(x, sparse=True)
        ts = timed({"dense": lambda: dense(x), "ffn": lambda: sparse(False), "query": lambda: sparse(True)}, a.repeats)
        alpha = model(x)[2]["alpha_hard"].item()
        for mode in ("ffn", "query"):
            ideal = common.dense_flops_per_token(cfg, T) / tsa.flops_per_token(cfg, T, alpha, mode)
            s_min = min(ts["dense"]) / min(ts[mode])
            s_med = statistics.median(ts["dense"]) / statistics.median(ts[mode])
            print(f"forward B={B:3d} sparse_{mode:5s} {1e3 * min(ts[mode]):8.1f} ms (dense {1e3 * min(ts['dense']):8.1f}) "
                  f"speed-up min {s_min:.3f} median {s_med:.3f}  ideal {ideal:.3f}  "
                  f"frac of ideal gain min {(s_min - 1) / (ideal - 1):.2f} median {(s_med - 1) / (ideal - 1):.2f}")
    for r in model.routers:  # decode: the real routers, each bias set so that a share α of x's tokens is active
        r.__dict__.pop("forward", None)
    x = torch.randint(0, 65, (8, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for r in model.routers:
            z = []
            hook = r.fc2.register_forward_hook(lambda mod, inp, out: z.append(out.flatten()))
            model.trunk(model.embed(x), "hard")
            hook.remove()
            r.fc2.bias -= z[0].quantile(a.alpha)  # active: p <= 0.5, i.e. logit <= the α-quantile
    for B in [int(b) for b in a.decode.split(",") if b]:
        x = torch.randint(0, 65, (B, T), generator=torch.Generator().manual_seed(1))
        T0 = T // 2

        def decode(m):
            logits, state = m.prefill(x[:, :T0])
            for t in range(T0, T):
                logits, state = m.step(x[:, t:t + 1], state)
        ts = timed({"dense": lambda: decode(dense), "tsa": lambda: decode(model)}, max(2, a.repeats // 3))
        with torch.no_grad():
            alpha = model(x)[2]["alpha_hard"].item()
        ideal = common.dense_flops_per_token(cfg, T) / tsa.flops_per_token(cfg, T, alpha, "query")
        tok = B * (T - T0)
        print(f"decode  B={B:3d} α={alpha:.2f} {T - T0} steps after a {T0}-token prefill: tsa {tok / min(ts['tsa']):8.1f} tok/s, "
              f"dense {tok / min(ts['dense']):8.1f} tok/s (min), ratio {min(ts['dense']) / min(ts['tsa']):.3f}, "
              f"median ratio {statistics.median(ts['dense']) / statistics.median(ts['tsa']):.3f}, FLOPs-ideal {ideal:.3f}")


if __name__ == "__main__":
    main()
