"""Tests for conddepth.py (conditional depth routing, arXiv:2604.17228).
Tiny configs; < 60 s on 2 CPU cores. Each test says which bug it guards against; every one was
planted and seen to fail (see results/conddepth.md)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import common
from conftest import decoded_vs_full
import conddepth as cd
import train

V = 40


def tiny(**kw):
    base = dict(n_layer=3, n_embd=32, n_head=2, block_size=32, vocab_size=V, n_controlled=2,
                cheap_rank=4, d_c=16, d_a=4, d_s=8, pred_hidden=8)
    base.update(kw)
    return cd.Config(**base)


def make(dtype=torch.float64, seed=0, randomize_cheap=True, **kw):
    """A model whose cheap path is NOT the identity (W_down randomised),
    so routing changes the output."""
    torch.manual_seed(seed)
    m = cd.Model(tiny(**kw)).to(dtype)
    with torch.no_grad():
        if randomize_cheap:
            for ffn in m.cheap:
                ffn.down.weight.normal_(0, 0.5)
        # bias=True: nonzero biases (init gives 0), so that one lost counts
        for name, p in m.named_parameters():
            if m.cfg.bias and name.endswith("bias") and name.startswith(("blocks.", "ln_f.")):
                p.normal_(0, 0.2)
    return m


def data(B=3, T=32, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    return x.to(device), y.to(device)


def calibrated(m, n=3, B=4):
    """θ from a few batches of training's top-k routing
    (what a training run leaves in the checkpoint)."""
    T, dev, was_training = m.cfg.block_size, m.wte.weight.device, m.training
    m.threshold_batches.zero_()  # θ restarts: the first batch's cut, then the running average
    with torch.no_grad():
        for s in range(n):
            m.train()(data(B=B, T=T, seed=100 + s, device=dev)[0])
    return m.train(was_training)


def prefix(m, x):
    h = m.embed(x)
    for block in m.blocks[:m.cfg.n_layer - m.cfg.n_controlled]:
        h = block(h)
    return h


def replay(m, x):
    """Reference: the training forward written out from the paper's equations, layer by layer."""
    cfg, out, h = m.cfg, [], prefix(m, x)
    for j, block in enumerate(m.blocks[-cfg.n_controlled:]):
        a = h + block.attn_delta(h)                                     # eq. (1)
        g = m.gates[j]
        if cfg.gate == "G1":
            u, qf, qc = g.w2(F.silu(g.w1(a)))[..., 0], None, None       # eq. (10)
        else:
            P = lambda z: g.pred[-1](F.silu(g.pred[0](z)))  # noqa: E731  Linear → SiLU → Linear
            c = g.w_c(a)                                                 # eq. (11)
            qf = P(torch.cat([c, g.e[0].expand(*c.shape[:2], -1)], -1))  # eq. (12)
            qc = P(torch.cat([c, g.e[1].expand(*c.shape[:2], -1)], -1))
            u = g.head[-1](F.silu(g.head[0](torch.cat([qf, qc, qf - qc], -1))))[..., 0]  # (13)
        mask = cd.topk_mask(u, cd.budget_k(cfg.rho, x.size(1)))
        h_full, h_cheap = a + block.ffn_delta(a), a + m.cheap[j](a)     # eqs. (2), (3)
        out.append(dict(a=a, u=u, qf=qf, qc=qc, m=mask, p=torch.sigmoid(u / cfg.tau),
                        h_full=h_full, h_cheap=h_cheap))
        h = torch.where(mask[..., None], h_full, h_cheap)               # eq. (9)'s forward value
    return out


def scored(m, *args, **kw):
    """m(*args, **kw) and each controlled layer's score u (B, T), detached,
    as that forward's routing saw it."""
    seen, controller = [], m.controller

    def spy(*a):
        seen.append(controller(*a))
        return seen[-1]
    m.controller = spy
    try:
        out = m(*args, **kw)
    finally:
        del m.controller
    # eval with targets also runs the top-k
    return out, [u.detach() for u, _ in seen[:m.cfg.n_controlled]]


def agree(a_masks, b_masks):
    """(B,) rows whose decisions agree at every controlled layer (bf16 may flip a score at θ)."""
    return torch.stack([(a == b).all(-1) for a, b in zip(a_masks, b_masks)]).all(0)


# ---- config --------------------------------------------------------------------------------------

RECIPE_LIST = "G1, G3, A1, A2, A3-G1, A3-G3, A4-0.25, A4-2"


@pytest.mark.parametrize("kw, msg", [
    (dict(rho=0.0), "rho must be in (0, 1], got 0.0"),
    (dict(rho=1.5), "rho must be in (0, 1], got 1.5"),
    (dict(gate="G2"), "gate must be G1 or G3, got 'G2'"),
    (dict(recipe="A9"), f"unknown recipe 'A9'; choose one of {RECIPE_LIST}"),
    (dict(mode="foo"), "mode must be causal or topk, got 'foo'"),
    (dict(n_controlled=5), "n_controlled must be in [1, n_layer], got 5"),
    (dict(tau=0.0), "tau must be > 0, got 0.0"), (dict(d_c=0), "d_c must be > 0, got 0"),
    (dict(d_s=-1), "d_s must be > 0, got -1"), (dict(d_a=0), "d_a must be > 0, got 0"),
    (dict(pred_hidden=0), "pred_hidden must be > 0, got 0"),
    (dict(cheap_rank=0), "cheap_rank must be > 0, got 0"),
    (dict(g1_hidden=-1), "g1_hidden must be >= 0, got -1"),
    (dict(lam_util=-0.5), "lam_util must be >= 0, got -0.5"),
    (dict(oracle_window=0), "oracle_window must be > 0, got 0"),
    (dict(label_start=-1), "label_start must be >= 0, got -1"),
    (dict(oracle_gamma=1.5), "oracle_gamma must be in [0, 1], got 1.5"),
    (dict(p_min=1.0), "p_min must be in [0, 1), got 1.0"),
    (dict(gate="G1", n_embd=2, n_head=1),
     "G1's hidden width n_embd // 4 is 0 at n_embd=2: set g1_hidden >= 1 or n_embd >= 4")])
def test_bad_config_is_one_line_error(kw, msg):
    """Each refusal word for word: the message is what a user reads after `error:`."""
    with pytest.raises(common.NanorouteError) as e:
        tiny(**kw)
    assert str(e.value) == msg


def test_recipes_set_the_paper_flags_and_refuse_contradictions():
    assert tiny(recipe="A1").lam_jepa == 0.0 and tiny(recipe="A1").gate == "G3"
    a3 = tiny(recipe="A3-G1")
    assert (a3.gate, a3.lam_util, a3.lam_rank, a3.lam_jepa) == ("G1", 0.0, 0.0, 1.0)
    assert tiny(recipe="A2").shuffle_targets and tiny(recipe="A4-0.25").lam_jepa == 0.25
    assert tiny(recipe="A1", lam_jepa=0.0).lam_jepa == 0.0  # agreeing is fine
    with pytest.raises(common.NanorouteError,
                       match="recipe A1 sets lam_jepa=0.0; lam_jepa=0.5 contradicts it"):
        tiny(recipe="A1", lam_jepa=0.5)  # used to give 0 silently
    with pytest.raises(common.NanorouteError):
        tiny(recipe="A3-G3", gate="G1")
    # a flag that repeats the standard recipe's value contradicts a recipe too (it used to pass as
    # a default)
    with pytest.raises(common.NanorouteError,
                       match="recipe A3-G1 sets gate=G1; gate=G3 contradicts it"):
        tiny(recipe="A3-G1", gate="G3")
    with pytest.raises(common.NanorouteError, match="recipe A1 sets lam_jepa=0.0; lam_jepa=1.0"):
        tiny(recipe="A1", lam_jepa=1.0)
    with pytest.raises(common.NanorouteError, match="recipe G1 sets shuffle_targets=False"):
        tiny(recipe="G1", shuffle_targets=True)
    std = tiny()  # no recipe: the standard one, each field given on its own
    assert (std.gate, std.lam_jepa, std.lam_util, std.lam_rank, std.shuffle_targets) == (
        "G3", 1.0, 1.0, 0.2, False)
    assert (tiny(gate="G1", lam_util=0.5).gate, tiny(lam_util=0.5).lam_util) == ("G1", 0.5)
    saved = tiny(recipe="A3-G1")  # a saved config (its fields resolved) loads again as it was
    assert cd.Config(**vars(saved)) == saved
    assert tiny(rho=1.0).rho == 1.0


