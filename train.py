"""
Train any nanoroute model on any dataset.

  python train.py --model tsa --dataset shakespeare
  python train.py --model dtrnet --dataset shakespeare --preset paper --max_iters=500
  python train.py --model gpt --dataset shakespeare --resume          # continue out/gpt-shakespeare
  torchrun --standalone --nproc_per_node=2 train.py --model gpt  # DDP (gloo on CPU, nccl on CUDA)
  python train.py --model tsa --preset classroom                  # ~3 minutes on a laptop CPU
  python train.py --model tsa --dataset shakespeare_bpe --init_from gpt2  # route a pretrained GPT-2
  python train.py --sample out/tsa-shakespeare --prompt "ROMEO:" --num_tokens 300 \
      --temperature 0.8 --top_k 200

Every Config field is a flag (--key=value or --key value); the model file's Config has the defaults
and its PRESETS dict the named presets. Order: defaults < preset < flags. Each eval writes one JSON
line to out/<run>/metrics.jsonl and an atomic checkpoint (ckpt.pt: the latest, for --resume;
best.pt: the weights with the best val loss); --resume continues exactly where the last one left
off, with the run's saved values (its config.json: a flag that differs is refused). The run ends
with a summary: hard (what inference runs) vs soft loss, vs a dense GPT of the same preset in
out/, work really skipped per layer, sparse vs dense speed measured on the spot, the routing
picture, and a sample.
"""
import contextlib
import dataclasses
import html
import importlib
import inspect
import json
import math
import os
import re
import shlex
import socket
import sys
import tempfile
import time

import numpy as np
import torch

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

import common
from common import NanorouteError

MODELS = {"gpt": "common", "tsa": "tsa", "dtrnet": "dtrnet", "conddepth": "conddepth",
          "hybrid": "hybrid_attn", "mod": "mod"}
# an out_dir with one of these holds a run
RUN_FILES = ("ckpt.pt", "best.pt", "metrics.jsonl", "config.json")
OUTPUTS = RUN_FILES + ("routing.html", "sample_routing.html")  # what --overwrite removes
TIMING = ("time", "tok_s", "mfu", "max_mem_gib")  # measured: they differ between identical runs
# What a user may change when resuming a run; every other value is the run's saved one (a flag that
# differs is refused): how long it trains and how often it looks (max_iters, eval_interval,
# log_interval), where it runs (device, compile: the same computation; peak_flops: what its MFU
# is measured against) and where its files are
# now (out_dir, data_dir: a run or its data may move). eval_iters is not among them: every val
# loss in a run's log (and so best.pt) is measured on the same batches.
MAY_CHANGE = ("max_iters", "eval_interval", "log_interval", "device", "compile", "out_dir",
              "data_dir", "peak_flops")
FLAGS = {  # the flags that are not Config fields: default, one line of help
    "model": ("gpt", "the model: " + ", ".join(MODELS)),
    "dataset": ("shakespeare", "the data: " + ", ".join(common.DATASETS)),
    "preset": ("", "named settings of the model (listed below); defaults < preset < flags"),
    "resume": (False, "continue the run in out_dir from its ckpt.pt with the values in its "
               "config.json: a flag that differs is refused, but --"
               + ", --".join(MAY_CHANGE) + " may change"),
    "overwrite": (False, "start over in an out_dir that holds a run: first removes its "
                  + ", ".join(OUTPUTS)),
}
# --help's groups of flags; the rest of common.Config: "model"
GROUPS = {"run": ("model", "preset", "resume", "overwrite", "out_dir", "init_from", "device",
                  "compile", "peak_flops", "seed", "eval_interval", "eval_iters", "eval_seed",
                  "log_interval"),
          "data": ("dataset", "data_dir", "shards"),
          "optimisation": ("max_iters", "batch_size", "grad_accum", "learning_rate", "min_lr",
                           "warmup_iters", "weight_decay", "beta1", "beta2", "grad_clip")}


# flags that name a file or folder: a leading ~ is the user's home, as a shell would make it
PATHS = ("out_dir", "data_dir", "init_from", "sample")


def parse_value(name, typ, text):
    """Rule: a flag's value is the value the user wrote, or a one-line refusal. Its text -> typ; a
    bare --name (text None, as in `--lam --seed 3`) is True for a bool, a refusal for the rest; a
    path's ~ is expanded (PATHS)."""
    if text is None and typ is not bool:
        raise NanorouteError(f"--{name} needs a value")
    if name in PATHS:
        return os.path.expanduser(text)
    if typ is bool:
        if text is None or text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
    else:
        try:
            value = typ(text)
        except ValueError:
            value = None
        if typ is float and value is not None and not math.isfinite(value):
            raise NanorouteError(f"--{name} must be a finite number, got {text!r}")
        if value is not None:
            return value
    raise NanorouteError(f"--{name} expects {typ.__name__}, got {text!r}")


def split_flags(argv, may_be_empty=()):
    """['--a=1', '--b', '2', '--c'] -> {'a': '1', 'b': '2', 'c': None}; a stray word, an empty value
    (but for the flags in may_be_empty) or a flag given twice is a one-line error."""
    flags, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise NanorouteError(f"unexpected argument {arg!r}; "
                                 "flags look like --key=value (see --help)")
        key, eq, val = arg[2:].partition("=")
        if not eq:  # --key value, or a bare boolean --key
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            val = argv[i + 1] if has_value else None
            i += has_value
        if key in flags:
            raise NanorouteError(f"--{key} is given twice; give each flag once")
        if val == "" and key not in may_be_empty:
            raise NanorouteError(f"--{key} has an empty value; give a value or leave the flag out")
        flags[key] = val
        i += 1
    return flags


def parse_args(argv):
    """argv -> (Config, model module, mode: "new", "resume" or "overwrite")."""
    return parse(argv)[:3]


def parse(argv):
    """argv -> (Config, model module, mode, given: {field: the flag that set it, e.g. '--lam' or
    '--preset classroom'}). Unknown keys and bad values are one-line errors. With --resume the
    Config is the run's saved one (resumed_values)."""
    opts = split_flags(argv)
    explicit = set(opts)
    resume = parse_value("resume", bool, opts.pop("resume", "false"))
    overwrite = parse_value("overwrite", bool, opts.pop("overwrite", "false"))
    if resume and overwrite:
        raise NanorouteError("--resume continues the run in out_dir, --overwrite removes it: "
                             "give one of them")
    saved, saved_at = {}, None
    if resume:  # the run's model and dataset are the defaults of --model and --dataset
        out = opts.get("out_dir") or os.path.join(
            "out", f"{opts.get('model') or 'gpt'}-{opts.get('dataset') or 'shakespeare'}")
        saved, saved_at = saved_config(parse_value("out_dir", str, out))
    name, module = model_module(opts.pop("model", saved.get("model", "gpt")))
    dataset = opts.pop("dataset", saved.get("dataset")) or "shakespeare"
    if dataset not in common.DATASETS:
        raise NanorouteError(f"unknown dataset {dataset!r}; "
                             f"choose one of {', '.join(common.DATASETS)}")
    preset, presets = opts.pop("preset", None), getattr(module, "PRESETS", {})
    if preset is not None and preset not in presets:
        raise NanorouteError(f"unknown preset {preset!r} for --model {name}; choose one of "
                             f"{', '.join(presets) or '(none)'}")
    values = dict(presets[preset]) if preset is not None else {}  # defaults < preset < flags
    given = {k: f"--preset {preset} (its {k})" for k in values}
    fields = {f.name: f for f in dataclasses.fields(module.Config)}
    for key, val in opts.items():
        if key not in fields or key in FLAGS:
            valid = list(FLAGS) + sorted(set(fields) - set(FLAGS))
            raise NanorouteError(f"unknown option --{key}; valid: --{', --'.join(valid)}")
        values[key], given[key] = parse_value(key, fields[key].type, val), f"--{key}"
    values.update(model=name, dataset=dataset)
    given.update({k: f"--{k}" for k in ("model", "dataset") if k in explicit})
    if resume:
        values = resumed_values(saved, saved_at, values, given)
    mode = "resume" if resume else "overwrite" if overwrite else "new"
    try:
        return module.Config(**values), module, mode, given
    except NanorouteError as e:  # a value the saved file holds: name the file
        raise NanorouteError(f"{e} ({saved_at}, with the flags given)") if resume else e


