"""
Token-Selective Attention (TSA), from "Adaptive Computation Depth via Learned Token Routing in
Transformers" (A. A. A. Mohammed, 2026, arXiv:2605.05222). A learned per-token gate on the residual
updates of every block after the stem.

    (1)  h ← f0(h);  p_l = r_l(h);  h ← f_{l+1}(h, p_l),   l = 0..L−2      the stem f0 always runs
    (2)  r_l(h) = σ(W2 ReLU(W1 h + b1) + b2) ∈ (0,1)^{B×T}, hidden max(d/4, 16), b2 init −1
    (3)  h ← h + (1 − p_l) ⊙ Δattn_{l+1}(h)
    (4)  h ← h + (1 − p_l) ⊙ Δffn_{l+1}(h)
    (5)  L_depth = λ · 1/(L−1) Σ_l mean(1 − p_l);   L = L_task + L_depth
    (6)  α = 1/(L−1) Σ_l mean(1 − p_l)                       (the mean active fraction)
    (7)  Δ = 1 − (1 + (L−1) α) / L                             (TLOps saved, common.tlops_saving)

Inference (§3.6): a token with p_l > 0.5 halts at block l+1. eval() applies this densely (the
reference); `sparse=True` and the decode step skip a halted token's attention, out-projection and
FFN, same logits; its K/V still run (later tokens attend to it).

Deviations from the paper and the authors' code, one line each (measured: results/tsa.md):
  * hard_ft_iters: the last iterations train straight-through (forward: eval's gate; grad: 1 − p's).
  * hard_ft_routers: "frozen", or "calibrate": b2 shifts once so that 1 − p̄ (or exec_share) runs.
  * hard_ft_lr > 0: the phase's lr restarts, cosine to min_lr (the schedule's tail is too low).
  * hard_variant="scaled": an active token keeps its soft scale 1 − p at inference (paper "01": 1).
  * skip_queries=True: halted tokens skip attention and out-projection too (paper: dense attention).
  * stats report the hard decisions inference executes; eval's soft_loss / soft_alpha: a soft pass.
  * the router runs in fp32 under autocast (the numerics policy: routing decisions in fp32).
  * p_l = 0.5 exactly runs the block (§3.6: p > 0.5 halts); the authors' MLX code halts it.
  * `--preset paper`: lr 3e-4 → 3e-5, dropout 0.1, no warm-up from the authors' code (paper: none).
  * dropout after attention's and the FFN's out-projections (common.Block); the authors: after GELU.
  * `--preset paper` has no biases (bias=False); the authors' LayerNorms and FFN have them.
  * Q/K/V, FFN-in and router weights start N(0, 0.02); the authors keep PyTorch's default init.
  * Shakespeare splits 90/10 train/val (common.prepare); the paper and the authors 80/10/10.

The early-exit baseline of §3.5 and App. D: class EarlyExit (`--variant=early_exit`).
"""
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import NanorouteError


@dataclass
class Config(common.Config):
    lam: float = 1e-3  # λ of eq. (5)
    router_bias: float = -1.0  # b2 init: σ(−1) ≈ 0.27, so routers start mostly open (§2.2)
    hard_variant: str = "scaled"  # an active token's eval gate: "01" (paper: 1), "scaled" (1 − p)
    skip_queries: bool = True  # sparse path: halted tokens also skip attention / out-proj
    eval_soft: bool = True  # eval also runs the soft pass (its loss: soft_loss)
    hard_ft_iters: int = 250  # the last iterations train straight-through (all if > max_iters)
    hard_ft_routers: str = "train"  # ... routers "train", "frozen", "calibrate", "soft" (no phase)
    hard_ft_lr: float = 0.0  # > 0: the phase's lr restarts here, cosine to min_lr
    exec_share: float = 0.0  # "calibrate": share of routed token-layers left active (0: 1 − p̄)
    variant: str = "tsa"  # or "early_exit", the §3.5 baseline
    threshold: float = 1.0  # early exit: exit when max softmax prob > threshold (1.0: never)
    model: str = "tsa"

    def __post_init__(self):
        super().__post_init__()
        choices = dict(variant=("tsa", "early_exit"), hard_variant=("01", "scaled"),
                       hard_ft_routers=("train", "frozen", "calibrate", "soft"))
        rules = [(getattr(self, k) in v, k, f"one of {v}") for k, v in choices.items()] + [
            (self.n_layer >= 2, "n_layer", ">= 2 (a stem and a routed block)"),
            (self.lam >= 0, "lam", ">= 0"),
            (0.0 <= self.threshold <= 1.0, "threshold", "in [0, 1]"),
            (self.hard_ft_iters >= 0, "hard_ft_iters", ">= 0"),
            (0.0 <= self.exec_share <= 1.0, "exec_share", "in [0, 1]"),
            (not self.exec_share or self.hard_ft_routers == "calibrate", "exec_share",
             "0 unless hard_ft_routers='calibrate'"),
            (not self.hard_ft_lr or self.hard_ft_lr >= self.min_lr, "hard_ft_lr",
             f"0 (off) or >= min_lr={self.min_lr}")]
        for ok, name, rule in rules:
            if not ok:  # a comparison with nan is False: nan is refused too
                raise NanorouteError(f"{name} must be {rule}, got {getattr(self, name)!r}")


