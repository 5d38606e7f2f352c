"""Every entry point survives a careless user: --help, a bad input is one `error:` line with exit 2
and no traceback, nothing a run wrote is replaced without --overwrite, Ctrl-C says how to resume.
One parametrised test per entry point holds its cases; subprocesses only where a real process is
the point (signals, torchrun)."""
import dataclasses
import html
import json
import math
import os
import runpy
import shlex
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import common
import train
from conftest import ROOT

TINY = ["--model=gpt", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16",
        "--batch_size=2", "--eval_iters=1", "--eval_interval=2", "--log_interval=1",
        "--max_iters=4", "--warmup_iters=1", "--device=cpu"]


def flags(data_dir, out_dir, *extra):
    """TINY with extra flags replacing TINY's of the same name (a flag may be given once)."""
    given = {a.split("=")[0] for a in extra}
    base = TINY + [f"--data_dir={data_dir}", f"--out_dir={out_dir}"]
    return [a for a in base if a.split("=")[0] not in given] + list(extra)


def one_error(capsys, call):
    """call() must exit 2 with a single `error: ...` line on stderr and no traceback; returns
    that line."""
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished tiny GPT run (4 steps), a prepared data copy, and a tiny TSA run and copy-task
    run to sample."""
    root = tmp_path_factory.mktemp("runs")
    data = root / "data"
    src = next(p for p in (os.path.join(ROOT, "data", "shakespeare", "input.txt"),
                           os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare",
                                        "input.txt"))
               if os.path.exists(p))
    (data / "shakespeare").mkdir(parents=True)
    shutil.copy(src, data / "shakespeare" / "input.txt")
    train.main(flags(data, root / "gpt"))
    train.main(flags(data, root / "tsa", "--model=tsa", "--n_layer=2", "--max_iters=2",
                     "--hard_ft_iters=1"))
    train.main(flags(data, root / "copy", "--dataset=copy", "--max_iters=2"))
    return root


def copy_run(runs, tmp_path, name="gpt"):
    shutil.copytree(runs / name, tmp_path / name)
    return tmp_path / name


def drop_a_weight(out):
    """A checkpoint whose weights miss one tensor its own config makes."""
    ckpt = common.load_checkpoint(str(out / "ckpt.pt"))
    ckpt["model"].pop(next(iter(ckpt["model"])))
    torch.save(ckpt, out / "ckpt.pt")
    return out


def narrow_wte(out):
    """A checkpoint whose token embedding is half as wide as its config says."""
    ckpt = common.load_checkpoint(str(out / "ckpt.pt"))
    ckpt["model"]["wte.weight"] = ckpt["model"]["wte.weight"][:, :8].clone()
    torch.save(ckpt, out / "ckpt.pt")
    return out


def edit_config(out, lr=None, model=None):
    """A config.json edited by hand after the run was written."""
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({k: v for k, v in (("learning_rate", lr), ("model", model)) if v is not None})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


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
    """A folder this process cannot write in (root ignores chmod: then a read-only mount, if
    there is one)."""
    return "/sys/nanoroute" if os.geteuid() == 0 else None


# (argv after the tiny flags, setup(runs, tmp_path, monkeypatch) -> out_dir or None,
# message in the error)
TRAIN_CASES = {
    "empty model": (["--model="], None, "--model has an empty value"),
    "empty dataset": (["--dataset", ""], None, "--dataset has an empty value"),
    "flag twice": (["--n_embd=32", "--n_embd=64"], None, "--n_embd is given twice"),
    "zero heads": (["--n_head=0"], None, "n_head must be >= 1, got 0"),
    "negative width": (["--n_embd=-16"], None, "n_embd must be >= 1"),
    "zero layers": (["--n_layer=0"], None, "n_layer must be >= 1"),
    "a size the model refuses": (["--model=conddepth", "--n_layer=2", "--d_s=-1"], None,
                                 "d_s must be > 0, got -1"),
    "data_dir a file": (["--data_dir={data}/shakespeare/input.txt"], None,
                        "is a file, not a directory"),
    "infinite lr": (["--learning_rate=inf"], None, "--learning_rate must be a finite number"),
    "meta device": (["--device=meta"], None,
                    "device must be auto, cpu, cuda, cuda:N or mps, got 'meta'"),
    "device typo": (["--device=cdua"], None, "got 'cdua'"),
    "bool typo": (["--compile=maybe"], None, "--compile expects bool"),
    "resume and overwrite": (["--resume", "--overwrite"], None, "give one of them"),
    "too big for memory": (["--n_layer=64", "--n_embd=16384", "--n_head=64"], None, "more than"),
    "activations too big": (["--block_size=20000", "--batch_size=4096"], None,
                            "activations at batch_size=4096"),
    "a run is there": ([], lambda r, t, m: copy_run(r, t),
                       "holds a run (ckpt.pt, best.pt, metrics.jsonl, "
                       "config.json): continue it with --resume, or start over with --overwrite"),
    "only a log is there": ([], lambda r, t, m: (t / "x").mkdir()
                            or (t / "x" / "metrics.jsonl").write_text("") or t / "x",
                            "holds a run (metrics.jsonl)"),
    "resume nothing": (["--resume"], lambda r, t, m: t / "none", "no {out}/ckpt.pt to resume from"),
    "resume another model": (["--resume", "--model=tsa", "--n_layer=2", "--max_iters=9"],
                             lambda r, t, m: copy_run(r, t),
                             "--resume: --model asks for model=tsa but {out}/config.json "
                             "has model=gpt; a resumed run keeps its values: drop --model (may"),
    "resume another size": (["--resume", "--n_embd=32", "--max_iters=9"],
                            lambda r, t, m: copy_run(r, t),
                            "--n_embd asks for n_embd=32 but {out}/config.json has n_embd=16"),
    "resume another dataset": (["--resume", "--dataset=sort", "--max_iters=9"],
                               lambda r, t, m: copy_run(r, t),
                               "--dataset asks for dataset=sort but {out}/config.json "
                               "has dataset=shakespeare"),
    "resume with another seed": (["--resume", "--seed=7", "--max_iters=9"],
                                 lambda r, t, m: copy_run(r, t),
                                 "--resume: --seed asks for seed=7 but {out}/config.json has "
                                 "seed=1337; a resumed run keeps its values: drop --seed (may "
                                 "change: --max_iters"),
    "resume with a preset": (["--resume", "--preset=paper", "--max_iters=9"],
                             lambda r, t, m: copy_run(r, t),
                             "--preset paper (its learning_rate) asks for learning_rate=0.001 but"),
    "resume with another eval_iters": (["--resume", "--eval_iters=3", "--max_iters=9"],
                                       lambda r, t, m: copy_run(r, t),
                                       "--eval_iters asks for eval_iters=3"),
    "resume an edited config.json": (["--resume", "--max_iters=9"], lambda r, t, m: edit_config(
        copy_run(r, t), lr=0.5),
        "ckpt.pt has learning_rate=0.002 but this run asks for learning_rate=0.5"),
    "resume a config.json of nothing": (["--resume", "--max_iters=9"], lambda r, t, m: edit_config(
        copy_run(r, t), model="mlp"), "config.json is not a nanoroute run's config"),
    "resume a config.json with a string lr": (
        ["--resume", "--max_iters=9"], lambda r, t, m: edit_config(copy_run(r, t), lr="0.002"),
        "learning_rate must be float, got '0.002' ({out}/config.json, with the flags"),
    "resume a best.pt copy": (["--resume", "--max_iters=9"], lambda r, t, m: shutil.copy(
        copy_run(r, t) / "best.pt", t / "gpt" / "ckpt.pt") and t / "gpt",
        "has no training state (optimizer"),
    "resume at max_iters": (["--resume"], lambda r, t, m: copy_run(r, t),
                            "is at step 4 and --max_iters=4"),
    "resume past max_iters": (["--resume", "--max_iters=2"], lambda r, t, m: copy_run(r, t),
                              "nothing left"),
    "resume a corrupt log": (["--resume", "--max_iters=9"],
                             lambda r, t, m: (copy_run(r, t) / "metrics.jsonl")
                             .write_text("{}\nnot json\n{}\n") and t / "gpt",
                             "line 2 is not JSON"),
    "out_dir under a file": ([], lambda r, t, m: (t / "f").write_text("") or t / "f" / "run",
                             "is a file"),
    "read-only out_dir": ([],
                          lambda r, t, m: read_only() or pytest.skip("no read-only folder here"),
                          "cannot write in"),
    "full disk": ([], lambda r, t, m: writes_fail(m) or t / "full", "No space left on device"),
    "odd train.bin": (["--data_dir={data}"],
                      lambda r, t, m: damage(t / "data" / "shakespeare" / "train.bin", 2001),
                      "train.bin has 2,001 bytes, but"),
    "truncated train.bin": (["--data_dir={data}"], lambda r, t, m: damage(
        t / "data" / "shakespeare" / "train.bin", 2000), "the preparation is damaged; delete"),
    "empty val.bin": (["--data_dir={data}"],
                      lambda r, t, m: damage(t / "data" / "shakespeare" / "val.bin", 0),
                      "val.bin has 0 bytes"),
    "stray word": (["gpt"], None, "unexpected argument 'gpt'"),
    "a seed torch cannot take": (["--seed=99999999999999999999999"], None,
                                 "seed must be < 2**63, got 9999"),
    "out_dir inside the data": ([], lambda r, t, m: t / "data" / "shakespeare",
                                "is inside --data_dir {data}, the prepared data: "
                                "choose another --out_dir"),
    "init_from a folder of nothing": (["--init_from={data}"], None,
                                      "no config.json or model.safetensors there "
                                      "(a Hugging Face GPT-2"),
    "resume weights that do not fit": (["--resume", "--max_iters=9"],
                                       lambda r, t, m: drop_a_weight(copy_run(r, t)),
                                       "{out}/ckpt.pt does not fit this run's gpt (Error(s) in "
                                       "loading state_dict for Model:); resume with the flags it "
                                       "was trained with"),
    "unknown dataset": (["--dataset=imdb"], None, "unknown dataset 'imdb'; choose one of "
                        "shakespeare, shakespeare_bpe, enwik8, copy, sort, fineweb_edu"),
    "unknown preset": (["--preset=laptop"], None, "unknown preset 'laptop' for --model gpt; "
                       "choose one of classroom, paper, gpu"),
    "init_from a routed run": (["--init_from={data}/../tsa/ckpt.pt", "--n_layer=2"],
                               lambda r, t, m: copy_run(r, t, "tsa") and None,
                               "/tsa/ckpt.pt has weights --model gpt lacks: ['routers.0.fc1.weight"
                               "', 'routers.0.fc1.bias', 'routers.0.fc2.weight']"),
    "init_from a weight of another shape": (
        ["--init_from={data}/../gpt/ckpt.pt"], lambda r, t, m: narrow_wte(copy_run(r, t)) and None,
        "/gpt/ckpt.pt does not fit --model gpt: size mismatch for wte.weight: copying a param with "
        "shape torch.Size([65, 8]) from checkpoint"),
    "compile refused here": (
        ["--model=dtrnet", "--n_layer=3", "--compile=true"],
        lambda r, t, m: m.setattr(__import__("dtrnet"), "COMPILE_REFUSED", {"cpu": "planted"}),
        "error: --compile is refused for --model dtrnet on cpu: planted"),
    "init_from a log": (["--init_from={data}/shakespeare/meta.json"], None,
                        "meta.json is corrupt or not a nanoroute checkpoint (UnpicklingError)"),
    "a leftover RANK": ([], lambda r, t, m: [m.delenv(k, raising=False) for k in (
        "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")] and m.setenv("RANK", "1"),
        "RANK=1 is set but not WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK: a leftover"),
    "no value before a flag": (["--model=tsa", "--n_layer=2", "--lam", "--seed", "3"], None,
                               "--lam needs a value"),
    "dtrnet with no D layer": (["--model=dtrnet", "--n_layer=2"], None,
                               "layers='bilayer' at n_layer=2 gives 'TT', no D (routed) layer"),
}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_py(case, runs, tmp_path, monkeypatch, capsys):
    extra, setup, message = TRAIN_CASES[case]
    shutil.copytree(runs / "data", tmp_path / "data")
    out = (setup(runs, tmp_path, monkeypatch) if setup else None) or tmp_path / "run"
    before = {f: (out / f).read_bytes() for f in train.RUN_FILES
              if os.path.isfile(os.path.join(out, f))}
    extra = [a.replace("{data}", str(tmp_path / "data")) for a in extra]
    capsys.readouterr()
    data = tmp_path / "data" if case == "out_dir inside the data" else runs / "data"
    err = one_error(capsys, lambda: train.main(flags(data, out, *extra)))
    assert message.replace("{out}", str(out)).replace("{data}", str(data)) in err
    assert "weights_only=False" not in err  # torch's advice to run a file's code is not ours
    assert {f: (out / f).read_bytes() for f in before} == before  # a refusal writes nothing
    # nor leaves partial files
    assert not [f for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]


SAMPLE_VALID = ("--sample, --prompt, --num_tokens, --temperature, --top_k, --dense, --compile, "
                "--seed, --device")
SAMPLE_LIMITS = "--num_tokens and --top_k must be >= 1 and --temperature >= 0"
# (argv after --sample <the gpt run> ({runs}: the runs folder), the exact line after "error: ")
SAMPLE_CASES = {
    "nan temperature": (["--temperature", "nan"],
                        "--temperature must be a finite number, got 'nan'"),
    "inf temperature": (["--temperature=inf"], "--temperature must be a finite number, got 'inf'"),
    "negative temperature": (["--temperature=-1"], SAMPLE_LIMITS),
    "empty run dir": (["--sample="],
                      "--sample has an empty value; give a value or leave the flag out"),
    "prompt twice": (["--prompt=a", "--prompt=b"], "--prompt is given twice; give each flag once"),
    "meta device": (["--device=meta"], "device must be auto, cpu, cuda, cuda:N or mps, got 'meta'"),
    "zero tokens": (["--num_tokens=0"], SAMPLE_LIMITS),
    "zero top_k": (["--top_k=0"], SAMPLE_LIMITS),
    "copy prompt not numbers": (["--prompt=hello"], "a copy prompt is space-separated numbers "
                                "0..31 and [BOS]/[SEP]/[EOS], got 'hello'"),
    "copy prompt empty": (["--prompt="], "--prompt is empty; a copy prompt needs at least one "
                          "token (e.g. '[BOS] 3 1')"),
    "a seed of 2**64": (["--seed=18446744073709551616"],
                        "--seed must be in 0..2**63-1, got 18446744073709551616"),
    "a seed of 2**63": (["--seed=9223372036854775808"],
                        "--seed must be in 0..2**63-1, got 9223372036854775808"),
    "a negative seed": (["--seed=-1"], "--seed must be in 0..2**63-1, got -1"),
    "dense and a step to build": (["--compile", "--dense"],  # no "compile" in the id: it is fast
                                  "--compile compiles the cached decoding step, and --dense "
                                  "decodes without one: give one of them"),
    "unknown option": (["--top_p=0.9"],
                       f"unknown option --top_p with --sample; valid: {SAMPLE_VALID}"),
    "no such run": (["--sample={runs}/none"], "--sample {runs}/none: no such run directory "
                    "(train one with python train.py --model ...)"),
    "a folder with no checkpoint": (["--sample={runs}/data"], "--sample {runs}/data: no best.pt or "
                                    "ckpt.pt there (has the run reached its first eval?)"),
}


@pytest.mark.parametrize("case", SAMPLE_CASES)
def test_train_py_sample(case, runs, capsys):
    extra, message = SAMPLE_CASES[case]
    run = runs / ("copy" if case.startswith("copy") else "gpt")
    extra = [a.replace("{runs}", str(runs)) for a in extra]
    given = {a.split("=")[0] for a in extra}
    argv = [a for a in ("--sample", str(run)) if "--sample" not in given] + extra
    capsys.readouterr()
    err = one_error(capsys, lambda: train.main(argv))
    assert err == "error: " + message.replace("{runs}", str(runs))


def test_sample_copy_task_without_a_prompt_completes_a_held_out_record(runs, capsys):
    train.main(["--sample", str(runs / "copy"), "--device=cpu"])
    out = capsys.readouterr().out
    source = common.load_split("copy", "val", str(runs / "data"))[:common.TASK_LEN + 2]
    line = "no --prompt: completing the first held-out record's source " \
           f"{' '.join(['[BOS]', *map(str, source[1:-1]), '[SEP]'])!r}"
    assert out.splitlines()[0] == line and source[0] == common.BOS and source[-1] == common.SEP
    sample = out.split("sample:\n")[1].split()
    assert sample[0] == "[BOS]" and sample[11] == "[SEP]" and len(sample) == 2 * common.TASK_LEN + 3
    train.main(["--sample", str(runs / "copy"), "--num_tokens=3", "--device=cpu"])  # given: taken
    assert len(capsys.readouterr().out.split("sample:\n")[1].split()) == common.TASK_LEN + 2 + 3


def test_a_sample_cropped_to_the_context_says_so(runs, capsys):
    train.main(["--sample", str(runs / "gpt"), "--prompt=" + "ROMEO: " * 4, "--num_tokens=2",
                "--device=cpu"])
    out = capsys.readouterr().out
    assert "note: the prompt's 28 tokens are more than the model's context (block_size 16): " \
           "it continues from the last 16" in out
    assert "KV-cached decoding" in out and out.split("sample:\n")[1].startswith(
        ("ROMEO: " * 4)[-16:])
    train.main(["--sample", str(runs / "gpt"), "--prompt=" + ("ROMEO: " * 4)[-16:],
                "--num_tokens=2", "--device=cpu"])  # exactly block_size tokens: all seen, no note
    assert "note:" not in capsys.readouterr().out


def test_sample_in_a_read_only_run_prints_the_sample_then_warns(runs, monkeypatch, capsys):
    writes_fail(monkeypatch)
    train.main(["--sample", str(runs / "tsa"), "--num_tokens=5", "--prompt=ROMEO:", "--device=cpu"])
    out, err = capsys.readouterr()
    assert "sample:\nROMEO:" in out and "Traceback" not in err
    assert (err.count("\n") == 1 and err.startswith("warning: could not write")
            and "sample_routing.html" in err)
    assert "\ntsa: routing of the sample's last 11 tokens   legend: " in out  # the picture, unsaved


def test_sample_takes_the_boundary_values_and_an_empty_prompt_is_a_newline(runs, capsys):
    """seed 0 and 2**63-1, one token, temperature 0, top_k 1 are accepted (the table above
    refuses one past each); --prompt= continues a newline, as nanoGPT's sample.py."""
    for seed in (0, 2 ** 63 - 1):
        train.main(["--sample", str(runs / "gpt"), "--prompt=", f"--seed={seed}", "--num_tokens=1",
                    "--temperature=0", "--top_k=1", "--device=cpu"])
        out = capsys.readouterr().out
        assert " 1 tokens in " in out and len(out.split("sample:\n")[1]) == 3  # "\n", one, "\n"
        assert out.split("sample:\n")[1].startswith("\n")


