"""The execution plan as a table: (device, dtype, flags, kernels available) -> plan.

``plan_target`` / ``plan_draft`` are pure functions of the configuration, the architecture,
the device and hand-written ``Capabilities``, so every platform is planned here on the CPU,
CUDA included (a fake capability: nothing touches a GPU)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from tailserve.config import EngineConfig, decode_graph_batch_sizes
from tailserve.engine.plan import Capabilities, plan_draft, plan_target, uses_draft_model
from tailserve.errors import ConfigError
from tailserve.model.config import ModelArchConfig, RopeConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}

AVX2_KERNELS = Capabilities(AVX2, cpu_kernels=True, cpu_kernels_reason="built", onednn=True)
AVX512_KERNELS = Capabilities(AVX512_BF16, cpu_kernels=True, cpu_kernels_reason="built", onednn=True)
NO_KERNELS = Capabilities(AVX2, cpu_kernels=False, cpu_kernels_reason="no C compiler found", onednn=True)
H200 = Capabilities(AVX2, cuda=True, cuda_capability=(9, 0), triton=True)


def arch(dtype: torch.dtype = torch.bfloat16, head_dim: int = 64, qk_norm: bool = False,
         sliding_window: int | None = None, hidden: int = 512, layers: int = 8) -> ModelArchConfig:
    return ModelArchConfig("LlamaForCausalLM", 4096, hidden, 1408, layers, 8, 2, head_dim, 1e-5, 2048, RopeConfig(),
                           False, False, False, False, qk_norm, sliding_window, dtype, 1, (2,))


def config(**kw) -> EngineConfig:
    return EngineConfig(model="builtin", **kw)


def row(plan) -> tuple:
    m = plan.model
    return (m.dtype, m.linear.method, m.layer_ops, m.attention_backend, m.fuse_decode_layers, plan.sampler_kernels,
            len(plan.decode_graph_sizes) > 0)


TABLE = [
    # (case, config, arch, device, caps) -> (dtype, linear, layer ops, attention, fused, sampler kernels, graphs)
    ("avx2 bf16 checkpoint, auto", config(), arch(), CPU, AVX2_KERNELS,
     (torch.float32, "cpu-compact-weights", "cpu-kernels", "cpu-decode", True, True, False)),
    # float32 over the compact weights decodes 2.1x faster than native bf16 there (batch 1, PEERS shape)
    ("avx512-bf16, auto: float32 over the bf16 weights", config(), arch(), CPU, AVX512_KERNELS,
     (torch.float32, "cpu-compact-weights", "cpu-kernels", "cpu-decode", True, True, False)),
    ("avx512-bf16 without the kernels keeps bf16", config(), arch(), CPU,
     dataclasses.replace(NO_KERNELS, cpu_flags=AVX512_BF16),
     (torch.bfloat16, "onednn-packed", "torch", "torch-reference", False, False, False)),
    ("explicit bfloat16 on avx512-bf16", config(dtype="bfloat16"), arch(), CPU, AVX512_KERNELS,
     (torch.bfloat16, "onednn-packed", "torch", "torch-reference", False, True, False)),
    ("kernels unavailable", config(), arch(), CPU, NO_KERNELS,
     (torch.float32, "onednn-packed", "torch", "torch-reference", False, False, False)),
    ("--no-cpu-kernels", config(cpu_kernels=False), arch(), CPU, AVX2_KERNELS,
     (torch.float32, "onednn-packed", "torch", "torch-reference", False, False, False)),
    ("--no-cpu-kernels --no-cpu-onednn", config(cpu_kernels=False, cpu_onednn=False), arch(), CPU, AVX2_KERNELS,
     (torch.float32, "plain", "torch", "torch-reference", False, False, False)),
    ("int8", config(quantization="int8"), arch(), CPU, AVX2_KERNELS,
     (torch.float32, "int8-weight-only", "cpu-kernels", "cpu-decode", True, True, False)),
    ("float32 checkpoint", config(), arch(torch.float32), CPU, AVX2_KERNELS,
     (torch.float32, "onednn-packed", "cpu-kernels", "cpu-decode", True, True, False)),
    ("explicit bfloat16 on avx2", config(dtype="bfloat16"), arch(), CPU, AVX2_KERNELS,
     (torch.bfloat16, "onednn-packed", "torch", "torch-reference", False, True, False)),
    ("q/k norms (Qwen3): no fused layers", config(), arch(qk_norm=True), CPU, AVX2_KERNELS,
     (torch.float32, "cpu-compact-weights", "cpu-kernels", "cpu-decode", False, True, False)),
    ("head size the kernel cannot take", config(), arch(head_dim=60), CPU, AVX2_KERNELS,
     (torch.float32, "cpu-compact-weights", "cpu-kernels", "torch-reference", False, True, False)),
    ("CUDA", config(device="cuda"), arch(), CUDA, H200,
     (torch.bfloat16, "plain", "torch", "torch-reference", False, False, True)),
    ("CUDA --enforce-eager", config(device="cuda", enforce_eager=True), arch(), CUDA, H200,
     (torch.bfloat16, "plain", "torch", "torch-reference", False, False, False)),
    ("CUDA triton", config(device="cuda", attention_backend="triton"), arch(), CUDA, H200,
     (torch.bfloat16, "plain", "torch", "triton-paged", False, False, True)),
    ("CUDA int8", config(device="cuda", quantization="int8"), arch(), CUDA, H200,
     (torch.bfloat16, "int8-weight-only", "torch", "torch-reference", False, False, True)),
    ("triton on the CPU (interpreter)", config(attention_backend="triton"), arch(), CPU,
     dataclasses.replace(AVX2_KERNELS, triton=True, triton_interpreter=True),
     (torch.float32, "cpu-compact-weights", "cpu-kernels", "triton-paged", False, True, False)),
]


@pytest.mark.parametrize("case,cfg,a,device,caps,want", TABLE, ids=[t[0] for t in TABLE])
def test_target_plan_table(case, cfg, a, device, caps, want):
    plan = plan_target(cfg, a, device, caps)
    assert row(plan) == want
    # Every decision says why, and the whole plan reads as plain strings.
    described = plan.describe()
    assert all(isinstance(v, str) and "(" in v for k, v in described.items() if k not in ("device", "cpu"))


def test_reasons_name_what_turned_a_path_off():
    off = plan_target(config(), arch(), CPU, NO_KERNELS).describe()
    assert "no C compiler found" in off["linear"] and "no C compiler found" in off["sampler"]
    flag = plan_target(config(cpu_kernels=False), arch(), CPU, AVX2_KERNELS).describe()
    assert "--no-cpu-kernels" in flag["layer_ops"]
    auto = plan_target(config(), arch(), CPU, AVX2_KERNELS)
    assert "no native bfloat16" in auto.model.dtype_reason and "kept in bfloat16" in auto.model.dtype_reason
    assert plan_target(config(), arch(), CPU, AVX512_KERNELS).cpu_capability == "AVX-512 bf16"
    assert plan_target(config(), arch(), CPU, AVX2_KERNELS).cpu_capability == "AVX2"


def test_cuda_graph_buckets_and_what_turns_them_off():
    plan = plan_target(config(device="cuda", max_num_seqs=20), arch(), CUDA, H200)
    assert list(plan.decode_graph_sizes) == decode_graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert plan_target(config(device="cuda"), arch(), CUDA, H200, tp_size=2).decode_graph_sizes == ()
    assert "--enforce-eager" in plan_target(config(device="cuda", enforce_eager=True), arch(), CUDA,
                                            H200).graphs_reason


def test_triton_without_triton_is_a_config_error():
    with pytest.raises(ConfigError, match="needs Triton"):
        plan_target(config(device="cuda", attention_backend="triton"), arch(), CUDA,
                    dataclasses.replace(H200, triton=False))


def test_triton_on_the_cpu_outside_the_interpreter_is_a_config_error():
    # Without TRITON_INTERPRET=1 the kernel would fail at the first step's launch (CPU tensors),
    # as it did on a machine with a GPU when --device was left at cpu.
    with pytest.raises(ConfigError, match="runs on a CUDA device"):
        plan_target(config(attention_backend="triton"), arch(), CPU, dataclasses.replace(AVX2_KERNELS, triton=True))


def test_tensor_parallel_ranks_fuse_nothing():
    assert plan_target(config(), arch(), CPU, AVX2_KERNELS, tp_size=2).model.fuse_decode_layers is False


DRAFT_DIR = pathlib.Path("/nonexistent/draft")  # the plan names the folder; it reads nothing
SMALL_F32 = arch(torch.float32, hidden=128, layers=2)  # ~1M parameters: NumPy-step size


DRAFT_TABLE = [
    # (case, config, draft arch, caps, target dtype) -> (dtype, linear, keep fp32, attention, chain)
    ("bf16 draft, AVX2 kernels: w8a8_int8 by default", config(speculative_method="draft_model",
                                                              speculative_model="builtin"), arch(), AVX2_KERNELS,
     torch.float32, (torch.float32, "int8-w8a8", False, "cpu-decode", "batched")),
    ("bf16 draft, its own weights", config(speculative_method="draft_model", speculative_model="builtin",
                                           speculative_draft_quantization="none"), arch(), AVX2_KERNELS,
     torch.float32, (torch.float32, "cpu-compact-weights", True, "cpu-decode", "batched")),
    ("small float32 draft: NumPy chain", config(speculative_method="draft_model", speculative_model="builtin"),
     SMALL_F32, AVX2_KERNELS, torch.float32, (torch.float32, "onednn-packed", False, "cpu-decode", "numpy")),
    ("bf16 draft, no kernels", config(speculative_method="draft_model", speculative_model="builtin"), arch(),
     NO_KERNELS, torch.float32, (torch.float32, "onednn-packed", False, "torch-reference", "torch")),
    ("hybrid, bf16 draft", config(speculative_method="hybrid", speculative_model="builtin"), arch(),
     AVX2_KERNELS, torch.float32, (torch.float32, "int8-w8a8", False, "cpu-decode", "batched")),
    ("sliding-window draft", config(speculative_method="draft_model", speculative_model="builtin"),
     arch(sliding_window=64), AVX2_KERNELS, torch.float32,
     (torch.float32, "int8-w8a8", False, "torch-reference", "torch")),
    ("explicit bf16 draft", config(speculative_method="draft_model", speculative_model="builtin",
                                   speculative_draft_dtype="bfloat16"), arch(), AVX2_KERNELS, torch.float32,
     (torch.bfloat16, "onednn-packed", False, "torch-reference", "torch")),
    ("--speculative-draft-numpy", config(speculative_method="draft_model", speculative_model="builtin",
                                         speculative_draft_numpy=True), arch(), AVX2_KERNELS, torch.float32,
     (torch.float32, "cpu-compact-weights", True, "cpu-decode", "numpy")),
    ("int8 draft, kernels", config(speculative_method="draft_model", speculative_model="builtin",
                                   speculative_draft_quantization="int8"), arch(), AVX2_KERNELS, torch.float32,
     (torch.float32, "int8-weight-only", False, "cpu-decode", "batched")),
    ("small int8 draft: no NumPy chain", config(speculative_method="draft_model", speculative_model="builtin",
                                                speculative_draft_quantization="int8"), SMALL_F32, AVX2_KERNELS,
     torch.float32, (torch.float32, "int8-weight-only", False, "cpu-decode", "batched")),
    ("bf16 draft, AVX-512 kernels: w8a8_int8 by default", config(speculative_method="draft_model",
                                                                 speculative_model="builtin"), arch(), AVX512_KERNELS,
     torch.float32, (torch.float32, "int8-w8a8", False, "cpu-decode", "batched")),
    ("hybrid, bf16 draft, AVX-512 kernels: w8a8_int8 by default", config(speculative_method="hybrid",
                                                                         speculative_model="builtin"), arch(),
     AVX512_KERNELS, torch.float32, (torch.float32, "int8-w8a8", False, "cpu-decode", "batched")),
    ("w8a8_int8 draft, AVX2 kernels", config(speculative_method="draft_model", speculative_model="builtin",
                                             speculative_draft_quantization="w8a8_int8"), arch(), AVX2_KERNELS,
     torch.float32, (torch.float32, "int8-w8a8", False, "cpu-decode", "batched")),
    ("AVX-512, --speculative-draft-quantization int8: weight-only", config(
        speculative_method="draft_model", speculative_model="builtin", speculative_draft_quantization="int8"), arch(),
     AVX512_KERNELS, torch.float32, (torch.float32, "int8-weight-only", False, "cpu-decode", "batched")),
    ("AVX-512, --speculative-draft-quantization none", config(speculative_method="draft_model",
                                                              speculative_model="builtin",
                                                              speculative_draft_quantization="none"), arch(),
     AVX512_KERNELS, torch.float32, (torch.float32, "cpu-compact-weights", True, "cpu-decode", "batched")),
    ("AVX-512, float32 draft: not quantized", config(speculative_method="draft_model", speculative_model="builtin"),
     SMALL_F32, AVX512_KERNELS, torch.float32, (torch.float32, "onednn-packed", False, "cpu-decode", "numpy")),
    ("AVX-512, explicit bf16 draft: not quantized", config(speculative_method="draft_model",
                                                           speculative_model="builtin",
                                                           speculative_draft_dtype="bfloat16"), arch(),
     AVX512_KERNELS, torch.float32, (torch.bfloat16, "onednn-packed", False, "torch-reference", "torch")),
    ("AVX-512, --speculative-draft-numpy: not quantized", config(speculative_method="draft_model",
                                                                 speculative_model="builtin",
                                                                 speculative_draft_numpy=True), arch(),
     AVX512_KERNELS, torch.float32, (torch.float32, "cpu-compact-weights", True, "cpu-decode", "numpy")),
    ("CUDA draft: the target's dtype", config(device="cuda", speculative_method="draft_model",
                                              speculative_model="builtin"), arch(), H200, torch.bfloat16,
     (torch.bfloat16, "plain", False, "torch-reference", "torch")),
]


def test_an_int8_target_on_the_kernels_multiplies_every_batch_through_int8_panels():
    lp = plan_target(config(quantization="int8"), arch(), CPU, AVX2_KERNELS).model.linear
    assert lp.method == "int8-weight-only" and lp.panel_packed and "every batch" in lp.reason
    assert not plan_target(config(quantization="int8"), arch(), CPU, NO_KERNELS).model.linear.panel_packed


def test_a_default_int8_draft_says_why_and_how_to_keep_the_drafts_own_weights():
    cfg = config(speculative_method="draft_model", speculative_model="builtin")
    linear = plan_draft(cfg, DRAFT_DIR, arch(), CPU, AVX512_KERNELS, torch.float32).model.linear
    assert linear.reason.startswith("w8a8_int8 by default for a bf16/fp16 draft on the compiled CPU kernels")
    assert "--speculative-draft-quantization int8: weight-only; none: the draft's own weights" in linear.reason
    assert linear.method == "int8-w8a8" and "int8 activations quantised per row" in linear.reason
    asked = dataclasses.replace(cfg, speculative_draft_quantization="int8")
    linear = plan_draft(asked, DRAFT_DIR, arch(), CPU, AVX2_KERNELS, torch.float32).model.linear
    assert linear.reason.startswith("--speculative-draft-quantization int8")
    # An int8 draft's small batches go through int8 panels wherever the kernels run it.
    assert linear.panel_packed and "int8 panels" in linear.reason
    assert not plan_draft(asked, DRAFT_DIR, arch(), CPU, NO_KERNELS, torch.float32).model.linear.panel_packed


def test_a_w8a8_draft_without_the_compiled_kernels_is_refused_with_the_reason():
    cfg = config(speculative_method="draft_model", speculative_model="builtin",
                 speculative_draft_quantization="w8a8_int8")
    with pytest.raises(ConfigError, match="w8a8_int8 runs in the compiled CPU kernels"):
        plan_draft(cfg, DRAFT_DIR, arch(), CPU, NO_KERNELS, torch.float32)
    with pytest.raises(ConfigError, match="float32 model"):
        plan_draft(dataclasses.replace(cfg, speculative_draft_dtype="bfloat16"), DRAFT_DIR, arch(), CPU,
                   AVX512_KERNELS, torch.float32)


@pytest.mark.parametrize("case,cfg,a,caps,target_dtype,want", DRAFT_TABLE, ids=[t[0] for t in DRAFT_TABLE])
def test_draft_plan_table(case, cfg, a, caps, target_dtype, want):
    device = torch.device(cfg.device if cfg.device == "cpu" else "cuda", 0) if cfg.device != "cpu" else CPU
    d = plan_draft(cfg, DRAFT_DIR, a, device, caps, target_dtype)
    assert (d.dtype, d.model.linear.method, d.model.linear.keep_float32, d.model.attention_backend,
            d.chain_step) == want
    assert uses_draft_model(cfg)
    assert "chain_step" in d.describe()


def test_ngram_plans_no_draft_model():
    assert not uses_draft_model(config(speculative_method="ngram"))
    assert not uses_draft_model(config())


def test_numpy_step_refuses_a_sliding_window():
    cfg = config(speculative_method="draft_model", speculative_model="builtin", speculative_draft_numpy=True)
    with pytest.raises(ConfigError, match="sliding window"):
        plan_draft(cfg, DRAFT_DIR, arch(sliding_window=64), CPU, AVX2_KERNELS, torch.float32)


def test_the_worker_applies_its_plan_and_reports_it(llm_builtin_spec):
    """The engine's plan is the one the table predicts for this machine, and /health shows it."""
    eng = llm_builtin_spec.engine
    plan = eng.info.plan
    assert plan.draft is not None
    assert eng.runner.uses_draft_kv and eng.runner.needs_draft_probs
    assert eng.runner.attn_backend.name == plan.model.attention_backend
    assert eng.health()["plan"]["attention"].startswith(plan.model.attention_backend)


