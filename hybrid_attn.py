"""
hybrid_attn.py: "Adaptive Attention Selection: A Proof-of-Concept for Dynamic Routing in Linear
Transformers" (../shared/papers/003), with Gated DeltaNet (Yang, Kautz, Hatamizadeh, "Gated Delta
Networks: Improving Mamba2 with Delta Rule", ICLR 2025, arXiv:2412.06464) in plain PyTorch.

Layers follow a pattern: G = Gated DeltaNet, S = softmax attention, R = routed (holds both; a router
picks one per token). Paper §2.1: `G R R S`. Every layer is pre-norm mixer + pre-norm MLP.

Gated delta rule (Yang et al.; per head, S ∈ R^{K×V}, g_t ≤ 0 the log decay, β_t ∈ (0, 1)):
    S_t = e^{g_t}·S_{t−1};   u_t = β_t·(v_t − S_tᵀ k_t);   S_t ← S_t + k_t u_tᵀ;   o_t = S_tᵀ q_t
Chunkwise form (the WY / UT transform; chunks of C tokens, S₀ the state entering one,
L_ij = Σ_{j<s≤i} g_s, Γ_i = Σ_{s≤i} g_s the decay since the chunk's start):
    (I + A) [W U₀] = [diag(β e^Γ) K, diag(β) V],   A_ij = β_i e^{L_ij} k_i·k_j  (i > j)
    O = (diag(e^Γ) Q − (QKᵀ ⊙ M) W) S₀ + (QKᵀ ⊙ M) U₀,   M_ij = e^{L_ij} (i ≥ j), 0 above
    next S₀ = P S₀ + R,   P = e^{Γ_C} I − Kᵀ diag(e^{L_{C,·}}) W,   R = Kᵀ diag(e^{L_{C,·}}) U₀
GDN layer: q, k, v = SiLU(causal depthwise conv₄(W_{q,k,v} x)); q, k L2-normalised, q scaled by
    K^−½;  β = σ(W_b x);  g = −exp(A_log)·softplus(W_a x + dt_bias);
    y = W_o(RMSNorm_head(o) ⊙ SiLU(W_g x))
Routing (§2.2, parallel): a routed layer outputs y_G·GDN(x) + y_S·Attn(x); one router reads layer
0's output h₀ and gives 2-way logits z_l for every routed layer l at once:
    train: y = onehot(argmax(z + γ)) − sg(p_τ) + p_τ,  p_τ = softmax((z + γ)/τ),  γ ~ Gumbel(0, 1)
    eval:  y = onehot(argmax z)   (a tie goes to GDN, argmax's first index)
Balance (§2.2, the Switch Transformer's loss), N = 2 mixers, α = 0.01:
    L_balance = N·Σ_i f_i·P_i   (1 balanced, 2 collapsed; f_i: the fraction of tokens sent to
    mixer i, P_i: the mean router probability);   loss = L_lm + α·mean_l L_balance
The state math runs in fp32 with autocast off; on CUDA, fla's Triton kernels when installed
(pip install fla-core). Sparse inference (sparse=True, prefill, step): every token of a routed layer
writes the GDN state and the softmax K/V; a GDN token then reads through RMSNorm, W_g and W_o, a
softmax token through Q, scores and W_o.

Deviations from the paper, one line each (what they cost: results/hybrid.md):
  * no τ schedule is given: ours is geometric, tau_start 1.0 → tau_end 0.5 at max_iters.
  * width, heads and lr are not given: PRESETS["paper"] guesses them (n_embd 1280: 160M, 49k vocab).
  * Gumbel-softmax is hard straight-through: the training forward is τ-free and equals eval's.
  * a route picks how a token READS: the GDN state and softmax K/V hold every token (our reading).
  * the router runs in fp32 with autocast off: its decisions do not depend on the matmul dtype.
  * learned positions and common.py's GELU MLP around both mixers (the paper does not say).
  * q, k's L2 norm is x / max(‖x‖, 1e-6) (F.normalize); fla's kernels take x / √(‖x‖² + 1e-6).
"""
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
    balance: float = 0.01  # α, weight of the Switch balance loss (paper: 0.01)
    tau_start: float = 1.0  # Gumbel-softmax temperature at step 0 …
    tau_end: float = 0.5  # … annealed geometrically to this at max_iters
    gdn_head_dim: int = 0  # K, key dim per GDN head (0 = n_embd // n_head); n_head GDN heads
    gdn_expand_v: int = 1  # V = expand_v·K, value dim per GDN head
    chunk_size: int = 64  # chunk length of the chunkwise gated delta rule
    use_fla: bool = True  # CUDA: fla's kernels if installed (pip install fla-core)

    @property
    def kinds(self):  # the pattern's letters, spaces ignored
        return "".join(self.pattern.split())

    @property
    def head_k(self):  # K
        return self.gdn_head_dim or self.n_embd // self.n_head

    def __post_init__(self):
        super().__post_init__()
        k, p = self.kinds, f"pattern {self.pattern!r}"
        bad = "".join(c for c in k if c not in "GRS")
        errors = [
            (len(k) != self.n_layer, f"{p} has {len(k)} layers but n_layer={self.n_layer}"),
            (bad, f"{p}: unknown layer {bad[:1]!r}; use G (GDN), R (routed), S (softmax)"),
            (k[:1] == "R", f"{p}: layer 0 cannot be routed (the router reads its output)"),
            (not (self.tau_start > 0 and self.tau_end > 0), "Gumbel temperatures must be > 0, "
             f"got tau_start={self.tau_start}, tau_end={self.tau_end}")]
        errors += [(getattr(self, n) < low, f"{n} must be >= {low}, got {getattr(self, n)}")
                   for n, low in (("balance", 0), ("gdn_head_dim", 0), ("gdn_expand_v", 1),
                                  ("chunk_size", 1))]
        for failed, msg in errors:
            if failed:
                raise NanorouteError(msg)


