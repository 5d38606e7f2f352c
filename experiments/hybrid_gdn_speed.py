"""Gated delta rule, the chunked form in hybrid_attn.py vs the previous one (kept below verbatim, as it was
before issues 13/15/16): (1) accuracy against the recurrent form in float64, in fp32 and under CPU bf16
autocast; (2) speed, forward and forward+backward, fp32, interleaved, median of the repeats, one thread.
  python experiments/hybrid_gdn_speed.py [--repeats 15]   (results/hybrid.md §4)"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hybrid_attn as HA  # noqa: E402


def previous_chunked(q, k, v, g, beta, chunk_size=64, initial_state=None):
    """hybrid_attn.gated_delta_rule_chunked before issue 13: ~10 kernels per chunk in the loop."""
    B, H, T, K = q.shape
    V, C, in_dtype = v.size(-1), chunk_size, v.dtype
    dt = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v = (t.view(B, H, N, C, -1) for t in (q, k, v))
    g, beta = g.view(B, H, N, C), beta.view(B, H, N, C)
    G = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    M = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, -math.inf).exp()
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * M).tril(-1)
    eye = torch.eye(C, dtype=dt, device=q.device)
    rhs = torch.cat([(beta * G.exp())[..., None] * k, beta[..., None] * v], -1)
    W, U0 = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True).split([K, V], -1)
    QK = (q @ k.transpose(-1, -2)) * M
    Qg = q * G.exp()[..., None]
    Kd = k * (G[..., -1:] - G).exp()[..., None]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    out = []
    for n in range(N):
        U = U0[:, :, n] - W[:, :, n] @ S
        out.append(Qg[:, :, n] @ S + QK[:, :, n] @ U)
        S = S * G[:, :, n, -1, None, None].exp() + Kd[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(out, 2).view(B, H, N * C, V)[:, :, :T]
    return o.to(in_dtype), S


def inputs(B, H, T, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, H, T, K, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, H, T, K, generator=g)
    return q, k, v, -torch.rand(B, H, T, generator=g), torch.rand(B, H, T, generator=g)


def accuracy():
    g64 = torch.Generator().manual_seed(0)
    B, H, T, K = 1, 2, 1024, 32
    q, k = (F.normalize(torch.randn(B, H, T, K, generator=g64, dtype=torch.float64), dim=-1) for _ in range(2))
    q, v = q * K ** -0.5, torch.randn(B, H, T, K, generator=g64, dtype=torch.float64)
    beta = torch.rand(B, H, T, generator=g64, dtype=torch.float64)
    r = lambda: torch.rand(B, H, T, generator=g64, dtype=torch.float64)
    decays = {"uniform in (−2, 0]": -2 * r(),
              "half in (−1e4, 0], half in (−0.01, 0]": torch.where(r() < 0.5, -1e4 * r(), -0.01 * r())}
    print("| log decays | previous fp32 | previous, CPU bf16 autocast | now fp32 | now, CPU bf16 autocast |")
    print("|---|---|---|---|---|")
    for label, g in decays.items():
        ref = HA.gated_delta_rule_recurrent(q, k, v, g, beta)[0]
        f32 = [t.float() for t in (q, k, v, g, beta)]
        errs = []
        for fn in (previous_chunked, HA.gated_delta_rule_chunked):
            for cast in (False, True):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
                    o = fn(*f32)[0]
                errs.append(((o.double() - ref).norm() / ref.norm()).item())
        print(f"| {label} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    accuracy()
    fns = {"new": HA.gated_delta_rule_chunked, "previous": previous_chunked}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, fp32, chunk 64, median of {args.repeats}")
    print("| B | H | T | K=V | fwd new ms | fwd previous ms | fwd speed-up | fwd+bwd new ms | fwd+bwd previous ms | fwd+bwd speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B, H, T, K in ((8, 4, 128, 32), (16, 4, 64, 32), (1, 4, 256, 64), (1, 4, 1024, 64), (1, 4, 4096, 64), (8, 4, 1024, 32)):
        x = inputs(B, H, T, K)
        leaves = [t.clone().requires_grad_() for t in x]
        o_new, o_old = fns["new"](*x)[0], fns["previous"](*x)[0]
        assert ((o_new - o_old).norm() / o_old.norm()) < 1e-5
        times = {(n, w): [] for n in fns for w in ("fwd", "fwdbwd")}
        for rep in range(args.repeats + 1):  # first round is warm-up
            for name, fn in fns.items():    # interleaved: A, B, A, B, ...
                t0 = time.perf_counter()
                with torch.no_grad():
                    fn(*x)
                t1 = time.perf_counter()
                o, S = fn(*leaves)
                (o.sum() + S.sum()).backward()
                t2 = time.perf_counter()
                if rep:
                    times[name, "fwd"].append(t1 - t0)
                    times[name, "fwdbwd"].append(t2 - t1)
        med = {key: 1e3 * statistics.median(v) for key, v in times.items()}
        print(f"| {B} | {H} | {T} | {K} | {med['new', 'fwd']:.2f} | {med['previous', 'fwd']:.2f} | "
              f"{med['previous', 'fwd'] / med['new', 'fwd']:.2f}× | {med['new', 'fwdbwd']:.2f} | "
              f"{med['previous', 'fwdbwd']:.2f} | {med['previous', 'fwdbwd'] / med['new', 'fwdbwd']:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
