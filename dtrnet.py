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

Variants: `skip` (δ ≡ 0, paper A3) and `no_vo` (the bypass uses LN1(x) itself instead of LN1(x) W_V W_O, A5).
Deviations from the paper, one line each (why: results/dtrnet.md, "Choices … and deviations"):
  - eq. (7) takes the mean over tokens, not ‖G[:,0]‖₁ (as the authors' code): λ = 8e-4 does not depend on T.
  - the first and last layers are T, as the paper says (the authors' released code routes them instead).
  - nanoGPT's GELU MLP of width 4d, learned positions, full multi-head attention (paper: SwiGLU, RoPE, GQA).
  - LayerNorm by default (`norm=rmsnorm` gives the paper's RMSNorm; the paper preset uses it).
  - no "route 15% of the tokens when none is routed" fallback (the authors' training code has one).
  - cached decoding computes Q, K and attention for a bypassed token too and discards them (fixed shapes).

Paths (all with the same hard decisions δ):
  - training and `model(idx, sparse=True)` pack each row's routed tokens to the front (a stable sort keeps
    their order), so eq. (6) among them is plain causal SDPA on (B, nh, R, hs) — a flash kernel, no mask;
    bypassed tokens pay only W_V and W_O. One host sync per D layer reads R (bucketed: see pack_length).
  - `model.eval()` with sparse=False: the reference, eq. (6) as a dense (B, 1, T, T) boolean mask.
  - cached decoding, `prefill(idx)` (the packed forward, one batch) then `step(tok, state)` with fixed shapes
    (torch.compile captures one graph per step: a CUDA graph on CUDA). T layers cache every token; a D layer
    keeps K/V of its routed tokens only — a bypassed token has no key there (eq. 6: no later token attends
    to it), so it does not advance that layer's cache.
Numerics (common.py's policy): fp32 residual stream, router probabilities in fp32, caches typed from the
first K/V they receive.
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


# --compile on CUDA is refused. On an H100, inductor failed to build DTRNet's training step: Triton could not lower
# (make_ttgir: "PassManager::run failed") the one reduction kernel into which it fused the cross-entropy with
# eq. (7) and the routing stats (router softmax, stack, mean, clamp_min, div). That kernel has nothing to do with
# the routed lengths (bucketed now), the stats were rewritten since, and no GPU was at hand to show that the new
# kernel compiles: refusing is the honest choice until a CUDA run passes tests/test_common.py's compile test.
COMPILE_REFUSED = {"cuda": "Triton failed to compile DTRNet's fused loss + routing-stats kernel on an H100 "
                           "(make_ttgir: PassManager::run failed); train without --compile on CUDA"}


# ----------------------------------------------------------------------------------------------------
# Router, eq. (1)

class Router(nn.Module):
    """Eq. (1): two-layer MLP on the residual stream -> probabilities [g_attn, g_bypass] in fp32."""

    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.n_embd // 2, bias=cfg.bias)  # W1: d × d/2
        self.w2 = nn.Linear(cfg.n_embd // 2, 2, bias=cfg.bias)           # W2: d/2 × 2

    def forward(self, x):
        z = self.w2(F.silu(self.w1(x)))  # (B, T, 2) logits; bf16/fp16 under autocast
        fp = torch.float64 if z.dtype == torch.float64 else torch.float32  # at least fp32
        return F.softmax(z, dim=-1, dtype=fp)  # (B, T, 2)


def router_params(cfg):
    """Parameters one router adds: d·d/2 + d/2·2 (+ biases)."""
    h = cfg.n_embd // 2
    return cfg.n_embd * h + h * 2 + (h + 2) * cfg.bias


# ----------------------------------------------------------------------------------------------------
# Block

class DTRBlock(common.Block):
    """A D layer: common.Block's parameters (so a dense checkpoint loads) plus a router."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.router = Router(cfg)
        self.variant = cfg.variant

    def route(self, x):
        """x (B, T, C) -> g_attn (B, T) (eq. 1, on the residual stream), g (B, T): the probability of the
        chosen path, δ (B, T) bool (eq. 2). 8 ops under autocast: x's cast, W1, SiLU, W2, the fp32 cast, softmax,
        the comparison and g's where."""
        g_attn, g_bypass = self.router(x).unbind(-1)  # 2 × (B, T) fp32
        delta = g_attn > g_bypass                       # (B, T)
        if self.variant == "skip":                      # A3: no token ever reaches attention
            delta = torch.zeros_like(delta)
        return g_attn, torch.where(delta, g_attn, g_bypass), delta

    def proj(self, h, part):
        """Slices of the fused c_attn: part 'qk' -> LN1(x) [W_Q W_K] (B, T, 2C), 'v' -> LN1(x) W_V (B, T, C)."""
        C, W, b = h.size(-1), self.attn.c_attn.weight, self.attn.c_attn.bias
        s = slice(0, 2 * C) if part == "qk" else slice(2 * C, 3 * C)
        return F.linear(h, W[s], None if b is None else b[s])

    def mix(self, x, a, h, v, delta, g):
        """Eqs. (3)+(5): x + g · W_O(routed rows: attention output a; bypassed rows: their own value v). The
        router probability g scales the chosen path: this carries the LM gradient into the router."""
        y = self.attn.c_proj(torch.where(delta[..., None], a, v))  # (B, T, C)
        if self.variant == "no_vo":                                  # A5: bypass without W_V W_O
            y = torch.where(delta[..., None], y, h)
        y = common.dropout(y, self.attn.dropout, self.training)
        return torch.addcmul(x, g[..., None], y)                  # x + g·y in one op, fp32

    def attend_masked(self, x):
        """Reference: attention over all tokens with the boolean mask of eq. (6)."""
        h = self.ln_1(x)
        g_attn, g, delta = self.route(x)
        q, k, v = self.attn.qkv(h)  # (B, nh, T, hs)
        T = x.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=x.device)
        # eq. (6); "| eye" lets a bypassed row see itself, so no row is all -inf (no NaN). Its result is
        # exactly v_i, which mix() takes from v anyway.
        mask = (delta[:, None, :, None] & delta[:, None, None, :] & causal) | eye  # (B, 1, T, T)
        a = self.attn.attend(q, k, v, mask)                                        # (B, T, C)
        v = v.transpose(1, 2).reshape_as(a)                                        # (B, T, C)
        return self.mix(x, a, h, v, delta, g), g_attn, delta, None

    def attend_packed(self, x):
        """Training, sparse inference and prefill: gather each row's routed tokens into a (B, R) packed batch,
        causal SDPA on those only, scatter back. Also returns their K, V (B, R, C) for a cache."""
        # ops beyond the dense block's 12 (bf16 autocast): route() 8; the split projections 4 (a second matmul,
        # h cast twice, the weight slices cast every call); packing 7 (R: sum, max, sync; sort; 2 gathers;
        # scatter); mix()'s where 1
        h = self.ln_1(x)
        g_attn, g, delta = self.route(x)
        v = self.proj(h, "v")  # (B, T, C): every token needs its value (eq. 5)
        a, kv = v, None
        R = pack_length(delta)  # host sync (one per D layer)
        if R:
            B, T, C = h.shape
            # a stable sort puts routed tokens first, in their original order, so for a real query i < R_b
            # every key j <= i is real: plain causal SDPA is "key-padding ∧ causal" and no row is empty.
            # Padding queries (i >= R_b: bypassed tokens) see real keys; mix() replaces their outputs by v.
            order = torch.sort(delta, dim=1, descending=True, stable=True)[1][:, :R]  # (B, R)
            idx = order[..., None].expand(B, R, C)
            q, k = self.proj(torch.gather(h, 1, idx), "qk").chunk(2, dim=-1)  # 2 × (B, R, C)
            vr = torch.gather(v, 1, idx)                                       # (B, R, C)
            split = self.attn.split_heads
            a = v.scatter(1, idx, self.attn.attend(split(q), split(k), split(vr)))  # (B, T, C)
            kv = (k, vr)
        return self.mix(x, a, h, v, delta, g), g_attn, delta, kv

    def forward(self, x, packed=False):
        x, g_attn, delta, kv = (self.attend_packed if packed else self.attend_masked)(x)
        return x + self.ffn_delta(x), g_attn, delta, kv  # fp32 + bf16 promotes: no cast op

    def step(self, x, cache):
        """One new token x (B, 1, C) against this layer's RoutedKVCache. Every row computes Q, K, V and
        attends (fixed shapes, no host sync); a bypassed row's K/V is not kept (see RoutedKVCache.append) and
        its attention output is replaced by its own value (eq. 5)."""
        # ops beyond common.Block.step's 14: route() 8; the routed cache 1 (one K|V write instead of two, plus
        # the mask slot and the count); mix()'s where 1
        h = self.ln_1(x)
        g_attn, g, delta = self.route(x)  # (B, 1)
        C = x.size(-1)
        qkv = self.attn.c_attn(h)  # (B, 1, 3C)
        K, V, mask = cache.append(qkv[..., C:], delta[:, 0])  # 2 × (B, nh, S, hs), (B, 1, 1, S)
        a = self.attn.attend(self.attn.split_heads(qkv[..., :C]), K, V, attn_mask=mask)  # (B, 1, C)
        x = self.mix(x, a, h, qkv[..., 2 * C:], delta, g)
        return x + self.ffn_delta(x)


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
            fracs = torch.stack([d for _, d, _ in routes]).mean((1, 2), dtype=torch.float32)  # (L_D,) f_l / (B·T)
            skips = 1 - fracs                                                                # (L_D,)
            T = idx.size(1)
            fixed, a, b = flops_terms(self.cfg, T)
            ratio = (fixed + (fracs * (a + b * fracs)).sum()) / common.dense_flops_per_token(self.cfg, T)
            frac = fracs.mean()
            stats.update(frac_attn=frac, skipped=1 - frac, flops_ratio=ratio, flops_saved_hard=1 - ratio)
            for j, i in enumerate(self.d_layers):
                stats[f"frac_l{i}"], stats[f"skip_l{i}"] = fracs[j], skips[j]  # routed to attention / bypassed
            if targets is not None:
                g_means = torch.stack([g for g, _, _ in routes]).mean((1, 2))  # (L_D,) mean g_attn per layer
                rl = routing_loss(g_means, fracs)  # eq. (7)
                stats["route_loss"] = rl.detach()
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
    # Cached decoding (common.LM.generate drives it): state = (one cache per layer, position as a 0-d tensor,
    # the T layers' additive mask (1, S)). Every buffer is preallocated to block_size and written in place.

    @torch.no_grad()
    def prefill(self, idx):
        """idx (B, T) -> logits (B, V) of the last position and the decode state, from one packed forward."""
        S = self.cfg.block_size
        x, caches = self.embed(idx), []  # (B, T, C)
        for block in self.blocks:
            if isinstance(block, DTRBlock):
                x, _, delta, kv = block(x, packed=True)
                caches.append(RoutedKVCache(delta.sum(1), caches[0].k, kv))
            else:
                x, cache = block.prefill(x, S)
                caches.append(cache)
        pos = torch.tensor(idx.size(1), device=idx.device)
        mask = common.past_mask(pos - 1, S, caches[0].k.dtype)  # (1, S): 0 at the prefilled positions
        torch._dynamo.mark_static_address(mask)                 # written in place by every step
        return self.head(x[:, -1:])[0][:, -1], (caches, pos, mask)

    @torch.no_grad()
    def step(self, tok, state):
        """tok (B, 1) at position pos -> logits (B, V) and the state with its K/V written."""
        caches, pos, mask = state
        if not torch.compiler.is_compiling() and int(pos) >= self.cfg.block_size:  # eager only: one host sync
            raise NanorouteError(f"position {int(pos)} is past block_size {self.cfg.block_size}: prefill a new window")
        x = self.wte(tok) + self.wpe(pos)       # (B, 1, C)
        mask.index_fill_(1, pos.view(1), 0.0)   # (1, S): T layers see positions 0..pos (one op, not past_mask's 4)
        for block, cache in zip(self.blocks, caches):
            if isinstance(block, DTRBlock):
                x = block.step(x, cache)
            else:
                x = block.step(x, cache, pos, mask)
        return self.head(x)[0][:, -1], (caches, pos + 1, mask)


# ----------------------------------------------------------------------------------------------------
# Loss, eq. (7)

def routing_loss(g_means, fracs):
    """Σ_l α_l · mean(g_attn,l) with α_l = f_l / Σ_j f_j from the hard counts (no gradient; 0 if Σ f = 0).
    g_means, fracs: (L_D,) mean router probability and routed fraction of each D layer."""
    f = fracs.detach()
    alpha = f / f.sum().clamp_min(1e-12)  # (L_D,)
    return (alpha * g_means).sum()


# ----------------------------------------------------------------------------------------------------
# Sparse inference (and training): the packed length

PACK_MULTIPLE = 64  # packed lengths are rounded up to a multiple of this


def pack_length(delta):
    """δ (B, T) -> R: the largest number of tokens a row routes, rounded up to a multiple of PACK_MULTIPLE
    (at most T); 0 when no row routes. One host sync: the packed batch's shape."""
    n = int(delta.sum(1).max())
    # Bucketed, so that shapes do not change with the routing. Without it nearly every training step meets a
    # new packed length, and on CUDA under bf16 SDPA sends those to cuDNN attention, which builds a new plan
    # per shape (DTRNet's H100 training step: 143 ms vs 10.3 ms fp32; torch.compile recompiles per shape too).
    # With buckets a run sees at most T/64 lengths, each set up once, on every backend; restricting SDPA's
    # backends (sdpa_kernel) would fix cuDNN only, as global state around every call. The padding rows are
    # bypassed tokens (see attend_packed): the result is the same function.
    return 0 if n == 0 else min(delta.size(1), -(-n // PACK_MULTIPLE) * PACK_MULTIPLE)


# ----------------------------------------------------------------------------------------------------
# Decoding: the routed KV cache

class RoutedKVCache:
    """K/V of one D layer for its routed tokens only, packed per row: row b holds n[b] tokens in slots
    0..n[b]-1, in token order. Preallocated to block_size slots, so a decode step's shapes never change; K and
    V share one buffer (B, S, 2C), so a step writes both with one op; an additive mask (B, S) in the cache's
    dtype (0: a slot the next query may see) is kept beside it, so no step builds one."""

    def __init__(self, n, like, kv=None):
        """n (B,) routed tokens per row; like: a T layer's K buffer (B, nh, S, hs), whose dtype, heads and
        length S this cache takes; kv: the routed tokens' (K, V), each (B, R, C), packed to the front (slots
        >= n[b] are padding), or None when no row routed a token."""
        B, self.n_head, S, hs = like.shape
        self.n = n                                            # (B,) long
        self.kv = like.new_zeros(B, S, 2 * self.n_head * hs)  # (B, S, 2C)
        if kv is not None:
            self.kv[:, :kv[0].size(1)] = torch.cat(kv, -1)
        slots = torch.arange(S, device=n.device)
        self.mask = like.new_zeros(B, S).masked_fill_(slots >= n[:, None], float("-inf"))  # (B, S)
        for t in (self.n, self.kv, self.mask):  # written in place by a captured step: a fixed address
            torch._dynamo.mark_static_address(t)

    def heads(self):
        """K, V: (B, nh, S, hs) views of the shared buffer."""
        B, S, C2 = self.kv.shape
        split = lambda t: t.view(B, S, self.n_head, C2 // 2 // self.n_head).transpose(1, 2)  # noqa: E731
        return split(self.kv[..., :C2 // 2]), split(self.kv[..., C2 // 2:])

    def append(self, kv, routed):
        """kv (B, 1, 2C): K and V of the new token; routed (B,) bool. Every row writes at its slot n[b] and may
        see slots 0..n[b]; only a routed row advances n[b]. A bypassed row's K/V is overwritten by the row's next
        token before any later query sees it, and its own attention output is not used (mix() takes v).
        Returns K, V (B, nh, S, hs) and the mask (B, 1, 1, S)."""
        B, _, C2 = kv.shape
        self.kv.scatter_(1, self.n.view(B, 1, 1).expand(B, 1, C2), kv)  # (B, S, 2C)
        self.mask.scatter_(1, self.n.view(B, 1), 0.0)                     # (B, S)
        self.n.add_(routed)
        K, V = self.heads()
        return K, V, self.mask[:, None, None, :]


def kv_cache_bytes(state):
    """(bytes of K/V the cache holds, bytes a dense model's cache holds: every layer at block_size). T layers
    count their preallocated block_size slots; D layers count only the routed entries in use (Σ_b n[b] slots),
    not their preallocated buffers: what a cache sized to its routed tokens holds (the paper's KV saving)."""
    caches = state[0]
    t = caches[0].k  # (B, nh, S, hs): the first layer is always T
    per_token = 2 * t.size(1) * t.size(3) * t.element_size()  # K and V of one token in one layer
    slots = [int(c.n.sum()) if isinstance(c, RoutedKVCache) else t.size(0) * t.size(2) for c in caches]
    return sum(slots) * per_token, len(caches) * t.size(0) * t.size(2) * per_token


# ----------------------------------------------------------------------------------------------------
# Accounting: forward FLOPs per token from common.py's functions

def flops_router(d):
    return 2 * (d * (d // 2) + (d // 2) * 2)


def flops_terms(cfg, T, hidden=None, pattern=None):
    """(fixed, a, b): forward FLOPs per token = fixed + Σ_l (a·ρ_l + b·ρ_l²) over the D layers, ρ_l the share
    of tokens routed to attention there. A routed token pays Q, K (a: 2/3 of QKV) and scores over the
    ~ρ·mean_context(T) routed keys before it (b); every D-layer token pays the router, V, W_O and the MLP.
    hidden: MLP width (4d for our GELU MLP; a SwiGLU of width h costs like hidden = 1.5h)."""
    d, hidden = cfg.n_embd, hidden or 4 * cfg.n_embd
    pattern = pattern or cfg.pattern
    attn_scores = common.flops_attn_scores(d, common.mean_context(T))
    dense = common.flops_qkv(d) + common.flops_attn_out(d) + common.flops_ffn(d, hidden) + attn_scores
    d_fixed = flops_router(d) + common.flops_qkv(d) / 3 + common.flops_attn_out(d) + common.flops_ffn(d, hidden)
    fixed = common.flops_lm_head(d, cfg.vocab_size) + pattern.count("T") * dense + pattern.count("D") * d_fixed
    return fixed, 2 * common.flops_qkv(d) / 3, attn_scores


def flops_per_token(cfg, T, rho, hidden=None, pattern=None):
    """rho: share of tokens routed to attention in each D layer (a float, or one value per D layer)."""
    fixed, a, b = flops_terms(cfg, T, hidden, pattern)
    rho = rho if hasattr(rho, "__len__") else [rho] * (pattern or cfg.pattern).count("D")
    return fixed + sum(a * r + b * r * r for r in rho)


def flops_ratio(cfg, T, rho, hidden=None, pattern=None):
    """DTRNet FLOPs / dense FLOPs (same dims, every layer T) at sequence length T."""
    pattern = pattern or cfg.pattern
    return (flops_per_token(cfg, T, rho, hidden, pattern)
            / flops_per_token(cfg, T, [], hidden, "T" * len(pattern)))
