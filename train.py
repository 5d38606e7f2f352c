"""
Train any nanoroute model on any dataset.

  python train.py --model tsa --dataset shakespeare
  python train.py --model dtrnet --dataset shakespeare --preset paper --max_iters=500
  python train.py --model gpt --dataset shakespeare --resume          # continue out/gpt-shakespeare
  torchrun --standalone --nproc_per_node=2 train.py --model gpt       # DDP (gloo on CPU, nccl on CUDA)
  python train.py --model tsa --preset classroom                       # ~3 minutes on a laptop CPU
  python train.py --sample out/tsa-shakespeare --prompt "ROMEO:" --num_tokens 300 --temperature 0.8 --top_k 200

Every Config field is a flag (--key=value or --key value); the model file's Config has the defaults and
its PRESETS dict the named presets. Order: defaults < preset < flags. Each eval writes one JSON line to
out/<run>/metrics.jsonl and an atomic checkpoint (ckpt.pt: the latest, for --resume; best.pt: the weights
with the best val loss); --resume continues exactly where the last one left off. The run ends with a
summary: hard (what inference runs) vs soft loss, vs a dense GPT of the same preset in out/, work really
skipped per layer, sparse vs dense speed measured on the spot, the routing picture, and a sample.
"""
import dataclasses
import html
import importlib
import json
import os
import sys
import time

import numpy as np
import torch

import common
from common import NanorouteError

MODELS = {"gpt": "common", "tsa": "tsa", "dtrnet": "dtrnet", "conddepth": "conddepth", "hybrid": "hybrid_attn"}
FLAGS = ("model", "dataset", "preset", "resume")  # the flags that are not Config fields


def parse_value(name, typ, text):
    """A flag's text -> typ; a bare --name (text None) is True for a bool, a one-line error for the rest."""
    if text is None and typ is not bool:
        raise NanorouteError(f"--{name} needs a value")
    if typ is bool:
        if text is None or text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
    else:
        try:
            return typ(text)
        except ValueError:
            pass
    raise NanorouteError(f"--{name} expects {typ.__name__}, got {text!r}")


