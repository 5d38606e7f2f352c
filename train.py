"""
Train any nanoroute model on any dataset.

  python train.py --model tsa --dataset shakespeare
  python train.py --model dtrnet --dataset shakespeare --preset paper --max_iters=500
  python train.py --model gpt --dataset shakespeare --resume          # continue out/gpt-shakespeare
  torchrun --standalone --nproc_per_node=2 train.py --model gpt       # DDP (gloo on CPU, nccl on CUDA)

Every Config field is a flag (--key=value or --key value); the model file's Config has the defaults and
its PRESETS dict the named presets. Order: defaults < preset < flags. Each eval writes one JSON line to
out/<run>/metrics.jsonl and an atomic checkpoint; --resume continues exactly where the last one left off.
"""
import dataclasses
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
    if typ is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
    else:
        try:
            return typ(text)
        except ValueError:
            pass
    raise NanorouteError(f"--{name} expects {typ.__name__}, got {text!r}")


def parse_args(argv):
    """argv -> (Config, model module, resume). Unknown keys and bad values are one-line errors."""
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
    opts = dict(pairs)
    name = opts.pop("model", None) or "gpt"
    if name not in MODELS:
        raise NanorouteError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    module = importlib.import_module(MODELS[name])
    dataset = opts.pop("dataset", None) or "shakespeare"
    if dataset not in common.DATASETS:
        raise NanorouteError(f"unknown dataset {dataset!r}; choose one of {', '.join(common.DATASETS)}")
    resume = opts.pop("resume", "false")
    resume = resume is None or parse_value("resume", bool, resume)
    values = {}
    preset = opts.pop("preset", None)
    if preset is not None:
        presets = getattr(module, "PRESETS", {})
        if preset not in presets:
            raise NanorouteError(f"unknown preset {preset!r} for --model {name}; choose one of "
                                 f"{', '.join(presets) or '(none)'}")
        values.update(presets[preset])
    fields = {f.name: f for f in dataclasses.fields(module.Config)}
    for key, val in opts.items():
        if key not in fields:
            raise NanorouteError(f"unknown option --{key}; valid: --{', --'.join(list(FLAGS) + sorted(fields))}")
        if val is None and fields[key].type is not bool:
            raise NanorouteError(f"--{key} needs a value")
        values[key] = True if val is None else parse_value(key, fields[key].type, val)
    values.update(model=name, dataset=dataset)
    return module.Config(**values), module, resume


def resolve(cfg, meta):
    """Fill what the data decides: vocabulary, and for copy/sort the record length."""
    changes = {"vocab_size": meta["vocab_size"], "out_dir": cfg.out_dir or os.path.join("out", f"{cfg.model}-{cfg.dataset}")}
    if "record_len" in meta:
        changes["block_size"] = meta["record_len"] - 1
    return dataclasses.replace(cfg, **changes)