PRESETS = {
    # The paper's Shakespeare setup (§3.2) and sparse-TSA (§3.6), lr, dropout, warm-up as the
    # authors'; ours adds 750 calibrated straight-through steps (--hard_ft_iters=0: none).
    "paper": dict(n_layer=6, n_head=8, n_embd=256, block_size=128, batch_size=64, max_iters=5000,
                  learning_rate=3e-4, min_lr=3e-5, warmup_iters=0, beta2=0.95, weight_decay=0.1,
                  dropout=0.1, eval_interval=250, lam=1e-3, hard_variant="01", skip_queries=False,
                  hard_ft_iters=750, hard_ft_routers="calibrate", hard_ft_lr=3e-4),
    # ≤ 3 minutes on a 2-core CPU, the last 300 iterations straight-through
    "classroom": dict(common.CLASSROOM, hard_ft_iters=300),
    # common.GPU (one GPU, ~an hour) with the paper preset's routing, its phase scaled (15% of
    # the steps straight-through, calibrated) and its lr restart at the run's lr
    "gpu": dict(common.GPU, lam=1e-3, hard_variant="01", skip_queries=False, hard_ft_iters=375,
                hard_ft_routers="calibrate", hard_ft_lr=6e-4),
}


def build(cfg):
    """The model cfg asks for: TSA, or the early-exit baseline (train.py calls this)."""
    return EarlyExit(cfg) if cfg.variant == "early_exit" else Model(cfg)


def active(p):
    """§3.6: a token with p_l > 0.5 halts at block l+1; True where it runs (p = 0.5 runs)."""
    return p <= 0.5


def gated(x, g, delta):
    """Eqs. (3)–(4): h + g ⊙ Δ(h); g the gate of the block's residual update (1 − p_l when soft)."""
    return x + g * delta


# Router (eq. 2)

