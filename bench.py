"""
Wall-clock benchmarks on cuda, mps or cpu. Every comparison (A vs B) is timed in the same run, interleaved,
and reported as a ratio; FLOPs-ideal speedups come from common.py's accounting.

  python bench.py gpt                      # our dense GPT vs a plain nanoGPT-style model
  python bench.py tsa --json out/bench_tsa.json
  python bench.py all --quick              # every suite at small sizes (a smoke run)
  python bench.py all --device cuda --dtype bf16

Sweeps over batch or length end with a `what=crossover` row: the smallest B·T from which on the sparse path
beats dense at every measured size. Every suite ends with `what=decode` rows: cached generation at batch 1
and 8, `tokens_per_s` of the routed model next to `dense_tokens_per_s` of the dense GPT of the same size
(also cached), timed interleaved, and `flops_ideal`, the ratio time would show if it followed FLOPs.

Timing: warm-up calls, then the median of --repeats calls, each bracketed by common.sync(device).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import common


def timeit(fns, device, repeats=10, warmup=3):
    """Median seconds of each callable in fns (a dict), interleaved so drift hits all of them alike, the order
    rotating every round so that none always runs first (after another's cache traffic, or not). Fast calls
    get more rounds than `repeats` (a 15 ms call's median of 5 is noise): ~MIN_SECONDS per callable on average,
    so a slow callable timed beside a fast one is not run hundreds of times."""
    times, order = {name: [] for name in fns}, list(fns.items())
    i = 0
    while i < warmup + repeats:
        for name, fn in order[i % len(order):] + order[:i % len(order)]:
            common.sync(device)
            t = time.perf_counter()
            fn()
            common.sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
        i += 1
        if i == warmup + 1:  # the first timed round sets the number of rounds
            first = sum(ts[0] for ts in times.values())
            repeats = max(repeats, min(int(len(fns) * MIN_SECONDS / max(first, 1e-6)), 200))
    return {name: statistics.median(ts) for name, ts in times.items()}


def ms(t):
    """timeit's medians as row fields, in the order the callables were given: {"dense": s} -> {"dense_ms": 1e3 s}."""
    return {f"{name}_ms": 1e3 * s for name, s in t.items()}


DTYPE = None  # the autocast dtype of this run (--dtype; None: what training uses on the device)
MIN_SECONDS = 0.25  # timeit's time per callable at least (0 with --quick: a smoke run); keeps `all` short on a GPU


def train_step(model, x, y, device):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        with common.autocast(device, DTYPE):
            _, loss, _ = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def forward(model, x, **kw):
    @torch.no_grad()
    def run():
        with common.autocast(x.device, DTYPE):
            model(x, **kw)
    return run


def decode_rows(suite, model, device, args, extra=None, compiled=False):
    """Cached generation tokens/s of `model` (eval, its own routing) and of a dense GPT of the same size, at
    batch 1 and 8, interleaved; greedy from a 16-token prompt. A row per batch size, with `flops_ideal`: the
    dense GPT's FLOPs per token over the model's, with the routing its eval forward takes on the generated text
    (the speed_ratio routed decoding would reach if time followed FLOPs). compiled: a `decode_compiled` row at
    batch 1, both models' steps compiled (CUDA graphs on CUDA), compile time excluded (warm-up calls)."""
    cfg = model.cfg
    arch = {k: getattr(cfg, k) for k in common.ARCH_FIELDS}
    torch.manual_seed(0)  # the dense GPT of the same size; the gpt suite's model is one (timed once)
    dense = model if type(model) is common.Model else common.Model(common.Config(**arch)).to(device).eval()
    n_new = 8 if args.quick else min(128, cfg.block_size - 16)
    rows, reps = [], max(1, min(args.repeats, 3))  # a call is n_new steps: its median of 3 is steady

    def gen(m, prompt, compile=False):
        def run():
            with common.autocast(device, DTYPE):
                m.generate(prompt, n_new, temperature=0, compile=compile)
        return run
    for B in (1, 8):
        prompt = torch.randint(0, cfg.vocab_size, (B, 16), generator=torch.Generator().manual_seed(B)).to(device)
        fns = {"routed": gen(model, prompt)}
        if dense is not model:
            fns["dense"] = gen(dense, prompt)
        t = timeit(fns, device, reps, warmup=1)
        t.setdefault("dense", t["routed"])
        row = {"suite": suite, "what": "decode", "B": B, "new_tokens": n_new, **(extra or {}),
               "tokens_per_s": B * n_new / t["routed"], "dense_tokens_per_s": B * n_new / t["dense"],
               "speed_ratio": t["dense"] / t["routed"]}
        if "flops_ideal" not in row:  # the FLOPs the routing saved on the generated text, from the eval forward
            with torch.no_grad(), common.autocast(device, DTYPE):
                seq = model.generate(prompt, n_new, temperature=0)
                saved = model(seq[:, :-1], seq[:, 1:])[2].get("flops_saved_hard", 0.0)
            row["flops_ideal"] = 1.0 / (1.0 - float(saved))  # dense GPT FLOPs / routed FLOPs per token
        rows.append(row)
        if compiled and B == 1:
            fns = {"eager": gen(model, prompt), "compiled": gen(model, prompt, compile=True)}
            if dense is not model:
                fns["dense_compiled"] = gen(dense, prompt, compile=True)
            t = timeit(fns, device, reps, warmup=3)  # warm-up: compile, CUDA-graph record
            rows.append({"suite": suite, "what": "decode_compiled", "B": 1, "new_tokens": n_new, **(extra or {}),
                         "compiled_tokens_per_s": n_new / t["compiled"], "eager_tokens_per_s": n_new / t["eager"],
                         "dense_compiled_tokens_per_s": n_new / t.get("dense_compiled", t["compiled"]),
                         "speedup_compile": t["eager"] / t["compiled"]})
    return rows


def batch(cfg, B, T, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(device) for _ in range(2))  # x, y


def crossover(sweep, speed, **group):
    """Rows of one sweep (B and T vary, all else fixed) -> a row naming the smallest B·T from which on the
    sparse path beats dense at every measured size (where a small model's sparse path starts to pay)."""
    rs = sorted(sweep, key=lambda r: r["B"] * r["T"])
    first = next((r["B"] * r["T"] for i, r in enumerate(rs) if all(q[speed] > 1.0 for q in rs[i:])), "none_measured")
    return {"suite": rs[0]["suite"], "what": "crossover", **group, "B_T": "/".join(f"{r['B']}x{r['T']}" for r in rs),
            "speedups": "/".join(f"{r[speed]:.3f}" for r in rs), "sparse_faster_from_BT": first}


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


def bench_gpt(args, device, rows):
    cfg = common.Config(block_size=256)
    B, T = (4, 64) if args.quick else (16, 256)
    ours, plain = common.Model(cfg).to(device), PlainGPT(cfg).to(device)
    x, y = batch(cfg, B, T, device)
    for what, make in (("forward", lambda m: forward(m, x)), ("train_step", lambda m: train_step(m, x, y, device))):
        t = timeit({"ours": make(ours), "plain": make(plain)}, device, args.repeats)
        rows.append({"suite": "gpt", "what": what, "B": B, "T": T, **ms(t), "tokens_per_s": B * T / t["ours"],
                     "speed_ratio_ours_vs_plain": t["plain"] / t["ours"]})
    rows += decode_rows("gpt", ours.eval(), device, args, compiled=not args.quick or args.compile)


# ----------------------------------------------------------------------------------------------------
# hybrid: Gated DeltaNet chunked vs recurrent, GDN vs softmax, cached decode per pattern, sparse vs dense-hard

def bench_hybrid(args, device, rows):
    import hybrid_attn as HA
    reps = min(args.repeats, 3)
    B, nh, K = (1, 2, 32) if args.quick else (1, 4, 64)
    for T in ((64, 256) if args.quick else (256, 1024, 4096)):
        g = torch.Generator().manual_seed(T)
        q, k, v = (F.normalize(torch.randn(B, nh, T, K, generator=g), dim=-1).to(device) for _ in range(3))
        gate = (-torch.rand(B, nh, T, generator=g)).to(device)
        beta = torch.rand(B, nh, T, generator=g).to(device)
        leaves = [t.clone().requires_grad_() for t in (q, k, v, gate, beta)]

        def fwd_bwd(fn):
            def run():
                o, S = fn(*leaves)
                (o.sum() + S.sum()).backward()
            return run
        t = timeit({"chunked": fwd_bwd(lambda *a: HA.gated_delta_rule_chunked(*a, chunk_size=64)),
                    "recurrent": fwd_bwd(HA.gated_delta_rule_recurrent)}, device, reps if T <= 1024 else 1,
                   warmup=1)  # T=4096: one timed call; the loop's 4096 steps are ~150k ops (~5 s on a GPU)
        rows.append({"suite": "hybrid", "what": "gdn_fwd_bwd", "B": B, "H": nh, "T": T, "K": K, **ms(t),
                     "speedup_chunked": t["recurrent"] / t["chunked"]})
        with torch.no_grad():
            t = timeit({"gdn": lambda: HA.gated_delta_rule_chunked(q, k, v, gate, beta, chunk_size=64),
                        "softmax": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)},
                       device, args.repeats)
        rows.append({"suite": "hybrid", "what": "gdn_vs_softmax_fwd", "B": B, "H": nh, "T": T, "K": K, **ms(t),
                     "softmax_over_gdn": t["softmax"] / t["gdn"]})

    # cached decoding, tokens/s per pattern (random weights: routed layers split tokens by an untrained router)
    n_new, prompt_len = (16, 8) if args.quick else (128, 16)
    for pattern in ("G R R S", "G G G S", "S S S S"):
        torch.manual_seed(0)
        m = HA.Model(HA.Config(pattern=pattern, block_size=256)).to(device).eval()
        prompt = torch.randint(0, m.cfg.vocab_size, (1, prompt_len), device=device)
        t = timeit({"cached": lambda: m.generate(prompt, n_new, temperature=0),
                    "uncached": lambda: m.generate(prompt, n_new, temperature=0, use_cache=False)}, device, reps,
                   warmup=1)
        rows.append({"suite": "hybrid", "what": "decode_cache_vs_none", "pattern": pattern, "new_tokens": n_new,
                     "cached_tok_s": n_new / t["cached"], "uncached_tok_s": n_new / t["uncached"],
                     "speedup_cache": t["uncached"] / t["cached"]})

    # sparse vs dense-hard forward of the hybrid at forced softmax fractions, FLOPs-ideal next to each
    B, Ts = (2, (64,)) if args.quick else (8, (256, 1024))
    for T in Ts:
        torch.manual_seed(0)
        m = HA.Model(HA.Config(pattern="G R R S", block_size=T)).to(device).eval()
        x, _ = batch(m.cfg, B, T, device)
        for frac in (0.1, 0.5):
            m.forced_route = torch.rand(B, T, len(m.routed), device=device) < frac
            t = timeit({"sparse": forward(m, x, sparse=True), "dense": forward(m, x)}, device, args.repeats)
            ideal = HA.flops_per_token(m.cfg, T) / HA.flops_per_token(m.cfg, T, frac, sparse=True)
            rows.append({"suite": "hybrid", "what": "sparse_vs_dense_hard", "B": B, "T": T, "softmax_frac": frac,
                         **ms(t), "speedup": t["dense"] / t["sparse"], "flops_ideal": ideal})
    for frac in (0.1, 0.5):
        rows.append(crossover([r for r in rows if r["what"] == "sparse_vs_dense_hard" and r["softmax_frac"] == frac],
                              "speedup", softmax_frac=frac))
    if args.ckpt:  # a trained router's own decisions
        ck = common.load_checkpoint(args.ckpt)
        m = HA.Model(HA.Config(**ck["config"])).to(device).eval()
        m.load_state_dict(ck["model"])
        if m.routed:
            T = m.cfg.block_size
            x, _ = batch(m.cfg, 8, T, device)
            with torch.no_grad():
                frac = 1 - m(x)[2][f"gdn_frac_l{m.routed[0]}"].item()
            t = timeit({"sparse": forward(m, x, sparse=True), "dense": forward(m, x)}, device, args.repeats)
            rows.append({"suite": "hybrid", "what": "sparse_vs_dense_trained", "B": 8, "T": T,
                         "softmax_frac_first_routed": frac, **ms(t), "speedup": t["dense"] / t["sparse"]})
    torch.manual_seed(0)
    m = HA.Model(HA.Config(pattern="G R R S", block_size=256 if not args.quick else 32)).to(device).eval()
    rows += decode_rows("hybrid", m, device, args, {"pattern": "G R R S"}, compiled=args.compile)


# ----------------------------------------------------------------------------------------------------
# dtrnet: dense GPT vs DTRNet sparse forward at forced routed fractions ρ (and a trained router), FLOPs-ideal
# speedup next to the measured one; cached generation tokens/s and KV-cache bytes vs dense.

class _ForcedRouter(nn.Module):
    """Routes a ~ρ fraction of tokens: a fixed pseudo-random function of the token's residual vector, so the
    same token gets the same decision in the full forward and in cached decoding."""

    def __init__(self, rho):
        super().__init__()
        self.rho = rho

    def forward(self, x):
        u = torch.frac(x[..., :8].sum(-1).abs() * 9973.0)          # (B, T) ~ uniform in [0, 1)
        p = 0.3 + 0.4 * (u < self.rho).to(x.dtype)
        return torch.stack([p, 1 - p], -1)                         # (B, T, 2)


def bench_dtrnet(args, device, rows):
    import dtrnet
    quick = args.quick
    Ts, B = ((64, 128), 2) if quick else ((512, 1024, 2048, 4096), 8)
    cfg = dtrnet.Config(n_layer=7, n_head=4, n_embd=128, block_size=max(Ts), vocab_size=65)  # bilayer TDTDTDT

    def forced(rho, c=cfg):
        m = dtrnet.Model(c).to(device).eval()
        for blk in m.blocks:
            if isinstance(blk, dtrnet.DTRBlock):
                blk.router = _ForcedRouter(rho)
        return m

    torch.manual_seed(0)
    dense = common.Model(cfg).to(device).eval()
    for T in Ts:
        for rho_set in (0.1, 0.3, 0.5):
            m = forced(rho_set)
            x, _ = batch(m.cfg, B, T, device)
            fns = {"dense": forward(dense, x), "sparse": forward(m, x, sparse=True)}
            if T <= 1024:  # the boolean-mask reference materialises (B, nh, T, T) scores: skip it when large
                fns["eval_masked"] = forward(m, x)
            t = timeit(fns, device, args.repeats, warmup=1 if not quick else 2)
            t.setdefault("eval_masked", float("nan"))
            with torch.no_grad():
                rho = m(x, sparse=True)[2]["frac_attn"].item()  # the fraction actually routed
            ideal, meas = 1.0 / dtrnet.flops_ratio(m.cfg, T, rho), t["dense"] / t["sparse"]
            rows.append({"suite": "dtrnet", "what": "forward_forced", "B": B, "T": T, "rho_set": rho_set, "rho": rho,
                         **ms(t), "speedup_measured": meas, "speedup_flops_ideal": ideal,
                         "gain_fraction_of_ideal": (meas - 1) / (ideal - 1) if ideal > 1 else float("nan")})
    for rho in (0.1, 0.3, 0.5):
        rows.append(crossover([r for r in rows if r.get("rho_set") == rho], "speedup_measured", rho_set=rho))
    if args.ckpt:  # the trained router, at the checkpoint's own context length
        ck = common.load_checkpoint(args.ckpt)
        ccfg = dtrnet.Config(**{k: v for k, v in ck["config"].items() if k in dtrnet.Config.__dataclass_fields__})
        m = dtrnet.Model(ccfg).to(device).eval()
        m.load_state_dict(ck["model"])
        data = common.load_split(ccfg.dataset, "val", ccfg.data_dir)
        meta = common.load_meta(ccfg.dataset, ccfg.data_dir)
        x, _ = common.get_batch(data, meta, B, ccfg.block_size, common.eval_rng(0, "val", 0), device)
        dense_c = common.Model(ccfg).to(device).eval()
        t = timeit({"dense": forward(dense_c, x), "sparse": forward(m, x, sparse=True),
                    "eval_masked": forward(m, x)}, device, args.repeats)
        with torch.no_grad():
            rho = m(x)[2]["frac_attn"].item()
        ideal = 1.0 / dtrnet.flops_ratio(ccfg, ccfg.block_size, rho)
        rows.append({"suite": "dtrnet", "what": "forward_trained", "B": B, "T": ccfg.block_size, "rho_set": "trained",
                     "rho": rho, **ms(t), "speedup_measured": t["dense"] / t["sparse"], "speedup_flops_ideal": ideal})
    # cached decoding at B=1 and 8 vs the dense GPT's KV cache (ρ≈0.1), and the routed cache's bytes
    n_new = 32 if quick else 256
    gcfg = dtrnet.Config(n_layer=7, n_head=4, n_embd=128, block_size=n_new + 16, vocab_size=65)
    m = forced(0.1, gcfg)
    rows += decode_rows("dtrnet", m, device, args, {"rho_set": 0.1}, compiled=args.compile)
    prompt = torch.zeros(1, 16, dtype=torch.long, device=device)
    with torch.no_grad(), common.autocast(device, DTYPE):
        logits, state = m.prefill(prompt)
        for _ in range(n_new):
            logits, state = m.step(logits.argmax(-1, keepdim=True), state)
    held, full = dtrnet.kv_cache_bytes(state)
    rows.append({"suite": "dtrnet", "what": "kv_cache", "B": 1, "T": n_new + 16, "rho_set": 0.1,
                 "kv_bytes": held, "kv_bytes_dense": full, "kv_ratio": held / full})


# ----------------------------------------------------------------------------------------------------
# tsa: training step soft TSA vs dense; inference dense / soft / hard / sparse(FFN) / sparse(FFN+query) with
# forced routing over an α sweep (FLOPs-ideal speedup next to each measured one); batch scaling; a trained ckpt

def bench_tsa(args, device, rows):
    import tsa
    if args.quick:
        kw, B, T, alphas, batches = dict(n_layer=4, n_head=4, n_embd=64), 4, 64, (0.3, 0.73, 1.0), (1, 4)
    else:  # the paper's model (d=256, L=6, H=8) at its benchmark shape, batch 64 × seq 256 (its Table 8)
        kw, B, T = dict(n_layer=6, n_head=8, n_embd=256), 64, 256
        alphas, batches = (0.1, 0.3, 0.5, 0.73, 0.9, 1.0), (1, 8, 64, 128)
    cfg = tsa.Config(vocab_size=65, block_size=T, **kw)
    torch.manual_seed(0)
    dense = common.Model(cfg).to(device)
    model = tsa.Model(cfg).to(device)
    model.load_state_dict(dense.state_dict(), strict=False)  # the same GPT weights plus routers
    reps = args.repeats

    Btr, Ttr = (4, 64) if args.quick else (16, 128)
    x, y = batch(cfg, Btr, Ttr, device)
    model.train()
    t = timeit({"dense": train_step(dense, x, y, device), "tsa": train_step(model, x, y, device)}, device, reps)
    rows.append({"suite": "tsa", "what": "train_step", "B": Btr, "T": Ttr, **ms(t),
                 "ratio_tsa_vs_dense": t["tsa"] / t["dense"]})

    originals = [r.forward for r in model.routers]

    def force(alpha, B):
        """Each router still runs, then a fixed random fraction α of the tokens is declared active."""
        g = torch.Generator().manual_seed(0)
        for r, orig in zip(model.routers, originals):
            keep = (torch.rand(B, T, 1, generator=g) < alpha).to(device)
            r.forward = lambda h, orig=orig, keep=keep: torch.where(keep, 0.25, 0.75) + 0 * orig(h)

    def run(mode, x):
        @torch.no_grad()
        def f():
            with common.autocast(device, DTYPE):
                if mode == "dense":
                    return dense(x)
                model.train(mode == "soft")
                model.cfg.skip_queries = mode == "sparse_query"
                return model(x, sparse=mode.startswith("sparse"))
        return f

    ideal_mode = {"dense": "dense", "soft": "soft", "hard": "soft", "sparse_ffn": "ffn", "sparse_query": "query"}

    def measure(what, B, modes, x):
        t = timeit({m: run(m, x) for m in modes}, device, reps, warmup=1)
        model.eval()
        a_hard = model(x)[2]["alpha_hard"].item() if len(model.routers) else 1.0
        for m in modes:
            ideal = common.dense_flops_per_token(cfg, T) / tsa.flops_per_token(cfg, T, a_hard, ideal_mode[m])
            speed = t["dense"] / t[m]
            rows.append({"suite": "tsa", "what": what, "B": B, "T": T, "alpha": a_hard, "mode": m, "ms": 1e3 * t[m],
                         "speedup_vs_dense": speed, "ideal_speedup": ideal,
                         "frac_of_ideal_gain": (speed - 1) / (ideal - 1) if ideal > 1.001 else float("nan")})

    if args.ckpt:  # only the trained routers, on real validation text (B windows of the run's block_size)
        model, cfg = tsa.load_run(os.path.dirname(args.ckpt))
        model.to(device)
        T = cfg.block_size
        dense = common.Model(cfg).to(device).eval()  # the same weights without routers
        dense.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("routers.")})
        val = common.load_split(cfg.dataset, "val", cfg.data_dir)
        x = torch.stack([torch.from_numpy(val[i * T:(i + 1) * T].astype("int64")) for i in range(B)]).to(device)
        measure("infer_trained_ckpt", B, ["dense", "hard", "sparse_ffn", "sparse_query"], x)
        return
    dense.eval()
    x = batch(cfg, B, T, device)[0]
    for alpha in alphas:  # the α sweep at the paper's shape
        force(alpha, B)
        extra = ["soft", "hard"] if alpha == 0.73 else []
        measure("infer_alpha_sweep", B, ["dense", *extra, "sparse_ffn", "sparse_query"], x)
    for Bs in batches:  # batch-size scaling at the paper's Shakespeare α
        force(0.73, Bs)
        measure("infer_batch_scaling", Bs, ["dense", "sparse_ffn", "sparse_query"], batch(cfg, Bs, T, device)[0])
    for mode in ("sparse_ffn", "sparse_query"):
        rows.append(crossover([r for r in rows if r["what"] == "infer_batch_scaling" and r["mode"] == mode],
                              "speedup_vs_dense", mode=mode))
    for r, orig in zip(model.routers, originals):
        r.forward = orig
    # decode: the real routers, each output bias shifted so that a share α = 0.73 of a batch's tokens is
    # active there (the decision is a function of the token's state, so it holds at decode too)
    x = batch(cfg, 8, T, device, seed=2)[0]
    with torch.no_grad():
        for r in model.routers:  # in order: each calibration sees the previous routers' final decisions
            z = []
            hook = r.fc2.register_forward_hook(lambda mod, inp, out: z.append(out.flatten().float()))
            model.trunk(model.embed(x), "hard")
            hook.remove()
            r.fc2.bias -= z[0].quantile(0.73)  # active: p <= 0.5, i.e. logit <= the α-quantile
        a_hard = model.eval()(x)[2]["alpha_hard"].item()
    ideal = common.dense_flops_per_token(cfg, T) / tsa.flops_per_token(cfg, T, a_hard, "query")
    rows += decode_rows("tsa", model, device, args, {"alpha": a_hard, "flops_ideal": ideal}, compiled=args.compile)


