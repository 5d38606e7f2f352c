"""
DTRNet: Dynamic Token Routing Network to Reduce Quadratic Costs in Transformers (Sharma et al., 2025).

A stack of dense Transformer layers (T) and DTRNet layers (D), e.g. T-D-T-D-…-T ("bilayer"). In a D layer a
router sends each token either through causal attention among the routed tokens (quadratic path) or
through W_V·W_O alone (linear path: the token attends only to itself); every token then gets the MLP.

  (1) G_i = softmax(SiLU(x_i W1) W2) = [g_attn, g_bypass]      router on the residual stream, W1: d×d/2, W2: d/2×2
  (2) δ_i = [g_attn > g_bypass]                                  hard token-choice routing, train AND inference
  (3) δ_i=1:  x_i + g_attn · Attn(LN1 x)_i                         then the shared MLP (pre-norm residual form)
  (4) Attn = softmax(q Kᵀ/√d_h + M) V W_O
  (5) δ_i=0:  x_i + g_bypass · LN1(x_i) W_V W_O                    same LN1, W_V, W_O as the attention path
  (6) M = g̃ g̃ᵀ ∧ causal                                           routed tokens see only earlier routed tokens
  (7) L = CE + λ Σ_l α_l · mean_i g_attn,i^(l),  α_l = f_l / Σ_j f_j,  f_l = Σ_i δ_i^(l)  (no gradient through α)

Eq. (7) in the paper writes ‖G[:,0]‖₁; like the authors' code we take the mean over tokens, so λ = 8e-4 does
not depend on the sequence length. The first and last layers are always T (paper, "Architectural Design
Choices"; the authors' released model code instead makes its *listed* layers dense, i.e. routes the first and
last layers: we follow the paper). Variants: `skip` (δ ≡ 0, paper A3) and `no_vo` (the bypass uses LN1(x)
itself instead of LN1(x) W_V W_O, paper A5).

Paths (all with the same hard decisions δ):
  - training and `model(idx, sparse=True)` pack each row's routed tokens to the front (a stable sort keeps
    their order), so eq. (6) among them is plain causal SDPA on (B, nh, R, hs) — a flash kernel, no mask;
    bypassed tokens pay only W_V and W_O. One host sync per D layer reads R = max routed count.
  - `model.eval()` with sparse=False: the reference, eq. (6) as a dense (B, 1, T, T) boolean mask.
  - cached decoding, `prefill(idx)` (the packed forward, one batch) then `step(tok, state)`. T layers cache
    every token; a D layer caches K/V of its routed tokens only — a bypassed token has no key there (eq. 6:
    no later token attends to it), so at decode it skips Q, K and attention and contributes nothing to that
    layer's cache; it still pays the router, W_V, W_O, the MLP and its K/V in every T layer.
Numerics (common.py's policy): fp32 residual stream, router probabilities in fp32, deltas cast where added,
caches typed from the first K/V they receive.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import NanorouteError

VARIANTS = ("dtrnet", "skip", "no_vo")
NORMS = ("layernorm", "rmsnorm")


def layer_pattern(spec, n_layer):
    """'bilayer' T-D-T-D…, 'trilayer' T-D-D-T…, 'laterhalf' T…T D…D, or an explicit T/D string. Presets
    force the last layer to T (the paper keeps the first and last layers dense)."""
    presets = {"bilayer": lambda i: "TD"[i % 2], "trilayer": lambda i: "TDD"[i % 3],
               "laterhalf": lambda i: "T" if i < n_layer // 2 else "D"}
    if spec in presets:
        p = "".join(presets[spec](i) for i in range(n_layer))
        return p[:-1] + "T" if n_layer > 1 else p
    if not spec or set(spec) - set("TD"):
        raise NanorouteError(f"layers={spec!r}: use bilayer, trilayer, laterhalf or a string of T and D")
    if len(spec) != n_layer:
        raise NanorouteError(f"layers={spec!r} has {len(spec)} letters but n_layer={n_layer}")
    if spec[0] != "T" or spec[-1] != "T":
        raise NanorouteError(f"layers={spec!r}: the first and last layers must be T (dense)")
    return spec


@dataclass
class Config(common.Config):
    # CPU preset: 7 layers × 128 wide, context 256 (bilayer = T D T D T D T)
    n_layer: int = 7
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 256
    layers: str = "bilayer"   # T/D pattern (see layer_pattern)
    lam: float = 8e-4         # λ of eq. (7): 8e-4 at 360M, 6e-4 at 1.3B
    variant: str = "dtrnet"   # dtrnet | skip (A3: nothing routed) | no_vo (A5: bypass without W_V W_O)
    norm: str = "layernorm"   # layernorm (nanoGPT) | rmsnorm (the paper's LLaMA blocks)

    def __post_init__(self):
        super().__post_init__()
        layer_pattern(self.layers, self.n_layer)
        if self.variant not in VARIANTS:
            raise NanorouteError(f"variant={self.variant!r}: choose one of {', '.join(VARIANTS)}")
        if self.norm not in NORMS:
            raise NanorouteError(f"norm={self.norm!r}: choose one of {', '.join(NORMS)}")
        if not self.lam >= 0:
            raise NanorouteError(f"lam (λ) must be >= 0, got {self.lam}")
        if self.n_embd < 2:
            raise NanorouteError(f"n_embd={self.n_embd} is too small for a d → d/2 router")

    @property
    def pattern(self):
        return layer_pattern(self.layers, self.n_layer)


# SmolLM-360M (the paper's main scale): 32 layers, d=960, RMSNorm, AdamW 3e-4 / wd 0.01 / clip 0.1, cosine with a
# 10% warm-up (set here for the preset's max_iters: change both together). Differences kept from nanoGPT: GELU
# MLP of 4d (paper: SwiGLU 2560), learned positions (paper: RoPE), full multi-head attention (paper: GQA).
# classroom: 4 layers T D D T at the paper's λ (measured: ~65% of D-layer tokens bypass attention after 1500
# iters, with a visible pattern; λ = 0.01 or 0.05 closes every D layer to attention within 200 iters).
PRESETS = {"paper": dict(n_layer=32, n_embd=960, n_head=15, block_size=2048, layers="bilayer", lam=8e-4,
                         norm="rmsnorm", learning_rate=3e-4, min_lr=1e-5, weight_decay=0.01, grad_clip=0.1,
                         max_iters=2250, warmup_iters=225, vocab_size=32000),
           "classroom": dict(common.CLASSROOM, layers="trilayer", lam=8e-4)}


# ----------------------------------------------------------------------------------------------------
# Modules

class Router(nn.Module):
    """Eq. (1): two-layer MLP on the residual stream -> probabilities [g_attn, g_bypass] in fp32."""

    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.n_embd // 2, bias=cfg.bias)  # W1: d × d/2
        self.w2 = nn.Linear(cfg.n_embd // 2, 2, bias=cfg.bias)           # W2: d/2 × 2

    def forward(self, x):
        z = self.w2(F.silu(self.w1(x)))  # (B, T, 2) logits; bf16/fp16 under autocast
        return F.softmax(z, dim=-1, dtype=torch.promote_types(z.dtype, torch.float32))  # at least fp32


def router_params(cfg):
    """Parameters one router adds: d·d/2 + d/2·2 (+ biases)."""
    h = cfg.n_embd // 2
    return cfg.n_embd * h + h * 2 + (h + 2) * cfg.bias


class DTRBlock(common.Block):
    """A D layer: common.Block's parameters (so a dense checkpoint loads) plus a router."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.router = Router(cfg)
        self.variant = cfg.variant

    def route(self, x):
        g_attn, g_bypass = self.router(x).unbind(-1)  # 2 × (B, T)   eq. (1), on the residual stream x
        delta = g_attn > g_bypass                       # (B, T)       eq. (2)
        if self.variant == "skip":                      # A3: no token ever reaches attention
            delta = torch.zeros_like(delta)
        return g_attn, g_bypass, delta

    def proj(self, h, part):
        """Slices of the fused c_attn: part 'qk' -> LN1(x) [W_Q W_K] (B, T, 2C), 'v' -> LN1(x) W_V (B, T, C)."""
        C, W, b = h.size(-1), self.attn.c_attn.weight, self.attn.c_attn.bias
        s = slice(0, 2 * C) if part == "qk" else slice(2 * C, 3 * C)
        return F.linear(h, W[s], None if b is None else b[s])

    def mix(self, a, h, v, delta, g_attn, g_bypass):
        """Eqs. (3)+(5): routed rows take attention output a, bypassed rows their own value v; W_O; then the
        chosen path is scaled by its router probability (this carries the LM gradient into the router)."""
        y = self.attn.c_proj(torch.where(delta[..., None], a, v))  # (B, T, C)
        if self.variant == "no_vo":                                  # A5: bypass without W_V W_O
            y = torch.where(delta[..., None], y, h)
        g = torch.where(delta, g_attn, g_bypass)                     # (B, T) fp32
        return self.attn.resid_dropout(g[..., None] * y)             # (B, T, C) fp32

    def attn_delta_masked(self, x):
        """Reference: attention over all tokens with the boolean mask of eq. (6)."""
        h = self.ln_1(x)
        g_attn, g_bypass, delta = self.route(x)
        q, k, v = self.attn.qkv(h)  # (B, nh, T, hs)
        T = x.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=x.device)
        # eq. (6); "| eye" lets a bypassed row see itself, so no row is all -inf (no NaN). Its result is
        # exactly v_i, which mix() takes from v anyway.
        mask = (delta[:, None, :, None] & delta[:, None, None, :] & causal) | eye  # (B, 1, T, T)
        a = self.attn.attend(q, k, v, mask)                                        # (B, T, C)
        v = v.transpose(1, 2).reshape_as(a)                                        # (B, T, C)
        return self.mix(a, h, v, delta, g_attn, g_bypass), g_attn, delta, None

    def attn_delta_packed(self, x):
        """Training, sparse inference and prefill: gather each row's routed tokens into a (B, R) packed batch,
        causal SDPA on those only, scatter back. Also returns their K, V (B, nh, R, hs) for a cache."""
        h = self.ln_1(x)
        g_attn, g_bypass, delta = self.route(x)
        v = self.proj(h, "v")  # (B, T, C): every token needs its value (eq. 5)
        a, kv = v, None
        R = int(delta.sum(1).max())  # host sync (one per D layer): the packed length
        if R > 0:
            B, T, C = h.shape
            # a stable sort puts routed tokens first, in their original order, so for a real query i < R_b
            # every key j <= i is real: plain causal SDPA is "key-padding ∧ causal" and no row is empty
            # (padding queries at the end see real keys; their outputs land on bypassed slots, dropped by mix)
            order = torch.argsort((~delta).to(torch.int8), dim=1, stable=True)[:, :R]  # (B, R)
            idx = order[..., None].expand(B, R, C)
            q, k = self.proj(torch.gather(h, 1, idx), "qk").chunk(2, dim=-1)       # 2 × (B, R, C)
            split = self.attn.split_heads
            q, k, vr = split(q), split(k), split(torch.gather(v, 1, idx))          # (B, nh, R, hs)
            a = v.scatter(1, idx, self.attn.attend(q, k, vr).to(v.dtype))         # (B, T, C)
            kv = (k, vr)
        return self.mix(a, h, v, delta, g_attn, g_bypass), g_attn, delta, kv

    def forward(self, x, packed=False):
        d, g_attn, delta, kv = (self.attn_delta_packed if packed else self.attn_delta_masked)(x)
        x = x + d
        return x + self.ffn_delta(x).to(x.dtype), g_attn, delta, kv


