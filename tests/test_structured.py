"""Constrained decoding: request shapes, grammar compilation, the bitmask (stage by stage),
then the engine: outputs match, greedy is identical with speculation on and off, and the
sampled distribution under speculation is exactly the masked target's."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from tailserve.errors import InvalidRequestError
from tailserve.sampling_params import SamplingParams
from tailserve.sampling_params import StructuredOutputsParams as SO

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
PROMPTS = ["def main():", "import os\nimport sys\n", "class Point:\n    def __init__(self, x, y):"]


def tok8_json() -> str:
    """tokenizer.json for an 8-token vocabulary: <s>, </s>, a..f (byte-level, as llguidance reads)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{c: 2 + i for i, c in enumerate("abcdef")}}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok.to_str()


@pytest.fixture(scope="module")
def compiler8():
    from tailserve.structured.grammar import GrammarCompiler

    return GrammarCompiler(tok8_json, 8, [1])


def allowed(row: np.ndarray, vocab: int) -> list[int]:
    return np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])[0].tolist()


# -- request shapes --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["x"]}, "exactly one"),
    ({"json": "[1, 2]"}, "not a JSON schema object"),
    ({"json": "{nope"}, "not a JSON schema object"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "only non-empty strings"),
    ({"regex": ""}, "non-empty string"),
])
def test_structured_outputs_params_refuse_bad_shapes(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        SO(param="response_format", **kwargs)
    assert e.value.param == "response_format"


def test_a_schema_dict_is_kept_as_its_text_and_params_stay_hashable():
    so = SO(json=SCHEMA)
    assert json.loads(so.json) == SCHEMA and so.kind == "json"
    hash(SamplingParams(structured_outputs=so))


# -- compilation ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"json": {"type": "strin"}}, "invalid JSON schema.*strin"),
    ({"json": {"$ref": "#/definitions/missing"}}, "invalid JSON schema.*missing"),
    ({"regex": "[a-"}, "invalid regex"),
    ({"grammar": "start: \"a\" | missing_rule"}, "invalid grammar"),
    ({"grammar": "root ::= \"a\" ( \"b\""}, "invalid grammar"),
])
def test_invalid_grammars_name_the_field(compiler8, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        compiler8.compile(SO(param="structured_outputs", **kwargs))
    assert e.value.param == "structured_outputs"


def test_an_unimplemented_schema_keyword_is_named(compiler8):
    with pytest.raises(InvalidRequestError, match=r'Unimplemented keys: \["not"\]'):
        compiler8.compile(SO(json={"not": {"type": "string"}}))


def test_compiled_grammars_are_cached(compiler8):
    a = compiler8.compile(SO(regex="[ab]+"))
    assert compiler8.compile(SO(regex="[ab]+")) is a


# -- the bitmask --------------------------------------------------------------------------------
@pytest.mark.parametrize("parallel", [False, True])
def test_bitmask_rows_follow_the_drafts_and_leave_the_matcher_where_it_was(compiler8, parallel):
    from tailserve.structured.grammar import BitmaskBuilder

    g = compiler8.compile(SO(regex="[ab][c-f][ab]"))
    m1, m2 = g.start(), g.start()
    b = BitmaskBuilder(8, parallel=parallel)
    # m1 drafts a (valid), e (valid), c (invalid: the third must be a or b), d; m2 none.
    bm = b.build([(m1, [2, 6, 4, 5]), (m2, [])])
    assert bm.shape == (6, 1)
    assert allowed(bm[0], 8) == [2, 3]  # [ab]
    assert allowed(bm[1], 8) == [4, 5, 6, 7]  # after a: [c-f]
    assert allowed(bm[2], 8) == [2, 3]  # after a e: [ab]
    assert allowed(bm[3], 8) == list(range(8))  # after the refused c: never reached, left open
    assert allowed(bm[4], 8) == list(range(8))
    assert allowed(bm[5], 8) == [2, 3]  # m2 at its start
    # The walk through the drafts was rolled back: m1 still accepts its first token.
    assert m1.consume_token(3) and not m1.is_error()


@pytest.mark.parametrize("parallel", [False, True])
def test_drafts_past_the_grammars_end_leave_the_matcher_where_it_was(compiler8, parallel):
    from tailserve.structured.grammar import BitmaskBuilder

    g = compiler8.compile(SO(regex="[ab][c-f]"))
    b = BitmaskBuilder(8, parallel=parallel)
    m = g.start()
    assert m.consume_token(2)  # a
    # c completes the grammar (the matcher stops), then EOS and b: a stopped matcher takes EOS
    # without recording it, so a walk that rolled back every validated draft undid the a too.
    bm = b.build([(m, [4, 1, 3])])
    assert [allowed(r, 8) for r in bm] == [[4, 5, 6, 7], [1], list(range(8)), list(range(8))]
    assert not m.is_stopped() and not m.is_error()
    assert m.consume_token(4) and m.is_stopped()  # c is still what completes it
    bm = b.build([(m, [1, 3])])  # at the end already: EOS only, nothing after it reached
    assert [allowed(r, 8) for r in bm] == [[1], list(range(8)), list(range(8))]
    assert m.is_stopped() and not m.is_error()
    m.rollback(1)  # its history is still a c: one step back it is after the a
    assert not m.is_stopped() and m.consume_token(5) and m.is_stopped()


def test_the_matcher_stops_when_the_grammar_is_complete(compiler8):
    m = compiler8.compile(SO(choice=["ab", "ba"])).start()
    assert m.consume_tokens([2, 3]) and m.is_stopped()


@pytest.mark.parametrize("vocab", [8, 4096, 151_936])
def test_bitmask_kernel_matches_the_vectorised_path(vocab):
    from tailserve.kernels.cpu import kernels
    from tailserve.sample.bitmask import apply_token_bitmask

    k = kernels()
    if k is None:
        pytest.skip("the compiled CPU kernels are unavailable here")
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    bm = rng.integers(-(2**31), 2**31 - 1, size=(3, words), dtype=np.int64).astype(np.int32)
    bm[0, : words // 2] = -1  # all-allowed and all-refused words take the kernel's short cuts
    bm[1, : words // 2] = 0
    logits = torch.randn(5, vocab)
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask(a, [4, 0, 2], bm, None)
    apply_token_bitmask(b, [4, 0, 2], bm, k)
    assert torch.equal(a, b)
    bits = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    assert torch.equal(torch.isinf(a[4]), torch.from_numpy(~bits[0]))
    assert torch.equal(a[1], logits[1]) and torch.equal(a[3], logits[3])  # rows without a mask untouched


# -- the engine ------------------------------------------------------------------------------------
def _texts(llm, params, prompts=PROMPTS):
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def builtin(engine_cache):
    return engine_cache()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_outputs_validate(builtin, seed):
    outs = builtin.generate(PROMPTS, SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                                                    structured_outputs=SO(json=SCHEMA)))
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text  # the grammar completed (maxLength bounds the string)
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert " " not in c.text.replace('" "', "").split('"name"')[0]  # compact: no free whitespace


def test_regex_choice_and_grammar_outputs_match(builtin):
    rx = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
    for t in _texts(builtin, SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_outputs=SO(regex=rx))):
        assert re.fullmatch(rx, t), t
    for t in _texts(builtin, SamplingParams(max_tokens=10, temperature=1.0, seed=4,
                                            structured_outputs=SO(choice=("yes", "no", "maybe")))):
        assert t in ("yes", "no", "maybe")
    gbnf = 'root ::= "x = " [0-9]+ ("\\n" "y = " [0-9]+)?'
    p = SamplingParams(max_tokens=30, temperature=1.0, seed=5, structured_outputs=SO(grammar=gbnf))
    for t in _texts(builtin, p):
        assert re.fullmatch(r"x = [0-9]+(\ny = [0-9]+)?", t), t


def test_json_object_with_whitespace_allowed_still_parses(builtin):
    so = SO(json_object=True, disable_any_whitespace=False)
    outs = builtin.generate(PROMPTS, SamplingParams(max_tokens=200, temperature=0.7, seed=0, structured_outputs=so))
    texts = [o.outputs[0].text for o in outs]
    assert all(t.startswith("{") for t in texts)
    # A raw newline is JSON whitespace (a string holds it escaped): compact mode never writes one.
    assert any("\n" in t for t in texts)
    stopped = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(t), dict) for t in stopped)


