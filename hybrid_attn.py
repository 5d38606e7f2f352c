"""
hybrid_attn.py: "Adaptive Attention Selection: A Proof-of-Concept for Dynamic Routing in Linear Transformers"
(the paper in ../shared/papers/003), with Gated DeltaNet (Yang, Kautz, Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", ICLR 2025) written in plain PyTorch.

Layers follow a pattern string: G = Gated DeltaNet, S = softmax attention, R = routed (holds both; a router
picks one per token). Paper §2.1: `G R R S`. Every layer is pre-norm mixer + pre-norm MLP.

Gated delta rule (per head; S ∈ R^{K×V}, g_t ≤ 0 the log decay, β_t ∈ (0,1)):
    S_t = exp(g_t)·S_{t−1};   u_t = β_t·(v_t − S_tᵀ k_t);   S_t ← S_t + k_t u_tᵀ;   o_t = S_tᵀ q_t
Chunkwise (WY / UT transform) form, chunk of C tokens, Γ_t = Σ_{s≤t in chunk} g_s, S₀ the state entering it:
    (I + A) U = diag(β) V − diag(β e^Γ) K S₀,   A_ij = β_i e^{Γ_i−Γ_j} k_i·k_j  for i > j (strictly lower)
    O = diag(e^Γ) Q S₀ + (Q Kᵀ ⊙ M) U,           M_ij = e^{Γ_i−Γ_j} for i ≥ j, 0 above
    S_C = e^{Γ_C} S₀ + Kᵀ diag(e^{Γ_C−Γ}) U
GDN layer: q,k,v = SiLU(causal depthwise conv₄(W_{q,k,v} x)); q,k L2-normalised, q scaled by K^−½;
    β = σ(W_b x);  g = −exp(A_log)·softplus(W_a x + dt_bias);  y = W_o(RMSNorm_head(o) ⊙ SiLU(W_g x))
Routing (§2.2, parallel): one router reads layer 0's output h₀ and gives 2-way logits z_l for every routed
layer l at once. Train: Gumbel-softmax, hard straight-through, y = onehot(argmax(z+γ)) − sg(p_τ) + p_τ with
p_τ = softmax((z+γ)/τ); a routed layer outputs y_G·GDN(x) + y_S·Attn(x). Eval: argmax z, no noise.
Switch balance loss per routed layer (N = 2 mixers):  L_bal = N·Σ_i f_i·P_i  (1 balanced, 2 collapsed),
    f_i = fraction of tokens sent to mixer i, P_i = mean router probability softmax(z)_i;
    loss = L_lm + α·mean_l L_bal,  α = 0.01 (paper).
Temperature schedule (the paper does not give one): τ(it) = τ_start·(τ_end/τ_start)^(it/max_iters),
geometric from 1.0 to 0.5. With hard straight-through the forward pass does not depend on τ (argmax of
z+γ is τ-free); τ only sharpens the surrogate gradient.
Inference: eval = hard routing computed densely (both mixers on every token, one kept). sparse=True: in
routed layers softmax attention runs only for the query tokens routed to it (K/V of every token are still
projected: in training every token's K/V was visible), GDN consumes every token (it is a recurrence); one
host sync per forward sizes the gather for all routed layers. generate(): GDN state + conv tail + KV cache.
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
        if self.gdn_head_dim == 0 and self.n_embd % self.n_head:
            raise NanorouteError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def kinds(self):
        return "".join(self.pattern.split())

    @property
    def head_k(self):
        return self.gdn_head_dim or self.n_embd // self.n_head


# The paper: ~160M parameters, 4 layers, 200 steps, α = 0.01. Width, heads and lr are not given: n_embd 1280
# gives 160M with a 49k (SmolLM) vocabulary; on Shakespeare chars the same preset is ~97M.
PRESETS = {"paper": {"n_layer": 4, "n_head": 10, "n_embd": 1280, "pattern": "G R R S", "balance": 0.01,
                     "max_iters": 200, "warmup_iters": 20, "learning_rate": 6e-4, "block_size": 256}}


# ----------------------------------------------------------------------------------------------------
# Gated delta rule: the step-by-step reference and the chunkwise-parallel form

def gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=None):
    """q, k: (B, H, T, K); v: (B, H, T, V); g, beta: (B, H, T). Returns o (B, H, T, V), state (B, H, K, V)."""
    B, H, T, K = q.shape
    in_dtype, dt = v.dtype, torch.promote_types(q.dtype, torch.float32)  # state and gates in fp32 (or fp64)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, v.size(-1)) if initial_state is None else initial_state.to(dt)
    out = []
    for t in range(T):
        S = S * g[:, :, t, None, None].exp()                                       # decay: S ← e^{g_t} S
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k[:, :, t], S))  # (B, H, V)
        S = S + k[:, :, t, :, None] * u[:, :, None, :]                             # delta rule write k uᵀ
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))                   # o_t = Sᵀ q_t
    return torch.stack(out, 2).to(in_dtype), S


def gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=64, initial_state=None):
    """Same contract as gated_delta_rule_recurrent; O(T/C) sequential steps, everything else batched."""
    B, H, T, K = q.shape
    V, C, in_dtype = v.size(-1), chunk_size, v.dtype
    dt = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    pad = (-T) % C  # zero padding: g = 0, β = 0, k = 0 leave the state untouched and the outputs are cut off
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v = (t.view(B, H, N, C, -1) for t in (q, k, v))                         # (B, H, N, C, K|V)
    g, beta = g.view(B, H, N, C), beta.view(B, H, N, C)
    G = g.cumsum(-1)                                                               # Γ: cumulative within chunk only
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    M = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, -math.inf).exp()  # (B, H, N, C, C), mask before exp
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * M).tril(-1)                 # strictly lower part of I + A
    eye = torch.eye(C, dtype=dt, device=q.device)
    rhs = torch.cat([(beta * G.exp())[..., None] * k, beta[..., None] * v], -1)    # (B, H, N, C, K+V)
    # UT transform: one batched unit-lower-triangular solve gives both W (acts on S₀) and U₀ (state-free)
    W, U0 = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True).split([K, V], -1)
    QK = (q @ k.transpose(-1, -2)) * M                                             # (B, H, N, C, C) causal, decayed
    Qg = q * G.exp()[..., None]                                                    # e^Γ Q: reads S₀
    Kd = k * (G[..., -1:] - G).exp()[..., None]                                    # e^{Γ_C−Γ} K: writes the state
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    out = []
    for n in range(N):  # only the state crosses chunk boundaries
        U = U0[:, :, n] - W[:, :, n] @ S                                           # (B, H, C, V)
        out.append(Qg[:, :, n] @ S + QK[:, :, n] @ U)                              # (B, H, C, V)
        S = S * G[:, :, n, -1, None, None].exp() + Kd[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(out, 2).view(B, H, N * C, V)[:, :, :T]
    return o.to(in_dtype), S


class GatedDeltaNet(nn.Module):
    """The GDN token mixer. forward(x, cache) fills cache (conv tail + state) when given one; step() decodes."""

    def __init__(self, cfg):
        super().__init__()
        H, K = cfg.n_head, cfg.head_k
        V = cfg.gdn_expand_v * K
        self.H, self.K, self.V, self.chunk = H, K, V, cfg.chunk_size
        ch = H * (2 * K + V)
        self.qkv_proj = nn.Linear(cfg.n_embd, ch, bias=False)
        self.conv = nn.Conv1d(ch, ch, 4, groups=ch, bias=False)  # depthwise, made causal by left padding
        self.a_proj = nn.Linear(cfg.n_embd, H, bias=False)       # → decay rate
        self.b_proj = nn.Linear(cfg.n_embd, H, bias=False)       # → β
        self.g_proj = nn.Linear(cfg.n_embd, H * V, bias=False)   # output gate
        self.A_log = nn.Parameter(torch.zeros(H))                # 1-D: make_optimizer puts it in no-decay
        self.dt_bias = nn.Parameter(torch.zeros(H))
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
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
        """x: normed input (B, T, C); z: conv output (B, T, ch) -> q, k, v (B, H, T, ·), g, β (B, H, T)."""
        B, T, _ = x.shape
        q, k, v = F.silu(z).split([self.H * self.K, self.H * self.K, self.H * self.V], -1)
        q, k, v = (t.view(B, T, self.H, -1).transpose(1, 2) for t in (q, k, v))  # (B, H, T, K|V)
        q = F.normalize(q, dim=-1, eps=1e-6) * self.K ** -0.5
        k = F.normalize(k, dim=-1, eps=1e-6)
        f32 = torch.promote_types(x.dtype, torch.float32)                           # gates in fp32 (or fp64)
        beta = torch.sigmoid(self.b_proj(x).to(f32)).transpose(1, 2)                # (B, H, T)
        g = -self.A_log.to(f32).exp() * F.softplus(self.a_proj(x).to(f32) + self.dt_bias.to(f32))
        return q, k, v, g.transpose(1, 2), beta

    def _output(self, o, x):
        B, H, T, V = o.shape
        f32 = torch.promote_types(x.dtype, torch.float32)
        o = F.rms_norm(o.transpose(1, 2).to(f32), (V,), self.norm_weight.to(f32), eps=1e-6).to(x.dtype)  # (B, T, H, V)
        o = o * F.silu(self.g_proj(x)).view(B, T, H, V)
        return self.drop(self.c_proj(o.reshape(B, T, H * V)))

    def forward(self, x, cache=None):
        z = F.pad(self.qkv_proj(x).transpose(1, 2), (3, 0))                        # (B, ch, 3+T)
        if cache is not None:
            cache["conv"] = z[:, :, -3:]                                           # last 3 conv inputs
        z = F.conv1d(z, self.conv.weight, groups=z.size(1)).transpose(1, 2)        # (B, T, ch)
        o, S = gated_delta_rule_chunked(*self._inputs(x, z), chunk_size=self.chunk)
        if cache is not None:
            cache["S"] = S
        return self._output(o, x)

    def step(self, x, cache):
        """One token x (B, 1, C): the conv window from the cache, one recurrent step of the state."""
        win = torch.cat([cache["conv"], self.qkv_proj(x).transpose(1, 2)], -1)      # (B, ch, 4)
        cache["conv"] = win[:, :, 1:]
        z = (win * self.conv.weight[:, 0]).sum(-1)[:, None]                         # (B, 1, ch)
        o, cache["S"] = gated_delta_rule_recurrent(*self._inputs(x, z), initial_state=cache["S"])
        return self._output(o, x)


# ----------------------------------------------------------------------------------------------------
# Layers, router, model

def attn_prefill(attn, h, cache):
    q, k, v = attn.qkv(h)                                                          # (B, nh, T, hs)
    cache["k"], cache["v"] = k, v
    return attn.resid_dropout(attn.c_proj(attn.attend(q, k, v)))


def attn_step(attn, h, cache):
    q, k, v = attn.qkv(h)                                                          # (B, nh, 1, hs)
    cache["k"], cache["v"] = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
    every_key = torch.ones(1, 1, 1, cache["k"].size(2), dtype=torch.bool, device=h.device)
    return attn.c_proj(attn.attend(q, cache["k"], cache["v"], attn_mask=every_key))


def attn_sparse(attn, h, soft, n_max):
    """Softmax attention for the query tokens with soft=True only (B, T) bool; K/V of every token.
    Returns (B, T, C) with the selected rows filled (others zero). n_max = max selected per row."""
    B, T, C = h.shape
    Wq, Wkv = attn.c_attn.weight.split([C, 2 * C])
    bq, bkv = attn.c_attn.bias.split([C, 2 * C]) if attn.c_attn.bias is not None else (None, None)
    k, v = (attn.split_heads(t) for t in F.linear(h, Wkv, bkv).chunk(2, -1))       # (B, nh, T, hs)
    pos = torch.sort((~soft).to(torch.int8), dim=1, stable=True).indices[:, :n_max]  # (B, n) selected first, in order
    idx = pos[..., None].expand(-1, -1, C)                                         # (B, n, C)
    q = attn.split_heads(F.linear(h.gather(1, idx), Wq, bq))                       # (B, nh, n, hs)
    causal = torch.arange(T, device=h.device)[None, None, :] <= pos[:, :, None]   # (B, n, T) key ≤ query position
    y = attn.c_proj(attn.attend(q, k, v, attn_mask=causal[:, None]))               # (B, n, C)
    return torch.zeros_like(h).scatter(1, idx, y)  # padding slots land on GDN tokens, which the caller keeps


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

    def forward(self, x, y=None, cache=None, sparse_n=None):
        """y: (B, T, 2) routing weights [GDN, softmax] for kind R. cache: dict to fill (prefill).
        sparse_n: run softmax only on the tokens with y[..., 1] = 1 (eval; y is one-hot)."""
        h = self.ln_1(x)
        if self.kind == "G":
            mix = self.gdn(h, cache)
        elif self.kind == "S":
            mix = self.attn(h) if cache is None else attn_prefill(self.attn, h, cache)
        elif sparse_n is not None:
            soft = y[..., 1] > 0.5                                                 # (B, T)
            mix = self.gdn(h)  # the recurrence consumes every token
            if sparse_n > 0:
                mix = torch.where(soft[..., None], attn_sparse(self.attn, h, soft, sparse_n), mix)
        else:
            a = self.attn(h) if cache is None else attn_prefill(self.attn, h, cache)
            mix = y[..., :1] * self.gdn(h, cache) + y[..., 1:] * a                 # (B, T, C)
        x = x + mix
        return x + self.mlp(self.ln_2(x))

    def step(self, x, cache, soft=None):
        """One token (B, 1, C). soft: (B, 1) bool decision for kind R; both mixers update their caches."""
        h = self.ln_1(x)
        if self.kind == "G":
            mix = self.gdn.step(h, cache)
        elif self.kind == "S":
            mix = attn_step(self.attn, h, cache)
        else:
            mix = torch.where(soft[..., None], attn_step(self.attn, h, cache), self.gdn.step(h, cache))
        x = x + mix
        return x + self.mlp(self.ln_2(x))


def balance_loss(probs, hard):
    """Switch loss N·Σ_i f_i·P_i per routed layer, mean over layers. probs, hard: (..., n_routed, N)."""
    N = probs.size(-1)
    f = hard.detach().flatten(0, -3).float().mean(0)                               # (n_routed, N) token fractions
    P = probs.flatten(0, -3).float().mean(0)                                       # (n_routed, N) mean probabilities
    return (N * (f * P).sum(-1)).mean()


class Model(common.LM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = nn.ModuleList([Layer(cfg, kind) for kind in cfg.kinds])
        self.routed = [i for i, kind in enumerate(cfg.kinds) if kind == "R"]
        if self.routed:  # one router after layer 0 for every routed layer (parallel routing, §2.2)
            self.ln_r = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
            self.router = nn.Linear(cfg.n_embd, 2 * len(self.routed), bias=False)
        self.tau = cfg.tau_start
        self.forced_route = None  # (B, T, n_routed) bool, True = softmax: benchmarks/tests force decisions
        self.init_weights()
        for layer in self.blocks:
            if hasattr(layer, "gdn"):
                layer.gdn.reset_gdn_parameters()

    def on_step(self, it):
        """Anneal τ geometrically from tau_start (step 0) to tau_end (max_iters)."""
        c = self.cfg
        self.tau = c.tau_start * (c.tau_end / c.tau_start) ** min(1.0, it / max(1, c.max_iters))

    def route(self, h0):
        """h0: layer-0 output (B, T, C) -> weights y (B, T, nR, 2) [GDN, softmax], probs, hard."""
        B, T, _ = h0.shape
        z = self.router(self.ln_r(h0)).view(B, T, len(self.routed), 2).float()     # logits z
        probs = z.softmax(-1)
        if self.forced_route is not None:
            hard = F.one_hot(self.forced_route.long(), 2).to(z)
            return hard, probs, hard
        if not self.training:
            hard = F.one_hot(z.argmax(-1), 2).to(z)                                 # eval: argmax, no noise
            return hard, probs, hard
        gumbel = -torch.empty_like(z).exponential_().clamp_min(1e-20).log()       # γ ~ Gumbel(0, 1)
        soft = ((z + gumbel) / self.tau).softmax(-1)
        hard = F.one_hot(soft.argmax(-1), 2).to(z)
        return hard - soft.detach() + soft, probs, hard                            # straight-through

    def forward(self, idx, targets=None, sparse=False, caches=None):
        if sparse and self.training:
            raise NanorouteError("sparse=True is the inference path: call model.eval() first")
        x = self.blocks[0](self.embed(idx), cache=None if caches is None else caches[0])  # (B, T, C)
        stats = {}
        if self.routed:
            y, probs, hard = self.route(x)                                          # (B, T, nR, 2)
            # sparse: one host sync for all routed layers at once (the router decides them all after layer 0)
            n_soft = hard[..., 1].sum(1).amax(0).long().tolist() if sparse else [None] * len(self.routed)
        r = 0
        for i, layer in enumerate(self.blocks[1:], start=1):
            if layer.kind == "R":
                x = layer(x, y[:, :, r], None if caches is None else caches[i], sparse_n=n_soft[r])
                r += 1
            else:
                x = layer(x, cache=None if caches is None else caches[i])
        logits, loss = self.head(x, targets)
        if self.routed:
            bal = balance_loss(probs, hard)
            stats["balance"] = bal.detach()
            stats["tau"] = torch.tensor(self.tau, device=idx.device)
            for r, i in enumerate(self.routed):
                stats[f"gdn_frac_l{i}"] = hard[..., r, 0].mean().detach()       # per-layer GDN fraction
        if loss is not None:
            stats = {"lm_loss": loss.detach(), **stats}
            if self.routed:
                loss = loss + self.cfg.balance * bal
        return logits, loss, stats

    # -------------------------------------------------------------------------------------------------
    # cached decoding: GDN state + conv tail, KV cache; routing decided per token by the same router

    @torch.no_grad()
    def prefill(self, idx):
        caches = [{} for _ in self.blocks]
        logits, _, _ = self(idx, caches=caches)
        return logits[:, -1], (caches, idx.size(1))

    @torch.no_grad()
    def step(self, tok, state):
        """tok (B, 1) at position pos -> logits (B, V); updates every layer's cache in place."""
        caches, pos = state
        x = self.blocks[0].step(self.drop(self.wte(tok) + self.wpe.weight[pos]), caches[0])  # (B, 1, C)
        if self.routed:
            z = self.router(self.ln_r(x)).view(x.size(0), 1, len(self.routed), 2)
            soft = z.argmax(-1) == 1 if self.forced_route is None else self.forced_route[:, pos:pos + 1]
        r = 0
        for i, layer in enumerate(self.blocks[1:], start=1):
            x = layer.step(x, caches[i], soft[:, :, r] if layer.kind == "R" else None)
            r += layer.kind == "R"
        return self.lm_head(self.ln_f(x))[:, -1], (caches, pos + 1)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Cached sampling with eval-mode (argmax) routing. Once the context fills block_size the caches are
        rebuilt from the last block_size tokens each step, exactly what the cache-free sampler sees."""
        was_training = self.training
        self.eval()
        bs = self.cfg.block_size
        logits, state = self.prefill(idx[:, -bs:])
        for i in range(max_new_tokens):
            nxt = common.sample_next(logits, temperature, top_k)
            idx = torch.cat([idx, nxt], 1)
            if i + 1 < max_new_tokens:
                logits, state = self.step(nxt, state) if state[1] < bs else self.prefill(idx[:, -bs:])
        self.train(was_training)
        return idx


# ----------------------------------------------------------------------------------------------------
# Accounting (forward FLOPs per token, common.py's conventions: multiply-adds × 2)

def flops_gdn(cfg):
    """Projections (q, k, v, gate, a, b, out) + short conv + the recurrence (Sᵀk, k uᵀ, Sᵀq: 3 K×V per head)."""
    d, H, K = cfg.n_embd, cfg.n_head, cfg.head_k
    V = cfg.gdn_expand_v * K
    proj = 2 * d * H * (2 * K + V) + 2 * d * H * V + 2 * d * 2 * H + 2 * H * V * d
    return proj + 2 * 4 * H * (2 * K + V) + 2 * 3 * H * K * V


def flops_per_token(cfg, T, soft_frac=None, sparse=False):
    """Forward FLOPs per token. Routed layers: dense-hard runs both mixers on every token; sparse runs
    the K/V projections on every token and Q, scores, out only on the soft_frac routed to softmax."""
    d = cfg.n_embd
    attn_q = common.flops_qkv(d) / 3
    full_attn = common.flops_qkv(d) + common.flops_attn_out(d) + common.flops_attn_scores(d, common.mean_context(T))
    total = common.flops_lm_head(d, cfg.vocab_size)
    for kind in cfg.kinds:
        total += common.flops_ffn(d, 4 * d)
        if kind == "S":
            total += full_attn
        elif kind == "G":
            total += flops_gdn(cfg)
        else:
            total += flops_gdn(cfg) + 2 * d * 2  # router share (2 logits per routed layer)
            if sparse:
                total += 2 * attn_q + soft_frac * (attn_q + common.flops_attn_out(d)
                                                   + common.flops_attn_scores(d, common.mean_context(T)))
            else:
                total += full_attn
    return total
