#!/usr/bin/env bash
# One prepared GPU session: correctness on CUDA against the CPU reference, then timings.
#
# Usage (device machine, repository root): bash benchmarks/gpu_check.sh
#   STAGES="tests triton alloc kv decode engine" (default: all) picks stages, for a rerun of the failed ones.
#   A .whl/ folder in the repository root (made here by benchmarks/gpu_wheels.sh: ddsketch, starlette, hypercorn,
#   llguidance, ... for Python 3.12) is installed to /tmp/site first: the device machine reaches no package
#   registry. With the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=480);
#   the first run took 198 s on an H200 (2026-12-04).
#
# Time: the correctness stages (tests, triton, alloc) run side by side, each in its own processes
# (the GPU has room for all of them; none of them times anything); then kv, decode and engine run
# alone, one after another, since they time or size memory. About 6-7 minutes in all on an H200.
# $OUT gets at most 8 files (the device tool brings back no more).
set -uo pipefail
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src:$PWD/tests:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/gpu_out}"; mkdir -p "$OUT"
STAGES="${STAGES:-tests triton alloc kv decode engine}"
want() { [[ " $STAGES " == *" $1 "* ]]; }
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  "$PY" -c "import tailserve, ddsketch, llguidance, starlette; print('tailserve imports')"; } 2>&1 | tee "$OUT/gpu.txt"
T0=$SECONDS
stamp() { echo "[gpu_check] $1 at $((SECONDS - T0)) s" | tee -a "$OUT/gpu.txt"; }

# --- correctness, side by side ---
pids=()
if want tests; then
    # Greedy equality with the CPU for every architecture, speculative greedy identity, the captured
    # decode against the eager one.
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_attention_backend.py \
        >"$OUT/gpu_tests.log" 2>&1 &
    pids+=($!)
fi
if want triton; then
    # The Triton paged-attention kernel compiled for real (CI runs it in the interpreter).
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_attention.py >"$OUT/triton_tests.log" 2>&1 &
    pids+=($!)
fi
if want alloc; then
    # The caching-allocator model against the real allocator on the same traces (goal: within 5%).
    timeout 200 "$PY" benchmarks/allocator_check.py --json "$OUT/allocator_check.json" >"$OUT/allocator_check.log" 2>&1 &
    pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p"; done
stamp "correctness stages done"
for f in gpu_tests triton_tests allocator_check; do
    [ -f "$OUT/$f.log" ] && { echo "== $f"; tail -25 "$OUT/$f.log"; }
done

# --- alone: sizing and timings ---
if want kv; then
    # The KV cache sized from --gpu-memory-utilization after the profiling pass, and CUDA graphs in the engine.
    timeout 90 "$PY" - <<'PY' 2>&1 | tail -12 | tee -a "$OUT/gpu.txt"
from tailserve import LLM, SamplingParams
llm = LLM(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
i = llm.engine.info
print("plan:", i.plan.describe())
print(i.memory_profile.describe(i.num_blocks, llm.engine.config.block_size))
out = llm.generate(["def add(a, b):"] * 3, SamplingParams(temperature=0, max_tokens=16))
print("graphs:", list(i.decode_graph_sizes)[:6], "... replays", llm.engine.runner.graph_replays, repr(out[0].text))
PY
    stamp "kv done"
fi
if want decode; then
    # Decode tok/s at batch 1/16/64 for the 0.5B shape in bf16, graphs on and off, both attention backends,
    # and batch 1 against the bandwidth roofline.
    timeout 150 "$PY" benchmarks/bench_gpu_decode.py --shape 0.5b --json "$OUT/gpu_decode.json" \
        >"$OUT/gpu_decode.log" 2>&1
    tail -8 "$OUT/gpu_decode.log"
    stamp "decode done"
fi
if want engine; then
    timeout 90 "$PY" benchmarks/bench_engine.py --runs 3 --dtypes bfloat16 --device cuda >"$OUT/bench_engine.log" 2>&1
    tail -20 "$OUT/bench_engine.log"
    stamp "engine done"
fi