# ----------------------------------------------------------------------------------------------------
# conddepth: sparse vs dense-hard execution of the controlled FFN sub-layers (top-k ρ ∈ {0.25, 0.5}), and the
# whole forward, each next to its FLOPs-ideal speedup

def bench_conddepth(args, device, rows):
    import conddepth as cd
    if args.ckpt:
        ck = common.load_checkpoint(args.ckpt)
        kw = {k: ck["config"][k] for k in common.ARCH_FIELDS}
    else:
        kw = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=65) if args.quick else dict(vocab_size=65)
    B, T = (4, 64) if args.quick else (16, 128)
    for rho in (0.25, 0.5):
        cfg = cd.Config(**{**kw, "block_size": max(T, kw.get("block_size", T))}, rho=rho,
                        n_controlled=1 if args.quick else 2)
        torch.manual_seed(0)
        model = cd.Model(cfg).to(device).eval()
        if args.ckpt:
            model.load_state_dict(ck["model"], strict=False)
        x, _ = batch(cfg, B, T, device)
        model.calibrate_thresholds([x])  # causal θ at the budget ρ (a fresh model starts at θ = +∞: all cheap)
        block, cheap = model.blocks[-1], model.cheap[-1]
        a = torch.randn(B, T, cfg.n_embd, device=device)
        m = cd.topk_mask(torch.randn(B, T, device=device), cd.budget_k(rho, T))
        with torch.no_grad():  # dense: what eval() does, both paths for every token, then select
            t = timeit({"dense": lambda: torch.where(m[..., None], a + block.ffn_delta(a), a + cheap(a)),
                        "sparse": lambda: cd.sparse_ffn(block, cheap, a, m)}, device, args.repeats)
        d, dff = cfg.n_embd, 4 * cfg.n_embd
        ffn, chp = common.flops_ffn(d, dff), common.flops_ffn(d, cfg.cheap_rank)
        rows.append({"suite": "conddepth", "what": "controlled_ffn_sublayer", "rho": rho, "B": B, "T": T, **ms(t),
                     "speedup": t["dense"] / t["sparse"], "ideal_speedup": (ffn + chp) / (rho * ffn + (1 - rho) * chp)})
        C, L = cfg.n_controlled, cfg.n_layer
        attn = common.flops_qkv(d) + common.flops_attn_out(d) + common.flops_attn_scores(d, common.mean_context(T))
        ctrl = cd.controller_flops(cfg, train=False)
        base = L * attn + (L - C) * ffn + common.flops_lm_head(d, cfg.vocab_size) + C * ctrl
        ideal = (base + C * (ffn + chp)) / (base + C * (rho * ffn + (1 - rho) * chp))
        sweep = []
        for Bf in ((1, 4) if args.quick else (1, 8, 64)):  # the whole model, dense-hard vs sparse
            x, _ = batch(cfg, Bf, T, device)
            t = timeit({"dense": forward(model, x), "sparse": forward(model, x, sparse=True)}, device, args.repeats)
            sweep.append({"suite": "conddepth", "what": "model_forward", "rho": rho, "B": Bf, "T": T, **ms(t),
                          "speedup": t["dense"] / t["sparse"], "ideal_speedup": ideal,
                          "frac_of_ideal_gain": (t["dense"] / t["sparse"] - 1) / (ideal - 1),
                          "infer_vs_full": cd.infer_vs_full(cfg)})
        rows += sweep + [crossover(sweep, "speedup", rho=rho)]
        rows += decode_rows("conddepth", model, device, args, {"rho": rho}, compiled=args.compile and rho == 0.5)


