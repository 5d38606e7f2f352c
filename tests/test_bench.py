"""What the GPU paths promise, checked on CPU: bench.py keeps every row it measured, the decode step
compiles to one graph that decodes like eager, and the CLI's edge cases are one-line errors."""
import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import bench
import common
import train
from conftest import ROOT, compiled_decode_matches


def tiny_gpt(**kw):
    torch.manual_seed(0)
    size = dict(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32)
    cfg = common.Config(**{**size, **kw})
    return common.Model(cfg).eval()


# --------------------------------------------------------------------------------------------------
# bench.py

def test_bench_bad_repeats_is_a_one_line_error():
    r = subprocess.run([sys.executable, "bench.py", "tsa", "--repeats", "0", "--quick"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "error: --repeats must be >= 1, got 0", r.stderr


def test_bench_json_keeps_the_rows_of_a_run_stopped_half_way(tmp_path, monkeypatch):
    """Every row is written as it is measured: a run killed in its second suite leaves the first
    suite's rows and the second's finished ones in --json."""
    def first(args, device, rows, *_):
        rows.append({"suite": "first", "what": "a", "ms": 1.0})
        rows += [{"suite": "first", "what": "b", "ms": 2.0}]

    def second(args, device, rows, *_):
        rows.append({"suite": "second", "what": "c", "ms": 3.0})
        raise KeyboardInterrupt  # what a kill -INT or a time limit does half-way through a suite
    monkeypatch.setattr(bench, "SUITES", {"first": first, "second": second})
    path = str(tmp_path / "rows.json")
    with pytest.raises(KeyboardInterrupt):
        bench.main(["all", "--device", "cpu", "--quick", "--json", path])
    rows = json.load(open(path))["rows"]
    assert [r["what"] for r in rows] == ["a", "b", "c"] and all(r["device"] == "cpu" for r in rows)
    assert not os.path.exists(path + ".tmp")


def test_timeit_rounds_fast_calls_up_and_does_not_repeat_a_slow_one_beside_a_fast_one(monkeypatch):
    """On a fake clock: two 1 ms calls get extra rounds (~MIN_SECONDS each, at most 200); a 1 ms
    call beside a 1 s one does not drag the slow one through hundreds of rounds (what made `bench.py
    all` overrun a GPU's minutes: a 4096-step recurrent loop timed beside the chunked form)."""
    clock, calls = [0.0], {}
    fake = type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])})
    monkeypatch.setattr(bench, "time", fake)
    monkeypatch.setattr(bench, "MIN_SECONDS", 0.25)

    def call(name, seconds):
        def f():
            calls[name] = calls.get(name, 0) + 1
            clock[0] += seconds
        return f
    cpu = torch.device("cpu")
    t = bench.timeit({"a": call("a", 1e-3), "b": call("b", 1e-3)}, cpu, repeats=3, warmup=1)
    assert calls == {"a": 201, "b": 201} and t == pytest.approx({"a": 1e-3, "b": 1e-3})
    calls.clear()
    fns = {"fast": call("fast", 1e-3), "slow": call("slow", 1.0)}
    t = bench.timeit(fns, cpu, repeats=3, warmup=1)
    assert calls == {"fast": 4, "slow": 4} and t == pytest.approx({"fast": 1e-3, "slow": 1.0})


