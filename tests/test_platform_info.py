"""``--dtype auto`` on the CPU: half precision only where the processor has it natively."""

import torch

from tailserve.platform_info import cpu_has_native, resolve_auto_dtype

CPU = torch.device("cpu")
AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
SPR = AVX2 | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def test_bf16_checkpoint_runs_in_float32_without_native_bf16():
    dtype, why = resolve_auto_dtype(torch.bfloat16, CPU, AVX2)
    assert dtype == torch.float32 and "no native bfloat16" in why


def test_bf16_checkpoint_stays_bf16_with_avx512_bf16():
    assert resolve_auto_dtype(torch.bfloat16, CPU, SPR)[0] == torch.bfloat16


def test_fp16_needs_its_own_instructions():
    assert not cpu_has_native(torch.float16, SPR)
    assert resolve_auto_dtype(torch.float16, CPU, SPR)[0] == torch.float32
    assert resolve_auto_dtype(torch.float16, CPU, SPR | {"avx512_fp16"})[0] == torch.float16


def test_float32_checkpoint_and_unknown_cpu_and_gpu_keep_the_checkpoint_dtype():
    assert resolve_auto_dtype(torch.float32, CPU, AVX2)[0] == torch.float32
    assert resolve_auto_dtype(torch.bfloat16, CPU, frozenset())[0] == torch.bfloat16
    assert resolve_auto_dtype(torch.bfloat16, torch.device("cuda"), AVX2)[0] == torch.bfloat16


def test_arm_bf16_feature_counts():
    assert resolve_auto_dtype(torch.bfloat16, CPU, frozenset({"fp", "asimd", "bf16"}))[0] == torch.bfloat16