def split_flags(argv):
    """['--a=1', '--b', '2', '--c'] -> [('a', '1'), ('b', '2'), ('c', None)]; anything else is a one-line error."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise NanorouteError(f"unexpected argument {arg!r}; flags look like --key=value")
        key, eq, val = arg[2:].partition("=")
        if not eq:  # --key value, or a bare boolean --key
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            val = argv[i + 1] if has_value else None
            i += has_value
        pairs.append((key, val))
        i += 1
    return pairs


def parse_args(argv):
    """argv -> (Config, model module, resume). Unknown keys and bad values are one-line errors."""
    opts = dict(split_flags(argv))
    name = opts.pop("model", None) or "gpt"
    if name not in MODELS:
        raise NanorouteError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    module = importlib.import_module(MODELS[name])
    dataset = opts.pop("dataset", None) or "shakespeare"
    if dataset not in common.DATASETS:
        raise NanorouteError(f"unknown dataset {dataset!r}; choose one of {', '.join(common.DATASETS)}")
    resume = parse_value("resume", bool, opts.pop("resume", "false"))
    preset, presets = opts.pop("preset", None), getattr(module, "PRESETS", {})
    if preset is not None and preset not in presets:
        raise NanorouteError(f"unknown preset {preset!r} for --model {name}; choose one of "
                             f"{', '.join(presets) or '(none)'}")
    values = dict(presets[preset]) if preset is not None else {}  # defaults < preset < flags
    fields = {f.name: f for f in dataclasses.fields(module.Config)}
    for key, val in opts.items():
        if key not in fields:
            raise NanorouteError(f"unknown option --{key}; valid: --{', --'.join(list(FLAGS) + sorted(fields))}")
        values[key] = parse_value(key, fields[key].type, val)
    values.update(model=name, dataset=dataset)
    return module.Config(**values), module, resume


def resolve(cfg, meta):
    """Fill what the data decides: vocabulary, and for copy/sort the record length."""
    changes = {"vocab_size": meta["vocab_size"],
               "out_dir": cfg.out_dir or os.path.join("out", f"{cfg.model}-{cfg.dataset}")}
    if "record_len" in meta and cfg.block_size != meta["record_len"] - 1:
        changes["block_size"] = meta["record_len"] - 1
        print(f"note: {cfg.dataset} trains on whole records: block_size {cfg.block_size} -> {changes['block_size']}")
    return dataclasses.replace(cfg, **changes)


def check_fits(cfg, meta):
    """Refuse, before anything is written, windows the data or the memory cannot hold."""
    val_tokens = meta.get("val_tokens", 0)
    if "record_len" not in meta and 2 * cfg.block_size > val_tokens:
        raise NanorouteError(f"block_size={cfg.block_size} is more than half of {cfg.dataset}'s validation split "
                             f"({val_tokens:,} tokens): too few distinct windows to evaluate on")
    scores = cfg.batch_size * cfg.n_head * cfg.block_size ** 2 * 4 * 3  # fp32 attention scores, fwd + bwd
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    if ram and scores > ram / 2:
        raise NanorouteError(f"block_size={cfg.block_size} with batch_size={cfg.batch_size}: one layer's attention "
                             f"would need ~{scores / 2 ** 30:.0f} GiB, more than half of this machine's memory")
    parent = cfg.out_dir
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise NanorouteError(f"--out_dir {cfg.out_dir}: {parent} is a file, not a directory")


def build(module, cfg):
    """The model a Config asks for: a module's build(cfg) when it has variants in their own classes
    (tsa: the early-exit baseline), else its Model(cfg)."""
    return getattr(module, "build", module.Model)(cfg)


def write_atomic(path, text):
    """Write text to path via a temporary file: a crash mid-write leaves the previous file intact."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def train(cfg, module, resume=False):
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    device = common.pick_device(cfg.device)
    if ddp:
        if device.type == "cuda":
            device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
            torch.cuda.set_device(device)
        torch.distributed.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    master = rank == 0
    log = print if master else (lambda *a, **k: None)

    meta = common.prepare(cfg.dataset, cfg.data_dir) if master else None
    if ddp:
        torch.distributed.barrier()
        meta = common.load_meta(cfg.dataset, cfg.data_dir)
    init = None
    if cfg.init_from:  # another run's or GPT-2's weights, and their architecture
        cfg, init = start_from(cfg, module, meta, master, ddp)
    cfg = resolve(cfg, meta)
    check_fits(cfg, meta)
    refused = getattr(module, "COMPILE_REFUSED", {}).get(device.type)  # device type -> why compile is refused there
    if cfg.compile and refused:
        raise NanorouteError(f"--compile is refused for --model {cfg.model} on {device.type}: {refused}")
    train_data, val_data = (common.load_split(cfg.dataset, split, cfg.data_dir) for split in ("train", "val"))
    ckpt_path, best_path, metrics_path = (os.path.join(cfg.out_dir, f) for f in ("ckpt.pt", "best.pt", "metrics.jsonl"))

    torch.manual_seed(cfg.seed + rank)
    model = build(module, cfg).to(device)
    if init is not None:
        try:
            missing, unexpected = model.load_state_dict(init, strict=False)
        except RuntimeError as e:
            raise NanorouteError(f"--init_from {cfg.init_from} does not fit --model {cfg.model}: "
                                 f"{str(e).splitlines()[1].strip()}")
        if unexpected:
            raise NanorouteError(f"--init_from {cfg.init_from} has weights --model {cfg.model} lacks: {unexpected[:3]}")
        fresh = sorted({f"blocks.*.{k.split('.')[2]}" if k.startswith("blocks.") else
                        k.split(".")[0] for k in missing})  # routers, gates, cheap FFNs
        log(f"init from {cfg.init_from}: {len(missing)} new tensors ({', '.join(fresh) or 'none'})")
    optimizer = common.make_optimizer(model, cfg, device)
    start, best_val = 0, float("inf")
    if resume:
        ckpt = common.load_checkpoint(ckpt_path)
        for k in common.ARCH_FIELDS:
            if ckpt["config"].get(k, getattr(cfg, k)) != getattr(cfg, k):
                raise NanorouteError(f"checkpoint {ckpt_path} has {k}={ckpt['config'][k]} but this run asks for "
                                     f"{k}={getattr(cfg, k)}")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start, best_val = ckpt["iter"], ckpt["best_val_loss"]
        torch.set_rng_state(ckpt["rng_cpu"][rank])
        if device.type == "cuda" and "rng_cuda" in ckpt:
            torch.cuda.set_rng_state(ckpt["rng_cuda"][rank])
        if master:  # drop what the killed run logged after its checkpoint, so the log reads as one run
            keep = [r for r in map(json.loads, open(metrics_path)) if r["step"] < start or
                    (r["kind"] == "eval" and r["step"] == start)] if os.path.exists(metrics_path) else []
            write_atomic(metrics_path, "".join(json.dumps(r) + "\n" for r in keep))
        log(f"resuming {ckpt_path} at step {start}")
    elif master:
        write_atomic(metrics_path, "")  # a fresh log (and out_dir)
    if master:
        write_atomic(os.path.join(cfg.out_dir, "config.json"), json.dumps(dataclasses.asdict(cfg), indent=1))
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model,
                                                          device_ids=[device.index] if device.type == "cuda" else None)
    log(f"{cfg.model} on {cfg.dataset}: {raw_model.num_params() / 1e6:.2f}M parameters, device {device}, "
        f"{world} process(es), {cfg.max_iters} iters of {cfg.batch_size}×{cfg.block_size} tokens")

    def record(rec):  # called on the master only
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    t0, t_last = time.time(), time.time()
    for it in range(start, cfg.max_iters + 1):
        eval_now = (it % cfg.eval_interval == 0 or it == cfg.max_iters) and not (resume and it == start)
        if eval_now:
            rng = {"rng_cpu": _gather_rng(torch.get_rng_state(), ddp)}  # a collective: every rank joins
            if device.type == "cuda":
                rng["rng_cuda"] = _gather_rng(torch.cuda.get_rng_state(), ddp)
        if master and eval_now:
            ev = {split: common.estimate_loss(raw_model, data, meta, cfg, device, split)
                  for split, data in (("train", train_data), ("val", val_data))}
            val = ev["val"]
            log(f"step {it}: train loss {ev['train']['loss']:.4f}, val loss {val['loss']:.4f}"
                + (f" (soft {val['soft_loss']:.4f})" if "soft_loss" in val else "")
                + (f", skipped {val['skipped']:.0%}" if "skipped" in val else ""))
            record({"kind": "eval", "step": it, "time": round(time.time() - t0, 2),
                    "train_loss": ev["train"]["loss"], "val_loss": val["loss"],
                    **{f"val_{k}": v for k, v in val.items() if k != "loss"}})
            state = dict(model=raw_model.state_dict(), config=dataclasses.asdict(cfg), iter=it, val_loss=val["loss"])
            if val["loss"] < best_val:  # nanoGPT keeps the best weights: long presets overfit
                best_val = val["loss"]
                common.save_checkpoint(best_path, **state)
            common.save_checkpoint(ckpt_path, **state, optimizer=optimizer.state_dict(), best_val_loss=best_val, **rng)
        if it == cfg.max_iters:
            break
        if hasattr(raw_model, "on_step"):  # schedules that depend on the step (temperatures, label phases)
            raw_model.on_step(it)
        lr = raw_model.lr_at(it) if hasattr(raw_model, "lr_at") else common.lr_at(it, cfg)  # TSA: its last phase
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = common.get_batch(train_data, meta, cfg.batch_size, cfg.block_size,
                                np.random.default_rng([cfg.seed, 0, it, rank]), device)
        with common.autocast(device):
            _, loss, stats = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # the pre-clipping gradient norm is logged (conddepth's grad-norm tiers); grad_clip=0 only measures
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or float("inf"))
        optimizer.step()
        lossf = loss.item()
        if not np.isfinite(lossf):
            raise NanorouteError(f"loss became {lossf} at step {it}; lower --learning_rate or check the data")
        if master and it % cfg.log_interval == 0:
            dt = (time.time() - t_last) / (cfg.log_interval if it > start else 1)
            t_last = time.time()
            log(f"iter {it}/{cfg.max_iters}: loss {lossf:.4f}, {dt * 1000:.0f} ms/iter, "
                f"ETA {_duration(dt * (cfg.max_iters - it))}")
            record({"kind": "train", "step": it, "loss": lossf, "lr": lr, "grad_norm": grad_norm.item(),
                    **{k: v.item() for k, v in stats.items() if v.numel() == 1}})
    if ddp:
        torch.distributed.barrier()  # every rank is past its last collective before the group goes away
        torch.distributed.destroy_process_group()
    if master:
        log(f"done in {_duration(time.time() - t0)}; best val loss {best_val:.4f}")
        summary(raw_model, cfg, meta, val_data, device, metrics_path)
    return best_val


