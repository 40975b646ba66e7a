"""Paged KV blocks against a contiguous reservation of max_model_len per sequence, at the
same KV-cache bytes, on one mixed-length workload.

The contiguous baseline is the same engine whose scheduler reserves a sequence's whole
context (max_model_len tokens of blocks) when it admits it, as an engine with one
contiguous KV buffer per sequence must; paging allocates a block when a sequence reaches it.
Same model, same kernels, prefix caching off in both, every request queued at t = 0.
Reported for each: the most sequences running at once, output tokens per second, preemptions,
and the KV bytes allocated but holding no token (mean and peak over steps).

    python benchmarks/bench_kv_capacity.py [--requests 96] [--kv-cache-memory 48MiB] [--max-model-len 1024]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tailserve import LLM, SamplingParams
from tailserve.engine.scheduler import Scheduler
from tailserve.memory.kv_cache import kv_bytes_per_block


class ContiguousReservationScheduler(Scheduler):
    """Reserves max_model_len tokens of blocks per sequence at admission."""

    def __init__(self, *args, max_model_len: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.max_model_len = max_model_len

    def _blocks_at_admission(self, req, num_tokens: int) -> int:
        return -(-max(num_tokens, self.max_model_len) // self.block_size)


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 4000) for _ in range(rng.randint(32, 480))], rng.randint(16, 192)) for _ in range(n)]


def run(kind: str, requests, kv_bytes: int, max_len: int, dtype: str = "bfloat16") -> dict[str, float]:
    llm = LLM(dtype=dtype, kv_cache_memory_bytes=kv_bytes, max_model_len=max_len, enable_prefix_caching=False,
              max_num_seqs=256, enable_metrics=False)
    eng = llm.engine
    if kind == "contiguous":
        old = eng.core.scheduler
        eng.core.scheduler = ContiguousReservationScheduler(old.config, old.pool, max_model_len=max_len)
    bs = eng.config.block_size
    bytes_per_token = kv_bytes_per_block(eng.arch, bs, eng.info.dtype) // bs
    for prompt, n in requests:
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    running, wasted = [], []
    generated = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        outs = eng.step()
        generated += sum(len(o.delta_token_ids) for o in outs)
        sched = eng.core.scheduler
        running.append(len(sched.running))
        slots = sum(len(r.block_ids) for r in sched.running) * sched.block_size
        live = sum(r.num_computed_tokens for r in sched.running)
        wasted.append((slots - live) * bytes_per_token)
    dt = time.perf_counter() - t0
    return {"max_concurrent": max(running), "mean_concurrent": statistics.mean(running),
            "tok_s": generated / dt, "preemptions": eng.core.scheduler.num_preemptions,
            "mean_wasted_mib": statistics.mean(wasted) / 2**20, "peak_wasted_mib": max(wasted) / 2**20,
            "num_blocks": eng.block_pool.num_blocks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--kv-cache-memory", default="48MiB")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json")
    args = ap.parse_args()
    from tailserve.config import parse_bytes

    kv = parse_bytes(args.kv_cache_memory)
    reqs = workload(args.requests)
    res = {k: run(k, reqs, kv, args.max_model_len, args.dtype) for k in ("paged", "contiguous")}
    print(f"{args.requests} requests (prompts 32-480 tokens, 16-192 new), KV cache {args.kv_cache_memory}, "
          f"max_model_len {args.max_model_len}, {args.dtype}")
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