def test_prefill_multiplies_natively_only_under_auto_on_a_cpu_with_native_bf16():
    auto512 = plan_target(config(), arch(), CPU, AVX512_KERNELS).model.linear
    assert auto512.native_large_batches and "prefill" in auto512.reason
    assert not plan_target(config(dtype="float32"), arch(), CPU, AVX512_KERNELS).model.linear.native_large_batches
    assert not plan_target(config(), arch(), CPU, AVX2_KERNELS).model.linear.native_large_batches


def test_bf16_weights_go_in_panels_where_no_native_product_reads_the_rows():
    avx2 = plan_target(config(), arch(), CPU, AVX2_KERNELS).model.linear
    assert avx2.panel_packed and "panels" in avx2.reason
    assert not plan_target(config(), arch(), CPU, AVX512_KERNELS).model.linear.panel_packed  # native prefill
    assert plan_target(config(dtype="float32"), arch(), CPU, AVX512_KERNELS).model.linear.panel_packed
    assert not plan_target(config(), arch(dtype=torch.float16), CPU, AVX2_KERNELS).model.linear.panel_packed


def test_with_native_bf16_the_panels_sit_beside_the_rows_where_memory_allows_a_second_copy():
    """Native prefill reads the rows; decode and verification decode faster from panels, so both
    are kept while the second copy is at most an eighth of the machine's memory."""
    weight_bytes = arch().num_parameters * 2
    roomy = dataclasses.replace(AVX512_KERNELS, memory_bytes=8 * weight_bytes)
    both = plan_target(config(), arch(), CPU, roomy).model.linear
    assert both.panel_packed and both.native_large_batches and "beside the rows" in both.reason
    tight = dataclasses.replace(AVX512_KERNELS, memory_bytes=8 * weight_bytes - 1)
    rows = plan_target(config(), arch(), CPU, tight).model.linear
    assert rows.native_large_batches and not rows.panel_packed and "rows only" in rows.reason
    # A draft keeps a float32 copy (rows); an fp16 checkpoint has no panels at all.
    assert not plan_target(config(), arch(dtype=torch.float16), CPU, roomy).model.linear.panel_packed