def start_from(cfg, module, meta, master=True, ddp=False):
    """--init_from -> (cfg with the checkpoint's architecture, its state dict). The checkpoint is
    another run's ckpt.pt, or a Hugging Face GPT-2: a Hub name (downloaded once into data/hf/NAME/)
    or a folder holding config.json + model.safetensors. A flag that contradicts the checkpoint is
    refused: a value other than the model's default (given, or set by a preset) was asked for."""
    src, gpt2 = cfg.init_from, common.is_hf_gpt2(cfg.init_from)
    if gpt2 and os.path.isfile(os.path.join(src, "ckpt.pt")):
        raise NanorouteError(f"--init_from {src} is a run: pass {os.path.join(src, 'ckpt.pt')}")
    if gpt2 and cfg.model == "hybrid":
        raise NanorouteError("--model hybrid cannot start from GPT-2: its Gated DeltaNet layers "
                             "have no GPT-2 weights, and GPT-2 with random mixers in place of its "
                             "attention is no trained model (route GPT-2 with tsa, dtrnet or "
                             "conddepth, or train the hybrid from scratch)")
    if gpt2 and getattr(cfg, "norm", "layernorm") != "layernorm":
        raise NanorouteError(f"--norm={cfg.norm} cannot load GPT-2, whose blocks use LayerNorm")
    if gpt2 and meta.get("encoding") != "r50k_base":
        raise NanorouteError(f"GPT-2 reads GPT-2's BPE tokens; --dataset {cfg.dataset} has a "
                             f"vocabulary of {meta['vocab_size']} {meta.get('unit', 'token')}s: use "
                             "--dataset shakespeare_bpe")

    def fetch(files):  # rank 0 downloads, the others wait for its files
        folder = common.gpt2_folder(src, cfg.data_dir, files if master else ())
        if ddp:
            torch.distributed.barrier()
        return folder

    if gpt2:
        arch, ckpt = common.gpt2_config(fetch(common.HF_FILES[:1])), None  # config.json: small
    else:
        ckpt = common.load_checkpoint(src)
        arch = {k: ckpt["config"][k] for k in common.ARCH_FIELDS if k in ckpt["config"]}
    if arch.get("vocab_size", meta["vocab_size"]) != meta["vocab_size"]:
        raise NanorouteError(f"--init_from {src} has a vocabulary of {arch['vocab_size']}, "
                             f"--dataset {cfg.dataset} one of {meta['vocab_size']}: use the "
                             "dataset it learned")
    defaults = {f.name: f.default for f in dataclasses.fields(module.Config)}
    if gpt2:  # the run's block_size stays: GPT-2's positions may be cropped (as nanoGPT does)
        n_pos = arch.pop("block_size")
        if cfg.block_size > n_pos:
            raise NanorouteError(f"--block_size={cfg.block_size} is longer than {src}'s {n_pos} "
                                 "positions")
        if cfg.block_size < n_pos and master:
            print(f"note: block_size {cfg.block_size} keeps the first {cfg.block_size} of {src}'s "
                  f"{n_pos} positions (--block_size={n_pos} for all of them)")
    for k, v in arch.items():
        if k != "vocab_size" and getattr(cfg, k) not in (v, defaults[k]):
            raise NanorouteError(f"--init_from {src} has {k}={v}, but this run asks for "
                                 f"{k}={getattr(cfg, k)}: drop --{k} (or the --preset setting it)")
    cfg = dataclasses.replace(cfg, **arch)
    if not gpt2:
        return cfg, ckpt["model"]
    return cfg, common.gpt2_state_dict(fetch(common.HF_FILES), cfg.n_layer, cfg.block_size)


