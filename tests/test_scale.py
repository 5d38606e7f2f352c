"""The papers' scale on one GPU: gradient accumulation (N micro-batches of B are one batch of N·B,
but for the routers' batch statistics, each checked against its formula), throughput in the log,
the gpu presets, and experiments/scale.py's smoke path."""
import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import sys
import re

import numpy as np
import pytest
import torch

import common
import conddepth
from conftest import ROOT, killed_at
import dtrnet
import hybrid_attn
import mod
import train
import tsa

SMALL = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=50, block_size=16)
SMALL3 = dict(SMALL, n_layer=3)
B, N = 2, 3  # micro-batch size, micro-batches per step
CPU = torch.device("cpu")


def batch(skew=False):
    """One batch of N·B sequences (x, y), and the same split into N micro-batches of B. skew: the
    first micro-batch repeats one token, so a router sees micro-batches unlike each other."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (N * B, 16), generator=g)
    y = torch.randint(0, 50, (N * B, 16), generator=g)
    if skew:
        x[:B] = 0
    return [(x, y)], [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(N)]


LR = 1e-2


def step(model, batches):
    """train.accumulate on a copy, then one AdamW step -> (loss, stats, grads, params, the copy)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loss, stats = train.accumulate(model, batches, CPU)
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    opt.step()
    return loss, stats, grads, {k: p.detach().clone() for k, p in model.named_parameters()}, model


def assert_same_step(model, atol=1e-6):
    full, micro = batch()
    loss_f, _, grads_f, params_f, _ = step(model, full)
    loss_m, _, grads_m, params_m, _ = step(model, micro)
    assert loss_m.item() == pytest.approx(loss_f.item(), rel=1e-5)
    assert grads_f.keys() == grads_m.keys() and len(grads_f) > 4
    for k in grads_f:
        torch.testing.assert_close(grads_m[k], grads_f[k], atol=atol, rtol=1e-4, msg=k)
    for k in params_f:  # AdamW's g/√v turns float noise in a gradient near 0 into a share of lr
        torch.testing.assert_close(params_m[k], params_f[k], atol=LR / 100, rtol=0, msg=k)


def no_gumbel(monkeypatch):
    """The hybrid's Gumbel noise is drawn per call: N micro-batches draw other noise than one big
    batch. Zero noise leaves what accumulation itself changes."""
    monkeypatch.setattr(hybrid_attn, "gumbel_like", torch.zeros_like)


def models():
    torch.manual_seed(0)
    hard = tsa.Model(tsa.Config(**SMALL3, hard_ft_iters=5, max_iters=5))
    hard.on_step(0)  # the straight-through phase, routers trained
    return {
        "gpt": common.Model(common.Config(**SMALL)),
        "tsa": tsa.Model(tsa.Config(**SMALL3, lam=0.5)),  # depth loss: a mean, exact
        "tsa-hard": hard,
        "tsa-early-exit": tsa.build(tsa.Config(**SMALL, variant="early_exit")),
        "dtrnet-lam0": dtrnet.Model(dtrnet.Config(**SMALL3, lam=0.0)),
        "conddepth-no-budget": conddepth.Model(conddepth.Config(**SMALL, n_controlled=1,
                                                                lam_b=0.0, p_min=0.0)),
        # MoD: top-k per sequence and a BCE mean over tokens: nothing over the batch
        "mod": mod.Model(mod.Config(**SMALL3, every=1, capacity=0.5)),
        "mod-mlp": mod.Model(mod.Config(**SMALL3, predictor="mlp")),
        "hybrid-no-balance": hybrid_attn.Model(hybrid_attn.Config(**SMALL, pattern="S R",
                                                                  balance=0.0)),
    }


@pytest.mark.parametrize("name", list(models()))
def test_micro_batches_equal_one_big_batch(name, monkeypatch):
    """Where every loss term is a mean over tokens or sequences, N micro-batches of B give one
    batch of N·B's gradients and AdamW step (to float tolerance). Seen failing with the loss not
    divided by N, and divided by N twice."""
    no_gumbel(monkeypatch)
    assert_same_step(models()[name].train())


def sharpen(*layers, by=30.0):
    """A router's layers scaled: decisions that differ between micro-batches."""
    with torch.no_grad():
        for layer in layers:
            layer.weight *= by


