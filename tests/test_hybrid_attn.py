"""Tests for hybrid_attn.py: the gated delta rule (chunked == recurrent), the GDN layer's decode step, routing,
the balance loss, sparse == dense-hard, causality, cached decoding, and the CLI."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import common
import hybrid_attn as H
from common import NanorouteError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




def gdr_inputs(B=2, Hh=3, T=37, K=8, V=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    q = F.normalize(r(B, Hh, T, K), dim=-1) * K ** -0.5
    k = F.normalize(r(B, Hh, T, K), dim=-1)
    v = r(B, Hh, T, V)
    gate = -torch.rand(B, Hh, T, generator=g, dtype=dtype) * 2   # log decays in (−2, 0]
    beta = torch.rand(B, Hh, T, generator=g, dtype=dtype)
    S0 = r(B, Hh, K, V)
    return q, k, v, gate, beta, S0


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- gated delta rule

@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent_float64(chunk, with_state):
    q, k, v, g, beta, S0 = gdr_inputs(T=37)  # 37 is not a multiple of 3, 16 or 64: exercises the padding
    S0 = S0 if with_state else None
    o1, s1 = H.gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=S0)
    o2, s2 = H.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=chunk, initial_state=S0)
    assert o2.shape == o1.shape and s2.shape == s1.shape
    assert torch.allclose(o2, o1, atol=1e-10, rtol=1e-10)
    assert torch.allclose(s2, s1, atol=1e-10, rtol=1e-10)


def test_chunked_equals_recurrent_float32():
    q, k, v, g, beta, S0 = gdr_inputs(T=100, dtype=torch.float32)
    o1, s1 = H.gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=S0)
    o2, s2 = H.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=32, initial_state=S0)
    assert o2.dtype == torch.float32 and s2.dtype == torch.float32
    assert rel(o2, o1) < 1e-5 and rel(s2, s1) < 1e-5


def test_recurrence_matches_hand_computation():
    """One head, 2 steps, K = V = 1: S1 = β1 v1 k1, S2 = e^{g2} S1 + k2 β2 (v2 − e^{g2} S1 k2)."""
    k1, k2, v1, v2, b1, b2, g2 = 0.6, -0.8, 1.5, -2.0, 0.3, 0.7, -0.5
    f = lambda *xs: torch.tensor(xs, dtype=torch.float64)
    q = f(1.0, 1.0).view(1, 1, 2, 1)
    o, S = H.gated_delta_rule_recurrent(q, f(k1, k2).view(1, 1, 2, 1), f(v1, v2).view(1, 1, 2, 1),
                                        f(0.0, g2).view(1, 1, 2), f(b1, b2).view(1, 1, 2))
    S1 = b1 * v1 * k1
    Sd = torch.exp(f(g2)).item() * S1
    S2 = Sd + k2 * b2 * (v2 - Sd * k2)
    assert torch.allclose(o.flatten(), f(S1, S2)) and abs(S.item() - S2) < 1e-12


@pytest.mark.parametrize("fn", ["recurrent", "chunked"])
def test_split_with_carried_state_equals_one_pass(fn):
    q, k, v, g, beta, _ = gdr_inputs(T=50)
    run = (lambda *a, s=None: H.gated_delta_rule_recurrent(*a, initial_state=s)) if fn == "recurrent" else \
        (lambda *a, s=None: H.gated_delta_rule_chunked(*a, chunk_size=16, initial_state=s))
    o, S = run(q, k, v, g, beta)
    cut = 21
    oa, Sa = run(*(t[:, :, :cut] for t in (q, k, v, g, beta)))
    ob, Sb = run(*(t[:, :, cut:] for t in (q, k, v, g, beta)), s=Sa)
    assert torch.allclose(torch.cat([oa, ob], 2), o, atol=1e-10) and torch.allclose(Sb, S, atol=1e-10)


def test_chunked_gradcheck():
    q, k, v, g, beta, S0 = gdr_inputs(B=1, Hh=1, T=7, K=3, V=2)
    args = [t.clone().requires_grad_() for t in (q, k, v, g, beta, S0)]
    f = lambda q, k, v, g, b, s: H.gated_delta_rule_chunked(q, k, v, g, b, chunk_size=3, initial_state=s)
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)


def test_chunked_stable_with_strong_decay():
    """Masking before exp: big negative gates must not produce inf/nan (exp(+large) above the diagonal)."""
    q, k, v, g, beta, _ = gdr_inputs(T=64, dtype=torch.float32)
    g = g * 100  # log decays down to −200 per token
    o1, s1 = H.gated_delta_rule_recurrent(q, k, v, g, beta)
    o2, s2 = H.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=64)
    assert torch.isfinite(o2).all() and rel(o2, o1) < 1e-5


# ---------------------------------------------------------------- config

def tiny(**kw):
    base = dict(n_layer=4, n_head=2, n_embd=32, block_size=32, vocab_size=40, chunk_size=8)
    return H.Config(**{**base, **kw})


@pytest.mark.parametrize("kw,msg", [
    (dict(pattern="G R S"), "has 3 layers"),
    (dict(pattern="G R X S"), "unknown layer 'X'"),
    (dict(pattern="R G G S"), "layer 0 cannot be routed"),
    (dict(balance=-0.1), "balance"),
    (dict(tau_end=0.0), "temperatures"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_config_errors(kw, msg):
    with pytest.raises(NanorouteError, match=msg):
        tiny(**kw)


def test_config_pattern_forms():
    assert tiny(pattern="GRRS").kinds == tiny(pattern="G R R S").kinds == "GRRS"


def test_gdn_inits_and_no_weight_decay():
    torch.manual_seed(0)
    m = H.Model(tiny(n_head=4))
    gdn = m.blocks[0].gdn
    A = gdn.A_log.exp()
    dt = F.softplus(gdn.dt_bias)
    assert ((A > 0) & (A <= 16)).all() and ((dt >= 1e-3 - 1e-9) & (dt <= 0.1 + 1e-9)).all()
    opt = common.make_optimizer(m, m.cfg, torch.device("cpu"))
    no_decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    for layer in m.blocks:
        if hasattr(layer, "gdn"):
            assert id(layer.gdn.A_log) in no_decay and id(layer.gdn.dt_bias) in no_decay
            assert id(layer.gdn.qkv_proj.weight) not in no_decay


def test_gdn_layer_decode_step_matches_forward():
    torch.manual_seed(0)
    cfg = tiny()
    gdn = H.GatedDeltaNet(cfg).double()
    gdn.reset_gdn_parameters()
    x = torch.randn(2, 11, cfg.n_embd, dtype=torch.float64)
    full = gdn(x)
    cache = {}
    out = [gdn(x[:, :2], cache)]  # prefill 2 tokens (fewer than the conv's 3-token tail), then step
    out += [gdn.step(x[:, t:t + 1], cache) for t in range(2, 11)]
    assert torch.allclose(torch.cat(out, 1), full, atol=1e-10)


# ---------------------------------------------------------------- routing and balance loss

def test_balance_loss_values():
    hard_bal = F.one_hot(torch.tensor([0, 1] * 50), 2).float().view(100, 1, 2)
    probs_bal = torch.full((100, 1, 2), 0.5)
    assert abs(H.balance_loss(probs_bal, hard_bal).item() - 1.0) < 1e-6      # balanced: 1.0
    hard_col = torch.tensor([1.0, 0.0]).expand(100, 1, 2)
    assert abs(H.balance_loss(hard_col, hard_col).item() - 2.0) < 1e-6       # collapsed: 2.0
    # paper example: f = [0.9, 0.1], P = [0.9, 0.1] -> 2·(0.81 + 0.01) = 1.64; mean over two layers
    hard = F.one_hot(torch.tensor([0] * 90 + [1] * 10), 2).float()[:, None].expand(100, 2, 2)
    probs = torch.tensor([0.9, 0.1]).expand(100, 2, 2)
    assert abs(H.balance_loss(probs, hard).item() - 1.64) < 1e-6


def test_train_routing_is_hard_straight_through():
    torch.manual_seed(0)
    m = H.Model(tiny())
    x = torch.randint(0, 40, (4, 32))
    y, probs, hard = m.route(m.blocks[0](m.embed(x)))
    assert torch.equal(y.detach(), hard) and set(hard.unique().tolist()) == {0.0, 1.0}
    assert y.requires_grad and torch.allclose(probs.sum(-1), torch.ones(()))
    _, loss, stats = m(x, x)
    assert {"lm_loss", "balance", "tau", "gdn_frac_l1", "gdn_frac_l2"} <= set(stats)
    assert all(not v.requires_grad and v.numel() == 1 for v in stats.values())
    assert torch.isclose(loss, stats["lm_loss"] + 0.01 * stats["balance"])


@pytest.mark.parametrize("which", ["lm", "balance"])
def test_gradients_reach_the_router(which):
    """Through the LM loss alone (straight-through Gumbel, α = 0) and through the balance loss alone."""
    torch.manual_seed(0)
    m = H.Model(tiny(balance=0.0 if which == "lm" else 1.0))
    x = torch.randint(0, 40, (2, 32))
    _, loss, stats = m(x, x)
    (loss if which == "lm" else loss - stats["lm_loss"]).backward()
    assert m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0
    assert m.blocks[0].gdn.A_log.grad is not None  # layer 0 feeds the router


def test_eval_routing_is_deterministic_argmax():
    torch.manual_seed(0)
    m = H.Model(tiny()).eval()
    x = torch.randint(0, 40, (2, 32))
    a, _, sa = m(x, x)
    b, _, sb = m(x, x)
    assert torch.equal(a, b) and sa["gdn_frac_l1"] == sb["gdn_frac_l1"]
    h0 = m.blocks[0](m.embed(x))
    z = m.router(m.ln_r(h0)).view(2, 32, 2, 2)
    assert torch.isclose(sa["gdn_frac_l1"], (z[:, :, 0].argmax(-1) == 0).float().mean())


def test_temperature_schedule():
    m = H.Model(tiny(max_iters=100, tau_start=1.0, tau_end=0.25))
    m.on_step(0); assert m.tau == 1.0
    m.on_step(50); assert abs(m.tau - 0.5) < 1e-12
    m.on_step(100); assert abs(m.tau - 0.25) < 1e-12


# ---------------------------------------------------------------- sparse path, causality, decoding

def routed_counts(m, x):
    m.eval()
    with torch.no_grad():
        _, _, hard = m.route(m.blocks[0](m.embed(x)))
    return hard[..., 1].sum(1)  # (B, nR) tokens routed to softmax per row


def test_sparse_equals_dense_hard_router_decisions():
    torch.manual_seed(3)
    m = H.Model(tiny()).eval()
    x = torch.randint(0, 40, (4, 32))
    counts = routed_counts(m, x)
    assert len(set(counts[:, 0].tolist())) > 1  # rows route different numbers of tokens
    with torch.no_grad():
        dense, _, sd = m(x, x)
        sparse, _, ss = m(x, x, sparse=True)
    assert torch.allclose(sparse, dense, atol=1e-5)
    assert sd["gdn_frac_l1"] == ss["gdn_frac_l1"]


def test_sparse_equals_dense_forced_and_really_skips(monkeypatch):
    torch.manual_seed(0)
    m = H.Model(tiny(pattern="G R R S")).double().eval()
    x = torch.randint(0, 40, (3, 32))
    forced = torch.zeros(3, 32, 2, dtype=torch.bool)
    forced[0, ::3, 0] = True           # row 0: 11 tokens in layer 1
    forced[1, 5, 0] = True             # row 1: 1 token
    forced[:, 10:20, 1] = True         # layer 2: 10 tokens in every row; row 2 of layer 1: none
    m.forced_route = forced
    seen = []
    orig = common.CausalSelfAttention.attend
    monkeypatch.setattr(common.CausalSelfAttention, "attend",
                        lambda self, q, k, v, attn_mask=None: seen.append(q.size(2)) or orig(self, q, k, v, attn_mask))
    with torch.no_grad():
        dense, _, _ = m(x)
        seen.clear()
        sparse, _, _ = m(x, sparse=True)
    assert seen == [11, 10, 32]  # queries attended in layers 1, 2 (max per row), 3 (all)
    assert torch.allclose(sparse, dense, atol=1e-10)
    m.forced_route = torch.zeros(3, 32, 2, dtype=torch.bool)  # nobody routed to softmax: no attention at all
    with torch.no_grad():
        assert torch.allclose(m(x, sparse=True)[0], m(x)[0], atol=1e-10)


def test_sparse_in_train_mode_is_an_error():
    with pytest.raises(NanorouteError, match="eval"):
        H.Model(tiny())(torch.zeros(1, 4, dtype=torch.long), sparse=True)


@pytest.mark.parametrize("mode", ["train", "eval", "sparse"])
def test_causality(mode):
    torch.manual_seed(0)
    m = H.Model(tiny(pattern="G R R S"))
    m.train(mode == "train")
    x = torch.randint(0, 40, (2, 32))
    x2 = x.clone()
    x2[:, 20:] = torch.randint(0, 40, (2, 12))
    outs = []
    for inp in (x, x2):
        torch.manual_seed(7)  # same Gumbel noise tensor in train mode: noise at position t is independent of the input
        outs.append(m(inp, sparse=mode == "sparse")[0].detach())
    assert torch.allclose(outs[0][:, :20], outs[1][:, :20], atol=1e-6)
    assert not torch.allclose(outs[0][:, 20:], outs[1][:, 20:], atol=1e-3)  # the future does change the future


@pytest.mark.parametrize("pattern", ["G R R S", "G G G S", "S S S S", "S R G R"])
def test_cached_decoding_equals_full_forward(pattern):
    torch.manual_seed(0)
    m = H.Model(tiny(pattern=pattern)).double().eval()
    x = torch.randint(0, 40, (3, 30))
    with torch.no_grad():
        full, _, _ = m(x)
        logits, state = m.prefill(x[:, :5])
        steps = [logits]
        for t in range(5, 30):
            logits, state = m.step(x[:, t:t + 1], state)
            steps.append(logits)
    assert torch.allclose(torch.stack(steps, 1), full[:, 4:], atol=1e-9)
    if "R" in pattern:  # some decisions of both kinds were exercised
        c = routed_counts(m, x)
        assert (c > 0).any() and (c < 30).any()


def test_generate_matches_uncached_greedy_past_block_size():
    torch.manual_seed(0)
    m = H.Model(tiny(block_size=16)).double().eval()
    prompt = torch.randint(0, 40, (2, 5))
    cached = m.generate(prompt, 20, temperature=0)
    plain = common.LM.generate(m, prompt, 20, temperature=0)  # cache-free sampler, crops to block_size
    assert torch.equal(cached, plain) and cached.shape == (2, 25)


def test_all_softmax_pattern_loads_dense_gpt_weights():
    torch.manual_seed(0)
    cfg = tiny(pattern="S S S S")
    gpt = common.Model(common.Config(n_layer=4, n_head=2, n_embd=32, block_size=32, vocab_size=40)).eval()
    m = H.Model(cfg).eval()
    m.load_state_dict(gpt.state_dict(), strict=True)  # same names as common.Model: --init_from works
    x = torch.randint(0, 40, (2, 32))
    assert torch.allclose(m(x)[0], gpt(x)[0], atol=1e-6)


def test_static_pattern_has_no_router_or_routing_stats():
    m = H.Model(tiny(pattern="G G G S"))
    x = torch.randint(0, 40, (2, 16))
    _, loss, stats = m(x, x)
    assert not hasattr(m, "router") and set(stats) == {"lm_loss"} and torch.equal(loss, stats["lm_loss"])


def test_flops_accounting():
    cfg = tiny()
    dense = H.flops_per_token(cfg, 32)
    assert H.flops_per_token(cfg, 32, 1.0, sparse=True) == pytest.approx(dense)  # all-softmax sparse = dense-hard
    assert H.flops_per_token(cfg, 32, 0.1, sparse=True) < H.flops_per_token(cfg, 32, 0.5, sparse=True) < dense


# ---------------------------------------------------------------- CLI

def test_cli_smoke(data_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--model", "hybrid", "--dataset", "shakespeare", "--max_iters=2",
           "--eval_interval=2", "--eval_iters=1", "--batch_size=2", "--block_size=32", "--n_embd=32",
           "--n_head=2", f"--data_dir={data_dir}", f"--out_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "val_gdn_frac_l1" in (out / "metrics.jsonl").read_text()
    bad = subprocess.run(cmd[:-2] + ["--pattern=G X R S", f"--data_dir={data_dir}", f"--out_dir={out}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unknown layer" in bad.stderr
