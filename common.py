"""
nanoroute/common.py: the small shared core every paper file imports.

1. data      prepare() writes data/<name>/{train,val}.bin (uint16) + meta.json once (fineweb_edu:
             llm.c token shards, read in place); get_batch() reads windows.
2. blocks    the pre-norm GPT block (attention and FFN deltas apart) and the dense GPT baseline.
3. compute   TLOps savings Δ (TSA eq. 7), forward FLOPs per token of each block component, the
             FLOPs a training step executed (LM.train_flops_per_token, each paper its own),
             GPUs' peak FLOP/s, tokens/s and MFU.
4. plumbing  device/autocast/sync, AdamW groups, atomic checkpoints, eval loop, sampling.

Every model file has a `Config` and a `Model` whose `forward(idx, targets=None, sparse=False)`
returns `(logits, loss, stats)`, with cached decoding through `prefill(idx)` / `step(tok, state)`.
"""
import hashlib
import json
import math
import os
import re
import sys
import time
import zipfile
from contextlib import nullcontext
from dataclasses import dataclass, fields

import numpy as np
import requests
import torch
import torch.nn as nn
import torch.nn.functional as F


class NanorouteError(Exception):
    """A user-facing problem (bad flag, missing data, corrupt checkpoint): printed as one line."""


# --------------------------------------------------------------------------------------------------
# Config: nanoGPT's field names; every paper's Config subclasses this one.

@dataclass
class Config:
    # model
    vocab_size: int = 65       # set from the dataset (its meta.json); a flag value is replaced
    block_size: int = 128      # context length in tokens (copy/sort: set to their record length)
    n_layer: int = 6           # transformer blocks
    n_head: int = 6            # attention heads (must divide n_embd)
    n_embd: int = 192          # width of the residual stream
    dropout: float = 0.0       # dropout on attention, FFN and embeddings while training
    bias: bool = False         # biases in Linear layers and LayerNorms
    gelu: str = "none"         # the FFN's GELU: "none" (exact) or "tanh" (GPT-2's approximation)
    # training
    max_iters: int = 2250      # optimizer steps in all (the last one is evaluated and checkpointed)
    batch_size: int = 16       # sequences per micro-batch (per process under torchrun)
    grad_accum: int = 1        # micro-batches per step; routers' batch stats are per micro-batch
    learning_rate: float = 2e-3  # peak lr, after the warm-up
    min_lr: float = 1e-4       # the cosine schedule ends here at max_iters
    warmup_iters: int = 100    # linear lr warm-up steps
    weight_decay: float = 0.1  # AdamW's, on matrices only
    beta1: float = 0.9         # AdamW's β1
    beta2: float = 0.99        # AdamW's β2
    grad_clip: float = 1.0     # clip the gradient norm to this (0: off; the norm is logged anyway)
    eval_interval: int = 750   # evaluate and checkpoint every this many steps
    eval_iters: int = 40       # fixed batches per evaluation
    log_interval: int = 50     # log the training loss every this many steps
    seed: int = 1337           # seed of the initialisation, dropout and batch order
    eval_seed: int = -1        # seed of the fixed evaluation batches (-1: the run's seed)
    device: str = "auto"       # auto, cpu, cuda, cuda:N or mps (auto: cuda, else mps, else cpu)
    compile: bool = False      # torch.compile the model
    peak_flops: float = 0.0    # the device's peak FLOP/s for the logged MFU (0: GPU_PEAKS' entry)
    out_dir: str = ""          # default: out/<model>-<dataset>
    data_dir: str = "data"     # where datasets are prepared (data/<dataset>/)
    shards: int = 1            # fineweb_edu: training shards (~100M tokens each) fetched and used
    init_from: str = ""        # a checkpoint whose weights (and architecture) start this run
    model: str = "gpt"         # set by --model
    dataset: str = "shakespeare"  # set by --dataset

    def __post_init__(self):
        for f in fields(self):  # dataclasses do not check types; the CLI and checkpoints need them
            v = getattr(self, f.name)
            if f.type is float and type(v) is int:
                setattr(self, f.name, float(v))
            elif f.type in (int, float, bool, str) and type(v) is not f.type:
                raise NanorouteError(f"{f.name} must be {f.type.__name__}, got {v!r}")
            elif f.type is float and not math.isfinite(v):
                raise NanorouteError(f"{f.name} must be a finite number, got {v}")
        if self.gelu not in ("none", "tanh"):
            raise NanorouteError("gelu must be 'none' (exact) or 'tanh' (GPT-2), "
                                 f"got {self.gelu!r}")
        check_device_name(self.device)
        at_least = {1: ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "batch_size",
                        "eval_iters", "eval_interval", "log_interval", "shards",
                        "grad_accum"),
                    0: ("max_iters", "warmup_iters", "seed", "weight_decay", "grad_clip", "min_lr",
                        "peak_flops"),
                    -1: ("eval_seed",)}
        # sizes first: a ratio of them (n_embd / n_head) needs them >= 1
        for low, names in at_least.items():
            for name in names:
                if getattr(self, name) < low:
                    raise NanorouteError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.seed >= 2 ** 63:  # torch's seeds are 64-bit; each rank adds its index
            raise NanorouteError(f"seed must be < 2**63, got {self.seed}")
        if self.n_embd % self.n_head:
            raise NanorouteError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not self.learning_rate > 0:
            raise NanorouteError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.min_lr > self.learning_rate:
            raise NanorouteError(f"min_lr={self.min_lr} is above "
                                 f"learning_rate={self.learning_rate}")
        for name in ("beta1", "beta2", "dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise NanorouteError(f"{name} must be in [0, 1), got {getattr(self, name)}")


# `--preset classroom` (each model adds its routing settings): ≤ 3 minutes on a 2-core laptop CPU.
CLASSROOM = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=16, max_iters=1500,
                 eval_interval=500, eval_iters=20, log_interval=100, learning_rate=2e-3,
                 min_lr=1e-4, warmup_iters=50)
