"""Sampler and stop conditions through the real engine on a tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from tailserve import LLM, SamplingParams
from tailserve.sample.sampler import SamplingTensors, SamplingTensorsCache, filtered_probs


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    path, _ = llama_checkpoint
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=2 << 20)


PROMPT = [5, 17, 42, 99, 3]


def test_seeded_request_is_reproducible_whatever_shares_its_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 9)]
    batch = llm.generate([[7, 8, 9], PROMPT, [11] * 40, [1, 2]], [others[0], params, others[1], others[2]])
    assert batch[1].token_ids == alone
    different_seed = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=99, max_tokens=16,
                                                           ignore_eos=True))[0]
    assert different_seed.token_ids != alone


def test_top_k_1_is_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    topk1 = llm.generate([PROMPT], SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True))[0]
    assert topk1.token_ids == greedy.token_ids


def test_stop_token_ids_end_the_request(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop_at = greedy[4]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_at]))[0]
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_eos_from_generation_config_ends_the_request(llm, llama_checkpoint, tmp_path):
    import json
    import shutil

    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    eos = greedy[5]
    path, _ = llama_checkpoint
    shutil.copytree(path, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 1]}))
    other = LLM(str(tmp_path / "m"), dtype="float32", kv_cache_memory_bytes=1 << 20)
    assert other.engine.eos_token_ids == {eos, 1}
    out = other.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.token_ids == greedy[: greedy.index(eos) + 1] and out.finish_reason == "stop"
    ignored = other.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert ignored.token_ids == greedy


def test_stop_string_cuts_text(llm):
    full = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    text = full.text
    assert len(text) >= 4
    stop = text[2:4]
    out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                          stop=[stop]))[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    kept = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                           stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_logprobs_are_returned(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for tok, step in zip(out.token_ids, lps):
        assert tok in step and len(step) == 3  # greedy token is also the most likely
        assert max(step.values()) == step[tok] <= 0.0


def test_abort_frees_blocks_and_step_outputs_stream(llm):
    eng = llm.engine
    rid = eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    deltas = []
    for _ in range(5):
        for out in eng.step():
            deltas.extend(out.delta_token_ids)
    assert len(deltas) == 5 and eng.block_pool.num_used_blocks > 0
    eng.abort_request(rid)
    assert eng.block_pool.num_used_blocks == 0
    assert not eng.has_unfinished_requests()
    assert eng.step() == []


def test_filtered_probs_top_p_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    def probs(**kw):
        st = SamplingTensors.from_params([SamplingParams(**kw)], 4, torch.device("cpu"))
        return filtered_probs(logits, st)[0]
    assert torch.allclose(probs(top_p=0.8), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(probs(top_p=0.81), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    assert torch.allclose(probs(top_k=2), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(probs(min_p=0.5), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(probs(top_p=0.01), torch.tensor([1.0, 0, 0, 0]))


def test_sampling_follows_the_distribution():
    """Empirical frequencies of the inverse-CDF sampler match p (fixed seed, 4 sigma)."""
    from tailserve.sample.sampler import Sampler

    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = torch.log(p).expand(n, 4).contiguous()
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * n, 4, torch.device("cpu"))
    tokens = Sampler(4, torch.device("cpu"), seed=0).sample(logits, st, [None] * n)
    freq = torch.bincount(tokens, minlength=4).float() / n
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() < 4 * sigma).all()


def test_fast_argmax_equals_torch_argmax_including_ties():
    from tailserve.sample.sampler import fast_argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 32000, generator=g)
    x[3, 100] = x[3, 31999] = 50.0  # tie across chunks: the first one wins
    x[4, 5] = x[4, 6] = 60.0  # tie inside a chunk
    x[5] = 1.0  # all equal
    x[6, 7] = x[6, 9] = float("nan")  # a NaN counts as the largest, the first one wins
    x[7] = float("-inf")
    assert torch.equal(fast_argmax(x), x.argmax(-1))  # 288k elements: the chunked path
    assert torch.equal(fast_argmax(x[:, :1000]), x[:, :1000].argmax(-1))  # not a multiple of 128: fallback
    small = x[:, :4096].contiguous()  # NumPy's argmax (small float32 tensors in host memory)
    assert torch.equal(fast_argmax(small, host=True), small.argmax(-1))
    assert fast_argmax(small, host=True).dtype == torch.int64
    assert torch.equal(fast_argmax(small[2:3], host=True), small[2:3].argmax(-1))


def _sorted_reference(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """top-k then top-p by a full descending sort (the definition the partial topk must match)."""
    logits = logits.float() / st.temperature
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if st.top_k is not None:
        drop |= torch.arange(logits.shape[-1])[None, :] >= st.top_k[:, None]
    if st.top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        drop |= ((probs.cumsum(-1) - probs) >= st.top_p[:, None]) & (st.top_p < 1.0)[:, None]
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf"))).softmax(-1)


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 20.0])  # flat (nucleus past every topk width) to peaked
def test_top_k_top_p_from_partial_topk_equal_a_full_sort(scale):
    g = torch.Generator().manual_seed(int(scale * 100))
    v = 3000  # not a power of two: the last widening is the whole vocabulary
    params = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=1.0, top_k=300, top_p=0.9), SamplingParams(temperature=1.2, top_k=2000),
              SamplingParams(temperature=1.0, top_p=0.999), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=1, top_p=0.3)]
    st = SamplingTensors.from_params(params, v, torch.device("cpu"))
    logits = torch.randn(len(params), v, generator=g) * scale
    got, want = filtered_probs(logits, st), _sorted_reference(logits, st)
    assert torch.equal(got > 0, want > 0)  # the same survivors, row by row
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    if scale == 0.05:  # flat: the 0.95 nucleus holds most of the vocabulary, far past the first widths
        assert int((got[0] > 0).sum()) > 2000
    assert int((got[3] > 0).sum()) == 5 and int((got[8] > 0).sum()) == 1


def test_inverse_cdf_never_draws_a_token_of_probability_zero():
    from tailserve.sample.sampler import sample_from_probs

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    edges = torch.tensor([0.0, 0.5, 1.0 - 2 ** -53], dtype=torch.float64)
    for u in edges:
        tokens = sample_from_probs(probs, u.expand(3)).tolist()
        assert tokens[0] in (1, 3) and tokens[1] == 4 and tokens[2] == 0, (u, tokens)
    assert sample_from_probs(probs, torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)).tolist() == [1, 4, 0]


def test_repeated_rows_are_each_requests_row_counts_times():
    """repeat_rows gives verification's k + 1 rows per request: one request's row broadcast,
    several gathered; either way each field's rows are its request's, in order."""
    params = [SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=2)]
    for chosen, counts in (([0], [4]), ([0, 1, 2], [2, 1, 3]), ([2], [1])):
        sub = SamplingTensors.from_params([params[i] for i in chosen], 8, torch.device("cpu"))
        got = sub.repeat_rows(counts)
        rows = [params[i] for i, c in zip(chosen, counts) for _ in range(c)]
        want = SamplingTensors.from_params(rows, 8, torch.device("cpu"))
        for field in ("temperature", "top_k", "top_p", "min_p", "greedy"):
            g, w = getattr(got, field), getattr(want, field)
            assert (g is None and w is None) or torch.equal(g, w), (chosen, field)
        assert (got.all_greedy, got.any_greedy) == (want.all_greedy, want.any_greedy)
        logits = torch.randn(len(rows), 8, generator=torch.Generator().manual_seed(len(rows)))
        assert torch.equal(filtered_probs(logits, got), filtered_probs(logits, want))


def test_sampling_tensors_are_reused_only_for_the_same_parameter_objects():
    """A decode's requests keep their parameter objects step after step: the cache hands back
    the same tensors for the same objects in the same order, and builds anew for another
    object (even an equal one), another order or another count."""
    a, b = SamplingParams(temperature=0.5), SamplingParams(temperature=0.9, top_k=4)
    cache = SamplingTensorsCache(8, torch.device("cpu"))
    first = cache.get([a, b])
    assert cache.get([a, b]) is first
    assert cache.get([b, a]) is not first and torch.equal(cache.get([b, a]).temperature, first.temperature.flip(0))
    equal = SamplingParams(temperature=0.5)
    again = cache.get([equal])
    assert again is not first and cache.get([equal]) is again and cache.get([a]) is not again


def test_a_batch_of_greedy_and_sampled_rows_takes_argmax_only_for_the_greedy_ones():
    """Greedy rows take the argmax, sampled rows the inverse-CDF draw of their own uniform,
    whether the batch mixes them or holds sampled rows only (where no argmax is taken)."""
    from tailserve.sample.sampler import Sampler, row_uniforms, sample_from_probs

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5)) * 3
    logits[0] = 0.0
    logits[0, 7] = 1e-3  # a flat row: its argmax is 7, a draw from it almost never is
    for greedy_rows in ((True, False, False), (False, False, False)):
        params = [SamplingParams(temperature=0.0 if g else 0.9) for g in greedy_rows]
        sampler = Sampler(50, torch.device("cpu"), seed=11)
        st = SamplingTensors.from_params(params, 50, torch.device("cpu"))
        got = sampler.sample(logits, st, [None] * 3).tolist()
        gen = torch.Generator().manual_seed(11)
        want = sample_from_probs(filtered_probs(logits, st), row_uniforms(3, gen, torch.device("cpu"))).tolist()
        for row, g in enumerate(greedy_rows):
            assert got[row] == (int(logits[row].argmax()) if g else want[row])
