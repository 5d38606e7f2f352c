"""Foundation: data preparation (against a server on 127.0.0.1), batches, the dense GPT, accounting,
checkpoints and exact resume, the CLI's errors, and a 2-process DDP run."""
import contextlib
import dataclasses
import hashlib
import http.server
import importlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
import requests
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import common
import train
from conftest import ROOT, decoded_vs_full, killed_at


# --------------------------------------------------------------------------------------------------
# data: download over HTTP from a local server

class Server:
    """Serves self.routes[path] = (body, claimed_length) on 127.0.0.1;
    a short body = an interrupted download."""

    def __init__(self):
        self.routes, self.hits = {}, 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.hits += 1
                if self.path not in outer.routes:
                    self.send_error(404)
                    return
                body, length = outer.routes[self.path]
                self.send_response(200)
                self.send_header("Content-Length", str(length or len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(common.time, "sleep", lambda s: None)  # no back-off waits in tests
    s = Server()
    yield s
    s.httpd.shutdown()


@pytest.fixture(scope="module")
def shakespeare_text(data_dir):
    return open(os.path.join(data_dir, "shakespeare", "input.txt"), "rb").read()


def test_download_prepares_shakespeare_and_checks_sha256(server, tmp_path, shakespeare_text,
                                                         capsys):
    assert hashlib.sha256(shakespeare_text).hexdigest() == common.SHAKESPEARE_SHA256
    server.routes["/input.txt"] = (shakespeare_text, None)
    meta = common.prepare("shakespeare", str(tmp_path), url=server.url + "/input.txt")
    assert meta["vocab_size"] == 65 and meta["itos"][0] == "\n"
    assert meta["train_tokens"] + meta["val_tokens"] == 1_115_394
    assert meta["train_tokens"] == int(0.9 * 1_115_394)  # nanoGPT's split
    assert "vocab_size 65" in capsys.readouterr().out  # prepare says what it produced
    val = common.load_split("shakespeare", "val", str(tmp_path))
    assert common.decode(meta, val[:20].tolist()) \
        == shakespeare_text.decode()[int(0.9 * 1_115_394):][:20]
    hits = server.hits
    common.prepare("shakespeare", str(tmp_path), url=server.url + "/input.txt")
    assert server.hits == hits  # prepared once


def test_download_rejects_checksum_mismatch(server, tmp_path, shakespeare_text):
    server.routes["/input.txt"] = (shakespeare_text[:-1] + b"?", None)
    with pytest.raises(common.NanorouteError, match="sha256 mismatch"):
        common.prepare("shakespeare", str(tmp_path), url=server.url + "/input.txt")
    assert os.listdir(tmp_path / "shakespeare") == []  # no partial or bad file left behind


def test_interrupted_download_leaves_nothing_and_says_where_to_put_the_file(server, tmp_path,
                                                                            shakespeare_text):
    # connection drops early
    server.routes["/input.txt"] = (shakespeare_text[:1000], len(shakespeare_text))
    with pytest.raises(common.NanorouteError) as e:
        common.prepare("shakespeare", str(tmp_path), url=server.url + "/input.txt")
    assert str(tmp_path / "shakespeare" / "input.txt") in str(e.value)
    assert server.hits == 3  # retried
    assert os.listdir(tmp_path / "shakespeare") == []


class FakeResponse:
    """What requests.get returns, for what a local server cannot send: a body shorter than its
    Content-Length that urllib3 does not catch (urllib3 1.x), or no Content-Length at all."""

    def __init__(self, body, length, tick=0):
        self.body, self.status_code, self.tick, self.now = body, 200, tick, 0
        self.headers = requests.structures.CaseInsensitiveDict(
            {} if length is None else {"Content-Length": str(length)})

    def __enter__(self):
        return self

    def __exit__(self, *a):
        pass

    def raise_for_status(self):
        pass

    def iter_content(self, chunk):
        for i in range(0, len(self.body), chunk):
            self.now += self.tick  # each chunk takes `tick` seconds (self.now: the clock)
            yield self.body[i:i + chunk]


@pytest.mark.parametrize("length,error", [
    (None, None), (6, None), (10, "download interrupted: got 6 of 10 bytes")],
    ids=["no-length", "whole", "short"])
def test_download_checks_the_length_the_server_gave_with_the_default_timeout(
        tmp_path, monkeypatch, capsys, length, error):
    """No Content-Length: the body as it comes; a body short of it: an error naming both counts;
    every request has the 30 s default timeout; a small file prints no progress."""
    asked = []
    monkeypatch.setattr(common.requests, "get", lambda url, **kw: asked.append(kw)
                        or FakeResponse(b"abcdef", length))
    dest = str(tmp_path / "f")
    if error is None:
        assert common.download("http://x/f", dest) == dest and open(dest, "rb").read() == b"abcdef"
    else:
        with pytest.raises(common.NanorouteError) as e:
            common.download("http://x/f", dest, retries=1)
        assert str(e.value) == (f"could not download http://x/f (OSError: {error}); download it "
                                f"yourself and place it at {dest}")
        assert os.listdir(tmp_path) == []
    assert [kw["timeout"] for kw in asked] == [30] and capsys.readouterr().out == ""


def test_download_backs_off_between_tries_and_says_what_failed_last(server, tmp_path, monkeypatch):
    """Waits of 1, 2, 4, 8, 8 s (doubling, at most 8) between six tries and none after the last;
    the error names the last failure; no .part was written, and none is looked for."""
    waits = []
    monkeypatch.setattr(common.time, "sleep", waits.append)
    with pytest.raises(common.NanorouteError) as e:
        common.download(server.url + "/missing", str(tmp_path / "f"), retries=6, hint="do this")
    assert waits == [1, 2, 4, 8, 8, 0] and server.hits == 6
    assert re.fullmatch(rf"could not download {server.url}/missing \(HTTPError: 404 Client Error: "
                        r".*\); do this", str(e.value)), str(e.value)


@pytest.mark.parametrize("chunk,total,shows", [(100, 5000, False), (100, 5001, True),
                                               (25000, 1_500_000, True)])
@pytest.mark.parametrize("tick", [0, 2, 2.5])
def test_download_shows_progress_for_a_large_file_every_2_s(tmp_path, monkeypatch, chunk, total,
                                                            shows, tick):
    """A file of more than 50 chunks shows "done/total MB" (rounded, 1 MB = 10^6 bytes) on one
    line when more than 2 s have passed since the last time it did (or the start), then ends the
    line; printed flushed at once, so that a terminal shows it."""
    printed, r = [], FakeResponse(b"x" * total, total, tick)
    monkeypatch.setattr(common, "print", lambda *a, **kw: printed.append((a, kw)), raising=False)
    monkeypatch.setattr(common.time, "time", lambda: r.now)
    monkeypatch.setattr(common.requests, "get", lambda url, **kw: r)
    common.download("http://x/f", str(tmp_path / "f"), chunk=chunk)
    n = -(-total // chunk) if shows else 0  # chunks; a line at a chunk > 2 s after the last
    assert len(printed) == {0: 0, 2: n // 2, 2.5: n}[tick] + (tick > 0 and n > 0)  # + the "\n"
    if not printed:
        return
    assert printed[-1] == ((), {})
    assert all(kw == {"end": "", "flush": True} for _, kw in printed[:-1])
    first, last = ("\r  0/0 MB", "\r  0/0 MB") if total < 10 ** 6 else ("\r  0/2 MB", "\r  2/2 MB")
    assert (printed[0][0], printed[-2][0]) == ((first,), (last,))  # 1.5 MB shows 2 (1.499... 1)


def test_offline_uses_the_file_in_place_and_never_touches_the_network(tmp_path, shakespeare_text):
    os.makedirs(tmp_path / "shakespeare")
    (tmp_path / "shakespeare" / "input.txt").write_bytes(shakespeare_text)
    meta = common.prepare("shakespeare", str(tmp_path), url="http://127.0.0.1:9/unreachable")
    assert meta["vocab_size"] == 65


def test_enwik8_from_a_small_zip(server, tmp_path, monkeypatch):
    raw = bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("enwik8", raw)
    server.routes["/enwik8.zip"] = (buf.getvalue(), None)
    cuts, read = [], zipfile.ZipFile.read

    class Bytes(bytes):  # records how the member is cut: enwik8 is its first 10^8 bytes
        def __getitem__(self, k):
            cuts.append(k)
            return bytes(self)[k]
    monkeypatch.setattr(zipfile.ZipFile, "read", lambda z, *a: Bytes(read(z, *a)))
    meta = common.prepare("enwik8", str(tmp_path), url=server.url + "/enwik8.zip")
    assert (meta["train_tokens"], meta["val_tokens"], meta["test_tokens"]) == (3600, 200, 200)
    assert (meta["unit"], meta["vocab_size"], meta["characters"]) == ("byte", 256, 4000)
    assert cuts == [slice(None, 10 ** 8)]
    assert bytes(common.load_split("enwik8", "val", str(tmp_path)).astype(np.uint8)) \
        == raw[3600:3800]


def test_corrupt_enwik8_zip_is_a_clear_error(tmp_path):
    os.makedirs(tmp_path / "enwik8")
    (tmp_path / "enwik8" / "enwik8.zip").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(common.NanorouteError, match="corrupt"):
        common.prepare("enwik8", str(tmp_path))



def test_enwik8_zip_with_a_bad_crc_or_no_enwik8_member_is_corrupt(tmp_path):
    """The zip's own CRCs are the integrity check (no sha256 for enwik8): a flipped byte, or a
    zip without the enwik8 member, is refused naming the zip, before anything is written."""
    zpath = tmp_path / "enwik8" / "enwik8.zip"
    os.makedirs(zpath.parent)
    for member, flip, says in (("enwik8", True, "CRC mismatch"), ("other", False, ".*no item.*")):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            z.writestr(member, b"x" * 1000)
        body = bytearray(buf.getvalue())
        if flip:
            body[body.index(b"x" * 1000) + 500] ^= 1
        zpath.write_bytes(bytes(body))
        with pytest.raises(common.NanorouteError, match=f"^{re.escape(str(zpath))} is corrupt "
                           f"\\({says}\\); delete it and run again, or place a good copy there$"):
            common.prepare("enwik8", str(tmp_path))
        assert os.listdir(zpath.parent) == ["enwik8.zip"]


def test_prepare_writes_the_char_mapping_and_says_what_it_made(tmp_path, capsys):
    """A character dataset by hand: itos sorted, the ids are itos' indices, 90/10, meta.json on
    disk is the meta returned; a split too short for one window (an input and a target) is
    refused before anything is written; a --data_dir that is a file is refused."""
    d = tmp_path / "shakespeare"
    os.makedirs(d)
    (d / "input.txt").write_text("ba\nab" * 4, encoding="utf-8")  # 20 characters: val 2
    meta = common.prepare("shakespeare", str(tmp_path))
    assert meta == {"dataset": "shakespeare", "vocab_size": 3, "itos": ["\n", "a", "b"],
                    "unit": "char", "characters": 20, "train_tokens": 18, "val_tokens": 2}
    assert json.loads((d / "meta.json").read_text()) == meta
    assert common.prepare("shakespeare", str(tmp_path)) == meta  # read back from tmp_path
    assert capsys.readouterr().out == ("prepared shakespeare: vocab_size 3, characters 20, "
                                       "train_tokens 18, val_tokens 2\n")
    assert np.fromfile(d / "train.bin", dtype=np.uint16).tolist() == [2, 1, 0, 1, 2] * 3 + [2, 1, 0]
    assert sorted(os.listdir(d)) == ["input.txt", "meta.json", "train.bin", "val.bin"]
    for text, says in (("ba\nab" * 2, "a val split of 1 token(s)"),
                       ("", "a train, val split of 0 token(s)")):
        shutil.rmtree(d)
        os.makedirs(d)
        (d / "input.txt").write_text(text, encoding="utf-8")
        with pytest.raises(common.NanorouteError, match=f"^shakespeare gives {re.escape(says)}: "
                           f"its input in {re.escape(str(d))} is empty or too short; put "
                           "the full file there and run again$"):
            common.prepare("shakespeare", str(tmp_path))
        assert os.listdir(d) == ["input.txt"]
    (d / "input.txt").write_bytes(b"ab\xffcd")
    with pytest.raises(common.NanorouteError) as e:
        common.prepare("shakespeare", str(tmp_path))
    assert str(e.value) == (f"{d / 'input.txt'} is not UTF-8 text (invalid start byte at byte 2); "
                            "replace it with Tiny Shakespeare's input.txt")
    (tmp_path / "file").write_text("x")
    with pytest.raises(common.NanorouteError, match="^--data_dir .*file is a file, not a dir"):
        common.prepare("copy", str(tmp_path / "file"))
    with pytest.raises(common.NanorouteError, match="^unknown dataset 'imdb'; choose one of "
                       "shakespeare, shakespeare_bpe, enwik8, copy, sort, fineweb_edu$"):
        common.prepare("imdb", str(tmp_path))


def test_copy_and_sort_data_are_pinned(tmp_path):
    """The synthetic tasks are the same data everywhere: 10,000 training and 1,000 validation
    records from fixed seeds (copy 1234, sort 4321), pinned by their first records."""
    first = {("copy", "train"): [32, 31, 31, 31, 12, 5, 29, 3, 8, 4, 10, 33,
                                 31, 31, 31, 12, 5, 29, 3, 8, 4, 10, 34],
             ("sort", "val"): [32, 0, 22, 16, 19, 7, 3, 13, 0, 5, 2, 33,
                               0, 0, 2, 3, 5, 7, 13, 16, 19, 22, 34]}
    for (task, split), record in first.items():
        meta = common.prepare(task, str(tmp_path))
        assert (meta["train_tokens"], meta["val_tokens"], meta["unit"]) == (230_000, 23_000,
                                                                            "token")
        assert common.load_split(task, split, str(tmp_path))[:23].tolist() == record

def test_shakespeare_bpe(data_dir):
    meta = common.prepare("shakespeare_bpe", data_dir)
    assert (meta["vocab_size"], meta["encoding"], meta["unit"]) == (50257, "r50k_base", "token")
    val = common.load_split("shakespeare_bpe", "val", data_dir)
    assert common.decode(meta, val[:50].tolist()).startswith("?\n\nGREMIO:")


# --------------------------------------------------------------------------------------------------
# batches

def test_windows_are_shifted_by_one(data_dir):
    meta = common.prepare("shakespeare", data_dir)
    data = common.load_split("shakespeare", "train", data_dir)
    x, y = common.get_batch(data, meta, 4, 32, np.random.default_rng(0))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = common.get_batch(data, meta, 4, 32, np.random.default_rng(0))
    assert torch.equal(x, x2)  # seeded


@pytest.mark.parametrize("task", ["copy", "sort"])
def test_copy_sort_records_and_target_masking(tmp_path, task):
    meta = common.prepare(task, str(tmp_path))
    assert meta["vocab_size"] == 35 and meta["record_len"] == 23 \
        and meta["train_tokens"] == 23 * 10_000
    data = common.load_split(task, "train", str(tmp_path))
    x, y = common.get_batch(data, meta, 8, 22, np.random.default_rng(1))
    assert x.shape == y.shape == (8, 22)
    assert (x[:, 0] == common.BOS).all() and (x[:, 11] == common.SEP).all()
    assert (y[:, :11] == -1).all()  # no loss on the source or on predicting [SEP]
    src, tgt = x[:, 1:11], y[:, 11:21]
    assert torch.equal(tgt, src if task == "copy" else src.sort(dim=1).values)
    assert (y[:, 21] == common.EOS).all()


def test_batches_reach_every_window_of_the_split():
    """Windows start anywhere from the split's first token to the last start that still has a
    target: the first and the last position of the split are both seen, and y is x shifted by
    exactly one (a sampler whose upper bound is one short never trains on the split's tail)."""
    meta, T = {"dataset": "shakespeare", "unit": "char"}, 8
    for n in (T + 5, T + 1):  # five windows, then only one
        data = np.arange(n, dtype=np.uint16)
        x, y = common.get_batch(data, meta, 200, T, np.random.default_rng(0))
        # arange: the target of every position is the next token of the split
        assert torch.equal(y, x + 1)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x - x[:, :1], torch.arange(T).expand(200, T))  # contiguous windows
        assert set(x[:, 0].tolist()) == set(range(n - T))  # every start, 0 and n - T - 1 included
        assert x.min() == 0 and y.max() == n - 1  # the first token is read, the last is predicted


def test_a_split_no_longer_than_block_size_is_refused():
    """A window needs block_size + 1 tokens (an input and its shifted target)."""
    meta = {"dataset": "shakespeare", "unit": "char"}
    with pytest.raises(common.NanorouteError, match=r"^block_size=8 is longer than the split "
                       r"\(8 tokens\)$"):
        common.get_batch(np.arange(8, dtype=np.uint16), meta, 2, 8, np.random.default_rng(0))
    x, _ = common.get_batch(np.arange(9, dtype=np.uint16), meta, 2, 8, np.random.default_rng(0))
    assert x[:, 0].tolist() == [0, 0]


def test_record_batches_reach_every_record():
    """copy/sort batches are whole records drawn from all of them, the last record included."""
    R, n = 2 * common.TASK_LEN + 3, 6
    meta = {"dataset": "copy", "record_len": R, "unit": "token"}
    data = np.arange(n * R, dtype=np.uint16)
    x, y = common.get_batch(data, meta, 200, R - 1, np.random.default_rng(0))
    assert set((x[:, 0] // R).tolist()) == set(range(n)) and x.dtype == y.dtype == torch.int64
    # whole records, from their start
    assert torch.equal(x - x[:, :1], torch.arange(R - 1).expand(200, R - 1))
    assert (y[:, :common.TASK_LEN + 1] == -1).all()
    assert torch.equal(y[:, common.TASK_LEN + 1:], x[:, common.TASK_LEN + 1:] + 1)


# --------------------------------------------------------------------------------------------------
# the dense GPT

def tiny(**kw):
    return common.Config(**{**dict(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=32),
                            **kw})


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gpt_is_causal(mode):
    torch.manual_seed(0)
    model = common.Model(tiny())
    model.train(mode == "train")
    x = torch.randint(0, 50, (2, 24))
    x2 = x.clone()
    x2[:, 16:] = torch.randint(0, 50, (2, 8))
    torch.manual_seed(1); a, _, _ = model(x)
    torch.manual_seed(1); b, _, _ = model(x2)
    assert torch.equal(a[:, :16], b[:, :16]) and not torch.allclose(a[:, 16:], b[:, 16:])


def test_gpt_init_and_tied_embeddings():
    cfg = tiny(n_layer=4)
    model = common.Model(cfg)
    assert model.lm_head.weight is model.wte.weight
    std = model.blocks[0].mlp.c_proj.weight.std().item()
    assert abs(std - 0.02 / (2 * 4) ** 0.5) < 0.003  # GPT-3 residual init
    assert model.wte.padding_idx is None
    x = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    logits, loss, stats = model(x, x.roll(-1, 1))
    assert abs(loss.item() - np.log(50)) < 0.1  # near-uniform predictions at init
    assert stats == {"lm_loss": loss} and not stats["lm_loss"].requires_grad
    assert model(x)[2] == {}  # no targets: no loss to report
    # wte 50·32 + 4 blocks × 12,352 (LayerNorms 2·32, c_attn 32·96, c_proj 32·32, MLP 2·32·128)
    # + ln_f 32; wpe (32·32) is not counted, as in nanoGPT
    assert model.num_params() == 1600 + 4 * 12_352 + 32


@pytest.mark.parametrize("bias", [False, True])
def test_gpt_biases_are_where_config_says_and_never_in_the_head(bias):
    """Config.bias puts a bias in every Linear and LayerNorm of the GPT (GPT-2 has them, which
    --init_from gpt2 loads), but the head tied to wte has none in either case."""
    model = common.Model(tiny(bias=bias))
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.LayerNorm))]
    assert len(layers) == 2 * 6 + 2  # a block: ln_1, c_attn, c_proj, ln_2, c_fc, c_proj
    has = {m: m.bias is not None for m in layers}
    assert has.pop(model.lm_head) is False and set(has.values()) == {bias}


def test_gpt_ffn_gelu_is_exact_or_gpt2s_tanh_as_config_says():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32)
    for gelu in ("none", "tanh"):
        mlp = common.MLP(tiny(gelu=gelu))
        want = mlp.c_proj(F.gelu(mlp.c_fc(x), approximate=gelu))
        assert torch.equal(mlp(x), want)
        assert not torch.allclose(mlp(x), mlp.c_proj(F.gelu(mlp.c_fc(x), approximate={
            "none": "tanh", "tanh": "none"}[gelu])), atol=1e-7, rtol=0)


def test_gpt_dropout_acts_on_attention_and_residuals_in_training_only(monkeypatch):
    """Config.dropout p: in training at the embedding, inside attention (SDPA's dropout_p) and on
    both residual branches of every block; in eval nowhere (p 0 to SDPA, training False)."""
    sdpa, dropout, seen = F.scaled_dot_product_attention, F.dropout, []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, dropout_p=0.0, **kw:
                        seen.append(("attn", dropout_p)) or sdpa(*a, dropout_p=dropout_p, **kw))
    monkeypatch.setattr(F, "dropout", lambda x, p=0.5, training=True, inplace=False:
                        seen.append(("drop", p, training)) or dropout(x, p, training, inplace))
    model, idx = common.Model(tiny(dropout=0.3)), torch.zeros(1, 4, dtype=torch.long)
    for training in (True, False):
        seen.clear()
        model.train(training)(idx)
        block = [("attn", 0.3 if training else 0.0)] + [("drop", 0.3, training)] * 2
        assert seen == [("drop", 0.3, training)] + block * 2, seen


