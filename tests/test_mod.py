"""Mixture-of-Depths tests: tiny float64 models for exactness, the `dev` matrix (CPU fp32/bf16,
CUDA, MPS) for the model contract."""
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import mod
import train
from conftest import decoded_vs_full


def make(seed=0, dtype=torch.float64, **kw):
    """A tiny T R T R model; with bias=True every bias is random (init zeroes them, hiding a lost
    one)."""
    torch.manual_seed(seed)
    base = dict(n_layer=4, n_head=4, n_embd=32, block_size=64, vocab_size=50, capacity=0.25)
    m = mod.Model(mod.Config(**{**base, **kw}))
    for name, p in m.named_parameters():
        if name.endswith("bias"):
            nn.init.normal_(p.data, 0.0, 0.1)
    return m.to(dtype)


def sharpen(m):
    """Unit-gain init: outputs depend on the context and a wrong path differs by more than bf16's
    tolerance; routers far from 0, so decisions are mixed."""
    for name, p in m.named_parameters():
        if p.dim() == 2:
            std = 1.0 if name.startswith(("wte", "wpe")) else p.size(1) ** -0.5
            nn.init.normal_(p.data, 0.0, std)
    return m


def r_blocks(m):
    return [b for b in m.blocks if isinstance(b, mod.MoDBlock)]


class FixedRouter(nn.Module):
    """Test router: logit +1 at position `offset + t` where table (B, T_max) is True, else −1; fp32,
    so every path and dtype takes the same decisions."""

    def __init__(self, table):
        super().__init__()
        self.table, self.offset = table, 0

    def forward(self, x):
        t = self.table[:, self.offset:self.offset + x.size(1)].to(x.device, torch.float32)
        return (2 * t - 1)[..., None]  # (B, T, 1)


class HashRouter(nn.Module):
    """Test router: a pseudo-random half of the tokens by a fixed function of the token's state, so
    a decoded token takes the decision of the full forward and no Python state changes."""

    def forward(self, x):
        u = torch.frac(x[..., :8].float().sum(-1).abs() * 9973.0)  # (B, T) ~ uniform in [0, 1)
        return torch.where(u < 0.5, 1.0, -1.0)[..., None]


def fix_routers(m, table):
    routers = []
    for b in r_blocks(m):
        b.router = FixedRouter(table)
        routers.append(b.router)
    return routers


