"""Mixture-of-Depths under torch.compile on the CPU: graphs and breaks per path, counted with
dynamo's explain or a counting backend (no inductor build), and compiled == eager."""
import pytest
import torch
import torch._dynamo as dynamo

from test_mod import HashRouter, make, r_blocks, sharpen


def counts(fn, *args):
    dynamo.reset()
    e = dynamo.explain(fn)(*args)
    return e.graph_count, e.graph_break_count, e.break_reasons


@pytest.mark.parametrize("predictor", ["aux_loss", "mlp"])
def test_training_step_is_one_graph_and_equals_eager(predictor):
    """Forward and backward: one graph, no break (k tokens gathered: a shape known in advance); the
    compiled loss and every gradient equal eager's."""
    m = make(dtype=torch.float32, predictor=predictor, every=1).train()
    x, y = torch.randint(0, 50, (3, 40)), torch.randint(0, 50, (3, 40))
    graphs, breaks, reasons = counts(lambda x, y: m(x, y)[1], x, y)
    assert (graphs, breaks) == (1, 0), [r.reason for r in reasons]
    runs = []
    for fn in (m, torch.compile(m, backend="aot_eager", fullgraph=True)):
        m.zero_grad()
        _, loss, st = fn(x, y)
        loss.backward()
        runs.append([loss] + [p.grad.clone() for p in m.parameters() if p.grad is not None])
    assert st["skipped"].item() == pytest.approx(0.75)
    for a, b in zip(*runs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_eval_forward_is_one_graph():
    m = sharpen(make(dtype=torch.float32)).eval()
    graphs, breaks, reasons = counts(lambda x: m(x)[0], torch.randint(0, 50, (3, 40)))
    assert (graphs, breaks) == (1, 0), [r.reason for r in reasons]


@pytest.mark.parametrize("B", [1, 4])
def test_decode_step_is_one_graph_over_64_mixed_steps(B):
    """fullgraph=True at B = 1 and 4: one graph for 64 steps in which routed blocks run some rows
    and skip others (torch.cond), greedy tokens equal to eager's."""
    m = sharpen(make(dtype=torch.float32, block_size=80)).eval()
    for b in r_blocks(m):
        b.router = HashRouter()
    prompt = torch.randint(0, 50, (B, 8), generator=torch.Generator().manual_seed(B))
    with torch.no_grad():
        _, state = m.prefill(prompt)
        assert counts(m.step, prompt[:, -1:], state)[:2] == (1, 0)
    dynamo.reset()
    graphs, ns = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(m.step, backend=backend, fullgraph=True)
    toks = {}
    for name, fn in (("eager", m.step), ("compiled", step)):
        logits, state = m.prefill(prompt)
        out = []
        for _ in range(64):
            out.append(logits.argmax(-1, keepdim=True))  # (B, 1)
            if name == "eager":
                ns.append(torch.stack([state[0][i].n.clone() for i in m.routed]))  # (L_R, B)
            logits, state = fn(out[-1], state)
        toks[name] = torch.cat(out, 1)
    assert torch.equal(toks["eager"], toks["compiled"]) and len(graphs) == 1
    ran = torch.stack(ns).diff(dim=0)  # (63, L_R, B): 1 where a row's token ran the block
    assert ran.any() and not ran.all()
