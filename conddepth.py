"""
Conditional depth routing, from "Revisiting Auxiliary Losses for Conditional Depth Routing: An Empirical Study"
(Q. Lin, 2026, arXiv:2604.17228). In the last C ("controlled") layers of a pretrained GPT, each token's FFN
sub-layer runs the full FFN or a cheap low-rank one, chosen by a controller under an exact top-k budget.

    (1)  a = h_in + Attn(LN1(h_in))
    (2)  h_full  = a + FFN_full(LN2(a))
    (3)  h_cheap = a + FFN_cheap(LN2_cheap(a))
    (4)  h = m·h_full + (1 − m)·h_cheap,            m ∈ {0,1} per token
    (5)  FFN_cheap(x) = W_down SiLU(W_up x),         rank r ≪ d_ff, W_down = 0 at init (cheap = identity)
    (6)  p = σ(u/τ)                                  soft gate (budget/alive losses and the ST gradient only)
    (7)  k = ⌈ρT⌉                                    exact top-k of u per sequence → m_hard
    (8)  m_st = sg(m_hard − p) + p                   straight-through: forward = hard top-k, backward via p
    (9)  h = m_st·h_full + (1 − m_st)·h_cheap        training computes BOTH paths for every token
    (10) G1:  u = W2 SiLU(W1 h)                      MLP gate, hidden d/4
    (11) G3:  c = W_c sg(h)
    (12)       q_a = P([c; e_a]),  a ∈ {full, cheap}  shared predictor Linear→SiLU→Linear
    (13)       u = D(q_full, q_cheap, q_full − q_cheap)
    (14)  L_JEPA = Σ_a (1 − cos(q_a, z_a)),  z_a = sg(T(h*_a)), T fixed orthogonal d→d_s
    (15) u*_{l,t} = C̃E^cheap_{l,t} − C̃E^full_{l,t}    oracle: fork token t at layer l, every later layer full
    (16) C̃E_{l,t} = Σ_{δ<W} γ^δ CE_{l,t+δ}           (window runs forward in t; truncated at the sequence end)
    (17) L_util = Huber(u, u*)
    (18) L_rank = E_(i,j) softplus(−sign(u*_i − u*_j)(u_i − u_j))
    (19) L = L_LM + λ_JEPA L_JEPA + λ_util L_util + λ_rank L_rank + λ_b L_budget + λ_a L_alive
    (20) L_budget = 1/C Σ_l (p̄_l − ρ)²
    (21) L_alive  = 1/C Σ_l ReLU(p_min − p̄_l)

Deviations from the paper and choices where it is silent, one line each (results/conddepth.md says why):
- the gate reads the FFN sub-layer input a (eq. 1), the only state that exists before the decision
- the controller runs in fp32 under any autocast, from PyTorch's fan-in init (GPT's 0.02 gave var(u) ~ 1e-12)
- inference routes causally: full iff u > θ_l, θ_l a running average of training's top-k cut (top-k sees the future)
- the oracle forks each (l, t) from the dense prefix; all B·T forks of a layer run in one batch, W positions each
- rank pairs are (t, π(t)), π a random permutation per sequence, ties dropped; L_JEPA is averaged over the C layers
- A2 deranges the JEPA targets with one random B·T-cycle; eval never shuffles
- the paper preset's P/D widths are 64 each: they give its trainable counts (G1 828,484, G3 849,348) exactly
- only the controller and the cheap path train (§3.4); controller_only=False also trains the backbone (future work)
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import NanorouteError

# recipe -> the fields it sets (paper §3.4). Standard = G1 / G3; A1 no JEPA; A2 deranged targets; A3 no util/rank.
RECIPES = {"G1": dict(gate="G1"), "G3": dict(gate="G3"), "A1": dict(gate="G3", lam_jepa=0.0),
           "A2": dict(gate="G3", shuffle_targets=True), "A3-G1": dict(gate="G1", lam_util=0.0, lam_rank=0.0),
           "A3-G3": dict(gate="G3", lam_util=0.0, lam_rank=0.0), "A4-0.25": dict(gate="G3", lam_jepa=0.25),
           "A4-2": dict(gate="G3", lam_jepa=2.0)}
THRESHOLD_EMA = 0.05  # θ_l: a cumulative mean over the first 20 batches, then a running average over ~20


@dataclass
class Config(common.Config):
    n_controlled: int = 2         # C: the last C layers are controlled (paper: 4 of 12)
    cheap_rank: int = 24          # r of eq. (5) (paper 80 = d_ff/32)
    tau: float = 2.0              # τ of eq. (6)
    rho: float = 0.5              # ρ: full-path budget, eq. (7)
    gate: str = "G3"              # "G1" (eq. 10) | "G3" (eqs. 11–14)
    recipe: str = ""              # one of RECIPES: sets its fields; giving one a different value too is an error
    g1_hidden: int = 0            # G1 hidden width (0 = d/4); larger = the paper's G1-costmatch
    d_c: int = 48                 # G3 context width (paper 128)
    d_a: int = 16                 # G3 action-embedding width
    d_s: int = 32                 # G3 summary width (paper 64)
    pred_hidden: int = 32         # hidden width of P and of D (paper: 64 each, see docstring)
    lam_jepa: float = 1.0
    lam_util: float = 1.0
    lam_rank: float = 0.2
    lam_b: float = 1.0
    lam_a: float = 0.5
    p_min: float = 0.05
    shuffle_targets: bool = False  # A2: JEPA targets deranged across batch × sequence
    oracle_window: int = 8        # W of eq. (16)
    oracle_gamma: float = 0.5     # γ of eq. (16)
    label_start: int = 100        # no oracle labels before this step ...
    label_every: int = 5          # ... then every 5 steps (util/rank = 0 on the others)
    controller_only: bool = True  # freeze the backbone (paper §3.4)
    mode: str = "causal"          # eval/inference routing: "causal" (threshold θ_l) | "topk" (the paper's, non-causal)
    # training (paper §4: AdamW 2e-4, wd 0.01, clip 1, warmup + cosine to lr·0.01; ours is shorter, so faster)
    learning_rate: float = 1e-3
    min_lr: float = 1e-5
    weight_decay: float = 0.01
    warmup_iters: int = 30
    max_iters: int = 400
    eval_interval: int = 50
    eval_iters: int = 10
    model: str = "conddepth"

    def __post_init__(self):
        if self.recipe and self.recipe not in RECIPES:
            raise NanorouteError(f"unknown recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")
        for k, v in RECIPES.get(self.recipe, {}).items():
            if getattr(self, k) not in (v, getattr(Config, k)):  # an explicit value the recipe would overwrite
                raise NanorouteError(f"recipe {self.recipe} sets {k}={v}; {k}={getattr(self, k)} contradicts it")
            setattr(self, k, v)
        super().__post_init__()
        checks = {"rho": (0.0 < self.rho <= 1.0, "in (0, 1]"), "gate": (self.gate in ("G1", "G3"), "G1 or G3"),
                  "n_controlled": (1 <= self.n_controlled <= self.n_layer, f"in [1, n_layer={self.n_layer}]"),
                  "mode": (self.mode in ("causal", "topk"), "causal or topk")}
        for k in ("tau", "cheap_rank", "oracle_window", "label_every"):
            checks[k] = (getattr(self, k) > 0, "> 0")
        for name, (ok, want) in checks.items():
            if not ok:
                raise NanorouteError(f"{name} must be {want}, got {getattr(self, name)!r}")


PRESETS = {"paper": dict(n_layer=12, n_embd=640, n_head=10, block_size=256, n_controlled=4, cheap_rank=80,
                         d_c=128, d_a=16, d_s=64, pred_hidden=64, learning_rate=2e-4, min_lr=2e-6,
                         warmup_iters=1000, max_iters=20000, eval_interval=500, eval_iters=16),
           # one command, no dense checkpoint: backbone, cheap path, G1 gate trained jointly, no oracle (A3)
           "classroom": dict(common.CLASSROOM, recipe="A3-G1", controller_only=False, cheap_rank=16,
                             weight_decay=0.1)}


# ----------------------------------------------------------------------------------------------------
# Router: gates G1 (eq. 10) and G3 (eqs. 11–14), the top-k budget (eq. 7)

class GateG1(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg.g1_hidden or cfg.n_embd // 4
        self.w1 = nn.Linear(cfg.n_embd, h)
        self.w2 = nn.Linear(h, 1)

    def forward(self, a, fold=()):
        return self.w2(F.silu(self.w1(a))).squeeze(-1), None        # u (B, T), eq. (10)


class GateG3(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w_c = nn.Linear(cfg.n_embd, cfg.d_c)
        self.e = nn.Parameter(torch.empty(2, cfg.d_a))              # e_full, e_cheap (init in Model)
        self.pred = nn.Sequential(nn.Linear(cfg.d_c + cfg.d_a, cfg.pred_hidden), nn.SiLU(),
                                  nn.Linear(cfg.pred_hidden, cfg.d_s))
        self.head = nn.Sequential(nn.Linear(3 * cfg.d_s, cfg.pred_hidden), nn.SiLU(), nn.Linear(cfg.pred_hidden, 1))
        self.target = nn.Linear(cfg.n_embd, cfg.d_s, bias=False).requires_grad_(False)  # T: fixed, never trained

    @torch.no_grad()
    def fold(self):
        """Inference needs u, not q: the linear maps between the nonlinearities of eqs. (11)–(13) composed."""
        P1, P2, D1 = self.pred[0], self.pred[2], self.head[0]
        P1_c, P1_e = P1.weight.split([self.w_c.out_features, self.e.size(1)], 1)
        D1_f, D1_c, D1_d = D1.weight.split(P2.out_features, 1)
        beta = P1_c @ self.w_c.bias + self.e @ P1_e.T + P1.bias      # (2, h): P1[c; e_a] = (P1_c W_c) a + β_a
        M = torch.cat([(D1_f + D1_d) @ P2.weight, (D1_c - D1_d) @ P2.weight], 1)  # (h_D, 2h): D1 on q_f, q_c alone
        return P1_c @ self.w_c.weight, beta, M, (D1_f + D1_c) @ P2.bias + D1.bias

    def forward(self, a, fold=()):
        if fold:                                                     # u alone: 3 small GEMMs instead of 5, no cat
            W_z, beta, M, c0 = fold
            s = F.silu(F.linear(a, W_z)[..., None, :] + beta)       # (B, T, 2, h): P's hidden, per action
            return self.head[2](F.silu(F.linear(s.flatten(-2), M, c0))).squeeze(-1), None  # (B, T)
        c = self.w_c(a.detach())                                     # (B, T, d_c), eq. (11): sg(h)
        e = self.e[:, None, None, :].expand(2, *c.shape[:2], -1)     # (2, B, T, d_a)
        qf, qc = self.pred(torch.cat([c.expand(2, *c.shape), e], -1))  # 2 × (B, T, d_s), eq. (12)
        u = self.head(torch.cat([qf, qc, qf - qc], -1)).squeeze(-1)  # (B, T), eq. (13)
        return u, (qf, qc)


def budget_k(rho, T):
    return max(1, math.ceil(round(rho * T, 6)))  # k = ⌈ρT⌉, eq. (7); round: 0.3·10 = 3.0000000000000004 must give 3


def topk_mask(u, k):
    return torch.zeros_like(u, dtype=torch.bool).scatter_(-1, u.topk(k, dim=-1).indices, True)  # (B, T): k True per row


# ----------------------------------------------------------------------------------------------------
# Block: the cheap FFN of a controlled layer, LN2_cheap then eq. (5); attention and the full FFN are common.Block's

class CheapFFN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)                           # its own LN, not shared with LN2
        self.up = nn.Linear(cfg.n_embd, cfg.cheap_rank)
        self.down = nn.Linear(cfg.cheap_rank, cfg.n_embd)

    def forward(self, a):
        return self.down(F.silu(self.up(self.ln(a))))               # the residual delta of eq. (3)


# ----------------------------------------------------------------------------------------------------
# The model: training (top-k, eqs. 7–9, and the losses) and inference (causal θ, dense-hard or sparse)

class CondDepthLM(common.LM):                                        # all but cached decoding (Model adds it)
    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = nn.ModuleList([common.Block(cfg) for _ in range(cfg.n_layer)])  # same names as common.Model
        C = cfg.n_controlled
        self.cheap = nn.ModuleList([CheapFFN(cfg) for _ in range(C)])
        self.gates = nn.ModuleList([(GateG1 if cfg.gate == "G1" else GateG3)(cfg) for _ in range(C)])
        self.register_buffer("thresholds", torch.full((C,), -math.inf if cfg.rho >= 1 else math.inf))  # θ_l
        self.register_buffer("threshold_batches", torch.zeros(C))   # how many batches θ_l has averaged
        self.init_weights()
        for ffn in self.cheap:                                       # eq. (5): the cheap path starts as identity
            nn.init.zeros_(ffn.down.weight)                          # (its bias is 0 from init_weights)
        for g in self.gates:                                         # fan-in init: u spreads at step 0 (docstring)
            g.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
            if cfg.gate == "G3":
                nn.init.normal_(g.e)                                 # distinct actions: q_full ≠ q_cheap at step 0
                nn.init.orthogonal_(g.target.weight)                 # T: orthogonal init, frozen
        self.train()                                                 # controller_only: the backbone frozen
        self.mode = cfg.mode                                         # switchable (tests, experiments)
        self.label_now = False                                       # oracle labels this step? (on_step)
        self.folded = (None, [])                                     # folds(): (the gates' parameters, their folds)

    def train(self, mode=True):                                      # controller_only: backbone frozen in training
        super().train(mode)
        for name, p in self.named_parameters():                      # eval: all but T, so autocast casts once
            trainable = not self.cfg.controller_only or name.startswith(("cheap.", "gates."))
            p.requires_grad = ".target." not in name and (trainable or not mode)
        return self

    def on_step(self, it):                                           # train.py calls it before every step
        cfg = self.cfg
        self.label_now = (cfg.lam_util > 0 or cfg.lam_rank > 0) and it >= cfg.label_start \
            and (it - cfg.label_start) % cfg.label_every == 0

    def controller(self, j, a, fold=()):                             # u (B, T), G3's (q_full, q_cheap) or None
        with torch.autocast(a.device.type, enabled=False):           # the gate in fp32 (fp64 in tests)
            return self.gates[j](a.float() if a.dtype.itemsize < 4 else a, fold)

    def forward(self, idx, targets=None, sparse=False):
        if sparse and self.training:
            raise NanorouteError("sparse=True is an inference path: call model.eval() first")
        x = self.embed(idx)                                          # (B, T, d)
        for block in self.blocks[:self.cfg.n_layer - self.cfg.n_controlled]:
            x = block(x)
        topk = self.training or self.mode == "topk"                  # training is always the paper's top-k
        h, r = self.controlled(x, topk, sparse, targets is not None)
        logits, lm_loss = self.head(h, targets)
        self.last_masks = r["m"]                                     # per layer (B, T): this forward's routing
        if lm_loss is None:                                          # inference: no statistics to pay for
            return logits, None, {}
        loss, stats = total_loss(self, x, targets, lm_loss, r)       # eq. (19)
        if not self.training:  # the training computation (top-k, eq. 9's forward value) on the same batch
            soft = lm_loss if topk else self.head(self.controlled(x, True)[0], targets)[1]
            stats["soft_loss"] = soft.detach()
        return logits, loss, stats

    def controlled(self, x, topk, sparse=False, losses=False):       # x (B, T, d) into the C controlled layers
        cfg, C = self.cfg, self.cfg.n_controlled
        B, T, _ = x.shape
        k = budget_k(cfg.rho, T)
        r = {"u": [], "m": [], "p": [], "jepa": []}
        full_terms = losses or self.training                         # q and p feed only the losses and eq. (8)
        folds = [()] * C if full_terms else self.folds()
        for j, block in enumerate(self.blocks[-C:]):
            a = x + block.attn_delta(x)                              # (B, T, d), eq. (1); fp32 + bf16 promotes
            u, q = self.controller(j, a, folds[j])                   # (B, T) fp32
            p = torch.sigmoid(u / cfg.tau) if full_terms else None   # eq. (6)
            m = topk_mask(u.detach(), k) if topk else u > self.thresholds[j]  # (B, T) bool: eq. (7), or causal θ
            if self.training and k < T:                              # θ_j averages this batch's top-k cut
                cut = u.detach().flatten().topk(k * B + 1).values[-2:].mean()  # midway: kB-th, next score
                n = self.threshold_batches[j]                        # how many batches θ_j has averaged
                beta = (1 / (n + 1)).clamp(min=THRESHOLD_EMA)
                theta = self.thresholds[j]
                self.thresholds[j] = torch.where(n == 0, cut, theta + beta * (cut - theta))
                self.threshold_batches[j] += 1
            r["u"].append(u)
            r["m"].append(m)
            r["p"].append(p)
            if sparse:
                x = sparse_ffn(block, self.cheap[j], a, m)
                continue
            h_full = a + block.ffn_delta(a)                          # eq. (2)
            h_cheap = a + self.cheap[j](a)                           # eq. (3)
            if self.training:
                m_st = ((m.float() - p).detach() + p)[..., None]     # (B, T, 1), eq. (8)
                x = m_st * h_full + (1 - m_st) * h_cheap             # eq. (9)
            else:
                x = torch.where(m[..., None], h_full, h_cheap)       # eq. (4), hard
            if q is not None and losses:
                shuffle = cfg.shuffle_targets and self.training      # A2: another token's real targets
                r["jepa"].append(jepa_terms(self.gates[j].target, *q, h_full, h_cheap, shuffle))
        return x, r

    @torch.no_grad()
    def calibrate_thresholds(self, batches):                         # θ as training sets it, for a fresh model
        was_training = self.training
        self.threshold_batches.zero_()
        self.train()
        for x in batches:
            self(x)
        self.train(was_training)

    @torch.compiler.disable                                         # reads parameter versions: host bookkeeping
    def folds(self):                                                 # fp32 gate folds, made again after a change
        key = [(p._version, p.data_ptr(), p.dtype) for p in self.gates.parameters()]
        if key != self.folded[0]:
            with torch.autocast(self.wte.weight.device.type, enabled=False):
                self.folded = (key, [g.fold() if self.cfg.gate == "G3" else () for g in self.gates])
        return self.folded[1]

    @torch.no_grad()
    def routing_map(self, idx):                                      # m (C, T): 1 = inference ran the full FFN
        was_training = self.training
        self.eval()(idx)
        self.train(was_training)
        L, C = self.cfg.n_layer, self.cfg.n_controlled
        m = torch.stack([mk[0].float() for mk in self.last_masks]).cpu()  # (C, T)
        return m, [f"layer {L - C + j}" for j in range(C)], ("cheap FFN", "full FFN")


# ----------------------------------------------------------------------------------------------------
# Losses: eq. (19) and its terms; the oracle's labels (eqs. 15–16), a no-grad teacher independent of the gates

def total_loss(model, x, targets, lm_loss, r):                       # eq. (19), logged stats; x: oracle's start
    cfg, L, C = model.cfg, model.cfg.n_layer, model.cfg.n_controlled
    full = torch.stack([m.float().mean() for m in r["m"]])          # (C,) fraction on the full path
    p_bar = torch.stack([p.mean() for p in r["p"]])                  # (C,) batch-averaged gate prob per layer
    budget = ((p_bar - cfg.rho) ** 2).mean()                         # eq. (20)
    alive = F.relu(cfg.p_min - p_bar).mean()                         # eq. (21)
    ratio = flops_per_token(cfg, x.size(1), full) / common.dense_flops_per_token(cfg, x.size(1))
    stats = {"gate_prob": p_bar.mean().detach(), "full_ratio": full.mean(), "skipped": 1 - full.mean(),
             "flops_saved_hard": 1 - ratio, "budget": budget.detach(), "alive": alive.detach(),
             "util_var": torch.stack([u.detach().var(correction=0) for u in r["u"]]).mean(),
             **{f"skip_l{L - C + j}": 1 - f for j, f in enumerate(full)}}
    util = rank = jepa = zero = lm_loss.new_zeros(())
    if r["jepa"]:                                                    # G3: each term averaged over the C layers
        jepa, l2, cos = (torch.stack(t).mean() for t in zip(*r["jepa"]))
        stats.update(jepa=jepa.detach(), qf_qc_l2=l2, qf_qc_cos=cos)
    labelled = model.training and model.label_now
    if labelled:
        u_star = [us.to(u.dtype) for us, u in zip(oracle_labels(model, x.detach(), targets), r["u"])]  # C × (B, T)
        util = torch.stack([F.huber_loss(u, us) for u, us in zip(r["u"], u_star)]).mean()  # eq. (17)
        rank = torch.stack([rank_loss(u, us) for u, us in zip(r["u"], u_star)]).mean()     # eq. (18)
    loss = lm_loss + cfg.lam_jepa * jepa + cfg.lam_util * util + cfg.lam_rank * rank \
        + cfg.lam_b * budget + cfg.lam_a * alive
    stats.update(lm_loss=lm_loss.detach(), util=util.detach(), rank=rank.detach(), label_step=zero + labelled)
    return loss, stats


def jepa_terms(target, qf, qc, h_full, h_cheap, shuffle):            # eq. (14); ‖q_f − q_c‖, cos(q_f, q_c) to log
    with torch.autocast(qf.device.type, enabled=False):
        z = target(torch.stack([h_full, h_cheap]).detach().to(qf.dtype))  # (2, B, T, d_s)
    if shuffle:
        z = z.flatten(1, 2)[:, derangement(z.size(1) * z.size(2), z.device)].view_as(z)
    loss = (2 - F.cosine_similarity(qf, z[0], dim=-1) - F.cosine_similarity(qc, z[1], dim=-1)).mean()
    return loss, (qf - qc).detach().norm(dim=-1).mean(), F.cosine_similarity(qf.detach(), qc.detach(), dim=-1).mean()


def derangement(n, device):                                          # one n-cycle through a random order (n ≥ 2)
    order = torch.randperm(n, device=device)
    return torch.empty_like(order).scatter_(0, order, order.roll(-1))  # perm[order[i]] = order[i+1]


def rank_loss(u, u_star):
    perm = torch.randperm(u.size(1), device=u.device)                # pairs (t, π(t)); tied labels are dropped
    s = torch.sign(u_star - u_star[:, perm])                         # (B, T)
    loss = F.softplus(-s * (u - u[:, perm]))                         # eq. (18)
    return (loss * (s != 0)).sum() / (s != 0).sum().clamp(min=1)


def token_ce(model, h, targets):                                     # h (..., d) -> (...); ignored targets give 0
    logits, _ = model.head(h)
    logits = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets.flatten(), ignore_index=-1, reduction="none").view(targets.shape)


@torch.no_grad()
def oracle_labels(model, x, targets):                                # u*_l (B, T) per layer from x (B, T, d)
    cfg, C, W = model.cfg, model.cfg.n_controlled, model.cfg.oracle_window
    B, T, d = x.shape
    nh = cfg.n_head
    kv, outs, cheap_outs = [], [], []                                # per layer: (block, K, V), out, cheap out
    for j, block in enumerate(model.blocks[-C:]):                    # the dense pass
        q, k, v = block.attn.qkv(block.ln_1(x))                      # 3 × (B, nh, T, hs)
        a = x + block.attn.c_proj(block.attn.attend(q, k, v))
        cheap_outs.append(a + model.cheap[j](a))                     # eq. (3) on the dense trajectory
        x = a + block.ffn_delta(a)
        kv.append((block, k, v))
        outs.append(x)
    ce_full = token_ce(model, x, targets)                            # (B, T)
    pos = torch.arange(T, device=x.device)[:, None] + torch.arange(W, device=x.device)  # (T, W) fork windows
    valid = pos < T
    pos = pos.clamp(max=T - 1)
    decay = cfg.oracle_gamma ** torch.arange(W, device=x.device) * valid                # (T, W)
    see_dense = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-1)[:, None]  # (T, 1, T): key s < t
    see_fork = torch.ones(W, W, dtype=torch.bool, device=x.device).tril() & valid[:, None, :]  # (T, W, W): w' <= w
    labels = []
    for j in range(C):
        h = outs[j][:, pos]                                          # (B, T, W, d): dense layer-j outputs ...
        h[:, :, 0] = cheap_outs[j]                                   # ... but the forked token took the cheap FFN
        for block, K, V in kv[j + 1:]:                               # each later layer, all forks' windows at once
            q, k, v = block.attn.c_attn(block.ln_1(h)).view(B, T, W, 3, nh, d // nh).permute(3, 0, 4, 1, 2, 5)
            s_dense = torch.einsum("bhtwe,bhse->bhtws", q, K).float()  # (B, nh, T, W, T)
            s_fork = torch.einsum("bhtwe,bhtve->bhtwv", q, k).float()  # (B, nh, T, W, W)
            s = torch.cat([s_dense.masked_fill(~see_dense, -math.inf),
                           s_fork.masked_fill(~see_fork, -math.inf)], -1)
            att = (s / math.sqrt(d // nh)).softmax(-1).to(v.dtype)   # (B, nh, T, W, T + W)
            y = torch.einsum("bhtws,bhse->bhtwe", att[..., :T], V)   # (B, nh, T, W, hs): dense keys ...
            y = y + torch.einsum("bhtwv,bhtve->bhtwe", att[..., T:], v)  # ... and the window's
            h = h + block.attn.c_proj(y.permute(0, 2, 3, 1, 4).reshape(B, T, W, d))
            h = h + block.ffn_delta(h)
        ce = token_ce(model, h, targets[:, pos])                     # (B, T, W)
        labels.append(((ce - ce_full[:, pos]) * decay).sum(-1))      # u*_{l,t}, eqs. (15)–(16)
    return labels


# ----------------------------------------------------------------------------------------------------
# Sparse inference: each token runs only its own FFN

def sparse_ffn(block, cheap, a, m):                                  # a (B, T, d), m (B, T) -> eq. (4)
    a2 = a.reshape(-1, a.size(-1))                                   # (N, d)
    i_full = m.reshape(-1).nonzero().squeeze(1)                      # (n,): the one host sync, to know n
    if i_full.numel() == a2.size(0):
        return a + block.ffn_delta(a)                                # eq. (2); fp32 + bf16 promotes, no cast
    out = a2 + cheap(a2)                                             # (N, d), eq. (3): every token
    if i_full.numel():
        x_full = a2.index_select(0, i_full)                          # (n, d): the full FFN only on these
        out.index_copy_(0, i_full, x_full + block.ffn_delta(x_full))  # eq. (2)
    return out.view_as(a)


# ----------------------------------------------------------------------------------------------------
# Cached decoding: every layer caches every token's K/V; state = (the KVCaches, the position (0-d), the folds)

class Model(CondDepthLM):
    @torch.no_grad()
    def step(self, tok, state=None):                                 # tok (B, T') from pos on; state None: a prompt
        if state is None and self.mode != "causal":
            raise NanorouteError("cached decoding routes causally: mode='topk' looks at future tokens "
                                 "(use mode='causal', or generate(..., use_cache=False))")
        L, C, S = self.cfg.n_layer, self.cfg.n_controlled, self.cfg.block_size
        caches, pos, folds = state or ([None] * L, torch.tensor(0, device=tok.device), self.folds())
        prompt = caches[0] is None
        x = self.embed(tok) if prompt else self.wte(tok) + self.wpe(pos)  # (B, T', d)
        mask = None if prompt else common.past_mask(pos, S, caches[0].k.dtype)  # (1, S): no shape depends on pos
        for i, block in enumerate(self.blocks):
            q, k, v = block.attn.qkv(block.ln_1(x))                  # 3 × (B, nh, T', hs)
            if prompt:
                caches[i] = common.KVCache(x.size(0), S, k, v)
            else:
                k, v = caches[i].append(pos, k, v)                   # (B, nh, S, hs)
            a = x + block.attn.c_proj(block.attn.attend(q, k, v, attn_mask=mask))  # eq. (1); no mask: causal
            j = i - (L - C)                                          # controlled: j >= 0
            if j < 0:
                x = a + block.ffn_delta(a)
                continue
            full = self.controller(j, a, folds[j])[0] > self.thresholds[j]  # (B, T')
            if prompt or (x.size(0) == 1 and not torch.compiler.is_compiling()):  # one sync, one FFN
                x = sparse_ffn(block, self.cheap[j], a, full)
            else:                                                    # B > 1 or compiled: both FFNs, a select
                x = a + torch.where(full[..., None], block.ffn_delta(a), self.cheap[j](a))  # (B, 1, d), eq. (4)
        return self.head(x[:, -1:])[0][:, -1], (caches, pos + tok.size(1), folds)

    prefill = step                                                   # prefill(idx): the prompt, no state yet

    def generate(self, *args, use_cache=True, **kw):                 # mode="topk" (no causal cache): cache-free
        return super().generate(*args, use_cache=use_cache and self.mode == "causal", **kw)


# ----------------------------------------------------------------------------------------------------
# Compute: forward FLOPs per token of what inference runs, and the paper's proxies (§4) in FFN units

def controller_flops(cfg, train, folded=True):
    """One gate's forward FLOPs per token: in training, or at inference (G3 folded; folded=False: the paper's)."""
    d = cfg.n_embd
    if cfg.gate == "G1":
        h = cfg.g1_hidden or d // 4
        return 2 * (d * h + h)
    h = cfg.pred_hidden
    if folded and not train:                                         # GateG3 with its fold: W_z, M, D's last layer
        return 2 * (d * h + 2 * h * h + h)
    f = 2 * d * cfg.d_c                                              # W_c
    f += 2 * 2 * ((cfg.d_c + cfg.d_a) * h + h * cfg.d_s)             # P, once per action
    f += 2 * (3 * cfg.d_s * h + h)                                   # D
    return f + (2 * 2 * d * cfg.d_s if train else 0)                 # T on both branch outputs (training)


def flops_per_token(cfg, T, full):                                   # inference; full (C,): each layer's share
    full = torch.as_tensor(full, dtype=torch.float32)
    ffn, cheap = common.flops_ffn(cfg.n_embd, 4 * cfg.n_embd), common.flops_ffn(cfg.n_embd, cfg.cheap_rank)
    routed = full * ffn + (1 - full) * cheap + controller_flops(cfg, train=False)
    return common.dense_flops_per_token(cfg, T) + (routed - ffn).sum()


def infer_vs_full(cfg):
    """Paper §4, inference in FFN units of a controlled layer: ρ + (1 − ρ)·r/d_ff + ctrl/FFN, G3's ctrl unfolded."""
    ffn, cheap = common.flops_ffn(cfg.n_embd, 4 * cfg.n_embd), cfg.cheap_rank / (4 * cfg.n_embd)  # cheap: r / d_ff
    return cfg.rho + (1 - cfg.rho) * cheap + controller_flops(cfg, train=False, folded=False) / ffn


def compute_vs_full(cfg):
    """Paper §4, training in FFN units: 1 + r/d_ff + ctrl_train/FFN + f_label·oracle/C, oracle per label step."""
    ffn, cheap = common.flops_ffn(cfg.n_embd, 4 * cfg.n_embd), cfg.cheap_rank / (4 * cfg.n_embd)
    C = cfg.n_controlled
    n_label = max(0, math.ceil((cfg.max_iters - cfg.label_start) / cfg.label_every))  # steps with oracle labels
    f_label = n_label / cfg.max_iters if cfg.lam_util or cfg.lam_rank else 0.0
    oracle = f_label * (C + C * cheap + cfg.oracle_window * C * (C - 1) / 2) / C  # dense, forks, their later layers
    return 1 + cheap + controller_flops(cfg, train=True) / ffn + oracle
