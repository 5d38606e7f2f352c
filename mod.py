"""
Mixture-of-Depths: Dynamically allocating compute in transformer-based language models.
D. Raposo, S. Ritter, B. Richards, T. Lillicrap, P. C. Humphreys, A. Santoro (2024),
arXiv:2404.02258.

Every other block (`every=2`) is a routed block. A linear router gives each token a scalar weight;
in training the k tokens of each sequence with the largest weights run the block (attention and
MLP, the selected tokens attending only to one another, causally), the rest pass by on the residual
stream. k is fixed, so training has static shapes and does fewer FLOPs per step.

  (1) r_i^l = w_θ^T x_i^l                               router weight of token i in block l
  (2) k = ⌈C·T⌉,  P_β(R^l) the β-percentile of R^l = {r_i^l}, β = 1 − C    capacity C
  (3) x_i^{l+1} = r̂_i^l f_i(X̃^l) + x_i^l  if r_i^l > P_β(R^l) (i among the top k), else x_i^l
      X̃^l: the selected tokens in positional order; f: the block (attention among X̃, then MLP)
  (4) causal inference, method a: L_aux = BCE(r_i, 1[i ∈ top-k]); run the block if σ(r_i) > 0.5
  (5) causal inference, method b: a small MLP p(sg(x_i)) trained by BCE(p_i, 1[i ∈ top-k]), no
      gradient into the LM; run the block where σ(p_i) > 0.5

Choices where the paper leaves one (each a Config field where it is cheap to change):
  - r̂ = σ(r) (`router_weight=sigmoid`): a gate in (0, 1); σ(r) > 0.5 is method a's threshold, so
    the product and the decision read one quantity; `raw` multiplies by r as (3) is printed (a
    raw r starts near 0, so the routed blocks start switched off and can change sign).
  - ties at the k-th weight: the lower position wins (a stable sort), so exactly k tokens run and
    the choice does not depend on the sort kernel.
  - the router reads the residual stream x_i itself, not LN1(x_i), as (1) is written; it and the
    predictor run in fp32 (common.py's numerics policy: decisions do not depend on the dtype).
  - the predictor (5): d → max(d/4, 16) → 1 with SiLU; the paper says "a small auxiliary MLP".
  - the BCE of (4) and (5) is weighted by `aux_weight` (the paper gives no weight).
Deviations, one line each:
  - routed blocks are blocks 1, 3, 5, … (every=2); the paper says "every other block".
  - nanoGPT's GELU MLP of width 4d, learned positions, LayerNorm (the paper: no details given).
  - the decode step computes every token's Q/K/V (fixed shapes); a routed-around one's are not
    written to the cache and the rest of the block is skipped.

Paths, each with the same decisions: training gathers exactly k tokens per sequence (static
shape); `eval()` takes causal decisions (4)/(5) and computes them densely under a boolean mask (the
reference); `sparse=True` packs each row's routed tokens and skips the others' block; cached
decoding keeps K/V of a routed block's routed tokens only (no later token attends to the others).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import NanorouteError

PREDICTORS = ("aux_loss", "mlp")
WEIGHTS = ("sigmoid", "raw")


@dataclass
class Config(common.Config):
    capacity: float = 0.125  # C of eq. (2): share of a sequence's tokens a routed block runs
    every: int = 2  # route every n-th block (2: every other, the paper's best; 1: every block)
    predictor: str = "aux_loss"  # causal inference: aux_loss (eq. 4, BCE on r) | mlp (eq. 5)
    aux_weight: float = 0.1  # weight of the BCE of eq. (4) or (5) in the loss
    router_weight: str = "sigmoid"  # r̂ of eq. (3): sigmoid (σ(r)) | raw (r, as printed)

    def __post_init__(self):
        super().__post_init__()
        rules = [(0.0 < self.capacity <= 1.0, "capacity", "in (0, 1]"),
                 (1 <= self.every <= self.n_layer, "every", f"in 1..n_layer={self.n_layer}"),
                 (self.predictor in PREDICTORS, "predictor", f"one of {', '.join(PREDICTORS)}"),
                 (self.router_weight in WEIGHTS, "router_weight", f"one of {', '.join(WEIGHTS)}"),
                 (self.aux_weight >= 0.0, "aux_weight", ">= 0")]
        for ok, name, rule in rules:
            if not ok:  # a comparison with nan is False: nan is refused too
                raise NanorouteError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def pattern(self):
        """'T' (dense) or 'R' (routed) per block: blocks every−1, 2·every−1, … are routed."""
        return "".join("R" if i % self.every == self.every - 1 else "T"
                       for i in range(self.n_layer))


# paper: its routing (C = 12.5%, every other block) at GPT-2 small's trunk (its sizes are not all
# given). classroom: common.CLASSROOM with blocks 1 and 3 routed, 8 of 64 tokens each.
PRESETS = {"paper": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, capacity=0.125,
                         every=2, learning_rate=6e-4, min_lr=6e-5, weight_decay=0.1, beta2=0.95,
                         warmup_iters=200),
           "classroom": dict(common.CLASSROOM, capacity=0.125, every=2),
           # common.GPU (one GPU, ~an hour of a dense GPT's FLOPs): the paper's routing
           "gpu": dict(common.GPU, capacity=0.125, every=2)}


def capacity_k(C, T):
    """k = ⌈C·T⌉ (eq. 2), in 1..T; C·T is rounded first so that 0.07·100 gives 7, not 8."""
    return min(T, max(1, math.ceil(round(C * T, 6))))


def top_k(r, k):
    """r (B, T) -> the k selected positions (B, k), ascending, and membership (B, T) bool. A stable
    sort: among equal weights the lower position wins."""
    order = torch.sort(r, dim=1, descending=True, stable=True).indices[:, :k]  # (B, k)
    idx = order.sort(dim=1).values  # positional order: X̃ keeps the sequence's order
    member = torch.zeros_like(r, dtype=torch.bool).scatter(1, idx, True)
    return idx, member


# Router and predictor, eqs. (1), (4), (5)

class Predictor(nn.Module):
    """Eq. (5): a small MLP on the router's input through a stop-gradient -> a logit (B, T, 1)."""

    def __init__(self, cfg):
        super().__init__()
        h = max(cfg.n_embd // 4, 16)
        self.fc1 = nn.Linear(cfg.n_embd, h, bias=cfg.bias)
        self.fc2 = nn.Linear(h, 1, bias=cfg.bias)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(x.detach())))