def saved_config(out):
    """--resume: (the config a run in out was trained with, the file it came from): its config.json,
    or where that is gone, its ckpt.pt's copy. Checked to be a config of a known model."""
    path, ckpt_path = os.path.join(out, "config.json"), os.path.join(out, "ckpt.pt")
    if not os.path.exists(ckpt_path):
        held = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
        raise NanorouteError(f"--resume: no {ckpt_path} to resume from" + (
            "; the run stopped before its first checkpoint: start it again with --overwrite"
            if held else ""))
    if not os.path.exists(path):
        path, saved = ckpt_path, common.load_checkpoint(ckpt_path)["config"]
    else:
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            raise NanorouteError(f"{path} is not readable JSON ({type(e).__name__}): it holds the "
                                 "run's flags; restore it, or delete it to use ckpt.pt's copy")
    if not isinstance(saved, dict) or saved.get("model") not in MODELS:
        raise NanorouteError(f"{path} is not a nanoroute run's config (no known model in it)")
    known = {f.name for f in dataclasses.fields(model_module(saved["model"])[1].Config)}
    odd = sorted(set(saved) - known)
    if odd:
        raise NanorouteError(f"{path} has fields --model {saved['model']} does not know "
                             f"({', '.join(odd[:3])}): it was written by other code")
    return saved, path


def resumed_values(saved, saved_at, values, given):
    """Rule of --resume: every value is the run's saved one; a flag (or a preset's setting) that
    differs is refused, but for MAY_CHANGE."""
    out = dict(saved)
    first = sorted(values, key=lambda k: k not in ("model", "dataset"))  # the run's kind first
    for k, v in ((k, values[k]) for k in first):
        if k in MAY_CHANGE or k not in saved:  # not saved: a field newer than the run
            out[k] = v
        elif v != saved[k]:
            raise NanorouteError(
                f"--resume: {given.get(k, '--' + k)} asks for {k}={show(v)} but {saved_at} has "
                f"{k}={show(saved[k])}; a resumed run keeps its values: drop {given.get(k)} "
                f"(may change: --{', --'.join(MAY_CHANGE)})")
    # the folder it was found in, wherever the run was first written
    out["out_dir"] = values.get("out_dir", os.path.dirname(saved_at) or ".")
    return out


def model_module(name):
    if name not in MODELS:
        raise NanorouteError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return name, importlib.import_module(MODELS[name])


def field_help(cls):
    """Field name -> its one line of help: the trailing comment of its line in the Config classes (a
    subclass's comment wins; a field a subclass redefines without one keeps its base's)."""
    out = {}
    for c in reversed(cls.__mro__):
        if dataclasses.is_dataclass(c):
            commented = r"^    (\w+): [^\n=]+=[^\n#]*#\s*(.*)$"
            for key, text in re.findall(commented, inspect.getsource(c), re.M):
                out[key] = text
    return out


def show(value):
    if isinstance(value, bool):
        return str(value).lower()
    return shlex.quote(str(value))  # '' for an empty value


def print_help(argv):
    """python train.py [--model M] --help: the flags of that model, grouped, with defaults and one
    line each."""
    name, module = model_module(split_flags(argv).get("model") or "gpt")
    cfg, helps = module.Config(), field_help(module.Config)
    common_fields = {g.name for g in dataclasses.fields(common.Config)}
    own = [f.name for f in dataclasses.fields(cfg)
           if f.name not in common_fields and f.name not in FLAGS]
    shown = set(FLAGS) | set(own) | {k for g in GROUPS.values() for k in g}
    rest = [f.name for f in dataclasses.fields(cfg) if f.name not in shown]
    groups = {**GROUPS, "model (every model)": rest}
    if own:
        groups[f"--model {name} ({MODELS[name]}.py's Config)"] = own
    print("usage: python train.py [--model M] [--dataset D] [--preset P] [--resume | --overwrite] "
          "[--key=value ...]\n"
          "       python train.py --sample RUN_DIR [--prompt TEXT] ...  "
          "(python train.py --sample --help)\n"
          "       python train.py --model M --help  (that model's own flags)\n\n"
          f"{__doc__.strip().split(chr(10))[0]}"
          "\nEvery flag is --key=value or --key value; a bool alone (--compile) is true.")
    for title, keys in groups.items():
        print(f"\n{title}:")
        for k in keys:
            default, text = FLAGS[k] if k in FLAGS else (getattr(cfg, k), helps.get(k, ""))
            if k == "model":
                default = name
            print(f"{'  --' + k + '=' + show(default):<30} {text}".rstrip())
    print("\n--grad_accum=N: N micro-batches of batch_size per step, the gradients of their mean "
          "loss\n(DDP syncs on the last); a router's batch statistics are each micro-batch's: "
          "dtrnet's α_l,\nthe hybrid's balance loss and Gumbel noise, conddepth's budget/alive "
          "losses and θ_l, tsa's\ncalibration (train.accumulate's docstring gives each "
          "difference)")
    presets = getattr(module, "PRESETS", {})
    print(f"\npresets of --model {name} (--preset NAME sets these; flags given too win):")
    for key, values in presets.items():
        print(f"  {key}: " + " ".join(f"--{k}={show(v)}" for k, v in values.items()))
    if not presets:
        print("  (none)")


def out_dir_of(cfg):
    return cfg.out_dir or os.path.join("out", f"{cfg.model}-{cfg.dataset}")


def resolve(cfg, meta):
    """Fill what the data decides: vocabulary, and for copy/sort the record length."""
    changes = {"vocab_size": meta["vocab_size"], "out_dir": out_dir_of(cfg)}
    if cfg.vocab_size != meta["vocab_size"]:
        print(f"note: vocab_size {cfg.vocab_size} -> {meta['vocab_size']}, {cfg.dataset}'s "
              "vocabulary (the data decides it)")
    if "record_len" in meta and cfg.block_size != meta["record_len"] - 1:
        changes["block_size"] = meta["record_len"] - 1
        print(f"note: {cfg.dataset} trains on whole records: "
              f"block_size {cfg.block_size} -> {changes['block_size']}")
    return dataclasses.replace(cfg, **changes)


def check_fits(cfg, meta, module, device):
    """Refuse, before anything is written, windows the data cannot hold and a model the memory
    cannot."""
    val_tokens = meta.get("val_tokens", 0)
    if "record_len" not in meta and 2 * cfg.block_size > val_tokens:
        raise NanorouteError(f"block_size={cfg.block_size} is more than half of {cfg.dataset}'s "
                             f"validation split ({val_tokens:,} tokens): too few distinct windows "
                             "to evaluate on")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        limit, where = 0.9 * total, "this GPU's memory"
    else:  # the CPU's, and MPS's unified memory, shared with everything else the machine runs
        has_sysconf = hasattr(os, "sysconf")
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if has_sysconf else 0
        limit, where = ram / 2, "half of this machine's memory"
    B, T, C = cfg.batch_size, cfg.block_size, cfg.n_embd
    # a GPT's, a lower bound: no need to build a huge one
    params = 12 * cfg.n_layer * C * C + cfg.vocab_size * C
    if limit and sum(train_memory(cfg, params)) <= limit:
        # every tensor of this very model, without allocating it;
        # a size it cannot take is refused here
        try:
            with torch.device("meta"):
                params = sum(t.numel() for t in build(module, cfg).state_dict().values())
        except (RuntimeError, ValueError, ZeroDivisionError) as e:
            raise NanorouteError(f"--model {cfg.model} cannot be built with these sizes: "
                                 f"{str(e).splitlines()[0]}")
    state, act = train_memory(cfg, params)
    need = state + act
    if limit and need > limit:
        raise NanorouteError(f"this run would need ~{need / 2 ** 30:,.1f} GiB to train "
                             f"({params / 1e6:,.1f}M parameters with their gradients and AdamW's "
                             f"moments: {16 * params / 2 ** 30:,.1f} GiB; activations at "
                             f"batch_size={B}, block_size={T}: ~{act / 2 ** 30:,.1f} GiB), "
                             f"more than {where} ({limit / 2 ** 30:,.0f} GiB)")


