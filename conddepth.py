"""
Conditional depth routing, from "Revisiting Auxiliary Losses for Conditional Depth Routing: An Empirical
Study" (Q. Lin, 2026, arXiv:2604.17228). The last C layers of a pretrained GPT are "controlled": attention
is unchanged, and each token's FFN sub-layer runs either the full FFN or a cheap low-rank FFN, chosen by a
controller under an exact top-k budget. Only the controller and the cheap path are trained.

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
    (15) u*_{l,t} = C̃E^cheap_{l,t} − C̃E^full_{l,t}    oracle fork at layer l, all later controlled layers full
    (16) C̃E_{l,t} = Σ_{δ<W} γ^δ CE_{l,t+δ}           (window runs forward in t; truncated at the sequence end)
    (17) L_util = Huber(u, u*)
    (18) L_rank = E_(i,j) softplus(−sign(u*_i − u*_j)(u_i − u_j))
    (19) L = L_LM + λ_JEPA L_JEPA + λ_util L_util + λ_rank L_rank + λ_b L_budget + λ_a L_alive
    (20) L_budget = 1/C Σ_l (p̄_l − ρ)²
    (21) L_alive  = 1/C Σ_l ReLU(p_min − p̄_l)

Choices where the paper is silent: the gate reads the FFN sub-layer input a (eq. 1), the only hidden state
that exists before the decision; the oracle forks ALL tokens of layer l at once (two no-grad passes of the
later layers per controlled layer, not one per token); rank pairs are (t, π(t)) for a random permutation π
of each sequence, ties dropped; A2 deranges the targets with a random T·B-cycle (a permutation without a
fixed point). Predictor/decision-head hidden widths are 64 in the paper preset: that reproduces the
paper's trainable counts exactly (G1 828,484, G3 849,348 at d=640, r=80, d_c=128, d_s=64, d_a=16).

Inference. eval(): hard top-k, computed densely (the reference). sparse=True: each token runs only its
path (gather/scatter). Top-k over a sequence looks at FUTURE tokens, so it is not causal; mode="causal"
replaces it by a per-layer score threshold calibrated on training data to hit ρ (calibrate_thresholds).

Compute proxies (paper §4), in FFN-equivalent token-layers of the C controlled layers (1 = one token through
one full FFN, common.flops_ffn(d, 4d)); forward FLOPs only, like the paper:
    infer_vs_full   = ρ·1 + (1 − ρ)·r/d_ff + ctrl_infer/FFN
    compute_vs_full = 1 + r/d_ff + ctrl_train/FFN + f_label·(C − 1)
ctrl = G1 MLP, or G3's W_c + P (twice) + D; training adds G3's target head T (twice). Oracle: each label
step forks every controlled layer l and runs the C−l later layers for both branches (layer l's two outputs
are reused from the training forward): Σ_l 2(C − l) = C(C − 1) units, i.e. C − 1 per controlled layer;
f_label = fraction of steps that compute labels.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import NanorouteError

# recipe -> overrides (paper §3.4). Standard = G1 / G3; A1 no JEPA; A2 deranged targets; A3 no util/rank.
RECIPES = {
    "G1": dict(gate="G1"), "G3": dict(gate="G3"),
    "A1": dict(gate="G3", lam_jepa=0.0), "A2": dict(gate="G3", shuffle_targets=True),
    "A3-G1": dict(gate="G1", lam_util=0.0, lam_rank=0.0), "A3-G3": dict(gate="G3", lam_util=0.0, lam_rank=0.0),
    "A4-0.25": dict(gate="G3", lam_jepa=0.25), "A4-2": dict(gate="G3", lam_jepa=2.0),
}


@dataclass
class Config(common.Config):
    n_controlled: int = 2         # C: the last C layers are controlled (paper: 4 of 12)
    cheap_rank: int = 24          # r of eq. (5) (paper 80 = d_ff/32)
    tau: float = 2.0              # τ of eq. (6)
    rho: float = 0.5              # ρ: full-path budget, eq. (7)
    gate: str = "G3"              # "G1" (eq. 10) | "G3" (eqs. 11–14)
    recipe: str = ""              # one of RECIPES; when set it overrides gate / λ_JEPA / λ_util / λ_rank / A2
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
    mode: str = "topk"            # inference routing: "topk" (paper, non-causal) | "causal" (calibrated threshold)
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
        if self.recipe:
            if self.recipe not in RECIPES:
                raise NanorouteError(f"unknown recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")
            for k, v in RECIPES[self.recipe].items():
                setattr(self, k, v)
        super().__post_init__()
        if not 0.0 < self.rho <= 1.0:
            raise NanorouteError(f"rho (the full-path budget) must be in (0, 1], got {self.rho}")
        if not 1 <= self.n_controlled <= self.n_layer:
            raise NanorouteError(f"n_controlled must be in [1, n_layer={self.n_layer}], got {self.n_controlled}")
        if self.gate not in ("G1", "G3"):
            raise NanorouteError(f"gate must be G1 or G3, got {self.gate!r}")
        if self.mode not in ("topk", "causal"):
            raise NanorouteError(f"mode must be topk or causal, got {self.mode!r}")
        if self.tau <= 0 or self.cheap_rank < 1 or self.oracle_window < 1 or self.label_every < 1:
            raise NanorouteError("tau, cheap_rank, oracle_window and label_every must be positive")


PRESETS = {"paper": dict(n_layer=12, n_embd=640, n_head=10, block_size=256, n_controlled=4, cheap_rank=80,
                         d_c=128, d_a=16, d_s=64, pred_hidden=64, learning_rate=2e-4, min_lr=2e-6,
                         warmup_iters=1000, max_iters=20000, eval_interval=500, eval_iters=16)}


# ----------------------------------------------------------------------------------------------------
# Modules: cheap FFN (eq. 5), gates G1 (eq. 10) and G3 (eqs. 11–14)

class CheapFFN(nn.Module):
    """LN2_cheap then W_down SiLU(W_up x): returns the residual delta of eq. (3)."""

    def __init__(self, cfg):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)                           # its own LN, not shared with LN2
        self.up = nn.Linear(cfg.n_embd, cfg.cheap_rank)
        self.down = nn.Linear(cfg.cheap_rank, cfg.n_embd)

    def forward(self, a):
        return self.down(F.silu(self.up(self.ln(a))))


class GateG1(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg.g1_hidden or cfg.n_embd // 4
        self.w1, self.w2 = nn.Linear(cfg.n_embd, h), nn.Linear(h, 1)

    def forward(self, a):
        return self.w2(F.silu(self.w1(a))).squeeze(-1), None        # u (B, T), eq. (10)


class GateG3(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w_c = nn.Linear(cfg.n_embd, cfg.d_c)
        self.e = nn.Parameter(torch.zeros(2, cfg.d_a))              # e_full, e_cheap
        self.pred = nn.Sequential(nn.Linear(cfg.d_c + cfg.d_a, cfg.pred_hidden), nn.SiLU(),
                                  nn.Linear(cfg.pred_hidden, cfg.d_s))
        self.head = nn.Sequential(nn.Linear(3 * cfg.d_s, cfg.pred_hidden), nn.SiLU(), nn.Linear(cfg.pred_hidden, 1))
        self.target = nn.Linear(cfg.n_embd, cfg.d_s, bias=False)    # T: fixed, never trained
        self.target.weight.requires_grad = False

    def forward(self, a):
        c = self.w_c(a.detach())                                     # (B, T, d_c), eq. (11): sg(h)
        e = self.e[:, None, None, :].expand(2, *c.shape[:2], -1)     # (2, B, T, d_a)
        q = self.pred(torch.cat([c.expand(2, *c.shape), e], -1))     # (2, B, T, d_s), eq. (12)
        qf, qc = q[0], q[1]
        u = self.head(torch.cat([qf, qc, qf - qc], -1)).squeeze(-1)  # (B, T), eq. (13)
        return u, (qf, qc)


def budget_k(rho, T):
    """k = ⌈ρT⌉ (eq. 7), robust to float error (0.3·10 = 3.0000000000000004 must give 3)."""
    return max(1, math.ceil(round(rho * T, 6)))


def topk_mask(u, k):
    """Exact top-k per sequence: (B, T) scores -> (B, T) bool, exactly k True per row."""
    idx = u.topk(k, dim=-1).indices                                  # (B, k)
    return torch.zeros_like(u, dtype=torch.bool).scatter_(-1, idx, True)


def derangement(n, device):
    """A random permutation with no fixed point: a single n-cycle through a random order (n ≥ 2)."""
    order = torch.randperm(n, device=device)
    perm = torch.empty_like(order)
    perm[order] = order.roll(-1)                                     # order[i] -> order[i+1]
    return perm


def windowed_ce(ce, W, gamma):
    """eq. (16): C̃E_t = Σ_{δ<W} γ^δ CE_{t+δ}; (N, T) -> (N, T), positions past T contribute 0."""
    T = ce.size(1)
    padded = F.pad(ce, (0, W - 1))
    return sum(gamma ** d * padded[:, d:d + T] for d in range(W))


# ----------------------------------------------------------------------------------------------------
# The model

class Model(common.LM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = nn.ModuleList([common.Block(cfg) for _ in range(cfg.n_layer)])  # same names as common.Model
        C = cfg.n_controlled
        self.cheap = nn.ModuleList([CheapFFN(cfg) for _ in range(C)])
        self.gates = nn.ModuleList([(GateG1 if cfg.gate == "G1" else GateG3)(cfg) for _ in range(C)])
        self.register_buffer("thresholds", torch.zeros(C))          # causal mode: u > threshold_l -> full
        self.init_weights()
        for ffn in self.cheap:                                       # eq. (5): the cheap path starts as identity
            nn.init.zeros_(ffn.down.weight), nn.init.zeros_(ffn.down.bias)
        for g in self.gates:
            if cfg.gate == "G3":
                nn.init.orthogonal_(g.target.weight)                 # T: orthogonal init, frozen
        if cfg.controller_only:                                      # paper §3.4: train cheap path + controller only
            for p in self.parameters():
                p.requires_grad = False
            for m in (*self.cheap, *self.gates):
                for name, p in m.named_parameters():
                    p.requires_grad = not name.startswith("target")
        self.mode = cfg.mode                                         # switchable (calibration, tests)
        self.label_now = False                                       # set by on_step: oracle labels this step?
        self.last_masks, self.last_scores = [], []

    def on_step(self, it):
        """train.py calls this before every step: oracle labels from label_start on, every label_every steps."""
        cfg = self.cfg
        self.label_now = (cfg.lam_util > 0 or cfg.lam_rank > 0) and it >= cfg.label_start \
            and (it - cfg.label_start) % cfg.label_every == 0

    def forward(self, idx, targets=None, sparse=False):
        cfg, L, C = self.cfg, self.cfg.n_layer, self.cfg.n_controlled
        if sparse and self.training:
            raise NanorouteError("sparse=True is an inference path; call model.eval() first")
        x = self.embed(idx)                                          # (B, T, d)
        for block in self.blocks[:L - C]:
            x = block(x)
        B, T, _ = x.shape
        k = budget_k(cfg.rho, T)
        causal = self.mode == "causal" and not self.training
        zero = x.new_zeros(())
        us, ps, masks, branches = [], [], [], []
        jepa, l2, cos = zero, zero, zero
        for j, block in enumerate(self.blocks[L - C:]):
            a = x + block.attn_delta(x)                              # (B, T, d), eq. (1)
            u, q = self.gates[j](a)                                  # (B, T)
            p = torch.sigmoid(u / cfg.tau)                           # eq. (6)
            m = u > self.thresholds[j] if causal else topk_mask(u.detach(), k)  # (B, T) bool, eq. (7)
            us.append(u), ps.append(p), masks.append(m)
            if sparse:                                               # each token runs only its own path
                x = self.sparse_ffn(block, self.cheap[j], a, m)
                continue
            h_full = a + block.ffn_delta(a)                          # eq. (2)
            h_cheap = a + self.cheap[j](a)                           # eq. (3)
            if self.training:
                m_st = ((m.to(p.dtype) - p).detach() + p)[..., None]  # (B, T, 1), eq. (8)
                x = m_st * h_full + (1 - m_st) * h_cheap             # eq. (9)
            else:
                x = torch.where(m[..., None], h_full, h_cheap)       # eq. (4), hard
            branches.append((h_full.detach(), h_cheap.detach()))
            if q is not None and targets is not None:                # G3: JEPA alignment, eq. (14)
                qf, qc = q
                z = self.gates[j].target(torch.stack([h_full, h_cheap]).detach())  # (2, B, T, d_s)
                if cfg.shuffle_targets and self.training:            # A2: another token's real targets
                    perm = derangement(B * T, z.device)
                    z = z.flatten(1, 2)[:, perm].view_as(z)
                jepa = jepa + (2 - F.cosine_similarity(qf, z[0], dim=-1) - F.cosine_similarity(qc, z[1], dim=-1)).mean()
                l2 = l2 + (qf - qc).detach().norm(dim=-1).mean()
                cos = cos + F.cosine_similarity(qf.detach(), qc.detach(), dim=-1).mean()
        logits, lm_loss = self.head(x, targets)
        self.last_masks = [m.detach() for m in masks]
        self.last_scores = [u.detach() for u in us]

        p_bar = torch.stack([p.mean() for p in ps])                  # (C,) batch-averaged gate prob
        budget = ((p_bar - cfg.rho) ** 2).mean()                     # eq. (20)
        alive = F.relu(cfg.p_min - p_bar).mean()                     # eq. (21)
        util, rank = zero, zero
        labelled = self.training and self.label_now and targets is not None
        if labelled:
            u_star = self.oracle_labels(branches, targets)           # C × (B, T)
            util = torch.stack([F.huber_loss(u, us_) for u, us_ in zip(us, u_star)]).mean()  # eq. (17)
            rank = torch.stack([rank_loss(u, us_) for u, us_ in zip(us, u_star)]).mean()     # eq. (18)
        stats = {"gate_prob": p_bar.mean().detach(), "full_ratio": torch.stack(masks).float().mean(),
                 "util_var": torch.stack([u.detach().var(correction=0) for u in us]).mean(),
                 "budget": budget.detach(), "alive": alive.detach()}
        if cfg.gate == "G3" and not sparse and targets is not None:
            stats.update(jepa=jepa.detach() / C, qf_qc_l2=l2 / C, qf_qc_cos=cos / C)
        if lm_loss is None:
            return logits, None, stats
        loss = lm_loss + cfg.lam_jepa * jepa / C + cfg.lam_util * util + cfg.lam_rank * rank \
            + cfg.lam_b * budget + cfg.lam_a * alive                 # eq. (19)
        stats.update(lm_loss=lm_loss.detach(), util=util.detach(), rank=rank.detach(), label_step=zero + labelled)
        return logits, loss, stats

    def sparse_ffn(self, block, cheap, a, m):
        """Gather the full-path tokens and the cheap-path tokens of the whole batch, run each FFN once on
        its subset, scatter the deltas back. Rows may route different numbers of tokens (causal mode)."""
        a2, m2 = a.reshape(-1, a.size(-1)), m.reshape(-1)            # (B·T, d), (B·T,)
        i_full, i_cheap = m2.nonzero().squeeze(1), (~m2).nonzero().squeeze(1)
        out = a2.clone()
        out.index_add_(0, i_full, block.ffn_delta(a2[i_full]))       # (n_full, d)
        out.index_add_(0, i_cheap, cheap(a2[i_cheap]))               # (n_cheap, d)
        return out.view_as(a)

    @torch.no_grad()
    def oracle_labels(self, branches, targets):
        """eq. (15): for each controlled layer l, fork (all tokens) into h_full / h_cheap, run every later
        layer full, and take the difference of the windowed per-token CE. No gradient: a teacher signal."""
        cfg, L, C = self.cfg, self.cfg.n_layer, self.cfg.n_controlled
        B, T = targets.shape
        labels = []
        for j, (h_full, h_cheap) in enumerate(branches):
            z = torch.cat([h_full, h_cheap])                         # (2B, T, d)
            for block in self.blocks[L - C + j + 1:]:                # later controlled layers: all full
                z = block(z)
            logits, _ = self.head(z)                                 # (2B, T, V)
            ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.repeat(2, 1).flatten(),
                                 ignore_index=-1, reduction="none").view(2 * B, T)
            ce = windowed_ce(ce, cfg.oracle_window, cfg.oracle_gamma)
            labels.append((ce[B:] - ce[:B]).to(h_full.dtype))   # u* = C̃E_cheap − C̃E_full, (B, T)
        return labels

    @torch.no_grad()
    def calibrate_thresholds(self, batches):
        """Causal mode: per layer, the (1 − ρ)-quantile of u on training batches, layer after layer (u_l
        depends on how layers < l routed, so earlier thresholds are fixed first)."""
        was_training, mode = self.training, self.mode
        self.eval()
        self.mode = "causal"
        for j in range(self.cfg.n_controlled):
            scores = []
            for x in batches:
                self(x)
                scores.append(self.last_scores[j].flatten())
            self.thresholds[j] = torch.quantile(torch.cat(scores).float(), 1 - self.cfg.rho)
        self.train(was_training)
        self.mode = mode
        return self.thresholds.clone()


def rank_loss(u, u_star):
    """eq. (18) over pairs (t, π(t)) of each sequence, π a random permutation; tied labels are dropped."""
    perm = torch.randperm(u.size(1), device=u.device)
    s = torch.sign(u_star - u_star[:, perm])                         # (B, T)
    loss = F.softplus(-s * (u - u[:, perm]))
    return (loss * (s != 0)).sum() / (s != 0).sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------------
# Compute proxies (paper §4), in FFN-equivalent token-layers of the controlled layers

def controller_flops(cfg, train):
    d = cfg.n_embd
    if cfg.gate == "G1":
        h = cfg.g1_hidden or d // 4
        return 2 * (d * h + h)
    h = cfg.pred_hidden
    f = 2 * d * cfg.d_c                                              # W_c
    f += 2 * 2 * ((cfg.d_c + cfg.d_a) * h + h * cfg.d_s)             # P, once per action
    f += 2 * (3 * cfg.d_s * h + h)                                   # D
    return f + (2 * 2 * d * cfg.d_s if train else 0)                 # T on both branch outputs (training)


def label_fraction(cfg):
    """Fraction of the max_iters steps that compute oracle labels."""
    if cfg.lam_util == 0 and cfg.lam_rank == 0:
        return 0.0
    n = max(0, math.ceil((cfg.max_iters - cfg.label_start) / cfg.label_every))
    return n / cfg.max_iters


def infer_vs_full(cfg):
    ffn = common.flops_ffn(cfg.n_embd, 4 * cfg.n_embd)
    cheap = common.flops_ffn(cfg.n_embd, cfg.cheap_rank) / ffn       # r / d_ff
    return cfg.rho + (1 - cfg.rho) * cheap + controller_flops(cfg, train=False) / ffn


def compute_vs_full(cfg):
    ffn = common.flops_ffn(cfg.n_embd, 4 * cfg.n_embd)
    cheap = common.flops_ffn(cfg.n_embd, cfg.cheap_rank) / ffn
    oracle = label_fraction(cfg) * (cfg.n_controlled - 1)
    return 1 + cheap + controller_flops(cfg, train=True) / ffn + oracle
