"""Rotary position embeddings with the scaling types Llama-family checkpoints use.

``default`` is plain RoPE; ``linear`` divides positions by ``factor``; ``llama3`` rescales
low frequencies by ``factor`` and leaves high ones alone, with a smooth ramp between
(Llama 3.1's recipe). Layout is Hugging Face's "rotate half" (non-interleaved) one.
"""

from __future__ import annotations

import math

import torch

from tailserve.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables, indexed by absolute position."""

    # The rotate-half layout over the whole head (Llama, Mistral, Qwen): what the CPU decode
    # kernel's fused rotation implements.
    rotate_half = True

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        # Computed in float32 then cast, like transformers, so both round the same way.
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)
        self.half = head_dim // 2

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, (T, 1, D): gathered once per forward, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x: (T, heads, D). Returns a new tensor."""
        x1, x2 = x[..., : self.half], x[..., self.half :]
        rotated = torch.cat((-x2, x1), dim=-1)
        return x * cos + rotated * sin