# ----------------------------------------------------------------------------------------------------

SUITES = {"gpt": bench_gpt, "hybrid": bench_hybrid, "dtrnet": bench_dtrnet, "tsa": bench_tsa,
          "conddepth": bench_conddepth}


class Rows(list):
    """The rows of this run: each is printed and, with --json, the file rewritten (atomically) as it is
    measured, so a run stopped half-way keeps every row it finished."""

    def __init__(self, args, device):
        super().__init__()
        self.args, self.device = args, device

    def append(self, r):
        r["device"] = str(self.device)
        r.setdefault("dtype", DTYPE)
        super().append(r)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
        if self.args.json:
            with open(self.args.json + ".tmp", "w") as f:
                json.dump({"argv": sys.argv, "torch": torch.__version__, "threads": torch.get_num_threads(),
                           "rows": list(self)}, f, indent=1)
            os.replace(self.args.json + ".tmp", self.args.json)

    def __iadd__(self, rs):
        for r in rs:
            self.append(r)
        return self


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=list(SUITES) + ["all"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=list(common.DTYPES), default=None,
                   help="autocast dtype (default: what training uses on the device: bf16 on CUDA, fp32 elsewhere)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--compile", action="store_true", help="also time compiled decoding in every suite (gpt: always)")
    p.add_argument("--json", default="", help="also write the rows to this JSON file (rewritten after every row)")
    p.add_argument("--ckpt", default="", help="a trained checkpoint, for suites that use trained routers")
    args = p.parse_args(argv)
    try:
        global DTYPE, MIN_SECONDS
        if args.repeats < 1:
            raise common.NanorouteError(f"--repeats must be >= 1, got {args.repeats}")
        if args.json and os.path.isdir(args.json):
            raise common.NanorouteError(f"--json {args.json} is a directory; give a file name")
        MIN_SECONDS = 0.0 if args.quick else MIN_SECONDS
        device = common.pick_device(args.device)
        DTYPE = args.dtype or common.default_dtype(device)
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        torch.manual_seed(0)
        rows = Rows(args, device)
        for name in (SUITES if args.suite == "all" else [args.suite]):
            SUITES[name](args, device, rows)
    except common.NanorouteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return list(rows)


if __name__ == "__main__":
    main()