def test_constrained_logprobs_are_of_the_masked_distribution(builtin):
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=0, logprobs=5, structured_outputs=SO(choice=("yes",)))
    out = builtin.generate(["x"], p)[0].outputs[0]
    assert out.text == "yes"
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp[tok] == pytest.approx(0.0, abs=1e-6)  # the only token allowed has all the mass
        assert all(v == float("-inf") for t, v in lp.items() if t != tok)


def test_seeded_constrained_samples_repeat_and_n_samples_each_match(builtin):
    p = SamplingParams(max_tokens=120, temperature=1.0, seed=11, structured_outputs=SO(json=SCHEMA))
    assert _texts(builtin, p) == _texts(builtin, p)
    outs = builtin.generate(PROMPTS[:1], SamplingParams(n=3, max_tokens=120, temperature=1.0, seed=12,
                                                        structured_outputs=SO(json=SCHEMA)))
    for c in outs[0].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_penalties_bias_and_stop_strings_compose(builtin):
    p = SamplingParams(max_tokens=120, temperature=1.0, seed=2, repetition_penalty=1.3, frequency_penalty=0.5,
                       logit_bias={1: -100.0}, structured_outputs=SO(json=SCHEMA))
    for t in _texts(builtin, p):
        jsonschema.validate(json.loads(t), SCHEMA)
    p = SamplingParams(max_tokens=120, temperature=0, stop=['"count"'], structured_outputs=SO(json=SCHEMA))
    for t in _texts(builtin, p):
        assert t.startswith('{"name":') and '"count"' not in t


