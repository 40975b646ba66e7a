"""Overhead of the measurement layer: engine throughput with metrics on vs off, one run.

Two engines on the same checkpoint (one with enable_metrics=False) run the same workload,
alternating, --runs times each; the figure is the ratio of median throughputs. Target:
less than 2% overhead.

    python benchmarks/bench_metrics_overhead.py [--model DIR] [--batch 16] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tailserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    engines = {flag: LLM(args.model, dtype=args.dtype, enable_metrics=flag, kv_cache_memory_bytes=1 << 30)
               for flag in (True, False)}
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    prompt = list(range(10, 74))
    for batch in args.batch:
        tput: dict[bool, list[float]] = {True: [], False: []}
        for llm in engines.values():  # warm-up
            llm.generate([prompt] * batch, params)
        for _ in range(args.runs):
            for flag, llm in engines.items():
                t = time.perf_counter()
                llm.generate([prompt] * batch, params)
                tput[flag].append(batch * args.new_tokens / (time.perf_counter() - t))
        on, off = statistics.median(tput[True]), statistics.median(tput[False])
        print(f"batch {batch:>3}: metrics on {on:8.1f} tok/s, off {off:8.1f} tok/s, "
              f"overhead {100 * (off - on) / off:+.2f}% (median of {args.runs})")


if __name__ == "__main__":
    main()
