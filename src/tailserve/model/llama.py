"""The Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over a paged KV cache.

Weights are fused where that saves kernel launches: q/k/v in one ``qkv_proj`` and
gate/up in one ``gate_up_proj``. Submodules are invoked through ``.forward`` rather than
``__call__``: these modules carry no hooks, and the hook machinery costs ~1.5 us per call,
about 50 calls per step of a 6-layer model. The forward pass takes a flat batch of tokens (prefill
chunks and decodes mixed) plus an ``AttentionMetadata``; it never decides policy.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tailserve.attention.backend import LayerAttentionMetadata
from tailserve.kernels.cpu import KV_FORMATS, LayerStruct, PanelPackedWeight, StepStruct, weight_format
from tailserve.model.config import ModelArchConfig
from tailserve.model.linear import (
    SINGLE,
    CpuCompactWeightsLinearMethod,
    Int8WeightOnlyLinearMethod,
    Linear,
    LinearMethod,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelLMHead,
)
from tailserve.model.rope import RotaryEmbedding


def _param(*shape: int) -> nn.Parameter:
    # Built on the meta device by the loader; real storage is assigned when weights load.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LayerOps:
    """The small per-layer operations around the projections (norms with the residual add,
    the gated activation), chosen once at load time: PyTorch's here, the compiled CPU kernels'
    in ``KernelLayerOps``. The residual stream is passed separately (as vLLM does) so the add
    and the next norm are one operation."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # One fused kernel. It accumulates in float32 like transformers' RMSNorm; in bf16/fp16
        # it rounds once after the weight product where transformers rounds before it too, a
        # last-bit difference that costs 4 kernel launches per norm to avoid.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x, and its norm: (normed, new residual)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up


TORCH_OPS = LayerOps()


class KernelLayerOps(LayerOps):
    """The same float32 arithmetic in one compiled pass each (kernels/cpu): PyTorch
    spends 15-30 us per operation on a small CPU whatever its size. The residual stream is
    updated in place. Float32 CPU models only (the worker decides at load time)."""

    name = "cpu-kernels"

    def __init__(self, kernels) -> None:  # model.cpu_kernels.CpuKernels
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.add_rms_norm(x, None, weight, eps)[0]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)


class FusedDecodeLayer:
    """A decoder layer's decode step in one compiled call (``tailserve_decode_layer``): the
    same kernels as KernelLayerOps, the compact linear methods and the CPU decode attention,
    without a return to Python between them. Built by ``fuse_decode_layers`` for layers that
    qualify; DecoderLayer.forward uses it for steps of up to MAX_ROWS rows whose attention
    metadata is the CPU decode kernel's, and the per-operation path otherwise."""

    MAX_ROWS = 16

    def __init__(self, kernels, layer: DecoderLayer, fmt: int, weights: list[torch.Tensor | PanelPackedWeight],
                 scales: list[torch.Tensor | None]) -> None:
        attn = layer.self_attn
        self.kernels = kernels
        self._keep = (weights, scales)  # the struct holds raw pointers into these
        ptr = [w.data_ptr() for w in weights] + [0 if sc is None else sc.data_ptr() for sc in scales]
        self.struct = LayerStruct(fmt, *ptr, layer.input_layernorm.weight.data_ptr(),
                                  layer.post_attention_layernorm.weight.data_ptr(), layer.input_layernorm.eps,
                                  attn.scale, layer.input_layernorm.dim, attn.num_heads, attn.num_kv_heads,
                                  attn.head_dim, layer.mlp.intermediate_size)
        self.block_size = 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
        h = x if residual is None else residual  # the first layer's stream is the embedding itself
        out = torch.empty_like(h)
        cos, sin = rope
        k_ptr = kv_cache.data_ptr()
        self.kernels.decode_layer(self.struct, step, h.data_ptr(), 0 if residual is None else x.data_ptr(),
                                  out.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_ptr,
                                  k_ptr + kv_cache.stride(0) * kv_cache.element_size())
        return out, h


