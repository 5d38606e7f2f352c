"""DTRNet tests: tiny float64 models for exactness, the `dev` matrix (CPU fp32/bf16, CUDA, MPS) for
the model contract; < 60 s in total."""
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import dtrnet
import train


def make(seed=0, dtype=torch.float64, **kw):
    """A tiny model; with bias=True every bias is random (init zeroes them, hiding a lost one)."""
    torch.manual_seed(seed)
    base = dict(n_layer=4, n_head=4, n_embd=32, block_size=64, vocab_size=50, layers="TDDT")
    cfg = dtrnet.Config(**{**base, **kw})
    m = dtrnet.Model(cfg)
    for name, p in m.named_parameters():
        if name.endswith("bias"):  # the router's small: the routing stays mixed
            nn.init.normal_(p.data, 0.0, 1e-3 if ".router." in name else 0.1)
    return m.to(dtype)


class FixedRouter(nn.Module):
    """Test router: token at position `offset + t` is routed where `table` (B, T_max) is True;
    probabilities 0.7/0.3 (0.3/0.7), fp32. Decisions do not depend on the numerics, so every path
    and dtype agrees."""

    def __init__(self, table):
        super().__init__()
        self.table, self.offset = table, 0

    def forward(self, x):
        t = self.table[:, self.offset:self.offset + x.size(1)].to(device=x.device,
                                                                  dtype=torch.float32)
        p = 0.3 + 0.4 * t  # (B, T)
        return torch.stack([p, 1 - p], -1)


def d_blocks(m):
    return [b for b in m.blocks if isinstance(b, dtrnet.DTRBlock)]


def fix_routers(m, table):
    routers = []
    for b in d_blocks(m):
        b.router = FixedRouter(table)
        routers.append(b.router)
    return routers


def mixed_table(B, T, seed=1):
    """Rows routing 0%, 100%, ~10%, ~50%, ~90% of their tokens (cycled over B rows)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.zeros(T, dtype=torch.bool), torch.ones(T, dtype=torch.bool)] + \
           [torch.rand(T, generator=g) < p for p in (0.1, 0.5, 0.9)]
    return torch.stack([rows[i % 5] for i in range(B)])


def sharpen(m):
    """Unit-gain init: logits ~5, attention deltas as large as x, routers far from 50/50 — outputs
    depend on the context (at the default init a tied-embedding model just repeats its input token)
    and a wrong path differs by far more than bf16's tolerance."""
    for name, p in m.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p.data, 0.0,
                            1.0 if name.startswith(("wte", "wpe")) else p.size(1) ** -0.5)
    return m


