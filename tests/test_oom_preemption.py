"""A step that runs out of device memory preempts the newest half of its requests and runs
the rest again, instead of failing them. The out-of-memory error is injected (a CPU has no
device allocator to exhaust); everything else is the real engine."""

from __future__ import annotations

import pytest
import torch

from tailserve import LLM, SamplingParams
from tailserve.engine.core import EngineStepError


def _failing_once(worker, min_requests: int):
    """The model's forward raises once, in the first step with at least ``min_requests``
    requests: where a real out-of-memory error would come from."""
    model = worker.runner.model
    real = model.forward
    state = {"failed": 0, "batch": None}
    runner_execute = worker.runner.execute

    def execute(sched):
        state["batch"] = len(sched.scheduled)
        return runner_execute(sched)

    def forward(*args, **kwargs):
        if state["failed"] == 0 and state["batch"] >= min_requests:
            state["failed"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(*args, **kwargs)

    worker.runner.execute = execute
    model.forward = forward
    return state


@pytest.mark.parametrize("speculative", [False, True])
def test_out_of_memory_step_preempts_and_every_request_completes_exactly(llama_checkpoint, noisy_draft,
                                                                          speculative):
    path, _ = llama_checkpoint
    prompts = [[5 + i, 6, 7, 8, 9 + i] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(path), dtype="float32", kv_cache_memory_bytes=2 << 20).generate(prompts,
                                                                                                        params)]
    spec = dict(speculative_model=str(noisy_draft), num_speculative_tokens=3) if speculative else {}
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=2 << 20, **spec)
    state = _failing_once(llm.engine.core.worker, min_requests=4)
    outs = llm.generate(prompts, params)
    assert state["failed"] == 1
    assert [o.token_ids for o in outs] == ref
    assert llm.engine.core.num_oom_preemptions == 3  # the newest half of six
    assert sum(o.num_preemptions for o in outs) == 3
    llm.engine.scheduler.check_consistency()
    assert llm.engine.block_pool.num_used_blocks == 0


def test_a_lone_request_that_runs_out_of_memory_fails_alone(llama_checkpoint):
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=2 << 20)
    _failing_once(llm.engine.core.worker, min_requests=1)
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    with pytest.raises(EngineStepError, match="out of memory"):
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.block_pool.num_used_blocks == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))  # and it keeps serving
    assert out[0].num_output_tokens == 3
