"""The attention-backend interface: what a layer calls, what a backend builds, and the
hooks a graph-captured decode needs.

A backend turns one step's batch (per sequence: query length, context length after the
step, block table) into per-step metadata that every layer reads through one call,
``meta.attend(q, k, v, kv_cache, scale)``. Each metadata kind knows the kernel that reads
it, so a layer never branches on the platform.

Metadata comes in the forms paged flash / Triton kernels take (``PagedBatch``: block tables
as a padded int32 tensor, sequence lengths, query start offsets, slot mapping), written into
buffers preallocated once for ``max_num_seqs`` / ``max_num_batched_tokens`` (``PersistentBuffers``),
so building a step allocates nothing on the device and a captured graph can read the same
memory every replay. ``StaticDecodeBuffers`` + ``DecodeGraph`` are the capture / replay hooks
for a decode of B sequences: fixed shapes, inputs copied in before each replay. On CUDA the
forward is captured as a CUDA graph; elsewhere "replay" runs the same forward eagerly over the
same static buffers, which is how CPU tests check that a replayed step gives the eager logits.

The pure-PyTorch backend (``tailserve.attention.reference``) is the reference
implementation and the oracle for faster ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F


class LayerAttentionMetadata(Protocol):
    """What a model layer sees: where to write this step's K/V and how to attend. One form
    for every backend: whether the rotary embedding is applied inside the kernel or before
    it is the metadata's business, and so is whether the step can run as fused layers."""

    slot_mapping: torch.Tensor

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q (T, H, D), k/v (T, KVH, D), kv_cache (2, num_blocks, block_size, KVH, D) -> (T, H*D)."""
        ...

    def attend_rope(self, qkv: torch.Tensor, rotary: RotateHalf, cos: torch.Tensor, sin: torch.Tensor,
                    num_heads: int, num_kv_heads: int, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """From the fused QKV rows (T, (H + 2*KVH) * D) of a layer without q/k norms whose
        rotary embedding rotates halves: rotate q and k, write K/V, attend. (T, H*D)."""
        ...

    def kernel_step(self, kv_cache: torch.Tensor) -> object | None:
        """The step's tables as the fused decode layer takes them (kernels.cpu.StepStruct, with
        ``kv_cache``'s block size and format), or None where this step's metadata is not the CPU
        decode kernel's."""
        ...


class RotateHalf(Protocol):
    """The rotary embedding as attention metadata uses it (model/rope.py RotaryEmbedding)."""

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


