"""Each stage alone, with hand-written inputs and no model: the ``Processor`` (validation and
the context limit), the ``OutputProcessor`` (stop strings at every position, hold-back,
logprobs, n > 1 parents) and the ``EngineCore`` driven by a fake worker that replays
hand-written ``ModelRunnerOutput``s (speculative rollback, preemption, out-of-memory)."""

from __future__ import annotations

import dataclasses
import itertools
import pathlib

import pytest
import torch

from tailserve import SamplingParams
from tailserve.config import EngineConfig
from tailserve.engine.core import EngineCore, EngineStepError
from tailserve.engine.output_processor import OutputProcessor
from tailserve.engine.plan import Capabilities, plan_target
from tailserve.engine.processor import PreparedRequest, Processor
from tailserve.engine.scheduler_output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    StepAppliedError,
    WorkerInfo,
)
from tailserve.errors import InvalidRequestError
from tailserve.memory.allocator.conf import AllocatorConf
from tailserve.memory.allocator.control import AllocatorSettings
from tailserve.model.config import ModelArchConfig, RopeConfig

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"


class ToyTokenizer:
    """One character per token id (ids index ALPHABET); id 100 decodes to two characters,
    "xy", so a stop string can end in the middle of a token."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("xy" if i == 100 else ALPHABET[i] for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ALPHABET.index(c) for c in text]


TOK = ToyTokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text)


# -- Processor: validation and the one context rule ---------------------------------------------
def _processor(max_model_len: int = 32, num_blocks: int = 64) -> Processor:
    return Processor(TOK, len(ALPHABET) + 100, max_model_len, 4, num_blocks, "toy")  # type: ignore[arg-type]


def test_processor_refuses_prompt_plus_max_tokens_over_the_context_with_both_numbers():
    p = _processor(max_model_len=32)
    assert len(p.process(ids("abcdefghij"), SamplingParams(max_tokens=22)).prompt_token_ids) == 10
    with pytest.raises(InvalidRequestError, match=r"context \(max_model_len\) is 32 tokens.*10 prompt tokens "
                                                  r"\+ max_tokens 23 = 33; lower max_tokens to at most 22") as e:
        p.process(ids("abcdefghij"), SamplingParams(max_tokens=23))
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError, match="at least one token must be left") as e:
        p.process(list(range(20)) + list(range(12)), SamplingParams(max_tokens=1))
    assert e.value.param == "prompt"


def test_processor_refuses_what_the_kv_cache_cannot_hold_and_bad_token_ids():
    p = _processor(max_model_len=64, num_blocks=3)  # 12 token slots
    with pytest.raises(InvalidRequestError, match="needs 4 KV blocks but the cache holds 3"):
        p.process(ids("abcdefghij"), SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequestError, match=r"prompt token ids must be integers in \[0, 129\)"):
        p.process([1, 500], SamplingParams())
    with pytest.raises(InvalidRequestError, match="logit_bias token id 200"):
        p.process([1], SamplingParams(logit_bias={200: 1.0}, max_tokens=4))


# -- OutputProcessor -----------------------------------------------------------------------------
def _co(rid: str, toks: list[int], finished: bool = False, reason: str | None = None,
        logprobs: list[dict[int, float]] | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(rid, toks, logprobs, finished, reason)


def _run(op: OutputProcessor, rid: str, chunks: list[list[int]], final_reason: str = "length"):
    """Feed ``chunks`` as successive steps (the last one finishes the request unless a stop
    string did); returns (the outputs, the ids the engine core was asked to stop)."""
    outs, stops = [], []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        res, to_stop = op.process([_co(rid, chunk, last, final_reason if last else None)], 0)
        outs.extend(res)
        stops.extend(to_stop)
        if res and res[-1].finished:
            break
    return outs, stops


def _chunkings(n: int):
    """Every split of n tokens into steps of 1 to 4 tokens (speculative steps emit several)."""
    for size in (1, 2, 3, 4):
        yield [list(range(i, min(i + size, n))) for i in range(0, n, size)]


TEXT = "hello world, the end"


@pytest.mark.parametrize("stop", ["lo w", "d", "the end", "o", ", t", "zz"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_ids_text_and_stream_at_every_position(stop, include):
    toks = ids(TEXT)
    cut = TEXT.find(stop)
    want_text = TEXT if cut < 0 else TEXT[: cut + len(stop) if include else cut]
    # The token that completes the stop string is the last one kept.
    want_ids = toks if cut < 0 else toks[: cut + len(stop)]
    for chunking in _chunkings(len(toks)):
        op = OutputProcessor(TOK)  # type: ignore[arg-type]
        params = SamplingParams(stop=[stop], include_stop_str_in_output=include, max_tokens=64)
        op.add_request("r", None, [0], params, None)
        outs, stops = _run(op, "r", [[toks[i] for i in c] for c in chunking])
        final = outs[-1]
        assert final.finished and final.outputs[0].text == want_text, chunking
        assert final.outputs[0].token_ids == want_ids
        assert "".join(o.delta_text for o in outs) == want_text  # streamed text is never retracted
        assert [t for o in outs for t in o.delta_token_ids] == want_ids
        if cut >= 0:
            assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
            # Stopped in a step before the one the core finished it in: the core is told to finish it.
            stop_chunk = next(i for i, c in enumerate(chunking) if cut + len(stop) - 1 in c)
            assert stops == (["r"] if stop_chunk < len(chunking) - 1 else [])
        else:
            assert final.outputs[0].finish_reason == "length" and stops == []
        assert "r" not in op


def test_a_stop_string_ending_inside_a_token():
    op = OutputProcessor(TOK)  # type: ignore[arg-type]
    op.add_request("r", None, [0], SamplingParams(stop=["ax"], max_tokens=8), None)
    outs, stops = _run(op, "r", [[0], [100], [1, 2]])  # "a", "xy", "bc"
    assert outs[-1].outputs[0].text == "" and outs[-1].outputs[0].token_ids == [0, 100]
    assert stops == ["r"]


def test_hold_back_streams_only_what_cannot_start_a_stop_string():
    op = OutputProcessor(TOK)  # type: ignore[arg-type]
    op.add_request("r", None, [0], SamplingParams(stop=["xyz!"], max_tokens=8), None)  # can never match
    deltas = []
    for t in ids("abcdef"):
        (out,), _ = op.process([_co("r", [t])], 0)
        deltas.append(out.delta_text)
        assert out.outputs[0].text.startswith("".join(deltas))
        assert len(out.outputs[0].text) - len("".join(deltas)) == min(3, len(out.outputs[0].text))
    (out,), _ = op.process([_co("r", [], True, "length")], 0)
    assert "".join(deltas) + out.delta_text == "abcdef"


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_that_ended_a_request_is_in_its_ids_not_its_text(include):
    op = OutputProcessor(TOK)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=10, stop_token_ids=(ALPHABET.index("."),), include_stop_str_in_output=include)
    op.add_request("r", None, [0], params, None)
    co = EngineCoreOutput("r", ids("ok."), None, True, "stop", ALPHABET.index("."), stop_token=True)
    (out,) = op.process([co], 0)[0]
    assert out.outputs[0].token_ids == ids("ok.")
    assert out.outputs[0].text == ("ok." if include else "ok") == out.outputs[0].delta_text
    # A request the grammar completed ends on a real token: it is kept.
    op.add_request("g", None, [0], SamplingParams(max_tokens=10), None)
    (out,) = op.process([EngineCoreOutput("g", ids("ok."), None, True, "stop")], 0)[0]
    assert out.outputs[0].text == "ok."


def test_logprobs_are_kept_per_token_and_cut_with_the_stop():
    op = OutputProcessor(TOK)  # type: ignore[arg-type]
    op.add_request("r", None, [0], SamplingParams(stop=["c"], logprobs=1, max_tokens=8), None)
    lps = [{t: -0.1 * t} for t in ids("abcd")]
    (out,), _ = op.process([_co("r", ids("abcd"), logprobs=lps)], 0)
    assert out.finished and out.outputs[0].text == "ab" and out.outputs[0].logprobs == lps[:3]


def test_samples_of_one_request_merge_into_one_output():
    op = OutputProcessor(TOK)  # type: ignore[arg-type]
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1)
    samples = [("p-0", dataclasses.replace(params, n=1, seed=1)), ("p-1", dataclasses.replace(params, n=1, seed=2))]
    op.add_request("p", None, [0], params, None, samples=samples)
    assert op.request_ids() == ["p"] and len(op) == 1
    (first,), _ = op.process([_co("p-0", ids("ab")), _co("p-1", ids("c"))], 0)
    assert not first.finished and [c.text for c in first.outputs] == ["ab", "c"]
    (last,), _ = op.process([_co("p-0", ids("d"), True, "length"), _co("p-1", ids("ef"), True, "length")], 0)
    assert last.finished and [c.text for c in sorted(last.outputs, key=lambda c: c.index)] == ["abd", "cef"]
    assert len(op) == 0


def _final_only_cases():
    """(params, the steps' token chunks, whether the last ends on a stop token): every kind
    of ending a request can have without a stop string."""
    period = ALPHABET.index(".")
    for chunking in _chunkings(len(TEXT)):
        yield SamplingParams(max_tokens=64), [[ids(TEXT)[i] for i in c] for c in chunking], False
    for include in (False, True):
        stop_ids = SamplingParams(max_tokens=64, stop_token_ids=(period,), include_stop_str_in_output=include)
        yield stop_ids, [ids("ok"), [100], ids(" .")], True
    lp = SamplingParams(max_tokens=64, logprobs=1)
    yield lp, [ids("ab"), ids("c"), ids("de")], False


@pytest.mark.parametrize("case", range(len(list(_final_only_cases()))))
def test_a_final_only_request_gets_one_output_equal_to_the_last_of_the_per_step_ones(case):
    params, chunks, stop_token = list(_final_only_cases())[case]
    finals = []
    for final_only in (False, True):
        op = OutputProcessor(TOK)  # type: ignore[arg-type]
        op.add_request("r", None, [0], params, None, final_only=final_only)
        outs = []
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            lps = [{t: -0.01 * t} for t in chunk] if params.logprobs is not None else None
            co = EngineCoreOutput("r", chunk, lps, last, ("stop" if stop_token else "length") if last else None,
                                  chunk[-1] if last and stop_token else None, stop_token=last and stop_token)
            outs.extend(op.process([co], 0)[0])
        assert "r" not in op
        if final_only:
            assert len(outs) == 1  # nothing per step
            # Its delta is all of it: everything since the caller's last output (none).
            assert outs[0].delta_text == outs[0].outputs[0].text
            assert outs[0].delta_token_ids == outs[0].outputs[0].token_ids
        finals.append(outs[-1])
    per_step, final_only = finals
    assert final_only.finished and final_only.outputs == [
        dataclasses.replace(per_step.outputs[0], delta_text=final_only.outputs[0].delta_text,
                            delta_token_ids=final_only.outputs[0].delta_token_ids)]


def test_final_only_with_stop_strings_still_checks_them_per_token():
    op = OutputProcessor(TOK)  # type: ignore[arg-type]
    op.add_request("r", None, [0], SamplingParams(stop=["lo"], max_tokens=64), None, final_only=True)
    outs, stops = _run(op, "r", [ids("hel"), ids("lo wor"), ids("ld")])
    assert outs[-1].finished and outs[-1].outputs[0].text == "hel" and stops == ["r"]


# -- EngineCore with a fake worker ---------------------------------------------------------------
ARCH = ModelArchConfig("LlamaForCausalLM", 128, 64, 128, 2, 4, 2, 16, 1e-5, 256, RopeConfig(), False, False,
                       False, False, False, None, torch.float32, 1, (127,))


class ReplayWorker:
    """A ``ModelExecutor`` with no model: each step it records the ``SchedulerOutput`` and
    answers with what ``answer(sched)`` returns (or raises)."""

    def __init__(self, config: EngineConfig, num_blocks: int, answer, proposer: bool = False) -> None:
        plan = plan_target(config, ARCH, torch.device("cpu"), Capabilities())
        self.info = WorkerInfo(ARCH, pathlib.Path("toy"), 256, num_blocks, config.block_size, 1024, torch.float32,
                               "test", torch.device("cpu"), AllocatorSettings("", "default", AllocatorConf(), None, ()),
                               None, (), None, proposer, plan)
        self.answer = answer
        self.steps: list[SchedulerOutput] = []
        self.freed: list[str] = []

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(sched)
        return self.answer(sched)

    def warm_up(self, decode_batch_sizes, prefill_lens) -> None: ...

    def free(self, request_ids) -> None:
        self.freed.extend(request_ids)

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


def _prepared(n: int, **params) -> PreparedRequest:
    return PreparedRequest(None, list(range(1, n + 1)), SamplingParams(**params))


def _tokens_for(sched: SchedulerOutput, token: int = 5, drafts: dict | None = None) -> ModelRunnerOutput:
    out = ModelRunnerOutput()
    for s in sched.scheduled:
        if s.sample:
            out.sampled_token_ids[s.request_id] = [token] * (1 + len(s.draft_token_ids))
            if drafts and s.num_lookahead_tokens:
                out.draft_token_ids[s.request_id] = drafts[s.request_id][: s.num_lookahead_tokens]
                out.draft_caps[s.request_id] = s.num_lookahead_tokens
    return out


def test_engine_core_rolls_back_rejected_drafts_from_a_replayed_output():
    cfg = EngineConfig(model="builtin", block_size=4, speculative_method="ngram", num_speculative_tokens=3)
    answers = iter([
        # step 1: the prompt; the proposer offers 3 drafts for the next step
        lambda s: dataclasses.replace(_tokens_for(s, 7), draft_token_ids={"r": [8, 9, 10]}, draft_caps={"r": 3}),
        # step 2: verify 3 drafts, accept 1 (8) and a correction (11): 2 tokens, 2 drafts rolled back
        lambda s: ModelRunnerOutput(sampled_token_ids={"r": [8, 11]}),
        lambda s: _tokens_for(s, 12),
    ])
    worker = ReplayWorker(cfg, 32, lambda s: next(answers)(s), proposer=True)
    core = EngineCore(cfg, worker=worker)
    core.add_request("r", _prepared(6, max_tokens=8, temperature=0.0))
    core.step()
    req = core.scheduler.requests["r"]
    assert req.num_computed_tokens == 6 and req.output_token_ids == [7]
    outs = core.step()
    verify = worker.steps[1].scheduled[0]
    assert list(verify.draft_token_ids) == [8, 9, 10] and verify.num_tokens == 4
    assert outs[0].new_token_ids == [8, 11] and outs[0].num_draft_tokens == 3 and outs[0].num_accepted_tokens == 1
    # 6 prompt + 7 + 8 computed; 11 is sampled, not yet computed; the rejected 9, 10 are rolled back.
    assert req.num_computed_tokens == 8 and req.output_token_ids == [7, 8, 11]
    core.block_pool.check_consistency()
    assert core.scheduler.spec_stats.num_draft_tokens == 3 and core.scheduler.spec_stats.num_accepted_tokens == 1


def test_engine_core_preempts_the_newest_when_blocks_run_out():
    cfg = EngineConfig(model="builtin", block_size=4, max_num_seqs=4, admission_reserve_tokens=0)
    worker = ReplayWorker(cfg, 6, _tokens_for)  # 24 token slots
    core = EngineCore(cfg, worker=worker)
    core.add_request("old", _prepared(8, max_tokens=12, ignore_eos=True))
    core.add_request("new", _prepared(8, max_tokens=12, ignore_eos=True))
    for _ in range(40):
        core.step()
        core.block_pool.check_consistency()
        if not core.has_unfinished_requests():
            break
    assert not core.has_unfinished_requests()
    assert core.scheduler.num_preemptions >= 1
    # The newest was the victim: a second NewRequestData for it (resumed with all its data).
    resumed = [nr.request_id for s in worker.steps for nr in s.new_requests]
    assert resumed.count("new") >= 2 and resumed.count("old") == 1


def _oom_then_ok():
    calls = itertools.count()

    def answer(sched):
        if next(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return _tokens_for(sched)

    return answer


def test_engine_core_preempts_half_the_step_on_out_of_memory_and_retries():
    cfg = EngineConfig(model="builtin", block_size=4)
    worker = ReplayWorker(cfg, 64, _oom_then_ok())
    core = EngineCore(cfg, worker=worker)
    for i in range(4):
        core.add_request(f"r{i}", _prepared(4, max_tokens=3, ignore_eos=True))
    core.step()  # the four prompts
    assert core.step() == []  # out of memory: nothing emitted, nobody aborted
    assert core.num_oom_preemptions == 2
    while core.has_unfinished_requests():
        core.step()
    assert all(core.scheduler.requests.get(f"r{i}") is None for i in range(4))


def test_an_error_after_the_step_was_applied_fails_its_requests():
    cfg = EngineConfig(model="builtin", block_size=4)
    calls = itertools.count()

    def answer(sched):
        if next(calls) == 1:
            raise StepAppliedError("OutOfMemoryError in the draft proposal: CUDA out of memory")
        return _tokens_for(sched)

    worker = ReplayWorker(cfg, 64, answer)
    core = EngineCore(cfg, worker=worker)
    core.add_request("a", _prepared(4, max_tokens=3, ignore_eos=True))
    core.add_request("b", _prepared(4, max_tokens=3, ignore_eos=True))
    core.step()
    with pytest.raises(EngineStepError) as e:
        core.step()
    assert sorted(e.value.request_ids) == ["a", "b"] and core.num_oom_preemptions == 0
    assert not core.has_unfinished_requests()  # aborted, not preempted and queued again


def test_the_speculation_policy_learns_only_through_update():
    """The previous decode step's cost reaches the controller with the next update, and a
    step with nothing measured leaves it untouched: schedule() reads only its state."""
    cfg = EngineConfig(model="builtin", block_size=4, speculative_method="ngram")
    worker = ReplayWorker(cfg, 64, lambda s: dataclasses.replace(_tokens_for(s), target_forward_s=0.004,
                                                                 propose_s=0.001), proposer=True)
    core = EngineCore(cfg, worker=worker)
    spec = core.scheduler.speculation
    core.add_request("r", _prepared(4, max_tokens=6, ignore_eos=True))
    n0 = spec._steps_observed
    core.step()
    core.end_step()  # a prefill step: not a decode cost
    core.step()
    core.end_step()  # a decode step: measured, not yet observed
    assert spec._steps_observed == n0 and core._last_cost is not None
    assert core._last_cost.target_forward_s == 0.004 and core._last_cost.propose_s == 0.001
    core.step()  # ... observed here, in update
    assert spec._steps_observed == n0 + 1 and core._last_cost is None


def test_a_quiet_step_is_not_timed_and_reaches_the_policy_as_nothing():
    """A step the policy leaves quiet (k = 0 standing: ``AdaptiveSpeculation.last_round`` None)
    costs no timing in the engine core and no report in the next update; a reported one
    does."""
    cfg = EngineConfig(model="builtin", block_size=4, speculative_method="ngram")
    worker = ReplayWorker(cfg, 64, lambda s: dataclasses.replace(_tokens_for(s), target_forward_s=0.004),
                          proposer=True)
    core = EngineCore(cfg, worker=worker)
    spec = core.scheduler.speculation
    quiet = [True]
    spec.choose_k = lambda num_decoding, *a, decode_only=True, **kw: spec._set(0, num_decoding,
                                                                               quiet=decode_only and quiet[0])
    core.add_request("r", _prepared(4, max_tokens=8, ignore_eos=True))
    core.step()
    core.end_step()  # the prompt: reported (not a decode cost)
    n0 = spec._steps_observed
    for _ in range(3):
        core.step()
        assert core._pending_timing is None
        core.end_step()
    assert spec._steps_observed == n0  # nothing reported, nothing observed
    quiet[0] = False
    core.step()
    core.end_step()
    core.step()  # its update carries the reported step's cost
    assert spec._steps_observed == n0 + 1