def test_sparse_forward_in_training_is_refused():
    m = make().train()
    with pytest.raises(common.NanorouteError) as e:
        m(torch.zeros(1, 4, dtype=torch.long), sparse=True)
    assert str(e.value) == "sparse=True is an inference path: call model.eval() first"


def test_classroom_preset_trains_jointly_from_scratch():
    cfg = cd.Config(**cd.PRESETS["classroom"])
    assert (not cfg.controller_only and cfg.lam_util == cfg.lam_rank == 0
            and cfg.n_controlled < cfg.n_layer)
    assert all(getattr(cfg, k) == v for k, v in common.CLASSROOM.items())


def test_controller_only_needs_a_trained_start():
    """From scratch (no init_from) a frozen random backbone would only hold the routers back (loss
    4.16 where the GPT reaches 3.24): the default trains everything;
    with init_from the backbone is frozen."""
    assert not tiny().controller_only and not tiny(controller_only=True).controller_only
    assert (tiny(init_from="ckpt.pt").controller_only
            and not tiny(init_from="x", controller_only=False).controller_only)
    m = make()
    assert all(p.requires_grad for n, p in m.named_parameters() if ".target." not in n)


def test_cli_help_and_one_line_errors(capsys):
    import subprocess
    import sys
    for flag in ("-h", "--help"):
        cd.main([flag])
        out = capsys.readouterr().out
        assert "usage: python conddepth.py" in out and "train.py" in out
    for bad in (["foo"], ["--preset=paper"], ["-h", "x"]):
        with pytest.raises(common.NanorouteError) as e:
            cd.main(bad)
        assert str(e.value) == "conddepth.py takes no arguments, got " + " ".join(bad)
    cd.main([])  # §4's proxies at paper size, the whole table (paper: G1 0.547, G3 0.553)
    assert capsys.readouterr().out.splitlines() == [
        "recipe   FFN units: inference, training",
        "G1       0.547, 3.656", "G3       0.553, 3.686", "A1       0.553, 3.686",
        "A2       0.553, 3.686", "A3-G1    0.547, 1.063", "A3-G3    0.553, 1.093",
        "A4-0.25  0.553, 3.686", "A4-2     0.553, 3.686"]
    r = subprocess.run([sys.executable, cd.__file__, "--preset=paper"], capture_output=True,
                       text=True)
    assert (r.returncode == 2 and r.stdout == "" and r.stderr.startswith("error: ")
            and r.stderr.count("\n") == 1)


# ---- the model contract on every device × dtype --------------------------------------------------

@pytest.mark.parametrize("gate", ["G1", "G3"])
@pytest.mark.parametrize("mode", ["causal", "topk"])
@pytest.mark.parametrize("bias", [False, True])
def test_sparse_equals_dense_hard(dev, gate, mode, bias):
    m = calibrated(make(torch.float32, gate=gate, mode=mode, bias=bias)).to(dev.device).eval()
    x, y = data(B=6, device=dev.device)
    with torch.no_grad(), dev.autocast():
        dense, _, st = m(x, y)
        dense_masks = m.last_masks
        sparse, _, st_sparse = m(x, y, sparse=True)
    rows = agree(dense_masks, m.last_masks)
    assert rows.float().mean() >= (0.8 if dev.low else 1.0) and rows.any()
    atol, rtol = dev.tol()
    torch.testing.assert_close(sparse[rows].float(), dense[rows].float(), atol=atol, rtol=rtol)
    counts = [mk.sum(-1) for mk in dense_masks]
    # rows route different numbers of tokens: the unequal case really is exercised
    if mode == "causal":
        assert (any(len(set(c.tolist())) > 1 for c in counts)
                and all(0 < c.sum() < x.numel() for c in counts))
    assert abs(st["lm_loss"] - st_sparse["lm_loss"]) < (0.05 if dev.low else 1e-5)
    # routing matters: all-full gives other logits, so the comparison is not vacuous
    m.thresholds.fill_(-math.inf)
    m.mode = "causal"
    with torch.no_grad(), dev.autocast():
        assert not torch.allclose(m(x)[0].float(), dense.float(), atol=atol)


def test_each_forward_runs_the_ffns_on_the_rows_it_says():
    """sparse=True really skips the work: layer j's full FFN sees only its full tokens, the cheap
    FFN the rest. Eval with targets runs the routed pass densely, then the top-k pass for
    soft_loss (dense too; mode="topk" reuses the routed pass), T of eq. (14) in the routed pass
    only. The sparse path, and only it, runs with dynamo's capture_scalar_outputs (its counts
    compile as symbols; the dense forward must not enter that wrapper, one graph)."""
    m = calibrated(make(gate="G3")).eval()
    x, y = data(B=2)
    N, C = x.numel(), m.cfg.n_controlled
    seen = []
    for j, block in enumerate(m.blocks[-C:]):
        for name, mod in (("full", block.mlp), ("cheap", m.cheap[j]), ("T", m.gates[j].target)):
            mod.register_forward_hook(lambda mod, inp, out, key=(name, j): seen.append(
                (key, inp[0].shape[:-1].numel(), torch._dynamo.config.capture_scalar_outputs)))

    def run(*args, **kw):
        seen.clear()
        with torch.no_grad():
            m(*args, **kw)
        return sorted(seen)
    with torch.no_grad():
        m(x)
    n_full = [mk.sum().item() for mk in m.last_masks]
    assert all(0 < n < N for n in n_full)
    want = [((f, j), n, True) for j in range(C) for f, n in (("cheap", N - n_full[j]),
                                                              ("full", n_full[j]))]
    assert run(x, sparse=True) == sorted(want)
    dense = [((f, j), N, False) for j in range(C) for f in ("cheap", "full")]
    jepa = [(("T", j), 2 * N, False) for j in range(C)]  # z of h_full and h_cheap, one call
    assert run(x) == sorted(dense)
    assert run(x, y) == sorted(dense * 2 + jepa)  # the routed pass, then the top-k pass
    m.mode = "topk"
    assert run(x, y) == sorted(dense + jepa)


def test_eval_is_causal_training_topk_is_not(dev):
    m = calibrated(make(torch.float32)).to(dev.device).eval()
    x, _ = data(B=4, device=dev.device)
    x2 = x.clone()
    x2[:, 16:] = (x2[:, 16:] + 7) % V  # change only the future half
    atol, rtol = dev.tol()
    with torch.no_grad(), dev.autocast():
        for sparse in (False, True):  # what inference runs: earlier positions never see the future
            a, b = m(x, sparse=sparse)[0].float(), m(x2, sparse=sparse)[0].float()
            torch.testing.assert_close(a[:, :16], b[:, :16], atol=atol / 10, rtol=rtol / 10)
            assert not torch.allclose(a[:, 16:], b[:, 16:], atol=atol)
        # honest: training's exact top-k over the sequence lets future tokens move earlier outputs
        m.train()
        assert not torch.allclose(m(x)[0][:, :16].float(), m(x2)[0][:, :16].float(), atol=atol)
        m.mode = "topk"  # and so does the paper's top-k evaluation
        m.eval()
        assert not torch.allclose(m(x)[0][:, :16].float(), m(x2)[0][:, :16].float(), atol=atol)


@pytest.mark.parametrize("bias", [False, True])
def test_prefill_and_step_equal_the_full_forward(dev, bias):
    m = calibrated(make(torch.float32, gate="G3", block_size=16, bias=bias)).to(dev.device).eval()
    x, _ = data(B=4, T=16, device=dev.device)
    with dev.autocast():
        steps, full = decoded_vs_full(m, x, 5)
    atol, rtol = dev.tol()
    close = torch.isclose(steps, full, atol=atol, rtol=rtol).all(-1)  # (B, 12) positions that match
    assert close.float().mean() >= (0.9 if dev.low else 1.0) and close[:, 0].all()
    assert 0 < torch.stack(m.last_masks).float().mean() < 1  # both paths were really taken