def micro_and_full(model, monkeypatch, key):
    """One step of model (in float64: the differences are small) on the skewed batch ->
    (accumulated minus full-batch loss, the same of stats[key], each micro-batch's stats)."""
    no_gumbel(monkeypatch)
    model.double()
    full, micro = batch(skew=True)
    per_micro = [copy.deepcopy(model)(x, y)[2] for x, y in micro]
    (loss_m, stats_m), (loss_f, stats_f) = (step(model, b)[:2] for b in (micro, full))
    return (loss_m - loss_f).item(), (stats_m[key] - stats_f[key]).item(), per_micro


def test_dtrnet_alpha_is_each_micro_batchs(monkeypatch):
    """Eq. (7)'s α_l = f_l / Σf is a ratio of batch counts: accumulated, the step's routing loss is
    mean_m Σ_l α_l^m ḡ_l^m, not Σ_l α_l ḡ_l with α and ḡ over the N·B batch."""
    torch.manual_seed(0)
    lam = 0.5
    model = dtrnet.Model(dtrnet.Config(**dict(SMALL, n_layer=5), layers="TDDDT", lam=lam)).train()
    for i in model.d_layers:
        sharpen(model.blocks[i].router.w1, model.blocks[i].router.w2)
    diff, route_diff, _ = micro_and_full(model, monkeypatch, "route_loss")
    g, f = [], []  # (N, L_D) ḡ_l^m, f_l^m / (B·T)
    with torch.no_grad():
        for x, _ in batch(skew=True)[1]:
            routes = model.trunk(model.embed(x), packed=True)[1]
            g.append(torch.stack([r[0].mean() for r in routes]))
            f.append(torch.stack([r[1].float().mean() for r in routes]))
    g, f = torch.stack(g).double(), torch.stack(f).double()
    alpha_m = f / f.sum(1, keepdim=True)
    alpha = f.mean(0) / f.mean(0).sum()
    want = ((alpha_m * g).sum(1).mean() - (alpha * g.mean(0)).sum()).item()
    assert abs(want) > 1e-3  # the example shows the difference
    assert route_diff == pytest.approx(want, rel=1e-5)  # f_l: counted in fp32
    assert diff == pytest.approx(lam * want, abs=1e-6)  # the LM loss (fp32): the same


def test_hybrid_balance_loss_differs_by_a_covariance(monkeypatch):
    """Switch's N·Σ_i f_i P_i is a product of two batch means: accumulated, the step's loss is
    the full batch's plus α·(N/n_R)·Σ_{r,i} Cov_m(f_ri^m, P_ri^m)."""
    torch.manual_seed(0)
    alpha = 1.0
    cfg = hybrid_attn.Config(**SMALL3, pattern="S R R", balance=alpha)
    model = hybrid_attn.Model(cfg).train()
    sharpen(model.router)
    diff, balance_diff, _ = micro_and_full(model, monkeypatch, "balance")
    f, P = [], []
    with torch.no_grad():
        for x, _ in batch(skew=True)[1]:
            _, probs, hard = model.route(model.blocks[0](model.embed(x)))  # (B, T, nR, 2)
            f.append(hard.flatten(0, 1).mean(0))
            P.append(probs.flatten(0, 1).mean(0))
    f, P = torch.stack(f).double(), torch.stack(P).double()  # (N, nR, 2)
    cov = ((f - f.mean(0)) * (P - P.mean(0))).mean(0).sum()
    want = 2 / 2 * cov.item()  # N = 2 paths, n_R = 2 routed layers
    assert abs(want) > 1e-3
    assert balance_diff == pytest.approx(want, rel=1e-4)  # the router runs in fp32
    assert diff == pytest.approx(alpha * want, abs=1e-6)


def test_conddepth_budget_loss_adds_the_variance_and_theta_averages_each_micro_batch(
        monkeypatch):
    """Eq. (20)'s (p̄_l − ρ)² of a batch mean: accumulated, the step's loss is the full batch's
    plus λ_b·Var_m(p̄_l^m) (the top-k of eq. 7 is per sequence: exact). θ_l's running average
    takes one update per micro-batch."""
    torch.manual_seed(0)
    lam_b = 1.0
    cfg = conddepth.Config(**SMALL, n_controlled=1, lam_b=lam_b, p_min=0.0, gate="G1")
    model = conddepth.Model(cfg).train()
    sharpen(model.gates[0].w1, model.gates[0].w2)
    diff, budget_diff, per_micro = micro_and_full(model, monkeypatch, "budget")
    p_bar = torch.tensor([s["gate_prob"].item() for s in per_micro], dtype=torch.float64)
    want = p_bar.var(correction=0).item()
    assert want > 1e-3
    assert budget_diff == pytest.approx(want, rel=1e-6)
    assert diff == pytest.approx(lam_b * want, abs=1e-6)
    stepped = step(model, batch(skew=True)[1])[4]
    assert stepped.threshold_batches.tolist() == [N]  # N updates of θ in one step


