"""Time of the FFN on M rows (x (M, d) -> W1 -> GELU -> W2, d -> 4d -> d) on one core against M: does skipping rows
of a small decode batch pay? (results/bench.md, "Why small-batch decode does not follow FLOPs")
  OMP_NUM_THREADS=1 taskset -c 0 python experiments/gemm_rows.py [M,M,...]   (default 1,2,4,6,8,16,64)"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
for d in (256, 640):
    W1, W2 = torch.randn(4 * d, d), torch.randn(d, 4 * d)

    def ffn(x):
        return F.linear(F.gelu(F.linear(x, W1)), W2)  # (M, d) -> (M, 4d) -> (M, d)
    base = None
    for M in [int(m) for m in (sys.argv[1:] or ['1,2,4,6,8,16,64'])[0].split(',')]:
        x = torch.randn(M, d)
        for _ in range(50): ffn(x)
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            for _ in range(50): ffn(x)
            ts.append((time.perf_counter() - t) / 50)
        t = statistics.median(ts)
        base = base or t
        print(f"d={d} FFN on M={M:3d} rows: {1e6 * t:8.1f} us  ({t / base:.2f}x the 1-row time, {M} rows of FLOPs)")