# `--model gpt --preset paper`: TSA's paper size and budget, tuned to its dense baseline 1.4422
# (results/tsa.md).
PAPER = dict(n_layer=6, n_head=8, n_embd=256, block_size=128, batch_size=64, max_iters=5000,
             learning_rate=1e-3, min_lr=1e-4, beta2=0.95, weight_decay=0.1, dropout=0.2,
             eval_interval=500)
# `--preset gpu` (each model adds its routing settings): GPT-2 small (12 × 768, 12 heads, GPT-2's
# biases and tanh GELU, so --init_from gpt2 loads; the vocabulary from the data) on 1024-token
# windows, GPT-3 small's optimiser (lr 6e-4, β2 0.95), 16 × 1024 × 32 = 524,288 tokens a step by
# accumulation, 2,500 steps: 1.31B tokens (14 shards of fineweb_edu, ~100M tokens each). Budget:
# the dense GPT executes 3 × 2.66e8 FLOPs a token (dense_flops_per_token at T = 1024: ~6N with
# N = 124M, plus attention), 1.05e18 FLOPs in all: 50 minutes on one H100/H200 at an assumed 35%
# MFU (346 of 989 bf16 TFLOP/s), plus its evaluations; computed, not measured (results/scale.md).
# bf16 is CUDA's default; compile where the model compiles on CUDA.
GPU = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, bias=True, gelu="tanh",
           batch_size=16, grad_accum=32, max_iters=2500, warmup_iters=250, learning_rate=6e-4,
           min_lr=6e-5, beta2=0.95, weight_decay=0.1, grad_clip=1.0, dropout=0.0,
           eval_interval=250, eval_iters=20, log_interval=10, compile=True, shards=14)
PRESETS = {"classroom": CLASSROOM, "paper": PAPER, "gpu": GPU}

ARCH_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias", "gelu")

# --------------------------------------------------------------------------------------------------
# 1. Data

DATA_DIR = "data"
SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                   "tinyshakespeare/input.txt")
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
DATASETS = ("shakespeare", "shakespeare_bpe", "enwik8", "copy", "sort", "fineweb_edu")
TASK_LEN, TASK_VOCAB = 10, 32               # TSA §3.1: length-10 sequences over 32 symbols
BOS, SEP, EOS = TASK_VOCAB, TASK_VOCAB + 1, TASK_VOCAB + 2


def download(url, dest, sha256=None, retries=3, timeout=30, chunk=1 << 20, hint=None,
             resume=False):
    """Stream url to dest.part, check it, then rename: dest exists only complete and intact.
    hint: what the error tells a user to do instead (default: place the file at dest).
    resume: a dest.part an interrupted run left is continued with an HTTP Range request, and kept
    when this run fails too (for files too large to fetch again from the start)."""
    tmp, err = dest + ".part", None
    for attempt in range(retries):
        try:
            have = os.path.getsize(tmp) if resume and os.path.exists(tmp) else 0
            headers = {"Range": f"bytes={have}-"} if have else {}
            with requests.get(url, stream=True, timeout=timeout, headers=headers) as r:
                if have and r.status_code == 416:  # the part is not a prefix of this file
                    os.remove(tmp)
                    raise IOError("the partial download does not fit the file: starting again")
                r.raise_for_status()
                if have and r.status_code != 206:  # the server sends the whole file instead
                    have = 0
                start = re.match(r"bytes (\d+)-", r.headers.get("content-range", ""))
                if have and (start is None or int(start.group(1)) != have):
                    os.remove(tmp)
                    raise IOError(f"asked for bytes {have}- and got "
                                  f"{r.headers.get('content-range')!r}: starting again")
                total = int(r.headers.get("content-length", 0))
                total = total and have + total
                done, h, t0, shown = have, hashlib.sha256(), time.time(), False
                if have and sha256:
                    with open(tmp, "rb") as f:
                        for block in iter(lambda: f.read(chunk), b""):
                            h.update(block)
                with open(tmp, "ab" if have else "wb") as f:
                    for block in r.iter_content(chunk):
                        f.write(block)
                        h.update(block)
                        done += len(block)
                        if total > 50 * chunk and time.time() - t0 > 2:  # a large file: progress
                            print(f"\r  {done / 1e6:.0f}/{total / 1e6:.0f} MB", end="", flush=True)
                            t0, shown = time.time(), True
                if shown:
                    print()
                if total and done != total:
                    raise IOError(f"download interrupted: got {done} of {total} bytes")
            if sha256 and h.hexdigest() != sha256:
                os.remove(tmp)
                raise NanorouteError(f"{url}: sha256 mismatch (got {h.hexdigest()[:12]}…, "
                                     f"expected {sha256[:12]}…); place a good copy at {dest}")
            os.replace(tmp, dest)
            return dest
        except (requests.RequestException, IOError) as e:
            err = e
            time.sleep(min(2 ** attempt, 8) * (attempt + 1 < retries))
    if os.path.exists(tmp) and not resume:
        os.remove(tmp)
    hint = hint or f"download it yourself and place it at {dest}"
    raise NanorouteError(f"could not download {url} ({type(err).__name__}: {err}); {hint}")


def _task_records(kind, n, rng):
    """[BOS] src [SEP] tgt [EOS]; tgt = src (copy) or sorted(src) (sort)."""
    src = rng.integers(0, TASK_VOCAB, size=(n, TASK_LEN))
    tgt = src if kind == "copy" else np.sort(src, axis=1)
    col = lambda v: np.full((n, 1), v)
    return np.concatenate([col(BOS), src, col(SEP), tgt, col(EOS)], axis=1).reshape(-1)


