"""Tests for conddepth.py (conditional depth routing, arXiv:2604.17228). Tiny configs; < 60 s on 2 CPU cores."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import common
import conddepth as cd
import train

V = 40


def tiny(**kw):
    base = dict(n_layer=3, n_embd=32, n_head=2, block_size=32, vocab_size=V, n_controlled=2, cheap_rank=4,
                d_c=16, d_a=4, d_s=8, pred_hidden=8)
    base.update(kw)
    return cd.Config(**base)


def make(dtype=torch.float64, seed=0, randomize_cheap=True, **kw):
    """A model whose cheap path is NOT the identity (W_down randomised), so routing changes the output."""
    torch.manual_seed(seed)
    m = cd.Model(tiny(**kw)).to(dtype)
    if randomize_cheap:
        with torch.no_grad():
            for ffn in m.cheap:
                ffn.down.weight.normal_(0, 0.5)
    return m


def data(B=3, T=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


# ---- config ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(rho=0.0), dict(rho=1.5), dict(rho=-0.1), dict(gate="G2"), dict(recipe="A9"),
                                dict(mode="foo"), dict(n_controlled=5), dict(tau=0.0)])
def test_bad_config_is_one_line_error(kw):
    with pytest.raises(common.NanorouteError) as e:
        tiny(**kw)
    assert "\n" not in str(e.value)


def test_recipes_set_the_paper_flags():
    assert tiny(recipe="A1").lam_jepa == 0.0 and tiny(recipe="A1").gate == "G3"
    a3 = tiny(recipe="A3-G1")
    assert (a3.gate, a3.lam_util, a3.lam_rank, a3.lam_jepa) == ("G1", 0.0, 0.0, 1.0)
    assert tiny(recipe="A2").shuffle_targets and tiny(recipe="A4-0.25").lam_jepa == 0.25
    assert tiny(rho=1.0).rho == 1.0  # ρ = 1 is allowed (all full)


# ---- routing ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("rho,T,k", [(0.3, 10, 3), (0.5, 32, 16), (0.25, 13, 4), (1.0, 7, 7), (0.01, 20, 1)])
def test_exact_topk_count_per_sequence(rho, T, k):
    assert cd.budget_k(rho, T) == k == math.ceil(round(rho * T, 9))
    m = make(rho=rho)
    x, y = data(T=T)
    for train_mode in (True, False):
        m.train(train_mode)
        _, _, stats = m(x, y)
        for mask, u in zip(m.last_masks, m.last_scores):
            assert mask.sum(-1).tolist() == [k] * x.size(0)  # exactly k full tokens in every sequence
            # the selected tokens are the k highest scores
            assert (u.masked_fill(~mask, -1e9).topk(k, -1).values == u.topk(k, -1).values).all()
        assert abs(stats["full_ratio"].item() - k / T) < 1e-6


@pytest.mark.parametrize("gate", ["G1", "G3"])
@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_sparse_equals_dense_hard(gate, mode):
    m = make(gate=gate, mode=mode).eval()
    x, _ = data(B=4)
    if mode == "causal":  # thresholds that make rows route different numbers of tokens
        m.last_scores = []
        m.mode = "topk"
        m(x)
        m.thresholds.copy_(torch.stack([u.median() for u in m.last_scores]))
        m.mode = "causal"
    dense, _, _ = m(x)
    counts = [mk.sum(-1).tolist() for mk in m.last_masks]
    sparse, _, _ = m(x, sparse=True)
    assert torch.allclose(sparse, dense, atol=1e-10, rtol=0)
    if mode == "causal":
        assert any(len(set(c)) > 1 for c in counts)  # the case with unequal rows really was exercised
        assert all(0 < sum(c) < x.numel() for c in counts)
    # and routing matters: forcing all-full gives different logits (so the comparison is not vacuous)
    m.cfg.rho, m.mode = 1.0, "topk"
    assert not torch.allclose(m(x)[0], dense, atol=1e-6)


def test_sparse_float32_and_train_mode_refused():
    m = make(dtype=torch.float32).eval()
    x, _ = data()
    assert torch.allclose(m(x, sparse=True)[0], m(x)[0], atol=1e-5)
    with pytest.raises(common.NanorouteError):
        m.train()(x, sparse=True)


@pytest.mark.parametrize("gate", ["G1", "G3"])
def test_straight_through(gate):
    """Forward = hard top-k (eq. 8), and the LM loss alone sends a gradient to the controller through p."""
    m = make(gate=gate, lam_jepa=0.0, lam_util=0.0, lam_rank=0.0, lam_b=0.0, lam_a=0.0)
    x, y = data()
    m.train()
    logits_train, loss, stats = m(x, y)
    m.eval()
    logits_eval, _, _ = m(x, y)
    assert torch.allclose(logits_train, logits_eval, atol=1e-12)
    assert abs(loss.item() - stats["lm_loss"].item()) < 1e-6  # every λ = 0: loss is the LM loss only
    m.train()
    m.zero_grad()
    m(x, y)[1].backward()
    for g in m.gates:
        grads = [p.grad for p in g.parameters() if p.requires_grad]
        assert all(gr is not None for gr in grads) and sum(gr.abs().sum() for gr in grads) > 0
    # the gradient reaching u is exactly the eq. (8) one: dL/du = <dL/dh, h_full − h_cheap> · σ'(u/τ)/τ
    m.zero_grad()
    j = 1
    store = {}
    block = m.blocks[-1]
    orig = block.attn_delta

    def spy(h):
        out = orig(h)
        store["a"] = h + out
        return out
    block.attn_delta = spy
    us = []
    gate_fwd = m.gates[j].forward

    def gate_spy(a):
        u, q = gate_fwd(a)
        u.retain_grad()
        us.append(u)
        return u, q
    m.gates[j].forward = gate_spy
    _, loss, _ = m(x, y)
    a = store["a"]
    a.retain_grad() if a.requires_grad else None
    h_full = a + block.ffn_delta(a)
    h_cheap = a + m.cheap[j](a)
    # dL/dh at the output of the last controlled layer:
    hout = torch.where(m.last_masks[j][..., None], h_full, h_cheap).detach().requires_grad_(True)
    logits, lm = m.head(hout, y)
    (g_h,) = torch.autograd.grad(lm, hout)
    loss.backward()
    u = us[0]
    p = torch.sigmoid(u / m.cfg.tau)
    expected = (g_h * (h_full - h_cheap)).sum(-1) * p * (1 - p) / m.cfg.tau
    assert torch.allclose(u.grad, expected.detach(), atol=1e-10)
    block.attn_delta, m.gates[j].forward = orig, gate_fwd


def test_cheap_path_starts_as_identity():
    """W_down = 0 at init: a model routing every token cheap equals the GPT with those FFNs skipped."""
    m = make(randomize_cheap=False).eval()
    assert all((f.down.weight == 0).all() and (f.down.bias == 0).all() for f in m.cheap)
    m.mode = "causal"
    m.thresholds.fill_(float("inf"))  # nobody passes: all cheap
    x, _ = data()
    logits, _, stats = m(x)
    assert stats["full_ratio"].item() == 0.0
    h = m.embed(x)
    L, C = m.cfg.n_layer, m.cfg.n_controlled
    for i, block in enumerate(m.blocks):
        h = h + block.attn_delta(h)
        if i < L - C:
            h = h + block.ffn_delta(h)  # the FFN of controlled layers is skipped
    ref, _ = m.head(h)
    assert torch.allclose(logits, ref, atol=1e-12)
    # and with ρ = 1 (all full) the model is exactly the dense GPT on the same weights
    m.mode, m.cfg.rho = "topk", 1.0
    dense = common.Model(tiny()).to(torch.float64)
    dense.load_state_dict(m.state_dict(), strict=False)
    assert torch.allclose(m(x)[0], dense.eval()(x)[0], atol=1e-12)


def test_topk_is_not_causal_but_causal_mode_is():
    m = make().eval()
    x, _ = data(B=4)
    x2 = x.clone()
    x2[:, 16:] = (x2[:, 16:] + 7) % V  # change only the future half
    for train_mode in (False, True):
        m.train(train_mode)
        a, b = m(x)[0], m(x2)[0]
        # honest: exact top-k over the sequence lets future tokens change earlier outputs
        assert not torch.allclose(a[:, :16], b[:, :16], atol=1e-6)
    m.eval()
    m.calibrate_thresholds([data(B=4, seed=s)[0] for s in range(3)])
    m.mode = "causal"
    for sparse in (False, True):
        a, b = m(x, sparse=sparse)[0], m(x2, sparse=sparse)[0]
        assert torch.allclose(a[:, :16], b[:, :16], atol=1e-12)
        assert not torch.allclose(a[:, 16:], b[:, 16:], atol=1e-6)


def test_calibration_hits_the_budget():
    m = make(rho=0.25).eval()
    batches = [data(B=8, seed=s)[0] for s in range(4)]
    thr = m.calibrate_thresholds(batches)
    assert torch.isfinite(thr).all() and m.mode == "topk"  # mode restored
    m.mode = "causal"
    ratios = [m(x)[2]["full_ratio"].item() for x in batches]
    assert abs(sum(ratios) / len(ratios) - 0.25) < 0.02


# ---- losses ----------------------------------------------------------------------------------------

def test_derangement_has_no_fixed_point():
    for n in (2, 3, 5, 17, 64, 1000):
        for _ in range(5):
            p = cd.derangement(n, "cpu")
            assert sorted(p.tolist()) == list(range(n))      # a permutation
            assert (p != torch.arange(n)).all()              # no fixed point


def test_a2_shuffles_targets():
    x, y = data()
    base = make(gate="G3")
    shuf = make(gate="G3", shuffle_targets=True)
    assert base.train()(x, y)[2]["jepa"] != shuf.train()(x, y)[2]["jepa"]
    assert base.eval()(x, y)[2]["jepa"] == shuf.eval()(x, y)[2]["jepa"]  # eval: never shuffled


def test_window_looks_forward_with_decay():
    """A CE change at position t0 only moves labels at t0−W+1 … t0, by γ^(t0−t)."""
    T, W, g, t0 = 20, 4, 0.5, 10
    ce_full = torch.zeros(1, T)
    ce_cheap = torch.zeros(1, T)
    ce_cheap[0, t0] = 1.0  # cheap hurts exactly one prediction
    u = cd.windowed_ce(ce_cheap, W, g) - cd.windowed_ce(ce_full, W, g)
    expect = torch.zeros(1, T)
    for t in range(t0 - W + 1, t0 + 1):
        expect[0, t] = g ** (t0 - t)
    assert torch.equal(u, expect)
    assert (u > 0).sum() == W and u[0, t0 + 1:].abs().sum() == 0  # positive sign: full is worth it


def test_oracle_labels_match_explicit_forks():
    m = make(oracle_window=3, oracle_gamma=0.5, label_start=0, label_every=1)
    x, y = data(T=16)
    y[0, 5] = -1  # ignored targets contribute 0
    m.train()
    m.on_step(0)
    captured = {}
    orig = m.oracle_labels
    m.oracle_labels = lambda br, t: captured.setdefault("u", orig(br, t))
    _, _, stats = m(x, y)
    assert stats["label_step"].item() == 1 and stats["util"] > 0
    L, C = m.cfg.n_layer, m.cfg.n_controlled
    with torch.no_grad():
        for j in range(C):  # brute force: replay layer by layer with forced paths, per-token CE, explicit window
            ces = []
            for force_full in (True, False):
                h = m.embed(x)
                for i, block in enumerate(m.blocks):
                    if i < L - C:
                        h = block(h)
                        continue
                    jj = i - (L - C)
                    a = h + block.attn_delta(h)
                    if jj < j:  # the on-policy (top-k) route
                        h = torch.where(m.last_masks[jj][..., None], a + block.ffn_delta(a), a + m.cheap[jj](a))
                    elif jj == j and not force_full:
                        h = a + m.cheap[jj](a)
                    else:
                        h = a + block.ffn_delta(a)
                logits, _ = m.head(h)
                ce = torch.zeros(y.shape, dtype=torch.float64)
                for b in range(y.size(0)):
                    for t in range(y.size(1)):
                        if y[b, t] >= 0:
                            ce[b, t] = F.cross_entropy(logits[b, t].double(), y[b, t])
                win = torch.zeros_like(ce)
                for t in range(y.size(1)):
                    for d in range(3):
                        if t + d < y.size(1):
                            win[:, t] += 0.5 ** d * ce[:, t + d]
                ces.append(win)
            assert torch.allclose(captured["u"][j].double(), ces[1] - ces[0], atol=1e-6)


def test_labels_only_on_label_steps():
    m = make(label_start=100, label_every=5)
    x, y = data()
    m.train()
    for it, want in ((0, 0), (99, 0), (100, 1), (101, 0), (105, 1)):
        m.on_step(it)
        assert m(x, y)[2]["label_step"].item() == want
    m3 = make(recipe="A3-G3", label_start=0)
    m3.train().on_step(0)
    assert m3(x, y)[2]["label_step"].item() == 0  # A3: never computes labels


def test_rank_loss_direction():
    u_star = torch.arange(10.0)[None]
    torch.manual_seed(0)
    good, bad = cd.rank_loss(u_star * 3, u_star), cd.rank_loss(-u_star * 3, u_star)
    assert good < math.log(2) < bad


def test_budget_and_alive_losses():
    m = make(rho=0.5, p_min=0.05)
    x, y = data()
    with torch.no_grad():
        for g in m.gates:
            g.head[2].bias.fill_(-40.0)  # p ≈ 0 everywhere
    _, _, st = m.train()(x, y)
    assert abs(st["budget"].item() - 0.25) < 1e-6 and abs(st["alive"].item() - 0.05) < 1e-6


# ---- training scope --------------------------------------------------------------------------------

def test_controller_only_freezes_the_backbone():
    m = make(gate="G3", label_start=0)
    x, y = data()
    m.train().on_step(0)
    m(x, y)[1].backward()
    for name, p in m.named_parameters():
        trainable = name.startswith(("cheap.", "gates.")) and ".target." not in name
        assert p.requires_grad == trainable, name
        if trainable:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    full = make(controller_only=False)
    full.train()(x, y)[1].backward()
    assert full.blocks[0].mlp.c_fc.weight.grad is not None and full.wte.weight.grad is not None


# ---- CLI, --init_from a dense checkpoint -----------------------------------------------------------

ARCH = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=2", "--eval_iters=1"]


def test_init_from_dense_checkpoint_rho1_reproduces_dense(data_dir, tmp_path, capsys):
    gpt_dir, cd_dir = str(tmp_path / "gpt"), str(tmp_path / "cd")
    train.main(["--model", "gpt", f"--data_dir={data_dir}", f"--out_dir={gpt_dir}", "--max_iters=3", *ARCH])
    train.main(["--model", "conddepth", f"--data_dir={data_dir}", f"--out_dir={cd_dir}", "--max_iters=0",
                f"--init_from={gpt_dir}/ckpt.pt", "--rho=1.0", "--n_controlled=1"])
    g, c = common.load_checkpoint(f"{gpt_dir}/ckpt.pt"), common.load_checkpoint(f"{cd_dir}/ckpt.pt")
    dense = common.Model(common.Config(**{k: v for k, v in g["config"].items()}))
    dense.load_state_dict(g["model"])
    ours = cd.Model(cd.Config(**c["config"]))
    ours.load_state_dict(c["model"])
    x = torch.randint(0, dense.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    ld, lo = dense.eval()(x)[0], ours.eval()(x)[0]
    assert torch.allclose(ld, lo, atol=1e-5)
    assert torch.allclose(ours(x, sparse=True)[0], ld, atol=1e-5)
    # ρ = 0.5 routes half the tokens cheap (identity at init): no longer the dense model
    ours.cfg.rho = 0.5
    assert not torch.allclose(ours(x)[0], ld, atol=1e-4)


def test_cli_smoke_with_labels(data_dir, tmp_path, capsys):
    out = str(tmp_path / "run")
    best = train.main(["--model", "conddepth", f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=4",
                       "--label_start=0", "--label_every=2", "--recipe=G1", "--log_interval=1", *ARCH,
                       "--n_controlled=1", "--eval_interval=2"])
    assert math.isfinite(best)
    text = open(os.path.join(out, "metrics.jsonl")).read()
    assert "val_full_ratio" in text and '"util"' in text
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "conddepth", f"--data_dir={data_dir}", "--rho=0"])
    assert e.value.code == 2 and "rho" in capsys.readouterr().err


# ---- compute proxies with the paper's dimensions ---------------------------------------------------

def test_compute_proxies_paper_dims():
    P = cd.PRESETS["paper"]
    g1, g3 = cd.Config(**P, recipe="G1"), cd.Config(**P, recipe="G3")
    # the paper's trainable controller counts (§4) come out exactly
    for cfg, n in ((g1, 828_484), (g3, 849_348)):
        parts = [cd.CheapFFN(cfg), (cd.GateG1 if cfg.gate == "G1" else cd.GateG3)(cfg)]
        assert cfg.n_controlled * sum(p.numel() for m in parts for p in m.parameters() if p.requires_grad) == n
    # inference: paper 0.547 (G1) … 0.553 (G3)
    assert abs(cd.infer_vs_full(g1) - (0.5 + 0.5 * 80 / 2560 + 640 * 160 / (2 * 640 * 2560) + 160 / (2 * 640 * 2560))) < 1e-12
    assert abs(cd.infer_vs_full(g1) - 0.547) < 0.001 and abs(cd.infer_vs_full(g3) - 0.553) < 0.001
    # training without oracle (A3): paper 1.054 (G1) / 1.068 (G3); ours 1.0625 / 1.093 (we also count T)
    a3g1, a3g3 = cd.Config(**P, recipe="A3-G1"), cd.Config(**P, recipe="A3-G3")
    assert abs(cd.compute_vs_full(a3g1) - 1.0625) < 1e-3 and abs(cd.compute_vs_full(a3g3) - 1.0931) < 1e-3
    # standard recipe: + oracle = (C − 1) units per controlled layer on 3980 of 20000 steps (paper: 1.513 / 1.527)
    frac = 3980 / 20000
    assert abs(cd.label_fraction(g3) - frac) < 1e-12
    assert abs(cd.compute_vs_full(g3) - cd.compute_vs_full(a3g3) - 3 * frac) < 1e-12
    assert 1.5 < cd.compute_vs_full(g1) < 1.7 and 1.5 < cd.compute_vs_full(g3) < 1.7
