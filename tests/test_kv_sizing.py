"""KV-cache sizing from --gpu-memory-utilization after a profiling pass (memory/kv_sizing.py).

A CPU has no allocator statistics, so ``ScriptedMemory`` stands in for the device's: it
reports what the test says the device holds, and records the profiling pass's effect (its
peak) only while that pass runs: the pass itself is the worker's real forward."""

from __future__ import annotations

import pytest

from tailserve.errors import ConfigError
from tailserve.memory.kv_sizing import MemoryProfile, num_blocks_from_profile, profile_memory

GIB = 1 << 30


class ScriptedMemory:
    def __init__(self, total: int, weights: int, activations: int, non_torch: int, cached: int = 0) -> None:
        self.total, self.weights, self.activations, self.non_torch, self.cached = total, weights, activations, \
            non_torch, cached
        self.allocated = weights
        self.peak = weights
        self.calls: list[str] = []

    def run(self, fn):
        def step() -> None:
            self.calls.append("step")
            fn()
            self.peak = max(self.peak, self.weights + self.activations)
        return step

    def mem_get_info(self) -> tuple[int, int]:
        used = self.non_torch + self.memory_reserved()
        return self.total - used, self.total

    def memory_allocated(self) -> int:
        return self.allocated

    def memory_reserved(self) -> int:
        return self.peak + self.cached

    def max_memory_allocated(self) -> int:
        return self.peak

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset")
        self.peak = self.allocated

    def empty_cache(self) -> None:
        self.calls.append("empty")
        self.cached = 0


def test_the_budget_is_the_fraction_minus_weights_activations_and_non_torch_memory():
    mem = ScriptedMemory(total=80 * GIB, weights=16 * GIB, activations=3 * GIB, non_torch=1 * GIB, cached=GIB)
    prof = profile_memory(mem, mem.run(lambda: None), 0.9)
    assert mem.calls == ["empty", "reset", "step", "empty"]  # the peak is reset before the pass, read after
    assert (prof.weights_bytes, prof.peak_activation_bytes, prof.non_torch_bytes) == (16 * GIB, 3 * GIB, GIB)
    assert prof.kv_cache_bytes == int(0.9 * 80 * GIB) - 20 * GIB
    assert num_blocks_from_profile(prof, 2 << 20) == (int(0.9 * 80 * GIB) - 20 * GIB) // (2 << 20)
    text = prof.describe(100, 16)
    assert "100 blocks = 1600 tokens" in text and "0.9 x 80.00 GiB" in text


def test_a_fraction_too_small_for_the_weights_says_what_took_the_memory():
    prof = MemoryProfile(total_bytes=24 * GIB, weights_bytes=15 * GIB, peak_activation_bytes=2 * GIB,
                         non_torch_bytes=GIB, utilization=0.5)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization 0.5 leaves no room.*weights 15.00 GiB"):
        num_blocks_from_profile(prof, 1 << 20)


def test_the_worker_profiles_its_largest_step_and_sizes_the_cache(llama_checkpoint):
    """The worker's own pass runs (a real forward of max_num_batched_tokens tokens, in
    sequences of at most max_model_len) and the cache gets the blocks the budget holds."""
    from tailserve.config import EngineConfig
    from tailserve.engine.worker import Worker

    path, _ = llama_checkpoint
    worker = Worker(EngineConfig(model=str(path), dtype="float32", max_num_batched_tokens=700, max_model_len=256,
                                 max_num_seqs=8))
    from tailserve.config import DEFAULT_KV_CACHE_MEMORY_BYTES

    assert worker.memory_profile is None  # the CPU without a byte count: the default budget
    assert worker.num_blocks == DEFAULT_KV_CACHE_MEMORY_BYTES // worker.kv_bytes_per_block
    mem = ScriptedMemory(total=4 * GIB, weights=GIB, activations=GIB // 2, non_torch=GIB // 4)
    ran = []
    real = worker._run_largest_step
    worker._run_largest_step = mem.run(lambda: (ran.append(True), real()))
    num_blocks = worker.determine_num_blocks(mem)
    assert ran == [True] and worker.memory_profile is not None
    want = (int(0.9 * 4 * GIB) - GIB - GIB // 2 - GIB // 4) // worker.kv_bytes_per_block
    assert num_blocks == want
    # A byte count, when given, is the budget: no profiling.
    sized = Worker(EngineConfig(model=str(path), dtype="float32", kv_cache_memory_bytes=1 << 20))
    assert sized.determine_num_blocks(mem) == (1 << 20) // sized.kv_bytes_per_block and sized.memory_profile is None