def mixed_table(B, T, seed=1):
    """Rows routing 0%, 100%, ~10%, ~50%, ~90% of their tokens (cycled over B rows)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.zeros(T, dtype=torch.bool), torch.ones(T, dtype=torch.bool)] + \
           [torch.rand(T, generator=g) < p for p in (0.1, 0.5, 0.9)]
    return torch.stack([rows[i % 5] for i in range(B)])


# --------------------------------------------------------------------------------------------------
# config and constants

@pytest.mark.parametrize("C, T, k", [(0.125, 64, 8), (0.7, 10, 7), (0.3, 10, 3), (0.125, 256, 32),
                                     (0.125, 1, 1), (0.5, 7, 4), (1.0, 5, 5), (0.01, 10, 1),
                                     (0.07, 100, 7), (0.14, 100, 14), (0.070000001, 100, 7),
                                     (0.07000001, 100, 8)])
def test_capacity_k_is_ceil_of_C_T(C, T, k):
    assert mod.capacity_k(C, T) == k  # 0.07 · 100 is 7.000000000000001 in floats: not 8
    # C·T is rounded to 6 decimals first: 7.0000001 is 7, 7.000001 is above it


@pytest.mark.parametrize("kw, msg", [
    (dict(capacity=0.0), "capacity"), (dict(capacity=1.5), "capacity"),
    (dict(capacity=-0.1), "capacity"), (dict(capacity=float("nan")), "capacity"),
    (dict(every=0), "every"), (dict(every=5), "every"), (dict(predictor="topk"), "predictor"),
    (dict(router_weight="tanh"), "router_weight"), (dict(aux_weight=-1.0), "aux_weight"),
])
def test_config_refusals_are_one_line(kw, msg):
    with pytest.raises(common.NanorouteError) as e:
        mod.Config(**{**dict(n_layer=4, n_head=4, n_embd=32), **kw})
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_config_refusal_messages_and_the_edges_of_each_range():
    base = dict(n_layer=4, n_head=4, n_embd=32)
    for kw, want in ((dict(capacity=0.0), "capacity must be in (0, 1], got 0.0"),
                     (dict(every=5), "every must be in 1..n_layer=4, got 5"),
                     (dict(predictor="topk"), "predictor must be one of aux_loss, mlp, got 'topk'"),
                     (dict(router_weight="tanh"),
                      "router_weight must be one of sigmoid, raw, got 'tanh'"),
                     (dict(aux_weight=-1.0), "aux_weight must be >= 0, got -1.0")):
        with pytest.raises(common.NanorouteError) as e:
            mod.Config(**base, **kw)
        assert str(e.value) == want
    # each range's closed ends are accepted: C = 1 (every token), every = n_layer, no BCE
    cfg = mod.Config(**base, capacity=1.0, every=4, aux_weight=0.0, predictor="mlp",
                     router_weight="raw")
    assert cfg.pattern == "TTTR" and mod.Config(**base, every=1).pattern == "RRRR"


def test_cli_refuses_bad_capacity_before_any_work(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "mod", "--capacity=0", f"--out_dir={tmp_path / 'x'}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error:") and "capacity" in err
    assert "\n" not in err and not os.path.exists(tmp_path / "x")


def test_paper_constants_and_pattern():
    cfg = mod.Config()
    assert (cfg.capacity, cfg.every) == (0.125, 2)  # the paper's best: 12.5%, every other block
    # ours where the paper gives none (the docstring's choices): BCE weight, r̂ = σ(r), method a
    assert (cfg.aux_weight, cfg.router_weight, cfg.predictor) == (0.1, "sigmoid", "aux_loss")
    assert mod.Config(n_layer=6, n_head=2, n_embd=8).pattern == "TRTRTR"
    assert mod.Config(n_layer=3, n_head=2, n_embd=8, every=1).pattern == "RRR"
    c = mod.PRESETS["classroom"]
    assert {k: c[k] for k in common.CLASSROOM} == common.CLASSROOM
    assert mod.PRESETS["paper"]["capacity"] == 0.125 and mod.PRESETS["paper"]["every"] == 2


def test_router_parameters_and_dense_checkpoint_loads():
    for predictor, bias in (("aux_loss", False), ("aux_loss", True), ("mlp", False), ("mlp", True)):
        m = make(predictor=predictor, bias=bias)
        extra = m.num_params() - common.Model(m.cfg).num_params()
        pred = (32 * 16 + 16 + (16 + 1) * bias) if predictor == "mlp" else 0  # d → max(d/4, 16) → 1
        assert extra == 2 * (32 + bias + pred)  # two routed blocks: w_θ (d) and the predictor
    m = make(predictor="mlp", n_embd=130, n_head=2)  # d/4 = 32.5 > 16: the hidden width is 32
    assert m.num_params() - common.Model(m.cfg).num_params() == 2 * (130 + 130 * 32 + 32)
    m = make(predictor="mlp")
    missing, unexpected = m.load_state_dict(common.Model(m.cfg).state_dict(), strict=False)
    assert not unexpected and missing
    assert all(".router." in k or ".predictor." in k for k in missing)


def test_init_scales_pinned():
    """common.LM's init on a routed block: w_θ, the predictor and Q/K/V N(0, 0.02), W_O
    N(0, 0.02/√(2L)), biases 0."""
    torch.manual_seed(0)
    m = mod.Model(mod.Config(n_layer=4, n_head=4, n_embd=256, predictor="mlp", bias=True))
    b = r_blocks(m)[0]
    for w, std in ((b.router.weight, 0.02), (b.predictor.fc1.weight, 0.02),
                   (b.attn.c_attn.weight, 0.02), (b.attn.c_proj.weight, 0.02 / 8 ** 0.5)):
        assert w.std().item() == pytest.approx(std, rel=0.1 if w.numel() < 1000 else 0.02)
    assert not b.router.bias.any() and not b.predictor.fc1.bias.any()


def test_predictor_is_the_silu_mlp_by_value():
    """Eq. (5)'s predictor, d → max(d/4, 16) → 1 with SiLU, is the causal logit z of method b."""
    b = r_blocks(make(predictor="mlp", bias=True))[0]
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    p = b.predictor
    want = F.silu(x @ p.fc1.weight.T + p.fc1.bias) @ p.fc2.weight.T + p.fc2.bias  # (B, T, 1)
    assert torch.allclose(b.route(x)[1], want[..., 0], atol=1e-12)