def prepare(name, data_dir=DATA_DIR, url=None, shards=1):
    """Write data/<name>/{train,val}.bin + meta.json once. An input file already in place is never
    downloaded again, so dropping the file there is the offline path. fineweb_edu: its token
    shards (shards: how many training shards), see prepare_fineweb."""
    if name not in DATASETS:
        raise NanorouteError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    d = os.path.join(data_dir, name)
    meta_path = os.path.join(d, "meta.json")
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise NanorouteError(f"--data_dir {data_dir} is a file, not a directory")
    if name == "fineweb_edu":
        return prepare_fineweb(data_dir, shards, url)
    if os.path.exists(meta_path):
        meta = load_meta(name, data_dir)
        for split in (k[:-len("_tokens")] for k in meta if k.endswith("_tokens")):
            load_split(name, split, data_dir)  # a damaged preparation is refused before any work
        return meta
    os.makedirs(d, exist_ok=True)
    splits, meta = {}, {"dataset": name}
    if name in ("shakespeare", "shakespeare_bpe"):
        places = (os.path.join(d, "input.txt"), os.path.join(data_dir, "shakespeare", "input.txt"))
        src = next((p for p in places if os.path.exists(p)), None)
        if src is None:
            src = download(url or SHAKESPEARE_URL, os.path.join(d, "input.txt"), SHAKESPEARE_SHA256)
        try:
            text = open(src, encoding="utf-8").read()
        except UnicodeDecodeError as e:
            raise NanorouteError(f"{src} is not UTF-8 text ({e.reason} at byte {e.start}); "
                                 "replace it with Tiny Shakespeare's input.txt")
        n = int(0.9 * len(text))  # nanoGPT's 90/10 split, so val losses compare with its 1.4697
        if name == "shakespeare":
            chars = sorted(set(text))
            stoi = {c: i for i, c in enumerate(chars)}
            splits = {"train": [stoi[c] for c in text[:n]], "val": [stoi[c] for c in text[n:]]}
            meta.update(vocab_size=len(chars), itos=chars, unit="char")
        else:
            enc = bpe()
            splits = {"train": enc.encode_ordinary(text[:n]), "val": enc.encode_ordinary(text[n:])}
            meta.update(vocab_size=enc.n_vocab, encoding="r50k_base", unit="token")
        meta["characters"] = len(text)
    elif name == "enwik8":
        zpath = os.path.join(d, "enwik8.zip")
        if not os.path.exists(zpath):
            download(url or ENWIK8_URL, zpath)
        try:
            with zipfile.ZipFile(zpath) as z:
                if z.testzip() is not None:  # the zip's own CRCs are the integrity check
                    raise zipfile.BadZipFile("CRC mismatch")
                raw = np.frombuffer(z.read("enwik8")[:10 ** 8], dtype=np.uint8)
        except (zipfile.BadZipFile, KeyError) as e:
            raise NanorouteError(f"{zpath} is corrupt ({e}); delete it and run again, or place a "
                                 "good copy there")
        n = len(raw)
        a, b = int(0.9 * n), int(0.95 * n)  # the standard 90M/5M/5M split
        splits = {"train": raw[:a], "val": raw[a:b], "test": raw[b:]}
        meta.update(vocab_size=256, unit="byte", characters=n)
    else:
        rng = np.random.default_rng(1234 if name == "copy" else 4321)
        splits = {"train": _task_records(name, 10_000, rng), "val": _task_records(name, 1_000, rng)}
        meta.update(vocab_size=TASK_VOCAB + 3, record_len=2 * TASK_LEN + 3, unit="token")
    short = {k: len(v) for k, v in splits.items() if len(v) < 2}  # a window: an input + a target
    if short:
        raise NanorouteError(f"{name} gives a {', '.join(short)} split of {min(short.values())} "
                             f"token(s): its input in {d} is empty or too short; put the full file "
                             "there and run again")
    for split, ids in splits.items():
        arr = np.asarray(ids, dtype=np.uint16)  # every vocabulary here fits in 16 bits
        path = os.path.join(d, f"{split}.bin")
        atomic_write(path, arr.tofile)
        meta[f"{split}_tokens"] = len(arr)
    # meta.json last: it marks a complete preparation
    atomic_write(meta_path, lambda f: f.write(json.dumps(meta).encode()))
    shown = {k: v for k, v in meta.items() if k in ("characters", "vocab_size") or "_tokens" in k}
    print(f"prepared {name}: " + ", ".join(f"{k} {v:,}" for k, v in shown.items()))
    return meta


def bpe():
    import tiktoken
    try:
        return tiktoken.get_encoding("r50k_base")  # the GPT-2 vocabulary (same ids as "gpt2")
    except (OSError, ValueError) as e:  # tiktoken downloads it once, into TIKTOKEN_CACHE_DIR
        raise NanorouteError(f"the GPT-2 BPE vocabulary could not be loaded ({type(e).__name__}): "
                             "connect once, or set TIKTOKEN_CACHE_DIR to a folder that holds "
                             "tiktoken's r50k_base file")