class Router(nn.Module):
    """Eq. (2): p = σ(W2 ReLU(W1 h + b1) + b2); d²/4 + d/2 + 1 parameters at d divisible by 4."""

    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, max(d // 4, 16))
        self.fc2 = nn.Linear(max(d // 4, 16), 1)

    def forward(self, h):
        # in the residual stream's dtype (fp32) under autocast too: decisions in fp32
        with torch.autocast(h.device.type, enabled=False):
            return torch.sigmoid(self.fc2(F.relu(self.fc1(h))))  # (B, T, 1) p_l


# Model

class Model(common.LM):
    """TSA: common.Model's blocks (and names: --init_from a dense run loads them), a router before
    each block after the stem; gates soft (train), straight-through (hard_ft_iters), hard (eval)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.variant != "tsa":
            raise NanorouteError(f"variant={cfg.variant!r}: build it with tsa.build(cfg)")
        L = cfg.n_layer
        self.blocks = nn.ModuleList([common.Block(cfg) for _ in range(L)])
        self.routers = nn.ModuleList([Router(cfg.n_embd) for _ in range(L - 1)])  # r_0..r_{L-2}
        ddp = torch.distributed.is_available() and torch.distributed.is_initialized()
        if cfg.hard_ft_routers in ("frozen", "calibrate") and cfg.hard_ft_iters and ddp:
            raise NanorouteError(f"hard_ft_routers={cfg.hard_ft_routers} leaves routers without "
                                 "gradients, which DDP refuses: use one process or 'train'")
        self.hard_train = False  # on_step sets these: the straight-through phase,
        self.calibrate_now = False  # its first step ("calibrate")
        self.init_weights()
        for r in self.routers:
            nn.init.constant_(r.fc2.bias, cfg.router_bias)

    def on_step(self, it):
        """train.py calls this before every step: the last hard_ft_iters are straight-through."""
        cfg, start = self.cfg, self.cfg.max_iters - self.cfg.hard_ft_iters
        self.hard_train = cfg.hard_ft_iters > 0 and it >= start and cfg.hard_ft_routers != "soft"
        self.calibrate_now = (self.hard_train and cfg.hard_ft_routers == "calibrate"
                              and it == max(start, 0))

    def train_flops_per_token(self, T, stats=None):
        """Training gates (eqs. 3–4) and skips nothing: every block and router runs."""
        return float(flops_per_token(self.cfg, T, 1.0, "soft"))

    def lr_at(self, it):
        """train.py's lr at step it: common's, or (hard_ft_lr > 0) a fresh cosine over the phase
        (a phase longer than the run starts at step 0, at hard_ft_lr)."""
        cfg, start = self.cfg, max(self.cfg.max_iters - self.cfg.hard_ft_iters, 0)
        if not (cfg.hard_ft_lr and cfg.hard_ft_iters and it >= start):
            return common.lr_at(it, cfg)
        ratio = (it - start) / max(1, cfg.max_iters - start)
        return common.cosine(ratio, cfg.hard_ft_lr, cfg.min_lr)

    def gate(self, p, mode):
        """p (B, T, 1) -> the gate of the next block's deltas: soft (eqs. 3–4), hard (§3.6) or
        hard_st (straight-through: hard forward, soft gradient)."""
        soft = 1.0 - p
        if mode == "soft":
            return soft
        hard = active(p).to(p.dtype) * (soft if self.cfg.hard_variant == "scaled" else 1.0)
        if mode == "hard_st":
            return hard.detach() + (soft - soft.detach())
        return hard

    def trunk(self, x, mode):
        """Eq. (1) with dense computation. Returns the final hidden state and the L−1 p_l."""
        x = self.blocks[0](x)  # stem f0: always runs
        ps = []
        for router, block in zip(self.routers, self.blocks[1:]):
            p = router(x)  # (B, T, 1) p_l from the state after block l
            if mode == "hard_st" and self.cfg.hard_ft_routers != "train":
                if self.calibrate_now:  # once: shift b2 so that a share of this batch runs:
                    with torch.no_grad():  # exec_share, or 1 − mean(p_l) (the soft gate's claim)
                        z = torch.logit(p, eps=1e-6).flatten()  # (B·T,) router logits + b2
                        share = self.cfg.exec_share or 1.0 - p.mean()
                        router.fc2.bias -= z.quantile(share).to(router.fc2.bias.dtype)
                    p = router(x)
                p = p.detach()  # frozen: no gradient reaches the router, so AdamW skips it
            g = self.gate(p, mode)
            x = gated(x, g, block.attn_delta(x))  # eq. (3)
            x = gated(x, g, block.ffn_delta(x))  # eq. (4)
            ps.append(p)
        self.calibrate_now = self.calibrate_now and mode != "hard_st"  # done
        return x, ps

    def forward(self, idx, targets=None, sparse=False):
        if sparse and self.training:
            raise NanorouteError("sparse=True is an inference path: call model.eval() first")
        x = self.embed(idx)  # (B, T, C)
        if sparse:  # graph break before and after this call (it patches dynamo's config)
            h, ps = sparse_trunk(self, x)
        else:
            h, ps = self.trunk(x, "hard" if not self.training else
                               "hard_st" if self.hard_train else "soft")
        logits, lm_loss = self.head(h, targets)
        depth_loss, stats = depth_stats(ps, self.cfg)  # eqs. (5)–(7) on the pass of the logits
        if not self.training:  # what inference executed, and the soft computation beside it
            hard = active(torch.cat(ps, -1)).to(ps[0].dtype).mean((0, 1))  # (L−1,) shares run
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
        """idx (B, T) -> (logits (B, V) at the last position, state): sparse, caching K/V."""
        caches = []
        h = sparse_trunk(self, self.embed(idx), caches)[0]
        pos = torch.tensor(idx.size(1), device=idx.device)
        return self.head(h[:, -1:])[0][:, -1], (caches, pos)

    @torch.no_grad()
    def step(self, tok, state):
        """tok (B, 1) at position pos (0-d) -> (logits (B, V), state); the same shapes every pos."""
        caches, pos = state
        x = self.wte(tok) + self.wpe(pos)  # (B, 1, C)
        mask = common.past_mask(pos, self.cfg.block_size, caches[0].k.dtype)  # (1, S)
        x = self.blocks[0].step(x, caches[0], pos, mask)  # stem f0
        for router, block, cache in zip(self.routers, self.blocks[1:], caches[1:]):
            x = decode_block(self, block, cache, x, pos, mask, router(x))
        return self.head(x)[0][:, -1], (caches, pos + 1)

    def actives(self, x):
        """The L−1 (B, T) masks of the tokens that run block l+1."""
        return [active(p)[..., 0] for p in self.trunk(x, "hard")[1]]

    @torch.no_grad()
    def routing_map(self, idx):
        """idx (1, T) -> (m (L, T) on CPU, rows, legend): row 0 the share of routed blocks each
        token ran, then a row per routed block (1 = ran it)."""
        was_training = self.training
        self.eval()
        actives = self.actives(self.embed(idx))
        self.train(was_training)
        m = torch.stack([a.reshape(-1) for a in actives]).float().cpu()  # (L−1, T)
        rows = ["depth: share of routed layers run"] + [f"layer {l + 1}" for l in range(len(m))]
        return torch.cat([m.mean(0, keepdim=True), m]), rows, ("halted", "active")


class EarlyExit(common.LM):
    """The early-exit baseline (§3.5, App. D): exit heads (own LayerNorm, tied embedding) after each
    block, trained on the mean CE of all exits. Eval: a token exits when its max softmax probability
    > threshold, its state (and K/V) frozen after; block l+1 is active for the tokens not exited."""

    def __init__(self, cfg):
        super().__init__(cfg)
        L = cfg.n_layer
        self.blocks = nn.ModuleList([common.Block(cfg) for _ in range(L)])
        self.exit_ln = nn.ModuleList(nn.LayerNorm(cfg.n_embd, bias=cfg.bias) for _ in range(L - 1))
        self.threshold = cfg.threshold
        self.init_weights()

    def train_flops_per_token(self, T, stats=None):
        """Training runs every block and its L exit heads."""
        return float(flops_per_token(self.cfg, T, 1.0, "exit"))

    def exit_norm(self, l):
        return self.exit_ln[l] if l < self.cfg.n_layer - 1 else self.ln_f

    def forward(self, idx, targets=None, sparse=False):
        if sparse and self.training:
            raise NanorouteError("sparse=True is an inference path: call model.eval() first")
        x = self.embed(idx)  # (B, T, C)
        if self.training:
            exits, stats = [], {}
            for l, block in enumerate(self.blocks):
                x = block(x)
                exits.append(self.lm_head(self.exit_norm(l)(x)))  # (B, T, V) exit l
        else:
            logits, actives = self.exit_infer(x)
            exits, hard = [logits], torch.stack([a.to(x.dtype).mean() for a in actives])  # (L−1,)
            stats = hard_stats(self.cfg, hard, x.size(1))
            stats.update(alpha=stats["alpha_hard"], tlops_saved=stats["tlops_saved_hard"])
        if targets is None:
            return exits[-1], None, stats
        ces = [F.cross_entropy(z.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
               for z in exits]
        loss = torch.stack(ces).mean()  # training: the mean CE of the L exits
        stats["lm_loss"] = ces[-1].detach()
        if self.training:
            stats["exit_loss"] = loss.detach()
        return exits[-1], loss, stats

    def exit_infer(self, x):
        """-> each token's exit logits (B, T, V), and the L−1 (B, T) masks of the tokens that run
        block l+1."""
        done = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)  # (B, T) exited
        actives, out = [], None
        for l, block in enumerate(self.blocks):
            x = torch.where(done[..., None], x, block(x))
            logits = self.lm_head(self.exit_norm(l)(x))  # (B, T, V)
            out = logits if out is None else torch.where(done[..., None], out, logits)
            if l < self.cfg.n_layer - 1:
                conf = F.softmax(logits.float(), dim=-1).amax(-1)  # (B, T) max softmax prob
                done = done | (conf > self.threshold)  # an exited token never comes back
                actives.append(~done)
        return out, actives

    @torch.no_grad()
    def prefill(self, idx):
        """No KV cache (exited tokens' K/V come from frozen states): the state is the window."""
        return self(idx)[0][:, -1], (idx,)

    @torch.no_grad()
    def step(self, tok, state):
        idx = torch.cat([state[0], tok], dim=1)
        return self(idx)[0][:, -1], (idx,)

    def actives(self, x):
        return self.exit_infer(x)[1]

    routing_map = Model.routing_map


# Stats: eqs. (5)–(7), and what the hard decisions ran

def depth_stats(ps, cfg):
    """ps: the L−1 router outputs (B, T, 1) -> (L_depth of eq. 5, stats: active_r{l}, α, Δ)."""
    active_l = (1.0 - torch.cat(ps, -1)).mean((0, 1))  # (L−1,) mean(1 − p_l)
    alpha = active_l.mean()  # eq. (6)
    depth_loss = cfg.lam * alpha  # eq. (5): the same mean, times λ
    stats = {f"active_r{l}": a for l, a in enumerate(active_l.detach())}
    stats.update(alpha=alpha.detach(), tlops_saved=common.tlops_saving(alpha.detach(), cfg.n_layer),
                 depth_loss=depth_loss.detach())
    return depth_loss, stats


def hard_stats(cfg, hard, T):
    """hard (L−1,): the share of tokens that ran each block l+1 -> common's stats (skip_l{l+1},
    skipped, flops_saved_hard) and TSA's own (hard_r{l}, alpha_hard, tlops_saved_hard)."""
    a = hard.mean()
    mode = "exit" if cfg.variant == "early_exit" else "query" if cfg.skip_queries else "ffn"
    flops = flops_per_token(cfg, T, a, mode) / common.dense_flops_per_token(cfg, T)
    stats = {f"hard_r{l}": h for l, h in enumerate(hard)}
    stats.update({f"skip_l{l + 1}": s for l, s in enumerate(1.0 - hard)})
    stats.update(alpha_hard=a, tlops_saved_hard=common.tlops_saving(a, cfg.n_layer),
                 skipped=1.0 - a, flops_saved_hard=1.0 - flops)
    return stats


# Sparse inference (§3.6)

# compiled: nonzero's data-dependent size traced as a symbol, one graph that never recompiles
@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def sparse_trunk(model, x, caches=None):
    """model.trunk(x, "hard") with the work of halted tokens skipped. caches (a list, prefill):
    every block's K/V goes in it. -> (final state, the L−1 p_l)."""
    if caches is None:
        x = model.blocks[0](x)  # stem f0
    else:  # ... also storing its K/V (prefill)
        x, cache = model.blocks[0].prefill(x, model.cfg.block_size)
        caches.append(cache)
    ps = []
    for router, block in zip(model.routers, model.blocks[1:]):
        ps.append(router(x))  # (B, T, 1) p_l
        x = sparse_block(model, block, x, ps[-1], caches)
    return x, ps


def sparse_block(model, block, x, p, caches):
    """Block l+1 run by its N active tokens: their rows are gathered, run through out-projection
    and FFN, and written back."""
    B, T, C = x.shape
    attn, dense_attention = block.attn, not model.cfg.skip_queries and caches is None
    if not dense_attention:  # K/V of every token (later ones attend to it)
        q, k, v = attn.qkv(block.ln_1(x))  # 3 × (B, nh, T, hs)
        if caches is not None:
            caches.append(common.KVCache(B, model.cfg.block_size, k, v))
    idx = active(p).view(-1).nonzero().squeeze(1)  # (N,) the tokens that run block l+1
    g = model.gate(p, "hard").view(B * T, 1)[idx]  # (N, 1)
    xa = x.view(B * T, C)[idx]  # (N, C) the active tokens' state
    if dense_attention:  # the paper's sparse-TSA: its residual gated by the same mask
        xa = gated(xa, g, block.attn_delta(x).view(B * T, C)[idx])
    else:
        # every query slot attends, then the halted ones are dropped: SDPA keeps its shapes
        y = attn.attend(q, k, v).view(B * T, C)[idx]  # (N, C)
        xa = gated(xa, g, attn.c_proj(y))  # eq. (3)
    xa = gated(xa, g, block.ffn_delta(xa))  # eq. (4), the FFN on active tokens only
    return x.view(B * T, C).index_copy(0, idx, xa).view(B, T, C)


# Cached decoding (common.LM.generate), the eval forward's decisions

def decode_block(model, block, cache, x, pos, mask, p):
    """A routed block of a decode step, x (B, 1, C), p (B, 1, 1): every row writes its K/V at pos;
    the rest runs unless every row halts (§3.6), a halted row keeping its state (hard gate 0)."""
    attn = block.attn
    q, k, v = attn.qkv(block.ln_1(x))  # 3 × (B, nh, 1, hs)
    k, v = cache.append(pos, k, v)  # (B, nh, S, hs)
    g = model.gate(p, "hard")  # (B, 1, 1)

    def run(x):
        x = gated(x, g, attn.c_proj(attn.attend(q, k, v, attn_mask=mask)))  # eq. (3)
        return gated(x, g, block.ffn_delta(x))  # eq. (4)

    # skipped: a copy, as a branch of torch.cond may not return its input
    return common.cond(active(p).any(), run, lambda x: x.clone(), (x,))


# Accounting: forward FLOPs per token

def flops_router(d):
    h = max(d // 4, 16)
    return 2 * (d * h + h)


def flops_per_token(cfg, T, alpha=1.0, mode="dense"):
    """mode: dense (the plain GPT), soft (all blocks + routers), ffn (sparse-TSA: halted tokens skip
    the FFN), query (also attention, c_proj), exit (early exit: also Q/K/V). α: float or tensor."""
    d, L = cfg.n_embd, cfg.n_layer
    if mode == "dense":
        return common.dense_flops_per_token(cfg, T)
    q = common.flops_qkv(d) / 3
    kv = 2 * q  # K and V of every token, halted or not
    per_query = q + common.flops_attn_out(d) + common.flops_attn_scores(d, common.mean_context(T))
    ffn = common.flops_ffn(d, 4 * d)
    head = common.flops_lm_head(d, cfg.vocab_size)
    routed = {"soft": kv + per_query + ffn, "ffn": kv + per_query + alpha * ffn,
              "query": kv + q + alpha * (per_query - q + ffn),  # every Q: one Q/K/V matmul
              "exit": kv + alpha * (per_query + ffn)}[mode]
    # per routed block: a router, or (exit) the exit head of the running tokens
    decide = head * (1 + (L - 2) * alpha) / (L - 1) if mode == "exit" else flops_router(d)
    return kv + per_query + ffn + (L - 1) * (routed + decide) + head


# CLI: early-exit threshold sweep

@torch.no_grad()
def exit_sweep(model, data, meta, cfg, device, thresholds=None):
    """α and val loss of the early-exit model at each threshold (App. D)."""
    thresholds = thresholds or [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0]
    rows = []
    for t in thresholds:
        model.threshold = t
        ev = common.estimate_loss(model, data, meta, cfg, device, "val")
        rows.append({"threshold": t, "alpha": ev["alpha"], "tlops_saved": ev["tlops_saved"],
                     "val_loss": ev["loss"]})
    model.threshold = cfg.threshold
    return rows


def load_run(run_dir):
    """The model (eval mode) and Config of a TSA run; another model's run is refused."""
    ckpt = common.load_checkpoint(os.path.join(run_dir, "ckpt.pt"))
    if ckpt["config"].get("model") != "tsa":
        raise NanorouteError(f"{run_dir} holds a {ckpt['config'].get('model')!r} run, not tsa")
    cfg = Config(**ckpt["config"])
    model = build(cfg)
    model.load_state_dict(ckpt["model"])
    return model.eval(), cfg


def main(argv):
    """python tsa.py exit_sweep RUN_DIR: α, val loss per threshold of an early-exit run (App. D)"""
    if "-h" in argv or "--help" in argv:
        return print("usage: " + main.__doc__)
    if len(argv) != 2 or argv[0] != "exit_sweep":
        raise NanorouteError(f"usage: python tsa.py exit_sweep RUN_DIR (see --help), got {argv}")
    run_dir = argv[1]
    model, cfg = load_run(run_dir)
    if cfg.variant != "early_exit":
        raise NanorouteError(f"exit_sweep needs an early-exit run; {run_dir} is {cfg.variant}")
    meta = common.load_meta(cfg.dataset, cfg.data_dir)
    val = common.load_split(cfg.dataset, "val", cfg.data_dir)
    for r in exit_sweep(model, val, meta, cfg, torch.device("cpu")):
        print(" ".join(f"{k}={v:.4f}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    common.cli(main)
