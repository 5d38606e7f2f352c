"""
hybrid_attn.py: "Adaptive Attention Selection: A Proof-of-Concept for Dynamic Routing in Linear Transformers"
(../shared/papers/003), with Gated DeltaNet (Yang, Kautz, Hatamizadeh, ICLR 2025) in plain PyTorch.

Layers follow a pattern: G = Gated DeltaNet, S = softmax attention, R = routed (holds both; a router picks
one per token). Paper §2.1: `G R R S`. Every layer is pre-norm mixer + pre-norm MLP.
    routing (§2.2, parallel): one router reads layer 0's output h₀ and gives 2-way logits z_l for every routed
        layer l at once; a routed layer outputs y_G·GDN(x) + y_S·Attn(x). Train: Gumbel-softmax, hard
        straight-through y = onehot(argmax(z+γ)) − sg(p_τ) + p_τ, p_τ = softmax((z+γ)/τ). Eval: argmax z.
    balance (Switch):  L_balance = N·Σ_i f_i·P_i  (N = 2; 1 balanced, 2 collapsed), f_i the fraction of tokens
        sent to mixer i, P_i the mean router probability;  loss = L_lm + α·mean_l L_balance,  α = 0.01
    gated delta rule (per head; S ∈ R^{K×V}, g_t ≤ 0 the log decay, β_t ∈ (0,1)):
        S_t = e^{g_t}·S_{t−1};   u_t = β_t·(v_t − S_tᵀ k_t);   S_t ← S_t + k_t u_tᵀ;   o_t = S_tᵀ q_t
    GDN layer: q,k,v = SiLU(causal depthwise conv₄(W_{q,k,v} x)); q,k L2-normalised, q scaled by K^−½;
        β = σ(W_b x);  g = −exp(A_log)·softplus(W_a x + dt_bias);  y = W_o(RMSNorm_head(o) ⊙ SiLU(W_g x))
    chunkwise form (WY / UT transform; chunks of C tokens, S₀ the state entering one, L_ij = Σ_{j<s≤i} g_s,
    Γ_i = L_{i,−1} the decay since the chunk's start):
        (I + A) [W U₀] = [diag(β e^Γ) K, diag(β) V],   A_ij = β_i e^{L_ij} k_i·k_j  (i > j)
        O = (diag(e^Γ) Q − (QKᵀ ⊙ M) W) S₀ + (QKᵀ ⊙ M) U₀,   M_ij = e^{L_ij} (i ≥ j), 0 above
        next S₀ = P S₀ + R,   P = e^{Γ_C} I − Kᵀ diag(e^{L_{C,·}}) W,   R = Kᵀ diag(e^{L_{C,·}}) U₀
The state math runs in fp32 with autocast off; on CUDA, fla's Triton kernels (pip install fla-core) when installed.
Sparse inference (sparse=True, prefill, step): every token of a routed layer writes the GDN state and the
softmax K/V; a GDN token then reads through RMSNorm, W_g and W_o, a softmax token through Q, scores and W_o.

Deviations from the paper, one line each (what they cost: results/hybrid.md):
  * no τ schedule is given: ours is geometric, tau_start 1.0 → tau_end 0.5 at max_iters.
  * width, heads and lr are not given: PRESETS["paper"] guesses them (n_embd 1280: 160M, 49k vocabulary).
  * Gumbel-softmax is hard straight-through: the training forward is τ-free and equals the eval forward.
  * a route picks how a token READS: the GDN state and the softmax K/V hold every token (our reading).
  * the router runs in fp32 with autocast off: its decisions do not depend on the matmul dtype.
  * learned positions and common.py's GELU MLP around both mixers (the paper does not say).
"""
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import common
from common import NanorouteError

