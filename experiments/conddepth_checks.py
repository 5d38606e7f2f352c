"""
Two measurements on a trained conddepth run (results/conddepth.md, "Causal inference" and "The oracle"):

  python experiments/conddepth_checks.py /work/runs/conddepth/G1-s42

1. Future tokens: how far the second half of 16 validation windows moves the logits of the first half, under the
   paper's top-k routing and under the causal thresholds θ (what inference runs).
2. Oracle labels: the paper's per-token fork (conddepth.oracle_labels) against the cheaper all-tokens-of-a-layer
   fork (what this file did before), from the dense prefix and from the gated (top-k) prefix, on 8 training batches.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import conddepth as cd  # noqa: E402


@torch.no_grad()
def future_tokens(m, cfg, meta, val):
    x, _ = common.get_batch(val, meta, 16, cfg.block_size, np.random.default_rng(5))
    T, h = x.size(1), x.size(1) // 2
    x2 = x.clone()
    x2[:, h:] = torch.from_numpy(np.random.default_rng(6).integers(0, cfg.vocab_size, (16, T - h)))
    for mode in ("topk", "causal"):
        m.mode = mode
        a, ma = m(x)[0][:, :h], torch.stack(m.last_masks)[..., :h]
        b, mb = m(x2)[0][:, :h], torch.stack(m.last_masks)[..., :h]
        print(f"{mode}: max |Δ logits| at positions < {h} when positions >= {h} change: {(a - b).abs().max():.4f}; "
              f"routing decisions there that change: {(ma != mb).float().mean():.3f}")


@torch.no_grad()
def oracle(m, cfg, meta, train):
    L, C, W, g = cfg.n_layer, cfg.n_controlled, cfg.oracle_window, cfg.oracle_gamma
    pairs = {"all-tokens fork, dense prefix": [[] for _ in range(C)], "all-tokens fork, gated prefix": [[] for _ in range(C)]}
    for b in range(8):
        x, y = common.get_batch(train, meta, 16, cfg.block_size, np.random.default_rng([7, b]))
        h = m.embed(x)
        for block in m.blocks[:L - C]:
            h = block(h)
        token = m.oracle_labels(h, y)
        for kind, out in pairs.items():
            z_in = h
            for j, block in enumerate(m.blocks[L - C:]):
                a = z_in + block.attn_delta(z_in)
                full, cheap = a + block.ffn_delta(a), a + m.cheap[j](a)
                ce = []
                for z in (full, cheap):  # every later layer full
                    for later in m.blocks[L - C + j + 1:]:
                        z = later(z)
                    ce.append(cd.windowed_ce(m.token_ce(z, y), W, g))
                out[j].append((token[j].flatten(), (ce[1] - ce[0]).flatten()))
                gated = cd.topk_mask(m.controller(j, a)[0], cd.budget_k(cfg.rho, x.size(1)))[..., None]
                z_in = torch.where(gated, full, cheap) if "gated" in kind else full
    rank = lambda v: v.argsort().argsort().double()
    for kind, out in pairs.items():
        for j in range(C):
            a, b = (torch.cat(v).double() for v in zip(*out[j]))
            top = lambda v: v >= v.median()
            print(f"per-token fork vs {kind}, layer {L - C + j}: Pearson {np.corrcoef(a, b)[0, 1]:.3f}, Spearman "
                  f"{np.corrcoef(rank(a), rank(b))[0, 1]:.3f}, top-50% sets agree on {(top(a) == top(b)).double().mean():.1%}")


def main(run_dir):
    torch.set_num_threads(1)
    ckpt = common.load_checkpoint(os.path.join(run_dir, "ckpt.pt"))
    cfg = cd.Config(**ckpt["config"])
    m = cd.Model(cfg)
    m.load_state_dict(ckpt["model"])
    m.eval()
    meta = common.load_meta(cfg.dataset, cfg.data_dir)
    future_tokens(m, cfg, meta, common.load_split(cfg.dataset, "val", cfg.data_dir))
    oracle(m, cfg, meta, common.load_split(cfg.dataset, "train", cfg.data_dir))


if __name__ == "__main__":
    main(sys.argv[1])
