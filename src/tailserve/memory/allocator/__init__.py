"""PyTorch's CUDA caching allocator: its configuration (PYTORCH_CUDA_ALLOC_CONF) and a
Python model of it that replays allocation traces (``simulator``)."""

from tailserve.memory.allocator.conf import AllocatorConf, parse_alloc_conf
from tailserve.memory.allocator.simulator import CachingAllocatorSimulator, SimulatedOutOfMemory, simulate_trace

__all__ = ["AllocatorConf", "CachingAllocatorSimulator", "SimulatedOutOfMemory", "parse_alloc_conf", "simulate_trace"]
