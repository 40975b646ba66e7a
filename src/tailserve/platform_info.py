"""What this machine's processor can do, and the choices that follow from it (made once, at
load time): today, the dtype that ``--dtype auto`` means on the CPU.

A bf16 or fp16 checkpoint runs in half precision on the CPU only where the processor has
native instructions for it (x86: AVX512_BF16 / AMX-BF16, AVX512_FP16 / AMX-FP16; Arm: the
BF16 extension). Elsewhere PyTorch emulates the format by converting to float32 inside every
kernel, which is slower than float32 itself: on an AVX2-only EPYC a 113-token prefill of the
built-in model took 174 ms in bf16 and 42-55 ms in float32 (2026-12-01). So ``auto`` picks
float32 there, as llama.cpp does with its f32 path, at twice the weight memory.
"""

from __future__ import annotations

import functools
import pathlib

import torch


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The processor's feature flags (Linux ``/proc/cpuinfo``; empty where unreadable)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("flags", "features"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_native(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    if dtype == torch.bfloat16:
        return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    if dtype == torch.float16:
        return bool(flags & {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"})
    return True


def resolve_auto_dtype(checkpoint_dtype: torch.dtype, device: torch.device,
                       flags: frozenset[str] | None = None) -> tuple[torch.dtype, str]:
    """The dtype ``--dtype auto`` loads a checkpoint in, and why (one phrase for the log)."""
    if device.type != "cpu":
        return checkpoint_dtype, "the checkpoint's dtype"
    flags = cpu_flags() if flags is None else flags
    if checkpoint_dtype in (torch.bfloat16, torch.float16) and not cpu_has_native(checkpoint_dtype, flags):
        if not flags:  # unknown processor (no /proc/cpuinfo): do not second-guess the checkpoint
            return checkpoint_dtype, "the checkpoint's dtype (processor features unknown)"
        name = str(checkpoint_dtype).removeprefix("torch.")
        return torch.float32, f"float32: this CPU has no native {name} instructions"
    return checkpoint_dtype, "the checkpoint's dtype"