def fuse_decode_layers(model: LlamaFamilyModel, kernels) -> int:
    """Give each qualifying layer of a float32 CPU model its FusedDecodeLayer; returns how
    many qualified. A layer qualifies when its four projections keep compact weights for the
    compiled kernel (bf16, fp16, or int8 with float row scales), none has a bias, and it has
    no q/k norms (Llama, Mistral, Qwen2 without biases)."""
    count = 0
    for layer in model.layers:
        layer.fused = None
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        if attn.q_norm is not None or not attn.rotary.rotate_half or model.tp.size != 1 \
                or not isinstance(layer.ops, KernelLayerOps) or model.embed_tokens.dtype != torch.float32:
            continue
        weights, scales = [], []
        for lin in linears:
            q = getattr(lin, "qweight", None)
            method = lin.method
            if lin.bias is not None or q is None or not kernels.supports(q):
                break
            if isinstance(method, CpuCompactWeightsLinearMethod):
                weights.append(q)
                scales.append(None)
            elif isinstance(method, Int8WeightOnlyLinearMethod) and getattr(lin, "scales_f32", None) is not None:
                weights.append(q)  # row-major int8 or int8 panels, scales_f32 their scales
                scales.append(lin.scales_f32)
            else:
                break
        formats = {weight_format(w) for w in weights}
        if len(weights) != 4 or len(formats) != 1:
            continue
        layer.fused = FusedDecodeLayer(kernels, layer, formats.pop(), weights, scales)
        count += 1
    model.fused_decode = FusedDecodeModel(kernels, model) if count and count == len(model.layers) \
        and isinstance(model.ops, KernelLayerOps) and model.embed_tokens.is_contiguous() else None
    return count


