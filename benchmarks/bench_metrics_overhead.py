"""Overhead of the measurement layer: engine throughput with metrics on vs off, one run.

One engine runs the same workload with recording switched on and off between runs
(alternating, --runs times each), so both see the same weights, KV cache and memory
placement; the figure is the ratio of median throughputs. Target: less than 2% overhead.

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

    llm = LLM(args.model, dtype=args.dtype, enable_metrics=True, kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    prompt = list(range(10, 74))
    for batch in args.batch:
        tput: dict[bool, list[float]] = {True: [], False: []}
        llm.generate([prompt] * batch, params)  # warm-up
        for _ in range(args.runs):
            for flag in (True, False):
                llm.engine.metrics_enabled = flag  # read per request (timelines) and per step
                t = time.perf_counter()
                llm.generate([prompt] * batch, params)
                tput[flag].append(batch * args.new_tokens / (time.perf_counter() - t))
        on, off = statistics.median(tput[True]), statistics.median(tput[False])
        print(f"batch {batch:>3}: metrics on {on:8.1f} tok/s, off {off:8.1f} tok/s, "
              f"overhead {100 * (off - on) / off:+.2f}% (median of {args.runs})")


if __name__ == "__main__":
    main()
