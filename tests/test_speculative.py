"""Speculative decoding end to end: lossless greedy and sampled outputs, bookkeeping, metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import build_hf_model, save_checkpoint
from tailserve import LLM, SamplingParams
from test_rejection_sampler import chi2_pvalue

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts():
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(2, 300, (36,), generator=g).tolist()
    out = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (4, 23, 41)]
    out.append([5, 6, 7, 8, 9] * 6)  # repetitive: n-gram lookup finds matches
    out += [shared + torch.randint(2, 300, (n,), generator=g).tolist() for n in (3, 19)]
    return out


@pytest.fixture(scope="module")
def draft_checkpoint(noisy_draft):
    return noisy_draft


@pytest.fixture(scope="module")
def greedy_reference(llama_checkpoint):
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    return [o.token_ids for o in llm.generate(_prompts(), GREEDY)]


SPEC = {
    "draft_k3": lambda d: dict(speculative_model=d, num_speculative_tokens=3),
    "draft_adaptive": lambda d: dict(speculative_model=d),
    "ngram_k4": lambda d: dict(speculative_method="ngram", num_speculative_tokens=4, ngram_max=3),
    "hybrid_k3": lambda d: dict(speculative_model=d, speculative_method="hybrid", num_speculative_tokens=3,
                                ngram_min=2, ngram_max=3),
}
MODES = {
    "plain": dict(enable_prefix_caching=False),
    "chunked_prefix": dict(max_num_batched_tokens=16, enable_prefix_caching=True),
    # 14 blocks of 16 tokens (both caches' bytes): requests must be preempted.
    "preemption": dict(kv_cache_memory_bytes=14 * 16 * 2 * 2 * 2 * 16 * 4 * 2, admission_reserve_tokens=0),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("spec", sorted(SPEC))
def test_greedy_with_speculation_equals_without(llama_checkpoint, draft_checkpoint, greedy_reference, spec, mode):
    path, _ = llama_checkpoint
    kw = dict(dtype="float32", kv_cache_memory_bytes=4 << 20)
    kw.update(MODES[mode])
    kw.update(SPEC[spec](str(draft_checkpoint)))
    if mode == "preemption" and spec.startswith("ngram"):
        kw["kv_cache_memory_bytes"] //= 2  # no draft cache shares the budget
    llm = LLM(str(path), **kw)
    if spec == "draft_adaptive":
        # The start-up profile can rule speculation out for this tiny pair on the CPU: what is
        # tested here is identity under a k that varies, so the controller explores as without one.
        llm.engine.scheduler.speculation.cost_profile = None
    if mode == "chunked_prefix":
        llm.generate([_prompts()[4]], GREEDY)  # warm the prefix cache
    outs = llm.generate(_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == greedy_reference
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    if mode == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_pool.num_used_blocks == 0
    assert sum(o.metrics.spec_num_draft_tokens for o in outs) <= stats.num_draft_tokens
    if spec.startswith("hybrid"):  # both kinds of drafts were used
        assert llm.engine.proposer.num_lookup_drafts > 0 and llm.engine.proposer.num_model_drafts > 0


def test_prefix_hit_reuses_only_blocks_the_draft_filled(llama_checkpoint, draft_checkpoint):
    path, _ = llama_checkpoint
    prompt = _prompts()[2]  # 41 tokens: 2 full blocks of 16
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_model=str(draft_checkpoint),
              num_speculative_tokens=3)
    llm.generate([prompt], GREEDY)
    eng = llm.engine
    blocks = eng.block_pool.blocks
    assert sum(b.draft_filled for b in blocks) >= 2
    # Same prompt again: the two full prompt blocks are hits and the draft skips them too.
    eng.add_request(prompt, GREEDY)
    new = eng.scheduler.schedule(0).new_requests[0]  # what the worker is told at admission
    assert new.num_computed_tokens == 32 and new.num_draft_computed_tokens == 32
    # A hit block whose draft K/V was never written (flag cleared) stops the draft's reuse there.
    eng2 = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_model=str(draft_checkpoint),
               num_speculative_tokens=3).engine
    eng2.add_request(prompt, GREEDY)
    while eng2.has_unfinished_requests():
        eng2.step()
    for b in eng2.block_pool.blocks:
        if b.block_hash is not None and b.token_ids == tuple(prompt[16:32]):
            b.draft_filled = False
    eng2.add_request(prompt, GREEDY)
    new = eng2.scheduler.schedule(0).new_requests[0]
    assert new.num_computed_tokens == 32 and new.num_draft_computed_tokens == 16


@pytest.mark.parametrize("margin", [0.0, 0.999])
def test_draft_chain_stops_after_an_unsure_draft(llama_checkpoint, draft_checkpoint, greedy_reference, margin):
    """Margin 0: every round drafts its k = 4. Margin 0.999 (above every top-1 minus top-2
    gap of the small random draft): each chain stops after its first draft. Outputs stay
    the target's either way."""
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_model=str(draft_checkpoint),
              num_speculative_tokens=4, speculative_draft_stop_margin=margin)
    assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == greedy_reference
    s = llm.engine.spec_stats
    if margin == 0.0:
        # Only rounds near max_tokens are shorter than k.
        assert s.num_draft_tokens > 3.5 * s.num_drafts
    else:
        assert s.num_draft_tokens == s.num_drafts > 0