@pytest.mark.parametrize("bias", [False, True])
def test_batch_one_decoding_takes_one_path_per_layer(dev, bias):
    """B = 1: the whole batch is one token, so each controlled layer runs the full FFN alone or the
    cheap alone (the host decides which); both must equal the full forward."""
    m = calibrated(make(torch.float32, gate="G3", block_size=16, bias=bias)).to(dev.device).eval()
    x, _ = data(B=1, T=16, seed=3, device=dev.device)
    with dev.autocast():
        steps, full = decoded_vs_full(m, x, 2)
    atol, rtol = dev.tol()
    close = torch.isclose(steps, full, atol=atol, rtol=rtol).all(-1)  # (1, 15)
    assert close.float().mean() >= (0.9 if dev.low else 1.0) and close[:, 0].all()
    decided = torch.stack(m.last_masks)[:, 0, 1:]  # (C, 15) decisions of the decoded tokens
    assert decided.any(1).all() and (~decided).any(1).all()  # every layer ran each path alone


def test_cached_generate_equals_cache_free_past_block_size(dev):
    m = calibrated(make(torch.float32, block_size=8)).to(dev.device)
    with torch.no_grad():
        for p in m.parameters():  # sharp logits, so a wrong cache entry changes the greedy tokens
            p.mul_(4)
    calibrated(m)
    prompt = data(B=2, T=3, device=dev.device)[0]
    with dev.autocast():
        a = m.generate(prompt, 30, temperature=0)
        b = m.generate(prompt, 30, temperature=0, use_cache=False)
    assert a.shape == (2, 33)
    if dev.low:
        assert torch.equal(a[:, :12], b[:, :12]) and (a == b).float().mean() > 0.9
    else:
        assert torch.equal(a, b)
    assert m.decodes_cached() is True and m.decodes_cached(use_cache=False) is False
    m.mode = "topk"  # no causal cache for top-k: generate falls back to recomputing the window
    assert m.decodes_cached() is False
    assert m.generate(prompt, 3, temperature=0).shape == (2, 6)
    with pytest.raises(common.NanorouteError, match="cached decoding routes causally"):
        m.prefill(prompt)


def test_residual_stream_stays_fp32_in_every_path(dev):
    """Numerics policy: under autocast every delta is cast to the fp32 residual
    where it is added."""
    m = calibrated(make(torch.float32, block_size=16)).to(dev.device)
    seen = []
    for mod in (*[b.ln_1 for b in m.blocks], *[b.ln_2 for b in m.blocks], m.ln_f):
        mod.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    x, y = data(B=4, T=16, device=dev.device)
    with dev.autocast():
        m.train()(x, y)
        with torch.no_grad():
            m.eval()(x, y), m(x, sparse=True)
            m.step(x[:, 8:9], m.prefill(x[:, :8])[1])
            m.step(x[:1, 8:9], m.prefill(x[:1, :8])[1])  # B = 1: one path for the whole batch
    assert set(seen) == {torch.float32}


@pytest.mark.parametrize("gate", ["G1", "G3"])
def test_training_step_is_finite_and_reaches_the_routers(dev, gate):
    m = make(torch.float32, gate=gate, label_start=0, label_every=1).to(dev.device).train()
    m.on_step(0)
    x, y = data(device=dev.device)
    with dev.autocast():
        _, loss, stats = m(x, y)
    loss.backward()
    assert torch.isfinite(loss) and stats["label_step"] == 1
    for mod in (*m.gates, *m.cheap):
        grads = [p.grad for p in mod.parameters() if p.requires_grad]
        assert (all(g is not None and torch.isfinite(g).all() for g in grads)
                and sum(g.abs().sum() for g in grads) > 0)
    assert torch.isfinite(m.thresholds).all()


# ---- routing: top-k in training, causal thresholds θ at inference --------------------------------

@pytest.mark.parametrize("rho,T,k", [(0.3, 10, 3), (0.5, 32, 16), (0.25, 13, 4), (1.0, 7, 7),
                                     (0.01, 20, 1)])
def test_training_routes_exact_topk_whatever_the_thresholds(rho, T, k):
    assert cd.budget_k(rho, T) == k == math.ceil(round(rho * T, 9))
    m = make(rho=rho).train()
    m.thresholds.fill_(math.inf)  # causal routing would send every token cheap
    x, y = data(T=T)
    (_, _, stats), scores = scored(m, x, y)
    for mask, u in zip(m.last_masks, scores):
        assert mask.sum(-1).tolist() == [k] * x.size(0)  # exactly k full tokens in every sequence
        assert (u.masked_fill(~mask, -1e9).topk(k, -1).values == u.topk(k, -1).values).all()
    assert abs(stats["full_ratio"].item() - k / T) < 1e-6


def test_topk_at_ties_keeps_exactly_k():
    """Eq. (7): exactly k = ⌈ρT⌉ tokens run full, also when scores tie at the cut (a rule 'u >= the
    k-th score' would run every tied token full)."""
    u = torch.tensor([[0.0] * 8, [3.0, 1.0, 1.0, 1.0, 1.0, -2.0, 5.0, 1.0]])
    m = cd.topk_mask(u, cd.budget_k(0.5, 8))
    assert m.sum(-1).tolist() == [4, 4]
    # 2 of the 5 tied at the cut
    assert m[1, 0] and m[1, 6] and not m[1, 5] and m[1, [1, 2, 3, 4, 7]].sum() == 2


@pytest.mark.parametrize("gate", ["G1", "G3"])
def test_inference_rule_is_strict_at_the_threshold(gate):
    """Inference: full iff u > θ_l (strict): a token whose score equals θ_l exactly takes the cheap
    FFN, in the dense-hard forward, the sparse forward
    and the decode step (B = 1 and B = 2) alike."""
    m = make(gate=gate, block_size=16).eval()
    x = data(B=2, T=16, seed=5)[0]
    u = scored(m, x)[1]
    t = 9
    with torch.no_grad():
        # layer 1's θ = token (0, t)'s score
        m.thresholds.copy_(torch.stack([u[0][0, t], u[1].median()]))
        # layer 2's scores follow layer 1's routing
        u = scored(m, x)[1]
        m.thresholds[1] = u[1][0, t]
        dense = m(x)[0]
        masks = m.last_masks
        assert not masks[0][0, t] and not masks[1][0, t]            # u == θ: cheap
        assert all(torch.equal(mk, uj > th) for mk, uj, th in zip(masks, u, m.thresholds))
        assert 0 < torch.stack(masks).float().mean() < 1
        torch.testing.assert_close(m(x, sparse=True)[0], dense, atol=1e-12, rtol=0)
        for B in (1, 2):
            _, state = m.prefill(x[:B, :t])
            torch.testing.assert_close(m.step(x[:B, t:t + 1], state)[0], dense[:B, t], atol=1e-12,
                                       rtol=0)
        m.thresholds.copy_(torch.stack([uj[0, t] for uj in u]).nextafter(torch.tensor(-math.inf)))
        assert not torch.allclose(m(x)[0][0, t], dense[0, t])  # one ulp below θ: full, other logits