# --------------------------------------------------------------------------------------------------
# top-k routing in training, eq. (3)

def test_top_k_takes_exactly_k_and_ties_go_to_the_lower_position():
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 3, (6, 33), generator=g).double()  # many ties at the k-th weight
    for k in (1, 5, 16, 33):
        idx, member = mod.top_k(r, k)
        assert idx.shape == (6, k) and member.dtype == torch.bool and (member.sum(1) == k).all()
        assert (idx.diff(dim=1) > 0).all()  # ascending positions
        for b in range(6):  # by hand: largest weight first, then the lower position
            want = sorted(range(33), key=lambda i: (-r[b, i].item(), i))[:k]
            assert idx[b].tolist() == sorted(want)


def test_training_runs_exactly_k_tokens_per_sequence_at_a_full_tie():
    """w_θ = 0: every weight ties at 0; each routed block changes exactly the first k positions."""
    m = make(bias=False).train()
    ins, outs = [], []
    for b in r_blocks(m):
        b.router.weight.data.zero_()
        b.register_forward_hook(lambda mod_, a, out: ins.append(a[0]) or outs.append(out[0]))
    x = torch.randint(0, 50, (3, 40))
    _, _, st = m(x, x)
    k = mod.capacity_k(0.25, 40)
    for xin, xout in zip(ins, outs):
        changed = (xin != xout).any(-1)  # (B, T)
        assert (changed.sum(1) == k).all() and changed[:, :k].all()
    assert st["skipped"].item() == pytest.approx(1 - k / 40)


@pytest.mark.parametrize("weight", ["sigmoid", "raw"])
def test_selected_tokens_attend_only_among_themselves_causally(weight):
    """A routed block in training is eq. (3): per row, the dense block (common.Block) run on the
    selected tokens alone in positional order, its update times r̂; the others unchanged."""
    m = make(router_weight=weight, bias=True).train()
    blk = r_blocks(m)[0]
    blk.router.weight.data *= 30  # weights far apart: the top-k is well defined
    x = torch.randn(3, 20, 32, dtype=torch.float64)
    y, r, _, member, ran = blk(x, "topk")
    k = mod.capacity_k(0.25, 20)
    assert torch.equal(member, ran) and (member.sum(1) == k).all()
    for b in range(3):
        idx = torch.topk(r[b], k).indices.sort().values  # no ties in random weights
        xs = x[b, idx][None]  # (1, k, C)
        rhat = torch.sigmoid(r[b, idx]) if weight == "sigmoid" else r[b, idx]
        want = xs + rhat[None, :, None] * (common.Block.forward(blk, xs) - xs)
        assert torch.allclose(y[b, idx], want[0], atol=1e-12)
        rest = torch.ones(20, dtype=torch.bool)
        rest[idx] = False
        assert torch.equal(y[b, rest], x[b, rest])


