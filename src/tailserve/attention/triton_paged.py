"""Paged attention in Triton: every query of a step attends straight from the block table.

One kernel serves decodes (one query per sequence), prefill chunks and speculative
verification (several queries, causal within the chunk, after any cached context): program
(b, h, m) takes a tile of ``BLOCK_M`` queries of sequence b and query head h, walks the
sequence's block table one cache block at a time, and keeps an online softmax (running max
and sum, as FlashAttention does), so no context is gathered into a padded copy and no
(query, context) score matrix is materialised. GQA: query head h reads KV head
h // (H / KVH). A sliding window bounds each query's keys from below.

The step's new K/V are written into the cache first (``index_copy_`` by slot, as the
reference backend does), so the kernel reads every key from the cache alike.

Products: where every tile is at least 16 wide (queries per tile, block size, head size),
both products are ``tl.dot`` on the tensor cores, with float32 inputs at IEEE precision
(``input_precision="ieee"``: exact float32, as the reference) and 16-bit inputs as they are
(the probabilities rounded to the value dtype, as FlashAttention does), accumulating in
float32. Smaller tiles (block sizes 4 or 8) use broadcast-and-sum. That form is written
value-first on purpose: Triton's combine pass rewrites ``sum(p[:, :, None] * v[None, :, :],
1)`` into a dot product, which on an H200 (Triton 3.6) ran at TF32 precision and put the
float32 output ~1e-3 off the exact result (2026-12-04); the kernel's own error is ~4e-7.

Tested on the CPU with Triton's interpreter (``TRITON_INTERPRET=1``) against the PyTorch
reference backend (tests/test_triton_attention.py), and on an H200 (docs/benchmarks.md). The
execution plan (engine/plan.py) still picks the reference for ``auto``; ``"triton"`` selects this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tailserve.attention.backend import AttentionBackend, PagedBatch, RopeOutsideKernel, StaticDecodeBuffers


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale, window,
    stride_qt, stride_qh,  # q (T, H, D), last dim contiguous
    stride_cb, stride_cs, stride_ch,  # cache (num_blocks, block_size, KVH, D)
    stride_ot, stride_oh,  # out (T, H, D)
    stride_bt,  # block tables (B, max_blocks)
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_WINDOW: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m = tl.program_id(2)
    kvh = h // QUERIES_PER_KV
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if m * BLOCK_M >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + b)
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    row_ok = rows < q_len
    q_pos = ctx - q_len + rows  # each query's position in the sequence
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D), the cache's dtype
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    # Keys beyond the last query's position are never needed (causal), nor before the first
    # query's window.
    last = tl.minimum(ctx, ctx - q_len + m * BLOCK_M + BLOCK_M)
    first_block = 0
    if HAS_WINDOW:
        first_block = tl.maximum(ctx - q_len + m * BLOCK_M - window + 1, 0) // BLOCK_SIZE
    offs = tl.arange(0, BLOCK_SIZE)
    for j in range(first_block, tl.cdiv(last, BLOCK_SIZE)):
        blk = tl.load(block_tables_ptr + b * stride_bt + j).to(tl.int64)
        kv_pos = j * BLOCK_SIZE + offs
        base = blk * stride_cb + offs[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        k = tl.load(k_cache_ptr + base)  # (BLOCK_SIZE, D)
        v = tl.load(v_cache_ptr + base)
        if USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_SIZE)
        else:
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        ok = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < ctx)
        if HAS_WINDOW:
            ok = ok & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with no admissible key yet keep -inf; exp(-inf - -inf) would be NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        else:  # value first: see the module docstring
            acc = acc * alpha[:, None] + tl.sum(v.to(tl.float32)[None, :, :] * p[:, :, None], axis=1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                           batch: PagedBatch, scale: float, sliding_window: int | None = None,
                           block_m: int = 16) -> torch.Tensor:
    """q (T, H, D), k/v (T, KVH, D), kv_cache (2, num_blocks, block_size, KVH, D) -> (T, H*D)."""
    t, h, d = q.shape
    kvh = k.shape[1]
    if d & (d - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim, got {d}")
    block_size = kv_cache.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # (num_blocks, block_size, KVH, D)
    k_cache.view(-1, kvh, d).index_copy_(0, batch.slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, batch.slot_mapping, v)
    q = q.contiguous()
    out = torch.empty_like(q)
    b = batch.num_seqs
    grid = (b, h, triton.cdiv(max(batch.max_query_len, 1), block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, batch.block_tables[:b], batch.seq_lens[:b], batch.query_start_loc[: b + 1],
        scale, sliding_window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), batch.block_tables.stride(0),
        QUERIES_PER_KV=h // kvh, HEAD_DIM=d, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        HAS_WINDOW=sliding_window is not None, USE_DOT=min(block_m, block_size, d) >= 16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32: ignored for 16-bit inputs
    )
    return out.view(t, h * d)


@dataclass
class TritonAttentionMetadata(RopeOutsideKernel):
    slot_mapping: torch.Tensor
    batch: PagedBatch
    sliding_window: int | None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        return triton_paged_attention(q, k, v, kv_cache, self.batch, scale, self.sliding_window)


@dataclass
class StaticTritonDecodeMetadata(RopeOutsideKernel):
    """A captured decode through the same kernel: it reads the static buffers' block tables
    and sequence lengths from device memory and loops over each sequence's own blocks, so one
    capture serves every context length (no gather of max_model_len slots per sequence)."""

    buffers: StaticDecodeBuffers
    sliding_window: int | None
    max_seq_len: int

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.buffers.slot_mapping

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        return triton_paged_attention(q, k, v, kv_cache, self.buffers.paged(self.max_seq_len), scale,
                                      self.sliding_window)


class TritonPagedBackend(AttentionBackend):
    """Paged attention in one Triton kernel for every kind of step (module docstring),
    captured decodes included."""

    name = "triton-paged"
    supports_graph_capture = True

    def build(self, query_lens: list[int], context_lens: list[int],
              block_tables: list[list[int]]) -> TritonAttentionMetadata:
        batch = self.buffers.fill(query_lens, context_lens, block_tables, self.block_size)
        return TritonAttentionMetadata(batch.slot_mapping, batch, self.sliding_window)

    def static_decode_metadata(self, buffers: StaticDecodeBuffers) -> StaticTritonDecodeMetadata:
        return StaticTritonDecodeMetadata(buffers, self.sliding_window, self.max_blocks_per_seq * self.block_size)