def test_attention_by_value_causal_masked_or_over_every_key():
    """qkv() splits c_attn's output into heads (B, nh, T, hs) channel block by block; attend() is
    softmax(q·kᵀ/√hs + mask)·v per head, merged back to (B, T, C) head after head: causal by
    default, under an additive attn_mask, or over every key with causal=False. By value."""
    torch.manual_seed(0)
    attn = common.CausalSelfAttention(tiny(n_embd=12, n_head=3)).eval()
    x = torch.randn(2, 5, 12)
    q, k, v = attn.qkv(x)
    Q, K, V = attn.c_attn(x).split(12, dim=-1)  # 3 × (B, T, C)
    heads = lambda t: torch.stack([t[..., 4 * h:4 * h + 4] for h in range(3)], 1)
    for got, want in ((q, Q), (k, K), (v, V)):
        assert torch.allclose(got, heads(want), atol=1e-6)
    future = torch.ones(5, 5, dtype=torch.bool).triu(1)
    other = torch.randn(5, 5)
    for kw, add in (({}, torch.zeros(5, 5).masked_fill(future, -math.inf)),
                    (dict(attn_mask=other), other), (dict(causal=False), torch.zeros(5, 5))):
        w = (q @ k.transpose(-2, -1) / 2.0 + add).softmax(-1)  # √hs = 2
        want = torch.cat([(w @ v)[:, h] for h in range(3)], -1)  # (B, T, C)
        assert torch.allclose(attn.attend(q, k, v, **kw), want, atol=1e-5), kw



def test_init_scales_by_value():
    """Every matrix N(0, 0.02²) but the two projections into the residual stream, N(0, (0.02 /
    √(2L))²) (GPT-2/3); biases 0, LayerNorm gains 1: each std within 3% (≥ 16k samples: its own
    error is < 1%), where L = 3 makes 0.02/√(2L) = 0.00816 and 0.02/√(3L) = 0.00667."""
    torch.manual_seed(0)
    model = common.Model(tiny(n_layer=3, n_embd=64, n_head=2, vocab_size=256, block_size=256,
                              bias=True))
    residual = 0.02 / math.sqrt(2 * 3)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            want = residual if name.endswith("c_proj.weight") else 0.02
            assert p.std().item() == pytest.approx(want, rel=0.03), name
            assert abs(p.mean().item()) < 0.1 * want, name
        else:
            want = 0.0 if name.endswith("bias") else 1.0
            assert torch.equal(p, torch.full_like(p, want)), name
    assert sum(n.endswith("c_proj.weight") for n, _ in model.named_parameters()) == 2 * 3

def test_generate_greedy_is_deterministic_and_respects_block_size():
    model = common.Model(tiny(block_size=8)).eval()
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 10, temperature=0)
    assert out.shape == (2, 13) \
        and torch.equal(out, model.generate(torch.zeros(2, 3, dtype=torch.long), 10, 0))
    for training in (True, False):  # sampling runs in eval, and the mode it found is restored
        for use_cache in (True, False):
            model.train(training).generate(torch.zeros(1, 2, dtype=torch.long), 2,
                                           use_cache=use_cache)
            assert model.training is training


