"""The Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over a paged KV cache.

Weights are fused where that saves kernel launches: q/k/v in one ``qkv_proj`` and
gate/up in one ``gate_up_proj``. The forward pass takes a flat batch of tokens (prefill
chunks and decodes mixed) plus an ``AttentionMetadata``; it never decides policy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tailserve.model.attention import AttentionMetadata, paged_attention
from tailserve.model.config import ModelArchConfig
from tailserve.model.rope import RotaryEmbedding


def _param(*shape: int) -> nn.Parameter:
    # Built on the meta device by the loader; real storage is assigned when weights load.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, as transformers does.
        return self.weight * F.rms_norm(x.float(), (self.dim,), eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = _param(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
        self.qkv_bias = _param(cfg.q_size + 2 * cfg.kv_size) if cfg.qkv_bias else None
        self.o_proj = _param(cfg.hidden_size, cfg.q_size)
        self.o_bias = _param(cfg.hidden_size) if cfg.o_bias else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)  # (T, (H + 2*KVH) * D)
        v = qkv[:, self.q_size + self.kv_size :].view(t, kvh, d)
        if self.q_norm is None:
            # q and k are adjacent in the fused projection: rotate both with one call.
            qk = self.rotary(positions, qkv[:, : self.q_size + self.kv_size].view(t, h + kvh, d))
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = self.rotary(positions, self.q_norm(qkv[:, : self.q_size].view(t, h, d)))
            k = self.rotary(positions, self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, kvh, d)))
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)  # (T, H*D)
        return F.linear(out, self.o_proj, self.o_bias)


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = _param(2 * cfg.intermediate_size, cfg.hidden_size)
        self.gate_up_bias = _param(2 * cfg.intermediate_size) if cfg.mlp_bias else None
        self.down_proj = _param(cfg.hidden_size, cfg.intermediate_size)
        self.down_bias = _param(cfg.hidden_size) if cfg.mlp_bias else None
        self.intermediate_size = cfg.intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_proj, self.gate_up_bias)  # (T, 2*I)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj, self.down_bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaFamilyModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = cfg
        # The rotary table is computed, not loaded, so the loader builds it for real outside
        # the meta-device context in which the rest of the model is built.
        self.rotary = rotary
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,). Returns the final-norm hidden states (T, hidden)."""
        x = F.embedding(input_ids, self.embed_tokens)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32 logits."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()
