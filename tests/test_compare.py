"""The comparison table (issue #7) is built only from run records: test it on small synthetic ones."""
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "experiments"))
import compare  # noqa: E402


def rec(run, model, seed, loss, flops, **kw):
    return {"run": run, "model": model, "seed": seed, "params": 1e6, "val_loss": loss, "val_bpc": loss / 0.693,
            "flops_ratio": flops, "speedup_T256": 1.0, "speedup_T1024": 1.0, "kv_ratio_1024": 1.0,
            "train_step_ratio": 1.0, **kw}


RECORDS = [rec("gpt-L6", "gpt", s, 1.60 + 0.01 * s, 1.0) for s in (1, 2)] + \
          [rec("gpt-L3", "gpt", s, 1.80 + 0.01 * s, 0.5) for s in (1, 2)] + \
          [rec("tsa-good", "tsa", s, 1.62, 0.75) for s in (1, 2)] + \
          [rec("dtr-bad", "dtrnet", s, 1.75 + 0.01 * s, 0.8) for s in (1, 2)] + \
          [rec("hyb-out", "hybrid", s, 1.9, 0.3) for s in (1, 2)]


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
    assert "1.620 ± 0.000" in tsa and "0.75 ± 0.00" in tsa and "beats the dense line" in tsa and "| 1,2 |" in tsa
    assert "worse than the dense line" in next(l for l in md if l.startswith("| dtr-bad"))
    assert "outside the dense range" in next(l for l in md if l.startswith("| hyb-out"))
    assert md[2].startswith("| gpt-L6") and "| dense |" in md[2]


def test_single_seed_has_zero_spread():
    assert compare.mean_sd([1.5]) == (1.5, 0.0)
    assert compare.mean_sd([None]) == (None, None)