PRESETS = {
    "paper": {"n_layer": 4, "n_head": 10, "n_embd": 1280, "pattern": "G R R S", "balance": 0.01,
              "max_iters": 200, "warmup_iters": 20, "learning_rate": 6e-4, "block_size": 256},
    "classroom": dict(common.CLASSROOM, pattern="G R R S", balance=0.01, max_iters=700,
                      eval_interval=350),
    # common.GPU (one GPU, ~an hour of a dense GPT's FLOPs): the paper's G R R S three times
    "gpu": dict(common.GPU, pattern="G R R S G R R S G R R S", balance=0.01)}


# --------------------------------------------------------------------------------------------------
# The gated delta rule: per timestep (the decode step's rule, and the reference the chunked form is
# tested against), chunkwise (parallel over a sequence: training, prefill), fla's CUDA kernels

def gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=None):
    """q, k (B, H, T, K), v (B, H, T, V), g, beta (B, H, T) -> o (B, H, T, V), S (B, H, K, V),
    in fp32 (fp64 if given)."""
    B, H, T, K = q.shape
    dt = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):  # autocast would run the einsums in bf16
        q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
        S = q.new_zeros(B, H, K, v.size(-1)) if initial_state is None else initial_state.to(dt)
        out = []
        for t in range(T):
            S = S * g[:, :, t, None, None].exp()  # S ← e^{g_t} S
            u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k[:, :, t], S))
            S = S + k[:, :, t, :, None] * u[:, :, None, :]  # S ← S + k_t u_tᵀ
            out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))  # o_t = Sᵀ q_t
        return torch.stack(out, 2), S


def gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=64, initial_state=None,
                             output_final_state=True):
    """gated_delta_rule_recurrent's contract, every chunk at once; the loop carries only S₀."""
    B, H, T, K = q.shape
    V, C = v.size(-1), chunk_size
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g[..., None], beta[..., None]))
        pad = (-T) % C  # zeros: g = 0, β = 0, k = 0 leave the state as it is; outputs are cut off
        q, k, v, g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g, beta))
        N = (T + pad) // C
        q, k, v, g, beta = (t.unflatten(2, (N, C)) for t in (q, k, v, g, beta))  # (B, H, N, C, ·)
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # i ≥ j
        # L_ij summed over (j, i] itself: Γ_i − Γ_j of two large sums would cancel in fp32
        L = (g * causal.tril(-1)).cumsum(-2)  # (B, H, N, C, C)
        M = L.masked_fill(~causal, -math.inf).exp()  # e^{L_ij}, 0 above
        eG = g.cumsum(-2).exp()  # e^{Γ_i} (…, C, 1)
        A = ((beta * k) @ k.mT) * M  # the solve reads its strict lower part
        QK = (q @ k.mT) * M  # QKᵀ ⊙ M
        rhs = torch.cat([beta * eG * k, beta * v], -1)  # (B, H, N, C, K+V)
        WU = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # (I + A)⁻¹
        W, U0 = WU.split([K, V], -1)
        KdT = (k * M[..., -1, :, None]).mT  # Kᵀ diag(e^{L_C,·}) (B, H, N, K, C)
        P = eG[..., -1:, :] * torch.eye(K, dtype=dt, device=q.device) - KdT @ W  # (B, H, N, K, K)
        R = KdT @ U0  # (B, H, N, K, V)
        S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
        states = []
        for n in range(N):  # only the state crosses chunks
            states.append(S)
            S = P[:, :, n] @ S + R[:, :, n]
        S0 = torch.stack(states, 2)  # (B, H, N, K, V)
        o = (q * eG - QK @ W) @ S0 + QK @ U0  # (B, H, N, C, V)
        return o.flatten(2, 3)[:, :, :T], S if output_final_state else None


try:  # optional: flash-linear-attention's Triton kernels (CUDA); the forms above stay the reference
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as _fla_recurrent
except Exception:  # not installed, or no Triton here
    _fla_chunk = _fla_recurrent = None


def gated_delta_rule_fla(q, k, v, g, beta, chunk_size=64, initial_state=None,
                         output_final_state=True):
    """The same contract through fla's chunk_gated_delta_rule (own chunk size, 16-bit inputs)."""
    dt = v.dtype if v.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    qf, kf, vf, bf = (t.transpose(1, 2).to(dt) for t in (q, k, v, beta))  # (B, T, H, ·)
    S0 = None if initial_state is None else initial_state.float()
    o, S = _fla_chunk(qf, kf, vf, g.transpose(1, 2).float(), bf, scale=1.0, initial_state=S0,
                      output_final_state=output_final_state)
    return o.transpose(1, 2).float(), S.float() if output_final_state else None


def gated_delta_step_fla(q, k, v, g, beta, initial_state):
    """gated_delta_rule_recurrent's contract through fla's fused_recurrent_gated_delta_rule."""
    qf, kf, vf, gf, bf = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))  # (B, T, H, ·)
    o, S = _fla_recurrent(qf, kf, vf, gf, bf, scale=1.0, initial_state=initial_state.float(),
                          output_final_state=True)
    return o.transpose(1, 2), S


# --------------------------------------------------------------------------------------------------
# Blocks: the GDN mixer and the layer

