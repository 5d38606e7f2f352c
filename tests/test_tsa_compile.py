"""tsa.py under torch.compile, on CPU: the graphs and breaks of every path (torch._dynamo.explain,
a counting backend), and compiled == eager (training losses and gradients, the sparse forward,
greedy decoding)."""
import copy

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from test_tsa import ids, make, record_p


def graphs_and_breaks(fn, *args, **kw):
    dynamo.reset()
    e = dynamo.explain(fn)(*args, **kw)
    return e.graph_count, e.graph_break_count


def phase_model(mode):
    """A model in the training phase `mode`: soft, straight-through (hard_st),
    or the calibrating step."""
    kw = (dict(max_iters=6, hard_ft_iters=3, hard_ft_routers="calibrate") if mode == "calibrate"
          else {})
    m = make(mixed=True, dtype=torch.float32, **kw).train()
    m.on_step(3) if mode == "calibrate" else setattr(m, "hard_train", mode == "hard_st")
    return m


@pytest.mark.parametrize("mode", ["soft", "hard_st", "calibrate"])
def test_training_step_is_one_graph(mode):
    """The training forward compiles with fullgraph=True into one graph (AOT autograd derives the
    backward from it); the compiled forward + backward gives eager's loss and gradients
    (and, calibrating, eager's b2)."""
    x = ids()
    eager = phase_model(mode)
    compiled = copy.deepcopy(eager)
    cc = CompileCounterWithBackend("aot_eager")
    dynamo.reset()
    losses = []
    for m, fn in ((eager, eager), (compiled, torch.compile(compiled, backend=cc, fullgraph=True))):
        loss = fn(x, x)[1]
        loss.backward()
        losses.append(loss.detach())
    assert cc.frame_count == 1
    assert torch.allclose(losses[0], losses[1], atol=1e-6, rtol=1e-6)
    for (n, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.allclose(a, b), n  # the calibration's b2
        assert (a.grad is None) == (b.grad is None), n  # frozen routers: no gradient in either
        assert a.grad is None or torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), n


def test_eval_forward_is_one_graph():
    m = make(mixed=True, dtype=torch.float32).eval()
    x = ids(B=4)
    with torch.no_grad():
        assert graphs_and_breaks(m, x, x) == (1, 0)  # the hard pass, its stats and the soft pass
        assert graphs_and_breaks(m, x) == (1, 0)


def test_sparse_forward_graphs():
    """The sparse trunk is one graph (nonzero's size traced as a symbol): 3 graphs, so 2 breaks
    (around its call), whatever the depth (at most one break per routed block); compiled == eager
    over batches whose active counts differ, and with every token halted, without recompiling."""
    m = make(mixed=True, dtype=torch.float32).eval()
    with torch.no_grad():
        cc = CompileCounterWithBackend("aot_eager")
        dynamo.reset()
        fn = torch.compile(m, backend=cc)
        for seed in (1, 2, 3):
            x = ids(B=4, seed=seed)
            assert torch.allclose(fn(x, sparse=True)[0], m(x)[0], atol=1e-5, rtol=1e-5)
        for r in m.routers:
            r.fc2.bias.fill_(50.0)
        assert torch.allclose(fn(x, sparse=True)[0], m(x)[0], atol=1e-5, rtol=1e-5)
    assert cc.frame_count == 3


@pytest.mark.parametrize("B", [1, 4])
def test_decode_step_compiles_whole(B):
    """torch.compile(step, fullgraph=True) at B=1 and B=4: one graph for 64 greedy steps of mixed
    routing (steps where a routed block runs and steps where it is skipped: torch.cond), the same
    tokens as the eager step."""
    m = make(mixed=True, dtype=torch.float32, block_size=80).eval()
    prompt = ids(B=4)[:B, :8]
    cc = CompileCounterWithBackend("aot_eager")
    dynamo.reset()
    toks = {}
    for name, step in (("compiled", torch.compile(m.step, backend=cc, fullgraph=True)),
                       ("eager", m.step)):
        if name == "eager":
            rec = record_p(m)  # hooks after compiling (dynamo guards on them)
        with torch.no_grad():
            logits, state = m.prefill(prompt)
            out = []
            for _ in range(64):
                out.append(logits.argmax(-1, keepdim=True))
                logits, state = step(out[-1], state)
        toks[name] = torch.cat(out, 1)
    assert cc.frame_count == 1
    assert torch.equal(toks["compiled"], toks["eager"])
    runs = torch.stack([(p <= 0.5).any() for p in rec if p.size(1) == 1])  # (64 · 3,) a block ran
    assert runs.any() and not runs.all()
