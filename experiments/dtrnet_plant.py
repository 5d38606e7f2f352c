"""Plant each bug a DTRNet test must catch, one at a time, in a scratch copy of the repo (this checkout is
never modified), run tests/test_dtrnet.py there and print which tests fail. A row that says "NONE" is a test gap.
  python experiments/dtrnet_plant.py                 # every plant (~25 pytest runs of the file)
  python experiments/dtrnet_plant.py "cache" "λ"     # only plants whose name contains one of these
Window-policy plants (common.window_start monkeypatched) are at the end."""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANTS = [
 ("router reads LN1(x)", "g_attn, g_bypass = self.router(x).unbind(-1)", "g_attn, g_bypass = self.router(self.ln_1(x)).unbind(-1)"),
 ("router GELU", "F.silu(self.w1(x))", "F.gelu(self.w1(x))"),
 ("router ReLU", "F.silu(self.w1(x))", "F.relu(self.w1(x))"),
 ("λ term detached", "g_means = torch.stack([g.mean() for", "g_means = torch.stack([g.mean().detach() for"),
 ("default λ 1e-3", "lam: float = 8e-4 ", "lam: float = 1e-3 "),
 ("paper warm-up 100", "max_iters=2250, warmup_iters=225", "max_iters=2250, warmup_iters=100"),
 ("paper LayerNorm", 'norm="rmsnorm", learning_rate', 'learning_rate'),
 ("unstable pack order", "dim=1, stable=True)", "dim=1, stable=False, descending=True)"),
 ("packed non-causal", "a = v.scatter(1, idx, self.attn.attend(q, k, vr)", "a = v.scatter(1, idx, self.attn.attend(q, k, vr, causal=False)"),
 ("packed attention detached", "self.attn.attend(q, k, vr).to(v.dtype)", "self.attn.attend(q, k, vr).detach().to(v.dtype)"),
 ("D cache stores every token", "K, V, valid = cache.append(split(k), split(v), delta[:, 0])", "K, V, valid = cache.append(split(k), split(v), torch.ones_like(delta[:, 0]))"),
 ("step ignores valid mask", "(valid | ~delta)[:, None, None, :]", "None, causal=False"),
 ("step never skips", "if delta.any():", "if True:"),
 ("prefill pos off by one", "return self.head(x[:, -1:])[0][:, -1], (caches, T)", "return self.head(x[:, -1:])[0][:, -1], (caches, T - 1)"),
 ("cache typed fp32", "k, v = like.new_zeros(*like.shape[:2], new, like.size(3)), like.new_zeros(*like.shape[:2], new, like.size(3))",
  "k, v = like.new_zeros(*like.shape[:2], new, like.size(3), dtype=torch.float32), like.new_zeros(*like.shape[:2], new, like.size(3), dtype=torch.float32)"),
 ("mix swaps g", "g = torch.where(delta, g_attn, g_bypass)", "g = torch.where(delta, g_bypass, g_attn)"),
 ("skip_l = frac", 'stats[f"frac_l{i}"], stats[f"skip_l{i}"] = f, 1 - f', 'stats[f"frac_l{i}"], stats[f"skip_l{i}"] = f, f'),
 ("flops_saved = ratio", "flops_ratio=ratio, flops_saved_hard=1 - ratio", "flops_ratio=ratio, flops_saved_hard=ratio"),
 ("soft_loss missing", 'stats["soft_loss"] = stats["lm_loss"]', 'pass'),
 ("routing_map inverted", "m = torch.stack([d[0].float() for", "m = torch.stack([(~d[0]).float() for"),
 ("masked eq6 without causal", "& causal) | eye", ") | eye"),
]

WINDOW = {  # common.window_start replaced by a wrong policy; test_generate_* must fail
    "sliding window": "lambda n, bs: max(0, n - bs)",
    "restart keeps one token less": "lambda n, bs, f=_c.window_start: f(n, bs) + (n > bs > 2)",
    "restart keeps one token more": "lambda n, bs, f=_c.window_start: f(n, bs) - (n > bs > 2)",
}


def scratch_copy():
    d = tempfile.mkdtemp(prefix="dtrnet_plant_")
    for name in os.listdir(ROOT):
        if name.endswith(".py"):
            shutil.copy(os.path.join(ROOT, name), d)
    shutil.copytree(os.path.join(ROOT, "tests"), os.path.join(d, "tests"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    txt = os.path.join(ROOT, "data", "shakespeare", "input.txt")
    if os.path.exists(txt):  # the CLI smoke test's offline data
        os.makedirs(os.path.join(d, "data", "shakespeare"))
        shutil.copy(txt, os.path.join(d, "data", "shakespeare"))
    return d


def failed_tests(d, extra=()):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, "tests/test_dtrnet.py"],
                       cwd=d, capture_output=True, text=True)
    return sorted({l.split("::")[1].split(" ")[0] for l in r.stdout.splitlines() if l.startswith("FAILED")})


def main(only):
    d = scratch_copy()
    src = os.path.join(d, "dtrnet.py")
    good = open(src).read()
    try:
        for name, a, b in PLANTS:
            if only and not any(o in name for o in only):
                continue
            assert good.count(a) == 1, f"plant {name!r}: the line to change is not in dtrnet.py any more"
            open(src, "w").write(good.replace(a, b))
            failed = failed_tests(d)
            print(f"{name}: {len(failed)} failed: {', '.join(failed) or 'NONE (not caught!)'}", flush=True)
        open(src, "w").write(good)
        for name, fn in WINDOW.items():
            if only and not any(o in name for o in only):
                continue
            with open(os.path.join(d, "tests", "conftest.py"), "a") as f:  # the patch, for this run only
                f.write(f"\nimport common as _c\n_c.window_start = {fn}\n")
            failed = failed_tests(d, ["-k", "generate"])
            shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), os.path.join(d, "tests", "conftest.py"))
            print(f"window: {name}: {len(failed)} failed: {', '.join(failed) or 'NONE (not caught!)'}", flush=True)
    finally:
        shutil.rmtree(d)


if __name__ == "__main__":
    main(sys.argv[1:])