class FusedDecodeModel:
    """A whole decode-shaped forward of a model whose every layer fuses, in one compiled call
    (``tailserve_decode_model``): the embedding, the fused layers, the final norm of each
    sequence's last row and, where the LM head's weights are the kernels' (compact or int8 with
    float row scales), its logits. The same compiled calls in the same order as ``forward`` and
    ``compute_logits`` make for such a step, so the logits are bitwise theirs; what goes is
    Python's ~10 calls around each layer. A draft model's chain step is where that counted: the
    built-in draft (one layer, 256 wide) took ~155 us a step at batch 1 on 2 Xeon cores, about
    half of it around its ~75 us of compiled work."""

    def __init__(self, kernels, model: LlamaFamilyModel) -> None:
        self.kernels = kernels
        fused = [layer.fused for layer in model.layers]
        self.num_layers = len(fused)
        self.structs = (LayerStruct * len(fused))(*[f.struct for f in fused])
        self.embed = model.embed_tokens
        self.norm = model.norm
        self.hidden_size, self.vocab_size = model.config.hidden_size, model.config.vocab_size
        head = model.lm_head
        q = getattr(head, "qweight", None)
        scales = getattr(head, "scales_f32", None)
        compact = isinstance(head.method, CpuCompactWeightsLinearMethod)
        int8 = isinstance(head.method, Int8WeightOnlyLinearMethod) and scales is not None
        # Tensor parallelism splits the head by vocabulary rows: fusion needs tp size 1 anyway.
        self.head = None
        if q is not None and head.bias is None and (compact or int8) and kernels.supports(q):
            self.head = (weight_format(q), q, scales)
        self._kv: tuple[list[torch.Tensor], ctypes.Array, ctypes.Array] | None = None

    def _cache_pointers(self, kv_caches: list[torch.Tensor]) -> tuple[ctypes.Array, ctypes.Array]:
        if self._kv is None or self._kv[0] is not kv_caches:
            k = [c.data_ptr() for c in kv_caches]
            v = [c.data_ptr() + c.stride(0) * c.element_size() for c in kv_caches]
            self._kv = (kv_caches, (ctypes.c_void_p * len(k))(*k), (ctypes.c_void_p * len(v))(*v))
        return self._kv[1], self._kv[2]

    def run(self, token_ids: torch.Tensor | np.ndarray, rope: tuple[torch.Tensor, torch.Tensor],
            kv_caches: list[torch.Tensor], meta: LayerAttentionMetadata, query_len: int = 1,
            head: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A step of ``len(token_ids)`` rows (int64, contiguous), ``query_len`` per sequence:
        (the final-norm hidden state of each sequence's last row, and with ``head`` its
        float32 logits, None where the head is not the kernels'). None where the step does
        not fit the fused layers (too many rows, metadata that is not the CPU decode kernel's,
        rotary tables that are not contiguous): the caller goes layer by layer."""
        m = len(token_ids)
        cos, sin = rope
        if m > FusedDecodeLayer.MAX_ROWS or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        step = meta.kernel_step(kv_caches[0])
        if step is None:
            return None
        ids = token_ids.ctypes.data if isinstance(token_ids, np.ndarray) else token_ids.data_ptr()
        n_sel = m // query_len
        hidden = torch.empty((n_sel, self.hidden_size), dtype=torch.float32)
        k_ptrs, v_ptrs = self._cache_pointers(kv_caches)
        fmt, w, scales = self.head if head and self.head is not None else (0, None, None)
        out = torch.empty((n_sel, self.vocab_size), dtype=torch.float32) if w is not None else None
        bad = self.kernels.decode_model(self.structs, self.num_layers, step, ids, self.embed.data_ptr(),
                                        cos.data_ptr(), sin.data_ptr(), k_ptrs, v_ptrs, self.norm.weight.data_ptr(),
                                        self.norm.eps, query_len - 1, query_len, n_sel, fmt,
                                        0 if w is None else w.data_ptr(), 0 if scales is None else scales.data_ptr(),
                                        self.vocab_size, hidden.data_ptr(), 0 if out is None else out.data_ptr())
        if bad >= 0:  # as F.embedding refuses it
            raise IndexError(f"token id {int(token_ids[bad])} is outside the vocabulary ({self.vocab_size})")
        return hidden, out

    # draft_rounds' modes (tailserve_draft_rounds)
    GREEDY, SAMPLED, SEEDED = 0, 1, 2

    def draft_rounds(self, ids: list[list[int]], first_pos: list[int], pads: list[int], steps: list[int],
                     block_ids: list[list[int]], rotary: RotaryEmbedding, kv_caches: list[torch.Tensor],
                     stop_margin: float, modes: list[int], temperatures: list[float], top_ks: list[int],
                     top_ps: list[float], min_ps: list[float], uniforms: np.ndarray | None = None,
                     keys: np.ndarray | None = None, scratch_slot: int = 0
                     ) -> tuple[list[list[int]], list[torch.Tensor] | None] | None:
        """A round of drafts for B sequences in one compiled call (``tailserve_draft_rounds``):
        sequence b is fed ``ids[b]`` (the same count for all; its first ``pads[b]`` only repeat
        cached tokens, their K/V written to ``scratch_slot``) from position ``first_pos[b]``, a
        draft is taken from its last row's logits, then each draft is fed at the next position,
        up to ``steps[b]`` drafts, fewer after one whose margin (top two) is below
        ``stop_margin`` > 0. Each step is the ``run`` the Python chain step makes with the head,
        row for row (so the same K/V and, greedy, the same drafts). ``modes[b]``: GREEDY
        (argmax), SAMPLED (q = the softmax of logits / temperature after top-k (0: off), top-p
        and min-p, as ``filtered_probs`` filters; the draft by inverse CDF at ``uniforms[b, n]``,
        float64) or SEEDED (the exponential race with ``keys[b, n]``, uint64). Returns (each
        sequence's drafts, each sequence's q rows for them, (n, V) float32, set for sampled
        sequences; None when every one is greedy); None where this model's head is not the kernels', the
        rows pass the fused layers' or the positions the rotary tables. For a model without a
        sliding window (the caller's)."""
        cos, sin = rotary.cos, rotary.sin  # (positions, D) float32, contiguous
        b, qn = len(ids), len(ids[0]) if ids else 0
        kmax = max(steps, default=0)
        lasts = [f + qn - 1 + k - 1 for f, k in zip(first_pos, steps)]  # each sequence's last position fed
        if self.head is None or not b or not qn or kmax <= 0 or b * qn > FusedDecodeLayer.MAX_ROWS \
                or max(lasts) >= cos.shape[0] or any(len(x) != qn for x in ids):
            return None
        fmt, w, scales = self.head
        bs = kv_caches[0].shape[2]
        width = max(last // bs + 1 for last in lasts)
        rows, d, e, v = b * qn, cos.shape[1], self.hidden_size, self.vocab_size
        sampled = any(m != self.GREEDY for m in modes)
        if any(m == self.SAMPLED for m in modes) and (uniforms is None or uniforms.shape != (b, kmax)):
            raise ValueError(f"draft_rounds: sampled rows need ({b}, {kmax}) uniforms")
        if any(m == self.SEEDED for m in modes) and (keys is None or keys.shape != (b, kmax)):
            raise ValueError(f"draft_rounds: seeded rows need ({b}, {kmax}) keys")
        # Three host buffers instead of a dozen arrays (each array and pointer costs ~1 us).
        # int64: ids0 | first_pos | pads | steps | top_ks | counts | slots | out
        i64 = np.empty(rows + 5 * b + rows + b * kmax, dtype=np.int64)
        i64[:rows] = np.asarray(ids, dtype=np.int64).reshape(-1)
        i64[rows : rows + 5 * b].reshape(5, b)[:] = (
            first_pos, pads, steps, [k if 0 < k < v else v for k in top_ks], [0] * b)
        # int32: modes | seq_lens | tables (b, width) | table_buf (rows, width)
        i32 = np.zeros(b + rows + (b + rows) * width, dtype=np.int32)
        i32[:b] = modes
        tables = i32[b + rows : b + rows + b * width].reshape(b, width)
        for r, (blocks, last) in enumerate(zip(block_ids, lasts)):
            n = last // bs + 1
            tables[r, :n] = blocks[:n]
        # float32: temps | top_ps | min_ps | rope_buf (2, rows, d) | hidden (b, e) | logits (b, v)
        f32 = np.empty(3 * b + 2 * rows * d + b * e + b * v, dtype=np.float32)
        f32[: 3 * b].reshape(3, b)[:] = (temperatures, top_ps, min_ps)
        p64, p32, pf = i64.ctypes.data, i32.ctypes.data, f32.ctypes.data
        slots_at = p64 + 8 * (rows + 5 * b)
        step = StepStruct(p32 + 4 * (b + rows + b * width), width, p32 + 4 * b, slots_at, rows, bs, 0, 0,
                          torch.get_num_threads(), KV_FORMATS[kv_caches[0].dtype])
        k_ptrs, v_ptrs = self._cache_pointers(kv_caches)
        q = np.empty((b, kmax, v), dtype=np.float32) if sampled else None
        u = 0 if uniforms is None else np.ascontiguousarray(uniforms, dtype=np.float64)
        kk = 0 if keys is None else np.ascontiguousarray(keys, dtype=np.uint64)
        rope_at = pf + 4 * 3 * b
        hidden_at = rope_at + 4 * 2 * rows * d
        bad = self.kernels.draft_rounds(
            self.structs, self.num_layers, step, b, qn, p64, p64 + 8 * rows, p64 + 8 * (rows + b), scratch_slot,
            p64 + 8 * (rows + 2 * b), kmax, p32 + 4 * (b + rows), width, p32 + 4 * (b + rows + b * width),
            cos.data_ptr(), sin.data_ptr(), d, rope_at, k_ptrs, v_ptrs, self.embed.data_ptr(),
            self.norm.weight.data_ptr(), self.norm.eps, fmt, w.data_ptr(), 0 if scales is None else scales.data_ptr(),
            v, p32, pf, p64 + 8 * (rows + 3 * b), pf + 4 * b, pf + 8 * b, 0 if uniforms is None else u.ctypes.data,
            0 if keys is None else kk.ctypes.data, stop_margin, hidden_at, hidden_at + 4 * b * e,
            0 if q is None else q.ctypes.data, slots_at + 8 * rows, p64 + 8 * (rows + 4 * b))
        out = i64[2 * rows + 5 * b :].reshape(b, kmax)
        counts = i64[rows + 4 * b : rows + 5 * b]
        if bad != -1:  # a fed token outside the vocabulary (as F.embedding refuses it)
            token = int(i64[bad]) if bad >= 0 else int(out[-2 - bad, counts[-2 - bad] - 1])
            raise IndexError(f"token id {token} is outside the vocabulary ({v})")
        got = [out[r, : counts[r]].tolist() for r in range(b)]
        return got, None if q is None else [torch.from_numpy(q[r, : len(d)]) for r, d in enumerate(got)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TORCH_OPS.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, tp)
        # This rank's heads (all of them at tp size 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.hidden_size, cfg.q_size, cfg.o_bias, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: LayerAttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)  # (T, (H + 2*KVH) * D)
        if self.q_norm is None:
            # q and k adjacent in the fused projection, rotated by the backend (inside its
            # kernel, or in one call before it).
            return self.o_proj.forward(meta.attend_rope(qkv, self.rotary, *rope, h, kvh, kv_cache, self.scale))
        v = qkv[:, self.q_size + self.kv_size :].view(t, kvh, d)
        q = self.rotary.apply(self.q_norm.forward(qkv[:, : self.q_size].view(t, h, d)), *rope)
        k = self.rotary.apply(self.k_norm.forward(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, kvh, d)),
                              *rope)
        out = meta.attend(q, k, v, kv_cache, self.scale)  # (T, H*D)
        return self.o_proj.forward(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear([cfg.intermediate_size] * 2, cfg.hidden_size, cfg.mlp_bias, tp)
        self.down_proj = RowParallelLinear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.intermediate_size = cfg.intermediate_size // tp.size
        self.ops: LayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)  # (T, 2*I)
        return self.down_proj.forward(self.ops.silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)
        self.ops: LayerOps = TORCH_OPS
        self.fused: FusedDecodeLayer | None = None  # fuse_decode_layers

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: LayerAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (T, hidden), residual: the stream before it (None at
        the first layer, where x is the embedding). Returns (this layer's output, the stream):
        the stream plus both outputs is what ``x + attn(norm(x))``, ``x + mlp(norm(x))`` give."""
        fused = self.fused
        if fused is not None and x.shape[0] <= FusedDecodeLayer.MAX_ROWS and rope[0].is_contiguous() \
                and rope[1].is_contiguous():
            step = meta.kernel_step(kv_cache)  # None: not the CPU decode kernel's metadata
            if step is not None:
                return fused.forward(x, residual, rope, kv_cache, step)
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, h = x, self.ops.rms_norm(x, ln1.weight, ln1.eps)
        else:
            h, residual = self.ops.add_rms_norm(x, residual, ln1.weight, ln1.eps)
        h = self.self_attn.forward(h, rope, kv_cache, meta)
        h, residual = self.ops.add_rms_norm(h, residual, ln2.weight, ln2.eps)
        return self.mlp.forward(h), residual


class LlamaFamilyModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        # The rotary table is computed, not loaded, so the loader builds it for real outside
        # the meta-device context in which the rest of the model is built.
        self.rotary = rotary
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The embedding is replicated on every rank (a lookup, no collective); the head is
        # split by vocabulary rows and gathered (model/linear.py VocabParallelLMHead).
        self.lm_head = VocabParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.tied = cfg.tie_word_embeddings
        self.ops: LayerOps = TORCH_OPS
        self.fused_decode: FusedDecodeModel | None = None  # fuse_decode_layers, when every layer fuses

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, kv_caches: list[torch.Tensor],
                meta: LayerAttentionMetadata, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: (T,). Returns the final-norm hidden states (T, hidden).
        ``rope``: the rotary cos/sin for these positions, (T, 1, D) each, when the caller has
        them already (the draft chain looks them up once per round); positions may then be None."""
        if rope is None:
            if positions is None:
                raise ValueError("forward needs positions or precomputed rope tables")
            rope = self.rotary.lookup(positions)
        fused = self.fused_decode
        if fused is not None and input_ids.dtype == torch.int64 and input_ids.is_contiguous():
            got = fused.run(input_ids, rope, kv_caches, meta)  # a decode-shaped step: one compiled call
            if got is not None:
                return got[0]
        x = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer.forward(x, residual, rope, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm.forward(x)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def forward_groups(self, groups: list[tuple[torch.Tensor, torch.Tensor, LayerAttentionMetadata]],
                       kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Several independent batches (input_ids, positions, metadata), each what ``forward``
        gives it alone, computed layer by layer across them: each layer's weights are read once
        for all the groups while they are in cache. On 2 AVX-512 cores, two 16-row decode
        forwards back to back cost 7.1 ms each against 5.6 ms for one alone (600-token contexts)."""
        xs = [F.embedding(ids, self.embed_tokens) for ids, _, _ in groups]
        ropes = [self.rotary.lookup(pos) for _, pos, _ in groups]
        residuals: list[torch.Tensor | None] = [None] * len(groups)
        for layer, kv_cache in zip(self.layers, kv_caches):
            for g, (_, _, meta) in enumerate(groups):
                xs[g], residuals[g] = layer.forward(xs[g], residuals[g], ropes[g], kv_cache, meta)
        out = []
        for x, residual in zip(xs, residuals):
            out.append(self.norm.forward(x) if residual is None
                       else self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0])
        return out

    def set_layer_ops(self, ops: LayerOps) -> None:
        """Use ``ops`` for the norms and activations of every layer (chosen once, at load time)."""
        self.ops = ops
        for layer in self.layers:
            layer.ops = layer.mlp.ops = ops

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) logits: float32, or the model's dtype with
        ``upcast=False`` (enough for an argmax: the upcast is exact, so it picks the same token)."""
        logits = self.lm_head.forward(hidden)
        return logits.float() if upcast else logits

    def set_linear_method(self, method: LinearMethod) -> list[str]:
        """Use ``method`` for every projection and the LM head (chosen once, at load time).
        Returns the method each layer ended with (a layer whose dtype the method cannot run
        keeps plain ``F.linear``)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.set_method(method)
        return [m.method.name for m in linears]