@pytest.fixture
def eager_compile(monkeypatch):
    """torch.compile with dynamo's eager backend: the compiled rows' paths in seconds (inductor on
    the CPU takes minutes); every torch.compile bench.py and LM.generate make goes through it."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compile_(*a, **{**k, "backend": "eager"}))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_graph_rows_count_the_graphs_and_name_a_planted_break(monkeypatch):
    """The dense GPT's paths are one graph each; an .item() planted in its block's forward breaks
    the eval forward's graph in every layer, named by file and line."""
    size = bench.QUICK_GRAPH_SIZE
    rows = {r["path"]: r for r in bench.graph_rows("gpt", size)}
    assert set(rows) == {"train_forward", "eval_forward", "decode_step_B1", "decode_step_B4"}
    assert all((r["graphs"], r["breaks"], r["break_sites"]) == (1, 0, "") for r in rows.values())
    forward = common.Block.forward

    def planted(self, x):
        if x.sum().item() > 1e30:  # never true: only the host read matters
            x = x + 1
        return forward(self, x)
    monkeypatch.setattr(common.Block, "forward", planted)
    m = tiny_gpt(n_layer=size["n_layer"])
    graphs, breaks, sites = bench.explain(m, torch.randint(0, 65, (2, 8)))
    assert breaks >= size["n_layer"] and graphs > size["n_layer"], (graphs, breaks)
    assert sites.startswith("test_bench.py:") and "item()" in sites, sites


@pytest.mark.parametrize("suite,stat", [("tsa", "alpha_hard"), ("dtrnet", "frac_attn"),
                                        ("conddepth", "full_ratio"), ("hybrid", "skipped"),
                                        ("mod", "skipped")])
@pytest.mark.parametrize("first,share", [(0.7, 0.1), (0.1, 0.7)])
def test_set_share_routes_that_share_of_the_tokens_the_costly_way(suite, stat, first, share):
    """bench's routers are set so that `share` of the calibration tokens takes the costly path,
    which the model's own eval stats confirm (the hybrid's: the share that skipped softmax). Set
    twice, so that the second setting starts from routers already moved off a symmetric spread of
    decisions."""
    size, cpu = bench.SIZES["quick"], torch.device("cpu")
    model, dense, _ = bench.models(suite, size, cpu, share=first)
    assert type(dense) is common.Model and dense.cfg.n_layer == model.cfg.n_layer
    x = bench.batch(model.cfg, min(size["B"], 4), size["T"], cpu, seed=1)[0]
    assert bench.set_share(suite, model, x, share) == share
    with torch.no_grad():
        measured = float(model.eval()(x, x)[2][stat])
    measured = 1 - measured if suite in ("hybrid", "mod") else measured
    assert measured == pytest.approx(share, abs=0.1), (suite, measured)


def test_a_suite_times_eager_and_compiled_rows(eager_compile, monkeypatch):
    """`bench.py dtrnet --quick --compile`: forward, sparse forward (with its sweep and crossover),
    training step and decoding, each eager and compiled, routed against the dense GPT; graph rows
    first (stubbed here: the graph test holds them)."""
    stub = lambda suite, size: [{"suite": suite, "what": "graphs"}]  # noqa: E731
    monkeypatch.setattr(bench, "graph_rows", stub)
    rows = bench.main(["dtrnet", "--quick", "--compile", "--repeats=1", "--device=cpu"])
    assert rows[0]["what"] == "graphs"
    timed = [r for r in rows if r["what"] in ("forward", "sparse_forward", "train_step", "decode")]
    for comp in (False, True):
        got = [(r["what"], r["B"]) for r in timed if r["compiled"] is comp]
        want = [("forward", 2), ("sparse_forward", 2), ("train_step", 2), ("decode", 1),
                ("decode", 8)]
        assert [w for w in got if w[0] != "sparse_forward" or w[1] == 2] == want, got
    assert all(r["routed_ms"] > 0 and r["dense_ms"] > 0 for r in timed if "dense_ms" in r)
    decode = [r for r in timed if r["what"] == "decode"]
    assert all(r["tokens_per_s"] > 0 and r["flops_ideal"] > 1 for r in decode)
    assert [r["what"] for r in rows].count("crossover") == 1  # the eager sweep only
    assert all(r["share_set"] == 0.1 for r in timed)


@pytest.fixture
def no_compile(monkeypatch):
    """torch.compile as the identity: the GPU script's plan, rows and JSON in seconds. What
    compiling each path does is held elsewhere: the compiled rows of a suite here, the compiled
    training and decoding tests of every model in its own test file."""
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)