def test_gradient_reaches_the_router_through_the_weight_only():
    """aux_weight = 0: the LM's gradient alone trains w_θ (through r̂ · f); the predictor (eq. 5)
    gets its gradient from its BCE alone, and that BCE reaches nothing else (the stop-gradient)."""
    x = torch.randint(0, 50, (2, 32))
    m = make(predictor="mlp", aux_weight=0.0).train()
    _, loss, st = m(x, x)
    loss.backward()
    for b in r_blocks(m):
        assert b.router.weight.grad.abs().sum() > 0
        assert all(p.grad is None or not p.grad.any() for p in b.predictor.parameters())
    k = mod.capacity_k(0.25, 32)
    for r, z, mem, _ in m.trunk(m.embed(x), "topk")[1]:  # training's top-k: the router's, not z's
        assert torch.equal(mem, mod.top_k(r, k)[1]) and not torch.equal(mem, mod.top_k(z, k)[1])
    m.zero_grad()
    _, _, st = m(x, x)  # the BCE alone, recomputed from the routes
    aux = torch.stack([F.binary_cross_entropy_with_logits(z, mem.double())
                       for _, z, mem, _ in m.trunk(m.embed(x), "topk")[1]]).mean()
    assert torch.allclose(aux.detach(), st["aux_loss"].double())
    aux.backward()
    for name, p in m.named_parameters():
        if ".predictor." in name:
            assert p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None or not p.grad.any(), name


def test_aux_loss_trains_the_router_and_total_loss_adds_it():
    m = make(aux_weight=0.5).train()
    x = torch.randint(0, 50, (2, 32))
    _, loss, st = m(x, x)
    assert torch.allclose(loss, st["lm_loss"] + 0.5 * st["aux_loss"])
    routes = m.trunk(m.embed(x), "topk")[1]
    bce = torch.stack([F.binary_cross_entropy_with_logits(r, mem.double())
                       for r, _, mem, _ in routes])
    assert torch.allclose(bce.mean(), st["aux_loss"].double())


