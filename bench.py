"""
Wall-clock benchmarks on cuda, mps or cpu: each routed model against a dense GPT of the same size,
eager and compiled (torch.compile), every pair timed in the same run, interleaved, as a ratio.

  python bench.py tsa                           # TSA vs the dense GPT, eager, small size
  python bench.py all --compile --json F        # every suite, eager and compiled
  python bench.py dtrnet --size busy --compile  # 12 layers x 768, T = 1,024, B = 16 (+ T = 4,096)
  python bench.py hybrid --ckpt out/hybrid-shakespeare/ckpt.pt   # a trained model, its own routing
  python bench.py gpu --json results/gpu_bench.json              # the GPU script (< 8 minutes)
  python bench.py all --quick                   # tiny sizes: a smoke run

A suite (tsa, dtrnet, conddepth, hybrid, mod) builds its model at --size, its routers set so that a
share of the tokens (SHARES) takes the costly path, and a dense GPT of the same size. Rows (`what`):
  graphs          graphs / graph breaks torch._dynamo.explain finds on each path (train_forward,
                  eval_forward, sparse_forward, decode_step_B1, decode_step_B4) and where it breaks;
                  on the CPU at GRAPH_SIZE: the counts do not depend on the device
  forward         the eval forward (dense-hard: every path computed, then selected) vs the dense GPT
  sparse_forward  the sparse forward (only the routed work) vs the dense GPT and the dense-hard
                  forward; eager also at B = 1 and 4
  crossover       the smallest B·T from which the sparse forward beats dense-hard at every B
  train_step      forward, backward and an AdamW step vs the dense GPT's; each one's tok_s and
                  mfu (the FLOPs it executed over the GPU's peak; None on a CPU)
  decode          greedy cached decoding at B = 1 and 8, tokens/s, vs the dense GPT's
Timed rows carry compiled (with --compile every timing is repeated compiled; decoding compiled as
LM.generate(compile=True) runs it, on CUDA as CUDA graphs), routed_ms, dense_ms, speedup = dense /
routed (> 1: the routed model is faster) and, where routing skips work, flops_ideal: the speedup
if time followed the FLOPs saved. The gpt suite times our dense GPT against a plain nanoGPT-style
model.

gpu: every row compiled, in training's dtype (bf16 on CUDA), one measurement at a time, in this
order: B = 1 decoding of each router vs the dense GPT (small size); the training step of each
router vs the dense GPT's (small size); at the busy size each router's sparse forward vs its
dense-hard forward and the dense GPT's; DTRNet's sparse forward at T = 4,096, ρ = 0.1; the training
steps at the busy size. A measurement that would not end within --budget seconds is written as
what=skipped, one that raises (a compiler error) as what=failed with its error, and the run goes on;
--only keeps the measurements whose name ("decode small tsa", "train_step busy hybrid") contains it.

Timing: warm-up calls (compiles included), then the median of --repeats calls or more, each
bracketed by common.sync(device). With --json the file is rewritten after every row.
"""
import argparse
import copy
import importlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import train

DTYPE = None  # the autocast dtype of this run (--dtype; None: what training uses on the device)
MIN_SECONDS = 0.25  # timeit's time per callable at least (0 with --quick: a smoke run)
SIZES = {"quick": dict(n_layer=3, n_head=2, n_embd=64, T=32, B=2),
         "small": dict(n_layer=6, n_head=8, n_embd=256, T=256, B=16),    # TSA's paper size
         "busy": dict(n_layer=12, n_head=12, n_embd=768, T=1024, B=16)}  # GPT-2 small's trunk
GRAPH_SIZE = dict(n_layer=4, n_head=2, n_embd=64, T=64, B=2)  # --quick: QUICK_GRAPH_SIZE
QUICK_GRAPH_SIZE = dict(n_layer=3, n_head=2, n_embd=16, T=16, B=2)
# The share of tokens on the costly path: TSA's α ≈ 0.73 on Shakespeare; DTRNet routes ~10% of the
# tokens to attention (its paper); conddepth's budget ρ; the hybrid's softmax layers in half; MoD
# runs 12.5% of the tokens in every other block (its paper's capacity, which training uses).
SHARES = {"tsa": 0.7, "dtrnet": 0.1, "conddepth": 0.5, "hybrid": 0.5, "mod": 0.125}
LONG_T = 4096  # DTRNet's long context (at the busy size; twice the size's T otherwise)
ROUTERS = ("tsa", "dtrnet", "conddepth", "hybrid", "mod")


