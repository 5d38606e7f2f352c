"""
Token-Selective Attention (TSA), from "Adaptive Computation Depth via Learned Token Routing in
Transformers" (A. A. A. Mohammed, 2026, arXiv:2605.05222). A learned per-token gate on the residual
updates of every block after the stem.

    (1)  h ← f0(h);  p_l = r_l(h);  h ← f_{l+1}(h, p_l),   l = 0..L−2      the stem f0 always runs
    (2)  r_l(h) = σ(W2 ReLU(W1 h + b1) + b2) ∈ (0,1)^{B×T}, hidden max(d/4, 16), b2 initialised to −1
    (3)  h ← h + (1 − p_l) ⊙ Δattn_{l+1}(h)
    (4)  h ← h + (1 − p_l) ⊙ Δffn_{l+1}(h)
    (5)  L_depth = λ · 1/(L−1) Σ_l mean(1 − p_l);   L = L_task + L_depth
    (6)  α = 1/(L−1) Σ_l mean(1 − p_l)                       (the mean active fraction)
    (7)  Δ = 1 − (1 + (L−1) α) / L                             (TLOps saved, common.tlops_saving)

Inference (§3.6): a token with p_l > 0.5 halts at block l+1 (for that block only; the next router decides
again). eval() applies these hard decisions densely (the reference); `sparse=True` really skips the work
and gives the same logits. A halted token skips the FFN and — beyond the paper — its query, attention and
output projection; it still computes its K/V, because active tokens attend to every earlier token in every
layer, exactly as in the dense eval forward. Cached decoding (prefill/step, used by common's generate)
keeps these semantics: the cache of every layer holds the K/V of every token (halted ones included, from
their state at that layer); a layer where every row of the batch halts (at B=1: where the token halts)
runs only K/V, skipping q / attention / c_proj / FFN, so B=1 decode saves (1 − α)·(q + attention +
out-proj + FFN) per routed layer. In a mixed batch every row runs the layer and halted rows are gated by 0
(a GEMM over a few rows costs what reading its weights costs: gathering the active rows does not pay).

Deviations from the paper (Config fields; `--preset paper` sets the paper's values except hard_ft_*):
  * hard_ft_iters=250: the last 250 iterations (of the default 2250) train with straight-through hard
    gates — forward = the eval gate, gradient = that of 1 − p — so that the hard routing inference runs is
    the one the model was trained with (the paper trains soft only; results/tsa.md, issue 12).
  * hard_ft_routers (what the routers do in that phase): "train" (the default recipe), "frozen" (no
    gradient, so AdamW does not move them: only the backbone adapts to their hard decisions) or
    "calibrate" (`--preset paper`, with hard_ft_iters=750 of its 5000): at the phase's first step each
    router's b2 is shifted once so that p > 0.5 for the share of tokens its soft gate claims, mean(p_l)
    (eq. 6's term; a soft-trained router at the paper's budget scales tokens by 1 − p but hardly halts
    any), then frozen. Trained routers re-open in the phase and skip almost nothing (issue 12); calibrated,
    frozen ones execute the savings the soft model reports (results/tsa.md, CPU proxy). exec_share=S in (0, 1]
    instead shifts b2 so that a share S of the batch's tokens stays active at every router (the quantile S of
    its logits): TLOps saved (L−1)(1−S)/L, an operating point λ alone no longer moves. "soft" is a control:
    no hard phase at all, only hard_ft_lr's restart (is a gain the hard phase's or the extra step size's?).
  * hard_ft_lr (`--preset paper`: 3e-4, its peak lr; default 0 = off): the phase's lr restarts at hard_ft_lr
    and falls by a cosine to min_lr over the phase. The main schedule's tail (≈4e-5 → 3e-5 there) leaves the
    backbone too little step size to adapt to the hard gates in 15% of the run (results/tsa.md, CPU proxy).
  * hard_variant="scaled": an active token keeps its soft scale 1 − p at inference (paper: "01", the full
    update); better than "01" in every run of results/tsa.md.
  * skip_queries=True: the sparse path also skips halted tokens' query / attention / out-projection work
    (paper: dense attention, its residual gated by the same binary mask).
  * the stats report what inference really skips (hard decisions), not only eq. (6)'s soft α. In eval,
    alpha / active_r* are eq. (6) on the router outputs of the hard pass (with or without targets);
    soft_loss / soft_alpha come from a soft pass (eqs. 3–4) on the same batch.
The paper preset's lr 3e-4 → 3e-5, dropout 0.1 and no warm-up come from the authors' code
(AhmedHamadto/TSA, scripts/phase6_language.py); the paper states none of them. Numerics: fp32 residual
stream, router probabilities in fp32 under autocast (common.py's policy).

Early-exit baseline (§3.5, App. D, `--variant=early_exit`): the same backbone with an exit head after each
block (own LayerNorm + the tied embedding), trained on the mean CE of all exits; at inference a token exits
when its max softmax probability exceeds `threshold` and its hidden state is frozen afterwards (it still
provides K/V from the frozen state). It has no KV cache: its decode state is the token window.
"""
import os
import sys
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import NanorouteError


