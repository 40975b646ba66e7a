"""Paged KV blocks against a contiguous reservation of max_model_len per sequence, at the
same KV-cache bytes, on one mixed-length workload.

The contiguous baseline is the same engine whose scheduler reserves a sequence's whole
context (max_model_len tokens of blocks) when it admits it, as an engine with one
contiguous KV buffer per sequence must; paging allocates a block when a sequence reaches it.
Same model, same kernels, prefix caching off in both, every request queued at t = 0.
Reported for each: the most sequences running at once, output tokens per second, preemptions,
and the KV bytes allocated but holding no token (mean and peak over steps).

    python benchmarks/bench_kv_capacity.py [--requests 96] [--kv-cache-memory 48MiB] [--max-model-len 1024]
        [--dtype bfloat16] [--admission-reserve-tokens 64]
"""

from __future__ import annotations

import argparse
import json

from tailserve.config import DEFAULT_ADMISSION_RESERVE_TOKENS
from tailserve.demo.capacity import mixed_workload, run_capacity


def run(kind: str, requests, kv_bytes: int, max_len: int, dtype: str = "bfloat16",
        admission_reserve_tokens: int = DEFAULT_ADMISSION_RESERVE_TOKENS) -> dict[str, float]:
    return run_capacity(kind, requests, kv_bytes, max_len, dtype=dtype,
                        admission_reserve_tokens=admission_reserve_tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--kv-cache-memory", default="48MiB")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--admission-reserve-tokens", type=int, default=DEFAULT_ADMISSION_RESERVE_TOKENS,
                    help="the paged engine's admission reserve (0: vLLM V1's admit-then-preempt)")
    ap.add_argument("--json")
    args = ap.parse_args()
    from tailserve.config import parse_bytes

    kv = parse_bytes(args.kv_cache_memory)
    reqs = mixed_workload(args.requests)
    res = {k: run(k, reqs, kv, args.max_model_len, args.dtype, args.admission_reserve_tokens)
           for k in ("paged", "contiguous")}
    print(f"{args.requests} requests (prompts 32-480 tokens, 16-192 new), KV cache {args.kv_cache_memory}, "
          f"max_model_len {args.max_model_len}, {args.dtype}, admission reserve {args.admission_reserve_tokens} tokens")
    print(f"{'':12s} {'max concurrent':>15s} {'mean concurrent':>16s} {'tok/s':>8s} {'preemptions':>12s} "
          f"{'mean wasted MiB':>16s} {'peak wasted MiB':>16s}")
    for k, r in res.items():
        print(f"{k:12s} {r['max_concurrent']:15d} {r['mean_concurrent']:16.1f} {r['tok_s']:8.1f} "
              f"{r['preemptions']:12d} {r['mean_wasted_mib']:16.2f} {r['peak_wasted_mib']:16.2f}")
    p, c = res["paged"], res["contiguous"]
    print(f"paged / contiguous: max concurrent {p['max_concurrent'] / c['max_concurrent']:.2f}x, "
          f"throughput {p['tok_s'] / c['tok_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