def load_meta(name, data_dir=DATA_DIR):
    path = os.path.join(data_dir, name, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise NanorouteError(f"{path} is missing or corrupt ({type(e).__name__}): delete it if "
                             f"it is there and run train.py --dataset {name} to prepare the data "
                             "again")
    problem = meta_problem(meta, name)
    if problem:
        raise NanorouteError(f"{path} {problem}: it is not what prepare() writes for {name}; "
                             f"delete it and run train.py --dataset {name} to prepare the data "
                             "again")
    return meta


def meta_problem(meta, name):
    """Rule: a file read from outside is validated before use. What is wrong with a dataset's
    meta.json (None: nothing): the dataset it names, its vocabulary, its split sizes and the keys
    decoding and sampling need. The token ids in its splits are checked by load_split."""
    count = lambda v: type(v) is int and v >= 0  # noqa: E731
    if not isinstance(meta, dict):
        return f"is a JSON {type(meta).__name__}, not an object"
    if meta.get("dataset") != name:
        return f"names the dataset {meta.get('dataset')!r}"
    V = meta.get("vocab_size")
    if not (count(V) and 1 <= V <= 1 << 16):  # the splits are uint16
        return f"has vocab_size {V!r}"
    bad = [k for k, v in meta.items() if k.endswith("_tokens") and not count(v)]
    missing = [k for k in ("train_tokens", "val_tokens") if k not in meta]
    if bad or missing:
        return f"has {bad[0]} {meta[bad[0]]!r}" if bad else f"has no {missing[0]}"
    itos = meta.get("itos")
    needs = {"shakespeare": (isinstance(itos, list) and len(itos) == V
                             and all(isinstance(c, str) and len(c) == 1 for c in itos),
                             f"an itos of {V} characters"),
             "shakespeare_bpe": (meta.get("encoding") == "r50k_base" and V == 50257,
                                 "encoding r50k_base and vocab_size 50257"),
             "fineweb_edu": (meta.get("encoding") == "r50k_base" and V == 50257
                             and isinstance(meta.get("shards"), dict),
                             "encoding r50k_base, vocab_size 50257 and its shards"),
             "enwik8": (V == 256, "vocab_size 256 (bytes)"),
             "copy": (meta.get("record_len") == 2 * TASK_LEN + 3 and V == TASK_VOCAB + 3,
                      f"record_len {2 * TASK_LEN + 3} and vocab_size {TASK_VOCAB + 3}")}
    ok, what = needs.get(name, needs["copy"])
    return None if ok else f"lacks {what}"


def load_split(name, split, data_dir=DATA_DIR):
    """A split's tokens, memory-mapped, once its size is checked against meta.json (a truncated
    copy, a full disk or an odd byte count would train on other data than the one prepared)."""
    if name == "fineweb_edu":
        return load_shards(split, data_dir)
    path = os.path.join(data_dir, name, f"{split}.bin")
    meta_path = os.path.join(data_dir, name, "meta.json")
    meta = load_meta(name, data_dir)
    want = meta.get(f"{split}_tokens")
    have = os.path.getsize(path) if os.path.isfile(path) else None
    if have is None or want is None or have != 2 * want or want < 2:
        found = "is missing" if have is None else f"has {have:,} bytes"
        expect = f"{want:,} uint16 tokens" if want is not None else f"no {split} split"
        raise NanorouteError(f"{path} {found}, but {meta_path} says {expect}: the preparation is "
                             f"damaged; delete {meta_path} and run again to re-prepare")
    data = np.memmap(path, dtype=np.uint16, mode="r")
    vocab = meta["vocab_size"]
    top = int(data.max())  # one pass over the file: what an embedding lookup would fail on later
    if top >= vocab:
        raise NanorouteError(f"{path} holds token id {top}, beyond {meta_path}'s vocab_size "
                             f"{vocab}: the preparation is damaged; delete {meta_path} and run "
                             "again to re-prepare")
    return data


def atomic_write(path, write):
    """write(f) into path.tmp opened for bytes, then rename it over path: a failed write (a full
    disk, a kill) leaves the previous file intact and no partial one, raised as an OSError naming
    path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        with open(path + ".tmp", "wb") as f:
            write(f)
        os.replace(path + ".tmp", path)
    except BaseException as e:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        # torch.save's zip writer replaces what stopped the write (a full disk, a Ctrl-C) with a
        # RuntimeError of its own on the way out: raise what stopped it
        err = e if isinstance(e, OSError) else e.__context__
        if isinstance(err, OSError):
            raise OSError(err.errno, err.strerror or str(err), path) from None
        if isinstance(err, BaseException) and not isinstance(err, Exception):
            raise err from None  # an interrupt stays one: Ctrl-C, SystemExit
        raise


def get_batch(data, meta, batch_size, block_size, rng, device="cpu"):
    """Random windows (x, y) with y = x shifted by one. For copy/sort whole records are drawn and
    targets before [SEP] are -1 (ignored): the loss sees only the target tokens and [EOS]."""
    if "record_len" in meta:
        R = meta["record_len"]
        rows = rng.integers(0, len(data) // R, size=batch_size)
        rec = np.stack([data[r * R:(r + 1) * R] for r in rows]).astype(np.int64)
        rec = torch.from_numpy(rec)  # (B, R)
        x, y = rec[:, :-1].clone(), rec[:, 1:].clone()
        y[:, :TASK_LEN + 1] = -1  # positions 0..10 predict src and [SEP]
    elif isinstance(data, Shards):
        x, y = data.batch(batch_size, block_size, rng)
    else:
        if len(data) <= block_size:
            raise NanorouteError(f"block_size={block_size} is longer than the split "
                                 f"({len(data)} tokens)")
        ix = rng.integers(0, len(data) - block_size, size=batch_size)
        x = np.stack([data[i:i + block_size] for i in ix]).astype(np.int64)  # (B, T)
        y = np.stack([data[i + 1:i + 1 + block_size] for i in ix]).astype(np.int64)
        x, y = torch.from_numpy(x), torch.from_numpy(y)
    device = torch.device(device)
    if device.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x.to(device), y.to(device)


def decode(meta, ids):
    if meta["dataset"] == "shakespeare":
        return "".join(meta["itos"][i] for i in ids)
    if meta["dataset"] in ("shakespeare_bpe", "fineweb_edu"):
        return bpe().decode(ids)
    if meta["dataset"] == "enwik8":
        return bytes(ids).decode("utf-8", errors="replace")
    return " ".join({BOS: "[BOS]", SEP: "[SEP]", EOS: "[EOS]"}.get(i, str(i)) for i in ids)


# FineWeb-Edu (sample-10BT) in GPT-2 tokens: the pre-tokenised shards modded-nanogpt's users fetch,
# in llm.c's format: a header of 256 int32 (magic, version, token count), then uint16 tokens.

HF_URL = "https://huggingface.co"  # the environment variable NANOROUTE_HF_URL overrides it
FINEWEB_REPO = "kjj0/finewebedu10B-gpt2"
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
SHARD_HEADER_BYTES = 4 * SHARD_HEADER_INTS


def hf_url():
    """The Hugging Face Hub's base URL: NANOROUTE_HF_URL (a mirror, a test server) or the Hub."""
    return (os.environ.get("NANOROUTE_HF_URL") or HF_URL).rstrip("/")


def fineweb_files(shards=1):
    """{split: shard file names}: the one validation shard and the first `shards` training ones."""
    if type(shards) is not int or shards < 1:
        raise NanorouteError(f"shards must be an integer >= 1, got {shards!r}")
    return {"train": [f"finewebedu_train_{i:06d}.bin" for i in range(1, shards + 1)],
            "val": ["finewebedu_val_000000.bin"]}


def read_shard(path):
    """An llm.c token file -> its tokens, a read-only uint16 memmap, once the header and the file's
    size agree (a wrong magic, a short or long body: one error naming the file)."""
    redo = f"delete it and run again to download it, or put a good copy at {path}"
    try:
        header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)  # (256,) int32
        size = os.path.getsize(path)
    except OSError as e:
        raise NanorouteError(f"{path} cannot be read ({e.strerror or e})")
    if len(header) < SHARD_HEADER_INTS:
        raise NanorouteError(f"{path} has {size:,} bytes, less than an llm.c token shard's "
                             f"{SHARD_HEADER_BYTES:,}-byte header; {redo}")
    if (header[0], header[1]) != (SHARD_MAGIC, SHARD_VERSION):
        got = f"{header[0]}, {header[1]}"
        raise NanorouteError(f"{path} is not an llm.c token shard (its header starts {got}, not "
                             f"magic {SHARD_MAGIC}, version {SHARD_VERSION}); {redo}")
    n = int(header[2])
    if n < 0 or size != SHARD_HEADER_BYTES + 2 * n:
        raise NanorouteError(f"{path} has {size:,} bytes, but its header says {n:,} tokens "
                             f"({SHARD_HEADER_BYTES + 2 * n:,} bytes): it is damaged; {redo}")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=SHARD_HEADER_BYTES, shape=(n,))