def test_tsa_calibrates_on_the_first_micro_batch():
    """hard_ft_routers="calibrate" shifts b2 once, by a quantile of the batch it sees first:
    accumulated, the first micro-batch's. Seen failing with the shift on every micro-batch."""
    torch.manual_seed(0)
    cfg = tsa.Config(**SMALL3, hard_ft_iters=5, max_iters=5, hard_ft_routers="calibrate")
    model = tsa.Model(cfg).train()
    model.on_step(0)
    first = copy.deepcopy(model)
    x, y = batch()[1][0]
    with torch.no_grad():
        first(x, y)
    stepped = step(model, batch()[1])[4]
    for r, r1, r0 in zip(stepped.routers, first.routers, model.routers):
        assert not torch.equal(r1.fc2.bias, r0.fc2.bias)  # it shifted
        assert torch.equal(r.fc2.bias, r1.fc2.bias)  # frozen in the phase: the step keeps it


class FakeDDP(torch.nn.Module):
    """What DDP's no_sync changes, recorded: whether each micro-step's forward and backward ran
    with the gradient all-reduce on."""

    def __init__(self, model):
        super().__init__()
        self.model, self.quiet, self.synced = model, False, []

    @contextlib.contextmanager
    def no_sync(self):
        self.quiet = True
        try:
            yield
        finally:
            self.quiet = False

    def forward(self, x, y):
        self.synced.append(not self.quiet)
        return self.model(x, y)


def test_ddp_syncs_on_the_last_micro_step_only():
    """Seen failing with no_sync left out (a sync every micro-step)."""
    ddp = FakeDDP(common.Model(common.Config(**SMALL)))
    train.accumulate(ddp, batch()[1], CPU, ddp=True)
    assert ddp.synced == [False] * (N - 1) + [True]
    one = FakeDDP(common.Model(common.Config(**SMALL)))
    train.accumulate(one, batch()[0], CPU, ddp=True)
    assert one.synced == [True]


