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
    # The reference in float64: on a GPU, SDPA's float32 kernels differ from exact by ~1e-3 (seen
    # on an H200), more than the kernel's own float32 error.
    want = paged_attention(q.double(), k.double(), v.double(), cache.double(), ref_meta, scale).float()
    backend = TritonPagedBackend(bs, 16, 256, 128, window, DEVICE)
    meta = backend.build(qlens, ctxs, tables)
    got_cache = cache.clone()
    got = meta.attend(q, k, v, got_cache, scale)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    # The step's K/V went into the cache at the same slots as the reference writes them.
    ref_cache = cache.clone()  # fresh metadata: the float64 call above cast its mask to float64
    paged_attention(q, k, v, ref_cache, build_attention_metadata(qlens, ctxs, tables, bs, window, DEVICE), scale)
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
    # Six tokens: the second prompt's decode crosses into its second block (size 8); each
    # interpreted step costs most of a second.
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # A fixed KV budget: on a GPU the default sizes the cache from 0.9 of the card's memory (twice here).
    kw = dict(dtype="float32", block_size=8, device=str(DEVICE), kv_cache_memory_bytes=8 << 20)
    want = [o.token_ids for o in LLM(str(path), **kw).generate(prompts, params)]
    llm = LLM(str(path), attention_backend="triton", **kw)
    assert llm.engine.core.worker.attn_backend.name == "triton-paged"
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_captured_decode_on_the_triton_backend_replays_the_eager_logits(tiny_checkpoint, kind):
    """The static-buffer metadata runs the same kernel over every row's own blocks: a batch of
    3 in a bucket of 4 (one padding row on the scratch block) gives the eager logits, step
    after step, across a block boundary."""
    from tailserve.attention import DecodeGraph
    from tailserve.memory.kv_cache import allocate_kv_caches
    from tailserve.model.loader import load_model

    path, _ = tiny_checkpoint(kind)
    model, cfg = load_model(path, torch.float32, device=DEVICE)
    bs, num_blocks = 4, 16
    backend = TritonPagedBackend(bs, 8, 256, cfg.max_position_embeddings, cfg.sliding_window, DEVICE)
    eager_caches = allocate_kv_caches(cfg, num_blocks + 1, bs, torch.float32, DEVICE)
    graph_caches = allocate_kv_caches(cfg, num_blocks + 1, bs, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(5)
    lens, tables = [3, 9, 4], [[4, 1], [0, 6, 2], [3, 9]]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    with torch.inference_mode():
        for caches in (eager_caches, graph_caches):
            meta = backend.build(lens, lens, tables)
            model(torch.tensor([t for p in prompts for t in p], device=DEVICE),
                  torch.tensor([i for n in lens for i in range(n)], device=DEVICE), caches, meta)
        graph = DecodeGraph(model, graph_caches, backend, batch_size=4, scratch_slot=num_blocks * bs)
        graph.capture()
        for step in range(3):
            toks = [7 + step, 17 + step, 27 + step]
            ctx = [n + step + 1 for n in lens]
            eager = model.compute_logits(model(torch.tensor(toks, device=DEVICE),
                                               torch.tensor([c - 1 for c in ctx], device=DEVICE), eager_caches,
                                               backend.build([1, 1, 1], ctx, tables)))
            torch.testing.assert_close(model.compute_logits(graph.replay(toks, ctx, tables)), eager,
                                       rtol=1e-4, atol=1e-4)
    for a, b in zip(eager_caches, graph_caches):
        torch.testing.assert_close(a[:, :num_blocks], b[:, :num_blocks])