@pytest.mark.parametrize("cfg, a, device, caps, want", [
    # --dtype auto over a bf16 checkpoint on the CPU: float32 arithmetic, bf16 weights and K/V.
    (config(), arch(), CPU, AVX2_KERNELS, torch.bfloat16),
    (config(), arch(torch.float16), CPU, AVX512_KERNELS, torch.float16),
    # An explicit float32 asks for float32 throughout; a float32 checkpoint is float32.
    (config(dtype="float32"), arch(), CPU, AVX2_KERNELS, torch.float32),
    (config(), arch(torch.float32), CPU, AVX2_KERNELS, torch.float32),
    # Without the decode kernel (nothing would read a narrower cache any faster): the model's dtype.
    (config(), arch(), CPU, NO_KERNELS, torch.float32),  # AVX2 without kernels: a float32 model
    (config(attention_backend="torch"), arch(), CPU, AVX2_KERNELS, torch.float32),
    (config(device="cuda"), arch(), CUDA, H200, torch.bfloat16),
    # Chosen.
    (config(kv_cache_dtype="float32"), arch(), CPU, AVX2_KERNELS, torch.float32),
    (config(dtype="float32", kv_cache_dtype="bfloat16"), arch(), CPU, AVX2_KERNELS, torch.bfloat16),
    (config(attention_backend="torch", kv_cache_dtype="float16"), arch(), CPU, AVX2_KERNELS, torch.float16),
])
def test_the_kv_cache_dtype(cfg, a, device, caps, want):
    plan = plan_target(cfg, a, device, caps)
    assert plan.kv_dtype == want
    assert plan.describe()["kv_cache_dtype"].startswith(str(want).removeprefix("torch.") + " (")


