"""What the GPU paths promise, checked on CPU: bench.py keeps every row it measured, the decode step compiles
to one graph that decodes like eager, and the CLI's edge cases are one-line errors."""
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
    cfg = common.Config(**{**dict(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32), **kw})
    return common.Model(cfg).eval()


# ---------------------------------------------------------------------------------------------------
# bench.py

def test_bench_bad_repeats_is_a_one_line_error():
    r = subprocess.run([sys.executable, "bench.py", "tsa", "--repeats", "0", "--quick"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "error: --repeats must be >= 1, got 0", r.stderr


def test_bench_json_keeps_the_rows_of_a_run_stopped_half_way(tmp_path, monkeypatch):
    """Every row is written as it is measured: a run killed in its second suite leaves the first suite's rows
    and the second's finished ones in --json."""
    def first(args, device, rows):
        rows.append({"suite": "first", "what": "a", "ms": 1.0})
        rows += [{"suite": "first", "what": "b", "ms": 2.0}]

    def second(args, device, rows):
        rows.append({"suite": "second", "what": "c", "ms": 3.0})
        raise KeyboardInterrupt  # what a kill -INT or a time limit does half-way through a suite
    monkeypatch.setattr(bench, "SUITES", {"first": first, "second": second})
    path = str(tmp_path / "rows.json")
    with pytest.raises(KeyboardInterrupt):
        bench.main(["all", "--device", "cpu", "--quick", "--json", path])
    rows = json.load(open(path))["rows"]
    assert [r["what"] for r in rows] == ["a", "b", "c"] and all(r["device"] == "cpu" for r in rows)
    assert not os.path.exists(path + ".tmp")


def test_timeit_rounds_fast_calls_up_and_does_not_repeat_a_slow_one_for_a_fast_neighbour(monkeypatch):
    """On a fake clock: two 1 ms calls get extra rounds (~MIN_SECONDS each, at most 200); a 1 ms call beside a
    1 s one does not drag the slow one through hundreds of rounds (what made `bench.py all` overrun a GPU's
    minutes: a 4096-step recurrent loop timed beside the chunked form)."""
    clock, calls = [0.0], {}
    monkeypatch.setattr(bench, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    monkeypatch.setattr(bench, "MIN_SECONDS", 0.25)

    def call(name, seconds):
        def f():
            calls[name] = calls.get(name, 0) + 1
            clock[0] += seconds
        return f
    t = bench.timeit({"a": call("a", 1e-3), "b": call("b", 1e-3)}, torch.device("cpu"), repeats=3, warmup=1)
    assert calls == {"a": 201, "b": 201} and t == pytest.approx({"a": 1e-3, "b": 1e-3})
    calls.clear()
    t = bench.timeit({"fast": call("fast", 1e-3), "slow": call("slow", 1.0)}, torch.device("cpu"), repeats=3, warmup=1)
    assert calls == {"fast": 4, "slow": 4} and t == pytest.approx({"fast": 1e-3, "slow": 1.0})


# ---------------------------------------------------------------------------------------------------
# a decode step a GPU can capture

def test_gpt_decode_step_compiles_to_one_graph_that_decodes_like_eager():
    """The dense GPT's step has no Python-int-dependent shape: one graph for every token (B=1 and B=2), greedy
    tokens equal eager's."""
    m = tiny_gpt()
    for B in (1, 2):
        prompt = torch.randint(0, 65, (B, 5), generator=torch.Generator().manual_seed(B))
        assert compiled_decode_matches(m, prompt, 12) == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here"))])
def test_generate_compiled_equals_eager_token_for_token(device):
    """train.py --sample --compile's path: generate(compile=True) (inductor; on CUDA replayed as CUDA graphs, each
    step's state fed to the next replay) samples the same tokens as eager (fp32), also past block_size where the
    cache is rebuilt."""
    m = tiny_gpt(block_size=16).to(device)
    prompt = torch.randint(0, 65, (1, 4), generator=torch.Generator().manual_seed(0)).to(device)
    torch._dynamo.reset()
    eager = m.generate(prompt, 20, temperature=0)
    compiled = m.generate(prompt, 20, temperature=0, compile=True)
    assert torch.equal(eager, compiled)


# ---------------------------------------------------------------------------------------------------
# train.py: presets, compile refusals, the sampler's edge cases

def test_gpt_paper_preset_is_the_tsa_papers_size_with_the_dense_baselines_settings():
    cfg, module, _ = train.parse_args(["--model", "gpt", "--preset", "paper"])
    assert module is common
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.batch_size, cfg.max_iters) == (6, 8, 256, 128, 64, 5000)
    assert (cfg.learning_rate, cfg.min_lr, cfg.dropout, cfg.beta2, cfg.weight_decay) == (1e-3, 1e-4, 0.2, 0.95, 0.1)


def test_compile_refusal_is_per_device_and_one_line(data_dir, tmp_path, capsys, monkeypatch):
    """A model's COMPILE_REFUSED names the device types where --compile is refused and why; elsewhere it runs."""
    monkeypatch.setattr(common, "COMPILE_REFUSED", {"cpu": "a planted refusal"}, raising=False)
    argv = ["--model=gpt", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'r'}", "--n_layer=2", "--n_embd=16",
            "--n_head=2", "--block_size=16", "--batch_size=2", "--max_iters=1", "--eval_iters=1", "--device=cpu"]
    with pytest.raises(SystemExit):
        train.main(argv + ["--compile=true"])
    err = capsys.readouterr().err.strip()
    assert err == "error: --compile is refused for --model gpt on cpu: a planted refusal"
    assert not os.path.exists(tmp_path / "r")
    assert train.main(argv + ["--compile=false"]) > 0  # the refusal is only for --compile


@pytest.fixture(scope="module")
def tiny_run(data_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run") / "gpt")
    train.main(["--model=gpt", f"--data_dir={data_dir}", f"--out_dir={out}", "--n_layer=1", "--n_embd=16",
                "--n_head=2", "--block_size=16", "--batch_size=2", "--max_iters=2", "--eval_iters=1", "--device=cpu"])
    return out


def test_sample_with_an_empty_prompt_starts_from_a_newline(tiny_run, capsys):
    """nanoGPT's sample.py starts from a newline; so does --prompt "" (it was an IndexError). --compile
    samples the same text through the compiled step (on the CPU: under CUDA's bf16 a compiled kernel may round
    differently, and a barely trained model's near-tie then picks another token)."""
    args = ["--sample", tiny_run, "--prompt", "", "--num_tokens", "5", "--temperature", "0", "--device", "cpu"]
    train.main(args)
    text = capsys.readouterr().out.split("sample:\n", 1)[1]
    assert text.startswith("\n") and len(text) > 1
    train.main(args + ["--compile"])
    assert capsys.readouterr().out.split("sample:\n", 1)[1] == text