# ----------------------------------------------------------------------------------------------------
# Model

class Model(common.LM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.pattern = cfg.pattern
        self.d_layers = [i for i, c in enumerate(self.pattern) if c == "D"]
        self.blocks = nn.ModuleList(DTRBlock(cfg) if c == "D" else common.Block(cfg) for c in self.pattern)
        if cfg.norm == "rmsnorm":  # the paper's LLaMA blocks: every LayerNorm (ln_1, ln_2, ln_f) -> RMSNorm
            for mod in [self, *self.blocks]:
                for name, child in list(mod.named_children()):
                    if isinstance(child, nn.LayerNorm):
                        setattr(mod, name, nn.RMSNorm(cfg.n_embd, eps=1e-5))
        self.init_weights()

    def trunk(self, x, packed):
        """All blocks; returns x and [(g_attn, δ, K/V of the routed tokens or None)] per D layer."""
        routes = []
        for block in self.blocks:
            if isinstance(block, DTRBlock):
                x, g_attn, delta, kv = block(x, packed)
                routes.append((g_attn, delta, kv))
            else:
                x = block(x)
        return x, routes

    def forward(self, idx, targets=None, sparse=False):
        if sparse and self.training:
            raise NanorouteError("sparse=True is an inference path: call model.eval() first")
        x, routes = self.trunk(self.embed(idx), packed=self.training or sparse)  # (B, T, C)
        logits, lm_loss = self.head(x, targets)
        stats, rl = {}, 0.0
        if routes:
            g_means = torch.stack([g.mean() for g, _, _ in routes])          # (L_D,) mean g_attn per layer
            fracs = torch.stack([d.float().mean() for _, d, _ in routes])    # (L_D,) f_l / (B·T)
            rl = routing_loss(g_means, fracs)  # eq. (7)
            T = idx.size(1)
            ratio = flops_per_token(self.cfg, T, fracs) / common.dense_flops_per_token(self.cfg, T)
            stats.update(route_loss=rl.detach(), frac_attn=fracs.mean(), skipped=1 - fracs.mean(),
                         flops_ratio=ratio, flops_saved_hard=1 - ratio)  # tensor math, no sync
            for i, f in zip(self.d_layers, fracs):
                stats[f"frac_l{i}"], stats[f"skip_l{i}"] = f, 1 - f  # routed to attention / bypassed
        loss = None
        if targets is not None:
            loss = lm_loss + self.cfg.lam * rl
            stats["lm_loss"] = lm_loss.detach()
            if not self.training:  # DTRNet trains with the same hard δ (eq. 2): training's loss is this one
                stats["soft_loss"] = stats["lm_loss"]
        return logits, loss, stats

    @torch.no_grad()
    def routing_map(self, idx):
        """idx (1, T) -> (m (L_D, T): 1 = the token took attention at that D layer (hard, what inference
        runs), row labels, legend)."""
        was_training = self.training
        self.eval()
        _, routes = self.trunk(self.embed(idx), packed=True)
        self.train(was_training)
        m = torch.stack([d[0].float() for _, d, _ in routes]).cpu() if routes else torch.zeros(0, idx.size(1))
        return m, [f"layer {i}" for i in self.d_layers], ("bypass (W_V·W_O)", "attention")

    # ------------------------------------------------------------------------------------------------
    # Cached decoding (common.LM.generate drives it): state = (one cache per layer, position).

    @torch.no_grad()
    def prefill(self, idx):
        """idx (B, T) -> logits (B, V) of the last position and the caches, from one packed forward."""
        B, T = idx.shape
        x, caches = self.embed(idx), []  # (B, T, C)
        for block in self.blocks:
            if isinstance(block, DTRBlock):
                x, _, delta, kv = block(x, packed=True)
                caches.append(RoutedKVCache(delta.sum(1), self.cfg.block_size, *(kv or ())))
            else:
                x, cache = block.prefill(x, self.cfg.block_size)
                caches.append(cache)
        return self.head(x[:, -1:])[0][:, -1], (caches, T)

    @torch.no_grad()
    def step(self, tok, state):
        """tok (B, 1) at position pos -> logits (B, V) and the state with its K/V appended."""
        caches, pos = state
        if pos >= self.cfg.block_size:
            raise NanorouteError(f"position {pos} is past block_size {self.cfg.block_size}: prefill a new window")
        x = self.wte(tok) + self.wpe.weight[pos]  # (B, 1, C)
        for block, cache in zip(self.blocks, caches):
            if not isinstance(block, DTRBlock):
                x = block.step(x, cache, pos)
                continue
            h = block.ln_1(x)
            g_attn, g_bypass, delta = block.route(x)  # (B, 1)
            v = block.proj(h, "v")                    # (B, 1, C)
            a = v
            if delta.any():  # host sync (one per D layer): a token no row routes skips Q, K and attention
                split = block.attn.split_heads
                q, k = block.proj(h, "qk").chunk(2, dim=-1)                # 2 × (B, 1, C)
                K, V, valid = cache.append(split(k), split(v), delta[:, 0])  # (B, nh, L, hs), (B, L)
                # a bypassed row's result is dropped by mix(); letting it see every slot avoids all -inf
                a = block.attn.attend(split(q), K, V, (valid | ~delta)[:, None, None, :])  # (B, 1, C)
            x = x + block.mix(a, h, v, delta, g_attn, g_bypass)
            x = x + block.ffn_delta(x).to(x.dtype)
        return self.head(x)[0][:, -1], (caches, pos + 1)


class RoutedKVCache:
    """K/V of one D layer for its routed tokens only, packed per row: row b holds n[b] valid slots in token
    order. Allocated from the first K/V it receives (their dtype); the capacity doubles when full (O(S)
    copying in all, memory <= 2× the routed tokens and never above block_size: the paper's KV saving).
    `bound` is a host-side upper bound on n.max(), so an append needs a host sync only near capacity."""

    def __init__(self, n, block_size, k=None, v=None):
        self.n, self.block_size = n, block_size  # n: (B,) valid slots per row
        self.k = self.v = None
        self.bound = 0
        if k is not None:  # prefill: k, v (B, nh, R, hs) packed, slots >= n[b] are padding
            self.reserve(k, k.size(2))
            self.k[:, :, :k.size(2)], self.v[:, :, :k.size(2)] = k, v
            self.bound = k.size(2)

    def reserve(self, like, need):
        cap = 0 if self.k is None else self.k.size(2)
        if need <= cap:
            return
        new = min(self.block_size, max(2 * cap, need, 16))
        k, v = like.new_zeros(*like.shape[:2], new, like.size(3)), like.new_zeros(*like.shape[:2], new, like.size(3))
        if cap:
            k[:, :, :cap], v[:, :, :cap] = self.k, self.v
        self.k, self.v = k, v  # (B, nh, capacity, hs)

    def append(self, k, v, routed):
        """k, v (B, nh, 1, hs) of the new token; routed (B,). Every row writes at its slot n[b] (a row that did
        not route writes past its valid slots: harmless), then n += routed. Returns the first `bound` slots
        K, V (B, nh, L, hs) and which are valid (B, L)."""
        if self.k is None or self.bound == self.k.size(2):
            self.bound = int(self.n.max())  # host sync, only when the capacity might be reached
            self.reserve(k, self.bound + 1)
        slot = self.n.view(-1, 1, 1, 1).expand_as(k)  # (B, nh, 1, hs)
        self.k.scatter_(2, slot, k.to(self.k.dtype))
        self.v.scatter_(2, slot, v.to(self.v.dtype))
        self.n = self.n + routed
        self.bound += 1
        valid = torch.arange(self.bound, device=k.device) < self.n[:, None]  # (B, L)
        return self.k[:, :, :self.bound], self.v[:, :, :self.bound], valid


def kv_cache_bytes(state):
    """(bytes this cache holds, bytes a dense model's cache holds: every layer preallocated to block_size)."""
    caches, _ = state
    held = sum(c.k.numel() * c.k.element_size() * 2 for c in caches if c.k is not None)
    t = next(c for c in caches if isinstance(c, common.KVCache))  # the first layer is always T
    return held, len(caches) * 2 * t.k.numel() * t.k.element_size()


# ----------------------------------------------------------------------------------------------------
# Loss, eq. (7)

def routing_loss(g_means, fracs):
    """Σ_l α_l · mean(g_attn,l) with α_l = f_l / Σ_j f_j from the hard counts (no gradient; 0 if Σ f = 0).
    g_means, fracs: (L_D,) mean router probability and routed fraction of each D layer."""
    f = fracs.detach()
    alpha = f / f.sum().clamp_min(1e-12)  # (L_D,)
    return (alpha * g_means).sum()


# ----------------------------------------------------------------------------------------------------
# Accounting: forward FLOPs per token from common.py's functions

def flops_router(d):
    return 2 * (d * (d // 2) + (d // 2) * 2)


def flops_per_token(cfg, T, rho, hidden=None, pattern=None):
    """rho: fraction of tokens routed to attention in each D layer (a float or one value per D layer).
    A routed token pays Q, K, V, W_O and scores over the ~rho·mean_context(T) routed keys before it; a
    bypassed token pays V and W_O; every D-layer token pays the router and the MLP. hidden: MLP width
    (4d for our GELU MLP; a SwiGLU of width h costs like hidden = 1.5h)."""
    d, hidden = cfg.n_embd, hidden or 4 * cfg.n_embd
    pattern = pattern or cfg.pattern
    n_d = pattern.count("D")
    rho = rho if hasattr(rho, "__len__") else [rho] * n_d  # floats or a (L_D,) tensor
    dense = (common.flops_qkv(d) + common.flops_attn_out(d) + common.flops_ffn(d, hidden)
             + common.flops_attn_scores(d, common.mean_context(T)))
    total, j = common.flops_lm_head(d, cfg.vocab_size), 0
    for c in pattern:
        if c == "T":
            total += dense
            continue
        r = rho[j]; j += 1
        total += (flops_router(d) + common.flops_qkv(d) * (1 + 2 * r) / 3 + common.flops_attn_out(d)
                  + common.flops_ffn(d, hidden) + r * common.flops_attn_scores(d, r * common.mean_context(T)))
    return total


def flops_ratio(cfg, T, rho, hidden=None, pattern=None):
    """DTRNet FLOPs / dense FLOPs (same dims, every layer T) at sequence length T."""
    pattern = pattern or cfg.pattern
    return (flops_per_token(cfg, T, rho, hidden, pattern)
            / flops_per_token(cfg, T, [], hidden, "T" * len(pattern)))