def sampled_checkpoint(runs, tmp_path, edit):
    """A run folder holding only a ckpt.pt: the gpt run's, changed by edit(ckpt)."""
    ckpt = common.load_checkpoint(str(runs / "gpt" / "ckpt.pt"))
    edit(ckpt)
    (tmp_path / "run").mkdir()
    torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    return tmp_path / "run" / "ckpt.pt"


# (edit of the checkpoint, the exact error line after "error: checkpoint {path}")
CHECKPOINT_CASES = {
    "unknown model": (lambda c: c["config"].update(model="mlp"), " names an unknown model 'mlp'"),
    "unknown field": (lambda c: c["config"].update(top_p=0.9), " has a config this code does not "
                      "know (Config.__init__() got an unexpected keyword argument 'top_p')"),
    "weights of another model": (lambda c: c["model"].pop("wpe.weight"), "'s weights do not fit "
                                 "its own config: Error(s) in loading state_dict for Model:"),
}


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_sample_refuses_a_checkpoint_it_cannot_build(case, runs, tmp_path, capsys):
    edit, message = CHECKPOINT_CASES[case]
    path = sampled_checkpoint(runs, tmp_path, edit)
    err = one_error(capsys, lambda: train.main(["--sample", str(path.parent), "--device=cpu"]))
    assert err == f"error: checkpoint {path}{message}"


def test_sample_of_a_checkpoint_without_a_val_loss_says_nan(runs, tmp_path, capsys):
    """No best.pt: the ckpt.pt; a checkpoint without val_loss (written by hand) reads `val nan`."""
    path = sampled_checkpoint(runs, tmp_path, lambda c: c.pop("val_loss"))
    train.main(["--sample", str(path.parent), "--num_tokens=2", "--device=cpu"])
    assert capsys.readouterr().out.startswith(f"gpt from {path} (step 4, val nan); 2 tokens in ")


def test_sample_passes_its_flags_to_generate_and_says_what_ran(runs, tmp_path, monkeypatch,
                                                                capsys):
    """The values generate gets, and the line saying what ran: decoding (cached, routed, a
    compiled step, or the whole window per token), the step, val loss, time and tokens/s."""
    import inspect
    calls, seeds, signature = [], [], inspect.signature(common.LM.generate)

    def generate(self, *args, **kwargs):  # what it was asked; its tokens: newlines (id 0)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        calls.append({k: v for k, v in bound.arguments.items() if k not in ("self", "idx")})
        seeds.append(torch.initial_seed())  # --seed seeds the sampling
        return torch.cat([args[0], args[0].new_zeros(1, args[1])], 1)
    monkeypatch.setattr(common.LM, "generate", generate)
    clock = iter([100.0, 102.5])
    monkeypatch.setattr(train.time, "perf_counter", lambda: next(clock))
    tsa = copy_run(runs, tmp_path, "tsa")
    cases = [  # (run, flags, use_cache, compile, what ran)
        (runs / "gpt", [], True, False, "KV-cached decoding"),
        (runs / "gpt", ["--dense"], False, False,
         "cache-free forward of the whole window per token"),
        (runs / "gpt", ["--compile"], True, True,
         "KV-cached decoding, compiled step (includes compile time)"),
        (tsa, [], True, False, "KV-cached decoding, routed"),
        (tsa, ["--compile"], True, True,
         "KV-cached decoding, routed, compiled step (includes compile time)"),
        (tsa, ["--dense"], False, False, "cache-free forward of the whole window per token"),
    ]
    for run, extra, use_cache, compiled, how in cases:
        clock = iter([100.0, 102.5])
        train.main(["--sample", str(run), "--prompt=ROMEO:", "--num_tokens=5", "--temperature=0.5",
                    "--top_k=7", "--device=cpu", "--seed=11", *extra])
        assert seeds.pop() == 11
        assert calls.pop() == {"max_new_tokens": 5, "temperature": 0.5, "top_k": 7,
                               "use_cache": use_cache, "compile": compiled}, extra
        ckpt = common.load_checkpoint(str(run / "best.pt"))
        out = capsys.readouterr().out.splitlines()
        assert out[:3] == [f"{run.name} from {run / 'best.pt'} (step {ckpt['iter']}, val "
                           f"{ckpt['val_loss']:.4f}); 5 tokens in 2.50s (2 tok/s, {how})",
                           "sample:", "ROMEO:"]
    # a model that decodes without a cache whatever is asked (conddepth's mode=topk): the line
    # says what generate ran, not what the flag asked for
    monkeypatch.setattr(common.LM, "decodes_cached", lambda self, use_cache=True: False)
    clock = iter([100.0, 102.5])
    train.main(["--sample", str(runs / "gpt"), "--prompt=ROMEO:", "--num_tokens=5", "--device=cpu"])
    assert capsys.readouterr().out.splitlines()[0].endswith(
        "(2 tok/s, cache-free forward of the whole window per token)")


def test_the_sample_is_flushed_before_the_routing_picture(runs, tmp_path, monkeypatch):
    """The sample first: a picture that never ends (a kill, a crash) loses nothing."""
    import io

    class Stdout(io.StringIO):
        flushed = ""

        def flush(self):
            self.flushed = self.getvalue()
    monkeypatch.setattr(sys, "stdout", Stdout())
    seen = []
    monkeypatch.setattr(train, "picture", lambda *a: seen.append(sys.stdout.flushed) or "picture")
    train.main(["--sample", str(copy_run(runs, tmp_path, "tsa")), "--prompt=ROMEO:",
                "--num_tokens=3", "--device=cpu"])
    assert len(seen) == 1 and seen[0].endswith("sample:\nROMEO:" + seen[0][-4:])
    assert seen[0].count("\n") == 3 and seen[0].endswith("\n")


def test_sample_of_a_routed_model_writes_the_picture_of_its_last_window(runs, tmp_path, monkeypatch,
                                                                        capsys):
    run = copy_run(runs, tmp_path, "tsa")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    train.main(["--sample", str(run), "--prompt=ROMEO:", "--num_tokens=12", "--device=cpu"])
    out = capsys.readouterr().out
    sample = out.split("sample:\n")[1][:18]  # 6 + 12 tokens, the last block_size = 16 drawn
    title = "tsa: routing of the sample's last 16 tokens"
    assert f"\n{title}   legend: " in out
    assert out.endswith(f"\nwrote {run / 'sample_routing.html'}\n")
    assert "\n" + sample[2:].replace("\n", "⏎\n") in out and not os.listdir(tmp_path / "cwd")
    assert f"<title>{html.escape(title)}</title>" in (run / "sample_routing.html").read_text()


def test_sample_whose_decoding_step_fails_to_build_is_one_line(runs, monkeypatch, capsys):
    """A compiler that cannot build (no C++ compiler here): one line with the cause and the fix."""
    import functools

    def no_compiler(gm, example_inputs):
        raise RuntimeError("Compiler: cc is not found")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=no_compiler))
    err = one_error(capsys, lambda: train.main(["--sample", str(runs / "gpt"), "--compile",
                                                "--num_tokens=3", "--device=cpu"]))
    assert err == "error: --compile failed compiling the decoding step " \
                  "(RuntimeError: Compiler: cc is not found); run without it: leave out --compile"


