"""
Conditional depth routing, from "Revisiting Auxiliary Losses for Conditional Depth Routing:
An Empirical Study" (Q. Lin, 2026, arXiv:2604.17228). In the last C ("controlled") layers of a
pretrained GPT, each token's FFN sub-layer runs the full FFN or a cheap low-rank one, chosen by a
controller under an exact top-k budget.

    (1)  a = h_in + Attn(LN1(h_in))
    (2)  h_full  = a + FFN_full(LN2(a))
    (3)  h_cheap = a + FFN_cheap(LN2_cheap(a))
    (4)  h = m·h_full + (1 − m)·h_cheap          m ∈ {0,1} per token
    (5)  FFN_cheap(x) = W_down SiLU(W_up x)       rank r ≪ d_ff, W_down = 0 at init
    (6)  p = σ(u/τ)                               for the budget/alive losses and eq. (8)
    (7)  k = ⌈ρT⌉                                 top-k of u per sequence → m_hard
    (8)  m_st = sg(m_hard − p) + p                straight-through
    (9)  h = m_st·h_full + (1 − m_st)·h_cheap     training: both paths for every token
    (10) G1:  u = W2 SiLU(W1 h)                   hidden d/4
    (11) G3:  c = W_c sg(h)
    (12)      q_a = P([c; e_a]), a ∈ {full, cheap}
    (13)      u = D(q_full, q_cheap, q_full − q_cheap)
    (14) L_JEPA = Σ_a (1 − cos(q_a, z_a)),  z_a = sg(T(h*_a)), T fixed orthogonal d→d_s
    (15) u*_{l,t} = C̃E^cheap_{l,t} − C̃E^full_{l,t}   fork t at layer l, later layers full
    (16) C̃E_{l,t} = Σ_{δ<W} γ^δ CE_{l,t+δ}        cut at the sequence's end
    (17) L_util = Huber(u, u*)
    (18) L_rank = E_(i,j) softplus(−sign(u*_i − u*_j)(u_i − u_j))
    (19) L = L_LM + λ_JEPA L_JEPA + λ_util L_util + λ_rank L_rank + λ_b L_budget + λ_a L_alive
    (20) L_budget = 1/C Σ_l (p̄_l − ρ)²
    (21) L_alive  = 1/C Σ_l ReLU(p_min − p̄_l)

Deviations, and choices where the paper is silent (results/conddepth.md says why):
- the gate reads the FFN sub-layer input a (eq. 1), the only state there before the decision
- the controller runs in fp32, from PyTorch's fan-in init (GPT's 0.02 gave var(u) ~ 1e-12)
- inference routes causally, full iff u > θ_l, θ_l a running average of training's top-k cut
- the oracle forks each (l, t) from the dense prefix; a layer's B·T forks run in one batch
- rank pairs are (t, π(t)), π random per sequence, tied labels dropped; L_JEPA averages the layers
- A2 deranges the JEPA targets with one random B·T-cycle; eval never shuffles
- the paper preset's P/D widths are 64: they give its trainable counts (G1 828,484, G3 849,348)
- the backbone is frozen (§3.4) only with init_from; from scratch all trains (§7's future work)
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import NanorouteError

# §3.4: standard (G1, G3); A1 no JEPA; A2 deranged targets; A3 no util/rank; A4 λ_JEPA
STANDARD = dict(gate="G3", lam_jepa=1.0, lam_util=1.0, lam_rank=0.2, shuffle_targets=False)
NO_ORACLE = dict(lam_util=0.0, lam_rank=0.0)
RECIPES = {"G1": dict(gate="G1"), "G3": {}, "A1": dict(lam_jepa=0.0),
           "A2": dict(shuffle_targets=True), "A3-G1": dict(gate="G1", **NO_ORACLE),
           "A3-G3": NO_ORACLE, "A4-0.25": dict(lam_jepa=0.25), "A4-2": dict(lam_jepa=2.0)}
THRESHOLD_EMA = 0.05  # θ_l: a mean over the first 20 batches, then a running average


@dataclass
class Config(common.Config):
    n_controlled: int = 2  # C: the last C layers are controlled (paper 4 of 12)
    cheap_rank: int = 24  # r of eq. (5) (paper 80 = d_ff/32)
    tau: float = 2.0  # τ of eq. (6)
    rho: float = 0.5  # ρ of eq. (7): full-path budget
    recipe: str = ""  # one of RECIPES; fields it sets, if given too, must agree
    gate: str = ""  # "G1" (eq. 10) | "G3" (eqs. 11–14); "": the recipe's (standard: G3)
    g1_hidden: int = 0  # G1 hidden width (0 = d/4); larger: G1-costmatch
    d_c: int = 48  # G3 context width (paper 128)
    d_a: int = 16  # G3 action-embedding width
    d_s: int = 32  # G3 summary width (paper 64)
    pred_hidden: int = 32  # hidden width of P and of D (paper: 64 each)
    lam_jepa: float = -1.0  # λ_JEPA of eq. (19); -1: the recipe's (STANDARD: 1)
    lam_util: float = -1.0  # λ_util of eq. (19); -1: the recipe's (1)
    lam_rank: float = -1.0  # λ_rank of eq. (19); -1: the recipe's (0.2)
    lam_b: float = 1.0  # λ_b of eq. (19)
    lam_a: float = 0.5  # λ_a of eq. (19)
    p_min: float = 0.05  # p_min of eq. (21)
    shuffle_targets: bool = False  # A2: JEPA targets deranged
    oracle_window: int = 8  # W of eq. (16)
    oracle_gamma: float = 0.5  # γ of eq. (16)
    label_start: int = 100  # no oracle labels before this step ...
    label_every: int = 5  # ... then every 5 (util/rank 0 on others)
    controller_only: bool = True  # §3.4: freeze init_from's backbone
    mode: str = "causal"  # inference: "causal" (θ_l) | "topk" (the paper's)
    # training: shorter than the paper's (§4: AdamW 2e-4, wd 0.01)
    learning_rate: float = 1e-3
    min_lr: float = 1e-5
    weight_decay: float = 0.01
    warmup_iters: int = 30
    max_iters: int = 400
    eval_interval: int = 50
    eval_iters: int = 10
    model: str = "conddepth"

    def __post_init__(self):
        recipe = self.recipe
        if recipe not in ("", *RECIPES):
            raise NanorouteError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
        for k, v in {**STANDARD, **RECIPES.get(recipe, {})}.items():
            given = getattr(self, k)
            if given == getattr(Config, k):  # not given
                setattr(self, k, v)
            elif recipe and given != v:
                raise NanorouteError(f"recipe {recipe} sets {k}={v}; {k}={given} contradicts it")
        if not self.init_from:  # nothing trained to freeze
            self.controller_only = False
        super().__post_init__()
        ok = {"rho": (0 < self.rho <= 1, "in (0, 1]"),
              "gate": (self.gate in ("G1", "G3"), "G1 or G3"),
              "n_controlled": (1 <= self.n_controlled <= self.n_layer, "in [1, n_layer]"),
              "mode": (self.mode in ("causal", "topk"), "causal or topk"),
              "oracle_gamma": (0 <= self.oracle_gamma <= 1, "in [0, 1]"),
              "p_min": (0 <= self.p_min < 1, "in [0, 1)")}
        for k in "tau cheap_rank d_c d_a d_s pred_hidden oracle_window label_every".split():
            ok[k] = (getattr(self, k) > 0, "> 0")
        for k in "g1_hidden lam_jepa lam_util lam_rank lam_b lam_a label_start".split():
            ok[k] = (getattr(self, k) >= 0, ">= 0")
        for k, (good, want) in ok.items():
            if not good:
                raise NanorouteError(f"{k} must be {want}, got {getattr(self, k)!r}")
        if self.gate == "G1" and not (self.g1_hidden or self.n_embd // 4):  # W1: d → 0, u constant
            raise NanorouteError(f"G1's hidden width n_embd // 4 is 0 at n_embd={self.n_embd}: "
                                 "set g1_hidden >= 1 or n_embd >= 4")


PRESETS = {"paper": dict(n_layer=12, n_embd=640, n_head=10, block_size=256, n_controlled=4,
                         cheap_rank=80, d_c=128, d_a=16, d_s=64, pred_hidden=64, learning_rate=2e-4,
                         min_lr=2e-6, warmup_iters=1000, max_iters=20000, eval_interval=500,
                         eval_iters=16),
           # one command, no dense checkpoint: all trained jointly, no oracle (A3)
           "classroom": dict(common.CLASSROOM, recipe="A3-G1", controller_only=False, cheap_rank=16,
                             weight_decay=0.1),
           # common.GPU's model and tokens, the paper's controllers (C = 4 of 12, r = d_ff/32)
           # trained alone (§3.4) on a dense run of the same preset, or on GPT-2:
           #   python train.py --model gpt --dataset fineweb_edu --preset gpu
           #   python train.py --model conddepth --dataset fineweb_edu --preset gpu \
           #       --init_from out/gpt-fineweb_edu/ckpt.pt          (or --init_from gpt2)
           # micro-batches of 8 (×64): the oracle's forks hold B·nh·T·W·T scores
           "gpu": dict(common.GPU, n_controlled=4, cheap_rank=96, d_c=128, d_a=16, d_s=64,
                       pred_hidden=64, controller_only=True, learning_rate=2e-4, min_lr=2e-6,
                       weight_decay=0.01, batch_size=8, grad_accum=64)}


# Router: gates G1 (eq. 10) and G3 (eqs. 11–14), the top-k (eq. 7)

class GateG1(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg.g1_hidden or cfg.n_embd // 4
        self.w1 = nn.Linear(cfg.n_embd, h)
        self.w2 = nn.Linear(h, 1)

    def forward(self, a):
        return self.w2(F.silu(self.w1(a))).squeeze(-1), None  # u (B, T), eq. (10)


class GateG3(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg.pred_hidden
        self.w_c = nn.Linear(cfg.n_embd, cfg.d_c)
        self.e = nn.Parameter(torch.empty(2, cfg.d_a))  # e_full, e_cheap
        self.pred = nn.Sequential(nn.Linear(cfg.d_c + cfg.d_a, h), nn.SiLU(), nn.Linear(h, cfg.d_s))
        self.head = nn.Sequential(nn.Linear(3 * cfg.d_s, h), nn.SiLU(), nn.Linear(h, 1))
        self.target = nn.Linear(cfg.n_embd, cfg.d_s, bias=False).requires_grad_(False)  # T, fixed

    def forward(self, a):
        c = self.w_c(a.detach())  # (B, T, d_c), eq. (11): sg(h)
        e = self.e[:, None, None, :].expand(2, *c.shape[:2], -1)  # (2, B, T, d_a)
        qf, qc = self.pred(torch.cat([c.expand(2, *c.shape), e], -1))  # (B, T, d_s), eq. (12)
        u = self.head(torch.cat([qf, qc, qf - qc], -1)).squeeze(-1)  # (B, T), eq. (13)
        return u, (qf, qc)


def budget_k(rho, T):
    """k = ⌈ρT⌉ of eq. (7), at least 1 (rounded: 0.3·10 = 3.0000000000000004 gives 3)."""
    return max(1, math.ceil(round(rho * T, 6)))


def topk_mask(u, k):
    """(B, T) bool, eq. (7): exactly k True per row, the k highest u (torch.topk breaks ties)."""
    return torch.zeros_like(u, dtype=torch.bool).scatter_(-1, u.topk(k, dim=-1).indices, True)


class CheapFFN(nn.Module):
    """LN2_cheap then eq. (5): eq. (3)'s delta (attention and the full FFN: common.Block's)."""

    def __init__(self, cfg):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)  # its own LN, not shared with LN2
        self.up = nn.Linear(cfg.n_embd, cfg.cheap_rank)
        self.down = nn.Linear(cfg.cheap_rank, cfg.n_embd)

    def forward(self, a):
        return self.down(F.silu(self.up(self.ln(a))))


# The model: training (eqs. 7–9) and inference (causal θ; dense-hard or sparse)

class Model(common.LM):
    def __init__(self, cfg):
        super().__init__(cfg)
        C, Gate = cfg.n_controlled, GateG1 if cfg.gate == "G1" else GateG3
        self.blocks = nn.ModuleList([common.Block(cfg) for _ in range(cfg.n_layer)])
        self.cheap = nn.ModuleList([CheapFFN(cfg) for _ in range(C)])
        self.gates = nn.ModuleList([Gate(cfg) for _ in range(C)])
        theta = -math.inf if cfg.rho >= 1 else math.inf  # untrained: all full if ρ = 1, else cheap
        self.register_buffer("thresholds", torch.full((C,), theta))  # θ_l
        self.register_buffer("threshold_batches", torch.zeros(C))  # batches θ_l has averaged
        self.init_weights()
        for ffn in self.cheap:  # eq. (5): cheap = identity at init (its bias is 0)
            nn.init.zeros_(ffn.down.weight)
        for g in self.gates:  # fan-in init
            g.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
            if cfg.gate == "G3":
                nn.init.normal_(g.e)  # distinct actions: q_full ≠ q_cheap
                nn.init.orthogonal_(g.target.weight)  # T: orthogonal, frozen
        for name, p in self.named_parameters():  # §3.4
            routers = name.startswith(("cheap.", "gates."))
            p.requires_grad = ".target." not in name and (routers or not cfg.controller_only)
        self.mode = cfg.mode  # switchable
        self.label_now = False

    def on_step(self, it):
        """Before every step (train.py): is it one of §3.3's label steps?"""
        cfg = self.cfg
        self.label_now = (cfg.lam_util > 0 or cfg.lam_rank > 0) and it >= cfg.label_start \
            and (it - cfg.label_start) % cfg.label_every == 0

    def train_flops_per_token(self, T, stats=None):
        """Eq. (9): both FFNs for every controlled token, and its controller (with T of eq. 14);
        the oracle's forks on its label steps are not counted."""
        cfg = self.cfg
        both = common.flops_ffn(cfg.n_embd, cfg.cheap_rank) + controller_flops(cfg, train=True)
        return float(common.dense_flops_per_token(cfg, T) + cfg.n_controlled * both)

    def controller(self, j, a):
        """Gate j on a (B, T, d) -> u (B, T) and G3's (q_full, q_cheap) or None; at least fp32."""
        with torch.autocast(a.device.type, enabled=False):
            return self.gates[j](a.to(torch.promote_types(a.dtype, torch.float32)))

    def forward(self, idx, targets=None, sparse=False):
        if sparse and self.training:
            raise NanorouteError("sparse=True is an inference path: call model.eval() first")
        x = self.embed(idx)  # (B, T, d)
        for block in self.blocks[:self.cfg.n_layer - self.cfg.n_controlled]:
            x = block(x)
        topk = self.training or self.mode == "topk"  # training: always the top-k
        controlled = sparse_controlled if sparse else Model.controlled
        h, r = controlled(self, x, topk, sparse, targets is not None)
        logits, lm_loss = self.head(h, targets)
        self.last_masks = r["m"]  # per layer (B, T)
        if lm_loss is None:
            return logits, None, {}
        loss, stats = total_loss(self, x, targets, lm_loss, r)  # eq. (19)
        if not self.training:  # training's computation (top-k, eq. 9) too
            soft = lm_loss if topk else self.head(self.controlled(x, True)[0], targets)[1]
            stats["soft_loss"] = soft.detach()
        return logits, loss, stats

    def controlled(self, x, topk, sparse=False, losses=False):
        """x (B, T, d) through the controlled layers -> (h, each layer's u, m, p, JEPA terms)."""
        cfg = self.cfg
        B, T, _ = x.shape
        k = budget_k(cfg.rho, T)
        r = {"u": [], "m": [], "p": [], "jepa": []}
        for j, block in enumerate(self.blocks[-cfg.n_controlled:]):
            a = x + block.attn_delta(x)  # (B, T, d), eq. (1)
            u, q = self.controller(j, a)  # (B, T) fp32
            p = torch.sigmoid(u / cfg.tau)  # eq. (6)
            if topk:
                m = topk_mask(u.detach(), k)  # (B, T) bool, eq. (7)
            else:
                m = u > self.thresholds[j]  # the causal inference rule
            if self.training and k < T:  # θ_j averages this batch's top-k cut
                cut = u.detach().flatten().topk(k * B + 1).values[-2:].mean()  # midway: kB-th, next
                n = self.threshold_batches[j]
                beta = (1 / (n + 1)).clamp(min=THRESHOLD_EMA)
                theta = self.thresholds[j]
                self.thresholds[j] = torch.where(n == 0, cut, theta + beta * (cut - theta))
                self.threshold_batches[j] += 1
            for key, t in zip("ump", (u, m, p)):
                r[key].append(t)
            if sparse:
                x = sparse_ffn(block, self.cheap[j], a, m)
                continue
            h_full = a + block.ffn_delta(a)  # eq. (2)
            h_cheap = a + self.cheap[j](a)  # eq. (3)
            if self.training:
                m_st = ((m.float() - p).detach() + p)[..., None]  # (B, T, 1), eq. (8)
                x = m_st * h_full + (1 - m_st) * h_cheap  # eq. (9)
            else:
                x = torch.where(m[..., None], h_full, h_cheap)  # eq. (4), hard
            if q is not None and losses:
                shuffle = cfg.shuffle_targets and self.training  # A2
                r["jepa"].append(jepa_terms(self.gates[j].target, *q, h_full, h_cheap, shuffle))
        return x, r

    @torch.no_grad()
    def routing_map(self, idx):
        """m (C, T) of idx's first row as inference routes it (1 = full), row names, legend."""
        was_training = self.training
        self.eval()(idx)
        self.train(was_training)
        L, C = self.cfg.n_layer, self.cfg.n_controlled
        m = torch.stack([mk[0].float() for mk in self.last_masks]).cpu()  # (C, T)
        return m, [f"layer {L - C + j}" for j in range(C)], ("cheap FFN", "full FFN")

    @torch.no_grad()
    def step(self, tok, state=None):
        """Cached decoding: tok (B, T') after the past in state = (KVCaches, position), or a
        prompt (state None) -> (logits, state). Routing: full iff u > θ_l, as in forward."""
        if state is None and self.mode != "causal":
            raise NanorouteError("cached decoding routes causally: mode='topk' looks at future "
                                 "tokens (use mode='causal', or use_cache=False)")
        L, C, S = self.cfg.n_layer, self.cfg.n_controlled, self.cfg.block_size
        prompt = state is None
        caches, pos = state or ([None] * L, torch.tensor(0, device=tok.device))
        x = self.embed(tok) if prompt else self.wte(tok) + self.wpe(pos)  # (B, T', d)
        mask = None if prompt else common.past_mask(pos, S, caches[0].k.dtype)  # (1, S)
        for i, block in enumerate(self.blocks):
            q, k, v = block.attn.qkv(block.ln_1(x))  # 3 × (B, nh, T', hs)
            if prompt:
                caches[i] = common.KVCache(x.size(0), S, k, v)
            else:
                k, v = caches[i].append(pos, k, v)  # (B, nh, S, hs)
            a = x + block.attn.c_proj(block.attn.attend(q, k, v, attn_mask=mask))  # eq. (1)
            j = i - (L - C)  # controlled: j >= 0
            if j < 0:
                x = a + block.ffn_delta(a)
                continue
            full = self.controller(j, a)[0] > self.thresholds[j]  # (B, T')
            if torch.compiler.is_compiling():  # one graph, no host sync: both FFNs, rows select
                x = torch.where(full[..., None], a + block.ffn_delta(a), a + self.cheap[j](a))
            elif full.numel() == 1:  # one token: the host decides, only its FFN runs
                x = a + (block.ffn_delta(a) if full.item() else self.cheap[j](a))
            else:  # the rows that run each FFN are selected
                x = sparse_ffn(block, self.cheap[j], a, full)
        return self.head(x[:, -1:])[0][:, -1], (caches, pos + tok.size(1))

    prefill = step  # prefill(idx): no state yet

    def decodes_cached(self, use_cache=True):
        """mode="topk" has no causal cache: generate recomputes the window."""
        return super().decodes_cached(use_cache) and self.mode == "causal"