@dataclass
class Config(common.Config):
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    pattern: str = "G R R S"   # one letter per layer: G (GDN), R (routed), S (softmax)
    balance: float = 0.01      # α, weight of the Switch balance loss (paper: 0.01)
    tau_start: float = 1.0     # Gumbel-softmax temperature at step 0 …
    tau_end: float = 0.5       # … annealed geometrically to this at max_iters
    gdn_head_dim: int = 0      # K, key dim per GDN head (0 = n_embd // n_head); GDN uses n_head heads
    gdn_expand_v: int = 1      # V = expand_v·K, value dim per GDN head
    chunk_size: int = 64       # chunk length of the chunkwise gated delta rule
    use_fla: bool = True       # CUDA: fla's kernels if installed (pip install fla-core): autocast, eager step
    kinds = property(lambda self: "".join(self.pattern.split()))                     # the letters, spaces ignored
    head_k = property(lambda self: self.gdn_head_dim or self.n_embd // self.n_head)  # K

    def __post_init__(self):
        super().__post_init__()
        k, p = self.kinds, f"pattern {self.pattern!r}"
        bad = "".join(c for c in k if c not in "GRS")
        errors = [(len(k) != self.n_layer, f"{p} has {len(k)} layers but n_layer={self.n_layer}"),
                  (bad, f"{p}: unknown layer {bad[:1]!r}; use G (GDN), R (routed), S (softmax)"),
                  (k[:1] == "R", f"{p}: layer 0 cannot be routed (the router reads its output)"),
                  (not (self.tau_start > 0 and self.tau_end > 0),
                   f"Gumbel temperatures must be > 0, got tau_start={self.tau_start}, tau_end={self.tau_end}")]
        errors += [(getattr(self, n) < low, f"{n} must be >= {low}, got {getattr(self, n)}")
                   for n, low in (("balance", 0), ("gdn_head_dim", 0), ("gdn_expand_v", 1), ("chunk_size", 1))]
        for failed, msg in errors:
            if failed:
                raise NanorouteError(msg)


PRESETS = {"paper": {"n_layer": 4, "n_head": 10, "n_embd": 1280, "pattern": "G R R S", "balance": 0.01,
                     "max_iters": 200, "warmup_iters": 20, "learning_rate": 6e-4, "block_size": 256},
           "classroom": dict(common.CLASSROOM, pattern="G R R S", balance=0.01, max_iters=700, eval_interval=350)}


# ----------------------------------------------------------------------------------------------------
# Router decisions (the router, ln_r + one linear for every routed layer, is Model.logits)

def gumbel_like(z):
    return -torch.empty_like(z).exponential_().clamp_min(1e-20).log()              # γ ~ Gumbel(0, 1)


# ----------------------------------------------------------------------------------------------------
# Blocks: the gated delta rule (step-by-step reference, chunkwise form, fla), the GDN mixer, the layer

def gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=None):
    """q, k: (B, H, T, K); v: (B, H, T, V); g, beta: (B, H, T) -> o (B, H, T, V), state (B, H, K, V) in fp32."""
    B, H, T, K = q.shape
    dt = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):  # autocast would run the einsums in bf16
        q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
        S = q.new_zeros(B, H, K, v.size(-1)) if initial_state is None else initial_state.to(dt)
        out = []
        for t in range(T):
            S = S * g[:, :, t, None, None].exp()                                       # decay: S ← e^{g_t} S
            u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k[:, :, t], S))  # (B, H, V)
            S = S + k[:, :, t, :, None] * u[:, :, None, :]                             # delta rule write k uᵀ
            out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))                   # o_t = Sᵀ q_t
        return torch.stack(out, 2), S


@functools.lru_cache(maxsize=None)
def chunk_masks(C, device):  # (C, C+1) bool: incl (g_s counts in L_ij; column j+1 = key j, 0 = start), future
    ones = torch.ones(C, C + 1, dtype=torch.bool, device=device)
    return ones.tril(), ones.triu(2)


def gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=True):
    """gated_delta_rule_recurrent's contract, every chunk at once; the loop carries only the state S₀."""
    B, H, T, K = q.shape
    V, C = v.size(-1), chunk_size
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(q.device.type, enabled=False):
        q, k, g, beta = (t.to(dt) for t in (q, k, g[..., None], beta[..., None]))  # v: promoted by v·β below
        pad = (-T) % C  # zero padding: g = 0, β = 0, k = 0 leave the state untouched; outputs are cut off
        if pad:
            q, k, v, g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g, beta))
        N = (T + pad) // C
        q, k, v, g, beta = (t.unflatten(2, (N, C)) for t in (q, k, v, g, beta))   # (B, H, N, C, K|V|1)
        incl, future = chunk_masks(C, q.device)
        E = (g * incl).cumsum(-2).masked_fill(future, -math.inf).exp()  # (B, H, N, C, C+1): e^Γ_i, e^{L_ij}
        eG, M = E[..., :1], E[..., 1:]                                           # (.., C, 1), (.., C, C)
        bk = k * beta                                                            # β_i k_i
        # A and QKᵀ ⊙ M in one product; the UT transform's one batched solve reads only A's strictly lower part
        A, QK = (torch.cat([bk, q], -2) @ k.mT).unflatten(-2, (2, C)).mul(M[..., None, :, :]).unbind(-3)
        rhs = torch.cat([bk * eG, v * beta], -1)                                 # (B, H, N, C, K+V)
        W, U0 = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([K, V], -1)
        KdT = (k * M[..., -1, :, None]).mT                                      # Kᵀ diag(e^{L_C,·}) (B, H, N, K, C)
        flat = lambda t: t.flatten(0, 2)                                          # (B·H·N, ·, ·) views
        eGC = torch.diag_embed(eG[..., -1, :].expand(B, H, N, K))                 # e^{Γ_C} I (B, H, N, K, K)
        P = torch.baddbmm(flat(eGC), flat(KdT), flat(W), alpha=-1).view(B * H, N, K, K)
        R = (KdT @ U0).view(B * H, N, K, V)
        S = None if initial_state is None else initial_state.to(dt).reshape(B * H, K, V)
        states = [torch.zeros_like(R[:, 0]) if S is None else S]
        for n in range(N - 1 + output_final_state):  # only the state crosses chunks: S_{n+1} = P_n S_n + R_n
            S = R[:, n] if S is None else torch.baddbmm(R[:, n], P[:, n], S)
            states.append(S)
        S0 = torch.stack(states[:N], 1).view(B * H * N, K, V)                      # state entering each chunk
        Qd = torch.baddbmm(flat(q * eG), flat(QK), flat(W), alpha=-1)               # diag(e^Γ) Q − (QKᵀ⊙M) W
        o = torch.baddbmm(flat(QK @ U0), Qd, S0).view(B, H, N * C, V)[:, :, :T]    # (B, H, T, V)
        return o, S.view(B, H, K, V) if output_final_state else None


