"""Transparent huge pages for PyTorch's large CPU allocations (``THP_MEM_ALLOC_ENABLE``).

With ``THP_MEM_ALLOC_ENABLE=1`` PyTorch's CPU allocator advises the kernel to back each
allocation of 2 MiB or more with 2 MiB pages (``madvise(MADV_HUGEPAGE)``); without it those
buffers sit on 4 KiB pages. A CPU engine's large buffers are the activations of prompt steps
(a 2,048-token step of the built-in target makes a 16 MB gate/up product), the KV cache, the
embedding and the LM head. Measured on 2 AVX2 cores (AMD EPYC, Zen 3;
``benchmarks/bench_kv_capacity.py`` at 96 MiB of KV, docs/benchmarks.md, session 33): the
2,048-token prompt steps ran ~8% faster, the paged engine's throughput rose ~7% and the
contiguous reservation's ~3% (its prompts come in smaller steps). Advising only the KV cache
changed nothing measurable.

PyTorch reads the variable once, at its first CPU allocation (importing it makes none), so
the engine sets it before it loads anything, unless the user set it (theirs wins, ``0``
included) or the kernel's huge pages are off (``never``). Whether it took effect is then
probed (the mapping of a fresh 4 MiB buffer carries the huge-page advice only under it) and
reported in the plan as ``cpu_huge_pages``: a process that made a tensor before the engine
started keeps 4 KiB pages, and the plan says so. CPU devices only; a GPU engine leaves the
environment alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, MutableMapping

ENV = "THP_MEM_ALLOC_ENABLE"
HUGE_PAGE_BYTES = 2 << 20
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
_OFF = ("0", "false", "off", "no", "")  # values of the variable that ask for 4 KiB pages

_decided: tuple[bool, str] | None = None  # (in force, reason) once ``enable_for_engine`` ran here


def kernel_thp_mode(path: str = THP_MODE_FILE) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``); None
    where it cannot be read (not Linux, no sysfs)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def decide(env: MutableMapping[str, str], thp_mode: str | None, cpu_device: bool,
           platform: str = sys.platform) -> tuple[bool, str]:
    """Whether to set ``THP_MEM_ALLOC_ENABLE=1`` here (True) or leave the environment as it
    is (False), and why."""
    if not cpu_device:
        return False, "not a CPU device"
    if ENV in env:
        return False, f"{ENV}={env[ENV]} as set"
    if not platform.startswith("linux"):
        return False, "not Linux"
    if thp_mode not in ("always", "madvise"):
        return False, f"the kernel's transparent huge pages are {thp_mode or 'unavailable'}"
    return True, "large CPU buffers (prompt-step activations, KV cache, embedding, LM head) on 2 MiB pages"


def allocator_uses_huge_pages(smaps: str = "/proc/self/smaps") -> bool:
    """Whether PyTorch's CPU allocator is on its huge-page path in this process: the mapping
    that holds a fresh 4 MiB buffer then carries the kernel's huge-page advice (``hg`` among
    its ``VmFlags`` in ``/proc/self/smaps``). False where that cannot be read."""
    import torch

    probe = torch.empty(2 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    return "hg" in _vm_flags(smaps, probe.data_ptr())


def _vm_flags(smaps: str, address: int) -> list[str]:
    """The ``VmFlags`` of the mapping that holds ``address`` (empty if none or unreadable)."""
    try:
        with open(smaps) as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
                    lo, _, hi = head.partition("-")
                    try:
                        inside = int(lo, 16) <= address < int(hi, 16)
                    except ValueError:
                        inside = False
                elif inside and line.startswith("VmFlags:"):
                    return line.split()[1:]
    except OSError:
        pass
    return []


def enable_for_engine(cpu_device: bool, env: MutableMapping[str, str] | None = None,
                      thp_mode: str | None = None,
                      probe: Callable[[], bool] = allocator_uses_huge_pages) -> tuple[bool, str]:
    """Set the variable for a CPU engine (``decide``), then report whether PyTorch's allocator
    uses huge pages (``probe``, which reads this process) and why. Called by the worker before
    it loads the model. A test that passes its own ``env`` passes a ``probe`` to match: this
    process's allocator answers for ``os.environ``, not for that mapping."""
    global _decided
    real = env is None
    env = os.environ if env is None else env
    mode = kernel_thp_mode() if thp_mode is None else thp_mode
    set_it, why = decide(env, mode, cpu_device)
    if not cpu_device:
        return False, why
    if set_it:
        env[ENV] = "1"
    in_force = probe()
    if not in_force and (set_it or env.get(ENV, "0").strip().lower() not in _OFF):
        why = (f"not in force: this process made a CPU tensor before {ENV} was set (PyTorch reads it at "
               f"its first allocation); set {ENV}=1 before starting")
    if real:
        _decided = (in_force, why)
    return in_force, why


def current() -> tuple[bool, str]:
    """What applies in this process (the plan's ``cpu_huge_pages``)."""
    if _decided is not None:
        return _decided
    return False, "not decided (no CPU engine started in this process)"
