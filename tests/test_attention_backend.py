"""The attention-backend interface: kernel-form metadata in persistent buffers, and a
decode replayed through static buffers (the CUDA-graph path) against the eager forward."""

from __future__ import annotations

import pytest
import torch

from tailserve.attention import DecodeGraph, TorchReferenceBackend
from tailserve.memory.kv_cache import allocate_kv_caches
from tailserve.model.loader import load_model


def test_paged_form_is_what_kernels_take():
    be = TorchReferenceBackend(4, 8, 64, 64, None, torch.device("cpu"))
    # Three sequences: a decode (context 6), a prefill chunk of 5 from position 3, a decode at 1.
    tables = [[7, 2], [3, 9, 4], [5]]
    meta = be.build([1, 5, 1], [6, 8, 1], tables)
    pb = meta.paged
    assert pb.block_tables.dtype == torch.int32 and pb.block_tables.tolist() == [[7, 2], [3, 9], [5, 0]]
    assert pb.seq_lens.tolist() == [6, 8, 1] and pb.query_start_loc.tolist() == [0, 1, 6, 7]
    want = [2 * 4 + 1, *[3 * 4 + 3] + [9 * 4 + i for i in range(4)], 5 * 4 + 0]
    assert pb.slot_mapping.tolist() == want == meta.slot_mapping.tolist()
    assert (pb.max_query_len, pb.max_seq_len, pb.num_tokens) == (5, 8, 7)
    # Persistent: a second step writes the same memory, and stale entries are cleared.
    ptr = pb.block_tables.data_ptr()
    pb2 = be.build([1], [3], [[6]]).paged
    assert pb2.block_tables.data_ptr() == ptr and pb2.block_tables.tolist() == [[6]]
    with pytest.raises(ValueError, match="exceeds the buffers"):
        be.build([1] * 9, [1] * 9, [[0]] * 9).paged  # noqa: B018


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_decode_replayed_through_static_buffers_gives_the_eager_logits(tiny_checkpoint, kind, device):
    """On CUDA the replay is a captured CUDA graph; on the CPU the same forward over the
    same static buffers."""
    path, _ = tiny_checkpoint(kind)
    dev = torch.device(device)
    model, cfg = load_model(path, torch.float32, device=dev)
    bs = 4
    num_blocks = 24
    backend = TorchReferenceBackend(bs, 8, 256, cfg.max_position_embeddings, cfg.sliding_window, dev)
    eager_caches = allocate_kv_caches(cfg, num_blocks + 1, bs, torch.float32, dev)
    graph_caches = allocate_kv_caches(cfg, num_blocks + 1, bs, torch.float32, dev)
    g = torch.Generator().manual_seed(3)
    lens = [5, 11, 2]
    tables = [[0, 1], [2, 3, 4, 7], [5]]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    with torch.inference_mode():
        for caches in (eager_caches, graph_caches):  # the same prefill into both caches
            meta = backend.build(lens, lens, tables)
            ids = torch.tensor([t for p in prompts for t in p], device=dev)
            pos = torch.tensor([i for n in lens for i in range(n)], device=dev)
            model(ids, pos, caches, meta)
        # A bucket of 4 rows for a batch of 3: row 4 is padding writing to the scratch slot.
        graph = DecodeGraph(model, graph_caches, backend, batch_size=4, scratch_slot=num_blocks * bs)
        graph.capture()
        tokens = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
        for step in range(3):
            toks = [t[step] for t in tokens]
            ctx = [n + step + 1 for n in lens]
            if ctx[2] > 4 and len(tables[2]) == 1:
                tables[2] = [5, 6]
            meta = backend.build([1, 1, 1], ctx, tables)
            eager = model.compute_logits(model(torch.tensor(toks, device=dev),
                                               torch.tensor([c - 1 for c in ctx], device=dev), eager_caches, meta))
            replayed = model.compute_logits(graph.replay(toks, ctx, tables))
            torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
        for a, b in zip(eager_caches, graph_caches):  # same K/V written (scratch block aside)
            torch.testing.assert_close(a[:, :num_blocks], b[:, :num_blocks])


