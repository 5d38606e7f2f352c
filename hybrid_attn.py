"""
hybrid_attn.py: "Adaptive Attention Selection: A Proof-of-Concept for Dynamic Routing in Linear Transformers"
(the paper in ../shared/papers/003), with Gated DeltaNet (Yang, Kautz, Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", ICLR 2025) written in plain PyTorch.

Layers follow a pattern string: G = Gated DeltaNet, S = softmax attention, R = routed (holds both; a router
picks one per token). Paper §2.1: `G R R S`. Every layer is pre-norm mixer + pre-norm MLP.

Gated delta rule (per head; S ∈ R^{K×V}, g_t ≤ 0 the log decay, β_t ∈ (0,1)):
    S_t = exp(g_t)·S_{t−1};   u_t = β_t·(v_t − S_tᵀ k_t);   S_t ← S_t + k_t u_tᵀ;   o_t = S_tᵀ q_t
Chunkwise (WY / UT transform) form, chunk of C tokens, S₀ the state entering it, L_ij = Σ_{j<s≤i} g_s
(summed from j+1, never as a difference of two large cumulative sums), Γ_t = Σ_{s≤t in chunk} g_s:
    (I + A) U = diag(β) V − diag(β e^Γ) K S₀,   A_ij = β_i e^{L_ij} k_i·k_j  for i > j (strictly lower)
    O = diag(e^Γ) Q S₀ + (Q Kᵀ ⊙ M) U,           M_ij = e^{L_ij} for i ≥ j, 0 above
    S_C = e^{Γ_C} S₀ + Kᵀ diag(e^{L_{C,·}}) U
The state math always runs in fp32 (fp64 for fp64 inputs), with autocast switched off inside it. Optional:
use_fla=true runs fla's Triton kernel on CUDA instead (tested against this form where both exist).
GDN layer: q,k,v = SiLU(causal depthwise conv₄(W_{q,k,v} x)); q,k L2-normalised, q scaled by K^−½;
    β = σ(W_b x);  g = −exp(A_log)·softplus(W_a x + dt_bias);  y = W_o(RMSNorm_head(o) ⊙ SiLU(W_g x))
Routing (§2.2, parallel): one router reads layer 0's output h₀ and gives 2-way logits z_l for every routed
layer l at once. Train: Gumbel-softmax, hard straight-through, y = onehot(argmax(z+γ)) − sg(p_τ) + p_τ with
p_τ = softmax((z+γ)/τ); a routed layer outputs y_G·GDN(x) + y_S·Attn(x). Eval: argmax z, no noise.
Switch balance loss per routed layer (N = 2 mixers):  L_bal = N·Σ_i f_i·P_i  (1 balanced, 2 collapsed),
    f_i = fraction of tokens sent to mixer i (hard), P_i = mean router probability softmax(z)_i (no noise);
    loss = L_lm + α·mean_l L_bal,  α = 0.01 (paper).
Temperature schedule (the paper does not give one): τ(it) = τ_start·(τ_end/τ_start)^(it/max_iters),
geometric from 1.0 to 0.5. With hard straight-through the forward pass does not depend on τ (argmax of
z+γ is τ-free); τ only sharpens the surrogate gradient. So the noise-free training forward IS the eval
forward: eval's `soft_loss` equals its hard loss by construction.

What a route means (our reading of the paper's y_G·GDN(x) + y_S·Attn(x), where GDN and Attn are causal
sequence layers over the whole layer input, as in training): the route picks how a token READS the context;
the context itself — the GDN state and the softmax keys/values — holds every token. Inference (sparse=True,
prefill, step) computes in a routed layer, exactly equal to that definition:
    every token    GDN write: W_{q,k,v} x (q too: the conv mixes it into the next 3 tokens' queries), conv,
                   β, g, the state update (the chunked form also reads Sᵀq for all); softmax K, V (cache)
    GDN token      + RMSNorm, the SiLU gate W_g x, W_o                    (skips softmax Q, scores, W_o)
    softmax token  + Q, scores over every earlier token, W_o              (skips GDN's gate, norm, W_o)
The MoE-style alternative (each mixer sees only its own tokens: GDN tokens skip K/V, softmax tokens the
whole GDN) is a different model, trained differently; not implemented. sparse=True: one host sync per
forward (sizes of the gathers for all routed layers); step(): one per token, at B=1 it skips exactly.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import NanorouteError

KINDS = {"G": "Gated DeltaNet", "R": "routed", "S": "softmax attention"}


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
    use_fla: bool = False      # on CUDA, run the gated delta rule with fla's Triton kernel (pip install fla-core)

    def __post_init__(self):
        super().__post_init__()
        letters = self.pattern.split() if " " in self.pattern.strip() else list(self.pattern.strip())
        if len(letters) != self.n_layer:
            raise NanorouteError(f"pattern {self.pattern!r} has {len(letters)} layers but n_layer={self.n_layer}")
        bad = [c for c in letters if c not in KINDS]
        if bad:
            raise NanorouteError(f"pattern {self.pattern!r}: unknown layer {bad[0]!r}; use G (GDN), R (routed), S (softmax)")
        if letters[0] == "R":
            raise NanorouteError(f"pattern {self.pattern!r}: layer 0 cannot be routed (the router reads its output)")
        if self.balance < 0:
            raise NanorouteError(f"balance (α) must be >= 0, got {self.balance}")
        if not (self.tau_start > 0 and self.tau_end > 0):
            raise NanorouteError(f"Gumbel temperatures must be > 0, got tau_start={self.tau_start}, tau_end={self.tau_end}")
        for name in ("gdn_head_dim", "gdn_expand_v", "chunk_size"):
            if getattr(self, name) < (0 if name == "gdn_head_dim" else 1):
                raise NanorouteError(f"{name} must be >= {0 if name == 'gdn_head_dim' else 1}, got {getattr(self, name)}")
        if self.use_fla and _fla_chunk is None:
            raise NanorouteError("use_fla=true needs flash-linear-attention (pip install fla-core) and Triton")

    @property
    def kinds(self):
        return "".join(self.pattern.split())

    @property
    def head_k(self):
        return self.gdn_head_dim or self.n_embd // self.n_head


# The paper: ~160M parameters, 4 layers, 200 steps, α = 0.01. Width, heads and lr are not given: n_embd 1280
# gives 160M with a 49k (SmolLM) vocabulary; on Shakespeare chars the same preset is ~97M.
PRESETS = {"paper": {"n_layer": 4, "n_head": 10, "n_embd": 1280, "pattern": "G R R S", "balance": 0.01,
                     "max_iters": 200, "warmup_iters": 20, "learning_rate": 6e-4, "block_size": 256},
           "classroom": dict(common.CLASSROOM, pattern="G R R S", balance=0.01, max_iters=700, eval_interval=350)}


# ----------------------------------------------------------------------------------------------------
# Gated delta rule: the step-by-step reference and the chunkwise-parallel form

def gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=None):
    """q, k: (B, H, T, K); v: (B, H, T, V); g, beta: (B, H, T). Returns o (B, H, T, V), state (B, H, K, V),
    both fp32 (fp64 for fp64 inputs) whatever the input dtype or autocast."""
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


def gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=64, initial_state=None):
    """Same contract as gated_delta_rule_recurrent. Everything within a chunk is batched over all chunks;
    the sequential loop carries only the state (3 kernels per chunk); outputs are one batched product."""
    B, H, T, K = q.shape
    V, C = v.size(-1), chunk_size
    dt = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
        pad = (-T) % C  # zero padding: g = 0, β = 0, k = 0 leave the state untouched; outputs are cut off
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        N = (T + pad) // C
        q, k, v = (t.reshape(B, H, N, C, -1) for t in (q, k, v))                  # (B, H, N, C, K|V)
        g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        L = (g[..., :, None] * lower.tril(-1)).cumsum(-2)     # L_ij = Σ_{j<s≤i} g_s (B, H, N, C, C), no cancellation
        M = L.masked_fill(~lower, -math.inf).exp()            # e^{L_ij} for i ≥ j, 0 above: mask before exp
        Gam = g.cumsum(-1)                                     # Γ_t (B, H, N, C): decay from the chunk start
        A = ((beta[..., None] * k) @ k.transpose(-1, -2)) * M  # only its strictly lower part is read below
        rhs = torch.cat([(beta * Gam.exp())[..., None] * k, beta[..., None] * v], -1)  # (B, H, N, C, K+V)
        # UT transform: one batched unit-lower-triangular solve (the diagonal is taken as 1) gives W and U₀
        W, U0 = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([K, V], -1)
        # the loop runs over chunks with (B·H) batched: chunk-major copies make each step's operands contiguous
        chunk_major = lambda t: t.permute(2, 0, 1, 3, 4).reshape(N, B * H, *t.shape[-2:])
        W, U0 = chunk_major(W), chunk_major(U0)                                   # (N, BH, C, K|V)
        KdT = chunk_major((k * L[..., -1, :, None].exp()).transpose(-1, -2))     # e^{L_C,·}-weighted Kᵀ (N, BH, K, C)
        decay = Gam[..., -1].exp().permute(2, 0, 1).reshape(N, B * H, 1, 1)      # e^{Γ_C}
        S = q.new_zeros(B * H, K, V) if initial_state is None else initial_state.to(dt).reshape(B * H, K, V)
        states, us = [], []
        for n in range(N):  # only the state crosses chunk boundaries: 3 kernels per chunk
            states.append(S)
            us.append(torch.baddbmm(U0[n], W[n], S, alpha=-1))                     # U = U₀ − W S₀ (BH, C, V)
            S = torch.baddbmm(S * decay[n], KdT[n], us[-1])                        # S_C
        S0 = torch.stack(states, 1).view(B, H, N, K, V)                            # state entering each chunk
        U = torch.stack(us, 1).view(B, H, N, C, V)
        o = (q * Gam.exp()[..., None]) @ S0 + ((q @ k.transpose(-1, -2)) * M) @ U  # (B, H, N, C, V)
        return o.view(B, H, N * C, V)[:, :, :T], S.view(B, H, K, V)


try:  # optional: flash-linear-attention's Triton kernel (CUDA); the pure-PyTorch forms above stay the reference
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
except Exception:  # not installed, or no Triton here
    _fla_chunk = None


def gated_delta_rule_fla(q, k, v, g, beta, chunk_size=64, initial_state=None):
    """The same contract through fla's kernel (its layout is (B, T, H, ·); q arrives already scaled)."""
    dt = v.dtype if v.dtype != torch.float32 else torch.bfloat16  # the kernel wants one 16-bit dtype for q, k, v
    qf, kf, vf = (t.transpose(1, 2).to(dt) for t in (q, k, v))                     # (B, T, H, K|V)
    o, S = _fla_chunk(qf, kf, vf, g.transpose(1, 2).float(), beta.transpose(1, 2).to(dt), scale=1.0,
                      initial_state=None if initial_state is None else initial_state.float(), output_final_state=True)
    return o.transpose(1, 2).float(), S.float()