class GatedDeltaNet(nn.Module):
    """write(h): the gated delta rule over every token -> o; read(o, gate): the outputs of some."""

    def __init__(self, cfg):
        super().__init__()
        H, K, V = cfg.n_head, cfg.head_k, cfg.gdn_expand_v * cfg.head_k
        self.H, self.K, self.V, self.chunk, self.use_fla = H, K, V, cfg.chunk_size, cfg.use_fla
        ch = H * (2 * K + V)
        self.qkv_proj = nn.Linear(cfg.n_embd, ch, bias=False)
        self.conv = nn.Conv1d(ch, ch, 4, groups=ch, bias=False)  # depthwise; causal by left padding
        self.a_proj = nn.Linear(cfg.n_embd, H, bias=False)  # → decay rate
        self.b_proj = nn.Linear(cfg.n_embd, H, bias=False)  # → β
        self.g_proj = nn.Linear(cfg.n_embd, H * V, bias=False)  # output gate
        self.A_log = nn.Parameter(torch.zeros(H))  # 1-D: make_optimizer: no decay
        self.dt_bias = nn.Parameter(torch.zeros(H))
        self.norm_weight = nn.Parameter(torch.ones(V))  # per-head RMSNorm gain
        self.c_proj = nn.Linear(H * V, cfg.n_embd, bias=cfg.bias)  # named as attention's: init
        self.dropout = cfg.dropout

    @torch.no_grad()
    def reset_gdn_parameters(self):
        """Yang et al.'s init: A ~ U(0, 16), dt log-uniform in [1e-3, 0.1], dt_bias = softplus⁻¹(dt)
        (as fla's GatedDeltaNet)."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).clamp_min(1e-4).log())
        lo, hi = math.log(1e-3), math.log(0.1)
        dt = torch.exp(torch.rand_like(self.dt_bias) * (hi - lo) + lo)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.conv.reset_parameters()

    def write(self, h, cache=None):
        """Normed h (B, T, C) -> o = Sᵀq (B, H, T, V) fp32. A cache holding a state continues it (a
        decode step, in place); an empty one receives the state and the conv's last 3 inputs."""
        B, T, _ = h.shape
        H, K, V = self.H, self.K, self.V
        decoding = cache is not None and "S" in cache
        p = self.qkv_proj(h).mT  # (B, ch, T)
        past = cache["conv"] if decoding else p.new_zeros(B, p.size(1), 3)  # inputs t−3..t−1
        window = torch.cat([past, p], -1)  # (B, ch, 3 + T)
        z = F.silu(F.conv1d(window, self.conv.weight, groups=p.size(1)))  # (B, ch, T)
        f32 = torch.float64 if h.dtype == torch.float64 else torch.float32
        q, k, v = z.split([H * K, H * K, H * V], 1)
        q, k = (F.normalize(t.unflatten(1, (H, K)).mT.to(f32), dim=-1, eps=1e-6) for t in (q, k))
        q = q * K ** -0.5  # (B, H, T, K)
        v = v.unflatten(1, (H, V)).mT  # (B, H, T, V)
        beta = torch.sigmoid(self.b_proj(h).to(f32)).mT  # (B, H, T)
        g = (-self.A_log.exp() * F.softplus(self.a_proj(h) + self.dt_bias)).mT  # (B, H, T) fp32
        fla = self.use_fla and _fla_chunk is not None and v.is_cuda
        if decoding:  # fla's kernel runs eagerly; compiled, the plain rule (the compiler fuses it)
            fla = fla and not torch.compiler.is_compiling()
            rule = gated_delta_step_fla if fla else gated_delta_rule_recurrent
            o, S = rule(q, k, v, g, beta, initial_state=cache["S"])
            cache["S"].copy_(S)  # in place: a CUDA graph keeps the cache addresses
            cache["conv"].copy_(window[..., -3:])
            return o
        fla = fla and v.dtype in (torch.float16, torch.bfloat16)
        rule = gated_delta_rule_fla if fla else gated_delta_rule_chunked
        o, S = rule(q, k, v, g, beta, chunk_size=self.chunk, output_final_state=cache is not None)
        if cache is not None:
            cache["S"], cache["conv"] = S.contiguous(), window[..., -3:].contiguous()
            for t in (cache["S"], cache["conv"]):
                torch._dynamo.mark_static_address(t)
        return o

    def read(self, o, gate):
        """o = Sᵀq (B, H, n, V) fp32, gate = W_g x (B, n, H·V) -> W_o(RMSNorm(o) ⊙ SiLU(gate))."""
        o = F.rms_norm(o, (self.V,), self.norm_weight.to(o.dtype), eps=1e-6).transpose(1, 2)
        o = o * F.silu(gate).unflatten(-1, (self.H, self.V))  # (B, n, H, V)
        return F.dropout(self.c_proj(o.flatten(-2)), self.dropout, self.training)

    def forward(self, h, cache=None):
        return self.read(self.write(h, cache), self.g_proj(h))