try:  # optional: flash-linear-attention's Triton kernels (CUDA); the pure-PyTorch forms above stay the reference
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as _fla_recurrent
except Exception:  # not installed, or no Triton here
    _fla_chunk = _fla_recurrent = None


def gated_delta_rule_fla(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=True):
    """The same contract through fla's chunk_gated_delta_rule (fla-core 0.6, own chunk size); scale=1: q as is."""
    dt = v.dtype if v.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    qf, kf, vf, bf = (t.transpose(1, 2).to(dt) for t in (q, k, v, beta))  # (B, T, H, ·) in one 16-bit dtype
    o, S = _fla_chunk(qf, kf, vf, g.transpose(1, 2).float(), bf, scale=1.0, output_final_state=output_final_state,
                      initial_state=None if initial_state is None else initial_state.float())
    return o.transpose(1, 2).float(), S.float() if output_final_state else None


def gated_delta_step_fla(z, ab, S, A_log, dt_bias):
    """GatedDeltaNet.step's rule in one fla kernel (fused_recurrent_gated_delta_rule, fla-core 0.6): q, k
    L2-normalised (x/√(|x|²+1e-6) there, x/max(|x|, 1e-6) here), decay e^g, write, read o = Sᵀq; in fp32.
    z (B, ch) fp32 conv outputs [q, k, v]; ab (B, 2H) [−W_a x, W_b x]; S (B, H, K, V) fp32 -> o (B, H, 1, V)."""
    B, H, K, V = S.shape
    q, k, v = (t.view(B, 1, H, -1) for t in z.split([H * K, H * K, H * V], -1))  # (B, 1, H, K|V) views
    o, S1 = _fla_recurrent(q, k, v, g=-ab[:, None, :H], beta=ab[:, None, H:], scale=1.0, initial_state=S,
                           output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)  # g, β from raw a, b
    S.copy_(S1)                                                                    # the cache's S, in place
    return o.transpose(1, 2)                                                       # (B, H, 1, V) fp32


