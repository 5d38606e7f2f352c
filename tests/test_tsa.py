"""Tests for tsa.py (Token-Selective Attention). Tiny float64 configs; the whole file runs in well under 60 s."""
import json
import os
import subprocess
import sys

import pytest
import torch

import common
import tsa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




def tiny(**kw):
    base = dict(n_layer=4, n_head=4, n_embd=32, block_size=32, vocab_size=50)
    base.update(kw)
    return tsa.Config(**base)


def make(seed=0, mixed=False, **kw):
    """A float64 model. mixed=True makes the routers decisive (large weights, bias 0) so roughly half the
    tokens halt at each router, in different numbers per row."""
    torch.manual_seed(seed)
    m = tsa.Model(tiny(**kw)).double()
    if mixed:
        with torch.no_grad():
            for r in getattr(m, "routers", []):
                r.fc1.weight.normal_(0, 1.0)
                r.fc2.weight.normal_(0, 1.0)
                r.fc2.bias.zero_()
    return m


def ids(B=3, T=32, V=50, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_router_parameter_count_paper():
    # §2.2: d=256, L=6 -> 5 routers × (256·64 + 64 + 64 + 1) = 82,565 parameters
    m = tsa.Model(tsa.Config(n_layer=6, n_embd=256, n_head=8, vocab_size=65))
    assert sum(p.numel() for n, p in m.named_parameters() if n.startswith("routers.")) == 82_565
    assert len(m.routers) == 5
    assert all(torch.all(r.fc2.bias == -1.0) for r in m.routers)  # σ(−1) ≈ 0.27 at init


def test_router_hidden_floor():
    assert tsa.Router(32).fc1.out_features == 16  # max(d/4, 16)
    assert tsa.Router(256).fc1.out_features == 64


def test_gate_extremes():
    """p = 0: the plain block exactly; p = 1: h unchanged (eqs. 3–4)."""
    m = make()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    block = m.blocks[1]
    for p_val, expect in ((0.0, block(x)), (1.0, x)):
        for r in m.routers:  # force p by a huge router bias
            torch.nn.init.zeros_(r.fc2.weight)
            torch.nn.init.constant_(r.fc2.bias, 1e4 if p_val == 1.0 else -1e4)
        m.train()
        h, ps = m.trunk(x, "soft")
        assert torch.all(ps[0] == p_val)
        ref = x
        ref = m.blocks[0](ref)
        for b in m.blocks[1:]:
            ref = b(ref) if p_val == 0.0 else ref
        assert torch.equal(h, ref)
    # and one gated block with p = 0 vs common.Block: identical
    g = torch.zeros(2, 16, 1, dtype=torch.float64)
    y = x + (1 - g) * block.attn_delta(x)
    y = y + (1 - g) * block.ffn_delta(y)
    assert torch.equal(y, block(x))


def test_dense_init_matches_gpt_names():
    """Blocks keep common.Model's parameter names, so --init_from a dense checkpoint loads every tensor."""
    dense = common.Model(common.Config(n_layer=4, n_head=4, n_embd=32, block_size=32, vocab_size=50))
    missing, unexpected = make().load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("routers.") for k in missing)


def test_stats_alpha_and_tlops():
    m = make()
    m.train()
    x = ids()
    _, loss, st = m(x, x)
    ps = m.trunk(m.embed(x), "soft")[1]
    alpha = torch.stack([(1 - p).mean() for p in ps]).mean()
    assert torch.allclose(st["alpha"], alpha)
    assert torch.allclose(st["tlops_saved"], 1 - (1 + 3 * alpha) / 4)  # eq. (7), L = 4
    assert torch.allclose(loss, st["lm_loss"] + 1e-3 * alpha)           # eq. (5)
    assert all(f"active_r{l}" in st for l in range(3)) and all(not v.requires_grad for v in st.values())
    assert abs(common.tlops_saving(0.726, 6) - 0.228) < 1e-3  # the paper's Shakespeare point


def test_hard_variants_and_stats():
    m = make(mixed=True)
    m.eval()
    x = ids()
    with torch.no_grad():
        _, _, st = m(x, x)
        ps = m.trunk(m.embed(x), "hard")[1]
    hard = torch.stack([(p <= 0.5).double().mean() for p in ps])
    assert torch.allclose(st["alpha_hard"], hard.mean())
    assert 0.1 < st["alpha_hard"] < 0.9  # the forced routers really mix
    assert "soft_loss" in st and "lm_loss" in st
    p = torch.tensor([[[0.2], [0.7]]], dtype=torch.float64)
    assert torch.equal(m.gate(p, "hard"), torch.tensor([[[0.8], [0.0]]], dtype=torch.float64))
    m01 = make(hard_variant="01")
    assert torch.equal(m01.gate(p, "hard"), torch.tensor([[[1.0], [0.0]]], dtype=torch.float64))
    st_gate = m01.gate(p.clone().requires_grad_(), "hard_st")  # straight-through: hard value, soft gradient
    assert torch.equal(st_gate.detach(), m01.gate(p, "hard"))