class Layer(nn.Module):
    """Pre-norm mixer + pre-norm MLP; G has gdn, S attn (named as common.Block's), R both."""

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

    def forward(self, x, cache=None, y=None, plan=None):
        """x (B, T, C); y (B, T, 2): a routed layer's weights [GDN, softmax]; plan: sparse_plan's"""
        h = self.ln_1(x)
        if self.kind == "G":
            mix = self.gdn(h, cache)
        elif self.kind == "S":
            q, k, v = self.attn.qkv(h)  # (B, nh, T, hs)
            if cache is not None:  # prefill
                cache["kv"] = common.KVCache(x.size(0), cache["block_size"], k, v)
            mix = self.attn.c_proj(self.attn.attend(q, k, v))
            mix = F.dropout(mix, self.attn.dropout, self.training)
        elif plan is None:  # y_G·GDN(x) + y_S·Attn(x)
            mix = y[..., :1] * self.gdn(h) + y[..., 1:] * self.attn(h)  # (B, T, C)
        else:
            mix = sparse_mix(self.gdn, self.attn, h, plan, cache)
        x = x + mix
        return x + self.mlp(self.ln_2(x))

    def step(self, x, cache, pos, mask, soft=None):
        """One token x (B, 1, C) at pos (0-d) -> (B, 1, C); soft (B, 1) bool: True = softmax."""
        h = self.ln_1(x)
        if self.kind in "GR":  # every token writes the GDN state ...
            o = self.gdn.write(h, cache)  # (B, H, 1, V)
        if self.kind in "SR":  # ... and its K, V
            q, k, v = self.attn.qkv(h)  # (B, nh, 1, hs)
            k, v = cache["kv"].append(pos, k, v)  # (B, nh, S, hs)
        gdn_read = lambda: self.gdn.read(o, self.gdn.g_proj(h))  # (B, 1, C)
        attn_read = lambda: self.attn.c_proj(self.attn.attend(q, k, v, attn_mask=mask))
        if self.kind != "R":
            mix = gdn_read() if self.kind == "G" else attn_read()
        elif x.size(0) == 1:  # the paper's inference rule: the token reads through one mixer
            mix = common.cond(soft.view(()), attn_read, gdn_read)
        else:  # each row takes its own read
            mix = torch.where(soft[..., None], attn_read(), gdn_read())
        x = x + mix
        return x + self.mlp(self.ln_2(x))


# --------------------------------------------------------------------------------------------------
# Model