@pytest.mark.parametrize("spec", ["draft_model", "ngram"])
def test_greedy_constrained_output_is_identical_with_speculation(builtin, llm_builtin_spec, engine_cache, spec):
    llm = llm_builtin_spec if spec == "draft_model" else engine_cache(speculative_method="ngram",
                                                                    num_speculative_tokens=3)
    before = llm.engine.spec_stats.num_draft_tokens
    for so in (SO(json=SCHEMA), SO(regex=r"(def [a-z_]+\(\):\n    return [a-z]+\n){2}"),
               SO(grammar='start: ("x = " /[0-9]+/ "\\n")+ "end"')):
        p = SamplingParams(max_tokens=80, temperature=0, structured_outputs=so)
        ids = [o.outputs[0].token_ids for o in builtin.generate(PROMPTS, p)]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p)] == ids
    assert llm.engine.spec_stats.num_draft_tokens > before  # drafts were verified under the masks


def test_greedy_constrained_output_is_identical_when_drafts_run_past_the_grammars_end(builtin, engine_cache):
    # The context holds the answer followed by EOS (an agent's earlier turns do), so a lookup
    # drafts the answer's end and then EOS: the mask walk went past the grammar's stop, rolled
    # back one token too many, and the request was aborted mid-answer (finish_reason "abort").
    llm = engine_cache(speculative_method="ngram", num_speculative_tokens=3)
    tok = builtin.engine.tokenizer
    call, ask, eos = '[{"name": "f"}]', "answer: ", 1
    ids = [t for _ in range(3) for t in (*tok.encode(ask, add_special_tokens=False),
                                         *tok.encode(call, add_special_tokens=False), eos)]
    ids += tok.encode(ask, add_special_tokens=False)
    p = SamplingParams(max_tokens=30, temperature=0, structured_outputs=SO(choice=(call,)))
    before = llm.engine.spec_stats.num_draft_tokens
    ref, got = builtin.generate([ids], p)[0].outputs[0], llm.generate([ids], p)[0].outputs[0]
    assert (ref.text, ref.finish_reason) == (call, "stop")
    assert (got.token_ids, got.finish_reason) == (ref.token_ids, "stop")
    assert llm.engine.spec_stats.num_draft_tokens > before


def test_finishing_and_aborting_release_the_matcher(builtin):
    eng = builtin.engine
    rid = eng.add_request("def f():", SamplingParams(max_tokens=50, structured_outputs=SO(json=SCHEMA)))
    req = eng.scheduler.requests[rid]
    assert req.grammar is not None
    eng.step()
    eng.abort_request(rid)
    assert req.grammar is None and rid not in eng.scheduler.requests
    while eng.has_unfinished_requests():
        eng.step()


