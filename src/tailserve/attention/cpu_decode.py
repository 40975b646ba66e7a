"""CPU attention: decode steps through the compiled paged decode kernel, the rest through the
reference.

A step whose sequences have at most ``MAX_QUERY_LEN`` new tokens each (decodes, the common
step at any batch size, and speculative verification) is attended by
``tailserve_paged_decode_attention`` (kernels/cpu/gemv_avx2.c), one kernel row per new
token: the new K/V written into their slots, then each row walks its sequence's block table
up to its own position, with no gathered copy of the context and no mask (from a bf16 cache,
the rows of one sequence, a verification's, walk it together: each block read once for all
of them, each row's output bitwise the one it gets alone). Measured on a 2-core AVX2 machine at
a 200-token context: ~230 us per layer through the reference's gather and SDPA, against a few
microseconds here (docs/benchmarks.md). Longer prefill chunks use the reference backend's
metadata and kernels, unchanged.

Float32, bf16 or fp16 caches (``--kv-cache-dtype``; 16-bit K/V widened in registers as they
are read), head sizes that are multiples of 8 up to 512; the execution plan
(engine/plan.py) picks this backend for ``--attention-backend auto`` on the CPU when the model
is float32 and the kernels build.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from tailserve.attention.backend import slot_of
from tailserve.attention.reference import AttentionMetadata, TorchReferenceBackend
from tailserve.kernels.cpu import KV_FORMATS, CpuKernels, StepStruct


@dataclass
class CpuDecodeMetadata:
    slot_mapping: torch.Tensor  # (B,) int64
    block_tables: torch.Tensor  # (B, W) int32
    seq_lens: torch.Tensor  # (B,) int32
    max_ctx: int
    sliding_window: int | None
    kernels: CpuKernels

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q, k, v, kv_cache, self.block_tables, self.seq_lens,
                                                   self.slot_mapping, scale, self.sliding_window, self.max_ctx)

    _step: object = None

    def kernel_step(self, kv_cache: torch.Tensor):
        """The step's tables as the fused decode layer takes them (built once per step: every
        layer's cache has the same block size and format)."""
        if self._step is None:
            self._step = StepStruct(self.block_tables.data_ptr(), self.block_tables.stride(0),
                                    self.seq_lens.data_ptr(), self.slot_mapping.data_ptr(),
                                    self.slot_mapping.shape[0], kv_cache.shape[2], self.sliding_window or 0,
                                    self.max_ctx, torch.get_num_threads(), KV_FORMATS[kv_cache.dtype])
        return self._step

    def attend_rope(self, qkv: torch.Tensor, rotary, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                    num_kv_heads: int, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """From the fused QKV rows: the rotary embedding (rotate-half, RotaryEmbedding.apply's
        arithmetic) applied inside the kernel."""
        return self.kernels.rope_paged_decode_attention(qkv, cos, sin, num_heads, num_kv_heads, kv_cache,
                                                        self.block_tables, self.seq_lens, self.slot_mapping, scale,
                                                        self.sliding_window, self.max_ctx)


def _rows(rows: list[int]) -> slice | torch.Tensor:
    """Row selector: a slice (a view, no copy) where the rows are one run, else an index."""
    if rows and rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long)