@pytest.mark.parametrize("predictor", ["aux_loss", "mlp"])
def test_predictors_learn_the_top_k(predictor):
    """Each causal predictor learns top-k membership on a rule it can learn (every block routed,
    random tokens: membership is nearly a function of the token): val accuracy well above the
    majority share 1 − C = 0.75, where it starts near chance."""
    torch.manual_seed(0)
    cfg = mod.Config(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=20, every=1,
                     capacity=0.25, predictor=predictor, aux_weight=1.0)
    m = mod.Model(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    val = torch.randint(0, 20, (16, 32), generator=g)
    before = m.eval()(val, val)[2]["pred_acc"].item()
    m.train()
    for _ in range(150):
        x = torch.randint(0, 20, (8, 32), generator=g)
        loss = m(x, x)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    acc = m.eval()(val, val)[2]["pred_acc"].item()
    assert acc > 0.9 and acc > before + 0.1, (before, acc)


# --------------------------------------------------------------------------------------------------
# eval (causal decisions, dense) == sparse == cached decoding

@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("predictor", ["aux_loss", "mlp"])
def test_sparse_equals_dense_hard_learned_routers(bias, B, predictor):
    m = sharpen(make(bias=bias, predictor=predictor)).eval()
    x = torch.randint(0, 50, (B, 48))
    ref, _, st = m(x, x)
    out, _, st2 = m(x, x, sparse=True)
    assert torch.isfinite(ref).all() and torch.allclose(out, ref, atol=1e-10, rtol=0)
    assert 0.05 < st["skipped"].item() < 0.95  # mixed decisions: the mask matters
    for k in ("skipped", "skip_l1", "skip_l3", "flops_saved_hard", "pred_acc", "lm_loss"):
        assert torch.allclose(st[k], st2[k]), k


def test_sparse_equals_dense_hard_varied_counts_and_no_leak_across_rows():
    m = sharpen(make()).eval()
    table = mixed_table(5, 64)
    fix_routers(m, table)
    x = torch.randint(0, 50, (5, 48))
    ref = m(x)[0]
    assert torch.allclose(m(x, sparse=True)[0], ref, atol=1e-10, rtol=0)
    x2 = x.clone()
    x2[1:] = torch.randint(0, 50, (4, 48))  # other rows change -> row 0 must not
    for sparse in (False, True):
        assert torch.allclose(m(x2, sparse=sparse)[0][0], ref[0], atol=1e-10, rtol=0)


def test_routed_around_tokens_pass_unchanged_and_are_not_seen():
    """Eval: a routed-around token's state is untouched by the block, and changing it changes no
    routed token's output in that block (it is not among the keys)."""
    m = make().eval()
    blk = r_blocks(m)[0]
    table = mixed_table(5, 64)[2:4]
    blk.router = FixedRouter(table)
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    x2 = x.clone()
    off = ~table[:, :30]
    x2[off] += 1.0
    for mode in ("hard", "sparse"):
        y, y2 = blk(x, mode)[0], blk(x2, mode)[0]
        assert torch.equal(y[off], x[off])
        assert torch.allclose(y[~off], y2[~off], atol=1e-12)


@pytest.mark.parametrize("mode", ["eval", "sparse"])
def test_causal(mode):
    m = sharpen(make()).eval()
    x = torch.randint(0, 50, (3, 48))
    x2 = x.clone()
    x2[:, 30:] = torch.randint(0, 50, (3, 18))
    a, _, st = m(x, x, sparse=mode == "sparse")
    b = m(x2, sparse=mode == "sparse")[0]
    assert 0.05 < st["skipped"].item() < 0.95
    assert torch.allclose(a[:, :30], b[:, :30], atol=1e-10, rtol=0)
    assert not torch.allclose(a[:, 30:], b[:, 30:])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("predictor", ["aux_loss", "mlp"])
def test_cached_decode_equals_full_forward(bias, B, predictor):
    m = sharpen(make(bias=bias, predictor=predictor)).eval()
    x = torch.randint(0, 50, (B, 40))
    steps, full = decoded_vs_full(m, x, 6)
    assert torch.allclose(steps, full, atol=1e-10, rtol=0)
    assert 0.05 < m(x)[2]["skipped"].item() < 0.95


def test_decode_writes_no_kv_for_routed_around_tokens():
    """After prefill and steps, a routed block's cache holds row b's routed tokens only: n[b] of
    them, and zeros in every other slot (a routed-around token wrote nothing)."""
    m = make().eval()
    B, T0, T = 5, 9, 30
    table = mixed_table(B, 64)
    routers = fix_routers(m, table)
    x = torch.randint(0, 50, (B, T))
    _, state = m.prefill(x[:, :T0])
    for t in range(T0, T):
        for r in routers:
            r.offset = t
        _, state = m.step(x[:, t:t + 1], state)
    for i in m.routed:
        c = state[0][i]
        assert torch.equal(c.n, table[:, :T].sum(1))
        for b in range(B):
            n = int(c.n[b])
            assert not c.k[b, :, n:].any() and not c.v[b, :, n:].any()
            assert n == 0 or c.k[b, :, :n].abs().sum(-1).all()


def test_eager_decode_skips_the_block_of_routed_around_tokens(monkeypatch):
    """At B = 1 a routed-around token runs no attention and no MLP in a routed block (the host
    decides); at B = 2 the block runs when some row is routed."""
    m = make().eval()
    calls = []
    for b in r_blocks(m):
        monkeypatch.setattr(b, "ffn_delta", lambda h, f=b.ffn_delta: calls.append(1) or f(h))
    table = torch.zeros(2, 64, dtype=torch.bool)
    table[0, 6], table[1, 7] = True, True
    routers = fix_routers(m, table)
    x = torch.randint(0, 50, (2, 9))
    for rows, want in (([0], [0, 2, 0]), ([1], [0, 0, 2]), ([0, 1], [0, 2, 2])):
        for r in routers:
            r.offset, r.table = 0, table[rows]
        _, state = m.prefill(x[rows, :5])
        seen = []
        for t in range(5, 8):
            for r in routers:
                r.offset = t
            calls.clear()
            m.step(x[rows, t:t + 1], state)
            seen.append(len(calls))
        assert seen == want


def test_step_past_block_size_is_refused():
    m = make(block_size=12).eval()
    x = torch.randint(0, 50, (1, 12))
    with pytest.raises(common.NanorouteError):
        m.step(x[:, :1], m.prefill(x)[1])


def test_sparse_requires_eval():
    with pytest.raises(common.NanorouteError) as e:
        make().train()(torch.zeros(1, 4, dtype=torch.long), sparse=True)
    assert str(e.value) == "sparse=True is an inference path: call model.eval() first"


def test_a_zero_logit_is_routed_around_in_every_path():
    """σ(0) = 0.5 is not > 0.5 (eqs. 4-5): with w_θ = 0 every z is exactly 0, and no token runs a
    routed block in eval, sparse or cached decoding; the top-k at that full tie (the first k) is
    what pred_acc compares the decisions with."""
    m = sharpen(make()).eval()
    for b in r_blocks(m):
        b.router.weight.data.zero_()
    x = torch.randint(0, 50, (2, 40))
    for sparse in (False, True):
        _, _, st = m(x, x, sparse=sparse)
        assert st["skipped"].item() == 1.0 and st["pred_acc"].item() == 1 - 10 / 40
    steps, full = decoded_vs_full(m, x, 6)
    assert torch.allclose(steps, full, atol=1e-10, rtol=0)
    _, (caches, _) = m.prefill(x[:, :6])
    m.step(x[:, 6:7], (caches, torch.tensor(6)))
    assert all(not caches[i].n.any() for i in m.routed)


def test_sparse_packs_to_the_most_any_row_routes_and_skips_an_empty_block(monkeypatch):
    """sparse=True runs f on (B, R) tokens, R the most tokens any row routes (not more), and not at
    all where no row routes a token; eval without it (the reference) runs f on all T."""
    m = make().eval()
    table = torch.zeros(3, 64, dtype=torch.bool)
    table[0, [2, 5, 9]], table[1, [1, 4, 6, 7, 8]] = True, True  # rows route 3, 5 and 0 tokens
    fix_routers(m, table)
    shapes = []
    for b in r_blocks(m):
        monkeypatch.setattr(b, "f", lambda x, mask=None, f=b.f:
                             shapes.append(x.shape) or f(x, mask))
    x = torch.randint(0, 50, (3, 12))
    ref = m(x)[0]
    assert shapes == [(3, 12, 32)] * 2  # eval's reference: every token, dense under a mask
    shapes.clear()
    assert torch.allclose(m(x, sparse=True)[0], ref, atol=1e-10, rtol=0)
    assert shapes == [(3, 5, 32)] * 2
    table[:] = False
    shapes.clear()
    m(x, sparse=True)
    assert shapes == []


def test_dropout_is_off_outside_training():
    """cfg.dropout is a training regulariser: eval and sparse give the dropout-free function."""
    x = torch.randint(0, 50, (2, 40))
    ref = sharpen(make()).eval()(x)[0]
    m = sharpen(make(dropout=0.5)).eval()
    for sparse in (False, True):
        assert torch.allclose(m(x, sparse=sparse)[0], ref, atol=1e-10, rtol=0)


# --------------------------------------------------------------------------------------------------
# the model contract on every device × dtype (tests/conftest.py's `dev`)

def dev_model(dev, B=4, T=40, **kw):
    m = sharpen(make(dtype=torch.float32, **kw)).to(dev.device).eval()
    routers = fix_routers(m, mixed_table(B, 64).to(dev.device))
    return m, routers, torch.randint(0, 50, (B, T), device=dev.device)


def close(a, b, dev):
    atol, rtol = dev.tol()
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= atol + rtol * b.abs().amax(-1, keepdim=True)).all())


