"""How big the KV cache may be on a GPU: ``--gpu-memory-utilization`` after a profiling pass.

As vLLM does it: once the weights are loaded, run the largest step the scheduler can send
(``max_num_batched_tokens`` prompt tokens, then logits and sampling for ``max_num_seqs``
rows) and record the allocator's peak. The cache then takes what is left of the device's
budget::

    kv_bytes = utilization * total - weights - peak_activations - non_torch

``weights``: bytes allocated once the models are loaded; ``peak_activations``: the profiling
pass's peak above that; ``non_torch``: device memory used outside PyTorch's caching
allocator (the CUDA context, cuBLAS workspaces, other processes), read as
``(total - free) - reserved`` after the pass. A draft model's weights are in ``weights``; its
own forward is smaller than the target's and runs after it, so the target's peak bounds both.

The numbers come from a ``DeviceMemory`` (``CudaMemory`` on a GPU); tests give a scripted one,
since a CPU has no allocator statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tailserve.errors import ConfigError


class DeviceMemory(Protocol):
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""
        ...

    def memory_allocated(self) -> int: ...

    def memory_reserved(self) -> int: ...

    def max_memory_allocated(self) -> int: ...

    def reset_peak_memory_stats(self) -> None: ...

    def empty_cache(self) -> None: ...


class CudaMemory:
    """``DeviceMemory`` of one CUDA device, through ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def max_memory_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class MemoryProfile:
    """What the profiling pass measured, in bytes."""

    total_bytes: int
    weights_bytes: int
    peak_activation_bytes: int
    non_torch_bytes: int
    utilization: float

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.utilization * self.total_bytes) - self.weights_bytes - self.peak_activation_bytes \
            - self.non_torch_bytes

    def describe(self, num_blocks: int, block_size: int) -> str:
        gib = 1 << 30
        return (f"KV cache: {num_blocks} blocks = {num_blocks * block_size} tokens "
                f"({self.kv_cache_bytes / gib:.2f} GiB = {self.utilization:g} x {self.total_bytes / gib:.2f} GiB "
                f"- weights {self.weights_bytes / gib:.2f} - peak activations {self.peak_activation_bytes / gib:.2f} "
                f"- non-torch {self.non_torch_bytes / gib:.2f})")


def profile_memory(memory: DeviceMemory, run_largest_step: Callable[[], None], utilization: float) -> MemoryProfile:
    """Run the largest step once and measure (module docstring). Call after the weights load
    and before the KV cache is allocated."""
    memory.empty_cache()
    weights = memory.memory_allocated()
    memory.reset_peak_memory_stats()
    run_largest_step()
    peak = memory.max_memory_allocated()
    free, total = memory.mem_get_info()
    non_torch = max((total - free) - memory.memory_reserved(), 0)
    memory.empty_cache()
    return MemoryProfile(total, weights, max(peak - weights, 0), non_torch, utilization)


def num_blocks_from_profile(profile: MemoryProfile, bytes_per_block: int) -> int:
    """Blocks that fit the budget, or a ConfigError that says what took the memory."""
    n = profile.kv_cache_bytes // bytes_per_block
    if n < 1:
        gib = 1 << 30
        raise ConfigError(
            f"gpu_memory_utilization {profile.utilization:g} leaves no room for the KV cache: "
            f"{profile.utilization:g} x {profile.total_bytes / gib:.2f} GiB minus weights "
            f"{profile.weights_bytes / gib:.2f} GiB, peak activations {profile.peak_activation_bytes / gib:.2f} GiB "
            f"and non-torch memory {profile.non_torch_bytes / gib:.2f} GiB is {profile.kv_cache_bytes / gib:.2f} "
            f"GiB (raise --gpu-memory-utilization, or lower --max-num-batched-tokens / --max-num-seqs)")
    return int(n)