def test_target_as_its_own_draft_accepts_everything(llama_checkpoint):
    path, _ = llama_checkpoint
    k = 4
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_model=str(path),
              num_speculative_tokens=k)
    # 1 token from the prefill, then rounds of exactly k+1 tokens.
    outs = llm.generate(_prompts()[:3], SamplingParams(temperature=0, max_tokens=1 + 6 * (k + 1), ignore_eos=True))
    s = llm.engine.spec_stats
    assert s.acceptance_rate == 1.0
    assert s.mean_acceptance_length == k + 1
    for o in outs:
        assert o.metrics.spec_acceptance_rate == 1.0 and o.metrics.spec_mean_acceptance_length == k + 1
    text = llm.engine.prometheus.exposition().decode()
    line = f'tailserve:spec_decode_num_accepted_tokens_total{{model_name="{path.name}"}} {float(s.num_accepted_tokens)}'
    assert line in text


SEEDED_SPEC = {
    "off": {},
    "draft_k3": dict(num_speculative_tokens=3),
    "draft_adaptive_block": dict(speculative_verification="block"),
    "hybrid_k4": dict(speculative_method="hybrid", num_speculative_tokens=4, ngram_min=1),
}


def test_seeded_sampling_gives_the_same_tokens_with_speculation_on_or_off(llama_checkpoint, draft_checkpoint):
    """A seeded request's tokens are its races' winners (sample/sampler.py): the same with
    speculation off, a fixed k, adaptive k with block verification, or hybrid lookups, and
    whatever unseeded requests share its batch."""
    path, _ = llama_checkpoint
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=5 + i, max_tokens=15, ignore_eos=True) for i in range(3)]
    prompts = [[5, 6, 7], [5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43]]
    others = [[9, 9, 9], [1, 2, 3, 4]]
    runs = {}
    for name, spec in SEEDED_SPEC.items():
        extra = dict(speculative_model=str(draft_checkpoint), **spec) if spec else {}
        llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, **extra)
        if spec and "num_speculative_tokens" not in spec:
            llm.engine.scheduler.speculation.cost_profile = None  # explore, as test_greedy_with_speculation...
        mates = [SamplingParams(temperature=1.0, max_tokens=9)] * len(others) if name != "off" else []
        outs = llm.generate(prompts + (others if name != "off" else []), seeded + mates)
        runs[name] = [o.token_ids for o in outs[: len(prompts)]]
        if name != "off":
            assert llm.engine.spec_stats.num_accepted_tokens > 0  # drafts really were verified
    assert len({str(r) for r in runs.values()}) == 1, runs


def _tiny_vocab_model(tmp_path, name, seed):
    hf = build_hf_model("llama", seed=seed, vocab_size=8, hidden_size=32, intermediate_size=64)
    with torch.no_grad():  # sharper but not degenerate distributions
        hf.lm_head.weight.mul_(0.5)
    return save_checkpoint(hf, tmp_path / name), hf


