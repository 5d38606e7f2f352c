"""Tests for tsa.py (Token-Selective Attention). Tiny configs (float64 for exactness tests, the
`dev` matrix of tests/conftest.py for the model contract); the whole file runs in well under
60 s."""
import dataclasses
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import common
import tsa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(**kw):
    base = dict(n_layer=4, n_head=4, n_embd=32, block_size=32, vocab_size=50, hard_ft_iters=0)
    base.update(kw)
    return tsa.Config(**base)


def make(seed=0, mixed=False, dtype=torch.float64, calib=None, **kw):
    """mixed=True gives every router a known mix on the batch `calib` (default ids(B=4)): about half
    of its tokens halt, in different numbers per row (asserted where it matters), with a margin
    around p = 0.5."""
    torch.manual_seed(seed)
    m = tsa.build(tiny(**kw)).to(dtype)
    if mixed:
        with torch.no_grad():
            for r in getattr(m, "routers", []):
                r.fc1.weight.normal_(0, 1.0)
                r.fc2.weight.normal_(0, 4.0)
            m.ln_f.weight.mul_(20)  # logits of O(1) and peaked attention, so that a wrong
            for b in m.blocks:      # residual or a wrong K/V shows above bf16 tolerances
                b.attn.c_attn.weight.mul_(8)
            if m.cfg.variant == "tsa":
                calibrate(m, ids(B=4) if calib is None else calib)
    return m


def calibrate(m, x):
    """Router by router (later inputs depend on earlier decisions), put the threshold in the widest
    gap between the 30% and 70% quantiles of the router's logits on x."""
    for r in m.routers:
        z = []
        hook = r.fc2.register_forward_hook(lambda mod, inp, out: z.append(out.flatten()))
        m.trunk(m.embed(x), "hard")
        hook.remove()
        s = z[0].sort().values
        lo, hi = int(0.3 * len(s)), int(0.7 * len(s))
        j = lo + (s[lo + 1:hi + 1] - s[lo:hi]).argmax()
        r.fc2.bias -= (s[j] + s[j + 1]) / 2