class GatedDeltaNet(nn.Module):
    """The GDN token mixer. forward(x, cache, rows): the recurrence over every token; the output (norm, gate,
    W_o) only for `rows` (B, n) when given. step(x, cache, read) decodes one token."""

    def __init__(self, cfg):
        super().__init__()
        H, K = cfg.n_head, cfg.head_k
        V = cfg.gdn_expand_v * K
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
        self.drop = nn.Dropout(cfg.dropout)

    @torch.no_grad()
    def reset_gdn_parameters(self):
        """GDN inits: A ~ U(0, 16), dt log-uniform in [1e-3, 0.1], dt_bias = softplus⁻¹(dt); default conv init."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).clamp_min(1e-4).log())
        dt = torch.exp(torch.rand_like(self.dt_bias) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))    # inverse softplus
        self.conv.reset_parameters()

    def _inputs(self, x, z):
        """x: normed input (B, T, C); z: conv output (B, T, ch) -> q, k, v (B, H, T, ·), g, β (B, H, T) fp32."""
        B, T, _ = x.shape
        q, k, v = F.silu(z).split([self.H * self.K, self.H * self.K, self.H * self.V], -1)
        q, k, v = (t.view(B, T, self.H, -1).transpose(1, 2) for t in (q, k, v))  # (B, H, T, K|V)
        f32 = torch.promote_types(x.dtype, torch.float32)                           # fp32 (fp64 stays fp64)
        q = F.normalize(q.to(f32), dim=-1, eps=1e-6) * self.K ** -0.5
        k = F.normalize(k.to(f32), dim=-1, eps=1e-6)
        beta = torch.sigmoid(self.b_proj(x).to(f32)).transpose(1, 2)                # (B, H, T)
        g = -self.A_log.to(f32).exp() * F.softplus(self.a_proj(x).to(f32) + self.dt_bias.to(f32))
        return q, k, v, g.transpose(1, 2), beta

    def _output(self, o, x):
        """o (B, n, H, V) fp32, x (B, n, C) the same tokens' normed input -> (B, n, C)."""
        B, n, H, V = o.shape
        o = F.rms_norm(o, (V,), self.norm_weight.to(o.dtype), eps=1e-6)                 # per head
        o = o * F.silu(self.g_proj(x)).view(B, n, H, V)
        return self.drop(self.c_proj(o.reshape(B, n, H * V)))

    def forward(self, x, cache=None, rows=None):
        z = F.pad(self.qkv_proj(x).transpose(1, 2), (3, 0))                        # (B, ch, 3+T)
        if cache is not None:
            cache["conv"] = z[:, :, -3:]                                           # last 3 conv inputs
        z = F.conv1d(z, self.conv.weight, groups=z.size(1)).transpose(1, 2)        # (B, T, ch)
        gdr = gated_delta_rule_fla if self.use_fla and x.is_cuda else gated_delta_rule_chunked
        o, S = gdr(*self._inputs(x, z), chunk_size=self.chunk)                    # (B, H, T, V), (B, H, K, V) fp32
        if cache is not None:
            cache["S"] = S                                                         # (B, H, K, V) fp32
        o = o.transpose(1, 2)                                                      # (B, T, H, V)
        if rows is not None:                                                       # only the GDN tokens read
            o = o.gather(1, rows[:, :, None, None].expand(-1, -1, self.H, self.V))  # (B, n, H, V)
            x = x.gather(1, rows[..., None].expand(-1, -1, x.size(-1)))            # (B, n, C)
        return self._output(o, x)

    def step(self, x, cache, read=True):
        """One token x (B, 1, C): the conv window from the cache, one recurrent step of the state; the
        output only if read (a token routed to softmax writes the state and reads nothing)."""
        win = torch.cat([cache["conv"], self.qkv_proj(x).transpose(1, 2)], -1)      # (B, ch, 4)
        cache["conv"] = win[:, :, 1:]
        z = (win * self.conv.weight[:, 0]).sum(-1)[:, None]                         # (B, 1, ch)
        o, cache["S"] = gated_delta_rule_recurrent(*self._inputs(x, z), initial_state=cache["S"])
        return self._output(o.transpose(1, 2), x) if read else None