class MoDBlock(common.Block):
    """A routed block: common.Block's parameters (a dense checkpoint loads) plus a router w_θ
    (and the predictor of eq. 5)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.router = nn.Linear(cfg.n_embd, 1, bias=cfg.bias)  # w_θ of eq. (1)
        self.predictor = Predictor(cfg) if cfg.predictor == "mlp" else None
        self.capacity, self.raw = cfg.capacity, cfg.router_weight == "raw"

    def route(self, x):
        """x (B, T, C) -> r (B, T) router weights (eq. 1), z (B, T) the causal logit (r for
        method a, the predictor's for b); in the residual stream's dtype (fp32) under autocast."""
        with torch.autocast(x.device.type, enabled=False):
            r = self.router(x)[..., 0]
            z = r if self.predictor is None else self.predictor(x)[..., 0]
        return r, z

    def weight(self, r):
        """r̂ of eq. (3): what multiplies f; the LM's gradient reaches the router through it."""
        return r if self.raw else torch.sigmoid(r)

    def f(self, x, mask=None):
        """f of eq. (3): the block's residual update (B, n, C), attention among x's tokens (causal,
        or under a boolean mask), then the MLP on x plus the attention update; and its K, V."""
        q, k, v = self.attn.qkv(self.ln_1(x))  # 3 × (B, nh, n, hs)
        a = self.attn.c_proj(self.attn.attend(q, k, v, attn_mask=mask))  # (B, n, C)
        a = F.dropout(a, self.attn.dropout, self.training)
        return a + self.ffn_delta(x + a), (k, v)

    def run(self, x, idx, g, keep=None):
        """Eq. (3) on the tokens idx (B, n) of each row (ascending positions): gathered, the block
        run on them alone, x + r̂·f written back; keep (B, n) bool: the rows that take it (packing
        pads with others). -> x, and K/V (B, nh, n, hs) of the gathered tokens."""
        B, n = idx.shape
        gi = idx[..., None].expand(B, n, x.size(-1))
        xs = torch.gather(x, 1, gi)  # (B, n, C) X̃
        f, kv = self.f(xs)
        y = xs + torch.gather(g, 1, idx)[..., None] * f  # (B, n, C)
        if keep is not None:
            y = torch.where(keep[..., None], y, xs)
        return x.scatter(1, gi, y), kv

    def forward(self, x, mode):
        """x (B, T, C), mode topk (training, eq. 3), hard (causal decisions, dense under a mask),
        sparse (causal decisions, routed tokens packed) -> (x, r, z, top-k membership, ran)."""
        r, z = self.route(x)  # (B, T) each
        g = self.weight(r)
        idx, member = top_k(r.detach(), capacity_k(self.capacity, x.size(1)))
        if mode == "topk":
            return self.run(x, idx, g)[0], r, z, member, member
        delta = z > 0  # eqs. (4)-(5): σ(z) > 0.5
        if mode == "hard":
            T = x.size(1)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            eye = torch.eye(T, dtype=torch.bool, device=x.device)
            # routed tokens see earlier routed ones; "| eye": no row is empty (its output unused)
            mask = (delta[:, None, :, None] & delta[:, None, None, :] & causal) | eye
            x = torch.where(delta[..., None], x + g[..., None] * self.f(x, mask)[0], x)
        else:
            x = self.run_packed(x, g, delta)[0]
        return x, r, z, member, delta

    def run_packed(self, x, g, delta, min_len=0):
        """Each row's routed tokens packed to the front of a (B, R) batch (R: the most any row
        routes, at least min_len) and run; a row's packed tokens after its own n_b are others,
        left unchanged. -> x, and K/V (B, nh, R, hs) of the packed tokens (None if R = 0)."""
        R = max(int(delta.sum(1).max()), min_len)  # read on the host
        if R == 0:
            return x, None
        # stable: routed tokens first, in their order, so plain causal attention is eq. (3)'s
        idx = torch.sort(delta.to(torch.uint8), dim=1, descending=True, stable=True).indices
        idx = idx[:, :R]  # (B, R)
        return self.run(x, idx, g, torch.gather(delta, 1, idx))

    def step(self, x, cache):
        """One token x (B, 1, C) against this block's RoutedKVCache: a routed token attends to the
        routed tokens before it and stays in the cache; a routed-around one passes unchanged."""
        r, z = self.route(x)  # (B, 1)
        delta, g = z > 0, self.weight(r)
        q, k, v = self.attn.qkv(self.ln_1(x))  # 3 × (B, nh, 1, hs)
        K, V, mask = cache.append(k, v, delta[:, 0])

        def routed(x, K, V, mask):  # eq. (3) for the routed rows; the others keep x
            a = self.attn.c_proj(self.attn.attend(q, K, V, attn_mask=mask))  # (B, 1, C)
            return torch.where(delta[..., None], x + g[..., None] * (a + self.ffn_delta(x + a)), x)

        def skipped(x, K, V, mask):  # a copy: a branch of torch.cond may not return its input
            return x.clone()

        return common.cond(delta.any(), routed, skipped, (x, K, V, mask))


# Model

class Model(common.LM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.pattern = cfg.pattern
        self.routed = [i for i, c in enumerate(self.pattern) if c == "R"]
        self.blocks = nn.ModuleList(MoDBlock(cfg) if c == "R" else common.Block(cfg)
                                    for c in self.pattern)
        self.init_weights()

    def train_flops_per_token(self, T, stats=None):
        """Training runs a routed block on its k = ⌈C·T⌉ selected tokens only (eq. 3), and every
        token's router (and predictor)."""
        return float(flops_per_token(self.cfg, T, capacity_k(self.cfg.capacity, T) / T))

    def trunk(self, x, mode):
        """All blocks; returns x and [(r, z, top-k membership, ran)] per routed block."""
        routes = []
        for block in self.blocks:
            if isinstance(block, MoDBlock):
                x, *route = block(x, mode)
                routes.append(route)
            else:
                x = block(x)
        return x, routes

    def forward(self, idx, targets=None, sparse=False):
        if sparse and self.training:
            raise NanorouteError("sparse=True is an inference path: call model.eval() first")
        x0 = self.embed(idx)  # (B, T, C)
        x, routes = self.trunk(x0, "topk" if self.training else "sparse" if sparse else "hard")
        logits, lm_loss = self.head(x, targets)
        aux, stats = route_stats(self.cfg, routes, self.routed, idx.size(1))
        if targets is None:
            return logits, None, stats
        stats["lm_loss"] = lm_loss.detach()
        if not self.training and not sparse:  # the training computation (top-k) beside it
            stats["soft_loss"] = self.head(self.trunk(x0, "topk")[0], targets)[1].detach()
        return logits, lm_loss + self.cfg.aux_weight * aux, stats

    @torch.no_grad()
    def routing_map(self, idx):
        """idx (1, T) -> (m (L_R, T): 1 = the token ran that block (causal decisions), rows,
        legend)."""
        was_training = self.training
        self.eval()
        _, routes = self.trunk(self.embed(idx), "sparse")
        self.train(was_training)
        m = torch.stack([ran[0].float() for *_, ran in routes]).cpu()
        return m, [f"layer {i}" for i in self.routed], ("routed around", "block")

    # Cached decoding (common.LM.generate drives it): state = (a cache per block, position (0-d));
    # caches are preallocated to block_size and written in place, so a step's shapes are fixed.

    @torch.no_grad()
    def prefill(self, idx):
        """idx (B, T) -> logits (B, V) at the last position, and the decode state."""
        x, caches = self.embed(idx), []  # (B, T, C)
        for block in self.blocks:
            if isinstance(block, MoDBlock):
                r, z = block.route(x)
                delta = z > 0
                x, kv = block.run_packed(x, block.weight(r), delta, min_len=1)
                caches.append(RoutedKVCache(delta.sum(1), self.cfg.block_size, kv))
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
        mask = None
        for block, cache in zip(self.blocks, caches):
            if isinstance(block, MoDBlock):
                x = block.step(x, cache)
            else:
                if mask is None:  # (1, S): dense blocks see 0..pos
                    mask = common.past_mask(pos, S, cache.k.dtype)
                x = block.step(x, cache, pos, mask)
        return self.head(x)[0][:, -1], (caches, pos + 1)


def route_stats(cfg, routes, layers, T):
    """-> (the BCE of eq. 4 or 5, the mean over routed blocks, stats): skip_l{i} per routed block i
    (share of tokens routed around), skipped (their mean), pred_acc (causal decisions z > 0 vs
    the true top-k), aux_loss, flops_saved_hard (1 − this pass's FLOPs / the dense GPT's)."""
    aux = torch.stack([F.binary_cross_entropy_with_logits(z, member.to(z.dtype))
                       for _, z, member, _ in routes]).mean()
    runs = torch.stack([ran.float().mean() for *_, ran in routes])  # (L_R,)
    acc = torch.stack([((z > 0) == member).float().mean() for _, z, member, _ in routes])
    ratio = flops_per_token(cfg, T, runs) / common.dense_flops_per_token(cfg, T)
    stats = {f"skip_l{i}": 1 - s for i, s in zip(layers, runs)}
    stats.update(skipped=1 - runs.mean(), pred_acc=acc.mean(), aux_loss=aux.detach(),
                 flops_ratio=ratio, flops_saved_hard=1 - ratio)
    return aux, stats


# Decoding: the routed KV cache

class RoutedKVCache:
    """K/V of one routed block's routed tokens: row b holds its n[b] routed tokens in slots
    0..n[b]−1; the other slots hold zeros (a routed-around token writes nothing)."""

    def __init__(self, n, S, kv):
        """n (B,) routed tokens per row; S block_size; kv: the packed tokens' K, V (B, nh, R, hs),
        a row's first n[b] its routed ones."""
        self.n = n  # (B,) long
        k, v = kv
        B, nh, R, hs = k.shape
        self.k, self.v = k.new_zeros(B, nh, S, hs), v.new_zeros(B, nh, S, hs)  # (B, nh, S, hs)
        mine = (torch.arange(R, device=n.device) < n[:, None])[:, None, :, None]  # (B, 1, R, 1)
        self.k[:, :, :R], self.v[:, :, :R] = k * mine, v * mine
        for t in (self.n, self.k, self.v):  # written in place by a compiled step
            torch._dynamo.mark_static_address(t)

    def append(self, k, v, routed):
        """Write k, v (B, nh, 1, hs) at slot n[b] of the routed rows (routed (B,) bool) and advance
        their n[b]. Returns K, V and the mask (B, 1, 1, S) of the slots a row's token sees."""
        rows = torch.arange(k.size(0), device=k.device)
        keep = routed[:, None, None]  # (B, 1, 1)
        self.k[rows, :, self.n] = torch.where(keep, k[:, :, 0], self.k[rows, :, self.n])
        self.v[rows, :, self.n] = torch.where(keep, v[:, :, 0], self.v[rows, :, self.n])
        mask = torch.arange(self.k.size(2), device=k.device) <= self.n[:, None]  # (B, S)
        self.n += routed
        return self.k, self.v, mask[:, None, None, :]


# Accounting: forward FLOPs per token

def flops_router(d):
    return 2 * d  # r = w·x


def flops_predictor(d):
    h = max(d // 4, 16)
    return 2 * (d * h + h)


def flops_per_token(cfg, T, rho):
    """Forward FLOPs per token: dense blocks in full; a routed block at share ρ (one per routed
    block, or a float) pays its router (and predictor) for every token, and for a share ρ of them
    Q/K/V, W_O, the MLP and scores over the ~ρ·T selected tokens before them."""
    d = cfg.n_embd
    n_routed = cfg.pattern.count("R")
    rho = [rho] * n_routed if not hasattr(rho, "__len__") else rho
    block = common.flops_qkv(d) + common.flops_attn_out(d) + common.flops_ffn(d, 4 * d)
    dense = block + common.flops_attn_scores(d, common.mean_context(T))
    decide = flops_router(d) + (flops_predictor(d) if cfg.predictor == "mlp" else 0)
    routed = sum(p * (block + common.flops_attn_scores(d, common.mean_context(p * T))) + decide
                 for p in rho)
    return (cfg.pattern.count("T") * dense + routed
            + common.flops_lm_head(d, cfg.vocab_size))


def main(argv):
    """python mod.py [-h]: what this file is; it takes no commands."""
    if argv not in ([], ["-h"], ["--help"]):
        raise NanorouteError(f"mod.py takes no arguments, got {' '.join(argv)!r}")
    print("usage: python mod.py [-h]\nDefines the Mixture-of-Depths model (no commands): train it "
          "with `python train.py --model mod`, time it with `python bench.py mod`.")


if __name__ == "__main__":
    common.cli(main)
