"""Paged KV blocks against a contiguous per-sequence reservation, in the same KV bytes.

The contiguous baseline is the same engine whose scheduler reserves a sequence's whole
context (``max_model_len`` tokens of blocks) when it admits it, as an engine with one
contiguous KV buffer per sequence must; paging allocates a block when a sequence reaches it.
Same model, same kernels, prefix caching off in both, every request queued at t = 0. Used by
the demo's memory act and ``benchmarks/bench_kv_capacity.py``.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from tailserve.config import DEFAULT_ADMISSION_RESERVE_TOKENS
from tailserve.engine.llm import LLM
from tailserve.engine.scheduler import Scheduler
from tailserve.memory.kv_cache import kv_bytes_per_block
from tailserve.sampling_params import SamplingParams


class ContiguousReservationScheduler(Scheduler):
    """Reserves max_model_len tokens of blocks per sequence at admission."""

    def __init__(self, *args: Any, max_model_len: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.max_model_len = max_model_len

    def _blocks_at_admission(self, req: Any, num_tokens: int) -> int:
        return -(-max(num_tokens, self.max_model_len) // self.block_size)

    def _admission_reserve(self) -> int:
        return 0  # every admitted sequence already holds its whole context


def mixed_workload(n: int, seed: int = 0, prompt_range: tuple[int, int] = (32, 480),
                   output_range: tuple[int, int] = (16, 192), vocab: int = 4000) -> list[tuple[list[int], int]]:
    """n (prompt token ids, new tokens) pairs, lengths uniform in the ranges."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(n)]


def bytes_per_token(llm: LLM) -> int:
    eng = llm.engine
    bs = eng.config.block_size
    return kv_bytes_per_block(eng.arch, bs, eng.info.plan.kv_dtype) // bs


def run_capacity(kind: str, requests: list[tuple[list[int], int]], kv_bytes: int, max_len: int,
                 model: str | None = None, dtype: str = "auto",
                 admission_reserve_tokens: int = DEFAULT_ADMISSION_RESERVE_TOKENS,
                 kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Run every request to its end under ``kind`` ("paged" | "contiguous"): the most
    sequences running at once, their mean, output tokens/s, preemptions, and the KV bytes
    allocated but holding no token (mean and peak over steps)."""
    llm = LLM(model, dtype=dtype, kv_cache_memory_bytes=kv_bytes, max_model_len=max_len, enable_prefix_caching=False,
              max_num_seqs=256, enable_metrics=False, admission_reserve_tokens=admission_reserve_tokens,
              kv_cache_dtype=kv_cache_dtype)
    eng = llm.engine
    if kind == "contiguous":
        old = eng.core.scheduler
        eng.core.scheduler = ContiguousReservationScheduler(old.config, old.pool, max_model_len=max_len)
    elif kind != "paged":
        raise ValueError(f"kind must be paged or contiguous, got {kind!r}")
    per_token = bytes_per_token(llm)
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
        wasted.append((slots - live) * per_token)
    dt = time.perf_counter() - t0
    out = {"max_concurrent": max(running), "mean_concurrent": statistics.mean(running),
           "tok_s": generated / dt, "preemptions": eng.core.scheduler.num_preemptions,
           "mean_wasted_mib": statistics.mean(wasted) / 2**20, "peak_wasted_mib": max(wasted) / 2**20,
           "num_blocks": eng.block_pool.num_blocks, "bytes_per_token": per_token, "seconds": dt,
           "kv_cache_dtype": str(eng.info.plan.kv_dtype).removeprefix("torch."),
           "huge_pages": eng.info.plan.huge_pages}
    llm.shutdown()
    return out
