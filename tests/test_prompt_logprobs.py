"""Prompt log-probabilities (``SamplingParams(prompt_logprobs=k)``, and the server's echo +
logprobs): every prompt token's logprob equals transformers' log-softmax at the position
before it, over chunked prefill and with the prefix cache on."""

from __future__ import annotations

import pytest
import torch

from tailserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    path, hf = tiny_checkpoint("llama")
    torch.manual_seed(3)
    ids = torch.randint(3, hf.config.vocab_size, (70,)).tolist()
    with torch.inference_mode():
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return path, ids, lp


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_match_transformers(reference, chunk):
    path, ids, lp = reference
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=chunk,
              enable_prefix_caching=True)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    first = llm.generate([ids], params)[0]
    again = llm.generate([ids], params)[0]  # its blocks are cached now: the logprobs must not be skipped
    for out in (first, again):
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        for j in range(1, len(ids)):
            assert abs(plp[j][ids[j]] - lp[j - 1, ids[j]].item()) < 1e-4
            top = lp[j - 1].topk(3).indices.tolist()
            assert set(top) <= set(plp[j]) and len(plp[j]) <= 4
    assert again.num_cached_tokens == 0


def test_without_the_option_there_are_none(reference):
    path, ids, _ = reference
    out = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20).generate([ids], SamplingParams(max_tokens=1))
    assert out[0].prompt_logprobs is None
