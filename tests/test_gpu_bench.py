"""The CPU-only parts of the GPU decode benchmark (benchmarks/bench_gpu_decode.py, run by
benchmarks/gpu_check.sh): the model it builds, its arguments, and a whole smoke run on the CPU."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_gpu_decode as bench


@pytest.mark.parametrize("shape, approx", [("0.5b", 494e6), ("1.5b", 1544e6)])
def test_the_shapes_are_the_released_models_parameter_counts(shape, approx):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = bench.model_config(shape)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    counted = sum(p.numel() for p in model.parameters())  # tied: the head is the embedding
    assert bench.num_parameters(cfg) == counted
    assert abs(counted - approx) / approx < 0.01


def test_bad_arguments_exit_with_a_message(capsys):
    for argv in (["--new-tokens", "1"], ["--batch-sizes", "0"], ["--shape", "7b"], ["--prefill-len", "-1"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2
    assert "--new-tokens must be at least 2" in capsys.readouterr().err


def test_a_smoke_run_on_the_cpu_writes_every_figure(tmp_path):
    # 32 new tokens: t(N) - t(1) must stay positive beside another test worker (with 4 it
    # came out negative once under pytest-xdist).
    out = tmp_path / "gpu_decode.json"
    res = bench.main(["--device", "cpu", "--layers", "1", "--vocab", "512", "--batch-sizes", "1", "3",
                      "--new-tokens", "32", "--runs", "1", "--backends", "torch", "--graphs", "on", "off",
                      "--kv-cache-memory", str(64 << 20), "--prefill-len", "96", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["parameters"] == res["parameters"] == bench.num_parameters(saved["config"])
    assert saved["copy_bandwidth_gb_s"] > 0 and saved["roofline_batch1_tok_s"] > 0
    assert [r["requested"]["graphs"] for r in saved["runs"]] == ["on", "off"]
    for run in saved["runs"]:
        assert "error" not in run, run
        assert set(run["decode_tok_s"]) == {"1", "3"} and all(v > 0 for v in run["decode_tok_s"].values())
        assert run["graphs"] is False  # the CPU never captures
        assert run["batch1_roofline_fraction"] > 0
        assert run["prefill_len"] == 96 and run["prefill_ms"] > 0