def exact_first_three(target, prompt: list[int], params: SamplingParams, mask=None) -> torch.Tensor:
    """(8, 8, 8) float64: the probability of each first three tokens under the tiny-vocabulary
    target with ``params``' filters, exactly from its logits; ``mask(position)`` -> (8,) additive
    logit mask (a grammar's), if given."""
    from tailserve.sample.sampler import SamplingTensors, filtered_probs

    st = SamplingTensors.from_params([params], 8, torch.device("cpu"))

    def probs(prefix):
        with torch.inference_mode():
            logits = target(torch.tensor([prompt + prefix])).logits[0, -1:].float()
        if mask is not None:
            logits = logits + mask(len(prefix))
        return filtered_probs(logits, st)[0].double()

    p0 = probs([])
    exact = torch.zeros(8, 8, 8, dtype=torch.float64)
    for a in range(8):
        if p0[a] == 0:
            continue
        p1 = probs([a])
        for b in range(8):
            if p1[b] > 0:
                exact[a, b] = p0[a] * p1[b] * probs([a, b])
    return exact


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "hybrid", "block", "seeded"])
def test_sampled_tokens_match_exact_target_distribution(tmp_path, method):
    """Temperature 1, top_p 0.9: the first three generated tokens (the second and third come
    from draft proposals verified by rejection sampling) follow the target's own
    probabilities, computed exactly from its logits. Draft chains stop early on unsure
    drafts. Hybrid: n-gram (one-hot q) and model drafts mixed in the same batches. Block:
    block verification. Seeded: every request with its own seed (verified by the race)."""
    target_path, target = _tiny_vocab_model(tmp_path, "target", seed=0)
    draft_path, _ = _tiny_vocab_model(tmp_path, "draft", seed=1)
    prompt = [3, 1, 4]
    # A fourth token (not counted) leaves room for two drafts in the first round.
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, ignore_eos=True)
    exact = exact_first_three(target, prompt, params)

    llm = LLM(str(target_path), dtype="float32", kv_cache_memory_bytes=64 << 20, max_num_seqs=512,
              max_num_batched_tokens=4096, speculative_model=str(draft_path), num_speculative_tokens=2, seed=123,
              enable_prefix_caching=False, speculative_method="hybrid" if method == "hybrid" else "draft_model",
              ngram_min=1, speculative_verification="block" if method == "block" else "token",
              speculative_draft_stop_margin=0.02,  # the tiny draft's margins are a few hundredths
              suffix_cache_max_requests=256,  # hybrid's suffix source: 8 token ids make every list long
              enable_metrics=False)  # Prometheus recording is a fifth of these 4-token requests' time
    n = 16_000 if method == "draft_model" else 12_000  # the suite's time: fewer for the variants
    counts = torch.zeros(512, dtype=torch.float64)
    for r in range(n // 2000):
        batch = [dataclasses.replace(params, seed=r * 2000 + i) for i in range(2000)] if method == "seeded" \
            else params
        for out in llm.generate([prompt] * 2000, batch):
            a, b, c = out.token_ids[:3]
            counts[a * 64 + b * 8 + c] += 1
    spec = llm.engine.spec_stats
    # Some model rounds stopped after one draft (margin < 0.02), others drafted both: the
    # early stop decides from q alone, so the output must still be exactly the target's.
    assert 0 < spec.drafted_per_position[1] < spec.drafted_per_position[0]
    assert 0 < spec.acceptance_rate < 1
    if method == "hybrid":
        assert llm.engine.proposer.num_lookup_drafts > 0 and llm.engine.proposer.num_model_drafts > 0
    assert chi2_pvalue(counts, exact.reshape(-1)) > 1e-3


def test_stop_conditions_inside_an_accepted_run(llama_checkpoint):
    """A stop token (or stop string) in the middle of k accepted drafts ends the output there."""
    path, _ = llama_checkpoint
    base = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    spec = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_model=str(path),
               num_speculative_tokens=5)
    prompt = [7, 8, 9, 10]
    full = base.generate([prompt], GREEDY)[0]
    stop_tok = full.token_ids[6]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop_tok])
    want, got = base.generate([prompt], params)[0], spec.generate([prompt], params)[0]
    assert got.token_ids == want.token_ids and got.token_ids[-1] == stop_tok and got.finish_reason == "stop"
    text_params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=[full.text[5:7]])
    want, got = base.generate([prompt], text_params)[0], spec.generate([prompt], text_params)[0]
    assert got.text == want.text and got.finish_reason == "stop"
    assert spec.engine.block_pool.num_used_blocks == 0