@pytest.mark.parametrize("num_seqs, kvh", [(1, 2), (3, 1)])
def test_whole_prompts_take_the_causal_path_and_match_the_masked_one(num_seqs, kvh):
    """Prompts computed from their start skip the mask and the cache gather (is_causal on the
    step's own K/V); the result equals explicit masked attention over the gathered cache."""
    import dataclasses

    from tailserve.attention.reference import build_attention_metadata, paged_attention

    torch.manual_seed(0)
    q_len, h, d, bs = 37, 4, 16, 8
    blocks = -(-q_len // bs)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(num_seqs)]
    meta = build_attention_metadata([q_len] * num_seqs, [q_len] * num_seqs, tables, bs, None, torch.device("cpu"))
    (group,) = meta.groups
    assert group.causal and group.fresh and group.mask is None
    t = q_len * num_seqs
    q, k, v = torch.randn(t, h, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    cache = torch.zeros(2, num_seqs * blocks, bs, kvh, d)
    fast = paged_attention(q, k, v, cache, meta, d ** -0.5)
    tri = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    masked = dataclasses.replace(group, causal=False, fresh=False, mask=tri.expand(num_seqs, 1, q_len, q_len).clone())
    slow = paged_attention(q, k, v, torch.zeros_like(cache), dataclasses.replace(meta, groups=[masked]), d ** -0.5)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    # A chunk after a cached prefix is not a whole prompt: it keeps its mask.
    later = build_attention_metadata([5], [20], [[0, 1, 2]], bs, None, torch.device("cpu"))
    assert not later.groups[0].causal and later.groups[0].mask is not None


def test_the_start_up_warm_up_leaves_no_trace(llama_checkpoint):
    """Warm-up forwards write only into free, uncached blocks and record nothing: the engine
    afterwards serves exactly what an engine without warm-up serves."""
    from tailserve import LLM, SamplingParams

    path, _ = llama_checkpoint
    prompts = [[5, 6, 7, 8, 9] * 8, [11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    warm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=2 << 20, warmup=True)
    assert warm.engine.warmup_s is not None and warm.engine.warmup_s > 0
    assert warm.engine.block_pool.num_used_blocks == 0 and warm.engine.block_pool.num_cached_blocks == 0
    reg, labels = warm.engine.prometheus.registry, {"model_name": warm.engine.model_name}
    assert not reg.get_sample_value("tailserve:generation_tokens_total", labels)  # absent or 0
    assert not reg.get_sample_value("tailserve:e2e_request_latency_seconds_count", labels)
    cold = LLM(str(path), dtype="float32", kv_cache_memory_bytes=2 << 20)
    want = [o.token_ids for o in cold.generate(prompts, params)]
    assert [o.token_ids for o in warm.generate(prompts, params)] == want


def test_the_warm_up_runs_prompt_steps_as_serving_does_including_the_first_burst():
    """Prompt shapes go through ``ModelRunner._forward`` with native products allowed (the
    path of a real prompt step; oneDNN builds a bf16 primitive per shape on first use), and the
    burst of 128-token prompts that fills a step is among them."""
    from tailserve import LLM

    llm = LLM(None, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=1024)
    runner, calls = llm.engine.core.worker.runner, []
    original = runner._forward
    runner._forward = lambda ids, pos, q, c, t, native: calls.append((tuple(q), native)) or original(
        ids, pos, q, c, t, native)
    llm.engine.warm_up()
    prompt_calls = [(q, native) for q, native in calls if max(q) > 1]
    assert ((128,) * 8, True) in prompt_calls  # 1,024 tokens: the step's budget
    assert all(native for _, native in prompt_calls)
    assert llm.engine.block_pool.num_used_blocks == 0 and llm.engine.block_pool.num_cached_blocks == 0


def _exact_attention(q, k, v, scale):  # one sequence's whole prompt, causal, float64: (T, H*D)
    t, h, d = q.shape
    rep = h // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vv).reshape(t, h * d)


def test_whole_prompts_of_different_lengths_attend_one_causal_call_each():
    from tailserve.attention.reference import build_attention_metadata, paged_attention

    # A decode and three whole prompts (5, 40, 9 tokens): padded into one group they would
    # need a 40 x 40 mask each (2.3x their work); so each prompt is its own causal group.
    qlens, ctxs = [1, 5, 40, 9], [7, 5, 40, 9]
    tables = [[0, 1], [2, 3], list(range(4, 14)), [14, 15, 16]]
    meta = build_attention_metadata(qlens, ctxs, tables, 4, None, torch.device("cpu"))
    assert [(g.num_seqs, g.causal, g.mask is None) for g in meta.groups] == \
        [(1, False, True), (1, True, True), (1, True, True), (1, True, True)]
    torch.manual_seed(0)
    t, h, kvh, d = sum(qlens), 4, 2, 16
    q, k, v = torch.randn(t, h, d), torch.randn(t, kvh, d), torch.randn(t, kvh, d)
    cache = torch.randn(2, 17, 4, kvh, d)
    out = paged_attention(q, k, v, cache, meta, d ** -0.5)
    start = 1
    for n in qlens[1:]:
        rows = slice(start, start + n)
        torch.testing.assert_close(out[rows].double(), _exact_attention(q[rows], k[rows], v[rows], d ** -0.5),
                                   rtol=1e-5, atol=1e-5)
        start += n
    # Lengths close enough that padding costs less than the work itself: one masked group.
    near = build_attention_metadata([30, 28, 26], [30, 28, 26], [list(range(8)), list(range(8, 15)),
                                                                  list(range(15, 22))], 4, None, torch.device("cpu"))
    assert len(near.groups) == 1 and near.groups[0].num_seqs == 3
    # A chunk after cached context stays in a masked group of its own beside the split prompts.
    chunk = build_attention_metadata([3, 30, 6], [3, 30, 20], [[0], list(range(1, 9)), list(range(9, 14))], 4, None,
                                     torch.device("cpu"))
    assert [(g.num_seqs, g.causal) for g in chunk.groups] == [(1, True), (1, True), (1, False)]