def train_memory(cfg, params):
    """What a training step holds, roughly, in bytes -> (fp32 weights, gradients and AdamW's two
    moments: 16 a parameter, the activations of one micro-batch). Activations kept for the
    backward pass, fp32: ~16 B·T·C per layer (qkv, attention output, the 4C-wide FFN and its GELU,
    norms, residuals), one layer's attention scores B·nh·T² (fwd + bwd, the math path), the logits
    three times (logits, softmax, gradient)."""
    B, T, C = cfg.batch_size, cfg.block_size, cfg.n_embd
    act = 4 * (16 * B * T * C * cfg.n_layer + 2 * B * cfg.n_head * T * T
               + 3 * B * T * cfg.vocab_size)
    return 16 * params, act


def check_writable(out):
    """Refuse an out_dir that cannot be made or written in."""
    parent = out
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise NanorouteError(f"--out_dir {out}: {parent} is a file, not a directory")
    try:  # what the OS says, not os.access (root passes that on a read-only mount)
        tempfile.TemporaryFile(dir=parent or ".").close()
    except OSError as e:
        raise NanorouteError(f"--out_dir {out}: cannot write in {parent or '.'} ({e.strerror})")


def check_out_dir(cfg, mode, world):
    """Refuse, before any work, an out_dir that cannot be written, that lies in the prepared data
    or that holds a run a new one would replace. With --resume, return its checkpoint once it is
    known to fit this run."""
    out = cfg.out_dir
    check_writable(out)
    data = os.path.realpath(cfg.data_dir)
    if os.path.commonpath([data, os.path.realpath(out)]) == data:
        raise NanorouteError(f"--out_dir {out} is inside --data_dir {cfg.data_dir}, the prepared "
                             "data: choose another --out_dir")
    held = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    if mode == "new" and held:
        raise NanorouteError(f"{out} holds a run ({', '.join(held)}): continue it with --resume, "
                             "or start over with --overwrite (removes it), or choose another "
                             "--out_dir")
    if mode != "resume":
        return None
    path = os.path.join(out, "ckpt.pt")
    if not os.path.exists(path):
        raise NanorouteError(f"--resume: no {path} to resume from" + (
            "; the run stopped before its first checkpoint: start it again with --overwrite"
            if held else ""))
    ckpt = common.load_checkpoint(path)
    missing = [k for k in ("optimizer", "iter", "best_val_loss", "rng_cpu") if k not in ckpt]
    if missing:
        raise NanorouteError(f"{path} has no training state ({', '.join(missing)}; a copy of "
                             "best.pt?): --resume needs the ckpt.pt a run writes; to train on from "
                             f"its weights, start a new run with --init_from={path}")
    saved = ckpt["config"]
    for k in (f.name for f in dataclasses.fields(cfg)):
        if k not in MAY_CHANGE and saved.get(k, getattr(cfg, k)) != getattr(cfg, k):
            raise NanorouteError(f"checkpoint {path} has {k}={show(saved[k])} but this run asks "
                                 f"for {k}={show(getattr(cfg, k))}; resume with the values it was "
                                 f"trained with ({os.path.join(out, 'config.json')})")
    n = len(ckpt["rng_cpu"])
    if n != world:
        how = "python train.py ..." if n == 1 else f"torchrun --nproc_per_node={n} train.py ..."
        raise NanorouteError(f"{path} was written by {n} process(es), this run has {world}: "
                             f"resume it with {how}")
    if ckpt["iter"] >= cfg.max_iters:
        raise NanorouteError(f"{path} is at step {ckpt['iter']} and --max_iters={cfg.max_iters}: "
                             f"nothing left to train; give a --max_iters above {ckpt['iter']} "
                             "to train on")
    return ckpt


LOCK = "train.lock"  # in a run folder while a process trains into it: its pid and host


@contextlib.contextmanager
def run_lock(out_dir):
    """Rule: one run folder, one writer. An exclusive flock on out_dir/train.lock, held while the
    run trains: a second train.py into the folder is refused in one line. The OS drops the lock when
    its process ends, however it ends (SIGKILL included), so a killed run leaves no lock that
    holds; the file it leaves is taken over. Without fcntl (Windows) there is no lock."""
    if fcntl is None:
        yield
        return
    path, created = os.path.join(out_dir, LOCK), not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise NanorouteError(f"{out_dir} is being trained by {holder} ({path}): one run folder "
                                 "has one writer; wait for that run to end or stop it, or choose "
                                 "another --out_dir")
        try:  # the file locked is still the one at path (its holder may have just removed it)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    try:
        yield
    finally:
        try:
            os.remove(path)
            if created:  # a run refused before it wrote anything leaves no empty folder
                os.rmdir(out_dir)
        except OSError:  # not empty: the run's files
            pass
        os.close(fd)


def differences(saved, cfg):
    """What a checkpoint's config and this run's disagree on, for a one-line error."""
    return ", ".join(f"{k}={v!r} (this run: {getattr(cfg, k)!r})" for k, v in saved.items()
                     if hasattr(cfg, k) and v != getattr(cfg, k)
                     and k not in ("out_dir", "device", "max_iters"))


def read_metrics(path):
    """The records of a metrics.jsonl. A last line cut short (what a full disk or a kill mid-write
    leaves) is dropped with a note; any other line that is not JSON is an error."""
    if not os.path.exists(path):
        return []
    lines, recs = open(path, encoding="utf-8").read().splitlines(), []
    for i, line in enumerate(lines):
        try:
            recs.append(json.loads(line))
        except ValueError:
            if i + 1 < len(lines):
                raise NanorouteError(f"{path}: line {i + 1} is not JSON; fix or remove that line")
            print(f"note: {path}: dropped its last line, cut short ({line[:40]!r})")
    return recs


def build(module, cfg):
    """The model a Config asks for: a module's build(cfg) when it has variants in their own classes
    (tsa: the early-exit baseline), else its Model(cfg)."""
    return getattr(module, "build", module.Model)(cfg)


def write_atomic(path, text):
    """Write text to path via a temporary file: a crash mid-write leaves the previous file
    intact."""
    common.atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def train(cfg, module, mode="new", given=None):
    """mode: "new" (refused where out_dir holds a run), "resume" or "overwrite" (removes the old run
    first); given: the fields the user set (parse), for --init_from. The run folder's lock is held
    until this returns (the stack releases it)."""
    with contextlib.ExitStack() as stack:
        return train_run(cfg, module, mode, given, stack)


def ddp_env():
    """(under torchrun, rank, world size), from the variables torchrun sets. A RANK without the
    others (a leftover of another job's environment) is one line, on its one process."""
    if "RANK" not in os.environ:
        return False, 0, 1
    missing = [k for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
               if k not in os.environ]
    if missing:
        raise NanorouteError(f"RANK={os.environ['RANK']} is set but not {', '.join(missing)}: "
                             "a leftover of another job? unset RANK, or start the run with "
                             "torchrun")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise NanorouteError(f"RANK={os.environ['RANK']!r} and WORLD_SIZE="
                             f"{os.environ['WORLD_SIZE']!r} must be numbers (torchrun sets them)")
    if not 0 <= rank < world:
        raise NanorouteError(f"RANK={rank} is not in 0..WORLD_SIZE-1={world - 1}")
    return True, rank, world


def on_rank0(check, ddp, master):
    """Rule: every rank checks what rank 0 checks. check() runs on rank 0 alone (it writes: data,
    the run folder); its verdict is broadcast, so a refusal ends every rank with the same
    NanorouteError (printed once, by rank 0) instead of leaving the others at a barrier."""
    verdict, out = None, None
    if master:
        try:
            out = check()
        except NanorouteError as e:
            verdict = str(e)
        except OSError as e:
            verdict = f"{e.filename}: {e.strerror}" if e.filename else str(e)
    if ddp:
        box = [verdict]
        torch.distributed.broadcast_object_list(box, src=0)
        verdict = box[0]
    if verdict is not None:
        raise NanorouteError(verdict)
    return out


