"""
CPU timing of conddepth's inference paths (results/conddepth.md, "Speed"), in one process, interleaved:

  python experiments/conddepth_speed.py forward [pairs]   # sparse vs dense-hard vs dense GPT, B 1 / 8 / 64, T 128
  python experiments/conddepth_speed.py decode [paper]    # cached generate: routed vs the dense GPT, B 1 / 8

One thread. Both: median (and interquartile range) of per-pair time ratios, the pair order alternating, so a
busy machine hits both sides of a pair alike. Until bench.py carries these rows (issue 13).
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import conddepth as cd  # noqa: E402

T = 128


def paired(fa, fb, n):
    r = []
    for i in range(n + 3):
        ts = {}
        for name, f in ((("a", fa), ("b", fb)) if i % 2 else (("b", fb), ("a", fa))):
            t = time.perf_counter()
            f()
            ts[name] = time.perf_counter() - t
        if i >= 3:
            r.append(ts["a"] / ts["b"])
    q = statistics.quantiles(r, n=4)
    return statistics.median(r), q[0], q[2]


@torch.no_grad()
def forward(n):
    for rho in (0.5, 0.25):
        cfg = cd.Config(rho=rho, block_size=T, vocab_size=65)   # 6 × 192, 2 controlled layers, r 24, G3
        torch.manual_seed(0)
        model, gpt = cd.Model(cfg).eval(), common.Model(common.Config(vocab_size=65, block_size=T)).eval()
        for B in (1, 8, 64):
            x = torch.randint(0, 65, (B, T))
            model.calibrate_thresholds([x])
            model(x)
            full = torch.stack([m.float().mean() for m in model.last_masks])
            k = n if B < 64 else max(n // 4, 8)
            sp, lo, hi = paired(lambda: model(x), lambda: model(x, sparse=True), k)
            g, glo, ghi = paired(lambda: gpt(x), lambda: model(x, sparse=True), k)
            routed = cd.flops_per_token(cfg, T, full).item()
            extra = cfg.n_controlled * (common.flops_ffn(cfg.n_embd, cfg.cheap_rank) + cd.controller_flops(cfg, False))
            ideal, ideal_gpt = (common.dense_flops_per_token(cfg, T) + extra) / routed, common.dense_flops_per_token(cfg, T) / routed
            print(f"rho={rho} B={B} full={full.mean():.3f}: sparse vs dense-hard {sp:.3f} (IQR {lo:.3f}-{hi:.3f}), "
                  f"ideal {ideal:.3f}, {100 * (sp - 1) / (ideal - 1):.0f}% of the gain; vs dense GPT {g:.3f} "
                  f"({glo:.3f}-{ghi:.3f}), ideal {ideal_gpt:.3f}", flush=True)


@torch.no_grad()
def decode(paper, new=100):
    reps = 5 if paper else 30
    size = dict(n_layer=12, n_embd=640, n_head=10, n_controlled=4, cheap_rank=80, d_c=128, d_s=64,
                pred_hidden=64) if paper else {}
    arch = {k: v for k, v in size.items() if k in ("n_layer", "n_embd", "n_head")}
    for rho, gate in ((0.5, "G1"), (0.5, "G3"), (0.25, "G1")):
        cfg = cd.Config(rho=rho, block_size=T, vocab_size=65, gate=gate, **size)
        torch.manual_seed(0)
        model, gpt = cd.Model(cfg).eval(), common.Model(common.Config(vocab_size=65, block_size=T, **arch)).eval()
        for f in model.cheap:
            f.down.weight.normal_(0, 0.02)
        model.calibrate_thresholds([torch.randint(0, 65, (16, T))])
        for B in (1, 8):
            prompt = torch.randint(0, 65, (B, 1))
            seeded = lambda m: lambda: (torch.manual_seed(0), m.generate(prompt, new))
            r, lo, hi = paired(seeded(gpt), seeded(model), reps)  # dense time / routed time
            model(model.generate(prompt, new))
            full = torch.stack([m.float().mean() for m in model.last_masks]).mean().item()
            ideal = common.dense_flops_per_token(cfg, new) / cd.flops_per_token(cfg, new, [full] * cfg.n_controlled).item()
            print(f"{gate} d={cfg.n_embd} rho={rho} B={B}: routed/dense tokens/s {r:.3f} (IQR {lo:.3f}-{hi:.3f}), "
                  f"FLOPs-ideal {ideal:.3f}, full {full:.2f}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "forward":
        forward(int(sys.argv[2]) if len(sys.argv) > 2 else 80)
    else:
        decode(len(sys.argv) > 2 and sys.argv[2] == "paper")
