"""experiments/compare.py: the table is built only from run records (tested on small synthetic
ones), the verdict of a run that starts from a checkpoint is also taken against its equal-training
control, and the training scheduler starts a run only once the run whose checkpoint it starts from
has finished."""
import importlib.util
import json
import os
import threading
import time

import pytest

from conftest import ROOT

# loaded from its path: putting experiments/ on sys.path would shadow tsa.py etc. with the scripts
# of the same name
_spec = importlib.util.spec_from_file_location("compare",
                                               os.path.join(ROOT, "experiments", "compare.py"))
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def rec(run, model, seed, loss, flops, **kw):
    return {"run": run, "model": model, "seed": seed, "params": 1e6, "val_loss": loss,
            "val_bpc": loss / 0.693, "flops_ratio": flops, "speedup_T256": 1.0,
            "speedup_T1024": 1.0, "kv_ratio_1024": 1.0, "train_step_ratio": 1.0, "iters": 800, **kw}


RECORDS = [rec("gpt-L6", "gpt", s, 1.60 + 0.01 * s, 1.0) for s in (1, 2)] + \
          [rec("gpt-L3", "gpt", s, 1.80 + 0.01 * s, 0.5) for s in (1, 2)] + \
          [rec("tsa-good", "tsa", s, 1.62, 0.75) for s in (1, 2)] + \
          [rec("dtr-bad", "dtrnet", s, 1.75 + 0.01 * s, 0.8) for s in (1, 2)] + \
          [rec("hyb-out", "hybrid", s, 1.9, 0.3) for s in (1, 2)]


@pytest.fixture
def ft_runs(monkeypatch):
    """A router fine-tuned from gpt-L6 and its control
    (the same checkpoint trained on as a dense GPT)."""
    monkeypatch.setitem(compare.RUNS, "cd",
                        ("conddepth", {"init_from": "{gpt-L6}", "max_iters": 800}))
    monkeypatch.setitem(compare.RUNS, "gpt-L6-ft",
                        ("gpt", {"init_from": "{gpt-L6}", "max_iters": 800}))


def test_dense_line_is_sorted_means():
    line = compare.dense_line(compare.group(RECORDS))
    assert line == [(0.5, pytest.approx(1.815)), (1.0, pytest.approx(1.615))]
    assert compare.dense_loss_at(line, 0.75) == pytest.approx(1.715)
    assert compare.dense_loss_at(line, 0.3) is None


def test_verdicts_use_the_seed_spread():
    assert compare.verdict(1.62, 0.0, 1.715) == "beats the dense line"
    assert compare.verdict(1.755, 0.007, 1.695) == "worse than the dense line"
    assert compare.verdict(1.70, 0.02, 1.71) == "on the dense line (within seed spread)"
    assert compare.verdict(1.9, 0.0, None) == "outside the dense range"


def test_table_rows():
    md = compare.table(RECORDS).splitlines()
    assert len(md) == 2 + 5
    tsa = next(l for l in md if l.startswith("| tsa-good"))
    assert ("1.620 ± 0.000" in tsa and "0.75 ± 0.00" in tsa and "beats the dense line" in tsa
            and "| 1,2 |" in tsa)
    assert "worse than the dense line" in next(l for l in md if l.startswith("| dtr-bad"))
    assert "outside the dense range" in next(l for l in md if l.startswith("| hyb-out"))
    assert md[2].startswith("| gpt-L6") and "| dense |" in md[2]


def test_md_table():
    assert compare.md_table([[1, "a"], [2.5, "b"]], ["x", "y"]) == (
        "| x | y |\n|---|---|\n| 1 | a |\n| 2.5 | b |\n")


def test_single_seed_has_zero_spread():
    assert compare.mean_sd([1.5]) == (1.5, 0.0)
    assert compare.mean_sd([None]) == (None, None)


