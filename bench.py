"""
Wall-clock benchmarks on cuda, mps or cpu. Every comparison (A vs B) is timed in the same run, interleaved,
and reported as a ratio; FLOPs-ideal speedups come from common.py's accounting.

  python bench.py gpt                      # our dense GPT vs a plain nanoGPT-style model
  python bench.py tsa --json out/bench_tsa.json
  python bench.py all --quick              # every suite at small sizes (a smoke run)

Timing: warm-up calls, then the median of --repeats calls, each bracketed by common.sync(device).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import common


def timeit(fns, device, repeats=10, warmup=3):
    """Median seconds of each callable in fns (a dict), interleaved so drift hits all of them alike."""
    times = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            common.sync(device)
            t = time.perf_counter()
            fn()
            common.sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def train_step(model, x, y, device):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        with common.autocast(device):
            _, loss, _ = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def forward(model, x, **kw):
    @torch.no_grad()
    def run():
        with common.autocast(common.pick_device(str(x.device))):
            model(x, **kw)
    return run


def batch(cfg, B, T, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return x.to(device), y.to(device)


# ----------------------------------------------------------------------------------------------------
# gpt: our dense GPT vs a plain nanoGPT-style model written here (same sizes, fused QKV, SDPA)

class PlainBlock(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.nh = nh
        self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(PlainBlock(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss, {}


def bench_gpt(args, device):
    cfg = common.Config(block_size=256)
    B, T = (4, 64) if args.quick else (16, 256)
    ours, plain = common.Model(cfg).to(device), PlainGPT(cfg).to(device)
    x, y = batch(cfg, B, T, device)
    rows = []
    for what, make in (("forward", lambda m: forward(m, x)), ("train_step", lambda m: train_step(m, x, y, device))):
        t = timeit({"ours": make(ours), "plain": make(plain)}, device, args.repeats)
        rows.append({"suite": "gpt", "what": what, "B": B, "T": T, "ours_ms": 1e3 * t["ours"],
                     "plain_ms": 1e3 * t["plain"], "tokens_per_s": B * T / t["ours"],
                     "speed_ratio_ours_vs_plain": t["plain"] / t["ours"]})
    return rows


# ----------------------------------------------------------------------------------------------------

SUITES = {"gpt": bench_gpt}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=list(SUITES) + ["all"])
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--json", default="", help="also write the rows to this JSON file")
    p.add_argument("--ckpt", default="", help="a trained checkpoint, for suites that use trained routers")
    args = p.parse_args(argv)
    try:
        device = common.pick_device(args.device)
        torch.manual_seed(0)
        rows = []
        for name in (SUITES if args.suite == "all" else [args.suite]):
            for r in SUITES[name](args, device):
                r["device"] = str(device)
                rows.append(r)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                      flush=True)
    except common.NanorouteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json + ".tmp", "w") as f:
            json.dump({"argv": sys.argv, "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "rows": rows}, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    return rows


if __name__ == "__main__":
    main()