def timeit(fns, device, repeats=10, warmup=3):
    """Median seconds of each callable in fns (a dict), interleaved so drift hits all of them alike,
    the order rotating every round so that none always runs first. Fast calls get more rounds than
    `repeats`: ~MIN_SECONDS per callable on average (at most 200), so a slow callable timed beside a
    fast one is not run hundreds of times."""
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


def batch(cfg, B, T, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(device)
                 for _ in range(2))  # x, y


def crossover(sweep, speed, **group):
    """Rows of one sweep (B and T vary, all else fixed) -> a row naming the smallest B·T from which
    on the sparse path beats dense at every measured size (where its skipping starts to pay)."""
    rs = sorted(sweep, key=lambda r: r["B"] * r["T"])
    first = next((r["B"] * r["T"] for i, r in enumerate(rs)
                  if all(q[speed] > 1.0 for q in rs[i:])), "none_measured")
    return {"suite": rs[0]["suite"], "what": "crossover", **group,
            "B_T": "/".join(f"{r['B']}x{r['T']}" for r in rs),
            "speedups": "/".join(f"{r[speed]:.3f}" for r in rs), "sparse_faster_from_BT": first}


def compiled(model):
    """torch.compile as train.py applies it, shapes static: each size its own specialised graphs."""
    return torch.compile(model, dynamic=False)


# --------------------------------------------------------------------------------------------------
# Models: a suite's routed model and the dense GPT of the same size

