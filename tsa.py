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

Inference (§3.6): a token with p_l > 0.5 halts at block l+1 (that block only). eval() applies these hard
decisions densely (the reference); `sparse=True` skips the work, same logits: a halted token skips the FFN,
attention and output projection, but its K/V run (later tokens attend to it). Cached decoding keeps this: every
cache holds every token's K/V; a layer where every row halts runs only Q/K/V.

Deviations from the paper, one line each (Config fields; why, and what each measured: results/tsa.md):
  * hard_ft_iters: the last iterations train with straight-through hard gates (forward: eval's; gradient: 1 − p's).
  * hard_ft_routers: in that phase the routers "train", stay "frozen" or "calibrate"; "soft" = no phase (a control).
  * "calibrate": at the phase's first step b2 shifts so that the share the soft gate claims, 1 − mean(p_l), runs.
  * exec_share=S ("calibrate" only): a share S runs instead, so TLOps saved = (L−1)(1−S)/L, whatever λ did.
  * hard_ft_lr > 0: the phase's lr restarts there and falls by a cosine to min_lr (the schedule's tail is too low).
  * hard_variant="scaled": an active token keeps its soft scale 1 − p at inference (paper: "01", the full update).
  * skip_queries=True: halted tokens also skip attention / out-projection; Q/K/V stay one GEMM (paper: dense attention).
  * stats report the hard decisions inference executes; eval's soft_loss / soft_alpha come from a soft pass.
  * the router runs in fp32 under autocast (the numerics policy's fp32 decisions, also for its matmuls).
  * `--preset paper`: lr 3e-4 → 3e-5, dropout 0.1 and no warm-up from the authors' code (the paper states none).

Early-exit baseline (§3.5, App. D, `--variant=early_exit`, class EarlyExit, built by `build(cfg)`): the same
backbone with an exit head after each block (own LayerNorm + the tied embedding), trained on the mean CE of
all exits; at inference a token exits when its max softmax probability exceeds `threshold`, and its hidden
state is frozen afterwards (it still provides K/V from the frozen state). Its decode state is the token window.
"""
import os
import sys
from dataclasses import dataclass

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
    skip_queries: bool = True       # sparse path: halted tokens also skip attention / out-proj
    eval_soft: bool = True          # eval also runs the soft pass (soft_loss next to the hard loss)
    hard_ft_iters: int = 250        # the last iterations train with straight-through hard gates (all if > max_iters)
    hard_ft_routers: str = "train"  # ... in which the routers "train", stay "frozen", "calibrate" or "soft" (docstring)
    hard_ft_lr: float = 0.0         # > 0: that phase's lr restarts here, cosine to min_lr (0: the schedule goes on)
    exec_share: float = 0.0         # "calibrate": share of routed token-layers left active (0: the soft gate's claim)
    variant: str = "tsa"            # "tsa" | "early_exit" (the §3.5 baseline: class EarlyExit, see build)
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
    # The paper's Shakespeare setup (§3.2) and sparse-TSA (§3.6: "01" gates, dense attention); lr, dropout and
    # warm-up from the authors' code. Ours adds the last 750 iterations straight-through with calibrated, frozen
    # routers and the lr restarted (results/tsa.md); --hard_ft_iters=0 is the paper's soft-only recipe.
    "paper": dict(n_layer=6, n_head=8, n_embd=256, block_size=128, batch_size=64, max_iters=5000,
                  learning_rate=3e-4, min_lr=3e-5, warmup_iters=0, beta2=0.95, weight_decay=0.1, dropout=0.1,
                  eval_interval=250, lam=1e-3, hard_variant="01", skip_queries=False, hard_ft_iters=750,
                  hard_ft_routers="calibrate", hard_ft_lr=3e-4),
    # ≤ 3 minutes on a 2-core CPU; the last 300 iterations straight-through (the routing a student sees is trained)
    "classroom": dict(common.CLASSROOM, hard_ft_iters=300),
}


def build(cfg):
    """The model cfg asks for: TSA, or the early-exit baseline (train.py calls this when a module has it)."""
    return EarlyExit(cfg) if cfg.variant == "early_exit" else Model(cfg)


# ----------------------------------------------------------------------------------------------------
# Router (eq. 2)

class Router(nn.Module):
    """Eq. (2): p = σ(W2 ReLU(W1 h + b1) + b2); d²/4 + d/2 + 1 parameters at d divisible by 4."""

    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, max(d // 4, 16))
        self.fc2 = nn.Linear(max(d // 4, 16), 1)

    def forward(self, h):
        # in h's dtype (fp32, the residual stream) even under autocast: the decision at p = 0.5 does not depend on
        # the dtype the blocks run in, and no cast is dispatched (a GPU is bound by the number of ops here)
        with torch.autocast(h.device.type, enabled=False):
            return torch.sigmoid(self.fc2(F.relu(self.fc1(h))))  # (B, T, 1) p_l


# ----------------------------------------------------------------------------------------------------
# Block pieces: TSA reuses common.Block; the sparse path runs parts of it on subsets of tokens

def gated(x, g, delta):
    """Eqs. (3)–(4): x + g ⊙ delta in one op; g None is the "01" gate, 1. fp32 x + bf16 delta promotes (no cast)."""
    return x + delta if g is None else torch.addcmul(x, g, delta)


# ----------------------------------------------------------------------------------------------------
# Model

class Model(common.LM):
    """TSA: common.Block blocks (names as common.Model, so --init_from a dense checkpoint loads them), a router
    before every block after the stem. forward: soft (train), straight-through hard (the last hard_ft_iters
    iterations), hard (eval, dense reference) or sparse (eval, sparse=True)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.variant != "tsa":
            raise NanorouteError(f"variant={cfg.variant!r} is built by tsa.build(cfg) (class EarlyExit)")
        L = cfg.n_layer
        self.blocks = nn.ModuleList([common.Block(cfg) for _ in range(L)])
        self.routers = nn.ModuleList([Router(cfg.n_embd) for _ in range(L - 1)])  # r_0..r_{L-2}
        ddp = torch.distributed.is_available() and torch.distributed.is_initialized()
        if cfg.hard_ft_routers in ("frozen", "calibrate") and cfg.hard_ft_iters and ddp:  # DDP: a grad per param
            raise NanorouteError(f"hard_ft_routers={cfg.hard_ft_routers} (routers without gradients) is not supported "
                                 "under DDP; run on one process or pass --hard_ft_routers=train")
        self.hard_train = False  # set by on_step during the last hard_ft_iters iterations
        self.calibrate_now = False  # set by on_step for the first of them (hard_ft_routers="calibrate")
        self.init_weights()
        for r in self.routers:
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

    def gate(self, p, mode):
        """p (B, T, 1) -> the factor on both residual deltas of the next block: soft (eqs. 3–4), hard (§3.6:
        p > 0.5 halts) or hard_st (straight-through: the hard value forward, the soft gradient backward)."""
        soft = 1.0 - p
        if mode == "soft":
            return soft
        hard = (p <= 0.5).to(p.dtype) * (soft if self.cfg.hard_variant == "scaled" else 1.0)
        if mode == "hard_st":
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
            x = x + g * block.attn_delta(x)  # eq. (3)
            x = x + g * block.ffn_delta(x)   # eq. (4)
            ps.append(p)
        self.calibrate_now = self.calibrate_now and mode != "hard_st"  # done
        return x, ps

    def forward(self, idx, targets=None, sparse=False):
        if sparse and self.training:
            raise NanorouteError("sparse=True is an inference path: call model.eval() first")
        x = self.embed(idx)  # (B, T, C)
        hard = None  # (L−1,) shares of tokens that ran each routed block: the sparse path counts them on the host
        if sparse:
            h, ps, hard = sparse_trunk(self, x)
        else:
            h, ps = self.trunk(x, "hard" if not self.training else "hard_st" if self.hard_train else "soft")
        logits, lm_loss = self.head(h, targets)
        depth_loss, stats = depth_stats(ps, self.cfg)  # eqs. (5)–(7) on the pass that produced the logits
        if not self.training:  # what inference executed, and the training computation next to it
            if hard is None:  # (L−1,) the sparse path's host division (count / B·T), on the device: equal bits
                hard = (torch.cat(ps, -1) <= 0.5).sum((0, 1)).to(ps[0].dtype) / idx.numel()
            stats.update(hard_stats(self.cfg, hard, idx.size(1)))
            if self.cfg.eval_soft and targets is not None and not sparse:
                hs, ps_soft = self.trunk(x, "soft")
                stats["soft_loss"] = self.head(hs, targets)[1]
                stats["soft_alpha"] = depth_stats(ps_soft, self.cfg)[1]["alpha"]
        if targets is None:
            return logits, None, stats
        stats["lm_loss"] = lm_loss.detach()
        return logits, lm_loss + depth_loss, stats

    @torch.no_grad()
    def prefill(self, idx):
        """idx (B, T) -> (logits (B, V) of the last position, state); one sparse forward filling the caches."""
        caches = []
        h = sparse_trunk(self, self.embed(idx), caches)[0]
        return self.head(h[:, -1:])[0][:, -1], (caches, torch.tensor(idx.size(1), device=idx.device))

    @torch.no_grad()
    def step(self, tok, state):
        """tok (B, 1) at position pos (a 0-d tensor) -> (logits (B, V), state); shapes fixed from token to token."""
        caches, pos = state
        x = self.wte(tok) + self.wpe(pos)  # (B, 1, C)
        mask = common.past_mask(pos, self.cfg.block_size, caches[0].k.dtype)  # (1, S)
        x = self.blocks[0].step(x, caches[0], pos, mask)  # the stem: common.Block's cached step
        for router, block, cache in zip(self.routers, self.blocks[1:], caches[1:]):
            x = decode_block(self, block, cache, x, pos, mask, router(x))
        return self.head(x)[0][:, -1], (caches, pos + 1)

    @torch.no_grad()
    def routing_map(self, idx):
        """idx (1, T) -> (m (L, T) on CPU, rows, legend): row 0 the fraction of the L−1 routed blocks each
        token ran, then one row per routed block (1 = ran it) — the hard decisions inference takes."""
        was_training = self.training
        self.eval()
        actives = [p <= 0.5 for p in self.trunk(self.embed(idx), "hard")[1]]
        self.train(was_training)
        return routing_rows(actives)


class EarlyExit(common.LM):
    """The early-exit baseline (§3.5, App. D): exit heads after blocks 0..L−2 (the last exit is the model's own
    ln_f + head). Train: mean CE over all L exits. Eval: confidence exit with frozen hidden states; the stats
    count block l+1 as active for the tokens that have not exited after block l (the same α as TSA)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        L = cfg.n_layer
        self.blocks = nn.ModuleList([common.Block(cfg) for _ in range(L)])
        self.exit_ln = nn.ModuleList([nn.LayerNorm(cfg.n_embd, bias=cfg.bias) for _ in range(L - 1)])
        self.threshold = cfg.threshold
        self.init_weights()

    def exit_norm(self, l):
        return self.exit_ln[l] if l < self.cfg.n_layer - 1 else self.ln_f

    def forward(self, idx, targets=None, sparse=False):
        if sparse and self.training:
            raise NanorouteError("sparse=True is an inference path: call model.eval() first")
        x = self.embed(idx)  # (B, T, C)
        if not self.training:
            out, actives = self.exit_infer(x)
            hard = torch.stack([a.to(x.dtype).mean() for a in actives])  # (L−1,)
            stats = hard_stats(self.cfg, hard, x.size(1))
            stats.update(alpha=stats["alpha_hard"], tlops_saved=stats["tlops_saved_hard"])
            if targets is None:
                return out, None, stats
            lm_loss = F.cross_entropy(out.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
            stats["lm_loss"] = lm_loss.detach()
            return out, lm_loss, stats
        losses = []
        for l, block in enumerate(self.blocks):
            x = block(x)
            logits = self.lm_head(self.exit_norm(l)(x))  # (B, T, V) exit l, tied embedding
            if targets is not None:
                losses.append(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1))
        if targets is None:
            return logits, None, {}
        loss = torch.stack(losses).mean()
        return logits, loss, {"lm_loss": losses[-1].detach(), "exit_loss": loss.detach()}

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

    @torch.no_grad()
    def prefill(self, idx):
        """No KV cache (an exited token's K/V come from its frozen state): the state is the window itself."""
        return self(idx)[0][:, -1], (idx,)

    @torch.no_grad()
    def step(self, tok, state):
        idx = torch.cat([state[0], tok], dim=1)
        return self(idx)[0][:, -1], (idx,)

    @torch.no_grad()
    def routing_map(self, idx):
        was_training = self.training
        self.eval()
        actives = self.exit_infer(self.embed(idx))[1]
        self.train(was_training)
        return routing_rows(actives)


def routing_rows(actives):
    """L−1 masks (1, T) of the tokens that ran each routed block -> routing_map's (m (L, T), rows, legend)."""
    m = torch.stack([a.reshape(-1) for a in actives]).float().cpu()  # (L−1, T)
    rows = ["depth: share of routed layers run"] + [f"layer {l + 1}" for l in range(len(actives))]
    return torch.cat([m.mean(0, keepdim=True), m]), rows, ("halted", "active")


# ----------------------------------------------------------------------------------------------------
# Losses and stats: eqs. (5)–(7) on the router outputs, and what the hard decisions executed

def depth_stats(ps, cfg):
    """ps: the L−1 router outputs (B, T, 1) -> (L_depth of eq. 5, stats: active_r{l}, α of eq. 6, Δ of eq. 7)."""
    active = (1.0 - torch.cat(ps, -1)).mean((0, 1))  # (L−1,) mean(1 − p_l)
    alpha = active.mean()                            # eq. (6)
    depth_loss = cfg.lam * alpha                     # eq. (5): the same mean, times λ
    stats = {f"active_r{l}": a for l, a in enumerate(active.detach())}
    stats.update(alpha=alpha.detach(), tlops_saved=common.tlops_saving(alpha.detach(), cfg.n_layer),
                 depth_loss=depth_loss.detach())
    return depth_loss, stats


def hard_stats(cfg, hard, T):
    """hard (L−1,): the shares of tokens that ran block l+1 -> the common names (skip_l{i} by block index,
    skipped, flops_saved_hard) and TSA's own (hard_r{l}, alpha_hard, tlops_saved_hard)."""
    a = hard.mean()
    mode = "exit" if cfg.variant == "early_exit" else "query" if cfg.skip_queries else "ffn"
    dense = common.dense_flops_per_token(cfg, T)
    f0, f1 = (flops_per_token(cfg, T, x, mode) / dense for x in (0.0, 1.0))  # the FLOPs are affine in α
    stats = {f"hard_r{l}": h for l, h in enumerate(hard)}
    stats.update({f"skip_l{l + 1}": s for l, s in enumerate(1.0 - hard)})
    stats.update(alpha_hard=a, tlops_saved_hard=common.tlops_saving(a, cfg.n_layer), skipped=1.0 - a,
                 flops_saved_hard=(1.0 - f0) - (f1 - f0) * a)
    return stats


# ----------------------------------------------------------------------------------------------------
# Sparse inference (§3.6): the numbers of the eval forward, with the work of halted tokens skipped

def sparse_trunk(model, x, caches=None):
    """Same numbers as model.trunk(x, "hard"), but per routed block the N active tokens' state is gathered; their
    out-projection and FFN run on those rows only, and one index_copy writes them back. One host sync per routed
    block (N sets the shapes). caches (a list): every layer's K/V is stored in it (prefill). Returns the final
    state, the L−1 router outputs and the (L−1,) shares of tokens that ran each routed block."""
    B, T, C = x.shape
    cfg = model.cfg
    if caches is None:
        x = model.blocks[0](x)  # stem f0
    else:  # ... also storing its K/V (prefill)
        x, cache = model.blocks[0].prefill(x, cfg.block_size)
        caches.append(cache)
    ps, ran = [], []
    for router, block in zip(model.routers, model.blocks[1:]):
        p = router(x)                                                      # (B, T, 1)
        idx = (p <= 0.5).view(-1).nonzero().squeeze(1)                     # (N,) active tokens (a host sync)
        N = idx.numel()
        ps.append(p)
        ran.append(N / (B * T))
        attn = block.attn
        if cfg.skip_queries or caches is not None:  # Q, K, V of every token: one GEMM (later queries see K/V)
            q, k, v = attn.qkv(block.ln_1(x))                              # 3 × (B, nh, T, hs)
            if caches is not None:
                caches.append(common.KVCache(B, cfg.block_size, k, v))
        if N == 0:  # every token halts: nothing else to run
            continue
        ga = None if cfg.hard_variant == "01" else (1.0 - p).view(B * T, 1).index_select(0, idx)  # (N, 1)
        xa = x.view(B * T, C).index_select(0, idx)                         # (N, C) the active tokens' state
        if cfg.skip_queries or caches is not None:
            # Attention runs on all T query slots and the halted tokens' outputs are dropped: packing the active
            # queries per row would make the query length change with the routing (on CUDA, SDPA then picks cuDNN
            # attention, which sets itself up anew for every length) and cost more ops than one fixed-shape call.
            y = attn.attend(q, k, v).view(B * T, C).index_select(0, idx)  # (N, C)
            xa = gated(xa, ga, attn.c_proj(y))
        else:  # the paper's sparse-TSA: dense attention, its residual gated by the same binary mask
            xa = gated(xa, ga, block.attn_delta(x).view(B * T, C).index_select(0, idx))
        xa = gated(xa, ga, block.ffn_delta(xa))                            # (N, C) FFN on active tokens only
        x = x.view(B * T, C).index_copy(0, idx, xa).view(B, T, C)
    return x, ps, torch.tensor(ran, dtype=ps[0].dtype).to(x.device, non_blocking=True)  # blocking: one more sync


# ----------------------------------------------------------------------------------------------------
# Cached decoding (common.LM.generate): hard routing, the same decisions as the eval forward

def decode_block(model, block, cache, x, pos, mask, p):
    """One routed block of a decode step: x (B, 1, C), p (B, 1, 1). Every row writes its K/V at pos; the rest runs
    unless every row halts, read on the host (a sync; 1.4x faster on the H200 than running every block gated:
    results/bench.md). A compiled step captures both variants of a layer (K/V only; the whole block)."""
    attn = block.attn
    q, k, v = attn.qkv(block.ln_1(x))                                      # 3 × (B, nh, 1, hs)
    k, v = cache.append(pos, k, v)                                         # (B, nh, S, hs)
    if p.min().item() > 0.5:  # every row halts: its K/V only, no attention / c_proj / FFN
        return x
    y = attn.attend(q, k, v, attn_mask=mask)                               # (B, 1, C)
    # B > 1: the eval gate (0 for halted rows); B = 1: the token is active, its gate is 1 ("01") or 1 − p
    g = model.gate(p, "hard") if x.size(0) > 1 else None if model.cfg.hard_variant == "01" else 1.0 - p
    x = gated(x, g, attn.c_proj(y))
    return gated(x, g, block.ffn_delta(x))


# ----------------------------------------------------------------------------------------------------
# Accounting: forward FLOPs per token from common's per-component counts

def flops_router(d):
    h = max(d // 4, 16)
    return 2 * (d * h + h)


def flops_per_token(cfg, T, alpha=1.0, mode="dense"):
    """mode: dense (the plain GPT), soft (every block runs + routers), ffn (paper's sparse-TSA: halted
    tokens skip the FFN), query (ours: halted tokens also skip attention and c_proj; Q/K/V still run, one GEMM),
    exit (early exit: halted tokens skip Q/K/V too, an exit head instead of a router). α = active fraction."""
    d, L = cfg.n_embd, cfg.n_layer
    if mode == "dense":
        return common.dense_flops_per_token(cfg, T)
    q = common.flops_qkv(d) / 3
    kv = 2 * q  # K and V: every token, also a halted one (later queries attend to it)
    per_query = q + common.flops_attn_out(d) + common.flops_attn_scores(d, common.mean_context(T))
    # query: a halted token's Q runs in the Q/K/V GEMM of every token (one launch; its output is unused)
    ffn = common.flops_ffn(d, 4 * d)
    head = common.flops_lm_head(d, cfg.vocab_size)
    routed = {"soft": kv + per_query + ffn, "ffn": kv + per_query + alpha * ffn,
              "query": kv + q + alpha * (per_query - q + ffn), "exit": kv + alpha * (per_query + ffn)}[mode]
    decide = head * (1 + (L - 2) * alpha) / (L - 1) if mode == "exit" else flops_router(d)  # per routed block
    return kv + per_query + ffn + (L - 1) * (routed + decide) + head


# ----------------------------------------------------------------------------------------------------
# CLI: early-exit threshold sweep

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
    model = build(cfg)
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