class GatedDeltaNet(nn.Module):  # write(h): the recurrence over every token; read(o, gate): outputs of some
    def __init__(self, cfg):
        super().__init__()
        H, K, V = cfg.n_head, cfg.head_k, cfg.gdn_expand_v * cfg.head_k
        self.H, self.K, self.V, self.chunk, self.use_fla = H, K, V, cfg.chunk_size, cfg.use_fla
        ch = H * (2 * K + V)
        self.qkv_proj = nn.Linear(cfg.n_embd, ch, bias=False)
        self.conv = nn.Conv1d(ch, ch, 4, groups=ch, bias=False)  # depthwise, made causal by left padding
        self.a_proj = nn.Linear(cfg.n_embd, H, bias=False)       # → decay rate
        self.b_proj = nn.Linear(cfg.n_embd, H, bias=False)       # → β
        self.g_proj = nn.Linear(cfg.n_embd, H * V, bias=False)   # output gate
        self.A_log = nn.Parameter(torch.zeros(H))                # 1-D: make_optimizer puts it in no-decay
        self.dt_bias = nn.Parameter(torch.zeros(H))
        self.norm_weight = nn.Parameter(torch.ones(V))           # per-head RMSNorm gain
        self.c_proj = nn.Linear(H * V, cfg.n_embd, bias=cfg.bias)  # named like attention's: residual init
        self.dropout = cfg.dropout

    @torch.no_grad()
    def reset_gdn_parameters(self):  # A ~ U(0, 16), dt log-uniform in [1e-3, 0.1], dt_bias = softplus⁻¹(dt)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).clamp_min(1e-4).log())
        dt = torch.exp(torch.rand_like(self.dt_bias) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))    # inverse softplus
        self.conv.reset_parameters()

    def write(self, h, cache=None):  # normed h (B, T, C) -> o = Sᵀq (B, H, T, V) fp32; fills a decode cache
        T, H, K, V = h.size(1), self.H, self.K, self.V
        f32 = torch.float64 if h.dtype == torch.float64 else torch.float32
        p = self.qkv_proj(h).mT                                                     # (B, ch, T)
        z = F.silu(F.conv1d(p, self.conv.weight, padding=3, groups=p.size(1))[..., :T])  # causal: t sees t−3..t
        qk = z[:, :2 * H * K].unflatten(1, (2, H, K)).permute(1, 0, 2, 4, 3)        # (2, B, H, T, K) view
        # one copy: fp32, each head's (T, K) contiguous, so that the chunked form's matmuls take views
        q, k = F.normalize(qk.to(f32, memory_format=torch.contiguous_format), dim=-1, eps=1e-6)
        v = z[:, 2 * H * K:].unflatten(1, (H, V)).mT                                # (B, H, T, V)
        beta = torch.sigmoid(self.b_proj(h).to(f32)).mT                             # (B, H, T)
        g = (-self.A_log.exp() * F.softplus(self.a_proj(h) + self.dt_bias)).mT     # (B, H, T); bf16 + fp32 → fp32
        fast = self.use_fla and _fla_chunk is not None and v.is_cuda and v.dtype in (torch.float16, torch.bfloat16)
        rule = gated_delta_rule_fla if fast else gated_delta_rule_chunked
        o, S = rule(q, k, v, g, beta, chunk_size=self.chunk, output_final_state=cache is not None)
        if cache is not None:
            gdn_decode_cache(self, cache, S, p, h.dtype)
        return o

    def read(self, o, gate, token_major=False, out=None):
        """o = Sᵀq (B, H, n, V) fp32, gate = W_g x (B, n, H·V) -> (B, n, C); token_major: (n, B, ·) for both. q is
        unscaled (write()): RMSNorm(o·K^−½, ε) = RMSNorm(o, K·ε). out: the decode step's buffer (matmul dtype)."""
        o = F.rms_norm(o, (self.V,), self.norm_weight.to(o.dtype), eps=1e-6 * self.K)     # per head
        o = o.permute(2, 0, 1, 3) if token_major else o.transpose(1, 2)            # (n, B, H, V) | (B, n, H, V)
        o = torch.mul(F.silu(gate).unflatten(-1, (self.H, self.V)), o, out=out)  # the gate first: its layout
        return common.dropout(self.c_proj(o.flatten(-2)), self.dropout, self.training)

    def forward(self, h, cache=None):
        return self.read(self.write(h, cache), self.g_proj(h))

    @torch.no_grad()
    def step(self, y, cache, read=True):  # y = h cache["w"]ᵀ (B, 1, ·), GDN's first; conv, S updated in place
        B, H, K, V = y.size(0), self.H, self.K, self.V
        ch = H * (2 * K + V)                                                        # conv channels [q, k, v]
        ab, gate = y[:, 0, ch:ch + H * (2 + V)].split([2 * H, H * V], -1)          # [−W_a x, W_b x], W_g x
        S = cache["S"].view(B * H, K, V)                                            # fp32, updated in place
        with torch.autocast(y.device.type, enabled=False):
            # [p, ab] in one: ab's rows have taps [1, 0, 0, 0] and the constant sums [−dt_bias, 0] (fp32 adds)
            z = torch.addcmul(cache["conv"], y[:, 0, :ch + 2 * H, None], cache["taps"])  # (B, ch + 2H, 4)
            cache["conv"][..., :3].copy_(z[..., 1:])                                # next sums
            z, s = F.silu(z[:, :ch, 0]), z[:, ch:, 0]                               # (B, ch), (B, 2H) fp32
            if self.use_fla and _fla_recurrent is not None and y.is_cuda and not torch.compiler.is_compiling():
                o = gated_delta_step_fla(z, ab, cache["S"], self.A_log, self.dt_bias)  # 1 kernel, 4 ops: the 10 below
            else:
                q, k = F.normalize(z[:, :2 * H * K].unflatten(-1, (2, H, K)), dim=-1, eps=1e-6).unbind(1)
                # e^g = exp(−A·softplus(a + dt_bias)) = σ(−a − dt_bias)^A: −W_a stored, the bias added above
                s = torch.sigmoid(s)                                                # (B, 2H): σ(−a − dt_bias), β
                S.mul_(s[:, :H].pow(cache["A"]).view(B * H, 1, 1))                  # S ← e^g S
                v = z[:, 2 * H * K:].reshape(B * H, 1, V)                             # a view at B=1, a copy above
                u = torch.baddbmm(v, k.reshape(B * H, 1, K), S, alpha=-1)           # v − Sᵀk
                S.baddbmm_(k.reshape(B * H, K, 1), u * s[:, H:].reshape(B * H, 1, 1))  # S ← S + k(β(v − Sᵀk))ᵀ
                o = (q.reshape(B * H, 1, K) @ S).view(B, H, 1, V) if read else None  # Sᵀq
        return self.read(o, gate[:, None], out=cache["read"]) if read else None


