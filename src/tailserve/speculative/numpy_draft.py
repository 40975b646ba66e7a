"""The draft model's single-sequence chain step in NumPy, for the CPU.

A small draft model's forward on the CPU is dominated by per-operation overhead, not by
arithmetic: the built-in 1-layer draft runs ~30 PyTorch operations per token at 10-20 us
each (dispatch, autograd-free checks, allocation), ~0.55 ms per forward, while the same
step written with NumPy (whose small-array operations cost ~1 us) takes ~0.22 ms. At
batch 1 the draft chain is a third of a speculative round, so this is where batch-1
speculation gains most. The step reads and writes the draft's own paged KV cache (float32
tensors viewed as arrays, no copy), so it interleaves freely with the PyTorch path, which
still runs catch-ups of more than a few tokens, batches of several sequences and
sliding-window drafts. Tests compare its logits with the PyTorch path's.
"""

from __future__ import annotations

import numpy as np
import threadpoolctl
import torch

from tailserve.model.config import ModelArchConfig
from tailserve.model.llama import LlamaFamilyModel

# Used by default only up to this size. A forward reads every weight once: NumPy in float32
# (~30 GB/s here) against PyTorch's oneDNN in bf16 (~26 GB/s over half the bytes) costs
# ~0.06 ns more per parameter, which eats the ~0.4 ms of per-operation overhead it saves at
# about 7M parameters. The built-in draft has 1.7M.
NUMPY_DRAFT_MAX_PARAMETERS = 8_000_000


def _t(w: torch.Tensor) -> np.ndarray:
    """(out, in) weight -> contiguous float32 (in, out), for ``x @ w``."""
    return np.ascontiguousarray(w.detach().float().numpy().T)


def _vec(w: torch.Tensor | None) -> np.ndarray | None:
    return None if w is None else np.ascontiguousarray(w.detach().float().numpy())


def _single_threaded_openblas() -> None:
    """NumPy's OpenBLAS would run these small products on its own thread pool, whose idle
    threads spin after each call and take the cores from PyTorch's OpenMP workers: measured
    here, the target's forward became ~3x slower. One thread is also the fastest for
    matrix-vector products this small. Process-wide (the engine owns the process); only
    NumPy's OpenBLAS is touched, not PyTorch's OpenMP or oneDNN."""
    threadpoolctl.ThreadpoolController().select(internal_api="openblas").limit(limits=1)


class _Layer:
    def __init__(self, layer, arch: ModelArchConfig) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.w_in, self.w_post = _vec(layer.input_layernorm.weight), _vec(layer.post_attention_layernorm.weight)
        self.qkv, self.qkv_b = _t(attn.qkv_proj.weight), _vec(attn.qkv_proj.bias)
        self.o, self.o_b = _t(attn.o_proj.weight), _vec(attn.o_proj.bias)
        self.q_norm = _vec(attn.q_norm.weight) if attn.q_norm is not None else None
        self.k_norm = _vec(attn.k_norm.weight) if attn.k_norm is not None else None
        self.gate_up, self.gate_up_b = _t(mlp.gate_up_proj.weight), _vec(mlp.gate_up_proj.bias)
        self.down, self.down_b = _t(mlp.down_proj.weight), _vec(mlp.down_proj.bias)