# Losses: eq. (19) and its terms; the oracle's labels (eqs. 15–16)

def total_loss(model, x, targets, lm_loss, r):
    """Eq. (19) and the logged statistics; x (B, T, d): the controlled layers' input."""
    cfg, L, C = model.cfg, model.cfg.n_layer, model.cfg.n_controlled
    full = torch.stack([m.float().mean() for m in r["m"]])  # (C,) shares on the full path
    p_bar = torch.stack([p.mean() for p in r["p"]])  # (C,)
    budget = ((p_bar - cfg.rho) ** 2).mean()  # eq. (20)
    alive = F.relu(cfg.p_min - p_bar).mean()  # eq. (21)
    ratio = flops_per_token(cfg, x.size(1), full) / common.dense_flops_per_token(cfg, x.size(1))
    stats = {"gate_prob": p_bar.mean().detach(), "full_ratio": full.mean(),
             "skipped": 1 - full.mean(), "flops_saved_hard": 1 - ratio,
             "budget": budget.detach(), "alive": alive.detach(),
             "util_var": torch.stack([u.detach().var(correction=0) for u in r["u"]]).mean(),
             **{f"skip_l{L - C + j}": 1 - f for j, f in enumerate(full)}}
    util = rank = jepa = zero = lm_loss.new_zeros(())
    if r["jepa"]:  # G3: each term's mean over the C layers
        jepa, l2, cos = (torch.stack(t).mean() for t in zip(*r["jepa"]))
        stats.update(jepa=jepa.detach(), qf_qc_l2=l2, qf_qc_cos=cos)
    labelled = model.training and model.label_now
    if labelled:
        pairs = list(zip(r["u"], oracle_labels(model, x.detach(), targets)))  # C × (u, u*)
        util = torch.stack([F.huber_loss(u, us.to(u.dtype)) for u, us in pairs]).mean()  # eq. (17)
        rank = torch.stack([rank_loss(u, us.to(u.dtype)) for u, us in pairs]).mean()  # eq. (18)
    loss = lm_loss + cfg.lam_jepa * jepa + cfg.lam_util * util + cfg.lam_rank * rank \
        + cfg.lam_b * budget + cfg.lam_a * alive
    stats.update(lm_loss=lm_loss.detach(), util=util.detach(), rank=rank.detach(),
                 label_step=zero + labelled)
    return loss, stats