class Shards:
    """Token files read as one split, without loading them: a window lies inside one shard (the
    shards are separate documents' streams; a window across an end would join two of them)."""

    def __init__(self, arrays):
        self.arrays = list(arrays)
        self.sizes = np.array([len(a) for a in self.arrays], dtype=np.int64)

    def __len__(self):
        return int(self.sizes.sum())

    def batch(self, batch_size, block_size, rng):
        """batch_size windows (x, y), y = x shifted by one: uniform over every window of
        block_size + 1 tokens inside a shard, so a shard is drawn in proportion to its size."""
        per_shard = np.maximum(self.sizes - block_size, 0)  # windows starting in each shard
        if per_shard.sum() == 0:
            raise NanorouteError(f"block_size={block_size} is longer than every shard "
                                 f"(the longest has {self.sizes.max():,} tokens)")
        ends = np.cumsum(per_shard)
        k = rng.integers(0, ends[-1], size=batch_size)  # a window among all of them
        shard = np.searchsorted(ends, k, side="right")  # the shard it starts in
        start = k - (ends[shard] - per_shard[shard])
        w = np.stack([self.arrays[s][i:i + block_size + 1] for s, i in zip(shard, start)])
        w = torch.from_numpy(w.astype(np.int64))  # (B, T + 1)
        return w[:, :-1], w[:, 1:]


def prepare_fineweb(data_dir=DATA_DIR, shards=1, url=None):
    """Download the validation shard and `shards` training shards into data/fineweb_edu/ (those
    already there are used as they are; an interrupted download resumes), check each shard's
    header, and write meta.json naming the shards this preparation uses."""
    files = fineweb_files(shards)
    d = os.path.join(data_dir, "fineweb_edu")
    base = (url or f"{hf_url()}/datasets/{FINEWEB_REPO}/resolve/main").rstrip("/")
    names = files["val"] + files["train"]
    missing = [f for f in names if not os.path.isfile(os.path.join(d, f))]
    if missing:
        os.makedirs(d, exist_ok=True)
        hint = (f"download {', '.join(missing)} from {base}/ into {d}/ (a .part file there is "
                "continued)")
    for i, f in enumerate(missing):
        print(f"downloading {f} ({i + 1}/{len(missing)}) from {base}/")
        download(f"{base}/{f}", os.path.join(d, f), hint=hint, resume=True)
    meta = {"dataset": "fineweb_edu", "vocab_size": 50257, "encoding": "r50k_base",
            "unit": "token", "shards": files}
    for split, names in files.items():
        meta[f"{split}_tokens"] = sum(len(read_shard(os.path.join(d, f))) for f in names)
    atomic_write(os.path.join(d, "meta.json"), lambda f: f.write(json.dumps(meta).encode()))
    print(f"prepared fineweb_edu: {len(files['train'])} training shard(s), train_tokens "
          f"{meta['train_tokens']:,}, val_tokens {meta['val_tokens']:,}, vocab_size 50,257")
    return meta


def load_shards(split, data_dir=DATA_DIR):
    """A fineweb_edu split: the shards meta.json names, memory-mapped (one shard: its array)."""
    meta = load_meta("fineweb_edu", data_dir)
    names = meta.get("shards", {}).get(split)
    if not names:
        raise NanorouteError(f"{os.path.join(data_dir, 'fineweb_edu', 'meta.json')} names no "
                             f"{split} shards; run train.py --dataset fineweb_edu to prepare it")
    arrays = [read_shard(os.path.join(data_dir, "fineweb_edu", f)) for f in names]
    return arrays[0] if len(arrays) == 1 else Shards(arrays)


# --------------------------------------------------------------------------------------------------
# 2. Blocks and the dense GPT

