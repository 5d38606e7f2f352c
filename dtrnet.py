"""
DTRNet: Dynamic Token Routing Network to Reduce Quadratic Costs in Transformers.
A. Sharma, S. Najafi, P. Farinneya, B. Jamialahmadi, M. S. Tahaei, Y. Fan, M. Rezagholizadeh,
B. Chen, A. Jafari (2025), arXiv:2509.00925.

A stack of dense Transformer layers (T) and DTRNet layers (D), e.g. T-D-T-D-…-T ("bilayer"). In a D
layer a router sends each token either through causal attention among the routed tokens (quadratic
path) or through W_V W_O alone (linear path: it attends only to itself); every token gets the MLP.

  (1) G_i = softmax(SiLU(x_i W1) W2) = [g_attn, g_bypass]   router on the residual stream
  (2) δ_i = 1 if g_attn > g_bypass else 0                  strict (a tie bypasses), in training too
  (3) δ_i = 1:  x_i + g_attn · Attn(LN1 x)_i, then the MLP   (the pre-norm residual form)
  (4) Attn(x)_i = softmax(q_i Kᵀ / √d_h + M) V W_O
  (5) δ_i = 0:  x_i + g_bypass · LN1(x_i) W_V W_O, then the MLP   (eq. 4's LN1, W_V and W_O)
  (6) M = g̃ g̃ᵀ ∧ causal                                   routed tokens see earlier routed ones
  (7) L = CE + λ Σ_l α_l mean_i g_attn,i^(l),  α_l = f_l / Σ_j f_j,  f_l = Σ_i δ_i^(l)  (α: no grad)

Variants: `skip` (δ ≡ 0, paper A3), `no_vo` (the bypass adds LN1(x), not LN1(x) W_V W_O; A5).
Deviations from the paper, one line each (why: results/dtrnet.md, "Choices … and deviations"):
  - eq. (7) takes the mean over tokens, not ‖G[:,0]‖₁ (as the authors' code): λ is free of T.
  - the first and last layers are T, as the paper says (the authors' released code routes them).
  - nanoGPT's GELU MLP of width 4d, learned positions, full multi-head attention (paper: SwiGLU,
    RoPE, GQA); LayerNorm unless `norm=rmsnorm` (the paper's RMSNorm, set by the paper preset).
  - routers have biases only with `bias=True` (off in the paper preset); the authors' routers do.
  - no "route 15% of the tokens when none is routed" fallback (the authors' training code has one).
  - the decode step computes a bypassed token's K (fixed shapes); its Q and attention are skipped.

Paths, all with the same δ: training and `sparse=True` attend among each row's routed tokens
packed to the front (DTRBlock.attend_packed); `eval()` is the reference, eq. (6) as a boolean mask;
cached decoding keeps K/V of a D layer's routed tokens only (no later token attends to the others).
Numerics (common.py's policy): fp32 residual stream and router probabilities.
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
    """'bilayer' T-D-T-D…, 'trilayer' T-D-D-T…, 'laterhalf' T…T D…D (each ending in T, as the
    paper's), or an explicit T/D string."""
    presets = {"bilayer": lambda i: "TD"[i % 2], "trilayer": lambda i: "TDD"[i % 3],
               "laterhalf": lambda i: "T" if i < n_layer // 2 else "D"}
    if spec in presets:
        return "".join(presets[spec](i) for i in range(n_layer))[:-1] + "T"
    if not spec or set(spec) - set("TD"):
        raise NanorouteError(f"layers={spec!r}: use bilayer, trilayer, laterhalf or a string of "
                             "T and D")
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
    variant: str = "dtrnet"   # dtrnet | skip (A3: nothing routed) | no_vo (A5: no W_V W_O bypass)
    norm: str = "layernorm"   # layernorm (nanoGPT) | rmsnorm (the paper's LLaMA blocks)

    def __post_init__(self):
        super().__post_init__()
        if "D" not in layer_pattern(self.layers, self.n_layer):  # T only: a dense GPT
            raise NanorouteError(f"layers={self.layers!r} at n_layer={self.n_layer} gives "
                                 f"{self.pattern!r}, no D (routed) layer: nothing is routed; "
                                 "use --model gpt, or n_layer >= 3")
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


# paper: SmolLM-360M, the paper's main scale (a 10% warm-up: change it with max_iters). classroom:
# T D D T at the paper's λ (~65% of D-layer tokens bypass attention after 1500 iters, measured).
PRESETS = {"paper": dict(n_layer=32, n_embd=960, n_head=15, block_size=2048, layers="bilayer",
                         lam=8e-4, norm="rmsnorm", learning_rate=3e-4, min_lr=1e-5,
                         weight_decay=0.01, grad_clip=0.1, max_iters=2250, warmup_iters=225,
                         vocab_size=32000),
           "classroom": dict(common.CLASSROOM, layers="trilayer", lam=8e-4),
           # common.GPU (one GPU, ~an hour): bilayer at the 360M model's λ; GPT-2's LayerNorm (so
           # --init_from gpt2 loads); not compiled (COMPILE_REFUSED on CUDA)
           "gpu": dict(common.GPU, layers="bilayer", lam=8e-4, compile=False)}

# Refused until tests/test_common.py's compile test passes on CUDA.
COMPILE_REFUSED = {"cuda": "`python train.py --model=dtrnet --n_layer=4 --n_embd=32 --compile=true`"
                           " failed on an H100 with torch 2.11.0+cu130 (Triton, make_ttgir: "
                           "PassManager::run failed on inductor's fused loss + routing-stats "
                           "kernel); train without --compile on CUDA"}


# Router, eqs. (1)-(2)

class Router(nn.Module):
    """Eq. (1): a two-layer MLP on the residual stream -> [g_attn, g_bypass], at least in fp32
    (autocast off: the decision does not depend on the dtype the blocks run in)."""

    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.n_embd // 2, bias=cfg.bias)  # W1: d × d/2
        self.w2 = nn.Linear(cfg.n_embd // 2, 2, bias=cfg.bias)  # W2: d/2 × 2

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            z = self.w2(F.silu(self.w1(x.to(torch.promote_types(x.dtype, torch.float32)))))
            return F.softmax(z, dim=-1)  # (B, T, 2)


def router_params(cfg):
    """Parameters one router adds: d·d/2 + d/2·2 (+ biases)."""
    h = cfg.n_embd // 2
    return cfg.n_embd * h + h * 2 + (h + 2) * cfg.bias


# Block

class DTRBlock(common.Block):
    """A D layer: common.Block's parameters (so a dense checkpoint loads) plus a router."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.router = Router(cfg)
        self.variant = cfg.variant

    def route(self, x):
        """x (B, T, C) -> g_attn, g_bypass (B, T), fp32 (eq. 1), and δ (B, T) bool (eq. 2)."""
        g_attn, g_bypass = self.router(x).unbind(-1)
        delta = g_attn > g_bypass  # eq. (2) is strict: a tie bypasses
        if self.variant == "skip":  # A3: no token ever reaches attention
            delta = torch.zeros_like(delta)
        return g_attn, g_bypass, delta

    def proj(self, h, part):
        """h = LN1(x) times W_Q, W_K, W_V or [W_Q W_K] (part 'q', 'k', 'v', 'qk': c_attn's rows)."""
        C = h.size(-1)
        s = {"q": slice(0, C), "k": slice(C, 2 * C), "v": slice(2 * C, 3 * C), "qk": slice(2 * C)}
        W, b = self.attn.c_attn.weight[s[part]], self.attn.c_attn.bias
        return F.linear(h, W, None if b is None else b[s[part]])

    def mix(self, x, a, h, v, delta, g):
        """Eqs. (3) and (5): x + g·a W_O for a routed token (a: its attention output), x + g·v W_O
        for a bypassed one (v = LN1(x) W_V); (B, T, C). g (B, T), the chosen path's probability,
        carries the LM's gradient into the router."""
        y = self.attn.c_proj(torch.where(delta[..., None], a, v))  # (B, T, C)
        if self.variant == "no_vo":  # A5: bypass without W_V W_O
            y = torch.where(delta[..., None], y, h)
        return x + g[..., None] * F.dropout(y, self.attn.dropout, self.training)

    def attend_masked(self, h, v, delta):
        """The reference: attention of every token under eq. (6)'s boolean mask -> (B, T, C)."""
        split = self.attn.split_heads
        q, k = self.proj(h, "qk").chunk(2, dim=-1)  # 2 × (B, T, C)
        T = h.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=h.device)
        # eq. (6), "| eye": a bypassed row sees itself, so no row is all -inf (no NaN)
        mask = (delta[:, None, :, None] & delta[:, None, None, :] & causal) | eye  # (B, 1, T, T)
        return self.attn.attend(split(q), split(k), split(v), mask)

    def attend_packed(self, h, v, delta, R):
        """Eqs. (4) and (6) on the routed tokens alone: each row's routed tokens gathered to the
        front of a (B, R) batch, plain causal attention, scattered back -> (B, T, C), their K, V."""
        B, T, C = h.shape
        # A stable sort puts routed tokens first, in their order: for a routed query i < n_b every
        # key j <= i is routed, so eq. (6) is plain causal attention there and no row is empty.
        # Rows i >= n_b hold bypassed tokens: mix() discards their outputs.
        order = torch.sort(delta, dim=1, descending=True, stable=True).indices[:, :R]  # (B, R)
        idx = order[..., None].expand(B, R, C)
        q, k = self.proj(torch.gather(h, 1, idx), "qk").chunk(2, dim=-1)  # 2 × (B, R, C)
        q, k, vr = [self.attn.split_heads(t) for t in (q, k, torch.gather(v, 1, idx))]
        a = v.scatter(1, idx, self.attn.attend(q, k, vr))  # (B, T, C)
        return a, (k, vr)  # K, V: (B, nh, R, hs)

    def forward(self, x, packed=False):
        """x (B, T, C) -> (output, g_attn (B, T), δ (B, T), routed tokens' K, V or None)."""
        h = self.ln_1(x)  # (B, T, C)
        g_attn, g_bypass, delta = self.route(x)  # eqs. (1)-(2)
        v = self.proj(h, "v")  # (B, T, C): every token's value (eq. 5)
        if not packed:
            a, kv = self.attend_masked(h, v, delta), None
        elif self.training and torch.compiler.is_compiling():  # every row padded to T: one graph
            a, kv = self.attend_packed(h, v, delta, x.size(1))
        else:  # the longest row's length, read on the host
            a, kv = self.attend_packed(h, v, delta, pack_length(delta))
        x = self.mix(x, a, h, v, delta, torch.where(delta, g_attn, g_bypass))
        return x + self.ffn_delta(x), g_attn, delta, kv

    def step(self, x, cache):
        """One token x (B, 1, C) against this layer's RoutedKVCache: a routed token (eq. 2) attends
        to the routed tokens before it and stays in the cache, a bypassed one takes eq. (5) alone.
        At B > 1 attention runs if any row is routed, and each row takes its own path."""
        h = self.ln_1(x)  # (B, 1, C)
        g_attn, g_bypass, delta = self.route(x)  # (B, 1)
        g = torch.where(delta, g_attn, g_bypass)  # (B, 1)
        v = self.proj(h, "v")  # (B, 1, C): eq. (5) needs it either way
        split = self.attn.split_heads
        K, V, mask = cache.append(split(self.proj(h, "k")), split(v), delta[:, 0])

        def routed(h, K, V, mask):  # eqs. (3)-(4) for the routed rows, eq. (5) for the others
            a = self.attn.attend(split(self.proj(h, "q")), K, V, mask)  # (B, 1, C)
            return self.mix(x, a, h, v, delta, g)

        def bypassed(h, K, V, mask):  # eq. (5) for every row: no attention
            return self.mix(x, v, h, v, delta, g)

        x = common.cond(delta.any(), routed, bypassed, (h, K, V, mask))  # (B, 1, C)
        return x + self.ffn_delta(x)


# Model

class Model(common.LM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.pattern = cfg.pattern
        self.d_layers = [i for i, c in enumerate(self.pattern) if c == "D"]
        self.blocks = nn.ModuleList(DTRBlock(cfg) if c == "D" else common.Block(cfg)
                                    for c in self.pattern)
        if cfg.norm == "rmsnorm":  # the paper's LLaMA blocks (ln_1, ln_2, ln_f)
            for mod in [self, *self.blocks]:
                for name, child in list(mod.named_children()):
                    if isinstance(child, nn.LayerNorm):
                        setattr(mod, name, nn.RMSNorm(cfg.n_embd, eps=1e-5))
        self.init_weights()

    def train_flops_per_token(self, T, stats=None):
        """The packed pass runs Q, K and the scores on the routed share only: the training
        forward's flops_ratio (its stats) of the dense GPT; without it, the dense count."""
        ratio = (stats or {}).get("flops_ratio", 1.0)
        return float(ratio) * common.dense_flops_per_token(self.cfg, T)

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
        x = self.embed(idx)  # (B, T, C)
        x, routes = sparse_trunk(self, x) if sparse else self.trunk(x, packed=self.training)
        logits, lm_loss = self.head(x, targets)
        stats, rl, T = {}, 0.0, idx.size(1)
        if routes:
            # (L_D,) f_l / (B·T): the share of the batch's tokens each D layer routes to attention
            fracs = torch.stack([d.float().mean() for _, d, _ in routes])
            ratio = flops_per_token(self.cfg, T, fracs) / common.dense_flops_per_token(self.cfg, T)
            frac = fracs.mean()
            stats.update(frac_attn=frac, skipped=1 - frac, flops_ratio=ratio,
                         flops_saved_hard=1 - ratio)
            for j, i in enumerate(self.d_layers):
                stats[f"frac_l{i}"], stats[f"skip_l{i}"] = fracs[j], 1 - fracs[j]
            if targets is not None:
                g_means = torch.stack([g.mean() for g, _, _ in routes])  # (L_D,) mean g_attn
                rl = routing_loss(g_means, fracs)  # eq. (7)
                stats["route_loss"] = rl.detach()
        loss = None
        if targets is not None:
            loss = lm_loss + self.cfg.lam * rl
            stats["lm_loss"] = lm_loss.detach()
            if not self.training:  # DTRNet trains with the same hard δ (eq. 2): the same loss
                stats["soft_loss"] = stats["lm_loss"]
        return logits, loss, stats

    @torch.no_grad()
    def routing_map(self, idx):
        """idx (1, T) -> (m (L_D, T): 1 = the token took attention in that layer, rows, legend)."""
        was_training = self.training
        self.eval()
        _, routes = self.trunk(self.embed(idx), packed=True)
        self.train(was_training)
        m = torch.stack([d[0].float() for _, d, _ in routes]).cpu() if routes \
            else torch.zeros(0, idx.size(1))
        return m, [f"layer {i}" for i in self.d_layers], ("bypass (W_V·W_O)", "attention")

    # Cached decoding (common.LM.generate drives it): state = (a cache per layer, position (0-d));
    # caches are preallocated to block_size and written in place, so a step's shapes are fixed.

    @torch.no_grad()
    def prefill(self, idx):
        """idx (B, T) -> logits (B, V) at the last position, and the decode state."""
        x, caches = self.embed(idx), []  # (B, T, C)
        for block in self.blocks:
            if isinstance(block, DTRBlock):
                x, _, delta, kv = block(x, packed=True)
                caches.append(RoutedKVCache(delta.sum(1), caches[0].k, kv))
            else:
                x, cache = block.prefill(x, self.cfg.block_size)
                caches.append(cache)
        pos = torch.tensor(idx.size(1), device=idx.device)
        return self.head(x[:, -1:])[0][:, -1], (caches, pos)

    @torch.no_grad()
    def step(self, tok, state):
        """tok (B, 1) at position pos -> logits (B, V) and the state with its K/V written."""
        caches, pos = state
        S = self.cfg.block_size
        if not torch.compiler.is_compiling() and int(pos) >= S:  # eager only (a host sync)
            raise NanorouteError(f"position {int(pos)} is past block_size {S}: prefill anew")
        x = self.wte(tok) + self.wpe(pos)  # (B, 1, C)
        mask = common.past_mask(pos, S, caches[0].k.dtype)  # (1, S): T layers see 0..pos
        for block, cache in zip(self.blocks, caches):
            if isinstance(block, DTRBlock):
                x = block.step(x, cache)
            else:
                x = block.step(x, cache, pos, mask)
        return self.head(x)[0][:, -1], (caches, pos + 1)


# Loss, eq. (7)

def routing_loss(g_means, fracs):
    """Σ_l α_l mean(g_attn,l), α_l = f_l / Σ_j f_j from the hard counts (no gradient; 0 if Σ f = 0).

    g_means, fracs: (L_D,) mean router probability and routed fraction of each D layer."""
    f = fracs.detach()
    alpha = f / f.sum().clamp_min(1e-12)  # (L_D,)
    return (alpha * g_means).sum()


# Sparse inference: the packed length

PACK_MULTIPLE = 64


# compiled: the packed length is traced as a symbol, so the sparse trunk is one graph
@torch._dynamo.config.patch(capture_scalar_outputs=True)
def sparse_trunk(model, x):
    """Model.trunk with every D layer attending among its routed tokens only (packed)."""
    return model.trunk(x, packed=True)


def pack_length(delta):
    """δ (B, T) -> R: the most tokens a row routes, rounded up to a multiple of PACK_MULTIPLE (at
    least one, at most T): the packed batch's length, read on the host."""
    # Bucketed: cuDNN attention (SDPA's pick in bf16 on CUDA) and torch.compile set up anew per
    # length (an H100 training step: 143 ms vs 10.3 ms in fp32, unbucketed).
    T, M = delta.size(1), PACK_MULTIPLE
    R = int(((delta.sum(1).max().clamp(min=1) + M - 1) // M * M).clamp(max=T))
    torch._check(0 < R)  # for a compiler tracing R as a size (fullgraph=True)
    torch._check(R <= T)
    return R


# Decoding: the routed KV cache

class RoutedKVCache:
    """K/V of one D layer's routed tokens: row b holds its n[b] routed tokens in slots 0..n[b]-1."""

    def __init__(self, n, like, kv):
        """n (B,) routed tokens per row; like: a T layer's K (B, nh, S, hs), the shape to take;
        kv: the routed tokens' K, V (B, nh, R, hs), packed to the front."""
        self.n = n  # (B,) long
        self.k, self.v = torch.zeros_like(like), torch.zeros_like(like)  # (B, nh, S, hs)
        R = kv[0].size(2)
        self.k[:, :, :R], self.v[:, :, :R] = kv
        for t in (self.n, self.k, self.v):  # written in place by a compiled step
            torch._dynamo.mark_static_address(t)

    def visible(self):
        """(B, S) bool: the slots the next token sees, its own slot n[b] included."""
        return torch.arange(self.k.size(2), device=self.n.device) <= self.n[:, None]

    def append(self, k, v, routed):
        """Write k, v (B, nh, 1, hs) at slot n[b]; only a routed row advances n[b] (routed (B,)),
        so the row's next token overwrites a bypassed one. Returns K, V, the mask (B, 1, 1, S)."""
        rows = torch.arange(k.size(0), device=k.device)
        self.k[rows, :, self.n] = k[:, :, 0]  # (B, nh, hs) at slot n[b] of row b
        self.v[rows, :, self.n] = v[:, :, 0]
        mask = self.visible()[:, None, None, :]
        self.n += routed
        return self.k, self.v, mask


def kv_cache_bytes(state):
    """(bytes of K/V held, bytes a dense model's cache holds). T layers count block_size slots, D
    layers their routed tokens (Σ_b n[b]): what a cache sized to them holds (the paper's saving)."""
    caches = state[0]
    B, nh, S, hs = caches[0].k.shape  # the first layer is always T
    per_token = 2 * nh * hs * caches[0].k.element_size()  # K and V of one token in one layer
    slots = [int(c.n.sum()) if isinstance(c, RoutedKVCache) else B * S for c in caches]
    return sum(slots) * per_token, len(caches) * B * S * per_token


# Accounting: forward FLOPs per token

def flops_router(d):
    return 2 * (d * (d // 2) + (d // 2) * 2)


def flops_terms(cfg, T, hidden=None, pattern=None):
    """(fixed, a, b): FLOPs per token = fixed + Σ_l (a·ρ_l + b·ρ_l²), ρ_l the routed share of D
    layer l. A routed token pays Q, K (a) and scores over ~ρ·mean_context(T) keys (b); every token
    the router, V, W_O and the MLP of width hidden (4d; a SwiGLU of width h costs as 1.5h)."""
    d, hidden = cfg.n_embd, hidden or 4 * cfg.n_embd
    pattern = pattern or cfg.pattern
    attn_scores = common.flops_attn_scores(d, common.mean_context(T))
    mlp = common.flops_ffn(d, hidden)
    dense = common.flops_qkv(d) + common.flops_attn_out(d) + mlp + attn_scores
    d_fixed = flops_router(d) + common.flops_qkv(d) / 3 + common.flops_attn_out(d) + mlp
    fixed = common.flops_lm_head(d, cfg.vocab_size) + pattern.count("T") * dense
    return fixed + pattern.count("D") * d_fixed, 2 * common.flops_qkv(d) / 3, attn_scores


def flops_per_token(cfg, T, rho, hidden=None, pattern=None):
    """rho: share of tokens routed to attention in each D layer (a float, or one per D layer)."""
    fixed, a, b = flops_terms(cfg, T, hidden, pattern)
    rho = rho if hasattr(rho, "__len__") else [rho] * (pattern or cfg.pattern).count("D")
    return fixed + sum(a * r + b * r * r for r in rho)


def flops_ratio(cfg, T, rho, hidden=None, pattern=None):
    """DTRNet FLOPs / dense FLOPs (same dims, every layer T) at sequence length T."""
    pattern = pattern or cfg.pattern
    return (flops_per_token(cfg, T, rho, hidden, pattern)
            / flops_per_token(cfg, T, [], hidden, "T" * len(pattern)))


def main(argv):
    """python dtrnet.py [-h]: what this file is; it takes no commands."""
    if argv not in ([], ["-h"], ["--help"]):
        raise NanorouteError(f"dtrnet.py takes no arguments, got {' '.join(argv)!r}")
    print("usage: python dtrnet.py [-h]\nDefines the DTRNet model (no commands): train it with "
          "`python train.py --model dtrnet`, time it with `python bench.py dtrnet`.")


if __name__ == "__main__":
    common.cli(main)
