"""fineweb_edu: llm.c token shards downloaded from a server on 127.0.0.1 (resumed after an
interruption), checked, memory-mapped, and sampled in windows that never cross a shard's end."""
import functools
import hashlib
import http.server
import json
import os
import re
import threading

import numpy as np
import pytest
import torch

import common

VAL, TRAIN1, TRAIN2 = ("finewebedu_val_000000.bin", "finewebedu_train_000001.bin",
                       "finewebedu_train_000002.bin")
HUB_PATH = "/datasets/kjj0/finewebedu10B-gpt2/resolve/main/"


def shard_bytes(tokens, magic=common.SHARD_MAGIC, version=1, count=None):
    """llm.c's format: 256 int32 (magic, version, token count, zeros), then the uint16 tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    return header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes()


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 50257, n).astype(np.uint16)


class RangeServer:
    """Serves self.files[name] under the Hub's path on 127.0.0.1, honouring `Range: bytes=a-`;
    self.cut[name] = k: the next response for name stops after k bytes of its body (a dropped
    connection); self.misplaced: a range is answered from byte 0 (a broken mirror);
    self.no_ranges: Range is ignored (200 and the whole file, as HTTP allows).
    self.ranges: the Range header of each request (None: none)."""

    def __init__(self):
        self.files, self.cut, self.ranges = {}, {}, []
        self.misplaced = self.no_ranges = False
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                name = self.path[len(HUB_PATH):] if self.path.startswith(HUB_PATH) else None
                outer.ranges.append(self.headers.get("Range"))
                if name not in outer.files:
                    self.send_error(404)
                    return
                body, start = outer.files[name], 0
                m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if m and not outer.no_ranges:
                    start = 0 if outer.misplaced else int(m.group(1))
                    if start >= len(body):
                        self.send_error(416)
                        return
                    self.send_response(206)
                    self.send_header("Content-Range",
                                     f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                self.wfile.write(body[start:start + outer.cut.pop(name, len(body))])

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def hub(monkeypatch):
    """A Hub on 127.0.0.1 holding a val shard of 3,000 tokens and two training shards (4,000 and
    2,500), reached the way users reach a mirror: NANOROUTE_HF_URL."""
    monkeypatch.setattr(common.time, "sleep", lambda s: None)  # no back-off waits in tests
    s = RangeServer()
    s.toks = {VAL: tokens(3000, 0), TRAIN1: tokens(4000, 1), TRAIN2: tokens(2500, 2)}
    s.files = {name: shard_bytes(t) for name, t in s.toks.items()}
    monkeypatch.setenv("NANOROUTE_HF_URL", s.url + "/")
    yield s
    s.httpd.shutdown()


def test_download_prepares_the_shards_once_and_reads_them(hub, tmp_path, capsys):
    meta = common.prepare("fineweb_edu", str(tmp_path), shards=2)
    assert meta == {"dataset": "fineweb_edu", "vocab_size": 50257, "encoding": "r50k_base",
                    "unit": "token", "shards": {"train": [TRAIN1, TRAIN2], "val": [VAL]},
                    "train_tokens": 6500, "val_tokens": 3000}
    base = hub.url + HUB_PATH  # prepare says what it fetches, from where, and what it produced
    assert capsys.readouterr().out == (
        f"downloading {VAL} (1/3) from {base}\ndownloading {TRAIN1} (2/3) from {base}\n"
        f"downloading {TRAIN2} (3/3) from {base}\nprepared fineweb_edu: 2 training shard(s), "
        "train_tokens 6,500, val_tokens 3,000, vocab_size 50,257\n")
    assert common.load_meta("fineweb_edu", str(tmp_path)) == meta  # what other ranks read
    val = common.load_split("fineweb_edu", "val", str(tmp_path))
    assert isinstance(val, np.memmap) and np.array_equal(val, hub.toks[VAL])
    train = common.load_split("fineweb_edu", "train", str(tmp_path))
    assert [np.array_equal(a, hub.toks[n]) for a, n in zip(train.arrays, (TRAIN1, TRAIN2))] \
        == [True, True] and len(train) == 6500
    assert all(isinstance(a, np.memmap) for a in train.arrays)  # never the corpus in RAM
    assert sorted(os.listdir(tmp_path / "fineweb_edu")) == sorted([VAL, TRAIN1, TRAIN2,
                                                                  "meta.json"])
    n = len(hub.ranges)
    common.prepare("fineweb_edu", str(tmp_path), shards=2)
    assert len(hub.ranges) == n  # downloaded once
    common.prepare("fineweb_edu", str(tmp_path), shards=1)  # fewer shards: meta names those
    assert len(common.load_split("fineweb_edu", "train", str(tmp_path))) == 4000


def test_header_is_read_as_int32(tmp_path):
    """Read as int64, magic and version fuse into one number and the count lands on a zero."""
    path = str(tmp_path / VAL)
    with open(path, "wb") as f:
        f.write(shard_bytes(np.arange(7)))
    assert np.array_equal(common.read_shard(path), np.arange(7))


def test_an_interrupted_download_resumes_where_it_stopped(hub, tmp_path, monkeypatch):
    # chunks of 1,000 bytes (1 MB in use): what a dropped connection keeps is whole chunks
    monkeypatch.setattr(common, "download", functools.partial(common.download, chunk=1000))
    hub.cut[TRAIN1] = 3000  # the connection drops after 3,000 of 9,024 bytes
    common.prepare("fineweb_edu", str(tmp_path), shards=1)  # retries continue the .part file
    assert hub.ranges == [None, None, "bytes=3000-"]  # val whole; train1 cut, then continued
    train = common.load_split("fineweb_edu", "train", str(tmp_path))
    assert np.array_equal(train, hub.toks[TRAIN1])
    assert not any(f.endswith(".part") for f in os.listdir(tmp_path / "fineweb_edu"))


def test_a_resumable_download_that_fails_every_try_keeps_its_part_for_the_next_run(hub,
                                                                                   tmp_path):
    """resume=True: the bytes a failed run fetched stay in the .part (a shard is ~200 MB), and
    the next run continues them; without resume a failed download leaves nothing."""
    url, dest = hub.url + HUB_PATH + TRAIN1, str(tmp_path / TRAIN1)
    for resume in (False, True):
        hub.cut[TRAIN1] = 3000  # the connection drops after 3,000 of 9,024 bytes
        with pytest.raises(common.NanorouteError, match="IncompleteRead\\(3000 bytes read"):
            common.download(url, dest, retries=1, resume=resume, chunk=1000)
        assert os.listdir(tmp_path) == ([TRAIN1 + ".part"] if resume else [])
    assert open(dest + ".part", "rb").read() == hub.files[TRAIN1][:3000]
    common.download(url, dest, resume=True)
    assert hub.ranges[-1] == "bytes=3000-" and open(dest, "rb").read() == hub.files[TRAIN1]


def test_a_part_file_left_by_a_killed_run_is_continued(hub, tmp_path):
    d = tmp_path / "fineweb_edu"
    os.makedirs(d)
    (d / VAL).write_bytes(hub.files[VAL])
    (d / (TRAIN1 + ".part")).write_bytes(hub.files[TRAIN1][:5000])
    common.prepare("fineweb_edu", str(tmp_path), shards=1)
    assert hub.ranges == ["bytes=5000-"]
    assert (d / TRAIN1).read_bytes() == hub.files[TRAIN1]


def test_a_part_file_that_does_not_fit_starts_again(hub, tmp_path):
    d = tmp_path / "fineweb_edu"
    os.makedirs(d)
    (d / VAL).write_bytes(hub.files[VAL])
    (d / (TRAIN1 + ".part")).write_bytes(b"x" * 20000)  # longer than the file: 416
    common.prepare("fineweb_edu", str(tmp_path), shards=1)
    assert hub.ranges == ["bytes=20000-", None]
    assert (d / TRAIN1).read_bytes() == hub.files[TRAIN1]


def test_a_range_answered_from_elsewhere_starts_again(hub, tmp_path):
    d = tmp_path / "fineweb_edu"
    os.makedirs(d)
    (d / VAL).write_bytes(hub.files[VAL])
    (d / (TRAIN1 + ".part")).write_bytes(hub.files[TRAIN1][:5000])
    hub.misplaced = True  # 206 with bytes 0-9023: appended, it would duplicate the first 5,000
    common.prepare("fineweb_edu", str(tmp_path), shards=1)
    assert hub.ranges == ["bytes=5000-", None]
    assert (d / TRAIN1).read_bytes() == hub.files[TRAIN1]


@pytest.mark.parametrize("misplaced,why", [
    (False, "the partial download does not fit the file: starting again"),
    (True, "asked for bytes 5000- and got 'bytes 0-9023/9024': starting again")],
    ids=["416", "misplaced"])
def test_a_part_that_cannot_be_continued_is_dropped_saying_why(hub, tmp_path, misplaced, why):
    """A part longer than the file (416), or a range answered from byte 0: the part is deleted
    and the try fails with the reason (the next try starts again from byte 0)."""
    dest = str(tmp_path / TRAIN1)
    open(dest + ".part", "wb").write(hub.files[TRAIN1][:5000] if misplaced else b"x" * 20000)
    hub.misplaced = misplaced
    url = hub.url + HUB_PATH + TRAIN1
    with pytest.raises(common.NanorouteError) as e:
        common.download(url, dest, retries=1, resume=True, hint="do this")
    assert str(e.value) == f"could not download {url} (OSError: {why}); do this"
    assert os.listdir(tmp_path) == []


def test_a_server_without_ranges_sends_the_whole_file_and_it_replaces_the_part(hub, tmp_path):
    d = tmp_path / "fineweb_edu"
    os.makedirs(d)
    (d / VAL).write_bytes(hub.files[VAL])
    (d / (TRAIN1 + ".part")).write_bytes(hub.files[TRAIN1][:5000])
    hub.no_ranges = True
    common.prepare("fineweb_edu", str(tmp_path), shards=1)
    assert hub.ranges == ["bytes=5000-"]
    assert (d / TRAIN1).read_bytes() == hub.files[TRAIN1]


def test_a_resumed_download_checks_the_sha256_of_the_whole_file(hub, tmp_path, monkeypatch):
    """The hash covers the bytes already in the .part file, not just the ones fetched now."""
    body = hub.files[TRAIN1]
    dest = str(tmp_path / "f.bin")
    open(dest + ".part", "wb").write(body[:5000])
    url, want = hub.url + HUB_PATH + TRAIN1, hashlib.sha256(body).hexdigest()
    sizes, sha256 = [], hashlib.sha256

    class Sha:  # records what is hashed at a time: a part file is read a chunk at a time
        def __init__(self):
            self.h = sha256()

        def update(self, b):
            sizes.append(len(b))
            self.h.update(b)

        def hexdigest(self):
            return self.h.hexdigest()
    monkeypatch.setattr(common.hashlib, "sha256", Sha)
    common.download(url, dest, sha256=want, resume=True, chunk=1000)
    assert hub.ranges == ["bytes=5000-"] and open(dest, "rb").read() == body
    assert sizes[:5] == [1000] * 5 and max(sizes) <= 1000 and sum(sizes) == len(body)
    other = str(tmp_path / "g.bin")
    open(other + ".part", "wb").write(b"y" * 5000)  # a part that is not this file's start
    got = sha256(b"y" * 5000 + body[5000:]).hexdigest()
    with pytest.raises(common.NanorouteError) as e:
        common.download(url, other, sha256=want, resume=True)
    assert str(e.value) == (f"{url}: sha256 mismatch (got {got[:12]}…, expected {want[:12]}…); "
                            f"place a good copy at {other}")
    assert not os.path.exists(other) and not os.path.exists(other + ".part")  # not kept


def test_offline_uses_the_shards_in_the_folder_and_never_touches_the_network(tmp_path):
    d = tmp_path / "fineweb_edu"
    os.makedirs(d)
    for name, seed in ((VAL, 0), (TRAIN1, 1)):
        (d / name).write_bytes(shard_bytes(tokens(500, seed)))
    meta = common.prepare("fineweb_edu", str(tmp_path), url="http://127.0.0.1:9/unreachable")
    assert (meta["train_tokens"], meta["val_tokens"]) == (500, 500)


def test_offline_without_the_shards_is_one_line_naming_the_files_and_the_folder(tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setattr(common.time, "sleep", lambda s: None)
    with pytest.raises(common.NanorouteError) as e:
        common.prepare("fineweb_edu", str(tmp_path), url="http://127.0.0.1:9/mirrorX/")
    base, d = "http://127.0.0.1:9/mirrorX/", re.escape(str(tmp_path / "fineweb_edu"))
    assert re.fullmatch(rf"could not download {base}{VAL} \(ConnectionError: .*\); download "
                        rf"{VAL}, {TRAIN1} from {base} into {d}/ \(a \.part file there is "
                        r"continued\)", str(e.value)), str(e.value)


def test_a_mirror_url_is_used_with_or_without_its_slash_and_one_shard_is_the_default(hub,
                                                                                    tmp_path):
    """prepare's url is the folder holding the shards; the Hub that NANOROUTE_HF_URL names is
    not asked then."""
    url = hub.url + HUB_PATH
    os.environ["NANOROUTE_HF_URL"] = "http://127.0.0.1:9"  # hub's monkeypatch restores it
    meta = common.prepare("fineweb_edu", str(tmp_path / "a"), url=url)
    assert meta["shards"] == {"train": [TRAIN1], "val": [VAL]}
    meta = common.prepare_fineweb(str(tmp_path / "b"), url=url.rstrip("/"))
    assert meta["shards"] == {"train": [TRAIN1], "val": [VAL]}


@pytest.mark.parametrize("bad, why", [
    (shard_bytes(np.arange(100), magic=20240521), "not an llm.c token shard"),
    (shard_bytes(np.arange(100), version=2), "not an llm.c token shard"),
    (shard_bytes(np.arange(100))[:600], "1,024-byte header"),
    (shard_bytes(np.arange(100))[:-2], "header says 100 tokens"),  # a truncated body
    (shard_bytes(np.arange(100), count=101), "header says 101 tokens"),
    (shard_bytes(np.arange(100)) + b"\0\0", "header says 100 tokens"),  # a longer body
], ids=["magic", "version", "short-header", "truncated", "count", "long"])
def test_a_damaged_shard_is_one_error_naming_the_file(tmp_path, bad, why):
    d = tmp_path / "fineweb_edu"
    os.makedirs(d)
    (d / VAL).write_bytes(shard_bytes(tokens(500, 0)))
    (d / TRAIN1).write_bytes(bad)
    with pytest.raises(common.NanorouteError, match=why) as e:
        common.prepare("fineweb_edu", str(tmp_path), url="http://127.0.0.1:9/unreachable")
    assert str(d / TRAIN1) in str(e.value) and "\n" not in str(e.value)



def test_a_shard_is_read_by_its_header_alone_and_named_when_unreadable(tmp_path, monkeypatch):
    """read_shard reads 256 int32 of the header (a shard is ~200 MB: never the whole file into
    RAM); a bad shard says what to do; a path it cannot read is one line with the OS's reason."""
    path = str(tmp_path / VAL)
    with open(path, "wb") as f:
        f.write(shard_bytes(np.arange(3000)))
    counts, fromfile = [], np.fromfile
    monkeypatch.setattr(np, "fromfile", lambda *a, **kw: counts.append(kw.get("count", -1))
                        or fromfile(*a, **kw))
    shard = common.read_shard(path)
    assert len(shard) == 3000 and counts == [256]
    assert not shard.flags.writeable  # mapped read-only: a stray write cannot damage the data
    with open(path, "wb") as f:
        f.write(shard_bytes(np.arange(10), version=2))
    with pytest.raises(common.NanorouteError) as e:
        common.read_shard(path)
    assert str(e.value).endswith(f"; delete it and run again to download it, or put a good copy "
                                 f"at {path}")
    assert str(e.value).startswith(f"{path} is not an llm.c token shard (its header starts "
                                   f"{common.SHARD_MAGIC}, 2, not magic 20240520, version 1)")
    with open(path, "wb") as f:
        f.write(shard_bytes(np.arange(10), count=100))
    with pytest.raises(common.NanorouteError, match=f"^{re.escape(path)} has 1,044 bytes, but "
                       r"its header says 100 tokens \(1,224 bytes\): it is damaged; delete"):
        common.read_shard(path)
    with open(path, "wb") as f:
        f.write(shard_bytes([]))  # no tokens: valid, and empty
    assert len(common.read_shard(path)) == 0
    with pytest.raises(common.NanorouteError) as e:
        common.read_shard(str(tmp_path))
    assert str(e.value) == f"{tmp_path} cannot be read (Is a directory)"

