"""Markdown tables for results/bench.md from bench.py's --json files (one per suite or one for `all`).

  python experiments/bench_report.py out/bench/cpu_*.json
  python experiments/bench_report.py --host-bound 30e-6     # bench.py all's GPU wall time, modelled on the CPU
  python experiments/bench_report.py --cuda-ops             # the hybrid's what=ops rows as CUDA dispatches them
  python experiments/bench_report.py --decode-sync [cuda]   # B=1 decoding: host-deciding steps vs sync-free ones

Prints, per file set: the machine line, the sparse-vs-dense rows of every suite with the FLOPs-ideal
speed-up and the share of its gain measured, the crossover rows, and the decode rows.
"""
import contextlib
import io
import json
import os
import sys
import types

from compare import md_table

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(paths):
    runs = [json.load(open(p)) for p in paths]
    rows = [r for run in runs for r in run["rows"]]
    devs = sorted({f"{r['device']} {r['dtype']}" for r in rows})
    print(f"torch {runs[0]['torch']}, {runs[0]['threads']} thread(s), {', '.join(devs)}; commands: "
          + "; ".join(" ".join(["python", *run["argv"]]) for run in runs) + "\n")
    speed = []
    for r in rows:
        if r["what"] in ("infer_batch_scaling", "infer_alpha_sweep") and r["mode"].startswith("sparse"):
            s, i, setting = r["speedup_vs_dense"], r["ideal_speedup"], f"{r['mode']}, α={r['alpha']:.2f}"
        elif r["what"] == "forward_forced":
            s, i, setting = r["speedup_measured"], r["speedup_flops_ideal"], f"ρ={r['rho']:.2f}"
        elif r["what"] == "model_forward":
            s, i, setting = r["speedup"], r["ideal_speedup"], f"ρ={r['rho']} (vs dense-hard)"
        elif r["what"] == "sparse_vs_dense_hard":
            s, i, setting = r["speedup"], r["flops_ideal"], f"softmax {r['softmax_frac']} (vs dense-hard)"
        else:
            continue
        speed.append([r["suite"], r["what"], f"{r['B']} × {r['T']}", setting, f"{s:.3f}", f"{i:.3f}",
                      f"{(s - 1) / (i - 1):.2f}" if i > 1.001 else "–"])
    print(md_table(speed, ["suite", "what", "B × T", "setting", "sparse vs dense", "FLOPs-ideal",
                           "share of the ideal gain"]))
    print(md_table([[r["suite"], ", ".join(f"{k}={r[k]}" for k in ("mode", "rho", "rho_set", "softmax_frac") if k in r),
                     r["B_T"], r["speedups"], r["sparse_faster_from_BT"]] for r in rows if r["what"] == "crossover"],
                   ["suite", "sweep", "B×T measured", "speed-ups", "sparse faster from B·T"]))
    setting = lambda r: ", ".join(f"{k}={r[k]:.2f}" if isinstance(r[k], float) else f"{k}={r[k]}"  # noqa: E731
                                  for k in ("alpha", "rho", "rho_set", "pattern") if k in r) or "–"
    print(md_table([[r["suite"], r["B"], setting(r), f"{r['tokens_per_s']:.1f}", f"{r['dense_tokens_per_s']:.1f}",
                     f"{r['speed_ratio']:.3f}", f"{r['flops_ideal']:.3f}"] for r in rows if r["what"] == "decode"],
                   ["suite", "B", "setting", "routed tok/s", "dense GPT tok/s", "ratio", "FLOPs-ideal"]))


def host_bound(per_op):
    """The wall time of `bench.py all --device cuda` (bf16) if every call cost per_op seconds per op it
    dispatches (host-bound; the H100 ran 34–44 µs per op, results/bench.md): each timed callable runs once here,
    on the CPU, under bench's op counter, then bench.timeit's own rule picks the rounds on a clock that every call
    moves by its ops × per_op. Ops outside timed calls (set-up, the FLOPs-ideal forwards) count the same; compile
    is not modelled (a compiled decode step is counted as eager)."""
    import torch
    import bench
    clock, counted, timeit, out = [0.0], [0], bench.timeit, []

    def modelled(fn):
        n = []  # the callable's op count, from its first call

        def call():
            if not n:
                n.append(bench.count_ops(fn)[0])
                counted[0] += n[0]
            clock[0] += n[0] * per_op
        return call
    bench.time = types.SimpleNamespace(perf_counter=lambda: clock[0])
    bench.timeit = lambda fns, *a, **k: timeit({name: modelled(fn) for name, fn in fns.items()}, *a, **k)
    bench.DTYPE = "bf16"
    args = types.SimpleNamespace(quick=False, compile=False, repeats=10, json="", ckpt="")
    for suite, run in bench.SUITES.items():
        start, counted[0], rows = clock[0], 0, bench.Rows(args, torch.device("cpu"))
        with bench.OpCounter() as c, contextlib.redirect_stdout(io.StringIO()):
            run(args, torch.device("cpu"), rows)
        timed, other = clock[0] - start, (c.total - counted[0]) * per_op
        out.append([suite, f"{timed:.1f}", f"{other:.1f}", f"{timed + other:.1f}"])
    total = sum(float(r[3]) for r in out)
    print(md_table(out + [["all", "", "", f"{total:.1f}"]], ["suite", "timed calls s", "other ops s", "total s"]))