@dataclass
class CpuMixedMetadata:
    """A step of long prompt chunks beside short rows (decodes, verification, short chunks):
    the short rows attend through the kernel (``kernel``), the chunks through the reference
    (``reference``: grouped SDPA). Both parts share the step's products; only attention is
    split. Sequences are independent in attention, so the order of the two parts does not
    matter. Without the split the reference took the decode rows too, gathered and padded to
    the longest context beside them under a mask: in the KV-capacity benchmark on 2 AVX2
    cores, ~45 decode rows at ~500 tokens beside one prompt cost ~19 ms a layer, most of the
    paged run's mixed steps (docs/benchmarks.md)."""

    kernel: CpuDecodeMetadata
    reference: AttentionMetadata
    kernel_rows: slice | torch.Tensor
    reference_rows: slice | torch.Tensor
    slot_mapping: torch.Tensor  # (T,) every row's slot, in the step's row order

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        kr, rr = self.kernel_rows, self.reference_rows
        out = torch.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=q.dtype)
        out[kr] = self.kernel.attend(q[kr], k[kr], v[kr], kv_cache, scale).to(q.dtype)
        out[rr] = self.reference.attend(q[rr], k[rr], v[rr], kv_cache, scale)
        return out

    def attend_rope(self, qkv: torch.Tensor, rotary, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                    num_kv_heads: int, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        kr, rr = self.kernel_rows, self.reference_rows
        out = torch.empty((qkv.shape[0], qkv.shape[1] // (num_heads + 2 * num_kv_heads) * num_heads),
                          dtype=qkv.dtype)
        out[kr] = self.kernel.attend_rope(qkv[kr], rotary, cos[kr], sin[kr], num_heads, num_kv_heads, kv_cache,
                                          scale)
        out[rr] = self.reference.attend_rope(qkv[rr], rotary, cos[rr], sin[rr], num_heads, num_kv_heads,
                                             kv_cache, scale)
        return out

    def kernel_step(self, kv_cache: torch.Tensor) -> None:
        return None  # more than the fused layer's rows, and part of them prompt chunks


class CpuDecodeBackend(TorchReferenceBackend):
    name = "cpu-decode"
    supports_graph_capture = False  # CPU: nothing to capture

    def __init__(self, *args, kernels: CpuKernels, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kernels = kernels

    # Steps whose sequences have at most this many new tokens each go through the kernel: a
    # token at position p is one kernel row attending to positions <= p of its sequence (the
    # step's other new tokens included: every row's K/V is written before any row attends).
    # That covers decodes and speculative verification (k + 1 tokens); longer prefill chunks
    # take the reference's SDPA, which shares work across a chunk's queries.
    MAX_QUERY_LEN = 16

    def build(self, query_lens: list[int], context_lens: list[int],
              block_tables: list[list[int]]) -> CpuDecodeMetadata | CpuMixedMetadata | AttentionMetadata:
        short = [i for i, q in enumerate(query_lens) if q <= self.MAX_QUERY_LEN]
        if len(short) == len(query_lens):
            return self._kernel_metadata(query_lens, context_lens, block_tables)
        if not short:
            return super().build(query_lens, context_lens, block_tables)
        long = [i for i, q in enumerate(query_lens) if q > self.MAX_QUERY_LEN]
        starts = [0, *itertools.accumulate(query_lens)]
        short_rows = [r for i in short for r in range(starts[i], starts[i + 1])]
        long_rows = [r for i in long for r in range(starts[i], starts[i + 1])]
        kernel = self._kernel_metadata([query_lens[i] for i in short], [context_lens[i] for i in short],
                                       [block_tables[i] for i in short])
        reference = super().build([query_lens[i] for i in long], [context_lens[i] for i in long],
                                  [block_tables[i] for i in long])
        slots = torch.empty(starts[-1], dtype=torch.long)
        slots[torch.tensor(short_rows)] = kernel.slot_mapping
        slots[torch.tensor(long_rows)] = reference.slot_mapping
        return CpuMixedMetadata(kernel, reference, _rows(short_rows), _rows(long_rows), slots)

    def _kernel_metadata(self, query_lens: list[int], context_lens: list[int],
                         block_tables: list[list[int]]) -> CpuDecodeMetadata:
        if len(query_lens) == 1:
            return self._one_sequence_metadata(query_lens[0], context_lens[0], block_tables[0])
        return self._batch_metadata(query_lens, context_lens, block_tables)

    def _one_sequence_metadata(self, q: int, c: int, table: list[int]) -> CpuDecodeMetadata:
        """A batch-1 step, the latency-bound one: its decode (``q`` = 1) or its verification of
        ``q`` - 1 drafts, in a few calls (the array arithmetic of ``_batch_metadata`` took 20-35
        us for a verification of 3-5 rows on 2 Zen 4 cores, this ~6)."""
        bs = self.block_size
        seq_table = table[: -(-c // bs)]
        positions = range(c - q, c)
        return CpuDecodeMetadata(torch.from_numpy(np.array([slot_of(table, p, bs) for p in positions], dtype=np.int64)),
                                 torch.from_numpy(np.array([seq_table] * q, dtype=np.int32)),
                                 torch.from_numpy(np.array([p + 1 for p in positions], dtype=np.int32)), c,
                                 self.sliding_window, self.kernels)

    def _batch_metadata(self, query_lens: list[int], context_lens: list[int],
                        block_tables: list[list[int]]) -> CpuDecodeMetadata:
        # Whole-array arithmetic over the rows: a loop of small numpy calls per sequence cost
        # ~10 us a row (150 us a step at 16 decodes, on 2 AVX2 cores), now ~2.
        bs = self.block_size
        n = len(query_lens)
        ctx = np.asarray(context_lens, dtype=np.int64)
        nbs = -(-ctx // bs)
        seq_tables = np.zeros((n, int(nbs.max())), dtype=np.int32)
        for i, (table, nb) in enumerate(zip(block_tables, nbs.tolist())):
            seq_tables[i, :nb] = table[:nb]
        if len(query_lens) == sum(query_lens):  # one row per sequence: decodes
            tables, pos = seq_tables, ctx - 1
        else:  # verification or short chunks: rows of a sequence repeat its table
            q = np.asarray(query_lens, dtype=np.int64)
            seq = np.repeat(np.arange(n), q)
            first = np.cumsum(q) - q
            tables = seq_tables[seq]
            pos = ctx[seq] - q[seq] + np.arange(len(seq)) - first[seq]
        rows = np.arange(len(pos))
        slots = tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
        lens = (pos + 1).astype(np.int32)
        return CpuDecodeMetadata(torch.from_numpy(slots), torch.from_numpy(tables), torch.from_numpy(lens),
                                 int(ctx.max()), self.sliding_window, self.kernels)