def _duration(sec):
    sec = max(0, int(round(sec)))
    return f"{sec // 60}m{sec % 60:02d}s" if sec >= 60 else f"{sec}s"


def _gather_rng(state, ddp):
    """Every rank's RNG state, so a DDP run resumes exactly too."""
    if not ddp:
        return [state]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, state)
    return out


# ----------------------------------------------------------------------------------------------------
# The end of a run: what a user needs to trust the router, in words and numbers

def summary(model, cfg, meta, val_data, device, metrics_path):
    last = [r for r in map(json.loads, open(metrics_path)) if r["kind"] == "eval"][-1]
    hard, soft = last["val_loss"], last.get("val_soft_loss")
    print(f"\n== {cfg.model} on {cfg.dataset}: summary ==")
    print(f"val loss {hard:.4f}: what inference runs"
          + (f" (hard routing, sparse path); the training-mode (soft) model {soft:.4f}, so inference costs "
             f"{hard / soft - 1:+.1%}" if soft is not None else ""))
    if cfg.model != "gpt":
        dense = find_dense_run(cfg)
        print(f"dense GPT of the same preset ({dense[0]}): val {dense[1]:.4f}; this model is {hard / dense[1] - 1:+.1%}"
              if dense else "no dense GPT of the same preset in out/ to compare with (run train.py --model gpt "
              "with the same flags)")
    skips = sorted((int(k[len("val_skip_l"):]), v) for k, v in last.items() if k.startswith("val_skip_l"))
    if skips:
        print("work really skipped (share of tokens on the cheap path), per layer: "
              + ", ".join(f"layer {i} {v:.0%}" for i, v in skips)
              + f"; mean {sum(v for _, v in skips) / len(skips):.0%}"
              + (f"; forward FLOPs saved vs the dense GPT: {last['val_flops_saved_hard']:.1%}"
                 if "val_flops_saved_hard" in last else ""))
        print(speed_line(model, cfg, meta, val_data, device))
    files = [os.path.join(cfg.out_dir, f) for f in ("ckpt.pt", "best.pt", "metrics.jsonl")]
    if hasattr(model, "routing_map"):
        idx = torch.tensor(val_data[:min(cfg.block_size, 256)].astype(np.int64), device=device)[None]
        path = os.path.join(cfg.out_dir, "routing.html")
        print(picture(model, idx, meta, f"{cfg.model} routing on the first validation window", path))
        files.append(path)
    print("files: " + ", ".join(files))
    model.eval()
    if "record_len" in meta:  # copy/sort: complete a held-out record greedily
        prompt = torch.tensor(val_data[:common.TASK_LEN + 2].astype(np.int64), device=device)[None]
        out = model.generate(prompt, common.TASK_LEN + 1, temperature=0)
    else:
        prompt = torch.tensor(val_data[:1].astype(np.int64), device=device)[None]
        out = model.generate(prompt, 200, temperature=0.8, top_k=200)
    print("sample:\n" + common.decode(meta, out[0].tolist()))