def test_accumulate_averages_the_scalar_tensor_stats_only():
    """A stat that is not a one-element tensor (a count, a per-layer vector) is not averaged and
    does not break the step. Seen failing with `and` read as `or`."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x, y):
            loss = self.w * x.float().mean()
            return None, loss, {"a": x.float().mean(), "layers": torch.ones(3), "n": 3}
    loss, stats = train.accumulate(Model(), [(torch.tensor([1.0]), None),
                                             (torch.tensor([3.0]), None)], CPU)
    assert loss.item() == 2.0 and stats == {"a": 2.0}


def test_each_micro_step_draws_its_own_batch():
    """Micro-batch m of step it on rank r comes from (seed, it, r, m): distinct, reproducible on
    resume; one micro-batch keeps the key runs before accumulation used. Seen failing with one
    key for every micro-step."""
    data = np.arange(10_000, dtype=np.uint16) % 50
    cfg = common.Config(**SMALL, batch_size=B, grad_accum=N, seed=7)
    got = train.micro_batches(data, {}, cfg, 4, 1, CPU)
    assert len(got) == N
    for m, (x, y) in enumerate(got):
        want = common.get_batch(data, {}, B, 16, np.random.default_rng([7, 0, 4, 1, m]))
        assert torch.equal(x, want[0]) and torch.equal(y, want[1])
    assert not torch.equal(got[0][0], got[1][0])
    one = train.micro_batches(data, {}, common.Config(**SMALL, batch_size=B, seed=7), 4, 1, CPU)
    assert torch.equal(one[0][0], common.get_batch(data, {}, B, 16,
                                                   np.random.default_rng([7, 0, 4, 1]))[0])


def run(data_dir, out, *extra):
    return train.main(["--model=dtrnet", "--dataset=shakespeare", f"--data_dir={data_dir}",
                       f"--out_dir={out}", "--n_layer=3", "--n_head=2", "--n_embd=16",
                       "--block_size=16", "--batch_size=2", "--grad_accum=2", "--eval_iters=1",
                       "--eval_interval=3", "--log_interval=1", "--warmup_iters=1",
                       "--device=cpu", *extra])


def records(out):
    return [{k: v for k, v in r.items() if k not in train.TIMING}
            for r in map(json.loads, open(out / "metrics.jsonl"))]


def test_an_accumulating_run_resumes_exactly(data_dir, tmp_path):
    run(data_dir, tmp_path / "a", "--max_iters=6")
    with killed_at(4):
        run(data_dir, tmp_path / "b", "--max_iters=6")
    run(data_dir, tmp_path / "b", "--resume", "--max_iters=6")
    assert records(tmp_path / "a") == records(tmp_path / "b")
    saved = json.load(open(tmp_path / "b" / "config.json"))
    assert saved["grad_accum"] == 2
    with pytest.raises(SystemExit):  # the run's grad_accum is its own
        run(data_dir, tmp_path / "b", "--resume", "--max_iters=8", "--grad_accum=4")


def test_the_log_shows_tokens_per_second_and_mfu(data_dir, tmp_path, capsys, monkeypatch):
    """Every train line: tok/s over batch_size·block_size·grad_accum tokens, and MFU from the
    FLOPs the router's step executed (DTRNet: its flops_ratio) against the peak: unknown on a
    CPU unless --peak_flops gives it."""
    run(data_dir, tmp_path / "a", "--max_iters=2")
    assert "tok/s, MFU: peak unknown" in capsys.readouterr().out
    assert all(r["mfu"] is None and r["tok_s"] > 0
               for r in map(json.loads, open(tmp_path / "a" / "metrics.jsonl"))
               if r["kind"] == "train")
    seen, real = [], common.throughput
    monkeypatch.setattr(common, "throughput", lambda f, n, *a: seen.append(n) or real(f, n, *a))
    run(data_dir, tmp_path / "b", "--max_iters=2", "--peak_flops=1e9")
    assert seen == [2 * 16 * 2] * 2  # batch_size · block_size · grad_accum, each step logged
    assert re.search(r"tok/s, MFU \d+\.\d%", capsys.readouterr().out)
    cfg = dtrnet.Config(**json.load(open(tmp_path / "b" / "config.json")))
    model = dtrnet.Model(cfg)
    for r in map(json.loads, open(tmp_path / "b" / "metrics.jsonl")):
        if r["kind"] == "train":
            fpt = model.train_flops_per_token(16, {"flops_ratio": r["flops_ratio"]})
            assert fpt < common.dense_flops_per_token(cfg, 16)  # bypassed tokens ran less
            assert r["mfu"] == pytest.approx(3 * fpt * r["tok_s"] / 1e9, rel=1e-3)


def test_bench_train_rows_give_tokens_per_second_and_mfu(monkeypatch):
    """bench.py's train_step rows: tok/s and MFU computed as train.py logs them (the router's
    executed FLOPs); MFU None on a CPU, or against a peak when the device has one."""
    import bench
    torch.manual_seed(0)
    routed = dtrnet.Model(dtrnet.Config(**SMALL3)).to(CPU)
    dense = common.Model(common.Config(**SMALL3))
    x, y = batch()[0][0]
    row, = bench.train_rows("dtrnet", routed, dense, x, y, {}, CPU, 1, False)
    assert row["routed_tok_s"] == pytest.approx(x.numel() / row["routed_ms"] * 1e3)
    assert row["routed_mfu"] is None and row["dense_mfu"] is None
    monkeypatch.setattr(common, "peak_flops", lambda device, dtype, peak=None: 1e9)
    row, = bench.train_rows("dtrnet", routed, dense, x, y, {}, CPU, 1, False)
    stats = copy.deepcopy(routed).train()(x, y)[2]
    fpt = routed.train_flops_per_token(16, stats)
    assert fpt < dense.train_flops_per_token(16)
    assert row["routed_mfu"] == pytest.approx(3 * fpt * row["routed_tok_s"] / 1e9, rel=1e-6)
    assert row["dense_mfu"] == pytest.approx(
        3 * dense.train_flops_per_token(16) * row["dense_tok_s"] / 1e9, rel=1e-6)


@pytest.mark.parametrize("name", list(train.MODELS))
def test_every_models_gpu_preset_is_gpt2_small_at_half_a_million_tokens_a_step(name):
    """--preset gpu: GPT-2 small's shape (its biases and GELU: --init_from gpt2 loads), 1024-token
    windows, 524,288 tokens a step by accumulation, 2,500 steps (1.31B tokens: 14 shards), bf16
    (CUDA's default) and compiled where the model compiles on CUDA; the parameters counted on the
    meta device, GPT-2 small's 124M (nanoGPT's count, without positions) plus the routers' (the
    hybrid's Gated DeltaNet mixers: 143M)."""
    cfg, module, _ = train.parse_args(["--model", name, "--preset", "gpu"])
    cfg = dataclasses.replace(cfg, vocab_size=50257)  # what fineweb_edu's meta sets
    arch = (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.bias, cfg.gelu)
    assert arch == (12, 12, 768, 1024, True, "tanh")
    assert cfg.batch_size * cfg.block_size * cfg.grad_accum == 524_288
    assert (cfg.max_iters, cfg.shards) == (2500, 14)
    refused = getattr(module, "COMPILE_REFUSED", {}).get("cuda")
    assert cfg.compile is not bool(refused)
    with torch.device("meta"):
        n = train.build(module, cfg).num_params()
    assert n == 123_653_376 if name == "gpt" else 123_653_376 < n < 150e6  # hybrid: 143M