def test_a_kv_cache_dtype_the_kernels_cannot_read_is_a_config_error():
    with pytest.raises(ConfigError, match="Triton attention kernel reads a KV cache of the model's dtype"):
        plan_target(config(device="cuda", attention_backend="triton", kv_cache_dtype="float32"), arch(), CUDA, H200)
    with pytest.raises(ConfigError, match="fp8 KV caches are not supported"):
        config(kv_cache_dtype="fp8")


@pytest.mark.parametrize("device,caps,flag,want", [
    (CPU, AVX2_KERNELS, "auto", "inline"), (CUDA, H200, "auto", "thread"),
    (CPU, AVX2_KERNELS, "thread", "thread"), (CUDA, H200, "inline", "inline"),
])
def test_the_engine_loop_inline_on_the_cpu_on_its_own_thread_beside_a_gpu(device, caps, flag, want):
    plan = plan_target(config(device=device.type, engine_loop=flag), arch(), device, caps)
    assert plan.engine_loop == want
    assert plan.describe()["engine_loop"].startswith(want + " (")
    assert ("--engine-loop" in plan.engine_loop_reason) == (flag != "auto")


def test_an_unknown_engine_loop_is_a_config_error():
    with pytest.raises(ConfigError, match="engine_loop must be one of auto, inline, thread"):
        config(engine_loop="process")