def find_dense_run(cfg):
    """(run dir, final val loss) of a dense GPT in out/ trained with this run's data, sizes and budget."""
    same = ("dataset", "n_layer", "n_head", "n_embd", "block_size", "batch_size", "max_iters")
    root = os.path.dirname(os.path.abspath(cfg.out_dir))
    for name in sorted(os.listdir(root)):
        try:
            other = json.load(open(os.path.join(root, name, "config.json")))
            if other.get("model") == "gpt" and all(other.get(k) == getattr(cfg, k) for k in same):
                evals = [r for r in map(json.loads, open(os.path.join(root, name, "metrics.jsonl")))
                         if r["kind"] == "eval" and r["step"] == cfg.max_iters]
                if evals:
                    return os.path.join(root, name), evals[-1]["val_loss"]
        except (OSError, ValueError, KeyError):
            continue
    return None


def speed_line(model, cfg, meta, val_data, device, repeats=5):
    """Sparse vs dense-hard forward of this model, and vs a dense GPT of its size, timed now, interleaved."""
    x, _ = common.get_batch(val_data, meta, cfg.batch_size, cfg.block_size, common.eval_rng(0, "val", 0), device)
    gpt = common.Model(common.Config(**{k: getattr(cfg, k) for k in common.ARCH_FIELDS})).to(device).eval()
    model.eval()
    fns = {"sparse": lambda: model(x, sparse=True), "dense_hard": lambda: model(x), "gpt": lambda: gpt(x)}
    times = {k: [] for k in fns}
    with torch.no_grad(), common.autocast(device):
        for i in range(repeats + 2):
            for k, fn in fns.items():
                common.sync(device)
                t = time.perf_counter()
                fn()
                common.sync(device)
                if i >= 2:
                    times[k].append(time.perf_counter() - t)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return (f"speed, measured now (forward, batch {cfg.batch_size}×{cfg.block_size}, median of {repeats}): sparse "
            f"{med['sparse'] * 1e3:.1f} ms = {med['dense_hard'] / med['sparse']:.2f}× the same decisions computed "
            f"densely, {med['gpt'] / med['sparse']:.2f}× a dense GPT of the same size")