def test_control_is_found_and_kept_off_the_dense_line(ft_runs):
    assert compare.control_of("cd") == "gpt-L6-ft"
    assert compare.control_of("gpt-L6-ft") is None and compare.control_of("tsa-lam0.01") is None
    records = RECORDS + [rec("gpt-L6-ft", "gpt", s, 1.50, 1.0) for s in (1, 2)]
    assert compare.dense_line(compare.group(records)) == compare.dense_line(compare.group(RECORDS))


@pytest.mark.parametrize("losses, word", [
    ((1.52, 1.54), "worse than its control (+0.025 ± 0.007)"),
    ((1.48, 1.50), "better than its control (-0.015 ± 0.007)"),
    ((1.49, 1.53), "level with its control (within seed spread)")])
def test_verdict_against_the_control_is_paired_by_seed(ft_runs, losses, word):
    control = [rec("gpt-L6-ft", "gpt", 1, 1.50, 1.0), rec("gpt-L6-ft", "gpt", 2, 1.51, 1.0)]
    run = [rec("cd", "conddepth", s, loss, 0.93) for s, loss in zip((1, 2), losses)]
    assert compare.control_verdict(run, control).startswith(word)
    assert compare.control_verdict(run, []) == "control not run"


def test_table_shows_both_verdicts(ft_runs):
    # beats the dense line (1.615 at FLOPs 1.0 is above it) only with its extra steps; worse than
    # its control
    records = RECORDS + [rec("gpt-L6-ft", "gpt", s, 1.50 + 0.01 * s, 1.0) for s in (1, 2)] + \
        [rec("cd", "conddepth", s, 1.52 + 0.01 * s, 0.93) for s in (1, 2)]
    rows = {l.split(" | ")[0][2:]: l for l in compare.table(records).splitlines()[2:]}
    assert ("beats the dense line (with 800 more steps) | worse than its control (+0.020 ± 0.000)"
            in rows["cd"])
    assert "| the control |" in rows["gpt-L6-ft"] and "| dense | – |" in rows["gpt-L6"]


def test_schedule_waits_for_dependencies():
    events, lock = [], threading.Lock()

    def work(t):
        with lock:
            events.append(("start", t))
        time.sleep(0.2 if t == "a" else 0.05)
        with lock:
            events.append(("end", t))
    done = compare.schedule(["a", "b", "c", "d"], {"b": ["a"], "d": ["b", "outside"]}, work, jobs=2)
    assert sorted(done) == ["a", "b", "c", "d"]
    pos = {e: i for i, e in enumerate(events)}
    assert pos[("end", "a")] < pos[("start", "b")] and pos[("end", "b")] < pos[("start", "d")]
    # an independent run does not wait: two at a time
    assert pos[("start", "c")] < pos[("end", "a")]
    with pytest.raises(ValueError, match="circular"):
        compare.schedule(["x", "y"], {"x": ["y"], "y": ["x"]}, work, jobs=2)


def test_quick_pipeline_trains_the_control_after_its_checkpoint(data_dir, tmp_path, monkeypatch):
    tiny = dict(compare.BASE, n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4,
                data_dir=data_dir)
    monkeypatch.setitem(compare.BUDGETS, "cpu", tiny)
    out = str(tmp_path / "out")
    compare.main(["--quick", "--runs", "gpt-L6-ft", "--seeds", "1", "--jobs", "2",
                  "--device", "cpu", "--out", out])
    ckpt, started = (os.path.join(out, n, f)
                     for n, f in (("gpt-L6-s1", "ckpt.pt"), ("gpt-L6-ft-s1", "config.json")))
    assert os.path.getmtime(started) >= os.path.getmtime(ckpt)
    r = json.load(open(os.path.join(out, "results", "compare", "gpt-L6-ft-s1.json")))
    assert (r["run"] == "gpt-L6-ft" and r["iters"] == compare.QUICK["max_iters"]
            and r["flops_ratio"] == 1.0)
    assert "| gpt-L6-ft | 1 |" in open(os.path.join(out, "results", "compare.md")).read()
