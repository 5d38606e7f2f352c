"""
Plant each bug kind the TSA tests must catch (issue 15), run the tests selected for it, revert.

  python experiments/tsa_plant.py            # every plant; prints CAUGHT/MISSED per plant

Works on a copy of the repo in a temporary folder (tsa.py, common.py, train.py, tests/conftest.py,
tests/test_tsa.py, the Shakespeare text), so the working tree is never modified. Each entry: (what,
exact text in tsa.py, replacement, pytest -k expression).
"""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANTS = [
    ('A router relu removed', 'self.fc2(F.relu(self.fc1(h)))', 'self.fc2(self.fc1(h))', 'router'),
    ('B ST hard not detached', 'return hard.detach() + (soft - soft.detach())', 'return hard + (soft - soft.detach())', 'gates'),
    ('C soft_loss from hard pass', 'hs, ps_soft = self.trunk(x, "soft")', 'hs, ps_soft = self.trunk(x, "hard")', 'eval_stats'),
    ('D EE last exit only', 'loss = torch.stack(losses).mean()', 'loss = losses[-1]', 'early_exit'),
    ('E EE un-exit', 'done = done | (conf > self.threshold)', 'done = conf > self.threshold', 'early_exit'),
    ('F1 flops: K/V share of QKV wrong', '    kv = 2 * q ', '    kv = 1 * q ', 'flops'),
    ('F1b the same, against the FLOP counter', '    kv = 2 * q ', '    kv = 1 * q ', 'flops_accounting_matches'),
    ('F2 flops query counts kv*alpha', '"query": kv + alpha * (per_query + ffn)', '"query": alpha * (kv + per_query + ffn)', 'flops'),
    ('I alpha from soft pass with targets', 'stats["soft_alpha"] = torch.stack([(1.0 - p).mean() for p in ps_soft]).mean()', 'stats["soft_alpha"] = torch.stack([(1.0 - p).mean() for p in ps_soft]).mean(); stats["alpha"] = stats["soft_alpha"]', 'eval_stats'),
    ('G1 sparse attn ignores scaled gate (bf16)', 'return x.view(B * T, C).index_add(0, idx, delta.to(x.dtype) * gi)', 'return x.view(B * T, C).index_add(0, idx, delta.to(x.dtype))', 'sparse_equals_eval and bf16'),
    ('G2 sparse causal mask off-by-one (bf16)', 'torch.arange(hi, device=x.device) <= pos[:, :, None]', 'torch.arange(hi, device=x.device) <= pos[:, :, None] + 1', 'sparse_equals_eval and bf16'),
    ('G2b sparse: no causal mask (causality, bf16)', 'torch.arange(hi, device=x.device) <= pos[:, :, None]', 'torch.arange(hi, device=x.device) <= hi + 0 * pos[:, :, None]', 'causality and sparse and bf16'),
    ('G4 ffn gate dropped (bf16)', 'x = xf.index_add(0, idx, delta.to(x.dtype) * gi).view(B, T, C)', 'x = xf.index_add(0, idx, delta.to(x.dtype)).view(B, T, C)', 'sparse_equals_eval and bf16 and scaled'),
    ('G5 FFN-only attention ungated (bf16)', 'x = x + g * block.attn_delta(x).to(x.dtype)\n            if N:', 'x = x + block.attn_delta(x).to(x.dtype)\n            if N:', 'sparse_equals_eval and bf16'),
    ('G6 router decisions in bf16', 'return torch.sigmoid(z.to(torch.promote_types(z.dtype, torch.float32)))', 'return torch.sigmoid(z)', 'router'),
    ('G8 packed positions off by one (bf16)', 'pos = t.new_zeros(B * Wj).index_copy_(0, slot, tj)', 'pos = t.new_zeros(B * Wj).index_copy_(0, slot, tj + 1)', 'sparse_equals_eval and bf16'),
    ('H1 halted rows write zero K at decode (bf16)', 'k, v = cache.append(pos, k, v)                                     # (B, nh, pos + 1, hs)', 'k, v = cache.append(pos, k * (1 if active is None else active.view(-1, 1, 1, 1)), v)', 'cached_decode_equals and bf16'),
    ('H2 wrong position embedding in step (bf16)', 'x = self.wte(tok) + self.wpe.weight[pos]', 'x = self.wte(tok) + self.wpe.weight[pos - 1]', 'cached_decode_equals and bf16'),
    ('H3 mixed batch: gates of wrong rows (bf16)', 'g if isinstance(g, float) else g[rows]', 'g if isinstance(g, float) else g[rows].flip(0)', 'cached_decode_equals and bf16'),
    ('H4 halted token runs the block anyway at decode', '        if n == 0:\n            cache.append', '        if n == -1:\n            cache.append', 'decode_step_skips'),
    ('H5 step: scaled gate ignored (bf16)', 'g = 1.0 if p is None or self.cfg.hard_variant == "01" else 1.0 - p', 'g = 1.0', 'cached_decode_equals and bf16'),
    ('H6 prefill returns wrong position', '        return self.head(h[:, -1:])[0][:, -1], (caches, idx.size(1))', '        return self.head(h[:, -1:])[0][:, -1], (caches, idx.size(1) - 1)', 'generate'),
    ('K routers get no task gradient (p detached in trunk)', '            g = self.gate(p, mode)\n', '            g = self.gate(p.detach(), mode)\n', 'training_step and bf16'),
    ('L eval skip_l off by one block', 'stats.update({f"skip_l{l + 1}": 1.0 - h for l, h in enumerate(hard)})', 'stats.update({f"skip_l{l}": 1.0 - h for l, h in enumerate(hard)})', 'eval_stats'),
    ('M routing_map uses soft p', 'actives = [p <= 0.5 for p in self.trunk(x, "hard")[1]]', 'actives = [p <= 0.4 for p in self.trunk(x, "soft")[1]]', 'routing_map'),
    ("N sparse: a chunk's queries see keys of the wrong range", 'k[:, :, :hi], v[:, :, :hi]', 'k[:, :, lo:hi + lo], v[:, :, lo:hi + lo]', 'sparse_equals_eval and bf16'),
    ('O sparse FLOPs: Q for every token', 'q = q_proj(attn, h.view(B * T, C).index_select(0, idx))', 'q = q_proj(attn, h.view(B * T, C)).index_select(0, idx)', 'flops_accounting_matches'),
]


def main():
    missed = 0
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "tests"))
        for f in ("tsa.py", "common.py", "train.py", "tests/conftest.py", "tests/test_tsa.py"):
            shutil.copy(os.path.join(ROOT, f), os.path.join(d, f))
        text = os.path.join(ROOT, "data", "shakespeare", "input.txt")
        if os.path.exists(text):
            os.makedirs(os.path.join(d, "data", "shakespeare"))
            shutil.copy(text, os.path.join(d, "data", "shakespeare", "input.txt"))
        src = open(os.path.join(d, "tsa.py")).read()
        for what, old, new, sel in PLANTS:
            if src.count(old) != 1:
                print(f"STALE   {what}: the planted text occurs {src.count(old)} times in tsa.py")
                missed += 1
                continue
            open(os.path.join(d, "tsa.py"), "w").write(src.replace(old, new))
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                "tests/test_tsa.py", "-k", sel], cwd=d, capture_output=True, text=True)
            failed = [l.split(" ")[1] for l in r.stdout.splitlines() if l.startswith("FAILED")]
            print(("CAUGHT " if r.returncode else "MISSED ") + what + (f" by {failed[0]}" if failed else ""), flush=True)
            missed += not r.returncode
        open(os.path.join(d, "tsa.py"), "w").write(src)
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
