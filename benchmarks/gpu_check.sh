#!/usr/bin/env bash
# One prepared GPU session: correctness on CUDA against the CPU reference, then timings.
# Usage (device machine, repository root): bash benchmarks/gpu_check.sh
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD/tests:${PYTHONPATH:-}"
OUT="${OUT:-/tmp/gpu_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
pip install -q safetensors tokenizers ddsketch prometheus-client rich starlette hypercorn 2>/dev/null || true
# CUDA tests: greedy equality with the CPU for every architecture, speculative greedy identity,
# the captured decode against the eager one.
timeout 300 python -m pytest -q -m gpu tests/test_gpu.py tests/test_attention_backend.py 2>&1 | tail -20 | tee "$OUT/gpu_tests.txt"
# The Triton paged-attention kernel compiled for real (CI runs it in the interpreter).
pip install -q triton 2>/dev/null || true
timeout 200 python -m pytest -q tests/test_triton_attention.py 2>&1 | tail -8 | tee "$OUT/triton_tests.txt"
# The KV cache sized from --gpu-memory-utilization after the profiling pass, and CUDA graphs in the engine.
timeout 120 python - <<'PY' 2>&1 | tail -7 | tee "$OUT/kv_sizing.txt"
from tailserve import LLM, SamplingParams
llm = LLM(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
i = llm.engine.info
print("plan:", i.plan.describe())
print(i.memory_profile.describe(i.num_blocks, llm.engine.config.block_size))
out = llm.generate(["def add(a, b):"] * 3, SamplingParams(temperature=0, max_tokens=16))
print("graphs:", list(i.decode_graph_sizes)[:6], "... replays", llm.engine.runner.graph_replays, repr(out[0].text))
PY
# Decode tok/s at batch 1/16/64 for the 0.5B shape in bf16, graphs on and off, both attention backends,
# and batch 1 against the bandwidth roofline.
timeout 300 python benchmarks/bench_gpu_decode.py --shape 0.5b --json "$OUT/gpu_decode.json" 2>&1 | tail -8 \
    | tee "$OUT/gpu_decode.txt"
timeout 180 python benchmarks/bench_engine.py --runs 3 --dtypes bfloat16 --device cuda 2>&1 | tail -20 \
    | tee "$OUT/bench_engine_cuda.txt"
# The caching-allocator model against the real allocator on the same traces (goal: within 5%).
timeout 240 python benchmarks/allocator_check.py --json "$OUT/allocator_check.json" 2>&1 | tail -14 \
    | tee "$OUT/allocator_check.txt"
