"""KV cache tensors: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer.

Slot ``block_id * block_size + offset`` of the flattened cache holds one token's K (index 0)
or V (index 1) for that layer. Under tensor parallelism each rank holds only its own KV
heads (see ``kv_heads_per_rank``), so the cache is sized per rank.
"""

from __future__ import annotations

import torch

from tailserve.model.config import ModelArchConfig
from tailserve.model.linear import SINGLE, TensorParallel, kv_heads_per_rank


def kv_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype,
                       tp: TensorParallel = SINGLE) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * kv_heads_per_rank(arch.num_kv_heads, tp) * arch.head_dim * elem


def allocate_kv_caches(arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, tp: TensorParallel = SINGLE) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, kv_heads_per_rank(arch.num_kv_heads, tp), arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