class Model(common.LM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = nn.ModuleList([Layer(cfg, kind) for kind in cfg.kinds])
        self.routed = [i for i, kind in enumerate(cfg.kinds) if kind == "R"]
        if self.routed:  # one router after layer 0 for every routed layer (parallel routing, §2.2)
            self.ln_r = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
            self.router = nn.Linear(cfg.n_embd, 2 * len(self.routed), bias=False)
        # τ is a buffer: torch.compile would recompile for every new value of a float attribute
        self.register_buffer("tau", torch.tensor(cfg.tau_start), persistent=False)
        self.forced_route = None  # (B, T, n_routed) bool, True = softmax: benchmarks/tests force
        self.init_weights()
        self.apply(lambda m: m.reset_gdn_parameters() if isinstance(m, GatedDeltaNet) else None)

    def on_step(self, it):
        c = self.cfg
        frac = min(1.0, it / max(1, c.max_iters))
        self.tau.fill_(c.tau_start * (c.tau_end / c.tau_start) ** frac)

    def train_flops_per_token(self, T, stats=None):
        """Training runs both mixers in every routed layer, and the router."""
        return float(flops_per_token(self.cfg, T, sparse=False))

    def logits(self, h0):
        """Router logits z (B, T, nR, 2) of layer 0's output h0 (B, T, C), fp32 under autocast."""
        with torch.autocast(h0.device.type, enabled=False):
            return self.router(self.ln_r(h0)).float().unflatten(-1, (len(self.routed), 2))

    def route(self, h0):
        """h0 (B, T, C) -> weights y (B, T, nR, 2) [GDN, softmax], probabilities, hard (fp32)."""
        z, f = self.logits(h0), self.forced_route
        if f is not None:
            hard = torch.stack([~f, f], -1)[:, :h0.size(1)].to(z)
            return hard, z.softmax(-1), hard
        soft = ((z + gumbel_like(z)) / self.tau).softmax(-1) if self.training else z  # p_τ | z
        # onehot(argmax), a tie to GDN (F.one_hot would read the largest index on the host)
        hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(-1, keepdim=True), 1.0)
        y = hard - soft.detach() + soft if self.training else hard  # straight-through
        return y, z.softmax(-1), hard

    def forward(self, idx, targets=None, sparse=False, caches=None):
        """caches: a dict per layer for prefill to fill."""
        if (sparse or caches is not None) and self.training:
            raise NanorouteError("sparse=True is the inference path: call model.eval() first")
        cs = caches or [None] * len(self.blocks)
        x = self.blocks[0](self.embed(idx), cs[0])  # (B, T, C)
        routes = {}
        if self.routed:
            y, probs, hard = self.route(x)  # (B, T, nR, 2)
            plans = [None] * len(self.routed)
            if sparse:
                order, dump, sizes = sparse_plan(hard)
                sizes = sizes.tolist()  # graph break: the read counts set the gathered shapes
                plans = [(order[..., r], dump[..., r], *n) for r, n in enumerate(sizes)]
            routes = {i: (y[:, :, r], plans[r]) for r, i in enumerate(self.routed)}
        for i, layer in enumerate(self.blocks[1:], start=1):
            x = layer(x, cs[i], *routes.get(i, ()))
        logits, loss = self.head(x if caches is None else x[:, -1:], targets)
        stats = {} if loss is None else {"lm_loss": loss}
        if self.routed:
            gdn_frac = hard[..., 0].mean((0, 1))  # (nR,) cheap path
            for r, i in enumerate(self.routed):
                stats[f"skip_l{i}"] = stats[f"gdn_frac_l{i}"] = gdn_frac[r]
            stats["skipped"] = gdn_frac.mean()
            if self.training:
                stats["tau"] = self.tau.clone()
        stats["flops_saved_hard"] = flops_saved(self.cfg, idx.size(1), stats.get("skipped"),
                                                idx.device)
        if loss is not None and not self.training:  # the noise-free training forward is this one
            stats["soft_loss"] = loss
        if loss is not None and self.routed:
            stats["balance"] = balance_loss(probs, hard)
            loss = loss + self.cfg.balance * stats["balance"]
        return logits, loss, {k: v.detach() for k, v in stats.items()}

    @torch.no_grad()
    def prefill(self, idx):
        """Sparse forward of idx (B, T) filling every layer's cache -> logits (B, V), state."""
        caches = [{"block_size": self.cfg.block_size} for _ in self.blocks]
        logits, _, _ = self(idx, sparse=True, caches=caches)
        return logits[:, -1], (caches, torch.tensor(idx.size(1), device=idx.device))

    @torch.no_grad()
    def step(self, tok, state):
        """tok (B, 1) at pos (0-d) -> logits (B, V), state; no shape changes from token to token."""
        caches, pos = state
        x = self.wte(tok) + self.wpe(pos)  # (B, 1, C)
        kv = [c["kv"] for c in caches if "kv" in c]
        mask = common.past_mask(pos, self.cfg.block_size, kv[0].k.dtype) if kv else None  # (1, S)
        x = self.blocks[0].step(x, caches[0], pos, mask)
        if self.routed and self.forced_route is not None:
            soft = self.forced_route.index_select(1, pos.view(1))  # (B, 1, nR): True = softmax
        elif self.routed:  # eval's rule: argmax z, a tie to GDN
            z = self.logits(x)  # (B, 1, nR, 2)
            soft = z[..., 1] > z[..., 0]
        for i, layer in enumerate(self.blocks[1:], start=1):
            r = self.routed.index(i) if i in self.routed else None
            x = layer.step(x, caches[i], pos, mask, None if r is None else soft[..., r])
        return self.head(x)[0][:, -1], (caches, pos + 1)

    @torch.no_grad()
    def routing_map(self, idx):
        """idx (1, T) -> eval decisions m (nR, T) on CPU (1 = softmax), row names, legend."""
        was_training, hard = self.training, torch.zeros(1, idx.size(1), 0, 2)  # (1, T, nR, 2)
        if self.routed:
            hard = self.eval().route(self.blocks[0](self.embed(idx)))[2]
        self.train(was_training)
        rows = [f"layer {i}" for i in self.routed]
        return hard[0, :, :, 1].T.float().cpu(), rows, ("GDN (linear)", "softmax")