def test_a_split_without_shards_in_meta_json_is_refused_saying_what_to_run(tmp_path):
    d = tmp_path / "fineweb_edu"
    os.makedirs(d)
    (d / TRAIN1).write_bytes(shard_bytes(tokens(500, 1)))
    meta = {"dataset": "fineweb_edu", "vocab_size": 50257, "encoding": "r50k_base",
            "shards": {"train": [TRAIN1]}, "train_tokens": 500, "val_tokens": 0}
    (d / "meta.json").write_text(json.dumps(meta))
    assert len(common.load_split("fineweb_edu", "train", str(tmp_path))) == 500
    with pytest.raises(common.NanorouteError) as e:
        common.load_split("fineweb_edu", "val", str(tmp_path))
    assert str(e.value) == (f"{d / 'meta.json'} names no val shards; run train.py --dataset "
                            "fineweb_edu to prepare it")


def test_a_shard_damaged_after_preparation_is_refused_when_loaded(hub, tmp_path):
    common.prepare("fineweb_edu", str(tmp_path), shards=2)
    path = tmp_path / "fineweb_edu" / TRAIN2
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(common.NanorouteError, match=re.escape(str(path))):
        common.load_split("fineweb_edu", "train", str(tmp_path))


def test_windows_never_cross_a_shard_end():
    """Shard s holds only the token s: a window across an end would mix two values."""
    shards = common.Shards([np.full(n, s, dtype=np.uint16) for s, n in enumerate((40, 9, 25))])
    rng = np.random.default_rng(0)
    for _ in range(200):
        x, y = common.get_batch(shards, {}, 16, 8, rng)
        assert x.shape == y.shape == (16, 8) and x.dtype == torch.int64
        w = torch.cat([x, y[:, -1:]], 1)  # (B, T + 1)
        assert (w == w[:, :1]).all()