def test_block_is_pre_norm_by_value():
    """GPT-2's pre-norm block: x + attn(ln_1(x)), then h + mlp(ln_2(h)) (the norms on the branch
    inputs, never on their outputs or the residual stream)."""
    torch.manual_seed(0)
    block = common.Block(tiny(bias=True)).eval()
    for p in block.parameters():  # gains and biases away from 1 and 0, so a misplaced norm shows
        nn.init.normal_(p, 0.5, 0.5)
    x = torch.randn(2, 5, 32)
    h = x + block.attn(block.ln_1(x))
    assert torch.allclose(block(x), h + block.mlp(block.ln_2(h)), atol=1e-5)
    model = common.Model(tiny(bias=True))  # then the final norm, and the head tied to wte
    nn.init.normal_(model.ln_f.weight, 0.5, 0.5), nn.init.normal_(model.ln_f.bias, 0.5, 0.5)
    want = F.layer_norm(x, (32,), model.ln_f.weight, model.ln_f.bias) @ model.wte.weight.T
    assert torch.allclose(model.head(x)[0], want, atol=1e-5)


def test_config_rejects_impossible_shapes_and_types():
    with pytest.raises(common.NanorouteError, match="not divisible"):
        common.Config(n_embd=100, n_head=3)
    with pytest.raises(common.NanorouteError, match="n_layer must be int"):
        common.Config(n_layer="6")
    with pytest.raises(common.NanorouteError, match="exceeds block_size"):
        common.Model(tiny(block_size=8))(torch.zeros(1, 9, dtype=torch.long))



# every field with a lower bound: (name, the lowest valid value, the highest refused one)
BOUNDS = [(n, 1, 0) for n in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd",
                              "batch_size", "eval_iters", "eval_interval", "log_interval",
                              "shards", "grad_accum")] \
    + [(n, 0, -1) for n in ("max_iters", "warmup_iters", "seed")] \
    + [(n, 0.0, -1e-6) for n in ("weight_decay", "grad_clip", "min_lr", "peak_flops")] \
    + [("eval_seed", -1, -2)]


@pytest.mark.parametrize("name,low,below", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_config_accepts_each_lower_bound_and_refuses_below_it(name, low, below):
    """Each size, count and rate is valid from its bound on (the bound itself included) and
    refused, naming the field and the bound, just below it."""
    kw = dict(n_head=1) if name == "n_embd" else {}
    assert getattr(common.Config(**kw, **{name: low}), name) == low
    says = rf"^{name} must be >= {int(low)}, got {below}$"
    with pytest.raises(common.NanorouteError, match=says):
        common.Config(**kw, **{name: below})


GELU_SAYS = re.escape("gelu must be 'none' (exact) or 'tanh' (GPT-2), got 'relu'")


def test_config_rules_at_their_edges():
    """The other rules, each at the value where it starts and stops holding."""
    C, err = common.Config, common.NanorouteError
    cfg = C(learning_rate=1, min_lr=1)  # an int for a float field is taken as that float
    assert type(cfg.learning_rate) is float and cfg.min_lr == cfg.learning_rate == 1.0
    for name, value, says in [("bias", 1, "bias must be bool, got 1"),
                              ("device", 0, "device must be str, got 0"),
                              ("dropout", True, "dropout must be float, got True"),
                              ("learning_rate", math.inf, "learning_rate must be a finite number"),
                              ("min_lr", math.nan, "min_lr must be a finite number"),
                              ("gelu", "relu", GELU_SAYS),
                              ("device", "cuda:x", "device must be auto, cpu, cuda, cuda:N or mps"),
                              ("learning_rate", 0.0, "learning_rate must be > 0, got 0.0"),
                              ("seed", 2 ** 63, "seed must be < 2\\*\\*63"),
                              ("min_lr", 2e-3 + 1e-9, "min_lr=0.002000001 is above learning_rate")]:
        with pytest.raises(err, match=says):
            C(**{name: value})
    assert C(seed=2 ** 63 - 1, gelu="tanh", device="cuda:1", min_lr=2e-3).seed == 2 ** 63 - 1
    assert C(device="cuda:10").device == "cuda:10"  # a 16-GPU node's eleventh GPU
    # a paper's own fields are type-checked too: the rule is common.Config's, the fields are self's
    import tsa
    with pytest.raises(err, match="^lam must be float, got '0.1'$"):
        tsa.Config(lam="0.1")
    assert type(tsa.Config(lam=1).lam) is float
    assert C(learning_rate=1e-300, min_lr=0.0).learning_rate == 1e-300
    for name in ("beta1", "beta2", "dropout"):
        assert getattr(C(**{name: 0.0}), name) == 0.0 and getattr(C(**{name: 0.99}), name) == 0.99
        for bad in (1.0, -1e-9):
            with pytest.raises(err, match=rf"^{name} must be in \[0, 1\), got {bad}$"):
                C(**{name: bad})
    with pytest.raises(err, match="^n_embd=130 is not divisible by n_head=4$"):
        C(n_embd=130, n_head=4)
    assert C(n_embd=132, n_head=4).n_embd == 132


def test_defaults_and_presets_are_pinned_by_value():
    """The defaults a bare run trains with and each preset's settings, by value (the results
    pages were measured with them): nanoGPT's Shakespeare recipe (AdamW β2 0.99, not torch's
    0.999); --preset paper at TSA's size and dropout 0.2; --preset gpu GPT-3 small's optimiser."""
    c = common.Config()
    assert {f.name: getattr(c, f.name) for f in dataclasses.fields(c)} == dict(
        vocab_size=65, block_size=128, n_layer=6, n_head=6, n_embd=192, dropout=0.0, bias=False,
        gelu="none", max_iters=2250, batch_size=16, grad_accum=1, learning_rate=2e-3, min_lr=1e-4,
        warmup_iters=100, weight_decay=0.1, beta1=0.9, beta2=0.99, grad_clip=1.0,
        eval_interval=750, eval_iters=40, log_interval=50, seed=1337, eval_seed=-1,
        device="auto", compile=False, peak_flops=0.0, out_dir="", data_dir="data", shards=1,
        init_from="", model="gpt", dataset="shakespeare")
    assert common.PAPER == dict(n_layer=6, n_head=8, n_embd=256, block_size=128, batch_size=64,
                                max_iters=5000, learning_rate=1e-3, min_lr=1e-4, beta2=0.95,
                                weight_decay=0.1, dropout=0.2, eval_interval=500)
    assert common.CLASSROOM == dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=16,
                                    max_iters=1500, eval_interval=500, eval_iters=20,
                                    log_interval=100, learning_rate=2e-3, min_lr=1e-4,
                                    warmup_iters=50)
    assert common.GPU == dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, bias=True,
                              gelu="tanh", batch_size=16, grad_accum=32, max_iters=2500,
                              warmup_iters=250, learning_rate=6e-4, min_lr=6e-5, beta2=0.95,
                              weight_decay=0.1, grad_clip=1.0, dropout=0.0, eval_interval=250,
                              eval_iters=20, log_interval=10, compile=True, shards=14)
    assert common.PRESETS == {"classroom": common.CLASSROOM, "paper": common.PAPER,
                              "gpu": common.GPU}

# --------------------------------------------------------------------------------------------------
# accounting

@pytest.mark.parametrize("alpha,saved", [(0.726, 0.228), (0.833, 0.139), (0.341, 0.549)])
def test_tlops_saving_matches_the_tsa_paper(alpha, saved):
    assert round(common.tlops_saving(alpha, 6), 3) == saved
    assert common.tlops_saving(1.0, 6) == 0.0


def test_dense_flops_match_torch_flop_counter():
    """Our per-component formulas must count what the model really multiplies. The counter does not
    see inside CPU SDPA kernels, so attention scores are checked on explicit matmuls (charged for
    the full T×T square; causal attention is charged for the average (T+1)/2 keys)."""
    cfg = tiny(block_size=64, n_embd=64, n_head=4)
    model, B, T, d = common.Model(cfg), 2, 64, cfg.n_embd
    with FlopCounterMode(display=False) as fc:
        model(torch.zeros(B, T, dtype=torch.long))
    scores = cfg.n_layer * B * T * common.flops_attn_scores(d, common.mean_context(T))
    assert fc.get_total_flops() == common.dense_flops_per_token(cfg, T) * B * T - scores
    q = k = v = torch.randn(B, cfg.n_head, T, d // cfg.n_head)
    with FlopCounterMode(display=False) as fc:
        (q @ k.transpose(-2, -1)).softmax(-1) @ v
    assert fc.get_total_flops() == B * T * common.flops_attn_scores(d, T)


# --------------------------------------------------------------------------------------------------
# the learning-rate schedule and AdamW's groups

def cosine_expected(it, cfg):
    """The documented shape, written out: linear warm-up from lr/warmup_iters to the peak, then
    half a cosine from the peak at warmup_iters to min_lr at max_iters, and min_lr from then on."""
    lr, lo, w, n = cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.max_iters
    if it < w:
        return lr * (it + 1) / w
    if it >= n:
        return lo
    return lo + 0.5 * (1 + math.cos(math.pi * (it - w) / (n - w))) * (lr - lo)


@pytest.mark.parametrize("warmup,max_iters", [(10, 100), (1, 7), (0, 50), (4, 5)])
def test_lr_schedule_warms_up_linearly_and_floors_at_min_lr(warmup, max_iters):
    """The warm-up starts at lr/warmup_iters (never 0), grows by the same amount every step and is
    at the peak at warmup_iters; the cosine reaches min_lr exactly at max_iters and stays there
    after it (a run resumed or continued past max_iters must not climb back up the cosine)."""
    cfg = common.Config(learning_rate=1e-3, min_lr=1e-4, warmup_iters=warmup, max_iters=max_iters)
    lrs = [common.lr_at(it, cfg) for it in range(3 * max_iters + 5)]
    assert lrs == pytest.approx([cosine_expected(it, cfg) for it in range(len(lrs))], rel=1e-9,
                                abs=0)
    if warmup:
        assert lrs[0] == pytest.approx(1e-3 / warmup)
        assert np.diff(lrs[:warmup]) == pytest.approx([1e-3 / warmup] * (warmup - 1))
    assert lrs[warmup] == pytest.approx(1e-3) and max(lrs) == pytest.approx(1e-3)
    # only down after the peak
    assert all(b <= a + 1e-15 for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))
    assert lrs[max_iters:] == pytest.approx([1e-4] * (len(lrs) - max_iters), rel=1e-9)


def test_tsa_lr_schedule_restarts_for_the_hard_phase_and_floors_at_min_lr():
    """TSA's own lr_at (what train.py uses for it): the common schedule before the hard phase (and
    all the way with hard_ft_lr=0); with hard_ft_lr a fresh cosine from hard_ft_lr at the phase's
    first step to min_lr at max_iters, and min_lr after it."""
    import tsa
    base = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, learning_rate=1e-3, min_lr=1e-4,
                warmup_iters=5, max_iters=40, hard_ft_iters=10)
    off = tsa.Model(tsa.Config(**base))
    assert [off.lr_at(it) for it in range(100)] == [common.lr_at(it, off.cfg) for it in range(100)]
    model = tsa.Model(tsa.Config(**base, hard_ft_lr=5e-4))
    lrs = [model.lr_at(it) for it in range(100)]
    assert lrs[:30] == [common.lr_at(it, model.cfg) for it in range(30)]
    phase = [1e-4 + 0.5 * (1 + math.cos(math.pi * i / 10)) * (5e-4 - 1e-4) for i in range(10)]
    assert lrs[30:40] == pytest.approx(phase, rel=1e-9) and lrs[30] == pytest.approx(5e-4)
    assert lrs[40:] == pytest.approx([1e-4] * 60, rel=1e-9)


def test_tsa_hard_phase_covering_the_whole_run_starts_at_hard_ft_lr():
    """hard_ft_iters > max_iters means every step is in the hard phase (on_step calibrates at step
    max(start, 0)): the phase's lr then restarts at hard_ft_lr at step 0
    and still ends at min_lr."""
    import tsa
    model = tsa.Model(tsa.Config(n_layer=2, n_head=2, n_embd=16, block_size=8, learning_rate=1e-3,
                                 min_lr=1e-4, warmup_iters=5, max_iters=40, hard_ft_iters=60,
                                 hard_ft_lr=5e-4))
    assert model.lr_at(40) == pytest.approx(1e-4)
    assert model.lr_at(0) == pytest.approx(5e-4)


# Every model, tiny, built from a Config the way train.py builds it (flags as on its command line).
TINY = {"gpt": [], "tsa": [], "dtrnet": ["--n_layer=3"], "conddepth": [], "hybrid": ["--n_layer=4"],
        "mod": []}


def tiny_model(name, *flags):
    # a flag may be given once: these replace the base's
    given = {a.split("=")[0] for a in [*TINY[name], *flags]}
    base = [a for a in ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16"]
            if a.split("=")[0] not in given]
    cfg, module, _ = train.parse_args(["--model", name, *base, *TINY[name], *flags])
    torch.manual_seed(0)
    return (module.build(cfg) if hasattr(module, "build") else module.Model(cfg)), cfg