def window_start(n, block_size):
    """The brief's window policy, written independently of common.py
    (the reference for generate)."""
    if n <= block_size:
        return 0
    h = max(block_size // 2, 1)
    return n - h - ((n - block_size - 1) % (block_size - h + 1))


# --------------------------------------------------------------------------------------------------
# config and the paper's constants

def test_patterns():
    assert dtrnet.layer_pattern("bilayer", 7) == "TDTDTDT"
    assert dtrnet.layer_pattern("bilayer", 6) == "TDTDTT"
    assert dtrnet.layer_pattern("trilayer", 7) == "TDDTDDT"
    assert dtrnet.layer_pattern("laterhalf", 6) == "TTTDDT"
    assert dtrnet.layer_pattern("TDDT", 4) == "TDDT"
    # the paper's 360M model: 15 D layers
    assert dtrnet.layer_pattern("bilayer", 32).count("D") == 15


@pytest.mark.parametrize("kw, msg", [
    (dict(layers="DTTT"), "first and last"), (dict(layers="TTTD"), "first and last"),
    (dict(layers="TXDT"), "string of T and D"), (dict(layers="TDT"), "n_layer=4"),
    (dict(layers=""), "string of T and D"), (dict(variant="mod"), "variant"),
    (dict(lam=-1.0), "lam"), (dict(lam=-1e-6), "lam"),
    (dict(lam=float("nan")), "lam"), (dict(norm="batchnorm"), "norm"),
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


def test_paper_constants_are_pinned():
    assert dtrnet.Config().lam == 8e-4  # λ of the 360M model (paper, "Implementation details")
    p = dtrnet.PRESETS["paper"]
    assert p["lam"] == 8e-4 and p["layers"] == "bilayer" and p["norm"] == "rmsnorm"
    assert (p["n_layer"], p["n_embd"], p["block_size"], p["vocab_size"]) == (32, 960, 2048, 32000)
    assert (p["learning_rate"], p["weight_decay"], p["grad_clip"]) == (3e-4, 0.01, 0.1)
    assert p["warmup_iters"] == round(0.1 * p["max_iters"])  # warm-up ratio 0.1
    c = dtrnet.PRESETS["classroom"]
    assert ({k: c[k] for k in common.CLASSROOM} == common.CLASSROOM
            and dtrnet.Config(**c).pattern.count("D") >= 2)


def test_router_parameter_count_and_dense_checkpoint_loads():
    for bias in (False, True):
        m = make(bias=bias)
        extra = m.num_params() - common.Model(m.cfg).num_params()
        d = 32
        assert (extra == 2 * (d * d // 2 + d // 2 * 2 + (d // 2 + 2) * bias)
                == 2 * dtrnet.router_params(m.cfg))
    m = make()
    missing, unexpected = m.load_state_dict(common.Model(m.cfg).state_dict(), strict=False)
    assert not unexpected and missing and all(".router." in k for k in missing)


def test_rmsnorm_option():
    m = make(norm="rmsnorm")
    norms = [mod for mod in m.modules() if isinstance(mod, (nn.LayerNorm, nn.RMSNorm))]
    assert len(norms) == 2 * 4 + 1 and all(isinstance(n, nn.RMSNorm) for n in norms)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    ln = m.blocks[0].ln_1
    assert torch.allclose(ln(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt())
    m.eval()
    idx = torch.randint(0, 50, (2, 20))
    assert torch.allclose(m(idx, sparse=True)[0], m(idx)[0], atol=1e-10)


# --------------------------------------------------------------------------------------------------
# router, eq. (1)-(2), and loss, eq. (7)

def test_router_is_eq1_on_the_residual_stream():
    """Computed independently from each D block's input x: softmax(SiLU(x W1) W2),
    decisions g_attn > g_bypass."""
    m = make(layers="TDDT").train()
    for b in d_blocks(m):
        # decisions away from 50/50, so a changed input or activation shows
        b.router.w2.weight.data *= 30
    ins, outs = [], []
    for b in d_blocks(m):
        b.register_forward_pre_hook(lambda mod, a: ins.append(a[0]))
        b.router.register_forward_hook(lambda mod, a, out: outs.append(out))
    x = torch.randint(0, 50, (3, 40))
    _, _, st = m(x, x)
    for b, xin, out, i in zip(d_blocks(m), ins, outs, m.d_layers):
        g = F.softmax(F.silu(xin @ b.router.w1.weight.T) @ b.router.w2.weight.T, -1)  # (B, T, 2)
        assert torch.allclose(out, g, atol=1e-12)
        assert 0.05 < (g[..., 0] > g[..., 1]).double().mean() < 0.95
        assert st[f"frac_l{i}"].item() == pytest.approx(
            (g[..., 0] > g[..., 1]).double().mean().item())


@pytest.mark.parametrize("bias", [False, True])
def test_tie_bypasses_eq2_is_strict(bias):
    """Eq. (2): δ = 1 only if g_attn > g_bypass. With W2 = 0 both logits are equal, so every token
    sits at g_attn = g_bypass = 0.5 exactly: none is routed, on every path."""
    m = make(layers="TDDT", bias=bias).train()
    for b in d_blocks(m):
        b.router.w2.weight.data.zero_()
        if bias:
            b.router.w2.bias.data.fill_(0.3)  # equal biases: still a tie
    x = torch.randint(0, 50, (2, 24))
    for b in d_blocks(m):
        g_attn, g_bypass, delta = b.route(m.embed(x))
        assert (g_attn == 0.5).all() and (g_bypass == 0.5).all() and not delta.any()
    assert m(x, x)[2]["frac_attn"].item() == 0.0
    m.eval()
    assert m(x)[2]["frac_attn"].item() == 0.0 and m(x, sparse=True)[2]["frac_attn"].item() == 0.0
    b = d_blocks(m)[0]
    b.router.w2.weight.data[0] = 1e-4 * torch.randn(16, dtype=torch.float64)  # a hair off the tie
    g_attn, _, delta = b.route(torch.randn(2, 24, 32, dtype=torch.float64))
    assert delta.any() and not delta.all() and torch.equal(delta, g_attn > 0.5)


def test_routing_loss_hand_computed():
    # layer counts f = (2, 6) tokens of 8 -> α = (0.25, 0.75); mean g_attn = (0.4, 0.8)
    g = torch.tensor([0.4, 0.8], requires_grad=True)
    rl = dtrnet.routing_loss(g, torch.tensor([2 / 8, 6 / 8]))
    assert rl.item() == pytest.approx(0.25 * 0.4 + 0.75 * 0.8)
    rl.backward()
    assert torch.allclose(g.grad, torch.tensor([0.25, 0.75]))  # α carries no gradient
    assert dtrnet.routing_loss(g, torch.zeros(2)).item() == 0.0  # nothing routed: α = 0, no NaN


def hooked_eq7(m, x):
    """Loss and eq. (7)'s routing term computed from the router outputs seen
    in one training forward."""
    seen = []
    hs = [b.router.register_forward_hook(lambda mod, inp, out: seen.append(out))
          for b in d_blocks(m)]
    _, loss, st = m(x, x)
    for h in hs:
        h.remove()
    g = [o[..., 0] for o in seen]
    f = torch.stack([(gi > 0.5).double().sum() for gi in g])  # hard counts over the whole batch
    return loss, st, sum(f[i] / f.sum() * g[i].mean() for i in range(len(g)))


def test_total_loss_matches_eq7_from_router_outputs():
    m = make(lam=0.5).train()
    x = torch.randint(0, 50, (3, 40))
    loss, st, expect = hooked_eq7(m, x)
    assert torch.allclose(st["route_loss"], expect.detach())
    assert torch.allclose(loss, st["lm_loss"] + 0.5 * expect)


def test_lambda_term_gradient_reaches_the_routers():
    """The λ term must train the routers: ∂loss(λ)/∂θ − ∂loss(0)/∂θ = λ ∂(eq. 7)/∂θ. (A detached g
    keeps the loss's VALUE identical, so only a gradient check catches it.)"""
    x = torch.randint(0, 50, (3, 40))
    grads = {}
    for lam in (0.0, 0.5):
        m = make(lam=lam).train()
        loss, _, eq7 = hooked_eq7(m, x)
        params = [p for b in d_blocks(m) for p in b.router.parameters()]
        grads[lam] = torch.autograd.grad(loss, params, retain_graph=True)
        if lam:
            want = torch.autograd.grad(eq7, params)
    for g0, g1, w in zip(grads[0.0], grads[0.5], want):
        assert w.abs().sum() > 0 and torch.allclose(g1 - g0, 0.5 * w, atol=1e-12, rtol=1e-6)


def test_router_gets_gradient_through_probability_scaling():
    m = make(lam=0.0).train()  # no aux loss: the only path to the router is g · path output
    x = torch.randint(0, 50, (2, 32))
    _, loss, _ = m(x, x)
    loss.backward()
    for b in d_blocks(m):
        assert b.router.w1.weight.grad.abs().sum() > 0 and b.router.w2.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------------------------------
# packed (training / sparse) path == masked reference, exactly in float64

def tddt_with_fixed_routing(B=5, T=48):
    """A T D D T model whose D layers route by mixed_table(B, T),
    an eval-mode model and its input."""
    m = make(layers="TDDT").eval()
    table = mixed_table(B, T)
    fix_routers(m, table)
    return m, table, torch.randint(0, 50, (B, T))


def test_sparse_equals_eval_varied_counts():
    m, table, x = tddt_with_fixed_routing()
    ref, _, st = m(x)
    out, _, st2 = m(x, sparse=True)
    assert torch.isfinite(ref).all() and torch.allclose(out, ref, atol=1e-10, rtol=0)
    assert st["frac_attn"].item() == pytest.approx(table.float().mean().item())
    assert torch.allclose(st["flops_ratio"], st2["flops_ratio"])


@pytest.mark.parametrize("bias", [False, True])
def test_sparse_equals_eval_learned_router_and_row_independence(bias):
    m = make(layers="TDDT", bias=bias).eval()
    x = torch.randint(0, 50, (4, 64))
    ref, _, _ = m(x)
    out, _, _ = m(x, sparse=True)
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)
    counts = [int(b.route(m.embed(x))[2].sum(1).unique().numel()) for b in d_blocks(m)]
    assert counts[0] > 1  # rows really route different numbers of tokens
    x2 = x.clone()
    # other rows change -> row 0 must not (no leak across the batch)
    x2[1:] = torch.randint(0, 50, (3, 64))
    for sparse in (False, True):
        assert torch.allclose(m(x2, sparse=sparse)[0][0], ref[0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_training_path_equals_masked_reference_with_gradients(bias):
    """Training runs the packed path: its output AND every parameter gradient
    equal the eq. (6) mask's."""
    m = make(layers="TDDT", bias=bias).train()
    blk = d_blocks(m)[0]
    fix_routers(m, mixed_table(5, 40))
    x = torch.randn(5, 40, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 40, 32, dtype=torch.float64)
    outs, grads = [], []
    for packed in (False, True):
        y = blk(x, packed)[0]
        outs.append(y)
        grads.append(torch.autograd.grad((y * w).sum(), [x] + list(blk.parameters()),
                                         allow_unused=True))
    assert torch.allclose(outs[0], outs[1], atol=1e-12)
    for a, b in zip(*grads):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-12))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_padded_packing_is_the_same_function(monkeypatch, dtype):
    """Training and the sparse path round the packed length up to a multiple
    of PACK_MULTIPLE (the padding rows are bypassed tokens): logits and every parameter gradient
    equal those of the exact packed length, in fp32 and under bf16 autocast."""
    m = sharpen(make(dtype=torch.float32)).train()
    # rows routing ~10%, ~50%, ~90%: the largest count is not a multiple of 16
    table = mixed_table(5, 48)[2:]
    fix_routers(m, table)
    x = torch.randint(0, 50, (3, 48))
    n_max = int(table.sum(1).max())
    padded, lengths, runs = dtrnet.DTRBlock.attend_packed, [], []

    def exact(self, h, v, delta, R):
        lengths.append(R)
        return padded(self, h, v, delta, n_max)

    for attend_packed, mult in ((exact, 1), (padded, 16)):
        monkeypatch.setattr(dtrnet.DTRBlock, "attend_packed", attend_packed)
        monkeypatch.setattr(dtrnet, "PACK_MULTIPLE", mult)
        runs.append(dtrnet.pack_length(table))
        m.train().zero_grad()
        with common.autocast(torch.device("cpu"), dtype):
            logits, loss, _ = m(x, x)
            sparse = m.eval()(x, sparse=True)[0].float()
        loss.backward()
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        runs.append([logits.float(), sparse] + grads)
    assert lengths[0] == runs[0] == n_max < runs[2] == 48  # the bucketed batch has padding rows
    tol = 2e-2 if dtype == "bf16" else 1e-5
    # relative to each tensor's largest entry: bf16 has ~3 digits
    for a, b in zip(runs[1], runs[3]):
        assert (a - b).abs().max() <= tol * b.abs().max()


def test_a_traced_training_step_pads_every_row_to_T(monkeypatch):
    """Under torch.compile's trace (is_compiling) training packs to R = T, one shape for every
    batch; eager packs to pack_length(δ); the sparse path packs to pack_length(δ) even when traced
    (it is never traced for training). The same logits and gradients either way."""
    m = sharpen(make()).train()
    table = mixed_table(4, 48)[2:]  # rows routing ~10%, ~50%: pack_length < 48
    fix_routers(m, table)
    x, lengths, runs = torch.randint(0, 50, (2, 48)), [], []
    orig = dtrnet.DTRBlock.attend_packed
    monkeypatch.setattr(dtrnet, "PACK_MULTIPLE", 16)  # 64 would round 24 up to T = 48
    monkeypatch.setattr(dtrnet.DTRBlock, "attend_packed", lambda self, h, v, delta, R:
                        lengths.append(R) or orig(self, h, v, delta, R))
    for tracing in (False, True):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: tracing)
        m.train().zero_grad()
        logits, loss, _ = m(x, x)
        loss.backward()
        runs.append([logits] + [p.grad for p in m.parameters() if p.grad is not None])
        m.eval()(x, sparse=True)
    short = dtrnet.pack_length(table)
    assert short < 48 and lengths == [short] * 4 + [48, 48, short, short]
    for a, b in zip(*runs):
        assert torch.allclose(a, b, atol=1e-9)


def test_sparse_requires_eval():
    with pytest.raises(common.NanorouteError):
        make().train()(torch.zeros(1, 4, dtype=torch.long), sparse=True)


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
        fix_routers(m, torch.full((2, 64), value))
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
    h = x + 0.7 * blk.attn_delta(x)
    for packed in (False, True):
        assert torch.allclose(blk(x, packed)[0], h + blk.ffn_delta(h), atol=1e-12)


# --------------------------------------------------------------------------------------------------
# variants

def test_bypass_is_ln1_wv_wo_and_no_token_mixing():
    """All bypassed: eq. (5) with the SAME LN1, W_V (slice of c_attn) and W_O (c_proj),
    scaled by g_bypass."""
    m = make().eval()
    blk = d_blocks(m)[0]
    blk.router = FixedRouter(torch.zeros(2, 64, dtype=torch.bool))
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    Wv = blk.attn.c_attn.weight[64:]
    expect = x + 0.7 * blk.attn.c_proj(blk.ln_1(x) @ Wv.T)
    for packed in (False, True):
        assert torch.allclose(blk(x, packed)[0], expect + blk.ffn_delta(expect), atol=1e-12)


def test_skip_variant_never_attends():
    m = make(variant="skip").eval()
    x = torch.randint(0, 50, (2, 32))
    _, _, st = m(x, x)
    assert st["frac_attn"].item() == 0.0 and st["route_loss"].item() == 0.0
    blk = d_blocks(m)[0]
    h = torch.randn(2, 20, 32, dtype=torch.float64)
    h2 = h.clone()
    # change earlier tokens: a skip layer mixes nothing, later outputs are unchanged
    h2[:, :10] += 1.0
    assert torch.allclose(blk(h)[0][:, 10:], blk(h2)[0][:, 10:], atol=1e-12)
    g = blk.router(h)[..., 1]
    e = h + g[..., None] * blk.attn.c_proj(blk.proj(blk.ln_1(h), "v"))
    assert torch.allclose(blk(h)[0], e + blk.ffn_delta(e), atol=1e-12)
    assert torch.allclose(m(x, sparse=True)[0], m(x)[0], atol=1e-10)


def test_no_vo_variant_bypass_is_identity():
    m = make(variant="no_vo").eval()
    ref = make(variant="dtrnet").eval()
    ref.load_state_dict(m.state_dict())
    blk, rblk = d_blocks(m)[0], d_blocks(ref)[0]
    table = torch.rand(2, 64, generator=torch.Generator().manual_seed(0)) < 0.5
    blk.router, rblk.router = FixedRouter(table), FixedRouter(table)
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    y, _, delta, _ = blk(x)
    yr = rblk(x)[0]
    keep = delta[..., None].expand_as(x)
    # bypassed tokens: x + 0.7·LN1(x), then the MLP; routed tokens: exactly as in dtrnet
    e = x + 0.7 * blk.ln_1(x)
    assert torch.allclose(y[~keep], (e + blk.ffn_delta(e))[~keep], atol=1e-12)
    assert torch.allclose(y[keep], yr[keep], atol=1e-12)
    assert torch.allclose(blk(x, True)[0], y, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# cached decoding: prefill / step, window policy, generate

def cached_logits(m, x, T0):
    """prefill(x[:, :T0]) then one step per later token
    -> (B, T − T0 + 1, V) logits of positions T0−1 …"""
    logits, state = m.prefill(x[:, :T0])
    steps = [logits]
    for t in range(T0, x.size(1)):
        logits, state = m.step(x[:, t:t + 1], state)
        steps.append(logits)
    return torch.stack(steps, 1), state


@pytest.mark.parametrize("bias", [False, True])
def test_prefill_step_equal_full_forward_and_cache_holds_routed_tokens_only(bias):
    m = make(layers="TDDT", bias=bias).eval()
    B, T, T0 = 3, 48, 10
    x = torch.randint(0, 50, (B, T))
    full, _, _ = m(x)
    got, state = cached_logits(m, x, T0)
    assert torch.allclose(got, full[:, T0 - 1:], atol=1e-10, rtol=0)
    # a D layer holds exactly the routed tokens of each row, in order (K of the routed tokens);
    # T layers all
    caches, pos = state
    h = m.embed(x)
    assert pos == T
    for blk, c in zip(m.blocks, caches):
        if isinstance(blk, dtrnet.DTRBlock):
            _, _, delta = blk.route(h)
            K, V = c.k, c.v  # (B, nh, S, hs): preallocated to block_size (fixed step shapes)
            assert torch.equal(c.n, delta.sum(1)) and K.size(2) == m.cfg.block_size
            q, k, v = blk.attn.qkv(blk.ln_1(h))
            for b in range(B):
                assert torch.allclose(K[b, :, :c.n[b]], k[b][:, delta[b]], atol=1e-12)
                assert torch.allclose(V[b, :, :c.n[b]], v[b][:, delta[b]], atol=1e-12)
            h = blk(h)[0]
        else:
            h = blk(h)
    held, dense = dtrnet.kv_cache_bytes(state)
    assert held < dense == 4 * 2 * B * 64 * 32 * 8


@pytest.mark.parametrize("variant, bias", [("dtrnet", False), ("no_vo", False), ("dtrnet", True)])
def test_batch_one_decode_equals_full_forward_on_both_paths(variant, bias):
    """At B=1 every step takes one branch: routed (attention) or the bypass alone (eq. 5)."""
    m = make(layers="TDDT", variant=variant, bias=bias).eval()
    x = torch.randint(0, 50, (1, 40))
    full, _, stats = m(x)
    got, _ = cached_logits(m, x, 8)
    assert 0.1 < stats["frac_attn"] < 0.9  # both branches ran
    assert torch.allclose(got, full[:, 7:], atol=1e-10, rtol=0)


def test_decode_bypassed_tokens_cache_nothing():
    """A token no row routes leaves every D layer's cache as it was: no slot kept (n stays 0), only
    the scratch slot n[b] visible to the next query (which overwrites it), and the KV bytes are the
    T layers' alone. (The fixed-shape step computes its Q, K and attention and discards them: one
    graph, no host sync.)"""
    m = make(layers="TDDT").eval()
    routers = fix_routers(m, torch.zeros(2, 64, dtype=torch.bool))
    x = torch.randint(0, 50, (2, 30))
    _, state = m.prefill(x[:, :5])
    for t in range(5, 30):
        for r in routers:
            r.offset = t
        _, state = m.step(x[:, t:t + 1], state)
    for c, blk in zip(state[0], m.blocks):
        if isinstance(blk, dtrnet.DTRBlock):
            assert c.n.sum() == 0  # nothing cached
            only_slot_0 = torch.arange(64)[None].expand(2, 64) == 0  # the scratch slot alone
            assert torch.equal(c.visible(), only_slot_0)
    held, dense = dtrnet.kv_cache_bytes(state)
    assert held == dense // 2


class HashRouter(nn.Module):
    """Test router: routes a pseudo-random half of the tokens by a fixed function of the token's
    residual vector (so a decoded token is routed as in the full forward, and no Python state
    changes between steps)."""

    def forward(self, x):
        u = torch.frac(x[..., :8].float().sum(-1).abs() * 9973.0)  # (B, T) ~ uniform in [0, 1)
        p = 0.3 + 0.4 * (u < 0.5).float()
        return torch.stack([p, 1 - p], -1)


def test_eager_decode_skips_attention_of_bypassed_tokens(monkeypatch):
    """The paper's inference rule in the eager step: at B = 1 a bypassed token runs no attention
    in a D layer (the host decides); at B = 2 attention runs when some row is routed."""
    m = make(layers="TDDT").eval()
    calls = []
    for b in d_blocks(m):
        attend = b.attn.attend
        monkeypatch.setattr(b.attn, "attend",
                            lambda *a, f=attend, **k: calls.append(1) or f(*a, **k))
    table = torch.zeros(2, 64, dtype=torch.bool)
    table[0, 6], table[1, 7] = True, True  # row 0 routes position 6, row 1 position 7
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
            seen.append(len(calls))  # D-layer attention calls (T layers run common.Block.step)
        assert seen == want


def reference_generate(m, prompt, n_new, temperature, window):
    idx = prompt  # the cache-free reference: the window recomputed every token
    for _ in range(n_new):
        logits = m(idx[:, window(idx.size(1), m.cfg.block_size):])[0][:, -1]
        idx = torch.cat([idx, common.sample_next(logits, temperature)], 1)
    return idx


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_cached_equals_cache_free_past_block_size(block_size, temperature):
    """Greedy, and sampled with the same seed (sampling makes the text depend on the context, so a
    wrong window shows; greedy text from a random model settles on one repeated token)."""
    m = sharpen(make(layers="TDDT", block_size=block_size, dtype=torch.float32)).eval()
    prompt = torch.randint(0, 50, (3, 3))
    n_new = 3 * block_size + 7
    runs = []
    for gen in (lambda: m.generate(prompt, n_new, temperature),
                lambda: common.LM.generate(m, prompt, n_new, temperature, use_cache=False),
                # policy written here
                lambda: reference_generate(m, prompt, n_new, temperature, window_start),
                lambda: reference_generate(m, prompt, n_new, temperature,
                                           lambda n, bs: max(0, n - bs))):
        torch.manual_seed(7)
        runs.append(gen())
    assert torch.equal(runs[0], runs[2]) and torch.equal(runs[1], runs[2])
    if temperature and block_size > 1:
        assert not torch.equal(runs[2], runs[3])  # the test can tell window policies apart


def test_step_logits_equal_window_forward_for_every_prefix():
    bs = 12
    m = make(layers="TDDT", block_size=bs).eval()
    x = torch.randint(0, 50, (2, 40))
    w_prev, state = -1, None
    for n in range(1, 41):
        w = window_start(n, bs)
        logits, state = m.prefill(x[:, w:n]) if w != w_prev else m.step(x[:, n - 1:n], state)
        w_prev = w
        assert torch.allclose(logits, m(x[:, w:n])[0][:, -1], atol=1e-10, rtol=0)
    with pytest.raises(common.NanorouteError):
        # past block_size: a clear error, not a wrong answer
        m.step(x[:, :1], m.prefill(x[:, :bs])[1])


# --------------------------------------------------------------------------------------------------
# the model contract on every device × dtype (tests/conftest.py's `dev`)

def dev_model(dev, B=4, T=40, **kw):
    """Sharpened fp32 weights and fixed routing decisions (identical in every dtype)."""
    m = sharpen(make(dtype=torch.float32, **kw)).to(dev.device).eval()
    routers = fix_routers(m, mixed_table(B, 64).to(dev.device))
    return m, routers, torch.randint(0, 50, (B, T), device=dev.device)


def close(a, b, dev):
    """Logits a ≈ b within dev.tol(), the relative part taken against each row's largest logit: bf16
    logits near 10 have a resolution of 0.06, so elementwise rtol on a logit near 0 would demand
    more than bf16 has."""
    atol, rtol = dev.tol()
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= atol + rtol * b.abs().amax(-1, keepdim=True)).all())


@pytest.mark.parametrize("variant", ["dtrnet", "no_vo"])
def test_dev_sparse_equals_eval(dev, variant):
    m, _, x = dev_model(dev, variant=variant)
    with dev.autocast():
        ref, _, st = m(x)
        out, _, st2 = m(x, sparse=True)
    assert ref.dtype == out.dtype and torch.isfinite(out).all() and close(out, ref, dev)
    assert torch.equal(st["frac_attn"], st2["frac_attn"])


@pytest.mark.parametrize("mode", ["train", "eval", "sparse"])
def test_dev_causal(dev, mode):
    m, _, x = dev_model(dev)
    m.train(mode == "train")
    x2 = x.clone()
    x2[:, 25:] = (x2[:, 25:] + 1) % 50
    with dev.autocast():
        a = m(x, sparse=mode == "sparse")[0].float()
        b = m(x2, sparse=mode == "sparse")[0].float()
    assert torch.equal(a[:, :25], b[:, :25]) or close(a[:, :25], b[:, :25], dev)
    assert not close(a[:, 25:], b[:, 25:], dev)


@pytest.mark.parametrize("variant", ["dtrnet", "no_vo"])
def test_dev_cached_decode_equals_full_forward(dev, variant):
    m, routers, x = dev_model(dev, variant=variant)
    T0 = 7
    with dev.autocast():
        full = m(x)[0].float()
        logits, state = m.prefill(x[:, :T0])
        steps = [logits]
        for t in range(T0, x.size(1)):
            for r in routers:
                r.offset = t  # the fixed decisions of position t
            logits, state = m.step(x[:, t:t + 1], state)
            steps.append(logits)
    assert close(torch.stack(steps, 1), full[:, T0 - 1:], dev)
    # typed from K/V
    assert all(c.k.dtype == (torch.float32 if not dev.low
               else torch.bfloat16 if dev.dtype == "bf16" else torch.float16) for c in state[0])


def test_dev_training_step(dev):
    m = make(dtype=torch.float32).to(dev.device).train()
    for b in d_blocks(m):
        b.router.w2.weight.data *= 30  # a mix of routed and bypassed tokens
    x = torch.randint(0, 50, (3, 40), device=dev.device)
    probs = []
    for b in d_blocks(m):
        b.router.register_forward_hook(lambda mod, a, out: probs.append(out))
    with dev.autocast():
        _, loss, st = m(x, x)
    loss.backward()
    # router decisions in fp32 (numerics policy)
    assert all(p.dtype == torch.float32 for p in probs)
    assert torch.isfinite(loss) and 0.05 < st["frac_attn"].item() < 0.95
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    for b in d_blocks(m):
        assert b.router.w1.weight.grad.abs().sum() > 0 and b.router.w2.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------------------------------
# eval stats, routing map, accounting

def test_eval_stats_contract():
    m, table, x = tddt_with_fixed_routing()
    T = x.shape[1]
    _, loss, st = m(x, x)
    rho = table.double().mean()
    for i in m.d_layers:
        assert st[f"skip_l{i}"].item() == pytest.approx(1 - rho.item())
    assert st["skipped"].item() == pytest.approx(1 - rho.item())
    # the training computation is the same hard routing
    assert torch.equal(st["soft_loss"], st["lm_loss"])
    # by hand: T layers dense; D layers router + V + W_O + MLP,
    # and Q, K + scores for the routed share
    d = 32
    dense_layer = 2 * 4 * d * d + 4 * d * (T + 1) / 2 + 2 * 2 * d * 4 * d
    d_layer = 2 * (d * d // 2 + d) + 2 * d * d * (1 + 2 * rho) + 2 * d * d + 16 * d * d \
        + rho * 4 * d * rho * (T + 1) / 2
    head = 2 * d * 50
    want = 1 - (2 * dense_layer + 2 * d_layer + head) / (4 * dense_layer + head)
    assert st["flops_saved_hard"].item() == pytest.approx(want.item())


def test_routing_map():
    m = make(layers="TDDT").train()
    table = mixed_table(1, 30, seed=3)[[0]] | (torch.arange(30) % 3 == 0)[None]
    fix_routers(m, table)
    m.blocks[2].router = FixedRouter(~table)
    mp, rows, legend = m.routing_map(torch.randint(0, 50, (1, 30)))
    assert mp.shape == (2, 30) and mp.device.type == "cpu" and mp.dtype == torch.float32
    assert torch.equal(mp[0], table[0].float()) and torch.equal(mp[1], (~table[0]).float())
    assert rows == ["layer 1", "layer 2"] and legend[1] == "attention" and m.training
    assert (torch.equal(m.eval().routing_map(torch.randint(0, 50, (1, 30)))[0], mp)
            and not m.training)


def test_flops_accounting():
    cfg = make().cfg
    T = 1000
    assert dtrnet.flops_ratio(cfg, T, [], pattern="TTTT") == 1.0
    dense = dtrnet.flops_per_token(cfg, T, [], pattern="TTTT")
    assert dense == pytest.approx(common.dense_flops_per_token(cfg, T))
    # ρ = 1: identical work plus the router, so slightly above 1; ρ < 1 falls with T
    assert dtrnet.flops_per_token(cfg, T, 1.0) == pytest.approx(dense + 2 * dtrnet.flops_router(32))
    r = [dtrnet.flops_ratio(cfg, t, 0.1) for t in (256, 2048, 20000)]
    assert r[0] > r[1] > r[2]
    # paper Fig. 4 (1.3B: 24 layers, d=2048, SwiGLU 5632, bilayer, ~10% routed)
    # reports 0.785 at 20K tokens
    big = dtrnet.Config(n_layer=24, n_embd=2048, n_head=32, vocab_size=32000, block_size=20000)
    assert dtrnet.flops_ratio(big, 20000, 0.1, hidden=1.5 * 5632) == pytest.approx(0.778, abs=0.002)


def test_flops_saved_at_known_shares_per_layer_and_batch():
    """Two D layers routing different shares, rows routing different counts (B = 4): frac_l is the
    share of the batch's B·T tokens in that layer; flops_saved_hard = 1 − flops_ratio at those
    shares, by hand."""
    m = make(layers="TDDT").eval()
    B, T = 4, 40
    t1 = torch.zeros(B, 64, dtype=torch.bool)
    t1[0, :T], t1[1, :10] = True, True  # layer 1: 40 + 10 of 160 tokens
    t2 = torch.zeros(B, 64, dtype=torch.bool)
    t2[:, ::4] = True                   # layer 2: 10 per row, 40 of 160
    d_blocks(m)[0].router, d_blocks(m)[1].router = FixedRouter(t1), FixedRouter(t2)
    x = torch.randint(0, 50, (B, T))
    for sparse in (False, True):
        st = m(x, sparse=sparse)[2]
        assert st["frac_l1"].item() == 50 / 160 and st["frac_l2"].item() == 40 / 160
        assert st["skip_l1"].item() == 110 / 160
        assert st["frac_attn"].item() == pytest.approx(45 / 160)
        want = 1 - dtrnet.flops_ratio(m.cfg, T, [50 / 160, 40 / 160])
        assert st["flops_saved_hard"].item() == pytest.approx(want, rel=1e-6)
    # by hand: T layers dense; D layers pay router, V, W_O, MLP, and Q, K and the scores for the
    # routed share
    d, r, head = 32, [50 / 160, 40 / 160], 2 * 32 * 50
    dense = 2 * 4 * d * d + 4 * d * (T + 1) / 2 + 2 * 2 * d * 4 * d
    dlay = [2 * (d * d // 2 + d) + 2 * d * d * (1 + 2 * p) + 2 * d * d + 16 * d * d
            + p * 4 * d * p * (T + 1) / 2 for p in r]
    assert want == pytest.approx(1 - (2 * dense + sum(dlay) + head) / (4 * dense + head))


def test_kv_cache_bytes_at_known_routed_counts():
    """B = 3 rows routing 0, all, and every third token: after prefill and steps, a D layer holds
    the routed tokens of each row, T layers block_size slots per row (float64: 8 bytes)."""
    m = make(layers="TDDT").eval()
    B, S, T0, T = 3, 64, 9, 21
    table = torch.zeros(B, S, dtype=torch.bool)
    table[1] = True
    table[2, ::3] = True
    routers = fix_routers(m, table)
    x = torch.randint(0, 50, (B, T))
    _, state = m.prefill(x[:, :T0])
    for t in range(T0, T):
        for r in routers:
            r.offset = t
        _, state = m.step(x[:, t:t + 1], state)
    routed = int(table[:, :T].sum())  # 0 + 21 + 7
    assert routed == 28 and [c.n.tolist() for c in state[0][1:3]] == [[0, 21, 7]] * 2
    per_token = 2 * 32 * 8  # K and V: nh · hs = 32 values each
    held, dense = dtrnet.kv_cache_bytes(state)
    assert dense == 4 * B * S * per_token and held == (2 * B * S + 2 * routed) * per_token


# --------------------------------------------------------------------------------------------------
# CLI

def test_cli_smoke(data_dir, tmp_path):
    out = str(tmp_path / "run")
    train.main(["--model", "dtrnet", "--dataset", "shakespeare", "--max_iters=2", "--eval_iters=1",
                "--n_layer=3", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=2",
                f"--data_dir={data_dir}", f"--out_dir={out}", "--eval_interval=2",
                "--log_interval=1"])
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    ev = [r for r in rows if r["kind"] == "eval"][-1]
    assert {"val_frac_attn", "val_route_loss", "val_frac_l1", "val_flops_ratio", "val_skip_l1",
            "val_skipped", "val_soft_loss", "val_flops_saved_hard"} <= set(ev)
    assert os.path.exists(os.path.join(out, "ckpt.pt"))


def test_module_cli_help_and_refusal(monkeypatch, capsys):
    """`python dtrnet.py --help` says what it offers; anything else: one error line, exit 2."""
    import runpy
    cases = ((["--help"], 0), (["-h"], 0), (["foo"], 2), (["--help", "x"], 2), (["--compile"], 2))
    for args, rc in cases:
        monkeypatch.setattr("sys.argv", ["dtrnet.py", *args])
        try:
            runpy.run_path(dtrnet.__file__, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        assert code == rc
        if rc == 0:
            assert "usage:" in out and "train.py --model dtrnet" in out and not err
        else:
            assert not out and err.startswith("error: ") and len(err.strip().splitlines()) == 1


# ---- values pinned where a one-line change shows -------------------------------------------------

@pytest.mark.parametrize("spec, n, want", [
    ("bilayer", 1, "T"), ("bilayer", 2, "TT"), ("bilayer", 5, "TDTDT"), ("bilayer", 6, "TDTDTT"),
    ("trilayer", 7, "TDDTDDT"), ("trilayer", 5, "TDDTT"), ("laterhalf", 1, "T"),
    ("laterhalf", 7, "TTTDDDT"), ("laterhalf", 6, "TTTDDT"), ("TDDT", 4, "TDDT")])
def test_layer_patterns_by_value(spec, n, want):
    """Odd n_layer (n // 2 vs n / 2), n_layer 1 and 2 (the last layer forced to T)."""
    assert dtrnet.layer_pattern(spec, n) == want


def test_sizes_too_small_to_route_are_refused_and_the_smallest_builds():
    with pytest.raises(common.NanorouteError, match="too small for a d → d/2 router"):
        dtrnet.Config(n_layer=3, n_head=1, n_embd=1)
    assert dtrnet.Config(n_layer=3, n_head=1, n_embd=2, lam=0.0).lam == 0.0  # the edges are valid
    m = dtrnet.Model(dtrnet.Config(n_layer=3, n_head=1, n_embd=2, block_size=8, vocab_size=5))
    assert m(torch.zeros(1, 8, dtype=torch.long))[0].shape == (1, 8, 5)


def test_router_decides_in_fp32_under_bf16_autocast():
    """Eq. (1) under CPU bf16 autocast equals its fp32 computation
    (a bf16 matmul differs by ~1e-2)."""
    torch.manual_seed(0)
    r = dtrnet.Router(dtrnet.Config(n_layer=3, n_head=4, n_embd=64))
    nn.init.normal_(r.w2.weight, 0.0, 1.0)
    x = torch.randn(2, 16, 64)
    want = r(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = r(x)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-6, rtol=0)
    xb = x.bfloat16()  # "at least fp32": a bf16 input is promoted, not multiplied in bf16
    assert torch.equal(r(xb), r(xb.float()))


def test_rmsnorm_eps_pinned_at_a_scale_where_it_matters():
    """The paper preset's RMSNorm: ε = 1e-5, seen on inputs with mean square ~1e-6 (ε 1e-6 or 1e-8
    changes the output by > 30%)."""
    m = make(norm="rmsnorm", dtype=torch.float32)
    norms = [mod for mod in m.modules() if isinstance(mod, nn.RMSNorm)]
    assert len(norms) == 2 * len(m.blocks) + 1 and not any(isinstance(mod, nn.LayerNorm)
                                                           for mod in m.modules())
    x = 1e-3 * torch.randn(4, 32)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    for n in norms:
        assert torch.allclose(n(x), want, rtol=1e-5, atol=0)


def test_init_scales_pinned():
    """common.LM's init on a D layer: router and Q/K/V N(0, 0.02), W_O N(0, 0.02/√(2L)),
    biases 0."""
    torch.manual_seed(0)
    m = dtrnet.Model(dtrnet.Config(n_layer=4, n_head=4, n_embd=256, layers="TDDT", bias=True))
    b = d_blocks(m)[0]
    for w, std in ((b.router.w1.weight, 0.02), (b.router.w2.weight, 0.02),
                   (b.attn.c_attn.weight, 0.02), (b.attn.c_proj.weight, 0.02 / 8 ** 0.5)):
        assert w.std().item() == pytest.approx(std, rel=0.1 if w.numel() < 1000 else 0.02)
    assert not b.router.w1.bias.any() and not b.router.w2.bias.any()


def test_routing_loss_by_value():
    """Eq. (7): α_l = f_l / Σ f from the hard counts, without gradient; 0 when nothing is routed."""
    g = torch.tensor([0.2, 0.6], requires_grad=True)
    f = torch.tensor([0.25, 0.75], requires_grad=True)
    loss = dtrnet.routing_loss(g, f)
    assert loss.item() == pytest.approx(0.25 * 0.2 + 0.75 * 0.6, abs=1e-7)
    loss.backward()
    assert f.grad is None and torch.allclose(g.grad, torch.tensor([0.25, 0.75]))
    assert dtrnet.routing_loss(g, torch.zeros(2)).item() == 0.0
    assert dtrnet.routing_loss(g, torch.tensor([1e-9, 0.0])).item() == pytest.approx(0.2)


@pytest.mark.parametrize("T, counts, want", [
    (200, [65, 3], 128), (200, [64, 0], 64), (200, [0, 0], 64), (200, [1, 0], 64),
    (100, [65, 0], 100), (40, [0, 0], 40), (40, [3, 1], 40), (256, [129, 256], 256)])
def test_pack_length_rounds_up_to_the_bucket(T, counts, want):
    delta = torch.zeros(len(counts), T, dtype=torch.bool)
    for row, c in enumerate(counts):
        delta[row, :c] = True
    assert dtrnet.pack_length(delta) == want


def test_flops_terms_by_value():
    """d = 32, V = 50, T D D T, T = 64 (mean context 32.5, not an integer), by hand: dense layer
    6144 + 2048 + 16384 + 4160 = 28736; D layer's fixed part 1088 (router) + 2048 (V) + 2048 (W_O)
    + 16384; head 3200."""
    cfg = dtrnet.Config(n_layer=4, n_head=4, n_embd=32, vocab_size=50, layers="TDDT")
    assert dtrnet.flops_router(32) == 1088 and dtrnet.flops_router(33) == 2 * (33 * 16 + 16 * 2)
    assert dtrnet.flops_terms(cfg, 64) == (3200 + 2 * 28736 + 2 * 21568, 4096, 4160)
    assert dtrnet.flops_per_token(cfg, 64, [0.5, 0.25]) == 103808 + 4096 * 0.75 + 4160 * 0.3125
    assert dtrnet.flops_per_token(cfg, 64, 0.5) == 103808 + 2 * (4096 * 0.5 + 4160 * 0.25)
    # a pattern given: a float ρ is its D layers' (three here, not cfg's two)
    assert dtrnet.flops_per_token(cfg, 64, 0.5, pattern="TDDDT") \
        == 3200 + 2 * 28736 + 3 * 21568 + 3 * (4096 * 0.5 + 4160 * 0.25)
    assert dtrnet.flops_ratio(cfg, 64, [0.5, 0.25]) == pytest.approx(108180 / 118144, rel=1e-12)
    assert dtrnet.flops_terms(cfg, 64, hidden=100)[0] == 103808 - 4 * 2 * 2 * 32 * 28


def test_kv_cache_bytes_by_value():
    """T layers hold B·block_size slots, D layers the routed tokens they hold (fp64: 8 bytes)."""
    m = make().eval()
    table = torch.zeros(2, 64, dtype=torch.bool)
    table[0, :5], table[1, :3] = True, True
    fix_routers(m, table)
    _, state = m.prefill(torch.zeros(2, 10, dtype=torch.long))
    per_token = 2 * 4 * 8 * 8  # K and V, nh = 4, hs = 8
    assert dtrnet.kv_cache_bytes(state) == ((2 * 2 * 64 + 2 * 8) * per_token,
                                            4 * 2 * 64 * per_token)


def test_main_in_process(capsys):
    """dtrnet.main itself (the module CLI test runs a fresh copy of the file)."""
    for args in ([], ["-h"], ["--help"]):
        dtrnet.main(args)
        out = capsys.readouterr().out
        assert out == ("usage: python dtrnet.py [-h]\nDefines the DTRNet model (no commands): "
                       "train it with `python train.py --model dtrnet`, time it with `python "
                       "bench.py dtrnet`.\n")
    with pytest.raises(common.NanorouteError, match=r"^dtrnet.py takes no arguments, got 'a b'$"):
        dtrnet.main(["a", "b"])


def test_each_mode_takes_its_attention_path(monkeypatch):
    """Training and sparse=True attend packed (the routed tokens only); eval() without sparse is
    the masked reference; sparse=True in training is refused by name."""
    calls = []
    for name in ("attend_packed", "attend_masked"):
        orig = getattr(dtrnet.DTRBlock, name)
        monkeypatch.setattr(dtrnet.DTRBlock, name,
                            lambda self, *a, _o=orig, _n=name: calls.append(_n) or _o(self, *a))
    m, x = make(), torch.randint(0, 50, (2, 16))
    for mode, sparse, want in (("train", False, "attend_packed"), ("eval", False, "attend_masked"),
                               ("eval", True, "attend_packed")):
        calls.clear()
        getattr(m, mode)()(x, sparse=sparse)
        assert calls == [want] * 2, (mode, sparse, calls)
    with pytest.raises(common.NanorouteError,
                       match=r"^sparse=True is an inference path: call model.eval\(\) first$"):
        m.train()(x, sparse=True)


def test_no_targets_no_loss_and_a_dense_pattern_is_refused():
    """A pattern with no D layer would be a dense GPT under DTRNet's name: refused, not trained."""
    m, x = make(lam=0.5).eval(), torch.randint(0, 50, (2, 16))
    assert m(x)[1] is None
    with pytest.raises(common.NanorouteError, match=r"no D \(routed\) layer"):
        make(layers="TTTT", lam=0.5)


def test_router_params_at_an_odd_width():
    cfg = dtrnet.Config(n_layer=3, n_head=3, n_embd=33, bias=True)
    assert dtrnet.router_params(cfg) == 33 * 16 + 16 * 2 + 18
    assert dtrnet.router_params(cfg) == sum(p.numel() for p in dtrnet.Router(cfg).parameters())


def test_config_refusals_word_for_word():
    base = dict(n_layer=4, n_head=4, n_embd=32)
    for kw, msg in ((dict(variant="mod"), "variant='mod': choose one of dtrnet, skip, no_vo"),
                    (dict(norm="bn"), "norm='bn': choose one of layernorm, rmsnorm"),
                    (dict(lam=-1.0), "lam (λ) must be >= 0, got -1.0"),
                    (dict(n_embd=1, n_head=1), "n_embd=1 is too small for a d → d/2 router")):
        with pytest.raises(common.NanorouteError) as e:
            dtrnet.Config(**{**base, **kw})
        assert str(e.value) == msg


def test_eval_applies_no_dropout_and_a_block_defaults_to_the_reference():
    """eval() is deterministic at dropout 0.5 (mix() passes self.training); DTRBlock(x) alone is the
    masked reference."""
    m, x = make(dropout=0.5).eval(), torch.randint(0, 50, (2, 16))
    assert torch.equal(m(x)[0], m(x)[0])
    b, h = d_blocks(m)[0], m.embed(x)
    assert torch.equal(b(h)[0], b(h, packed=False)[0])
    calls = []
    b.attend_packed = lambda *a: calls.append(1)
    b(h)
    assert not calls