# ----------------------------------------------------------------------------------------------------
# Softmax attention on a subset of queries, and with a cache

def attn_proj(attn, h, part):
    """part "q" or "kv" of c_attn applied to h (B, n, C) -> a list of (B, nh, n, hs)."""
    C = h.size(-1)
    rows = slice(0, C) if part == "q" else slice(C, 3 * C)
    b = attn.c_attn.bias[rows] if attn.c_attn.bias is not None else None
    return [attn.split_heads(t) for t in F.linear(h, attn.c_attn.weight[rows], b).split(C, -1)]


def attn_prefill(attn, h, cache):
    """Causal softmax attention over every token of h (B, T, C), its K/V kept in a preallocated KVCache."""
    q, k, v = attn.qkv(h)                                                          # (B, nh, T, hs)
    cache["kv"] = common.KVCache(h.size(0), cache["block_size"], k, v)
    return attn.resid_dropout(attn.c_proj(attn.attend(q, k, v)))


def attn_rows(attn, h, rows, cache=None):
    """Softmax attention for the query tokens `rows` (B, n) only, over the K/V of every token; fills a
    KVCache when given one. Returns (B, n, C)."""
    B, T, C = h.shape
    k, v = attn_proj(attn, h, "kv")       # (B, nh, T, hs): every token's, as in training
    if cache is not None:
        cache["kv"] = common.KVCache(B, cache["block_size"], k, v)
    if rows.size(1) == 0:  # nobody reads: only the cache needed the K/V
        return k.new_zeros(B, 0, C)
    (q,) = attn_proj(attn, h.gather(1, rows[..., None].expand(-1, -1, C)), "q")    # (B, nh, n, hs)
    causal = torch.arange(T, device=h.device) <= rows[:, :, None]                  # (B, n, T) key ≤ query position
    return attn.resid_dropout(attn.c_proj(attn.attend(q, k, v, attn_mask=causal[:, None])))


