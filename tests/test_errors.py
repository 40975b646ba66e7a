"""Every bad input raises a clear, documented error naming what was wrong."""

from __future__ import annotations

import json
import shutil

import pytest

from tailserve import (
    LLM,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    InvalidRequestError,
    SamplingParams,
    UnsupportedArchitectureError,
)
from tailserve.model.loader import load_model


@pytest.fixture
def ckpt_copy(llama_checkpoint, tmp_path):
    path, _ = llama_checkpoint
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return dst


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="model folder not found"):
        load_model(tmp_path / "nope")


def test_missing_config(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"config\.json"):
        load_model(ckpt_copy)


def test_missing_weights(ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"model\.safetensors"):
        load_model(ckpt_copy)


def test_pickled_weights_refused(ckpt_copy):
    (ckpt_copy / "model.safetensors").rename(ckpt_copy / "pytorch_model.bin")
    with pytest.raises(CheckpointFormatError, match="safetensors only"):
        load_model(ckpt_copy)


def test_bad_json(ckpt_copy):
    (ckpt_copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match=r"config.json: invalid JSON"):
        load_model(ckpt_copy)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture(ckpt_copy):
    _edit_config(ckpt_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        load_model(ckpt_copy)


def test_unsupported_rope_type(ckpt_copy):
    _edit_config(ckpt_copy, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        load_model(ckpt_copy)


def test_missing_tensor(ckpt_copy):
    # An untied model whose checkpoint lacks lm_head.weight.
    _edit_config(ckpt_copy, tie_word_embeddings=False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt_copy / "model.safetensors")
    tensors.pop("lm_head.weight")
    save_file(tensors, ckpt_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match=r"'lm_head\.weight' missing"):
        load_model(ckpt_copy)


def test_misshaped_tensor(ckpt_copy):
    _edit_config(ckpt_copy, intermediate_size=96)
    expected = r"mlp\.gate_proj\.weight' has shape \(128, 64\), expected \(96, 64\)"
    with pytest.raises(CheckpointFormatError, match=expected):
        load_model(ckpt_copy)


def test_corrupt_safetensors(ckpt_copy):
    (ckpt_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointFormatError, match="not a valid safetensors file"):
        load_model(ckpt_copy)


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    path, _ = llama_checkpoint
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 20, max_model_len=128)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(llm, prompt):
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        llm.generate([prompt])


def test_prompt_longer_than_context(llm):
    with pytest.raises(InvalidRequestError, match="max_model_len") as e:
        llm.generate([[5] * 128])
    assert e.value.param == "prompt"


def test_out_of_vocabulary_token(llm):
    with pytest.raises(InvalidRequestError, match="token ids must be integers"):
        llm.generate([[5, 10**6]])


def test_request_bigger_than_kv_cache(llama_checkpoint):
    path, _ = llama_checkpoint
    small = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 * 2 * 2 * 16 * 2 * 16 * 4)  # 4 blocks
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        small.generate([[5] * 60], SamplingParams(max_tokens=10))


def test_failed_batch_leaves_nothing_queued(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6], ""])
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(stop=5), "stop"),
    (dict(stop=["ok", 7]), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=["x"]), "stop_token_ids"),
    (dict(stop_token_ids=3), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"),
    (dict(n=0), "n"),
    (dict(n=129), "n"),
    (dict(n=3, best_of=2), "best_of"),
    (dict(best_of=1.5), "best_of"),
])
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert param in str(e.value)


@pytest.mark.parametrize("kwargs", [
    dict(block_size=3), dict(max_num_seqs=0), dict(max_num_batched_tokens=-1), dict(dtype="int8"),
    dict(kv_cache_memory_bytes="lots"), dict(device="tpu"), dict(max_model_len=1),
    dict(speculative_method="hybrid"), dict(speculative_method="eagle"),
    dict(speculative_model="builtin", speculative_draft_dtype="int4"),
    dict(speculative_model="builtin", speculative_draft_stop_margin=1.0),
    dict(speculative_model="builtin", speculative_draft_stop_margin=-0.1),
    dict(speculative_model="builtin", speculative_draft_stop_margin="high"),
    dict(speculative_model="builtin", speculative_draft_numpy=True, speculative_draft_dtype="bfloat16"),
    dict(speculative_model="builtin", speculative_draft_numpy="yes"),
    dict(speculative_model="builtin", speculative_draft_quantization="int4"),
    dict(speculative_method="ngram", speculative_draft_quantization="int8"),
    dict(speculative_method="ngram", speculative_draft_quantization="none"),
    dict(speculative_model="builtin", speculative_draft_quantization="int8", speculative_draft_numpy=True),
    dict(speculative_model="builtin", speculative_draft_quantization="w8a8_int8", speculative_draft_numpy=True),
    dict(speculative_model="builtin", speculative_draft_quantization="w8a8_int8", speculative_draft_dtype="bfloat16"),
])
def test_bad_engine_config(llama_checkpoint, kwargs):
    path, _ = llama_checkpoint
    with pytest.raises(ConfigError):
        LLM(str(path), **kwargs)


def test_max_model_len_beyond_the_model(llama_checkpoint):
    path, _ = llama_checkpoint
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLM(str(path), max_model_len=100_000)
