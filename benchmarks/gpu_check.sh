#!/usr/bin/env bash
# One prepared GPU session: correctness on CUDA against the CPU reference, then timings.
# Usage (device machine, repository root): bash benchmarks/gpu_check.sh
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD/tests:${PYTHONPATH:-}"
OUT="${OUT:-/tmp/gpu_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
pip install -q safetensors tokenizers ddsketch prometheus-client rich starlette hypercorn 2>/dev/null || true
timeout 300 python -m pytest -q -m gpu tests/test_gpu.py tests/test_attention_backend.py 2>&1 | tail -20 | tee "$OUT/gpu_tests.txt"
# The Triton paged-attention kernel compiled for real (CI runs it in the interpreter).
pip install -q triton 2>/dev/null || true
timeout 200 python -m pytest -q tests/test_triton_attention.py 2>&1 | tail -8 | tee "$OUT/triton_tests.txt"
timeout 240 python benchmarks/bench_engine.py --runs 3 --dtypes bfloat16 --device cuda 2>&1 | tail -20 \
    | tee "$OUT/bench_engine_cuda.txt"
# The caching-allocator model against the real allocator on the same traces (goal: within 5%).
timeout 240 python benchmarks/allocator_check.py --json "$OUT/allocator_check.json" 2>&1 | tail -14 \
    | tee "$OUT/allocator_check.txt"