def attn_step(attn, h, cache, pos, read=True):
    """One token at position pos: its K/V go into the cache; its query attends only if read."""
    k, v = cache["kv"].append(pos, *attn_proj(attn, h, "kv"))                      # (B, nh, pos+1, hs)
    return attn.c_proj(attn.attend(*attn_proj(attn, h, "q"), k, v, causal=False)) if read else None


# ----------------------------------------------------------------------------------------------------
# Layers, router, model

class Layer(nn.Module):
    """Pre-norm mixer + pre-norm MLP; kind G has `gdn`, S has `attn` (names as common.Block), R has both."""

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

    def forward(self, x, y=None, cache=None, sparse=None):
        """y: (B, T, 2) routing weights [GDN, softmax] for kind R. cache: dict to fill (prefill).
        sparse = (soft (B, T) bool, n_gdn, n_soft): each mixer's output only for its own tokens (eval)."""
        h = self.ln_1(x)
        if self.kind == "G":
            mix = self.gdn(h, cache)
        elif self.kind == "S":
            mix = self.attn(h) if cache is None else attn_prefill(self.attn, h, cache)
        elif sparse is None:
            a = self.attn(h) if cache is None else attn_prefill(self.attn, h, cache)
            mix = y[..., :1] * self.gdn(h, cache) + y[..., 1:] * a                 # (B, T, C)
        else:
            soft, n_gdn, n_soft = sparse
            mix = 0
            for is_soft, n in ((False, n_gdn), (True, n_soft)):
                # rows (B, n): this mixer's tokens first, in order; padding slots are the other mixer's
                rows = torch.argsort((soft != is_soft).to(torch.int8), dim=1, stable=True)[:, :n]
                if n == 0 and cache is None:
                    continue  # nobody reads this mixer and no cache needs its K/V or state
                out = self.gdn(h, cache, rows) if not is_soft else attn_rows(self.attn, h, rows, cache)
                full = out.new_zeros(h.shape).scatter(1, rows[..., None].expand(-1, -1, h.size(-1)), out)
                mix = torch.where(soft[..., None] == is_soft, full, mix)           # (B, T, C)
        x = x + mix.to(x.dtype)
        return x + self.mlp(self.ln_2(x)).to(x.dtype)

    def step(self, x, cache, pos, soft=None, run=(True, True)):
        """One token (B, 1, C) at position pos. soft: (B, 1) bool decision for kind R; run: (any row reads
        GDN, any row reads softmax), so at B=1 the unused read is skipped; both caches are always written."""
        h = self.ln_1(x)
        if self.kind == "G":
            mix = self.gdn.step(h, cache)
        elif self.kind == "S":
            mix = attn_step(self.attn, h, cache, pos)
        else:
            g, a = self.gdn.step(h, cache, read=run[0]), attn_step(self.attn, h, cache, pos, read=run[1])
            mix = a if g is None else g if a is None else torch.where(soft[..., None], a, g)
        x = x + mix.to(x.dtype)
        return x + self.mlp(self.ln_2(x)).to(x.dtype)


