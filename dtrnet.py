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
not depend on the sequence length. Variants: `skip` (δ ≡ 0, paper A3) and `no_vo` (the bypass uses LN1(x)
itself instead of LN1(x) W_V W_O, paper A5). Inference: `model.eval()` computes eq. (6) as a dense boolean
mask (the reference); `model(idx, sparse=True)` gathers each row's routed tokens into a padded batch and runs
SDPA on them only; `generate` keeps a KV cache in which D layers store keys/values of routed tokens only.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import NanorouteError

VARIANTS = ("dtrnet", "skip", "no_vo")


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

    def __post_init__(self):
        super().__post_init__()
        layer_pattern(self.layers, self.n_layer)
        if self.variant not in VARIANTS:
            raise NanorouteError(f"variant={self.variant!r}: choose one of {', '.join(VARIANTS)}")
        if self.lam < 0:
            raise NanorouteError(f"lam (λ) must be >= 0, got {self.lam}")
        if self.n_embd < 2:
            raise NanorouteError(f"n_embd={self.n_embd} is too small for a d → d/2 router")

    @property
    def pattern(self):
        return layer_pattern(self.layers, self.n_layer)


# SmolLM-360M (the paper's main scale): 32 layers, d=960. Differences kept from nanoGPT: GELU MLP of 4d (the
# paper: SwiGLU 2560), learned positions (paper: RoPE), full multi-head attention (paper: GQA 5 kv heads).
PRESETS = {"paper": dict(n_layer=32, n_embd=960, n_head=15, block_size=2048, layers="bilayer", lam=8e-4,
                         learning_rate=3e-4, min_lr=1e-5, weight_decay=0.01, grad_clip=0.1, vocab_size=32000)}


# ----------------------------------------------------------------------------------------------------
# Modules