class Layer(nn.Module):  # pre-norm mixer + pre-norm MLP; G has gdn, S attn (names as common.Block), R both
    def __init__(self, cfg, kind):
        super().__init__()
        self.kind = kind
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        if kind in "SR":
            self.attn = common.CausalSelfAttention(cfg)
        if kind in "GR":
            self.gdn = GatedDeltaNet(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = common.MLP(cfg)

    def normed(self, x):  # ln_1(x) in autocast's matmul dtype: cast once, sparing each F.linear of it a cast
        dev = x.device.type
        return self.ln_1(x).to(torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype)

    def forward(self, x, cache=None, y=None, plan=None):  # y (B, T, 2): R's weights [GDN, softmax]
        h = self.normed(x)
        if self.kind == "G":
            mix = self.gdn(h, cache)
        elif self.kind == "S":
            q, k, v = self.attn.qkv(h)                                              # (B, nh, T, hs)
            if cache is not None:                                                   # prefill: K/V into a KVCache
                cache["kv"] = common.KVCache(x.size(0), cache["block_size"], k, v)
            mix = common.dropout(self.attn.c_proj(self.attn.attend(q, k, v)), self.attn.dropout, self.training)
        elif plan is None:
            mix = y[..., :1] * self.gdn(h) + y[..., 1:] * self.attn(h)             # (B, T, C)
        else:
            mix = sparse_mix(self.gdn, self.attn, h, plan, cache)
        x = x + mix                                   # fp32 + bf16 promotes with the same values: no cast op
        return x + self.mlp(self.ln_2(x))

    def step(self, x, cache, pos, mask, soft=None, reads=(True, True)):  # x (B, 1, C); soft (B, 1): R's choice
        h = self.normed(x)
        y = self.attn.c_attn(h) if self.kind == "S" else F.linear(h, cache["w"], cache["b"])  # one matmul
        g = self.gdn.step(y, cache, reads[0]) if self.kind in "GR" else None     # (B, 1, C) each, if run
        if self.kind in "SR":  # every token's K/V go into the cache; its query attends only if read
            q, k, v = (self.attn.split_heads(t) for t in y[..., -3 * x.size(-1):].chunk(3, -1))  # (B, nh, 1, hs)
            k, v = cache["kv"].append(pos, k, v)                                    # (B, nh, S, hs), masked
        a = self.attn.c_proj(self.attn.attend(q, k, v, attn_mask=mask)) if self.kind in "SR" and reads[1] else None
        x = x + (a if g is None else g if a is None else torch.where(soft[..., None], a, g))
        return x + self.mlp(self.ln_2(x))


# ----------------------------------------------------------------------------------------------------
# Model

class Model(common.LM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = nn.ModuleList([Layer(cfg, kind) for kind in cfg.kinds])
        self.routed = [i for i, kind in enumerate(cfg.kinds) if kind == "R"]
        if self.routed:  # one router after layer 0 for every routed layer (parallel routing, §2.2)
            self.ln_r = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
            self.router = nn.Linear(cfg.n_embd, 2 * len(self.routed), bias=False)
        # τ is a buffer, not a float attribute: torch.compile would recompile for every new value of a float
        self.register_buffer("tau", torch.tensor(cfg.tau_start), persistent=False)
        self.forced_route = None  # (B, T, n_routed) bool, True = softmax: benchmarks/tests force decisions
        self.init_weights()
        self.apply(lambda m: m.reset_gdn_parameters() if isinstance(m, GatedDeltaNet) else None)

    def on_step(self, it):
        c = self.cfg
        self.tau.fill_(c.tau_start * (c.tau_end / c.tau_start) ** min(1.0, it / max(1, c.max_iters)))

    def logits(self, h0):  # router logits z (B, T, nR, 2) of layer 0's output h0 (B, T, C), fp32 under autocast
        with torch.autocast(h0.device.type, enabled=False):
            return self.router(self.ln_r(h0)).float().unflatten(-1, (len(self.routed), 2))

    def route(self, h0):  # h0 (B, T, C) -> weights y (B, T, nR, 2) [GDN, softmax], probs, hard (fp32)
        z, f = self.logits(h0), self.forced_route
        if f is not None:
            hard = torch.stack([~f, f], -1)[:, :h0.size(1)].to(z)
            return hard, z.softmax(-1), hard
        soft = ((z + gumbel_like(z)) / self.tau).softmax(-1) if self.training else z  # p_τ; eval: argmax z
        # onehot(argmax), a tie to GDN (F.one_hot would check its range on the host)
        hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(-1, keepdim=True), 1.0)
        return (hard - soft.detach() + soft if self.training else hard), z.softmax(-1), hard  # straight-through

    def forward(self, idx, targets=None, sparse=False, caches=None):  # caches: a dict per layer, prefill's
        if (sparse or caches is not None) and self.training:
            raise NanorouteError("sparse=True is the inference path: call model.eval() first")
        cs = caches or [None] * len(self.blocks)
        x = self.blocks[0](self.embed(idx), cs[0])                                  # (B, T, C)
        if self.routed:
            y, probs, hard = self.route(x)                                          # (B, T, nR, 2)
            plans = sparse_plan(hard) if sparse else [None] * len(self.routed)
        routes = {i: (y[:, :, r], plans[r]) for r, i in enumerate(self.routed)}     # routed layer i: (y_i, plan_i)
        for i, layer in enumerate(self.blocks[1:], start=1):
            x = layer(x, cs[i], *routes.get(i, ()))
        logits, loss = self.head(x if caches is None else x[:, -1:], targets)
        stats = {} if loss is None else {"lm_loss": loss}
        if self.routed:
            gdn_frac = hard[..., 0].mean((0, 1))                                    # (nR,) took the cheap path
            for r, i in enumerate(self.routed):
                stats[f"skip_l{i}"] = stats[f"gdn_frac_l{i}"] = gdn_frac[r]
            stats["skipped"] = gdn_frac.mean()
            if self.training:
                stats["tau"] = self.tau.clone()
        stats["flops_saved_hard"] = flops_saved(self.cfg, idx.size(1), stats.get("skipped"), idx.device)
        if loss is not None and not self.training:  # the noise-free training forward is this one (hard ST)
            stats["soft_loss"] = loss
        if loss is not None and self.routed:  # a loss term: only where there is a loss
            stats["balance"] = balance_loss(probs, hard)
            loss = loss + self.cfg.balance * stats["balance"]
        return logits, loss, {k: v.detach() for k, v in stats.items()}

    @torch.no_grad()
    def prefill(self, idx):  # sparse forward of idx (B, T) filling every layer's cache -> logits (B, V), state
        caches = [{"block_size": self.cfg.block_size} for _ in self.blocks]
        logits, _, _ = self(idx, sparse=True, caches=caches)
        return logits[:, -1], (caches, torch.tensor(idx.size(1), device=idx.device))

    @torch.no_grad()
    def step(self, tok, state):  # tok (B, 1) at pos (0-d) -> logits (B, V); no shape changes from token to token
        caches, pos = state
        x = self.wte(tok) + self.wpe(pos)                                          # (B, 1, C)
        kv = [c["kv"] for c in caches if "kv" in c]
        mask = common.past_mask(pos, self.cfg.block_size, kv[0].k.dtype) if kv else None  # (1, S)
        x = self.blocks[0].step(x, caches[0], pos, mask)
        routes = decode_routes(self, x, pos) if self.routed else {}
        for i, layer in enumerate(self.blocks[1:], start=1):
            x = layer.step(x, caches[i], pos, mask, *routes.get(i, ()))
        return self.head(x)[0][:, -1], (caches, pos + 1)

    @torch.no_grad()
    def routing_map(self, idx):  # idx (1, T) -> m (nR, T) on CPU (1 = softmax), rows, legend: eval decisions
        was_training, hard = self.training, torch.zeros(1, idx.size(1), 0, 2)       # (1, T, nR, 2)
        if self.routed:
            hard = self.eval().route(self.blocks[0](self.embed(idx)))[2]
        self.train(was_training)
        return hard[0, :, :, 1].T.float().cpu(), [f"layer {i}" for i in self.routed], ("GDN (linear)", "softmax")


# ----------------------------------------------------------------------------------------------------
# Losses

def balance_loss(probs, hard):  # Switch's N·Σ_i f_i·P_i per routed layer, mean over layers; (..., n_routed, N)
    f = hard.detach().flatten(0, -3).float().mean(0)                               # (n_routed, N) token fractions
    P = probs.flatten(0, -3).float().mean(0)                                       # (n_routed, N) mean probabilities
    return torch.dot(f.flatten(), P.flatten()) * (probs.size(-1) / probs.size(-2))  # · N / n_routed


# ----------------------------------------------------------------------------------------------------
# Sparse inference: a routed layer runs each read only for the tokens routed to it

@functools.lru_cache(maxsize=8)
def causal_mask(T, dtype, device):  # additive (T, T), made once: SDPA takes it as is (a bool one costs 3 ops)
    return torch.full((T, T), -math.inf, dtype=dtype, device=device).triu(1)


def sparse_plan(hard):
    """hard (B, T, nR, 2) -> per routed layer (order, dump, n_gdn, n_soft). order (B, T): a row's GDN tokens, then
    its softmax ones; GDN reads take slots [0, n_gdn), softmax [T − n_soft, T), some holding the other kind's."""
    T = hard.size(1)
    kind, order = hard[..., 1].sort(dim=1, stable=True)                            # (B, T, nR): GDN first
    counts = kind.sum(1).T.tolist()                                                # (nR, B) softmax tokens: the sync
    dump = order.masked_fill(kind < 0.5, T)                                        # GDN in softmax slots → row T
    return [(order[..., r], dump[..., r], T - int(min(c)), int(max(c))) for r, c in enumerate(counts)]


def sparse_mix(gdn, attn, h, plan, cache=None):  # normed h (B, T, C) -> a routed layer's mixer output (B, T, C)
    order, dump, n_gdn, n_soft = plan
    B, T, C = h.shape
    # token-major (T, B, ·): each kind's slots are contiguous rows, which a GEMM takes without a copy
    hs = h.transpose(0, 1).gather(0, order.T[..., None].expand(-1, -1, C))         # (T, B, C) GDN tokens first
    mix = h.new_zeros(T + 1, B, C)                                                 # row T: the dump
    if n_gdn or cache is not None:
        o = gdn.write(h, cache)                                                    # (B, H, T, V) every token
    if n_gdn:  # first: its padding slots hold softmax tokens, which the softmax read overwrites
        rows = order[:, :n_gdn]                                                    # (B, n_gdn)
        o = o.gather(2, rows[:, None, :, None].expand(-1, gdn.H, -1, gdn.V))       # (B, H, n_gdn, V)
        out = gdn.read(o, gdn.g_proj(hs[:n_gdn]), token_major=True)                # (n_gdn, B, C)
        mix.scatter_(0, rows.T[..., None].expand(-1, -1, C), out)
    w, b = attn.c_attn.weight.detach().to(h.dtype), attn.c_attn.bias                # one cast for Q and K, V
    if n_soft or cache is not None:
        kv = F.linear(h, w[C:], None if b is None else b[C:])
        k, v = (attn.split_heads(t) for t in kv.split(C, -1))                      # (B, nh, T, hs) every token
        if cache is not None:  # the step's one matmul gives GDN's projections and then Q, K, V
            cache["kv"] = common.KVCache(B, cache["block_size"], k, v)
            cache["w"] = torch.cat([cache["w"], w])
            cache["b"] = None if b is None else F.pad(b.to(h.dtype), (cache["rows"], 0))
    if n_soft:
        q = F.linear(hs[T - n_soft:], w[:C], None if b is None else b[:C])         # (n_soft, B, C)
        q = attn.split_heads(q.transpose(0, 1))                                    # (B, nh, n_soft, hs)
        mask = causal_mask(T, h.dtype, h.device)[order[:, T - n_soft:]][:, None]   # (B, 1, n_soft, T)
        # n_soft varies: on CUDA, cuDNN would set itself up anew per length (DTRNet's bf16 step: 14x slower)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            y = attn.attend(q, k, v, attn_mask=mask).transpose(0, 1)               # (n_soft, B, C), q's layout
        mix.scatter_(0, dump[:, T - n_soft:].T[..., None].expand(-1, -1, C), attn.c_proj(y))
    return mix[:T].transpose(0, 1)                                                 # (B, T, C) view


# ----------------------------------------------------------------------------------------------------
# Cached decoding (common.LM.generate drives prefill/step): GDN state and conv sums, preallocated KV caches

@torch.no_grad()
def gdn_decode_cache(gdn, cache, S, p, dtype):
    """Made once at prefill for GDN.step: S (B, H, K, V) and the conv's partial sums (ab's rows: [−dt_bias, 0]),
    updated in place (fixed addresses: a CUDA graph); [W_qkv; −W_a; W_b; W_g; 0] in matmul dtype; A = e^{A_log}."""
    ch, f32 = p.size(1), S.dtype                                                    # p: conv inputs (B, ch, T)
    with torch.autocast(p.device.type, enabled=False):
        tail = F.pad(p, (3, 0))[..., -3:].to(f32)                                   # last 3 conv inputs (B, ch, 3)
        # s_j: what the tail adds to conv output T−1+j (j = 1, 2, 3); step() adds each new input's part to all
        sums = F.conv1d(F.pad(tail, (0, 3)), gdn.conv.weight.to(f32), groups=ch)   # (B, ch, 3)
    ab_bias = torch.cat([-gdn.dt_bias, torch.zeros_like(gdn.dt_bias)]).to(f32)      # (2H,)
    cache["conv"] = torch.cat([F.pad(sums, (0, 1)), ab_bias[:, None].expand(sums.size(0), -1, 4)], 1)  # (B, ch+2H, 4)
    cache["taps"] = torch.cat([gdn.conv.weight[:, 0].flip(-1).to(f32),             # (ch, 4): w₃ (z_t), w₂, w₁, w₀
                               F.pad(ab_bias.new_ones(2 * gdn.H, 1), (0, 3))])      # (2H, 4): 1, 0, 0, 0
    cache["S"] = S.contiguous()
    w = torch.cat([gdn.qkv_proj.weight, -gdn.a_proj.weight, gdn.b_proj.weight, gdn.g_proj.weight]).to(dtype)
    # zero rows to a multiple of 8: the Q appended after starts on 16 bytes, which CUDA's fused attention assumes
    cache["w"] = F.pad(w, (0, 0, 0, -w.size(0) % 8))  # unchecked (pytorch/pytorch#183484: 'misaligned address')
    cache["rows"], cache["b"] = cache["w"].size(0), None
    cache["read"] = S.new_empty(S.size(0), 1, gdn.H, gdn.V, dtype=dtype)  # W_o's input in its dtype: no cast op
    cache["A"] = gdn.A_log.exp().to(f32)
    for t in (cache["S"], cache["conv"], cache["read"]):
        torch._dynamo.mark_static_address(t)


def decode_routes(model, h0, pos):
    """{layer i: (soft (B, 1) bool, reads (GDN?, softmax?))}. Eager: one host sync a token finds the reads a row
    needs (B=1: one read, soft None). Compiled: both reads, torch.where picks per row: one graph, every token."""
    eager, f = not torch.compiler.is_compiling(), model.forced_route
    z = model.logits(h0) if f is None else None                                    # (B, 1, nR, 2)
    if eager and z is not None and h0.size(0) == 1:  # the host compares the logits itself: no soft tensor, no sum
        return {i: (None, (not z1 > z0, z1 > z0)) for i, (z0, z1) in zip(model.routed, z.view(-1, 2).tolist())}
    soft = z[..., 1] > z[..., 0] if f is None else f.index_select(1, pos.view(1))  # argmax, a tie to GDN
    n = soft.sum((0, 1)).tolist() if eager else [None] * soft.size(-1)            # (nR,) rows reading softmax
    reads = [(True, True) if c is None else (c < soft.size(0), c > 0) for c in n]  # compiled: both, no sync
    return {i: (soft[:, :, r], reads[r]) for r, i in enumerate(model.routed)}


# ----------------------------------------------------------------------------------------------------
# Accounting (forward FLOPs per token, common.py's conventions: multiply-adds × 2)

def flops_gdn(cfg):
    """(write, read) per token: W_{q,k,v}, W_a, W_b, conv, Sᵀk, k uᵀ, Sᵀq (chunked: every token); W_g, W_o."""
    d, H, K, V = cfg.n_embd, cfg.n_head, cfg.head_k, cfg.gdn_expand_v * cfg.head_k
    write = 2 * d * H * (2 * K + V) + 2 * d * 2 * H + 2 * 4 * H * (2 * K + V) + 2 * 3 * H * K * V
    return write, 2 * d * H * V + 2 * H * V * d


def flops_per_token(cfg, T, soft_frac=0.0, sparse=False):
    """FLOPs per token, dense-hard (both mixers) or sparse; soft_frac: the softmax share (a list: per layer)."""
    d = cfg.n_embd
    fracs = soft_frac if isinstance(soft_frac, (list, tuple)) else [soft_frac] * cfg.kinds.count("R")
    kv = 2 * common.flops_qkv(d) / 3                                                # K, V: every token
    q_scores_out = common.flops_qkv(d) / 3 + common.flops_attn_scores(d, common.mean_context(T)) \
        + common.flops_attn_out(d)                                                  # what a softmax query adds
    write, read = flops_gdn(cfg)
    total = common.flops_lm_head(d, cfg.vocab_size) + cfg.n_layer * common.flops_ffn(d, 4 * d)
    total += sum(kv + q_scores_out if k == "S" else write + read for k in cfg.kinds if k != "R")
    for s in fracs:  # routed layers: the router's 2 logits, both writes, then the reads
        total = total + 2 * d * 2 + write + kv + ((1 - s) * read + s * q_scores_out if sparse else read + q_scores_out)
    return total


def flops_saved(cfg, T, skipped, device):
    """1 − sparse / dense-GPT FLOPs per token; skipped: the GDN share of routed token-layers (0-d; None: none)."""
    dense = common.dense_flops_per_token(cfg, T)
    all_gdn, all_soft = (flops_per_token(cfg, T, s, sparse=True) for s in (0.0, 1.0))  # linear in s: 2 tensor ops
    if skipped is None:
        return torch.full((), 1 - all_gdn / dense, device=device)
    return skipped * ((all_soft - all_gdn) / dense) + (1 - all_soft / dense)
