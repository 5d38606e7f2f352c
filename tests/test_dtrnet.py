"""DTRNet tests: tiny float64 models, < 60 s in total."""
import json
import os

import pytest
import torch
import torch.nn as nn

import common
import dtrnet
import train




def make(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    base = dict(n_layer=4, n_head=4, n_embd=32, block_size=64, vocab_size=50, layers="TDDT")
    cfg = dtrnet.Config(**{**base, **kw})
    return dtrnet.Model(cfg).to(dtype)


class FixedRouter(nn.Module):
    """Test router: routes exactly where `table` (B, T) is True, probabilities 0.7/0.3 (0.3/0.7)."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, x):
        t = self.table[:, :x.size(1)].to(x.dtype)
        p = 0.3 + 0.4 * t  # (B, T)
        return torch.stack([p, 1 - p], -1)


def d_blocks(m):
    return [b for b in m.blocks if isinstance(b, dtrnet.DTRBlock)]


# ---------------------------------------------------------------------------------------------------
# config

def test_patterns():
    assert dtrnet.layer_pattern("bilayer", 7) == "TDTDTDT"
    assert dtrnet.layer_pattern("bilayer", 6) == "TDTDTT"
    assert dtrnet.layer_pattern("trilayer", 7) == "TDDTDDT"
    assert dtrnet.layer_pattern("laterhalf", 6) == "TTTDDT"
    assert dtrnet.layer_pattern("TDDT", 4) == "TDDT"
    assert dtrnet.layer_pattern("bilayer", 32).count("D") == 15  # the paper's 360M model: 15 D layers


@pytest.mark.parametrize("kw, msg", [
    (dict(layers="DTTT"), "first and last"), (dict(layers="TTTD"), "first and last"),
    (dict(layers="TXDT"), "string of T and D"), (dict(layers="TDT"), "n_layer=4"),
    (dict(layers=""), "string of T and D"), (dict(variant="mod"), "variant"), (dict(lam=-1.0), "lam"),
])
def test_config_errors_are_one_line(kw, msg):
    with pytest.raises(common.NanorouteError) as e:
        dtrnet.Config(**{**dict(n_layer=4, n_head=4, n_embd=32), **kw})
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_cli_bad_pattern_is_one_line_error(capsys):
    with pytest.raises(SystemExit):
        train.main(["--model", "dtrnet", "--layers=TDD", "--n_layer=3"])
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "first and last" in err and "\n" not in err


def test_router_parameter_count():
    for bias in (False, True):
        m = make(bias=bias)
        dense = common.Model(m.cfg)
        extra = m.num_params() - dense.num_params()
        d = 32
        assert extra == 2 * (d * d // 2 + d // 2 * 2 + (d // 2 + 2) * bias) == 2 * dtrnet.router_params(m.cfg)


def test_dense_checkpoint_loads_with_only_routers_new():
    m = make()
    dense = common.Model(m.cfg)
    missing, unexpected = m.load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected and missing and all(".router." in k for k in missing)


# ---------------------------------------------------------------------------------------------------
# loss, eq. (7)

def test_routing_loss_hand_computed():
    # layer counts f = (2, 6) tokens of 8 -> α = (0.25, 0.75); mean g_attn = (0.4, 0.8)
    g = torch.tensor([0.4, 0.8], requires_grad=True)
    rl = dtrnet.routing_loss(g, torch.tensor([2 / 8, 6 / 8]))
    assert rl.item() == pytest.approx(0.25 * 0.4 + 0.75 * 0.8)
    rl.backward()
    assert torch.allclose(g.grad, torch.tensor([0.25, 0.75]))  # α carries no gradient
    assert dtrnet.routing_loss(g, torch.zeros(2)).item() == 0.0  # nothing routed: α = 0, no NaN


def test_total_loss_matches_eq7_from_router_outputs():
    m = make(lam=0.5).train()
    x = torch.randint(0, 50, (3, 40))
    seen = []
    for b in d_blocks(m):
        b.router.register_forward_hook(lambda mod, inp, out: seen.append(out))
    _, loss, st = m(x, x)
    g = [o[..., 0] for o in seen]
    f = torch.stack([(gi > 0.5).double().sum() for gi in g])  # hard counts over the whole batch
    expect = sum(f[i] / f.sum() * g[i].mean() for i in range(2))
    assert torch.allclose(st["route_loss"], expect)
    assert torch.allclose(loss, st["lm_loss"] + 0.5 * expect)
    assert torch.allclose(st["frac_attn"].double(), f.mean() / x.numel())


def test_router_gets_gradient_through_probability_scaling():
    m = make(lam=0.0).train()  # no aux loss: the only path to the router is g · path output
    x = torch.randint(0, 50, (2, 32))
    _, loss, _ = m(x, x)
    loss.backward()
    for b in d_blocks(m):
        assert b.router.w1.weight.grad.abs().sum() > 0 and b.router.w2.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------
# sparse path == dense reference

def test_sparse_equals_eval_varied_counts():
    m = make(layers="TDDT").eval()
    B, T = 5, 48
    g = torch.Generator().manual_seed(1)
    table = torch.stack([torch.zeros(T, dtype=torch.bool), torch.ones(T, dtype=torch.bool),
                         torch.rand(T, generator=g) < 0.1, torch.rand(T, generator=g) < 0.5,
                         torch.rand(T, generator=g) < 0.9])
    for b in d_blocks(m):
        b.router = FixedRouter(table)
    x = torch.randint(0, 50, (B, T))
    ref, _, st = m(x)
    out, _, st2 = m(x, sparse=True)
    assert torch.isfinite(ref).all()
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)
    assert st["frac_attn"].item() == pytest.approx(table.float().mean().item())
    assert torch.allclose(st["flops_ratio"], st2["flops_ratio"])


def test_sparse_equals_eval_learned_router_and_row_independence():
    m = make(layers="TDDT").eval()
    x = torch.randint(0, 50, (4, 64))
    ref, _, _ = m(x)
    out, _, _ = m(x, sparse=True)
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)
    counts = [int(b.route(m.embed(x))[2].sum(1).unique().numel()) for b in d_blocks(m)]
    assert counts[0] > 1  # rows really route different numbers of tokens
    x2 = x.clone()
    x2[1:] = torch.randint(0, 50, (3, 64))  # other rows change -> row 0 must not (no leak across the batch)
    for sparse in (False, True):
        assert torch.allclose(m(x2, sparse=sparse)[0][0], ref[0], atol=1e-10, rtol=0)


def test_sparse_requires_eval():
    with pytest.raises(common.NanorouteError):
        make().train()(torch.zeros(1, 4, dtype=torch.long), sparse=True)


# ---------------------------------------------------------------------------------------------------
# causality

@pytest.mark.parametrize("mode", ["train", "eval", "sparse"])
def test_causal(mode):
    m = make(layers="TDDT")
    m.train(mode == "train")
    x = torch.randint(0, 50, (3, 48))
    x2 = x.clone()
    x2[:, 30:] = torch.randint(0, 50, (3, 18))
    a, _, st = m(x, sparse=mode == "sparse")
    b, _, _ = m(x2, sparse=mode == "sparse")
    assert 0.05 < st["frac_attn"].item() < 0.95  # routing is mixed, so the mask matters
    assert torch.allclose(a[:, :30], b[:, :30], atol=1e-10, rtol=0)
    assert not torch.allclose(a[:, 30:], b[:, 30:])


def test_all_bypass_and_all_routed_are_finite_with_gradients():
    for value in (False, True):
        m = make(layers="TDDT").train()
        for b in d_blocks(m):
            b.router = FixedRouter(torch.full((2, 64), value))
        x = torch.randint(0, 50, (2, 32))
        _, loss, st = m(x, x)
        loss.backward()
        assert torch.isfinite(loss) and st["frac_attn"].item() == float(value)
        assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_all_routed_equals_dense_block_scaled():
    """δ ≡ 1: a D layer is the dense block with its attention delta scaled by g_attn = 0.7."""
    m = make(layers="TDDT").eval()
    blk = d_blocks(m)[0]
    blk.router = FixedRouter(torch.ones(2, 64, dtype=torch.bool))
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    y, _, _ = blk(x)
    h = x + 0.7 * blk.attn_delta(x)
    assert torch.allclose(y, h + blk.ffn_delta(h), atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# variants

def test_bypass_is_ln1_wv_wo_and_no_token_mixing():
    """All bypassed: eq. (5) with the SAME LN1, W_V (slice of c_attn) and W_O (c_proj), scaled by g_bypass."""
    m = make().eval()
    blk = d_blocks(m)[0]
    blk.router = FixedRouter(torch.zeros(2, 64, dtype=torch.bool))
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    Wv = blk.attn.c_attn.weight[64:]
    expect = x + 0.7 * blk.attn.c_proj(blk.ln_1(x) @ Wv.T)
    for sparse in (False, True):
        y, _, _ = blk(x, sparse)
        assert torch.allclose(y, expect + blk.ffn_delta(expect), atol=1e-12)


def test_skip_variant_never_attends():
    m = make(variant="skip").eval()
    x = torch.randint(0, 50, (2, 32))
    _, _, st = m(x, x)
    assert st["frac_attn"].item() == 0.0 and st["route_loss"].item() == 0.0
    blk = d_blocks(m)[0]
    h = torch.randn(2, 20, 32, dtype=torch.float64)
    h2 = h.clone()
    h2[:, :10] += 1.0  # change earlier tokens: a skip layer mixes nothing, later outputs are unchanged
    assert torch.allclose(blk(h)[0][:, 10:], blk(h2)[0][:, 10:], atol=1e-12)
    g = blk.router(h)[..., 1]
    e = h + g[..., None] * blk.attn.c_proj(blk.w_v(blk.ln_1(h)))
    assert torch.allclose(blk(h)[0], e + blk.ffn_delta(e), atol=1e-12)
    assert torch.allclose(m(x, sparse=True)[0], m(x)[0], atol=1e-10)


def test_no_vo_variant_bypass_is_identity():
    m = make(variant="no_vo").eval()
    ref = make(variant="dtrnet").eval()
    ref.load_state_dict(m.state_dict())
    blk, rblk = d_blocks(m)[0], d_blocks(ref)[0]
    table = torch.rand(2, 64, generator=torch.Generator().manual_seed(0)) < 0.5
    blk.router = FixedRouter(table)
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    y, _, delta = blk(x)
    rblk.router = FixedRouter(table)
    yr, _, _ = rblk(x)
    keep = delta[..., None].expand_as(x)
    # bypassed tokens: x + 0.7·LN1(x), then the MLP; routed tokens: exactly as in dtrnet
    e = x + 0.7 * blk.ln_1(x)
    assert torch.allclose(y[~keep], (e + blk.ffn_delta(e))[~keep], atol=1e-12)
    assert torch.allclose(y[keep], yr[keep], atol=1e-12)
    assert torch.allclose(blk(x, True)[0], y, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# cached decoding

def test_cached_decoding_equals_full_forward():
    m = make(layers="TDDT").eval()
    B, T = 3, 48
    x = torch.randint(0, 50, (B, T))
    full, _, _ = m(x)
    cache = m.new_cache(B, "cpu")
    steps = torch.stack([m.decode_step(x[:, t:t + 1], cache) for t in range(T)], 1)  # (B, T, V)
    assert torch.allclose(steps, full, atol=1e-10, rtol=0)
    # D layers hold exactly the routed tokens of each row; T layers every token
    h = m.embed(x)
    for blk, c in zip(m.blocks, cache["layers"]):
        if isinstance(blk, dtrnet.DTRBlock):
            n = blk.route(h)[2].sum(1)
            assert torch.equal(c["n"], n) and c["k"].size(2) == int(n.max()) < T
            h = blk(h)[0]
        else:
            assert torch.equal(c["n"], torch.full((B,), T)) and c["k"].size(2) == T
            h = blk(h)
    held, dense = dtrnet.kv_cache_bytes(cache)
    assert held < dense == 4 * 2 * B * T * 32 * 8


def test_generate_cached_matches_uncached_greedy_and_wraps():
    m = make(layers="TDDT", block_size=32).eval()
    prompt = torch.randint(0, 50, (2, 5))
    out = m.generate(prompt, 20, temperature=0)
    ref = common.LM.generate(m, prompt, 20, temperature=0)  # cache-free reference
    assert torch.equal(out, ref)
    assert m.generate(prompt, 70, temperature=0).shape == (2, 75)  # past block_size: cache is rebuilt


# ---------------------------------------------------------------------------------------------------
# accounting

def test_flops_accounting():
    cfg = make().cfg
    T = 1000
    assert dtrnet.flops_ratio(cfg, T, [], pattern="TTTT") == 1.0
    dense = dtrnet.flops_per_token(cfg, T, [], pattern="TTTT")
    assert dense == pytest.approx(common.dense_flops_per_token(cfg, T))
    # ρ = 1: identical work plus the router, so slightly above 1; ρ < 1 falls with T
    d = 32
    assert dtrnet.flops_per_token(cfg, T, 1.0) == pytest.approx(dense + 2 * dtrnet.flops_router(d))
    r = [dtrnet.flops_ratio(cfg, t, 0.1) for t in (256, 2048, 20000)]
    assert r[0] > r[1] > r[2]
    # paper Fig. 4 (1.3B: 24 layers, d=2048, SwiGLU 5632, bilayer, ~10% routed) reports 0.785 at 20K tokens
    big = dtrnet.Config(n_layer=24, n_embd=2048, n_head=32, vocab_size=32000, block_size=20000)
    assert dtrnet.flops_ratio(big, 20000, 0.1, hidden=1.5 * 5632) == pytest.approx(0.778, abs=0.002)


# ---------------------------------------------------------------------------------------------------
# CLI

def test_cli_smoke(data_dir, tmp_path):
    out = str(tmp_path / "run")
    train.main(["--model", "dtrnet", "--dataset", "shakespeare", "--max_iters=2", "--eval_iters=1",
                "--n_layer=3", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=2",
                f"--data_dir={data_dir}", f"--out_dir={out}", "--eval_interval=2", "--log_interval=1"])
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    ev = [r for r in rows if r["kind"] == "eval"][-1]
    assert {"val_frac_attn", "val_route_loss", "val_frac_l1", "val_flops_ratio"} <= set(ev)
    assert os.path.exists(os.path.join(out, "ckpt.pt"))
