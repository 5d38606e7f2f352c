"""--init_from GPT-2. A small random GPT-2, built and saved by Hugging Face `transformers` (a
test-only dependency), served from 127.0.0.1 as the Hub serves it and loaded through --init_from,
computes what `transformers` computes: the same logits (fp32, <= 1e-5) and the same greedy tokens,
for the dense GPT and every router on GPT-2 blocks with its routers forced to run every token."""
import dataclasses
import functools
import http.server
import json
import math
import os
import shutil
import socket
import threading

import pytest
import torch

import common
import conddepth
import dtrnet
import train
import tsa

transformers = pytest.importorskip("transformers")

N_LAYER, N_EMBD, N_HEAD, N_POS, VOCAB = 3, 64, 4, 128, 50257  # 3 layers: DTRNet's bilayer is TDT
MODULES = {"gpt": common, "tsa": tsa, "dtrnet": dtrnet, "conddepth": conddepth}
BPE = {"dataset": "shakespeare_bpe", "vocab_size": VOCAB, "encoding": "r50k_base", "unit": "token"}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(folder of the saved checkpoint, the transformers model in eval mode). Every parameter is
    random, biases and LayerNorms too: a tensor loaded into the wrong place changes the logits."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, n_positions=N_POS,
                                  vocab_size=VOCAB, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02))
    folder = str(tmp_path_factory.mktemp("hf") / "tiny-gpt2")
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


@pytest.fixture(scope="module")
def hub(hf):
    """A Hub on 127.0.0.1 serving <url>/gpt2/resolve/main/{config.json, model.safetensors}, the
    weights through a redirect as the Hub does (to its CDN). Yields (url, the paths asked for)."""
    root = os.path.join(os.path.dirname(hf[0]), "hub")
    os.makedirs(os.path.join(root, "gpt2", "resolve"))
    shutil.copytree(hf[0], os.path.join(root, "gpt2", "resolve", "main"))
    os.makedirs(os.path.join(root, "cdn"))
    os.replace(os.path.join(root, "gpt2", "resolve", "main", "model.safetensors"),
               os.path.join(root, "cdn", "model.safetensors"))
    asked = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            asked.append(self.path)
            if self.path == "/gpt2/resolve/main/model.safetensors":
                self.send_response(302)
                self.send_header("Location", "/cdn/model.safetensors")
                self.end_headers()
                return
            super().do_GET()

    handler = functools.partial(Handler, directory=root)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("NO_PROXY", "no_proxy"):  # a machine's proxy must not take the local calls
            mp.setenv(name, "127.0.0.1")
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    server.shutdown()
    server.server_close()


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(name, init_from, data_dir, **flags):
    """The model train.py builds for --model name --init_from init_from, its weights loaded."""
    module = MODULES[name]
    cfg = module.Config(model=name, dataset="shakespeare_bpe", init_from=init_from,
                        data_dir=data_dir, **flags)
    cfg, sd = train.start_from(cfg, module, BPE)
    model = train.build(module, cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected
    return model, missing


@torch.no_grad()
def force_every_token(model):
    """Routers that run every token: TSA's halting probability p = σ(−200) = 0 (gate 1 − p = 1),
    DTRNet's g_attn = softmax([100, −100])₀ = 1 (attention), conddepth's θ = −∞ (the full FFN)."""
    name = model.cfg.model
    if name == "tsa":
        for r in model.routers:
            r.fc2.weight.zero_()
            r.fc2.bias.fill_(-200.0)
    elif name == "dtrnet":
        for b in model.blocks:
            if isinstance(b, dtrnet.DTRBlock):
                b.router.w2.weight.zero_()
                b.router.w2.bias.copy_(torch.tensor([100.0, -100.0]))
    elif name == "conddepth":
        model.thresholds.fill_(-math.inf)
    return model.eval()


FRESH = {"gpt": set(), "tsa": {"routers"}, "dtrnet": {"router"},
         "conddepth": {"cheap", "gates", "thresholds", "threshold_batches"}}  # what is not GPT-2's


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("source", ["hub", "folder"])
def test_logits_and_greedy_tokens_equal_transformers(hf, hub, tmp_path, monkeypatch, name, source):
    folder, ref = hf
    monkeypatch.setenv("NANOROUTE_HF_URL", hub[0])
    model, missing = load(name, "gpt2" if source == "hub" else folder, str(tmp_path),
                          block_size=N_POS)
    c = model.cfg
    assert (c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size, c.bias, c.gelu) == \
        (N_LAYER, N_HEAD, N_EMBD, N_POS, VOCAB, True, "tanh")
    fresh = {k.split(".")[2] if k.startswith("blocks.") else k.split(".")[0] for k in missing}
    assert fresh == FRESH[name], fresh
    force_every_token(model)
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(idx).logits                                   # (B, T, V)
        err = (model(idx)[0] - want).abs().max()
        assert err <= 1e-5, err
        if name != "gpt":                                        # the sparse path: the same logits
            err = (model(idx, sparse=True)[0] - want).abs().max()
            assert err <= 1e-5, err
    prompt = idx[:1, :8]
    ours = model.generate(prompt, 16, temperature=0)             # cached greedy decoding
    theirs = ref.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=VOCAB - 1,
                          attention_mask=torch.ones_like(prompt))
    assert torch.equal(ours, theirs), (ours, theirs)