class Router(nn.Module):
    """Eq. (1): two-layer MLP on the residual stream -> probabilities [g_attn, g_bypass]."""

    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.n_embd // 2, bias=cfg.bias)  # W1: d × d/2
        self.w2 = nn.Linear(cfg.n_embd // 2, 2, bias=cfg.bias)           # W2: d/2 × 2

    def forward(self, x):
        return F.softmax(self.w2(F.silu(self.w1(x))), dim=-1)  # (B, T, 2)


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
        g_attn, g_bypass = self.router(x).unbind(-1)  # 2 × (B, T)   eq. (1)
        delta = g_attn > g_bypass                       # (B, T)       eq. (2)
        if self.variant == "skip":                      # A3: no token ever reaches attention
            delta = torch.zeros_like(delta)
        return g_attn, g_bypass, delta

    def w_v(self, h):
        """LN1(x) W_V for every token: the V slice of the fused c_attn (eq. 5 and the values of eq. 4)."""
        C = h.size(-1)
        b = self.attn.c_attn.bias
        return F.linear(h, self.attn.c_attn.weight[2 * C:], None if b is None else b[2 * C:])  # (B, T, C)

    def mix(self, a, h, v, delta, g_attn, g_bypass):
        """Eqs. (3)+(5): routed rows take attention output a, bypassed rows their own value v; W_O; then the
        chosen path is scaled by its router probability (this carries the LM gradient into the router)."""
        y = self.attn.c_proj(torch.where(delta[..., None], a, v))  # (B, T, C)
        if self.variant == "no_vo":                                  # A5: bypass without W_V W_O
            y = torch.where(delta[..., None], y, h)
        g = torch.where(delta, g_attn, g_bypass)                     # (B, T)
        return self.attn.resid_dropout(g[..., None] * y)

    def attn_delta_dense(self, x):
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
        return self.mix(a, h, v, delta, g_attn, g_bypass), g_attn, delta

    def attn_delta_sparse(self, x):
        """Eval only: gather each row's routed tokens into a (B, R_max) padded batch, SDPA on those only,
        scatter back. Bypassed tokens only pay for W_V and W_O."""
        h = self.ln_1(x)
        g_attn, g_bypass, delta = self.route(x)
        v = self.w_v(h)  # (B, T, C)
        a = v
        R = int(delta.sum(1).max())  # the one host sync: the size of the ragged batch
        if R > 0:
            B, T, C = h.shape
            # stable sort puts routed tokens first, in their original order -> causal order is kept
            order = torch.argsort((~delta).to(torch.int8), dim=1, stable=True)[:, :R]  # (B, R)
            idx = order[..., None].expand(B, R, C)
            hr, vr = torch.gather(h, 1, idx), torch.gather(v, 1, idx)                  # (B, R, C)
            W, b = self.attn.c_attn.weight, self.attn.c_attn.bias
            q, k = F.linear(hr, W[:2 * C], None if b is None else b[:2 * C]).chunk(2, dim=-1)
            # Routed tokens are packed first, so for a real query i < R_b every key j <= i is real: the
            # plain causal mask already is "key-padding ∧ causal", and no row is empty (padding rows see
            # key 0; their outputs are discarded). So: is_causal SDPA on (B, nh, R, hs).
            split = self.attn.split_heads
            ar = self.attn.attend(split(q), split(k), split(vr))  # (B, R, C)
            # padding slots are bypassed tokens: what lands there is ignored, mix() takes their own v
            a = v.scatter(1, idx, ar)
        return self.mix(a, h, v, delta, g_attn, g_bypass), g_attn, delta

    def forward(self, x, sparse=False):
        d, g_attn, delta = (self.attn_delta_sparse if sparse else self.attn_delta_dense)(x)
        x = x + d
        return x + self.ffn_delta(x), g_attn, delta


# ----------------------------------------------------------------------------------------------------
# Model

class Model(common.LM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.pattern = cfg.pattern
        self.blocks = nn.ModuleList(DTRBlock(cfg) if c == "D" else common.Block(cfg) for c in self.pattern)
        self.init_weights()

    def forward(self, idx, targets=None, sparse=False):
        if sparse and self.training:
            raise NanorouteError("sparse=True is an inference path: call model.eval() first")
        x = self.embed(idx)  # (B, T, C)
        g_means, fracs = [], []
        for block in self.blocks:
            if isinstance(block, DTRBlock):
                x, g_attn, delta = block(x, sparse)
                g_means.append(g_attn.mean())
                fracs.append(delta.float().mean())  # f_l / (B·T)
            else:
                x = block(x)
        logits, lm_loss = self.head(x, targets)
        stats, rl = {}, 0.0
        if fracs:
            g_means, fracs = torch.stack(g_means), torch.stack(fracs).detach()  # (L_D,)
            rl = routing_loss(g_means, fracs)  # eq. (7)
            stats.update(route_loss=rl.detach(), frac_attn=fracs.mean(),
                         flops_ratio=flops_ratio(self.cfg, idx.size(1), fracs))  # tensor math, no sync
            d_layers = [i for i, c in enumerate(self.pattern) if c == "D"]
            stats.update({f"frac_l{i}": f for i, f in zip(d_layers, fracs)})
        loss = None
        if targets is not None:
            loss = lm_loss + self.cfg.lam * rl
            stats["lm_loss"] = lm_loss.detach()
        return logits, loss, stats

    # ------------------------------------------------------------------------------------------------
    # Cached decoding. Per layer the cache holds K, V: (B, nh, S, hs) and n: (B,) valid slots per row.
    # T layers append every token; D layers only routed ones, so rows get different lengths (padded to S,
    # masked by n). The position is tracked separately (cache["pos"]), because in D layers it != n.

    def new_cache(self, B, device):
        nh, hs = self.cfg.n_head, self.cfg.n_embd // self.cfg.n_head
        empty = lambda: torch.zeros(B, nh, 0, hs, device=device, dtype=self.wte.weight.dtype)
        return {"pos": 0, "layers": [{"k": empty(), "v": empty(), "n": torch.zeros(B, dtype=torch.long,
                                                                                    device=device)}
                                     for _ in self.blocks]}

    @torch.no_grad()
    def decode_step(self, idx, cache):
        """One token per row (B, 1) -> logits (B, V); appends to cache. Prefill = one step per prompt token."""
        pos = cache["pos"]
        if pos >= self.cfg.block_size:
            raise NanorouteError(f"cache is full (block_size {self.cfg.block_size}); start a new cache")
        x = self.drop(self.wte(idx) + self.wpe.weight[pos])  # (B, 1, C)
        for block, c in zip(self.blocks, cache["layers"]):
            h = block.ln_1(x)
            q, k, v = block.attn.qkv(h)  # (B, nh, 1, hs)
            if isinstance(block, DTRBlock):
                g_attn, g_bypass, delta = block.route(x)  # (B, 1)
            else:
                delta = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
            r = delta[:, 0]  # (B,)
            rows = r.nonzero()[:, 0]
            if len(rows):  # routed rows append their key/value at slot n; grow S by one slot if needed
                if int(c["n"][rows].max()) == c["k"].size(2):
                    pad = c["k"].new_zeros(*c["k"].shape[:2], 1, c["k"].size(3))
                    c["k"], c["v"] = torch.cat([c["k"], pad], 2), torch.cat([c["v"], pad], 2)
                c["k"][rows, :, c["n"][rows]] = k[rows, :, 0]
                c["v"][rows, :, c["n"][rows]] = v[rows, :, 0]
                c["n"] = c["n"] + r
            v = v.transpose(1, 2).reshape_as(x)  # (B, 1, C)
            a = v
            if c["k"].size(2):  # attention over the valid slots; bypassed rows are masked to "see all"
                S = c["k"].size(2)  # (finite zeros, result discarded) so no row is all -inf
                mask = (torch.arange(S, device=x.device) < c["n"][:, None]) | ~r[:, None]  # (B, S)
                a = block.attn.attend(q, c["k"], c["v"], mask[:, None, None, :])  # (B, 1, C)
            if isinstance(block, DTRBlock):
                x = x + block.mix(a, h, v, delta, g_attn, g_bypass)
            else:
                x = x + block.attn.resid_dropout(block.attn.c_proj(a))
            x = x + block.ffn_delta(x)
        cache["pos"] = pos + 1
        return self.lm_head(self.ln_f(x))[:, -1]  # (B, V)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, return_cache=False):
        """Cached sampling. When the position reaches block_size the cache is rebuilt from the last
        block_size/2 tokens (learned positions cannot go further)."""
        cache, logits = None, None
        for _ in range(max_new_tokens):
            if cache is None or cache["pos"] == self.cfg.block_size:
                ctx = idx[:, -(self.cfg.block_size // 2 if cache else self.cfg.block_size):]
                cache = self.new_cache(idx.size(0), idx.device)
                for t in range(ctx.size(1)):
                    logits = self.decode_step(ctx[:, t:t + 1], cache)
            idx = torch.cat([idx, common.sample_next(logits, temperature, top_k)], dim=1)
            if cache["pos"] < self.cfg.block_size:  # feed the sampled token (the last one needs no step)
                logits = self.decode_step(idx[:, -1:], cache)
        return (idx, cache) if return_cache else idx


def kv_cache_bytes(cache):
    """Bytes held by the cache vs a dense model that caches every token in every layer."""
    held = sum((c["k"].numel() + c["v"].numel()) * c["k"].element_size() for c in cache["layers"])
    k = cache["layers"][0]["k"]
    dense = len(cache["layers"]) * 2 * k.size(0) * k.size(1) * cache["pos"] * k.size(3) * k.element_size()
    return held, dense


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