def write_json_atomic(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
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
    if cfg.init_from:  # start from another run's weights; its architecture wins
        init = common.load_checkpoint(cfg.init_from)
        cfg = dataclasses.replace(cfg, **{k: init["config"][k] for k in common.ARCH_FIELDS if k in init["config"]})
    cfg = resolve(cfg, meta)
    train_data = common.load_split(cfg.dataset, "train", cfg.data_dir)
    val_data = common.load_split(cfg.dataset, "val", cfg.data_dir)
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")

    torch.manual_seed(cfg.seed + rank)
    model = module.Model(cfg).to(device)
    if init is not None:
        try:
            missing, unexpected = model.load_state_dict(init["model"], strict=False)
        except RuntimeError as e:
            raise NanorouteError(f"--init_from {cfg.init_from} does not fit --model {cfg.model}: "
                                 f"{str(e).splitlines()[1].strip()}")
        if unexpected:
            raise NanorouteError(f"--init_from {cfg.init_from} has weights --model {cfg.model} lacks: {unexpected[:3]}")
        log(f"init from {cfg.init_from}: {len(missing)} new tensors")
    optimizer = common.make_optimizer(model, cfg, device)
    start, best_val = 0, float("inf")
    if resume:
        ckpt = common.load_checkpoint(ckpt_path)
        common.check_same_arch(ckpt["config"], cfg, ckpt_path)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start, best_val = ckpt["iter"], ckpt["best_val_loss"]
        torch.set_rng_state(ckpt["rng_cpu"][rank])
        if device.type == "cuda" and "rng_cuda" in ckpt:
            torch.cuda.set_rng_state(ckpt["rng_cuda"][rank])
        if master:  # drop what the killed run logged after its checkpoint, so the log reads as one run
            keep = [r for r in map(json.loads, open(metrics_path)) if r["step"] < start or
                    (r["kind"] == "eval" and r["step"] == start)] if os.path.exists(metrics_path) else []
            with open(metrics_path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in keep)
            os.replace(metrics_path + ".tmp", metrics_path)
        log(f"resuming {ckpt_path} at step {start}")
    elif master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        open(metrics_path, "w").close()
    if master:
        write_json_atomic(os.path.join(cfg.out_dir, "config.json"), dataclasses.asdict(cfg))
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    log(f"{cfg.model} on {cfg.dataset}: {raw_model.num_params() / 1e6:.2f}M parameters, device {device}, "
        f"{world} process(es), {cfg.max_iters} iters of {cfg.batch_size}×{cfg.block_size} tokens")

    def record(rec):
        if master:
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
            best_val = min(best_val, ev["val"]["loss"])
            extra = ", ".join(f"{k} {v:.4g}" for k, v in ev["val"].items() if k not in ("loss",))
            log(f"step {it}: train loss {ev['train']['loss']:.4f}, val loss {ev['val']['loss']:.4f} ({extra})")
            record({"kind": "eval", "step": it, "time": round(time.time() - t0, 2),
                    "train_loss": ev["train"]["loss"], "val_loss": ev["val"]["loss"],
                    **{f"val_{k}": v for k, v in ev["val"].items() if k != "loss"}})
            common.save_checkpoint(
                ckpt_path, model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
                config=dataclasses.asdict(cfg), iter=it, best_val_loss=best_val, **rng)
        if it == cfg.max_iters:
            break
        if hasattr(raw_model, "on_step"):  # schedules that depend on the step (temperatures, label phases)
            raw_model.on_step(it)
        lr = common.lr_at(it, cfg)
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
            log(f"iter {it}: loss {lossf:.4f}, lr {lr:.2e}, grad norm {grad_norm.item():.3g}, {dt * 1000:.0f} ms/iter")
            record({"kind": "train", "step": it, "loss": lossf, "lr": lr, "grad_norm": grad_norm.item(),
                    **{k: v.item() for k, v in stats.items() if v.numel() == 1}})
    if ddp:
        torch.distributed.destroy_process_group()
    if master:
        log(f"done in {time.time() - t0:.0f}s; best val loss {best_val:.4f}")
        sample(raw_model, val_data, meta, device)
    return best_val


def _gather_rng(state, ddp):
    """Every rank's RNG state, so a DDP run resumes exactly too."""
    if not ddp:
        return [state]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, state)
    return out


def sample(model, val_data, meta, device, n=200):
    model.eval()
    if "record_len" in meta:  # copy/sort: complete a held-out record greedily
        prompt = torch.tensor(val_data[:common.TASK_LEN + 2].astype(np.int64), device=device)[None]
        out = model.generate(prompt, common.TASK_LEN + 1, temperature=0)
    else:
        prompt = torch.tensor(val_data[:1].astype(np.int64), device=device)[None]
        out = model.generate(prompt, n, temperature=0.8, top_k=200)
    print("sample:\n" + common.decode(meta, out[0].tolist()))


def main(argv=None):
    try:
        cfg, module, resume = parse_args(sys.argv[1:] if argv is None else argv)
        return train(cfg, module, resume)
    except NanorouteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