def test_download_once_into_the_cache(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOROUTE_HF_URL", hub[0] + "/")
    hub[1].clear()
    folder = train.gpt2_folder("gpt2", str(tmp_path))
    assert folder == os.path.join(str(tmp_path), "hf", "gpt2")
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]  # no .part left
    cdn = ["/cdn/model.safetensors"]  # the weights' redirect, followed
    assert hub[1] == [f"/gpt2/resolve/main/{f}" for f in train.HF_FILES] + cdn
    train.gpt2_folder("gpt2", str(tmp_path))
    assert len(hub[1]) == 3  # cached: not asked again


def test_position_embeddings_cropped_and_checkpoints_checked(hf, tmp_path):
    folder, ref = hf
    sd = train.gpt2_state_dict(folder, N_LAYER, 32)
    assert torch.equal(sd["wpe.weight"], ref.transformer.wpe.weight[:32])
    assert sd["lm_head.weight"] is sd["wte.weight"]
    with pytest.raises(common.NanorouteError, match="not hold a 4-layer GPT-2: no blocks.3"):
        train.gpt2_state_dict(folder, N_LAYER + 1, 32)
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(bad / "model.safetensors") - 4)
    with pytest.raises(common.NanorouteError, match="not a readable safetensors file"):
        train.gpt2_state_dict(str(bad), N_LAYER, 32)
    cfg = json.load(open(bad / "config.json"))
    json.dump(dict(cfg, activation_function="relu"), open(bad / "config.json", "w"))
    with pytest.raises(common.NanorouteError, match="activation_function 'relu' is not GPT-2's"):
        train.gpt2_config(str(bad))


@pytest.mark.parametrize("field,value,says", [
    ("n_layer", "3", "n_layer is '3', not int"), ("n_embd", True, "n_embd is True, not int"),
    ("scale_attn_weights", "false", "scale_attn_weights is 'false', not bool"),
    ("n_head", 0, "n_head is 0, not a size"), ("n_ctx", 64, "n_ctx 64 unlike n_positions 128"),
    ("architectures", ["GPT2ForSequenceClassification"], "architectures ['GPT2ForSequence")])
def test_a_hf_config_is_checked_field_by_field(hf, tmp_path, field, value, says):
    """A config.json field of the wrong type (a string "false" is truthy: it would read as
    scale_attn_weights on) or one that changes the function is refused, naming the file."""
    bad = tmp_path / "bad"
    shutil.copytree(hf[0], bad)
    json.dump(dict(json.load(open(bad / "config.json")), **{field: value}),
              open(bad / "config.json", "w"))
    with pytest.raises(common.NanorouteError, match="config.json: " + says.replace("[", r"\[")):
        train.gpt2_config(str(bad))


