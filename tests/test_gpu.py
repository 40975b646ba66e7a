"""CUDA runs of the CPU-verified paths (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tailserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_cuda_logits_match_transformers(tiny_checkpoint, kind):
    from tailserve.attention.reference import build_attention_metadata
    from tailserve.model.loader import load_model

    path, hf = tiny_checkpoint(kind)
    model, cfg = load_model(path, torch.float32, device="cuda")
    ids = list(range(2, 50))
    ref = hf(torch.tensor([ids])).logits[0]
    caches = [torch.zeros(2, 4, 16, cfg.num_kv_heads, cfg.head_dim, device="cuda") for _ in range(cfg.num_layers)]
    meta = build_attention_metadata([len(ids)], [len(ids)], [[0, 1, 2, 3]], 16, cfg.sliding_window,
                                    torch.device("cuda"))
    with torch.inference_mode():
        out = model.compute_logits(model(torch.tensor(ids, device="cuda"), torch.arange(len(ids), device="cuda"),
                                         caches, meta))
    assert (out.cpu() - ref).abs().max().item() <= 1e-3  # TF32/cuBLAS reductions differ from the CPU's


def test_cuda_greedy_generation_matches_cpu(llama_checkpoint):
    path, _ = llama_checkpoint
    prompts = [[5, 6, 7, 8], list(range(10, 60)), [3] * 20]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20).generate(prompts, params)
    gpu = LLM(str(path), dtype="float32", device="cuda", kv_cache_memory_bytes=4 << 20).generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


def test_cuda_speculative_greedy_matches(llama_checkpoint):
    path, _ = llama_checkpoint
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = LLM(str(path), dtype="float32", device="cuda", kv_cache_memory_bytes=4 << 20)
    spec = LLM(str(path), dtype="float32", device="cuda", kv_cache_memory_bytes=4 << 20,
               speculative_model=str(path), num_speculative_tokens=3)
    prompts = [[5, 6, 7, 8] * 3, list(range(10, 40))]
    want = [o.token_ids for o in base.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert spec.engine.spec_stats.acceptance_rate == 1.0