def test_help(capsys):
    assert train.main(["--help"]) is None
    out = capsys.readouterr().out
    for group in ("run:", "data:", "optimisation:", "model (every model):",
                  "presets of --model gpt"):
        assert f"\n{group}" in out
    assert ("--overwrite=false" in out
            and "removes its ckpt.pt, best.pt, metrics.jsonl, config.json" in out)
    assert "--n_head=6" in out and "attention heads" in out and "classroom: --n_layer=4" in out
    every = {f.name for f in __import__("dataclasses").fields(common.Config)} - {"model", "dataset"}
    lines = {ln.split("=")[0].strip(): ln for ln in out.splitlines() if ln.startswith("  --")}
    # each explained
    assert every <= {k[2:] for k in lines} and all(len(lines["--" + k].split()) > 1 for k in every)
    for name, file in train.MODELS.items():  # every field of every model's Config: one line of help
        train.main(["--model", name, "--help"])
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  --")]
        fields = {f.name
                  for f in __import__("dataclasses").fields(train.model_module(name)[1].Config)}
        assert {ln.split("=")[0].strip()[2:] for ln in lines} >= fields - {"model", "dataset"}, name
        assert all(len(ln.split()) > 1 for ln in lines), (
            name, [ln for ln in lines if len(ln.split()) < 2])
    train.main(["--model", "tsa", "-h"])
    out = capsys.readouterr().out
    assert ("--model tsa (tsa.py's Config):" in out and "--lam=0.001" in out
            and "λ of eq. (5)" in out)
    assert "  --model=tsa " in out  # the model asked for is the one shown
    train.main(["--sample", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python train.py --sample RUN_DIR") and "--temperature=0.8" in out
    assert out.splitlines()[:3] == [
        "usage: python train.py --sample RUN_DIR [--prompt TEXT] [--num_tokens N] "
        "[--temperature T] ...", "", "Generate text from a trained run (nanoGPT's sample.py)."]
    # each flag shows once, and a model's own group holds exactly its Config's own fields
    train.main(["--model=tsa", "--help"])
    groups, keys = {}, []
    for ln in capsys.readouterr().out.split("\n--grad_accum=N")[0].splitlines():
        if ln.endswith(":") and not ln.startswith(" "):
            title = ln
        elif ln.startswith("  --"):
            groups.setdefault(title, []).append(ln.split("=")[0].strip()[2:])
            keys.append(groups[title][-1])
    import tsa
    common_fields = {f.name for f in dataclasses.fields(common.Config)}
    assert len(keys) == len(set(keys))
    assert set(groups["--model tsa (tsa.py's Config):"]) == {
        f.name for f in dataclasses.fields(tsa.Config)} - common_fields - set(train.FLAGS)


def test_help_prose_by_value(capsys, monkeypatch):
    """The usage lines and the accumulation note, word for word; a field with no help comment
    shows its default alone. Seen failing with each text changed and with a placeholder help."""
    train.main(["--help"])
    out = capsys.readouterr().out
    assert out.splitlines()[:6] == [
        "usage: python train.py [--model M] [--dataset D] [--preset P] [--resume | --overwrite] "
        "[--key=value ...]",
        "       python train.py --sample RUN_DIR [--prompt TEXT] ...  "
        "(python train.py --sample --help)",
        "       python train.py --model M --help  (that model's own flags)", "",
        train.__doc__.strip().splitlines()[0],
        "Every flag is --key=value or --key value; a bool alone (--compile) is true."]
    assert ("\n--grad_accum=N: N micro-batches of batch_size per step, the gradients of their "
            "mean loss\n(DDP syncs on the last); a router's batch statistics are each "
            "micro-batch's: dtrnet's α_l,\nthe hybrid's balance loss and Gumbel noise, "
            "conddepth's budget/alive losses and θ_l, tsa's\ncalibration (train.accumulate's "
            "docstring gives each difference)\n") in out
    presets = out.split("\npresets of --model gpt (--preset NAME sets these; flags given too "
                        "win):\n")[1].splitlines()
    assert [ln.split(":")[0] for ln in presets] == ["  classroom", "  paper", "  gpu"]
    assert presets[0] == ("  classroom: --n_layer=4 --n_head=4 --n_embd=128 --block_size=64 "
                          "--batch_size=16 --max_iters=1500 --eval_interval=500 --eval_iters=20 "
                          "--log_interval=100 --learning_rate=0.002 --min_lr=0.0001 "
                          "--warmup_iters=50")
    monkeypatch.setattr(train, "field_help", lambda config: {})
    train.main(["--help"])
    assert "\n  --n_head=6\n" in capsys.readouterr().out


def test_each_eval_records_its_own_splits_and_keeps_the_best_val(runs, tmp_path, monkeypatch,
                                                                  capsys):
    """Each eval measures train on the train split and val on the val split; its record's val_*
    stats (every one but the loss) are val's and its line shows val's soft loss; the last step is
    evaluated though off the interval; best.pt holds the eval with the lowest val loss (not train
    loss), and every checkpoint's val_loss is its own eval's. Losses scripted: val 3, 1, 2; train
    0.5, 2.5, 0.1; soft losses val's + 0.5 (train's + 0.25)."""
    script = {"val": iter([3.0, 1.0, 2.0]), "train": iter([0.5, 2.5, 0.1])}
    sizes = []

    def estimate_loss(model, data, meta, cfg, device, split="val", sparse=False):
        sizes.append((split, len(data)))
        loss, val = next(script[split]), split == "val"
        return {"loss": loss, "soft_loss": loss + (0.5 if val else 0.25),
                "acc": 0.4 if val else 0.6, "skipped": 0.25 if val else 0.75}
    monkeypatch.setattr(common, "estimate_loss", estimate_loss)
    monkeypatch.setattr(train, "summary", lambda *a: None)
    out = tmp_path / "run"
    assert train.main(flags(runs / "data", out, "--eval_interval=3")) == 1.0
    n = {s: len(common.load_split("shakespeare", s, str(runs / "data"))) for s in ("train", "val")}
    assert n["train"] != n["val"] and sizes == [("train", n["train"]), ("val", n["val"])] * 3
    evals = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r["kind"] == "eval"]
    assert [(r["step"], r["train_loss"], r["val_loss"], r["val_skipped"], r["val_acc"],
             r["val_soft_loss"]) for r in evals] == [
        (0, 0.5, 3.0, 0.25, 0.4, 3.5), (3, 2.5, 1.0, 0.25, 0.4, 1.5), (4, 0.1, 2.0, 0.25, 0.4, 2.5)]
    assert "step 3: train loss 2.5000, val loss 1.0000 (soft 1.5000), skipped 25%\n" in \
        capsys.readouterr().out
    best, last = (common.load_checkpoint(str(out / f)) for f in ("best.pt", "ckpt.pt"))
    assert (best["iter"], best["val_loss"]) == (3, 1.0)
    assert (last["iter"], last["val_loss"], last["best_val_loss"]) == (4, 2.0, 1.0)


def test_train_lines_time_the_steps_alone(runs, tmp_path, monkeypatch, capsys):
    """Every log_interval steps a line and a record: ms/iter, tok/s and MFU from the mean time of
    the steps since the last line (evals not counted), and the ETA of the steps left. A clock that
    ticks one second a call: each step takes 1 s, whatever the evals and logging took."""
    clock = iter(range(10 ** 6))
    monkeypatch.setattr(train, "time", types.SimpleNamespace(time=lambda: float(next(clock)),
                                                             perf_counter=time.perf_counter))
    monkeypatch.setattr(train, "summary", lambda *a: None)
    out = tmp_path / "run"
    train.main(flags(runs / "data", out, "--log_interval=2", "--peak_flops=1e6"))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("iter ")]
    recs = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r["kind"] == "train"]
    assert [(r["step"], r["tok_s"]) for r in recs] == [(0, 32.0), (2, 32.0)]  # 2·16 tokens a step
    # a dense GPT's record: these keys (no max_mem_gib off CUDA), its step's learning rate
    arch_cfg = common.Config(**json.load(open(out / "config.json")))
    assert all(set(r) == {"kind", "step", "loss", "lm_loss", "lr", "grad_norm", "tok_s", "mfu"}
               for r in recs)
    assert [r["lr"] for r in recs] == [common.lr_at(i, arch_cfg) for i in (0, 2)]
    assert all(r["grad_norm"] > 0 for r in recs)
    assert [ln.split(": loss ")[0] for ln in lines] == ["iter 0/4", "iter 2/4"]
    assert [ln.split(", ", 1)[1] for ln in lines] == [
        f"1000 ms/iter, 32 tok/s, MFU {r['mfu']:.1%}, ETA {eta}"
        for r, eta in zip(recs, ("4s", "2s"))]
    saved = json.load(open(out / "config.json"))
    arch = common.Config(**{k: saved[k] for k in common.ARCH_FIELDS})
    fpt = common.Model(arch).train_flops_per_token(16, {})
    assert [r["mfu"] for r in recs] == pytest.approx([3 * fpt * 32 / 1e6] * 2, rel=1e-3)


def test_the_run_says_its_size_and_times_its_evals_and_itself_from_its_start(
        runs, tmp_path, monkeypatch, capsys):
    """The first line names the tokens a step trains on; an eval record's time is the seconds since
    the start to 2 decimals; the last line the run's duration. A clock at 1e9 s that ticks
    1.0005 s a call. Seen failing with the time a constant, to 3 decimals, t0 added not
    subtracted, and the header's "tokens" changed."""
    clock = iter(range(10 ** 6))
    monkeypatch.setattr(train, "time", types.SimpleNamespace(
        time=lambda: 1e9 + 1.0005 * next(clock), perf_counter=time.perf_counter))
    monkeypatch.setattr(train, "summary", lambda *a: None)
    train.main(flags(runs / "data", tmp_path / "run"))
    out = capsys.readouterr().out
    assert out.startswith("gpt on shakespeare: 0.00M parameters, device cpu, 1 process(es), "
                          "4 iters of 2×16 tokens\n")
    # a dense model's eval line ends at its val loss; config.json is one field a line
    assert re.search(r"\nstep 4: train loss \d\.\d{4}, val loss \d\.\d{4}\n", out)
    config = (tmp_path / "run" / "config.json").read_text()
    assert config.count("\n") == len(json.loads(config)) + 1
    # the optimizer stepped at the schedule's rate: the last step's (3) is in the checkpoint
    lr = common.lr_at(3, common.Config(**json.loads(config)))
    ckpt = common.load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))
    assert [g["lr"] for g in ckpt["optimizer"]["param_groups"]] == [lr] * 2 and 0 < lr < 1e-3
    times = [r["time"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))
             if r["kind"] == "eval"]
    assert times == sorted(set(times)) and all(t == round(t, 2) for t in times), times
    assert any(round(t % 1, 3) not in (0.0, 0.5) for t in times), times  # where 3 decimals show
    assert re.search(r"\ndone in \d+s; best val loss ", out) and times[-1] < 100


def test_a_tie_keeps_the_first_best_weights(runs, tmp_path):
    """best.pt holds the first weights to reach the best val loss: at a learning rate of 1e-30
    (weights unchanged) every eval ties, and the step-0 weights stay."""
    out = tmp_path / "run"
    train.main(flags(runs / "data", out, "--learning_rate=1e-30", "--min_lr=0"))
    losses = [r["val_loss"] for r in map(json.loads, open(out / "metrics.jsonl"))
              if r["kind"] == "eval"]
    assert len(losses) == 3 and len(set(losses)) == 1
    assert common.load_checkpoint(str(out / "best.pt"))["iter"] == 0


def test_the_data_is_prepared_with_the_runs_shards(runs, tmp_path, monkeypatch, capsys):
    """Seen failing with shards=None passed to prepare."""
    seen = []

    def prepare(dataset, data_dir, shards=None):
        seen.append((dataset, data_dir, shards))
        raise common.NanorouteError("stop here")
    monkeypatch.setattr(common, "prepare", prepare)
    one_error(capsys, lambda: train.main(flags(runs / "data", tmp_path / "r", "--shards=3")))
    assert seen == [("shakespeare", str(runs / "data"), 3)]


def test_each_step_runs_at_its_own_schedule_step(runs, tmp_path, monkeypatch):
    """A model's step schedule (TSA's hard phase, conddepth's label steps, the hybrid's
    temperature) is told the step about to be trained: 0, 1, 2, 3 for a 4-step run."""
    import tsa
    seen, real = [], tsa.Model.on_step
    monkeypatch.setattr(tsa.Model, "on_step", lambda self, it: seen.append(it) or real(self, it))
    monkeypatch.setattr(train, "summary", lambda *a: None)
    losses, accumulate = [], train.accumulate  # the loss logged: the one trained on
    monkeypatch.setattr(train, "accumulate", lambda *a, **k: losses.append(
        accumulate(*a, **k)) or losses[-1])
    train.main(flags(runs / "data", tmp_path / "run", "--model=tsa", "--n_layer=2",
                     "--hard_ft_iters=1"))
    assert seen == [0, 1, 2, 3]
    logged = [r["loss"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))
              if r["kind"] == "train"]
    assert logged == [loss.item() for loss, _ in losses]


def test_each_micro_step_runs_its_forward_under_the_devices_autocast(monkeypatch):
    """The training forward runs in autocast (bf16 on a GPU), the backward outside it: a CPU's
    fp32 has no autocast, so a recording stand-in shows where the forward ran."""
    import contextlib
    where = []

    @contextlib.contextmanager
    def autocast(device, dtype=None):
        where.append("in")
        yield
        where.append("out")
    monkeypatch.setattr(common, "autocast", autocast)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x, y):
            where.append("forward")
            return None, (self.w * x).sum(), {}
    x = torch.ones(2)
    train.accumulate(Model(), [(x, x), (x, x)], torch.device("cpu"))
    assert where == ["in", "forward", "out"] * 2


def test_a_preset_is_read_not_changed():
    """Flags given with a preset override a copy of it: the model's PRESETS stay as written."""
    import tsa
    before = json.dumps(tsa.PRESETS)
    cfg = train.parse_args(["--model=tsa", "--preset=classroom", "--lam=0.5", "--seed=3"])[0]
    assert cfg.lam == 0.5 and json.dumps(tsa.PRESETS) == before
    assert train.parse_args(["--model=tsa", "--preset=classroom"])[0].seed == 1337


