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

Inference (§3.6): a token with p_l > 0.5 halts at block l+1. eval() applies the hard decisions densely;
`sparse=True` really skips the work: halted tokens skip the FFN (gather/scatter), and, beyond the paper,
also their query / attention-output / output-projection work (their K/V are still computed, because
active tokens attend to them). Active tokens use the full residual (`hard_variant=01`, the paper) or keep
the soft scale 1 − p (`scaled`). Optional last phase: train with straight-through hard gates
(`hard_ft_iters`) so that hard inference matches what was trained.

Early-exit baseline (§3.5, App. D, `--variant=early_exit`): the same backbone with an exit head after each
block (own LayerNorm + the tied embedding), trained on the mean CE of all exits; at inference a token exits
when its max softmax probability exceeds `threshold` and its hidden state is frozen afterwards.
"""
import html
import math
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
    skip_queries: bool = True       # sparse path: halted tokens also skip Q / attention / out-proj
    eval_soft: bool = True          # eval also runs the soft pass (reports soft_loss next to the hard loss)
    hard_ft_iters: int = 0          # last iterations trained with straight-through hard gates
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
        if self.lam < 0:
            raise NanorouteError(f"lam (λ) must be >= 0, got {self.lam}")
        if not 0.0 <= self.threshold <= 1.0:
            raise NanorouteError(f"threshold must be in [0, 1], got {self.threshold}")
        if not 0 <= self.hard_ft_iters <= self.max_iters:
            raise NanorouteError(f"hard_ft_iters must be in [0, max_iters={self.max_iters}], got {self.hard_ft_iters}")


# The paper's Shakespeare setup (§3.2): d=256, L=6, H=8, d_ff=1024, ctx 128, batch 64, 5000 steps, AdamW
# β=(0.9, 0.95), wd 0.1, cosine. The paper gives no LM learning rate; 1e-3 is our choice.
PRESETS = {"paper": dict(n_layer=6, n_head=8, n_embd=256, block_size=128, batch_size=64, max_iters=5000,
                         learning_rate=1e-3, min_lr=1e-4, beta2=0.95, weight_decay=0.1, dropout=0.0)}


class Router(nn.Module):
    """Eq. (2): p = σ(W2 ReLU(W1 h + b1) + b2); d²/4 + d/2 + 1 parameters at d divisible by 4."""

    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, max(d // 4, 16))
        self.fc2 = nn.Linear(max(d // 4, 16), 1)

    def forward(self, h):
        return torch.sigmoid(self.fc2(F.relu(self.fc1(h))))  # (B, T, 1): halting probability p_l


class Model(common.LM):
    def __init__(self, cfg):
        super().__init__(cfg)
        L = cfg.n_layer
        self.blocks = nn.ModuleList([common.Block(cfg) for _ in range(L)])  # names as common.Model (--init_from)
        if cfg.variant == "tsa":
            self.routers = nn.ModuleList([Router(cfg.n_embd) for _ in range(L - 1)])  # r_0..r_{L-2}
        else:  # early exit: exit heads after blocks 0..L-2 (the last exit is the model's own ln_f + head)
            self.exit_ln = nn.ModuleList([nn.LayerNorm(cfg.n_embd, bias=cfg.bias) for _ in range(L - 1)])
        self.hard_train = False  # set by on_step during the last hard_ft_iters iterations
        self.threshold = cfg.threshold
        self.init_weights()
        for r in getattr(self, "routers", []):
            nn.init.constant_(r.fc2.bias, cfg.router_bias)

    def on_step(self, it):
        """train.py calls this before every step: switch to straight-through hard gates at the end."""
        self.hard_train = self.cfg.hard_ft_iters > 0 and it >= self.cfg.max_iters - self.cfg.hard_ft_iters

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
            g = self.gate(p, mode)
            x = x + g * block.attn_delta(x)  # eq. (3)
            x = x + g * block.ffn_delta(x)   # eq. (4)
            ps.append(p)
        return x, ps

    def sparse_trunk(self, x):
        """Same numbers as trunk(x, 'hard') but halted tokens skip work. Batched gather/scatter; the only
        host syncs are the data-dependent sizes (how many tokens are active), one or two per block."""
        B, T, C = x.shape
        x = self.blocks[0](x)
        ps = []
        for router, block in zip(self.routers, self.blocks[1:]):
            p = router(x)                           # (B, T, 1)
            g = self.gate(p, "hard")                # (B, T, 1), 0 for halted tokens
            active = (p <= 0.5).squeeze(-1)         # (B, T)
            idx = active.flatten().nonzero().squeeze(1)  # (N,) active tokens over the whole batch (host sync)
            gi = g.reshape(B * T, 1).index_select(0, idx)  # (N, 1) their gates
            if self.cfg.skip_queries:
                x = self.sparse_attention(block, x, active, idx, gi)
            else:  # the paper's sparse-TSA: dense attention, gated by the same binary mask
                x = x + g * block.attn_delta(x)
            if idx.numel():
                xf = x.reshape(B * T, C)
                delta = block.ffn_delta(xf.index_select(0, idx))  # (N, C) FFN on active tokens only
                x = xf.index_add(0, idx, delta * gi).view(B, T, C)
            ps.append(p)
        return x, ps

    def sparse_attention(self, block, x, active, idx, gi):
        """K/V for every token (active queries attend to halted tokens too); Q and c_proj only for the N
        active tokens (flattened over the batch); attention on them packed to the front of each row,
        (B, Tq) with Tq = the most active tokens in any row, with an explicit causal mask by position."""
        B, T, C = x.shape
        attn = block.attn
        h = block.ln_1(x)                                                    # (B, T, C)
        W, b = attn.c_attn.weight, attn.c_attn.bias
        k, v = F.linear(h, W[C:], None if b is None else b[C:]).chunk(2, dim=-1)  # 2 × (B, T, C)
        n = active.sum(1)                                                    # (B,) active per row
        Tq = int(n.max())  # host sync: the packed width depends on the routing
        if Tq == 0:
            return x
        pos = torch.argsort((~active).to(torch.int8), dim=1, stable=True)[:, :Tq]  # (B, Tq) active first, in order
        valid = torch.arange(Tq, device=x.device)[None, :] < n[:, None]      # (B, Tq) real vs padding
        q = F.linear(h.reshape(B * T, C).index_select(0, idx), W[:C], None if b is None else b[:C])  # (N, C)
        qp = q.new_zeros(B, Tq, C)
        qp[valid] = q  # row-major order of valid slots == order of idx (stable sort keeps positions)
        mask = torch.arange(T, device=x.device)[None, None, :] <= pos[:, :, None]  # (B, Tq, T) causal by position
        y = attn.attend(attn.split_heads(qp), attn.split_heads(k), attn.split_heads(v), mask[:, None])  # (B, Tq, C)
        delta = attn.c_proj(y[valid])                                        # (N, C)
        return x.reshape(B * T, C).index_add(0, idx, delta * gi).view(B, T, C)

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
        stats = {}
        if not self.training:  # what inference executed: the hard active fraction per router
            hard = [(p <= 0.5).to(p.dtype).mean() for p in ps]
            stats.update({f"hard_r{l}": a.detach() for l, a in enumerate(hard)})
            stats["alpha_hard"] = torch.stack(hard).mean()
            stats["tlops_saved_hard"] = common.tlops_saving(stats["alpha_hard"], self.cfg.n_layer)
            if self.cfg.eval_soft and targets is not None and not sparse:  # soft quality, soft α
                hs, ps = self.trunk(x, "soft")
                stats["soft_loss"] = self.head(hs, targets)[1]
        active = torch.stack([(1.0 - p).mean() for p in ps])  # (L−1,) mean(1 − p_l)
        alpha = active.mean()                                # eq. (6)
        depth_loss = self.cfg.lam * alpha                    # eq. (5): the same mean, times λ
        stats.update({f"active_r{l}": a.detach() for l, a in enumerate(active)})
        stats.update(alpha=alpha.detach(), tlops_saved=common.tlops_saving(alpha.detach(), self.cfg.n_layer),
                     depth_loss=depth_loss.detach())
        if targets is None:
            return logits, None, stats
        stats["lm_loss"] = lm_loss.detach()
        return logits, lm_loss + depth_loss, stats

    # ------------------------------------------------------------------------------------------------
    # early-exit baseline (§3.5)

    def exit_norm(self, l):
        return self.exit_ln[l] if l < self.cfg.n_layer - 1 else self.ln_f

    def exit_forward(self, x, targets):
        """Train: mean CE over all L exits. Eval: confidence exit with frozen hidden states; the stats
        count block l+1 as active for the tokens that have not exited after block l (same α as TSA)."""
        L, stats = self.cfg.n_layer, {}
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
        done = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)  # (B, T) exited already
        active, out = [], None
        for l, block in enumerate(self.blocks):
            x = torch.where(done[..., None], x, block(x))  # exited tokens keep (freeze) their state
            logits = self.lm_head(self.exit_norm(l)(x))     # (B, T, V)
            out = logits if out is None else torch.where(done[..., None], out, logits)
            if l < L - 1:
                conf = F.softmax(logits.float(), dim=-1).amax(-1)  # (B, T) max softmax probability
                done = done | (conf > self.threshold)
                active.append((~done).to(x.dtype).mean())
        alpha = torch.stack(active).mean()
        stats.update({f"hard_r{l}": a for l, a in enumerate(active)})
        stats.update(alpha=alpha, alpha_hard=alpha, tlops_saved=common.tlops_saving(alpha, L),
                     tlops_saved_hard=common.tlops_saving(alpha, L))
        if targets is None:
            return out, None, stats
        lm_loss = F.cross_entropy(out.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        stats["lm_loss"] = lm_loss.detach()
        return out, lm_loss, stats


# ----------------------------------------------------------------------------------------------------
# Accounting: forward FLOPs per token from common's per-component counts

def flops_router(d):
    h = max(d // 4, 16)
    return 2 * (d * h + h)


def flops_per_token(cfg, T, alpha=1.0, mode="dense"):
    """mode: dense (the plain GPT), soft (every block runs + routers), ffn (paper's sparse-TSA: halted
    tokens skip the FFN), query (ours: halted tokens also skip Q, attention and c_proj). α = active fraction."""
    d, mean_ctx = cfg.n_embd, common.mean_context(T)
    attn = common.flops_qkv(d) + common.flops_attn_out(d) + common.flops_attn_scores(d, mean_ctx)
    ffn = common.flops_ffn(d, 4 * d)
    if mode == "dense":
        return common.dense_flops_per_token(cfg, T)
    routed = {"soft": attn + ffn, "ffn": attn + alpha * ffn,
              "query": common.flops_qkv(d) * 2 / 3 + alpha * (attn - common.flops_qkv(d) * 2 / 3 + ffn)}[mode]
    L = cfg.n_layer
    return attn + ffn + (L - 1) * (routed + flops_router(d)) + common.flops_lm_head(d, cfg.vocab_size)


# ----------------------------------------------------------------------------------------------------
# Tools: early-exit threshold sweep, routing picture (Fig. 4)

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


@torch.no_grad()
def routing_picture(model, idx, meta, out_dir=None):
    """Per-token active fraction 1 − p_l of each router (soft pass) over one passage: returns ANSI text
    (green = active, red = halted) and writes a self-contained routing.html into out_dir."""
    model.eval()
    x, ps = model.trunk(model.embed(idx[None]), "soft")
    chars = [common.decode(meta, [i]) for i in idx.tolist()]
    rgb = lambda a: (int(255 * (1 - a)), int(200 * a), 60)
    lines, rows = [], []
    for l, p in enumerate(ps):
        a = (1 - p[0, :, 0]).tolist()
        txt = "".join(f"\x1b[48;2;{r};{g};{b}m{c if c != chr(10) else '⏎'}" for c, (r, g, b) in zip(chars, map(rgb, a)))
        lines.append(f"r{l} (mean {sum(a) / len(a):.3f}) {txt}\x1b[0m")
        spans = "".join(f'<span style="background:rgb{rgb(v)}" title="{v:.3f}">'
                        f'{html.escape(c) if c != chr(10) else "⏎"}</span>' for c, v in zip(chars, a))
        rows.append(f"<h3>router r{l}: mean active {sum(a) / len(a):.3f}</h3><pre>{spans}</pre>")
    path = None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "routing.html")
        with open(path, "w") as f:
            f.write("<!doctype html><meta charset=utf-8><title>TSA routing</title><body style='font-family:mono"
                    "space'><p>Per-token active fraction 1 − p<sub>l</sub> (green: active, red: halted)</p>"
                    + "".join(rows) + "</body>")
    return "\n".join(lines), path


def load_run(run_dir):
    ckpt = common.load_checkpoint(os.path.join(run_dir, "ckpt.pt"))
    cfg = Config(**ckpt["config"])
    model = Model(cfg)
    model.load_state_dict(ckpt["model"])
    return model.eval(), cfg


def main(argv):
    """python tsa.py picture RUN_DIR | python tsa.py exit_sweep RUN_DIR"""
    if len(argv) != 2 or argv[0] not in ("picture", "exit_sweep"):
        raise NanorouteError("usage: python tsa.py {picture,exit_sweep} RUN_DIR")
    model, cfg = load_run(argv[1])
    meta = common.load_meta(cfg.dataset, cfg.data_dir)
    val = common.load_split(cfg.dataset, "val", cfg.data_dir)
    if argv[0] == "picture":
        if cfg.variant != "tsa":
            raise NanorouteError("picture needs a TSA run (variant=tsa)")
        idx = torch.tensor(val[:min(cfg.block_size, 128)].astype("int64"))
        text, path = routing_picture(model, idx, meta, argv[1])
        print(text + f"\nwrote {path}")
    else:
        if cfg.variant != "early_exit":
            raise NanorouteError("exit_sweep needs an early-exit run (variant=early_exit)")
        for r in exit_sweep(model, val, meta, cfg, torch.device("cpu")):
            print(" ".join(f"{k}={v:.4f}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except NanorouteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