# ----------------------------------------------------------------------------------------------------
# The routing picture. Every router returns routing_map(idx (1, T)) -> (m (R, T) in [0, 1], row labels,
# (meaning of 0, meaning of 1)); 1 = the token took the expensive path there. One renderer draws them all.

CHEAP, COSTLY = (214, 234, 248), (239, 138, 54)  # light blue -> orange; black text stays readable on both


def _mix(a):
    return tuple(round(c0 + (c1 - c0) * a) for c0, c1 in zip(CHEAP, COSTLY))


def render_routing(meta, idx, m, rows, legend, title, path=None, color=True, width=96):
    """idx (T,) ids, m (R, T) in [0, 1] -> terminal text (ANSI colour, or a plain marker line under each
    line of text when color=False) and, if path is given, a self-contained HTML file written atomically."""
    toks = [common.decode(meta, [i]).replace("\n", "⏎\n") for i in idx]  # a newline shows as ⏎ and ends the line
    m = m.float().clamp(0, 1).tolist()
    out = [f"{title}   legend: {legend[0]} = light" + (" (blue)" if color else " '.'") +
           f", {legend[1]} = dark" + (" (orange)" if color else " '#'")]
    for label, vals in zip(rows, m):
        mean = sum(vals) / max(len(vals), 1)
        out.append(f"-- {label}: {legend[1]} {mean:.0%}")
        line, marks, n = "", "", 0
        for tok, a in zip(toks, vals):
            shown = tok.rstrip("\n")
            if color:
                r, g, b = _mix(a)
                line += f"\x1b[38;2;0;0;0;48;2;{r};{g};{b}m{shown}\x1b[0m"
            else:
                line += shown
                marks += ("#" if a > 0.5 else ".") * len(shown)
            n += len(shown)
            if tok.endswith("\n") or n >= width:
                out += [line] if color else [line, marks]
                line, marks, n = "", "", 0
        if n:
            out += [line] if color else [line, marks]
    if path:
        sections = []
        for label, vals in zip(rows, m):
            spans = "".join(f'<span style="background:rgb{_mix(a)}" title="{a:.2f}">{html.escape(t)}</span>'
                            for t, a in zip(toks, vals))
            sections.append(f"<h2>{html.escape(label)} <small>({legend[1]} {sum(vals) / max(len(vals), 1):.0%}"
                            f")</small></h2>\n<pre>{spans}</pre>")
        key = "".join(f'<span style="background:rgb{_mix(a)}">&nbsp;{html.escape(t)}&nbsp;</span> '
                      for a, t in ((0.0, legend[0]), (0.5, "between"), (1.0, legend[1])))
        page = ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>" + html.escape(title) +
                "</title>\n<style>body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#111;"
                "background:#fff}pre{font-size:16px;line-height:1.6;white-space:pre-wrap;word-break:break-all;"
                "border:1px solid #ccc;padding:.5em}h2{font-size:1em;margin:1.2em 0 .2em}span{color:#000}</style>"
                "</head><body>\n<h1>" + html.escape(title) + "</h1>\n<p>Each token is coloured by what the model "
                "ran for it in each layer. " + key + "</p>\n" + "\n".join(sections) + "\n</body></html>\n")
        write_atomic(path, page)
    return "\n".join(out)