def test_windows_are_y_shifted_x_and_reach_every_start():
    """Every window (start) of every shard is drawn, the last included; y = x shifted by one."""
    a, b = np.arange(0, 12, dtype=np.uint16), np.arange(100, 110, dtype=np.uint16)
    c = np.arange(200, 207, dtype=np.uint16)
    shards = common.Shards([a, b, c])
    x, y = shards.batch(4000, 4, np.random.default_rng(1))
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:, -1], x[:, -1] + 1)
    starts = set(x[:, 0].tolist())
    assert starts == set(range(0, 12 - 5 + 1)) | set(range(100, 100 + 10 - 5 + 1)) \
        | set(range(200, 200 + 7 - 5 + 1))  # windows of 5 tokens


def test_shards_are_drawn_in_proportion_to_their_windows():
    """Uniform over windows: a shard of 1,005 tokens holds 1,000 windows of 6, one of 105 holds
    100, so it is drawn 10/11 of the time (a uniform choice of shard would give 1/2)."""
    shards = common.Shards([np.zeros(1005, dtype=np.uint16), np.ones(105, dtype=np.uint16)])
    x, _ = shards.batch(20000, 5, np.random.default_rng(2))
    share = (x[:, 0] == 0).float().mean().item()
    assert abs(share - 10 / 11) < 0.01, share