def gumbel_like(z):
    return -torch.empty_like(z).exponential_().clamp_min(1e-20).log()  # γ ~ Gumbel(0, 1)


def balance_loss(probs, hard):
    """Switch's N·Σ_i f_i·P_i per routed layer, mean over layers; probs, hard (..., n_routed, N)."""
    f = hard.detach().flatten(0, -3).float().mean(0)  # (nR, N) token fractions
    P = probs.flatten(0, -3).float().mean(0)  # (nR, N) mean probabilities
    return torch.dot(f.flatten(), P.flatten()) * (probs.size(-1) / probs.size(-2))  # ·N/n_routed


# --------------------------------------------------------------------------------------------------
# Sparse inference: a routed layer runs each read only on the tokens routed to it

def sparse_plan(hard):
    """hard (B, T, nR, 2) -> order, dump (B, T, nR), sizes (nR, 2): [n_gdn, n_soft]. order: a row's
    GDN tokens, then its softmax ones; GDN reads take slots [0, n_gdn), softmax reads
    [T − n_soft, T), a row with fewer of a kind filling them with the other kind's (dump: to T)."""
    T = hard.size(1)
    kind, order = hard[..., 1].sort(dim=1, stable=True)  # (B, T, nR): GDN first
    n_soft = kind.sum(1).long()  # (B, nR)
    dump = order.masked_fill(kind < 0.5, T)
    return order, dump, torch.stack([T - n_soft.amin(0), n_soft.amax(0)], 1)


def sparse_mix(gdn, attn, h, plan, cache=None):
    """Normed h (B, T, C) -> a routed layer's mixer output (B, T, C), each read on its tokens;
    plan: (order, dump, n_gdn, n_soft) of sparse_plan."""
    order, dump, n_gdn, n_soft = plan
    B, T, C = h.shape
    hs = h.gather(1, order[..., None].expand(-1, -1, C))  # (B, T, C) GDN first
    mix = h.new_zeros(B, T + 1, C)  # position T: the dump
    if n_gdn or cache is not None:  # the state holds every token
        o = gdn.write(h, cache)  # (B, H, T, V)
    if n_gdn:  # first: the softmax tokens some rows' slots hold are overwritten below
        rows = order[:, :n_gdn]  # (B, n_gdn)
        o = o.gather(2, rows[:, None, :, None].expand(-1, gdn.H, -1, gdn.V))  # (B, H, n_gdn, V)
        out = gdn.read(o, gdn.g_proj(hs[:, :n_gdn]))  # (B, n_gdn, C)
        mix.scatter_(1, rows[..., None].expand(-1, -1, C), out.to(mix.dtype))
    w, b = attn.c_attn.weight, attn.c_attn.bias
    bq, bkv = (None, None) if b is None else b.split([C, 2 * C])
    if n_soft or cache is not None:  # K, V of every token
        k, v = (attn.split_heads(t) for t in F.linear(h, w[C:], bkv).split(C, -1))  # (B, nh, T, hs)
        if cache is not None:
            cache["kv"] = common.KVCache(B, cache["block_size"], k, v)
    if n_soft:
        q = attn.split_heads(F.linear(hs[:, T - n_soft:], w[:C], bq))  # (B, nh, n_soft, hs)
        at = order[:, T - n_soft:]  # (B, n_soft) positions
        mask = at[:, None, :, None] >= torch.arange(T, device=h.device)  # (B, 1, n_soft, T)
        # n_soft varies: on CUDA, cuDNN would plan itself anew for every length (slow), so not cuDNN
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.MATH]):
            y = attn.c_proj(attn.attend(q, k, v, attn_mask=mask))  # (B, n_soft, C)
        mix.scatter_(1, dump[:, T - n_soft:, None].expand(-1, -1, C), y.to(mix.dtype))
    return mix[:, :T]


