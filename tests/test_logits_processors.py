"""Penalties and logit bias: the batched function against a per-row loop written from the
definitions, and the engine's greedy outputs against transformers with the same rules."""

from __future__ import annotations

import random

import pytest
import torch

from tailserve import LLM, SamplingParams
from tailserve.errors import InvalidRequestError
from tailserve.sample.logits_processors import apply_logits_processors


def _oracle(logits, params, prompt, output):
    x = logits.clone().float()
    if params.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    for t, b in params.logit_bias:
        x[t] += b
    return x


def test_batched_processors_equal_the_definitions():
    rng = random.Random(0)
    torch.manual_seed(0)
    v = 50
    params = [SamplingParams(), SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
              SamplingParams(repetition_penalty=1.8, logit_bias={3: 5.0, "7": -2.5}),
              SamplingParams(frequency_penalty=1.1, repetition_penalty=0.6, logit_bias={3: 1.0})]
    prompts = [[rng.randrange(v) for _ in range(rng.randrange(1, 9))] for _ in params]
    outputs = [[rng.randrange(v) for _ in range(rng.randrange(0, 12))] for _ in params]
    logits = torch.randn(6, v)
    rows = [0, 2, 3, 5]
    got = apply_logits_processors(logits, rows, params, prompts, outputs)
    for i, r in enumerate(rows):
        assert torch.allclose(got[r], _oracle(logits[r], params[i], prompts[i], outputs[i]), atol=1e-5)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[4], logits[4])
    plain = apply_logits_processors(logits, rows, [SamplingParams()] * 4, prompts, outputs)
    assert plain is logits  # nothing to do: no copy


@pytest.mark.parametrize("bad", [dict(presence_penalty=3), dict(repetition_penalty=0), dict(logit_bias={5: 101}),
                                 dict(logit_bias={"x": 1})])
def test_out_of_range_values_are_rejected(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def engine_and_hf(tiny_checkpoint):
    path, hf = tiny_checkpoint("llama")
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20), hf


def _hf_greedy(hf, prompt, n, params):
    ids = list(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            tok = int(_oracle(logits, params, prompt, out).argmax())
            out.append(tok)
            ids.append(tok)
    return out


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.7), dict(frequency_penalty=1.5, presence_penalty=0.5),
                                dict(repetition_penalty=1.3, frequency_penalty=0.8, logit_bias={11: 4.0})])
def test_engine_greedy_with_penalties_equals_the_reference(engine_and_hf, kw):
    llm, hf = engine_and_hf
    prompt = [5, 9, 9, 14, 5, 20, 9]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **kw)
    got = llm.generate([prompt], params)[0].token_ids
    assert got == _hf_greedy(hf, prompt, 12, params)
    assert got != llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids


def test_repetition_penalty_equals_transformers_generate(engine_and_hf):
    llm, hf = engine_and_hf
    prompt = [7, 8, 9, 7, 8, 9, 7]
    got = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                repetition_penalty=1.6))[0].token_ids
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, repetition_penalty=1.6,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == ref


def test_logit_bias_forces_and_forbids_tokens(engine_and_hf):
    llm, _ = engine_and_hf
    forced = llm.generate([[5, 6]], SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True,
                                                   logit_bias={42: 100.0}))[0].token_ids
    assert forced == [42] * 6
    free = llm.generate([[5, 6]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    banned = llm.generate([[5, 6]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                   logit_bias={free[0]: -100.0}))[0].token_ids
    assert free[0] not in banned


def test_penalised_requests_draw_no_drafts_and_stay_exact(tiny_checkpoint, noisy_draft):
    path, hf = tiny_checkpoint("llama")
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_model=str(noisy_draft),
              num_speculative_tokens=3)
    prompt = [5, 9, 9, 14, 5, 20, 9]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, frequency_penalty=1.2)
    assert llm.generate([prompt], params)[0].token_ids == _hf_greedy(hf, prompt, 10, params)