@pytest.mark.parametrize("gate", ["G1", "G3"])
def test_flops_saved_at_known_shares(gate):
    """FLOPs per token (inference) at shares set exactly, B = 3: layer 1 all full, layer 2 all
    cheap; then the top-k's ρ = 0.25 on both. Golden numbers from the tiny sizes (d 32, d_ff 128,
    r 4, G1 hidden 8; G3: W_c 32→16, P (16+4)→8→8 twice, D 24→8→1)."""
    m = make(gate=gate).eval()
    cfg, x, y = m.cfg, *data(B=3)
    ffn, cheap, ctrl = 2 * 2 * 32 * 128, 2 * 2 * 32 * 4, {"G1": 2 * (32 * 8 + 8), "G3": 2320}[gate]
    assert cd.controller_flops(cfg, False) == ctrl
    dense = common.dense_flops_per_token(cfg, 32)
    m.thresholds.copy_(torch.tensor([-math.inf, math.inf]))
    st = m(x, y)[2]
    assert (st["skip_l1"], st["skip_l2"], st["full_ratio"]) == (0, 1, 0.5)
    assert abs(st["flops_saved_hard"] - (ffn - cheap - 2 * ctrl) / dense) < 1e-6
    m.mode = "topk"
    cfg.rho = 0.25
    st = m(x, y)[2]
    assert (abs(st["full_ratio"] - 0.25) < 1e-9
            and [mk.sum().item() for mk in m.last_masks] == [24, 24])
    assert abs(st["flops_saved_hard"] - 2 * (0.75 * (ffn - cheap) - ctrl) / dense) < 1e-6
    m.mode, cfg.rho = "causal", 0.5
    # causal θ: rows route different numbers of tokens; the share is over all B·T
    with torch.no_grad():
        for j in range(2):
            # row 0's median: row 0 half full, others not
            m.thresholds[j] = scored(m, x)[1][j][0].median()
        st = m(x, y)[2]
    full = [mk.double().mean().item() for mk in m.last_masks]
    assert any(abs(mk[0].double().mean().item() - f) > 0.05 for mk, f in zip(m.last_masks, full))
    saved = sum((1 - f) * (ffn - cheap) - ctrl for f in full)
    assert (abs(st["full_ratio"] - sum(full) / 2) < 1e-6
            and abs(st["flops_saved_hard"] - saved / dense) < 1e-6)


def test_thresholds_are_a_running_average_of_the_topk_cut():
    m = make(rho=0.25)
    # untrained: every token cheap
    assert torch.isinf(m.thresholds).all() and (m.thresholds > 0).all()
    m.eval()
    assert m(*data())[2]["skipped"] == 1.0
    assert (make(rho=1.0).thresholds == -math.inf).all()  # ρ = 1: every token full
    m.train()
    cuts = []
    for s in range(25):
        v = torch.stack(scored(m, data(B=2, seed=s)[0])[1]).flatten(1).sort(
            -1, descending=True).values  # (C, B·T)
        kb = 2 * cd.budget_k(0.25, 32)
        # between the last full and the first cheap score
        cuts.append((v[:, kb - 1] + v[:, kb]) / 2)
        if s == 2:
            # a cumulative mean ...
            assert torch.allclose(m.thresholds, torch.stack(cuts).mean(0), rtol=1e-12, atol=0)
    ema = torch.stack(cuts[:20]).mean(0)
    for c in cuts[20:]:
        ema = ema + cd.THRESHOLD_EMA * (c - ema)  # ... then a running average
    assert torch.allclose(m.thresholds, ema, rtol=1e-12, atol=0)
    x, before = data(B=8, seed=99)[0], m.thresholds.clone()
    m.eval()
    m.mode = "topk"
    m(x)
    m.mode = "causal"
    scores = scored(m, x)[1]  # eval routes by u > θ, and eval never moves θ, whatever the mode
    assert torch.equal(m.thresholds, before)
    assert all(torch.equal(mk, u > t) for mk, u, t in zip(m.last_masks, scores, m.thresholds))
    # held-out tokens: near the budget
    assert abs(torch.stack(m.last_masks).float().mean() - 0.25) < 0.1
    fresh = make(rho=0.25)
    fresh.load_state_dict(m.state_dict())  # θ travels in the checkpoint
    assert torch.equal(fresh.eval()(x)[0], m(x)[0])


def test_eval_reports_causal_hard_loss_and_the_topk_soft_loss():
    m = calibrated(make(gate="G3"))
    x, y = data(B=4)
    lm_train = m.train()(x, y)[2]["lm_loss"]  # the training computation (no labels, no dropout)
    calibrated(m)
    m.eval()
    logits, loss, st = m(x, y)
    assert abs(st["soft_loss"] - lm_train) < 1e-9  # soft = top-k, what training optimises
    # hard = causal
    assert abs(st["lm_loss"] - F.cross_entropy(logits.flatten(0, 1), y.flatten())) < 1e-6
    assert abs(st["lm_loss"] - st["soft_loss"]) > 1e-4  # they are different computations here
    full = torch.stack([mk.double().mean() for mk in m.last_masks])
    L, C = m.cfg.n_layer, m.cfg.n_controlled
    assert [f"skip_l{i}" for i in range(L - C, L)] == [k for k in st if k.startswith("skip_l")]
    assert torch.allclose(torch.stack([st[f"skip_l{i}"] for i in range(L - C, L)]).double(),
                          1 - full)
    dense = common.dense_flops_per_token(m.cfg, 32)
    ffn, chp = common.flops_ffn(32, 128), common.flops_ffn(32, 4)
    ours = dense + sum(f * ffn + (1 - f) * chp + cd.controller_flops(m.cfg, False) - ffn
                       for f in full.tolist())
    assert abs(st["flops_saved_hard"] - (1 - ours / dense)) < 1e-6
    m.mode = "topk"
    st = m(x, y)[2]
    assert abs(st["lm_loss"] - lm_train) < 1e-9 and st["soft_loss"] == st["lm_loss"]


def test_routing_map():
    m = calibrated(make(torch.float32))
    x = data(B=1)[0]
    mp, rows, legend = m.routing_map(x)
    assert (mp.shape == (2, 32) and rows == ["layer 1", "layer 2"]
            and legend == ("cheap FFN", "full FFN"))
    assert set(mp.unique().tolist()) == {0.0, 1.0} and m.training  # hard decisions; mode restored
    m.eval()
    m(x)
    assert torch.equal(mp, torch.stack(m.last_masks)[:, 0].float())  # what inference runs


def test_controller_decides_in_fp32_under_autocast():
    """Numerics policy: the score, hence the decision, depends on a only,
    not on the autocast dtype."""
    for gate in ("G1", "G3"):
        m = make(torch.float32, gate=gate)
        a = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(0))
        ref = m.controller(1, a)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            u = m.controller(1, a)[0]
        assert u.dtype == torch.float32 and torch.equal(u, ref)


def test_init_spreads_the_scores_and_the_actions():
    """At step 0 the top-k must be decided by the features, not by rounding
    (GPT's 0.02 init gave var(u) 1e-12)."""
    for gate in ("G1", "G3"):
        m = make(torch.float32, gate=gate, randomize_cheap=False)
        # a residual stream of unit scale
        a = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(0))
        for j in range(2):
            u = m.controller(j, a)[0]
            assert u.std() > 1e-3 and u.std() > 1e-2 * u.mean().abs(), (gate, u.std(), u.mean())
        if gate == "G3":
            # q_full ≠ q_cheap
            assert all((g.e[0] - g.e[1]).norm() > 1 and g.e.std() > 0.5 for g in m.gates)


# ---- the paper's equations, against the reference replay -----------------------------------------

@pytest.mark.parametrize("gate", ["G1", "G3"])
def test_gate_reads_the_post_attention_state_and_the_head_its_three_inputs(gate):
    m = make(gate=gate).train()
    x, _ = data()
    for ref, u in zip(replay(m, x), scored(m, x)[1]):
        assert torch.allclose(u, ref["u"].float() if u.dtype == torch.float32 else ref["u"],
                              atol=1e-10)


def test_jepa_pairs_q_with_its_own_action_and_averages_layers():
    m = make(gate="G3").train()
    x, y = data()
    st = m(x, y)[2]
    ref = replay(m, x)
    per_layer = []
    for r, g in zip(ref, m.gates):
        zf, zc = g.target(r["h_full"]), g.target(r["h_cheap"])
        per_layer.append((2 - F.cosine_similarity(r["qf"], zf, -1)
                          - F.cosine_similarity(r["qc"], zc, -1)).mean())
    assert abs(st["jepa"] - torch.stack(per_layer).mean()) < 1e-10  # eq. (14), then 1/C Σ_l
    swapped = torch.stack([(2 - F.cosine_similarity(r["qf"], g.target(r["h_cheap"]), -1)
                            - F.cosine_similarity(r["qc"], g.target(r["h_full"]), -1)).mean()
                           for r, g in zip(ref, m.gates)])
    assert abs(swapped.mean() - st["jepa"]) > 1e-3  # the check can tell the pairing apart