def train_run(cfg, module, mode, given, stack):
    ddp, rank, world = ddp_env()
    device = common.pick_device(cfg.device)
    if ddp:
        if device.type == "cuda":
            device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
            torch.cuda.set_device(device)
        torch.distributed.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    master = rank == 0
    log = print if master else (lambda *a, **k: None)

    meta = on_rank0(lambda: common.prepare(cfg.dataset, cfg.data_dir, shards=cfg.shards), ddp,
                    master)
    if ddp:
        meta = common.load_meta(cfg.dataset, cfg.data_dir)
    init = None
    # another run's or GPT-2's weights, and their architecture (a resumed run has its own)
    if cfg.init_from and mode != "resume":
        cfg, init = start_from(cfg, module, meta, master, ddp, given)
    cfg = resolve(cfg, meta)
    check_fits(cfg, meta, module, device)
    # COMPILE_REFUSED: device type -> why compile is refused there
    refused = getattr(module, "COMPILE_REFUSED", {}).get(device.type)
    if cfg.compile and refused:
        raise NanorouteError(f"--compile is refused for --model {cfg.model} on {device.type}: "
                             f"{refused}")
    def claim():  # the lock before the folder is read: what is in it may be another run's doing
        check_writable(cfg.out_dir)
        stack.enter_context(run_lock(cfg.out_dir))
        return check_out_dir(cfg, mode, world)
    ckpt = on_rank0(claim, ddp, master)
    if not master and mode == "resume":  # every rank restores its own state from the checkpoint
        ckpt = check_out_dir(cfg, mode, world)
    train_data, val_data = (common.load_split(cfg.dataset, split, cfg.data_dir)
                            for split in ("train", "val"))
    ckpt_path, best_path, metrics_path = (os.path.join(cfg.out_dir, f)
                                          for f in ("ckpt.pt", "best.pt", "metrics.jsonl"))

    torch.manual_seed(cfg.seed + rank)
    model = build(module, cfg).to(device)
    if init is not None:
        try:
            missing, unexpected = model.load_state_dict(init, strict=False)
        except RuntimeError as e:
            raise NanorouteError(f"--init_from {cfg.init_from} does not fit --model {cfg.model}: "
                                 f"{str(e).splitlines()[1].strip()}")
        if unexpected:
            raise NanorouteError(f"--init_from {cfg.init_from} has weights --model {cfg.model} "
                                 f"lacks: {unexpected[:3]}")
        fresh = sorted({f"blocks.*.{k.split('.')[2]}" if k.startswith("blocks.") else
                        k.split(".")[0] for k in missing})  # routers, gates, cheap FFNs
        log(f"init from {cfg.init_from}: {len(missing)} new tensors ({', '.join(fresh) or 'none'})")
    optimizer = common.make_optimizer(model, cfg, device)
    raw_model = model
    if cfg.compile:  # before anything is written into out_dir
        model = compile_checked(raw_model, cfg, train_data, meta, device)
    start, best_val = 0, float("inf")
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            why = differences(ckpt["config"], cfg) or str(e).strip().splitlines()[0]
            raise NanorouteError(f"{ckpt_path} does not fit this run's {cfg.model} ({why}); resume "
                                 "with the flags it was trained with")
        start, best_val = ckpt["iter"], ckpt["best_val_loss"]
        torch.set_rng_state(ckpt["rng_cpu"][rank])
        if device.type == "cuda" and "rng_cuda" in ckpt:
            torch.cuda.set_rng_state(ckpt["rng_cuda"][rank])
        # drop what the killed run logged after its checkpoint, so the log reads as one run
        if master:
            keep = [r for r in read_metrics(metrics_path) if r["step"] < start or
                    (r["kind"] == "eval" and r["step"] == start)]
            write_atomic(metrics_path, "".join(json.dumps(r) + "\n" for r in keep))
        log(f"resuming {ckpt_path} at step {start}")
    elif master:
        for f in OUTPUTS if mode == "overwrite" else ():
            for p in (os.path.join(cfg.out_dir, f), os.path.join(cfg.out_dir, f + ".tmp")):
                if os.path.exists(p):
                    os.remove(p)
        write_atomic(metrics_path, "")  # a fresh log (and out_dir)
    if master:
        write_atomic(os.path.join(cfg.out_dir, "config.json"),
                     json.dumps(dataclasses.asdict(cfg), indent=1))
    if ddp:
        device_ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    log(f"{cfg.model} on {cfg.dataset}: {raw_model.num_params() / 1e6:.2f}M parameters, "
        f"device {device}, {world} process(es), {cfg.max_iters} iters of "
        f"{cfg.batch_size}×{cfg.block_size}" + (f"×{cfg.grad_accum} (accumulated)"
                                                if cfg.grad_accum > 1 else "") + " tokens")

    def record(rec):  # called on the master only
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    # tokens/s and MFU: this process's tokens per step over the time its steps took (evals not
    # counted), against the peak of the dtype autocast runs in (None on a CPU: "peak unknown")
    tokens = cfg.batch_size * cfg.block_size * cfg.grad_accum
    peak = common.peak_flops(device, common.default_dtype(device), cfg.peak_flops or None)
    t0, busy, steps = time.time(), 0.0, 0
    for it in range(start, cfg.max_iters + 1):
        eval_now = ((it % cfg.eval_interval == 0 or it == cfg.max_iters)
                    and not (ckpt is not None and it == start))
        if eval_now:  # _gather_rng is a collective: every rank joins
            rng = {"rng_cpu": _gather_rng(torch.get_rng_state(), ddp)}
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
            state = dict(model=raw_model.state_dict(), config=dataclasses.asdict(cfg), iter=it,
                         val_loss=val["loss"])
            if val["loss"] < best_val:  # nanoGPT keeps the best weights: long presets overfit
                best_val = val["loss"]
                common.save_checkpoint(best_path, **state)
            common.save_checkpoint(ckpt_path, **state, optimizer=optimizer.state_dict(),
                                   best_val_loss=best_val, **rng)
        if it == cfg.max_iters:
            break
        # schedules that depend on the step (temperatures, label phases)
        if hasattr(raw_model, "on_step"):
            raw_model.on_step(it)
        # TSA: its last phase
        lr = raw_model.lr_at(it) if hasattr(raw_model, "lr_at") else common.lr_at(it, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t_step = time.time()
        optimizer.zero_grad(set_to_none=True)
        loss, stats = accumulate(model, micro_batches(train_data, meta, cfg, it, rank, device),
                                 device, ddp)
        # the pre-clipping gradient norm is logged (conddepth's grad-norm tiers);
        # grad_clip=0 only measures
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(),
                                                   cfg.grad_clip or float("inf"))
        optimizer.step()
        lossf = loss.item()  # waits for the step: busy is its time
        busy, steps = busy + time.time() - t_step, steps + 1
        if not np.isfinite(lossf):
            raise NanorouteError(f"loss became {lossf} at step {it}; "
                                 "lower --learning_rate or check the data")
        if master and it % cfg.log_interval == 0:
            dt, busy, steps = busy / steps, 0.0, 0
            # the FLOPs this step executed: a router that skips work shows it (its stats)
            fpt = raw_model.train_flops_per_token(cfg.block_size, stats)
            tps, mfu = common.throughput(fpt, tokens, dt, peak)
            log(f"iter {it}/{cfg.max_iters}: loss {lossf:.4f}, {dt * 1000:.0f} ms/iter, "
                f"{common.throughput_text(tps, mfu)}, ETA {_duration(dt * (cfg.max_iters - it))}")
            record({"kind": "train", "step": it, "loss": lossf, "lr": lr,
                    "grad_norm": grad_norm.item(), "tok_s": round(tps, 1),
                    "mfu": None if mfu is None else round(mfu, 5),
                    **({"max_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}
                       if device.type == "cuda" else {}),
                    **{k: v.item() for k, v in stats.items() if v.numel() == 1}})
    if ddp:
        # every rank is past its last collective before the group goes away
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if master:
        log(f"done in {_duration(time.time() - t0)}; best val loss {best_val:.4f}")
        summary(raw_model, cfg, meta, val_data, device, metrics_path)
    return best_val


def micro_batches(data, meta, cfg, it, rank, device):
    """Step it's cfg.grad_accum micro-batches of this rank, each from its own generator seeded by
    (seed, it, rank, micro): a resumed run draws the same ones. One micro-batch: (seed, it, rank)
    alone, the batches of the runs before accumulation existed."""
    keys = [[cfg.seed, 0, it, rank]] if cfg.grad_accum == 1 else \
        [[cfg.seed, 0, it, rank, micro] for micro in range(cfg.grad_accum)]
    return [common.get_batch(data, meta, cfg.batch_size, cfg.block_size,
                             np.random.default_rng(key), device) for key in keys]


def accumulate(model, batches, device, ddp=False):
    """Forward and backward over N micro-batches [(x, y), ...], each loss scaled by 1/N: the
    gradients of the mean loss, as nanoGPT accumulates. Under DDP the gradients are all-reduced on
    the last micro-step only (no_sync on the others). -> (the mean loss, the mean of each scalar
    stat), detached.

    N micro-batches of B equal one batch of N·B where a loss is a mean over tokens or sequences
    (the LM loss; TSA's depth loss; conddepth's per-sequence top-k, JEPA and Huber terms). Where
    a term is a nonlinear function of batch means, each micro-batch has its own (tests/
    test_scale.py checks each difference against its formula): DTRNet's eq. (7) weights
    α_l = f_l/Σf (the step's mean of α_l^m·ḡ_l^m, not α_l·ḡ_l); the hybrid's balance loss N·Σ f_i
    P_i (the difference: Σ_i Cov_m(f_i, P_i)) and its Gumbel noise (other draws); conddepth's
    budget loss (p̄_l − ρ)² (plus Var_m(p̄_l)), alive loss, the rank loss's pair count, and θ_l's
    running average (N updates a step, one per micro-batch); TSA's calibration (b2 shifts once,
    on the first micro-batch's quantile)."""
    n, total, sums = len(batches), 0.0, {}
    for micro, (x, y) in enumerate(batches):
        last = micro == n - 1
        with model.no_sync() if ddp and not last else contextlib.nullcontext():
            with common.autocast(device):
                _, loss, stats = model(x, y)
            (loss / n).backward()
        total = total + loss.detach()
        for k, v in stats.items():
            if torch.is_tensor(v) and v.numel() == 1:
                sums[k] = sums.get(k, 0.0) + v.detach().float()
    return total / n, {k: v / n for k, v in sums.items()}


def compile_failure(e, what, fix):
    """An exception raised while compiling `what` -> the NanorouteError naming its root cause and
    the fix, or None where it is not the compiler's (the model's own error, as eager raises it)."""
    chain = [e]  # the compiler's own exceptions wrap the cause (BackendCompilerFailed)
    while len(chain) < 20 and (getattr(chain[-1], "inner_exception", None)
                               or chain[-1].__cause__ or chain[-1].__context__):
        last = chain[-1]
        chain.append(getattr(last, "inner_exception", None) or last.__cause__ or last.__context__)
    if not any(type(c).__module__.startswith(("torch._dynamo", "torch._inductor")) for c in chain):
        return None
    why = (str(chain[-1]).strip().splitlines() or [""])[0][:200]
    return NanorouteError(f"--compile failed compiling {what} ({type(chain[-1]).__name__}: {why});"
                          f" run without it: {fix}")


def compile_checked(model, cfg, data, meta, device):
    """Rule: --compile failing at compile time (no C++ compiler, an op the compiler cannot take)
    is one line naming the cause and --compile=false, before anything is written into out_dir.
    torch.compile compiles at the first call: here one training forward and backward on a batch,
    whose traces are undone (RNG states, buffers, gradients), so the run is the one it would be
    without this call. -> the compiled model."""
    compiled = torch.compile(model)
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    x, y = common.get_batch(data, meta, cfg.batch_size, cfg.block_size,
                            np.random.default_rng([cfg.seed, 0, 0, 0]), device)
    try:
        with common.autocast(device):
            loss = compiled(x, y)[1]
        loss.backward()
    except Exception as e:
        raise compile_failure(e, "the training step", "--compile=false") or e
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    return compiled


def start_from(cfg, module, meta, master=True, ddp=False, given=None):
    """--init_from -> (cfg with the checkpoint's architecture, its state dict). The checkpoint is
    another run's ckpt.pt, or a Hugging Face GPT-2: a Hub name (downloaded once into data/hf/NAME/)
    or a folder holding config.json + model.safetensors. The architecture is the checkpoint's: a
    value given (a flag, or a preset's setting: given, see parse) that differs is refused, and one
    line says which values came from the checkpoint. given=None: the values other than the
    model's defaults count as given."""
    src, gpt2 = cfg.init_from, is_hf_gpt2(cfg.init_from)
    if gpt2 and os.path.isfile(os.path.join(src, "ckpt.pt")):
        raise NanorouteError(f"--init_from {src} is a run: pass {os.path.join(src, 'ckpt.pt')}")
    if gpt2 and src not in GPT2_NAMES:  # a folder: what it lacks first (nothing is downloaded)
        gpt2_folder(src, cfg.data_dir, HF_FILES)
    if gpt2 and cfg.model == "hybrid":
        raise NanorouteError("--model hybrid cannot start from GPT-2: its Gated DeltaNet layers "
                             "have no GPT-2 weights, and GPT-2 with random mixers in place of its "
                             "attention is no trained model (route GPT-2 with tsa, dtrnet or "
                             "conddepth, or train the hybrid from scratch)")
    if gpt2 and getattr(cfg, "norm", "layernorm") != "layernorm":
        raise NanorouteError(f"--norm={cfg.norm} cannot load GPT-2, whose blocks use LayerNorm")
    if gpt2 and meta.get("encoding") != "r50k_base":
        raise NanorouteError(f"GPT-2 reads GPT-2's BPE tokens; --dataset {cfg.dataset} has a "
                             f"vocabulary of {meta['vocab_size']} "
                             f"{meta.get('unit', 'token')}s: use --dataset shakespeare_bpe")

    def fetch(files):  # rank 0 downloads, the others wait for its files (or its refusal)
        on_rank0(lambda: gpt2_folder(src, cfg.data_dir, files), ddp, master)
        return gpt2_folder(src, cfg.data_dir, ())

    if gpt2:
        arch, ckpt = gpt2_config(fetch(HF_FILES[:1])), None  # config.json: small
    else:
        ckpt = common.load_checkpoint(src)
        arch = {k: ckpt["config"][k] for k in common.ARCH_FIELDS if k in ckpt["config"]}
    if arch.get("vocab_size", meta["vocab_size"]) != meta["vocab_size"]:
        raise NanorouteError(f"--init_from {src} has a vocabulary of {arch['vocab_size']}, "
                             f"--dataset {cfg.dataset} one of {meta['vocab_size']}: use the "
                             "dataset it learned")
    defaults = {f.name: f.default for f in dataclasses.fields(module.Config)}
    if given is None:
        given = {k: f"--{k}" for k, v in defaults.items() if getattr(cfg, k) != v}
    if gpt2:  # the run's block_size stays: GPT-2's positions may be cropped (as nanoGPT does)
        n_pos = arch.pop("block_size")
        if cfg.block_size > n_pos:
            raise NanorouteError(f"--block_size={cfg.block_size} is longer than {src}'s {n_pos} "
                                 "positions")
        if cfg.block_size < n_pos and master:
            print(f"note: block_size {cfg.block_size} keeps the first {cfg.block_size} of {src}'s "
                  f"{n_pos} positions (--block_size={n_pos} for all of them)")
    for k, v in arch.items():
        if k != "vocab_size" and k in given and getattr(cfg, k) != v:
            raise NanorouteError(f"--init_from {src} has {k}={v}, but this run asks for "
                                 f"{k}={getattr(cfg, k)}: drop --{k} (or the --preset setting it)")
    if master:
        print(f"from --init_from {src}: " + ", ".join(f"{k}={show(v)}" for k, v in arch.items())
              + "; the rest from this run's flags and defaults")
    cfg = dataclasses.replace(cfg, **arch)
    if not gpt2:
        return cfg, ckpt["model"]
    return cfg, gpt2_state_dict(fetch(HF_FILES), cfg.n_layer, cfg.block_size)


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


# --------------------------------------------------------------------------------------------------
# --init_from gpt2: a Hugging Face GPT-2 (config.json + model.safetensors) as our state dict

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # 124M, 350M, 774M, 1.56B parameters
HF_FILES = ("config.json", "model.safetensors")
# HF's GPT-2 stores these as Conv1D weights, (in, out): the transpose of nn.Linear's (out, in)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GPT2_LAYER = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
              "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
              "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")
