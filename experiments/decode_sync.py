"""B=1 cached decoding, eager bf16: the routed models' decode steps, which read each routing decision on the host
(one sync a routed layer, then only the chosen work), against sync-free steps that run every choice and keep one
with a select (TSA: every block, gated; conddepth: both FFNs). Mixed routing (bench.ops_model), the dense GPT of
the same size beside them, repeats interleaved. Where a sync is cheap (a B=1 step keeps the GPU idle), skipping
work wins; results/bench.md has what the H200 showed.

    python experiments/decode_sync.py [cuda|cpu]
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import common  # noqa: E402
import conddepth  # noqa: E402
import tsa  # noqa: E402


def tsa_gated_block(model, block, cache, x, pos, mask, p):  # tsa.decode_block without the host read: every row
    attn = block.attn                                      # runs the block, the hard gate (0: halted) keeps its state
    q, k, v = attn.qkv(block.ln_1(x))                      # 3 × (B, nh, 1, hs)
    k, v = cache.append(pos, k, v)                         # (B, nh, S, hs)
    g = model.gate(p, "hard")                              # (B, 1, 1)
    x = tsa.gated(x, g, attn.c_proj(attn.attend(q, k, v, attn_mask=mask)))
    return tsa.gated(x, g, block.ffn_delta(x))


def conddepth_select_ffn(block, cheap, a, m, sparse_ffn=conddepth.sparse_ffn):  # a decode token: both FFNs, a
    if a.size(1) > 1:                                                              # select; a prompt: as before
        return sparse_ffn(block, cheap, a, m)
    return a + torch.where(m[..., None], block.ffn_delta(a), cheap(a))            # (B, 1, d)


SYNC_FREE = {"tsa": (tsa, "decode_block", tsa_gated_block),
             "conddepth": (conddepth, "sparse_ffn", conddepth_select_ffn)}


def main(dev):
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    prompt = torch.randint(0, 65, (1, 100), generator=torch.Generator().manual_seed(1)).to(dev)
    n = 120

    def run(m):  # ms a token, tokens
        sync()
        t = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16):
            out = m.generate(prompt, n, temperature=0)
        sync()
        return (time.perf_counter() - t) / n * 1e3, out

    def sync_free(suite, m):
        mod, name, f = SYNC_FREE[suite]
        host = getattr(mod, name)
        setattr(mod, name, f)
        try:
            return run(m)
        finally:
            setattr(mod, name, host)

    torch.manual_seed(0)
    gpt = common.Model(common.Config(**bench.OPS_SIZE)).to(dev).eval()
    for suite in SYNC_FREE:
        m = bench.ops_model(suite).to(dev).eval()
        for _ in range(2):  # warm-up
            run(gpt), run(m), sync_free(suite, m)
        g, h, s = [], [], []
        for _ in range(7):
            g.append(run(gpt)[0])
            a, b = run(m), sync_free(suite, m)
            h.append(a[0])
            s.append(b[0])
        mg, mh, ms = (statistics.median(v) for v in (g, h, s))
        print(f"{suite}: ms/token gpt {mg:.3f} host-deciding {mh:.3f} sync-free {ms:.3f}  host-deciding "
              f"{ms / mh:.3f}x as fast  vs gpt: host-deciding {mg / mh:.3f}x sync-free {mg / ms:.3f}x  same tokens "
              f"{torch.equal(a[1], b[1])}  spread host-deciding {min(h):.2f}-{max(h):.2f} sync-free "
              f"{min(s):.2f}-{max(s):.2f} gpt {min(g):.2f}-{max(g):.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")