@pytest.mark.parametrize("skip_queries", [False, True])
@pytest.mark.parametrize("hard_variant", ["01", "scaled"])
@pytest.mark.parametrize("mixed", [False, True])
def test_sparse_equals_eval(skip_queries, hard_variant, mixed):
    m = make(mixed=mixed, skip_queries=skip_queries, hard_variant=hard_variant)
    if not mixed:  # random routers: scatter the biases so some routers halt some tokens
        with torch.no_grad():
            for r in m.routers:
                r.fc2.weight.normal_(0, 2.0)
    m.eval()
    x = ids(B=4)
    with torch.no_grad():
        dense, _, st = m(x)
        sparse, _, st_s = m(x, sparse=True)
        halted_per_row = [(m.trunk(m.embed(x), "hard")[1][l] > 0.5).sum((1, 2)) for l in range(3)]
    if mixed:  # the test must see halted and active tokens, in different numbers per row
        assert any(len(set(h.tolist())) > 1 for h in halted_per_row)
        assert 0 < st["alpha_hard"] < 1
    assert torch.allclose(dense, sparse, atol=1e-10, rtol=0)
    assert torch.allclose(st["alpha_hard"], st_s["alpha_hard"])


def test_sparse_all_halted_and_all_active():
    for bias in (50.0, -50.0):
        m = make(skip_queries=True)
        with torch.no_grad():
            for r in m.routers:
                r.fc2.bias.fill_(bias)
        m.eval()
        x = ids()
        with torch.no_grad():
            assert torch.allclose(m(x)[0], m(x, sparse=True)[0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("mode", ["train", "eval", "sparse", "hard_train", "early_exit"])
def test_causality(mode):
    m = make(mixed=True, variant="early_exit" if mode == "early_exit" else "tsa",
             threshold=0.05 if mode == "early_exit" else 1.0)
    m.train(mode in ("train", "hard_train"))
    m.hard_train = mode == "hard_train"
    x = ids(B=2)
    y = x.clone()
    y[:, 20:] = (y[:, 20:] + 7) % 50  # change only the future
    with torch.no_grad():
        a = m(x, sparse=mode == "sparse")[0]
        b = m(y, sparse=mode == "sparse")[0]
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-12, rtol=0)
    assert not torch.allclose(a[:, 20:], b[:, 20:])  # ... and the future did change


@pytest.mark.parametrize("hard", [False, True])
def test_gradients_reach_every_router(hard):
    """With λ = 0, so the task loss alone must reach them (the paper's λ=0 routing; the ST estimator)."""
    m = make(mixed=hard, lam=0.0)
    m.train()
    m.hard_train = hard
    x = ids()
    _, loss, _ = m(x, x)
    loss.backward()
    for r in m.routers:
        for p in r.parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0


def test_lambda_pushes_routers_to_halt():
    """∂L_depth/∂b2 > 0 pushes p up: with only the depth loss, a step on b2 raises p."""
    m = make(lam=1.0)
    m.train()
    _, loss, st = m(ids(), ids())
    (loss - st["lm_loss"]).backward()
    assert all(r.fc2.bias.grad.item() < 0 for r in m.routers)  # gradient descent increases b2 → p ↑


def test_on_step_hard_phase():
    m = make(max_iters=100, hard_ft_iters=10)
    m.on_step(89)
    assert not m.hard_train
    m.on_step(90)
    assert m.hard_train
    # in the hard phase the training forward equals the hard eval forward (same values)
    m2 = make(mixed=True, max_iters=100, hard_ft_iters=10)
    m2.on_step(95)
    m2.train()
    x = ids()
    with torch.no_grad():
        a = m2(x)[0]
        m2.eval()
        b = m2(x)[0]
    assert torch.allclose(a, b, atol=1e-12)


def reference_early_exit(m, x, thr):
    """Slow per-token reference of the §3.5 inference: frozen exited tokens, logits from the exit head."""
    h = m.embed(x)
    B, T, _ = h.shape
    exited = [[None] * T for _ in range(B)]
    for l, block in enumerate(m.blocks):
        new = block(h)
        for b in range(B):
            for t in range(T):
                if exited[b][t] is None:
                    h[b, t] = new[b, t]
        logits = m.lm_head(m.exit_norm(l)(h))
        for b in range(B):
            for t in range(T):
                if exited[b][t] is None and (l == len(m.blocks) - 1 or logits[b, t].softmax(-1).max() > thr):
                    exited[b][t] = logits[b, t].clone()
    return torch.stack([torch.stack(r) for r in exited])


def test_early_exit_frozen_state():
    torch.manual_seed(0)
    m = tsa.Model(tiny(variant="early_exit")).double().eval()
    with torch.no_grad():
        m.wte.weight.mul_(10)  # sharper exit heads
        x = ids(B=2)
        full = m(x)[0]
        conf0 = m.lm_head(m.exit_norm(0)(m.blocks[0](m.embed(x)))).softmax(-1).amax(-1)
        for thr in conf0.quantile(torch.tensor([0.3, 0.7], dtype=conf0.dtype)).tolist():  # some exit, some not
            m.threshold = thr
            out, _, st = m(x)
            assert 0 < st["alpha"] < 1
            assert torch.allclose(out, reference_early_exit(m, x, thr), atol=1e-10)
            assert not torch.allclose(out, full)
        m.threshold = 1.0  # never exits: the plain model's last exit
        out, _, st = m(x)
        assert st["alpha"] == 1 and torch.equal(out, full)
    m.train()
    _, loss, st = m(x, x)  # training loss: the mean CE over all L exits
    assert torch.allclose(loss, st["exit_loss"]) and loss.requires_grad and len(m.exit_ln) == 3


def test_flops_accounting():
    cfg = tiny(n_embd=256, n_head=8, n_layer=6, block_size=256)
    dense = tsa.flops_per_token(cfg, 256, mode="dense")
    assert dense == common.dense_flops_per_token(cfg, 256)
    assert tsa.flops_per_token(cfg, 256, 1.0, "ffn") == tsa.flops_per_token(cfg, 256, 1.0, "soft")
    assert tsa.flops_per_token(cfg, 256, 1.0, "query") == pytest.approx(tsa.flops_per_token(cfg, 256, 1.0, "soft"))
    assert tsa.flops_per_token(cfg, 256, 0.5, "query") < tsa.flops_per_token(cfg, 256, 0.5, "ffn") < dense


def test_routing_picture(tmp_path):
    m = make(mixed=True)
    meta = {"dataset": "shakespeare", "itos": [chr(97 + i % 26) if i else "\n" for i in range(50)]}
    text, path = tsa.routing_picture(m.float(), ids(B=1)[0], meta, str(tmp_path))
    assert text.count("\n") == 2 and "\x1b[48;2;" in text
    assert open(path).read().count("<pre>") == 3


def test_bad_config_is_one_line_error():
    for bad in (dict(hard_variant="x"), dict(variant="moe"), dict(lam=-1.0), dict(n_layer=1),
                dict(threshold=2.0), dict(hard_ft_iters=10 ** 9)):
        with pytest.raises(common.NanorouteError):
            tiny(**bad)
    m = make().eval()
    with pytest.raises(common.NanorouteError):
        m.train()(ids(), sparse=True)


def test_cli_smoke(data_dir, tmp_path, capsys):
    """`python train.py --model tsa` end to end (a real subprocess), then the tools and the early-exit
    variant in-process (same code path, without paying another torch import on a busy machine)."""
    out = tmp_path / "run"
    args = ["--model", "tsa", "--dataset", "shakespeare", "--max_iters=2", "--n_layer=2", "--n_embd=32",
            "--n_head=2", "--block_size=32", "--batch_size=4", "--eval_iters=1", "--eval_interval=2",
            "--hard_ft_iters=1", f"--data_dir={data_dir}"]
    r = subprocess.run([sys.executable, "train.py", *args, f"--out_dir={out}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    rec = [json.loads(l) for l in open(out / "metrics.jsonl")]
    ev = [e for e in rec if e["kind"] == "eval"][-1]
    for k in ("val_loss", "val_soft_loss", "val_alpha", "val_alpha_hard", "val_tlops_saved", "val_active_r0"):
        assert k in ev
    tsa.main(["picture", str(out)])
    assert os.path.exists(out / "routing.html")
    import train
    train.main(args + [f"--out_dir={tmp_path / 'ee'}", "--variant=early_exit"])
    tsa.main(["exit_sweep", str(tmp_path / "ee")])
    assert capsys.readouterr().out.count("threshold=") == 13
    with pytest.raises(SystemExit) as e:
        train.main(args + ["--lam=-2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "lam" in err