# --------------------------------------------------------------------------------------------------
# Accounting (forward FLOPs per token, common.py's conventions: multiply-adds × 2)

def flops_gdn(cfg):
    """(write, read) per token: W_{q,k,v}, W_a, W_b, conv, Sᵀk, k uᵀ, Sᵀq (all tokens); W_g, W_o."""
    d, H, K, V = cfg.n_embd, cfg.n_head, cfg.head_k, cfg.gdn_expand_v * cfg.head_k
    write = 2 * d * H * (2 * K + V) + 2 * d * 2 * H + 2 * 4 * H * (2 * K + V) + 2 * 3 * H * K * V
    return write, 2 * d * H * V + 2 * H * V * d


def flops_per_token(cfg, T, soft_frac=0.0, sparse=False):
    """FLOPs per token, dense-hard (both mixers) or sparse; soft_frac: the softmax share (a list:
    per routed layer)."""
    d = cfg.n_embd
    n_routed = cfg.kinds.count("R")
    fracs = soft_frac if isinstance(soft_frac, (list, tuple)) else [soft_frac] * n_routed
    kv = 2 * common.flops_qkv(d) / 3  # K, V: every token
    query = common.flops_qkv(d) / 3 + common.flops_attn_scores(d, common.mean_context(T)) \
        + common.flops_attn_out(d)  # what a softmax read adds
    write, read = flops_gdn(cfg)
    total = common.flops_lm_head(d, cfg.vocab_size) + cfg.n_layer * common.flops_ffn(d, 4 * d)
    total += sum(kv + query if k == "S" else write + read for k in cfg.kinds if k != "R")
    for s in fracs:  # routed layers: the router's 2 logits, both writes, then the reads
        reads = (1 - s) * read + s * query if sparse else read + query
        total = total + 2 * d * 2 + write + kv + reads
    return total


def flops_saved(cfg, T, skipped, device):
    """1 − sparse / dense-GPT FLOPs per token; skipped: the GDN share of routed token-layers (0-d;
    None: no routed layer)."""
    dense = common.dense_flops_per_token(cfg, T)
    all_gdn, all_soft = (flops_per_token(cfg, T, s, sparse=True) for s in (0.0, 1.0))
    if skipped is None:
        return torch.full((), 1 - all_gdn / dense, device=device)
    return skipped * ((all_soft - all_gdn) / dense) + (1 - all_soft / dense)  # linear in the share


# --------------------------------------------------------------------------------------------------
# Command line

USAGE = """usage: python hybrid_attn.py [-h]

The hybrid of Gated DeltaNet and softmax attention with a per-token router (the module docstring:
python -c "import hybrid_attn; help(hybrid_attn)"). This file is a library; it takes no arguments.
  train:      python train.py --model hybrid --preset classroom
  sample:     python train.py --sample out/hybrid-shakespeare
  benchmark:  python bench.py hybrid"""


def main(argv):
    if argv and argv not in (["-h"], ["--help"]):
        raise NanorouteError(f"unrecognized arguments: {' '.join(argv)} (see --help)")
    print(USAGE)


if __name__ == "__main__":
    common.cli(main)
