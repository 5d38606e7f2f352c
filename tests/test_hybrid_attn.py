"""Tests for hybrid_attn.py: the gated delta rule (chunked == recurrent == a float64 loop written
here from Yang et al.'s equations, fp32 state under bf16 autocast), routing and the balance loss,
and the model contract on the device matrix (sparse == dense-hard, causality,
cached decoding == full forward, a training step)."""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import common
import hybrid_attn as H
import train
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
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---------------------------------------------------------------- gated delta rule

@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent_float64(chunk, with_state):
    # 37 is not a multiple of 3, 16 or 64: exercises the padding
    q, k, v, g, beta, S0 = gdr_inputs(T=37)
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


def test_chunked_defaults_and_no_final_state_on_request():
    """The default chunk is the Config's 64 (fla's too);
    output_final_state=False returns no state."""
    import inspect
    default = inspect.signature(H.gated_delta_rule_chunked).parameters["chunk_size"].default
    assert default == H.Config.chunk_size == 64
    q, k, v, g, beta, S0 = gdr_inputs(T=9)
    o, S = H.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=4, initial_state=S0,
                                      output_final_state=False)
    assert S is None and torch.equal(o, H.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=4,
                                                                   initial_state=S0)[0])


@pytest.mark.parametrize("fn", ["recurrent", "chunked"])
@pytest.mark.parametrize("case", ["state_f64", "state_bf16", "default_dtype_f64"])
def test_rules_compute_in_the_inputs_dtype(fn, case):
    """fp32 q, k, v: a state given in another dtype is converted, and torch's default dtype
    (set_default_dtype(float64), as for a gradcheck) changes nothing: fp32 out, the same values."""
    q, k, v, g, beta, S0 = (t.float() for t in gdr_inputs(T=9))
    rule = H.gated_delta_rule_recurrent if fn == "recurrent" else \
        (lambda *a, **kw: H.gated_delta_rule_chunked(*a, chunk_size=4, **kw))
    given = {"state_f64": S0.double(), "state_bf16": S0.bfloat16()}.get(case, S0)
    want_o, want_S = rule(q, k, v, g, beta, initial_state=given.float())
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if case == "default_dtype_f64" else before)
    try:
        o, S = rule(q, k, v, g, beta, initial_state=given)
    finally:
        torch.set_default_dtype(before)
    assert o.dtype == S.dtype == torch.float32
    assert torch.allclose(o, want_o, rtol=1e-6, atol=1e-6) and torch.allclose(S, want_S, rtol=1e-6,
                                                                                atol=1e-6)


def test_recurrence_matches_hand_computation():
    """One head, 2 steps, K = V = 1: S1 = β1 v1 k1, S2 = e^{g2} S1 + k2 β2 (v2 − e^{g2} S1 k2)."""
    k1, k2, v1, v2, b1, b2, g2 = 0.6, -0.8, 1.5, -2.0, 0.3, 0.7, -0.5
    f = lambda *xs: torch.tensor(xs, dtype=torch.float64)
    q = f(1.0, 1.0).view(1, 1, 2, 1)
    o, S = H.gated_delta_rule_recurrent(q, f(k1, k2).view(1, 1, 2, 1), f(v1, v2).view(1, 1, 2, 1),
                                        f(0.0, g2).view(1, 1, 2), f(b1, b2).view(1, 1, 2))
    S1 = b1 * v1 * k1
    Sd = math.exp(g2) * S1
    S2 = Sd + k2 * b2 * (v2 - Sd * k2)
    assert torch.allclose(o.flatten(), f(S1, S2)) and abs(S.item() - S2) < 1e-12


@pytest.mark.parametrize("fn", ["recurrent", "chunked"])
def test_split_with_carried_state_equals_one_pass(fn):
    q, k, v, g, beta, _ = gdr_inputs(T=50)
    run = ((lambda *a, s=None: H.gated_delta_rule_recurrent(*a, initial_state=s))
           if fn == "recurrent" else
           (lambda *a, s=None: H.gated_delta_rule_chunked(*a, chunk_size=16, initial_state=s)))
    o, S = run(q, k, v, g, beta)
    cut = 21
    oa, Sa = run(*(t[:, :, :cut] for t in (q, k, v, g, beta)))
    ob, Sb = run(*(t[:, :, cut:] for t in (q, k, v, g, beta)), s=Sa)
    assert torch.allclose(torch.cat([oa, ob], 2), o, atol=1e-10) and torch.allclose(
        Sb, S, atol=1e-10)


def test_chunked_gradcheck():
    q, k, v, g, beta, S0 = gdr_inputs(B=1, Hh=1, T=7, K=3, V=2)
    args = [t.clone().requires_grad_() for t in (q, k, v, g, beta, S0)]
    f = lambda q, k, v, g, b, s: H.gated_delta_rule_chunked(q, k, v, g, b, chunk_size=3,
                                                            initial_state=s)
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("decays", ["strong", "mixed"])
def test_chunked_fp32_accurate_with_extreme_decays(decays):
    """Masking before exp (no inf/nan from e^{+large} above the diagonal) and no cancellation:
    with log decays of −1e4 next to tiny ones, Γ_i − Γ_j of two large cumulative sums loses ~1e-3
    in fp32."""
    q, k, v, g, beta, _ = gdr_inputs(B=1, Hh=2, T=256, K=16, V=16)
    if decays == "strong":
        g = g * 100  # log decays down to −200 per token
    else:
        big = torch.rand(g.shape, generator=torch.Generator().manual_seed(1), dtype=g.dtype) < 0.5
        g = torch.where(big, g * 5e3, g * 5e-3)  # (−1e4, 0] and (−0.01, 0] mixed
    ref, _ = H.gated_delta_rule_recurrent(q, k, v, g, beta)
    o, _ = H.gated_delta_rule_chunked(*(t.float() for t in (q, k, v, g, beta)), chunk_size=64)
    assert torch.isfinite(o).all() and rel(o, ref) < 1e-5


@pytest.mark.parametrize("fn", ["recurrent", "chunked"])
def test_state_math_stays_fp32_under_bf16_autocast(fn):
    """bf16 inputs (what the layer produces under autocast) -> fp32 state and outputs with
    fp32-level error against a float64 run on the same inputs (it was 4e-3 at T=1024 with the state
    computed in bf16)."""
    q, k, v, g, beta, S0 = gdr_inputs(B=1, Hh=2, T=1024 if fn == "chunked" else 128, K=16, V=16)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    g, beta, S0 = g.float(), beta.float(), S0.float()
    ref_o, ref_S = H.gated_delta_rule_recurrent(*(t.double() for t in (q, k, v, g, beta)),
                                                initial_state=S0.double())
    run = H.gated_delta_rule_recurrent if fn == "recurrent" else H.gated_delta_rule_chunked
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, S = run(q, k, v, g, beta, initial_state=S0)
    assert o.dtype == S.dtype == torch.float32
    assert rel(o, ref_o) < 1e-5 and rel(S, ref_S) < 1e-5