def test_block_size_longer_than_every_shard_is_refused():
    shards = common.Shards([np.zeros(10, dtype=np.uint16), np.zeros(12, dtype=np.uint16)])
    with pytest.raises(common.NanorouteError, match="longer than every shard"):
        shards.batch(2, 12, np.random.default_rng(0))


def test_meta_decodes_gpt2_tokens(hub, tmp_path):
    meta = common.prepare("fineweb_edu", str(tmp_path), shards=1)
    ids = common.bpe().encode_ordinary("Photosynthesis converts light into energy.")
    assert common.decode(meta, ids) == "Photosynthesis converts light into energy."
    assert meta["encoding"] == "r50k_base"  # what --init_from gpt2 requires of a dataset


def test_fineweb_files_are_the_val_shard_and_the_first_training_ones():
    assert common.fineweb_files() == {"train": [TRAIN1], "val": [VAL]}
    assert common.fineweb_files(3)["train"] == [TRAIN1, TRAIN2, "finewebedu_train_000003.bin"]


def test_shards_must_be_a_positive_integer(tmp_path):
    for bad in (0, -1, 1.5, "2", True):  # a bool is no count, though Python's bool is an int
        with pytest.raises(common.NanorouteError, match="shards must be an integer >= 1"):
            common.prepare("fineweb_edu", str(tmp_path), shards=bad)


