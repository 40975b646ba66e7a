"""Paged attention: the pure-PyTorch reference backend's metadata and kernels.

The runner builds one ``AttentionMetadata`` per step (shared by every layer). Tokens of
the flat batch are grouped so that each group is a small padded batch: all single-token
decodes form one group, all longer query chunks (prefill chunks, speculative verification)
another. Each group runs as one ``scaled_dot_product_attention`` call over K/V gathered
from the paged cache by slot, so a batch of decodes needs no Python loop per sequence.
This backend is the correctness oracle for faster ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tailserve.attention.backend import (
    AttentionBackend,
    PagedBatch,
    PersistentBuffers,
    RopeOutsideKernel,
    StaticDecodeBuffers,
    StaticPagedDecodeMetadata,
    slot_of,
    upcasts_attention,
)


@dataclass
class AttentionGroup:
    """Sequences attended together as a padded batch of B rows, Q queries, C context slots."""

    q_index: torch.Tensor  # (B*Q,) flat-batch index of each (padded) query
    kv_slots: torch.Tensor  # (B, C) cache slot of each context position (padding -> slot 0)
    mask: torch.Tensor | None  # (B, 1, Q, C) True = may attend; None = attend to all C
    num_seqs: int
    max_query_len: int
    valid: torch.Tensor | None  # (n_valid,) rows of q_index that are real tokens; None if all
    covers_batch: bool  # q_index is exactly arange(T): no gather/scatter needed
    # Every row is a whole prompt computed from its start (queries = context, same length,
    # no window): plain causal attention, with no mask to build and the upper triangle skipped.
    causal: bool = False
    # ... and the group is the whole batch: its keys and values are the step's own k and v.
    fresh: bool = False


@dataclass
class AttentionMetadata(RopeOutsideKernel):
    slot_mapping: torch.Tensor  # (T,) where each new token's K/V is written
    groups: list[AttentionGroup]
    num_tokens: int
    upcast: bool = False  # attend in float32 whatever the model's dtype (upcasts_attention)
    # Set by TorchReferenceBackend.build: what ``paged`` fills the persistent buffers from.
    _paged_source: tuple | None = field(default=None, repr=False)
    _paged: PagedBatch | None = field(default=None, repr=False)

    @property
    def paged(self) -> PagedBatch:
        """The step in kernel form (padded int32 block tables, sequence lengths, query start
        offsets, slot mapping) in the backend's persistent buffers. The reference kernels
        read the groups, so this is filled only when asked for (by tests and by backends
        that delegate to the reference)."""
        if self._paged is None:
            if self._paged_source is None:
                raise ValueError("this metadata was not built by an attention backend")
            buffers, qlens, ctx, tables, block_size = self._paged_source
            self._paged = buffers.fill(qlens, ctx, tables, block_size)
        return self._paged

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        """What a layer calls: each metadata kind knows the kernel that reads it."""
        return paged_attention(q, k, v, kv_cache, self, scale)


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    upcast: bool | None = None,
) -> AttentionMetadata:
    """Metadata for a flat batch whose sequence i contributes query_lens[i] tokens, the last
    of which sits at position context_lens[i] - 1 (context includes the new tokens)."""
    slots: list[int] = []
    for qlen, ctx, table in zip(query_lens, context_lens, block_tables):
        for pos in range(ctx - qlen, ctx):
            slots.append(slot_of(table, pos, block_size))
    num_tokens = len(slots)

    starts = []
    acc = 0
    for qlen in query_lens:
        starts.append(acc)
        acc += qlen
    decode_ids = [i for i, q in enumerate(query_lens) if q == 1]
    multi_ids = [i for i, q in enumerate(query_lens) if q > 1]
    id_groups = [decode_ids, *_split_fresh_prompts(multi_ids, query_lens, context_lens, sliding_window)]
    groups = []
    for ids in id_groups:
        if ids:
            groups.append(_build_group(ids, query_lens, context_lens, block_tables, block_size, starts,
                                       num_tokens, sliding_window, device))
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    if upcast is None:  # backends and proposers pass their own, decided once
        upcast = upcasts_attention(device)
    return AttentionMetadata(slot_mapping=slot_mapping, groups=groups, num_tokens=num_tokens, upcast=upcast)


def _split_fresh_prompts(multi_ids: list[int], query_lens: list[int], context_lens: list[int],
                         sliding_window: int | None) -> list[list[int]]:
    """The multi-query sequences as attention groups. Whole prompts of different lengths,
    padded into one group, need an explicit mask over (longest x longest) for each: where
    that padding would more than double the work, each whole prompt gets its own group (SDPA's
    causal path, no mask, no padding) and the rest (chunks after cached context) stay
    together. 12 prompts of 94-403 tokens, 6 heads of 64 (float32, 2 cores): 18.2 ms a layer
    as one masked group, 6.6 ms one causal call each."""
    if len(multi_ids) < 2 or sliding_window is not None:
        return [multi_ids]
    fresh = [i for i in multi_ids if query_lens[i] == context_lens[i]]
    if len(fresh) < 2 or (len({query_lens[i] for i in fresh}) == 1 and len(fresh) == len(multi_ids)):
        return [multi_ids]  # one whole prompt, or prompts of one length: one causal group already
    max_q = max(query_lens[i] for i in multi_ids)
    max_ctx = max(context_lens[i] for i in multi_ids)
    padded = len(multi_ids) * max_q * max_ctx
    exact = sum(query_lens[i] * context_lens[i] for i in multi_ids)
    if 2 * exact >= padded:
        return [multi_ids]
    rest = [i for i in multi_ids if query_lens[i] != context_lens[i]]
    return [[i] for i in fresh] + [rest]


def _build_group(ids, query_lens, context_lens, block_tables, block_size, starts, num_tokens,
                 sliding_window, device) -> AttentionGroup:
    # Built from Python lists with one tensor constructor per array: per-row tensor ops
    # would cost more than the attention itself for a batch of decodes.
    b = len(ids)
    max_q = max(query_lens[i] for i in ids)
    max_ctx = max(context_lens[i] for i in ids)
    max_blocks = (max_ctx + block_size - 1) // block_size
    tables_l, q_index_l, q_pos_l = [], [], []
    all_valid = True
    for i in ids:
        nb = (context_lens[i] + block_size - 1) // block_size
        table = block_tables[i][:nb]
        tables_l.append(table + [0] * (max_blocks - nb))
        qlen, ctx, st = query_lens[i], context_lens[i], starts[i]
        pad = max_q - qlen
        all_valid &= pad == 0
        q_index_l.extend(range(st, st + qlen))
        q_pos_l.extend(range(ctx - qlen, ctx))
        if pad:
            q_index_l.extend([0] * pad)
            q_pos_l.extend([0] * pad)
    tables = torch.tensor(tables_l, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    kv_slots = (tables[:, :, None] * block_size + offsets).reshape(b, -1)[:, :max_ctx].contiguous()
    uniform_ctx = all(context_lens[i] == max_ctx for i in ids)
    causal = max_q > 1 and sliding_window is None and all(
        query_lens[i] == context_lens[i] == max_q for i in ids)
    if (max_q == 1 and uniform_ctx and sliding_window is None) or causal:
        mask = None  # every query sees its whole context, or exactly the causal triangle
    else:
        # Causal within the chunk and bounded by each row's own context; padded query rows
        # sit at position 0 so they see slot 0 and never produce an all-masked row (NaN).
        q_pos = torch.tensor(q_pos_l, dtype=torch.long).view(b, max_q)
        kv_pos = torch.arange(max_ctx, dtype=torch.long)
        m = kv_pos[None, None, :] <= q_pos[:, :, None]
        if sliding_window is not None:
            m &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        mask = m.unsqueeze(1).to(device)
    covers = all_valid and len(q_index_l) == num_tokens and q_index_l == list(range(num_tokens))
    valid = None
    if not all_valid:
        flags = [j < query_lens[i] for i in ids for j in range(max_q)]
        valid = torch.tensor([r for r, f in enumerate(flags) if f], dtype=torch.long, device=device)
    return AttentionGroup(
        q_index=torch.tensor(q_index_l, dtype=torch.long, device=device),
        kv_slots=kv_slots.to(device),
        mask=mask,
        num_seqs=b,
        max_query_len=max_q,
        valid=valid,
        covers_batch=covers,
        causal=causal,
        fresh=causal and covers,
    )


def decode_metadata(slot_mapping: torch.Tensor, kv_slots: torch.Tensor,
                    context_lens: torch.Tensor | None, query_len: int = 1,
                    upcast: bool | None = None) -> AttentionMetadata:
    """Metadata for a batch of B rows of ``query_len`` tokens each whose context slots are
    already known: ``kv_slots`` (B, C); ``slot_mapping`` (B * query_len,), row-major;
    ``context_lens`` (B,) when the rows' contexts (after their new tokens) differ, None
    when every row uses all C slots. Masked where rows are ragged or queries are causal.
    The speculative draft chain builds it from slot tables computed once per round instead
    of from block tables."""
    b, c = kv_slots.shape
    mask = None
    if context_lens is not None or query_len > 1:
        ends = context_lens if context_lens is not None else torch.full((b,), c, device=kv_slots.device)
        # Query j of a row sits at position end - query_len + j and sees keys up to it.
        limit = ends[:, None] - query_len + 1 + torch.arange(query_len, device=kv_slots.device)[None, :]  # (B, Q)
        mask = (torch.arange(c, device=kv_slots.device)[None, None, :] < limit[:, :, None]).view(b, 1, query_len, c)
    group = AttentionGroup(q_index=slot_mapping, kv_slots=kv_slots, mask=mask, num_seqs=b, max_query_len=query_len,
                           valid=None, covers_batch=True)  # q_index is unused when covers_batch
    if upcast is None:
        upcast = upcasts_attention(kv_slots.device)
    return AttentionMetadata(slot_mapping=slot_mapping, groups=[group], num_tokens=b * query_len, upcast=upcast)


def paged_attention(
    q: torch.Tensor,  # (T, H, D)
    k: torch.Tensor,  # (T, KVH, D)
    v: torch.Tensor,  # (T, KVH, D)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KVH, D)
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend every query to its context. (T, H*D)."""
    t, h, d = q.shape
    kvh = k.shape[1]
    k_cache = kv_cache[0].view(-1, kvh, d)
    v_cache = kv_cache[1].view(-1, kvh, d)
    if kv_cache.dtype != k.dtype:
        # A KV cache narrower (or wider) than the model (--kv-cache-dtype): every reader, this
        # step's own queries included, sees the K/V as stored, so a prompt attends the same
        # values whether they come fresh or from the prefix cache.
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    gqa = h != kvh
    # On the CPU the gathered q/K/V are upcast (upcasts_attention); the result is rounded
    # back to the model dtype.
    upcast = meta.upcast and q.dtype != torch.float32
    out = None
    for g in meta.groups:
        b, qlen = g.num_seqs, g.max_query_len
        qg = q if g.covers_batch else q.index_select(0, g.q_index)
        if g.fresh:  # the context is exactly this step's tokens: no gather from the cache
            kg, vg = k, v
        else:
            slots = g.kv_slots.reshape(-1)  # a view unless sliced from a wider slot table
            kg = k_cache.index_select(0, slots)  # (B*C, KVH, D)
            vg = v_cache.index_select(0, slots)
        if upcast:
            qg, kg, vg = qg.float(), kg.float(), vg.float()
        if kg.dtype != qg.dtype:
            kg, vg = kg.to(qg.dtype), vg.to(qg.dtype)
        qg = qg.view(b, qlen, h, d).transpose(1, 2)  # (B, H, Q, D)
        kg = kg.view(b, -1, kvh, d).transpose(1, 2)  # (B, KVH, C, D)
        vg = vg.view(b, -1, kvh, d).transpose(1, 2)
        if g.mask is not None and g.mask.dtype == torch.bool:
            # SDPA turns a boolean mask into an additive one on every call; do it once per
            # step (the first layer) and let the other layers reuse it.
            g.mask = torch.zeros(g.mask.shape, dtype=qg.dtype, device=qg.device).masked_fill_(~g.mask, float("-inf"))
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, is_causal=g.causal, scale=scale,
                                            enable_gqa=gqa)
        og = og.transpose(1, 2).reshape(b * qlen, h * d).to(q.dtype)  # (B*Q, H*D)
        if g.covers_batch:
            return og
        if out is None:
            out = q.new_empty((t, h * d))
        if g.valid is None:
            out[g.q_index] = og
        else:
            out[g.q_index[g.valid]] = og[g.valid]
    if out is None:
        raise ValueError("attention metadata has no groups")
    return out


class TorchReferenceBackend(AttentionBackend):
    """The pure-PyTorch backend: grouped SDPA over K/V gathered by slot (above), and
    fixed-shape decode metadata for graph capture. Runs everywhere; the oracle for others."""

    name = "torch-reference"
    supports_graph_capture = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.upcast = upcasts_attention(self.device)

    def build(self, query_lens: list[int], context_lens: list[int],
              block_tables: list[list[int]]) -> AttentionMetadata:
        meta = build_attention_metadata(query_lens, context_lens, block_tables, self.block_size,
                                        self.sliding_window, self.device, self.upcast)
        meta._paged_source = (self.buffers, query_lens, context_lens, block_tables, self.block_size)
        return meta

    def static_decode_metadata(self, buffers: StaticDecodeBuffers) -> StaticPagedDecodeMetadata:
        return StaticPagedDecodeMetadata(buffers, self.sliding_window, self.upcast)


__all__ = ["AttentionMetadata", "PersistentBuffers", "TorchReferenceBackend", "build_attention_metadata",
           "decode_metadata", "paged_attention"]