def jepa_terms(target, qf, qc, h_full, h_cheap, shuffle):
    """Eq. (14) of one layer; ‖q_f − q_c‖ and cos(q_f, q_c), §5.2's collapse diagnostics."""
    with torch.autocast(qf.device.type, enabled=False):
        z = target(torch.stack([h_full, h_cheap]).detach().to(qf.dtype))  # (2, B, T, d_s)
    if shuffle:
        z = z.flatten(1, 2)[:, derangement(z.size(1) * z.size(2), z.device)].view_as(z)
    cos = lambda q, z: F.cosine_similarity(q, z, dim=-1)
    loss = (2 - cos(qf, z[0]) - cos(qc, z[1])).mean()
    qf, qc = qf.detach(), qc.detach()
    return loss, (qf - qc).norm(dim=-1).mean(), cos(qf, qc).mean()


def derangement(n, device):
    """A permutation of n ≥ 2 without fixed points: an n-cycle through a random order."""
    order = torch.randperm(n, device=device)
    return torch.empty_like(order).scatter_(0, order, order.roll(-1))  # order[i] -> order[i+1]


def rank_loss(u, u_star):
    """Eq. (18) over the pairs (t, π(t)); pairs with tied labels are dropped."""
    perm = torch.randperm(u.size(1), device=u.device)
    s = torch.sign(u_star - u_star[:, perm])  # (B, T)
    loss = F.softplus(-s * (u - u[:, perm]))
    return (loss * (s != 0)).sum() / (s != 0).sum().clamp(min=1)