@pytest.mark.slow
def test_sampled_constrained_tokens_follow_the_masked_target_under_speculation(tmp_path):
    """Temperature 1 under the regex [ab][a-f][c-f] with a draft model proposing freely (so
    it often drafts tokens the grammar refuses): the three tokens follow the target's
    distribution masked position by position, computed exactly from its logits."""
    from tailserve import LLM
    from test_rejection_sampler import chi2_pvalue
    from test_speculative import _tiny_vocab_model, exact_first_three

    target_path, target = _tiny_vocab_model(tmp_path, "target", seed=0)
    draft_path, _ = _tiny_vocab_model(tmp_path, "draft", seed=1)
    for path in (target_path, draft_path):
        (path / "tokenizer.json").write_text(tok8_json())
    prompt = [3, 1, 4]
    allowed_at = [[2, 3], [2, 3, 4, 5, 6, 7], [4, 5, 6, 7]]
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True,
                            structured_outputs=SO(regex="[ab][a-f][c-f]"))

    def mask(position: int) -> torch.Tensor:
        m = torch.full((8,), float("-inf"))
        m[allowed_at[position]] = 0.0
        return m

    exact = exact_first_three(target, prompt, params, mask)
    llm = LLM(str(target_path), dtype="float32", kv_cache_memory_bytes=64 << 20, max_num_seqs=512,
              max_num_batched_tokens=4096, speculative_model=str(draft_path), num_speculative_tokens=2, seed=7,
              enable_prefix_caching=False, enable_metrics=False)  # Prometheus: a fifth of 8,000 requests' time
    n = 8_000  # 48 possible outcomes: ~170 samples each on average
    counts = torch.zeros(512, dtype=torch.float64)
    for _ in range(n // 2000):
        for out in llm.generate([prompt] * 2000, params):
            a, b, c = out.token_ids[:3]
            counts[a * 64 + b * 8 + c] += 1
            assert out.finish_reason == "stop"  # the grammar completed after three tokens
    spec = llm.engine.spec_stats
    assert spec.num_draft_tokens > 0 and 0 < spec.acceptance_rate < 1
    assert chi2_pvalue(counts, exact.reshape(-1)) > 1e-3


def test_masks_beside_the_forward_give_the_same_output_as_before_it(builtin):
    core = builtin.engine.core
    p = SamplingParams(max_tokens=60, temperature=1.0, seed=9, structured_outputs=SO(json=SCHEMA))
    planned = core.grammar_overlap_min_rows
    try:
        core.grammar_overlap_min_rows = 1  # a future the worker waits on
        beside = _texts(builtin, p)
        core.grammar_overlap_min_rows = 1 << 30
        assert _texts(builtin, p) == beside
    finally:
        core.grammar_overlap_min_rows = planned


def test_a_pending_bitmask_crosses_a_process_boundary_finished():
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    from tailserve.engine.scheduler_output import GrammarBitmask

    with ThreadPoolExecutor(1) as pool:
        gb = GrammarBitmask({"r": 0}, pool.submit(lambda: np.full((2, 3), 7, dtype=np.int32)))
        copy = pickle.loads(pickle.dumps(gb))  # what the tensor-parallel executor sends its ranks
    assert isinstance(copy.pending, np.ndarray) and copy.array().tolist() == [[7] * 3] * 2
    assert copy.first_rows == {"r": 0}


def test_a_preempted_constrained_request_resumes_its_grammar(engine_cache, builtin):
    """KV for about a third of the batch: requests are preempted (recomputed) mid-output and
    their matchers kept; greedy outputs equal those of an engine with room for all."""
    small = engine_cache(kv_cache_memory_bytes=20 * 128 << 10, max_num_seqs=8, enable_prefix_caching=False)
    long = {"type": "array", "minItems": 40, "maxItems": 40, "items": {"type": "string", "maxLength": 4}}
    p = SamplingParams(max_tokens=100, temperature=0, structured_outputs=SO(json=long))
    prompts = [f"def f{i}(x):" for i in range(8)]
    before = small.engine.scheduler.num_preemptions
    got = _texts(small, p, prompts)
    assert small.engine.scheduler.num_preemptions > before
    assert got == _texts(builtin, p, prompts)