@pytest.mark.parametrize("bias", [False, True])
def test_dev_sparse_equals_dense_hard(dev, bias):
    m, _, x = dev_model(dev, bias=bias)
    with dev.autocast():
        ref, _, st = m(x)
        out, _, st2 = m(x, sparse=True)
    assert ref.dtype == out.dtype and torch.isfinite(out).all() and close(out, ref, dev)
    assert torch.equal(st["skipped"], st2["skipped"])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("B", [1, 4])
def test_dev_cached_decode_equals_full_forward(dev, bias, B):
    m, routers, x = dev_model(dev, B=B, bias=bias)
    T0 = 7
    with dev.autocast():
        full = m(x)[0].float()
        logits, state = m.prefill(x[:, :T0])
        steps = [logits]
        for t in range(T0, x.size(1)):
            for r in routers:
                r.offset = t
            logits, state = m.step(x[:, t:t + 1], state)
            steps.append(logits)
    assert close(torch.stack(steps, 1), full[:, T0 - 1:], dev)


def test_dev_training_step(dev):
    m = make(dtype=torch.float32).to(dev.device).train()
    x = torch.randint(0, 50, (3, 40), device=dev.device)
    rs = []
    for b in r_blocks(m):
        b.router.register_forward_hook(lambda mod_, a, out: rs.append(out))
    with dev.autocast():
        _, loss, st = m(x, x)
    loss.backward()
    assert all(r.dtype == torch.float32 for r in rs)  # decisions in fp32 (numerics policy)
    assert torch.isfinite(loss) and st["skipped"].item() == pytest.approx(1 - 10 / 40)
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    assert all(b.router.weight.grad.abs().sum() > 0 for b in r_blocks(m))