@pytest.mark.skipif(H._fla_chunk is None or not torch.cuda.is_available(),
                    reason="fla (Triton) and CUDA not both here")
def test_fla_kernel_agrees_with_the_pytorch_reference():
    q, k, v, g, beta, S0 = (t.float().cuda() for t in gdr_inputs(B=2, Hh=4, T=300, K=64, V=64))
    ref_o, ref_S = H.gated_delta_rule_chunked(q, k, v, g, beta, initial_state=S0)
    o, S = H.gated_delta_rule_fla(q, k, v, g, beta, initial_state=S0)
    # bf16 kernel
    assert o.dtype == S.dtype == torch.float32 and rel(o, ref_o) < 1e-2 and rel(S, ref_S) < 1e-2


@pytest.mark.skipif(H._fla_recurrent is None or not torch.cuda.is_available(),
                    reason="no fla (Triton) or no CUDA")
@pytest.mark.parametrize("B", [1, 2])
def test_fla_decode_step_agrees_with_the_reference_step(B):
    """On CUDA the eager decode step takes fla's fused recurrent kernel; from the same prefill it
    decodes like the PyTorch step (their L2 norms differ only for |x|² near 1e-6) and leaves the
    same state, in fp32 and bf16."""
    torch.manual_seed(0)
    m = H.Model(tiny()).cuda().eval()
    # bf16 may flip a decision at the margin
    m.forced_route = torch.rand(B, 30, len(m.routed), device="cuda") < 0.5
    x = torch.randint(0, 40, (B, 30), device="cuda")

    def decode(fla):  # -> logits (B, 20, V), the GDN states
        gdns = [mod for mod in m.modules() if isinstance(mod, H.GatedDeltaNet)]
        for gdn in gdns:
            gdn.use_fla = False
        logits, state = m.prefill(x[:, :10])  # one prefill for both: only the step differs
        for gdn in gdns:
            gdn.use_fla = fla
        steps = []
        for t in range(10, 30):
            logits, state = m.step(x[:, t:t + 1], state)
            steps.append(logits.float())
        return torch.stack(steps, 1), [c["S"] for c in state[0] if "S" in c]

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            (fla, S_fla), (ref, S_ref) = decode(True), decode(False)
        assert torch.allclose(fla, ref, atol=tol, rtol=tol)
        assert all(rel(a, b) < tol for a, b in zip(S_fla, S_ref))


def fake_fla(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """fla's contract, run by the float64 reference: (B, T, H, ·) tensors, its own q scale (None:
    K^−½), an fp32 g and state; 16-bit q, k, v, β for the chunked kernel."""
    assert g.dtype == torch.float32 and q.shape[:3] == g.shape == beta.shape
    assert initial_state is None or initial_state.dtype == torch.float32
    scale = q.size(-1) ** -0.5 if scale is None else scale
    S0 = None if initial_state is None else initial_state.double()
    o, S = H.gated_delta_rule_recurrent(*(t.transpose(1, 2).double() for t in
                                          (q * scale, k, v, g, beta)), initial_state=S0)
    return o.transpose(1, 2).to(v.dtype), S.float() if output_final_state else None


def test_fla_wrappers_keep_the_references_contract_on_cpu(monkeypatch):
    """fla's kernels need CUDA; their wrappers (layout, q scale, dtypes, state in and out) are
    checked here against a stand-in with fla's contract: equal to the reference on the same
    16-bit-rounded inputs."""
    seen = []
    monkeypatch.setattr(H, "_fla_chunk", lambda *a, **kw: seen.append(a[0].dtype) or
                        fake_fla(*a, **kw))
    monkeypatch.setattr(H, "_fla_recurrent", fake_fla)
    q, k, v, g, beta, S0 = (t.float() for t in gdr_inputs())
    r16 = lambda t: t.bfloat16().double()  # noqa: E731  what the chunked kernel reads
    ref_o, ref_S = H.gated_delta_rule_recurrent(r16(q), r16(k), r16(v), g.double(), r16(beta),
                                                initial_state=S0.double())
    o, S = H.gated_delta_rule_fla(q, k, v, g, beta, initial_state=S0)
    assert seen == [torch.bfloat16] and o.dtype == S.dtype == torch.float32
    assert rel(o, ref_o.bfloat16()) < 1e-6 and rel(S, ref_S) < 1e-6  # o: the kernel's bf16
    o, S = H.gated_delta_rule_fla(q, k, v, g, beta, output_final_state=False)
    assert S is None and rel(o, H.gated_delta_rule_recurrent(
        r16(q), r16(k), r16(v), g.double(), r16(beta))[0].bfloat16()) < 1e-6
    ref_o, ref_S = H.gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=S0)
    o, S = H.gated_delta_step_fla(q, k, v, g, beta, initial_state=S0)  # fp32 throughout
    assert rel(o, ref_o) < 1e-6 and rel(S, ref_S) < 1e-6


@pytest.mark.parametrize("fla_installed", [False, True])
def test_use_fla_falls_back_to_the_chunked_reference_where_fla_cannot_run(monkeypatch,
                                                                         fla_installed):
    """use_fla=True (the default) takes fla's kernels only on CUDA with fla installed; elsewhere the
    model is the same function as with use_fla=False (the pure-PyTorch chunked form and decode
    step). fla_installed: its kernels importable (stand-ins that fail if called), tensors on CPU."""
    if fla_installed:
        def not_on_cpu(*args, **kwargs):
            raise AssertionError("fla's CUDA kernel called on CPU tensors")
        monkeypatch.setattr(H, "_fla_chunk", not_on_cpu)
        monkeypatch.setattr(H, "_fla_recurrent", not_on_cpu)
    torch.manual_seed(0)
    a, b = H.Model(tiny(use_fla=True)).eval(), H.Model(tiny(use_fla=False)).eval()
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 40, (2, 32))
    with torch.no_grad():
        assert torch.equal(a(x)[0], b(x)[0])
        (la, sa), (lb, sb) = a.prefill(x[:, :20]), b.prefill(x[:, :20])
        for t in range(20, 24):
            (la, sa), (lb, sb) = a.step(x[:, t:t + 1], sa), b.step(x[:, t:t + 1], sb)
            assert torch.equal(la, lb)


# -------------------------------------------------------------- the GDN layer against its equations

