# B=1 cached decoding on CUDA, eager bf16: the host-deciding decode step (a sync a routed layer) against the
# sync-free one (every block run, gated; conddepth: both FFNs and a select), mixed routing, dense GPT beside them.
import os, statistics, sys, time, torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench, common, conddepth, tsa
torch.manual_seed(0)
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
gpt = common.Model(common.Config(**bench.OPS_SIZE)).to(dev).eval()
prompt = torch.randint(0, 65, (1, 100), generator=torch.Generator().manual_seed(1)).to(dev)
N = 120
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

def run(m, mod=None, host=None):
    if mod is not None:
        mod.decides_on_host = (lambda x: True) if host else (lambda x: False)
    sync(); t = time.perf_counter()
    with torch.autocast(dev, dtype=torch.bfloat16):
        out = m.generate(prompt, N, temperature=0)
    sync()
    return (time.perf_counter() - t) / N * 1e3, out

for suite, mod in (("tsa", tsa), ("conddepth", conddepth)):
    m = bench.ops_model(suite).to(dev).eval()
    for _ in range(2):  # warm-up
        run(gpt); run(m, mod, True); run(m, mod, False)
    g, h, s = [], [], []
    for _ in range(7):
        g.append(run(gpt)[0]); a = run(m, mod, True); b = run(m, mod, False); h.append(a[0]); s.append(b[0])
    same = torch.equal(a[1], b[1])
    mg, mh, ms = (statistics.median(v) for v in (g, h, s))
    print(f"{suite}: ms/token gpt {mg:.3f} host-deciding {mh:.3f} no-sync {ms:.3f}  no-sync/host {mh / ms:.3f}x faster"
          f"  vs gpt: host {mg / mh:.3f}x no-sync {mg / ms:.3f}x  same tokens {same}  spread host {min(h):.2f}-{max(h):.2f}"
          f" no-sync {min(s):.2f}-{max(s):.2f} gpt {min(g):.2f}-{max(g):.2f}", flush=True)