def test_hf_url_is_the_hub_unless_the_environment_names_another(monkeypatch):
    monkeypatch.delenv("NANOROUTE_HF_URL", raising=False)
    assert common.hf_url() == "https://huggingface.co"
    monkeypatch.setenv("NANOROUTE_HF_URL", "http://mirror.example/")
    assert common.hf_url() == "http://mirror.example"
    monkeypatch.setenv("NANOROUTE_HF_URL", "http://mirror.example/hubX//")  # only "/" stripped
    assert common.hf_url() == "http://mirror.example/hubX"


TINY = ["--model=tsa", "--n_layer=2", "--n_head=2", "--n_embd=16", "--block_size=16",
        "--batch_size=2", "--eval_iters=1", "--eval_interval=2", "--log_interval=1",
        "--max_iters=2", "--warmup_iters=1", "--hard_ft_iters=1", "--device=cpu"]


def test_train_py_runs_on_fineweb_edu_through_the_server_then_from_the_folder(hub, tmp_path,
                                                                              capsys):
    import train
    data = tmp_path / "data"
    train.main(TINY + ["--dataset=fineweb_edu", f"--data_dir={data}", f"--out_dir={tmp_path}/a",
                       "--shards=2"])
    out = capsys.readouterr().out
    assert "train_tokens 6,500" in out and "step 2: train loss" in out  # both shards
    run = json.load(open(tmp_path / "a" / "config.json"))
    assert (run["dataset"], run["vocab_size"], run["shards"]) == ("fineweb_edu", 50257, 2)
    train.main(["--sample", str(tmp_path / "a"), "--prompt", "The cell", "--num_tokens=3",
                "--device=cpu"])  # a prompt in GPT-2's BPE
    assert "sample:\nThe cell" in capsys.readouterr().out
    os.environ["NANOROUTE_HF_URL"] = "http://127.0.0.1:9"  # offline: the shards there suffice
    train.main(TINY + ["--dataset=fineweb_edu", f"--data_dir={data}", f"--out_dir={tmp_path}/b"])
    assert "step 2: train loss" in capsys.readouterr().out