def test_overlapping_safetensors_are_refused(tmp_path):
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(12))
    with pytest.raises(common.NanorouteError, match="a and b overlap"):
        train.read_safetensors(str(path))


def test_a_cached_download_that_is_not_what_it_claims_is_not_kept(hub, hf, tmp_path, monkeypatch):
    """A proxy's HTML page served as config.json: refused, and removed from data/hf/, so the next
    run (here with the real file served) downloads it again instead of failing forever."""
    monkeypatch.setenv("NANOROUTE_HF_URL", hub[0])
    served = os.path.join(os.path.dirname(hf[0]), "hub", "gpt2-large", "resolve", "main")
    os.makedirs(served)
    with open(os.path.join(served, "config.json"), "w") as f:
        f.write("<!doctype html><html><body>Sign in to this network</body></html>")
    cached = tmp_path / "hf" / "gpt2-large" / "config.json"
    with pytest.raises(common.NanorouteError, match="is not a GPT-2 config .*removed it from the "
                       "cache: the next run downloads it again"):
        train.gpt2_folder("gpt2-large", str(tmp_path), files=("config.json",))
    assert not cached.exists()
    shutil.copy(os.path.join(hf[0], "config.json"), os.path.join(served, "config.json"))
    train.gpt2_folder("gpt2-large", str(tmp_path), files=("config.json",))
    assert train.gpt2_config(str(cached.parent))["n_layer"] == N_LAYER


def test_gpt2_folder_names_what_a_local_folder_lacks(tmp_path):
    with pytest.raises(common.NanorouteError) as e:
        train.gpt2_folder(str(tmp_path))
    assert str(e.value) == (f"--init_from {tmp_path}: no config.json or model.safetensors there "
                            "(a Hugging Face GPT-2 checkpoint is config.json + model.safetensors)")
    (tmp_path / "config.json").write_text(json.dumps(SMALL_HF))
    with pytest.raises(common.NanorouteError) as e:
        train.gpt2_folder(str(tmp_path))
    assert str(e.value).startswith(f"--init_from {tmp_path}: no model.safetensors there (")


def test_a_cached_model_safetensors_that_is_no_safetensors_is_not_kept(tmp_path):
    """What a proxy serves as the weights (an HTML page), already in data/hf/: refused and
    removed, the config kept; no download (both files are there)."""
    folder = tmp_path / "hf" / "gpt2"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(SMALL_HF))
    (folder / "model.safetensors").write_text("<!doctype html><html>Sign in</html>")
    with pytest.raises(common.NanorouteError) as e:
        train.gpt2_folder("gpt2", str(tmp_path))
    n = int.from_bytes(b"<!doctyp", "little")  # its first 8 bytes read as the header's length
    assert str(e.value) == (f"{folder / 'model.safetensors'} is not a readable safetensors file "
                            f"(ValueError: header length {n} in a file of 35 bytes); removed it "
                            "from the cache: the next run downloads it again")
    assert os.listdir(folder) == ["config.json"]