@pytest.mark.parametrize("device,caps,flags,want", [
    (CPU, AVX2_KERNELS, (None, None), (2, 1)), (CUDA, H200, (None, None), (0, 0)),
    (CPU, AVX2_KERNELS, (0, 0), (0, 0)), (CPU, AVX2_KERNELS, (None, 0), (2, 0)), (CUDA, H200, (4, 2), (4, 2)),
])
def test_two_prefills_one_long_per_step_on_a_cpu_server_unless_told(device, caps, flags, want):
    plan = plan_target(config(device=device.type, max_num_partial_prefills=flags[0],
                              max_long_partial_prefills=flags[1]), arch(), device, caps)
    assert (plan.max_num_partial_prefills, plan.max_long_partial_prefills) == want
    assert plan.describe()["prefills_per_step"].startswith(f"{want[0] or 'any'}, long ones {want[1] or 'any'} (")
    named = flags[1] is not None and flags != (0, 0)  # both 0: the offline default, no flag named
    assert ("--max-long-partial-prefills" in plan.partial_prefills_reason) == named


@pytest.mark.parametrize("name", ["max_long_partial_prefills", "max_num_partial_prefills"])
def test_a_negative_prefill_limit_is_a_config_error(name):
    with pytest.raises(ConfigError, match=f"{name} must be an integer >= 0"):
        config(**{name: -1})
