"""Every entry point survives a careless user: --help, a bad input is one `error:` line with exit 2 and no
traceback, nothing a run wrote is replaced without --overwrite, Ctrl-C says how to resume. One parametrised test
per entry point holds its cases; subprocesses only where a real process is the point (signals, torchrun)."""
import json
import os
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import common
import train
from conftest import ROOT

TINY = ["--model=gpt", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2",
        "--eval_iters=1", "--eval_interval=2", "--log_interval=1", "--max_iters=4", "--warmup_iters=1", "--device=cpu"]


def flags(data_dir, out_dir, *extra):
    """TINY with extra flags replacing TINY's of the same name (a flag may be given once)."""
    given = {a.split("=")[0] for a in extra}
    base = TINY + [f"--data_dir={data_dir}", f"--out_dir={out_dir}"]
    return [a for a in base if a.split("=")[0] not in given] + list(extra)


def one_error(capsys, call):
    """call() must exit 2 with a single `error: ...` line on stderr and no traceback; returns that line."""
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished tiny GPT run (4 steps), a prepared data copy, and a tiny TSA run and copy-task run to sample."""
    root = tmp_path_factory.mktemp("runs")
    data = root / "data"
    src = next(p for p in (os.path.join(ROOT, "data", "shakespeare", "input.txt"),
                           os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare", "input.txt"))
               if os.path.exists(p))
    (data / "shakespeare").mkdir(parents=True)
    shutil.copy(src, data / "shakespeare" / "input.txt")
    train.main(flags(data, root / "gpt"))
    train.main(flags(data, root / "tsa", "--model=tsa", "--n_layer=2", "--max_iters=2", "--hard_ft_iters=1"))
    train.main(flags(data, root / "copy", "--dataset=copy", "--max_iters=2"))
    return root


def copy_run(runs, tmp_path, name="gpt"):
    shutil.copytree(runs / name, tmp_path / name)
    return tmp_path / name


def damage(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def writes_fail(monkeypatch):
    """A full disk: every atomic write gets as far as a partial temporary file, then fails."""
    real = common.atomic_write

    def full(path, write):
        def partial(f):
            f.write(b"partial")
            raise OSError(28, "No space left on device")
        real(path, partial)
    monkeypatch.setattr(common, "atomic_write", full)


def read_only():
    """A folder this process cannot write in (root ignores chmod: then a read-only mount, if there is one)."""
    return "/sys/nanoroute" if os.geteuid() == 0 else None


# (argv after the tiny flags, setup(runs, tmp_path, monkeypatch) -> out_dir or None, message in the error)
TRAIN_CASES = {
    "empty model": (["--model="], None, "--model has an empty value"),
    "empty dataset": (["--dataset", ""], None, "--dataset has an empty value"),
    "flag twice": (["--n_embd=32", "--n_embd=64"], None, "--n_embd is given twice"),
    "zero heads": (["--n_head=0"], None, "n_head must be >= 1, got 0"),
    "negative width": (["--n_embd=-16"], None, "n_embd must be >= 1"),
    "zero layers": (["--n_layer=0"], None, "n_layer must be >= 1"),
    "a size the model refuses": (["--model=conddepth", "--n_layer=2", "--d_s=-1"], None,
                                 "d_s must be > 0, got -1"),
    "data_dir a file": (["--data_dir={data}/shakespeare/input.txt"], None, "is a file, not a directory"),
    "infinite lr": (["--learning_rate=inf"], None, "--learning_rate must be a finite number"),
    "meta device": (["--device=meta"], None, "device must be auto, cpu, cuda, cuda:N or mps, got 'meta'"),
    "device typo": (["--device=cdua"], None, "got 'cdua'"),
    "bool typo": (["--compile=maybe"], None, "--compile expects bool"),
    "resume and overwrite": (["--resume", "--overwrite"], None, "give one of them"),
    "too big for memory": (["--n_layer=64", "--n_embd=16384", "--n_head=64"], None, "more than"),
    "activations too big": (["--block_size=20000", "--batch_size=4096"], None, "activations at batch_size=4096"),
    "a run is there": ([], lambda r, t, m: copy_run(r, t), "holds a run (ckpt.pt, best.pt, metrics.jsonl, "
                       "config.json): continue it with --resume, or start over with --overwrite"),
    "only a log is there": ([], lambda r, t, m: (t / "x").mkdir() or (t / "x" / "metrics.jsonl").write_text("")
                            or t / "x", "holds a run (metrics.jsonl)"),
    "resume nothing": (["--resume"], lambda r, t, m: t / "none", "no {out}/ckpt.pt to resume from"),
    "resume another model": (["--resume", "--model=tsa", "--n_layer=2", "--max_iters=9"], lambda r, t, m: copy_run(r, t),
                             "has model=gpt but this run asks for model=tsa"),
    "resume another size": (["--resume", "--n_embd=32", "--max_iters=9"], lambda r, t, m: copy_run(r, t),
                            "has n_embd=16 but this run asks for n_embd=32"),
    "resume another dataset": (["--resume", "--dataset=sort", "--max_iters=9"], lambda r, t, m: copy_run(r, t),
                               "has dataset=shakespeare but this run asks for dataset=sort"),
    "resume a best.pt copy": (["--resume", "--max_iters=9"], lambda r, t, m: shutil.copy(
        copy_run(r, t) / "best.pt", t / "gpt" / "ckpt.pt") and t / "gpt", "has no training state (optimizer"),
    "resume at max_iters": (["--resume"], lambda r, t, m: copy_run(r, t), "is at step 4 and --max_iters=4"),
    "resume past max_iters": (["--resume", "--max_iters=2"], lambda r, t, m: copy_run(r, t), "nothing left"),
    "resume a corrupt log": (["--resume", "--max_iters=9"], lambda r, t, m: (copy_run(r, t) / "metrics.jsonl")
                             .write_text("{}\nnot json\n{}\n") and t / "gpt", "line 2 is not JSON"),
    "out_dir under a file": ([], lambda r, t, m: (t / "f").write_text("") or t / "f" / "run", "is a file"),
    "read-only out_dir": ([], lambda r, t, m: read_only() or pytest.skip("no read-only folder here"),
                          "cannot write in"),
    "full disk": ([], lambda r, t, m: writes_fail(m) or t / "full", "No space left on device"),
    "odd train.bin": (["--data_dir={data}"], lambda r, t, m: damage(t / "data" / "shakespeare" / "train.bin", 2001),
                      "train.bin has 2,001 bytes, but"),
    "truncated train.bin": (["--data_dir={data}"], lambda r, t, m: damage(
        t / "data" / "shakespeare" / "train.bin", 2000), "the preparation is damaged; delete"),
    "empty val.bin": (["--data_dir={data}"], lambda r, t, m: damage(t / "data" / "shakespeare" / "val.bin", 0),
                      "val.bin has 0 bytes"),
    "stray word": (["gpt"], None, "unexpected argument 'gpt'"),
}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_py(case, runs, tmp_path, monkeypatch, capsys):
    extra, setup, message = TRAIN_CASES[case]
    shutil.copytree(runs / "data", tmp_path / "data")
    out = (setup(runs, tmp_path, monkeypatch) if setup else None) or tmp_path / "run"
    before = {f: (out / f).read_bytes() for f in train.RUN_FILES if os.path.isfile(os.path.join(out, f))}
    extra = [a.replace("{data}", str(tmp_path / "data")) for a in extra]
    capsys.readouterr()
    err = one_error(capsys, lambda: train.main(flags(runs / "data", out, *extra)))
    assert message.replace("{out}", str(out)) in err
    assert {f: (out / f).read_bytes() for f in before} == before  # a refusal writes nothing
    assert not [f for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]  # nor leaves partial files


SAMPLE_CASES = {
    "nan temperature": (["--temperature", "nan"], "--temperature must be a finite number"),
    "inf temperature": (["--temperature=inf"], "--temperature must be a finite number"),
    "negative temperature": (["--temperature=-1"], "--temperature >= 0"),
    "empty run dir": (["--sample="], "--sample has an empty value"),
    "prompt twice": (["--prompt=a", "--prompt=b"], "--prompt is given twice"),
    "meta device": (["--device=meta"], "got 'meta'"),
    "zero tokens": (["--num_tokens=0"], "--num_tokens and --top_k must be >= 1"),
    "copy prompt not numbers": (["--prompt=hello"], "a copy prompt is space-separated numbers"),
}


@pytest.mark.parametrize("case", SAMPLE_CASES)
def test_train_py_sample(case, runs, capsys):
    extra, message = SAMPLE_CASES[case]
    run = runs / ("copy" if case.startswith("copy") else "gpt")
    given = {a.split("=")[0] for a in extra}
    argv = [a for a in ("--sample", str(run)) if "--sample" not in given] + extra
    capsys.readouterr()
    assert message in one_error(capsys, lambda: train.main(argv))


def test_sample_copy_task_without_a_prompt_completes_a_held_out_record(runs, capsys):
    train.main(["--sample", str(runs / "copy"), "--device=cpu"])
    out = capsys.readouterr().out
    assert "no --prompt: completing the first held-out record's source '[BOS]" in out
    sample = out.split("sample:\n")[1].split()
    assert sample[0] == "[BOS]" and sample[11] == "[SEP]" and len(sample) == 2 * common.TASK_LEN + 3


def test_sample_in_a_read_only_run_prints_the_sample_then_warns(runs, monkeypatch, capsys):
    writes_fail(monkeypatch)
    train.main(["--sample", str(runs / "tsa"), "--num_tokens=5", "--prompt=ROMEO:", "--device=cpu"])
    out, err = capsys.readouterr()
    assert "sample:\nROMEO:" in out and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("warning: could not write") and "sample_routing.html" in err


def test_help(capsys):
    assert train.main(["--help"]) is None
    out = capsys.readouterr().out
    for group in ("run:", "data:", "optimisation:", "model (every model):", "presets of --model gpt"):
        assert f"\n{group}" in out
    assert "--overwrite=false" in out and "removes its ckpt.pt, best.pt, metrics.jsonl, config.json" in out
    assert "--n_head=6" in out and "attention heads" in out and "classroom: --n_layer=4" in out
    every = {f.name for f in __import__("dataclasses").fields(common.Config)} - {"model", "dataset"}
    lines = {ln.split("=")[0].strip(): ln for ln in out.splitlines() if ln.startswith("  --")}
    assert every <= {k[2:] for k in lines} and all(len(lines["--" + k].split()) > 1 for k in every)  # each explained
    for name, file in train.MODELS.items():  # every field of every model's Config: one line of help
        train.main(["--model", name, "--help"])
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  --")]
        fields = {f.name for f in __import__("dataclasses").fields(train.model_module(name)[1].Config)}
        assert {ln.split("=")[0].strip()[2:] for ln in lines} >= fields - {"model", "dataset"}, name
        assert all(len(ln.split()) > 1 for ln in lines), (name, [ln for ln in lines if len(ln.split()) < 2])
    train.main(["--model", "tsa", "-h"])
    out = capsys.readouterr().out
    assert "--model tsa (tsa.py's Config):" in out and "--lam=0.001" in out and "λ of eq. (5)" in out
    train.main(["--sample", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python train.py --sample RUN_DIR") and "--temperature=0.8" in out


def test_resume_after_a_partial_last_log_line(runs, tmp_path, capsys):
    """What a full disk leaves in metrics.jsonl: the cut line is dropped, with a note, and the run goes on."""
    out = copy_run(runs, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    train.main(flags(runs / "data", out, "--resume", "--max_iters=6"))
    assert "dropped its last line, cut short" in capsys.readouterr().out
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert recs[-1]["step"] == 6 and [r["step"] for r in recs if r["kind"] == "train"] == list(range(6))


def test_empty_input_is_refused_and_not_cached(runs, tmp_path, capsys):
    d = tmp_path / "data" / "shakespeare"
    d.mkdir(parents=True)
    (d / "input.txt").write_text("")
    err = one_error(capsys, lambda: train.main(flags(tmp_path / "data", tmp_path / "run")))
    assert "is empty or too short" in err and not (d / "meta.json").exists() and not (tmp_path / "run").exists()
    shutil.copy(runs / "data" / "shakespeare" / "input.txt", d / "input.txt")
    train.main(flags(tmp_path / "data", tmp_path / "run", "--max_iters=1"))
    assert json.load(open(d / "meta.json"))["val_tokens"] == 111540


def test_overwrite_replaces_the_old_run(runs, tmp_path):
    out = copy_run(runs, tmp_path)
    (out / "routing.html").write_text("old")
    train.main(flags(runs / "data", out, "--overwrite", "--max_iters=2"))
    assert common.load_checkpoint(str(out / "ckpt.pt"))["iter"] == 2 and not (out / "routing.html").exists()


# ----------------------------------------------------------------------------------------------------
# real processes: a rerun refused, Ctrl-C, torchrun

def cli(*argv, timeout=120, **kw):
    return subprocess.run([sys.executable, "train.py", *map(str, argv)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


def test_rerun_never_replaces_a_run(runs, tmp_path):
    out = copy_run(runs, tmp_path)
    before = {f: (out / f).read_bytes() for f in train.RUN_FILES}
    p = cli(*flags(runs / "data", out, "--max_iters=2"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--resume" in p.stderr and "--overwrite" in p.stderr
    assert {f: (out / f).read_bytes() for f in train.RUN_FILES} == before


def test_ctrl_c_stops_with_the_resume_command(runs, tmp_path):
    argv = flags(runs / "data", tmp_path / "run", "--max_iters=100000", "--eval_interval=5")
    # Ctrl-C as a terminal delivers it: a shell's background job (nohup cmd &) starts with SIGINT
    # ignored, which Python (and so train.py) would inherit and keep
    p = subprocess.Popen([sys.executable, "train.py", *map(str, argv)], cwd=ROOT, text=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={**os.environ, "OMP_NUM_THREADS": "1"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for _ in range(1200):  # until the first checkpoint is there
            if (tmp_path / "run" / "ckpt.pt").exists():
                break
            time.sleep(0.1)
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1]
    finally:
        p.kill()
    assert p.returncode == 130 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("interrupted; continue with: python train.py ")
    cmd = shlex.split(err.split(": ", 1)[1])
    assert cmd[2:] == [str(a) for a in argv] + ["--resume"]
    step = common.load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["iter"]
    train.main([a if not a.startswith("--max_iters") else f"--max_iters={step + 1}" for a in cmd[2:]])
    assert not [f for f in os.listdir(tmp_path / "run") if f.endswith(".tmp")]


def test_torchrun_resume_of_a_one_process_run_is_refused(runs, tmp_path):
    out = copy_run(runs, tmp_path)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", *flags(runs / "data", out, "--resume", "--max_iters=9")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0
    assert p.stderr.count("error: ") == 1 and "was written by 1 process(es), this run has 2" in p.stderr
    assert common.load_checkpoint(str(out / "ckpt.pt"))["iter"] == 4


# ----------------------------------------------------------------------------------------------------
# experiments/: each script run as __main__, in this process

EXP = os.path.join(ROOT, "experiments")
EXPERIMENT_CASES = {
    "tsa.py": [(["table"], "table needs a records file"), (["table", "{tmp}/none.jsonl"], "No such file"),
               (["table", "{empty}"], "no records in"), (["proxy-table", "{tmp}/none"], "no finished runs in"),
               (["curve-table", "{tmp}"], "no finished runs in"), (["proxy"], "proxy needs --seed"),
               (["curve", "--seeds=one"], "expected comma-separated ints"), (["grid", "--lrs=fast"], "floats"),
               (["proxy", "--seed=1", "--branches=hard"], "unknown hard"), (["nope"], "invalid choice")],
    "dtrnet.py": [(["table", "--out={tmp}/none"], "no finished runs in"), ([], "required: cmd")],
    "conddepth.py": [(["table", "--out={tmp}"], "no run records in")],
    "hybrid.py": [(["table", "--out={tmp}/none"], "no finished runs in")],
    "devices.py": [(["--device=tpu"], "device must be"), (["--dtypes", "fp8"], "invalid choice: 'fp8'")],
    "compare.py": [(["--runs=gpt-L5"], "unknown gpt-L5; choose from gpt-L6"), (["--seeds=one"], "got 'one'"),
                   (["--table-only", "--quick", "--out={tmp}"], "no records in"), (["--jobs=0"], ">= 1")],
    "bench_report.py": [(["{tmp}/none.json"], "none.json: No such file"), ([], "required: json"),
                        (["{empty}"], "not a bench.py --json file"), (["{norows}"], "no rows to tabulate")],
}
if not torch.cuda.is_available():
    EXPERIMENT_CASES["devices.py"].append((["--device=cuda"], "device 'cuda' is not available here"))


@pytest.mark.parametrize("script,argv,message", [(s, a, m) for s, cases in EXPERIMENT_CASES.items()
                                                  for a, m in cases])
def test_experiments(script, argv, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "norows.json").write_text('{"rows": []}')
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{empty}", str(tmp_path / "empty.jsonl"))
            .replace("{norows}", str(tmp_path / "norows.json")) for a in argv]
    monkeypatch.setattr(sys, "path", sys.path + [EXP])  # after the model files: experiments/tsa.py shadows nothing
    monkeypatch.setattr(sys, "argv", [script, *argv])
    assert message in one_error(capsys, lambda: runpy.run_path(os.path.join(EXP, script), run_name="__main__"))


@pytest.mark.parametrize("script", sorted(EXPERIMENT_CASES))
def test_experiments_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", sys.path + [EXP])
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(EXP, script), run_name="__main__")
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: ")


@pytest.mark.parametrize("script", ["tsa.py --help", "dtrnet.py", "conddepth.py", "hybrid_attn.py",
                                    "mod.py"])
def test_paper_file_output_into_a_closed_pipe_is_quiet(script):
    """`python conddepth.py | head -1`: a reader that stops early ends the command quietly, without
    a BrokenPipeError traceback (here the reader, `true`, reads nothing and exits at once)."""
    p = subprocess.run(f"{shlex.quote(sys.executable)} {script} | true; exit ${{PIPESTATUS[0]}}",
                       shell=True, executable="/bin/bash", cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stderr == "", p.stderr