@dataclass
class Config(common.Config):
    lam: float = 1e-3               # λ of eq. (5)
    router_bias: float = -1.0       # b2 init: σ(−1) ≈ 0.27, so routers start mostly open (§2.2)
    hard_variant: str = "scaled"    # eval gate of an active token: "01" (paper: 1) or "scaled" (1 − p)
    skip_queries: bool = True       # sparse path: halted tokens also skip Q / attention / out-proj
    eval_soft: bool = True          # eval also runs the soft pass (soft_loss next to the hard loss)
    hard_ft_iters: int = 250        # the last iterations train with straight-through hard gates (all if > max_iters)
    hard_ft_routers: str = "train"  # ... in which the routers "train", stay "frozen", "calibrate" or "soft" (docstring)
    hard_ft_lr: float = 0.0         # > 0: that phase's lr restarts here, cosine to min_lr (0: the schedule goes on)
    exec_share: float = 0.0         # "calibrate": share of routed token-layers left active (0: the soft gate's claim)
    variant: str = "tsa"            # "tsa" | "early_exit" (the §3.5 baseline)
    threshold: float = 1.0          # early exit: exit when max softmax prob > threshold (1.0: never)
    model: str = "tsa"

    def __post_init__(self):
        super().__post_init__()
        if self.variant not in ("tsa", "early_exit"):
            raise NanorouteError(f"variant must be 'tsa' or 'early_exit', got {self.variant!r}")
        if self.hard_variant not in ("01", "scaled"):
            raise NanorouteError(f"hard_variant must be '01' or 'scaled', got {self.hard_variant!r}")
        if self.n_layer < 2:
            raise NanorouteError(f"TSA needs n_layer >= 2 (a stem and at least one routed block), got {self.n_layer}")
        if not self.lam >= 0:  # also refuses nan
            raise NanorouteError(f"lam (λ) must be >= 0, got {self.lam}")
        if not abs(self.router_bias) < float("inf"):
            raise NanorouteError(f"router_bias must be finite, got {self.router_bias}")
        if not 0.0 <= self.threshold <= 1.0:
            raise NanorouteError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.hard_ft_routers not in ("train", "frozen", "calibrate", "soft"):
            raise NanorouteError("hard_ft_routers must be 'train', 'frozen', 'calibrate' or 'soft', "
                                 f"got {self.hard_ft_routers!r}")
        if self.hard_ft_iters < 0:
            raise NanorouteError(f"hard_ft_iters must be >= 0, got {self.hard_ft_iters}")
        if not 0.0 <= self.exec_share <= 1.0:
            raise NanorouteError(f"exec_share must be in [0, 1], got {self.exec_share}")
        if self.exec_share and self.hard_ft_routers != "calibrate":
            raise NanorouteError(f"exec_share needs hard_ft_routers='calibrate', got {self.hard_ft_routers!r}")
        if self.hard_ft_lr and not self.hard_ft_lr >= self.min_lr:  # also refuses nan
            raise NanorouteError(f"hard_ft_lr must be 0 (off) or >= min_lr={self.min_lr}, got {self.hard_ft_lr}")