def decay_policy(model):
    """make_optimizer's documented policy, stated by what a parameter is rather than by its name or
    shape: (ids decayed, ids not decayed, ids the policy does not name). Decayed: the weights of
    Linear and Conv layers (matrices), except the one tied to the token embedding. Not decayed:
    biases, norm gains, embedding tables, and every 1-D parameter (gates, A_log, dt_bias, ...).
    Unnamed: a bare >= 2-D nn.Parameter that is not a layer's weight."""
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices = {id(m.weight) for m in model.modules()
                if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))}
    decay = (matrices - tables) & trainable.keys()
    unnamed = {i for i, p in trainable.items() if i not in decay | tables and p.dim() >= 2}
    return decay, trainable.keys() - decay - unnamed, unnamed


@pytest.mark.parametrize("name,flags", [
    ("gpt", ["--bias=true"]), ("tsa", ["--bias=true"]), ("tsa", ["--variant=early_exit"]),
    ("dtrnet", ["--bias=true"]), ("conddepth", []),
    ("conddepth", ["--controller_only=false", "--gate=G1"]),
    ("hybrid", ["--bias=true"]), ("mod", ["--bias=true", "--predictor=mlp"])],
    ids=lambda v: v if isinstance(v, str) else "-".join(a[2:] for a in v) or "default")
def test_adamw_decays_matrices_only_and_holds_every_trainable_parameter_once(name, flags):
    """Every trainable parameter is in exactly one group (the tied wte/lm_head weight once, frozen
    ones in none); the decayed group is exactly the matrices, at cfg.weight_decay; biases, norms,
    embeddings and 1-D gate parameters are in a group with weight decay 0;
    betas and lr are the Config's."""
    model, cfg = tiny_model(name, *flags)
    opt = common.make_optimizer(model, cfg, torch.device("cpu"))
    # the tied weight is named once, as wte.weight
    names = {id(p): n for n, p in model.named_parameters()}
    held = sorted(names[id(p)] for g in opt.param_groups for p in g["params"])
    # each once, none frozen
    assert held == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert model.lm_head.weight is model.wte.weight
    wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    decay, no_decay, unnamed = decay_policy(model)
    assert decay and no_decay
    assert sorted(names[i] for i in decay if wd[i] != cfg.weight_decay) == []
    assert sorted(names[i] for i in no_decay if wd[i] != 0.0) == []
    assert all(wd[i] in (0.0, cfg.weight_decay) for i in unnamed)
    assert cfg.weight_decay > 0 and opt.defaults["betas"] == (cfg.beta1, cfg.beta2)
    assert all(g["lr"] == cfg.learning_rate for g in opt.param_groups)


def test_adamw_does_not_decay_conddepth_action_embeddings():
    """eq. (12)'s e_a (GateG3.e: one learned row per action) is an embedding table, not a matrix."""
    model, cfg = tiny_model("conddepth", "--gate=G3")
    opt = common.make_optimizer(model, cfg, torch.device("cpu"))
    wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert [wd[id(g.e)] for g in model.gates] == [0.0] * len(model.gates)


def test_adamw_is_fused_on_cuda_only():
    """torch's fused AdamW kernel on CUDA (one launch for every parameter), the default elsewhere;
    the optimizer is built before any step, so a CUDA device is not needed to see the choice."""
    model = common.Model(tiny())
    for device, fused in (("cpu", False), ("cuda", True)):
        assert common.make_optimizer(model, tiny(), torch.device(device)).defaults["fused"] \
            is fused


def test_cond_is_torch_cond_in_a_traced_graph_and_one_branch_in_eager(monkeypatch):
    """Eager: the host reads pred and runs one branch on the operands; compiled: torch.cond gets
    pred, both branches and the operands, in that order."""
    x = torch.tensor([2.0])
    yes, no = (lambda a, b: a + b), (lambda a, b: a - b)
    assert common.cond(torch.tensor(True), yes, no, (x, x)).item() == 4.0
    assert common.cond(torch.tensor(False), yes, no, (x, x)).item() == 0.0
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(torch, "cond", lambda *a: a)
    pred = torch.tensor(True)
    assert common.cond(pred, yes, no, (x,)) == (pred, yes, no, (x,))
    assert common.cond(pred, yes, no) == (pred, yes, no, ())


def test_bpe_that_cannot_load_says_what_to_do(monkeypatch):
    import tiktoken

    def offline(name):
        raise ValueError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(common.NanorouteError) as e:
        common.bpe()
    assert str(e.value) == ("the GPT-2 BPE vocabulary could not be loaded (ValueError): connect "
                            "once, or set TIKTOKEN_CACHE_DIR to a folder that holds tiktoken's "
                            "r50k_base file")


# --------------------------------------------------------------------------------------------------
# evaluation

def test_eval_batches_are_fixed_and_differ_by_split_and_index():
    """eval_rng(seed, split, k) gives the same k-th batch in every run, a different batch for
    every k, and train and val batches drawn differently
    (the same windows in both would correlate the two numbers)."""
    data, meta = np.arange(5000, dtype=np.uint16), {"dataset": "shakespeare"}
    batch = lambda seed, split, k: common.get_batch(data, meta, 4, 16,
                                                    common.eval_rng(seed, split, k))[0]
    assert torch.equal(batch(3, "val", 1), batch(3, "val", 1))
    for split, i in (("train", 1), ("val", 2), ("test", 3)):  # the batches results/ measured on
        assert common.eval_rng(3, split, 4).integers(1 << 30) \
            == np.random.default_rng([3, i, 4]).integers(1 << 30)
    xs = [batch(3, split, k) for split in ("train", "val", "test") for k in range(3)] \
        + [batch(4, "val", 0)]
    assert all(not torch.equal(a, b) for i, a in enumerate(xs) for b in xs[i + 1:])


@pytest.mark.parametrize("name,flags",
                         [(n, []) for n in TINY] + [("tsa", ["--variant=early_exit"])])
def test_decode_state_is_a_tuple_whose_tensors_a_step_keeps_or_replaces(name, flags):
    """generate(compile=True) on CUDA copies a step's new state tensors out of the CUDA graph's pool
    and keeps those at the addresses prefill gave (caches, masks): it walks the state as a tuple,
    for every model."""
    model, cfg = tiny_model(name, *flags)
    idx = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, state = model.eval().prefill(idx)
        _, new = model.step(idx[:, -1:], state)
    assert isinstance(state, tuple) and isinstance(new, tuple) and len(new) == len(state)
    # the position (early exit: its window), which a step replaces
    assert any(torch.is_tensor(t) for t in new)


@pytest.mark.parametrize("name,flags",
                         [(n, []) for n in TINY] + [("tsa", ["--variant=early_exit"])])
def test_dropout_acts_in_training_only(name, flags, monkeypatch):
    """Residual and embedding dropout acts in training when p > 0, at least once per layer and at
    the embedding; in eval it is the identity: the same weights with p = 0.5 and 0 give equal eval
    logits (attention's own dropout is off in eval too),
    and p = 0 in training changes nothing either."""
    calls, f_dropout = [], F.dropout
    monkeypatch.setattr(F, "dropout", lambda x, *a, **kw: calls.append(1) or f_dropout(x, *a, **kw))
    idx = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for p in (0.5, 0.0):
        model, cfg = tiny_model(name, *flags, f"--dropout={p}")
        for mode in ("eval", "train"):
            calls.clear()
            logits[p, mode] = model.train(mode == "train")(idx)[0]
            if (p, mode) == (0.5, "train"):
                assert len(calls) >= cfg.n_layer + 1, len(calls)
    assert torch.equal(logits[0.5, "eval"], logits[0.0, "eval"])
    assert not torch.equal(logits[0.5, "train"], logits[0.5, "eval"])


def aligned_16_bytes(t):
    """Where a view starts and every step between its rows (dims of size 1 aside)
    fall on 16 bytes."""
    n = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * n % 16 == 0
                                          for s, d in zip(t.stride()[:-1], t.shape[:-1]) if d > 1)


@pytest.mark.parametrize("name,flags",
                         [(n, []) for n in TINY] + [("tsa", ["--variant=early_exit"])])