def test_conddepth_gpu_preset_trains_the_controllers_alone_from_a_dense_run():
    cfg = train.parse_args(["--model", "conddepth", "--preset", "gpu", "--init_from",
                            "out/gpt-fineweb_edu/ckpt.pt"])[0]
    assert cfg.controller_only and (cfg.n_controlled, cfg.cheap_rank) == (4, 768 * 4 // 32)


def script(name):
    """experiments/<name>.py loaded from its path (experiments/ on sys.path would shadow tsa.py
    etc. with the scripts of the same names); its `from compare import` finds compare.py."""
    for n in ("compare", name):
        if n not in sys.modules:
            spec = importlib.util.spec_from_file_location(n, os.path.join(ROOT, "experiments",
                                                                          f"{n}.py"))
            sys.modules[n] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[n])
    return sys.modules[name]


TINY = "n_layer=4,n_embd=16,n_head=2,block_size=32,batch_size=2,max_iters=2,eval_iters=1"


def test_scale_script_runs_the_table_resumably_at_a_tiny_size(data_dir, tmp_path, capsys,
                                                              monkeypatch):
    """experiments/scale.py --smoke: its five commands are valid train.py commands; on the CPU at
    a tiny size the dense run and conddepth from its checkpoint train, one JSON record a run
    written as it finishes; a second call skips them. (The other routers' runs: the same code
    path, left out for the test's time.)"""
    scale = script("scale")
    argv = ["--smoke", "--dataset=shakespeare", f"--data_dir={data_dir}", "--device=cpu",
            f"--out={tmp_path}/out", f"--results={tmp_path}/res"]
    scale.main(argv + ["--dry-run"])
    cmds = [c.split()[2:] for c in capsys.readouterr().out.splitlines() if "train.py" in c]
    assert [c[0] for c in cmds] == [f"--model={m}" for m in scale.RUNS]
    for c in cmds:
        cfg = train.parse_args(c)[0]
        assert (cfg.n_embd, cfg.max_iters, cfg.grad_accum, cfg.seed) == (768, 24, 2, 1)
    assert cmds[-1][-2] == f"--init_from={tmp_path}/out/gpt/ckpt.pt"
    monkeypatch.setattr(scale, "RUNS", ("gpt", "conddepth"))
    argv.append(f"--override={TINY}")
    scale.main(argv)
    recs = {m: json.load(open(tmp_path / "res" / f"{m}.json")) for m in scale.RUNS}
    for m, r in recs.items():
        assert r["model"] == m and r["tokens"] == 2 * 2 * 32 * 2 and r["tok_s"] > 0, m
        assert r["mfu"] is None and math.isfinite(r["val_loss"])  # CPU: peak unknown
    assert recs["conddepth"]["val_skipped"] is not None
    cond = json.load(open(tmp_path / "out" / "conddepth" / "config.json"))
    assert cond["init_from"].endswith("gpt/ckpt.pt") and cond["controller_only"]
    capsys.readouterr()
    scale.main(argv)
    assert capsys.readouterr().out.count("skip ") == 2


def test_ddp_accumulates_with_real_no_sync_on_two_processes(data_dir, tmp_path):
    """torchrun, 2 processes on gloo, --grad_accum=2: DDP's no_sync on the first micro-step, the
    all-reduce on the second; the run ends with rank 0's log and checkpoint."""
    import subprocess
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", "train.py", f"--data_dir={data_dir}",
                          f"--out_dir={tmp_path}", "--model=dtrnet", "--n_layer=3",
                          "--n_embd=32", "--n_head=2", "--block_size=32", "--max_iters=3",
                          "--eval_interval=3", "--eval_iters=1", "--log_interval=1",
                          "--grad_accum=2", "--device=cpu"], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)  # a hung collective must not leave workers behind
        raise
    assert p.returncode == 0, stderr[-2000:]
    assert "2 process(es)" in stdout and "16×32×2 (accumulated)" in stdout
    assert stdout.count("iter 2/3: loss") == 1  # rank 0 logs
    assert common.load_checkpoint(str(tmp_path / "ckpt.pt"))["iter"] == 3