def gdn_reference(gdn, x):
    """Yang et al.'s Gated DeltaNet layer, one timestep at a time in float64, from the equations
    alone: z = causal conv₄(W_qkv x); q, k, v = SiLU(z); q ← q/‖q‖·K^−½, k ← k/‖k‖; β = σ(W_b x);
    g = −e^{A_log}·softplus(W_a x + dt_bias); S ← e^g S; S ← S + β k (v − Sᵀk)ᵀ; o = Sᵀq;
    y = W_o(RMSNorm(o) per head · w ⊙ SiLU(W_g x))."""
    Hh, K, V = gdn.H, gdn.K, gdn.V
    B, T, C = x.shape
    proj = x @ gdn.qkv_proj.weight.T                                 # (B, T, H(2K+V))
    # (ch, 4); tap 3 is the current token
    w = gdn.conv.weight[:, 0]
    S = torch.zeros(B, Hh, K, V, dtype=x.dtype)
    ys = []
    for t in range(T):
        z = sum(w[:, 3 - j] * proj[:, t - j] for j in range(4) if t - j >= 0)
        z = z * torch.sigmoid(z)                                     # SiLU
        q, k, v = z.split([Hh * K, Hh * K, Hh * V], -1)
        q, k, v = q.view(B, Hh, K), k.view(B, Hh, K), v.view(B, Hh, V)
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6) / math.sqrt(K)
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        beta = torch.sigmoid(x[:, t] @ gdn.b_proj.weight.T)          # (B, H)
        a = x[:, t] @ gdn.a_proj.weight.T + gdn.dt_bias
        g = -torch.exp(gdn.A_log) * torch.log1p(torch.exp(a))        # (B, H)
        S = torch.exp(g)[..., None, None] * S
        u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", S, k))
        S = S + k[..., :, None] * u[..., None, :]
        o = torch.einsum("bhkv,bhk->bhv", S, q)                      # (B, H, V)
        o = o / torch.sqrt((o ** 2).mean(-1, keepdim=True) + 1e-6) * gdn.norm_weight
        gate = x[:, t] @ gdn.g_proj.weight.T
        o = o * (gate * torch.sigmoid(gate)).view(B, Hh, V)
        ys.append(o.reshape(B, Hh * V) @ gdn.c_proj.weight.T)
    return torch.stack(ys, 1)                                        # (B, T, C)


def reference_layer(seed=0, qk_scale=1.0, **kw):
    torch.manual_seed(seed)
    cfg = tiny(n_head=2, n_embd=16, **kw)
    gdn = H.GatedDeltaNet(cfg).double()
    gdn.reset_gdn_parameters()
    with torch.no_grad():  # heads with different scales: a norm over all heads is not one per head
        gdn.qkv_proj.weight.mul_(torch.linspace(0.5, 4.0, gdn.qkv_proj.weight.size(0),
                                                dtype=torch.float64)[:, None])
        gdn.qkv_proj.weight[:2 * gdn.H * gdn.K].mul_(qk_scale)  # the q and k rows
        gdn.norm_weight.copy_(torch.linspace(0.5, 1.5, gdn.V))
        gdn.b_proj.weight.mul_(30)  # β spread over (0, 1), not ≈ 0.5
    return gdn


