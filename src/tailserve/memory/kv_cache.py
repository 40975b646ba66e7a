"""KV cache tensors: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer.

Slot ``block_id * block_size + offset`` of the flattened cache holds one token's K (index 0)
or V (index 1) for that layer.
"""

from __future__ import annotations

import torch

from tailserve.model.config import ModelArchConfig


def kv_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def allocate_kv_caches(arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
