"""Throughput accounting: the FLOPs a training step executed (a router's own), the GPUs' peak
FLOP/s, tokens/s and MFU, pinned by value."""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import common
import conddepth
import dtrnet
import hybrid_attn
import tsa

SMALL = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=65, block_size=32)
# the dense GPT at SMALL, T = 32, per token: per layer Q/K/V 6d² + W_O 2d² + FFN 16d² + scores
# 4d·(T+1)/2, then the head 2dV: 2 · (24 · 4096 + 4 · 64 · 16.5) + 2 · 64 · 65
DENSE_SMALL = 2 * (24 * 4096 + 4 * 64 * 16.5) + 2 * 64 * 65


def test_dense_gpt_executes_the_dense_count():
    model = common.Model(common.Config(**SMALL))
    assert DENSE_SMALL == 213_376
    assert model.train_flops_per_token(32) == DENSE_SMALL


def test_tsa_training_runs_every_block_and_its_routers():
    """Training gates (eqs. 3–4) and skips nothing: the dense count plus L − 1 routers of
    2(d·d/4 + d/4) = 2080 FLOPs; the early-exit baseline: plus L − 1 exit heads of 2dV = 8320."""
    model = tsa.Model(tsa.Config(**SMALL))
    assert model.train_flops_per_token(32, {}) == DENSE_SMALL + 2080
    exit_model = tsa.build(tsa.Config(**SMALL, variant="early_exit"))
    assert exit_model.train_flops_per_token(32, {}) == DENSE_SMALL + 8320


def test_dtrnet_counts_what_its_packed_pass_ran():
    """A router that skips work shows it: the training forward's own flops_ratio."""
    cfg = dtrnet.Config(**{**SMALL, "n_layer": 3})  # T D T: one routed layer
    model = dtrnet.Model(cfg).train()
    x = torch.randint(0, 65, (4, 32), generator=torch.Generator().manual_seed(0))
    _, _, stats = model(x, x)
    fracs = [stats[f"frac_l{i}"] for i in model.d_layers]
    got = model.train_flops_per_token(32, stats)
    assert got == pytest.approx(float(dtrnet.flops_per_token(cfg, 32, fracs)), rel=1e-6)
    assert model.train_flops_per_token(32, {"flops_ratio": torch.tensor(0.75)}) \
        == pytest.approx(0.75 * common.dense_flops_per_token(cfg, 32))


def test_hybrid_training_runs_both_mixers():
    """Pattern "S R": a softmax layer, then a routed one that in training runs softmax attention
    and the Gated DeltaNet for every token, and its router's 2 logits (2·d·2)."""
    cfg = hybrid_attn.Config(**SMALL, pattern="S R")
    model = hybrid_attn.Model(cfg)
    write, read = hybrid_attn.flops_gdn(cfg)
    got = model.train_flops_per_token(32, {"skipped": 0.9})  # skips nothing in training
    assert got == DENSE_SMALL + 2 * 64 * 2 + write + read


def test_conddepth_training_runs_both_ffns_and_the_controllers():
    """Eq. (9): every controlled token runs the full and the cheap FFN (2·2·d·r) and its gate."""
    cfg = conddepth.Config(**SMALL, n_controlled=1)
    model = conddepth.Model(cfg)
    cheap = 2 * 2 * 64 * cfg.cheap_rank
    gate = conddepth.controller_flops(cfg, train=True)
    assert model.train_flops_per_token(32, {"flops_saved_hard": 0.3}) \
        == DENSE_SMALL + cheap + gate
    if cfg.gate == "G1":  # hidden d/4: 2(d·16 + 16)
        assert gate == 2 * (64 * 16 + 16)


def test_a_training_step_is_three_forwards():
    """FlopCounterMode sees the backward of every matmul at twice its forward."""
    torch.manual_seed(0)
    model = common.Model(common.Config(**SMALL))
    x = torch.randint(0, 65, (2, 32))
    with FlopCounterMode(display=False) as fwd:
        model(x, x)
    with FlopCounterMode(display=False) as step:
        model(x, x)[1].backward()
    assert step.get_total_flops() == common.train_flops(fwd.get_total_flops(), 1)
    assert common.train_flops(1000, 10) == 30_000