def test_the_hubs_layout_and_every_float_dtype(hf, tmp_path):
    """The Hub's gpt2 files predate `transformer.`-prefixed names and keep the causal-mask buffers
    (h.<i>.attn.bias, attn.masked_bias): both layouts give the same state dict. The reader gives
    back what the reference writer (the safetensors package) wrote, in each float dtype."""
    save_file = pytest.importorskip("safetensors.torch").save_file
    folder, _ = hf
    tensors = train.read_safetensors(os.path.join(folder, "model.safetensors"))
    old = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    for i in range(N_LAYER):
        old[f"h.{i}.attn.bias"] = torch.ones(1, 1, N_POS, N_POS).tril()
        old[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    hub_like = tmp_path / "hub-like"
    shutil.copytree(folder, hub_like)
    save_file(old, str(hub_like / "model.safetensors"))
    want, got = train.gpt2_state_dict(folder, N_LAYER, N_POS), train.gpt2_state_dict(
        str(hub_like), N_LAYER, N_POS)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    g = torch.Generator().manual_seed(0)
    mixed = {f"t_{dt}": torch.randn(3, 5, generator=g).to(dt)
             for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
    save_file(mixed, str(tmp_path / "mixed.safetensors"))
    back = train.read_safetensors(str(tmp_path / "mixed.safetensors"))
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in mixed.items())


# --------------------------------------------------------------------------------------------------
# train.py from GPT-2 runs for every model on GPT-2 blocks; what cannot work is refused in one line

RUN = ["--dataset=shakespeare_bpe", "--max_iters=2", "--eval_interval=2", "--eval_iters=1",
       "--batch_size=2", "--block_size=32", "--log_interval=1"]


@pytest.mark.parametrize("name", list(MODULES))
def test_train_runs_from_a_local_gpt2(hf, data_dir, tmp_path, name, capsys):
    out = str(tmp_path / name)
    best = train.main([f"--model={name}", f"--init_from={hf[0]}", f"--data_dir={data_dir}",
                       f"--out_dir={out}", *RUN])
    assert math.isfinite(best)
    saved = json.load(open(os.path.join(out, "config.json")))
    arch = dict(n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD, vocab_size=VOCAB, block_size=32,
                bias=True, gelu="tanh")
    assert {k: saved[k] for k in arch} == arch
    log = capsys.readouterr().out
    assert "note: block_size 32 keeps the first 32 of" in log
    fresh = {"gpt": "none", "tsa": "routers", "dtrnet": "blocks.*.router",
             "conddepth": "cheap, gates, threshold_batches, thresholds"}[name]  # what starts anew
    line = next(ln for ln in log.splitlines() if ln.startswith(f"init from {hf[0]}: "))
    assert line.endswith(f" new tensors ({fresh})"), line


def test_a_ddp_rank_other_than_0_waits_for_each_of_rank_0s_fetches(hf, data_dir, tmp_path,
                                                                   monkeypatch):
    """Rank 1 of 2 in this process (torch.distributed stood in for) starting from GPT-2: it waits
    for rank 0's verdict on the data, on GPT-2's config, on its weights and on the run folder, one
    broadcast each, so a download refused on rank 0 ends rank 1 too."""
    common.prepare("shakespeare_bpe", str(data_dir))  # what rank 0 did
    dist, boxes = torch.distributed, []
    monkeypatch.setattr(train, "ddp_env", lambda: (True, 1, 2))
    for name in ("init_process_group", "barrier", "destroy_process_group"):
        monkeypatch.setattr(dist, name, lambda *a, **k: None, raising=False)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src: boxes.append(src))
    monkeypatch.setattr(train, "_gather_rng", lambda state, ddp: [state, state])

    class FirstStep(Exception):
        pass
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda m, device_ids: m)

    def first_step(*a, **k):
        raise FirstStep
    monkeypatch.setattr(train, "accumulate", first_step)
    with pytest.raises(FirstStep):
        train.train(*train.parse(["--model=gpt", f"--init_from={hf[0]}",
                                  f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}",
                                  *RUN]))
    assert boxes == [0, 0, 0, 0]


BPE_RUN = "--dataset=shakespeare_bpe"
OFFLINE = ("); download config.json and model.safetensors from "
           "http://127.0.0.1:{port}/gpt2-medium/resolve/main/ into {data_dir}/hf/gpt2-medium/")


