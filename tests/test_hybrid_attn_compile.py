"""Graph counts of hybrid_attn's compiled paths on CPU (counting backends, dynamo only): the
training step and the eval forward in one graph, the sparse forward with one named break (the read
counts go to the host), the decode step in one graph at B=1 and B=4 that 64 steps of mixed routing
do not recompile; each compiled path computes what the eager one does."""
import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import hybrid_attn as H


def tiny_model():
    torch.manual_seed(0)
    cfg = H.Config(n_layer=4, n_head=2, n_embd=32, block_size=80, vocab_size=40, chunk_size=8)
    m = H.Model(cfg)
    with torch.no_grad():
        m.router.weight.mul_(10)  # router margins: both mixers are taken
    return m


def tokens(B, T, seed=0):
    return torch.randint(0, 40, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def test_training_step_is_one_graph():
    """The forward in one graph, that a new τ does not recompile; backward through its ops;
    the compiled loss and the router's gradient equal eager's (same Gumbel noise)."""
    m = tiny_model().train()
    x = tokens(4, 32)
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(m, backend=cnt, fullgraph=True)
    out = []
    for it, fn in ((0, m), (0, compiled), (50, m), (50, compiled)):
        m.on_step(it)
        m.zero_grad()
        torch.manual_seed(1)
        _, loss, stats = fn(x, x)
        loss.backward()
        out.append((loss.detach(), m.router.weight.grad.clone(), stats["tau"]))
    assert cnt.frame_count == 1
    for (l1, g1, tau1), (l2, g2, tau2) in (out[:2], out[2:]):
        assert tau1 == tau2 and torch.allclose(l1, l2, atol=1e-6)
        assert torch.allclose(g1, g2, atol=1e-6)
    assert out[0][2] != out[2][2]  # τ moved


def test_eval_forward_is_one_graph():
    m = tiny_model().eval()
    x = tokens(4, 32)
    cnt = CompileCounterWithBackend("eager")
    with torch.no_grad():
        want = m(x, x)
        got = torch.compile(m, backend=cnt, fullgraph=True)(x, x)
    assert cnt.frame_count == 1
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-6)


def test_sparse_forward_breaks_once_where_the_read_counts_reach_the_host():
    """One break per forward (at most one per routed layer is the bar), at sizes.tolist(): the
    counts of GDN and softmax reads set the shapes gathered in every routed layer."""
    m = tiny_model().eval()
    x = tokens(4, 32)
    with torch.no_grad():
        e = dynamo.explain(lambda x: m(x, sparse=True))(x)
        dynamo.reset()
        got = torch.compile(m, backend="eager")(x, sparse=True)[0]
        want = m(x, sparse=True)[0]
    assert (e.graph_count, e.graph_break_count) == (2, 1), e.break_reasons
    where = e.break_reasons[0].user_stack[-1]
    assert where.name == "forward" and "sizes.tolist()" in where.line
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("B", [1, 4])
def test_decode_step_is_one_graph_over_64_steps(B):
    """fullgraph=True; greedy decoding equals eager's token for token over 64 steps that take both
    reads (at B=1 torch.cond picks one, at B=4 torch.where per row), with the eager step's logits,
    and nothing recompiles. aot_eager: AOT tracing too, as a CUDA-graph capture needs."""
    m = tiny_model().eval()
    prompt = tokens(B, 8, seed=B)
    cnt = CompileCounterWithBackend("aot_eager")
    toks, logs = {}, {}
    with torch.no_grad():
        for name, step in (("eager", m.step),
                           ("compiled", torch.compile(m.step, backend=cnt, fullgraph=True))):
            logits, state = m.prefill(prompt)
            out, seen = [], []
            for _ in range(64):
                out.append(logits.argmax(-1, keepdim=True))  # (B, 1)
                logits, state = step(out[-1], state)
                seen.append(logits)
            toks[name], logs[name] = torch.cat(out, 1), torch.stack(seen, 1)  # (B, 64), (B, 64, V)
        seq = torch.cat([prompt, toks["eager"]], 1)
        soft = m.route(m.blocks[0](m.embed(seq)))[2][:, 8:, :, 1]  # (B, 64, nR): decisions taken
    assert torch.equal(toks["eager"], toks["compiled"])
    assert torch.allclose(logs["eager"], logs["compiled"], atol=1e-5), \
        (logs["eager"] - logs["compiled"]).abs().max()
    assert cnt.frame_count == 1
    assert 0.1 < soft.mean() < 0.9