def picture(model, idx, meta, title, path):
    """The model's routing_map drawn in the terminal (colour on a TTY) and written to path as HTML."""
    m, rows, legend = model.routing_map(idx)
    return render_routing(meta, idx[0].tolist(), m, rows, legend, title, path, color=sys.stdout.isatty())


def encode_prompt(meta, text):
    """A prompt -> ids; a character outside the vocabulary is a one-line error."""
    if meta["dataset"] == "shakespeare":
        stoi = {c: i for i, c in enumerate(meta["itos"])}
        bad = sorted(set(text) - set(stoi))
        if bad:
            raise NanorouteError(f"the prompt has characters Tiny Shakespeare never uses: {''.join(bad)!r}")
        return [stoi[c] for c in text]
    if meta["dataset"] == "shakespeare_bpe":
        return common.bpe().encode_ordinary(text)
    if meta["dataset"] == "enwik8":
        return list(text.encode("utf-8"))
    names = {"[BOS]": common.BOS, "[SEP]": common.SEP, "[EOS]": common.EOS}
    try:
        ids = [names[w] if w in names else int(w) for w in text.split()]
    except ValueError:
        raise NanorouteError(f"a {meta['dataset']} prompt is space-separated numbers 0..{common.TASK_VOCAB - 1} "
                             f"and [BOS]/[SEP]/[EOS], got {text!r}")
    if not all(0 <= i < meta["vocab_size"] for i in ids):
        raise NanorouteError(f"prompt ids must be in 0..{meta['vocab_size'] - 1}")
    return ids


# ----------------------------------------------------------------------------------------------------
# python train.py --sample RUN_DIR: nanoGPT's sample.py for a trained run

SAMPLE_FLAGS = {"sample": "", "prompt": "\n", "num_tokens": 300, "temperature": 0.8, "top_k": 200, "dense": False,
                "compile": False, "seed": 1337, "device": "auto"}  # the defaults; a flag's type is its default's