def test_budget_and_alive_are_per_layer():
    m = make(gate="G1", rho=0.5, p_min=0.3)
    with torch.no_grad():
        m.gates[0].w2.bias.fill_(8.0)   # layer 1: p ≈ 0.98
        m.gates[1].w2.bias.fill_(-8.0)  # layer 2: p ≈ 0.02 (layer-mean ≈ ρ: a pooled p̄ would see
                                        # no violation)
    x, y = data()
    st = m.train()(x, y)[2]
    p_bar = torch.stack([r["p"].mean() for r in replay(m, x)])
    # eq. (20)
    assert abs(st["budget"] - ((p_bar - 0.5) ** 2).mean()) < 1e-10 and st["budget"] > 0.15
    # eq. (21)
    assert abs(st["alive"] - F.relu(0.3 - p_bar).mean()) < 1e-10 and st["alive"] > 0.1


def test_loss_is_eq_19_with_each_lambda_on_its_own_term():
    lams = dict(lam_jepa=0.3, lam_util=0.7, lam_rank=0.11, lam_b=1.9, lam_a=2.3)
    m = make(gate="G3", p_min=0.6, label_start=0, label_every=1, **lams).train()
    m.on_step(0)
    x, y = data()
    torch.manual_seed(5)
    _, loss, st = m(x, y)
    ref = replay(m, x)
    u_star = cd.oracle_labels(m, prefix(m, x), y)
    # eq. (17)
    util = torch.stack([F.huber_loss(r["u"], us) for r, us in zip(ref, u_star)]).mean()
    torch.manual_seed(5)
    # eq. (18), same pairs
    rank = torch.stack([cd.rank_loss(r["u"], us) for r, us in zip(ref, u_star)]).mean()
    assert abs(st["util"] - util) < 1e-9 and abs(st["rank"] - rank) < 1e-9 and st["alive"] > 0
    expect = (st["lm_loss"] + 0.3 * st["jepa"] + 0.7 * util + 0.11 * rank + 1.9 * st["budget"]
              + 2.3 * st["alive"])
    assert abs(loss - expect) < 1e-9


def test_jepa_gradient_stays_in_the_controller():
    """sg(h) in eq. (11) and sg(T(h*)) in eq. (14): L_JEPA trains W_c, e, P only, never the backbone
    or the cheap path, even when the backbone is trainable."""
    grads = []
    for lam in (0.0, 5.0):
        m = make(gate="G3", controller_only=False, lam_jepa=lam, lam_b=0.0, lam_a=0.0).train()
        x, y = data()
        m(x, y)[1].backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    for name, g in grads[0].items():
        same = torch.allclose(g, grads[1][name], atol=1e-12)
        assert same != any(s in name for s in (".w_c.", ".e", ".pred.")), name


def test_util_and_rank_losses_train_the_gate():
    """Eqs. (17), (18) regress the gate's score u on the labels: each sends its own gradient to
    the gate (a u.detach() in either would leave the gate's gradient the LM's alone)."""
    grads = {}
    for lu, lr in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0)):
        m = make(gate="G1", lam_util=lu, lam_rank=lr, lam_b=0.0, lam_a=0.0, label_start=0,
                 label_every=1).train()
        m.on_step(0)
        torch.manual_seed(5)  # the same rank pairs
        m(*data())[1].backward()
        grads[lu, lr] = torch.cat([p.grad.flatten() for p in m.gates.parameters()])
    base = grads[0.0, 0.0]
    assert (grads[1.0, 0.0] - base).abs().max() > 1e-6  # L_util's own gradient
    assert (grads[0.0, 1.0] - base).abs().max() > 1e-6  # L_rank's


def test_jepa_target_is_a_fixed_orthogonal_projection():
    """Eq. (14): T is fixed (no gradient, no optimiser state) and orthogonal: T Tᵀ = I (d_s ≤ d)."""
    m = make(gate="G3")
    for g in m.gates:
        W = g.target.weight  # (d_s, d)
        assert not W.requires_grad
        assert torch.allclose(W @ W.T, torch.eye(8, dtype=W.dtype), atol=1e-6)  # fp32 init


def test_straight_through_gradient_is_eq_8():
    """Forward = hard top-k; dL/du = <dL/dh, h_full − h_cheap> · σ'(u/τ)/τ
    from the LM loss alone."""
    m = make(gate="G1", lam_jepa=0.0, lam_util=0.0, lam_rank=0.0, lam_b=0.0, lam_a=0.0).train()
    x, y = data()
    ref = replay(m, x)
    # the last layer's score, fed through eq. (8) by hand
    u = ref[-1]["u"].detach().requires_grad_(True)
    p = torch.sigmoid(u / m.cfg.tau)
    m_st = ((ref[-1]["m"].double() - p).detach() + p)[..., None]
    h = m_st * ref[-1]["h_full"].detach() + (1 - m_st) * ref[-1]["h_cheap"].detach()
    _, lm = m.head(h, y)
    lm.backward()
    hh = h.detach().requires_grad_(True)
    (g_h,) = torch.autograd.grad(m.head(hh, y)[1], hh)
    expect = (g_h * (ref[-1]["h_full"] - ref[-1]["h_cheap"])).sum(-1) * p * (1 - p) / m.cfg.tau
    assert torch.allclose(u.grad, expect.detach(), atol=1e-12)
    # and the model's own backward sends exactly this to the last gate's output bias
    _, loss, _ = m(x, y)
    assert abs(loss - lm) < 1e-12  # the same forward value as the hand-made eq. (9)
    loss.backward()
    assert torch.allclose(m.gates[-1].w2.bias.grad, u.grad.sum().reshape(1), atol=1e-10)


def test_cheap_path_starts_as_identity_and_rho1_is_the_dense_gpt():
    m = make(randomize_cheap=False).eval()
    assert all((f.down.weight == 0).all() and (f.down.bias == 0).all() for f in m.cheap)
    x, y = data()
    logits, _, stats = m(x, y)  # untrained θ = +∞: every token cheap
    assert stats["full_ratio"].item() == 0.0
    h = m.embed(x)
    for i, block in enumerate(m.blocks):
        h = h + block.attn_delta(h)
        if i < m.cfg.n_layer - m.cfg.n_controlled:
            h = h + block.ffn_delta(h)  # the FFN of controlled layers is skipped
    assert torch.allclose(logits, m.head(h)[0], atol=1e-12)
    m1 = make(randomize_cheap=False, rho=1.0).eval()
    dense = common.Model(tiny()).to(torch.float64)
    dense.load_state_dict(m1.state_dict(), strict=False)
    assert torch.allclose(m1(x)[0], dense.eval()(x)[0], atol=1e-12)


# ---- the oracle (eqs. 15–16): the paper's per-token fork, independent of the gate policy ---------

def forced_ce(m, x, y, cheap_at):
    """Per-token CE of the model with every controlled FFN full,
    except cheap_at {layer j: (B, T) bool}."""
    h, L, C = m.embed(x), m.cfg.n_layer, m.cfg.n_controlled
    for i, block in enumerate(m.blocks):
        a = h + block.attn_delta(h)
        j = i - (L - C)
        h = a + block.ffn_delta(a)
        if j in cheap_at:
            h = torch.where(cheap_at[j][..., None], a + m.cheap[j](a), h)
    logits = m.head(h)[0]
    return torch.stack([torch.stack([F.cross_entropy(logits[b, t], y[b, t]) if y[b, t] >= 0
                                     else logits.new_zeros(()) for t in range(y.size(1))])
                        for b in range(y.size(0))])


def window(ce, W, g):
    T = ce.size(1)
    return torch.stack([sum(g ** d * ce[:, t + d] for d in range(W) if t + d < T)
                        for t in range(T)], 1)


def test_oracle_labels_are_the_papers_per_token_fork():
    """eq. (15): token t alone forked at layer j (everything else full, the dense prefix),
    windowed CE (eq. 16)."""
    m = make(n_layer=4, n_controlled=3, oracle_window=3, oracle_gamma=0.5)
    x, y = data(B=2, T=12)
    y[0, 5] = -1  # ignored targets contribute 0
    with torch.no_grad():
        labels = cd.oracle_labels(m, prefix(m, x), y)
        dense = window(forced_ce(m, x, y, {}), 3, 0.5)
        for j in range(3):
            expect = torch.zeros_like(dense)
            for t in range(12):
                only_t = torch.zeros_like(y, dtype=torch.bool)
                only_t[:, t] = True
                expect[:, t] = (window(forced_ce(m, x, y, {j: only_t}), 3, 0.5) - dense)[:, t]
            assert torch.allclose(labels[j], expect, atol=1e-10), j
            # not the cheaper all-tokens-at-once fork (the audit's 0.87-correlated labels)
            every = window(forced_ce(m, x, y, {j: torch.ones_like(y, dtype=torch.bool)}),
                           3, 0.5) - dense
            assert not torch.allclose(labels[j], every, atol=1e-4)
    assert labels[0].abs().min() > 0  # the later layers really carry the fork's effect


