"""conddepth.py under torch.compile, on CPU: how many graphs each path compiles to (dynamo's explain
and a counting backend, aot_eager: no C++ build), and compiled == eager. Each count was seen to fail
on a planted `.item()` in its path."""
import copy

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from test_conddepth import calibrated, data, make


def explain(fn, *args, **kw):
    """(graph count, break count, break reasons) of fn(*args, **kw) under dynamo."""
    dynamo.reset()
    e = dynamo.explain(fn)(*args, **kw)
    return e.graph_count, e.graph_break_count, e.break_reasons


def test_training_step_is_one_graph_and_equals_eager(gate="G3"):
    """Forward and backward of a label step (the oracle, util/rank, JEPA, θ's update) compile whole
    (fullgraph=True: one graph), and the compiled loss, θ and gradients equal eager's."""
    m = make(torch.float32, gate=gate, label_start=0, label_every=1).train()
    m.on_step(0)
    twin = copy.deepcopy(m)
    x, y = data(B=2)
    torch.manual_seed(0)  # the rank pairs' permutation
    loss = m(x, y)[1]
    loss.backward()
    cnt = CompileCounterWithBackend("aot_eager")
    dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(twin, backend=cnt, fullgraph=True)(x, y)[1]
    compiled.backward()
    assert cnt.frame_count == 1
    torch.testing.assert_close(compiled, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(twin.thresholds, m.thresholds, atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(m.named_parameters(), twin.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_eval_forward_is_one_graph():
    m = calibrated(make(torch.float32, gate="G3")).eval()
    x, y = data(B=2)
    with torch.no_grad():
        assert explain(m, x)[:2] == (1, 0)  # inference: causal θ, dense-hard
        assert explain(m, x, y)[:2] == (1, 0)  # evaluation: the losses and the top-k soft loss too


@pytest.mark.parametrize("n_controlled", [1, 2])
def test_sparse_forward_is_one_graph_between_two_breaks(n_controlled):
    """sparse_controlled traces each layer's count of full tokens (sparse_ffn) as a symbol: the
    sparse forward is 3 graphs at any number of controlled layers,
    the breaks at its config patch."""
    m = calibrated(make(torch.float32, n_controlled=n_controlled)).eval()
    x = data(B=2)[0]
    with torch.no_grad():
        graphs, breaks, reasons = explain(m, x, sparse=True)
        assert (graphs, breaks) == (3, 2), [r.reason for r in reasons]


@pytest.mark.parametrize("B", [1, 4])
def test_decode_step_is_one_graph_without_recompiles(B):
    """torch.compile(step, fullgraph=True) decodes 64 tokens of mixed routing with the graph it
    compiled first (no shape or guard depends on the position or the decisions),
    token for token as eager."""
    m = calibrated(make(torch.float32, block_size=80)).eval()
    with torch.no_grad():
        for p in m.parameters():  # sharp logits: a wrong step changes the greedy tokens
            p.mul_(2)
    calibrated(m)
    prompt = data(B=B, T=8, seed=3)[0]
    _, state = m.prefill(prompt)
    assert explain(m.step, prompt[:, -1:], state)[:2] == (1, 0)
    dynamo.reset()
    step = torch.compile(m.step, backend="aot_eager", fullgraph=True)
    out = {}
    for name, fn in (("eager", m.step), ("compiled", step)):
        logits, state = m.prefill(prompt)
        toks = []
        for i in range(64):
            toks.append(logits.argmax(-1, keepdim=True))  # (B, 1)
            if name == "compiled" and i == 1:
                graphs = dynamo.utils.counters["stats"]["unique_graphs"]
            logits, state = fn(toks[-1], state)
        out[name] = torch.cat(toks, 1)
    assert dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "the decode step recompiled"
    assert torch.equal(out["eager"], out["compiled"])
    with torch.no_grad():
        m(torch.cat([prompt, out["eager"]], 1)[:, :80])
    decided = torch.stack(m.last_masks)[:, :, 8:]  # (C, B, 64): the decoded tokens' decisions
    # each layer: both paths
    assert decided.any(-1).any(-1).all() and (~decided).any(-1).any(-1).all()