def test_resume_after_a_partial_last_log_line(runs, tmp_path, capsys):
    """What a full disk leaves in metrics.jsonl: the cut line is dropped, with a note, and the run
    goes on."""
    out = copy_run(runs, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    train.main(flags(runs / "data", out, "--resume", "--max_iters=6"))
    assert "dropped its last line, cut short" in capsys.readouterr().out
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert (recs[-1]["step"] == 6
            and [r["step"] for r in recs if r["kind"] == "train"] == list(range(6)))


def test_resume_takes_every_value_from_the_runs_config(runs, tmp_path, capsys):
    """Resumed with only the folder and a longer --max_iters: the model, sizes, schedule and seed
    are the run's (config.json), not today's defaults; the flags a user may change mid-run are
    applied."""
    out = copy_run(runs, tmp_path, "tsa")
    saved = json.loads((out / "config.json").read_text())
    train.main(["--resume", f"--out_dir={out}", "--max_iters=3", "--log_interval=2",
                "--device=cpu"])
    now = json.loads((out / "config.json").read_text())
    assert now == {**saved, "max_iters": 3, "log_interval": 2, "out_dir": str(out)}
    assert now["model"] == "tsa" and now["n_layer"] == 2 and now["hard_ft_iters"] == 1
    assert common.load_checkpoint(str(out / "ckpt.pt"))["iter"] == 3
    assert "resuming" in capsys.readouterr().out


def test_resume_of_a_copy_run_by_its_folder_and_what_may_change(runs, tmp_path):
    """--resume with the folder alone: the run's dataset (copy), not --dataset's default; each
    flag of MAY_CHANGE is taken as given (a run's data may move, its device change, ...)."""
    out = copy_run(runs, tmp_path, "copy")
    changed = dict(max_iters=9, eval_interval=3, log_interval=3, device="cpu", compile=True,
                   out_dir=str(out), data_dir=str(tmp_path / "moved"), peak_flops=1e12)
    assert set(changed) == set(train.MAY_CHANGE)
    cfg, _, mode = train.parse_args(["--resume"] + [f"--{k}={v}" for k, v in changed.items()])
    assert (cfg.model, cfg.dataset, mode) == ("gpt", "copy", "resume")
    assert {k: getattr(cfg, k) for k in changed} == changed


def test_init_from_a_run_says_what_came_from_it_and_refuses_a_given_value(runs, tmp_path, capsys,
                                                                          monkeypatch):
    """--n_layer=6 is the default, but given it is asked for: refused, not silently replaced by the
    checkpoint's 1; left out, the checkpoint's sizes are taken and named in one line. Resumed, the
    run reads its own checkpoint once and not the one it started from (gone by then)."""
    ckpt = copy_run(runs, tmp_path, "gpt") / "ckpt.pt"
    base = [f"--data_dir={runs / 'data'}", f"--init_from={ckpt}", "--max_iters=1", "--eval_iters=1",
            "--batch_size=2", "--device=cpu"]
    err = one_error(capsys,
                    lambda: train.main(base + ["--n_layer=6", f"--out_dir={tmp_path / 'a'}"]))
    assert "has n_layer=1, but this run asks for n_layer=6: drop --n_layer" in err
    assert not (tmp_path / "a").exists()
    train.main(base + [f"--out_dir={tmp_path / 'b'}"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("from --init_from")]
    assert lines == [f"from --init_from {ckpt}: vocab_size=65, block_size=16, n_layer=1, n_head=2, "
                     "n_embd=16, bias=false, gelu=none; the rest from this run's flags and "
                     "defaults"]
    ckpt.unlink()
    reads, check = [], train.check_out_dir
    monkeypatch.setattr(train, "check_out_dir", lambda *a: reads.append(a) or check(*a))
    train.main([f"--data_dir={runs / 'data'}", "--resume", "--max_iters=2", "--device=cpu",
                f"--out_dir={tmp_path / 'b'}"])
    log = capsys.readouterr().out.split("resuming")[1]
    assert len(reads) == 1 and "from --init_from" not in log and "init from" not in log
    assert common.load_checkpoint(str(tmp_path / "b" / "ckpt.pt"))["iter"] == 2


def test_a_compile_refusal_leaves_eager_runs_alone(runs, tmp_path, monkeypatch):
    """COMPILE_REFUSED refuses --compile on a device type; without --compile the model trains."""
    import dtrnet
    monkeypatch.setattr(dtrnet, "COMPILE_REFUSED", {"cpu": "planted"})
    assert math.isfinite(train.main(flags(runs / "data", tmp_path / "run", "--model=dtrnet",
                                          "--n_layer=3", "--max_iters=1")))


def test_a_path_with_a_tilde_is_under_home_and_a_replaced_vocab_size_is_said(
        runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    train.main(flags(runs / "data", "~/run", "--max_iters=1", "--vocab_size=100"))
    assert (tmp_path / "run" / "ckpt.pt").exists() and not (tmp_path / "cwd" / "~").exists()
    assert "note: vocab_size 100 -> 65, shakespeare's vocabulary" in capsys.readouterr().out
    train.main(["--sample=~/run", "--num_tokens=3", "--temperature=1e-300", "--device=cpu"])
    assert "sample:" in capsys.readouterr().out
    train.main(flags(runs / "data", "~/run", "--resume", "--max_iters=2"))  # --resume's too
    assert common.load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["iter"] == 2


def test_compile_failing_at_compile_time_is_one_line_before_anything_is_written(
        runs, tmp_path, monkeypatch, capsys):
    """A compiler that cannot build (no C++ compiler here): one line with the cause and
    --compile=false, and no run in the folder, so the same command with --compile=false starts
    without --overwrite."""
    import functools

    def no_compiler(gm, example_inputs):
        raise RuntimeError("Compiler: cc is not found")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=no_compiler))
    err = one_error(capsys, lambda: train.main(flags(runs / "data", tmp_path / "run", "--compile")))
    assert "--compile failed compiling the training step " \
           "(RuntimeError: Compiler: cc is not found); run without it: --compile=false" in err
    assert not (tmp_path / "run").exists()
    # --sample --compile failing: test_sample_whose_decoding_step_fails_to_build_is_one_line


def test_a_new_run_keeps_the_pictures_only_overwrite_removes(runs, tmp_path):
    """A folder with no run in it is no run to replace: a new (dense) run leaves its other files,
    the pictures of OUTPUTS too, as they were."""
    out = tmp_path / "run"
    out.mkdir()
    for f in ("routing.html", "sample_routing.html"):
        (out / f).write_text("mine")
    train.main(flags(runs / "data", out, "--max_iters=1"))
    assert [(out / f).read_text() for f in ("routing.html", "sample_routing.html")] == ["mine"] * 2


def test_empty_input_is_refused_and_not_cached(runs, tmp_path, capsys):
    d = tmp_path / "data" / "shakespeare"
    d.mkdir(parents=True)
    (d / "input.txt").write_text("")
    err = one_error(capsys, lambda: train.main(flags(tmp_path / "data", tmp_path / "run")))
    assert ("is empty or too short" in err and not (d / "meta.json").exists()
            and not (tmp_path / "run").exists())
    shutil.copy(runs / "data" / "shakespeare" / "input.txt", d / "input.txt")
    train.main(flags(tmp_path / "data", tmp_path / "run", "--max_iters=1"))
    assert json.load(open(d / "meta.json"))["val_tokens"] == 111540


def test_overwrite_replaces_the_old_run_and_removes_only_what_it_lists(runs, tmp_path):
    out = copy_run(runs, tmp_path)
    (out / "routing.html").write_text("old")
    (out / "notes.txt").write_text("mine")  # a user's file in the run folder
    (out / "best.pt.tmp").write_text("partial")
    (out / "sample_routing.html.tmp").write_text("partial")  # no run writes this one over
    train.main(flags(runs / "data", out, "--overwrite", "--max_iters=2"))
    assert (common.load_checkpoint(str(out / "ckpt.pt"))["iter"] == 2
            and not (out / "routing.html").exists())
    assert (out / "notes.txt").read_text() == "mine" and not (out / "best.pt.tmp").exists()
    assert not (out / "sample_routing.html.tmp").exists()
    assert set(os.listdir(out)) <= {"notes.txt", *train.OUTPUTS}


class RunsCode:
    """What a pickled checkpoint can do when loaded without weights_only: call any function."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_is_not_weights_only_is_refused_unrun(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"model": {}, "config": {"model": "gpt"}, "x": RunsCode(str(tmp_path / "ran"))},
               run / "best.pt")
    err = one_error(capsys, lambda: train.main(["--sample", str(run)]))
    assert f"checkpoint {run / 'best.pt'} is not weights-only: it holds pickled objects" in err
    assert not (tmp_path / "ran").exists()


# --------------------------------------------------------------------------------------------------
# real processes: a rerun refused, Ctrl-C, torchrun

def cli(*argv, timeout=120, **kw):
    return subprocess.run([sys.executable, "train.py", *map(str, argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


def test_rerun_never_replaces_a_run(runs, tmp_path):
    out = copy_run(runs, tmp_path)
    before = {f: (out / f).read_bytes() for f in train.RUN_FILES}
    p = cli(*flags(runs / "data", out, "--max_iters=2"))
    assert (p.returncode == 2 and p.stderr.count("\n") == 1 and "--resume" in p.stderr
            and "--overwrite" in p.stderr)
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
    train.main([a if not a.startswith("--max_iters") else f"--max_iters={step + 1}"
                for a in cmd[2:]])
    assert not [f for f in os.listdir(tmp_path / "run") if f.endswith(".tmp")]


def test_one_run_folder_one_writer_and_a_killed_run_leaves_no_lock(runs, tmp_path):
    """A second train.py into a folder a live run trains into is one line and writes nothing; once
    the first is killed (SIGKILL: no code of its own runs), the next --resume takes the folder."""
    out = tmp_path / "run"
    argv = flags(runs / "data", out, "--max_iters=100000", "--eval_interval=5")
    first = subprocess.Popen([sys.executable, "train.py", *map(str, argv)], cwd=ROOT, text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for _ in range(1200):  # until the first checkpoint is there
            if (out / "ckpt.pt").exists():
                break
            time.sleep(0.1)
        log = (out / "metrics.jsonl").read_text()
        step = common.load_checkpoint(str(out / "ckpt.pt"))["iter"]
        second = cli(*argv[:-2], f"--max_iters={step + 1}", "--eval_interval=5", "--resume")
        assert first.poll() is None, "the first run ended before the second was tried"
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
        assert second.stderr.startswith(f"error: {out} is being trained by pid {first.pid} on ")
        assert (out / "metrics.jsonl").read_text().startswith(log)  # not rewritten by the second
    finally:
        first.kill()
        first.wait()
    assert (out / train.LOCK).exists()  # what SIGKILL leaves: a file no process holds
    step = common.load_checkpoint(str(out / "ckpt.pt"))["iter"]
    train.main(flags(runs / "data", out, "--resume", f"--max_iters={step + 1}",
                     "--eval_interval=5"))
    assert common.load_checkpoint(str(out / "ckpt.pt"))["iter"] == step + 1
    assert not (out / train.LOCK).exists()


def test_a_ddp_rank_other_than_0_seeds_and_resumes_as_its_own(runs, tmp_path, monkeypatch):
    """Rank 1 of 2, in this process (torch.distributed stood in for): it is seeded with
    seed + rank, on --resume restores the checkpoint's weights and its own RNG state
    (rng_cpu[1]) before its first step, and writes nothing. The run stops at that step."""
    dist = torch.distributed
    monkeypatch.setattr(train, "ddp_env", lambda: (True, 1, 2))
    monkeypatch.chdir(tmp_path)  # no data/ here: rank 1 reads --data_dir's meta.json, not ./data's
    for name in ("init_process_group", "barrier", "destroy_process_group"):
        monkeypatch.setattr(dist, name, lambda *a, **k: None, raising=False)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src: None)  # rank 0: no error
    monkeypatch.setattr(train, "_gather_rng", lambda state, ddp: [state, state])
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda m, device_ids: m)
    seen, build = {}, train.build
    monkeypatch.setattr(train, "build", lambda module, cfg: seen.update(
        seed=torch.initial_seed()) or build(module, cfg))

    class FirstStep(Exception):
        pass

    def accumulate(model, batches, device, ddp=False):
        seen.update(rng=torch.get_rng_state(), wte=model.wte.weight.detach().clone(), ddp=ddp)
        raise FirstStep
    monkeypatch.setattr(train, "accumulate", accumulate)
    out = copy_run(runs, tmp_path)
    ckpt = common.load_checkpoint(str(out / "ckpt.pt"))
    ckpt["rng_cpu"] = [torch.manual_seed(s).get_state() for s in (5, 6)]  # two processes wrote it
    torch.save(ckpt, out / "ckpt.pt")
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    for argv, where in (([], tmp_path / "new"), (["--resume", "--max_iters=9"], out)):
        with pytest.raises(FirstStep):
            train.train(*train.parse(flags(runs / "data", where, *argv)))
        assert seen.pop("seed") == 1337 + 1 and seen["ddp"] is True
    assert torch.equal(seen["rng"], ckpt["rng_cpu"][1])
    assert torch.equal(seen["wte"], ckpt["model"]["wte.weight"])
    assert not (tmp_path / "new").exists()
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before


def torchrun(*argv, monitor=0.1):
    # monitor: how often torchrun looks at its workers; once one has exited non-zero it SIGTERMs
    # the rest, so a rank still exiting on its own may be counted as killed (-15) when it is short
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", f"--monitor-interval={monitor}", "train.py",
                           *map(str, argv)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_torchrun_a_refusal_of_rank_0_ends_every_rank_and_a_sample_prints_once(runs, tmp_path):
    """Rank 0 alone checks the run folder; its verdict ends rank 1 too with exit 2 (not killed by
    torchrun at a barrier it waited at), one error line in all. --sample: one sample, rank 0's."""
    out = copy_run(runs, tmp_path)
    # 5 s: both ranks end on their own long before torchrun looks; one left at a barrier does not
    p = torchrun(*flags(runs / "data", out, "--max_iters=2"), monitor=5)
    assert p.stderr.count("error: ") == 1 and f"error: {out} holds a run" in p.stderr
    assert p.stderr.count("exitcode  : 2") == 2, p.stderr  # both ranks, each by its own refusal
    p = torchrun("--sample", out, "--num_tokens=3", "--device=cpu")
    assert p.returncode == 0 and p.stdout.count("sample:\n") == 1, p.stdout + p.stderr


def test_torchrun_resume_of_a_one_process_run_is_refused(runs, tmp_path):
    out = copy_run(runs, tmp_path)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", "train.py",
                        *flags(runs / "data", out, "--resume", "--max_iters=9")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0
    assert (p.stderr.count("error: ") == 1
            and "was written by 1 process(es), this run has 2" in p.stderr)
    assert common.load_checkpoint(str(out / "ckpt.pt"))["iter"] == 4


# --------------------------------------------------------------------------------------------------
# experiments/: each script run as __main__, in this process

EXP = os.path.join(ROOT, "experiments")
EXPERIMENT_CASES = {
    "tsa.py": [(["table"], "table needs a records file"),
               (["table", "{tmp}/none.jsonl"], "No such file"),
               (["table", "{empty}"], "no records in"),
               (["table", "{metrics}"], "metrics.json line 1 is not an `eval` record (no model)"),
               (["table", "{tsarec}"],
                "tsarec.json line 1 is not an `eval` record (no soft_loss, alpha"),
               (["proxy-table", "{tmp}/none"], "no finished runs in"),
               (["curve-table", "{tmp}"], "no finished runs in"), (["proxy"], "proxy needs --seed"),
               (["curve", "--seeds=one"], "expected comma-separated ints"),
               (["grid", "--lrs=fast"], "floats"),
               (["proxy", "--seed=1", "--branches=hard"], "unknown hard"),
               (["nope"], "invalid choice")],
    "dtrnet.py": [(["table", "--out={tmp}/none"], "no finished runs in"), ([], "required: cmd")],
    "conddepth.py": [(["table", "--out={tmp}"], "no run records in")],
    "hybrid.py": [(["table", "--out={tmp}/none"], "no finished runs in")],
    "devices.py": [(["--device=tpu"], "device must be"),
                   (["--dtypes", "fp8"], "invalid choice: 'fp8'")],
    "compare.py": [(["--runs=gpt-L5"], "unknown gpt-L5; choose from gpt-L6"),
                   (["--seeds=one"], "got 'one'"),
                   (["--table-only", "--quick", "--out={tmp}"], "no records in"),
                   (["--jobs=0"], ">= 1")],
    "bench_report.py": [(["{tmp}/none.json"], "none.json: No such file"), ([], "required: json"),
                        (["{empty}"], "not a bench.py --json file"),
                        (["{norows}"], "no rows to tabulate"),
                        (["{badrow}"], "row 2 is not a bench.py row (no B, T, dtype)"),
                        (["{listrows}"], "row 1 is not a bench.py row (not an object)"),
                        (["{results}"], "not a bench.py --json file (TypeError: rows is a dict)")],
}
if not torch.cuda.is_available():
    EXPERIMENT_CASES["devices.py"].append((["--device=cuda"],
                                           "device 'cuda' is not available here"))


@pytest.mark.parametrize("script,argv,message", [(s, a, m) for s, cases in EXPERIMENT_CASES.items()
                                                  for a, m in cases])
def test_experiments(script, argv, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "norows.json").write_text('{"rows": []}')
    timed = {"suite": "tsa", "what": "forward", "B": 1, "T": 8, "device": "cpu", "dtype": "fp32",
             "speedup": 1.0}
    files = {"badrow": {"rows": [timed, {"suite": "tsa", "what": "forward", "device": "cpu",
                                         "speedup": 2.0}]},
             "listrows": {"rows": [[1, 2]]}, "results": {"rows": {"tsa": 1.0}},
             "metrics": {"kind": "eval", "step": 4, "val_loss": 4.2},
             "tsarec": {"run": "out/tsa/lam0.01_s1", "model": "tsa", "variant": "tsa", "seed": 1,
                        "lam": 0.01}}
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{empty}", str(tmp_path / "empty.jsonl"))
            .replace("{norows}", str(tmp_path / "norows.json")) for a in argv]
    for name in files:
        argv = [a.replace("{" + name + "}", str(tmp_path / f"{name}.json")) for a in argv]
    # after the model files: experiments/tsa.py shadows nothing
    monkeypatch.setattr(sys, "path", sys.path + [EXP])
    monkeypatch.setattr(sys, "argv", [script, *argv])
    assert message in one_error(capsys, lambda: runpy.run_path(os.path.join(EXP, script),
                                                               run_name="__main__"))


