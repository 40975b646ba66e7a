"""Decodes replayed from graphs captured per batch-size bucket, wired into the engine.

On CUDA each bucket is a CUDA graph (``Worker`` captures them at start-up unless
``enforce_eager``); on the CPU a replay runs the same forward over the same static buffers,
so these tests check what the CUDA path relies on: which steps replay, the padding to the
bucket, the buffer copies, and that nothing a request sees changes."""

from __future__ import annotations

import pytest

from tailserve import LLM, SamplingParams
from tailserve.config import EngineConfig, decode_graph_batch_sizes
from tailserve.errors import ConfigError


def test_buckets_are_1_2_4_then_every_8_up_to_max_num_seqs():
    assert decode_graph_batch_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert decode_graph_batch_sizes(3) == [1, 2, 3]
    assert decode_graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert decode_graph_batch_sizes(1024)[-1] == 256  # larger batches run eagerly


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_replayed_decodes_generate_what_eager_decodes_do(tiny_checkpoint, kind):
    path, _ = tiny_checkpoint(kind)
    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=2 << 20)
    eager = LLM(str(path), **kw)
    want = [o.token_ids for o in eager.generate(prompts, greedy)]
    want_seeded = [o.token_ids for o in eager.generate(prompts, seeded)]
    assert eager.engine.core.worker.runner.graph_replays == 0  # the CPU never captures by itself

    llm = LLM(str(path), **kw)
    worker = llm.engine.core.worker
    seconds = worker.capture_decode_graphs([1, 2, 4])
    assert seconds > 0 and sorted(worker.runner.decode_graphs) == [1, 2, 4]
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want  # 3 decodes in the bucket of 4
    replays = worker.runner.graph_replays
    assert replays >= 11  # every decode step after the prefill
    assert [o.token_ids for o in llm.generate(prompts, seeded)] == want_seeded
    llm.engine.block_pool.check_consistency()
    # Five decodes exceed the largest bucket: those steps run eagerly, same tokens.
    five = [*prompts, [60, 61], [70, 71, 72, 73]]
    before = worker.runner.graph_replays
    assert [o.token_ids for o in llm.generate(five, greedy)] == [o.token_ids for o in eager.generate(five, greedy)]
    assert worker.runner.graph_replays - before < 11  # only the steps after some finished could replay


def test_speculative_steps_stay_eager_and_lossless(tiny_checkpoint, noisy_draft):
    path, _ = tiny_checkpoint("llama")
    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13]]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=2 << 20)
    want = [o.token_ids for o in LLM(str(path), **kw).generate(prompts, greedy)]
    llm = LLM(str(path), speculative_model=str(noisy_draft), num_speculative_tokens=3, **kw)
    llm.engine.core.worker.capture_decode_graphs([1, 2])
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want


def test_the_flags_reach_the_engine_config():
    from tailserve.cli import _engine_kwargs, build_parser

    args = build_parser().parse_args(["generate", "hi", "--enforce-eager", "--quantization", "int8"])
    kw = _engine_kwargs(args)
    assert kw["enforce_eager"] is True and kw["quantization"] == "int8"
    assert EngineConfig(model="m", **{k: v for k, v in kw.items() if k != "kv_cache_memory_bytes"}).enforce_eager
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(model="m", quantization="int4")
