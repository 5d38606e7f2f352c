import contextlib
import os
import shutil
import sys

import pytest
import torch

torch.set_num_threads(1)  # tiny models: threads only add overhead, and CI machines are often shared

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED_SHAKESPEARE = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare", "input.txt")
@contextlib.contextmanager
def killed_at(step):
    """The training run inside dies (KeyboardInterrupt) in the middle of `step`, as a kill would:
    that step's learning-rate lookup raises. The body must raise it; common.lr_at is restored."""
    import common
    real = common.lr_at

    def lr_at(it, cfg):
        if it == step:
            raise KeyboardInterrupt
        return real(it, cfg)
    common.lr_at = lr_at
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        common.lr_at = real


os.environ.setdefault("TIKTOKEN_CACHE_DIR",
                      os.path.join(ROOT, "..", "shared", "data", "tiktoken_cache"))


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A data/ folder with Tiny Shakespeare already in place (the offline path: no network)."""
    d = tmp_path_factory.mktemp("data")
    local = os.path.join(ROOT, "data", "shakespeare", "input.txt")
    src = next((p for p in (local, SHARED_SHAKESPEARE) if os.path.exists(p)), None)
    if src is None:
        pytest.skip("Tiny Shakespeare not available offline")
    os.makedirs(d / "shakespeare")
    shutil.copy(src, d / "shakespeare" / "input.txt")
    return str(d)


# ------------------------------------------------------------------------------------------------
# The device × dtype matrix every model contract runs on: CPU fp32 and CPU bf16 autocast
# always; CUDA (its training dtype) and MPS (fp32) when present, skipped visibly otherwise.
# Tests take the `dev` fixture and never depend on which device "auto" would pick.

class Dev:
    def __init__(self, device, dtype):
        self.device, self.dtype = torch.device(device), dtype
        self.low = dtype != "fp32"

    def autocast(self):
        import common
        return common.autocast(self.device, self.dtype)

    def tol(self):
        """(atol, rtol) for logits compared between two paths of the same model in this dtype."""
        return (5e-2, 5e-2) if self.low else (1e-4, 1e-4)

    def __repr__(self):
        return f"{self.device.type}-{self.dtype}"


def _dev_params():
    import common
    out = [pytest.param(("cpu", "fp32"), id="cpu-fp32"),
           pytest.param(("cpu", "bf16"), id="cpu-bf16")]
    has_cuda = torch.cuda.is_available()
    cuda_dt = common.default_dtype(torch.device("cuda")) if has_cuda else "bf16"
    out.append(pytest.param(("cuda", cuda_dt), id=f"cuda-{cuda_dt}",
                            marks=pytest.mark.skipif(not has_cuda, reason="no CUDA device here")))
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    out.append(pytest.param(("mps", "fp32"), id="mps-fp32",
                            marks=pytest.mark.skipif(not has_mps, reason="no MPS device here")))
    return out


@pytest.fixture(params=_dev_params())
def dev(request):
    """One (device, dtype) of the matrix: dev.device, dev.dtype, dev.autocast(), dev.tol()."""
    return Dev(*request.param)


@torch.no_grad()
def decoded_vs_full(model, idx, start):
    """Logits of prefill(idx[:, :start]) then one step per later token, and the full forward's
    logits at the same positions: (steps (B, T − start + 1, V), full (B, T − start + 1, V)), both
    fp32."""
    full, _, _ = model(idx)                                   # (B, T, V)
    logits, state = model.prefill(idx[:, :start])
    steps = [logits]
    for t in range(start, idx.size(1)):
        logits, state = model.step(idx[:, t:t + 1], state)
        steps.append(logits)
    return torch.stack(steps, 1).float(), full[:, start - 1:].float()


@torch.no_grad()
def compiled_decode_matches(model, prompt, n, backend="aot_eager"):
    """Greedy decoding with torch.compile(model.step) equals the eager step token for token, and the
    compiled step's shapes do not change from token to token: after the first two tokens (the first
    call traces, the second may specialise once) no new graph is compiled. aot_eager runs dynamo's
    capture and AOT tracing without inductor's C++ build (what the CUDA-graph capture of
    reduce-overhead needs: one graph per decode variant); the inductor run on CPU is tested on the
    dense GPT only (slow to build). Returns the number of graphs compiled (routed models that decide
    on the host per layer compile one per variant)."""
    import torch._dynamo as dynamo
    dynamo.reset()
    before = dynamo.utils.counters["stats"]["unique_graphs"]  # the counter runs on across resets
    step = torch.compile(model.step, backend=backend)
    out = {}
    for name, fn in (("eager", model.step), ("compiled", step)):
        logits, state = model.prefill(prompt)
        toks = []
        for i in range(n):
            tok = logits.argmax(-1, keepdim=True)               # (B, 1)
            toks.append(tok)
            if name == "compiled" and i == 2:
                graphs = dynamo.utils.counters["stats"]["unique_graphs"]
            logits, state = fn(tok, state)
        out[name] = torch.cat(toks, 1)
    assert torch.equal(out["eager"], out["compiled"]), (out["eager"], out["compiled"])
    assert dynamo.utils.counters["stats"]["unique_graphs"] == graphs, \
        "a decode step recompiled: its shapes change"
    return graphs - before