@pytest.mark.parametrize("path", ["chunked", "step"])
@pytest.mark.parametrize("qk_scale", [1.0, 1e-7])
def test_gdn_layer_matches_equations_float64(path, qk_scale):
    """qk_scale 1e-7: ‖q‖, ‖k‖ ~ 1e-8, below the L2 norm's ε = 1e-6, which then sets their size."""
    gdn = reference_layer(qk_scale=qk_scale)
    x = torch.randn(2, 19, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = gdn_reference(gdn, x)
    with torch.no_grad():
        if path == "chunked":
            out = gdn(x)
        else:
            cache = {}
            out = [gdn(x[:, :1], cache)]
            out += [gdn(x[:, t:t + 1], cache) for t in range(1, 19)]  # a cache with a state: a step
            out = torch.cat(out, 1)
    assert torch.allclose(out, ref, atol=1e-10, rtol=1e-8), (out - ref).abs().max()


def test_gdn_layer_decode_step_matches_forward():
    torch.manual_seed(0)
    cfg = tiny()
    gdn = H.GatedDeltaNet(cfg).double()
    gdn.reset_gdn_parameters()
    x = torch.randn(2, 11, cfg.n_embd, dtype=torch.float64)
    full = gdn(x)
    cache = {}
    out = [gdn(x[:, :2], cache)]  # prefill 2 tokens (fewer than the conv's 3-token tail), then step
    out += [gdn(x[:, t:t + 1], cache) for t in range(2, 11)]
    assert torch.allclose(torch.cat(out, 1), full, atol=1e-10)


# ---------------------------------------------------------------- config

def tiny(**kw):
    base = dict(n_layer=4, n_head=2, n_embd=32, block_size=32, vocab_size=40, chunk_size=8)
    return H.Config(**{**base, **kw})


@pytest.mark.parametrize("kw,msg", [
    (dict(pattern="G R S"), "has 3 layers"),
    (dict(pattern="G R X S"), "unknown layer 'X'"),
    # spaces are not separators of groups
    (dict(pattern="GR RS", n_layer=2), "has 4 layers"),
    (dict(pattern="R G G S"), "layer 0 cannot be routed"),
    (dict(balance=-0.1), "balance"),
    (dict(tau_end=0.0), "temperatures"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_config_errors(kw, msg):
    with pytest.raises(NanorouteError, match=msg):
        tiny(**kw)


def test_config_pattern_forms_and_presets():
    assert tiny(pattern="GRRS").kinds == tiny(pattern="G R R S").kinds == "GRRS"
    for name, preset in H.PRESETS.items():
        H.Config(**preset)  # every preset is a valid config
    assert {k: H.PRESETS["classroom"][k] for k in common.CLASSROOM
            if k not in ("max_iters", "eval_interval")} == \
        {k: v for k, v in common.CLASSROOM.items() if k not in ("max_iters", "eval_interval")}


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
    # f counts hard decisions, P averages probabilities: f = [1, 0], P = [0.6, 0.4] -> 2·0.6 = 1.2
    assert abs(H.balance_loss(torch.tensor([0.6, 0.4]).expand(100, 1, 2), hard_col).item()
               - 1.2) < 1e-6


def test_train_balance_uses_hard_fractions_and_noise_free_probabilities():
    torch.manual_seed(0)
    m = H.Model(tiny())
    x = torch.randint(0, 40, (4, 32))
    torch.manual_seed(5)
    _, loss, stats = m(x, x)
    with torch.no_grad():
        # (nR, 2)
        P = m.router(m.ln_r(m.blocks[0](m.embed(x)))).view(4, 32, 2, 2).softmax(-1).mean((0, 1))
    f = torch.stack([torch.stack([stats[f"gdn_frac_l{i}"], 1 - stats[f"gdn_frac_l{i}"]])
                     for i in m.routed])
    # both mixers used: P and f are not interchangeable
    assert 0 < f[:, 0].min() and f[:, 0].max() < 1
    assert torch.isclose(stats["balance"], (2 * (f * P).sum(-1)).mean(), atol=1e-6)
    assert torch.isclose(loss, stats["lm_loss"] + 0.01 * stats["balance"])
    assert set(stats) == {"lm_loss", "skip_l1", "gdn_frac_l1", "skip_l2", "gdn_frac_l2", "skipped",
                          "tau", "flops_saved_hard", "balance"}  # train.py logs each by its key
    assert torch.equal(stats["tau"], m.tau)


@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_straight_through_gradient_is_the_tau_softmax(monkeypatch, tau):
    """Forward = onehot(argmax(z + γ)); gradient = that of softmax((z + γ)/τ):
    the τ and the noise both count."""
    torch.manual_seed(0)
    m = H.Model(tiny())
    m.tau.fill_(tau)
    x = torch.randint(0, 40, (2, 32))
    h0 = m.blocks[0](m.embed(x)).detach()
    gamma = -torch.empty(2, 32, 2, 2).exponential_(generator=torch.Generator().manual_seed(3)).log()
    monkeypatch.setattr(H, "gumbel_like", lambda z: gamma)
    c = torch.randn(2, 32, 2, 2)
    y, _, hard = m.route(h0)
    (gw,) = torch.autograd.grad((y * c).sum(), m.router.weight)
    z = m.router(m.ln_r(h0)).view(2, 32, 2, 2)
    p = ((z + gamma) / tau).softmax(-1)
    assert torch.equal(hard, F.one_hot((z + gamma).argmax(-1), 2).float()) and torch.equal(
        y.detach(), hard)
    (want,) = torch.autograd.grad((p * c).sum(), m.router.weight)
    assert torch.allclose(gw, want, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("which", ["lm", "balance"])
def test_gradients_reach_the_router(which):
    """Through the LM loss alone (straight-through Gumbel, α = 0)
    and through the balance loss alone."""
    torch.manual_seed(0)
    m = H.Model(tiny(balance=0.0 if which == "lm" else 1.0))
    x = torch.randint(0, 40, (2, 32))
    _, loss, stats = m(x, x)
    assert loss.requires_grad and not stats["balance"].requires_grad
    (loss if which == "lm" else H.balance_loss(*m.route(m.blocks[0](m.embed(x)))[1:])).backward()
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
    m.on_step(0); assert m.tau.item() == 1.0
    m.on_step(50); assert abs(m.tau.item() - 0.5) < 1e-6
    m.on_step(100); assert abs(m.tau.item() - 0.25) < 1e-6
    assert "tau" not in m.state_dict()  # checkpoints keep their keys
    m.on_step(50)  # a pass's tau stat is its own τ, a copy: the next on_step leaves it as it was
    idx = torch.randint(0, 40, (1, 8))
    tau = m.train()(idx, idx)[2]["tau"]
    m.on_step(100); assert abs(tau.item() - 0.5) < 1e-6


def test_eval_stats_contract(monkeypatch):
    """soft_loss = the training-mode loss without noise; skip_l{i} = GDN fraction;
    flops_saved_hard from it."""
    torch.manual_seed(0)
    m = H.Model(tiny()).eval()
    x = torch.randint(0, 40, (4, 32))
    with torch.no_grad():
        _, loss, st = m(x, x)
        monkeypatch.setattr(H, "gumbel_like", torch.zeros_like)
        _, train_loss, train_st = m.train()(x, x)
    assert torch.isclose(st["soft_loss"], train_st["lm_loss"], atol=1e-6) and torch.equal(
        st["soft_loss"], st["lm_loss"])
    # the LM part is lm_loss (estimate_loss's)
    assert torch.isclose(loss, st["lm_loss"] + 0.01 * st["balance"])
    skips = [st[f"skip_l{i}"] for i in m.routed]
    assert all(torch.equal(st[f"skip_l{i}"], st[f"gdn_frac_l{i}"]) for i in m.routed)
    assert 0 < min(skips) and max(skips) < 1 and torch.isclose(
        st["skipped"], sum(skips) / len(skips))
    want = 1 - H.flops_per_token(m.cfg, 32, [1 - s.item() for s in skips], sparse=True) / \
        common.dense_flops_per_token(m.cfg, 32)
    assert abs(st["flops_saved_hard"].item() - want) < 1e-6
    assert all(torch.is_tensor(v) and v.numel() == 1 and not v.requires_grad for v in st.values())
    assert set(st) == {"lm_loss", "skip_l1", "gdn_frac_l1", "skip_l2", "gdn_frac_l2", "skipped",
                       "flops_saved_hard", "soft_loss", "balance"}  # no τ in eval


def test_static_pattern_has_no_router_or_routing_stats():
    m = H.Model(tiny(pattern="G G G S")).eval()
    x = torch.randint(0, 40, (2, 16))
    _, loss, stats = m(x, x)
    assert not hasattr(m, "router") and set(stats) == {"lm_loss", "soft_loss", "flops_saved_hard"}
    assert torch.equal(loss, stats["lm_loss"])
    assert abs(stats["flops_saved_hard"].item() - (
        1 - H.flops_per_token(m.cfg, 16) / common.dense_flops_per_token(m.cfg, 16))) < 1e-9


def test_routing_map():
    torch.manual_seed(0)
    m = H.Model(tiny()).train()
    x = torch.randint(0, 40, (1, 32))
    mp, rows, legend = m.routing_map(x)
    assert (m.training and mp.shape == (2, 32) and mp.device.type == "cpu"
            and rows == ["layer 1", "layer 2"])
    m.eval()
    with torch.no_grad():
        _, _, hard = m.route(m.blocks[0](m.embed(x)))
    assert torch.equal(mp, hard[0, :, :, 1].T) and legend[1] == "softmax"
    assert H.Model(tiny(pattern="G G G S")).routing_map(x)[0].shape == (0, 32)


# ---------------------------------------------------------- the model contract on the device matrix

def model_on(dev, seed=0, **kw):
    """A tiny model on dev with O(1) logits (so dev.tol() is tight relative to them), router margins
    and (bias=True) nonzero biases."""
    torch.manual_seed(seed)
    m = H.Model(tiny(**kw)).to(dev.device)
    with torch.no_grad():
        m.wte.weight.mul_(25)
        if m.routed:
            m.router.weight.mul_(10)
        for name, p in m.named_parameters():  # bias=True: biases away from their zero init
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return m


def close(a, b, dev):
    atol, rtol = dev.tol()
    return torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("bias", [False, True])
def test_sparse_equals_dense_hard(dev, bias):
    m = model_on(dev, seed=3, bias=bias).eval()
    x = torch.randint(0, 40, (4, 32), device=dev.device)
    with torch.no_grad(), dev.autocast():
        dense, _, sd = m(x, x)
        sparse, _, ss = m(x, x, sparse=True)
        soft = m.route(m.blocks[0](m.embed(x)))[2][..., 1].sum(1)  # (B, nR) tokens sent to softmax
    # rows differ
    assert len(set(soft[:, 0].tolist())) > 1 and (soft > 0).all() and (soft < 32).all()
    assert dense.abs().max() > 1 and close(sparse, dense, dev)
    assert all(torch.equal(sd[f"skip_l{i}"], ss[f"skip_l{i}"]) for i in m.routed)


def test_sparse_really_skips_and_equals_dense_forced(monkeypatch):
    torch.manual_seed(0)
    m = H.Model(tiny(pattern="G R R S")).double().eval()
    x = torch.randint(0, 40, (3, 32))
    forced = torch.zeros(3, 32, 2, dtype=torch.bool)
    forced[0, ::3, 0] = True           # row 0: 11 tokens in layer 1
    forced[1, 5, 0] = True             # row 1: 1 token
    forced[:, 10:20, 1] = True         # layer 2: 10 tokens in every row; row 2 of layer 1: none
    m.forced_route = forced
    queries, gdn_reads = [], []
    orig = common.CausalSelfAttention.attend
    monkeypatch.setattr(common.CausalSelfAttention, "attend", lambda self, q, k, v, **kw:
                        queries.append(q.size(2)) or orig(self, q, k, v, **kw))
    for i in (1, 2):
        m.blocks[i].gdn.c_proj.register_forward_hook(
            lambda mod, inp, out: gdn_reads.append(inp[0].shape[:-1].numel() // 3))
    with torch.no_grad():
        dense, _, _ = m(x)
        queries.clear(), gdn_reads.clear()
        sparse, _, _ = m(x, sparse=True)
    assert queries == [11, 10, 32]     # softmax queries in layers 1, 2 (max per row), 3 (all)
    assert gdn_reads == [32, 22]       # GDN outputs in layer 1 (row 2 has no softmax token),
                                       # layer 2 (32 − 10)
    assert torch.allclose(sparse, dense, atol=1e-10)
    # nobody routed to softmax: no attention at all
    m.forced_route = torch.zeros(3, 32, 2, dtype=torch.bool)
    with torch.no_grad():
        queries.clear()
        sparse = m(x, sparse=True)[0]
        assert queries == [32] and torch.allclose(sparse, m(x)[0], atol=1e-10)
    # everybody routed to softmax, no cache to fill: the routed layers write no GDN state
    writes = []
    for i in (1, 2):
        m.blocks[i].gdn.qkv_proj.register_forward_hook(lambda mod, inp, out: writes.append(i))
    m.forced_route = torch.ones(3, 32, 2, dtype=torch.bool)
    with torch.no_grad():
        sparse = m(x, sparse=True)[0]
        assert writes == [] and torch.allclose(sparse, m(x)[0], atol=1e-10)


@pytest.mark.parametrize("B", [1, 2])
def test_a_tie_goes_to_gdn_in_every_path(monkeypatch, B):
    """eval: y = onehot(argmax z), argmax's first index: at z_G = z_S exactly every token reads
    through GDN, in the forward, the sparse forward, the decode step (B=1: one read chosen on the
    host; B=2: per row) and the training forward (Gumbel noise 0)."""
    from conftest import decoded_vs_full
    torch.manual_seed(0)
    m = H.Model(tiny(bias=True)).eval()
    with torch.no_grad():
        m.router.weight.zero_()  # z = (0, 0) for every token and routed layer: a tie
        m.wte.weight.mul_(25)
    x = torch.randint(0, 40, (B, 24))
    with torch.no_grad():
        dense, _, st = m(x, x)
        assert all(st[f"gdn_frac_l{i}"] == 1 for i in m.routed)
        assert torch.allclose(m(x, sparse=True)[0], dense, atol=1e-5)
        steps, full = decoded_vs_full(m, x, 6)
        assert torch.allclose(steps, full, atol=1e-4), (steps - full).abs().max()
    monkeypatch.setattr(H, "gumbel_like", torch.zeros_like)
    _, _, st = m.train()(x, x)
    assert all(st[f"gdn_frac_l{i}"] == 1 for i in m.routed)


def test_b1_decode_step_reads_through_the_chosen_mixer_only(monkeypatch):
    """B = 1 (how users decode): a routed layer's step runs one read, the chosen one (§2.2's
    inference rule: GDN's RMSNorm, W_g, W_o or softmax's Q, scores, W_o), and decodes as the full
    forward does."""
    torch.manual_seed(0)
    m = H.Model(tiny()).eval()
    forced = torch.rand(1, 24, 2, generator=torch.Generator().manual_seed(2)) < 0.5
    assert forced[0, 6:].any(0).all() and not forced[0, 6:].all(0).any()  # both reads, each layer
    m.forced_route = forced
    reads = []
    gdn_read, attend = H.GatedDeltaNet.read, common.CausalSelfAttention.attend
    monkeypatch.setattr(H.GatedDeltaNet, "read",
                        lambda self, *a: reads.append(self) or gdn_read(self, *a))
    monkeypatch.setattr(common.CausalSelfAttention, "attend",
                        lambda self, *a, **kw: reads.append(self) or attend(self, *a, **kw))
    x = torch.randint(0, 40, (1, 24))
    with torch.no_grad():
        full = m(x)[0]
        logits, state = m.prefill(x[:, :6])
        for t in range(6, 24):
            reads.clear()
            logits, state = m.step(x[:, t:t + 1], state)
            routed = [m.blocks[i].attn if forced[0, t, r] else m.blocks[i].gdn
                      for r, i in enumerate(m.routed)]
            assert reads == [m.blocks[0].gdn, *routed, m.blocks[3].attn]
            assert torch.allclose(logits, full[:, t], atol=1e-5)


def test_flops_saved_at_known_shares_and_B_gt_1():
    """flops_saved_hard = 1 − FLOPs(sparse at the measured softmax shares) / dense GPT, where a
    share counts every row of the batch: forced rows of 0, 8, 16, 24 softmax tokens in layer 1
    (0.375), one row of 32 in layer 2 (0.25)."""
    torch.manual_seed(0)
    m = H.Model(tiny()).eval()
    forced = torch.zeros(4, 32, 2, dtype=torch.bool)
    for b in range(4):
        forced[b, :8 * b, 0] = True
    forced[2, :, 1] = True
    m.forced_route = forced
    with torch.no_grad():
        _, _, st = m(torch.randint(0, 40, (4, 32)))
    assert st["gdn_frac_l1"] == 0.625 and st["gdn_frac_l2"] == 0.75 and st["skipped"] == 0.6875
    cfg, d = m.cfg, m.cfg.n_embd
    dense = common.dense_flops_per_token(cfg, 32)
    want = 1 - H.flops_per_token(cfg, 32, [0.375, 0.25], sparse=True) / dense
    assert st["flops_saved_hard"].item() == pytest.approx(want, abs=1e-6)
    # the same from the parts: a softmax read instead of a GDN read adds Q, scores, W_o − W_g, W_o
    _, read = H.flops_gdn(cfg)
    query = 2 * d * d + common.flops_attn_scores(d, common.mean_context(32)) + 2 * d * d
    all_gdn = H.flops_per_token(cfg, 32, 0.0, sparse=True)
    assert want == pytest.approx(1 - (all_gdn + (0.375 + 0.25) * (query - read)) / dense, abs=1e-9)


def test_sparse_in_train_mode_is_an_error():
    with pytest.raises(NanorouteError) as e:
        H.Model(tiny())(torch.zeros(1, 4, dtype=torch.long), sparse=True)
    assert str(e.value) == "sparse=True is the inference path: call model.eval() first"


@pytest.mark.parametrize("mode", ["train", "eval", "sparse"])
def test_causality(dev, mode):
    m = model_on(dev, pattern="G R R S")
    m.train(mode == "train")
    x = torch.randint(0, 40, (2, 32), device=dev.device)
    x2 = x.clone()
    x2[:, 20:] = torch.randint(0, 40, (2, 12), device=dev.device)
    outs = []
    for inp in (x, x2):
        # same Gumbel noise tensor in train mode: noise at position t is independent of the input
        torch.manual_seed(7)
        with dev.autocast():
            outs.append(m(inp, sparse=mode == "sparse")[0].detach())
    assert close(outs[0][:, :20], outs[1][:, :20], dev)
    assert not close(outs[0][:, 20:], outs[1][:, 20:], dev)  # the future does change the future


@pytest.mark.parametrize("pattern,bias", [("G R R S", False), ("G G G S", False),
                                          ("S S S S", False), ("S R G R", False),
                                          ("G R R S", True), ("S R G R", True)])
def test_cached_decoding_equals_full_forward(dev, pattern, bias):
    """prefill + step == the full forward at every position. Low precision: decisions are forced
    (the same in both paths), because a router logit at the threshold may legitimately flip between
    bf16 paths."""
    m = model_on(dev, pattern=pattern, bias=bias).eval()
    x = torch.randint(0, 40, (3, 30), device=dev.device)
    if dev.low and m.routed:
        m.forced_route = torch.rand(
            3, 30, len(m.routed), generator=torch.Generator().manual_seed(1)).lt(0.4).to(dev.device)
    with torch.no_grad(), dev.autocast():
        full, _, _ = m(x)
        logits, state = m.prefill(x[:, :5])
        steps = [logits]
        for t in range(5, 30):
            logits, state = m.step(x[:, t:t + 1], state)
            steps.append(logits)
        if m.routed:
            soft = m.route(m.blocks[0](m.embed(x)))[2][..., 1]
    assert close(torch.stack(steps, 1), full[:, 4:], dev)
    if "R" in pattern:  # decisions of both kinds were exercised
        assert (soft > 0).any() and (soft < 1).any()
    if "G" in pattern or "R" in pattern:
        S = next(c["S"] for c in state[0] if "S" in c)
        assert S.dtype == torch.float32  # recurrent state in fp32 under autocast too


def test_a_prefill_with_one_read_per_layer_still_fills_both_caches():
    """The prompt's tokens all read through softmax in layer 1 and all through GDN in layer 2:
    prefill still writes layer 1's GDN state and layer 2's K, V (every token writes both), which
    the later tokens, routed both ways, read."""
    torch.manual_seed(0)
    m = H.Model(tiny()).double().eval()
    forced = torch.rand(2, 20, 2, generator=torch.Generator().manual_seed(4)) < 0.5
    forced[:, :8, 0], forced[:, :8, 1] = True, False
    assert forced[:, 8:].any() and not forced[:, 8:].all()
    m.forced_route = forced
    x = torch.randint(0, 40, (2, 20))
    with torch.no_grad():
        full = m(x)[0]
        logits, state = m.prefill(x[:, :8])
        steps = [logits]
        for t in range(8, 20):
            logits, state = m.step(x[:, t:t + 1], state)
            steps.append(logits)
    assert torch.allclose(torch.stack(steps, 1), full[:, 7:], atol=1e-10)


def test_prefill_matches_the_window_reference_at_every_prefix():
    torch.manual_seed(0)
    m = H.Model(tiny(block_size=16)).double().eval()
    x = torch.randint(0, 40, (2, 16))
    head_rows = []  # prefill runs the LM head on the last position only (T×V logits at 49k vocab)
    m.lm_head.register_forward_hook(lambda mod, inp, out: head_rows.append(inp[0].size(1)))
    with torch.no_grad():
        for n in (1, 2, 7, 16):
            head_rows.clear()
            logits, (caches, pos) = m.prefill(x[:, :n])
            assert head_rows == [1]
            assert pos == n and torch.allclose(logits, m(x[:, :n])[0][:, -1], atol=1e-10)


@pytest.mark.parametrize("B", [1, 2])
def test_generate_cached_equals_cache_free_past_block_size(B):
    """Greedy, fp32, token for token. B=1 is how users decode:
    there step() skips the read a token does not need."""
    torch.manual_seed(0)
    m = H.Model(tiny(block_size=16)).eval()
    with torch.no_grad():
        m.wte.weight.mul_(25)
        m.router.weight.mul_(10)
    prompt = torch.randint(0, 40, (B, 5))
    cached = m.generate(prompt, 40, temperature=0)
    plain = m.generate(prompt, 40, temperature=0, use_cache=False)
    assert torch.equal(cached, plain) and cached.shape == (B, 45)
    assert common.window_start(45, 16) > 0  # the window restarted at least once
    soft = m.route(m.blocks[0](m.embed(cached[:, -16:])))[2][..., 1]
    assert 0 < soft.mean() < 1  # both reads were taken


def test_training_step(dev):
    """One finite training step under the device's autocast, with gradients reaching the router."""
    m = model_on(dev).train()
    opt = common.make_optimizer(m, m.cfg, dev.device)
    x = torch.randint(0, 40, (4, 32), device=dev.device)
    with dev.autocast():
        _, loss, stats = m(x, x)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v).all() for v in stats.values())
    assert m.router.weight.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    before = m.router.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, m.router.weight)


def test_all_softmax_pattern_loads_dense_gpt_weights():
    torch.manual_seed(0)
    cfg = tiny(pattern="S S S S")
    gpt = common.Model(common.Config(n_layer=4, n_head=2, n_embd=32, block_size=32,
                                     vocab_size=40)).eval()
    m = H.Model(cfg).eval()
    # same names as common.Model: --init_from works
    m.load_state_dict(gpt.state_dict(), strict=True)
    x = torch.randint(0, 40, (2, 32))
    assert torch.allclose(m(x)[0], gpt(x)[0], atol=1e-6)


def test_biases_follow_cfg_bias():
    """bias=True (GPT-2's): every LayerNorm (the router's too) and every c_attn, c_fc, c_proj
    (GDN's W_o too) has a bias; bias=False: none. The GDN's W_qkv, W_a, W_b, W_g, its conv and the
    router never have one (Yang et al.; §2.2)."""
    for bias in (False, True):
        m = H.Model(tiny(bias=bias))
        got = {n.rsplit(".", 1)[0] for n, _ in m.named_parameters() if n.endswith(".bias")}
        want = {n for n, mod in m.named_modules() if isinstance(mod, torch.nn.LayerNorm)
                or n.rsplit(".", 1)[-1] in ("c_attn", "c_fc", "c_proj")}
        assert got == (want if bias else set()) and len(want) == 27  # 10 norms, 17 c_*
        assert "ln_r" in want and "blocks.0.gdn.c_proj" in want


def test_dropout_only_in_training(monkeypatch):
    """dropout > 0: eval (dense, sparse, decode) is the dropout-free model; training drops."""
    torch.manual_seed(0)
    m = H.Model(tiny(dropout=0.5)).eval()
    ref = H.Model(tiny(dropout=0.0)).eval()
    ref.load_state_dict(m.state_dict())
    x = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        want = ref(x)[0]
        assert torch.equal(m(x)[0], want) and torch.allclose(m(x, sparse=True)[0], want, atol=1e-5)
        logits, state = m.prefill(x[:, :15])
        assert torch.allclose(m.step(x[:, 15:], state)[0], want[:, -1], atol=1e-5)
    monkeypatch.setattr(H, "gumbel_like", torch.zeros_like)  # the same routes in both calls
    m.train()
    assert not torch.equal(m(x)[0], m(x)[0])


def test_flops_accounting():
    cfg = tiny()
    dense_hard = H.flops_per_token(cfg, 32)
    gdn_write, gdn_read = H.flops_gdn(cfg)
    d = cfg.n_embd
    # every softmax token skips GDN's gate and W_o; every GDN token skips Q, scores and W_o
    assert dense_hard - H.flops_per_token(cfg, 32, 1.0, sparse=True) == pytest.approx(2 * gdn_read)
    assert dense_hard - H.flops_per_token(cfg, 32, 0.0, sparse=True) == pytest.approx(
        2 * (2 * d * d + 2 * d * d + common.flops_attn_scores(d, common.mean_context(32))))
    assert H.flops_per_token(cfg, 32, [0.0, 1.0], sparse=True) == pytest.approx(
        (H.flops_per_token(cfg, 32, 0.0, sparse=True)
         + H.flops_per_token(cfg, 32, 1.0, sparse=True)) / 2)
    static_gdn = H.flops_per_token(tiny(pattern="G G G S"), 32)
    assert H.flops_per_token(cfg, 32, sparse=True) == H.flops_per_token(cfg, 32, 0.0, sparse=True)
    assert H.flops_per_token(cfg, 32, 0.0, sparse=True) - static_gdn == pytest.approx(
        2 * (4 * d * d + 2 * d * 2))


def test_train_flops_per_token_by_value():
    """Training runs both mixers of every routed layer and its router, whatever the routes. Tiny
    G R R S at T = 32 (d = 32, 2 heads, K = V = 16): LM head 2·32·40; MLPs 4·16384; GDN write
    10240 + read 4096 (layers 0-2); softmax 10304 (layers 1-3); router 2·32·2 (layers 1, 2)."""
    m = H.Model(tiny())
    for stats in (None, {"skipped": torch.tensor(0.9)}):
        got = m.train_flops_per_token(32, stats)
        assert type(got) is float and got == 2560 + 4 * 16384 + 3 * 14336 + 3 * 10304 + 2 * 128


def test_gumbel_noise_is_standard_gumbel():
    """γ = −log E, E ~ Exp(1): P(γ ≤ x) = exp(−e^{−x}), mean Euler's γ ≈ 0.5772 (200k draws:
    the CDF's standard error ~0.001)."""
    torch.manual_seed(0)
    z = torch.zeros(1000, 200)
    g = H.gumbel_like(z)
    assert g.shape == z.shape and g.dtype == z.dtype and torch.isfinite(g).all()
    for x in (-1.0, 0.0, 1.0, 3.0):
        assert (g <= x).float().mean().item() == pytest.approx(math.exp(-math.exp(-x)), abs=0.005)
    assert g.mean().item() == pytest.approx(0.5772, abs=0.01)


# ---------------------------------------------------------------- CLI

@pytest.mark.parametrize("argv", [[], ["-h"], ["--help"]])
def test_main_prints_its_usage(capsys, argv):
    H.main(argv)
    out = capsys.readouterr()
    assert out.out == H.USAGE + "\n" and not out.err
    assert out.out.startswith("usage: python hybrid_attn.py [-h]\n")


@pytest.mark.parametrize("argv", [["--bogus=1", "x"], ["-H"], ["--help", "-h"]])
def test_main_refuses_any_argument_but_help(capsys, argv):
    with pytest.raises(NanorouteError) as e:
        H.main(argv)
    assert str(e.value) == f"unrecognized arguments: {' '.join(argv)} (see --help)"
    assert capsys.readouterr().out == ""

def test_cli_smoke(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--model", "hybrid", "--dataset", "shakespeare",
           "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--batch_size=2",
           "--block_size=32", "--n_embd=32", "--n_head=2", f"--data_dir={data_dir}",
           f"--out_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    metrics = (out / "metrics.jsonl").read_text()
    assert all(k in metrics for k in ("val_gdn_frac_l1", "val_skip_l1", "val_soft_loss",
                                      "val_flops_saved_hard"))
    # in this process: the same refusal, no second torch import
    with pytest.raises(SystemExit) as bad:
        train.main(cmd[2:] + ["--pattern=G X R S"])
    err = capsys.readouterr().err
    assert bad.value.code == 2 and err.count("\n") == 1 and "unknown layer" in err



@pytest.mark.parametrize("args,rc", [(["--help"], 0), (["--help", "--bogus=1"], 2)])
def test_command_line(args, rc):
    """--help says what the file takes (nothing); anything else is one error line, exit 2."""
    r = subprocess.run([sys.executable, "hybrid_attn.py", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == rc, r.stderr
    if rc == 0:
        assert r.stdout.startswith("usage: python hybrid_attn.py") and not r.stderr
    else:
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and not r.stdout


# --------------------------------------------------------------- values pinned where a change shows

@pytest.mark.parametrize("kw, msg", [
    (dict(gdn_head_dim=-1), "gdn_head_dim"), (dict(gdn_expand_v=0), "gdn_expand_v"),
    (dict(tau_start=0.0), "temperatures"), (dict(tau_start=-1.0), "temperatures"),
    (dict(tau_end=-0.5), "temperatures"), (dict(balance=-1e-9), "balance")])
def test_every_range_is_refused_by_name(kw, msg):
    with pytest.raises(NanorouteError, match=msg):
        tiny(**kw)


def test_range_edges_build():
    for ok in (dict(balance=0.0), dict(chunk_size=1), dict(gdn_expand_v=1), dict(gdn_head_dim=0),
               dict(gdn_head_dim=1), dict(pattern="S R G G")):
        H.Model(tiny(**ok))
    assert tiny(gdn_head_dim=0).head_k == 16 and tiny(gdn_head_dim=3).head_k == 3


def test_temperature_schedule_at_its_edges():
    """Geometric τ at a step count that does not divide the run, past its end, and a 0-step run."""
    m = H.Model(tiny(max_iters=7, tau_start=1.0, tau_end=0.5))
    m.on_step(3)
    assert m.tau.item() == pytest.approx(0.5 ** (3 / 7), rel=1e-6)
    m.on_step(7)
    assert m.tau.item() == pytest.approx(0.5, rel=1e-6)
    m.on_step(20)
    assert m.tau.item() == pytest.approx(0.5, rel=1e-6)
    m = H.Model(tiny(max_iters=0, tau_start=2.0, tau_end=0.5))
    m.on_step(0)
    assert m.tau.item() == 2.0


def test_router_and_gdn_gates_run_in_fp32_under_bf16_autocast(monkeypatch):
    """Router logits, the decay g and β under CPU bf16 autocast equal their fp32 computation from
    the same projections (a bf16 elementwise pass moves them by ~1e-3 relative)."""
    torch.manual_seed(0)
    m = H.Model(tiny())
    with torch.no_grad():
        m.router.weight.normal_(0, 1.0)
    h0 = torch.randn(2, 16, 32)
    want = m.logits(h0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m.logits(h0)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-6, rtol=0)
    gdn = m.blocks[0].gdn
    seen = {}
    rule = H.gated_delta_rule_chunked

    def spy(q, k, v, g, beta, **kw):
        seen.update(q=q, k=k, g=g, beta=beta, kw=kw)
        return rule(q, k, v, g, beta, **kw)

    monkeypatch.setattr(H, "gated_delta_rule_chunked", spy)
    h = torch.randn(2, 16, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        gdn.write(h)
        a, b = gdn.a_proj(h), gdn.b_proj(h)  # the projections as autocast runs them (bf16)
    assert seen["g"].dtype == seen["beta"].dtype == torch.float32
    assert seen["q"].dtype == seen["k"].dtype == torch.float32  # normalised in fp32, not bf16
    assert seen["kw"] == {"chunk_size": 8, "output_final_state": False}  # cfg's chunk; no cache
    g = (-gdn.A_log.exp() * F.softplus(a.float() + gdn.dt_bias)).mT
    assert torch.allclose(seen["g"], g, rtol=1e-6, atol=0)
    assert torch.allclose(seen["beta"], torch.sigmoid(b.float()).mT, rtol=1e-6, atol=0)


def test_read_norm_eps_pinned_at_a_scale_where_it_matters():
    """The per-head RMSNorm of o: ε = 1e-6, seen at mean square 1e-8 (ε 1e-5 or 1e-7: > 50%)."""
    torch.manual_seed(0)
    gdn = H.GatedDeltaNet(tiny(n_head=4)).double()
    o = 1e-4 * torch.randn(1, 4, 5, 8, dtype=torch.float64)  # (B, H, n, V)
    gate = torch.randn(1, 5, 32, dtype=torch.float64)
    normed = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6)
    y = (normed.transpose(1, 2) * F.silu(gate).view(1, 5, 4, 8)).flatten(-2) @ gdn.c_proj.weight.T
    assert torch.allclose(gdn.read(o, gate), y, rtol=1e-9, atol=0)


def test_gdn_init_spans_its_ranges():
    """Yang et al.'s init on 64 heads: A ~ U(0, 16) (some A < 1, some > 8), dt log-uniform on
    [1e-3, 0.1] (some below 3e-3, some above 3e-2), dt_bias = softplus⁻¹(dt)."""
    torch.manual_seed(0)
    gdn = H.GatedDeltaNet(tiny(n_embd=256, n_head=64))
    gdn.reset_gdn_parameters()
    A, dt = gdn.A_log.exp(), F.softplus(gdn.dt_bias)
    assert A.max() <= 16 and A.min() < 1 and A.max() > 8 and A.min() >= 1e-4
    assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 0.1 + 1e-7
    assert dt.min() < 3e-3 and dt.max() > 3e-2 and (dt.log() < math.log(1e-2)).float().mean() > 0.3


def test_flops_gdn_by_value():
    """d = 32, H = 4, K = 8: write 2·32·4·24 + 2·32·8 + 2·4·4·24 + 2·3·4·8·V; read 2·2·32·4·V."""
    assert H.flops_gdn(tiny(n_head=4)) == (6144 + 512 + 768 + 1536, 4096)
    assert H.flops_gdn(tiny(n_head=4, gdn_expand_v=2)) == (8192 + 512 + 1024 + 3072, 8192)
    cfg = tiny(pattern="G G G S")
    want = 1 - H.flops_per_token(cfg, 32) / common.dense_flops_per_token(cfg, 32)
    assert H.flops_saved(cfg, 32, None, "cpu").item() == pytest.approx(want, rel=1e-6)
    cfg = tiny()
    for s in (0.0, 0.3, 1.0):  # skipped: the GDN share; flops_per_token takes the softmax share
        want = 1 - (H.flops_per_token(cfg, 32, 1 - s, sparse=True)
                    / common.dense_flops_per_token(cfg, 32))
        assert H.flops_saved(cfg, 32, torch.tensor(s), "cpu").item() == pytest.approx(
            want, rel=1e-6)


def test_temperature_schedule_from_a_start_other_than_1():
    m = H.Model(tiny(max_iters=4, tau_start=2.0, tau_end=0.5))
    m.on_step(2)
    assert m.tau.item() == pytest.approx(2.0 * 0.25 ** 0.5, rel=1e-6)
    m = H.Model(tiny(max_iters=1, tau_start=2.0, tau_end=0.5))  # a 1-step run ends at tau_end
    m.on_step(1)
    assert m.tau.item() == pytest.approx(0.5, rel=1e-6)


def test_forced_routes_report_the_routers_probabilities_and_eval_routes_carry_no_gradient():
    """Forced routes (benchmarks): the balance loss reads softmax(z) over the two mixers; eval's
    weights are the one-hot decisions themselves (no straight-through term, no gradient)."""
    torch.manual_seed(0)
    m = H.Model(tiny()).eval()
    with torch.no_grad():
        m.router.weight.normal_(0, 1.0)
    h0 = torch.randn(2, 16, 32)
    y, probs, hard = m.route(h0)
    assert not y.requires_grad and torch.equal(y, hard)
    m.forced_route = torch.rand(2, 16, 2) < 0.5
    y, probs, hard = m.route(h0)
    assert torch.allclose(probs, m.logits(h0).softmax(-1)) and torch.equal(hard[..., 1].bool(),
                                                                           m.forced_route)


def test_config_refusals_word_for_word():
    with pytest.raises(NanorouteError) as e:
        tiny(pattern="G X Y S")
    assert str(e.value) == ("pattern 'G X Y S': unknown layer 'X'; use G (GDN), R (routed), "
                            "S (softmax)")
    with pytest.raises(NanorouteError) as e:
        tiny(tau_start=0.0)
    assert str(e.value) == "Gumbel temperatures must be > 0, got tau_start=0.0, tau_end=0.5"
