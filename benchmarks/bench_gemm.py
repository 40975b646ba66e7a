"""The compiled CPU kernels' bf16 products on the 55M model's shapes (PEERS.md): the row-major
dot-product kernel against the outer-product kernel over weights packed in 16-column panels
(issue 27 item 4), with PyTorch's float32 GEMM over the widened weight as the peer, in one run.

Per shape (N x K) and row count M: GFLOP/s of each, best of --runs timings of enough calls to
take ~0.1 s, the kernels through ``CpuKernels.gemm`` (a ctypes call: a few microseconds each,
visible only at one row on the small shapes). The shapes: the fused QKV (768 x 512), the output
(512 x 512), gate/up (2816 x 512), down (512 x 1408), the LM head (32000 x 512), and a 128 MiB
weight that no cache holds (131072 x 512: batch 1 against DRAM).

    python benchmarks/bench_gemm.py [--runs 5] [--threads 2] [--rows 1 2 3 4 5 16 128]

Compare with the machine's FMA peak (2 AVX2 cores of docs/benchmarks.md: 204 GFLOP/s).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tailserve.kernels import cpu as cpu_kernels

SHAPES = [(768, 512), (512, 512), (2816, 512), (512, 1408), (32000, 512), (131072, 512)]


def gflops(fn, m: int, n: int, k: int, runs: int) -> float:
    fn()
    once = time.perf_counter()
    fn()
    once = max(time.perf_counter() - once, 1e-6)
    reps = max(3, int(0.1 / once))
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return 2.0 * m * n * k / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 16, 128])
    args = ap.parse_args()
    kernels = cpu_kernels.kernels()
    if kernels is None:
        raise SystemExit(f"the compiled CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; GFLOP/s, best of "
          f"{args.runs}")
    print(f"{'N x K':>13} {'M':>4} {'rows':>8} {'panels':>8} {'torch f32':>9} {'panels/rows':>11}")
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g).bfloat16()
        packed = cpu_kernels.pack_panels(w)
        wide = w.float()
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            rows = gflops(lambda x=x, w=w: kernels.gemm(x, w), m, n, k, args.runs)
            panels = gflops(lambda x=x, p=packed: kernels.gemm(x, p), m, n, k, args.runs)
            ref = gflops(lambda x=x, wf=wide: F.linear(x, wf), m, n, k, args.runs)
            print(f"{n:>6} x {k:<4} {m:>4} {rows:>8.1f} {panels:>8.1f} {ref:>9.1f} {panels / rows:>10.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