def test_gpu_script_runs_end_to_end_at_the_quick_size(no_compile, tmp_path):
    """`bench.py gpu --quick` on the CPU: every group runs, none fails, and the JSON holds every
    row."""
    path = str(tmp_path / "gpu.json")
    rows = bench.main(["gpu", "--quick", "--repeats=1", "--device=cpu", "--json", path])
    assert not [r for r in rows if r["what"] in ("failed", "skipped")], rows
    assert all(r["compiled"] is True for r in rows)
    got = {(r["what"], r["suite"]) for r in rows}
    for s in bench.ROUTERS:
        assert {("decode", s), ("train_step", s), ("sparse_forward", s)} <= got
    assert [r["B"] for r in rows if r["what"] == "decode"] == [1] * len(bench.ROUTERS)
    assert sum(r["what"] == "train_step" for r in rows) == 2 * len(bench.ROUTERS)  # two sizes
    assert [r["T"] for r in rows if r["size"] == "quick_T64"] == [64]  # DTRNet's long row
    saved = json.load(open(path))
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["torch"] == torch.__version__


def test_gpu_script_skips_what_its_budget_leaves_no_time_for(monkeypatch):
    """On a fake clock, every measurement 10 s: with a 25 s budget the first two run (0 + 0, 10 + 10
    <= 25) and the third would end past it (20 + 10), so it and all later ones are what=skipped rows
    saying why; a measurement that raises is a what=failed row and the run goes on."""
    clock = [0.0]

    def measure(*a, **k):
        clock[0] += 10.0
        if len([r for r in rows if r["what"] != "skipped"]) == 1:
            raise RuntimeError("a planted compiler failure\nmore lines")
        return [{"suite": "s", "what": "measured"}]
    rows = bench.Rows(argparse.Namespace(json=""), torch.device("cpu"))
    fake = type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])})
    monkeypatch.setattr(bench, "time", fake)
    for name in ("models", "decode_rows", "train_rows", "forward_rows", "long_rows"):
        stub = lambda *a, **k: (argparse.Namespace(cfg=None), None, 0.5)  # noqa: E731
        monkeypatch.setattr(bench, name, measure if name != "models" else stub)
    monkeypatch.setattr(bench, "batch", lambda *a, **k: (3, 4))
    args = argparse.Namespace(size_name="quick", quick=True, repeats=1, budget=25.0, only="")
    bench.bench_gpu(args, torch.device("cpu"), rows)
    plan = 4 * len(bench.ROUTERS) + 1  # decode, small and big train steps, sparse; long
    assert [r["what"] for r in rows] == ["measured", "failed"] + ["skipped"] * (plan - 2)
    assert rows[1]["error"] == "RuntimeError: a planted compiler failure"
    assert rows[2]["group"] == "decode quick conddepth"
    assert rows[2]["why"].startswith("time budget: 20 s")


def test_gpu_script_only_runs_the_measurements_named(monkeypatch):
    """--only keeps the measurements whose name contains its text, in the script's order."""
    done = []
    monkeypatch.setattr(bench, "models", lambda *a, **k: (argparse.Namespace(cfg=None), None, 0.5))
    monkeypatch.setattr(bench, "batch", lambda *a, **k: (3, 4))
    for name in ("decode_rows", "train_rows", "forward_rows", "long_rows"):
        monkeypatch.setattr(bench, name, lambda *a, name=name, **k: done.append((name, a[0])) or [])
    args = argparse.Namespace(size_name="small", quick=False, repeats=1, budget=25.0, only="hybrid")
    bench.bench_gpu(args, torch.device("cpu"), [])
    assert done == [("decode_rows", "hybrid"), ("train_rows", "hybrid"), ("forward_rows", "hybrid"),
                    ("train_rows", "hybrid")]