# --------------------------------------------------------------------------------------------------
# stats, routing map, accounting

def test_stats_contract_and_flops_by_hand():
    m = make().eval()
    B, T = 4, 40
    t1 = torch.zeros(B, 64, dtype=torch.bool)
    t1[0, :T], t1[1, :10] = True, True  # layer 1: 50 of 160 tokens run the block
    t3 = torch.zeros(B, 64, dtype=torch.bool)
    t3[:, ::4] = True                   # layer 3: 40 of 160
    r_blocks(m)[0].router, r_blocks(m)[1].router = FixedRouter(t1), FixedRouter(t3)
    x = torch.randint(0, 50, (B, T))
    for sparse in (False, True):
        _, _, st = m(x, x, sparse=sparse)
        assert st["skip_l1"].item() == 110 / 160 and st["skip_l3"].item() == 120 / 160
        assert st["skipped"].item() == pytest.approx(115 / 160)
        assert ("soft_loss" in st) != sparse
        d, head = 32, 2 * 32 * 50
        block = 2 * 3 * d * d + 2 * d * d + 2 * 2 * d * 4 * d
        dense = block + 4 * d * (T + 1) / 2
        routed = sum(p * (block + 4 * d * (p * T + 1) / 2) + 2 * d for p in (50 / 160, 40 / 160))
        want = 1 - (2 * dense + routed + head) / (4 * dense + head)
        assert st["flops_saved_hard"].item() == pytest.approx(want, rel=1e-6)
        assert st["flops_ratio"].item() == pytest.approx(1 - want, rel=1e-6)
    # the accuracy of the causal decisions against the true top-k of the router's weights
    acc = []
    routes = m.trunk(m.embed(x), "hard")[1]
    for r, z, member, _ in routes:
        assert torch.equal(member, mod.top_k(r, 10)[1])
        acc.append(((z > 0) == member).double().mean())
    assert st["pred_acc"].item() == pytest.approx(torch.stack(acc).mean().item())
    m.train()
    _, _, st = m(x, x)
    assert st["skip_l1"].item() == st["skip_l3"].item() == 1 - 10 / 40 and "soft_loss" not in st


def test_soft_loss_is_the_top_k_computation():
    m = make().eval()
    x = torch.randint(0, 50, (2, 32))
    _, _, st = m(x, x)
    train_loss = m.train()(x, x)[2]["lm_loss"]  # no dropout: training mode is the same function
    assert torch.allclose(st["soft_loss"], train_loss)


def test_flops_accounting():
    cfg = mod.Config(n_layer=4, n_head=4, n_embd=32, vocab_size=50, every=2)
    T = 100
    dense = common.dense_flops_per_token(cfg, T)
    assert mod.flops_per_token(cfg, T, 1.0) == pytest.approx(dense + 2 * 2 * 32)  # + routers
    mlp = mod.Config(**{**cfg.__dict__, "predictor": "mlp"})
    assert mod.flops_per_token(mlp, T, 1.0) - mod.flops_per_token(cfg, T, 1.0) == \
        2 * 2 * (32 * 16 + 16)
    # at capacity C attention scores run over the ~C·T selected tokens, not T: a C² term
    r = [mod.flops_per_token(cfg, 1000, c) for c in (0.125, 0.5)]
    d = 32
    block = 8 * d * d + 16 * d * d
    assert r[0] == pytest.approx(2 * (block + 4 * d * 1001 / 2) + 2 * (
        0.125 * (block + 4 * d * (125 + 1) / 2) + 2 * d) + 2 * d * 50)
    assert r[0] < r[1] < mod.flops_per_token(cfg, 1000, 1.0)