def test_bench_filters_that_match_nothing_and_checkpoint_rows_say_so(runs, capsys):
    import bench
    assert "matches no measurement of the gpu suite (names like: decode quick tsa," in one_error(
        capsys, lambda: bench.main(["gpu", "--quick", "--only=decode quick tsx", "--device=cpu"]))
    assert "--only picks among the gpu suite's measurements; bench.py gpt would ignore it" in (
        one_error(capsys, lambda: bench.main(["gpt", "--quick", "--only=decode", "--device=cpu"])))
    rows = bench.main(["gpt", "--quick", "--ckpt", str(runs / "gpt" / "ckpt.pt"), "--device=cpu",
                       "--repeats=1"])
    timed = [r for r in rows if r["what"] != "graphs"]
    assert timed and {r["size"] for r in timed} == {f"{runs / 'gpt' / 'ckpt.pt'}: 1 x 16, T = 16"}


def test_a_study_handed_runs_of_another_kind_says_so(runs, tmp_path, monkeypatch, capsys):
    """A folder of finished runs of another model (or other names) handed to a study's table: one
    line naming the run and what the study expects, not a table of the wrong runs or a traceback."""
    monkeypatch.setattr(sys, "path", sys.path + [EXP])

    def table(script, out):
        monkeypatch.setattr(sys, "argv", [script, "table", f"--out={out}"])
        return one_error(capsys, lambda: runpy.run_path(os.path.join(EXP, script),
                                                        run_name="__main__"))
    study = tmp_path / "study"
    shutil.copytree(runs / "tsa", study / "bilayer_s1")
    (study / "bilayer_s1" / "done").write_text("")
    assert (f"{study / 'bilayer_s1'} is a --model tsa run; this study's runs are dtrnet, gpt, mod"
            in table("dtrnet.py", study))
    assert "is a --model tsa run; this study's runs are hybrid: pass the --out" in table(
        "hybrid.py", study)
    shutil.rmtree(study)
    shutil.copytree(runs / "gpt", study / "gpt-run")
    (study / "gpt-run" / "done").write_text("")
    assert (f"{study / 'gpt-run'} is not one of this study's runs (bilayer, dense, skip, trilayer"
            in table("dtrnet.py", study))


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


# --------------------------------------------------------------------------------------------------
# train.py's rules called directly, each value pinned (mutation testing found these unpinned)

def refused(call, *args, **kw):
    """call(*args, **kw) must raise NanorouteError: its message."""
    with pytest.raises(common.NanorouteError) as e:
        call(*args, **kw)
    return str(e.value)


def test_parse_value_reads_each_type_and_refuses_the_rest(monkeypatch):
    pv = train.parse_value
    assert all(pv("compile", bool, t) is True for t in ("1", "true", "True", "YES", "on", None))
    assert all(pv("compile", bool, t) is False for t in ("0", "false", "No", "OFF"))
    assert pv("seed", int, "12") == 12 and pv("seed", int, "0") == 0
    assert pv("learning_rate", float, "1e-3") == 1e-3 and pv("lam", float, "0") == 0.0
    monkeypatch.setenv("HOME", "/home/u")
    for name in train.PATHS:
        assert pv(name, str, "~/run") == "/home/u/run"
    assert pv("prompt", str, "~x") == "~x" and pv("model", str, "gpt") == "gpt"
    assert refused(pv, "seed", int, None) == "--seed needs a value"
    assert refused(pv, "out_dir", str, None) == "--out_dir needs a value"
    assert refused(pv, "seed", int, "1.5") == "--seed expects int, got '1.5'"
    assert refused(pv, "compile", bool, "maybe") == "--compile expects bool, got 'maybe'"
    assert refused(pv, "compile", bool, "") == "--compile expects bool, got ''"
    for text in ("nan", "inf", "-inf"):
        assert refused(pv, "lr", float, text) == f"--lr must be a finite number, got {text!r}"


def test_split_flags_by_value():
    sf = train.split_flags
    assert sf(["--a=1", "--b", "2", "--c"]) == {"a": "1", "b": "2", "c": None}
    assert sf(["--c", "--d", "x", "--e=x=y"]) == {"c": None, "d": "x", "e": "x=y"}
    assert sf([]) == {} and sf(["--p="], may_be_empty=("p",)) == {"p": ""}
    assert sf(["--p", "", "--q"], may_be_empty=("p",)) == {"p": "", "q": None}
    # a negative number is a value, not a flag (--temperature -1 is then refused by its limit)
    assert sf(["--t", "-1", "--lr", "-1e-3", "--c"]) == {"t": "-1", "lr": "-1e-3", "c": None}
    for argv in (["x"], ["--"], ["-a"], ["--a=1", "b"]):
        assert refused(sf, argv) == (f"unexpected argument {argv[-1]!r}; flags look like "
                                     "--key=value (see --help)")
    assert refused(sf, ["--a", "--a=2"]) == "--a is given twice; give each flag once"
    assert refused(sf, ["--a="]) == ("--a has an empty value; give a value or leave the flag "
                                     "out")
    assert refused(sf, ["--a", ""], may_be_empty=("b",)).startswith("--a has an empty value")


def test_show_and_duration_by_value():
    assert [train.show(v) for v in (True, False, "", "a b", 3, 0, 0.5, "x")] == \
        ["true", "false", "''", "'a b'", "3", "0", "0.5", "x"]
    assert [train._duration(s) for s in (-3, 0, 59.4, 59.6, 60, 61, 3725)] == \
        ["0s", "0s", "59s", "1m00s", "1m00s", "1m01s", "62m05s"]
    assert [train.show(v) for v in ("XXXX", "-", "a.b")] == ["XXXX", "-", "a.b"]  # as they are


@dataclasses.dataclass
class _Commented(common.Config):
    n_layer: int = 3  # the depth this paper uses
    n_head: int = 2


def test_field_help_takes_a_subclass_comment_over_its_base_s():
    """A field a paper's Config redefines with its own comment shows that comment in --help; one it
    redefines without a comment keeps common.Config's."""
    helps = train.field_help(_Commented)
    assert helps["n_layer"] == "the depth this paper uses"
    assert helps["n_head"] == "attention heads (must divide n_embd)"


def test_routing_colours_by_value(monkeypatch):
    """Light blue (cheap) to dark orange (costly) in proportion; ANSI colour only on a TTY."""
    assert [train._mix(a) for a in (0, 0.5, 1)] == [(214, 234, 248), (226, 186, 151),
                                                    (239, 138, 54)]

    class Model:
        def routing_map(self, idx):  # (R, T) in [0, 1], row labels, legend
            return torch.tensor([[0.0, 1.0]]), ["layer 1"], ("halted", "active")
    meta = {"dataset": "shakespeare", "itos": ["a", "b"]}
    for tty in (False, True):
        monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
        text = train.picture(Model(), torch.tensor([[0, 1]]), meta, "t", None)
        assert ("\x1b[" in text) == tty and ("'.'" in text) == (not tty), text


def test_the_routing_page_escapes_every_text_it_shows(tmp_path):
    """Tokens, row labels, the legend and the title are text in the page, never markup."""
    meta = {"dataset": "shakespeare", "itos": ["<", "&"]}
    path = tmp_path / "r.html"
    train.render_routing(meta, [0, 1], torch.tensor([[0.0, 1.0]]), ["<b>"], ("<i>", "<u>"), "<t>",
                         str(path))
    page = path.read_text()
    assert 'title="0.00">&lt;</span>' in page and 'title="1.00">&amp;</span>' in page
    assert not any(tag in page for tag in ("<b>", "<i>", "<u>", "<t>"))


def test_the_plain_routing_text_marks_every_character(tmp_path):
    """Without colour each character of a token gets its own marker under it, so a token of
    several characters (the copy task's "[BOS]", "31") stays aligned with its marks."""
    meta = {"dataset": "copy"}
    text = train.render_routing(meta, [common.BOS, 31, 3], torch.tensor([[1.0, 0.0, 1.0]]),
                                ["layer 1"], ("cheap", "costly"), "t", color=False)
    assert text.splitlines()[2:] == ["[BOS]313", "#####..#"]


def test_train_memory_by_value():
    cfg = common.Config(batch_size=2, block_size=8, n_embd=16, n_layer=3, n_head=2, vocab_size=50)
    act = 4 * (16 * 2 * 8 * 16 * 3 + 2 * 2 * 2 * 8 * 8 + 3 * 2 * 8 * 50)
    assert train.train_memory(cfg, 1000) == (16000, act)


def test_ddp_env_reads_torchruns_variables(monkeypatch):
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    for k in keys:
        monkeypatch.delenv(k, raising=False)
    assert train.ddp_env() == (False, 0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert refused(train.ddp_env) == ("RANK=1 is set but not WORLD_SIZE, MASTER_ADDR, LOCAL_RANK: "
                                      "a leftover of another job? unset RANK, or start the run "
                                      "with torchrun")
    for k, v in zip(keys[1:], ("2", "localhost", "29500", "1")):
        monkeypatch.setenv(k, v)
    assert train.ddp_env() == (True, 1, 2)
    monkeypatch.setenv("RANK", "0")
    assert train.ddp_env() == (True, 0, 2)
    for rank, world in (("2", "2"), ("-1", "2")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world)
        assert refused(train.ddp_env) == f"RANK={rank} is not in 0..WORLD_SIZE-1=1"
    monkeypatch.setenv("RANK", "x")
    assert refused(train.ddp_env) == ("RANK='x' and WORLD_SIZE='2' must be numbers (torchrun "
                                      "sets them)")


def test_what_is_checked_to_fit_is_the_run_the_data_decides(runs, tmp_path, monkeypatch,
                                                              capsys):
    """check_fits sees the Config after the data set its vocabulary and record length (copy: 35
    tokens, records of 23 -> block_size 22), not the flags' values."""
    seen = []

    def check_fits(cfg, meta, module, device):
        seen.append((cfg.vocab_size, cfg.block_size))
        raise common.NanorouteError("stop here")
    monkeypatch.setattr(train, "check_fits", check_fits)
    one_error(capsys, lambda: train.main(flags(runs / "data", tmp_path / "r", "--dataset=copy")))
    assert seen == [(35, 22)]


def test_under_ddp_rank_0_alone_prints_the_one_error_line(monkeypatch, capsys):
    """Every rank refuses a bad flag with exit 2; rank 0 (not every rank, not none) says why."""
    for rank, says in ((0, "error: n_head must be >= 1, got 0\n"), (1, "")):
        monkeypatch.setattr(train, "ddp_env", lambda r=rank: (True, r, 2))
        with pytest.raises(SystemExit) as e:
            train.main(["--n_head=0"])
        assert e.value.code == 2 and capsys.readouterr().err == says


def test_build_makes_the_variant_a_config_asks_for():
    """tsa's early-exit baseline is a class of its own (tsa.build); a module without build() makes
    its Model. Seen failing with build looked up on None or by another name."""
    import tsa
    tiny = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=20)
    assert type(train.build(tsa, tsa.Config(**tiny, variant="early_exit"))) is tsa.EarlyExit
    assert type(train.build(tsa, tsa.Config(**tiny))) is tsa.Model
    assert type(train.build(common, common.Config(**tiny))) is common.Model


