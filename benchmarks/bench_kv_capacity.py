"""Paged KV blocks against a contiguous reservation of max_model_len per sequence, at the
same KV-cache bytes, on one mixed-length workload.

The contiguous baseline is the same engine whose scheduler reserves a sequence's whole
context (max_model_len tokens of blocks) when it admits it, as an engine with one
contiguous KV buffer per sequence must; paging allocates a block when a sequence reaches it.
Same model, same kernels, prefix caching off in both, every request queued at t = 0.
Reported for each: the most sequences running at once, output tokens per second, preemptions,
and the KV bytes allocated but holding no token (mean and peak over steps).

    python benchmarks/bench_kv_capacity.py [--requests 96] [--kv-cache-memory 48MiB] [--max-model-len 1024]
        [--dtype bfloat16] [--admission-reserve-tokens 64] [--kv-cache-dtype auto] [--rounds 1]

With --rounds N both kinds run N times, interleaved in alternating order after an untimed
pass of each, and the table shows each kind's median round with every round's tok/s; the
throughput ratio is given both as the ratio of the two medians and as the median of the
rounds' own ratios (each round runs both back to back).
"""

from __future__ import annotations

import argparse
import json
import statistics

from tailserve.config import DEFAULT_ADMISSION_RESERVE_TOKENS
from tailserve.demo.capacity import mixed_workload, run_capacity


def run(kind: str, requests, kv_bytes: int, max_len: int, dtype: str = "bfloat16",
        admission_reserve_tokens: int = DEFAULT_ADMISSION_RESERVE_TOKENS,
        kv_cache_dtype: str = "auto") -> dict[str, float]:
    return run_capacity(kind, requests, kv_bytes, max_len, dtype=dtype,
                        admission_reserve_tokens=admission_reserve_tokens, kv_cache_dtype=kv_cache_dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--kv-cache-memory", default="48MiB")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--admission-reserve-tokens", type=int, default=DEFAULT_ADMISSION_RESERVE_TOKENS,
                    help="the paged engine's admission reserve (0: vLLM V1's admit-then-preempt)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    from tailserve.config import parse_bytes

    kv = parse_bytes(args.kv_cache_memory)
    reqs = mixed_workload(args.requests)
    rounds: dict[str, list[dict]] = {"paged": [], "contiguous": []}
    # One untimed pass of each first (the first engine of a process pays one-time costs: oneDNN's
    # kernels for new shapes, the allocator's first pages), then rounds in alternating order.
    for k in rounds:
        run(k, reqs[:16], kv, args.max_model_len, args.dtype, args.admission_reserve_tokens, args.kv_cache_dtype)
    for i in range(args.rounds):
        for k in (("paged", "contiguous") if i % 2 == 0 else ("contiguous", "paged")):
            rounds[k].append(run(k, reqs, kv, args.max_model_len, args.dtype, args.admission_reserve_tokens,
                                 args.kv_cache_dtype))
    res = {}
    for k, rs in rounds.items():
        res[k] = dict(sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2])  # the median round's figures
        res[k]["tok_s_rounds"] = [round(r["tok_s"], 1) for r in rs]
    print(f"{args.requests} requests (prompts 32-480 tokens, 16-192 new), KV cache {args.kv_cache_memory}, "
          f"max_model_len {args.max_model_len}, {args.dtype}, KV {res['paged']['kv_cache_dtype']}, "
          f"admission reserve {args.admission_reserve_tokens} tokens, {args.rounds} round(s), "
          f"huge pages {'on' if res['paged']['huge_pages'] else 'off'}")
    print(f"{'':12s} {'max concurrent':>15s} {'mean concurrent':>16s} {'tok/s':>8s} {'preemptions':>12s} "
          f"{'mean wasted MiB':>16s} {'peak wasted MiB':>16s}")
    for k, r in res.items():
        print(f"{k:12s} {r['max_concurrent']:15d} {r['mean_concurrent']:16.1f} {r['tok_s']:8.1f} "
              f"{r['preemptions']:12d} {r['mean_wasted_mib']:16.2f} {r['peak_wasted_mib']:16.2f}"
              + (f"   rounds {r['tok_s_rounds']}" if args.rounds > 1 else ""))
    p, c = res["paged"], res["contiguous"]
    # Each round ran both back to back: the median of their ratios takes out the machine's
    # drift between rounds, which the ratio of the two medians keeps.
    pairs = sorted(a["tok_s"] / b["tok_s"] for a, b in zip(rounds["paged"], rounds["contiguous"]))
    res["paired_ratio_median"] = statistics.median(pairs)
    res["paired_ratios"] = [round(x, 3) for x in pairs]
    print(f"paged / contiguous: max concurrent {p['max_concurrent'] / c['max_concurrent']:.2f}x, "
          f"throughput {p['tok_s'] / c['tok_s']:.2f}x (ratio of the medians)"
          + (f", {res['paired_ratio_median']:.2f}x (median of the {len(pairs)} rounds' ratios, "
             f"{pairs[0]:.2f}-{pairs[-1]:.2f})" if args.rounds > 1 else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