def test_oracle_is_independent_of_the_gate_policy():
    m = make(n_layer=4, n_controlled=3, oracle_window=4)
    x, y = data(B=2, T=16)
    h = prefix(m, x)
    a = cd.oracle_labels(m, h, y)
    with torch.no_grad():
        for g in m.gates:  # a different policy: other scores, another order
            g.head[2].weight.normal_(0, 5.0)
    m.train()(x, y)
    assert all(torch.equal(p, q) for p, q in zip(a, cd.oracle_labels(m, h, y)))


def test_labels_only_on_label_steps_and_training_uses_them():
    m = make(label_start=100, label_every=5)
    x, y = data()
    m.train()
    assert m(x, y)[2]["label_step"].item() == 0  # a new model: no labels before on_step says so
    for it, want in ((0, 0), (99, 0), (100, 1), (101, 0), (105, 1)):
        m.on_step(it)
        assert m(x, y)[2]["label_step"].item() == want
    m3 = make(recipe="A3-G3", label_start=0)
    m3.train().on_step(0)
    assert m3(x, y)[2]["label_step"].item() == 0  # A3: never computes labels
    m.eval()  # eval on a label step: no labels, no util/rank in its loss
    st = m(x, y)[2]
    assert m.label_now and st["label_step"].item() == 0 and st["util"] == st["rank"] == 0


def test_window_looks_forward_with_decay():
    """eq. (16) as window() computes it, the reference the oracle's labels are checked against: a CE
    change at position t0 only moves labels at t0−W+1 … t0, by γ^(t0−t)."""
    T, W, g, t0 = 20, 4, 0.5, 10
    ce = torch.zeros(1, T)
    ce[0, t0] = 1.0
    u = window(ce, W, g)
    expect = torch.zeros(1, T)
    for t in range(t0 - W + 1, t0 + 1):
        expect[0, t] = g ** (t0 - t)
    assert torch.equal(u, expect)


def test_rank_loss_direction_and_ties():
    u_star = torch.arange(10.0)[None]
    torch.manual_seed(0)
    assert cd.rank_loss(u_star * 3, u_star) < math.log(2) < cd.rank_loss(-u_star * 3, u_star)
    u = torch.randn(2, 8)
    assert cd.rank_loss(u, torch.zeros(2, 8)) == 0  # every pair tied: no pair counts
    u_star = torch.tensor([[0.0, 0, 1, 1, 2, 2, 3, 3], [5, 5, 5, 5, 1, 1, 1, 1]])
    torch.manual_seed(3)
    got = cd.rank_loss(u, u_star)
    torch.manual_seed(3)
    perm = torch.randperm(8)
    s = torch.sign(u_star - u_star[:, perm])
    keep = s != 0
    assert keep.sum() < keep.numel()  # this permutation does pair some ties
    assert torch.allclose(got, F.softplus(-s * (u - u[:, perm]))[keep].mean())


def test_derangement_and_a2_shuffle():
    for n in (2, 3, 17, 1000):
        p = cd.derangement(n, "cpu")
        assert sorted(p.tolist()) == list(range(n)) and (p != torch.arange(n)).all()
    torch.manual_seed(7)  # the cycle order[0] → order[1] → … of randperm's order: a seed gives
    order = torch.randperm(6).tolist()  # the same A2 targets as before
    torch.manual_seed(7)
    p = cd.derangement(6, "cpu").tolist()
    assert [p[order[i]] for i in range(6)] == order[1:] + order[:1]
    assert cd.derangement(5, "meta").device.type == "meta"  # drawn on the device it is given
    x, y = data()
    base, shuf = make(gate="G3"), make(gate="G3", shuffle_targets=True)
    assert base.train()(x, y)[2]["jepa"] != shuf.train()(x, y)[2]["jepa"]
    assert base.eval()(x, y)[2]["jepa"] == shuf.eval()(x, y)[2]["jepa"]  # eval: never shuffled


# ---- training scope, CLI -------------------------------------------------------------------------

def test_controller_only_freezes_the_backbone():
    m = make(gate="G3", label_start=0, init_from="a dense checkpoint")
    x, y = data()
    m.train().on_step(0)
    m(x, y)[1].backward()
    for name, p in m.named_parameters():
        trainable = name.startswith(("cheap.", "gates.")) and ".target." not in name
        assert p.requires_grad == trainable, name
        assert ((p.grad is not None and p.grad.abs().sum() > 0) if trainable
                else p.grad is None), name
    full = make(controller_only=False)
    full.train()(x, y)[1].backward()
    assert full.blocks[0].mlp.c_fc.weight.grad is not None and full.wte.weight.grad is not None


ARCH = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=2",
        "--eval_iters=1"]


def test_init_from_dense_checkpoint_rho1_reproduces_dense(data_dir, tmp_path):
    gpt_dir, cd_dir = str(tmp_path / "gpt"), str(tmp_path / "cd")
    train.main(["--model", "gpt", f"--data_dir={data_dir}", f"--out_dir={gpt_dir}",
                "--max_iters=3", *ARCH])
    train.main(["--model", "conddepth", f"--data_dir={data_dir}", f"--out_dir={cd_dir}",
                "--max_iters=0", f"--init_from={gpt_dir}/ckpt.pt", "--rho=1.0", "--n_controlled=1"])
    g, c = common.load_checkpoint(f"{gpt_dir}/ckpt.pt"), common.load_checkpoint(f"{cd_dir}/ckpt.pt")
    dense = common.Model(common.Config(**g["config"]))
    dense.load_state_dict(g["model"])
    ours = cd.Model(cd.Config(**c["config"]))
    ours.load_state_dict(c["model"])
    x = torch.randint(0, dense.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    ld, lo = dense.eval()(x)[0], ours.eval()(x)[0]
    assert (torch.allclose(ld, lo, atol=1e-5)
            and torch.allclose(ours(x, sparse=True)[0], ld, atol=1e-5))
    # half the tokens cheap (identity at init): no longer the dense model
    ours.cfg.rho, ours.mode = 0.5, "topk"
    assert not torch.allclose(ours(x)[0], ld, atol=1e-4)


def test_finetune_from_a_dense_start_controller_only_vs_joint(data_dir, tmp_path):
    """Controller-only (the paper's scope) leaves the dense start untouched: routing every token
    full gives the start's logits exactly, so the routed model can only lose what the cheap path
    does not recover. controller_only=false (the fine-tune recipe) trains the backbone too, and
    still the routers."""
    gpt_dir = str(tmp_path / "gpt")
    train.main(["--model", "gpt", f"--data_dir={data_dir}", f"--out_dir={gpt_dir}",
                "--max_iters=3", *ARCH])
    g = common.load_checkpoint(f"{gpt_dir}/ckpt.pt")
    dense = common.Model(common.Config(**g["config"]))
    dense.load_state_dict(g["model"])
    x = torch.randint(0, dense.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    for joint in (False, True):
        out = str(tmp_path / f"cd-joint{joint}")
        train.main(["--model", "conddepth", f"--data_dir={data_dir}", f"--out_dir={out}",
                    f"--init_from={gpt_dir}/ckpt.pt", "--max_iters=4", "--warmup_iters=0",
                    "--learning_rate=1e-3", "--batch_size=2", "--eval_iters=1", "--n_controlled=1",
                    "--recipe=A3-G1", f"--controller_only={str(not joint).lower()}"])
        c = common.load_checkpoint(f"{out}/ckpt.pt")
        m = cd.Model(cd.Config(**c["config"]))
        m.load_state_dict(c["model"])
        moved = [n for n, p in m.named_parameters()
                 if n in g["model"] and not torch.equal(p, g["model"][n])]
        assert bool(moved) == joint and (not joint or "blocks.0.mlp.c_fc.weight" in moved), moved
        # routers trained
        assert m.cheap[0].down.weight.abs().sum() > 0 and torch.isfinite(m.thresholds).all()
        # every token full: the dense start again, unless the backbone moved
        m.eval().thresholds.fill_(-math.inf)
        same = torch.allclose(m(x)[0], dense.eval()(x)[0], atol=1e-5)
        assert same != joint


def test_cli_run_logs_hard_soft_and_resumes_exactly(data_dir, tmp_path, monkeypatch, capsys):
    def run(out, *extra):
        return train.main(["--model", "conddepth", f"--data_dir={data_dir}", f"--out_dir={out}",
                           "--max_iters=8", "--label_start=0", "--label_every=2",
                           "--recipe=G1", "--log_interval=1", *ARCH, "--n_controlled=1",
                           "--eval_interval=4", *extra])
    recs = lambda out: [{k: v for k, v in json.loads(r).items() if k not in train.TIMING}
                        for r in open(out / "metrics.jsonl")]
    assert math.isfinite(run(tmp_path / "a"))
    evals = [r for r in recs(tmp_path / "a") if r["kind"] == "eval"]
    assert {"val_soft_loss", "val_skip_l1", "val_skipped", "val_flops_saved_hard"} <= set(evals[-1])
    assert 0 < evals[-1]["val_skipped"] < 1  # the causal thresholds were learnt during training
    real = common.lr_at
    monkeypatch.setattr(common, "lr_at",
                        lambda it, cfg: (_ for _ in ()).throw(KeyboardInterrupt) if it == 6
                        else real(it, cfg))
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b")
    monkeypatch.setattr(common, "lr_at", real)
    run(tmp_path / "b", "--resume")
    # θ and its batch count are in the checkpoint
    assert recs(tmp_path / "a") == recs(tmp_path / "b")
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "conddepth", f"--data_dir={data_dir}", "--recipe=A1",
                    "--lam_jepa=0.5"])
    assert e.value.code == 2 and "contradicts" in capsys.readouterr().err