def test_main_reads_sys_argv_and_says_an_os_error_in_one_line(monkeypatch, capsys, tmp_path):
    """main() with no argv reads sys.argv after the script's name; an OSError is its file and
    reason, or its text where it names no file. Seen failing with sys.argv[2:], list(None), and
    the file always named."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "--n_head=0", "--n_head=0"])
    assert one_error(capsys, train.main) == "error: --n_head is given twice; give each flag once"
    for e, says in ((OSError(28, "No space left on device", "/x/ckpt.pt"),
                     "error: /x/ckpt.pt: No space left on device"),
                    (OSError("disk gone"), "error: disk gone")):
        def raises(*a, e=e):
            raise e
        monkeypatch.setattr(train, "train", raises)
        assert one_error(capsys, lambda: train.main(["--n_layer=1"])) == says


def test_a_reader_gone_ends_train_py_quietly(monkeypatch, capsys):
    """stdout's reader gone (head, a pager): no traceback; a run cut short exits 1, as Python
    does on a broken pipe; --help just ends. Seen failing with exit 2 and os.open of None or
    without its flags."""
    def gone(*a, **k):
        raise BrokenPipeError
    monkeypatch.setattr(train, "parse", gone)
    with pytest.raises(SystemExit) as e:
        train.main(["--n_layer=1"])
    assert e.value.code == 1 and capsys.readouterr().err == ""
    monkeypatch.setattr(train, "print_help", gone)
    assert train.main(["--help"]) is None and capsys.readouterr().err == ""


def test_on_rank0_runs_the_check_on_rank_0_alone_and_raises_its_verdict():
    calls = []
    assert train.on_rank0(lambda: calls.append(1) or "out", False, True) == "out"
    assert train.on_rank0(lambda: calls.append(2), False, False) is None and calls == [1]

    def raises(e):
        def check():
            raise e
        return check
    assert refused(train.on_rank0, raises(common.NanorouteError("no")), False, True) == "no"
    assert refused(train.on_rank0, raises(OSError(28, "No space left", "/x/ckpt.pt")), False,
                   True) == "/x/ckpt.pt: No space left"
    assert refused(train.on_rank0, raises(OSError("disk gone")), False, True) == "disk gone"
    with pytest.raises(ValueError):  # not a refusal: a bug, with its traceback
        train.on_rank0(raises(ValueError("bug")), False, True)


@pytest.mark.parametrize("sent", [None, "rank 0 refused"])
def test_on_rank0_under_ddp_takes_rank_0s_verdict(sent, monkeypatch):
    """Rank 1 runs no check and raises what rank 0 broadcast (torch.distributed stood in for: its
    broadcast fills the box with rank 0's verdict). Seen failing with src=1, the box not passed,
    or the box's content not read."""
    def broadcast(box, src):
        assert src == 0 and box == [None]
        box[0] = sent
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", broadcast)
    def run():
        return train.on_rank0(lambda: pytest.fail("rank 1 ran the check"), True, False)
    assert (refused(run) if sent else run()) == sent


# no 'compil' in this name: the suite's quick selection (-k 'not compile') keeps it
def test_a_dynamo_or_inductor_error_names_its_root_cause():
    class CompilerError(Exception):
        pass
    CompilerError.__module__ = "torch._inductor.exc"

    class Dynamo(Exception):
        pass
    Dynamo.__module__ = "torch._dynamo.exc"
    cause = RuntimeError("cc is not found\nsecond line")
    outer = CompilerError("backend failed")
    outer.__cause__ = cause
    e = train.compile_failure(outer, "the step", "--compile=false")
    assert str(e) == ("--compile failed compiling the step (RuntimeError: cc is not found); run "
                      "without it: --compile=false")
    wrapped = Dynamo("wrapper")
    wrapped.inner_exception = ValueError("x" * 300)  # BackendCompilerFailed's own attribute
    e = train.compile_failure(wrapped, "w", "f")
    assert str(e) == f"--compile failed compiling w (ValueError: {'x' * 200}); run without it: f"
    ctx = ValueError("")
    low = RuntimeError("model's own error")
    low.__context__ = ctx
    top = Dynamo("top")
    top.__context__ = low
    assert "(ValueError: ); run" in str(train.compile_failure(top, "w", "f"))
    model_error = RuntimeError("shape mismatch")
    model_error.__cause__ = ValueError("inner")
    assert train.compile_failure(model_error, "w", "f") is None  # eager raises it too
    loop = Dynamo("loop")
    loop.__context__ = loop  # a cycle ends (20 links)
    assert "(Dynamo: loop)" in str(train.compile_failure(loop, "w", "f"))


def test_resume_line_gives_the_command_that_continues(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    cfg = common.Config(out_dir=str(tmp_path))
    argv = ["--model=gpt", "--lam", "--overwrite", "--n_layer", "2", "--resume=false"]
    assert train.resume_line(argv, cfg) == (
        "interrupted before the first checkpoint; start again with: python train.py "
        "--model=gpt --lam --n_layer=2 --overwrite")
    (tmp_path / "ckpt.pt").write_text("")
    assert train.resume_line(argv, cfg) == ("interrupted; continue with: python train.py "
                                            "--model=gpt --lam --n_layer=2 --resume")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert train.resume_line(["--out_dir=a b"], cfg) == (
        "interrupted; continue with: torchrun --standalone --nproc_per_node=3 train.py "
        "'--out_dir=a b' --resume")
    # no --out_dir: the run's folder is out/<model>-<dataset> (out_dir_of), whose ckpt.pt says
    # resume; told to --overwrite, a user would remove the run
    (tmp_path / "cwd" / "out" / "gpt-shakespeare").mkdir(parents=True)
    (tmp_path / "cwd" / "out" / "gpt-shakespeare" / "ckpt.pt").write_text("")
    monkeypatch.chdir(tmp_path / "cwd")
    assert train.resume_line([], common.Config()) == (
        "interrupted; continue with: torchrun --standalone --nproc_per_node=3 train.py --resume")


def test_differences_names_what_a_checkpoint_and_the_run_disagree_on():
    cfg = common.Config(n_layer=2, n_embd=32, n_head=2, out_dir="a", device="cpu", max_iters=5)
    saved = dict(n_layer=3, n_embd=32, out_dir="b", device="cuda", max_iters=9, n_head=4,
                 nope=1)
    assert train.differences(saved, cfg) == "n_layer=3 (this run: 2), n_head=4 (this run: 2)"
    assert train.differences({}, cfg) == ""


def test_check_out_dir_refuses_by_value(tmp_path, monkeypatch):
    """Each refusal's exact line, called directly: where out_dir is, what it holds, and a ckpt.pt
    --resume cannot continue (no training state, other values, another process count, done)."""
    data = tmp_path / "data"
    data.mkdir()
    cfg = common.Config(out_dir=str(tmp_path / "run"), data_dir=str(data), max_iters=4)
    out, path = tmp_path / "run", tmp_path / "run" / "ckpt.pt"
    (tmp_path / "f").write_text("")
    assert refused(train.check_out_dir, dataclasses.replace(cfg, out_dir=str(tmp_path / "f" / "r")),
                   "new", 1) == f"--out_dir {tmp_path / 'f' / 'r'}: {tmp_path / 'f'} is a file, " \
                                "not a directory"
    assert refused(train.check_out_dir, dataclasses.replace(cfg, out_dir=str(data / "r")), "new",
                   1) == f"--out_dir {data / 'r'} is inside --data_dir {data}, the prepared " \
                         "data: choose another --out_dir"
    (tmp_path / "link").symlink_to(data)  # the data reached through a symlink: the same folder
    assert refused(train.check_out_dir, dataclasses.replace(
        cfg, out_dir=str(data / "r"), data_dir=str(tmp_path / "link")), "new", 1) == \
        f"--out_dir {data / 'r'} is inside --data_dir {tmp_path / 'link'}, the prepared data: " \
        "choose another --out_dir"
    out.mkdir()
    assert refused(train.check_out_dir, cfg, "resume", 1) == f"--resume: no {path} to resume from"
    (out / "metrics.jsonl").write_text("")
    assert refused(train.check_out_dir, cfg, "new", 1) == (
        f"{out} holds a run (metrics.jsonl): continue it with --resume, or start over with "
        "--overwrite (removes it), or choose another --out_dir")
    assert refused(train.check_out_dir, cfg, "resume", 1) == (
        f"--resume: no {path} to resume from; the run stopped before its first checkpoint: start "
        "it again with --overwrite")
    state = dict(model={}, config=dataclasses.asdict(cfg), iter=2)
    common.save_checkpoint(str(path), **state)
    assert refused(train.check_out_dir, cfg, "resume", 1) == (
        f"{path} has no training state (optimizer, best_val_loss, rng_cpu; a copy of best.pt?): "
        "--resume needs the ckpt.pt a run writes; to train on from its weights, start a new run "
        f"with --init_from={path}")
    state.update(optimizer={}, best_val_loss=4.0, rng_cpu=[torch.get_rng_state()])
    del state["config"]["eval_seed"]  # a field newer than the run: not compared
    common.save_checkpoint(str(path), **state)
    assert train.check_out_dir(cfg, "resume", 1)["iter"] == 2
    assert refused(train.check_out_dir, dataclasses.replace(cfg, n_layer=3), "resume", 1) == (
        f"checkpoint {path} has n_layer=6 but this run asks for n_layer=3; resume with the values "
        f"it was trained with ({out / 'config.json'})")
    assert refused(train.check_out_dir, cfg, "resume", 2) == (
        f"{path} was written by 1 process(es), this run has 2: resume it with python train.py ...")
    common.save_checkpoint(str(path), **dict(state, rng_cpu=[torch.get_rng_state()] * 2))
    assert refused(train.check_out_dir, cfg, "resume", 1) == (
        f"{path} was written by 2 process(es), this run has 1: resume it with torchrun "
        "--nproc_per_node=2 train.py ...")
    common.save_checkpoint(str(path), **dict(state, iter=4))
    assert refused(train.check_out_dir, cfg, "resume", 1) == (
        f"{path} is at step 4 and --max_iters=4: nothing left to train; give a --max_iters above "
        "4 to train on")
    monkeypatch.chdir(tmp_path)
    assert train.check_writable("new_run") is None  # made under the current folder

    def read_only(dir):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(train.tempfile, "TemporaryFile", read_only)
    assert refused(train.check_writable, "new_run") == (
        "--out_dir new_run: cannot write in . (Read-only file system)")


def test_gather_rng_is_every_ranks_state(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)

    def all_gather_object(out, obj):
        out[:] = [(rank, obj) for rank in range(len(out))]
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    assert train._gather_rng("s", True) == [(0, "s"), (1, "s")]
    assert train._gather_rng("s", False) == ["s"]


def test_read_metrics_drops_only_a_cut_last_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    assert train.read_metrics(str(path)) == []
    path.write_text('{"a": 1}\n{"b": 2}\n')
    assert train.read_metrics(str(path)) == [{"a": 1}, {"b": 2}]
    path.write_text('{"a": 1}\n{"b": 2}\n{"kind": "tr')
    assert train.read_metrics(str(path)) == [{"a": 1}, {"b": 2}]
    assert capsys.readouterr().out == (f"note: {path}: dropped its last line, cut short "
                                       "('{\"kind\": \"tr')\n")
    path.write_text('{"a": 1}\n{"kind": "train", "step": 12, "loss": 4.1, "time": 0.')
    assert train.read_metrics(str(path)) == [{"a": 1}]
    assert capsys.readouterr().out == (  # its first 40 characters
        f"note: {path}: dropped its last line, cut short ('{{\"kind\": \"train\", \"step\": 12, "
        "\"loss\": 4.')\n")
    path.write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    assert refused(train.read_metrics, str(path)) == (f"{path}: line 2 is not JSON; fix or remove "
                                                      "that line")


class SummaryStub:
    """What summary asks of a model: eval(), generate (recorded: its prompt, length, temperature,
    top_k; it appends two tokens of id 1), and for a router a routing_map (drawn by picture)."""

    def __init__(self, routed):
        self.seen = []
        if routed:
            self.routing_map = None

    def eval(self):
        self.seen.append("eval")

    def generate(self, prompt, n, temperature=1.0, top_k=None):
        self.seen.append((prompt.tolist(), n, temperature, top_k))
        return torch.cat([prompt, prompt.new_ones(1, 2)], 1)


def test_summary_by_value(tmp_path, monkeypatch, capsys):
    """The summary's numbers come from the run's last eval: the hard loss vs the soft one, vs the
    dense GPT of the same sizes in out/, the work skipped per routed layer and their mean over
    the routed layers (not all layers); then the picture of the first window, the files and a
    sample (copy/sort: the held-out record completed greedily)."""
    import numpy as np
    monkeypatch.setattr(train, "speed_line", lambda *a: "<speed>")
    monkeypatch.setattr(train, "picture", lambda m, idx, meta, title, path:
                        f"<picture {idx.tolist()} {title} {path}>")
    out = tmp_path / "out"
    cfg = dataclasses.replace(common.Config(), model="dtrnet", n_layer=11, max_iters=4,
                              block_size=4, out_dir=str(out / "dtrnet"))
    for name, log in (("dtrnet", [
            {"kind": "eval", "step": 0, "val_loss": 4.0, "val_soft_loss": 4.0},
            {"kind": "train", "step": 3, "loss": 9.0},
            {"kind": "eval", "step": 4, "val_loss": 1.5, "val_soft_loss": 1.2, "val_skip_l2": 0.75,
             "val_skip_l1": 0.25, "val_skip_l10": 0.5, "val_flops_saved_hard": 0.125}]),
            ("gpt", [{"kind": "eval", "step": 4, "val_loss": 1.25}])):
        (out / name).mkdir(parents=True)
        (out / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    (out / "gpt" / "config.json").write_text(json.dumps(dict(dataclasses.asdict(cfg),
                                                             model="gpt")))
    meta = {"dataset": "shakespeare", "itos": ["\n", "a", "b"]}
    val = np.array([1, 2, 2, 1, 1, 2], dtype=np.uint16)
    model = SummaryStub(routed=True)
    train.summary(model, cfg, meta, val, torch.device("cpu"), str(out / "dtrnet" / "metrics.jsonl"))
    run = out / "dtrnet"
    assert capsys.readouterr().out == (
        "\n== dtrnet on shakespeare: summary ==\n"
        "val loss 1.5000: what inference runs (hard routing, sparse path); the training-mode "
        "(soft) model 1.2000, so inference costs +25.0%\n"
        f"dense GPT of the same preset ({out / 'gpt'}): val 1.2500; this model is +20.0%\n"
        "work really skipped (share of tokens on the cheap path), per layer: layer 1 25%, layer 2 "
        "75%, layer 10 50%; mean 50%; forward FLOPs saved vs the dense GPT: 12.5%\n<speed>\n"
        f"<picture [[1, 2, 2, 1]] dtrnet routing on the first validation window "
        f"{run / 'routing.html'}>\n"
        f"files: {run / 'ckpt.pt'}, {run / 'best.pt'}, {run / 'metrics.jsonl'}, "
        f"{run / 'routing.html'}\nsample:\naaa\n")
    assert model.seen == ["eval", ([[1]], 200, 0.8, 200)]
    # a dense GPT on the copy task: no comparison, no skips, no picture; the record completed
    cfg = dataclasses.replace(cfg, model="gpt", dataset="copy", out_dir=str(out / "gpt"))
    meta = {"dataset": "copy", "record_len": 2 * common.TASK_LEN + 3, "vocab_size": 35}
    val = np.arange(30, dtype=np.uint16)
    model = SummaryStub(routed=False)
    train.summary(model, cfg, meta, val, torch.device("cpu"), str(out / "gpt" / "metrics.jsonl"))
    text = capsys.readouterr().out
    assert text.splitlines()[1:3] == ["== gpt on copy: summary ==",
                                      "val loss 1.2500: what inference runs"]
    assert "dense GPT" not in text  # a dense run is not compared with a dense GPT
    assert model.seen == ["eval", ([list(range(common.TASK_LEN + 2))], common.TASK_LEN + 1, 0,
                                   None)]
    # a routed run with no dense GPT of its sizes in out/: the line says how to make one
    (out / "gpt" / "config.json").unlink()
    train.summary(SummaryStub(routed=True), dataclasses.replace(cfg, model="dtrnet"), meta, val,
                  torch.device("cpu"), str(out / "dtrnet" / "metrics.jsonl"))
    assert "\nno dense GPT of the same preset in out/ to compare with (run train.py --model gpt " \
        "with the same flags)\n" in capsys.readouterr().out
    # a model that logs skips but no FLOPs: the skip line ends at the mean; a long context shows
    # its first 256 tokens
    (out / "mod").mkdir()
    (out / "mod" / "metrics.jsonl").write_text(json.dumps(
        {"kind": "eval", "step": 4, "val_loss": 2.0, "val_skip_l1": 0.5}) + "\n")
    val = np.arange(300, dtype=np.uint16) % 3
    train.summary(SummaryStub(routed=True), dataclasses.replace(cfg, block_size=300), meta, val,
                  torch.device("cpu"), str(out / "mod" / "metrics.jsonl"))
    text = capsys.readouterr().out
    assert "\nwork really skipped (share of tokens on the cheap path), per layer: layer 1 50%; " \
        "mean 50%\n<speed>\n" in text
    assert f"<picture [{(val[:256].tolist())}] " in text


def test_find_dense_run_takes_the_first_finished_gpt_of_the_same_sizes(tmp_path, monkeypatch):
    """The summary's dense baseline: in out_dir's parent, the first folder (sorted) holding a gpt
    run with this run's data, sizes and budget whose log has an eval at max_iters."""
    cfg = common.Config(out_dir=str(tmp_path / "out" / "tsa"), max_iters=4)
    log = [{"kind": "train", "step": s, "loss": 4.0} for s in range(4)] + [
        {"kind": "eval", "step": s, "val_loss": 4.0 - s / 8} for s in (0, 2, 4)]

    def run(name, log=log, **changes):
        (tmp_path / "out" / name).mkdir(parents=True)
        config = {**dataclasses.asdict(cfg), "model": "gpt", **changes}
        (tmp_path / "out" / name / "config.json").write_text(json.dumps(config))
        (tmp_path / "out" / name / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in log))
    run("a_tsa", model="tsa")  # not a gpt
    for k, v in (("dataset", "copy"), ("n_layer", 5), ("n_head", 3), ("n_embd", 96),
                 ("block_size", 64), ("batch_size", 8), ("max_iters", 6)):
        run(f"b_{k}", **{k: v})  # one size (or the data, or the budget) differs
    run("c_unfinished", log=log[:-1])  # its last eval is at step 2
    run("d_no_log", log=[])
    (tmp_path / "out" / "d_no_log" / "metrics.jsonl").unlink()
    (tmp_path / "out" / "e_empty").mkdir()
    (tmp_path / "out" / "e_notes.txt").write_text("mine")
    run("f_gpt")
    run("g_gpt", log=log[:-1] + [{**log[-1], "val_loss": 1.0}])
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # the folders are found under out_dir's parent, not here
    assert train.find_dense_run(cfg) == (str(tmp_path / "out" / "f_gpt"), 3.5)
    (tmp_path / "out" / "f_gpt" / "config.json").write_text("{not json")
    assert train.find_dense_run(cfg) == (str(tmp_path / "out" / "g_gpt"), 1.0)
    (tmp_path / "out" / "g_gpt" / "metrics.jsonl").write_text('{"kind": "eval"}\n')
    assert train.find_dense_run(cfg) is None


def test_resolve_takes_the_datas_vocabulary_and_record_length(capsys):
    cfg = common.Config(vocab_size=100, block_size=64, dataset="copy")
    got = train.resolve(cfg, {"vocab_size": 35, "record_len": 23})
    assert (got.vocab_size, got.block_size, got.out_dir) == (35, 22, os.path.join("out",
                                                                                  "gpt-copy"))
    assert capsys.readouterr().out == ("note: vocab_size 100 -> 35, copy's vocabulary (the data "
                                       "decides it)\nnote: copy trains on whole records: "
                                       "block_size 64 -> 22\n")
    same = train.resolve(dataclasses.replace(got, out_dir="x"), {"vocab_size": 35,
                                                                 "record_len": 23})
    assert same == dataclasses.replace(got, out_dir="x") and capsys.readouterr().out == ""
    assert train.resolve(cfg, {"vocab_size": 100}).block_size == 64


def test_saved_config_is_the_runs_config_json_or_its_checkpoints_copy(tmp_path):
    out = tmp_path / "run"
    assert refused(train.saved_config, str(out)) == f"--resume: no {out / 'ckpt.pt'} to resume from"
    out.mkdir()  # an empty folder: nothing was started there
    assert refused(train.saved_config, str(out)) == f"--resume: no {out / 'ckpt.pt'} to resume from"
    (out / "metrics.jsonl").write_text("")
    assert refused(train.saved_config, str(out)) == (
        f"--resume: no {out / 'ckpt.pt'} to resume from; the run stopped before its first "
        "checkpoint: start it again with --overwrite")
    saved = dataclasses.asdict(common.Config(n_layer=2))
    common.save_checkpoint(str(out / "ckpt.pt"), model={}, config=saved)
    assert train.saved_config(str(out)) == (saved, str(out / "ckpt.pt"))  # no config.json
    (out / "config.json").write_text(json.dumps(dict(saved, n_layer=3)))
    assert train.saved_config(str(out)) == (dict(saved, n_layer=3), str(out / "config.json"))
    (out / "config.json").write_text("{")
    assert refused(train.saved_config, str(out)) == (
        f"{out / 'config.json'} is not readable JSON (JSONDecodeError): it holds the run's flags; "
        "restore it, or delete it to use ckpt.pt's copy")
    for bad in ([saved], {"model": "mlp"}, {}):
        (out / "config.json").write_text(json.dumps(bad))
        assert refused(train.saved_config, str(out)) == (
            f"{out / 'config.json'} is not a nanoroute run's config (no known model in it)")
    (out / "config.json").write_text(json.dumps(dict(saved, model="tsa", d=1, c=2, b=3, a=4)))
    assert refused(train.saved_config, str(out)) == (
        f"{out / 'config.json'} has fields --model tsa does not know (a, b, c): it was written by "
        "other code")
    (out / "config.json").write_text(json.dumps(dict(saved, model="tsa", lam=0.5)))
    assert train.saved_config(str(out))[0]["lam"] == 0.5  # a field of tsa's Config


def test_resumed_values_keep_the_runs_values_but_for_what_may_change():
    saved = {"model": "gpt", "dataset": "shakespeare", "seed": 1, "max_iters": 4, "out_dir": "x"}
    values = {"model": "gpt", "dataset": "shakespeare", "seed": 1, "max_iters": 9, "lam": 0.5}
    assert train.resumed_values(saved, os.path.join("runs", "a", "config.json"), values, {}) == \
        {**saved, "max_iters": 9, "lam": 0.5, "out_dir": os.path.join("runs", "a")}
    assert train.resumed_values(saved, "config.json", dict(values, out_dir="y"), {}) == \
        {**saved, "max_iters": 9, "lam": 0.5, "out_dir": "y"}
    assert train.resumed_values(saved, "config.json", values, {})["out_dir"] == "."
    # the run's kind is named first, whatever else differs
    err = refused(train.resumed_values, saved, "c.json", dict(values, seed=2, model="tsa"),
                  {"model": "--model", "seed": "--seed"})
    assert err == ("--resume: --model asks for model=tsa but c.json has model=gpt; a resumed run "
                   "keeps its values: drop --model (may change: --" + ", --".join(train.MAY_CHANGE)
                   + ")")
    err = refused(train.resumed_values, saved, "c.json",  # the data too, after the seed here
                  {"seed": 2, "model": "gpt", "max_iters": 9, "dataset": "copy"}, {})
    assert err.startswith("--resume: --dataset asks for dataset=copy but c.json has dataset=")
    err = refused(train.resumed_values, saved, "c.json", dict(values, seed=2), {})
    assert err.startswith("--resume: --seed asks for seed=2 but c.json has seed=1;")


def test_encode_prompt_by_dataset():
    meta = {"dataset": "shakespeare", "itos": ["\n", " ", "a", "b"]}
    assert train.encode_prompt(meta, "ab a\n") == [2, 3, 1, 2, 0]
    assert refused(train.encode_prompt, meta, "zab!") == (
        "the prompt has characters Tiny Shakespeare never uses: '!z'")
    bpe = {"dataset": "shakespeare_bpe", "encoding": "r50k_base"}
    assert train.encode_prompt(bpe, "Hello world") == [15496, 995]
    assert train.encode_prompt({"dataset": "enwik8"}, "aé") == [97, 195, 169]
    task = {"dataset": "copy", "vocab_size": common.TASK_VOCAB + 3}
    assert train.encode_prompt(task, "[BOS] 3 31 0 [SEP] [EOS]") == [32, 3, 31, 0, 33, 34]
    assert refused(train.encode_prompt, task, "3 x") == (
        "a copy prompt is space-separated numbers 0..31 and [BOS]/[SEP]/[EOS], got '3 x'")
    for ids in ("35", "-1"):
        assert refused(train.encode_prompt, task, ids) == "prompt ids must be in 0..34"
    assert train.encode_prompt(task, "34") == [34]


def safetensors(path, header, data_len, n=None):
    raw = json.dumps(header).encode()
    path.write_bytes((len(raw) if n is None else n).to_bytes(8, "little") + raw
                     + bytes(data_len))
    return str(path)


def test_safetensors_header_by_value(tmp_path):
    f = tmp_path / "x.safetensors"
    good = {"__metadata__": {"format": "pt"},
            "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
            "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "e": {"dtype": "F64", "shape": [0], "data_offsets": [22, 22]}}
    n = len(json.dumps(good).encode())
    got = train.safetensors_header(safetensors(f, good, 22))
    assert got == {"a": ("<f4", torch.float32, [2, 2], 8 + n),
                   "b": ("<u2", torch.bfloat16, [3], 8 + n + 16),
                   "e": ("<f8", torch.float64, [0], 8 + n + 22)}
    assert train.read_safetensors(str(f))["b"].dtype == torch.bfloat16
    assert train.safetensors_header(safetensors(f, {}, 0)) == {}  # the shortest header, "{}"

    def says(header, data_len, n=None):
        return refused(train.safetensors_header, safetensors(f, header, data_len, n))
    one = {"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}
    size = 8 + len(json.dumps(one)) + 4
    assert f"(ValueError: header length {size - 7} in a file of {size} bytes)" in says(one, 4,
                                                                                      size - 7)
    assert "(ValueError: header length 1 in a file of" in says(one, 4, 1)
    assert "(ValueError: the header is no JSON object)" in says([1, 2], 0)
    assert "(KeyError: 'F8')" in says({"a": {"dtype": "F8", "shape": [2], "data_offsets": [0, 2]}},
                                      2)
    for shape, offsets in (([2], [-4, 0]), ([True, 2], [0, 4]), ([2.0], [0, 4]), ([-2], [0, 4])):
        bad = {"a": {"dtype": "F16", "shape": shape, "data_offsets": offsets}}
        assert "are not counts" in says(bad, 4), shape
    for shape, offsets in (([3], [0, 4]), ([2], [2, 6])):  # not its size; past the file's end
        bad = {"a": {"dtype": "F16", "shape": shape, "data_offsets": offsets}}
        assert f"(ValueError: a: data_offsets {offsets} do not hold shape {shape})" in says(bad, 4)
    assert says(one, 3).endswith("is not a readable safetensors file (ValueError: a: data_offsets "
                                 "[0, 4] do not hold shape [2]); delete it and download it again")
    touching = {"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
                "b": {"dtype": "F16", "shape": [1], "data_offsets": [4, 6]}}
    assert set(train.safetensors_header(safetensors(f, touching, 6))) == {"a", "b"}
    touching["b"]["data_offsets"] = [2, 4]
    touching["b"]["shape"] = [1]
    assert "(ValueError: a and b overlap)" in says(touching, 6)


def test_is_hf_gpt2_and_the_model_names(tmp_path):
    assert all(train.is_hf_gpt2(n) for n in train.GPT2_NAMES + (str(tmp_path),))
    (tmp_path / "ckpt.pt").write_text("")
    assert not train.is_hf_gpt2(str(tmp_path / "ckpt.pt")) and not train.is_hf_gpt2("gpt3")
    name, module = train.model_module("hybrid")
    assert name == "hybrid" and module.__name__ == "hybrid_attn"
    assert refused(train.model_module, "mlp") == ("unknown model 'mlp'; choose one of gpt, tsa, "
                                                  "dtrnet, conddepth, hybrid, mod")
    assert train.out_dir_of(common.Config(model="tsa", dataset="copy")) == os.path.join("out",
                                                                                      "tsa-copy")
    assert train.out_dir_of(common.Config(out_dir="mine")) == "mine"


def test_check_fits_refuses_too_few_windows_and_too_little_memory_by_value(monkeypatch):
    cfg = common.Config(block_size=50, n_layer=1, n_head=2, n_embd=16, vocab_size=65,
                        batch_size=2)
    cpu = torch.device("cpu")
    train.check_fits(cfg, {"val_tokens": 100}, common, cpu)  # 2·T windows' worth: enough
    assert refused(train.check_fits, cfg, {"val_tokens": 99}, common, cpu) == (
        "block_size=50 is more than half of shakespeare's validation split (99 tokens): too few "
        "distinct windows to evaluate on")
    assert "(0 tokens)" in refused(train.check_fits, cfg, {}, common, cpu)
    params = sum(t.numel() for t in common.Model(cfg).state_dict().values())
    state, act = train.train_memory(cfg, params)
    ram = {"SC_PAGE_SIZE": 2, "SC_PHYS_PAGES": state + act}  # half of it: exactly the need
    monkeypatch.setattr(os, "sysconf", lambda k: ram[k])
    train.check_fits(cfg, {"record_len": 11}, common, cpu)  # records: no windows to count
    ram["SC_PHYS_PAGES"] -= 1
    assert refused(train.check_fits, cfg, {"val_tokens": 100}, common, cpu) == (
        f"this run would need ~{(state + act) / 2 ** 30:,.1f} GiB to train ({params / 1e6:,.1f}M "
        f"parameters with their gradients and AdamW's moments: {state / 2 ** 30:,.1f} GiB; "
        f"activations at batch_size=2, block_size=50: ~{act / 2 ** 30:,.1f} GiB), more than half "
        f"of this machine's memory ({(state + act - 1) / 2 ** 30:,.0f} GiB)")
    monkeypatch.delattr(os, "sysconf")  # memory unknown: not refused
    train.check_fits(dataclasses.replace(cfg, n_embd=1 << 20), {"val_tokens": 100}, common, cpu)


def test_check_fits_at_a_size_where_every_figure_shows(monkeypatch):
    """~505M parameters, ~37 GiB to train: the refusal's every GiB figure is non-zero, so a wrong
    unit shows. On CUDA the limit is 90% of the GPU's memory (asked of that device); where a GPT's
    lower bound alone exceeds the limit the model is not built and the bound is what is reported;
    where the bound fits exactly, the model is built (on the meta device) and its own count is."""
    cfg = common.Config(n_layer=8, n_head=16, n_embd=2048, vocab_size=50304, block_size=1024,
                        batch_size=16)
    low = 12 * 8 * 2048 * 2048 + 50304 * 2048  # a GPT's parameters, a lower bound
    with torch.device("meta"):
        exact = sum(t.numel() for t in common.Model(cfg).state_dict().values())
    assert exact > low

    def message(params, limit, where):
        state, act = train.train_memory(cfg, params)
        return (f"this run would need ~{(state + act) / 2 ** 30:,.1f} GiB to train "
                f"({params / 1e6:,.1f}M parameters with their gradients and AdamW's moments: "
                f"{state / 2 ** 30:,.1f} GiB; activations at batch_size=16, block_size=1024: "
                f"~{act / 2 ** 30:,.1f} GiB), more than {where} ({limit / 2 ** 30:,.0f} GiB)")

    gpu, asked = torch.device("cuda", 0), []
    props = types.SimpleNamespace(total_memory=20 * 2 ** 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: asked.append(d) or props)
    assert refused(train.check_fits, cfg, {"val_tokens": 10 ** 6}, common, gpu) == message(
        low, 0.9 * 20 * 2 ** 30, "this GPU's memory")
    assert asked == [gpu]
    need_low = sum(train.train_memory(cfg, low))
    monkeypatch.setattr(os, "sysconf", lambda k: {"SC_PAGE_SIZE": 2, "SC_PHYS_PAGES": need_low}[k])
    assert refused(train.check_fits, cfg, {"val_tokens": 10 ** 6}, common,
                   torch.device("cpu")) == message(exact, need_low, "half of this machine's memory")
    # the model the run trains is build()'s (tsa's baselines are classes of their own), not Model's
    deeper = types.SimpleNamespace(Model=common.Model, build=lambda c: common.Model(
        dataclasses.replace(c, n_layer=9)))
    with torch.device("meta"):
        built = sum(t.numel() for t in deeper.build(cfg).state_dict().values())
    assert refused(train.check_fits, cfg, {"val_tokens": 10 ** 6}, deeper,
                   torch.device("cpu")) == message(built, need_low, "half of this machine's memory")


def test_check_fits_refuses_a_size_the_model_cannot_be_built_with(monkeypatch):
    def no_build(cfg):
        raise ValueError("a width of 0\nsecond line")
    monkeypatch.setattr(common, "Model", no_build)
    assert refused(train.check_fits, common.Config(), {"val_tokens": 10 ** 6}, common,
                   torch.device("cpu")) == ("--model gpt cannot be built with these sizes: a "
                                            "width of 0")


def test_run_lock_one_writer_per_folder(tmp_path, monkeypatch):
    import fcntl
    import socket
    out, me = tmp_path / "run", f"pid {os.getpid()} on {socket.gethostname()}"
    umask = os.umask(0)  # the mode asked for, not what a umask leaves of another
    try:
        with train.run_lock(str(out)):
            assert (out / train.LOCK).read_text() == me + "\n"
            assert (out / train.LOCK).stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)
    with train.run_lock(str(out)):
        assert refused(lambda: train.run_lock(str(out)).__enter__()) == (
            f"{out} is being trained by {me} ({out / train.LOCK}): one run folder has one writer; "
            "wait for that run to end or stop it, or choose another --out_dir")
    assert not out.exists()  # made by the lock, left empty: removed
    out.mkdir()
    with train.run_lock(str(out)):
        pass
    assert out.exists() and os.listdir(out) == []  # the user's (empty) folder stays
    (out / "ckpt.pt").write_text("")
    (out / train.LOCK).write_text("pid 1 on a machine that was killed long ago\n")  # a leftover
    with train.run_lock(str(out)):
        assert (out / train.LOCK).read_text() == me + "\n"
    assert os.listdir(out) == ["ckpt.pt"]
    fd = os.open(out / train.LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a holder that wrote nothing yet
        assert "is being trained by another process (" in refused(
            lambda: train.run_lock(str(out)).__enter__())
    finally:
        os.close(fd)
    monkeypatch.setattr(train, "fcntl", None)  # Windows: no lock
    with train.run_lock(str(tmp_path / "win")):
        assert not (tmp_path / "win").exists()


def test_speed_line_times_three_forwards_after_two_untimed_warmups(monkeypatch):
    """speed_line runs the sparse forward (sparse=True), the dense-hard one and a dense GPT of the
    model's size repeats + 2 times each, interleaved, on evaluation batch 0 of val, on the device
    given; it keeps the last `repeats` timings and reports their medians. A fake clock that each
    forward advances by its own planned duration pins which calls are timed."""
    # ms, out of order: the median is the sorted middle; warm-ups (the first two) slow; 99 shows a
    # scale off by 1e-3
    kept = [101, 97, 100, 99, 98]
    plan = {"sparse": [500, 400] + kept, "dense_hard": [500, 400] + [2 * t for t in kept],
            "gpt": [500, 400] + [3 * t for t in kept]}
    clock, calls, seen = [0.0], [], {}

    class Stub(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def to(self, device):
            seen["gpt_device"] = device
            return self

        def forward(self, x, sparse=False):
            k = self.name if self.name == "gpt" else "sparse" if sparse else "dense_hard"
            calls.append((k, x))
            clock[0] += plan[k][sum(c[0] == k for c in calls) - 1] / 1e3
            return x

    def get_batch(*args):
        seen["batch"] = args
        return "x", "y"

    device = torch.device("cpu")
    cfg = common.Config(n_layer=1, n_head=2, n_embd=8, block_size=4, batch_size=3, vocab_size=11)
    monkeypatch.setattr(common, "get_batch", get_batch)
    monkeypatch.setattr(common, "Model", lambda gpt_cfg: Stub("gpt"))
    monkeypatch.setattr(train.time, "perf_counter", lambda: clock[0])
    line = train.speed_line(Stub("model"), cfg, "meta", "val", device)
    assert line == ("speed, measured now (forward, batch 3×4, median of 5): sparse 99.0 ms = "
                    "2.00× the same decisions computed densely, 3.00× a dense GPT of the same size")
    assert [k for k, _ in calls] == ["sparse", "dense_hard", "gpt"] * 7
    assert all(x == "x" for _, x in calls) and seen["gpt_device"] is device
    data, meta, B, T, rng, dev = seen["batch"]
    assert (data, meta, B, T, dev) == ("val", "meta", 3, 4, device)
    assert rng.integers(1 << 30) == common.eval_rng(0, "val", 0).integers(1 << 30)


@pytest.mark.parametrize("argv,error", [
    (["--resume=maybe"], "--resume expects bool, got 'maybe'"),
    (["--overwrite=maybe"], "--overwrite expects bool, got 'maybe'"),
    (["--resume", "--overwrite"],
     "--resume continues the run in out_dir, --overwrite removes it: give one of them"),
    (["--resume"], "--resume: no out/gpt-shakespeare/ckpt.pt to resume from"),
    (["--resume", "--model=tsa", "--dataset=copy"],
     "--resume: no out/tsa-copy/ckpt.pt to resume from"),
])
def test_parse_resume_and_overwrite_refusals_by_text(argv, error, tmp_path, monkeypatch):
    """The two run-folder flags are named in their errors, exclusive, and --resume without
    --out_dir looks where a new run of that --model and --dataset would have been written."""
    monkeypatch.chdir(tmp_path)
    assert refused(train.parse, argv) == error


def test_the_trial_step_before_a_run_leaves_no_trace(monkeypatch):
    """compile_checked's trial forward and backward leave no trace: the RNG state, every buffer
    and every gradient are as before, so a --compile run is the run it would be without it. A
    stand-in for torch.compile (the model itself) whose step draws random numbers, bumps a buffer
    and makes gradients (the trial runs the backward too: the compiler builds it separately)."""
    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))
            self.register_buffer("count", torch.zeros(2))

        def forward(self, x, y):
            self.seen = (x, y)
            self.count += torch.rand(2) + 1
            return None, (self.w * torch.rand(3)).sum(), {}

    model, compiled_args, backward = Stub(), [], []
    model.w.register_hook(lambda g: backward.append(g.clone()))
    monkeypatch.setattr(torch, "compile", lambda m: compiled_args.append(m) or m)
    cfg = common.Config(batch_size=2, block_size=3, seed=5)
    data = __import__("numpy").arange(50, dtype="uint16")
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    assert train.compile_checked(model, cfg, data, {}, torch.device("cpu")) is model
    assert compiled_args == [model] and torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model.count, torch.zeros(2)) and model.w.grad is None
    assert len(backward) == 1 and model.seen[0].shape == (2, 3)


def test_render_routing_text_and_page_exactly():
    """The routing picture, character for character: values clamped to [0, 1] (1.7 reads as 1,
    -0.3 as 0), '#' only above 0.5, lines broken at `width` characters and after a newline (⏎),
    each row's mean; ANSI colours from _mix; the page escapes every text it shows."""
    meta = {"dataset": "shakespeare", "itos": list("\nabc ")}
    idx = [1, 2, 3, 4, 0, 1, 2, 3]  # "abc \nabc"
    m = torch.tensor([[1.7, 0.5, 0.51, 0, 0, 1, -0.3, 1], [0.2, 0, 0, 0, 0, 0, 1, 0.4]])
    text = train.render_routing(meta, idx, m, ["layer 1", "layer 2"], ("cheap", "costly"), "demo",
                                color=False, width=3)
    assert text == ("demo   legend: cheap = light '.', costly = dark '#'\n"
                    "-- layer 1: costly 50%\nabc\n#.#\n ⏎\n..\nabc\n#.#\n"
                    "-- layer 2: costly 20%\nabc\n...\n ⏎\n..\nabc\n.#.")
    colored = train.render_routing(meta, idx[:3], m[:1, :3], ["layer 1"], ("cheap", "costly"),
                                   "demo")
    assert colored == ("demo   legend: cheap = light (blue), costly = dark (orange)\n"
                       "-- layer 1: costly 67%\n"
                       "\x1b[38;2;0;0;0;48;2;239;138;54ma\x1b[0m"
                       "\x1b[38;2;0;0;0;48;2;226;186;151mb\x1b[0m"
                       "\x1b[38;2;0;0;0;48;2;227;185;149mc\x1b[0m")
    assert train._mix(0.0) == (214, 234, 248) and train._mix(1.0) == (239, 138, 54)
    one = train.render_routing({"dataset": "shakespeare", "itos": ["X"]}, [0], torch.ones(1, 1),
                               ["l"], ("a", "b"), "t", color=False)
    assert one == "t   legend: a = light '.', b = dark '#'\n-- l: b 100%\nX\n#"
    # colour: a line ends after a newline token and at `width` (96 unless given), nothing between
    colored = train.render_routing(meta, idx[2:6], m[:1, 2:6], ["l"], ("a", "b"), "t", width=2)
    cell = "\x1b[38;2;0;0;0;48;2;{}m{}\x1b[0m"
    assert colored.splitlines()[2:] == [cell.format("227;185;149", "c") + cell.format("214;234;248",
                                        " "), cell.format("214;234;248", "⏎"),
                                        cell.format("239;138;54", "a")]
    wide = train.render_routing({"dataset": "shakespeare", "itos": ["X"]}, [0] * 100,
                                torch.ones(1, 100), ["l"], ("a", "b"), "t", color=False)
    assert wide.splitlines()[2:] == ["X" * 96, "#" * 96, "X" * 4, "#" * 4]


def test_render_routing_page_exactly(tmp_path):
    meta = {"dataset": "shakespeare", "itos": list("\n<b&")}
    path = tmp_path / "routing.html"
    train.render_routing(meta, [1, 2, 3], torch.tensor([[1.0, 0.25, 0]]), ["l<1>"],
                         ("cheap", "cost&ly"), "a<b>", str(path), color=False)
    span = '<span style="background:rgb({})"{}>{}</span>'
    assert path.read_text(encoding="utf-8") == (
        '<!doctype html>\n<html><head><meta charset="utf-8"><title>a&lt;b&gt;</title>\n'
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#111;"
        "background:#fff}pre{font-size:16px;line-height:1.6;white-space:pre-wrap;"
        "word-break:break-all;border:1px solid #ccc;padding:.5em}h2{font-size:1em;"
        "margin:1.2em 0 .2em}span{color:#000}</style></head><body>\n<h1>a&lt;b&gt;</h1>\n"
        "<p>Each token is coloured by what the model ran for it in each layer. "
        + span.format("214, 234, 248", "", "&nbsp;cheap&nbsp;") + " "
        + span.format("226, 186, 151", "", "&nbsp;between&nbsp;") + " "
        + span.format("239, 138, 54", "", "&nbsp;cost&amp;ly&nbsp;") + " </p>\n"
        "<h2>l&lt;1&gt; <small>(cost&amp;ly 42%)</small></h2>\n<pre>"
        + span.format("239, 138, 54", ' title="1.00"', "&lt;")
        + span.format("220, 210, 200", ' title="0.25"', "b")
        + span.format("214, 234, 248", ' title="0.00"', "&amp;")
        + "</pre>\n</body></html>\n")
    # one token per row: each row's mean is its one value; rows are sections one line apart
    train.render_routing(meta, [1], torch.tensor([[1.0], [0.0]]), ["r1", "r2"], ("a", "b"), "t",
                         str(path))
    page = path.read_text(encoding="utf-8")
    assert "<h2>r1 <small>(b 100%)</small></h2>" in page and "(b 0%)" in page
    assert "</pre>\n<h2>r2 " in page


def test_ddp_schedules_reach_the_model_inside_the_wrapper(runs, tmp_path, monkeypatch):
    """Under DDP the loop steps a wrapper that has no on_step/lr_at of its own: the routed model's
    schedules (tsa's phases and its own lr) are called on the model inside, once per step. Rank 0
    of 2 in this process, torch.distributed and DDP stood in for."""
    dist = torch.distributed
    monkeypatch.setattr(train, "ddp_env", lambda: (True, 0, 2))
    for name in ("init_process_group", "barrier", "destroy_process_group",
                 "broadcast_object_list"):
        monkeypatch.setattr(dist, name, lambda *a, **k: None, raising=False)
    monkeypatch.setattr(train, "_gather_rng", lambda state, ddp: [state, state])

    class Wrapper(torch.nn.Module):  # what DDP gives: forward and no_sync, no model methods
        def __init__(self, m, device_ids=None):
            super().__init__()
            self.module = m

        def forward(self, *a, **k):
            return self.module(*a, **k)

        def no_sync(self):
            return __import__("contextlib").nullcontext()
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", Wrapper)
    import tsa
    calls = []
    for name in ("on_step", "lr_at"):
        orig = getattr(tsa.Model, name)
        monkeypatch.setattr(tsa.Model, name, lambda self, it, _o=orig, _n=name:
                            calls.append((_n, it)) or _o(self, it))
    train.train(*train.parse(flags(runs / "data", tmp_path / "run", "--model=tsa",
                                   "--max_iters=3", "--hard_ft_iters=1", "--n_layer=2")))
    assert calls == [(n, it) for it in range(3) for n in ("on_step", "lr_at")]
    # the checkpoint holds the model's own names, not the wrapper's (module.…): it loads anywhere
    saved = common.load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["model"]
    assert saved and not [k for k in saved if k.startswith("module.")]