def save_run(path, module, **kw):
    """A checkpoint as train.py writes one (weights and config), without training."""
    size = dict(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=16)
    cfg = module.Config(**{**size, **kw})
    torch.manual_seed(0)
    common.save_checkpoint(str(path), model=train.build(module, cfg).state_dict(),
                           config=dataclasses.asdict(cfg), iter=0)
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    import tsa
    d = tmp_path_factory.mktemp("ckpts")
    bad = save_run(d / "bad.pt", tsa)
    ck = common.load_checkpoint(bad)
    ck["config"]["n_layer"] = 3  # weights of 2 layers under a 3-layer config
    common.save_checkpoint(bad, **ck)
    (d / "corrupt.pt").write_bytes(b"not a checkpoint")
    (d / "file").write_text("")
    return {"gpt": save_run(d / "gpt.pt", common, n_layer=1),
            "gpt4": save_run(d / "gpt4.pt", common, n_layer=4), "tsa": save_run(d / "tsa.pt", tsa),
            "exit": save_run(d / "exit.pt", tsa, variant="early_exit"),
            "bad": bad, "corrupt": str(d / "corrupt.pt"), "file": str(d / "file"), "dir": str(d)}


def test_bench_times_a_checkpoint_with_its_own_routing(ckpts, monkeypatch):
    """`bench.py tsa --ckpt <a tsa run>`: the checkpoint's weights and routers (share_set "trained")
    on B = 8 windows of its context, against a dense GPT of its size."""
    monkeypatch.setattr(bench, "graph_rows", lambda suite, size: [])
    rows = bench.main(["tsa", "--ckpt", ckpts["tsa"], "--quick", "--repeats=1", "--device=cpu"])
    timed = [r for r in rows if r["what"] in ("forward", "sparse_forward", "train_step")]
    assert timed and all(r["share_set"] == "trained" and r["T"] == 16 for r in timed)
    assert {r["B"] for r in timed} == {1, 4, 8}  # 8, and the sparse sweep at 1 and 4
    ck = common.load_checkpoint(ckpts["tsa"])["model"]
    model = bench.check_ckpt("tsa", ckpts["tsa"])
    assert all(torch.equal(v, ck[k]) for k, v in model.state_dict().items())


CARELESS = {  # argv ({name} -> a path of ckpts) -> what the one error line says
    "json_under_a_file": (["tsa", "--json", "{file}/rows.json"], "is a file, not a folder"),
    "json_two_under_a_file": (["tsa", "--json", "{file}/a/rows.json"], "is a file, not a folder"),
    "json_a_directory": (["tsa", "--json", "{dir}"], "is a directory"),
    "hybrid_ckpt_a_gpt_run": (["hybrid", "--ckpt", "{gpt}"], "a 'gpt' run; bench.py hybrid needs"),
    "hybrid_ckpt_a_4_layer_gpt_run": (["hybrid", "--ckpt", "{gpt4}"], "is a 'gpt' run"),
    "ckpt_missing": (["tsa", "--ckpt", "{dir}/none.pt"], "not found"),
    "ckpt_corrupt": (["tsa", "--ckpt", "{corrupt}"], "corrupt"),
    "ckpt_weights_do_not_fit": (["tsa", "--ckpt", "{bad}"], "do not fit its config"),
    "ckpt_of_a_variant": (["tsa", "--ckpt", "{exit}"], "EarlyExit"),
    "ckpt_with_all": (["all", "--ckpt", "{tsa}"], "needs one suite"),
    "budget_zero": (["gpu", "--budget", "0"], "--budget must be > 0"),
    "unknown_size": (["tsa", "--size", "huge"], "invalid choice"),
    "unknown_suite": (["ops"], "invalid choice"),
    "unknown_device": (["tsa", "--device", "tpu"], "device must be auto, cpu, cuda, cuda:N or mps"),
}