def test_flops_of_the_router_and_predictor_by_value():
    assert mod.flops_router(32) == 64  # r = w·x: d multiply-adds
    # d → max(d // 4, 16) → 1: the floor of d/4 above 16, 16 below it
    for d, h in ((32, 16), (64, 16), (128, 32), (130, 32)):
        assert mod.flops_predictor(d) == 2 * (d * h + h)


def test_train_flops_count_the_k_selected_tokens():
    """Training runs a routed block on k = ⌈C·T⌉ tokens: ρ = k/T, not C (T = 36: k = 5, not 4.5)."""
    m = make(capacity=0.125)
    d, T = 32, 36
    block = 2 * 3 * d * d + 2 * d * d + 2 * 2 * d * 4 * d
    dense = block + 4 * d * (T + 1) / 2
    routed = 5 / T * (block + 4 * d * (5 + 1) / 2) + 2 * d
    assert m.train_flops_per_token(T) == pytest.approx(2 * dense + 2 * routed + 2 * d * 50,
                                                       rel=1e-12)


def test_routing_map():
    m = make().train()
    table = mixed_table(1, 30, seed=3)[[0]] | (torch.arange(30) % 3 == 0)[None]
    fix_routers(m, table)
    r_blocks(m)[1].router = FixedRouter(~table)
    mp, rows, legend = m.routing_map(torch.randint(0, 50, (1, 30)))
    assert mp.shape == (2, 30) and mp.device.type == "cpu" and mp.dtype == torch.float32
    assert torch.equal(mp[0], table[0].float()) and torch.equal(mp[1], (~table[0]).float())
    assert rows == ["layer 1", "layer 3"] and legend[1] == "block" and m.training
    mp_eval = m.eval().routing_map(torch.randint(0, 50, (1, 30)))[0]
    assert torch.equal(mp_eval, mp) and not m.training  # the mode is restored


# --------------------------------------------------------------------------------------------------
# CLI

def test_cli_smoke(data_dir, tmp_path):
    out = str(tmp_path / "run")
    train.main(["--model", "mod", "--dataset", "shakespeare", "--max_iters=2", "--eval_iters=1",
                "--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=2",
                f"--data_dir={data_dir}", f"--out_dir={out}", "--eval_interval=2",
                "--log_interval=1", "--predictor=mlp"])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    ev = [r for r in rows if r["kind"] == "eval"][-1]
    assert {"val_skip_l1", "val_skipped", "val_soft_loss", "val_flops_saved_hard", "val_pred_acc",
            "val_aux_loss"} <= set(ev)
    assert os.path.exists(os.path.join(out, "routing.html"))


def test_main_prints_its_usage_and_refuses_any_argument(capsys):
    for argv in ([], ["-h"], ["--help"]):
        mod.main(argv)
        assert capsys.readouterr().out == (
            "usage: python mod.py [-h]\nDefines the Mixture-of-Depths model (no commands): train "
            "it with `python train.py --model mod`, time it with `python bench.py mod`.\n")
    for argv in (["foo"], ["--help", "x"], ["-H"]):
        with pytest.raises(common.NanorouteError) as e:
            mod.main(argv)
        assert str(e.value) == f"mod.py takes no arguments, got {' '.join(argv)!r}"


def test_module_cli_help_and_refusal(monkeypatch, capsys):
    import runpy
    for args, rc in (([], 0), (["--help"], 0), (["-h"], 0), (["foo"], 2), (["--help", "x"], 2)):
        monkeypatch.setattr("sys.argv", ["mod.py", *args])
        try:
            runpy.run_path(mod.__file__, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        assert code == rc
        if rc == 0:
            assert out == ("usage: python mod.py [-h]\nDefines the Mixture-of-Depths model (no "
                           "commands): train it with `python train.py --model mod`, time it with "
                           "`python bench.py mod`.\n") and not err
        else:
            assert not out and err == f"error: mod.py takes no arguments, got {' '.join(args)!r}\n"