PRESETS = {
    # The paper's Shakespeare setup (§3.2): d=256, L=6, H=8, d_ff=1024, ctx 128, batch 64, 5000 steps, AdamW
    # β=(0.9, 0.95), wd 0.1, cosine; its sparse-TSA (§3.6: "01" gates, dense attention), soft training only.
    # lr, min_lr, dropout and warm-up: the authors' code (see the docstring). Deviation (ours, issue 12): the
    # last 750 iterations straight-through with calibrated, frozen routers and the lr restarted at its peak,
    # so that sparse inference skips what the soft model claims at the paper's soft model's quality (not at
    # the quality of a soft model given the same restart: results/tsa.md); --hard_ft_iters=0 is the paper's
    # recipe.
    "paper": dict(n_layer=6, n_head=8, n_embd=256, block_size=128, batch_size=64, max_iters=5000,
                  learning_rate=3e-4, min_lr=3e-5, warmup_iters=0, beta2=0.95, weight_decay=0.1, dropout=0.1,
                  eval_interval=250, lam=1e-3, hard_variant="01", skip_queries=False, hard_ft_iters=750,
                  hard_ft_routers="calibrate", hard_ft_lr=3e-4),
    # ≤ 3 minutes on a 2-core CPU; the last 300 iterations straight-through so the hard routing a student
    # sees (routing_map) is the one the model was trained for.
    "classroom": dict(common.CLASSROOM, hard_ft_iters=300),
}


QUERY_CHUNKS = 2  # sparse attention: active queries in this many position ranges (fewer masked scores)