def balance_loss(probs, hard):
    """Switch loss N·Σ_i f_i·P_i per routed layer, mean over layers. probs, hard: (..., n_routed, N)."""
    N = probs.size(-1)
    f = hard.detach().flatten(0, -3).float().mean(0)                               # (n_routed, N) token fractions
    P = probs.flatten(0, -3).float().mean(0)                                       # (n_routed, N) mean probabilities
    return (N * (f * P).sum(-1)).mean()


def gumbel_like(z):
    return -torch.empty_like(z).exponential_().clamp_min(1e-20).log()              # γ ~ Gumbel(0, 1)


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
        for layer in self.blocks:
            if hasattr(layer, "gdn"):
                layer.gdn.reset_gdn_parameters()

    def on_step(self, it):
        """Anneal τ geometrically from tau_start (step 0) to tau_end (max_iters)."""
        c = self.cfg
        self.tau.fill_(c.tau_start * (c.tau_end / c.tau_start) ** min(1.0, it / max(1, c.max_iters)))

    def route(self, h0, pos=0):
        """h0: layer-0 output (B, T, C) -> weights y (B, T, nR, 2) [GDN, softmax], probs, hard (fp32)."""
        B, T, _ = h0.shape
        z = self.router(self.ln_r(h0)).view(B, T, len(self.routed), 2).float()     # logits z
        probs = z.softmax(-1)
        if self.forced_route is not None:
            hard = F.one_hot(self.forced_route[:, pos:pos + T].long(), 2).to(z)
            return hard, probs, hard
        if not self.training:
            hard = F.one_hot(z.argmax(-1), 2).to(z)                                 # eval: argmax, no noise
            return hard, probs, hard
        soft = ((z + gumbel_like(z)) / self.tau).softmax(-1)                       # p_τ
        hard = F.one_hot(soft.argmax(-1), 2).to(z)
        return hard - soft.detach() + soft, probs, hard                            # straight-through

    def forward(self, idx, targets=None, sparse=False, caches=None):
        if (sparse or caches is not None) and self.training:
            raise NanorouteError("sparse=True is the inference path: call model.eval() first")
        B, T = idx.shape
        x = self.blocks[0](self.embed(idx), cache=None if caches is None else caches[0])  # (B, T, C)
        if self.routed:
            y, probs, hard = self.route(x)                                          # (B, T, nR, 2)
            soft = hard[..., 1] > 0.5                                               # (B, T, nR) routed to softmax
            if sparse:  # one host sync sizes the gathers of every routed layer (parallel routing: all known now)
                n = soft.sum(1)                                                     # (B, nR)
                n_soft, n_gdn = n.amax(0).tolist(), (T - n.amin(0)).tolist()
        r = 0
        for i, layer in enumerate(self.blocks[1:], start=1):
            cache = None if caches is None else caches[i]
            if layer.kind == "R":
                x = layer(x, y[:, :, r], cache, (soft[:, :, r], n_gdn[r], n_soft[r]) if sparse else None)
                r += 1
            else:
                x = layer(x, cache=cache)
        logits, loss = self.head(x if caches is None else x[:, -1:], targets)
        stats = {}
        if self.routed:
            gdn_frac = hard[..., 0].mean((0, 1)).detach()                          # (nR,) took the cheap path
            stats["balance"] = balance_loss(probs, hard)
            stats["tau"] = self.tau.clone()
            for r, i in enumerate(self.routed):
                stats[f"skip_l{i}"] = stats[f"gdn_frac_l{i}"] = gdn_frac[r]
            stats["skipped"] = gdn_frac.mean()
            soft_frac = 1 - gdn_frac
        else:
            soft_frac = 0.0
        saved = 1 - flops_per_token(self.cfg, T, soft_frac, sparse=True) / common.dense_flops_per_token(self.cfg, T)
        stats["flops_saved_hard"] = saved if torch.is_tensor(saved) else torch.full((), saved, device=idx.device)
        if loss is not None:
            stats = {"lm_loss": loss.detach(), **stats}
            if not self.training:  # the noise-free training forward is this one (hard straight-through)
                stats["soft_loss"] = loss.detach()
            if self.routed:
                loss = loss + self.cfg.balance * stats["balance"]
        stats = {k: v.detach() for k, v in stats.items()}
        return logits, loss, stats

    # -------------------------------------------------------------------------------------------------
    # cached decoding (common.LM.generate drives it): GDN state + conv tail, preallocated KV cache

    @torch.no_grad()
    def prefill(self, idx):
        """The sparse forward of idx (B, T), filling every layer's cache -> (logits (B, V), state)."""
        caches = [{"block_size": self.cfg.block_size} for _ in self.blocks]
        logits, _, _ = self(idx, sparse=True, caches=caches)
        return logits[:, -1], (caches, idx.size(1))

    @torch.no_grad()
    def step(self, tok, state):
        """tok (B, 1) at position pos -> logits (B, V); updates every layer's cache in place."""
        caches, pos = state
        x = self.blocks[0].step(self.drop(self.wte(tok) + self.wpe.weight[pos]), caches[0], pos)  # (B, 1, C)
        if self.routed:
            soft = self.route(x, pos)[2][..., 1] > 0.5                              # (B, 1, nR)
            # one host sync per token for all routed layers: which reads any row needs (B=1: exactly one)
            run = torch.stack([(~soft).any(0).any(0), soft.any(0).any(0)], 1).tolist()  # (nR, 2)
        r = 0
        for i, layer in enumerate(self.blocks[1:], start=1):
            if layer.kind == "R":
                x = layer.step(x, caches[i], pos, soft[:, :, r], run[r])
                r += 1
            else:
                x = layer.step(x, caches[i], pos)
        return self.lm_head(self.ln_f(x))[:, -1], (caches, pos + 1)

    @torch.no_grad()
    def routing_map(self, idx):
        """idx (1, T) -> (m (nR, T) on CPU, 1 = softmax, the expensive read; rows; legend), eval decisions."""
        was_training, m = self.training, torch.zeros(0, idx.size(1))
        if self.routed:
            hard = self.eval().route(self.blocks[0](self.embed(idx)))[2]           # (1, T, nR, 2)
            m = hard[0, :, :, 1].T.float().cpu()                                    # (nR, T)
        self.train(was_training)
        return m, [f"layer {i}" for i in self.routed], ("GDN (linear)", "softmax")