def sample_run(argv):
    opts = dict(SAMPLE_FLAGS)
    for key, val in split_flags(argv):
        if key not in SAMPLE_FLAGS:
            raise NanorouteError(f"unknown option --{key} with --sample; valid: --{', --'.join(SAMPLE_FLAGS)}")
        opts[key] = parse_value(key, type(SAMPLE_FLAGS[key]), val)
    run_dir = opts["sample"]
    if not os.path.isdir(run_dir):
        raise NanorouteError(f"--sample {run_dir}: no such run directory (train one with python train.py --model ...)")
    if opts["num_tokens"] < 1 or opts["temperature"] < 0 or opts["top_k"] < 1:
        raise NanorouteError("--num_tokens and --top_k must be >= 1 and --temperature >= 0")
    path = next((p for p in (os.path.join(run_dir, f) for f in ("best.pt", "ckpt.pt")) if os.path.exists(p)), None)
    if path is None:
        raise NanorouteError(f"--sample {run_dir}: no best.pt or ckpt.pt there (has the run reached its first eval?)")
    ckpt = common.load_checkpoint(path)
    saved = ckpt["config"]
    if saved.get("model") not in MODELS:
        raise NanorouteError(f"checkpoint {path} names an unknown model {saved.get('model')!r}")
    module = importlib.import_module(MODELS[saved["model"]])
    try:
        cfg = module.Config(**saved)
    except TypeError as e:
        raise NanorouteError(f"checkpoint {path} has a config this code does not know ({e})")
    device = common.pick_device(opts["device"])
    model = build(module, cfg).to(device)
    model.load_state_dict(ckpt["model"])
    meta = common.load_meta(cfg.dataset, cfg.data_dir)
    ids = encode_prompt(meta, opts["prompt"] or "\n")  # an empty prompt starts from a newline, as nanoGPT's sample.py
    if not ids:
        raise NanorouteError(f"--prompt is empty; a {cfg.dataset} prompt needs at least one token (e.g. '[BOS] 3 1')")
    idx = torch.tensor(ids[-cfg.block_size:], dtype=torch.long, device=device)[None]  # (1, T0)
    torch.manual_seed(opts["seed"])
    t = time.perf_counter()
    with common.autocast(device):
        out = model.generate(idx, opts["num_tokens"], opts["temperature"], opts["top_k"], use_cache=not opts["dense"],
                             compile=opts["compile"])
    common.sync(device)
    dt = time.perf_counter() - t
    how = ("cache-free forward of the whole window per token" if opts["dense"] or not hasattr(model, "prefill")
           else "KV-cached decoding" + (", routed" if hasattr(model, "routing_map") else "")
           + (", compiled step (includes compile time)" if opts["compile"] else ""))
    print(f"{cfg.model} from {path} (step {ckpt['iter']}, val {ckpt.get('val_loss', float('nan')):.4f}); "
          f"{opts['num_tokens']} tokens in {dt:.2f}s ({opts['num_tokens'] / dt:.0f} tok/s, {how})")
    if hasattr(model, "routing_map"):
        window = out[:, -cfg.block_size:]
        html_path = os.path.join(run_dir, "sample_routing.html")
        print(picture(model, window, meta, f"{cfg.model}: routing of the sample's last {window.size(1)} tokens",
                      html_path))
        print(f"wrote {html_path}")
    print("sample:\n" + common.decode(meta, out[0].tolist()))


def main(argv=None):
    try:
        argv = sys.argv[1:] if argv is None else argv
        if any(a == "--sample" or a.startswith("--sample=") for a in argv):
            return sample_run(argv)
        cfg, module, resume = parse_args(argv)
        best = train(cfg, module, resume)
        if "RANK" in os.environ:
            # DDP keeps gloo's worker threads alive past destroy_process_group, and one that frees a collective's
            # tensors while the interpreter shuts down aborts the process (SIGABRT): a finished worker skips that
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(0)
        return best
    except NanorouteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
