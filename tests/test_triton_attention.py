"""The Triton paged-attention kernel against the PyTorch reference, on the CPU through
Triton's interpreter (TRITON_INTERPRET=1): random block tables, lengths, GQA ratios, decode
and multi-query chunks after cached context, sliding windows."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported
triton = pytest.importorskip("triton", reason="Triton is not installed here (pip install triton)")

from tailserve.attention.reference import build_attention_metadata, paged_attention  # noqa: E402
from tailserve.attention.triton_paged import TritonPagedBackend, triton_paged_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(seed: int, num_seqs: int, h: int, kvh: int, d: int, bs: int, decode_only: bool, window: int | None,
          dtype: torch.dtype = torch.float32):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    qlens, ctxs = [], []
    for _ in range(num_seqs):
        ctx = rng.randint(1, 70)
        q = 1 if decode_only else rng.randint(1, min(ctx, 24))
        qlens.append(q)
        ctxs.append(ctx)
    num_blocks = sum(-(-c // bs) for c in ctxs) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered block tables, as a long-running pool has them
    tables = []
    for c in ctxs:
        nb = -(-c // bs)
        tables.append([free.pop() for _ in range(nb)])
    t = sum(qlens)
    q = torch.randn(t, h, d, dtype=dtype, device=DEVICE)
    k = torch.randn(t, kvh, d, dtype=dtype, device=DEVICE)
    v = torch.randn(t, kvh, d, dtype=dtype, device=DEVICE)
    cache = torch.randn(2, num_blocks, bs, kvh, d, dtype=dtype, device=DEVICE)  # the cached context
    return qlens, ctxs, tables, q, k, v, cache


@pytest.mark.parametrize("seed, num_seqs, h, kvh, d, bs, decode_only, window", [
    (0, 5, 4, 4, 16, 16, True, None),  # decode, multi-head
    (1, 6, 8, 2, 32, 8, True, None),  # decode, GQA 4:1, small blocks
    (2, 4, 4, 2, 16, 16, False, None),  # prefill chunks after cached context, GQA 2:1
    (3, 3, 6, 1, 64, 16, False, None),  # MQA, the built-in model's head size
    (4, 4, 4, 2, 16, 4, False, 9),  # sliding window
    (5, 7, 4, 4, 16, 16, False, None),  # a mix of decodes and chunks in one step
])
def test_triton_kernel_matches_the_reference(seed, num_seqs, h, kvh, d, bs, decode_only, window):
    qlens, ctxs, tables, q, k, v, cache = _case(seed, num_seqs, h, kvh, d, bs, decode_only, window)
    scale = d ** -0.5
    ref_meta = build_attention_metadata(qlens, ctxs, tables, bs, window, DEVICE)
    want = paged_attention(q, k, v, cache.clone(), ref_meta, scale)
    backend = TritonPagedBackend(bs, 16, 256, 128, window, DEVICE)
    meta = backend.build(qlens, ctxs, tables)
    got_cache = cache.clone()
    got = meta.attend(q, k, v, got_cache, scale)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    # The step's K/V went into the cache at the same slots as the reference writes them.
    ref_cache = cache.clone()
    paged_attention(q, k, v, ref_cache, ref_meta, scale)
    torch.testing.assert_close(got_cache, ref_cache)


def test_half_precision_inputs_accumulate_in_float32():
    qlens, ctxs, tables, q, k, v, cache = _case(7, 3, 4, 2, 16, 16, False, None, dtype=torch.float16)
    scale = 0.25
    want = paged_attention(q.float(), k.float(), v.float(), cache.float(),
                           build_attention_metadata(qlens, ctxs, tables, 16, None, DEVICE), scale)
    backend = TritonPagedBackend(16, 16, 256, 128, None, DEVICE)
    got = triton_paged_attention(q, k, v, cache, backend.buffers.fill(qlens, ctxs, tables, 16), scale)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


def test_a_head_size_the_kernel_cannot_tile_is_refused():
    qlens, ctxs, tables, q, k, v, cache = _case(8, 1, 2, 2, 16, 16, True, None)
    backend = TritonPagedBackend(16, 16, 256, 128, None, DEVICE)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        triton_paged_attention(q[..., :12].contiguous(), k[..., :12].contiguous(), v[..., :12].contiguous(),
                               cache[..., :12].contiguous(), backend.buffers.fill(qlens, ctxs, tables, 16), 1.0)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_engine_on_the_triton_backend_generates_what_the_reference_does(tiny_checkpoint, kind):
    from tailserve import LLM, SamplingParams

    path, _ = tiny_checkpoint(kind)
    prompts = [[5, 17, 33, 2, 90, 41] * 3, [7, 8, 100, 3]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), dtype="float32", block_size=8).generate(prompts, params)]
    llm = LLM(str(path), dtype="float32", block_size=8, attention_backend="triton")
    assert llm.engine.core.worker.attn_backend.name == "triton-paged"
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