# ---- compute proxies -----------------------------------------------------------------------------

def test_compute_proxies_paper_dims():
    P = cd.PRESETS["paper"]
    g1, g3 = cd.Config(**P, recipe="G1"), cd.Config(**P, recipe="G3")
    # the paper's trainable controller counts (§4), exactly
    for cfg, n in ((g1, 828_484), (g3, 849_348)):
        parts = [cd.CheapFFN(cfg), (cd.GateG1 if cfg.gate == "G1" else cd.GateG3)(cfg)]
        assert cfg.n_controlled * sum(p.numel() for m in parts for p in m.parameters()
                                      if p.requires_grad) == n
    ffn, ctrl = 2 * 2 * 640 * 2560, 2 * (640 * 160 + 160)
    for rho in (0.25, 0.5, 0.9):  # eq.: ρ·1 + (1 − ρ)·r/d_ff + ctrl/FFN
        c = cd.Config(**P, recipe="G1", rho=rho)
        assert abs(cd.infer_vs_full(c) - (rho + (1 - rho) * 80 / 2560 + ctrl / ffn)) < 1e-12
        # inference FLOPs at a uniform ρ = the dense model minus C·FFN·(1 − infer_vs_full)
        T, full = 256, [rho] * 4
        assert abs(cd.flops_per_token(c, T, full) - common.dense_flops_per_token(c, T)
                   - 4 * ffn * (cd.infer_vs_full(c) - 1)) < 1e-3 * ffn
    # paper
    assert abs(cd.infer_vs_full(g1) - 0.547) < 0.001 and abs(cd.infer_vs_full(g3) - 0.553) < 0.001
    a3g1, a3g3 = cd.Config(**P, recipe="A3-G1"), cd.Config(**P, recipe="A3-G3")
    assert (abs(cd.compute_vs_full(a3g1) - 1.0625) < 1e-3
            and abs(cd.compute_vs_full(a3g3) - 1.0931) < 1e-3)
    frac = 3980 / 20000  # labels from step 100, every 5, of 20k
    # dense pass + cheap forks + W × C(C−1)/2 later token-layers
    per_token = 4 + 4 * 80 / 2560 + 8 * 6
    assert abs(cd.compute_vs_full(g3) - cd.compute_vs_full(a3g3) - frac * per_token / 4) < 1e-12


# ---- values pinned where a one-line change shows -------------------------------------------------

@pytest.mark.parametrize("kw, name", [
    (dict(oracle_gamma=1.5), "oracle_gamma"), (dict(oracle_gamma=-0.1), "oracle_gamma"),
    (dict(label_every=0), "label_every"), (dict(lam_b=-1.0), "lam_b"), (dict(lam_a=-0.1), "lam_a"),
    (dict(lam_jepa=-0.5), "lam_jepa"), (dict(lam_rank=-0.5), "lam_rank"),
    (dict(n_controlled=0), "n_controlled"), (dict(p_min=-0.1), "p_min"), (dict(tau=-1.0), "tau"),
    (dict(rho=-0.5), "rho"), (dict(gate="G1", n_embd=2, n_head=1), "G1's hidden width")])
def test_every_range_is_refused_by_name(kw, name):
    with pytest.raises(common.NanorouteError, match=name):
        tiny(**kw)


def test_range_edges_build_and_route():
    for ok in (dict(rho=1.0), dict(n_controlled=3), dict(p_min=0.0), dict(oracle_gamma=0.0),
               dict(oracle_gamma=1.0), dict(label_start=0), dict(g1_hidden=0), dict(lam_b=0.0),
               dict(lam_jepa=0.0, lam_util=0.0, lam_rank=0.0, lam_a=0.0)):
        tiny(**ok)
    m = cd.Model(tiny(gate="G1", n_embd=2, n_head=1, g1_hidden=3))  # d // 4 = 0: g1_hidden routes
    assert m.gates[0].w1.out_features == 3
    assert cd.Model(tiny(gate="G1", n_embd=8, n_head=1)).gates[0].w1.out_features == 2
    assert cd.Model(tiny(gate="G1", n_embd=4, n_head=1)).gates[0].w1.out_features == 1  # smallest
    # G1's FLOPs count the hidden width it builds, d // 4 = 7 at d = 30 (not 7.5)
    cfg = tiny(gate="G1", n_embd=30, n_head=2)
    w = [lin.weight.numel() for lin in (cd.GateG1(cfg).w1, cd.GateG1(cfg).w2)]
    assert cd.controller_flops(cfg, False) == 2 * sum(w) == 2 * (30 * 7 + 7)


@pytest.mark.parametrize("max_iters, start, every, want", [
    (10, 3, 4, [3, 7]), (10, 0, 3, [0, 3, 6, 9]), (10, 10, 5, []), (10, 12, 5, []),
    (11, 1, 5, [1, 6]), (10, 9, 100, [9])])
def test_label_steps_at_the_schedule_edges_and_the_compute_proxy_counts_them(max_iters, start,
                                                                             every, want):
    """train.py trains steps 0..max_iters−1: the label steps are start, start + every, … below
    max_iters (a start at 0, past the run, an interval that does not divide the run); §4's
    training proxy counts exactly these."""
    cfg = tiny(max_iters=max_iters, label_start=start, label_every=every)
    m = cd.Model(cfg)
    steps = []
    for it in range(max_iters):
        m.on_step(it)
        steps += [it] * m.label_now
    assert steps == want
    no_labels = cd.compute_vs_full(tiny(max_iters=max_iters, recipe="A3-G3"))
    cheap = cfg.cheap_rank / (4 * cfg.n_embd)
    per_label = (2 + 2 * cheap + cfg.oracle_window * 2 * 1 / 2) / 2  # C = 2
    assert cd.compute_vs_full(cfg) - no_labels == pytest.approx(len(want) / max_iters * per_label,
                                                                abs=1e-12)
    m = cd.Model(tiny(max_iters=max_iters, label_start=start, label_every=every, recipe="A3-G3"))
    m.on_step(start)
    assert not m.label_now  # no oracle loss: no label step


