"""Applying PYTORCH_CUDA_ALLOC_CONF: validated, set before CUDA initialises, refused when too
late or in conflict, reported at /health and as an info metric."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tailserve import LLM
from tailserve.errors import ConfigError
from tailserve.memory.allocator.control import ENV, apply_alloc_conf


@pytest.fixture
def clean_env():
    """No allocator settings in the environment during the test, and none left after it
    (the engine writes os.environ itself, which monkeypatch would not undo)."""
    names = (ENV, "PYTORCH_ALLOC_CONF")
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    yield
    for k in names:
        os.environ.pop(k, None)
    os.environ.update(saved)


def test_applied_to_the_environment_before_cuda_and_reported(clean_env):
    s = apply_alloc_conf("max_split_size_mb:128", cuda_initialized=False)
    assert os.environ[ENV] == "max_split_size_mb:128" and s.source == "engine config"
    assert s.conf.max_split_size == 128 << 20


def test_too_late_or_conflicting_is_an_error_never_a_silent_no_op(clean_env, monkeypatch):
    with pytest.raises(ConfigError, match="already initialised"):
        apply_alloc_conf("max_split_size_mb:128", cuda_initialized=True)
    monkeypatch.setenv(ENV, "max_split_size_mb:256")
    with pytest.raises(ConfigError, match="set only one"):
        apply_alloc_conf("max_split_size_mb:128", cuda_initialized=False)
    s = apply_alloc_conf(None, cuda_initialized=False)  # the environment's is what is in force
    assert (s.text, s.source) == ("max_split_size_mb:256", "environment")
    with pytest.raises(ConfigError, match="unknown key"):
        apply_alloc_conf("max_split_sise_mb:128", cuda_initialized=False)


def test_gc_threshold_without_a_memory_fraction_warns(clean_env, caplog):
    with caplog.at_level(logging.WARNING, logger="tailserve.memory"):
        s = apply_alloc_conf("garbage_collection_threshold:0.8", cuda_initialized=False)
    assert s.warnings and "no effect without a per-process memory fraction" in caplog.text
    assert not apply_alloc_conf("garbage_collection_threshold:0.8", memory_fraction=0.9,
                                cuda_initialized=False).warnings


def test_engine_config_and_cli_reject_bad_values(clean_env, llama_checkpoint):
    path, _ = llama_checkpoint
    with pytest.raises(ConfigError, match="max_split_size_mb"):
        LLM(str(path), cuda_alloc_conf="max_split_size_mb:1")
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        LLM(str(path), gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="cuda_memory_fraction"):
        LLM(str(path), cuda_memory_fraction=0.0)
    out = subprocess.run([sys.executable, "-m", "tailserve", "generate", "--model", str(path), "--cuda-alloc-conf",
                          "roundup_power2_divisions:3", "x"], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != ENV})
    assert out.returncode == 2 and "roundup_power2_divisions must be a power of 2" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_in_force_settings_in_the_info_metric(clean_env, llama_checkpoint):
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20,
              cuda_alloc_conf="max_split_size_mb:64,garbage_collection_threshold:0.6", cuda_memory_fraction=0.9)
    text = llm.engine.metrics_exposition().decode()
    line = next(x for x in text.splitlines() if x.startswith("tailserve:cuda_alloc_conf_info{"))
    assert 'conf="max_split_size_mb:64,garbage_collection_threshold:0.6"' in line
    assert 'source="engine config"' in line and line.endswith(" 1.0")
    assert llm.engine.allocator_settings.as_dict()["memory_fraction"] == 0.9