SAFETENSORS_DTYPES = {"F64": ("<f8", torch.float64), "F32": ("<f4", torch.float32),
                      "F16": ("<f2", torch.float16), "BF16": ("<u2", torch.bfloat16)}  # bf16 bits


def is_hf_gpt2(init_from):
    """--init_from names a Hub GPT-2 or a Hugging Face checkpoint's folder, not a run's ckpt.pt."""
    return init_from in GPT2_NAMES or os.path.isdir(init_from)


def gpt2_folder(init_from, data_dir=common.DATA_DIR, files=HF_FILES):
    """The folder of a GPT-2 checkpoint: a local folder as it is, or for a Hub name data/hf/<name>/,
    where each of `files` is downloaded once (atomically: a file there is complete)."""
    if init_from not in GPT2_NAMES:
        missing = [f for f in files if not os.path.isfile(os.path.join(init_from, f))]
        if missing:
            raise NanorouteError(f"--init_from {init_from}: no {' or '.join(missing)} there "
                                 f"(a Hugging Face GPT-2 checkpoint is {' + '.join(HF_FILES)})")
        return init_from
    folder = os.path.join(data_dir, "hf", init_from)
    base = f"{common.hf_url()}/{init_from}/resolve/main"  # NANOROUTE_HF_URL: a mirror
    for f in files:
        dest = os.path.join(folder, f)
        if not os.path.exists(dest):
            os.makedirs(folder, exist_ok=True)
            common.download(f"{base}/{f}", dest,  # a user needs both files, in one folder
                            hint=f"download {' and '.join(HF_FILES)} from {base}/ into {folder}/")
        try:  # a file that is not what it claims (a proxy's HTML page) does not stay cached
            gpt2_config(folder) if f == "config.json" else safetensors_header(dest)
        except NanorouteError as e:
            os.remove(dest)
            why = str(e).removesuffix("; delete it and download it again")
            raise NanorouteError(f"{why}; removed it from the cache: the next run downloads it "
                                 "again")
    return folder