def test_throughput_and_mfu_by_value():
    # 16 × 1024 tokens in 0.5 s at 1 GFLOP per token forward on an H100 SXM's 989 TFLOP/s bf16
    tps, mfu = common.throughput(1e9, 16 * 1024, 0.5, 989e12)
    assert tps == 32_768
    assert mfu == pytest.approx(3e9 * 32_768 / 989e12) and round(mfu, 4) == 0.0994
    assert common.throughput_text(tps, mfu) == "32,768 tok/s, MFU 9.9%"
    assert common.throughput(1e9, 100, 0.5, None) == (200, None)
    assert common.throughput_text(200, None) == "200 tok/s, MFU: peak unknown"


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),  # the SXM card's name
    ("NVIDIA H100 80GB HBM3", "fp32", 67e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H100 PCIe", "fp32", 51e12),
    ("NVIDIA H200", "bf16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100-PCIE-40GB", "fp32", 19.5e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA L40S", "bf16", None),  # not an L4
    ("NVIDIA A10", "bf16", 125e12),
    ("NVIDIA A10G", "fp32", 31.2e12),
    ("NVIDIA A10G", "bf16", None),  # no datasheet: unknown, not guessed
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
    ("NVIDIA GeForce RTX 3090", "bf16", 71e12),
    ("NVIDIA GeForce RTX 3090 Ti", "bf16", None),
    ("Tesla V100-SXM2-16GB", "fp16", 125e12),
    ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores
    ("Tesla V100-PCIE-32GB", "fp16", 112e12),
    ("Tesla V100-PCIe-16GB", "fp16", 112e12),  # names differ in case: matched ignoring it
    ("Tesla T4", "fp16", 65e12),
    ("Tesla T4", "fp32", 8.1e12),
    ("NVIDIA GeForce GTX 1080", "fp32", None),
])
def test_gpu_peaks_by_name(monkeypatch, name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert common.peak_flops(torch.device("cuda"), dtype) == peak


def test_peak_unknown_off_cuda_and_a_given_peak_wins(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert common.peak_flops("cpu", "fp32") is None
    assert common.peak_flops("mps", "fp32") is None
    assert common.peak_flops("cpu", "fp32", peak=2e12) == 2e12
    assert common.peak_flops("cuda", "bf16", peak=5e14) == 5e14
    assert common.peak_flops("cpu", "fp32", peak=0.5) == 0.5  # any positive number
    for bad in (0, -1.0, math.inf, math.nan, "1e12"):
        with pytest.raises(common.NanorouteError, match="peak FLOP/s must be a positive number"):
            common.peak_flops("cpu", "fp32", peak=bad)


def test_mod_counts_the_k_tokens_its_routed_blocks_ran():
    """MoD's training runs its routed block on k = ⌈0.1·32⌉ = 4 of 32 tokens (⌊·⌋ would be 3): by
    hand at d = 64, blocks T R:
    dense block 98,304 + scores 4·64·16.5; routed 4/32 · (98,304 + scores over the 4 chosen,
    4·64·2.5) + its router 2·64; the head 2·64·65."""
    import mod
    model = mod.Model(mod.Config(**SMALL, capacity=0.1))
    assert model.train_flops_per_token(32) == 102528 + 12496 + 8320


def test_the_peak_is_the_named_gpus(monkeypatch):
    """cuda:1's peak is GPU 1's, not the current device's."""
    names = {None: "NVIDIA H100 80GB HBM3", 0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device=None: names[None if device is None else torch.device(
                            device).index])
    assert common.peak_flops(torch.device("cuda:1"), "bf16") == 312e12
    assert common.peak_flops("cuda:0", "bf16") == 989e12
