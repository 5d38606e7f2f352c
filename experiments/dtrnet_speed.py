"""DTRNet speed on CPU, one process, interleaved (A, B, C, A, B, C, …), median of --repeats, 1 thread:
forward (inference) and training step (forward + backward) of the dense GPT vs DTRNet at a forced routed
fraction ρ, next to the FLOPs-ideal speedup 1 / dtrnet.flops_ratio(cfg, T, ρ measured).
  python experiments/dtrnet_speed.py --Ts 512,1024,2048 --rho 0.1 --repeats 3
Paths: dense = common.Model (causal SDPA); packed = what training and sparse=True run (routed tokens packed,
causal SDPA on them); masked = the eq. (6) boolean-mask reference (the training path before the packed one),
run only up to --masked_max_T (it materialises B·nh·T² scores). --decode N: cached generation (prefill a
prompt of each --prompts length, then N greedy steps) at B = 1 and 8, DTRNet (forced ρ) vs the dense GPT's own KV cache."""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import dtrnet  # noqa: E402


class ForcedRouter(nn.Module):
    """Routes ~ρ of the tokens: a fixed pseudo-random function of the token's residual vector."""

    def __init__(self, rho):
        super().__init__()
        self.rho = rho

    def forward(self, x):
        u = torch.frac(x[..., :8].float().sum(-1).abs() * 9973.0)  # (B, T) ~ uniform in [0, 1)
        p = 0.3 + 0.4 * (u < self.rho).float()
        return torch.stack([p, 1 - p], -1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--Ts", default="512,1024,2048")
    ap.add_argument("--rho", type=float, default=0.1)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--B_train", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--masked_max_T", type=int, default=1024)
    ap.add_argument("--n_layer", type=int, default=7)
    ap.add_argument("--n_embd", type=int, default=128)
    ap.add_argument("--n_head", type=int, default=4)
    ap.add_argument("--decode", type=int, default=0, help="also time cached generation of this many new tokens")
    ap.add_argument("--prompts", default="16,1024", help="prompt lengths for --decode")
    ap.add_argument("--decode_only", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    Ts = [int(t) for t in args.Ts.split(",")]
    cfg = dtrnet.Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=max(Ts),
                        vocab_size=65, layers="bilayer")
    torch.manual_seed(0)
    dense = common.Model(cfg)
    m = dtrnet.Model(cfg)
    m.load_state_dict(dense.state_dict(), strict=False)  # the same GPT weights
    for blk in m.blocks:
        if isinstance(blk, dtrnet.DTRBlock):
            blk.router = ForcedRouter(args.rho)
    masked = lambda x, packed: dtrnet.Model.trunk(m, x, False)  # noqa: E731  (the old training path)

    def infer(model, x, **kw):
        def f():
            model.eval()
            with torch.no_grad():
                model(x, **kw)
        return f

    def train_step(model, x, use_masked=False):
        def f():
            model.train()
            if use_masked:
                model.trunk = masked
            _, loss, _ = model(x, x)
            loss.backward()
            model.zero_grad(set_to_none=True)
            model.__dict__.pop("trunk", None)
        return f

    print(f"# {cfg.n_layer}×{cfg.n_embd}, {cfg.n_head} heads, pattern {cfg.pattern}, forced ρ={args.rho}, "
          f"forward B={args.B}, train B={args.B_train}, median of {args.repeats} interleaved, 1 thread, "
          f"torch {torch.__version__}")
    print("| T | what | B | ρ measured | dense ms | packed ms | masked ms | packed speedup | FLOPs-ideal | share of "
          "ideal gain | masked speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for T in ([] if args.decode_only else Ts):
        x = torch.randint(0, 65, (args.B, T))
        xt = x[:args.B_train]
        with torch.no_grad():
            m.eval()
            rho = m(x, sparse=True)[2]["frac_attn"].item()
        ideal = 1 / dtrnet.flops_ratio(cfg, T, rho)
        for what, fns in (("forward", {"dense": infer(dense, x), "packed": infer(m, x, sparse=True),
                                       "masked": infer(m, x)}),
                          ("train step", {"dense": train_step(dense, xt), "packed": train_step(m, xt),
                                          "masked": train_step(m, xt, True)})):
            if T > args.masked_max_T:
                fns.pop("masked")
            times = {k: [] for k in fns}
            for f in fns.values():
                f()  # warm-up
            for _ in range(args.repeats):
                for k, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
            t = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            sp = t["dense"] / t["packed"]
            ms = f"{t['masked']:.0f}" if "masked" in t else "—"
            msp = f"{t['dense'] / t['masked']:.2f}" if "masked" in t else "—"
            print(f"| {T} | {what} | {args.B if what == 'forward' else args.B_train} | {rho:.3f} | {t['dense']:.0f} | "
                  f"{t['packed']:.0f} | {ms} | {sp:.2f} | {ideal:.2f} | {(sp - 1) / (ideal - 1):.2f} | {msp} |",
                  flush=True)

    if args.decode:
        decode(args, cfg, dense, m)


def decode(args, cfg, dense, m):
    """Prefill (one forward of the prompt) and the n greedy steps after it, timed separately."""
    n = args.decode
    dense.eval(), m.eval()
    print("\n| decode B | prompt | new tokens | dense prefill ms | DTRNet prefill ms | dense step tok/s | DTRNet step "
          "tok/s | step speed ratio | FLOPs-ideal (steps) | KV bytes DTRNet / dense |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    @torch.no_grad()
    def run(model, prompt):
        t0 = time.perf_counter()
        logits, state = model.prefill(prompt)
        t1 = time.perf_counter()
        for _ in range(n):
            logits, state = model.step(logits.argmax(-1, keepdim=True), state)
        return t1 - t0, time.perf_counter() - t1, state

    for P, B in ((int(p), B) for p in args.prompts.split(",") for B in (1, 8)):
        prompt = torch.randint(0, 65, (B, P), generator=torch.Generator().manual_seed(B))
        times = {"dense": [], "dtrnet": []}
        for k, model in (("dense", dense), ("dtrnet", m)):
            run(model, prompt)  # warm-up
        for _ in range(args.repeats):
            for k, model in (("dense", dense), ("dtrnet", m)):
                tp, ts, state = run(model, prompt)
                times[k].append((tp, ts))
        med = {k: (statistics.median(v[0] for v in vs), statistics.median(v[1] for v in vs)) for k, vs in times.items()}
        held, full = dtrnet.kv_cache_bytes(state)  # the DTRNet cache after the last run
        print(f"| {B} | {P} | {n} | {1e3 * med['dense'][0]:.0f} | {1e3 * med['dtrnet'][0]:.0f} | "
              f"{B * n / med['dense'][1]:.0f} | {B * n / med['dtrnet'][1]:.0f} | {med['dense'][1] / med['dtrnet'][1]:.2f} | "
              f"{ideal_decode(cfg, P, n, args.rho):.2f} | {held / full:.3f} |", flush=True)


def ideal_decode(cfg, P, n, rho):
    """Dense / DTRNet FLOPs of the n decode steps after a P-token prompt (step t attends over P + t keys in
    a T layer, ~ρ(P + t) in a D layer if routed): 1/ratio of flops_per_token with T = 2(P + t) − 1, whose
    mean_context is P + t."""
    f = lambda r, pat: sum(dtrnet.flops_per_token(cfg, 2 * (P + t) - 1, r, pattern=pat) for t in range(1, n + 1))  # noqa
    return f([], "T" * cfg.n_layer) / f(rho, cfg.pattern)


if __name__ == "__main__":
    main()
