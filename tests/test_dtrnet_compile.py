"""DTRNet under torch.compile on the CPU: graphs and breaks per path, counted with dynamo's explain
or a counting backend (no inductor build), and compiled == eager."""
import pytest
import torch
import torch._dynamo as dynamo

from test_dtrnet import HashRouter, d_blocks, make, sharpen


def mixed(block_size=64):
    """T D D T with learned routers sharpened so that both paths are taken (fp32)."""
    m = make(layers="TDDT", dtype=torch.float32, block_size=block_size)
    for b in d_blocks(m):
        b.router.w2.weight.data *= 30
    return m


def counts(fn, *args):
    dynamo.reset()
    e = dynamo.explain(fn)(*args)
    return e.graph_count, e.graph_break_count, e.break_reasons


def test_training_step_is_one_graph_and_equals_eager():
    """Forward and backward: one graph, no break (compiled, every row is packed to T, a shape the
    compiler sees); the compiled loss and every gradient equal eager's (the bucketed length)."""
    m = mixed().train()
    x, y = torch.randint(0, 50, (3, 40)), torch.randint(0, 50, (3, 40))
    graphs, breaks, _ = counts(lambda x, y: m(x, y)[1], x, y)
    assert (graphs, breaks) == (1, 0)
    runs = []
    for fn in (m, torch.compile(m, backend="aot_eager", fullgraph=True)):
        m.zero_grad()
        _, loss, st = fn(x, y)
        loss.backward()
        runs.append([loss] + [p.grad.clone() for p in m.parameters() if p.grad is not None])
    assert 0.05 < st["frac_attn"].item() < 0.95  # both paths taken
    for a, b in zip(*runs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_eval_forward_is_one_graph():
    m = mixed().eval()
    graphs, breaks, _ = counts(lambda x: m(x)[0], torch.randint(0, 50, (3, 40)))
    assert (graphs, breaks) == (1, 0)


@pytest.mark.parametrize("layers", ["TDTT", "TDDT"])
def test_sparse_forward_is_one_graph_between_two_breaks(layers):
    """sparse_trunk traces each D layer's packed length as a symbol: the sparse forward is 3 graphs
    (embedding, trunk, head) at any number of D layers, the breaks at sparse_trunk's config patch,
    and the compiled forward equals eager."""
    m = sharpen(make(layers=layers, dtype=torch.float32, block_size=64)).eval()
    x = torch.randint(0, 50, (3, 40))
    graphs, breaks, reasons = counts(lambda x: m(x, sparse=True)[0], x)
    assert (graphs, breaks) == (3, 2), [r.reason for r in reasons]
    dynamo.reset()
    with torch.no_grad():
        ref = m(x, sparse=True)[0]
        assert torch.allclose(torch.compile(m, backend="aot_eager")(x, sparse=True)[0], ref,
                              atol=1e-5)


@pytest.mark.parametrize("B", [1, 4])
def test_decode_step_is_one_graph_over_64_mixed_steps(B):
    """fullgraph=True at B = 1 and 4: one graph for 64 steps in which D layers route some rows and
    bypass others (torch.cond), greedy tokens equal to eager's."""
    m = sharpen(make(layers="TDDT", dtype=torch.float32, block_size=80)).eval()
    for b in d_blocks(m):
        b.router = HashRouter()
    prompt = torch.randint(0, 50, (B, 8), generator=torch.Generator().manual_seed(B))
    with torch.no_grad():  # no break in a default compile either (fullgraph=True traces .item())
        _, state = m.prefill(prompt)
        assert counts(m.step, prompt[:, -1:], state)[:2] == (1, 0)
    dynamo.reset()
    graphs, preds = [], []

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
                preds.append(torch.stack([c.n.clone() for c in state[0][1:3]]))  # (L_D, B)
            logits, state = fn(out[-1], state)
        toks[name] = torch.cat(out, 1)
    assert torch.equal(toks["eager"], toks["compiled"]) and len(graphs) == 1
    routed = torch.stack(preds).diff(dim=0)  # (63, L_D, B): 1 where a row's token was routed
    assert routed.any() and not routed.all()