class CausalSelfAttention(nn.Module):
    """Multi-head causal attention, split into qkv() / attend() / c_proj so that a routed model can
    run each part on its own subset of tokens."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def split_heads(self, t):
        B, T, C = t.shape
        return t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

    def qkv(self, x):
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # 3 × (B, T, C)
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)

    def attend(self, q, k, v, attn_mask=None, causal=True):
        """Causal SDPA, or SDPA under attn_mask, or causal=False (every key) -> (B, T, C)."""
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p,
                                           is_causal=causal and attn_mask is None)  # (B, nh, T, hs)
        B, nh, T, hs = y.shape
        return y.transpose(1, 2).reshape(B, T, nh * hs)

    def forward(self, x):
        y = self.c_proj(self.attend(*self.qkv(x)))  # (B, T, C)
        return F.dropout(y, self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.gelu = cfg.gelu

    def forward(self, x):
        h = F.gelu(self.c_fc(x), approximate=self.gelu)  # (B, T, 4C)
        return F.dropout(self.c_proj(h), self.dropout, self.training)


class Block(nn.Module):
    """Pre-norm block; attn_delta / ffn_delta are the residual updates TSA (eqs. 3–4) gates."""

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def attn_delta(self, x):
        return self.attn(self.ln_1(x))

    def ffn_delta(self, x):
        return self.mlp(self.ln_2(x))

    def forward(self, x):
        x = x + self.attn_delta(x)
        return x + self.ffn_delta(x)

    def prefill(self, x, block_size):
        """forward(x) that also returns this block's K/V in a KVCache."""
        q, k, v = self.attn.qkv(self.ln_1(x))  # 3 × (B, nh, T, hs)
        x = x + self.attn.c_proj(self.attn.attend(q, k, v))
        return x + self.ffn_delta(x), KVCache(x.size(0), block_size, k, v)

    def step(self, x, cache, pos, mask):
        """One new token x (B, 1, C) at position pos (0-d tensor) against the cache of its past;
        mask = past_mask(pos, block_size, dtype), made once per step for every layer."""
        q, k, v = self.attn.qkv(self.ln_1(x))  # 3 × (B, nh, 1, hs)
        k, v = cache.append(pos, k, v)         # (B, nh, S, hs)
        x = x + self.attn.c_proj(self.attn.attend(q, k, v, attn_mask=mask))
        return x + self.ffn_delta(x)


class LM(nn.Module):
    """Embeddings, final norm, tied head, init and sampling: what every model here shares."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # no padding_idx: id 0 is '\n' here
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def init_weights(self):
        """N(0, 0.02) everywhere, GPT-3's N(0, (0.02/√(2L))²) on projections into the residual
        stream. Subclasses call this at the end of __init__, then apply their own special inits."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                into_residual = name.endswith("c_proj.weight")
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if into_residual else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)  # LayerNorm weights

    def embed(self, idx):
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise NanorouteError(f"sequence of length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        return F.dropout(x, self.cfg.dropout, self.training)

    def head(self, x, targets=None):
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    def train_flops_per_token(self, T, stats=None):
        """Forward FLOPs per token one training forward of this model executed on length-T
        sequences (stats: that forward's): the dense GPT's count. A paper file whose training step
        runs something else overrides this next to its own flops_per_token."""
        return float(dense_flops_per_token(self.cfg, T))

    def num_params(self):
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel()  # nanoGPT's convention: position embeddings not counted

    def decodes_cached(self, use_cache=True):
        """Whether generate(use_cache=...) decodes with a cache: what a label of it must say."""
        return use_cache and hasattr(self, "prefill")

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True,
                 compile=False):
        """Sample max_new_tokens after idx (B, T0) with eval's hard routing, on the window
        idx[:, window_start(n, block_size):]. Cached: prefill(window) -> (logits (B, V), state, a
        tuple), then step(tok (B, 1), state) -> (logits, state) per token; use_cache=False runs
        the whole window per token (the reference). compile=True compiles the step (CUDA graphs
        on CUDA)."""
        was_training = self.training
        self.eval()
        cached = self.decodes_cached(use_cache)
        graphs = cached and compile and idx.device.type == "cuda"
        step = self.step
        if cached and compile:
            step = torch.compile(self.step, mode="reduce-overhead" if graphs else None)
        w_prev, state = -1, None
        for _ in range(max_new_tokens):
            w = window_start(idx.size(1), self.cfg.block_size)
            if not cached:
                logits = self(idx[:, w:])[0][:, -1]  # (B, V)
            elif w != w_prev:  # the first token, or the window restarted
                logits, state = self.prefill(idx[:, w:])
                fixed = {t.data_ptr() for t in state if torch.is_tensor(t)}  # e.g. a mask
            else:
                if graphs:  # a CUDA-graph replay frees what the last one returned
                    # (pytorch#152887): copy out what a step made (the position), not the caches
                    state = tuple(t.clone() if torch.is_tensor(t) and t.data_ptr() not in fixed
                                  else t for t in state)
                    torch.compiler.cudagraph_mark_step_begin()
                logits, state = step(idx[:, -1:], state)
            w_prev = w
            idx = torch.cat([idx, sample_next(logits, temperature, top_k)], dim=1)
        self.train(was_training)
        return idx