@pytest.mark.parametrize("case", list(CARELESS))
def test_bench_refuses_a_careless_command_before_any_work(case, ckpts, capsys):
    """Each is one `error:` line on stderr and exit 2, before any row is measured (nothing on
    stdout)."""
    argv, says = CARELESS[case]
    with pytest.raises(SystemExit) as e:
        bench.main([a.format(**ckpts) for a in argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and says in err, err


# --------------------------------------------------------------------------------------------------
# a decode step a GPU can capture

def test_gpt_decode_step_compiles_to_one_graph_that_decodes_like_eager():
    """The dense GPT's step has no Python-int-dependent shape: one graph for every token (B=1 and
    B=2), greedy tokens equal eager's."""
    m = tiny_gpt()
    for B in (1, 2):
        prompt = torch.randint(0, 65, (B, 5), generator=torch.Generator().manual_seed(B))
        assert compiled_decode_matches(m, prompt, 12) == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here"))])
def test_generate_compiled_equals_eager_token_for_token(device):
    """train.py --sample --compile's path: generate(compile=True) (inductor; on CUDA replayed as
    CUDA graphs, each step's state fed to the next replay) samples the same tokens as eager (fp32),
    also past block_size where the cache is rebuilt."""
    m = tiny_gpt(block_size=16).to(device)
    prompt = torch.randint(0, 65, (1, 4), generator=torch.Generator().manual_seed(0)).to(device)
    torch._dynamo.reset()
    eager = m.generate(prompt, 20, temperature=0)
    compiled = m.generate(prompt, 20, temperature=0, compile=True)
    assert torch.equal(eager, compiled)


# --------------------------------------------------------------------------------------------------
# train.py: presets, compile refusals, the sampler's edge cases

def test_gpt_paper_preset_is_the_tsa_papers_size_with_the_dense_baselines_settings():
    cfg, module, _ = train.parse_args(["--model", "gpt", "--preset", "paper"])
    assert module is common
    size = (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.batch_size, cfg.max_iters)
    assert size == (6, 8, 256, 128, 64, 5000)
    opt = (cfg.learning_rate, cfg.min_lr, cfg.dropout, cfg.beta2, cfg.weight_decay)
    assert opt == (1e-3, 1e-4, 0.2, 0.95, 0.1)


def test_compile_refusal_is_per_device_and_one_line(data_dir, tmp_path, capsys, monkeypatch):
    """A model's COMPILE_REFUSED names the device types where --compile is refused and why;
    elsewhere it runs."""
    monkeypatch.setattr(common, "COMPILE_REFUSED", {"cpu": "a planted refusal"}, raising=False)
    argv = ["--model=gpt", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'r'}", "--n_layer=2",
            "--n_embd=16", "--n_head=2", "--block_size=16", "--batch_size=2", "--max_iters=1",
            "--eval_iters=1", "--device=cpu"]
    with pytest.raises(SystemExit):
        train.main(argv + ["--compile=true"])
    err = capsys.readouterr().err.strip()
    assert err == "error: --compile is refused for --model gpt on cpu: a planted refusal"
    assert not os.path.exists(tmp_path / "r")
    assert train.main(argv + ["--compile=false"]) > 0  # the refusal is only for --compile


@pytest.fixture(scope="module")
def tiny_run(data_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run") / "gpt")
    train.main(["--model=gpt", f"--data_dir={data_dir}", f"--out_dir={out}", "--n_layer=1",
                "--n_embd=16", "--n_head=2", "--block_size=16", "--batch_size=2", "--max_iters=2",
                "--eval_iters=1", "--device=cpu"])
    return out


def test_sample_with_an_empty_prompt_starts_from_a_newline(tiny_run, capsys):
    """nanoGPT's sample.py starts from a newline; so does --prompt "" (it was an IndexError).
    --compile samples the same text through the compiled step (on the CPU: under CUDA's bf16 a
    compiled kernel may round differently, and a barely trained model's near-tie then picks another
    token)."""
    args = ["--sample", tiny_run, "--prompt", "", "--num_tokens", "5", "--temperature", "0",
            "--device", "cpu"]
    train.main(args)
    text = capsys.readouterr().out.split("sample:\n", 1)[1]
    assert text.startswith("\n") and len(text) > 1
    train.main(args + ["--compile"])
    assert capsys.readouterr().out.split("sample:\n", 1)[1] == text