def ids(B=3, T=32, V=50, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def record_p(m):
    """Every router output of the next calls, in call order (forward hooks)."""
    rec = []
    for r in m.routers:
        r.register_forward_hook(lambda mod, inp, out: rec.append(out.detach().float().cpu()))
    return rec


def agreeing_prefix(ps_a, ps_b):
    """(B, T) mask of the positions before the first token whose hard decision differs between two
    passes at any router; by causality, logits there must agree. ps_*: L−1 tensors (B, T, 1)."""
    same = torch.stack([(a <= 0.5) == (b <= 0.5)
                        for a, b in zip(ps_a, ps_b)]).all(0)[..., 0]  # (B, T)
    return same.int().cumprod(1).bool()


def assert_mixed(ps, rows_differ=True):
    for p in ps:
        halted = (p > 0.5).sum((1, 2))  # (B,)
        assert 0 < halted.sum() < p[..., 0].numel(), "the test must see halted and active tokens"
        if rows_differ:
            assert len(set(halted.tolist())) > 1, "the rows must halt different numbers of tokens"


# --------------------------------------------------------------------------------------------------
# The paper's formulas

def test_router_parameter_count_paper():
    # §2.2: d=256, L=6 -> 5 routers × (256·64 + 64 + 64 + 1) = 82,565 parameters
    m = tsa.Model(tsa.Config(n_layer=6, n_embd=256, n_head=8, vocab_size=65))
    assert sum(p.numel() for n, p in m.named_parameters() if n.startswith("routers.")) == 82_565
    assert len(m.routers) == 5
    assert all(torch.all(r.fc2.bias == -1.0) for r in m.routers)  # σ(−1) ≈ 0.27 at init


def test_router_hidden_floor():
    assert tsa.Router(32).fc1.out_features == 16  # max(d/4, 16)
    assert tsa.Router(256).fc1.out_features == 64


def test_router_is_eq2():
    """p = σ(W2 ReLU(W1 h + b1) + b2), computed here from the parameters,
    on inputs where ReLU matters."""
    torch.manual_seed(0)
    r = tsa.Router(32).double()
    torch.nn.init.normal_(r.fc1.bias, 0, 1.0)
    h = torch.randn(2, 5, 32, dtype=torch.float64)
    pre = h @ r.fc1.weight.T + r.fc1.bias                                 # (2, 5, 16)
    assert (pre < 0).any() and (pre > 0).any()
    ref = 1 / (1 + torch.exp(-(pre.clamp(min=0) @ r.fc2.weight.T + r.fc2.bias)))
    assert torch.allclose(r(h), ref, atol=1e-14, rtol=0)
    assert r(h).dtype == torch.float64 and r.float()(h.float()).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # decisions in fp32 under autocast (numerics policy)
        assert r(h.float()).dtype == torch.float32


def test_gate_extremes():
    """p = 0: the plain block exactly; p = 1: h unchanged (eqs. 3–4)."""
    m = make()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    block = m.blocks[1]
    for p_val in (0.0, 1.0):
        for r in m.routers:  # force p by a huge router bias
            torch.nn.init.zeros_(r.fc2.weight)
            torch.nn.init.constant_(r.fc2.bias, 1e4 if p_val == 1.0 else -1e4)
        m.train()
        h, ps = m.trunk(x, "soft")
        assert torch.all(ps[0] == p_val)
        ref = m.blocks[0](x)
        for b in m.blocks[1:]:
            ref = b(ref) if p_val == 0.0 else ref
        assert torch.equal(h, ref)
    # one gated block with p = 0 vs common.Block: identical
    g = torch.zeros(2, 16, 1, dtype=torch.float64)
    y = x + (1 - g) * block.attn_delta(x)
    assert torch.equal(y + (1 - g) * block.ffn_delta(y), block(x))


def test_gates_hard_and_straight_through():
    p = torch.tensor([[[0.2], [0.7]]], dtype=torch.float64)
    assert torch.equal(make().gate(p, "hard"), torch.tensor([[[0.8], [0.0]]], dtype=torch.float64))
    assert torch.equal(make(hard_variant="01").gate(p, "hard"),
                       torch.tensor([[[1.0], [0.0]]], dtype=torch.float64))
    # straight-through: the hard value forward, exactly the soft gradient backward
    for hv in ("scaled", "01"):
        m, pg = make(hard_variant=hv), p.clone().requires_grad_()
        g = m.gate(pg, "hard_st")
        assert torch.equal(g.detach(), m.gate(p, "hard"))
        g.sum().backward()
        # d(1 − p)/dp, for active and halted tokens
        assert torch.equal(pg.grad, torch.full_like(p, -1.0))


def test_dense_init_matches_gpt_names():
    """Blocks keep common.Model's parameter names,
    so --init_from a dense checkpoint loads every tensor."""
    dense = common.Model(common.Config(n_layer=4, n_head=4, n_embd=32, block_size=32,
                                       vocab_size=50))
    missing, unexpected = make().load_state_dict(dense.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("routers.") for k in missing)


def test_train_stats_alpha_and_tlops():
    m = make()
    m.train()
    x = ids()
    _, loss, st = m(x, x)
    ps = m.trunk(m.embed(x), "soft")[1]
    alpha = torch.stack([(1 - p).mean() for p in ps]).mean()
    assert torch.allclose(st["alpha"], alpha)
    assert torch.allclose(st["tlops_saved"], 1 - (1 + 3 * alpha) / 4)  # eq. (7), L = 4
    assert torch.allclose(loss, st["lm_loss"] + 1e-3 * alpha)           # eq. (5)
    assert all(f"active_r{l}" in st for l in range(3)) and all(
        not v.requires_grad for v in st.values())
    assert abs(common.tlops_saving(0.726, 6) - 0.228) < 1e-3  # the paper's Shakespeare point


@pytest.mark.parametrize("hard_train", [False, True])
def test_eval_stats(hard_train):
    """Eval: loss = the hard (inference) loss; soft_loss = the soft training computation (eqs. 3–4)
    on the same batch; alpha etc. from the hard pass with or without targets; skip/flops names of
    the common contract."""
    m = make(mixed=True)
    # the soft loss is the soft pass even during the straight-through phase
    m.hard_train = hard_train
    x, y = ids(), ids(seed=2)
    m.eval()
    with torch.no_grad():
        logits, loss, st = m(x, y)
        st_no_targets = m(x)[2]
        ps = m.trunk(m.embed(x), "hard")[1]
        m.train()
        m.hard_train = False
        soft_logits, _, st_train = m(x, y)
    # common.head: CE in fp32
    hard_loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    assert torch.allclose(st["lm_loss"], hard_loss) and torch.allclose(
        loss.float(), hard_loss + st["depth_loss"].float())
    assert torch.allclose(st["soft_loss"], st_train["lm_loss"], atol=1e-12)
    assert torch.allclose(st["soft_alpha"], st_train["alpha"], atol=1e-12)
    assert abs(st["soft_loss"] - st["lm_loss"]) > 1e-3  # soft and hard really differ here
    hard = torch.stack([(p <= 0.5).double().mean() for p in ps])
    alpha = torch.stack([(1 - p).mean() for p in ps]).mean()
    assert 0.1 < hard.mean() < 0.9  # the forced routers really mix
    for k, v in st_no_targets.items():  # the same numbers with and without targets
        assert torch.allclose(v, st[k]), k
    assert torch.allclose(st["alpha"], alpha) and torch.allclose(st["alpha_hard"], hard.mean())
    for i in (1, 2, 3):  # by block index: router l decides block l+1
        assert torch.allclose(st[f"skip_l{i}"], 1 - hard[i - 1]) and torch.allclose(
            st[f"hard_r{i - 1}"], hard[i - 1])
    assert "skip_l0" not in st and torch.allclose(st["skipped"], 1 - hard.mean())
    flops = (tsa.flops_per_token(m.cfg, 32, hard.mean(), "query")
             / common.dense_flops_per_token(m.cfg, 32))
    assert torch.allclose(st["flops_saved_hard"], 1 - flops)


@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("skip_queries", [False, True])
@pytest.mark.parametrize("hard_variant", ["01", "scaled"])
def test_sparse_equals_eval(dev, skip_queries, hard_variant, B):
    """B=4 packs each query range's active queries into a (B, W) grid;
    B=1 is the identity packing (slices)."""
    m = make(mixed=True, dtype=torch.float32, skip_queries=skip_queries,
             hard_variant=hard_variant).to(dev.device).eval()
    x = ids(B=4)[:B].to(dev.device)
    rec = record_p(m)
    with torch.no_grad(), dev.autocast():
        dense, _, st = m(x)
        ps_dense = rec[:]
        rec.clear()
        sparse, _, st_s = m(x, sparse=True)
    assert_mixed(ps_dense, rows_differ=B > 1)
    ok = agreeing_prefix(ps_dense, rec)
    assert ok.all() if not dev.low else ok.float().mean() > 0.5
    atol, rtol = dev.tol()
    assert torch.allclose(dense.float()[ok], sparse.float()[ok], atol=atol, rtol=rtol)
    assert not dev.low or torch.allclose(st["alpha_hard"], st_s["alpha_hard"], atol=0.02)
    assert dev.low or torch.equal(st["alpha_hard"], st_s["alpha_hard"])


def test_sparse_is_exact_in_fp64():
    for skip_queries in (False, True):
        m = make(mixed=True, skip_queries=skip_queries).eval()
        with torch.no_grad():
            assert torch.allclose(m(ids(B=4))[0], m(ids(B=4), sparse=True)[0], atol=1e-12, rtol=0)


def force_rows(m, rows):
    """Forward hooks overriding every router's p per row: "halt" (p = 0.9), "run" (p = 0.1), or
    "mix" (the router's own p, except that positions < 9 halt, so a mixed row's first query range of
    three is empty)."""
    def hook(mod, inp, p):
        p = p.clone()
        for b, r in enumerate(rows):
            if r == "mix":
                p[b, :9] = 0.9
            else:
                p[b] = 0.9 if r == "halt" else 0.1
        return p
    return [r.register_forward_hook(hook) for r in m.routers]


@pytest.mark.parametrize("rows", [["mix"], ["halt"], ["run"], ["halt", "run", "mix"],
                                  ["mix", "halt", "mix"]])
def test_sparse_rows_exact(rows):
    """The sparse path in float64 against the dense eval forward: B=1, rows whose every token
    halts / runs / mixes in one batch, at T=29 (the first 9 positions of a mixed row halt)."""
    m = make(mixed=True).eval()
    force_rows(m, rows)
    x = ids(B=len(rows), T=29)
    rec = record_p(m)
    with torch.no_grad():
        dense = m(x)[0]
        assert torch.allclose(dense, m(x, sparse=True)[0], atol=1e-12, rtol=0)
    if "mix" in rows:
        assert_mixed(rec[:3], rows_differ=False)


def test_sparse_all_halted_and_all_active():
    for bias in (50.0, -50.0):
        m = make(skip_queries=True)
        with torch.no_grad():
            for r in m.routers:
                r.fc2.bias.fill_(bias)
        m.eval()
        with torch.no_grad():
            assert torch.allclose(m(ids())[0], m(ids(), sparse=True)[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", ["train", "eval", "sparse", "hard_train", "early_exit"])
def test_causality(dev, mode):
    m = make(mixed=True, dtype=torch.float32,
             variant="early_exit" if mode == "early_exit" else "tsa",
             threshold=0.05 if mode == "early_exit" else 1.0).to(dev.device)
    m.train(mode in ("train", "hard_train"))
    m.hard_train = mode == "hard_train"
    x = ids(B=2).to(dev.device)
    y = x.clone()
    y[:, 20:] = (y[:, 20:] + 7) % 50  # change only the future
    with torch.no_grad(), dev.autocast():
        a = m(x, sparse=mode == "sparse")[0].float()
        b = m(y, sparse=mode == "sparse")[0].float()
    atol, rtol = dev.tol()  # the sparse path packs the work differently: rounding differs
    assert torch.allclose(a[:, :20], b[:, :20], atol=atol, rtol=rtol)
    assert not torch.allclose(a[:, 20:], b[:, 20:])  # ... and the future did change


# --------------------------------------------------------------------------------------------------
# Cached decoding (prefill/step) == the full eval forward

@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("hard_variant", ["01", "scaled"])
def test_cached_decode_equals_forward(dev, hard_variant, B):
    """Every prefix: prefill/step logits == self(idx[:, :n])[0][:, -1] (eval, dense-hard), with
    halted and active tokens in a mixed batch. Under bf16, positions after a decision flipped at the
    threshold are skipped (causality makes the earlier ones comparable)."""
    m = make(mixed=True, dtype=torch.float32, hard_variant=hard_variant).to(dev.device).eval()
    x = ids(B=3)[:B].to(dev.device)
    rec = record_p(m)
    with torch.no_grad(), dev.autocast():
        full = m(x)[0].float()  # (B, T, V)
        ps_full = rec[:]
        rec.clear()
        logits, state = m.prefill(x[:, :8])
        got = [logits.float()]
        for t in range(8, 32):
            logits, state = m.step(x[:, t:t + 1], state)
            got.append(logits.float())
    assert_mixed(ps_full, rows_differ=B > 1)
    # prefill (B, 8), then one per step
    ps_cached = [torch.cat([rec[l]] + rec[3 + l::3], dim=1) for l in range(3)]
    ok = agreeing_prefix(ps_full, ps_cached)[:, 7:]
    assert ok.all() if not dev.low else ok.float().mean() > 0.5
    atol, rtol = dev.tol()
    got = torch.stack(got, dim=1)  # (B, 25, V) for positions 7..31
    assert torch.allclose(got[ok], full[:, 7:][ok], atol=atol, rtol=rtol)
    if not dev.low:  # every prefix, its own full forward (the model sees exactly idx[:, :n])
        with torch.no_grad():
            for n in (9, 20, 32):
                assert torch.allclose(got[:, n - 8], m(x[:, :n])[0][:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B", [1, 3])
def test_cached_decode_exact_fp64_and_preallocated(B):
    """B=1: a step either runs a routed block or (the token halts) only writes its K/V;
    B=3: mixed batches."""
    m = make(mixed=True, skip_queries=False).eval()
    x = ids(B=3)[:B]
    rec = record_p(m)
    with torch.no_grad():
        logits, state = m.prefill(x[:, :5])
        storage = [c.k.data_ptr() for c in state[0]]
        for t in range(5, 32):
            assert torch.allclose(logits, m(x[:, :t])[0][:, -1], atol=1e-12, rtol=0)
            logits, state = m.step(x[:, t:t + 1], state)
    # no growth
    assert [c.k.data_ptr() for c in state[0]] == storage and state[0][0].k.size(2) == 32
    # every step's decisions, all routers
    steps = torch.cat([p.flatten() for p in rec if p.size(1) == 1])
    assert (steps > 0.5).any() and (steps <= 0.5).any()  # both branches of decode_block ran


def window_start(n, block_size):
    if hasattr(common, "window_start"):
        return common.window_start(n, block_size)
    h = max(block_size // 2, 1)
    return 0 if n <= block_size else n - h - (n - block_size - 1) % (block_size - h + 1)


@pytest.mark.parametrize("variant", ["tsa", "early_exit"])
def test_generate_cached_equals_uncached_past_block_size(variant):
    m = make(mixed=True, dtype=torch.float32, variant=variant, threshold=0.05).eval()
    prompt = ids(B=2, T=5)
    # 65 tokens > block_size 32: the window restarts
    a = m.generate(prompt, 60, temperature=0, use_cache=True)
    b = m.generate(prompt, 60, temperature=0, use_cache=False)
    assert torch.equal(a, b)
    ref = prompt  # and both are the cache-free window policy, written out
    with torch.no_grad():
        for _ in range(60):
            w = window_start(ref.size(1), 32)
            ref = torch.cat([ref, m(ref[:, w:])[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(a, ref)


@pytest.mark.parametrize("B", [1, 2])
def test_decode_step_skips_the_work_of_halted_tokens(B):
    """A step of an all-halted batch (B=1: the token halts) runs only the stem, the routers, Q/K/V
    (one GEMM: the cache needs K/V) and the head (FLOP counter):
    no attention, out-projection or FFN."""
    m = make().eval()
    d, V, L = 32, 50, 4
    kv, rest = 3 * 2 * d * d, 2 * d * d + 2 * 2 * d * 4 * d  # Q/K/V; out-proj + FFN
    for bias, routed in ((50.0, kv), (-50.0, kv + rest)):
        with torch.no_grad():
            for r in m.routers:
                r.fc2.bias.fill_(bias)
            _, state = m.prefill(ids(B=B, T=6))
            with FlopCounterMode(display=False) as fc:
                m.step(ids(B=B, T=1), state)
        assert fc.get_total_flops() == B * (kv + rest + (L - 1) * (routed + tsa.flops_router(d))
                                            + 2 * d * V)


# --------------------------------------------------------------------------------------------------
# With biases, at the tie p = 0.5, and the accounting at known shares

@pytest.mark.parametrize("skip_queries", [False, True])
@pytest.mark.parametrize("hard_variant", ["01", "scaled"])
def test_contracts_with_bias(skip_queries, hard_variant):
    """bias=True (nonzero biases everywhere): sparse == dense-hard, and cached decoding == the full
    forward at B=1 and in a mixed B=3 batch, in float64. A bias shows where a gate is applied before
    a linear layer instead of to its output, or where a halted token's (zero) update still goes
    through a biased layer."""
    m = make(mixed=True, bias=True, skip_queries=skip_queries, hard_variant=hard_variant)
    with torch.no_grad():
        for name, p in m.named_parameters():
            # keep the calibrated routing
            if name.endswith("bias") and not name.endswith("fc2.bias"):
                p.normal_(0, 0.5)
        calibrate(m, ids(B=4))
    m.eval()
    x = ids(B=3)
    rec = record_p(m)
    with torch.no_grad():
        dense = m(x)[0]
        assert_mixed(rec[:3])
        assert torch.allclose(dense, m(x, sparse=True)[0], atol=1e-12, rtol=0)
        for B in (1, 3):
            rec.clear()
            logits, state = m.prefill(x[:B, :6])
            for t in range(6, 32):
                assert torch.allclose(logits, m(x[:B, :t])[0][:, -1], atol=1e-12, rtol=0), (B, t)
                logits, state = m.step(x[:B, t:t + 1], state)
            steps = torch.cat([p.flatten() for p in rec if p.size(1) == 1])
            assert (steps > 0.5).any() and (steps <= 0.5).any()  # decode steps halt and run


@pytest.mark.parametrize("hard_variant", ["01", "scaled"])
def test_tie_p_exactly_half_runs_the_block(hard_variant):
    """Ours (declared; the authors' MLX code halts it): p = 0.5 exactly runs the block, as p > 0.5
    halts (§3.6). With every router at σ(0) = 0.5, the eval forward, the sparse forward and
    cached decoding ("01") equal the dense GPT with the same weights, and the stats count every
    token as active."""
    m = make(hard_variant=hard_variant).eval()
    with torch.no_grad():
        for r in m.routers:
            r.fc2.weight.zero_()
            r.fc2.bias.zero_()
    p = torch.full((1, 2, 1), 0.5, dtype=torch.float64)
    assert torch.equal(m.gate(p, "hard"), torch.full_like(p, 1.0 if hard_variant == "01" else 0.5))
    x = ids(B=2)
    dense = common.Model(common.Config(n_layer=4, n_head=4, n_embd=32, block_size=32,
                                       vocab_size=50)).double()
    dense.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("routers.")})
    dense.eval()
    with torch.no_grad():
        ref = dense(x)[0]
        (hard, _, st), (sparse, _, st_s) = m(x), m(x, sparse=True)
        for s in (st, st_s):
            assert s["alpha_hard"] == 1 and s["skipped"] == 0
        assert all(v == 1 for v in m.routing_map(x[:1])[0].flatten().tolist())
        logits, state = m.prefill(x[:, :5])
        got = [logits]
        for t in range(5, 32):
            logits, state = m.step(x[:, t:t + 1], state)
            got.append(logits)
    got = torch.stack(got, 1)  # (B, 28, V) positions 4..31
    if hard_variant == "01":  # the full update: the plain GPT
        for out in (hard, sparse, got):
            assert torch.allclose(out, ref[:, -out.size(1):], atol=1e-12, rtol=0)
    else:  # every block runs at half its update: not the GPT, and the three paths agree
        assert not torch.allclose(hard, ref)
        assert torch.allclose(sparse, hard, atol=1e-12, rtol=0) and torch.allclose(
            got, hard[:, 4:], atol=1e-12)


@pytest.mark.parametrize("sparse", [False, True])
def test_accounting_at_known_shares(sparse):
    """B=2, T=8, routing forced per router: r0 halts every 4th token (3/4 run), r1 halts row 0
    (1/2), r2 halts odd positions (1/2). Stats against numbers computed here by hand: hard_r,
    α_hard = 7/12, skipped, eq. (7)'s TLOps, and the FLOPs saved (d=32, L=4, V=50, T=8: mean
    context 4.5)."""
    m = make().eval()
    t = torch.arange(8)
    halt = [torch.stack([t % 4 == 0] * 2), torch.stack([t >= 0, t < 0]),
            torch.stack([t % 2 == 1] * 2)]

    def force(l):
        return lambda mod, inp, p: torch.where(halt[l][..., None], 0.9, 0.1).to(p.dtype)
    for l, r in enumerate(m.routers):
        r.register_forward_hook(force(l))
    with torch.no_grad():
        st = m(ids(B=2, T=8), sparse=sparse)[2]
    assert [st[f"hard_r{l}"].item() for l in range(3)] == [0.75, 0.5, 0.5]
    assert [st[f"skip_l{l}"].item() for l in (1, 2, 3)] == [0.25, 0.5, 0.5]
    assert st["alpha_hard"].item() == pytest.approx(7 / 12, abs=1e-15)
    assert st["skipped"].item() == pytest.approx(5 / 12, abs=1e-15)
    # eq. (7)
    assert st["tlops_saved_hard"].item() == pytest.approx((1 - 7 / 12) * 3 / 4, abs=1e-15)
    d, V = 32, 50
    block = 6 * d * d + 2 * d * d + 4 * d * 4.5 + 16 * d * d  # Q/K/V, out-proj, scores, FFN
    routed = (4 * d * d + 2 * d * d + 7 / 12 * (2 * d * d + 4 * d * 4.5 + 16 * d * d)
              + 2 * (d * 16 + 16))
    dense = 4 * block + 2 * d * V
    assert st["flops_saved_hard"].item() == pytest.approx(
        1 - (block + 3 * routed + 2 * d * V) / dense, abs=1e-12)


def test_cli_refuses_before_any_work(tmp_path, capsys):
    """python tsa.py: --help prints what it takes; no/unknown arguments and a run of another model
    are refused (NanorouteError), the wrong model from its checkpoint alone; as a command (one real
    subprocess), that is one `error:` line on stderr and exit 2, no traceback."""
    cfg = common.Config(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=50)
    common.save_checkpoint(str(tmp_path / "ckpt.pt"), model=common.Model(cfg).state_dict(),
                           config=dataclasses.asdict(cfg))
    for args in ([], ["exit_sweep"], ["sweep", "x"], ["exit_sweep", str(tmp_path), "x"]):
        with pytest.raises(common.NanorouteError, match="usage"):
            tsa.main(args)
    with pytest.raises(common.NanorouteError, match="'gpt' run"):
        tsa.main(["exit_sweep", str(tmp_path)])
    tsa_run = tmp_path / "tsa_run"  # a TSA run, not an early-exit one
    tsa_run.mkdir()
    common.save_checkpoint(str(tsa_run / "ckpt.pt"), model=tsa.Model(tiny()).state_dict(),
                           config=dataclasses.asdict(tiny()))
    with pytest.raises(common.NanorouteError) as e:
        tsa.main(["exit_sweep", str(tsa_run)])
    assert str(e.value) == f"exit_sweep needs an early-exit run; {tsa_run} is tsa"
    for args in (["--help"], ["-h"], ["exit_sweep", "--help"]):
        tsa.main(args)
        assert capsys.readouterr().out.startswith("usage: python tsa.py exit_sweep RUN_DIR: ")
    r = subprocess.run([sys.executable, "tsa.py", "exit_sweep", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (r.returncode == 2 and r.stderr.startswith("error: ")
            and r.stderr.count("\n") == 1), r.stderr


# --------------------------------------------------------------------------------------------------
# Training

@pytest.mark.parametrize("hard", [False, True])
def test_training_step(dev, hard):
    """One finite step under the device's autocast; the task loss alone (λ = 0) reaches every
    router, also through the straight-through estimator."""
    m = make(mixed=hard, dtype=torch.float32, lam=0.0).to(dev.device).train()
    m.hard_train = hard
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = ids().to(dev.device)
    with dev.autocast():
        _, loss, st = m(x, x)
    loss.backward()
    assert torch.isfinite(loss) and loss.dtype == torch.float32
    for r in m.routers:
        for p in r.parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    opt.step()
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_lambda_pushes_routers_to_halt():
    """∂L_depth/∂b2 > 0 pushes p up: with only the depth loss, a step on b2 raises p. Eq. (2) reads
    h with no stop-gradient: L_depth also reaches the stem, through every router's input."""
    m = make(lam=1.0)
    m.train()
    _, loss, st = m(ids(), ids())
    (loss - st["lm_loss"]).backward()
    assert all(r.fc2.bias.grad.item() < 0 for r in m.routers)  # gradient descent increases b2 → p ↑
    m.zero_grad(set_to_none=True)
    torch.cat(m.trunk(m.embed(ids()), "soft")[1], -1).sum().backward()  # the p_l alone
    g = m.blocks[0].attn.c_attn.weight.grad
    assert g is not None and g.abs().sum() > 0


def test_on_step_hard_phase():
    m = make(max_iters=100, hard_ft_iters=10)
    m.on_step(89)
    assert not m.hard_train
    m.on_step(90)
    assert m.hard_train
    # longer than the run: every iteration is straight-through
    m = make(max_iters=100, hard_ft_iters=500)
    m.on_step(0)
    assert m.hard_train
    # the control: lr only
    m = make(max_iters=100, hard_ft_iters=10, hard_ft_routers="soft", hard_ft_lr=1e-2)
    m.on_step(95)
    assert not m.hard_train and m.lr_at(95) > m.cfg.learning_rate
    # the hard phase's forward == the hard eval forward
    m2 = make(mixed=True, max_iters=100, hard_ft_iters=10)
    m2.on_step(95)
    m2.train()
    x = ids()
    with torch.no_grad():
        a = m2(x)[0]
        m2.eval()
        b = m2(x)[0]
    assert torch.allclose(a, b, atol=1e-12)


def test_hard_phase_lr_restarts(data_dir, tmp_path):
    """hard_ft_lr > 0: the phase's lr restarts at hard_ft_lr and falls by a cosine to min_lr; before
    the phase (and with hard_ft_lr = 0 everywhere) it is the common schedule. train.py must use it:
    the logged lr is checked."""
    kw = dict(max_iters=8, hard_ft_iters=4, learning_rate=1e-3, min_lr=1e-4, warmup_iters=2)
    plain, m = make(**kw), make(**kw, hard_ft_lr=1e-2)
    assert [plain.lr_at(it) for it in range(9)] == [common.lr_at(it, plain.cfg) for it in range(9)]
    assert [m.lr_at(it) for it in range(4)] == [common.lr_at(it, m.cfg) for it in range(4)]
    assert (m.lr_at(4) == 1e-2 and m.lr_at(6) == pytest.approx((1e-2 + 1e-4) / 2)
            and m.lr_at(8) == pytest.approx(1e-4))
    import train
    train.main(["--model", "tsa", f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--n_layer=2",
                "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=2", "--eval_iters=1",
                "--eval_interval=8", "--log_interval=1", *(f"--{k}={v}" for k, v in kw.items()),
                "--hard_ft_lr=1e-2"])
    logged = [r["lr"] for r in map(json.loads, open(tmp_path / "metrics.jsonl"))
              if r["kind"] == "train"]
    assert logged == pytest.approx([m.lr_at(it) for it in range(8)])


def test_frozen_routers_get_no_update():
    """hard_ft_routers="frozen": in the straight-through phase the routers receive no gradient, so
    AdamW leaves them exactly as they were (no momentum step, no weight decay) while the backbone
    trains on their hard decisions; before the phase they train as usual."""
    m = make(mixed=True, dtype=torch.float32, max_iters=6, hard_ft_iters=3,
             hard_ft_routers="frozen", lam=0.1).train()
    opt = common.make_optimizer(m, m.cfg, torch.device("cpu"))
    x = ids()
    snap = lambda mod: [p.detach().clone() for p in mod.parameters()]  # noqa: E731
    for it in range(6):
        if it == 3:  # entering the phase: Adam has momentum for the routers from the soft steps
            routers, backbone = snap(m.routers), snap(m.blocks)
        m.on_step(it)
        _, loss, _ = m(x, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        assert m.hard_train == (it >= 3)
        assert all((p.grad is None) == m.hard_train for p in m.routers.parameters())
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(routers, snap(m.routers)))
    assert not any(torch.equal(a, b) for a, b in zip(backbone, snap(m.blocks)) if a.dim() == 2)
    m.cfg.hard_ft_routers = "train"  # the unfrozen phase (the default recipe) still trains them
    _, loss, _ = m(x, x)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.routers.parameters())


def test_calibrated_routers_halt_what_the_soft_gate_claims():
    """hard_ft_routers="calibrate": at the first straight-through step, each router's b2 moves so
    that p > 0.5 for the share of tokens equal to its soft mean p on that batch (computed layer by
    layer on the same inputs); afterwards the routers are frozen, and later steps (or a resumed run)
    do not move them again."""
    m = make(dtype=torch.float32, max_iters=6, hard_ft_iters=3, hard_ft_routers="calibrate").train()
    x = ids(B=4)
    b_old = [r.fc2.bias.detach().clone() for r in m.routers]
    m.on_step(2)
    assert not m.calibrate_now
    m.on_step(3)
    with torch.no_grad():
        m(x, x)
        b_new = [r.fc2.bias.detach().clone() for r in m.routers]
        ps = m.trunk(m.embed(x), "hard_st")[1]  # the same inputs per router as the calibrating pass
    for p, a, b in zip(ps, b_old, b_new):
        # soft mean p before the shift
        claimed = torch.sigmoid(torch.logit(p, eps=1e-6) - (b - a)).mean()
        assert 0.15 < claimed < 0.45 and abs((p > 0.5).float().mean() - claimed) <= 1.5 / p.numel()
    for it in (4, 5):
        m.on_step(it)
        with torch.no_grad():
            m(x, x)
        assert all(torch.equal(r.fc2.bias, b) for r, b in zip(m.routers, b_new))


@pytest.mark.parametrize("share", [0.5, 0.8])
def test_exec_share_sets_the_active_share(share):
    """exec_share=S: the calibration step shifts each router's b2 to the quantile S of its logits
    on that batch, so a share S of the token-layers stays active (p <= 0.5) there, whatever the
    soft gate claims."""
    m = make(dtype=torch.float32, max_iters=6, hard_ft_iters=3, hard_ft_routers="calibrate",
             exec_share=share).train()
    # spread the logits (at init they differ by ~1e-6, fp32's resolution of logit(p))
    with torch.no_grad():
        for r in m.routers:
            r.fc2.weight.normal_(0, 1.0)
    x = ids(B=4)
    m.on_step(3)
    with torch.no_grad():
        m(x, x)
        ps = m.trunk(m.embed(x), "hard_st")[1]
    active = torch.stack([(p <= 0.5).float().mean() for p in ps])  # (L−1,) per router
    assert (active - share).abs().max() <= 0.01 and abs(active.mean() - share) <= 0.01


# --------------------------------------------------------------------------------------------------
# Early-exit baseline (§3.5)

def reference_early_exit(m, x, thr):
    """Slow per-token reference of the §3.5 inference:
    frozen exited tokens, logits from the exit head."""
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
                if exited[b][t] is None and (l == len(m.blocks) - 1
                                             or logits[b, t].softmax(-1).max() > thr):
                    exited[b][t] = logits[b, t].clone()
    return torch.stack([torch.stack(r) for r in exited])


def test_early_exit_frozen_state():
    torch.manual_seed(0)
    m = tsa.build(tiny(variant="early_exit")).double().eval()
    with torch.no_grad():
        m.wte.weight.mul_(10)  # sharper exit heads
        m.ln_f.weight.uniform_(0.5, 1.5)  # the last exit's norm differs from exit 0's: a token
        # that exited keeps the logits of its own exit head, not the last head's on its state
        x = ids(B=2)
        full = m(x)[0]
        conf0 = m.lm_head(m.exit_norm(0)(m.blocks[0](m.embed(x)))).softmax(-1).amax(-1)
        # some exit, some not
        for thr in conf0.quantile(torch.tensor([0.3, 0.7], dtype=conf0.dtype)).tolist():
            m.threshold = thr
            out, _, st = m(x)
            assert 0 < st["alpha"] < 1
            assert torch.allclose(out, reference_early_exit(m, x, thr), atol=1e-10)
            assert not torch.allclose(out, full)
            # (L−1, T): an exited token never runs a later block
            m_map = m.routing_map(x[:1])[0][1:]
            assert torch.all(m_map[1:] <= m_map[:-1])
        m.threshold = 1.0  # never exits: the plain model's last exit
        out, _, st = m(x)
        assert st["alpha"] == 1 and torch.equal(out, full)
        # exit head 1 is uniform: a token exited at 0 would "un-exit" there
        m.exit_ln[1].weight.zero_()
        m.threshold = conf0.median().item()
        out, _, st = m(x)
        assert torch.allclose(st["hard_r1"], st["hard_r0"]) and 0 < st["hard_r0"] < 1
        assert torch.allclose(out, reference_early_exit(m, x, m.threshold), atol=1e-10)


def test_exit_sweep_rows_and_the_threshold_restored():
    """exit_sweep: a row per threshold (0: every token exits after the stem, α = 0; 1: none does),
    then the model's threshold is the run's again."""
    import numpy as np
    m = tsa.build(tiny(variant="early_exit", threshold=0.9, eval_iters=1, batch_size=2)).eval()
    rows = tsa.exit_sweep(m, np.arange(400) % 50, {}, m.cfg, torch.device("cpu"), [0.0, 1.0])
    assert [(r["threshold"], r["alpha"]) for r in rows] == [(0.0, 0.0), (1.0, 1.0)]
    assert m.threshold == 0.9 and not m.training


def test_early_exit_trains_on_every_exit():
    """Training loss = mean over the L exits of CE(lm_head(norm_l(h_l))), computed here
    independently; targets of -1 (padding) count nowhere. stats: exit_loss (that mean), lm_loss
    (the last exit's)."""
    torch.manual_seed(0)
    m = tsa.build(tiny(variant="early_exit")).double().train()
    x, y = ids(), ids(seed=3)
    y[:, :5] = -1
    keep = y.flatten() >= 0
    _, loss, st = m(x, y)
    h, ces = m.embed(x), []
    for l, block in enumerate(m.blocks):
        h = block(h)
        norm = m.exit_ln[l] if l < len(m.exit_ln) else m.ln_f
        z = (norm(h) @ m.wte.weight.T).flatten(0, 1)[keep]
        ces.append(F.cross_entropy(z.float(), y.flatten()[keep]))
    assert torch.allclose(loss, torch.stack(ces).mean(), atol=1e-6)
    assert torch.allclose(st["lm_loss"], ces[-1]) and torch.equal(st["exit_loss"], loss.detach())
    loss.backward()
    assert all(ln.weight.grad.abs().sum() > 0 for ln in m.exit_ln)


# --------------------------------------------------------------------------------------------------
# Compute accounting

def test_flops_golden_paper_size():
    """Hand-computed, d=256, L=6, V=65, T=256 (mean context 128.5), α=0.5: per token, forward,
    ×2 per MAC. K/V 4d² = 262,144; Q 2d² = 131,072; out-proj 131,072; scores 4·d·128.5 = 131,584;
    FFN 16d² = 1,048,576; head 2dV = 33,280; router 2(d·64 + 64) = 32,896. Stem = all of a block:
    1,704,448."""
    cfg = tiny(n_embd=256, n_head=8, n_layer=6, block_size=256, vocab_size=65)
    assert (tsa.flops_per_token(cfg, 256, mode="dense") == common.dense_flops_per_token(cfg, 256)
            == 6 * 1_704_448 + 33_280)
    # query: Q/K/V of every token (one GEMM), the rest of the block for the active half
    assert (tsa.flops_per_token(cfg, 256, 0.5, "query")
            == 1_704_448 + 5 * (393_216 + 0.5 * 1_311_232 + 32_896) + 33_280)
    assert (tsa.flops_per_token(cfg, 256, 0.5, "ffn")
            == 1_704_448 + 5 * (655_872 + 0.5 * 1_048_576 + 32_896) + 33_280)
    assert tsa.flops_per_token(cfg, 256, 1.0, "soft") == 6 * 1_704_448 + 5 * 32_896 + 33_280


@pytest.mark.parametrize("skip_queries", [False, True])
def test_flops_accounting_matches_the_sparse_path(skip_queries):
    """The matmul FLOPs the sparse path really executes (torch's FLOP counter) == the
    accounting's, at the measured hard α (the counter does not see SDPA, so the attention-score
    term is left out)."""
    m = make(mixed=True, skip_queries=skip_queries).eval()
    x = ids(B=4)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        _, _, st = m(x, sparse=True)
    a, d, T = st["alpha_hard"].item(), 32, 32
    scores = (common.flops_attn_scores(d, common.mean_context(T))
              * (1 + 3 * (a if skip_queries else 1.0)))
    expect = tsa.flops_per_token(m.cfg, T, a, "query" if skip_queries else "ffn") - scores
    assert 0.1 < a < 0.9 and fc.get_total_flops() == pytest.approx(expect * 4 * T, rel=1e-9)


# --------------------------------------------------------------------------------------------------
# Routing map, presets, CLI

@pytest.mark.parametrize("variant", ["tsa", "early_exit"])
def test_routing_map(variant):
    m = make(mixed=True, variant=variant, threshold=0.05).train()
    x = ids(B=1)
    mp, rows, legend = m.routing_map(x)
    assert m.training and mp.shape == (4, 32) and mp.device.type == "cpu" and len(rows) == 4
    assert legend == ("halted", "active") and rows[1:] == ["layer 1", "layer 2", "layer 3"]
    assert torch.allclose(mp[0], mp[1:].mean(0)) and set(mp[1:].unique().tolist()) <= {0.0, 1.0}
    m.eval()
    assert torch.equal(m.routing_map(x)[0], mp) and not m.training  # the mode is restored
    with torch.no_grad():
        st = m(x)[2]
    assert torch.allclose(mp[1:].mean(1),
                          torch.stack([1 - st[f"skip_l{i}"] for i in (1, 2, 3)]).float())


def test_presets():
    assert tsa.PRESETS["classroom"].items() >= common.CLASSROOM.items()
    # the paper's sparse-TSA and dropout; our calibrated last 15%
    paper = tsa.Config(**tsa.PRESETS["paper"])
    assert (paper.hard_variant, paper.skip_queries, paper.dropout) == ("01", False, 0.1)
    assert (paper.hard_ft_iters, paper.hard_ft_routers, paper.hard_ft_lr) == (
        750, "calibrate", paper.learning_rate)
    assert (paper.n_layer, paper.n_embd, paper.n_head, paper.batch_size, paper.max_iters) == (
        6, 256, 8, 64, 5000)


BAD_CONFIGS = [  # (field=value, the exact refusal: one line, naming the field and the rule)
    (dict(hard_variant="x"), "hard_variant must be one of ('01', 'scaled'), got 'x'"),
    (dict(variant="moe"), "variant must be one of ('tsa', 'early_exit'), got 'moe'"),
    (dict(hard_ft_routers="freeze"),
     "hard_ft_routers must be one of ('train', 'frozen', 'calibrate', 'soft'), got 'freeze'"),
    (dict(lam=-1.0), "lam must be >= 0, got -1.0"),
    (dict(lam=float("nan")), "lam must be a finite number, got nan"),  # common.Config's check
    (dict(n_layer=1), "n_layer must be >= 2 (a stem and a routed block), got 1"),
    (dict(threshold=2.0), "threshold must be in [0, 1], got 2.0"),
    (dict(threshold=-0.5), "threshold must be in [0, 1], got -0.5"),
    (dict(hard_ft_iters=-1), "hard_ft_iters must be >= 0, got -1"),
    (dict(router_bias=float("inf")), "router_bias must be a finite number, got inf"),
    (dict(router_bias=float("-inf")), "router_bias must be a finite number, got -inf"),
    (dict(hard_ft_lr=-1.0), "hard_ft_lr must be 0 (off) or >= min_lr=0.0001, got -1.0"),
    (dict(hard_ft_lr=1e-9), "hard_ft_lr must be 0 (off) or >= min_lr=0.0001, got 1e-09"),
    (dict(hard_ft_lr=float("nan")), "hard_ft_lr must be a finite number, got nan"),
    (dict(exec_share=1.5, hard_ft_routers="calibrate"), "exec_share must be in [0, 1], got 1.5"),
    (dict(exec_share=-0.1, hard_ft_routers="calibrate"), "exec_share must be in [0, 1], got -0.1"),
    (dict(exec_share=0.5), "exec_share must be 0 unless hard_ft_routers='calibrate', got 0.5")]


@pytest.mark.parametrize("bad, message", BAD_CONFIGS, ids=[next(iter(b)) for b, _ in BAD_CONFIGS])
def test_bad_config_is_one_line_error(bad, message):
    with pytest.raises(common.NanorouteError) as e:
        tiny(**bad)
    assert str(e.value) == message


@pytest.mark.parametrize("variant", ["tsa", "early_exit"])
def test_sparse_in_training_is_refused(variant):
    m = make(variant=variant).train()
    with pytest.raises(common.NanorouteError) as e:
        m(ids(), sparse=True)
    assert str(e.value) == "sparse=True is an inference path: call model.eval() first"


def test_cli_smoke(data_dir, tmp_path, capsys, monkeypatch):
    """`python train.py --model tsa` end to end (a real subprocess), then the early-exit variant and
    its threshold sweep in-process (same code path, without paying another torch import on a busy
    machine): the sweep reads the run's data_dir (not ./data), flushes each row as measured."""
    out = tmp_path / "run"
    args = ["--model", "tsa", "--dataset", "shakespeare", "--max_iters=2", "--n_layer=2",
            "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=4", "--eval_iters=1",
            "--eval_interval=2", "--hard_ft_iters=1", f"--data_dir={data_dir}"]
    r = subprocess.run([sys.executable, "train.py", *args, f"--out_dir={out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    rec = [json.loads(l) for l in open(out / "metrics.jsonl")]
    ev = [e for e in rec if e["kind"] == "eval"][-1]
    for k in ("val_loss", "val_soft_loss", "val_alpha", "val_alpha_hard", "val_tlops_saved_hard",
              "val_skipped", "val_skip_l1", "val_flops_saved_hard", "val_active_r0"):
        assert k in ev, k
    import train
    train.main(args + [f"--out_dir={tmp_path / 'ee'}", "--variant=early_exit"])
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # keeps what is not flushed
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.chdir(tmp_path)  # no data/ here
    tsa.main(["exit_sweep", str(tmp_path / "ee")])
    assert not tsa.load_run(str(tmp_path / "ee"))[0].training  # load_run gives an eval() model
    rows = out.buffer.getvalue().decode().splitlines()
    monkeypatch.undo()
    row = r"threshold=\d\.\d{4} alpha=\d\.\d{4} tlops_saved=\d\.\d{4} val_loss=\d+\.\d{4}"
    assert len(rows) == 13 and rows[0].startswith("threshold=0.1000 ") and all(
        re.fullmatch(row, r) for r in rows), rows
    with pytest.raises(SystemExit) as e:
        train.main(args + ["--lam=-2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "lam" in err


# ---- values pinned where a one-line change shows -------------------------------------------------

def test_config_edges_are_valid():
    """The ends of each valid range build (the refusals are test_bad_config_is_one_line_error)."""
    for ok in (dict(n_layer=2), dict(lam=0.0), dict(threshold=0.0), dict(threshold=1.0),
               dict(exec_share=1.0, hard_ft_routers="calibrate"),
               dict(hard_ft_lr=1e-4, min_lr=1e-4),
               dict(exec_share=0.0, hard_ft_routers="calibrate"), dict(router_bias=-30.0)):
        tiny(**ok)
    with pytest.raises(common.NanorouteError, match="n_layer must be >= 2"):
        tiny(n_layer=1)
    with pytest.raises(common.NanorouteError, match=r"hard_ft_lr must be 0 \(off\) or >= min_lr"):
        tiny(hard_ft_lr=5e-5, min_lr=1e-4)


def test_hard_phase_longer_than_the_run_and_from_step_0():
    """A phase of 500 steps in a run of 100 (or of exactly 100) starts at step 0: straight-through,
    calibrated once at step 0, its lr restarting at hard_ft_lr and reaching min_lr at max_iters."""
    for n in (100, 500):
        m = make(max_iters=100, hard_ft_iters=n, hard_ft_routers="calibrate", hard_ft_lr=1e-2,
                 min_lr=1e-4, warmup_iters=10)
        m.on_step(0)
        assert m.hard_train and m.calibrate_now
        m.on_step(1)
        assert m.hard_train and not m.calibrate_now
        assert m.lr_at(0) == 1e-2 and m.lr_at(100) == pytest.approx(1e-4)
        assert m.lr_at(50) == pytest.approx((1e-2 + 1e-4) / 2)
    m = make(max_iters=100, hard_ft_iters=7, hard_ft_lr=1e-2, min_lr=1e-4)  # 7 does not divide 100
    assert m.lr_at(92) == pytest.approx(common.lr_at(92, m.cfg)) and m.lr_at(93) == 1e-2
    assert m.lr_at(100) == pytest.approx(1e-4) and m.lr_at(96) < m.lr_at(95) < 1e-2
    m.on_step(92)
    assert not m.hard_train
    m.on_step(93)
    assert m.hard_train


def test_router_runs_in_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    r = tsa.Router(64)
    torch.nn.init.normal_(r.fc2.weight, 0.0, 1.0)
    x = torch.randn(2, 16, 64)
    want = r(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = r(x)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-7, rtol=0)


def test_router_widths_init_and_flops_by_value():
    """Eq. (2): hidden max(d // 4, 16) (d = 66: 16, not 16.5; d = 100: 25), b2 starts at router_bias
    exactly, the rest of the router N(0, 0.02) as every matrix."""
    assert tsa.Router(66).fc1.out_features == 16 and tsa.Router(100).fc1.out_features == 25
    assert tsa.Router(32).fc1.out_features == 16
    assert tsa.flops_router(66) == 2 * (66 * 16 + 16) and tsa.flops_router(100) == 2 * (
        100 * 25 + 25)
    assert tsa.flops_router(32) == 2 * (32 * 16 + 16)  # the floor of 16
    for bias in (-1.0, -2.5):
        torch.manual_seed(0)
        m = tsa.Model(tiny(n_embd=256, n_head=4, router_bias=bias))
        assert all(r.fc2.bias.item() == bias for r in m.routers) and len(m.routers) == 3
        assert all(not r.fc1.bias.any() for r in m.routers)
        assert m.routers[0].fc1.weight.std().item() == pytest.approx(0.02, rel=0.03)


def test_gate_by_value_at_the_halting_edge():
    """§3.6: p = 0.5 runs (gate 1 or 1 − p = 0.5), p just above halts (0); soft: 1 − p; the
    straight-through gate's forward is the hard one, its gradient the soft one's (−1)."""
    p = torch.tensor([0.25, 0.5, 0.5 + 1e-6, 0.9], dtype=torch.float64, requires_grad=True)
    scaled, paper = make(hard_variant="scaled"), make(hard_variant="01")
    assert scaled.gate(p, "hard").tolist() == [0.75, 0.5, 0.0, 0.0]
    assert paper.gate(p, "hard").tolist() == [1.0, 1.0, 0.0, 0.0]
    assert paper.gate(p, "hard").dtype == scaled.gate(p, "hard").dtype == torch.float64
    assert torch.allclose(scaled.gate(p, "soft"), 1 - p)
    st = paper.gate(p, "hard_st")
    assert st.tolist() == [1.0, 1.0, 0.0, 0.0]
    st.sum().backward()
    assert p.grad.tolist() == [-1.0] * 4


def test_depth_and_hard_stats_by_value():
    """Eqs. (5)–(7) on known p: L = 4, p_l = 0.2, 0.5, 0.9 (active 0.8, 0.5, 0.1), λ = 0.3."""
    cfg = tiny(lam=0.3)
    ps = [torch.full((2, 3, 1), v) for v in (0.2, 0.5, 0.9)]
    loss, st = tsa.depth_stats(ps, cfg)
    alpha = (0.8 + 0.5 + 0.1) / 3
    assert [st[f"active_r{l}"].item() for l in range(3)] == pytest.approx([0.8, 0.5, 0.1])
    assert st["alpha"].item() == pytest.approx(alpha) and loss.item() == pytest.approx(0.3 * alpha)
    assert st["tlops_saved"].item() == pytest.approx(1 - (1 + 3 * alpha) / 4)
    hard = torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)
    for kw, mode in ((dict(), "query"), (dict(skip_queries=False), "ffn")):
        c = tiny(**kw)
        h = tsa.hard_stats(c, hard, 16)
        want = tsa.flops_per_token(c, 16, 0.5, mode) / common.dense_flops_per_token(c, 16)
        assert h["flops_saved_hard"].item() == pytest.approx(1 - want, rel=1e-9)
        assert [h[f"skip_l{l}"].item() for l in (1, 2, 3)] == [0.0, 0.5, 1.0] and "skip_l0" not in h
        assert h["skipped"].item() == 0.5 and h["alpha_hard"].item() == 0.5
        assert h["tlops_saved_hard"].item() == pytest.approx(1 - (1 + 3 * 0.5) / 4)
    c = tiny(variant="early_exit")
    want = tsa.flops_per_token(c, 16, 0.5, "exit") / common.dense_flops_per_token(c, 16)
    assert tsa.hard_stats(c, hard, 16)["flops_saved_hard"].item() == pytest.approx(1 - want)


def test_exit_flops_by_value():
    """Early exit, d = 32, L = 4, V = 50, T = 16 (mean context 8.5): K/V 4096, Q 2048, out 2048,
    scores 1088, FFN 16384, head 3200; exit heads of the running tokens: head·(1 + 2α)/3."""
    cfg = tiny(variant="early_exit", block_size=16)
    kv, per_query, ffn, head = 4096, 2048 + 2048 + 1088, 16384, 3200
    for a in (0.0, 0.25, 1.0):
        want = (kv + per_query + ffn + 3 * (kv + a * (per_query + ffn) + head * (1 + 2 * a) / 3)
                + head)
        assert tsa.flops_per_token(cfg, 16, a, "exit") == pytest.approx(want, rel=1e-12)


def test_one_step_phase_and_no_phase():
    """hard_ft_iters = 1: only the last step is straight-through, its lr hard_ft_lr, then min_lr at
    max_iters; hard_ft_iters = 0: never, at any step."""
    m = make(max_iters=10, hard_ft_iters=1, hard_ft_lr=1e-2, min_lr=1e-4)
    m.on_step(9)
    assert m.hard_train and m.lr_at(9) == 1e-2 and m.lr_at(10) == pytest.approx(1e-4)
    m.on_step(8)
    assert not m.hard_train
    m = make(max_iters=10, hard_ft_iters=0)
    for it in (0, 9, 10):
        m.on_step(it)
        assert not m.hard_train


def test_flops_defaults():
    """flops_per_token(cfg, T) is the dense GPT; α defaults to 1 (every routed block runs)."""
    cfg = tiny()
    assert tsa.flops_per_token(cfg, 32) == common.dense_flops_per_token(cfg, 32)
    assert tsa.flops_per_token(cfg, 32, mode="ffn") == tsa.flops_per_token(cfg, 32, 1.0, "ffn")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_model_init_refusals_and_fresh_state(tmp_path):
    """tsa.Model refuses the early-exit variant (tsa.build picks the class). Under DDP (a real
    one-process gloo group here) a phase whose routers get no gradient is refused before any work,
    as DDP would fail on them mid-run; the other phases build. A fresh model trains soft, no
    calibration pending, until on_step says otherwise."""
    with pytest.raises(common.NanorouteError) as e:
        tsa.Model(tiny(variant="early_exit"))
    assert str(e.value) == "variant='early_exit': build it with tsa.build(cfg)"
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                                         world_size=1)
    try:
        for routers in ("frozen", "calibrate"):
            with pytest.raises(common.NanorouteError) as e:
                tsa.Model(tiny(hard_ft_routers=routers, hard_ft_iters=5))
            assert str(e.value) == (f"hard_ft_routers={routers} leaves routers without gradients,"
                                    " which DDP refuses: use one process or 'train'")
        for ok in (dict(hard_ft_routers="frozen", hard_ft_iters=0),
                   dict(hard_ft_routers="train", hard_ft_iters=5),
                   dict(hard_ft_routers="soft", hard_ft_iters=5)):
            tsa.Model(tiny(**ok))
    finally:
        torch.distributed.destroy_process_group()
    tsa.Model(tiny(hard_ft_routers="frozen", hard_ft_iters=5))  # one process: no DDP, fine
    m = make(mixed=True, max_iters=10, hard_ft_iters=5, hard_ft_routers="calibrate").train()
    assert m.hard_train is False and m.calibrate_now is False
    x = ids()
    st = m(x, x)[2]
    soft = m.head(m.trunk(m.embed(x), "soft")[0], x)[1]
    hard = m.head(m.trunk(m.embed(x), "hard")[0], x)[1]
    assert torch.equal(st["lm_loss"], soft) and abs(soft - hard) > 1e-3  # soft, not hard


@pytest.mark.parametrize("bias", [False, True])
def test_early_exit_heads_and_eval_flops(bias):
    """The exit heads' LayerNorms have biases exactly when cfg.bias does (as ln_f); eval's FLOPs
    saved are counted at the batch's T (8 here; n_embd is 32)."""
    m = make(mixed=True, variant="early_exit", threshold=0.025, bias=bias).eval()
    assert [ln.bias is not None for ln in m.exit_ln] == [bias] * 3 and (m.ln_f.bias is None) != bias
    with torch.no_grad():
        st = m(ids(T=8))[2]
    a = st["alpha_hard"]
    want = 1 - tsa.flops_per_token(m.cfg, 8, a, "exit") / common.dense_flops_per_token(m.cfg, 8)
    assert 0 < a < 1 and st["flops_saved_hard"].item() == pytest.approx(want.item(), rel=1e-12)


def test_calibration_waits_for_its_pass_and_survives_a_saturated_router():
    """on_step arms the calibration; it happens at the phase's first straight-through pass even
    when the model is evaluated in between (eval's hard and soft passes leave it armed). A router
    saturated in fp32 (p = 1 for every token: it claims that none runs) moves b2 by the clamped
    logit(1 − 1e-6) = 13.802 in fp32 (1 − 1e-6 rounds to 1 − 1.0133e-6), to a finite value at
    which every token still halts."""
    m = make(dtype=torch.float32, max_iters=6, hard_ft_iters=3, hard_ft_routers="calibrate")
    x = ids(B=4)
    with torch.no_grad():
        for r in m.routers:
            r.fc2.bias.fill_(20.0)  # σ(20 ± 0.01) rounds to 1 in fp32
        m.on_step(3)
        m.eval()(x, x)
        assert m.calibrate_now and all(r.fc2.bias.item() == 20.0 for r in m.routers)
        m.train()(x, x)
        assert not m.calibrate_now
        ps = m.trunk(m.embed(x), "hard_st")[1]
    for r, p in zip(m.routers, ps):
        assert r.fc2.bias.item() == pytest.approx(20.0 - 13.802, abs=1e-3)
        assert (p > 0.5).all()