def token_ce(model, h, targets):
    """The head's cross-entropy per token of h (..., d) -> (...); 0 at ignored targets."""
    logits, _ = model.head(h)
    logits = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    ce = F.cross_entropy(logits, targets.flatten(), ignore_index=-1, reduction="none")
    return ce.view(targets.shape)


@torch.no_grad()
def oracle_labels(model, x, targets):
    """u*_l (B, T) of eqs. (15)–(16) of each controlled layer, from their input x (B, T, d)."""
    cfg, C, W = model.cfg, model.cfg.n_controlled, model.cfg.oracle_window
    B, T, d = x.shape
    nh = cfg.n_head
    kv, outs, cheap_outs = [], [], []
    for j, block in enumerate(model.blocks[-C:]):  # the dense pass
        q, k, v = block.attn.qkv(block.ln_1(x))  # 3 × (B, nh, T, hs)
        a = x + block.attn.c_proj(block.attn.attend(q, k, v))
        cheap_outs.append(a + model.cheap[j](a))  # eq. (3)
        x = a + block.ffn_delta(a)
        kv.append((block, k, v))
        outs.append(x)
    ce_full = token_ce(model, x, targets)  # (B, T)
    t, w = torch.arange(T, device=x.device), torch.arange(W, device=x.device)
    pos = t[:, None] + w  # (T, W): the window of the fork at t
    valid = pos < T
    pos = pos.clamp(max=T - 1)
    decay = cfg.oracle_gamma ** w * valid  # (T, W)
    see_dense = (t[:, None] > t)[:, None]  # (T, 1, T): key s < t
    see_fork = (w[:, None] >= w) & valid[:, None]  # (T, W, W): w' <= w
    labels = []
    for j in range(C):
        h = outs[j][:, pos]  # (B, T, W, d): layer j's dense outputs, the forked token cheap
        h[:, :, 0] = cheap_outs[j]
        for block, K, V in kv[j + 1:]:  # each later layer, all forks at once
            qkv = block.attn.c_attn(block.ln_1(h)).view(B, T, W, 3, nh, d // nh)
            q, k, v = qkv.permute(3, 0, 4, 1, 2, 5)  # 3 × (B, nh, T, W, hs)
            s_dense = torch.einsum("bhtwe,bhse->bhtws", q, K).float()  # (B, nh, T, W, T)
            s_fork = torch.einsum("bhtwe,bhtve->bhtwv", q, k).float()  # (B, nh, T, W, W)
            s = torch.cat([s_dense.masked_fill(~see_dense, -math.inf),
                           s_fork.masked_fill(~see_fork, -math.inf)], -1)
            att = (s / math.sqrt(d // nh)).softmax(-1).to(v.dtype)  # (B, nh, T, W, T + W)
            y = torch.einsum("bhtws,bhse->bhtwe", att[..., :T], V)  # (B, nh, T, W, hs): dense ...
            y = y + torch.einsum("bhtwv,bhtve->bhtwe", att[..., T:], v)  # ... and the window's
            h = h + block.attn.c_proj(y.permute(0, 2, 3, 1, 4).reshape(B, T, W, d))
            h = h + block.ffn_delta(h)
        ce = token_ce(model, h, targets[:, pos])  # (B, T, W)
        labels.append(((ce - ce_full[:, pos]) * decay).sum(-1))  # eqs. (15)–(16)
    return labels


# Sparse inference: each token runs its own FFN only

# Model.controlled compiled as one graph whatever the counts sparse_ffn gathers (symbols)
sparse_controlled = torch._dynamo.config.patch(capture_scalar_outputs=True)(Model.controlled)


def sparse_ffn(block, cheap, a, m):
    """Eq. (4) on a (B, T, d) under m (B, T): the full FFN on m's tokens, the cheap on the rest."""
    x, m = a.reshape(-1, a.size(-1)), m.reshape(-1)  # (N, d), (N,)
    order = torch.argsort(m.byte(), descending=True, stable=True)  # (N,): full tokens first
    n = int(m.sum())  # the full tokens' count sets the gathered shapes
    out = torch.empty_like(x)
    for i, ffn in ((order[:n], block.ffn_delta), (order[n:], cheap)):  # eqs. (2), (3)
        out[i] = x[i] + ffn(x[i])  # (n, d), (N − n, d)
    return out.view_as(a)


# Compute: inference FLOPs per token; §4's proxies in FFN units

def controller_flops(cfg, train):
    """One gate's forward FLOPs per token, in training (T of eq. 14 too) or at inference."""
    d, h = cfg.n_embd, cfg.pred_hidden
    if cfg.gate == "G1":
        h = cfg.g1_hidden or d // 4
        return 2 * (d * h + h)
    f = 2 * d * cfg.d_c  # W_c
    f += 2 * 2 * ((cfg.d_c + cfg.d_a) * h + h * cfg.d_s)  # P, per action
    f += 2 * (3 * cfg.d_s * h + h)  # D
    return f + (2 * 2 * d * cfg.d_s if train else 0)  # T on both branch outputs


def flops_per_token(cfg, T, full):
    """Inference FLOPs per token, layer l running the full FFN on a share full[l] of tokens."""
    full = torch.as_tensor(full, dtype=torch.float32)
    d = cfg.n_embd
    ffn, cheap = common.flops_ffn(d, 4 * d), common.flops_ffn(d, cfg.cheap_rank)
    routed = full * ffn + (1 - full) * cheap + controller_flops(cfg, train=False)
    return common.dense_flops_per_token(cfg, T) + (routed - ffn).sum()


def infer_vs_full(cfg):
    """Paper §4, inference in FFN units: ρ + (1 − ρ)·r/d_ff + ctrl/FFN."""
    ffn, cheap = common.flops_ffn(cfg.n_embd, 4 * cfg.n_embd), cfg.cheap_rank / (4 * cfg.n_embd)
    return cfg.rho + (1 - cfg.rho) * cheap + controller_flops(cfg, train=False) / ffn


def compute_vs_full(cfg):
    """Paper §4, training in FFN units: 1 + r/d_ff + ctrl/FFN + f_label·oracle/C."""
    ffn, cheap = common.flops_ffn(cfg.n_embd, 4 * cfg.n_embd), cfg.cheap_rank / (4 * cfg.n_embd)
    C = cfg.n_controlled
    n_label = max(0, math.ceil((cfg.max_iters - cfg.label_start) / cfg.label_every))
    f_label = n_label / cfg.max_iters if cfg.lam_util or cfg.lam_rank else 0.0
    oracle = f_label * (C + C * cheap + cfg.oracle_window * C * (C - 1) / 2) / C  # dense, forks
    return 1 + cheap + controller_flops(cfg, train=True) / ffn + oracle


def main(argv):
    """python conddepth.py: §4's compute proxies of the recipes at paper size (train: train.py)"""
    if argv in (["-h"], ["--help"]):
        return print("usage: " + main.__doc__)
    if argv:
        raise NanorouteError(f"conddepth.py takes no arguments, got {' '.join(argv)}")
    print("recipe   FFN units: inference, training")
    for recipe in RECIPES:
        cfg = Config(**PRESETS["paper"], recipe=recipe)
        print(f"{recipe:8} {infer_vs_full(cfg):.3f}, {compute_vs_full(cfg):.3f}")


if __name__ == "__main__":
    common.cli(main)