def configs(suite, size, share):
    """(the suite's Config, the dense GPT's Config) at a size of SIZES. The hybrid: G, then R R S
    repeated, S last (its paper's G R R S at 4 layers); conddepth: the last third of the layers
    controlled at the budget ρ = share, the whole model trained (a like-for-like training step)."""
    L = size["n_layer"]
    arch = dict(vocab_size=65, block_size=size["T"], n_layer=L, n_head=size["n_head"],
                n_embd=size["n_embd"])
    extra = {"hybrid": dict(pattern=" ".join(("G" + "RRS" * L)[:L - 1] + "S")),
             "conddepth": dict(n_controlled=max(1, L // 3), rho=share, controller_only=False)}
    module = importlib.import_module(train.MODELS[suite])
    return module.Config(**arch, **extra.get(suite, {})), common.Config(**arch)


@torch.no_grad()
def set_share(suite, model, x, share):
    """Shift each router so that about `share` of x's tokens take its costly path (TSA: run the
    block; DTRNet: attention; hybrid: softmax attention; conddepth: the full FFN, θ set by a
    training-mode pass at ρ = share), in depth order, each on the decisions of the routers before
    it. An eval decision is a function of the token's state: the share holds in the forward and in
    decoding. This reaches into the paper files (tsa: routers, fc2; dtrnet: blocks, router, w2;
    hybrid: router; conddepth: threshold_batches; what a router's forward returns): where they
    are not found the model keeps its own routing, and this returns "own" for its rows to say so."""
    model.eval()
    try:
        if suite == "conddepth":
            model.cfg.rho = share
            model.threshold_batches.zero_()  # θ restarts from this batch's top-k cut at ρ
            model.train()(x)
            model.eval()
            return share
        if suite == "tsa":  # p = σ(z) > 0.5 halts: the costly path is z <= 0
            routers = [(r, lambda p: -torch.logit(p, 1e-6).flatten()[None], r.fc2)
                       for r in model.routers]
        elif suite == "dtrnet":  # [g_attn, g_bypass] = softmax(z): attention where z_0 > z_1
            routers = [(b.router, lambda p: (p[..., 0].log() - p[..., 1].log()).flatten()[None],
                        b.router.w2) for b in model.blocks if hasattr(b, "router")]
        elif suite == "mod":  # r = w·x (B, T, 1): the block runs where r > 0
            routers = [(b.router, lambda r: r.flatten()[None], b.router)
                       for b in model.blocks if hasattr(b, "router")]
        else:  # z (B, T, 2·nR): [GDN, softmax] per routed layer, softmax where z_1 > z_0
            routers = [(model.router, lambda z: (z[..., 1::2] - z[..., ::2]).flatten(0, -2).T,
                        model.router)]
        for module, score, linear in routers:
            if linear.bias is None:
                linear.bias = nn.Parameter(linear.weight.new_zeros(linear.out_features))
            out = []
            hook = module.register_forward_hook(lambda m, i, o: out.append(o.detach().float()))
            model(x)
            hook.remove()
            q = torch.quantile(score(out[0]), 1 - share, dim=1)  # (decisions,); > 0: costly
            if suite == "tsa":
                linear.bias += q
            elif suite == "mod":
                linear.bias -= q
            elif suite == "dtrnet":
                linear.bias += torch.stack([-q[0], q[0]]) / 2
            else:
                linear.bias[1::2] -= q
        return share
    except (AttributeError, IndexError, TypeError, RuntimeError) as e:
        print(f"bench: {suite}'s routers not found ({type(e).__name__}: {e}); its own routing "
              "is timed", flush=True)
        return "own"


def models(suite, size, device, share=None):
    """(routed model, dense GPT, the share set) at a size of SIZES, eval, on device."""
    share = SHARES[suite] if share is None else share
    cfg, dense_cfg = configs(suite, size, share)
    torch.manual_seed(0)
    routed = train.build(sys.modules[type(cfg).__module__], cfg).to(device)
    dense = common.Model(dense_cfg).to(device).eval()
    x = batch(cfg, min(size["B"], 4), size["T"], device, seed=1)[0]
    return routed, dense, set_share(suite, routed, x, share)


def check_ckpt(suite, path):
    """The checkpoint a suite times, checked before any work: it loads, is this suite's model (not a
    variant without its paths), and its weights fit its config. -> the model, on the CPU."""
    if suite in ("all", "gpu"):
        raise common.NanorouteError(f"--ckpt needs one suite ({', '.join(SUITES)}), not {suite}")
    ck = common.load_checkpoint(path)
    saved = ck["config"] if isinstance(ck["config"], dict) else {}
    if saved.get("model") != suite:
        raise common.NanorouteError(f"--ckpt {path} is a {saved.get('model')!r} run; "
                                    f"bench.py {suite} needs a {suite} checkpoint")
    module = importlib.import_module(train.MODELS[suite])
    try:
        model = train.build(module, module.Config(**saved))
    except TypeError as e:
        raise common.NanorouteError(f"--ckpt {path} has a config this code does not know ({e})")
    if type(model) is not module.Model:
        raise common.NanorouteError(f"--ckpt {path} holds a {type(model).__name__}, a {suite} "
                                    f"variant; bench.py {suite} times {module.Model.__name__}")
    try:
        model.load_state_dict(ck["model"])
    except (RuntimeError, TypeError) as e:
        raise common.NanorouteError(f"--ckpt {path}: its weights do not fit its config "
                                    f"({str(e).strip().splitlines()[0][:160]})")
    return model


# --------------------------------------------------------------------------------------------------
# Graph counts: what torch.compile sees of each path (device-independent)

def explain(fn, *args, **kwargs):
    """(graphs, breaks, the distinct break sites "file:line reason") of one call of fn."""
    torch._dynamo.reset()
    torch._logging.set_logs(dynamo=logging.ERROR)  # the breaks are in the rows, not in warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            e = torch._dynamo.explain(fn)(*args, **kwargs)
    finally:
        torch._logging.set_logs()
    sites = []
    for r in e.break_reasons:
        frame = r.user_stack[-1] if r.user_stack else None
        where = f"{os.path.basename(frame.filename)}:{frame.lineno} " if frame else ""
        site = where + r.reason.strip().splitlines()[0][:80]
        if site not in sites:
            sites.append(site)
    return e.graph_count, e.graph_break_count, "; ".join(sites)


def graph_rows(suite, size=None):
    """what=graphs: each path of the suite's model at `size` (GRAPH_SIZE) on the CPU in fp32, its
    routers set to the suite's share (mixed routing: each data-dependent branch taken both ways)."""
    cpu, size = torch.device("cpu"), size or GRAPH_SIZE
    if suite == "gpt":
        torch.manual_seed(0)
        model = common.Model(configs("tsa", size, 0.5)[1]).eval()
    else:
        model = models(suite, size, cpu)[0]
    x, y = batch(model.cfg, size["B"], size["T"], cpu)
    half = size["T"] // 2
    paths = {"train_forward": lambda: explain(copy.deepcopy(model).train(), x, y),
             "eval_forward": lambda: explain(model, x)}
    if suite != "gpt":
        paths["sparse_forward"] = lambda: explain(model, x, sparse=True)
    for B in (1, 4):
        idx = batch(model.cfg, B, half + 1, cpu, seed=B)[0]
        paths[f"decode_step_B{B}"] = lambda idx=idx: explain(
            model.step, idx[:, half:], model.prefill(idx[:, :half])[1])
    rows = []
    for path, run in paths.items():
        row = {"suite": suite, "what": "graphs", "path": path, "device": "cpu", "dtype": "fp32",
               "n_layer": size["n_layer"], "B": int(path[-1]) if "B" in path else size["B"],
               "T": size["T"]}
        try:
            row["graphs"], row["breaks"], row["break_sites"] = run()
        except Exception as e:  # a path that does not trace is a finding, not a crash
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        rows.append(row)
    torch._dynamo.reset()
    return rows


# --------------------------------------------------------------------------------------------------
# Timed rows: routed vs dense, eager or compiled

def ideal(model, x):
    """The speedup if time followed FLOPs: 1 / (1 − the share of FLOPs the eval forward saved)."""
    with torch.no_grad(), common.autocast(x.device, DTYPE):
        stats = model.eval()(x, x)[2]  # with targets: some models report FLOPs with a loss only
    return 1.0 / (1.0 - float(stats.get("flops_saved_hard", 0.0)))


def forward_rows(suite, routed, dense, x, tags, device, repeats, comp, sweep=()):
    """what=forward and what=sparse_forward at x; eager, also the sparse forward at the `sweep`
    batch sizes and their crossover row."""
    r, d = (compiled(routed), compiled(dense)) if comp else (routed, dense)
    fns = {"dense": forward(d, x), "hard": forward(r, x), "sparse": forward(r, x, sparse=True)}
    t = timeit(fns, device, repeats)
    B, T = x.shape
    base = {"suite": suite, "what": "forward", **tags, "compiled": comp, "B": B, "T": T}
    rows = [{**base, "routed_ms": 1e3 * t["hard"], "dense_ms": 1e3 * t["dense"],
             "speedup": t["dense"] / t["hard"]}]
    sparse = [{**base, "what": "sparse_forward", "routed_ms": 1e3 * t["sparse"],
               "dense_ms": 1e3 * t["dense"], "hard_ms": 1e3 * t["hard"],
               "speedup": t["dense"] / t["sparse"], "speedup_vs_hard": t["hard"] / t["sparse"],
               "flops_ideal": ideal(routed, x)}]
    for Bs in sweep:
        xs = batch(routed.cfg, Bs, T, device, seed=Bs)[0]
        t = timeit({"hard": forward(routed, xs), "sparse": forward(routed, xs, sparse=True)},
                   device, repeats)
        sparse.append({**base, "what": "sparse_forward", "B": Bs, "routed_ms": 1e3 * t["sparse"],
                       "hard_ms": 1e3 * t["hard"], "speedup_vs_hard": t["hard"] / t["sparse"],
                       "flops_ideal": ideal(routed, xs)})
    if sweep:
        sparse.append(crossover(sparse, "speedup_vs_hard", **tags))
    return rows + sparse


def train_rows(suite, routed, dense, x, y, tags, device, repeats, comp):
    """what=train_step, on copies of both models (training moves the routers off their share)."""
    r, d = copy.deepcopy(routed).train(), copy.deepcopy(dense).train()
    r, d = (compiled(r), compiled(d)) if comp else (r, d)
    t = timeit({"routed": train_step(r, x, y, device), "dense": train_step(d, x, y, device)},
               device, repeats)
    # tokens/s and MFU as train.py logs them: the FLOPs each step executed (the routed model's
    # from a training forward's stats) against the peak of the dtype (None on a CPU)
    with torch.no_grad(), common.autocast(device, DTYPE):
        stats = copy.deepcopy(routed).train()(x, y)[2]
    peak = common.peak_flops(device, DTYPE or common.default_dtype(device))
    T, tokens = x.size(1), x.numel()
    rate = {k: common.throughput(m.train_flops_per_token(T, st), tokens, t[k], peak)
            for k, m, st in (("routed", routed, stats), ("dense", dense, {}))}
    return [{"suite": suite, "what": "train_step", **tags, "compiled": comp, "B": x.size(0),
             "T": T, "routed_ms": 1e3 * t["routed"], "dense_ms": 1e3 * t["dense"],
             "speedup": t["dense"] / t["routed"],
             **{f"{k}_{f}": v for k, tm in rate.items() for f, v in zip(("tok_s", "mfu"), tm)}}]


def decode_rows(suite, routed, dense, tags, device, Bs, comp):
    """what=decode: greedy cached generation after a 16-token prompt (fewer in a short context),
    routed vs the dense GPT (None: the routed model alone), interleaved; compiled:
    LM.generate(compile=True), its compile and CUDA-graph recording in the warm-up calls.
    flops_ideal: from the routing the eval forward takes on the generated text."""
    T = routed.cfg.block_size
    n0 = max(1, min(16, T // 2))
    n_new = max(1, min(8 if MIN_SECONDS == 0 else 128, T - n0))
    rows = []

    def gen(m, prompt):
        def run():
            with common.autocast(device, DTYPE):
                return m.generate(prompt, n_new, temperature=0, compile=comp)
        return run
    for i, B in enumerate(Bs):
        if comp and i:
            torch._dynamo.reset()  # each B its own static-shape step
        prompt = batch(routed.cfg, B, n0, device, seed=B)[0]
        fns = {"routed": gen(routed, prompt), **({"dense": gen(dense, prompt)} if dense else {})}
        t = timeit(fns, device, 3, warmup=3 if comp else 1)  # a call is n_new steps: steady
        t.setdefault("dense", t["routed"])
        rows.append({"suite": suite, "what": "decode", **tags, "compiled": comp, "B": B,
                     "T": n0 + n_new, "new_tokens": n_new, "tokens_per_s": B * n_new / t["routed"],
                     "dense_tokens_per_s": B * n_new / t["dense"],
                     "speedup": t["dense"] / t["routed"],
                     "flops_ideal": ideal(routed, gen(routed, prompt)()) if dense else 1.0})
    return rows


# --------------------------------------------------------------------------------------------------
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
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
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


def size_tag(args):
    """A row's size: the checkpoint's model where --ckpt gave one (what is printed is what ran),
    else the size's name."""
    if args.model is None:
        return args.size_name
    c = args.model.cfg
    return f"{args.ckpt}: {c.n_layer} x {c.n_embd}, T = {c.block_size}"


def bench_gpt(args, device, rows, size, modes):
    rows += graph_rows("gpt", QUICK_GRAPH_SIZE if args.quick else None)
    torch.manual_seed(0)
    ours = args.model or common.Model(configs("tsa", size, 0.5)[1])
    ours = ours.to(device)
    plain = PlainGPT(ours.cfg).to(device)
    B, T = (8, ours.cfg.block_size) if args.model else (size["B"], size["T"])
    x, y = batch(ours.cfg, B, T, device)
    for comp in modes:
        for what, run in (("forward", lambda m: forward(m, x)),
                          ("train_step", lambda m: train_step(m.train(), x, y, device))):
            o, p = (compiled(ours), compiled(plain)) if comp else (ours, plain)
            t = timeit({"ours": run(o), "plain": run(p)}, device, args.repeats)
            rows.append({"suite": "gpt", "what": what, "size": size_tag(args), "compiled": comp,
                         "B": B, "T": T, "ours_ms": 1e3 * t["ours"], "plain_ms": 1e3 * t["plain"],
                         "tokens_per_s": B * T / t["ours"],
                         "speed_ratio_ours_vs_plain": t["plain"] / t["ours"]})
            if what == "train_step":  # MFU as train.py logs it (None on a CPU: peak unknown)
                peak = common.peak_flops(device, DTYPE or common.default_dtype(device))
                rows[-1]["mfu"] = common.throughput(ours.train_flops_per_token(T), B * T,
                                                    t["ours"], peak)[1]
        tags = {"size": size_tag(args)}
        rows += decode_rows("gpt", ours.eval(), None, tags, device, (1, 8), comp)


# --------------------------------------------------------------------------------------------------
# A routed suite, and the GPU script

def bench_routed(suite, args, device, rows, size, modes):
    rows += graph_rows(suite, QUICK_GRAPH_SIZE if args.quick else None)
    if args.model:  # the trained routers, on B = 8 windows of the run's context
        routed, cfg = args.model.to(device).eval(), args.model.cfg
        dense = common.Model(common.Config(**{k: getattr(cfg, k) for k in common.ARCH_FIELDS}))
        dense, share, B, T = dense.to(device).eval(), "trained", 8, cfg.block_size
    else:
        routed, dense, share = models(suite, size, device)
        B, T = size["B"], size["T"]
    tags = {"size": size_tag(args), "share_set": share}
    x, y = batch(routed.cfg, B, T, device)
    for comp in modes:
        rows += forward_rows(suite, routed, dense, x, tags, device, args.repeats, comp,
                             sweep=() if comp else sorted({1, min(4, B)} - {B}))
        rows += train_rows(suite, routed, dense, x, y, tags, device, args.repeats, comp)
        rows += decode_rows(suite, routed, dense, tags, device, (1, 8), comp)
    if suite == "dtrnet" and args.size_name == "busy" and not args.model:
        rows += long_rows(args.size_name, device, args.repeats, modes)


def long_rows(size_name, device, repeats, modes):
    """DTRNet's sparse forward at LONG_T (twice T below the busy size), ρ = 0.1, vs the dense GPT;
    B a quarter of the size's: the same number of tokens."""
    size = SIZES[size_name]
    T = LONG_T if size_name == "busy" else 2 * size["T"]
    size = {**size, "T": T, "B": max(1, size["B"] // 4)}
    routed, dense, share = models("dtrnet", size, device, share=0.1)
    x = batch(routed.cfg, size["B"], size["T"], device)[0]
    out = []
    for comp in modes:
        r, d = (compiled(routed), compiled(dense)) if comp else (routed, dense)
        t = timeit({"dense": forward(d, x), "sparse": forward(r, x, sparse=True)}, device, repeats)
        out.append({"suite": "dtrnet", "what": "sparse_forward", "size": f"{size_name}_T{T}",
                    "share_set": share, "compiled": comp, "B": size["B"], "T": size["T"],
                    "routed_ms": 1e3 * t["sparse"], "dense_ms": 1e3 * t["dense"],
                    "speedup": t["dense"] / t["sparse"], "flops_ideal": ideal(routed, x)})
    return out


def bench_gpu(args, device, rows):
    """The GPU script: compiled measurements in priority order, each skipped (a what=skipped row)
    when the time used and the slowest measurement so far (compiles dominate) pass --budget, and
    written as what=failed when it raises. --only keeps those whose name contains its text."""
    small, big = args.size_name, "quick" if args.quick else "busy"

    def run(what, s, size):
        routed, dense, share = models(s, SIZES[size], device)
        x, y = batch(routed.cfg, SIZES[size]["B"], SIZES[size]["T"], device)
        tags = {"size": size, "share_set": share}
        if what == "decode":
            return decode_rows(s, routed, dense, tags, device, (1,), True)
        if what == "train_step":
            return train_rows(s, routed, dense, x, y, tags, device, args.repeats, True)
        return forward_rows(s, routed, dense, x, tags, device, args.repeats, True)
    plan = [("decode", s, small) for s in ROUTERS] + [("train_step", s, small) for s in ROUTERS]
    plan += [("sparse_forward", s, big) for s in ROUTERS] + [("long", "dtrnet", big)]
    plan += [("train_step", s, big) for s in ROUTERS]
    plan_names = [f"{what} {size} {s}" for what, s, size in plan]
    groups = [(f"{what} {size} {s}", lambda w=what, s=s, z=size: long_rows(
        z, device, args.repeats, (True,)) if w == "long" else run(w, s, z))
        for what, s, size in plan]
    groups = [g for g in groups if args.only in g[0]]
    if not groups:  # a filter that matches nothing says so, before a run that measures nothing
        raise common.NanorouteError(f"--only {args.only!r} matches no measurement of the gpu "
                                    f"suite (names like: {', '.join(plan_names[:3])}, ...)")
    start, slowest = time.monotonic(), 0.0
    for i, (name, measure) in enumerate(groups):
        used = time.monotonic() - start
        if used + slowest > args.budget:
            for skipped, _ in groups[i:]:
                rows.append({"suite": skipped.split()[-1], "what": "skipped", "group": skipped,
                             "why": f"time budget: {used:.0f} s of {args.budget:.0f} s used, the "
                                    f"slowest measurement so far took {slowest:.0f} s"})
            return
        t = time.monotonic()
        try:
            rows += measure()
        except Exception as e:  # a compiler failure is a result: say which and go on
            rows.append({"suite": name.split()[-1], "what": "failed", "group": name,
                         "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"})
        slowest = max(slowest, time.monotonic() - t)


# --------------------------------------------------------------------------------------------------

SUITES = {"gpt": bench_gpt, **{s: (lambda s: lambda *a: bench_routed(s, *a))(s) for s in ROUTERS}}


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


class Rows(list):
    """The rows of this run: each is printed and, with --json, the file rewritten (atomically) as it
    is measured, so a run stopped half-way keeps every row it finished."""

    def __init__(self, args, device):
        super().__init__()
        self.args, self.device = args, device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self.head = {"argv": sys.argv, "torch": torch.__version__, "commit": commit(),
                     "device_name": name, "threads": torch.get_num_threads()}

    def append(self, r):
        r.setdefault("device", str(self.device))
        r.setdefault("dtype", DTYPE)
        super().append(r)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in r.items()), flush=True)
        if self.args.json:  # rewritten after every row: a run stopped half-way keeps its rows
            text = json.dumps({**self.head, "rows": list(self)}, indent=1)
            common.atomic_write(self.args.json, lambda f: f.write(text.encode()))

    def __iadd__(self, rs):
        for r in rs:
            self.append(r)
        return self


def check_json(path):
    """--json names a file that can be written (its folder is made if missing)."""
    if os.path.isdir(path):
        raise common.NanorouteError(f"--json {path} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise common.NanorouteError(f"--json {path}: {parent} is a file, not a folder")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w"):
            pass
        os.remove(path + ".tmp")
    except OSError as e:
        raise common.NanorouteError(f"--json {path}: cannot write there ({e.strerror or e})")


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every entry point here
        print(f"error: {message} (python bench.py --help)", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=list(SUITES) + ["all", "gpu"], help="a suite, all, or gpu")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=list(common.DTYPES), default=None,
                   help="autocast dtype (default: training's: bf16 on CUDA, fp32 elsewhere)")
    p.add_argument("--size", choices=["small", "busy"], default="small",
                   help="small: 6 layers x 256, T = 256, B = 16; busy: 12 x 768, T = 1,024, B = 16")
    p.add_argument("--quick", action="store_true", help="tiny sizes (3 x 64, T = 32): a smoke run")
    p.add_argument("--compile", action="store_true", help="also time each row compiled")
    p.add_argument("--repeats", type=int, default=10, help="timed calls at least (default 10)")
    p.add_argument("--budget", type=float, default=450.0, help="gpu: seconds to end within (450)")
    p.add_argument("--only", default="", help="gpu: only the measurements whose name contains this")
    p.add_argument("--json", default="", help="also write the rows to this file, after every row")
    p.add_argument("--ckpt", default="", help="a trained checkpoint of the suite's model")
    args = p.parse_args(argv)
    try:
        global DTYPE, MIN_SECONDS
        if args.repeats < 1:
            raise common.NanorouteError(f"--repeats must be >= 1, got {args.repeats}")
        if not args.budget > 0:
            raise common.NanorouteError(f"--budget must be > 0 seconds, got {args.budget}")
        if args.only and args.suite != "gpu":
            raise common.NanorouteError(f"--only picks among the gpu suite's measurements; "
                                        f"bench.py {args.suite} would ignore it")
        args.model = check_ckpt(args.suite, args.ckpt) if args.ckpt else None
        device = common.pick_device(args.device)
        DTYPE = args.dtype or common.default_dtype(device)
        common.autocast(device, DTYPE)  # refuses a dtype this device cannot run, before any work
        if args.json:
            check_json(args.json)
        MIN_SECONDS = 0.0 if args.quick else MIN_SECONDS
        args.size_name = "quick" if args.quick else args.size
        torch._dynamo.config.cache_size_limit = 64  # many models, sizes and paths in one process
        rows = Rows(args, device)
        if args.suite == "gpu":
            bench_gpu(args, device, rows)
        for name in [] if args.suite == "gpu" else SUITES if args.suite == "all" else [args.suite]:
            SUITES[name](args, device, rows, SIZES[args.size_name],
                         (False, True) if args.compile else (False,))
    except common.NanorouteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return list(rows)


if __name__ == "__main__":
    main()