def test_draft_runs_in_its_own_dtype(llama_checkpoint, draft_checkpoint):
    """The draft may run in another dtype than the target (its K/V cache too); greedy output
    is still exactly the bf16 target's. On the CPU "auto" means float32 with the NumPy
    chain step; a bf16 draft runs in PyTorch only."""
    path, _ = llama_checkpoint
    kw = dict(dtype="bfloat16", kv_cache_memory_bytes=4 << 20)
    ref = [o.token_ids for o in LLM(str(path), **kw).generate(_prompts(), GREEDY)]
    for draft_dtype, expect in (("auto", torch.float32), ("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        llm = LLM(str(path), speculative_model=str(draft_checkpoint), num_speculative_tokens=3,
                  speculative_draft_dtype=draft_dtype, **kw)
        prop = llm.engine.proposer
        assert prop.model.embed_tokens.dtype == expect and prop.kv_caches[0].dtype == expect
        assert (prop.numpy_step is not None) == (expect == torch.float32)
        assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == ref
        assert llm.engine.spec_stats.num_accepted_tokens > 0
        # The last request alone in the batch drafts through the NumPy step.
        assert (prop.num_numpy_forwards > 0) == (expect == torch.float32)


def test_an_int8_draft_drafts_and_greedy_output_is_the_targets(llama_checkpoint, draft_checkpoint):
    """--speculative-draft-quantization int8: the draft's projections are int8 (its plan says so)
    and it still drafts what gets accepted, while greedy output stays the target's."""
    from tailserve.model.linear import Int8WeightOnlyLinearMethod

    path, _ = llama_checkpoint
    kw = dict(dtype="float32", kv_cache_memory_bytes=4 << 20)
    ref = [o.token_ids for o in LLM(str(path), **kw).generate(_prompts(), GREEDY)]
    llm = LLM(str(path), speculative_model=str(draft_checkpoint), num_speculative_tokens=3,
              speculative_draft_quantization="int8", **kw)
    assert isinstance(llm.engine.proposer.model.layers[0].self_attn.qkv_proj.method, Int8WeightOnlyLinearMethod)
    assert llm.engine.health()["plan"]["draft"]["linear"].startswith("int8-weight-only")
    from tailserve.kernels.cpu import PanelPackedInt8Weight, kernels

    if kernels() is not None:  # small batches, the fused layers and the head through int8 panels
        draft = llm.engine.proposer.model
        assert isinstance(draft.layers[0].self_attn.qkv_proj.qpanels, PanelPackedInt8Weight)
        assert draft.fused_decode is not None and isinstance(draft.fused_decode.head[1], PanelPackedInt8Weight)
    assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == ref
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_a_w8a8_draft_drafts_and_greedy_output_is_the_targets(llama_checkpoint, draft_checkpoint):
    """--speculative-draft-quantization w8a8_int8: int8 weights and per-row int8 activations
    in the draft's every product (its layers, fused, and its head), the plan says so, and
    greedy output stays the target's while drafts get accepted. Refused without the kernels."""
    from tailserve.errors import ConfigError
    from tailserve.kernels.cpu import PanelPackedW8A8Weight, kernels
    from tailserve.model.linear import Int8DynamicActivationLinearMethod

    path, _ = llama_checkpoint
    kw = dict(dtype="float32", kv_cache_memory_bytes=4 << 20)
    spec = dict(speculative_model=str(draft_checkpoint), num_speculative_tokens=3,
                speculative_draft_quantization="w8a8_int8")
    if kernels() is None:
        with pytest.raises(ConfigError, match="compiled CPU kernels"):
            LLM(str(path), **spec, **kw)
        return
    ref = [o.token_ids for o in LLM(str(path), **kw).generate(_prompts(), GREEDY)]
    llm = LLM(str(path), **spec, **kw)
    draft = llm.engine.proposer.model
    assert isinstance(draft.layers[0].self_attn.qkv_proj.method, Int8DynamicActivationLinearMethod)
    assert isinstance(draft.layers[0].mlp.down_proj.qweight, PanelPackedW8A8Weight)
    assert llm.engine.health()["plan"]["draft"]["linear"].startswith("int8-w8a8")
    assert draft.fused_decode is not None and isinstance(draft.fused_decode.head[1], PanelPackedW8A8Weight)
    assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == ref
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    with pytest.raises(ConfigError, match="needs device cpu"):
        LLM(str(path), device="cuda", **spec, **kw)


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "llama_biases", "qwen2", "qwen3", "llama_rope_llama3"])
def test_numpy_draft_step_matches_pytorch(llama_checkpoint, tmp_path, kind):
    """The NumPy chain step (one sequence) gives the PyTorch path's logits and writes the same
    K/V: single tokens and two-token catch-ups, GQA, biases, q/k norms, tied heads, scaled
    rotary tables."""
    from tailserve.speculative.proposer import ProposalInput

    path, _ = llama_checkpoint
    draft = save_checkpoint(build_hf_model(kind, seed=4), tmp_path / kind)
    kw = dict(dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_model=str(draft), num_speculative_tokens=4)
    fast, slow = LLM(str(path), **kw), LLM(str(path), speculative_draft_numpy=False, **kw)
    assert fast.engine.proposer.numpy_step is not None and slow.engine.proposer.numpy_step is None
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(3, 200, (37,), generator=g).tolist()
    table = [3, 0, 5]
    got = {}
    for name, llm in (("numpy", fast), ("torch", slow)):
        prop = llm.engine.proposer
        prop._forward([seq], [0], [table], [False])  # fill the draft's cache (PyTorch, general path)
        inp = [ProposalInput("r", seq, len(seq), len(seq), table, 4, GREEDY, None)]
        chain = prop._chain_slots(inp)
        got[name] = [prop._chain_forward(inp, chain, 0, seq[-2:], 2),  # catch-up of two tokens
                     prop._chain_forward(inp, chain, 1, [17]),  # then drafts 1 and 2
                     prop._chain_forward(inp, chain, 2, [29]),
                     prop.kv_caches[0].clone()]
    assert fast.engine.proposer.num_numpy_forwards == 3 and slow.engine.proposer.num_numpy_forwards == 0
    for a, b in zip(got["numpy"], got["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 8])
def test_draft_chain_fast_path_matches_the_general_forward(llama_checkpoint, draft_checkpoint, tmp_path, window):
    """The draft chain's steps (single tokens, and catch-ups of two tokens per row) use
    per-round slot tables (decode_metadata); their logits must equal the general metadata
    path's, with ragged contexts in one batch.
    A sliding-window draft (window 8, shorter than the contexts) takes the general path."""
    from tailserve.speculative.proposer import ProposalInput

    path, _ = llama_checkpoint
    draft = draft_checkpoint
    if window is not None:
        draft = save_checkpoint(build_hf_model("mistral", seed=5, sliding_window=window), tmp_path / "swa_draft")
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_model=str(draft),
              num_speculative_tokens=4)
    assert llm.engine.proposer.arch.sliding_window == window
    prop = llm.engine.proposer
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (21, 40, 7)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    prop._forward(seqs, [0, 0, 0], tables, [False] * 3)  # fill the draft's cache
    inputs = [ProposalInput(f"r{j}", s, len(s), len(s), t, 4, GREEDY, None)
              for j, (s, t) in enumerate(zip(seqs, tables))]
    chain = prop._chain_slots(inputs)
    fast = prop._chain_forward(inputs, chain, 1, [11, 12, 13])
    ref = prop._forward([[11 + j] for j in range(3)], [len(s) for s in seqs], tables, [True] * 3)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    # A subset of the rows (one request stopped drafting), second step of the chain.
    fast = prop._chain_forward(inputs[1:], chain, 2, [5, 5])
    ref = prop._forward([[5], [5]], [len(s) + 1 for s in seqs[1:]], tables[1:], [True, True])
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    # Step 0: the catch-up of each sequence's last token (its K/V rewritten with the same values).
    fast = prop._chain_forward(inputs, chain, 0, [s[-1] for s in seqs])
    ref = prop._forward([[s[-1]] for s in seqs], [len(s) - 1 for s in seqs], tables, [True] * 3)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    # Step 0 with two tokens per row (the catch-up after a fully accepted round): causal
    # within each row's pair; logits of each row's last token.
    fast = prop._chain_forward(inputs, chain, 0, [t for s in seqs for t in s[-2:]], 2)
    ref = prop._forward([s[-2:] for s in seqs], [len(s) - 2 for s in seqs], tables, [True] * 3)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    # ... and for one row alone (its slots are a slice of the table, not a gather).
    fast = prop._chain_forward(inputs[1:2], chain, 0, seqs[1][-2:], 2)
    ref = prop._forward([seqs[1][-2:]], [len(seqs[1]) - 2], tables[1:2], [True])
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_large_draft_stays_in_pytorch_by_default(llama_checkpoint, draft_checkpoint, monkeypatch):
    """Past NUMPY_DRAFT_MAX_PARAMETERS the NumPy step is not used unless asked for, and the
    draft keeps the target's dtype."""
    import tailserve.engine.plan as engine_mod

    path, _ = llama_checkpoint
    kw = dict(dtype="bfloat16", kv_cache_memory_bytes=4 << 20, speculative_model=str(draft_checkpoint))
    monkeypatch.setattr(engine_mod, "NUMPY_DRAFT_MAX_PARAMETERS", 1000)
    prop = LLM(str(path), **kw).engine.proposer
    assert prop.numpy_step is None and prop.model.embed_tokens.dtype == torch.bfloat16
    prop = LLM(str(path), speculative_draft_numpy=True, **kw).engine.proposer
    assert prop.numpy_step is not None and prop.model.embed_tokens.dtype == torch.float32


def test_draft_chain_through_the_cpu_decode_kernel_matches_the_reference(llama_checkpoint, draft_checkpoint):
    """On the CPU with the compiled kernels, a float32 draft's batched chain steps go through
    the paged decode kernel (``attention_backend`` auto); their logits equal the reference
    metadata's (``attention_backend`` torch), ragged contexts and two-token catch-ups
    included, and the catch-up of a row that needs one token fed two (the engine's ragged
    round: the extra token's K/V is rewritten with the same values)."""
    from tailserve.attention.cpu_decode import CpuDecodeBackend
    from tailserve.kernels.cpu import kernels
    from tailserve.speculative.proposer import ProposalInput

    if kernels() is None:
        pytest.skip("no compiled CPU kernels")
    path, _ = llama_checkpoint
    kw = dict(dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_model=str(draft_checkpoint),
              num_speculative_tokens=4, speculative_draft_numpy=False)
    fast, ref = LLM(str(path), **kw), LLM(str(path), attention_backend="torch", **kw)
    assert isinstance(fast.engine.proposer.attn_backend, CpuDecodeBackend) and ref.engine.proposer.attn_backend is None
    g = torch.Generator().manual_seed(9)
    seqs = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (21, 40, 7)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    got = {}
    for name, llm in (("fast", fast), ("ref", ref)):
        prop = llm.engine.proposer
        prop._forward(seqs, [0, 0, 0], tables, [False] * 3)
        inputs = [ProposalInput(f"r{j}", s, len(s), len(s), t, 4, GREEDY, None)
                  for j, (s, t) in enumerate(zip(seqs, tables))]
        chain = prop._chain_slots(inputs)
        got[name] = [prop._chain_forward(inputs, chain, 0, [t for s in seqs for t in s[-2:]], 2),
                     prop._chain_forward(inputs, chain, 1, [11, 12, 13]),
                     prop._chain_forward(inputs[1:], chain, 2, [5, 5]),
                     prop._chain_forward(inputs[:1], chain, 3, [7]),  # one row: the kernel too, not a step
                     prop.kv_caches[0].clone()]
    for a, b in zip(got["fast"], got["ref"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_builtin_bf16_draft_runs_through_the_kernels_and_stays_exact(llm_builtin_spec, engine_cache):
    """The built-in pair (bf16 checkpoints) on the CPU: the draft runs in float32 through the
    compiled kernels, not in NumPy, over int8 weights and activations by default (over its
    compact bf16 weights with --speculative-draft-quantization none); greedy output equals the
    target's alone at batch 1 and 4 either way, and sampled output keeps a seeded request's
    tokens whatever shares its batch."""
    from tailserve.kernels.cpu import kernels
    from tailserve.model.linear import CpuCompactWeightsLinearMethod, Int8DynamicActivationLinearMethod

    if kernels() is None:
        pytest.skip("no compiled CPU kernels")
    spec = llm_builtin_spec
    prop = spec.engine.proposer
    assert prop.numpy_step is None and prop.model.embed_tokens.dtype == torch.float32
    assert isinstance(spec.engine.core.worker.draft_linear_method, Int8DynamicActivationLinearMethod)
    base = engine_cache()
    prompts = ["def add(a, b):", "class Stack:\n", "import os\n", "for i in range("]
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for batch in (prompts[:1], prompts):
        assert [o.outputs[0].token_ids for o in spec.generate(batch, p)] == \
            [o.outputs[0].token_ids for o in base.generate(batch, p)]
    assert spec.engine.spec_stats.num_accepted_tokens > 0
    # The draft's own compact weights, asked for, on any CPU: the same greedy output.
    own = engine_cache(speculative_model="builtin", num_speculative_tokens=3, speculative_draft_quantization="none")
    assert isinstance(own.engine.core.worker.draft_linear_method, CpuCompactWeightsLinearMethod)
    assert [o.outputs[0].token_ids for o in own.generate(prompts, p)] == \
        [o.outputs[0].token_ids for o in base.generate(prompts, p)]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=11, ignore_eos=True)
    alone = spec.generate(prompts[:1], seeded)[0].outputs[0].token_ids
    mixed = spec.generate(prompts, [seeded] + [SamplingParams(temperature=1.0, max_tokens=30)] * 3)
    assert mixed[0].outputs[0].token_ids == alone


@pytest.mark.parametrize("query_len", [1, 2])
def test_a_draft_forward_in_one_compiled_call_is_bitwise_the_layer_by_layer_forward(llm_builtin_spec, query_len):
    """The built-in draft's chain steps run the whole model in one compiled call (embedding,
    fused layers, final norm of each sequence's last row, LM head): its logits and the K/V it
    writes are bitwise those of the model's forward and compute_logits, for decode rows and
    for a catch-up's two rows per sequence."""
    from tailserve.kernels.cpu import kernels
    from tailserve.memory.kv_cache import allocate_kv_caches

    if kernels() is None:
        pytest.skip("no compiled CPU kernels")
    prop = llm_builtin_spec.engine.proposer
    model, fused = prop.model, prop.model.fused_decode
    assert fused is not None and fused.head is not None  # the LM head's product too
    g = torch.Generator().manual_seed(query_len)
    bs = prop.block_size
    caches = allocate_kv_caches(prop.arch, 12, bs, prop.kv_caches[0].dtype, torch.device("cpu"))
    for c in caches:  # a context already there (own caches: the shared engine's stay as they are)
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    ctxs = [20, 9, 33]
    tables = [[0, 1], [2], [3, 4, 5]]
    tokens = torch.randint(0, prop.arch.vocab_size, (len(ctxs) * query_len,), generator=g).tolist()
    positions = torch.tensor([c - query_len + j for c in ctxs for j in range(query_len)])
    cos, sin = (t.contiguous() for t in model.rotary.lookup(positions))
    ours, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    hidden, logits = fused.run(torch.tensor(tokens), (cos, sin), ours,
                               prop.attn_backend.build([query_len] * 3, ctxs, tables), query_len, head=True)
    model.fused_decode = None  # the model's layer-by-layer forward, for the reference
    try:
        want_hidden = model.forward(torch.tensor(tokens), None, theirs,
                                    prop.attn_backend.build([query_len] * 3, ctxs, tables), rope=(cos, sin))
    finally:
        model.fused_decode = fused
    want_hidden = want_hidden[query_len - 1 :: query_len]
    assert torch.equal(hidden, want_hidden)
    assert torch.equal(logits, model.compute_logits(want_hidden, upcast=False))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    with pytest.raises(IndexError, match="outside the vocabulary"):  # as the embedding's lookup refuses it
        fused.run(torch.tensor([prop.arch.vocab_size] * len(tokens)), (cos, sin), ours,
                  prop.attn_backend.build([query_len] * 3, ctxs, tables), query_len)


def test_the_step_log_says_where_a_speculative_step_went(llm_builtin_spec):
    """Each step of the log carries the worker's stamps (the target's forward, the proposal)
    and the tokens it emitted: what bench_spec_limit.py splits a speculative step into. A
    step verifying drafts emits from one token a request to all it verified, and over a
    generate the log's tokens are the outputs' tokens."""
    llm = llm_builtin_spec
    log = llm.engine.step_log
    before = log[-1].step if log else -1
    outs = llm.generate(["def add(a, b):", "import os\n"], SamplingParams(temperature=0, max_tokens=24,
                                                                          ignore_eos=True))
    steps = [s for s in log if s.step > before]
    assert sum(s.num_output_tokens for s in steps) == sum(len(o.outputs[0].token_ids) for o in outs)
    assert all(s.target_forward_s > 0 and s.target_forward_s + s.propose_s <= s.duration_s for s in steps)
    verify = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > s.num_requests]
    assert verify and all(s.num_requests <= s.num_output_tokens <= s.num_decode_tokens for s in verify)
    assert max(s.num_output_tokens - s.num_requests for s in verify) > 0  # some drafts accepted
    assert sum(s.propose_s > 0 for s in steps) >= len(verify) - 1  # each round was proposed by a step


def test_goodput_overrides_reach_prometheus_as_a_counter(llm_builtin_spec):
    """The controller's count of goodput overrides (here set by hand: the shared engine runs
    the throughput objective) is exported after each step as a counter that only adds what
    is new."""
    llm = llm_builtin_spec
    ctl = llm.engine.core.scheduler.speculation
    name = f'tailserve:spec_decode_goodput_overrides_total{{model_name="{llm.engine.model_name}"}}'
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    before = ctl.num_goodput_overrides
    try:
        ctl.num_goodput_overrides = before + 5
        llm.generate(["def f(x):"], p)
        assert f"{name} {float(before + 5)}" in llm.engine.prometheus.exposition().decode()
        ctl.num_goodput_overrides = before + 7
        llm.generate(["def f(x):"], p)
        assert f"{name} {float(before + 7)}" in llm.engine.prometheus.exposition().decode()
    finally:
        ctl.num_goodput_overrides = before


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_ragged_catch_up_leaves_the_cached_values_it_repeats(llama_checkpoint, draft_checkpoint, backend):
    """Rows of one catch-up needing one and two tokens run as one chain forward of two; the
    row that needs one is fed its previous token too, whose K/V writes go to the scratch
    slot: the cache at that position keeps its values bitwise, and the row's logits are
    those of a catch-up of its one token alone."""
    from tailserve.speculative.proposer import ProposalInput

    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_model=str(draft_checkpoint),
              num_speculative_tokens=4, speculative_draft_numpy=False, attention_backend=backend)
    prop = llm.engine.proposer
    assert prop.scratch_slot == llm.engine.core.worker.num_blocks * 16
    g = torch.Generator().manual_seed(12)
    seqs = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (21, 40)]
    tables = [[0, 1], [2, 3, 4]]
    prop._forward(seqs, [0, 0], tables, [False, False])
    for layer in prop.kv_caches:  # the values first computed for row 0's second-to-last token: marked
        layer[:, 1, 3] += 1.0  # position 19: block 1 (of table [0, 1]), offset 3
    before = [c.clone() for c in prop.kv_caches]
    inputs = [ProposalInput("a", seqs[0], len(seqs[0]) - 1, len(seqs[0]), tables[0], 4, GREEDY, None),
              ProposalInput("b", seqs[1], len(seqs[1]) - 2, len(seqs[1]), tables[1], 4, GREEDY, None)]
    chain = prop._chain_slots(inputs)
    logits = prop._chain_forward(inputs, chain, 0, [t for s in seqs for t in s[-2:]], 2, pad=[1, 0])
    for a, b in zip(prop.kv_caches, before):
        assert torch.equal(a[:, 1, 3], b[:, 1, 3])  # row 0's padded position 19: untouched
    # Its real catch-up token (position 20) was written: past the first layer its K/V see the
    # marked values at 19.
    assert not torch.equal(prop.kv_caches[-1][:, 1, 4], before[-1][:, 1, 4])
    alone = prop._forward([seqs[0][-1:]], [len(seqs[0]) - 1], tables[:1], [True])
    torch.testing.assert_close(logits[:1], alone, rtol=1e-5, atol=1e-5)


