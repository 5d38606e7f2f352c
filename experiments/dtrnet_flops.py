"""FLOPs ratio DTRNet / dense vs sequence length (paper Fig. 4) from dtrnet.flops_ratio (common.py's FLOPs
functions). Paper dims: 360M = 32 layers, d=960, SwiGLU 2560; 1.3B = 24 layers, d=2048, SwiGLU 5632; vocab 32000.
A SwiGLU of width h costs like a 2-matrix MLP of width 1.5h. GQA (360M: 5 kv heads) and RoPE are not counted.
  python experiments/dtrnet_flops.py"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dtrnet  # noqa: E402

MODELS = {"360M": (dict(n_layer=32, n_embd=960, n_head=15), 2560), "1.3B": (dict(n_layer=24, n_embd=2048, n_head=32), 5632),
          "ours (7x128)": (dict(n_layer=7, n_embd=128, n_head=4, vocab_size=65), None)}
Ts = (256, 2048, 4096, 8192, 20000)
print("| model | layers | D layers | ρ | " + " | ".join(f"T={T}" for T in Ts) + " |")
print("|---|---|---|---|" + "---|" * len(Ts))
for name, (kw, h) in MODELS.items():
    for layers in ("bilayer", "trilayer"):
        cfg = dtrnet.Config(**{"vocab_size": 32000, "block_size": max(Ts), **kw}, layers=layers)
        for rho in (0.1, 0.3, 0.5, 1.0):
            r = [dtrnet.flops_ratio(cfg, T, rho, hidden=h and 1.5 * h) for T in Ts]
            print(f"| {name} | {layers} | {cfg.pattern.count('D')}/{cfg.n_layer} | {rho} | "
                  + " | ".join(f"{x:.3f}" for x in r) + " |")
print("\nIf scores were counted over all T keys (non-causal, n_keys = T instead of (T+1)/2), bilayer ρ=0.1:")
for name, (kw, h) in list(MODELS.items())[:2]:
    cfg = dtrnet.Config(**{"vocab_size": 32000, "block_size": 2 * max(Ts), **kw})
    print(name, " ".join(f"T={T}: {dtrnet.flops_ratio(cfg, 2 * T - 1, 0.1, hidden=1.5 * h):.3f}" for T in Ts))