class RopeOutsideKernel:
    """The metadata forms whose kernels take rotated q and k: ``attend_rope`` rotates q and k
    (adjacent in the fused projection: one call) and attends; no fused decode layers."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        raise NotImplementedError

    def attend_rope(self, qkv: torch.Tensor, rotary: RotateHalf, cos: torch.Tensor, sin: torch.Tensor,
                    num_heads: int, num_kv_heads: int, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        t, h, kvh = qkv.shape[0], num_heads, num_kv_heads
        d = qkv.shape[1] // (h + 2 * kvh)
        qk = rotary.apply(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), cos, sin)
        v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
        return self.attend(qk[:, :h], qk[:, h:], v, kv_cache, scale)

    def kernel_step(self, kv_cache: torch.Tensor) -> object | None:
        return None


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The KV-cache slot of one position of a sequence: its block's id times the block size,
    plus the offset inside the block (every builder's one formula; ``slots_of`` for arrays)."""
    return block_table[position // block_size] * block_size + position % block_size


def slots_of(blocks: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """``slot_of`` for an array of positions of one sequence (``blocks``: its block ids, int64)."""
    return blocks[positions // block_size] * block_size + positions % block_size


def upcasts_attention(device: torch.device) -> bool:
    """Whether the reference kernels attend in float32 for a bf16/fp16 model: on the CPU,
    PyTorch's attention kernels are several times slower in bf16/fp16 than in fp32 at these
    sizes (measured: 128 us vs 27 us for one decode row). Decided once, per backend."""
    return device.type == "cpu"


@dataclass
class PagedBatch:
    """One step's batch in the form paged kernels take (views into persistent buffers)."""

    num_seqs: int
    num_tokens: int
    block_tables: torch.Tensor  # (B, max_blocks) int32; unused entries 0
    seq_lens: torch.Tensor  # (B,) int32: context length after this step's tokens
    query_start_loc: torch.Tensor  # (B + 1,) int32: flat-batch offset of each sequence's first query
    slot_mapping: torch.Tensor  # (T,) int64: cache slot of each new token's K/V
    max_query_len: int
    max_seq_len: int


class PersistentBuffers:
    """Kernel-form metadata buffers, allocated once. On the CPU the tensors share memory
    with NumPy arrays that are filled in place; on a GPU a host staging copy is filled and
    sent with one non-blocking copy per buffer."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self._host = {
            "block_tables": np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32),
            "seq_lens": np.zeros(max_num_seqs, dtype=np.int32),
            "query_start_loc": np.zeros(max_num_seqs + 1, dtype=np.int32),
            "slot_mapping": np.zeros(max_num_batched_tokens, dtype=np.int64),
        }
        host_t = {k: torch.from_numpy(v) for k, v in self._host.items()}
        self._staged = device.type != "cpu"  # a host copy to send each step
        if not self._staged:
            self._dev = host_t
        else:
            self._host_t = {k: v.pin_memory() if torch.cuda.is_available() else v for k, v in host_t.items()}
            self._host = {k: v.numpy() for k, v in self._host_t.items()}
            self._dev = {k: torch.zeros_like(v, device=device) for k, v in host_t.items()}

    def fill(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
             block_size: int) -> PagedBatch:
        b, t = len(query_lens), sum(query_lens)
        if b > self.max_num_seqs or t > self.max_num_batched_tokens:
            raise ValueError(f"batch of {b} sequences / {t} tokens exceeds the buffers "
                             f"({self.max_num_seqs} / {self.max_num_batched_tokens})")
        h = self._host
        max_blocks = 0
        bt = h["block_tables"]
        slots = h["slot_mapping"]
        pos = 0
        for i, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            nb = -(-c // block_size)
            if nb > self.max_blocks_per_seq:
                raise ValueError(f"sequence of {c} tokens exceeds {self.max_blocks_per_seq} blocks")
            bt[i, :nb] = table[:nb]
            bt[i, nb : max(max_blocks, nb)] = 0
            max_blocks = max(max_blocks, nb)
            p = np.arange(c - q, c)
            slots[pos : pos + q] = slots_of(np.asarray(table[:nb], dtype=np.int64), p, block_size)
            pos += q
        h["seq_lens"][:b] = context_lens
        np.cumsum([0, *query_lens], out=h["query_start_loc"][: b + 1])
        if self._staged:
            for k, v in self._dev.items():
                v.copy_(self._host_t[k], non_blocking=True)
        d = self._dev
        return PagedBatch(b, t, d["block_tables"][:b, :max_blocks], d["seq_lens"][:b], d["query_start_loc"][: b + 1],
                          d["slot_mapping"][:t], max(query_lens), max(context_lens))


class AttentionBackend(ABC):
    """Builds one step's metadata; provides the static-buffer metadata a captured decode reads."""

    name: str = "abstract"
    supports_graph_capture: bool = False

    def __init__(self, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 sliding_window: int | None, device: torch.device) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device
        self.max_blocks_per_seq = -(-max_model_len // block_size) + 1  # + lookahead slack
        self.buffers = PersistentBuffers(max_num_seqs, max_num_batched_tokens + max_num_seqs,
                                         self.max_blocks_per_seq, device)

    @abstractmethod
    def build(self, query_lens: list[int], context_lens: list[int],
              block_tables: list[list[int]]) -> LayerAttentionMetadata:
        """Metadata for a flat batch whose sequence i has query_lens[i] new tokens, the last
        at position context_lens[i] - 1."""

    @abstractmethod
    def static_decode_metadata(self, buffers: StaticDecodeBuffers) -> LayerAttentionMetadata:
        """Metadata that reads only ``buffers`` (fixed shapes): what a captured decode uses."""


class StaticDecodeBuffers:
    """Fixed-shape inputs of a decode of ``batch_size`` sequences (one new token each).
    Rows past the real batch are padding: they attend to one slot and write their K/V to
    ``scratch_slot``, a cache slot no request owns."""

    def __init__(self, batch_size: int, max_blocks_per_seq: int, block_size: int, scratch_slot: int,
                 device: torch.device) -> None:
        self.batch_size, self.block_size, self.scratch_slot = batch_size, block_size, scratch_slot
        self.input_ids = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((batch_size, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(batch_size, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((batch_size,), scratch_slot, dtype=torch.long, device=device)
        # One query per row: constant, for kernels that take query offsets (PagedBatch form).
        self.query_start_loc = torch.arange(batch_size + 1, dtype=torch.int32, device=device)

    def paged(self, max_seq_len: int) -> PagedBatch:
        """These buffers in the form paged kernels take (fixed shapes: every row, every block)."""
        b = self.batch_size
        return PagedBatch(b, b, self.block_tables, self.seq_lens, self.query_start_loc, self.slot_mapping, 1,
                          max_seq_len)

    def load(self, token_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> int:
        """Copy a real decode batch in (in place: a captured graph reads these addresses)."""
        n, bs = len(token_ids), self.block_size
        if n > self.batch_size:
            raise ValueError(f"{n} sequences exceed the captured batch size {self.batch_size}")
        width = self.block_tables.shape[1]
        tables = np.zeros((self.batch_size, width), dtype=np.int32)
        slots = np.full(self.batch_size, self.scratch_slot, dtype=np.int64)
        lens = np.ones(self.batch_size, dtype=np.int32)
        pos = np.zeros(self.batch_size, dtype=np.int64)
        ids = np.zeros(self.batch_size, dtype=np.int64)
        scratch_block = self.scratch_slot // bs
        tables[n:, 0] = scratch_block  # padding rows attend to the scratch slot only
        for i, (tok, c, table) in enumerate(zip(token_ids, context_lens, block_tables)):
            nb = -(-c // bs)
            tables[i, :nb] = table[:nb]
            ids[i], pos[i], lens[i] = tok, c - 1, c
            slots[i] = slot_of(table, c - 1, bs)
        if n < self.batch_size:
            pos[n:] = self.scratch_slot % bs
            lens[n:] = self.scratch_slot % bs + 1
        self.input_ids.copy_(torch.from_numpy(ids), non_blocking=True)
        self.positions.copy_(torch.from_numpy(pos), non_blocking=True)
        self.block_tables.copy_(torch.from_numpy(tables), non_blocking=True)
        self.seq_lens.copy_(torch.from_numpy(lens), non_blocking=True)
        self.slot_mapping.copy_(torch.from_numpy(slots), non_blocking=True)
        return n


@dataclass
class StaticPagedDecodeMetadata(RopeOutsideKernel):
    """Decode metadata over static buffers, attended with fixed-shape tensor ops only (no
    host reads, no data-dependent shapes), so it can be captured in a CUDA graph. Reference
    arithmetic: gather every slot of the padded block tables, mask by sequence length."""

    buffers: StaticDecodeBuffers
    sliding_window: int | None = None
    upcast: bool = False  # attend in float32 (upcasts_attention)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.buffers.slot_mapping

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        buf = self.buffers
        b, h, d = q.shape
        kvh, bs = k.shape[1], buf.block_size
        k_cache = kv_cache[0].view(-1, kvh, d)
        v_cache = kv_cache[1].view(-1, kvh, d)
        k_cache.index_copy_(0, buf.slot_mapping, k.to(kv_cache.dtype))
        v_cache.index_copy_(0, buf.slot_mapping, v.to(kv_cache.dtype))
        offsets = torch.arange(bs, device=q.device)
        slots = (buf.block_tables.long()[:, :, None] * bs + offsets).view(b, -1)  # (B, C)
        c = slots.shape[1]
        kv_pos = torch.arange(c, device=q.device)[None, :]
        lens = buf.seq_lens.long()[:, None]
        allowed = kv_pos < lens
        if self.sliding_window is not None:
            allowed &= kv_pos > lens - 1 - self.sliding_window
        compute = torch.float32 if self.upcast else q.dtype
        mask = torch.zeros((b, 1, 1, c), dtype=compute, device=q.device).masked_fill_(~allowed[:, None, None, :],
                                                                                      float("-inf"))
        kg = k_cache[slots.view(-1)].view(b, c, kvh, d).transpose(1, 2).to(compute)  # (B, KVH, C, D)
        vg = v_cache[slots.view(-1)].view(b, c, kvh, d).transpose(1, 2).to(compute)
        qg = q.view(b, 1, h, d).transpose(1, 2).to(compute)  # (B, H, 1, D)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=h != kvh)
        return og.transpose(1, 2).reshape(b, h * d).to(q.dtype)


class DecodeGraph:
    """A decode of up to ``batch_size`` sequences, captured once and replayed per step.

    ``capture`` records the model's forward over the static buffers (a CUDA graph on CUDA;
    the same eager forward elsewhere); ``replay`` copies a real batch into the buffers and
    returns the final hidden states of its rows."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], backend: AttentionBackend,
                 batch_size: int, scratch_slot: int, pool: tuple[int, int] | None = None) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.batch_size = batch_size
        self.pool = pool  # a CUDA graph memory pool shared by every bucket's capture
        self.buffers = StaticDecodeBuffers(batch_size, backend.max_blocks_per_seq, backend.block_size,
                                           scratch_slot, backend.device)
        self.meta = backend.static_decode_metadata(self.buffers)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: torch.Tensor | None = None

    def _forward(self) -> torch.Tensor:
        return self.model(self.buffers.input_ids, self.buffers.positions, self.kv_caches, self.meta)

    @torch.inference_mode()
    def capture(self) -> None:
        if self.backend.device.type == "cuda":
            if not self.backend.supports_graph_capture:
                raise RuntimeError(f"attention backend {self.backend.name} cannot be captured")
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward()  # warm-up: allocator and kernel selection outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph, pool=self.pool):
                self._out = self._forward()

    @torch.inference_mode()
    def replay(self, token_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        n = self.buffers.load(token_ids, context_lens, block_tables)
        if self._graph is not None:
            self._graph.replay()
            assert self._out is not None
            return self._out[:n]
        return self._forward()[:n]