def test_synthetic_acceptance_is_refused_outside_benchmarks_and_labelled(monkeypatch, llama_checkpoint):
    from tailserve.config import EngineConfig
    from tailserve.errors import ConfigError

    monkeypatch.delenv("TAILSERVE_BENCHMARK", raising=False)
    with pytest.raises(ConfigError, match="benchmarks only"):
        EngineConfig(model="builtin", speculative_method="ngram", speculative_synthetic_acceptance=0.5)
    monkeypatch.setenv("TAILSERVE_BENCHMARK", "1")
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_model=str(path),
              num_speculative_tokens=4, speculative_synthetic_acceptance=0.5, seed=0)
    llm.generate([[5, 6, 7]] * 8, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    stats = llm.stats()["speculative"]
    # Accepted per round: 0.5 + 0.25 + 0.125 + 0.0625 of 4 drafts = 0.23, whatever the target says
    # (the draft is the target itself here: real acceptance would be 1).
    assert stats["synthetic_acceptance"] == 0.5 and abs(stats["acceptance_rate"] - 0.234) < 0.06
    assert llm.engine.health()["synthetic_acceptance"] == 0.5


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_objective="goodput"), "needs slo"),
    (dict(slo="p99_tpot_ms<=40"), "set that objective too"),
    (dict(speculative_objective="latency"), "throughput or goodput"),
    (dict(speculative_objective="goodput", slo="p99_tpot_ms<=40", num_speculative_tokens=3), "no num_speculative"),
    (dict(speculative_objective="goodput", slo="p50_tpot_ms<=40"), "KEY<=MS"),
    (dict(speculative_objective="goodput", slo="p99_tpot_ms=40"), "KEY<=MS"),
    (dict(speculative_objective="goodput", slo="p99_tpot_ms<=-1"), "positive"),
    (dict(speculative_objective="goodput", slo="p99_tpot_ms<=fast"), "number of milliseconds"),
    (dict(speculative_objective="goodput", slo="p99_tpot_ms<=4,p99_tpot_ms<=5"), "twice"),
])
def test_bad_goodput_settings_are_refused(kwargs, message):
    from tailserve.config import EngineConfig
    from tailserve.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        EngineConfig(model="builtin", speculative_method="ngram", **kwargs)