class Router(nn.Module):
    """Eq. (2): p = σ(W2 ReLU(W1 h + b1) + b2); d²/4 + d/2 + 1 parameters at d divisible by 4."""

    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, max(d // 4, 16))
        self.fc2 = nn.Linear(max(d // 4, 16), 1)

    def forward(self, h):
        z = self.fc2(F.relu(self.fc1(h)))  # (B, T, 1) router logit (bf16 under autocast)
        return torch.sigmoid(z.to(torch.promote_types(z.dtype, torch.float32)))  # p_l in fp32 (or fp64)


def gated(x, g, delta):
    """Eqs. (3)–(4) for the active tokens: x + g ⊙ delta, delta cast to x's dtype; g None: the "01" gate, 1."""
    return x + delta.to(x.dtype) if g is None else torch.addcmul(x, g, delta.to(x.dtype))


def q_proj(attn, h):
    """The query third of c_attn: (..., C) -> (..., C)."""
    C, W, b = h.size(-1), attn.c_attn.weight, attn.c_attn.bias
    return F.linear(h, W[:C], None if b is None else b[:C])


def kv_proj(attn, h):
    """The key and value thirds of c_attn: (..., C) -> k, v (..., C). Halted tokens need only these."""
    C, W, b = h.size(-1), attn.c_attn.weight, attn.c_attn.bias
    return F.linear(h, W[C:], None if b is None else b[C:]).split(C, dim=-1)


class Model(common.LM):
    def __init__(self, cfg):
        super().__init__(cfg)
        L = cfg.n_layer
        self.blocks = nn.ModuleList([common.Block(cfg) for _ in range(L)])  # names as common.Model (--init_from)
        if cfg.variant == "tsa":
            self.routers = nn.ModuleList([Router(cfg.n_embd) for _ in range(L - 1)])  # r_0..r_{L-2}
        else:  # early exit: exit heads after blocks 0..L-2 (the last exit is the model's own ln_f + head)
            self.exit_ln = nn.ModuleList([nn.LayerNorm(cfg.n_embd, bias=cfg.bias) for _ in range(L - 1)])
        if cfg.hard_ft_routers in ("frozen", "calibrate") and cfg.hard_ft_iters and torch.distributed.is_available() \
                and torch.distributed.is_initialized():  # DDP needs a gradient for every parameter
            raise NanorouteError(f"hard_ft_routers={cfg.hard_ft_routers} (routers without gradients) is not supported "
                                 "under DDP; run on one process or pass --hard_ft_routers=train")
        self.hard_train = False  # set by on_step during the last hard_ft_iters iterations
        self.calibrate_now = False  # set by on_step for the first of them (hard_ft_routers="calibrate")
        self.threshold = cfg.threshold
        self.init_weights()
        for r in getattr(self, "routers", []):
            nn.init.constant_(r.fc2.bias, cfg.router_bias)

    def on_step(self, it):
        """train.py calls this before every step: switch to straight-through hard gates at the end."""
        start = self.cfg.max_iters - self.cfg.hard_ft_iters
        self.hard_train = self.cfg.hard_ft_iters > 0 and it >= start and self.cfg.hard_ft_routers != "soft"
        self.calibrate_now = self.hard_train and self.cfg.hard_ft_routers == "calibrate" and it == max(start, 0)

    def lr_at(self, it):
        """train.py's lr at step it: the common schedule, or with hard_ft_lr > 0 a fresh cosine over the phase."""
        start = self.cfg.max_iters - self.cfg.hard_ft_iters
        if not (self.cfg.hard_ft_lr and self.cfg.hard_ft_iters and it >= start):
            return common.lr_at(it, self.cfg)
        return common.cosine((it - start) / self.cfg.hard_ft_iters, self.cfg.hard_ft_lr, self.cfg.min_lr)

    # ------------------------------------------------------------------------------------------------
    # gates: soft (training, eqs. 3–4) and hard (inference, §3.6)

    def gate(self, p, mode):
        """p (B, T, 1) -> the factor on both residual deltas of the next block."""
        soft = 1.0 - p  # eq. (3)/(4): gate by 1 − p
        if mode == "soft":
            return soft
        active = p <= 0.5  # p > 0.5 halts
        hard = active.to(p.dtype) * (soft if self.cfg.hard_variant == "scaled" else 1.0)
        if mode == "hard_st":  # straight-through: the forward value is hard, the gradient is the soft one
            return hard.detach() + (soft - soft.detach())
        return hard

    def trunk(self, x, mode):
        """Eq. (1) with dense computation. Returns the final hidden state and the L−1 halting probs."""
        x = self.blocks[0](x)  # stem f0: always runs
        ps = []
        for router, block in zip(self.routers, self.blocks[1:]):
            p = router(x)  # (B, T, 1) p_l from the state after block l
            if mode == "hard_st" and self.cfg.hard_ft_routers != "train":
                if self.calibrate_now:  # once: shift b2 so that p <= 0.5 (active) for a share of this batch's
                    with torch.no_grad():  # tokens: exec_share, or (0) 1 − mean(p_l), what the soft gate claims
                        z = torch.logit(p, eps=1e-6).flatten()        # (B·T,) router logits + b2
                        share = self.cfg.exec_share or 1.0 - p.mean()  # no host sync
                        router.fc2.bias -= z.quantile(share).to(router.fc2.bias.dtype)
                    p = router(x)
                p = p.detach()  # frozen: no gradient reaches the router, so AdamW skips it (no decay either)
            g = self.gate(p, mode)
            x = x + g * block.attn_delta(x).to(x.dtype)  # eq. (3)
            x = x + g * block.ffn_delta(x).to(x.dtype)   # eq. (4)
            ps.append(p)
        self.calibrate_now = self.calibrate_now and mode != "hard_st"  # done
        return x, ps

    def sparse_trunk(self, x, caches=None):
        """Same numbers as trunk(x, 'hard'), but halted tokens skip work. Per routed block: one host sync (the
        active tokens per row and query range), one gather of the active tokens' state x_a, the attention
        delta and the FFN on x_a only, one scatter back: a halted token's state does not change inside the
        block, and K/V come from ln_1(x) of every token before the block, as in the dense forward. With
        caches (a list), every layer's K/V of every token is stored in it (prefill)."""
        B, T, C = x.shape
        if caches is None:
            x = self.blocks[0](x)  # stem f0
        else:  # ... also storing its K/V (prefill)
            x, cache = self.blocks[0].prefill(x, self.cfg.block_size)
            caches.append(cache)
        ends = sorted({max(1, T * (j + 1) // QUERY_CHUNKS) for j in range(QUERY_CHUNKS)})  # query ranges by position
        causal = torch.full((T, T), float("-inf"), dtype=x.dtype, device=x.device).triu(1)  # (T, T) additive mask
        masks = [causal[:, :hi].contiguous() for hi in ends]  # (T, hi): the keys a query range can see
        last = torch.tensor([e - 1 for e in ends], device=x.device)
        ps = []
        for router, block in zip(self.routers, self.blocks[1:]):
            p = router(x)                                          # (B, T, 1)
            active = (p <= 0.5).view(B, T)                         # (B, T) p > 0.5 halts
            cum = active.cumsum(1).index_select(1, last).tolist()  # host sync: (B, Q) active tokens up to each range end
            n = [[c - ([0] + row)[j] for j, c in enumerate(row)] for row in cum]  # (B, Q) ... in each range
            idx = torch.nonzero_static(active.view(-1), size=sum(r[-1] for r in cum)).squeeze(1)  # (N,) row-major
            ga = None if self.cfg.hard_variant == "01" else 1.0 - p.view(B * T, 1).index_select(0, idx)  # (N, 1) gates
            xa = x.view(B * T, C).index_select(0, idx)            # (N, C) the active tokens' state
            if self.cfg.skip_queries or caches is not None:
                h = block.ln_1(x)                                  # (B, T, C)
                xa = gated(xa, ga, self.sparse_attention(block.attn, h, idx, n, masks, caches))
            else:  # the paper's sparse-TSA: dense attention, residual gated by the same binary mask
                xa = gated(xa, ga, block.attn_delta(x).view(B * T, C).index_select(0, idx))
            xa = gated(xa, ga, block.ffn_delta(xa))                # (N, C) FFN on active tokens only
            x = x.view(B * T, C).index_copy(0, idx, xa).view(B, T, C)
            ps.append(p)
        return x, ps

    def sparse_attention(self, attn, h, idx, n, masks, caches=None):
        """h = ln_1(x) (B, T, C) -> c_proj(attention) of the N active tokens idx, (N, C). K/V for every token
        (active queries attend to halted ones too); Q, attention and c_proj for the active ones only. Queries
        of position range j = [hi_{j-1}, hi_j) see keys [0, hi_j) only, packed into a (B, W_j) grid (W_j: the
        busiest row of n, (B, Q) active tokens per row and range) under the causal mask's rows (masks[j]) by
        position; at B=1 the packing is the identity (slices). No boolean-mask indexing, no host sync."""
        B, T, C = h.shape
        k, v = (attn.split_heads(t) for t in kv_proj(attn, h))   # 2 × (B, nh, T, hs)
        if caches is not None:
            caches.append(common.KVCache(B, self.cfg.block_size, k, v))
        q, t = q_proj(attn, h.view(B * T, C).index_select(0, idx)), idx % T  # (N, C) queries, (N,) positions
        Q, W = len(masks), [max(col) for col in zip(*n)]         # per range: the busiest row
        base = list(accumulate((B * w for w in W), initial=0))    # grid: range-major, then row, then rank
        start = list(accumulate(sum(n, []), initial=0))           # queries before (row b, range j) in idx
        shift = [base[j] + b * W[j] - start[b * Q + j] for b in range(B) for j in range(Q)]  # slot − index
        if any(shift):
            slot = torch.arange(len(idx), device=h.device) + torch.tensor(shift, device=h.device).repeat_interleave(
                torch.tensor(sum(n, []), device=h.device), output_size=len(idx))  # (N,)
            q = q.new_zeros(base[-1], C).index_copy_(0, slot, q)  # (S, C) padding slots: zeros
            t = t.new_zeros(base[-1]).index_copy_(0, slot, t)     # (S,) ... at position 0
        y = []
        for j, mask in enumerate(masks):
            if W[j]:
                qj, tj = q[base[j]:base[j + 1]].view(B, W[j], C), t[base[j]:base[j + 1]]  # (B, W_j, C), (B·W_j,)
                mask = mask.index_select(0, tj).view(B, 1, W[j], -1)  # (B, 1, W_j, hi_j) by position
                hi = mask.size(-1)
                y.append(attn.attend(attn.split_heads(qj), k[:, :, :hi], v[:, :, :hi], mask).view(B * W[j], C))
        y = torch.cat(y or [q])                                   # (S, C)
        return attn.c_proj(y.index_select(0, slot) if any(shift) else y)  # (N, C)

    # ------------------------------------------------------------------------------------------------

    def forward(self, idx, targets=None, sparse=False):
        if sparse and self.training:
            raise NanorouteError("sparse=True is an inference path: call model.eval() first")
        x = self.embed(idx)  # (B, T, C)
        if self.cfg.variant == "early_exit":
            return self.exit_forward(x, targets)
        if sparse:
            h, ps = self.sparse_trunk(x)
        else:
            h, ps = self.trunk(x, "hard" if not self.training else "hard_st" if self.hard_train else "soft")
        logits, lm_loss = self.head(h, targets)
        # eqs. (5)–(7) on the router outputs of the pass that produced the logits (soft in training, hard in eval)
        active = torch.stack([(1.0 - p).mean() for p in ps])  # (L−1,) mean(1 − p_l)
        alpha = active.mean()                                # eq. (6)
        depth_loss = self.cfg.lam * alpha                    # eq. (5): the same mean, times λ
        stats = {f"active_r{l}": a.detach() for l, a in enumerate(active)}
        stats.update(alpha=alpha.detach(), tlops_saved=common.tlops_saving(alpha.detach(), self.cfg.n_layer),
                     depth_loss=depth_loss.detach())
        if not self.training:  # what inference executed, and the training computation next to it
            stats.update(self.hard_stats([(p <= 0.5).to(p.dtype).mean() for p in ps], idx.size(1)))
            if self.cfg.eval_soft and targets is not None and not sparse:
                hs, ps_soft = self.trunk(x, "soft")
                stats["soft_loss"] = self.head(hs, targets)[1]
                stats["soft_alpha"] = torch.stack([(1.0 - p).mean() for p in ps_soft]).mean()
        if targets is None:
            return logits, None, stats
        stats["lm_loss"] = lm_loss.detach()
        return logits, lm_loss + depth_loss, stats

    def hard_stats(self, hard, T):
        """hard: the L−1 fractions of tokens that ran block l+1. The common names (skip_l{i} by block index,
        skipped, flops_saved_hard) and TSA's own (hard_r{l}, alpha_hard, tlops_saved_hard)."""
        L, a = self.cfg.n_layer, torch.stack(hard).mean()
        mode = "exit" if self.cfg.variant == "early_exit" else "query" if self.cfg.skip_queries else "ffn"
        stats = {f"hard_r{l}": h for l, h in enumerate(hard)}
        stats.update({f"skip_l{l + 1}": 1.0 - h for l, h in enumerate(hard)})
        stats.update(alpha_hard=a, tlops_saved_hard=common.tlops_saving(a, L), skipped=1.0 - a,
                     flops_saved_hard=1.0 - flops_per_token(self.cfg, T, a, mode) / common.dense_flops_per_token(self.cfg, T))
        return stats

    # ------------------------------------------------------------------------------------------------
    # Cached decoding (common.LM.generate): hard routing, the same decisions as the eval forward

    @torch.no_grad()
    def prefill(self, idx):
        """idx (B, T) -> (logits (B, V) of the last position, state); one sparse forward filling the caches."""
        if self.cfg.variant == "early_exit":  # no cache: the state is the window itself
            return self(idx)[0][:, -1], idx
        caches = []
        h, _ = self.sparse_trunk(self.embed(idx), caches)
        return self.head(h[:, -1:])[0][:, -1], (caches, idx.size(1))

    @torch.no_grad()
    def step(self, tok, state):
        """tok (B, 1): one new token at position pos -> (logits (B, V), state)."""
        if self.cfg.variant == "early_exit":
            idx = torch.cat([state, tok], dim=1)
            return self(idx)[0][:, -1], idx
        caches, pos = state
        x = self.wte(tok) + self.wpe.weight[pos]  # (B, 1, C)
        x = self.blocks[0].step(x, caches[0], pos)  # the stem: common.Block's cached step
        for router, block, cache in zip(self.routers, self.blocks[1:], caches[1:]):
            x = self.decode_block(block, cache, x, pos, router(x))
        return self.head(x)[0][:, -1], (caches, pos + 1)

    def decode_block(self, block, cache, x, pos, p):
        """x (B, 1, C), p (B, 1, 1) halting probabilities -> x after routed block l+1 (semantics: the docstring
        at the top). Every row writes its K/V; the rest runs unless every row halts."""
        attn, h = block.attn, block.ln_1(x)                                # (B, 1, C)
        if min(p.view(-1).tolist()) > 0.5:  # host sync: every row halts -> K/V only, no q / attention / c_proj / FFN
            cache.append(pos, *(attn.split_heads(t) for t in kv_proj(attn, h)))
            return x
        q, k, v = attn.qkv(h)                                              # 3 × (B, nh, 1, hs)
        k, v = cache.append(pos, k, v)                                     # (B, nh, pos + 1, hs)
        y = attn.attend(q, k, v, causal=False)                             # (B, 1, C)
        # B > 1: the eval gate (0 for halted rows); B = 1: the token is active, its gate is 1 ("01") or 1 − p
        g = self.gate(p, "hard") if x.size(0) > 1 else None if self.cfg.hard_variant == "01" else 1.0 - p
        x = gated(x, g, attn.c_proj(y))
        return gated(x, g, block.ffn_delta(x))

    # ------------------------------------------------------------------------------------------------
    # early-exit baseline (§3.5)

    def exit_norm(self, l):
        return self.exit_ln[l] if l < self.cfg.n_layer - 1 else self.ln_f

    def exit_forward(self, x, targets):
        """Train: mean CE over all L exits. Eval: confidence exit with frozen hidden states; the stats
        count block l+1 as active for the tokens that have not exited after block l (same α as TSA)."""
        stats = {}
        if self.training:
            losses = []
            for l, block in enumerate(self.blocks):
                x = block(x)
                logits = self.lm_head(self.exit_norm(l)(x))  # (B, T, V) exit l, tied embedding
                if targets is not None:
                    losses.append(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1))
            if targets is None:
                return logits, None, stats
            loss = torch.stack(losses).mean()
            stats.update(lm_loss=losses[-1].detach(), exit_loss=loss.detach())
            return logits, loss, stats
        out, actives = self.exit_infer(x)
        hard = [a.to(x.dtype).mean() for a in actives]
        alpha = torch.stack(hard).mean()
        stats.update(self.hard_stats(hard, x.size(1)))
        stats.update(alpha=alpha, tlops_saved=common.tlops_saving(alpha, self.cfg.n_layer))
        if targets is None:
            return out, None, stats
        lm_loss = F.cross_entropy(out.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        stats["lm_loss"] = lm_loss.detach()
        return out, lm_loss, stats

    def exit_infer(self, x):
        """-> logits of each token's exit (B, T, V), and for l = 0..L−2 the (B, T) mask of the tokens that
        run block l+1 (not exited after block l). Exited tokens keep (freeze) their hidden state."""
        L = self.cfg.n_layer
        done = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)  # (B, T) exited already
        actives, out = [], None
        for l, block in enumerate(self.blocks):
            x = torch.where(done[..., None], x, block(x))
            logits = self.lm_head(self.exit_norm(l)(x))     # (B, T, V)
            out = logits if out is None else torch.where(done[..., None], out, logits)
            if l < L - 1:
                conf = F.softmax(logits.float(), dim=-1).amax(-1)  # (B, T) max softmax probability
                done = done | (conf > self.threshold)              # an exited token never comes back
                actives.append(~done)
        return out, actives

    # ------------------------------------------------------------------------------------------------
    # Routing picture (contract 4, Fig. 4)

    @torch.no_grad()
    def routing_map(self, idx):
        """idx (1, T) -> (m (L, T) on CPU, rows, legend): row 0 the fraction of the L−1 routed blocks each
        token ran, then one row per routed block (1 = ran it) — the hard decisions inference takes."""
        was_training = self.training
        self.eval()
        x = self.embed(idx)
        if self.cfg.variant == "early_exit":
            actives = self.exit_infer(x)[1]
        else:
            actives = [p <= 0.5 for p in self.trunk(x, "hard")[1]]
        self.train(was_training)
        m = torch.stack([a.reshape(-1) for a in actives]).float().cpu()  # (L−1, T)
        rows = ["depth: share of routed layers run"] + [f"layer {l + 1}" for l in range(len(actives))]
        return torch.cat([m.mean(0, keepdim=True), m]), rows, ("halted", "active")


# ----------------------------------------------------------------------------------------------------
# Accounting: forward FLOPs per token from common's per-component counts

def flops_router(d):
    h = max(d // 4, 16)
    return 2 * (d * h + h)


def flops_per_token(cfg, T, alpha=1.0, mode="dense"):
    """mode: dense (the plain GPT), soft (every block runs + routers), ffn (paper's sparse-TSA: halted
    tokens skip the FFN), query (ours: halted tokens also skip Q, attention and c_proj; K/V still run),
    exit (early exit: like query, with an exit head instead of a router). α = active fraction."""
    d, L = cfg.n_embd, cfg.n_layer
    if mode == "dense":
        return common.dense_flops_per_token(cfg, T)
    q = common.flops_qkv(d) / 3
    kv = 2 * q  # K and V: every token, also a halted one (later queries attend to it)
    per_query = q + common.flops_attn_out(d) + common.flops_attn_scores(d, common.mean_context(T))
    ffn = common.flops_ffn(d, 4 * d)
    head = common.flops_lm_head(d, cfg.vocab_size)
    routed = {"soft": kv + per_query + ffn, "ffn": kv + per_query + alpha * ffn,
              "query": kv + alpha * (per_query + ffn), "exit": kv + alpha * (per_query + ffn)}[mode]
    decide = head * (1 + (L - 2) * alpha) / (L - 1) if mode == "exit" else flops_router(d)  # per routed block
    return kv + per_query + ffn + (L - 1) * (routed + decide) + head


# ----------------------------------------------------------------------------------------------------
# Tools: early-exit threshold sweep

@torch.no_grad()
def exit_sweep(model, data, meta, cfg, device, thresholds=None):
    """α and val loss of the early-exit model at each threshold (App. D)."""
    thresholds = thresholds or [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0]
    rows = []
    for t in thresholds:
        model.threshold = t
        ev = common.estimate_loss(model, data, meta, cfg, device, "val")
        rows.append({"threshold": t, "alpha": ev["alpha"], "tlops_saved": ev["tlops_saved"], "val_loss": ev["loss"]})
    model.threshold = cfg.threshold
    return rows


def load_run(run_dir):
    ckpt = common.load_checkpoint(os.path.join(run_dir, "ckpt.pt"))
    cfg = Config(**ckpt["config"])
    model = Model(cfg)
    model.load_state_dict(ckpt["model"])
    return model.eval(), cfg


def main(argv):
    """python tsa.py exit_sweep RUN_DIR"""
    if len(argv) != 2 or argv[0] != "exit_sweep":
        raise NanorouteError("usage: python tsa.py exit_sweep RUN_DIR  (an early-exit run)")
    model, cfg = load_run(argv[1])
    if cfg.variant != "early_exit":
        raise NanorouteError("exit_sweep needs an early-exit run (variant=early_exit)")
    meta = common.load_meta(cfg.dataset, cfg.data_dir)
    val = common.load_split(cfg.dataset, "val", cfg.data_dir)
    for r in exit_sweep(model, val, meta, cfg, torch.device("cpu")):
        print(" ".join(f"{k}={v:.4f}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except NanorouteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