class NumpyDraftStep:
    """``forward`` of one sequence's newest tokens over a float32 paged KV cache.

    Built from a float32 model whose projections still hold their plain weights (before
    its linear method is applied); keeps its own transposed copies (a few MB for a draft model)."""

    def __init__(self, model: LlamaFamilyModel, arch: ModelArchConfig, kv_caches: list[torch.Tensor]) -> None:
        if model.embed_tokens.dtype != torch.float32 or any(c.dtype != torch.float32 for c in kv_caches):
            raise ValueError("the NumPy draft step needs a float32 model and KV cache")
        if arch.sliding_window is not None:
            raise ValueError("the NumPy draft step has no sliding window")
        self.arch = arch
        self.h, self.kvh, self.d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        self.embed = np.ascontiguousarray(model.embed_tokens.detach().float().numpy())  # (V, hidden)
        self.lm_head = _t(model.lm_head.weight)  # (hidden, V)
        self.w_final = _vec(model.norm.weight)
        self.layers = [_Layer(layer, arch) for layer in model.layers]
        d = self.d
        # Views of the live caches: writes land in the tensors the PyTorch path reads.
        self.k_caches = [c[0].view(-1, self.kvh, d).numpy() for c in kv_caches]
        self.v_caches = [c[1].view(-1, self.kvh, d).numpy() for c in kv_caches]
        self.scale = np.float32(d ** -0.5)
        _single_threaded_openblas()

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        # np.add.reduce rather than np.mean: the same sum without mean's Python-level wrapper.
        ms = np.add.reduce(x * x, axis=-1, keepdims=True) * np.float32(1.0 / x.shape[-1])
        return x * (1.0 / np.sqrt(ms + self.eps)) * w

    def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        # x (Q, heads, D); cos/sin (Q, 1, D). Hugging Face's "rotate half" layout.
        half = self.d // 2
        rotated = np.concatenate((-x[..., half:], x[..., :half]), axis=-1)
        return x * cos + rotated * sin

    def forward(self, tokens: np.ndarray, kv_slots: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """tokens (Q,): the newest Q tokens, whose positions are the last Q of the context;
        kv_slots (C,): the cache slot of every context position (the new tokens' K/V are
        written to the last Q); cos/sin (Q, 1, D) float32. Returns the last token's logits (V,)."""
        q_len, ctx = len(tokens), len(kv_slots)
        h, kvh, d = self.h, self.kvh, self.d
        group = h // kvh
        new_slots = kv_slots[ctx - q_len :]
        x = self.embed[tokens]  # (Q, hidden)
        mask = None
        if q_len > 1:
            # Query t sits at position ctx - Q + t and sees keys up to it.
            limit = np.arange(ctx - q_len + 1, ctx + 1)[:, None]  # (Q, 1)
            mask = np.where(np.arange(ctx)[None, :] < limit, np.float32(0.0), np.float32(-np.inf))  # (Q, C)
        for layer, kc, vc in zip(self.layers, self.k_caches, self.v_caches):
            a = self._rms(x, layer.w_in) @ layer.qkv
            if layer.qkv_b is not None:
                a = a + layer.qkv_b
            qs, ks = h * d, kvh * d
            q = a[:, :qs].reshape(q_len, h, d)
            k = a[:, qs : qs + ks].reshape(q_len, kvh, d)
            v = a[:, qs + ks :].reshape(q_len, kvh, d)
            if layer.q_norm is not None:
                q, k = self._rms(q, layer.q_norm), self._rms(k, layer.k_norm)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            kc[new_slots] = k
            vc[new_slots] = v
            # Every product below has a unit stride in its operands' last dimension, so NumPy
            # hands it to BLAS; a transposed key view instead took its slow generic loop
            # (17 us against 3 for the scores at 400 positions).
            keys = kc[kv_slots].transpose(1, 0, 2)  # (KVH, C, D)
            values = vc[kv_slots].transpose(1, 0, 2)  # (KVH, C, D)
            qt = np.ascontiguousarray(q.reshape(q_len, kvh, group, d).transpose(1, 3, 0, 2)).reshape(
                kvh, d, q_len * group)  # (KVH, D, Q*G), columns ordered (query, group)
            scores = (keys @ qt) * self.scale  # (KVH, C, Q*G)
            if mask is not None:
                scores = scores + np.repeat(mask, group, axis=0).T[None]
            scores = np.exp(scores - scores.max(axis=1, keepdims=True))
            scores /= scores.sum(axis=1, keepdims=True)
            probs = np.ascontiguousarray(scores.transpose(0, 2, 1))  # (KVH, Q*G, C)
            out = (probs @ values).reshape(kvh, q_len, group, d).transpose(1, 0, 2, 3).reshape(q_len, h * d)
            o = out @ layer.o
            if layer.o_b is not None:
                o = o + layer.o_b
            x = x + o
            gu = self._rms(x, layer.w_post) @ layer.gate_up
            if layer.gate_up_b is not None:
                gu = gu + layer.gate_up_b
            inter = gu.shape[-1] // 2
            gate, up = gu[:, :inter], gu[:, inter:]
            # silu(g) = g * sigmoid(g), with the sigmoid as 0.5 * (1 + tanh(g / 2)): no overflow.
            m = (gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * up) @ layer.down
            if layer.down_b is not None:
                m = m + layer.down_b
            x = x + m
        return self._rms(x[-1], self.w_final) @ self.lm_head