# A Hugging Face GPT-2 config.json: each field that changes the function our blocks compute, with
# the type it must have; a value unlike GPT-2's is refused (gpt2_config).
HF_SIZES = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd")
HF_TYPES = {"model_type": str, "activation_function": str, "n_inner": (int, type(None)),
            "layer_norm_epsilon": (float, int), "scale_attn_weights": bool,
            "scale_attn_by_inverse_layer_idx": bool, "reorder_and_upcast_attn": bool,
            "tie_word_embeddings": bool, "add_cross_attention": bool, "n_ctx": int,
            "architectures": list, **{k: int for k in HF_SIZES}}


def gpt2_config(folder):
    """Rule: a file read from outside is validated before use. A Hugging Face GPT-2's config.json
    -> our architecture fields: a JSON object whose sizes are positive ints and whose every field
    in HF_TYPES has its type; a variant our blocks do not compute (another activation, norm ε, FFN
    width, attention scale, an untied head) is refused."""
    path = os.path.join(folder, "config.json")
    gelus = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}  # HF's names
    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise NanorouteError(f"{path} is not a GPT-2 config ({type(e).__name__}: {e})")
    if not isinstance(c, dict):
        raise NanorouteError(f"{path} is not a GPT-2 config (a JSON {type(c).__name__}, not an "
                             "object)")
    for k, typ in HF_TYPES.items():
        v = c.get(k)
        if (k in HF_SIZES or v is not None) and (not isinstance(v, typ) or
                                                 isinstance(v, bool) and typ is not bool):
            raise NanorouteError(f"{path}: {k} is {v!r}, not {getattr(typ, '__name__', 'int')}: "
                                 "not a GPT-2 config")
    small = [k for k in HF_SIZES if c[k] < 1]
    if small:
        raise NanorouteError(f"{path}: {small[0]} is {c[small[0]]}, not a size: not a GPT-2 config")
    arch = dict(vocab_size=c["vocab_size"], block_size=c["n_positions"], n_layer=c["n_layer"],
                n_head=c["n_head"], n_embd=c["n_embd"], bias=True,
                gelu=gelus.get(c.get("activation_function", "gelu_new"), "?"))
    unlike = [(c.get("model_type") != "gpt2", f"model_type {c.get('model_type')!r}"),
              (arch["gelu"] == "?", f"activation_function {c.get('activation_function')!r}"),
              (c.get("n_inner") not in (None, 4 * arch["n_embd"]), f"n_inner {c.get('n_inner')}"),
              (c.get("layer_norm_epsilon", 1e-5) != 1e-5,
               f"layer_norm_epsilon {c.get('layer_norm_epsilon')}"),
              (not c.get("scale_attn_weights", True) or c.get("scale_attn_by_inverse_layer_idx"),
               "another attention scale"),
              (not c.get("tie_word_embeddings", True), "an untied head"),
              (c.get("add_cross_attention"), "cross-attention"),
              (c.get("n_ctx", c["n_positions"]) != c["n_positions"],
               f"n_ctx {c.get('n_ctx')} unlike n_positions {c['n_positions']}"),
              (not set(c.get("architectures") or ["GPT2LMHeadModel"])
               <= {"GPT2LMHeadModel", "GPT2Model"}, f"architectures {c.get('architectures')}")]
    for differs, what in unlike:
        if differs:
            raise NanorouteError(f"{path}: {what} is not GPT-2's (what nanoroute's blocks compute)")
    return arch