def window_start(n, block_size):
    """First index of the context window over n tokens: 0 while n <= block_size; beyond, it
    restarts from the last h = block_size // 2 tokens and grows back (one prefill per
    block_size − h + 1 tokens)."""
    if n <= block_size:
        return 0
    h = max(block_size // 2, 1)  # tokens kept when the window restarts
    return n - h - (n - block_size - 1) % (block_size - h + 1)


def sample_next(logits, temperature=1.0, top_k=None):
    """logits (B, V) -> next ids (B, 1) drawn from softmax(logits / temperature), restricted to the
    top_k largest logits; temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    # shifted so the largest is 0 first: a tiny temperature then sends the others to -inf, the
    # greedy limit, where logits / temperature alone would overflow to inf and softmax give NaN;
    # in fp64, where every positive temperature a flag can hold is > 0 (in fp32 1e-300 is 0)
    logits = logits.double()
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))  # (B, k)
        logits[logits < v[:, [-1]]] = -float("inf")
    return torch.multinomial(F.softmax(logits, dim=-1).float(), num_samples=1)


class Model(LM):
    """The dense GPT baseline (`--model gpt`)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.init_weights()

    def forward(self, idx, targets=None, sparse=False):
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits, loss = self.head(x, targets)
        return logits, loss, ({"lm_loss": loss.detach()} if loss is not None else {})

    @torch.no_grad()
    def prefill(self, idx):
        """idx (B, T) -> (logits (B, V) of the last position, state = (caches, position))."""
        x, caches = self.embed(idx), []  # (B, T, C)
        for block in self.blocks:
            x, cache = block.prefill(x, self.cfg.block_size)
            caches.append(cache)
        pos = torch.tensor(idx.size(1), device=idx.device)
        return self.head(x[:, -1:])[0][:, -1], (caches, pos)

    @torch.no_grad()
    def step(self, tok, state):
        """tok (B, 1) at the state's position (a 0-d tensor) -> (logits (B, V), state)."""
        caches, pos = state
        x = self.wte(tok) + self.wpe(pos)  # (B, 1, C)
        mask = past_mask(pos, self.cfg.block_size, caches[0].k.dtype)  # (1, S)
        for block, cache in zip(self.blocks, caches):
            x = block.step(x, cache, pos, mask)
        return self.head(x)[0][:, -1], (caches, pos + 1)


class KVCache:
    """K, V of one layer preallocated to block_size positions. A step writes at a position held in
    a tensor and reads the whole buffer under past_mask: fixed shapes, so one compiled graph."""

    def __init__(self, B, block_size, k, v):
        nh, T, hs = k.shape[1:]
        self.k = k.new_zeros(B, nh, block_size, hs)  # (B, nh, S, hs)
        self.v = v.new_zeros(B, nh, block_size, hs)
        self.k[:, :, :T], self.v[:, :, :T] = k, v
        for t in (self.k, self.v):  # written in place inside a CUDA graph: a fixed address
            torch._dynamo.mark_static_address(t)

    def append(self, pos, k, v):
        """Write k, v (B, nh, 1, hs) at pos (0-d); return the buffers (B, nh, S, hs)."""
        self.k.index_copy_(2, pos.view(1), k)
        self.v.index_copy_(2, pos.view(1), v)
        return self.k, self.v


def cond(pred, true_fn, false_fn, operands=()):
    """A routed decode step's branch on a decision (a bool tensor pred): compiled, torch.cond, both
    branches in one graph; eager, the host reads pred and runs one branch, so the other's work is
    skipped, as the papers' inference rules say."""
    if torch.compiler.is_compiling():
        return torch.cond(pred, true_fn, false_fn, operands)
    return true_fn(*operands) if pred else false_fn(*operands)


def past_mask(pos, S, dtype):
    """(1, S) additive attention mask in the cache's dtype: 0 at 0..pos, −inf after."""
    future = torch.arange(S, device=pos.device) > pos  # (S,)
    return torch.zeros(1, S, dtype=dtype, device=pos.device).masked_fill_(future, float("-inf"))


# --------------------------------------------------------------------------------------------------
# 3. Compute accounting. FLOPs are forward multiply-adds × 2, per token, per layer.

def tlops_saving(alpha, n_layer):
    """TSA eq. (7): Δ = 1 − (1 + (L−1)α)/L, the stem counted in both; α the mean active fraction."""
    return 1.0 - (1.0 + (n_layer - 1) * alpha) / n_layer


def flops_qkv(d):
    return 2 * 3 * d * d


def flops_attn_out(d):
    return 2 * d * d


def flops_attn_scores(d, n):
    return 2 * 2 * d * n  # q·k over n keys, then the weighted sum of n values


def flops_ffn(d, hidden):
    return 2 * 2 * d * hidden


def flops_lm_head(d, vocab):
    return 2 * d * vocab


def mean_context(T):
    """Average number of keys a causal query sees in a length-T sequence."""
    return (T + 1) / 2


def dense_flops_per_token(cfg, T):
    d = cfg.n_embd
    attn = flops_qkv(d) + flops_attn_out(d) + flops_attn_scores(d, mean_context(T))
    layer = attn + flops_ffn(d, 4 * d)
    return cfg.n_layer * layer + flops_lm_head(d, cfg.vocab_size)


def train_flops(flops_per_token, tokens):
    """FLOPs of a training step over `tokens` tokens: the forward, and a backward of twice its
    FLOPs (a gradient for the input and one for the weights of each matmul). A frozen weight
    (conddepth's controller-only setting) has no weight gradient: there this overcounts."""
    return 3 * flops_per_token * tokens


# Peak dense FLOP/s by GPU and dtype, from the vendors' datasheets. NVIDIA's tables print the
# tensor-core figures with 2:4 structured sparsity ("*: with sparsity"), twice the dense ones:
# the numbers below are the dense halves. fp32: the CUDA-core FP32 figure (no TF32). bf16/fp16:
# tensor cores with FP32 accumulation (GeForce cards run that at half their FP16-accumulate
# rate). V100 and T4 have no bf16 (autocast runs fp16 there). The first pattern that matches
# torch.cuda.get_device_name wins.
GPU_PEAKS = (  # (regex, {dtype: FLOP/s})
    (r"H100.*PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),  # 1513 sparse
    (r"H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),  # SXM: 1979 sparse
    (r"H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),  # SXM: 1979 sparse
    (r"A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),  # 624 sparse
    (r"\bL4\b", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),  # 242 sparse
    (r"\bA10\b", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),  # 250 sparse
    # AWS's A10G: NVIDIA publishes no datasheet and third parties' tensor figures disagree
    # (62.5 to 125 TFLOPS), so only its FP32 (the A10's 9,216 CUDA cores) is given
    (r"A10G", {"fp32": 31.2e12}),
    (r"RTX 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "fp32": 82.6e12}),  # 330.3 sparse
    (r"RTX 3090(?! Ti)", {"bf16": 71e12, "fp16": 71e12, "fp32": 35.6e12}),  # 142 sparse
    (r"V100.*PCIE", {"fp16": 112e12, "fp32": 14e12}),
    (r"V100", {"fp16": 125e12, "fp32": 15.7e12}),  # SXM2
    (r"\bT4\b", {"fp16": 65e12, "fp32": 8.1e12}),
)


def peak_flops(device, dtype, peak=None):
    """The device's peak dense FLOP/s in dtype ('fp32', 'bf16', 'fp16'): `peak` when a user gives
    it (> 0), else GPU_PEAKS' entry for the GPU's name; None ("peak unknown") on a CPU, MPS, or a
    GPU or dtype not in the table: a made-up peak would make a made-up MFU."""
    if peak is not None:
        if not (isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0):
            raise NanorouteError(f"peak FLOP/s must be a positive number, got {peak!r}")
        return float(peak)
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    table = next((t for pattern, t in GPU_PEAKS if re.search(pattern, name, re.I)), {})
    return table.get(dtype)


def throughput(flops_per_token, tokens, seconds, peak):
    """A training step of `tokens` tokens in `seconds` -> (tokens/s, MFU: the share of the peak
    FLOP/s the step's executed FLOPs reached; None when the peak is unknown)."""
    tps = tokens / seconds
    return tps, (train_flops(flops_per_token, tps) / peak if peak else None)


def throughput_text(tps, mfu):
    """'12,345 tok/s, MFU 41.2%', or '12,345 tok/s, MFU: peak unknown' (a CPU, MPS, a GPU or
    dtype not in the table, and no peak given)."""
    return f"{tps:,.0f} tok/s, " + (f"MFU {mfu:.1%}" if mfu is not None else "MFU: peak unknown")


# --------------------------------------------------------------------------------------------------
# 4. Device, optimiser, checkpoints, evaluation

def check_device_name(name):
    """The devices the project supports: auto, cpu, cuda, cuda:N, mps (not meta, xla, ...)."""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", name):
        raise NanorouteError(f"device must be auto, cpu, cuda, cuda:N or mps, got {name!r}")


def cli(main):
    """A file's command line: main(argv); a NanorouteError is one `error:` line and exit 2; a reader
    of stdout that stops early (head) ends it quietly."""
    try:
        main(sys.argv[1:])
    except NanorouteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:  # Python's advice: stdout to devnull, or its last flush fails too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def pick_device(name="auto"):
    check_device_name(name)
    if name == "auto":
        mps = torch.backends.mps.is_available()
        name = "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    try:
        device = torch.device(name)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:
        raise NanorouteError(f"device {name!r} is not available here ({str(e).splitlines()[0]})")
    return device


# Numerics policy (every model file follows it; tests/conftest.py runs each contract under it):
# parameters and the residual stream are fp32; autocast runs the matmuls in bf16/fp16, whose
# deltas join the fp32 stream by type promotion; routers decide in fp32, so a decision does not
# depend on the dtype the blocks run in; recurrent state (Gated DeltaNet) accumulates in fp32;
# KV caches hold K/V in the dtype the projection produced.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_dtype(device):
    """What training uses on a device: bf16 on CUDA (fp16 without bf16 support), else fp32."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def autocast(device, dtype=None):
    """The autocast context for a device and a dtype name ('fp32': none; None: default_dtype)."""
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise NanorouteError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return nullcontext() if dtype == "fp32" else torch.autocast(device.type, dtype=DTYPES[dtype])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def make_optimizer(model, cfg, device):
    """AdamW; weight decay on the weights of linear maps and convolutions only: not on biases,
    norms, 1-D gates or embedding tables (wte, wpe and the head tied to wte, a bare table such as
    conddepth's action embeddings), whatever their names."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    maps = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d))}
    decay, no_decay = [], []
    for p in model.parameters():               # yields the tied wte/lm_head weight once
        if not p.requires_grad:
            continue
        (decay if id(p) in maps - embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                             fused=device.type == "cuda")


def lr_at(it, cfg):
    """Linear warm-up, then cosine to min_lr at max_iters."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / cfg.warmup_iters
    ratio = (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    return cosine(ratio, cfg.learning_rate, cfg.min_lr)


def cosine(ratio, hi, lo):
    """Half a cosine from hi (ratio 0) down to lo (ratio >= 1)."""
    return lo + 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio))) * (hi - lo)


def save_checkpoint(path, **state):
    """Atomic (atomic_write): a crash mid-write leaves the previous checkpoint intact."""
    atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path):
    if not os.path.isfile(path):
        where = " (a directory)" if os.path.isdir(path) else ""
        raise NanorouteError(f"checkpoint {path} not found" + where)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an empty file raises EOFError with no message
        if "Unsupported global" in str(e):  # pickled objects: loading them could run code
            raise NanorouteError(f"checkpoint {path} is not weights-only: it holds pickled "
                                 "objects, whose loading can run any code, so it is refused "
                                 "(nanoroute's checkpoints hold tensors and plain values)")
        # not torch's advice to load it with weights_only=False
        why = "" if "weights_only" in str(e) else (str(e).splitlines() or [""])[0][:120]
        raise NanorouteError(f"checkpoint {path} is corrupt or not a nanoroute checkpoint "
                             f"({type(e).__name__}{': ' + why if why else ''})")
    if not (isinstance(ckpt, dict) and "model" in ckpt and isinstance(ckpt.get("config"), dict)):
        raise NanorouteError(f"checkpoint {path} has no model/config: not a nanoroute checkpoint")
    return ckpt


def eval_rng(seed, split, k):
    """The k-th evaluation batch of a split, the same in every run with this seed."""
    return np.random.default_rng([seed, 1 + ("train", "val", "test").index(split), k])


@torch.no_grad()
def estimate_loss(model, data, meta, cfg, device, split="val", sparse=False):
    """Mean LM loss, accuracy and routing stats (floats) over cfg.eval_iters fixed batches."""
    was_training = model.training
    model.eval()
    sums = {}
    seed = cfg.eval_seed if cfg.eval_seed >= 0 else cfg.seed
    for k in range(cfg.eval_iters):
        rng = eval_rng(seed, split, k)
        x, y = get_batch(data, meta, cfg.batch_size, cfg.block_size, rng, device)
        with autocast(device):
            logits, loss, stats = model(x, y, sparse=sparse)
        mask = y >= 0
        stats = {"loss": stats.get("lm_loss", loss), **stats,
                 "acc": ((logits.argmax(-1) == y) & mask).sum() / mask.sum()}
        for name, v in stats.items():
            if torch.is_tensor(v) and v.numel() == 1:
                sums[name] = sums.get(name, 0.0) + v.float()
    model.train(was_training)
    out = {name: (v / cfg.eval_iters).item() for name, v in sums.items()}
    out.pop("lm_loss", None)
    if meta.get("unit") in ("char", "byte"):
        out["bpc"] = out["loss"] / math.log(2)
    return out