def cuda_ops():
    """The hybrid's `what=ops` rows counted here as CUDA dispatches them: F.rms_norm as CUDA's one fused op
    (aten::_fused_rms_norm; the CPU build runs a 6-op composite), then also with fla-core on CUDA, whose decode
    step calls fla's fused kernel: a stand-in dispatches what fla-core 0.6 dispatches besides its launch (two
    allocations) and computes the kernel's numbers uncounted, so every token takes the reference's route. Not
    seen here, added in results/bench.md: a device-to-host copy per tolist(), a launch per fla kernel."""
    import torch
    import torch.nn.functional as F
    import bench
    import hybrid_attn as H

    def fused_rms_norm(x, shape, w, eps):
        with torch._C._DisableTorchDispatch():  # uncounted: one op on CUDA
            r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            return x * r * (1 if w is None else w), r

    def fla_step(q, k, v, g, beta, initial_state, A_log, dt_bias, **kw):  # (B, 1, H, ·), raw g and β logits
        o, S = torch.empty_like(v), q.new_empty(initial_state.shape, dtype=torch.float32)
        with torch._C._DisableTorchDispatch():  # the kernel's work, uncounted
            qn, kn = (t[:, 0] / (t[:, 0].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for t in (q, k))  # (B, H, K)
            St = initial_state * torch.exp(-A_log.exp() * F.softplus(g[:, 0].float() + dt_bias))[..., None, None]
            u = torch.sigmoid(beta[:, 0].float())[..., None] * (v[:, 0] - (St * kn[..., None]).sum(-2))  # (B, H, V)
            S.copy_(St + kn[..., None] * u[..., None, :])
            o.copy_((S * qn[..., None]).sum(-2)[:, None])
        return o, S

    class Cuda(torch.Tensor):  # the step's device test answered yes
        is_cuda = property(lambda self: True)

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_fused_rms_norm", fused_rms_norm, "CPU")
    print("fused RMSNorm:", [(r["path"], r["ops"]) for r in bench.ops_rows("hybrid")])
    step, H._fla_recurrent = H.GatedDeltaNet.step, fla_step
    H.GatedDeltaNet.step = lambda self, y, *a: step(self, y.as_subclass(Cuda), *a)
    print("fused RMSNorm, fla-core:", [(r["path"], r["ops"]) for r in bench.ops_rows("hybrid")])


def decode_sync(dev):
    """B=1 cached decoding, eager bf16: the routed decode steps, which read each routing decision on the host (one
    sync a routed layer, then only the chosen work), against sync-free steps that run every choice and keep one with
    a select (TSA: every block, gated; conddepth: both FFNs), patched in here. Mixed routing (bench.ops_model), the
    dense GPT of the same size beside them, 7 interleaved repeats of a 100-token prompt and 120 greedy tokens."""
    import statistics
    import time
    import torch
    import bench
    import common
    import conddepth
    import tsa

    def tsa_gated_block(model, block, cache, x, pos, mask, p):  # no host read: every row runs the block, the
        attn = block.attn                                      # hard gate (0 for a halted row) keeps its state
        q, k, v = attn.qkv(block.ln_1(x))                      # 3 × (B, nh, 1, hs)
        k, v = cache.append(pos, k, v)                         # (B, nh, S, hs)
        g = model.gate(p, "hard")                              # (B, 1, 1)
        x = tsa.gated(x, g, attn.c_proj(attn.attend(q, k, v, attn_mask=mask)))
        return tsa.gated(x, g, block.ffn_delta(x))

    def conddepth_select_ffn(block, cheap, a, m, sparse_ffn=conddepth.sparse_ffn):  # a decoded token: both FFNs
        if a.size(1) > 1:                                                          # a prompt: as before
            return sparse_ffn(block, cheap, a, m)
        return a + torch.where(m[..., None], block.ffn_delta(a), cheap(a))        # (B, 1, d)

    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    prompt = torch.randint(0, 65, (1, 100), generator=torch.Generator().manual_seed(1)).to(dev)

    def run(m, patch=None):  # (ms a token, the tokens)
        host = patch and getattr(patch[0], patch[1])
        if patch:
            setattr(*patch)
        try:
            sync()
            t = time.perf_counter()
            with torch.autocast(dev, dtype=torch.bfloat16):
                out = m.generate(prompt, 120, temperature=0)
            sync()
            return (time.perf_counter() - t) / 120 * 1e3, out
        finally:
            if patch:
                setattr(patch[0], patch[1], host)

    torch.manual_seed(0)
    gpt = common.Model(common.Config(**bench.OPS_SIZE)).to(dev).eval()
    for suite, patch in (("tsa", (tsa, "decode_block", tsa_gated_block)),
                         ("conddepth", (conddepth, "sparse_ffn", conddepth_select_ffn))):
        m = bench.ops_model(suite).to(dev).eval()
        for _ in range(2):  # warm-up
            run(gpt), run(m), run(m, patch)
        g, h, s = [], [], []
        for _ in range(7):
            g.append(run(gpt)[0])
            (th, a), (ts, b) = run(m), run(m, patch)
            h.append(th)
            s.append(ts)
        mg, mh, ms = (statistics.median(v) for v in (g, h, s))
        print(f"{suite}: ms a token: dense GPT {mg:.3f}, host-deciding {mh:.3f}, sync-free {ms:.3f}; host-deciding "
              f"{ms / mh:.3f}x as fast; same tokens {torch.equal(a, b)}; spreads {min(h):.2f}-{max(h):.2f}, "
              f"{min(s):.2f}-{max(s):.2f}, {min(g):.2f}-{max(g):.2f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--host-bound"]:
        host_bound(float(sys.argv[2]))
    elif sys.argv[1:2] == ["--cuda-ops"]:
        cuda_ops()
    elif sys.argv[1:2] == ["--decode-sync"]:
        decode_sync(sys.argv[2] if len(sys.argv) > 2 else "cuda")
    else:
        main(sys.argv[1:])