def test_jepa_target_runs_in_fp32_under_bf16_autocast():
    """Eq. (14)'s z = T(h*) in fp32 under autocast (a bf16 T moves the loss by ~1e-3)."""
    torch.manual_seed(0)
    target = torch.nn.Linear(64, 32, bias=False)
    torch.nn.init.orthogonal_(target.weight)
    qf, qc = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    hf, hc = torch.randn(2, 8, 64) * 10, torch.randn(2, 8, 64) * 10
    want = cd.jepa_terms(target, qf, qc, hf, hc, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cd.jepa_terms(target, qf, qc, hf, hc, False)
    assert all(torch.allclose(g, w, atol=1e-6, rtol=0) for g, w in zip(got, want))
    z = hf @ target.weight.T  # eq. (14) by hand, plus the diagnostics
    cos = F.cosine_similarity
    loss = (2 - cos(qf, z, dim=-1) - cos(qc, hc @ target.weight.T, dim=-1)).mean()
    assert want[0].item() == pytest.approx(loss.item(), rel=1e-5)
    assert want[1].item() == pytest.approx((qf - qc).norm(dim=-1).mean().item(), rel=1e-6)
    assert want[2].item() == pytest.approx(cos(qf, qc, dim=-1).mean().item(), rel=1e-6)
    hf, hc = hf.bfloat16(), hc.bfloat16()  # h*_a arriving in bf16: T still runs in q's fp32
    want = cd.jepa_terms(target, qf, qc, hf.float(), hc.float(), False)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = cd.jepa_terms(target, qf, qc, hf, hc, False)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_oracle_ce_is_fp32_from_bf16_logits():
    """Eq. (15)'s labels are differences of per-token CEs: token_ce takes them in fp32 from bf16
    logits too (a bf16 CE rounds at ~1e-2, a label's size); 0 at an ignored target."""
    m = make(torch.bfloat16)
    h = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)).bfloat16() * 3
    y = data(B=2, T=8)[1]
    y[0, 3] = -1
    logits = m.head(h)[0].flatten(0, 1).float()
    want = F.cross_entropy(logits, y.flatten(), ignore_index=-1, reduction="none").view(2, 8)
    got = cd.token_ce(m, h, y)
    assert got.dtype == torch.float32 and torch.equal(got, want) and got[0, 3] == 0


def test_threshold_average_constants():
    """θ's running average: the mean of the first batches (β = 1/(n+1)), then β = 0.05 from the
    21st batch on (THRESHOLD_EMA)."""
    assert cd.THRESHOLD_EMA == 0.05
    m = make().train()
    cuts = []
    hook = lambda mod, inp, out: cuts.append(out[0].detach())  # noqa: E731
    m.gates[0].register_forward_hook(hook)
    theta = None
    for s in range(22):
        cuts.clear()
        with torch.no_grad():
            m(data(B=2, seed=s)[0])
        k = cd.budget_k(m.cfg.rho, 32)
        cut = cuts[0].flatten().topk(2 * k + 1).values[-2:].mean()
        beta = max(1 / (s + 1), 0.05)
        theta = cut if s == 0 else theta + beta * (cut - theta)
        assert m.thresholds[0].item() == pytest.approx(theta.item(), rel=1e-9)


@pytest.mark.parametrize("lam_util, lam_rank, labels", [
    (0.5, 0.0, True), (0.0, 0.5, True), (0.0, 0.0, False), (2.0, 0.0, True)])
def test_either_oracle_loss_alone_asks_for_labels(lam_util, lam_rank, labels):
    m = cd.Model(tiny(lam_util=lam_util, lam_rank=lam_rank, label_start=0, label_every=1))
    m.on_step(3)
    assert m.label_now == labels


def test_eval_stats_by_value_at_T_unequal_d():
    """T = 16, d = 32 (a T read as d changes the FLOPs); every statistic named and valued: the
    FLOPs, skipped = 1 − full_ratio, gate_prob = mean p, util_var the population variance of u."""
    m = calibrated(make(gate="G3", block_size=16)).eval()  # θ from training: some tokens full
    x, y = data(B=2, T=16)
    scores = []
    for g in m.gates:
        g.register_forward_hook(lambda mod, inp, out: scores.append(out[0].detach()))
    st = m(x, y)[2]
    full = torch.stack([mk.double().mean() for mk in m.last_masks])
    assert 0.1 < full.mean() < 0.9
    want = cd.flops_per_token(m.cfg, 16, full) / common.dense_flops_per_token(m.cfg, 16)
    assert st["flops_saved_hard"].item() == pytest.approx(1 - want.item(), rel=1e-6)
    assert st["skipped"].item() == pytest.approx(1 - st["full_ratio"].item())
    scores = scores[:2]  # the routed pass (eval runs a top-k pass after it for soft_loss)
    p = [torch.sigmoid(u / m.cfg.tau).mean() for u in scores]
    assert st["gate_prob"].item() == pytest.approx(torch.stack(p).mean().item(), rel=1e-9)
    var = torch.stack([u.var(correction=0) for u in scores]).mean()
    assert st["util_var"].item() == pytest.approx(var.item(), rel=1e-9)
    for k in ("qf_qc_l2", "qf_qc_cos", "jepa"):
        assert torch.is_tensor(st[k]) and torch.isfinite(st[k])


def test_budget_rounds_at_six_digits_and_the_controller_promotes_bf16():
    """k = ⌈ρT⌉ after rounding ρT to 6 decimals: 3.0000001 is 3 (float noise), 3.00001 is 4; a bf16
    input to the controller is promoted to fp32 (decisions in fp32)."""
    assert cd.budget_k(0.30000001, 10) == 3 and cd.budget_k(0.300001, 10) == 4
    m = make(dtype=torch.float32)
    a = torch.randn(2, 8, 32).bfloat16()
    assert torch.equal(m.controller(0, a)[0], m.controller(0, a.float())[0])


def test_training_proxy_counts_labels_for_either_oracle_loss():
    base = cd.compute_vs_full(tiny(recipe="A3-G3"))
    assert cd.compute_vs_full(tiny(lam_util=1.0, lam_rank=0.0)) > base
    assert cd.compute_vs_full(tiny(lam_util=0.0, lam_rank=0.2)) > base


def test_defaults_are_the_papers_section_4_values():
    """§4's constants by value (a default moved to a plausible value runs and trains as well):
    ρ 0.5, τ 2.0, p_min 0.05, λ_b 1, λ_a 0.5, W 8, γ 0.5, labels from step 100 every 5, the
    standard λ's; the paper preset's optimiser (AdamW 2e-4 → ×0.01, wd 0.01, 1k warmup, 20k
    steps, eval every 500 over 16 batches)."""
    c = cd.Config()
    assert (c.rho, c.tau, c.p_min, c.lam_b, c.lam_a) == (0.5, 2.0, 0.05, 1.0, 0.5)
    assert (c.oracle_window, c.oracle_gamma, c.label_start, c.label_every) == (8, 0.5, 100, 5)
    assert (c.gate, c.lam_jepa, c.lam_util, c.lam_rank) == ("G3", 1.0, 1.0, 0.2)
    p = cd.Config(**cd.PRESETS["paper"])
    assert (p.learning_rate, p.min_lr, p.weight_decay) == (2e-4, 2e-6, 0.01)
    assert (p.warmup_iters, p.max_iters, p.eval_interval, p.eval_iters) == (1000, 20000, 500, 16)
    assert (p.n_controlled, p.cheap_rank, p.d_c, p.d_s) == (4, 80, 128, 64)


@pytest.mark.parametrize("gate, ctrl", [("G1", 2 * (32 * 8 + 8)), ("G3", 2320 + 2 * 2 * 32 * 8)])
def test_train_flops_per_token_by_value(gate, ctrl):
    """Eq. (9): training runs both FFNs and the controller (G3: T on both outputs too) in each of
    the C = 2 controlled layers, on top of the dense model; d 32, r 4."""
    m = make(gate=gate)
    cheap = 2 * 2 * 32 * 4
    want = common.dense_flops_per_token(m.cfg, 32) + 2 * (cheap + ctrl)
    assert type(m.train_flops_per_token(32)) is float and m.train_flops_per_token(32) == want
