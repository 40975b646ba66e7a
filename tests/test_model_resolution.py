"""What a ``--model`` value points to: a folder, a Hugging Face id in the local cache
(no network), or a clear error."""

import shutil

import pytest

from tailserve.assets import resolve_model_path
from tailserve.errors import CheckpointNotFoundError


def _fake_cache(tmp_path, llama_checkpoint, model_id="acme/tiny-llama", commit="0123abcd"):
    path, _ = llama_checkpoint
    repo = tmp_path / "hub" / ("models--" + model_id.replace("/", "--"))
    shutil.copytree(path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_a_hugging_face_id_resolves_from_the_local_cache(tmp_path, llama_checkpoint, monkeypatch):
    snap = _fake_cache(tmp_path, llama_checkpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("acme/tiny-llama") == str(snap)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert resolve_model_path("acme/tiny-llama") == str(snap)


def test_an_uncached_id_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match=r"not in the local Hugging Face cache.*huggingface-cli download"):
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct")


def test_a_missing_folder_is_reported_as_a_missing_folder(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no such folder") as e:
        resolve_model_path(str(tmp_path / "nope"))
    assert "config.json" not in str(e.value)
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="not a folder"):
        resolve_model_path(str(f))


def test_llm_loads_a_cached_id(tmp_path, llama_checkpoint, monkeypatch):
    from tailserve import LLM, SamplingParams

    _fake_cache(tmp_path, llama_checkpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    out = LLM("acme/tiny-llama", dtype="float32", kv_cache_memory_bytes=1 << 20).generate(
        ["def f("], SamplingParams(max_tokens=2, temperature=0))
    assert out[0].num_output_tokens >= 1