def test_attention_inputs_are_16_byte_aligned(name, flags, monkeypatch):
    """CUDA's memory-efficient and cuDNN attention choose a kernel from strides and head size but
    not from where a view starts (pytorch/pytorch#183484): a q, k or v that is a view at an offset
    off 16 bytes crashes them ('misaligned address'; it did on an H200 in the hybrid's decode step).
    Every SDPA call a model makes — training, eval and sparse forwards, prefill and B=2 decode
    steps, in CPU bf16 autocast — gets aligned q, k, v."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kw):
        seen.append((q, k, v))
        return sdpa(q, k, v, *args, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model, cfg = tiny_model(name, *flags)
    idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model.train()(idx)
        model.eval()(idx)
        model(idx, sparse=True)
        _, state = model.prefill(idx[:, :8])
        for t in range(8, 12):
            _, state = model.step(idx[:, t:t + 1], state)
    assert seen
    bad = [(i, j, t.dtype, t.shape, t.stride(), t.storage_offset()) for i, qkv in enumerate(seen)
           for j, t in enumerate(qkv) if not aligned_16_bytes(t)]
    assert not bad, (f"{len(bad)} of {3 * len(seen)} SDPA inputs off 16 bytes (call, q|k|v, ...): "
                     f"{bad[:3]}")


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("kind", ["chars", "records"])
def test_estimate_loss_is_the_mean_over_eval_iters_fixed_batches(name, kind):
    """The reported loss is the cross-entropy of the eval-mode (hard) logits averaged over exactly
    cfg.eval_iters batches k = 0..eval_iters−1 drawn with eval_rng(eval seed, split, k) (eval_seed,
    or seed when it is -1); accuracy counts only scored targets; every routing stat is averaged the
    same way; bpc is the loss in bits; the model's training mode is restored. Checked against a
    direct computation."""
    model, cfg = tiny_model(name, "--block_size=22", "--batch_size=3", "--eval_iters=3", "--seed=5")
    if kind == "chars":
        meta, data = ({"dataset": "shakespeare", "unit": "char"},
                      np.random.default_rng(0).integers(0, 65, 400))
    else:
        meta = {"dataset": "copy", "record_len": 23, "unit": "token"}
        data = np.random.default_rng(0).integers(0, 35, 23 * 30)
    data = data.astype(np.uint16)
    for eval_seed, used in ((-1, 5), (0, 0)):
        cfg_e = dataclasses.replace(cfg, eval_seed=eval_seed)
        for split in ("train", "val"):
            model.train()
            got = common.estimate_loss(model, data, meta, cfg_e, torch.device("cpu"), split)
            assert model.training
            model.eval()
            per = []
            with torch.no_grad():
                for k in range(cfg.eval_iters):
                    rng = common.eval_rng(used, split, k)
                    x, y = common.get_batch(data, meta, cfg.batch_size, cfg.block_size, rng)
                    logits, _, stats = model(x, y)
                    scored = y >= 0
                    per.append({**{n: v.item() for n, v in stats.items() if n != "lm_loss"},
                                "loss": F.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                                        ignore_index=-1).item(),
                                "acc": (logits.argmax(-1) == y)[scored].float().mean().item()})
            want = {n: float(np.mean([p[n] for p in per])) for n in per[0]}
            if kind == "chars":
                want["bpc"] = want["loss"] / math.log(2)
            assert sorted(got) == sorted(want)
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (split, eval_seed)


@pytest.mark.parametrize("unit,bpc", [("char", True), ("byte", True), ("token", False)])
def test_estimate_loss_gives_bits_per_character_or_byte_and_none_per_token(unit, bpc):
    """bpc = loss / ln 2 for the character (shakespeare) and byte (enwik8) datasets; a loss over
    BPE tokens or task symbols is not per character and gets none."""
    model, cfg = tiny_model("gpt", "--block_size=8", "--batch_size=2", "--eval_iters=1")
    data = np.random.default_rng(0).integers(0, 65, 100).astype(np.uint16)
    got = common.estimate_loss(model, data, {"dataset": "x", "unit": unit}, cfg,
                               torch.device("cpu"))
    assert ("bpc" in got) is bpc
    assert got.get("bpc", got["loss"] / math.log(2)) == pytest.approx(got["loss"] / math.log(2))


# --------------------------------------------------------------------------------------------------
# checkpoints, resume and the CLI

def run(argv, data_dir, out_dir, **extra):
    base = ["--model=gpt", "--dataset=shakespeare", f"--data_dir={data_dir}",
            f"--out_dir={out_dir}", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32",
            "--batch_size=4", "--eval_iters=2", "--eval_interval=5", "--log_interval=1",
            "--max_iters=20", "--warmup_iters=4", "--dropout=0.1"]
    given = {a.split("=")[0] for a in argv}  # a flag may be given once: argv's replace the base's
    return train.main([a for a in base if a.split("=")[0] not in given] + argv)


def records(out_dir):
    return [{k: v for k, v in r.items() if k not in train.TIMING}
            for r in map(json.loads, open(out_dir / "metrics.jsonl"))]


@pytest.mark.parametrize("edit,says", [
    (lambda m: [], "is a JSON list, not an object"),
    (lambda m: dict(m, dataset="enwik8"), "names the dataset 'enwik8'"),
    (lambda m: dict(m, vocab_size="65"), "has vocab_size '65'"),
    (lambda m: dict(m, val_tokens=-1), "has val_tokens -1"),
    (lambda m: {k: v for k, v in m.items() if k != "itos"}, "lacks an itos of 65 characters"),
    (lambda m: dict(m, itos=m["itos"][:40], vocab_size=40), "holds token id 64, beyond"),
], ids=["list", "other dataset", "string vocab", "negative count", "no itos", "ids beyond vocab"])
def test_a_datasets_meta_json_is_checked_before_use(data_dir, tmp_path, edit, says):
    shutil.copytree(data_dir, tmp_path / "data")
    common.prepare("shakespeare", str(tmp_path / "data"))
    path = tmp_path / "data" / "shakespeare" / "meta.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(common.NanorouteError, match=f"{says}.*; delete "):
        common.prepare("shakespeare", str(tmp_path / "data"))



GOOD_META = {
    "shakespeare": dict(vocab_size=3, itos=["\n", "a", "b"]),
    "shakespeare_bpe": dict(vocab_size=50257, encoding="r50k_base"),
    "fineweb_edu": dict(vocab_size=50257, encoding="r50k_base", shards={"train": [], "val": []}),
    "enwik8": dict(vocab_size=256, test_tokens=0),
    "copy": dict(vocab_size=35, record_len=23),
    "sort": dict(vocab_size=35, record_len=23)}


@pytest.mark.parametrize("name,edit,says", [
    ("shakespeare", dict(vocab_size=0), "has vocab_size 0"),
    ("shakespeare", dict(vocab_size=True), "has vocab_size True"),
    ("enwik8", dict(vocab_size=1 << 16), "lacks vocab_size 256 (bytes)"),  # 2**16 ids fit uint16
    ("enwik8", dict(vocab_size=(1 << 16) + 1), "has vocab_size 65537"),
    ("enwik8", dict(vocab_size=1), "lacks vocab_size 256 (bytes)"),
    ("enwik8", dict(test_tokens=2.0), "has test_tokens 2.0"),
    ("enwik8", dict(train_tokens=None), "has train_tokens None"),
    ("enwik8", dict(val_tokens=-1, train_tokens=-1), "has train_tokens -1"),
    ("enwik8", dict(train_tokens=False), "has train_tokens False"),
    ("shakespeare", dict(itos=["\n", "a"]), "lacks an itos of 3 characters"),
    ("shakespeare", dict(itos=["\n", "a", "bc"]), "lacks an itos of 3 characters"),
    ("shakespeare", dict(itos=["\n", "a", 98]), "lacks an itos of 3 characters"),
    ("shakespeare", dict(itos="\nab"), "lacks an itos of 3 characters"),
    ("shakespeare_bpe", dict(encoding="gpt2"), "lacks encoding r50k_base and vocab_size 50257"),
    ("shakespeare_bpe", dict(vocab_size=50256), "lacks encoding r50k_base and vocab_size 50257"),
    ("fineweb_edu", dict(shards=["a.bin"]), "lacks encoding r50k_base, vocab_size 50257 and its"),
    ("fineweb_edu", dict(encoding="cl100k_base"), "lacks encoding r50k_base, vocab_size 50257"),
    ("fineweb_edu", dict(vocab_size=50256), "lacks encoding r50k_base, vocab_size 50257"),
    ("copy", dict(record_len=22), "lacks record_len 23 and vocab_size 35"),
    ("sort", dict(vocab_size=34), "lacks record_len 23 and vocab_size 35"),
])
def test_meta_problem_names_each_broken_rule(name, edit, says):
    """meta_problem's rules one at a time, each against a meta.json that passes every other one
    (every dataset's good meta passes; train_tokens and val_tokens are required, >= 0 ints)."""
    good = lambda n: {"dataset": n, "train_tokens": 10, "val_tokens": 0, **GOOD_META[n]}
    assert [common.meta_problem(good(n), n) for n in GOOD_META] == [None] * len(GOOD_META)
    assert common.meta_problem(good(name) | edit, name) == says \
        or common.meta_problem(good(name) | edit, name).startswith(says)
    for key in ("train_tokens", "val_tokens"):
        meta = {k: v for k, v in good(name).items() if k != key}
        assert common.meta_problem(meta, name) == f"has no {key}"


def split_on_disk(tmp_path, tokens, want):
    """data/shakespeare with a train.bin of `tokens` (uint16) and a meta.json that says `want`
    train tokens."""
    d = tmp_path / "shakespeare"
    os.makedirs(d, exist_ok=True)
    np.asarray(tokens, dtype=np.uint16).tofile(d / "train.bin")
    meta = {"dataset": "shakespeare", "vocab_size": 3, "itos": ["\n", "a", "b"], "val_tokens": 2,
            "train_tokens": want}
    (d / "meta.json").write_text(json.dumps(meta))
    return str(d / "train.bin")


@pytest.mark.parametrize("tokens,want,says", [
    ([1, 2, 0], 4, "has 6 bytes, but .* says 4 uint16 tokens"),  # a truncated copy
    ([1, 2, 0, 1, 1], 4, "has 10 bytes, but .* says 4 uint16 tokens"),  # a longer one
    ([1], 1, "has 2 bytes, but .* says 1 uint16 tokens"),  # no window: an input and a target
    ([2, 3], 2, "holds token id 3, beyond .* vocab_size 3"),
])
def test_a_split_that_is_not_what_meta_json_says_is_refused(tmp_path, tokens, want, says):
    """load_split checks a split's byte count against meta.json's token count, that it holds
    an input and a target, and that no token id is beyond the vocabulary, naming both files."""
    path = split_on_disk(tmp_path, tokens, want)
    meta = re.escape(str(tmp_path / "shakespeare" / "meta.json"))
    with pytest.raises(common.NanorouteError, match=f"^{re.escape(path)} {says}"):
        common.load_split("shakespeare", "train", str(tmp_path))
    with pytest.raises(common.NanorouteError, match=f"{meta}.*: the preparation is damaged; "
                       f"delete {meta} and run again to re-prepare$"):
        common.load_split("shakespeare", "train", str(tmp_path))
    good = split_on_disk(tmp_path, [0, 2], 2)  # the smallest split there is, ids up to V - 1
    split = common.load_split("shakespeare", "train", str(tmp_path))
    assert split.tolist() == [0, 2] and not split.flags.writeable  # mapped read-only
    assert good == path


def test_a_token_beyond_the_vocabulary_is_found_wherever_it_lies(tmp_path):
    """load_split reads every token of a split, not a prefix: one bad id at the very end of a
    2M-token file is refused."""
    tokens = np.zeros(2_000_000, dtype=np.uint16)
    tokens[-1] = 3
    path = split_on_disk(tmp_path, tokens, len(tokens))
    with pytest.raises(common.NanorouteError, match=f"^{re.escape(path)} holds token id 3"):
        common.load_split("shakespeare", "train", str(tmp_path))


def test_a_missing_or_unreadable_meta_json_is_one_line_saying_what_to_do(tmp_path):
    path = tmp_path / "copy" / "meta.json"
    for write, why in ((None, "FileNotFoundError"), ("{not json", "JSONDecodeError")):
        if write is not None:
            os.makedirs(path.parent, exist_ok=True)
            path.write_text(write)
        with pytest.raises(common.NanorouteError) as e:
            common.load_meta("copy", str(tmp_path))
        assert str(e.value) == (f"{path} is missing or corrupt ({why}): delete it if it is there "
                                "and run train.py --dataset copy to prepare the data again")
    path.write_text(json.dumps({"dataset": "copy", "vocab_size": 35}))
    with pytest.raises(common.NanorouteError) as e:
        common.load_meta("copy", str(tmp_path))
    assert str(e.value) == (f"{path} has no train_tokens: it is not what prepare() writes for "
                            "copy; delete it and run train.py --dataset copy to prepare the data "
                            "again")
    assert common.meta_problem([], "copy") == "is a JSON list, not an object"
    assert common.meta_problem({"dataset": "sort"}, "copy") == "names the dataset 'sort'"


def test_a_missing_split_or_split_size_is_refused(tmp_path):
    path = split_on_disk(tmp_path, [1, 2], 2)
    test = path.replace("train.bin", "test.bin")
    shutil.copy(path, test)  # a split that meta.json does not name
    with pytest.raises(common.NanorouteError, match=f"{re.escape(test)} has 4 bytes, but .*"
                       "meta.json says no test split: the preparation is damaged; delete"):
        common.load_split("shakespeare", "test", str(tmp_path))
    os.remove(path)
    with pytest.raises(common.NanorouteError, match=f"{re.escape(path)} is missing, but .*"
                       "says 2 uint16 tokens"):
        common.load_split("shakespeare", "train", str(tmp_path))
    os.makedirs(path)  # a directory in the file's place
    with pytest.raises(common.NanorouteError, match="is missing"):
        common.load_split("shakespeare", "train", str(tmp_path))

def test_killed_run_resumes_exactly(data_dir, tmp_path):
    run([], data_dir, tmp_path / "a")
    with killed_at(13):  # the process dies in the middle of step 13, after the checkpoint at 10
        run([], data_dir, tmp_path / "b")
    assert len(records(tmp_path / "b")) < len(records(tmp_path / "a"))
    run(["--resume"], data_dir, tmp_path / "b")
    # dropout RNG, data order, optimizer: all exact
    assert records(tmp_path / "a") == records(tmp_path / "b")
    ckpt = common.load_checkpoint(str(tmp_path / "b" / "ckpt.pt"))
    assert ckpt["iter"] == 20 and ckpt["config"]["n_embd"] == 32
    assert not [f for f in os.listdir(tmp_path / "b") if f.endswith(".tmp")]


def test_resume_errors_are_one_line(data_dir, tmp_path, capsys):
    run(["--max_iters=5"], data_dir, tmp_path)
    with pytest.raises(SystemExit):
        run(["--resume", "--n_embd=64"], data_dir, tmp_path)
    assert "--n_embd asks for n_embd=64 but" in capsys.readouterr().err
    (tmp_path / "ckpt.pt").write_bytes(b"garbage")
    with pytest.raises(SystemExit):
        run(["--resume"], data_dir, tmp_path)
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint") and "corrupt" in err and err.count("\n") == 1


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_non_finite_loss_stops_with_the_step(bad, data_dir, tmp_path, monkeypatch, capsys):
    forward = common.Model.forward

    def poisoned(self, idx, targets=None, sparse=False):
        logits, loss, stats = forward(self, idx, targets, sparse)
        return logits, loss * (float(bad) if self.training else 1.0), stats
    monkeypatch.setattr(common.Model, "forward", poisoned)
    with pytest.raises(SystemExit):
        run([], data_dir, tmp_path)
    assert capsys.readouterr().err == (f"error: loss became {bad} at step 0; lower "
                                       "--learning_rate or check the data\n")


def interrupted_save(cut):
    """A torch.save that writes only the first `cut` bytes of what it was given (None: all of them),
    then fails: a crash, a full disk or a kill at any point of a checkpoint write."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        buf = io.BytesIO()
        real(obj, buf, *args, **kwargs)
        data = buf.getvalue()[:cut]
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as fh:
                fh.write(data)
        else:
            f.write(data)
        raise OSError(28, "No space left on device")
    return save


@pytest.mark.parametrize("cut", [0, 1, 100, -1, None],
                         ids=["nothing", "1B", "100B", "all-but-1B", "all"])
def test_interrupted_checkpoint_write_leaves_the_previous_one(tmp_path, monkeypatch, cut):
    """save_checkpoint is atomic: a write that dies at any byte leaves the previous ckpt.pt loadable
    and equal to what it was, no new *.pt file that --resume or --sample could pick up, and a first
    checkpoint that dies leaves no ckpt.pt at all; the next save then succeeds and leaves no
    temporary file."""
    path, fresh = str(tmp_path / "run" / "ckpt.pt"), str(tmp_path / "run" / "best.pt")
    old = dict(model={"w": torch.arange(3000.0)}, config={"n_embd": 32}, iter=10, best_val_loss=1.5)
    new = dict(model={"w": -torch.arange(3000.0)}, config={"n_embd": 32}, iter=15,
               best_val_loss=1.25)
    common.save_checkpoint(path, **old)
    with monkeypatch.context() as m:
        m.setattr(torch, "save", interrupted_save(cut))
        for p in (path, fresh):
            with pytest.raises(OSError):
                common.save_checkpoint(p, **new)
    ckpt = common.load_checkpoint(path)
    assert ckpt["iter"] == 10 and torch.equal(ckpt["model"]["w"], old["model"]["w"])
    assert [f for f in os.listdir(tmp_path / "run") if f.endswith(".pt")] == ["ckpt.pt"]
    with pytest.raises(common.NanorouteError, match="not found"):
        common.load_checkpoint(fresh)
    common.save_checkpoint(path, **new)
    assert common.load_checkpoint(path)["iter"] == 15
    common.save_checkpoint(fresh, **new)
    assert sorted(os.listdir(tmp_path / "run")) == ["best.pt", "ckpt.pt"]



class StopsAt:
    """A file whose n-th write raises exc: a Ctrl-C or a kill arriving in the middle of a write."""
    def __init__(self, f, n, exc):
        self.f, self.n, self.exc = f, n, exc

    def write(self, b):
        self.n -= 1
        if self.n == 0:
            raise self.exc
        return self.f.write(b)

    def flush(self):
        self.f.flush()


def test_atomic_write_replaces_whole_or_keeps_the_old_file_and_names_it(tmp_path, monkeypatch):
    """atomic_write makes the folders, replaces the file only whole, and on any failure (an
    exception of the writer, a kill) removes its temporary and keeps the old file; an OSError,
    raised or wrapped (torch.save's RuntimeError), comes back with its errno, naming the path."""
    path = str(tmp_path / "a" / "b" / "f.bin")
    common.atomic_write(path, lambda f: f.write(b"old"))
    common.atomic_write(path, lambda f: f.write(b"new"))
    assert open(path, "rb").read() == b"new" and os.listdir(tmp_path / "a" / "b") == ["f.bin"]

    def fails(exc):
        def write(f):
            f.write(b"part")
            raise exc
        return write

    def wrapped(f):
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter")
    for exc, want in [(ValueError("bad"), ValueError), (KeyboardInterrupt(), KeyboardInterrupt),
                      (OSError(28, "No space left on device"), OSError), (None, OSError),
                      (OSError("no strerror"), OSError)]:
        with pytest.raises(want) as e:
            common.atomic_write(path, fails(exc) if exc is not None else wrapped)
        assert open(path, "rb").read() == b"new" and os.listdir(tmp_path / "a" / "b") == ["f.bin"]
        if want is OSError:
            assert e.value.filename == path
            assert (e.value.errno, e.value.strerror) in [(28, "No space left on device"),
                                                         (None, "no strerror")]
        else:
            assert e.value is exc
    for exc in (KeyboardInterrupt(), SystemExit(1)):  # torch.save's writer replaces an interrupt
        with pytest.raises(type(exc)) as e:
            common.atomic_write(path, lambda f: torch.save(torch.zeros(999), StopsAt(f, 3, exc)))
        assert e.value is exc and os.listdir(tmp_path / "a" / "b") == ["f.bin"]
    monkeypatch.chdir(tmp_path)  # a bare file name: the current folder
    common.atomic_write("g.bin", lambda f: f.write(b"g"))
    assert open(tmp_path / "g.bin", "rb").read() == b"g"
    assert sorted(os.listdir(tmp_path)) == ["a", "g.bin"]  # and no folder made for it

def test_empty_checkpoint_is_a_one_line_error(tmp_path):
    """A zero-byte checkpoint (what a crash leaves behind a writer that is not atomic, or a full
    disk) is reported like any other corrupt checkpoint."""
    (tmp_path / "ckpt.pt").write_bytes(b"")
    with pytest.raises(common.NanorouteError) as e:
        common.load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert str(e.value).endswith("ckpt.pt is corrupt or not a nanoroute checkpoint (EOFError)")



def test_a_checkpoint_that_is_not_weights_only_or_not_ours_is_refused(tmp_path):
    """load_checkpoint reads with weights_only=True: a crafted file holding a pickled object is
    refused as such (never loaded with weights_only=False); a file that is not a checkpoint says
    torch's reason in at most 120 characters (not its advice to turn weights_only off); a dict
    without a model and a config dict is not ours; a directory is named as one."""
    import fractions
    path = str(tmp_path / "ckpt.pt")
    torch.save({"model": {}, "config": {}, "obj": fractions.Fraction(1, 3)}, path)
    with pytest.raises(common.NanorouteError) as e:
        common.load_checkpoint(path)
    assert str(e.value) == (f"checkpoint {path} is not weights-only: it holds pickled objects, "
                            "whose loading can run any code, so it is refused (nanoroute's "
                            "checkpoints hold tensors and plain values)")
    torch.save({"model": {"w": torch.ones(2)}, "config": {"n_embd": 2}}, path)
    whole = open(path, "rb").read()
    seen, load = [], torch.load
    with pytest.MonkeyPatch.context() as m:  # a GPU's checkpoint must load on a CPU-only machine
        m.setattr(torch, "load", lambda *a, **kw: seen.append(kw) or load(*a, **kw))
        assert common.load_checkpoint(path)["config"] == {"n_embd": 2}
    assert seen == [{"map_location": "cpu", "weights_only": True}]
    open(path, "wb").write(whole[:len(whole) // 2])  # a truncated zip: torch says why, long
    with pytest.raises(RuntimeError) as torch_says:
        torch.load(path, weights_only=True)
    why = str(torch_says.value).splitlines()[0]
    assert len(why) > 120
    with pytest.raises(common.NanorouteError) as e:
        common.load_checkpoint(path)
    assert str(e.value) == (f"checkpoint {path} is corrupt or not a nanoroute checkpoint "
                            f"(RuntimeError: {why[:120]})")
    open(path, "wb").write(b"garbage")  # torch's message here advises weights_only=False
    with pytest.raises(common.NanorouteError) as e:
        common.load_checkpoint(path)
    assert str(e.value).endswith("is corrupt or not a nanoroute checkpoint (UnpicklingError)")
    for bad in ([1, 2], {"config": {}}, {"model": {}, "config": [1]}, {"model": {}}):
        torch.save(bad, path)
        with pytest.raises(common.NanorouteError, match="has no model/config: not a nanoroute"):
            common.load_checkpoint(path)
    with pytest.raises(common.NanorouteError, match=rf"^checkpoint {re.escape(str(tmp_path))} "
                       r"not found \(a directory\)$"):
        common.load_checkpoint(str(tmp_path))
    with pytest.raises(common.NanorouteError, match=r"^checkpoint .*nope.pt not found$"):
        common.load_checkpoint(str(tmp_path / "nope.pt"))

def grad_norms_at_step(monkeypatch):
    """Spy on train.py's optimizer: the L2 norm of the gradients
    each optimizer.step() really steps with."""
    seen, real = [], common.make_optimizer

    def spy(model, cfg, device):
        opt = real(model, cfg, device)

        def pre_step(o, args, kwargs):
            grads = [p.grad.flatten() for g in o.param_groups for p in g["params"]
                     if p.grad is not None]
            seen.append(torch.cat(grads).norm().item())
        opt.register_step_pre_hook(pre_step)
        return opt
    monkeypatch.setattr(common, "make_optimizer", spy)
    return seen


def test_grad_clip_is_applied_to_the_step(data_dir, tmp_path, monkeypatch):
    """With grad_clip the optimizer steps with the gradient rescaled to norm grad_clip whenever the
    logged (pre-clipping) norm is above it;
    with grad_clip=0 it steps with the logged, unclipped gradient."""
    monkeypatch.setattr(train, "summary", lambda *a: None)  # the loop is what is tested here
    seen = grad_norms_at_step(monkeypatch)
    run(["--grad_clip=0.02", "--max_iters=6", "--dropout=0"], data_dir, tmp_path / "clip")
    logged = [r["grad_norm"] for r in records(tmp_path / "clip") if r["kind"] == "train"]
    assert len(logged) == len(seen) == 6 and min(logged) > 0.1  # every step is clipped
    assert seen == pytest.approx([0.02] * 6, rel=1e-4)
    seen.clear()
    run(["--grad_clip=0", "--max_iters=6", "--dropout=0"], data_dir, tmp_path / "off")
    logged = [r["grad_norm"] for r in records(tmp_path / "off") if r["kind"] == "train"]
    assert seen == pytest.approx(logged, rel=1e-4) and min(logged) > 0.1


def test_best_checkpoint_survives_resume(data_dir, tmp_path, monkeypatch):
    """best.pt holds the best val loss so far across a kill and --resume: the resumed run starts
    from the best val the checkpoint recorded (not from +inf, nor from the last eval's val), so a
    later eval that is worse than the best never replaces best.pt; a better one still does. Val
    losses are scripted."""
    vals = iter([30.0, 10.0, 20.0,  # first run: steps 0, 5, 10 (best at 5), killed at 13
                 15.0, 12.0,        # resumed: steps 15, 20, both worse than the best
                 5.0])              # continued to 25: better
    monkeypatch.setattr(common, "estimate_loss",
                        lambda model, data, meta, cfg, device, split="val", sparse=False:
                        {"loss": 9.0} if split == "train" else {"loss": next(vals)})
    monkeypatch.setattr(train, "summary", lambda *a: None)
    with killed_at(13):
        run([], data_dir, tmp_path)
    best = lambda: common.load_checkpoint(str(tmp_path / "best.pt"))
    assert (best()["iter"], best()["val_loss"]) == (5, 10.0)
    assert run(["--resume"], data_dir, tmp_path) == 10.0
    assert (best()["iter"], best()["val_loss"]) == (5, 10.0)
    assert common.load_checkpoint(str(tmp_path / "ckpt.pt"))["best_val_loss"] == 10.0
    assert run(["--resume", "--max_iters=25"], data_dir, tmp_path) == 5.0
    assert (best()["iter"], best()["val_loss"]) == (25, 5.0)


@pytest.mark.parametrize("model", ["gpt", "tsa"])
def test_train_steps_at_the_models_lr_schedule(model, data_dir, tmp_path, monkeypatch):
    """Every step trains at the schedule's lr for that very step (TSA: its own lr_at, the hard
    phase's restart included), in every param group, not only in the logged number."""
    monkeypatch.setattr(train, "summary", lambda *a: None)
    extra = ["--hard_ft_iters=4", "--hard_ft_lr=1e-3"] if model == "tsa" else []
    run([f"--model={model}", "--max_iters=12", "--eval_interval=6", "--learning_rate=2e-3", *extra],
        data_dir, tmp_path)
    saved = json.load(open(tmp_path / "config.json"))
    module = __import__(train.MODELS[model])
    cfg = module.Config(**saved)
    net = module.Model(cfg)
    sched = net.lr_at if hasattr(net, "lr_at") else (lambda it: common.lr_at(it, cfg))
    lrs = {r["step"]: r["lr"] for r in records(tmp_path) if r["kind"] == "train"}
    assert sorted(lrs) == list(range(12))
    assert [lrs[it] for it in range(12)] == pytest.approx([sched(it) for it in range(12)], rel=1e-9)
    # warm-up 4 (run's default)
    assert lrs[0] == pytest.approx(2e-3 / 4) and lrs[4] == pytest.approx(2e-3)
    if model == "tsa":
        assert lrs[8] == pytest.approx(1e-3)  # the hard phase's restart at hard_ft_lr
    groups = common.load_checkpoint(str(tmp_path / "ckpt.pt"))["optimizer"]["param_groups"]
    assert len(groups) == 2 \
        and [g["lr"] for g in groups] == pytest.approx([sched(11)] * 2, rel=1e-9)


@pytest.mark.parametrize("argv,message", [
    (["--model", "bert"], "unknown model 'bert'"),
    (["--dataset", "imdb"], "unknown dataset 'imdb'"),
    (["--n_layers=3"], "unknown option --n_layers; valid: --model, --dataset"),
    (["--max_iters=ten"], "--max_iters expects int, got 'ten'"),
    (["--learning_rate", "fast"], "--learning_rate expects float"),
    (["--n_head=5"], "n_embd=32 is not divisible by n_head=5"),
    (["--preset", "laptop"], "unknown preset 'laptop' for --model gpt"),
    (["stray"], "unexpected argument 'stray'"),
    (["--device=tpu"], "device must be auto, cpu, cuda, cuda:N or mps, got 'tpu'"),
])
def test_cli_bad_input_is_one_line(argv, message, data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run(argv, data_dir, tmp_path)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1 \
        and err.startswith("error: ")


def test_cli_end_to_end_subprocess(data_dir, tmp_path):
    out = subprocess.run([sys.executable, "train.py", "--model=gpt", f"--data_dir={data_dir}",
                          f"--out_dir={tmp_path}", "--n_layer=1", "--n_embd=32", "--n_head=2",
                          "--max_iters=3", "--eval_iters=1", "--compile=false"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "step 3: train loss" in out.stdout and "sample:" in out.stdout
    assert json.load(open(tmp_path / "config.json"))["n_layer"] == 1
    bad = subprocess.run([sys.executable, "train.py", "--model=nope"], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: unknown model 'nope'; choose one of gpt, tsa, dtrnet, conddepth, hybrid, mod")


@pytest.mark.parametrize("model", ["gpt", "tsa", "dtrnet", "conddepth", "hybrid", "mod"])
def test_compile_trains_every_model_like_eager(model, data_dir, tmp_path):
    """--compile=true runs train.py end to end (train steps, a mode switch, evals, the summary's
    sparse pass) and gives eager's losses: a compile that breaks or changes a model fails here. What
    is supported where: every model on CPU and MPS; on CUDA every model but DTRNet, which refuses
    --compile there with a one-line error that says why (its module's COMPILE_REFUSED)."""
    device = common.pick_device("auto").type  # what train.py picks on this machine
    refused = getattr(importlib.import_module(train.MODELS[model]), "COMPILE_REFUSED",
                      {}).get(device)
    # the fewest layers that still route (a cold compile's time grows with the layers traced)
    layers = {"dtrnet": ["--n_layer=3"], "hybrid": ["--n_layer=2", "--pattern=G R"],
              "tsa": ["--n_layer=2", "--hard_ft_iters=2"]}.get(model, ["--n_layer=2"])
    argv = [f"--model={model}", f"--data_dir={data_dir}", *layers, "--n_embd=32", "--n_head=2",
            "--block_size=32", "--batch_size=4", "--max_iters=4", "--eval_interval=2",
            "--eval_iters=1"]
    out = subprocess.run([sys.executable, "train.py", *argv, f"--out_dir={tmp_path / 'c'}",
                          "--compile=true"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # as a user starts it
    if refused:
        assert out.returncode == 2 and out.stderr.strip() == (
            f"error: --compile is refused for --model {model} on {device}: {refused}")
        return
    assert out.returncode == 0, out.stderr[-2000:]
    train.main(argv + [f"--out_dir={tmp_path / 'e'}", "--compile=false"])  # eager: in this process
    evals = {c: [r["val_loss"] for r in map(json.loads, open(tmp_path / c / "metrics.jsonl"))
                 if r["kind"] == "eval"] for c in "ce"}
    assert len(evals["c"]) == 3 and evals["c"] == pytest.approx(evals["e"], abs=2e-3)


def test_ddp_two_processes_on_cpu(data_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", "train.py", f"--data_dir={data_dir}",
                          f"--out_dir={tmp_path}", "--n_layer=1", "--n_embd=32", "--n_head=2",
                          "--block_size=32", "--max_iters=4", "--eval_interval=2",
                          "--eval_iters=1", "--device=cpu"], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)  # a hung collective must not leave workers behind
        raise
    assert p.returncode == 0, stderr[-2000:]
    # rank 0 alone logs
    assert stdout.count("2 process(es)") == 1 and stdout.count("step 4: train loss") == 1
    ckpt = common.load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert ckpt["iter"] == 4 and len(ckpt["rng_cpu"]) == 2  # each rank's RNG state


def test_a_finished_ddp_worker_skips_the_interpreter_teardown(data_dir, tmp_path):
    """DDP keeps gloo's worker threads alive past destroy_process_group, and one that frees a
    collective's tensors during the interpreter's teardown aborts the worker (SIGABRT; 3 of 165 runs
    on a loaded 2-core machine). So a finished worker leaves with os._exit(0): no atexit handler
    runs, and its output and files are complete."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import atexit, sys, train; atexit.register(lambda: print('teardown ran')); "
            "train.main(sys.argv[1:]); print('main returned')")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    out = subprocess.run([sys.executable, "-c", code, f"--data_dir={data_dir}",
                          f"--out_dir={tmp_path}", "--n_layer=1", "--n_embd=32", "--n_head=2",
                          "--block_size=32", "--max_iters=2", "--eval_interval=2",
                          "--eval_iters=1", "--device=cpu"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "1 process(es)" in out.stdout and "step 2: train loss" in out.stdout
    assert "teardown ran" not in out.stdout and "main returned" not in out.stdout
    assert common.load_checkpoint(str(tmp_path / "ckpt.pt"))["iter"] == 2


def test_bench_gpt_quick_smoke(tmp_path):
    import bench
    rows = bench.main(["gpt", "--quick", "--repeats=1", f"--json={tmp_path / 'b.json'}"])
    assert {r["what"] for r in rows} == {"graphs", "forward", "train_step", "decode"}
    assert all(r["speed_ratio_ours_vs_plain"] > 0
               for r in rows if r["what"] in ("forward", "train_step"))
    assert [r["B"] for r in rows if r["what"] == "decode"] == [1, 8]
    assert all(r["tokens_per_s"] > 0 and r["dense_tokens_per_s"] > 0
               for r in rows if r["what"] == "decode")
    # the same model twice
    assert all(r["flops_ideal"] == 1.0 for r in rows if r["what"] == "decode")
    assert json.load(open(tmp_path / "b.json"))["rows"][0]["suite"] == "gpt"


def test_bench_crossover_is_where_sparse_wins_from_then_on():
    import bench
    sweep = lambda speeds: [{"suite": "s", "B": B, "T": 8, "x": v}
                            for B, v in zip((4, 1, 2, 8), speeds)]
    # B=1 loses, then wins
    assert bench.crossover(sweep([1.2, 0.9, 1.1, 1.3]), "x")["sparse_faster_from_BT"] == 16
    # B=4 loses again
    assert bench.crossover(sweep([0.9, 1.1, 1.2, 1.3]), "x")["sparse_faster_from_BT"] == 64
    assert bench.crossover(sweep([1.2, 1.1, 1.1, 0.99]), "x")["sparse_faster_from_BT"] \
        == "none_measured"
    row = bench.crossover(sweep([1.2, 0.9, 1.1, 1.3]), "x", mode="m")
    assert row["B_T"] == "1x8/2x8/4x8/8x8" and row["speedups"] == "0.900/1.100/1.200/1.300" \
        and row["mode"] == "m"


@pytest.mark.parametrize("suite", ["tsa", "dtrnet", "conddepth", "hybrid", "mod"])
def test_bench_paper_suites_quick_smoke(suite):
    """Every paper's benchmark runs and reports positive timings
    (numbers themselves go in results/)."""
    import bench
    rows = bench.main([suite, "--quick", "--repeats=1"])
    assert rows and all(r["suite"] == suite for r in rows)
    assert all(v > 0 for r in rows for k, v in r.items() if k.endswith("_ms"))
    decode = [r for r in rows if r["what"] == "decode"]
    assert decode and all(r["tokens_per_s"] > 0 and r["dense_tokens_per_s"] > 0 for r in decode)
    assert any(r["what"] == "crossover" for r in rows)
    # routers that skip work: fewer FLOPs per generated token than the dense GPT (conddepth's G3
    # controller costs more than the half FFN it saves at the quick size's width of 64)
    if suite in ("tsa", "dtrnet"):
        assert all(r["flops_ideal"] > 1.0 for r in decode), decode


# --------------------------------------------------------------------------------------------------
# cached decoding, the device matrix and the window policy shared by every model

def sampled_probs(monkeypatch, logits, **kw):
    """The distribution common.sample_next draws from (torch.multinomial's input), (B, V)."""
    seen = []
    monkeypatch.setattr(torch, "multinomial", lambda probs, num_samples: seen.append(probs) or
                        probs.argmax(-1, keepdim=True))
    common.sample_next(logits.clone(), **kw)
    return seen[0]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_temperature_divides_the_logits(monkeypatch, temperature):
    """Sampling at temperature τ draws from softmax(logits / τ): τ < 1 sharpens, τ > 1 flattens."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.0, 3.0, 1.0]])
    probs = sampled_probs(monkeypatch, logits, temperature=temperature)
    assert torch.allclose(probs, torch.softmax(logits / temperature, -1), atol=1e-6)
    if temperature == 1.0:  # the default
        assert torch.allclose(sampled_probs(monkeypatch, logits), probs, atol=0)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_sampling_top_k_keeps_exactly_the_k_largest(monkeypatch, k):
    """top_k keeps the k largest logits (renormalised, at the temperature) and zeroes the rest; a
    k at or above the vocabulary keeps everything."""
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.5, 0.0], [1.0, -2.0, 0.5, 3.0, 2.5]])
    probs = sampled_probs(monkeypatch, logits, temperature=0.7, top_k=k)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(
        1, logits.topk(min(k, 5)).indices, True)
    want = torch.softmax((logits / 0.7).masked_fill(~keep, float("-inf")), -1)
    assert ((probs > 0).sum(-1) == min(k, 5)).all()
    assert torch.allclose(probs, want, atol=1e-6)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324])
def test_sampling_at_a_vanishing_temperature_is_the_greedy_limit(temperature):
    """logits / τ alone overflows to inf (softmax: NaN, torch.multinomial refuses it); τ → 0 is
    greedy, ties shared."""
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, -1.0, 1.9], [1.0, 1.0, -3.0]])
    torch.manual_seed(0)
    picks = torch.cat([common.sample_next(logits, temperature) for _ in range(50)], 1)
    assert (picks[:2] == torch.tensor([[1], [0]])).all()
    assert set(picks[2].tolist()) == {0, 1}


def test_sampling_at_temperature_zero_is_greedy(monkeypatch):
    monkeypatch.setattr(torch, "multinomial", lambda *a, **kw: pytest.fail("sampled at τ = 0"))
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, -1.0, 1.9]])
    assert common.sample_next(logits, temperature=0).tolist() == [[1], [0]]


def test_window_start_keeps_between_half_and_full_block():
    for bs in (1, 2, 3, 8, 16):
        h = max(bs // 2, 1)
        ws = [common.window_start(n, bs) for n in range(1, 5 * bs)]
        assert ws[:bs] == [0] * bs
        for n, w in enumerate(ws, start=1):
            # never longer than block_size, never shorter than h once full
            assert min(n, h) <= n - w <= bs
        assert all(b >= a for a, b in zip(ws, ws[1:]))  # the window only moves forward
        restarts = [n for n in range(bs + 1, 5 * bs) if ws[n - 1] != ws[n - 2]]
        # a restart keeps exactly h tokens
        assert all(n - common.window_start(n, bs) == h for n in restarts)



def test_devices_dtypes_and_autocast(monkeypatch):
    """auto picks CUDA, else MPS, else the CPU; a device that is not here is one line naming it;
    training's dtype is bf16 on CUDA (fp16 where bf16 is not supported), fp32 elsewhere, and
    autocast runs that dtype (fp32: no autocast at all)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert common.pick_device("auto") == cpu and common.pick_device("cpu") == cpu
    with pytest.raises((RuntimeError, AssertionError)) as torch_says:
        torch.empty(1, device="cuda:1")
    with pytest.raises(common.NanorouteError) as e:
        common.pick_device("cuda:1")
    assert str(e.value) == ("device 'cuda:1' is not available here "
                            f"({str(torch_says.value).splitlines()[0]})")
    assert common.pick_device() == cpu  # auto by default
    with pytest.raises(common.NanorouteError, match="device must be auto, cpu, cuda, cuda:N"):
        common.pick_device("meta")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    with pytest.raises(common.NanorouteError, match="^device 'mps' is not available"):
        common.pick_device("auto")  # what auto picks is tried like a named device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(common.NanorouteError, match="^device 'cuda' is not available"):
        common.pick_device("auto")
    for bf16, want in ((True, "bf16"), (False, "fp16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda bf16=bf16: bf16)
        assert common.default_dtype(cuda) == want
    assert common.default_dtype(cpu) == common.default_dtype(torch.device("mps")) == "fp32"
    assert isinstance(common.autocast(cpu), contextlib.nullcontext)
    assert isinstance(common.autocast(cpu, "fp32"), contextlib.nullcontext)
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        ctx = common.autocast(cpu, name)
        assert isinstance(ctx, torch.autocast) and (ctx.device, ctx.fast_dtype) == ("cpu", dtype)
    with pytest.raises(common.NanorouteError, match="^dtype must be one of fp32, bf16, fp16, "
                       "got 'fp8'$"):
        common.autocast(cpu, "fp8")


def test_decode_each_dataset_and_the_past_mask():
    meta = {"dataset": "shakespeare", "itos": ["\n", "a", "b"]}
    assert common.decode(meta, [1, 0, 2]) == "a\nb"
    assert common.decode({"dataset": "enwik8"}, [104, 105, 255]) == "hi\ufffd"  # bytes, replaced
    assert common.decode({"dataset": "sort"}, [32, 3, 33, 0, 34]) == "[BOS] 3 [SEP] 0 [EOS]"
    ids = common.bpe().encode_ordinary(" the cat")
    for name in ("shakespeare_bpe", "fineweb_edu"):
        assert common.decode({"dataset": name}, ids) == " the cat"
    for dtype in (torch.float32, torch.bfloat16):
        mask = common.past_mask(torch.tensor(2), 5, dtype)
        assert mask.dtype == dtype and mask.shape == (1, 5)
        assert mask.tolist() == [[0.0, 0.0, 0.0, -math.inf, -math.inf]]
    assert common.cond(torch.tensor(True), lambda x: x + 1, lambda x: x - 1, (1,)) == 2
    assert common.cond(torch.tensor(False), lambda x: x + 1, lambda x: x - 1, (1,)) == 0


def test_cli_errors_are_one_line_exit_2(capsys):
    def bad(argv):
        raise common.NanorouteError("no such thing")
    with pytest.raises(SystemExit) as e:
        common.cli(bad)
    assert e.value.code == 2 and capsys.readouterr().err == "error: no such thing\n"
    seen = []
    monkey = pytest.MonkeyPatch()
    monkey.setattr(sys, "argv", ["x.py", "--a", "b"])
    common.cli(seen.append)
    monkey.undo()
    assert seen == [["--a", "b"]]

def sharp(model):
    """Weights of std 0.2 instead of GPT's 0.02: logits that depend strongly on every key, so a
    wrong cache entry moves them far beyond bf16's tolerance (at the default init the logits are
    nearly uniform)."""
    torch.manual_seed(0)
    for p in model.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, 0.0, 0.2)
    return model


def test_gpt_prefill_and_step_equal_the_full_forward(dev):
    model = sharp(common.Model(tiny(block_size=16))).to(dev.device).eval()
    idx = torch.randint(0, 50, (3, 16), device=dev.device)
    with dev.autocast():
        steps, full = decoded_vs_full(model, idx, 5)
    atol, rtol = dev.tol()
    torch.testing.assert_close(steps, full, atol=atol, rtol=rtol)


@pytest.mark.parametrize("name,flags", [(n, []) for n in TINY] + [("conddepth", ["--mode=topk"])])
def test_decodes_cached_says_what_generate_runs(name, flags, monkeypatch):
    """The label `train.py --sample` prints ("KV-cached decoding" or "cache-free") comes from
    decodes_cached: it must be true exactly when generate decodes through prefill/step."""
    model, cfg = tiny_model(name, *flags)
    model.eval()
    for use_cache in (True, False):
        calls = []
        if hasattr(model, "prefill"):
            real = model.prefill
            monkeypatch.setattr(model, "prefill",
                                lambda idx, real=real: calls.append(1) or real(idx))
        model.generate(torch.zeros(1, 2, dtype=torch.long), 3, temperature=0, use_cache=use_cache)
        assert bool(calls) == model.decodes_cached(use_cache), (name, flags, use_cache)


def test_gpt_decodes_with_its_cache_unless_told_not_to():
    model = common.Model(tiny())
    assert model.decodes_cached() is True and model.decodes_cached(True) is True
    assert model.decodes_cached(False) is False


def test_generate_prefills_once_per_window_and_steps_the_rest(monkeypatch):
    """30 tokens after a 3-token prompt at block_size 8: the window starts at 0, then restarts at
    5, 10, 15, 20, 25 (window_start: keep h = 4, one prefill per 5 tokens): 6 prefills, and a
    cached step for each of the other 24 tokens."""
    model, calls = common.Model(tiny(block_size=8)), []
    for name in ("prefill", "step"):
        real = getattr(model, name)
        monkeypatch.setattr(model, name, lambda *a, real=real, name=name:
                            calls.append(name) or real(*a))
    model.generate(torch.zeros(1, 3, dtype=torch.long), 30, temperature=0)
    assert (calls.count("prefill"), calls.count("step")) == (6, 24)


def test_gpt_cached_generate_equals_cache_free_past_block_size(dev):
    model = sharp(common.Model(tiny(block_size=8))).to(dev.device).eval()
    prompt = torch.randint(0, 50, (2, 3), device=dev.device)
    with dev.autocast():
        a = model.generate(prompt, 30, temperature=0)
        b = model.generate(prompt, 30, temperature=0, use_cache=False)
    assert a.shape == (2, 33)
    if not dev.low:
        assert torch.equal(a, b)
    # bf16: rounding may flip a near-tie; where the two first differ, it must be one
    for row in range(2):
        diff = (a[row] != b[row]).nonzero()
        if len(diff):
            j = int(diff[0])
            assert j >= 12  # the start agrees
            ctx = a[row:row + 1, common.window_start(j, 8):j]
            with dev.autocast(), torch.no_grad():
                logits = model(ctx)[0][0, -1].float()  # (V,) what the cache-free path saw at j
            gap = (logits[a[row, j]] - logits[b[row, j]]).abs()
            assert gap <= 0.02 * logits.abs().max(), (j, gap, logits.abs().max())


def test_gpt_training_step_is_finite_on_every_device(dev):
    torch.manual_seed(0)
    model = common.Model(tiny()).to(dev.device)
    x = torch.randint(0, 50, (2, 32), device=dev.device)
    with dev.autocast():
        _, loss, _ = model(x, x.roll(-1, 1))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_kv_cache_is_preallocated_and_typed_from_its_first_kv():
    k = torch.randn(2, 2, 3, 4, dtype=torch.bfloat16)
    cache = common.KVCache(2, 8, k, k)
    assert cache.k.shape == (2, 2, 8, 4) and cache.k.dtype == torch.bfloat16
    ptr = cache.k.data_ptr()
    k2, v2 = cache.append(torch.tensor(3), k[:, :, :1] + 1, k[:, :, :1])
    # written in place, no re-allocation
    assert k2.shape == (2, 2, 8, 4) and cache.k.data_ptr() == ptr
    # at pos, the past kept
    assert torch.equal(k2[:, :, 3], k[:, :, 0] + 1) and torch.equal(k2[:, :, :3], k)


# --------------------------------------------------------------------------------------------------
# the routing picture

def test_render_routing_text_and_html(tmp_path):
    meta = {"dataset": "shakespeare", "itos": list("\nabc ")}
    idx = [1, 2, 3, 4, 0, 1, 2]  # "abc \nab"
    m = torch.tensor([[1.0, 0, 1, 0, 0, 1, 0], [0.0, 0, 0, 0, 0, 0, 1]])
    path = str(tmp_path / "r" / "routing.html")
    text = train.render_routing(meta, idx, m, ["layer 1", "layer 2"], ("cheap", "costly"), "demo",
                                 path, color=False)
    lines = text.splitlines()
    # text, then a marker per character
    assert lines[2:4] == ["abc ⏎", "#.#.."] and lines[4:6] == ["ab", "#."]
    assert "layer 2: costly 14%" in text
    page = open(path, encoding="utf-8").read()
    # self-contained
    assert page.count("<pre>") == 2 and "http" not in page and "<script" not in page
    assert 'title="1.00">a</span>' in page and "cheap" in page and "costly" in page
    colored = train.render_routing(meta, idx, m, ["layer 1", "layer 2"], ("cheap", "costly"),
                                   "demo")
    assert "\x1b[" in colored and "#" not in colored.split("\n", 1)[1]


@pytest.mark.skipif(not any(shutil.which(b)
                            for b in ("chromium", "chromium-browser", "google-chrome")),
                    reason="no headless browser installed")
def test_routing_html_renders_in_a_headless_browser(tmp_path):
    browser = next(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                   if shutil.which(b))
    meta = {"dataset": "shakespeare", "itos": list("\nabc ")}
    path = tmp_path / "routing.html"
    train.render_routing(meta, [1, 2, 3] * 60, torch.rand(3, 180), ["l1", "l2", "l3"], ("a", "b"),
                         "t", str(path))
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-background-networking", f"--screenshot={shot}",
                    "--window-size=900,900", path.as_uri()], timeout=60, capture_output=True)
    assert shot.exists() and shot.stat().st_size > 5000


# --------------------------------------------------------------------------------------------------
# the end of a run, --sample, bad input

def test_run_ends_with_a_summary_and_keeps_the_best_checkpoint(data_dir, tmp_path, capsys):
    run(["--max_iters=10"], data_dir, tmp_path / "gpt")
    out = capsys.readouterr().out
    assert "== gpt on shakespeare: summary ==" in out and "best.pt" in out and "sample:" in out
    assert "iter 5/10: loss" in out and "ETA" in out
    best = common.load_checkpoint(str(tmp_path / "gpt" / "best.pt"))
    vals = [r["val_loss"] for r in records(tmp_path / "gpt") if r["kind"] == "eval"]
    assert best["val_loss"] == min(vals) and "optimizer" not in best


def test_sample_from_a_run(data_dir, tmp_path, capsys):
    run(["--max_iters=5"], data_dir, tmp_path / "gpt")
    capsys.readouterr()
    # sampled on the CPU: the same text by two computations is exact there (CUDA's bf16 may break
    # a near-tie)
    train.main(["--sample", str(tmp_path / "gpt"), "--prompt", "ROMEO:", "--num_tokens=20",
                "--temperature", "0", "--device=cpu"])
    out = capsys.readouterr().out
    assert "sample:\nROMEO:" in out and "20 tokens" in out and "KV-cached" in out
    cached = out.split("sample:\n")[1]
    train.main(["--sample", str(tmp_path / "gpt"), "--prompt", "ROMEO:", "--num_tokens=20",
                "--temperature=0", "--dense", "--device=cpu"])
    # the cache changes the speed, not the text
    assert capsys.readouterr().out.split("sample:\n")[1] == cached


@pytest.mark.parametrize("argv,message", [
    (["--sample", "nowhere"], "no such run directory"),
    (["--sample", "{tmp}", "--prompt", "ROMEO{"], "characters Tiny Shakespeare never uses: '{'"),
    (["--sample", "{tmp}", "--temp=1"], "unknown option --temp with --sample"),
    (["--sample", "{tmp}", "--num_tokens=lots"], "--num_tokens expects int"),
    (["--sample", "{empty}"], "no best.pt or ckpt.pt there"),
])
def test_sample_bad_input_is_one_line(argv, message, data_dir, tmp_path, capsys):
    run(["--max_iters=0"], data_dir, tmp_path / "gpt")
    (tmp_path / "empty").mkdir()
    argv = [a.replace("{tmp}", str(tmp_path / "gpt")).replace("{empty}", str(tmp_path / "empty"))
            for a in argv]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1 \
        and err.startswith("error: ")


@pytest.mark.parametrize("argv,message", [
    (["--eval_interval=0"], "eval_interval must be >= 1"),
    (["--learning_rate=nan"], "learning_rate must be a finite number"),
    (["--learning_rate=-1"], "learning_rate must be > 0"),
    (["--grad_clip=-1"], "grad_clip must be >= 0"),
    (["--warmup_iters=-1"], "warmup_iters must be >= 0"),
    (["--max_iters=-5"], "max_iters must be >= 0"),
    (["--beta2=1.5"], "beta2 must be in [0, 1)"),
    (["--block_size=100000"], "more than half of shakespeare's validation split"),
    (["--block_size=40000", "--batch_size=4096"], "more than half of this machine's memory"),
])
def test_bad_numbers_are_one_line_and_write_nothing(argv, message, data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run(argv, data_dir, tmp_path / "run")
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1 \
        and err.startswith("error: ")
    assert not (tmp_path / "run").exists()


def test_out_dir_under_a_file_and_non_utf8_data_are_one_line(data_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        run([], data_dir, tmp_path / "file" / "run")
    assert "is a file, not a directory" in capsys.readouterr().err
    bad = tmp_path / "data" / "shakespeare"
    bad.mkdir(parents=True)
    (bad / "input.txt").write_bytes(b"caf\xe9 \xff\xfe")
    with pytest.raises(common.NanorouteError, match="is not UTF-8 text"):
        common.prepare("shakespeare", str(tmp_path / "data"))
    assert not (bad / "meta.json").exists()


def test_copy_task_says_it_overrides_block_size(tmp_path, capsys):
    meta = common.prepare("copy", str(tmp_path))
    cfg = train.resolve(common.Config(block_size=64, dataset="copy", out_dir="x"), meta)
    assert cfg.block_size == 22 and "block_size 64 -> 22" in capsys.readouterr().out
