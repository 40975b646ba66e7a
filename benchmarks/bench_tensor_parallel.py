"""Tensor parallelism on the CPU: one rank against two, same model, same machine, one run.

Batch 1 and batch 16 (16 copies of a prompt), greedy, --new-tokens tokens with the length
forced. decode tok/s = batch * (N - 1) / (t(N) - t(1)), median over --runs runs, and the
two-rank figure as a ratio of the one-rank figure measured in the same run. One rank uses
all the cores; two ranks get half each (tensor_parallel.threads_per_rank), so on a small
machine this measures the cost of the split (collectives, a process hop per step), not a
speed-up: tensor parallelism pays where one device cannot hold, or feed, the model.

    python benchmarks/bench_tensor_parallel.py [--runs 3] [--new-tokens 64] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tailserve import LLM, SamplingParams

PROMPT = "def parse_config(path, *, strict=False):\n    \"\"\"Read a configuration file and"


def timed(llm: LLM, batch: int, n: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([PROMPT] * batch, params)
    return time.perf_counter() - t


def decode_tok_s(llm: LLM, batch: int, n: int) -> float:
    t1 = timed(llm, batch, 1)
    tn = timed(llm, batch, n)
    return batch * (n - 1) / (tn - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    results: dict[tuple[int, int], list[float]] = {}
    cores = torch.get_num_threads()
    engines = {1: LLM(dtype=args.dtype, enable_prefix_caching=False),
               2: LLM(dtype=args.dtype, enable_prefix_caching=False, tensor_parallel_size=2)}
    # Rank 0 shares this process with the one-rank engine: its thread count is set for each
    # (the two-rank engine set it to its per-rank share when it started).
    threads = {1: cores, 2: torch.get_num_threads()}
    try:
        for tp, llm in engines.items():  # warm-up: one-time costs out of the timings
            torch.set_num_threads(threads[tp])
            decode_tok_s(llm, 16, 8)
        for _ in range(args.runs):
            for tp, llm in engines.items():  # interleaved: drift hits both alike
                torch.set_num_threads(threads[tp])
                for batch in (1, 16):
                    results.setdefault((tp, batch), []).append(decode_tok_s(llm, batch, args.new_tokens))
    finally:
        engines[2].shutdown()
    print(f"threads per rank: 1 rank {threads[1]}, 2 ranks {threads[2]}")
    print(f"built-in model, {args.dtype}, {args.new_tokens} new tokens, median of {args.runs} runs")
    print("| ranks | batch 1 decode tok/s | batch 16 decode tok/s | vs 1 rank (batch 1 / 16) |")
    print("| --- | --- | --- | --- |")
    base = {b: statistics.median(results[(1, b)]) for b in (1, 16)}
    for tp in (1, 2):
        med = {b: statistics.median(results[(tp, b)]) for b in (1, 16)}
        print(f"| {tp} | {med[1]:.1f} | {med[16]:.1f} | {med[1] / base[1]:.2f}x / {med[16] / base[16]:.2f}x |")


if __name__ == "__main__":
    main()
