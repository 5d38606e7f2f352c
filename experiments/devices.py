"""
The model × device × dtype table of results/devices.md: for every (device, dtype) given, each model's contract
tests (the `dev`-parametrised tests of tests/test_<model>.py), its training step in ms/iter at the classroom preset,
and its sparse vs dense-hard forward ratio, on a trained classroom checkpoint when one is in out/<model>-classroom.

  python experiments/devices.py                           # cpu fp32 and cpu bf16
  python experiments/devices.py --device cuda --dtypes bf16 fp32
"""
import os
import re
import subprocess
import sys

import torch

from compare import ROOT, entry, parser  # first: it puts the model files ahead of this folder on sys.path
import bench
import common
import train

TEST_FILES = {"gpt": "test_common.py", "tsa": "test_tsa.py", "dtrnet": "test_dtrnet.py",
              "conddepth": "test_conddepth.py", "hybrid": "test_hybrid_attn.py"}


def contract(model, dev_id):
    """Pass/fail counts of the model's tests parametrised with this (device, dtype)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", dev_id,
                        os.path.join("tests", TEST_FILES[model])], cwd=ROOT, capture_output=True, text=True)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-200:]
    n = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", last)}
    return n.get("passed", 0), n.get("failed", 0) + n.get("error", 0), n.get("skipped", 0)


def speed(name, device, dtype, repeats):
    """(train ms/iter at the classroom preset, sparse/dense-hard forward ratio, where the routing came from)."""
    cfg, module, _ = train.parse_args(["--model", name, "--preset", "classroom", f"--device={device.type}"])
    ckpt = os.path.join(ROOT, "out", f"{name}-classroom", "ckpt.pt")
    meta = common.prepare(cfg.dataset, cfg.data_dir)
    cfg = train.resolve(cfg, meta)
    model = module.Model(cfg).to(device)
    if os.path.exists(ckpt):
        model.load_state_dict(common.load_checkpoint(ckpt)["model"])
    data = common.load_split(cfg.dataset, "val", cfg.data_dir)
    x, y = common.get_batch(data, meta, cfg.batch_size, cfg.block_size, common.eval_rng(0, "val", 0), device)
    opt = common.make_optimizer(model, cfg, device)

    def step():  # a new model is in training mode
        with common.autocast(device, dtype):
            _, loss, _ = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    ms = 1e3 * bench.timeit({"step": step}, device, repeats)["step"]
    if name == "gpt":
        return ms, float("nan"), "-"
    if os.path.exists(ckpt):  # the optimiser steps above moved the weights: reload
        model.load_state_dict(common.load_checkpoint(ckpt)["model"])
    model.eval()
    with torch.no_grad(), common.autocast(device, dtype):
        t = bench.timeit({"sparse": lambda: model(x, sparse=True), "dense": lambda: model(x)}, device, repeats)
    return ms, t["dense"] / t["sparse"], f"trained (out/{name}-classroom)" if os.path.exists(ckpt) else "untrained"


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(common.DTYPES))
    p.add_argument("--repeats", type=int, default=5)
    entry(table, p.parse_args(argv))


def table(args):
    """One markdown row per (dtype, model), printed as it is measured."""
    device = common.pick_device(args.device)
    machine = f"{device.type}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
                                  f" ({os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    print(f"| model | device | dtype | contract tests (pass / fail / skip) | train ms/iter (classroom) | "
          f"sparse ÷ dense-hard speed | routing |\n|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        for name in TEST_FILES:
            ok, bad, skip = contract(name, f"{device.type}-{dtype}")
            ms, ratio, routing = speed(name, device, dtype, args.repeats)
            print(f"| {name} | {machine} | {dtype} | {ok} / {bad} / {skip} | {ms:.1f} | "
                  f"{'–' if ratio != ratio else f'{ratio:.2f}×'} | {routing} |", flush=True)


if __name__ == "__main__":
    main()