def test_slo_bounds_parse_in_milliseconds():
    from tailserve.config import SloBounds, parse_slo

    assert parse_slo("p99_tpot_ms<=40, p99_ttft_ms<=500") == SloBounds(tpot_s=0.04, ttft_s=0.5)
    assert parse_slo("p99_ttft_ms<=250") == SloBounds(ttft_s=0.25)


def test_the_goodput_objective_decodes_the_targets_tokens(llama_checkpoint):
    """Whatever k the objective picks, greedy output stays the target's; the stats name the
    objective and its bounds."""
    path, _ = llama_checkpoint
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20).generate(prompts, params)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, speculative_method="ngram",
              speculative_objective="goodput", slo="p99_tpot_ms<=1,p99_ttft_ms<=1")
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    stats = llm.stats()["speculative"]
    assert stats["objective"] == "goodput" and stats["slo"] == "p99_tpot_ms<=1,p99_ttft_ms<=1"
    assert llm.engine.scheduler.speculation.slo.ttft_s == 0.001


def test_adaptive_speculation_starts_with_a_profile_of_verification(llama_checkpoint, draft_checkpoint):
    """The worker profiles verification once for the adaptive controller: the target at
    batch sizes 1, 2, 4 (max_num_seqs 4) up to the largest k their rows allow, and the draft
    model's round at each k > 0 and its catch-up over a context; drafts by lookup cost
    nothing; a fixed k takes no profile."""
    path, _ = llama_checkpoint
    kw = dict(dtype="float32", kv_cache_memory_bytes=4 << 20, max_num_seqs=4)
    llm = LLM(str(path), speculative_model=str(draft_checkpoint), speculative_max_tokens=3, **kw)
    profile = llm.engine.core.info.verify_costs
    assert profile is llm.engine.scheduler.speculation.cost_profile
    assert sorted((b, k) for b, k, _ in profile.target_s) == [(b, k) for b in (1, 2, 4) for k in range(4)]
    assert sorted((b, k) for b, k, _ in profile.draft_s) == [(b, k) for b in (1, 2, 4) for k in range(1, 4)]
    assert [(b, k) for b, k, _ in profile.sampled_target_s] == [(b, k) for b, k, _ in profile.target_s]
    assert [(b, k) for b, k, _ in profile.sampled_draft_s] == [(b, k) for b, k, _ in profile.draft_s]
    assert all(s > 0 for *_, s in profile.target_s + profile.draft_s + profile.sampled_target_s
               + profile.sampled_draft_s)
    draft = {(b, k): s for b, k, s in profile.draft_s}
    assert draft[(1, 3)] > draft[(1, 1)]  # a longer chain costs more
    # The draft's catch-up over an unseen context, per token: a prefill, cheaper a token than
    # a steady round's single-token forward.
    assert 0 < profile.catch_up_s_per_token < draft[(1, 1)]
    # The profile wrote into blocks no request owns yet: output as without it.
    ref = LLM(str(path), **kw).generate(_prompts(), GREEDY)
    assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == [o.token_ids for o in ref]
    ngram = LLM(str(path), speculative_method="ngram", speculative_max_tokens=3, **kw).engine.core.info.verify_costs
    assert all(s == 0.0 for *_, s in ngram.draft_s + ngram.sampled_draft_s)
    assert ngram.catch_up_s_per_token == 0.0
    fixed = LLM(str(path), speculative_model=str(draft_checkpoint), num_speculative_tokens=2, **kw)
    assert fixed.engine.core.info.verify_costs is None