@pytest.mark.parametrize("flags, says", [
    (["--model=gpt", "--init_from=gpt2-medium", "--dataset=shakespeare"],
     "GPT-2 reads GPT-2's BPE tokens; --dataset shakespeare has a vocabulary of 65 chars"),
    (["--model=gpt", "--init_from={folder}", BPE_RUN, "--n_layer=4"],
     "has n_layer=3, but this run asks for n_layer=4: drop --n_layer"),
    (["--model=tsa", "--init_from={folder}", BPE_RUN, "--n_embd=128", "--n_head=4"],
     "has n_embd=64, but this run asks for n_embd=128"),
    (["--model=conddepth", "--init_from={folder}", BPE_RUN, "--preset=classroom"],
     "asks for n_layer=4: drop --n_layer (or the --preset setting it)"),
    (["--model=gpt", "--init_from={folder}", BPE_RUN, "--block_size=256"],
     "--block_size=256 is longer than"),
    (["--model=hybrid", "--init_from={folder}", BPE_RUN], "--model hybrid cannot start from GPT-2"),
    (["--model=dtrnet", "--init_from={folder}", BPE_RUN, "--norm=rmsnorm"],
     "--norm=rmsnorm cannot load GPT-2"),
    (["--model=gpt", "--init_from=gpt2-medium", BPE_RUN], OFFLINE),
], ids=["char-data", "n_layer", "n_embd", "preset", "block_size", "hybrid", "rmsnorm", "offline"])
def test_refused_in_one_line_before_any_work(hf, data_dir, tmp_path, monkeypatch, capsys, flags,
                                             says):
    port = closed_port()
    monkeypatch.setenv("NANOROUTE_HF_URL", f"http://127.0.0.1:{port}")  # nothing listens: offline
    monkeypatch.setattr(common.time, "sleep", lambda s: None)  # download's back-off between tries
    out = str(tmp_path / "run")
    fill = dict(folder=hf[0], port=port, data_dir=data_dir)
    with pytest.raises(SystemExit) as e:
        train.main([f.format(**fill) for f in flags] + [f"--data_dir={data_dir}",
                                                         f"--out_dir={out}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert says.format(**fill) in err, err
    assert not os.path.exists(out)  # nothing written
    assert not os.path.exists(os.path.join(data_dir, "hf", "gpt2-medium", "config.json"))


SMALL_HF = {"model_type": "gpt2", "vocab_size": 50, "n_positions": 16, "n_layer": 2, "n_head": 2,
            "n_embd": 8}


@pytest.mark.parametrize("fields,says", [
    ({}, None), ({"activation_function": "gelu_new"}, None),
    ({"activation_function": "gelu_pytorch_tanh"}, None), ({"activation_function": "gelu"}, None),
    ({"n_inner": 32, "n_ctx": 16, "layer_norm_epsilon": 1e-5}, None),
    ({"vocab_size": 1, "n_positions": 1, "n_layer": 1, "n_head": 1, "n_embd": 1, "n_ctx": 1},
     None),  # 1 is a size
    ({"n_inner": None, "scale_attn_weights": True, "tie_word_embeddings": True}, None),
    ({"architectures": ["GPT2Model"], "add_cross_attention": False}, None),
    ({"architectures": None, "scale_attn_by_inverse_layer_idx": False}, None),
    ({"architectures": ["GPT2LMHeadModel", "GPT2Model"]}, None),
    ({"activation_function": "relu"}, "activation_function 'relu' is not GPT-2's"),
    ({"model_type": "llama"}, "model_type 'llama' is not GPT-2's"),
    ({"model_type": None}, "model_type None is not GPT-2's"),
    ({"n_inner": 16}, "n_inner 16 is not GPT-2's"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon 1e-06 is not GPT-2's"),
    ({"layer_norm_epsilon": 0}, "layer_norm_epsilon 0 is not GPT-2's"),
    ({"scale_attn_weights": False}, "another attention scale is not GPT-2's"),
    ({"scale_attn_by_inverse_layer_idx": True}, "another attention scale is not GPT-2's"),
    ({"tie_word_embeddings": False}, "an untied head is not GPT-2's"),
    ({"add_cross_attention": True}, "cross-attention is not GPT-2's"),
    ({"n_ctx": 8}, "n_ctx 8 unlike n_positions 16 is not GPT-2's"),
    ({"architectures": ["GPT2LMHeadModel", "X"]}, "architectures ['GPT2LMHeadModel', 'X'] is"),
    ({"vocab_size": None}, "vocab_size is None, not int: not a GPT-2 config"),
    ({"n_positions": 16.0}, "n_positions is 16.0, not int"),
    ({"n_ctx": True}, "n_ctx is True, not int"),
    ({"scale_attn_weights": 1}, "scale_attn_weights is 1, not bool"),
    ({"activation_function": 1}, "activation_function is 1, not str"),
    ({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon is '1e-5', not int"),
    ({"n_embd": -8}, "n_embd is -8, not a size: not a GPT-2 config"),
    ({"vocab_size": 0, "n_layer": 0}, "vocab_size is 0, not a size"),
])
def test_gpt2_config_maps_or_refuses_each_field(tmp_path, fields, says):
    """Each field that changes the function: GPT-2's value (or its absence) is mapped, any
    other refused in one line naming the file and the field."""
    (tmp_path / "config.json").write_text(json.dumps({**SMALL_HF, **fields}))
    if says is None:
        gelu = "none" if fields.get("activation_function") == "gelu" else "tanh"
        c = {**SMALL_HF, **fields}
        assert train.gpt2_config(str(tmp_path)) == dict(
            vocab_size=c["vocab_size"], block_size=c["n_positions"], n_layer=c["n_layer"],
            n_head=c["n_head"], n_embd=c["n_embd"], bias=True, gelu=gelu)
        return
    with pytest.raises(common.NanorouteError) as e:
        train.gpt2_config(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: {says}"), str(e.value)


def test_a_gpt2_config_that_is_no_json_object_is_refused(tmp_path):
    path = tmp_path / "config.json"
    for text, says in (("[1]", "is not a GPT-2 config (a JSON list, not an object)"),
                       ("{", "is not a GPT-2 config (JSONDecodeError: "),
                       (None, "is not a GPT-2 config (FileNotFoundError: ")):
        if text is not None:
            path.write_text(text)
        else:
            path.unlink()
        with pytest.raises(common.NanorouteError) as e:
            train.gpt2_config(str(tmp_path))
        assert str(e.value).startswith(f"{path} {says}"), str(e.value)


def tiny_gpt2(folder, **extra):
    """A 1-layer GPT-2's model.safetensors in HF's layout (Conv1D weights (in, out)), C=4."""
    save_file = pytest.importorskip("safetensors.torch").save_file
    g = torch.Generator().manual_seed(0)
    shapes = {"wte.weight": (10, 4), "wpe.weight": (8, 4), "ln_f.weight": (4,), "ln_f.bias": (4,)}
    for k, shape in {"ln_1.weight": (4,), "ln_1.bias": (4,), "attn.c_attn.weight": (4, 12),
                     "attn.c_attn.bias": (12,), "attn.c_proj.weight": (4, 4),
                     "attn.c_proj.bias": (4,), "ln_2.weight": (4,), "ln_2.bias": (4,),
                     "mlp.c_fc.weight": (4, 16), "mlp.c_fc.bias": (16,),
                     "mlp.c_proj.weight": (16, 4), "mlp.c_proj.bias": (4,)}.items():
        shapes[f"h.0.{k}"] = shape
    sd = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
    sd.update(extra)
    os.makedirs(folder, exist_ok=True)
    save_file(sd, os.path.join(folder, "model.safetensors"))
    return sd


def tiny_gpt2_folder(folder, **config):
    """A 1-layer GPT-2 checkpoint folder (tiny_gpt2's weights, vocabulary 10, 8 positions, C=4)."""
    tiny_gpt2(folder)
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "vocab_size": 10, "n_positions": 8, "n_layer": 1, "n_head": 1,
         "n_embd": 4, **config}))
    return str(folder)


def start_refused(cfg, module, meta):
    with pytest.raises(common.NanorouteError) as e:
        train.start_from(cfg, module, meta)
    return str(e.value)


def test_start_from_refuses_by_value_before_reading_weights(tmp_path, monkeypatch):
    """Each refusal's exact line, called directly (no run): a run's folder, a hybrid, data in
    another unit (a meta without one: tokens), another vocabulary; a checkpoint config without a
    vocab_size takes the run's."""
    folder = tiny_gpt2_folder(tmp_path / "hf")
    bpe = {"encoding": "r50k_base", "vocab_size": 10}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_text("")
    src = str(tmp_path / "run")
    assert start_refused(common.Config(init_from=src), common, bpe) == (
        f"--init_from {src} is a run: pass {os.path.join(src, 'ckpt.pt')}")
    import hybrid_attn
    hybrid = hybrid_attn.Config(model="hybrid", init_from=folder)
    assert start_refused(hybrid, hybrid_attn, bpe) == (
        "--model hybrid cannot start from GPT-2: its Gated DeltaNet layers have no GPT-2 weights, "
        "and GPT-2 with random mixers in place of its attention is no trained model (route GPT-2 "
        "with tsa, dtrnet or conddepth, or train the hybrid from scratch)")
    assert start_refused(common.Config(init_from=folder, dataset="x"), common,
                         {"vocab_size": 7}) == ("GPT-2 reads GPT-2's BPE tokens; --dataset x has "
                                                "a vocabulary of 7 tokens: use --dataset "
                                                "shakespeare_bpe")
    ckpt = str(tmp_path / "ckpt.pt")
    saved = dataclasses.asdict(common.Config(vocab_size=50, n_layer=1))
    common.save_checkpoint(ckpt, model={}, config=saved)
    meta = {"dataset": "shakespeare", "vocab_size": 65}
    assert start_refused(common.Config(init_from=ckpt), common, meta) == (
        f"--init_from {ckpt} has a vocabulary of 50, --dataset shakespeare one of 65: use the "
        "dataset it learned")
    del saved["vocab_size"]
    common.save_checkpoint(ckpt, model={}, config=saved)
    cfg, sd = train.start_from(common.Config(init_from=ckpt, vocab_size=65), common, meta)
    assert cfg.vocab_size == 65 and cfg.n_layer == 1 and sd == {}


def test_start_from_a_hub_name_reads_its_config_before_fetching_the_weights(tmp_path, monkeypatch,
                                                                           capsys):
    """A config refused (here: another vocabulary) costs no weights download; on a rank other
    than 0, both fetches wait for rank 0's verdict (a broadcast) and nothing is printed."""
    fetched = []
    monkeypatch.setattr(common, "download", lambda url, dest, **kw: fetched.append(url))
    cache = tmp_path / "hf" / "gpt2"
    cache.mkdir(parents=True)
    (cache / "config.json").write_text(json.dumps({**SMALL_HF, "vocab_size": 10}))
    cfg = common.Config(init_from="gpt2", data_dir=str(tmp_path), dataset="shakespeare_bpe")
    assert start_refused(cfg, common, {"encoding": "r50k_base", "vocab_size": 7}) == (
        "--init_from gpt2 has a vocabulary of 10, --dataset shakespeare_bpe one of 7: use the "
        "dataset it learned")
    assert fetched == [] and os.listdir(cache) == ["config.json"]
    boxes = []
    monkeypatch.setattr(torch.distributed, "broadcast_object_list",
                        lambda box, src: boxes.append((list(box), src)))
    folder = tiny_gpt2_folder(tmp_path / "local")
    cfg = common.Config(init_from=folder, block_size=4, vocab_size=10)
    cfg, sd = train.start_from(cfg, common, {"encoding": "r50k_base", "vocab_size": 10},
                               master=False, ddp=True)
    assert boxes == [([None], 0), ([None], 0)] and cfg.n_embd == 4 and "wte.weight" in sd
    assert capsys.readouterr().out == ""  # rank 0 says what came from where


def test_start_from_a_gpt2_folder_by_value(tmp_path, capsys):
    """Its positions: all (no note), fewer (a note), more (refused); a vocab_size given is the
    data's business (resolve), not a value the checkpoint refuses."""
    folder = tiny_gpt2_folder(tmp_path / "hf")
    bpe = {"encoding": "r50k_base", "vocab_size": 10}
    cfg, sd = train.start_from(common.Config(init_from=folder, block_size=8, vocab_size=100),
                               common, bpe)
    assert cfg.vocab_size == 10 and cfg.block_size == 8 and sd["wpe.weight"].shape == (8, 4)
    assert capsys.readouterr().out == (
        f"from --init_from {folder}: vocab_size=10, n_layer=1, n_head=1, n_embd=4, bias=true, "
        "gelu=tanh; the rest from this run's flags and defaults\n")
    train.start_from(common.Config(init_from=folder, block_size=5), common, bpe)
    assert capsys.readouterr().out.startswith(
        f"note: block_size 5 keeps the first 5 of {folder}'s 8 positions (--block_size=8 for all "
        "of them)\n")
    assert start_refused(common.Config(init_from=folder, block_size=9), common, bpe) == (
        f"--block_size=9 is longer than {folder}'s 8 positions")


def test_gpt2_state_dict_maps_each_name_and_refuses_the_rest(tmp_path):
    hf_sd = tiny_gpt2(tmp_path / "a")
    sd = train.gpt2_state_dict(str(tmp_path / "a"), 1, 8)
    assert torch.equal(sd["blocks.0.mlp.c_proj.weight"], hf_sd["h.0.mlp.c_proj.weight"].t())
    assert torch.equal(sd["blocks.0.ln_2.bias"], hf_sd["h.0.ln_2.bias"])
    assert torch.equal(sd["wpe.weight"], hf_sd["wpe.weight"]) and sd["lm_head.weight"] is \
        sd["wte.weight"]
    assert torch.equal(train.gpt2_state_dict(str(tmp_path / "a"), 1, 5)["wpe.weight"],
                       hf_sd["wpe.weight"][:5])  # a shorter context: the first positions
    with pytest.raises(common.NanorouteError) as e:
        train.gpt2_state_dict(str(tmp_path / "a"), 1, 9)
    assert str(e.value) == "block_size=9 is longer than the checkpoint's 8 positions"
    with pytest.raises(common.NanorouteError) as e:  # 12 tensors missing: the first 3 named
        train.gpt2_state_dict(str(tmp_path / "a"), 2, 8)
    assert str(e.value) == (f"{tmp_path / 'a' / 'model.safetensors'} does not hold a 2-layer "
                            "GPT-2: no blocks.1.attn.c_attn.bias, no blocks.1.attn.c_attn.weight, "
                            "no blocks.1.attn.c_proj.bias")
    tiny_gpt2(tmp_path / "b", **{"lm_head.weight": hf_sd["wte.weight"].clone()})  # tied: kept
    assert set(train.gpt2_state_dict(str(tmp_path / "b"), 1, 8)) == set(sd)
    tiny_gpt2(tmp_path / "c", **{"lm_head.weight": hf_sd["wte.weight"] + 1})
    with pytest.raises(common.NanorouteError, match="has an lm_head unlike wte: nanoroute's head "
                       "is tied"):
        train.gpt2_state_dict(str(tmp_path / "c"), 1, 8)
    tiny_gpt2(tmp_path / "d", **{k: torch.zeros(1) for k in (
        "h.0.attn.rotary", "h.1.ln_1.weight", "h.1.ln_2.weight", "zz")})  # the first 3 named
    with pytest.raises(common.NanorouteError) as e:
        train.gpt2_state_dict(str(tmp_path / "d"), 1, 8)
    assert str(e.value) == (f"{tmp_path / 'd' / 'model.safetensors'} does not hold a 1-layer "
                            "GPT-2: blocks.0.attn.rotary, blocks.1.ln_1.weight, "
                            "blocks.1.ln_2.weight")