def safetensors_header(path):
    """Rule: a file read from outside is validated before use. A .safetensors file's header: 8
    bytes (a little-endian u64) giving its length, then JSON {name: {dtype, shape, data_offsets:
    [begin, end)}}, then the raw data. -> (data start, {name: (numpy dtype, torch dtype, shape,
    begin)}), once every tensor is known to lie within the file, to fill its range exactly, and
    to overlap no other."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= size - 8:
                raise ValueError(f"header length {n} in a file of {size} bytes")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is no JSON object")
        out, spans = {}, []
        for name, t in header.items():
            if name == "__metadata__":
                continue
            np_dtype, dtype = SAFETENSORS_DTYPES[t["dtype"]]
            (a, b), shape = t["data_offsets"], t["shape"]
            if not all(type(v) is int and v >= 0 for v in (a, b, *shape)):
                raise ValueError(f"{name}: data_offsets {t['data_offsets']} or shape {shape} are "
                                 "not counts")
            nbytes = math.prod(shape) * np.dtype(np_dtype).itemsize
            if b - a != nbytes or not a <= b <= size - 8 - n:
                raise ValueError(f"{name}: data_offsets {[a, b]} do not hold shape {shape}")
            out[name] = (np_dtype, dtype, shape, 8 + n + a)
            spans.append((a, b, name))
        spans.sort()
        for (_, b0, first), (a1, _, second) in zip(spans, spans[1:]):
            if a1 < b0:
                raise ValueError(f"{first} and {second} overlap")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise NanorouteError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e});"
                             " delete it and download it again")
    return out


def read_safetensors(path):
    """A .safetensors file -> {name: tensor}, its header checked first (safetensors_header)."""
    out = {}
    for name, (np_dtype, dtype, shape, begin) in safetensors_header(path).items():
        arr = np.fromfile(path, dtype=np_dtype, count=math.prod(shape), offset=begin)
        out[name] = torch.from_numpy(arr).view(dtype).reshape(shape)
    return out


def gpt2_state_dict(folder, n_layer, block_size):
    """A HF GPT-2's model.safetensors -> common.Model's state dict: a `transformer.` prefix
    and the causal-mask buffers (attn.bias, attn.masked_bias) dropped, h.<i> -> blocks.<i>, Conv1D
    weights transposed, positions cropped to block_size, the head tied. Anything else is refused."""
    path, sd = os.path.join(folder, "model.safetensors"), {}
    for name, t in read_safetensors(path).items():
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if name.startswith("h."):
            name = "blocks." + name[2:]
        sd[name] = t.t() if name.endswith(CONV1D) else t
    head = sd.pop("lm_head.weight", None)
    want = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"}
    want |= {f"blocks.{i}.{k}" for i in range(n_layer) for k in GPT2_LAYER}
    if set(sd) != want:
        odd = sorted(set(sd) - want)[:3] or [f"no {k}" for k in sorted(want - set(sd))[:3]]
        raise NanorouteError(f"{path} does not hold a {n_layer}-layer GPT-2: {', '.join(odd)}")
    if head is not None and not torch.equal(head, sd["wte.weight"]):
        raise NanorouteError(f"{path} has an lm_head unlike wte: nanoroute's head is tied")
    if block_size > sd["wpe.weight"].size(0):
        raise NanorouteError(f"block_size={block_size} is longer than the checkpoint's "
                             f"{sd['wpe.weight'].size(0)} positions")
    sd["wpe.weight"] = sd["wpe.weight"][:block_size]  # a shorter context: its first positions
    sd["lm_head.weight"] = sd["wte.weight"]
    return sd


# --------------------------------------------------------------------------------------------------
# The end of a run: what a user needs to trust the router, in words and numbers

def summary(model, cfg, meta, val_data, device, metrics_path):
    last = [r for r in read_metrics(metrics_path) if r["kind"] == "eval"][-1]
    hard, soft = last["val_loss"], last.get("val_soft_loss")
    print(f"\n== {cfg.model} on {cfg.dataset}: summary ==")
    print(f"val loss {hard:.4f}: what inference runs"
          + (f" (hard routing, sparse path); the training-mode (soft) model {soft:.4f}, so "
             f"inference costs {hard / soft - 1:+.1%}" if soft is not None else ""))
    if cfg.model != "gpt":
        dense = find_dense_run(cfg)
        print(f"dense GPT of the same preset ({dense[0]}): val {dense[1]:.4f}; "
              f"this model is {hard / dense[1] - 1:+.1%}"
              if dense else "no dense GPT of the same preset in out/ to compare with "
              "(run train.py --model gpt with the same flags)")
    skips = sorted((int(k[len("val_skip_l"):]), v) for k, v in last.items()
                   if k.startswith("val_skip_l"))
    if skips:
        print("work really skipped (share of tokens on the cheap path), per layer: "
              + ", ".join(f"layer {i} {v:.0%}" for i, v in skips)
              + f"; mean {sum(v for _, v in skips) / len(skips):.0%}"
              + (f"; forward FLOPs saved vs the dense GPT: {last['val_flops_saved_hard']:.1%}"
                 if "val_flops_saved_hard" in last else ""))
        print(speed_line(model, cfg, meta, val_data, device))
    files = [os.path.join(cfg.out_dir, f) for f in ("ckpt.pt", "best.pt", "metrics.jsonl")]
    if hasattr(model, "routing_map"):
        window = val_data[:min(cfg.block_size, 256)].astype(np.int64)
        idx = torch.tensor(window, device=device)[None]
        path = os.path.join(cfg.out_dir, "routing.html")
        title = f"{cfg.model} routing on the first validation window"
        print(picture(model, idx, meta, title, path))
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
    """(run dir, final val loss) of a dense GPT in out/ trained with this run's data, sizes and
    budget."""
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
    """Sparse vs dense-hard forward of this model, and vs a dense GPT of its size, timed now,
    interleaved."""
    x, _ = common.get_batch(val_data, meta, cfg.batch_size, cfg.block_size,
                            common.eval_rng(0, "val", 0), device)
    gpt_cfg = common.Config(**{k: getattr(cfg, k) for k in common.ARCH_FIELDS})
    gpt = common.Model(gpt_cfg).to(device).eval()
    model.eval()
    fns = {"sparse": lambda: model(x, sparse=True), "dense_hard": lambda: model(x),
           "gpt": lambda: gpt(x)}
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
    return (f"speed, measured now (forward, batch {cfg.batch_size}×{cfg.block_size}, median of "
            f"{repeats}): sparse {med['sparse'] * 1e3:.1f} ms = "
            f"{med['dense_hard'] / med['sparse']:.2f}× the same decisions computed densely, "
            f"{med['gpt'] / med['sparse']:.2f}× a dense GPT of the same size")


# --------------------------------------------------------------------------------------------------
# The routing picture. Every router returns routing_map(idx (1, T)) -> (m (R, T) in [0, 1], row
# labels, (meaning of 0, meaning of 1)); 1 = the token took the expensive path there. One renderer
# draws them all.

# light blue -> orange; black text stays readable on both
CHEAP, COSTLY = (214, 234, 248), (239, 138, 54)


def _mix(a):
    return tuple(round(c0 + (c1 - c0) * a) for c0, c1 in zip(CHEAP, COSTLY))


def render_routing(meta, idx, m, rows, legend, title, path=None, color=True, width=96):
    """idx (T,) ids, m (R, T) in [0, 1] -> terminal text (ANSI colour, or a plain marker line under
    each line of text when color=False) and, if path is given, a self-contained HTML file written
    atomically."""
    # a newline shows as ⏎ and ends the line
    toks = [common.decode(meta, [i]).replace("\n", "⏎\n") for i in idx]
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
            spans = "".join(f'<span style="background:rgb{_mix(a)}" title="{a:.2f}">'
                            f'{html.escape(t)}</span>' for t, a in zip(toks, vals))
            mean = sum(vals) / max(len(vals), 1)
            sections.append(f"<h2>{html.escape(label)} <small>({html.escape(legend[1])} {mean:.0%}"
                            f")</small></h2>\n<pre>{spans}</pre>")
        key = "".join(f'<span style="background:rgb{_mix(a)}">&nbsp;{html.escape(t)}&nbsp;</span> '
                      for a, t in ((0.0, legend[0]), (0.5, "between"), (1.0, legend[1])))
        page = ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>"
                + html.escape(title) + "</title>\n<style>"
                "body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#111;"
                "background:#fff}"
                "pre{font-size:16px;line-height:1.6;white-space:pre-wrap;word-break:break-all;"
                "border:1px solid #ccc;padding:.5em}"
                "h2{font-size:1em;margin:1.2em 0 .2em}span{color:#000}</style>"
                "</head><body>\n<h1>" + html.escape(title) + "</h1>\n"
                "<p>Each token is coloured by what the model ran for it in each layer. "
                + key + "</p>\n" + "\n".join(sections) + "\n</body></html>\n")
        write_atomic(path, page)
    return "\n".join(out)


def picture(model, idx, meta, title, path):
    """The model's routing_map drawn in the terminal (colour on a TTY) and written to path as
    HTML."""
    m, rows, legend = model.routing_map(idx)
    return render_routing(meta, idx[0].tolist(), m, rows, legend, title, path,
                          color=sys.stdout.isatty())


def encode_prompt(meta, text):
    """A prompt -> ids; a character outside the vocabulary is a one-line error."""
    if meta["dataset"] == "shakespeare":
        stoi = {c: i for i, c in enumerate(meta["itos"])}
        bad = sorted(set(text) - set(stoi))
        if bad:
            raise NanorouteError("the prompt has characters Tiny Shakespeare never uses: "
                                 f"{''.join(bad)!r}")
        return [stoi[c] for c in text]
    if meta.get("encoding") == "r50k_base":  # shakespeare_bpe, fineweb_edu: GPT-2's BPE
        return common.bpe().encode_ordinary(text)
    if meta["dataset"] == "enwik8":
        return list(text.encode("utf-8"))
    names = {"[BOS]": common.BOS, "[SEP]": common.SEP, "[EOS]": common.EOS}
    try:
        ids = [names[w] if w in names else int(w) for w in text.split()]
    except ValueError:
        raise NanorouteError(f"a {meta['dataset']} prompt is space-separated numbers "
                             f"0..{common.TASK_VOCAB - 1} and [BOS]/[SEP]/[EOS], got {text!r}")
    if not all(0 <= i < meta["vocab_size"] for i in ids):
        raise NanorouteError(f"prompt ids must be in 0..{meta['vocab_size'] - 1}")
    return ids


# --------------------------------------------------------------------------------------------------
# python train.py --sample RUN_DIR: nanoGPT's sample.py for a trained run

SAMPLE_FLAGS = {  # name: (default, one line of help); a flag's type is its default's
    "sample": ("", "the run directory to sample from (its best.pt, else its ckpt.pt)"),
    "prompt": ("\n", "the text to continue (copy/sort: numbers 0..31 and [BOS]/[SEP]/[EOS]; "
                     "default: the first held-out record's source)"),
    "num_tokens": (300, "tokens to generate (copy/sort default: the record's target and [EOS])"),
    "temperature": (0.8, "0: greedy; higher: more random"),
    "top_k": (200, "sample among the k most likely tokens"),
    "dense": (False, "decode without the KV cache: the whole window per token"),
    "compile": (False, "torch.compile the decoding step (its compile time is in the timing)"),
    "seed": (1337, "seed of the sampling"),
    "device": ("auto", "auto, cpu, cuda, cuda:N or mps"),
}


def sample_run(argv):
    opts = {k: v for k, (v, _) in SAMPLE_FLAGS.items()}
    # --prompt "": a newline, as nanoGPT's sample.py
    given = split_flags(argv, may_be_empty=("prompt",))
    for key, val in given.items():
        if key not in SAMPLE_FLAGS:
            raise NanorouteError(f"unknown option --{key} with --sample; "
                                 f"valid: --{', --'.join(SAMPLE_FLAGS)}")
        opts[key] = parse_value(key, type(SAMPLE_FLAGS[key][0]), val)
    run_dir = opts["sample"]
    if not os.path.isdir(run_dir):
        raise NanorouteError(f"--sample {run_dir}: no such run directory "
                             "(train one with python train.py --model ...)")
    if not 0 <= opts["seed"] < 2 ** 63:  # torch's seeds are 64-bit
        raise NanorouteError(f"--seed must be in 0..2**63-1, got {opts['seed']}")
    if opts["num_tokens"] < 1 or opts["temperature"] < 0 or opts["top_k"] < 1:
        raise NanorouteError("--num_tokens and --top_k must be >= 1 and --temperature >= 0")
    if opts["compile"] and opts["dense"]:  # what is printed is what ran: no step to compile
        raise NanorouteError("--compile compiles the cached decoding step, and --dense decodes "
                             "without one: give one of them")
    common.check_device_name(opts["device"])
    candidates = (os.path.join(run_dir, f) for f in ("best.pt", "ckpt.pt"))
    path = next((p for p in candidates if os.path.exists(p)), None)
    if path is None:
        raise NanorouteError(f"--sample {run_dir}: no best.pt or ckpt.pt there "
                             "(has the run reached its first eval?)")
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
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise NanorouteError(f"checkpoint {path}'s weights do not fit its own config: "
                             f"{str(e).splitlines()[0]}")
    meta = common.load_meta(cfg.dataset, cfg.data_dir)
    # copy/sort: complete a held-out record, as the summary does
    if "record_len" in meta and "prompt" not in given:
        val_data = common.load_split(cfg.dataset, "val", cfg.data_dir)
        ids = val_data[:common.TASK_LEN + 2].astype(np.int64).tolist()
        if "num_tokens" not in given:
            opts["num_tokens"] = common.TASK_LEN + 1
        print("no --prompt: completing the first held-out record's source "
              f"{common.decode(meta, ids)!r}")
    else:
        ids = encode_prompt(meta, opts["prompt"] or "\n")
    if not ids:
        raise NanorouteError(f"--prompt is empty; a {cfg.dataset} prompt needs at least one token "
                             "(e.g. '[BOS] 3 1')")
    if len(ids) > cfg.block_size:  # what is printed is what ran: the model sees its context
        print(f"note: the prompt's {len(ids)} tokens are more than the model's context "
              f"(block_size {cfg.block_size}): it continues from the last {cfg.block_size}")
    idx = torch.tensor(ids[-cfg.block_size:], dtype=torch.long, device=device)[None]  # (1, T0)
    torch.manual_seed(opts["seed"])
    t = time.perf_counter()
    try:
        with common.autocast(device):
            out = model.generate(idx, opts["num_tokens"], opts["temperature"], opts["top_k"],
                                 use_cache=not opts["dense"], compile=opts["compile"])
    except Exception as e:
        raise compile_failure(e, "the decoding step", "leave out --compile") or e
    common.sync(device)
    dt = time.perf_counter() - t
    cache_free = not model.decodes_cached(not opts["dense"])  # what generate ran, not the flag
    how = ("cache-free forward of the whole window per token" if cache_free
           else "KV-cached decoding" + (", routed" if hasattr(model, "routing_map") else "")
           + (", compiled step (includes compile time)" if opts["compile"] else ""))
    print(f"{cfg.model} from {path} (step {ckpt['iter']}, "
          f"val {ckpt.get('val_loss', float('nan')):.4f}); {opts['num_tokens']} tokens in "
          f"{dt:.2f}s ({opts['num_tokens'] / dt:.0f} tok/s, {how})")
    # the sample first: a failed picture loses nothing
    print("sample:\n" + common.decode(meta, out[0].tolist()), flush=True)
    if hasattr(model, "routing_map"):
        window = out[:, -cfg.block_size:]
        html_path = os.path.join(run_dir, "sample_routing.html")
        title = f"{cfg.model}: routing of the sample's last {window.size(1)} tokens"
        try:
            print(picture(model, window, meta, title, html_path) + f"\nwrote {html_path}")
        except OSError as e:
            print(picture(model, window, meta, title, None))
            print(f"warning: could not write {html_path} ({e.strerror}); the sample is above",
                  file=sys.stderr)


def print_sample_help():
    print("usage: python train.py --sample RUN_DIR [--prompt TEXT] [--num_tokens N] "
          "[--temperature T] ...\n\n"
          "Generate text from a trained run (nanoGPT's sample.py).\n")
    for k, (default, text) in SAMPLE_FLAGS.items():
        print(f"{'  --' + k + '=' + show(default):<24} {text}")


def resume_line(argv, cfg):
    """After Ctrl-C: the exact command that continues this run (or starts it again, with no
    checkpoint yet)."""
    flags = [f"--{k}" if v is None else f"--{k}={v}" for k, v in split_flags(argv).items()
             if k not in ("resume", "overwrite")]
    n = int(os.environ.get("WORLD_SIZE", 1))
    ddp = "RANK" in os.environ
    run = ["torchrun", "--standalone", f"--nproc_per_node={n}"] if ddp else ["python"]
    if os.path.exists(os.path.join(out_dir_of(cfg), "ckpt.pt")):
        return f"interrupted; continue with: {shlex.join([*run, 'train.py', *flags, '--resume'])}"
    return (f"interrupted before the first checkpoint; start again with: "
            f"{shlex.join([*run, 'train.py', *flags, '--overwrite'])}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        master, cfg = ddp_env()[1] == 0, None
    except NanorouteError:  # the one process says so (train refuses it again below)
        master, cfg = True, None
    wants_help = "-h" in argv or "--help" in argv
    try:
        sample = any(a == "--sample" or a.startswith("--sample=") for a in argv)
        if wants_help:
            if sample:
                print_sample_help()
            else:
                print_help([a for a in argv if a not in ("-h", "--help")])
            sys.stdout.flush()  # a reader gone (head, a pager) shows here, not at the exit's flush
            return None
        if sample:
            if master:  # under torchrun, one sample: rank 0's
                sample_run(argv)
            sys.stdout.flush()
            return None
        cfg, module, mode, given = parse(argv)
        best = train(cfg, module, mode, given)
        if "RANK" in os.environ:
            # DDP keeps gloo's worker threads alive past destroy_process_group, and one that frees a
            # collective's tensors while the interpreter shuts down aborts the process (SIGABRT): a
            # finished worker skips that
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(0)
        sys.stdout.flush()
        return best
    except BrokenPipeError:  # stdout's reader (head, a pager) stopped reading: end quietly
        # Python flushes stdout once more at exit: point it at devnull so that flush cannot fail too
        # (what Python's docs on SIGPIPE recommend)
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is no file (a test's capture): nothing to redirect
            pass
        if wants_help:
            return None
        sys.exit(1)  # as Python exits on a broken pipe: the output (or the run) was cut short
    except NanorouteError as e:
        message = str(e)
    except OSError as e:  # a full disk, a folder made read-only mid-run: one line, no traceback
        message = f"{e.filename}: {e.strerror}" if e.filename else str(e)
    except KeyboardInterrupt:  # Ctrl-C: checkpoints are atomic, so the last one is whole
        if master:
            print(resume_line(argv, cfg) if cfg is not None else "interrupted", file=sys.stderr)
        # a caller in this process (a test, a script) stops too; the command line exits 130 below
        raise
    if master:
        print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)  # main said how to resume; 130 = 128 + SIGINT, the shell's code for Ctrl-C