# ----------------------------------------------------------------------------------------------------
# Accounting (forward FLOPs per token, common.py's conventions: multiply-adds × 2)

def flops_gdn(cfg):
    """(write, read) of one token: write = W_{q,k,v}, W_a, W_b, short conv and the recurrence (Sᵀk, k uᵀ,
    Sᵀq: 3 K×V per head; the chunked form reads Sᵀq for every token); read = W_g and W_o."""
    d, H, K = cfg.n_embd, cfg.n_head, cfg.head_k
    V = cfg.gdn_expand_v * K
    write = 2 * d * H * (2 * K + V) + 2 * d * 2 * H + 2 * 4 * H * (2 * K + V) + 2 * 3 * H * K * V
    return write, 2 * d * H * V + 2 * H * V * d


def flops_per_token(cfg, T, soft_frac=0.0, sparse=False):
    """Forward FLOPs per token. soft_frac: fraction of tokens routed to softmax, one number (or 0-d tensor)
    for every routed layer or a sequence with one per routed layer. Dense-hard runs both mixers on every
    token of a routed layer; sparse runs what the module docstring lists."""
    d = cfg.n_embd
    fracs = list(soft_frac) if isinstance(soft_frac, (list, tuple)) or getattr(soft_frac, "ndim", 0) else \
        [soft_frac] * cfg.kinds.count("R")
    kv = 2 * common.flops_qkv(d) / 3                                                # K, V: every token
    q_scores_out = common.flops_qkv(d) / 3 + common.flops_attn_scores(d, common.mean_context(T)) \
        + common.flops_attn_out(d)                                                  # what a softmax query adds
    write, read = flops_gdn(cfg)
    total = common.flops_lm_head(d, cfg.vocab_size) + cfg.n_layer * common.flops_ffn(d, 4 * d)
    total += sum(kv + q_scores_out if k == "S" else write + read for k in cfg.kinds if k != "R")
    for s in fracs:  # routed layers: the router's 2 logits, both writes, then the reads
        total = total + 2 * d * 2 + write + kv + ((1 - s) * read + s * q_scores_out if sparse else read + q_scores_out)
    return total
